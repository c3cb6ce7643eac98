"""cube-transfer fed by a PaddlePaddle trainer's donefiles, end to end on real processes: a
cube-local cluster with `source_format: paddle_fleet` reads Fleet's `xbox_base_done.txt` /
`xbox_patch_done.txt` lines naming the trainer's layout (`<day>/base/000`,
`<day>/delta-<pass>/000`), builds each save with cube-builder -input_format paddle_ps and
serves it; checked through the SDK against the saves' own rows.

The saves are the real trainer's (tests/data/paddle_ps/ctr_common_adagrad: a checkpoint, then
after fleet.shrink() a base, a delta and an empty delta), laid out as the trainer lays them out.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from cube.builder.paddle_ps import load_config, read_table
from cube.client import CubeClient
from cube.donefile import append_line, format_fleet_line
from cube.paddle_ps import PaddleSource
from cube.processes import poll_until
from cube.transfer.local import Cluster, ClusterSpec, up

pytestmark = pytest.mark.slow  # real processes end to end: `make quick` skips them

SAVES = Path(__file__).parent / "data" / "paddle_ps" / "ctr_common_adagrad"
CONFIG = SAVES / "fleet_desc.prototxt"
WAIT = 60.0
DAY1, DAY2 = "20261127", "20261128"
IDS = {"base1": 1795737600, "base2": 1795824000, "delta1": 1795827600, "delta2": 1795831200}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, Path]]:
    root = tmp_path_factory.mktemp("transfer-paddle")
    models = root / "models"  # the trainer's model_save_path: the donefiles live there too
    models.mkdir()
    spec = ClusterSpec(
        dir=root / "cluster",
        shards=2,
        replicas=1,
        donefile=models,
        poll_interval=0.2,
        phase_timeout=40.0,
        transfer_overrides={
            "source_format": "paddle_fleet",
            "builder_flags": ("-paddle_config", str(CONFIG)),
            "max_shrink": 0.9,  # the day's shrink deletes about a third of the keys
            "version_retries": 0,
        },
    )
    running = up(spec)
    try:
        yield running, models
    finally:
        running.down(timeout=5.0)


def save(models: Path, day: str, folder: str, which: str) -> Path:
    """The test save `which` copied to where the trainer writes it: <models>/<day>/<folder>."""
    target = models / day / folder
    shutil.copytree(SAVES / which, target)
    return target


def announce(models: Path, kind: str, version_id: int, key: int, path: Path) -> None:
    name = "xbox_base_done.txt" if kind == "base" else "xbox_patch_done.txt"
    day = path.parent.name
    line = format_fleet_line(str(version_id), str(key), f"{path}/000", str(models), day)
    append_line(models / name, line)


def expected(*paths: Path) -> dict[int, np.ndarray]:
    """What the versions built from `paths` in order serve: each save's rows over the last."""
    source = PaddleSource(config=tuple(load_config(str(CONFIG))), config_name=str(CONFIG))
    table: dict[int, np.ndarray] = {}
    for path in paths:
        keys, values = read_table(str(path), source)
        table.update(zip(keys.tolist(), values, strict=True))
    return table


def check_served(running: Cluster, table: dict[int, np.ndarray], gone: list[int]) -> None:
    keys = np.array(sorted(table), dtype=np.uint64)
    with CubeClient.from_conf(running.cube_conf) as client:
        result = client.seek(np.concatenate([keys, np.array(gone, dtype=np.uint64)]))
    found = result.found
    assert found[: len(keys)].all() and not found[len(keys) :].any()
    served = result.embeddings(6)[: len(keys)]  # ctr_common D=8: embed_w + 5 embedx_w
    np.testing.assert_array_equal(served, np.stack([table[int(k)] for k in keys]))


def test_bases_replace_the_table_and_deltas_apply_on_their_days_base(
    cluster: tuple[Cluster, Path],
) -> None:
    running, models = cluster
    # day 1: its base (a whole table: the checkpoint's rows)
    day1 = save(models, DAY1, "base", "checkpoint")
    announce(models, "base", IDS["base1"], IDS["base1"], day1)
    running.wait_version(str(IDS["base1"]), WAIT)
    check_served(running, expected(day1), [])
    # day 2: the base after shrink replaces the table: the keys shrink deleted are gone
    day2 = save(models, DAY2, "base", "base")
    announce(models, "base", IDS["base2"], IDS["base2"], day2)
    running.wait_version(str(IDS["base2"]), WAIT)
    shrunk = sorted(set(expected(day1)) - set(expected(day2)))
    assert len(shrunk) > 50  # the test save's shrink deleted keys
    check_served(running, expected(day2), shrunk)
    # its deltas, the second one empty (nothing trained since the first): applied in order
    delta1 = save(models, DAY2, "delta-1", "delta")
    announce(models, "patch", IDS["delta1"], IDS["base2"], delta1)
    version = f"{IDS['base2']}_{IDS['delta1']}"
    running.wait_version(version, WAIT)
    table = expected(day2, delta1)
    still_gone = [k for k in shrunk if k not in table]  # a delta brings trained keys back
    assert len(still_gone) > 50
    check_served(running, table, still_gone)
    delta2 = save(models, DAY2, "delta-2", "delta_empty")
    announce(models, "patch", IDS["delta2"], IDS["base2"], delta2)
    running.wait_version(f"{IDS['base2']}_{IDS['delta2']}", WAIT)
    check_served(running, table, still_gone)


def test_a_save_of_the_wrong_kind_or_day_is_refused_and_the_live_version_serves_on(
    cluster: tuple[Cluster, Path],
) -> None:
    running, models = cluster
    live = running.history()[-1]["version"]
    before = len(running.history())
    # a delta save announced as a base, a base save announced as a patch: malformed lines
    wrong = save(models, DAY2, "delta-3", "delta")
    announce(models, "base", IDS["delta2"] + 100, IDS["delta2"] + 100, wrong)
    announce(models, "patch", IDS["delta2"] + 200, IDS["base2"], models / DAY2 / "base")
    # a delta of another day on this day's base: refused
    other_day = save(models, "20261129", "delta-1", "delta")
    announce(models, "patch", IDS["delta2"] + 300, IDS["base2"], other_day)

    def judged() -> bool:
        return len(running.history()) >= before + 3 and all(
            r["status_str"] in ("failed", "refused") for r in running.history()[before:]
        )

    assert poll_until(judged, WAIT, 0.2), running.history()[before:]
    reasons = [r["message"] for r in running.history()[before:]]
    assert any("input is a delta save (20261128/delta-3), but the line is in "
               "xbox_base_done.txt" in m for m in reasons), reasons  # fmt: skip
    assert any("input is a base save (20261128/base), but the line is in "
               "xbox_patch_done.txt" in m for m in reasons), reasons  # fmt: skip
    assert any("is a save of day 20261129, but its base" in m for m in reasons), reasons
    assert running.history()[before - 1]["version"] == live
    status = running.status_table()
    assert live in status


def test_cube_local_up_takes_the_source_format_and_the_layout_by_flags(tmp_path: Path) -> None:
    """The same rollout from the command line: cube-local up --source_format paddle_fleet
    --paddle_config FILE (relative: made absolute, the transfer runs in --dir)."""
    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(CONFIG, tmp_path / "fleet_desc.prototxt")
    cluster_dir = tmp_path / "cluster"

    def cube_local(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "cube.transfer.local", *args, "--dir", str(cluster_dir)]
        return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path)

    started = cube_local(
        "up", "--donefile", str(models), "--shards", "2", "--replicas", "1",
        "--poll_interval", "0.2", "--source_format", "paddle_fleet",
        "--paddle_config", "fleet_desc.prototxt",
    )  # fmt: skip
    try:
        assert started.returncode == 0, started.stderr
        day1 = save(models, DAY1, "base", "checkpoint")
        announce(models, "base", IDS["base1"], IDS["base1"], day1)
        waited = cube_local("wait", "--version", str(IDS["base1"]), "--timeout", str(WAIT))
        assert waited.returncode == 0, waited.stdout + waited.stderr
        check_served(Cluster.load(cluster_dir), expected(day1), [])
    finally:
        if (cluster_dir / "cluster.json").exists():
            Cluster.load(cluster_dir).down(timeout=5.0)


def test_paddlerec_relative_inputs_build_from_the_trainers_working_directory(
    tmp_path: Path,
) -> None:
    """PaddleRec's online trainer run in <job> with runner.model_save_path `output_model`
    (relative, as its examples' config_online.yaml): its donefiles in <job>/output_model, each
    input `output_model/<day>/base/000`, relative to <job>. The transfer's build finds the
    save there (not in <job>/output_model/output_model/...) and builds what it holds."""
    import asyncio
    import json

    from cube.transfer.build_runner import BuildRunner
    from cube.transfer.config import load_config as load_transfer_config
    from cube.transfer.state import VersionRecord

    job = tmp_path / "job"
    models = job / "output_model"
    day1 = save(models, DAY1, "base", "checkpoint")
    line = {"id": str(IDS["base1"]), "key": str(IDS["base1"]),
            "input": f"output_model/{DAY1}/base/000", "monitor_data": ""}  # fmt: skip
    (models / "base_donefile.txt").write_text(json.dumps(line) + "\n")
    conf = tmp_path / "transfer.conf"
    conf.write_text(
        "[default]\ndict_name: emb\nmode: base_delta\nbuildtool_local: cube-builder\nwget_port: 0\n"
        f"donefile_address: {models}\noutput_address: out\ntmp_address: tmp\nshard_num: 2\n"
        f"source_format: paddlerec\nbuilder_flags: -paddle_config {CONFIG}\n"
        "[cube_agent]\nagent0_0: 127.0.0.1:1\ncube0_0: 127.0.0.1:2:/d0\n"
        "agent1_0: 127.0.0.1:3\ncube1_0: 127.0.0.1:4:/d1\n"
    )
    cfg = load_transfer_config(conf)
    version = str(IDS["base1"])
    rec = VersionRecord(
        version=version, depend=version, id=version, key=version, mode="base",
        input=line["input"], line="base_donefile.txt:1",
    )  # fmt: skip
    asyncio.run(BuildRunner(cfg).build(rec))
    records = sum(int(shard["records"]) for shard in rec.shards.values())
    assert records == len(expected(day1)) > 100
