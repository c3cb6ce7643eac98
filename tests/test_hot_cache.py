"""The hot cache of a version served paged (cube.server.hot): which keys it keeps (pure, on a
fake clock), the bounded ring of sampled answers, and `PagedGather` answering real shards
mapped for random access (base alone, base + delta with tombstones) exactly as the files
say, before and after the hot layer holds the keys."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cube.index import build_table
from cube.server.hot import (
    HotCache,
    HotLayer,
    SampleRing,
    capacity_for,
    choose_hot,
    chunks,
)
from cube.server.service import FastGather, PagedGather
from cube.shard import Shard, ShardStack, write_shard
from cube.values import ValueColumn

WIDTH = 16


def values_for(keys: np.ndarray, tag: int = 0) -> np.ndarray:
    """(n, WIDTH) uint8 values derived from the keys (and a tag per version)."""
    words = np.stack([keys * np.uint64(2654435761 + tag), keys ^ np.uint64(tag)], axis=1)
    return words.astype("<u8").view(np.uint8).reshape(-1, WIDTH)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_most_asked_keys_are_kept_and_old_scores_decay() -> None:
    cached = np.array([10, 20, 30], dtype=np.uint64)
    scores = np.array([8.0, 1.0, 4.0], dtype=np.float32)
    sampled = np.array([40, 40, 40, 20, 50], dtype=np.uint64)
    choice = choose_hot(cached, scores, sampled, capacity=3, decay=0.5)
    by_key = dict(zip(choice.keys.tolist(), choice.scores.tolist(), strict=True))
    # 10: 8*0.5 = 4, 30: 4*0.5 = 2, 40: 3, 20: 0.5 + 1 = 1.5, 50: 1 -> the top three
    assert by_key == {10: 4.0, 40: 3.0, 30: 2.0}
    source = dict(zip(choice.keys.tolist(), choice.from_layer.tolist(), strict=True))
    assert source[10] == 0 and source[30] == 2 and source[40] == -1
    sample_at = dict(zip(choice.keys.tolist(), choice.from_sample.tolist(), strict=True))
    assert sample_at[40] == 2 and sample_at[10] == -1  # the latest time 40 was sampled


def test_a_key_both_cached_and_sampled_takes_its_sampled_value() -> None:
    choice = choose_hot(
        np.array([7], dtype=np.uint64), np.ones(1, np.float32), np.array([7, 9, 7], np.uint64), 10
    )
    assert choice.keys.tolist() == [7, 9]
    assert choice.from_sample.tolist() == [2, 1] and choice.from_layer.tolist() == [0, -1]
    assert choice.scores.tolist() == [2.5, 1.0]


def test_capacity_zero_keeps_nothing() -> None:
    choice = choose_hot(
        np.empty(0, np.uint64), np.empty(0, np.float32), np.arange(5, dtype=np.uint64), 0
    )
    assert choice.keys.shape == (0,)
    assert capacity_for(0, 64) == 0
    assert capacity_for(1 << 20, 64) == (1 << 20) // (2 * (64 + 28))


def test_the_ring_keeps_the_latest_within_its_bytes() -> None:
    ring = SampleRing(WIDTH, max_bytes=10 * (8 + WIDTH))
    assert ring.size == 10
    first = np.arange(1, 8, dtype=np.uint64)
    ring.add(first, values_for(first))
    second = np.arange(8, 14, dtype=np.uint64)  # wraps: 1, 2, 3 are overwritten
    ring.add(second, values_for(second))
    keys, values = ring.take()
    assert keys.tolist() == list(range(4, 14))
    assert np.array_equal(values, values_for(keys))
    assert ring.take()[0].shape == (0,)  # taken: starts again
    big = np.arange(100, 130, dtype=np.uint64)  # more than the ring at once: the last 10
    ring.add(big, values_for(big))
    assert ring.take()[0].tolist() == list(range(120, 130))


def test_refreshes_come_1_2_4_then_every_5_seconds_and_build_from_samples() -> None:
    clock = FakeClock()
    cache = HotCache(WIDTH, budget_bytes=1 << 20, clock=clock, refresh_seconds=5.0)
    assert not cache.due()
    gaps = []
    for _ in range(5):
        start = clock.now
        while not cache.due():
            clock.now += 0.25
        gaps.append(clock.now - start)
        keys = np.arange(1, 101, dtype=np.uint64) * np.uint64(len(gaps))
        cache.ring.add(keys, values_for(keys))
        assert not cache.due()  # claimed: one refresh at a time
        cache.refresh()
    assert gaps == [1.0, 2.0, 4.0, 5.0, 5.0]
    layer = cache.layer
    every = np.unique(np.concatenate([np.arange(1, 101) * r for r in range(1, 6)]))
    assert cache.refreshes == 5 and layer.keys.shape[0] == every.shape[0]
    rows, found = layer.shard.lookup(layer.keys)
    assert found.all()
    assert np.array_equal(layer.shard.values.as_rows()[rows], values_for(layer.keys))


def test_a_full_cache_keeps_values_it_no_longer_sees_sampled() -> None:
    clock = FakeClock()
    cache = HotCache(WIDTH, budget_bytes=2 * 50 * (WIDTH + 28), clock=clock)
    assert cache.capacity == 50
    keys = np.arange(1, 41, dtype=np.uint64)
    cache.ring.add(keys, values_for(keys, tag=1))
    cache.refresh()
    newer = np.arange(100, 120, dtype=np.uint64)  # 40 cached + 20 new > 50: 10 cached leave
    cache.ring.add(np.repeat(newer, 2), values_for(np.repeat(newer, 2), tag=1))
    layer = cache.refresh()
    assert layer.keys.shape[0] == 50 and set(newer.tolist()) <= set(layer.keys.tolist())
    rows, found = layer.shard.lookup(layer.keys)
    assert found.all()
    assert np.array_equal(layer.shard.values.as_rows()[rows], values_for(layer.keys, tag=1))


def test_an_empty_layer_finds_nothing() -> None:
    layer = HotLayer.empty(WIDTH)
    _rows, found = layer.shard.lookup(np.array([1, 2], dtype=np.uint64))
    assert not found.any() and layer.keys.shape == (0,)


def test_chunks_split_the_misses_among_readers_but_not_too_thin() -> None:
    assert len(chunks(np.arange(1))) == 1
    assert len(chunks(np.arange(10))) == 5  # a few misses: each one's fault on its own thread
    parts = chunks(np.arange(10_000))
    assert len(parts) == 32 and np.array_equal(np.concatenate(parts), np.arange(10_000))


def _shard(directory: Path, keys: np.ndarray, tag: int, deleted: np.ndarray | None = None) -> Shard:
    built = build_table(keys, deleted)
    column = ValueColumn.fixed(values_for(keys, tag).reshape(-1), WIDTH)
    write_shard(directory, built, column, {"dict_name": "hot", "version": str(tag)})
    return Shard.open(directory, random_access=True)


@pytest.mark.parametrize("layers", ["base", "base+delta"])
def test_paged_gather_answers_as_the_files_say_before_and_after_the_cache_fills(
    tmp_path: Path, layers: str
) -> None:
    keys = np.arange(1, 20_001, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    shards = [_shard(tmp_path / "base", keys, tag=1)]
    expected = values_for(keys, 1)
    present = np.ones(keys.shape[0], dtype=bool)
    if layers == "base+delta":
        changed, gone = keys[:500], keys[500:700]
        shards.append(_shard(tmp_path / "delta", changed, tag=2, deleted=gone))
        expected[:500] = values_for(changed, 2)
        present[500:700] = False
    stack = ShardStack(shards)
    clock = FakeClock()
    paged = PagedGather(stack, hot_cache_bytes=4 << 20, clock=clock)
    assert paged.cache is not None
    rng = np.random.default_rng(3)
    absent = np.arange(1, 300, dtype=np.uint64)  # not multiples of the key step: misses
    for round_ in range(4):
        picks = rng.integers(0, 2_000, 1_000)  # a hot tenth of the keys
        asked = np.concatenate([keys[picks], absent])
        found, values = paged.fixed_values(asked)
        assert np.array_equal(found[:1_000], present[picks])
        assert not found[1_000:].any()
        hit = found[:1_000]
        assert np.array_equal(values[:1_000][hit], expected[picks][hit])
        assert not values[1_000:].any() and not values[:1_000][~hit].any()
        reference_found, reference = FastGather(stack).fixed_values(asked)
        assert np.array_equal(found, reference_found) and np.array_equal(values, reference)
        clock.now += 10
        if paged.cache.due():
            paged.cache.refresh()
        assert paged.cache.layer.keys.shape[0] > 0 or round_ == 0
    # rounds after the first were answered from the hot layer, as the files say
    stats = paged.cache.describe()
    assert stats["asked"] == 4 * (1_000 + absent.shape[0])
    assert stats["hits"] > 1_000, stats
    # the hot layer holds only keys that are present, with the values the files hold
    layer = paged.cache.layer
    assert 0 < layer.keys.shape[0] <= 2_000
    position = {int(k): i for i, k in enumerate(keys.tolist())}
    at = np.array([position[int(k)] for k in layer.keys])
    assert present[at].all()
    rows, _ = layer.shard.lookup(layer.keys)
    assert np.array_equal(layer.shard.values.as_rows()[rows], expected[at])
    stack.close()
