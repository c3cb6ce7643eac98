"""cube-builder -engine spark on a local[2] Spark: the same bytes as the local builder, the
same refusals, nothing published by a failed job."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from helpers.build_inputs import output_digests, write_mixed_input

from cube.builder.build import BuildConfig, BuildError, build
from cube.index import keys_at
from cube.shard import Shard, ShardStack

pyspark = pytest.importorskip("pyspark", reason="PySpark is not installed (cube-py[spark])")
if shutil.which("java") is None and not __import__("os").environ.get("JAVA_HOME"):
    pytest.skip(
        "no Java: Spark needs Java 17+ (java on PATH or JAVA_HOME)", allow_module_level=True
    )

from cube.builder.spark_build import (  # noqa: E402
    SparkSettings,
    build_on_spark,
    worker_environment,
)

if TYPE_CHECKING:
    from helpers.s3_helpers import MotoServer
    from pyspark.sql import SparkSession

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[1]
BASE, DELTA = 1_700_000_000, 1_700_000_100
LOCAL2 = SparkSettings(master="local[2]")


@pytest.fixture(scope="module")
def spark() -> Iterator[SparkSession]:
    """One local[2] session for the module (a session takes seconds to start); the builds
    use it as the active session and leave it running."""
    from pyspark.sql import SparkSession

    with worker_environment():
        session = (
            SparkSession.builder.master("local[2]")
            .appName("cube-tests")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .getOrCreate()
        )
    yield session
    session.stop()


def both_engines(
    root: Path, inputs: Path, builds: list[dict[str, Any]]
) -> tuple[dict[str, str], dict[str, str]]:
    """Run the same builds on each engine into its own output root; the outputs' digests.
    Each build is BuildConfig's keyword arguments of mixed types, with `input` (default
    `inputs`) and `delete_path` besides."""
    for engine in ("local", "spark"):
        for flags in builds:
            flags = dict(flags)
            source = flags.pop("input", inputs)
            deleted = flags.pop("delete_path", None)
            config = BuildConfig("dict", root / engine, **flags)
            if engine == "local":
                build(config, source, deleted)
            else:
                build_on_spark(config, str(source), deleted and str(deleted), LOCAL2)
    return output_digests(root / "local"), output_digests(root / "spark")


def test_spark_and_local_builds_are_byte_identical(tmp_path: Path, spark: SparkSession) -> None:
    inputs, deleted = write_mixed_input(tmp_path)
    local, on_spark = both_engines(
        tmp_path,
        inputs,
        [
            dict(shard_num=3, mode="base", cur_version=BASE, depend_version=BASE),
            dict(
                shard_num=3,
                mode="delta",
                cur_version=DELTA,
                depend_version=BASE,
                input=inputs / "sub",
                delete_path=deleted,
            ),
        ],
    )
    assert len(local) == 2 * (3 * 4 + 3)
    assert local == on_spark


def test_murmur3_and_a_shard_with_no_records(tmp_path: Path, spark: SparkSession) -> None:
    inputs, _ = write_mixed_input(tmp_path, records=40)
    local, on_spark = both_engines(
        tmp_path,
        inputs,
        [dict(shard_num=64, mode="base", cur_version=BASE, depend_version=BASE,
              partitioner="murmur3")],
    )  # fmt: skip
    assert local == on_spark


def test_a_paddle_ps_save_builds_the_same_bytes_on_spark(
    tmp_path: Path, spark: SparkSession
) -> None:
    """-input_format paddle_ps on both engines: a real trainer's save (gzip parts, short rows,
    keys past 2^63) as a base, and a delta save (plain parts) over it."""
    from cube.paddle_ps import PaddleSource, ValueSpec

    saves = ROOT / "tests" / "data" / "paddle_ps" / "ctr_common_adagrad"
    paddle = PaddleSource(
        accessor="ctr_common",
        dim=8,
        optimizer="adagrad",
        value=ValueSpec(("show", "click", "embed_w", "embedx_w"), "float16"),
    )
    common = dict(shard_num=3, input_format="paddle_ps", paddle=paddle)
    local, on_spark = both_engines(
        tmp_path,
        saves / "checkpoint",
        [
            dict(mode="base", cur_version=BASE, depend_version=BASE, **common),
            dict(
                mode="delta",
                cur_version=DELTA,
                depend_version=BASE,
                input=saves / "delta",
                **common,
            ),
        ],
    )
    assert len(local) == 2 * (3 * 4 + 3)
    assert local == on_spark


def test_a_shard_too_large_for_one_task_is_refused_by_name(
    tmp_path: Path, spark: SparkSession
) -> None:
    inputs, _ = write_mixed_input(tmp_path, records=30000)
    config = BuildConfig("dict", tmp_path / "out", 2, "base", BASE, BASE)
    with pytest.raises(BuildError) as caught:
        build_on_spark(config, str(inputs), None, SparkSettings("local[2]", shard_mb=1))
    message = str(caught.value)
    assert "shard " in message and "(dict_part" in message
    assert "-spark_shard_mb" in message and "-shard_num" in message
    assert_nothing_published(tmp_path / "out")


def test_a_bad_input_file_fails_the_job_naming_the_file(
    tmp_path: Path, spark: SparkSession
) -> None:
    inputs, _ = write_mixed_input(tmp_path, records=200)
    bad = inputs / "sub" / "part-00003"
    bad.write_bytes(bad.read_bytes()[:-7])  # truncated inside its last record
    config = BuildConfig("dict", tmp_path / "out", 2, "base", BASE, BASE)
    with pytest.raises(BuildError) as caught:
        build_on_spark(config, str(inputs), None, LOCAL2)
    assert str(bad) in str(caught.value)
    assert "\n" not in str(caught.value)
    assert_nothing_published(tmp_path / "out")


def assert_nothing_published(output: Path) -> None:
    """No version directory, no staging left, no meta_info."""
    left = sorted(p.name for p in output.iterdir()) if output.exists() else []
    assert left == [], left


def test_the_cli_builds_on_spark_as_it_builds_locally(tmp_path: Path) -> None:
    """`cube-builder -engine spark` in a process of its own (its own session), compared with
    `cube-builder` on the same flags."""
    inputs, _ = write_mixed_input(tmp_path, records=500)
    common = ["-dict_name", "dict", "-input_path", str(inputs), "-shard_num", "2",
              "-only_build", "false", "-cur_version", str(BASE)]  # fmt: skip
    local = subprocess.run(
        [sys.executable, "-m", "cube.builder.cli", *common, "-output_path", str(tmp_path / "a")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert local.returncode == 0, local.stderr
    on_spark = subprocess.run(
        [sys.executable, "-m", "cube.builder.cli", *common, "-output_path", str(tmp_path / "b"),
         "-engine", "spark", "-spark_master", "local[2]",
         "-spark_conf", "spark.ui.enabled=false"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert on_spark.returncode == 0, on_spark.stderr[-3000:]
    assert "2 shard tasks" in on_spark.stdout and "shuffled bytes/record" in on_spark.stdout
    assert output_digests(tmp_path / "a") == output_digests(tmp_path / "b")


def test_bad_spark_flags_exit_2(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "cube.builder.cli", "-dict_name", "d", "-input_path", "x",
         "-output_path", str(tmp_path), "-shard_num", "1", "-engine", "spark",
         "-spark_conf", "no-equals-sign"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "no-equals-sign" in result.stderr and "key=value" in result.stderr


def test_the_transfer_runs_the_spark_build_on_inputs_in_s3(
    moto: MotoServer, tmp_path: Path
) -> None:
    """The whole path at scale's shape: cube-transfer polls a donefile in S3 (moto's server),
    hands the input's s3:// URL to `cube-builder -engine spark` (builder_flags, mirror_input
    false: the executors fetch their files), waits for it as for a local build, and the
    agents and servers answer with the last record of every key."""
    import json

    import numpy as np
    from helpers.s3_helpers import aws_environment, s3_filesystem

    from cube.client import CubeClient
    from cube.transfer.local import ClusterSpec, up

    with aws_environment(moto.url, tmp_path):
        fs = s3_filesystem()
        if not fs.exists("cube-spark"):
            fs.mkdir("cube-spark")
        inputs, _ = write_mixed_input(tmp_path, records=400)
        fs.put(str(inputs), "cube-spark/inputs/base", recursive=True)
        spec = ClusterSpec(
            dir=tmp_path / "cluster",
            shards=2,
            replicas=1,
            donefile=tmp_path / "unused",
            poll_interval=0.2,
            phase_timeout=60.0,
            transfer_overrides={
                "donefile_address": "s3://cube-spark/donefile",
                "builder_flags": (
                    "-engine",
                    "spark",
                    "-spark_master",
                    "local[1]",
                    "-spark_conf",
                    "spark.ui.enabled=false",
                ),
                "mirror_input": False,
                "build_timeout": 240,
            },
        )
        cluster = up(spec)
        try:
            line = {"id": str(BASE), "key": str(BASE), "input": "s3://cube-spark/inputs/base"}
            fs.pipe_file("cube-spark/donefile/base.txt", (json.dumps(line) + "\n").encode())
            cluster.wait_version(str(BASE), 240.0)
            # the table the local builder makes of the same files is what the servers answer
            build(BuildConfig("dict", tmp_path / "local", 1, "base", BASE, BASE), inputs)
            [shard] = [
                Shard.open(p, verify=True) for p in (tmp_path / "local").glob("*/dict_part0")
            ]
            keys = keys_at(shard.table, np.arange(shard.table.row_count))
            want = ShardStack([shard]).gather(ShardStack([shard]).lookup(keys)).to_list()
            with CubeClient.from_conf(cluster.cube_conf) as client:
                result = client.seek(keys)
            assert result.version == str(BASE) and result.found.all()
            assert list(result.values) == want
            transfer_log = next((tmp_path / "cluster").rglob("transfer.log")).read_text()
            assert "-engine spark" in transfer_log and "s3://cube-spark/inputs/base" in transfer_log
            assert "mirroring" not in transfer_log  # the executors fetched the input
        finally:
            cluster.down(timeout=5.0)
