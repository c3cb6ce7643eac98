"""The lookup kernel: a 1000-key batch against 1M-, 10M- (and, opt-in, 100M-) key shards mapped
from disk, compiled kernel (cube.kernel) against the numpy path it replaced (cube.index).

Targets: issue 2's <= 100 µs at 1M keys and <= 180 µs at 10M for the numpy path; issue 13's
C reference for the compiled one (lookup + 40-byte gather of 1000 random keys in one C loop:
17 µs at 1M keys, 48 µs at 10M). `fresh` draws a different batch every round (the serving
case: cache-cold index lines); `same` repeats one batch (cache-warm).
Values are random bytes written to disk, so a gather reads real, distinct pages.
Run: make bench, or
    .venv/bin/pytest bench/micro/test_bench_lookup.py --benchmark-enable
    CUBE_BENCH_FULL=1 ... adds 100M keys (builds a 5.4 GB shard under the temp dir, ~2 min)
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from pytest_benchmark.fixture import BenchmarkFixture

from cube import kernel
from cube.bench.e2e import key_batches
from cube.index import build_table
from cube.index import lookup as numpy_lookup
from cube.shard import Shard, ShardStack, write_shard
from cube.values import ValueColumn

BATCH = 1000
WIDTH = 40
SIZES = [1_000_000, 10_000_000] + ([100_000_000] if os.environ.get("CUBE_BENCH_FULL") else [])


def build_shard(path: Path, count: int, width: int) -> tuple[Shard, np.ndarray]:
    rng = np.random.default_rng(count)
    keys = rng.integers(0, 2**64 - 1, count, dtype=np.uint64)
    values = ValueColumn.fixed(rng.integers(0, 256, count * width, dtype=np.uint8), width)
    write_shard(path, build_table(keys), values, {"version": "bench"})
    del values
    return Shard.open(path, populate=True), keys


@pytest.fixture(scope="module", params=SIZES, ids=lambda n: f"{n // 1_000_000}M")
def shard_and_keys(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Shard, np.ndarray]]:
    shard, keys = build_shard(tmp_path_factory.mktemp("shard"), request.param, WIDTH)
    yield shard, keys
    shard.close()


@pytest.fixture(params=["compiled", "numpy"])
def kernel_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "compiled" and not kernel.COMPILED:
        pytest.skip("numba not installed")
    monkeypatch.setattr(kernel, "COMPILED", request.param == "compiled")
    kind: str = request.param
    return kind


def batches(keys: np.ndarray, count: int = 512) -> list[np.ndarray]:
    return key_batches(keys, BATCH, count, seed=7)


def test_lookup_fresh_batches(
    benchmark: BenchmarkFixture, shard_and_keys: tuple[Shard, np.ndarray], kernel_kind: str
) -> None:
    shard, keys = shard_and_keys
    cycle = itertools.cycle(batches(keys))
    benchmark.extra_info.update(keys=keys.shape[0], kernel=kernel_kind)
    _rows, found = benchmark(lambda: shard.lookup(next(cycle)))
    assert found.all()


def test_lookup_same_batch(
    benchmark: BenchmarkFixture, shard_and_keys: tuple[Shard, np.ndarray], kernel_kind: str
) -> None:
    shard, keys = shard_and_keys
    batch = batches(keys, 1)[0]
    benchmark.extra_info.update(keys=keys.shape[0], kernel=kernel_kind)
    _rows, found = benchmark(shard.lookup, batch)
    assert found.all()


def test_lookup_and_gather_40_bytes(
    benchmark: BenchmarkFixture, shard_and_keys: tuple[Shard, np.ndarray], kernel_kind: str
) -> None:
    """What the server does per request: lookup and gather 40-byte values, fresh keys. The
    compiled kernel does both in one pass (seek_fixed); numpy looks up, then takes rows."""
    shard, keys = shard_and_keys
    stack = ShardStack([shard])
    words = kernel.value_words(shard.values.as_rows())
    cycle = itertools.cycle(batches(keys))
    benchmark.extra_info.update(keys=keys.shape[0], kernel=kernel_kind)

    def handle() -> np.ndarray:
        if kernel_kind == "compiled":
            return kernel.seek_fixed(shard.kernel_table, words, next(cycle), WIDTH)[1]
        return stack.gather_fixed(stack.lookup(next(cycle)))

    assert handle().shape == (BATCH, WIDTH)
    benchmark(handle)


def test_lookup_misses(
    benchmark: BenchmarkFixture, shard_and_keys: tuple[Shard, np.ndarray], kernel_kind: str
) -> None:
    shard, _keys = shard_and_keys
    rng = np.random.default_rng(11)
    misses = rng.integers(0, 2**64 - 1, BATCH, dtype=np.uint64)
    benchmark.extra_info.update(kernel=kernel_kind)
    _rows, found = benchmark(shard.lookup, misses)
    assert found.sum() <= 1
    assert (found == numpy_lookup(shard.table, misses)[1]).all()
