"""The ElasticCTR loop with real processes: cube-local (transfer, 2 shards x 2 replicas of agent +
server), the streaming trainer and the predictor, with a client loading the predictor while the
base and deltas roll out. Checks: served AUC equals the offline AUC of each version, shrunk
features miss after their delta, no answer mixes versions, a trainer killed mid-save announces
nothing half-written, and the predictor's errors."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np
import pytest

from cube.client import CubeClient
from cube.processes import poll_until, stop_child
from examples.ctr import client as ctr_client
from examples.ctr.data import StreamSpec, split_path, split_time, write_split
from examples.ctr.demo import (
    Background,
    python_env,
    start_predictor,
    start_trainer,
    wait_model,
    wait_predictor_ready,
)
from examples.ctr.model import auc, pool
from examples.ctr.samples import parse_lines
from examples.ctr.store import (
    SAVE_PAUSE_ENV,
    ModelMeta,
    announced_ids,
    find_model,
    load_dense,
    version_table,
)

if TYPE_CHECKING:
    from cube.transfer.local import Cluster
    from examples.ctr.client import Replay

pytestmark = pytest.mark.slow

SPEC = StreamSpec(samples=4000, heldout=1500, vocab=500, growth=50, churn=60, splits_per_day=2)
PASSES = 4  # base, delta, base, delta
DIM = 8


class Pass(TypedDict):
    """One version the loop trained and rolled out, and what the predictor answered for it."""

    meta: ModelMeta
    served: Replay
    heldout: list[str]
    deleted: np.ndarray | None  # a delta's delete list
    found_deleted: np.ndarray | None  # which of those Cube still found once it was live


class Loop(TypedDict):
    """The module's running loop: cluster, trainer, predictor and the passes seen so far."""

    work: Path
    cluster: Cluster
    url: str
    passes: list[Pass]
    background: Background
    trainer: subprocess.Popen[bytes]
    children: list[subprocess.Popen[bytes]]
    before_any_version: tuple[int, dict[str, Any]]


@pytest.fixture(scope="module")
def loop(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Loop]:
    from cube.transfer.local import ClusterSpec, up

    work = tmp_path_factory.mktemp("ctr")
    logs = work / "logs"
    logs.mkdir()
    (work / "out" / "donefile").mkdir(parents=True)
    cluster = up(
        ClusterSpec(
            dir=work / "cluster",
            shards=2,
            replicas=2,
            donefile=work / "out" / "donefile",
            dim=DIM,
            poll_interval=0.3,
        )
    )
    children: list[subprocess.Popen[bytes]] = []
    background: Background | None = None
    try:
        trainer = start_trainer(work, logs, ["--shrink_after", "1"])
        children.append(trainer)
        predictor, url = start_predictor(cluster.cube_conf, work / "out" / "models", logs)
        children.append(predictor)
        passes: list[Pass] = []
        checked = poll_until(
            lambda: ready_answer(url)[1].get("reason") != "not checked yet", 30, 0.1
        )
        before_any_version = ready_answer(url) if checked else (0, {})
        with CubeClient.from_conf(cluster.cube_conf) as cube:
            for index in range(PASSES):
                when = split_time(SPEC, index)
                write_split(SPEC, work / "stream", index)
                meta = wait_model(work, int(when.timestamp()), trainer, 60)
                cluster.wait_version(meta.version, 90)
                wait_predictor_ready(url, 60)
                heldout = ctr_client.read_samples(split_path(work / "stream", when, "heldout"))
                if background is None:
                    background = Background(url, heldout, keep=400).start()
                served = asyncio.run(ctr_client.replay(url, heldout, batch=100, concurrency=2))
                deleted = (
                    np.array(
                        (find_model(work / "out" / "models", meta.id) / "delete.txt")
                        .read_text()
                        .split(),
                        dtype=np.uint64,
                    )
                    if meta.kind == "delta"
                    else None
                )
                found_deleted = cube.seek(deleted).found if deleted is not None else None
                passes.append(
                    {
                        "meta": meta,
                        "served": served,
                        "heldout": heldout,
                        "deleted": deleted,
                        "found_deleted": found_deleted,
                    }
                )
        assert background is not None  # started on the first pass
        background.stop()
        yield {
            "work": work,
            "cluster": cluster,
            "url": url,
            "passes": passes,
            "background": background,
            "trainer": trainer,
            "children": children,
            "before_any_version": before_any_version,
        }
    finally:
        if background is not None:
            background.stop()
        for child in reversed(children):
            stop_child(child, 10.0)
        cluster.down()


def ready_answer(url: str) -> tuple[int, dict[str, Any]]:
    """The predictor's /ready status and body."""
    try:
        with urllib.request.urlopen(f"{url}/ready", timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_predictor_is_ready_only_when_cube_serves_it(loop: Loop) -> None:
    """Before any version is live the predictor runs (/health) but is not ready, and says
    what it waits for; once a version is live and its dense part loaded, it is."""
    status, body = loop["before_any_version"]
    assert status == 503 and body["ready"] is False
    assert "Cube" in body["reason"], body
    assert ready_answer(loop["url"]) == (200, {"ready": True})


def test_served_auc_equals_offline_auc_of_each_version(loop: Loop) -> None:
    assert [p["meta"].kind for p in loop["passes"]] == ["base", "delta"] * 2
    for p in loop["passes"]:
        meta, served = p["meta"], p["served"]
        assert not served.errors
        assert set(served.versions) == {meta.version}
        assert served.auc(meta.version) == pytest.approx(meta.offline_auc, abs=0.002)
    assert loop["passes"][-1]["meta"].offline_auc >= 0.70


def test_features_shrunk_away_miss_after_their_delta(loop: Loop) -> None:
    # (pass, its delete list, which of it Cube found): the loop seeks every delta's list
    deltas = [(p, p["deleted"], p["found_deleted"]) for p in loop["passes"]
              if p["deleted"] is not None and p["found_deleted"] is not None]  # fmt: skip
    assert sum(deleted.shape[0] for _, deleted, _ in deltas) > 0
    for p, deleted, found in deltas:
        assert found.shape == deleted.shape
        assert not found.any(), f"{p['meta'].version}: a deleted feature was found"
    # ... and they were served before: the version before the first delta had them
    first, first_deleted, _ = deltas[0]
    index = loop["passes"].index(first)
    previous = loop["passes"][index - 1]["meta"].version
    keys = version_table(loop["work"] / "out", previous, DIM).keys
    assert np.isin(first_deleted, keys).all()


def test_no_answer_mixes_versions_during_the_switches(loop: Loop) -> None:
    """Every background answer equals the prediction of the version it names, computed from the
    model files alone (embeddings of that version + its dense part)."""
    background = loop["background"]
    assert not background.errors
    assert len(background.versions) >= PASSES - 1, "the load did not span the rollouts"
    lines = background.lines
    samples = parse_lines(lines, first_line=0)
    out = loop["work"] / "out"
    expected: dict[str, np.ndarray] = {}
    for version in background.versions:
        emb = version_table(out, version, DIM).embeddings(samples.feasigns)
        dense, _ = load_dense(out / "models", version)
        expected[version] = dense.predict(pool(emb, samples, dense.slot_ids))
    ordered = sorted(expected)
    for a, b in itertools.pairwise(ordered):  # versions are told apart by their CTRs
        assert np.abs(expected[a] - expected[b]).max() > 1e-3
    checked = 0
    for replay in background.kept:
        versions = np.array(replay.versions)
        for version in set(replay.versions) - {""}:
            mask = versions == version
            np.testing.assert_allclose(
                replay.ctr[mask],
                expected[version][mask],
                atol=1e-5,
                err_msg=f"answers named {version} are not its CTRs",
            )
            checked += int(mask.sum())
    assert checked >= len(lines) * 2


def post(url: str, body: object, token: str = "") -> tuple[int, dict[str, Any]]:
    data = json.dumps(body).encode() if not isinstance(body, bytes) else body
    request = urllib.request.Request(f"{url}/predict", data=data, method="POST")
    request.add_header("Content-Type", "application/json")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_predictor_answers_bad_requests_with_what_is_wrong(loop: Loop) -> None:
    url = loop["url"]
    code, body = post(url, {"samples": ["1 0 5:1", "1 0 12:3 oops"]})
    assert code == 400 and "sample 1: feature 2" in body["error"] and "oops" not in body["error"]
    code, body = post(url, {"samples": ["1 0 5:1", "1 0 5:1 6:99"]})
    assert code == 400 and "sample 1: feature 2 is in slot 99" in body["error"]
    code, body = post(url, b"{not json")
    assert code == 400 and "not JSON" in body["error"]
    code, body = post(url, {"samples": "1 0 5:1"})
    assert code == 400
    code, body = post(url, {"samples": ["1 0", "0 0"]})
    assert code == 400 and "none of the 2 samples has a feature" in body["error"]
    code, body = post(url, {"samples": ["5:1"] * 10_001})
    assert code == 413
    code, body = post(url, {"samples": ["1 0 5:1 6:2", "7:3"]})
    assert code == 200 and len(body["ctr"]) == 2 and body["missing_features"] == 3
    with urllib.request.urlopen(f"{url}/status", timeout=5) as response:
        status = json.loads(response.read())
    assert status["missing_features"] >= 3 and status["answers_by_version"]
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as response:
        assert b"ctr_predict_requests_total" in response.read()


def test_predictor_refuses_to_listen_off_loopback_without_a_token(tmp_path: Path) -> None:
    conf = tmp_path / "cube.conf"
    conf.write_text("[]")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "examples.ctr.predictor",
            "--cube_conf",
            str(conf),
            "--model_dir",
            str(tmp_path),
            "--host",
            "0.0.0.0",
            "--port",
            "0",
        ],
        capture_output=True,
        text=True,
        env=python_env(),
        timeout=60,
    )
    assert result.returncode == 2
    assert "without a token" in result.stderr


def test_a_trainer_killed_mid_save_announces_nothing_half_written(loop: Loop) -> None:
    """kill -9 while the next version's files are being written: no donefile line, no model
    directory, the transfer keeps serving the live version; a restart finishes the version and
    it rolls out."""
    work, cluster = loop["work"], loop["cluster"]
    stop_child(loop["trainer"], 10.0)
    live = loop["passes"][-1]["meta"].version
    logs = work / "logs"
    doomed = start_trainer(work, logs, ["--shrink_after", "1"], env={SAVE_PAUSE_ENV: "30"})
    try:
        index = PASSES
        write_split(SPEC, work / "stream", index)
        version_id = int(split_time(SPEC, index).timestamp())
        models = work / "out" / "models"
        assert poll_until(lambda: bool(list(models.glob("[0-9]*/.tmp-base-*"))), 60, 0.05)
        os.kill(doomed.pid, signal.SIGKILL)
        doomed.wait(timeout=10)
    finally:
        stop_child(doomed, 5.0)
    assert str(version_id) not in announced_ids(work / "out")
    with pytest.raises(FileNotFoundError):
        find_model(models, version_id)
    time.sleep(1.5)  # several transfer polls
    assert cluster.transfer_info().get("live_version") == live
    assert all(r.get("version") != str(version_id) for r in cluster.history())
    restarted = start_trainer(work, logs, ["--shrink_after", "1"])
    loop["children"].append(restarted)
    meta = wait_model(work, version_id, restarted, 60)
    assert meta.kind == "base" and not list(models.glob("*/.tmp-*"))
    cluster.wait_version(meta.version, 90)
    heldout = ctr_client.read_samples(
        split_path(work / "stream", split_time(SPEC, index), "heldout")
    )
    served = asyncio.run(ctr_client.replay(loop["url"], heldout, batch=100, concurrency=2))
    assert set(served.versions) == {meta.version}
    assert auc(served.labels, served.ctr) == pytest.approx(meta.offline_auc, abs=0.002)


def test_the_demo_command_reports_every_pass_and_checks_the_auc(tmp_path: Path) -> None:
    """`make demo-ctr` at a small size: a day of two splits on 2 shards x 1 replica."""
    done = subprocess.run(
        [sys.executable, "-m", "examples.ctr.demo", "--dir", str(tmp_path / "demo"), "--days",
         "1", "--splits_per_day", "2", "--samples", "3000", "--heldout", "1000",
         "--replicas", "1"],
        capture_output=True, text=True, env=python_env(), timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "offline  served    diff" in done.stdout
    report = json.loads((tmp_path / "demo" / "report.json").read_text())
    assert [r["kind"] for r in report] == ["base", "delta"]
    for row in report:
        assert abs(row["served_auc"] - row["offline_auc"]) <= 0.002
    assert "0 errors" in done.stdout and "FAILED" not in done.stdout
