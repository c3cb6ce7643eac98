"""SequenceFile parse rate: what cube-builder pays to read its input.

Target (issue: builder >= 1M records/s end to end for 10M records of 40-byte values): the
reader alone should parse >= 4M records/s on the common case, an uncompressed Cube-dialect file
with fixed-length records and a sync escape every ~2000 bytes (the vectorized path). The
variable-length case (per-record walker) and the writer are measured for comparison.
Run: .venv/bin/pytest bench/micro/test_bench_seqfile.py --benchmark-enable
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from pytest_benchmark.fixture import BenchmarkFixture

from cube.seqfile import SequenceFileReader, SequenceFileWriter
from cube.values import ValueColumn

WIDTH = 40


def make_records(count: int, seed: int = 0) -> tuple[np.ndarray, ValueColumn]:
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, 2**64 - 1, count, dtype=np.uint64)
    values = ValueColumn.fixed(rng.integers(0, 256, count * WIDTH, dtype=np.uint8), WIDTH)
    return keys, values


@pytest.fixture(scope="module")
def cube_file_10m(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, np.ndarray]]:
    path = tmp_path_factory.mktemp("seq") / "feature"
    keys, values = make_records(10_000_000)
    with SequenceFileWriter(path) as writer:
        for start in range(0, keys.shape[0], 1_000_000):
            rows = np.arange(start, min(start + 1_000_000, keys.shape[0]))
            writer.write_batch(keys[rows], values.take(rows))
    yield path, keys
    path.unlink()


@pytest.fixture(scope="module")
def variable_file_1m(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, int]]:
    path = tmp_path_factory.mktemp("seq") / "variable"
    rng = np.random.default_rng(1)
    count = 1_000_000
    lengths = rng.integers(20, 60, count)
    offsets = np.zeros(count + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = ValueColumn.variable(rng.integers(0, 256, int(offsets[-1]), dtype=np.uint8), offsets)
    with SequenceFileWriter(path) as writer:
        writer.write_batch(np.arange(count, dtype=np.uint64), values)
    yield path, count
    path.unlink()


def read_all(path: Path) -> tuple[int, int]:
    count, checksum = 0, 0
    with SequenceFileReader(path) as reader:
        for batch in reader.batches():
            count += len(batch)
            checksum ^= int(np.bitwise_xor.reduce(batch.keys)) if len(batch) else 0
    return count, checksum


def test_parse_fixed_stride_10m(
    benchmark: BenchmarkFixture, cube_file_10m: tuple[Path, np.ndarray]
) -> None:
    path, keys = cube_file_10m
    count, checksum = benchmark.pedantic(read_all, args=(path,), rounds=3, iterations=1)  # type: ignore[no-untyped-call]  # pytest-benchmark is unannotated
    assert count == keys.shape[0]
    assert checksum == int(np.bitwise_xor.reduce(keys))
    if benchmark.stats is None:  # --benchmark-disable (the default): ran once, as a test
        return
    rate = count / benchmark.stats.stats.median
    benchmark.extra_info["records_per_second"] = round(rate)
    print(f"\nfixed-stride parse: {rate / 1e6:.2f} M records/s")


def test_parse_variable_length_1m(
    benchmark: BenchmarkFixture, variable_file_1m: tuple[Path, int]
) -> None:
    path, count = variable_file_1m
    got, _ = benchmark.pedantic(read_all, args=(path,), rounds=3, iterations=1)  # type: ignore[no-untyped-call]  # pytest-benchmark is unannotated
    assert got == count
    if benchmark.stats is None:  # --benchmark-disable (the default): ran once, as a test
        return
    rate = count / benchmark.stats.stats.median
    benchmark.extra_info["records_per_second"] = round(rate)
    print(f"\nvariable-length parse: {rate / 1e6:.2f} M records/s")


def test_write_fixed_stride_1m(benchmark: BenchmarkFixture, tmp_path: Path) -> None:
    keys, values = make_records(1_000_000, seed=2)
    path = tmp_path / "out"

    def write() -> None:
        with SequenceFileWriter(path) as writer:
            writer.write_batch(keys, values)

    benchmark.pedantic(write, rounds=3, iterations=1)  # type: ignore[no-untyped-call]  # pytest-benchmark is unannotated
    if benchmark.stats is None:  # --benchmark-disable (the default): ran once, as a test
        return
    rate = keys.shape[0] / benchmark.stats.stats.median
    benchmark.extra_info["records_per_second"] = round(rate)
    print(f"\nfixed-stride write: {rate / 1e6:.2f} M records/s")
