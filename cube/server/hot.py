"""Serving a version larger than the memory it may use: a key-granular hot cache in front of
its mapped files, and misses read in parallel.

Such a version is mapped for random access (cube.shard `_map_random`): a lookup that misses
the page cache faults one 4 KiB page from disk for a 64-byte value, so the page cache holds
one hot value per page and skewed traffic gains little from it (issue 37). Here:

- `HotCache` keeps copies of the values requests asked for most, in anonymous memory, as an
  in-memory shard (`Shard.in_memory`, the same index and kernels as a file's). Which keys:
  the found keys of recent answers are sampled into a bounded ring; every `REFRESH_SECONDS`
  `choose_hot` (pure) ranks the cached and sampled keys by a decayed count and keeps what the
  byte budget holds. The layer is immutable and replaced whole, so readers need no lock.
  Values come from the sampled answers of the same version (never re-read from disk).
- `PagedGather` answers a request from the hot layer first, then looks the rest up in the
  version's files on `READERS` threads at once: the compiled lookup releases the GIL, so the
  page faults of one request wait on the disk together (13K reads/s at one outstanding read,
  74K at 16 on this machine's disk) instead of one after another.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from cube import kernel
from cube.index import build_table
from cube.shard import Shard
from cube.values import ValueColumn

REFRESH_SECONDS = 5.0  # how often the hot layer is rebuilt from what was sampled, at most
DECAY = 0.5  # a cached key's score is halved at every refresh it was not asked for
SAMPLE_BYTES = 32 << 20  # the ring of sampled answers (keys and values), at most
READERS = 32  # threads that fault a request's misses in at once (the disk's queue depth)
# keys per reader task, at least: a task costs ~10 µs to hand over, a fault ~100 µs (at 32,
# a request's ~50 misses went to one thread: 8.8 ms a 1000-key request at 100M x 64 B)
MIN_CHUNK = 2
# bytes a cached key costs beside its value: its key and score here, its index in the layer
# (~7 bytes a key, index format 3), the sample it came from (and slack)
ENTRY_OVERHEAD = 8 + 4 + 16


@dataclass(frozen=True)
class HotChoice:
    """Which keys the next hot layer holds, and where each one's value comes from."""

    keys: np.ndarray  # uint64
    scores: np.ndarray  # float32
    from_sample: np.ndarray  # int64 position in the sample, -1: not sampled
    from_layer: np.ndarray  # int64 row in the current layer, -1: not cached


def choose_hot(
    cached: np.ndarray,
    cached_scores: np.ndarray,
    sampled: np.ndarray,
    capacity: int,
    decay: float = DECAY,
) -> HotChoice:
    """The `capacity` keys of the highest score, a key's score being its cached score times
    `decay` plus the times it was sampled since; a sampled key takes its latest sampled value.
    Pure and vectorized (a refresh ranks millions of keys)."""
    reversed_sample = sampled[::-1]
    unique, first_reversed, counts = np.unique(
        reversed_sample, return_index=True, return_counts=True
    )
    latest = sampled.shape[0] - 1 - first_reversed  # the last time each key was sampled
    everything = np.concatenate([cached, unique])
    keys, inverse = np.unique(everything, return_inverse=True)
    weights = np.concatenate([cached_scores * np.float32(decay), counts.astype(np.float32)])
    scores = np.bincount(inverse, weights=weights, minlength=keys.shape[0]).astype(np.float32)
    from_sample = np.full(keys.shape[0], -1, dtype=np.int64)
    from_sample[inverse[cached.shape[0] :]] = latest
    from_layer = np.full(keys.shape[0], -1, dtype=np.int64)
    from_layer[inverse[: cached.shape[0]]] = np.arange(cached.shape[0])
    if keys.shape[0] > capacity:
        keep: np.ndarray = (
            np.argpartition(-scores, capacity - 1)[:capacity] if capacity else np.empty(0, np.int64)
        )
        keys, scores = keys[keep], scores[keep]
        from_sample, from_layer = from_sample[keep], from_layer[keep]
    return HotChoice(keys, scores, from_sample, from_layer)


def capacity_for(budget_bytes: int, width: int) -> int:
    """Keys a hot layer of `width`-byte values holds in `budget_bytes`, counting the old and
    the new layer side by side while a refresh builds the new one."""
    return max(0, budget_bytes // (2 * (width + ENTRY_OVERHEAD)))


class SampleRing:
    """The latest found (key, value) pairs answered, bounded in bytes; thread-safe."""

    def __init__(self, width: int, max_bytes: int = SAMPLE_BYTES) -> None:
        self.size = max(1, max_bytes // (8 + width))
        self.keys = np.empty(self.size, dtype=np.uint64)
        self.values = np.empty((self.size, width), dtype=np.uint8)
        self.count = 0  # sampled since the last `take`, at most `size` kept
        self.lock = threading.Lock()

    def add(self, keys: np.ndarray, values: np.ndarray) -> None:
        """Keep `keys` and their (n, width) uint8 `values`, overwriting the oldest."""
        keys, values = keys[-self.size :], values[-self.size :]
        with self.lock:
            start = self.count % self.size
            first = min(keys.shape[0], self.size - start)
            self.keys[start : start + first] = keys[:first]
            self.values[start : start + first] = values[:first]
            rest = keys.shape[0] - first
            self.keys[:rest] = keys[first:]
            self.values[:rest] = values[first:]
            self.count += keys.shape[0]

    def take(self) -> tuple[np.ndarray, np.ndarray]:
        """What was sampled since the last take (oldest first), and start again."""
        with self.lock:
            kept = min(self.count, self.size)
            start = (self.count - kept) % self.size
            order = (start + np.arange(kept)) % self.size
            keys, values = self.keys[order], self.values[order]
            self.count = 0
        return keys, values


@dataclass(frozen=True)
class HotLayer:
    """An immutable hot layer: `shard` (in memory) with its keys and scores in row order."""

    shard: Shard
    words: np.ndarray  # kernel.value_words of its values
    keys: np.ndarray
    scores: np.ndarray

    @classmethod
    def empty(cls, width: int) -> HotLayer:
        return cls.build(np.empty(0, np.uint64), np.empty((0, width), np.uint8), np.empty(0))

    @classmethod
    def build(cls, keys: np.ndarray, values: np.ndarray, scores: np.ndarray) -> HotLayer:
        """The layer of `keys` with their (n, width) uint8 `values` and `scores`."""
        built = build_table(keys)
        shard = Shard.in_memory(built, ValueColumn.fixed(values.reshape(-1), values.shape[1]))
        order = built.live_order
        return cls(
            shard,
            kernel.value_words(shard.values.as_rows()),
            keys[order],
            scores[order].astype(np.float32),
        )

    @property
    def nbytes(self) -> int:
        index = self.shard.table.nbytes
        return int(index + self.shard.values.nbytes + self.keys.nbytes + self.scores.nbytes)


class HotCache:
    """The hot layer of one paged split, and how it is kept current (see the module)."""

    def __init__(
        self,
        width: int,
        budget_bytes: int,
        clock: Callable[[], float] = time.monotonic,
        refresh_seconds: float = REFRESH_SECONDS,
    ) -> None:
        self.width = width
        self.capacity = capacity_for(budget_bytes, width)
        ring_bytes = min(SAMPLE_BYTES, max(budget_bytes // 4, 1 << 20))
        self.ring = SampleRing(width, ring_bytes)
        self.layer = HotLayer.empty(width)
        self.clock = clock
        self.refresh_seconds = refresh_seconds
        self.next_refresh = clock() + min(1.0, refresh_seconds)
        self.refreshing = False
        self.refreshes = 0
        self.asked = 0  # keys looked up through it
        self.hits = 0  # of those, answered from the hot layer

    def record(self, keys: np.ndarray, rows: np.ndarray, asked: int, hits: int) -> None:
        """One answer: its found `keys` and their (n, width) uint8 `rows` sampled; `asked`
        keys of which `hits` came from the hot layer (counted for status and metrics)."""
        if self.capacity:
            self.ring.add(keys, rows)
        with self.ring.lock:
            self.asked += asked
            self.hits += hits

    def describe(self) -> dict[str, int]:
        """What status and the metrics show of it."""
        layer = self.layer
        return {
            "keys": int(layer.keys.shape[0]),
            "bytes": layer.nbytes,
            "capacity_keys": self.capacity,
            "asked": self.asked,
            "hits": self.hits,
            "refreshes": self.refreshes,
        }

    def due(self) -> bool:
        """Whether a refresh should start now (at most one at a time); claims it if so."""
        if self.refreshing or self.clock() < self.next_refresh:
            return False
        self.refreshing = True
        return True

    def refresh(self) -> HotLayer:
        """Rebuild the layer from the cached keys and what was sampled since (call after `due`
        returned True; any thread)."""
        try:
            sampled, sampled_values = self.ring.take()
            current = self.layer
            choice = choose_hot(current.keys, current.scores, sampled, self.capacity)
            values = np.empty((choice.keys.shape[0], self.width), dtype=np.uint8)
            fresh = choice.from_sample >= 0
            values[fresh] = sampled_values[choice.from_sample[fresh]]
            kept = ~fresh
            values[kept] = current.shard.values.as_rows()[choice.from_layer[kept]]
            self.layer = HotLayer.build(choice.keys, values, choice.scores)
            self.refreshes += 1
            return self.layer
        finally:  # 1, 2, 4 ... seconds apart up to refresh_seconds: a new version fills fast
            wait = min(self.refresh_seconds, 2.0**self.refreshes)
            self.next_refresh = self.clock() + wait
            self.refreshing = False


_readers: ThreadPoolExecutor | None = None
_readers_lock = threading.Lock()


def readers() -> ThreadPoolExecutor:
    """This process's pool of threads that fault pages in (made at first use)."""
    global _readers
    with _readers_lock:
        if _readers is None:
            _readers = ThreadPoolExecutor(READERS, thread_name_prefix="cube-pager")
        return _readers


def chunks(positions: np.ndarray, parts: int = READERS) -> list[np.ndarray]:
    """`positions` split into at most `parts` pieces of at least MIN_CHUNK."""
    count = max(1, min(parts, positions.shape[0] // MIN_CHUNK))
    return np.array_split(positions, count)
