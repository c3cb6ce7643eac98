"""The lookup kernel: a 1000-key batch against 1M- and 10M-key shards mapped from disk.

Targets (issue 2): <= 100 µs at 1M keys, <= 180 µs at 10M keys, in-process.
`fresh` draws a different batch every round (the serving case: cache-cold index lines);
`same` repeats one batch (cache-warm, the number most kernels are quoted with).
Run: make bench   (or .venv/bin/pytest bench/micro/test_bench_lookup.py --benchmark-enable)
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from cube.bench.e2e import key_batches
from cube.index import build_table
from cube.shard import Shard, ShardStack, write_shard
from cube.values import ValueColumn

BATCH = 1000


def build_shard(path, count: int, width: int) -> tuple[Shard, np.ndarray]:
    rng = np.random.default_rng(count)
    keys = rng.integers(0, 2**64 - 1, count, dtype=np.uint64)
    values = ValueColumn.fixed(np.zeros(count * width, dtype=np.uint8), width)
    write_shard(path, build_table(keys), values, {"version": "bench"})
    return Shard.open(path, populate=True), keys


@pytest.fixture(scope="module", params=[1_000_000, 10_000_000], ids=["1M", "10M"])
def shard_and_keys(request, tmp_path_factory):
    shard, keys = build_shard(tmp_path_factory.mktemp("shard"), request.param, 40)
    yield shard, keys
    shard.close()


def batches(keys: np.ndarray, count: int = 512) -> list[np.ndarray]:
    return key_batches(keys, BATCH, count, seed=7)


def test_lookup_fresh_batches(benchmark, shard_and_keys):
    shard, keys = shard_and_keys
    cycle = itertools.cycle(batches(keys))
    benchmark.extra_info["keys"] = keys.shape[0]
    _rows, found = benchmark(lambda: shard.lookup(next(cycle)))
    assert found.all()


def test_lookup_same_batch(benchmark, shard_and_keys):
    shard, keys = shard_and_keys
    batch = batches(keys, 1)[0]
    _rows, found = benchmark(shard.lookup, batch)
    assert found.all()


def test_lookup_and_gather_40_bytes(benchmark, shard_and_keys):
    """What a request handler does: lookup, gather 40-byte values, produce response bytes."""
    shard, keys = shard_and_keys
    stack = ShardStack([shard])
    cycle = itertools.cycle(batches(keys))

    def handle() -> bytes:
        result = stack.lookup(next(cycle))
        return stack.gather_fixed(result).tobytes()

    assert len(benchmark(handle)) == BATCH * 40


def test_lookup_misses(benchmark, shard_and_keys):
    shard, _keys = shard_and_keys
    rng = np.random.default_rng(11)
    misses = rng.integers(0, 2**64 - 1, BATCH, dtype=np.uint64)
    _rows, found = benchmark(shard.lookup, misses)
    assert found.sum() <= 1
