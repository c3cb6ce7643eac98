"""cube-builder end to end: the CLI building Cube-dialect SequenceFiles of fixed-width values.

Target (issue 13): >= 3M records/s end to end on the 2-core machine for fixed-width records
(40-byte values, and 64-byte float32[16] embeddings), `-shard_num 2`: reading in 2 processes,
then one process per shard finishing it. The test asserts only a floor of 1M records/s (the
machine is shared; bench/RESULTS.md has the measured figures). The 1M cases run by default; the
10M cases need CUBE_BENCH_FULL=1 (input 540 MB / 770 MB, written once into a temp dir; each round
writes about twice that as output).
Run: make bench, or
    CUBE_BENCH_FULL=1 .venv/bin/pytest bench/micro/test_bench_builder.py --benchmark-enable
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from pytest_benchmark.fixture import BenchmarkFixture

from cube.seqfile import SequenceFileWriter
from cube.values import ValueColumn

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / ".venv" / "bin" / "cube-builder"
COMMAND = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "cube.builder.cli"]
FULL = os.environ.get("CUBE_BENCH_FULL") == "1"
_FULL_ONLY = pytest.mark.skipif(not FULL, reason="set CUBE_BENCH_FULL=1 for the 10M builds")
SIZES = [
    pytest.param((1_000_000, 4, 40), id="1M-40B"),
    pytest.param((1_000_000, 4, 64), id="1M-64B"),
    pytest.param((10_000_000, 8, 40), id="10M-40B", marks=_FULL_ONLY),
    pytest.param((10_000_000, 8, 64), id="10M-64B", marks=_FULL_ONLY),
]


def write_input(directory: Path, count: int, files: int, width: int) -> None:
    """`files` Cube-dialect SequenceFiles holding `count` random keys with `width`-byte values."""
    rng = np.random.default_rng(count)
    per_file = count // files
    step = 1_000_000
    for number in range(files):
        with SequenceFileWriter(directory / f"part-{number:05d}") as writer:
            for start in range(0, per_file, step):
                n = min(step, per_file - start)
                keys = rng.integers(0, 2**64 - 1, n, dtype=np.uint64)
                blob = rng.integers(0, 256, n * width, dtype=np.uint8)
                writer.write_batch(keys, ValueColumn.fixed(blob, width))


@pytest.fixture(scope="module", params=SIZES)
def generated_input(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Path, int]]:
    count, files, width = request.param
    directory = tmp_path_factory.mktemp(f"builder-input-{count}-{width}")
    write_input(directory, count, files, width)
    yield directory, count
    shutil.rmtree(directory, ignore_errors=True)


def test_builder_end_to_end(
    benchmark: BenchmarkFixture, generated_input: tuple[Path, int], tmp_path: Path
) -> None:
    input_dir, count = generated_input
    output = tmp_path / "out"
    args = [
        *COMMAND,
        "-dict_name=bench",
        f"-input_path={input_dir}",
        f"-output_path={output}",
        "-shard_num=2",
        "-job_mode=base",
        "-quiet",
    ]

    def clear_output() -> tuple[tuple[()], dict[str, object]]:
        shutil.rmtree(output, ignore_errors=True)
        return (), {}

    def build() -> None:
        done = subprocess.run(args, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr

    rounds = 3 if count <= 1_000_000 else 2
    benchmark.pedantic(build, setup=clear_output, rounds=rounds, iterations=1)  # type: ignore[no-untyped-call]  # pytest-benchmark is unannotated
    (version,) = [p for p in output.iterdir() if p.name != "meta_info"]
    assert sorted(p.name for p in version.iterdir() if p.suffix == ".tar") == [
        "bench_part0.tar",
        "bench_part1.tar",
    ]
    if benchmark.stats is None:  # --benchmark-disable (the default): ran once, as a test
        return
    best = benchmark.stats.stats.min
    benchmark.extra_info["records"] = count
    benchmark.extra_info["records_per_s_best"] = round(count / best)
    if count >= 10_000_000:
        assert count / best >= 1_000_000, f"{count / best:,.0f} records/s"
