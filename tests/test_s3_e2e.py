"""s3:// end to end on real processes, against moto's S3 server (tests/conftest.py `moto`):
cube-builder building from an s3:// input (the same tars as from the same files on disk), a
cube-agent refusing a corrupted S3 object and placing a good one, and one whole rollout:
cube-transfer polling its donefiles in S3, mirroring multi-file inputs and a delete list from
S3, building with the real cube-builder, uploading the tars (download_mode s3), cube-agents
downloading them from S3 into their cube-servers, and lookups answering the records.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
from helpers.agent_helpers import flip_byte, make_shard_tar
from helpers.s3_helpers import (
    SECRET_KEY,
    MotoServer,
    ObjectStore,
    S3Bucket,
    SilentEndpoint,
    aws_environment,
    s3_filesystem,
)

from cube.client import CubeClient
from cube.seqfile import SequenceFileWriter
from cube.transfer.local import ClusterSpec, command, up
from cube.values import ValueColumn

if TYPE_CHECKING:
    from conftest import Deployment

pytestmark = pytest.mark.slow  # real processes end to end: `make quick` skips them

BUCKET = "cube-e2e"
DIM = 4
WAIT = 60.0


@pytest.fixture(scope="module")
def s3(moto: MotoServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Bucket]:
    root = tmp_path_factory.mktemp("s3-e2e")
    with aws_environment(moto.url, root):
        fs = s3_filesystem()
        if not fs.exists(BUCKET):
            fs.mkdir(BUCKET)
        yield S3Bucket(root=root, fs=fs, url=moto.url)


def seqfile(path: Path, keys: np.ndarray, values: np.ndarray) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    column = ValueColumn.fixed(np.ascontiguousarray(values, np.float32).view(np.uint8), DIM * 4)
    with SequenceFileWriter(path) as writer:
        writer.write_batch(np.asarray(keys, dtype=np.uint64), column)
    return path


def input_tree(root: Path, keys: np.ndarray, values: np.ndarray) -> tuple[Path, np.ndarray]:
    """`keys` split over three SequenceFiles (one in a sub-directory), the first file's first
    key written again, with other values, by the last file (last record wins: the order
    counts), an empty `_SUCCESS` and a hidden file that is no SequenceFile. Returns the
    directory and the values the table must then hold."""
    third = len(keys) // 3
    seqfile(root / "part-00000", keys[:third], values[:third])
    seqfile(root / "part-00001", keys[third : 2 * third], values[third : 2 * third])
    again = np.full((1, DIM), -7.0, np.float32)
    seqfile(root / "sub" / "part-00002", np.r_[keys[2 * third :], keys[:1]],
            np.r_[values[2 * third :], again])  # fmt: skip
    (root / "_SUCCESS").write_bytes(b"")
    (root / ".part-00003.crc").write_bytes(b"not a SequenceFile")
    expected = values.copy()
    expected[0] = again[0]
    return root, expected


def upload(fs: ObjectStore, local: Path, prefix: str) -> str:
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        fs.put_file(str(path), f"{BUCKET}/{prefix}/{path.relative_to(local)}")
    return f"s3://{BUCKET}/{prefix}"


def table(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return np.arange(1, n + 1, dtype=np.uint64), rng.standard_normal((n, DIM), dtype=np.float32)


def md5s(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.md5(p.read_bytes()).hexdigest() for p in directory.rglob("*.tar")}


def test_cube_builder_builds_from_s3_what_it_builds_from_disk(s3: S3Bucket) -> None:
    keys, values = table(3000, 1)
    local, _ = input_tree(s3.root / "builder-input", keys, values)
    url = upload(s3.fs, local, "builder/input")
    builder = command("cube-builder")
    common = ["-dict_name", "emb", "-shard_num", "2", "-only_build=false",
              "-cur_version", "1700000000", "-quiet", "-workers", "1"]  # fmt: skip
    for name, source in (("from-disk", str(local)), ("from-s3", url)):
        out = s3.root / name
        run = subprocess.run([builder, *common, "-input_path", source, "-output_path", str(out)],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
        assert run.returncode == 0, run.stderr
    assert md5s(s3.root / "from-s3") == md5s(s3.root / "from-disk") != {}
    assert not list((s3.root / "from-s3").glob(".fetch-*"))  # the fetched input is removed
    missing = f"s3://{BUCKET}/builder/none"
    argv = [builder, *common, "-input_path", missing, "-output_path", str(s3.root / "none")]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and run.stderr.strip() == f"error: {missing}: not found"
    assert SECRET_KEY not in run.stderr


def test_cube_builder_gives_up_on_a_stalled_source_within_fetch_timeout(tmp_path: Path) -> None:
    """-fetch_timeout bounds the listing too: against an S3 endpoint or a namenode that
    accepts and never answers, cube-builder exits 1 soon after it, naming the input (its
    user redacted), and leaves no fetched directory (it listed for 313 s with -fetch_timeout
    5: the listing had a timeout of its own)."""
    fetch_timeout = 3.0
    builder = command("cube-builder")
    common = ["-dict_name", "emb", "-shard_num", "2", "-only_build=false", "-cur_version",
              "1700000000", "-quiet", "-fetch_timeout", f"{fetch_timeout:g}"]  # fmt: skip
    with SilentEndpoint() as silent, aws_environment(f"http://127.0.0.1:{silent.port}", tmp_path):
        for source, shown in (
            (f"s3://{BUCKET}/stalled/in", f"s3://{BUCKET}/stalled/in"),
            (f"webhdfs://alice@127.0.0.1:{silent.port}/in",
             f"webhdfs://***@127.0.0.1:{silent.port}/in"),
        ):  # fmt: skip
            out = tmp_path / f"out-{source[:2]}"
            started = time.monotonic()
            argv = [builder, *common, "-input_path", source, "-output_path", str(out)]
            run = subprocess.run(argv, capture_output=True, text=True, timeout=90)
            took = time.monotonic() - started
            assert run.returncode == 1, run.stderr
            assert run.stderr.strip() == f"error: {shown}: timed out"
            assert took < fetch_timeout + 20  # the process's own start-up, on a loaded machine
            assert not list(out.glob(".fetch-*"))


def test_agent_refuses_a_corrupted_s3_object_and_places_a_good_one(
    s3: S3Bucket, deployment: Deployment
) -> None:
    good = s3.root / "agent" / "t_part0.tar"
    md5 = make_shard_tar(good, n_keys=500, seed=3)
    bad = good.with_name("bad.tar")
    bad.write_bytes(good.read_bytes())
    flip_byte(bad, bad.stat().st_size // 2)
    s3.fs.put_file(str(bad), f"{BUCKET}/shards/v1/t_part0.tar")
    source = f"s3://{BUCKET}/shards/v1/t_part0.tar"
    agent = deployment.agent("--allowed_sources", f"s3://{BUCKET}/shards")
    task = agent.run("download", "100", source=source, md5=md5)
    assert task["state"] == "failed", task
    assert f"md5 mismatch for {source}: expected {md5}" in task["message"]
    assert not (deployment.data / "100").exists()
    s3.fs.put_file(str(good), f"{BUCKET}/shards/v1/t_part0.tar")
    task = agent.run("download", "101", source=source, md5=md5, size=good.stat().st_size)
    assert task["state"] == "succeeded", task
    assert (deployment.data / "101" / "index.cube").is_file()
    task = agent.run("download", "102", source=f"s3://{BUCKET}/shards/v1/gone.tar", md5=md5)
    assert task["state"] == "failed" and task["message"].endswith("gone.tar: not found"), task
    status, reply = agent.call("POST", "/agent/cmd", {"command": "download", "version": "103",
                               "source": f"s3://{BUCKET}/other/t.tar", "md5": md5})  # fmt: skip
    assert status == 400 and "--allowed_sources" in reply["message"]
    assert SECRET_KEY not in json.dumps(agent.status())


def test_a_rollout_from_donefiles_and_inputs_in_s3(s3: S3Bucket) -> None:
    spec = ClusterSpec(
        dir=s3.root / "cluster",
        shards=2,
        replicas=1,
        donefile=s3.root / "unused-donefile",
        poll_interval=0.2,
        phase_timeout=40.0,
        agent_args=["--allowed_sources", f"s3://{BUCKET}/e2e/builds"],
        transfer_overrides={
            "donefile_address": f"s3://{BUCKET}/e2e/donefile",
            "download_mode": "s3",
            "upload_address": f"s3://{BUCKET}/e2e/builds",
            "retries": 1,
        },
    )
    cluster = up(spec)
    try:
        # a base: three SequenceFiles under the donefile's prefix, named relatively
        base = "1700000000"
        keys, values = table(4000, 2)
        local, expected = input_tree(s3.root / "e2e" / base, keys, values)
        upload(s3.fs, local, f"e2e/donefile/inputs/{base}")
        line = {"id": base, "key": base, "input": f"inputs/{base}"}
        s3.fs.pipe_file(f"{BUCKET}/e2e/donefile/base.txt", (json.dumps(line) + "\n").encode())
        cluster.wait_version(base, WAIT)
        with CubeClient.from_conf(cluster.cube_conf) as client:
            assert client.seek(keys).version == base
            np.testing.assert_array_equal(client.get_embeddings(keys, dim=DIM), expected)
        # a patch appended later: its input and delete list by absolute s3:// URLs
        cur = "1700000100"
        changed = np.random.default_rng(3).standard_normal((50, DIM), dtype=np.float32)
        seqfile(s3.root / "e2e" / cur / "part-00000", keys[100:150], changed)
        patch_input = upload(s3.fs, s3.root / "e2e" / cur, f"e2e/inputs/{cur}")
        deleted = keys[200:210]
        s3.fs.pipe_file(f"{BUCKET}/e2e/deletes/{cur}.txt",
                        "".join(f"{int(k)}\n" for k in deleted).encode())  # fmt: skip
        patch = {"id": cur, "key": base, "input": patch_input,
                 "delete": f"s3://{BUCKET}/e2e/deletes/{cur}.txt"}  # fmt: skip
        s3.fs.pipe_file(f"{BUCKET}/e2e/donefile/patch.txt", (json.dumps(patch) + "\n").encode())
        version = f"{base}_{cur}"
        cluster.wait_version(version, WAIT)
        expected[100:150] = changed
        with CubeClient.from_conf(cluster.cube_conf) as client:
            result = client.seek(keys)
            assert result.version == version
            assert not result.found[200:210].any() and result.found[:200].all()
            got = client.get_embeddings(keys, dim=DIM)
        expected[200:210] = 0
        np.testing.assert_array_equal(got, expected)
        # what the agents were sent: the uploaded copies, tars and md5s side by side
        prefix = f"{BUCKET}/e2e/builds/"
        uploaded = {name.removeprefix(prefix) for name in s3.fs.find(prefix)}
        assert uploaded == {
            f"{out}/test_dict_part{i}.tar{ext}"
            for out in (f"{base}_{base}", f"{base}_{cur}")
            for i in range(2)
            for ext in ("", ".md5")
        }
        sources = [inst["source"] for inst in cluster.api("/instance/status")["data"]]
        assert sources == [f"s3://{BUCKET}/e2e/builds/{base}_{cur}/test_dict_part{i}.tar"
                           for i in range(2)]  # fmt: skip
        assert SECRET_KEY not in json.dumps(cluster.api("/dict/info"))
    finally:
        cluster.down(timeout=5.0)
