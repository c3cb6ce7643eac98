"""The shard hash table: built once by the builder, probed in place from an mmap by servers.

Pure numpy, no I/O. Layout, chosen so that loading is free and a batch resolves in one pass:

- Slots come in buckets of `WINDOW` = 8 (64 bytes of keys: one cache line). A key's home
  bucket is `((fmix64(key) >> 32) * bucket_count) >> 32` ("fastrange": monotonic in the hash).
- Keys are placed in order of their hash with linear probing and no wrap-around, so the table
  is a Robin Hood table built in one vectorized pass: with home slots `8 * bucket` sorted,
  `pos[i] = max(home[i], pos[i-1] + 1)`, which is `maximum.accumulate(home - i) + i`.
- `slot_keys` (uint64) holds the keys; empty slots hold `empty_key`, a value chosen to be
  absent from the shard. A padding bucket at the end keeps every probe inside the array.
- Rows are numbered in slot order, and a bucket's keys are a prefix of it (keys sit at
  `max(home slot, previous + 1)` in home order), so a key's row is `bucket_rows[bucket] +
  slot within the bucket`, with `bucket_rows` one uint32 per bucket (the rows of the buckets
  before it). That array is an eighth of the slots' size and stays in cache, so a lookup
  misses the cache on the bucket line and the value only, not on a per-slot row array too.
- A probe reads each key's home bucket in one numpy pass and compares. If the key is not there
  and the bucket has an empty slot, the key is absent (a bucket's keys start inside it and are
  contiguous). The few keys left (2.5% at load 0.6) read the next bucket, and so on, bounded
  by `max_probe`, the largest bucket displacement in the table.
- A delta's deleted keys are not in the table: `deleted_keys` (sorted uint64) lists them, and
  a lookup reports them found with row `TOMBSTONE` (a newer layer's tombstone hides the key in
  older layers, see cube.shard.ShardStack).

Overhead at the default load factor 0.6: (8 bytes per slot + 4 per 8 slots) / 0.6 = 14.2 bytes
per key.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from cube.hashing import fmix64

# The table's constants live in the kernels' leaf module; importable from here too.
from cube.kernel_constants import MAX_ROWS as MAX_ROWS
from cube.kernel_constants import TOMBSTONE as TOMBSTONE
from cube.kernel_constants import WINDOW as WINDOW

LOAD_FACTOR = 0.6
_TOMBSTONE_U4 = np.uint32(TOMBSTONE)
_SHIFT32 = np.uint64(32)


@dataclass(frozen=True)
class HashTable:
    """A probe-ready table; arrays may be views on an mmap."""

    slot_keys: np.ndarray  # uint64, (bucket_count + overflow + 1) * WINDOW slots
    bucket_rows: np.ndarray  # uint32, one per bucket of slot_keys: row of its first slot
    deleted_keys: np.ndarray  # uint64, sorted: keys this delta deletes (tombstones)
    bucket_count: int  # number of home buckets
    empty_key: int
    max_probe: int  # largest (bucket of position - home bucket) in the table

    @property
    def slot_count(self) -> int:
        return int(self.slot_keys.shape[0])


@dataclass(frozen=True)
class BuiltTable:
    """Output of `build_table`: the table plus which input records became rows, in row order."""

    table: HashTable
    live_order: np.ndarray  # int64 positions into the input keys; row r holds record live_order[r]
    tombstone_count: int  # deleted keys (table.deleted_keys)


def bucket_count_for(count: int, load_factor: float = LOAD_FACTOR) -> int:
    return max(1, int(np.ceil(count / (load_factor * WINDOW))))


def home_buckets(hashes: np.ndarray, bucket_count: int) -> np.ndarray:
    """Home bucket of each hashed key (int64, for indexing)."""
    high = hashes >> _SHIFT32
    high *= np.uint64(bucket_count)
    high >>= _SHIFT32
    return high.view(np.int64)  # < 2**32: the same numbers, no copy


def _choose_empty_key(sorted_hashes: np.ndarray) -> int:
    """A uint64 that is not a key of the table (looked up through the bijective hash)."""
    candidate = 2**64 - 1
    while True:  # ends: at most len(sorted_hashes) candidates can be taken
        h = fmix64(np.array([candidate], dtype=np.uint64))[0]
        i = np.searchsorted(sorted_hashes, h)
        if i >= sorted_hashes.shape[0] or sorted_hashes[i] != h:
            return candidate
        candidate -= 1


def stable_hash_order(hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`np.argsort(hashes, kind="stable")` and the sorted hashes, about 5x faster.

    A plain sort of uint64 is far cheaper than a stable argsort, so each hash's low bits are
    replaced by its position and one `np.sort` orders by (hash prefix, position). Equal hashes
    share the prefix and so come out in input order. The few runs where different hashes share
    a prefix are then re-sorted exactly by (hash, position).
    """
    n = int(hashes.shape[0])
    bits = max(1, (n - 1).bit_length())
    if n < 2 or bits > 40:  # too few prefix bits left to be worth it
        order = np.argsort(hashes, kind="stable")
        return order, hashes[order]
    low = np.uint64((1 << bits) - 1)
    packed = hashes & ~low
    packed |= np.arange(n, dtype=np.uint64)
    packed.sort()
    order = (packed & low).astype(np.int64)
    sorted_hashes = hashes[order]
    # prefix equal <=> the packed values differ only in the position bits
    packed[1:] ^= packed[:-1]
    tied = packed[1:] <= low
    del packed
    mixed = tied & (sorted_hashes[1:] != sorted_hashes[:-1])
    if mixed.any():
        run = np.cumsum(np.concatenate([[True], ~tied]))  # run number of each position
        fix = np.zeros(int(run[-1]) + 1, dtype=bool)
        fix[run[1:][mixed]] = True
        members = np.flatnonzero(fix[run])
        resort = np.lexsort((order[members], sorted_hashes[members]))
        order[members] = order[members][resort]
        sorted_hashes[members] = sorted_hashes[members][resort]
    return order, sorted_hashes


def build_table(
    keys: np.ndarray,
    deleted: np.ndarray | None = None,
    load_factor: float = LOAD_FACTOR,
) -> BuiltTable:
    """Build a table from record keys (duplicates allowed: the last record wins) and keys to
    delete (they become tombstones and win over records with the same key).

    fmix64 is a bijection, so sorting by hash both orders the table and brings duplicates of a
    key together; a stable sort keeps them in input order, so the last of a run is the winner.
    """
    keys = np.ascontiguousarray(keys, dtype=np.uint64)
    record_count = keys.shape[0]
    if deleted is not None and deleted.shape[0]:
        keys = np.concatenate([keys, np.ascontiguousarray(deleted, dtype=np.uint64)])
    kernels = compiled_kernels(keys.shape[0])
    if kernels is not None:
        return _build_compiled(kernels, keys, record_count, load_factor)
    hashes = fmix64(keys)
    order, sorted_hashes = stable_hash_order(hashes)
    del hashes
    last_of_run = np.ones(sorted_hashes.shape[0], dtype=bool)
    np.not_equal(sorted_hashes[:-1], sorted_hashes[1:], out=last_of_run[:-1])
    winners = order[last_of_run]
    sorted_hashes = sorted_hashes[last_of_run]
    del order, last_of_run

    deleted_keys = np.empty(0, dtype=np.uint64)
    if keys.shape[0] > record_count:  # deletes win their runs; they leave the table
        is_deleted = winners >= record_count
        deleted_keys = np.sort(keys[winners[is_deleted]])
        live = ~is_deleted
        winners = winners[live]
        sorted_hashes = sorted_hashes[live]
        del is_deleted, live
    n = int(winners.shape[0])
    if n > MAX_ROWS:
        raise ValueError(f"{n} records in one shard; at most {MAX_ROWS} (use more shards)")

    bucket_count = bucket_count_for(n, load_factor)
    # In-place steps where possible: at 10M keys every temporary is 80 MB of fresh memory.
    homes = home_buckets(sorted_hashes, bucket_count)
    homes *= WINDOW
    ranks = np.arange(n, dtype=np.int64)
    positions = homes - ranks
    np.maximum.accumulate(positions, out=positions)
    positions += ranks
    del ranks
    # homes are bucket starts, so (position - home) // WINDOW is the bucket displacement
    max_probe = int((positions - homes).max()) // WINDOW if n else 0
    del homes
    used_buckets = max(bucket_count, int(positions[-1]) // WINDOW + 1 if n else 0)
    total_buckets = used_buckets + 1  # + one empty padding bucket

    empty_key = _choose_empty_key(sorted_hashes)
    slot_keys = np.full(total_buckets * WINDOW, empty_key, dtype=np.uint64)
    slot_keys[positions] = keys[winners]
    # rows are the slot order: a bucket's first row is the count of keys in earlier buckets
    per_bucket = np.bincount(positions // WINDOW, minlength=total_buckets)
    bucket_rows = np.zeros(total_buckets, dtype=np.uint32)
    np.cumsum(per_bucket[:-1], out=bucket_rows[1:], dtype=np.uint32)
    del positions, per_bucket

    table = HashTable(slot_keys, bucket_rows, deleted_keys, bucket_count, empty_key, max_probe)
    return BuiltTable(table, winners, int(deleted_keys.shape[0]))


# Below this many keys the numpy build is fast enough not to import numba and load the
# compiled loops for it (~0.7 s); once something in the process loaded them, they are used.
COMPILED_MIN_KEYS = 4 << 20
_SLACK_BUCKETS = 64  # room past the home buckets for the table's overflow (rarely > 2)


def compiled_kernels(count: int) -> ModuleType | None:
    """cube.build_kernels when compiled loops should do a build step over `count` items (a
    table's keys, a shard's values), else None (the numpy code does it)."""
    if count < 2 or count >= 1 << 32:  # the packed sort needs a prefix of 32 bits or more
        return None
    if count < COMPILED_MIN_KEYS and "cube.build_kernels" not in sys.modules:
        return None
    from cube import build_kernels

    return build_kernels if build_kernels.COMPILED else None


def _build_compiled(
    kernels: ModuleType, keys: np.ndarray, record_count: int, load_factor: float
) -> BuiltTable:
    """build_table's work in three compiled loops and one numpy sort, same bytes out: pack
    (hash prefix, position) as in stable_hash_order, sort, resolve runs (exact hash order,
    last record wins, deletions win and leave), place."""
    bits = max(1, (keys.shape[0] - 1).bit_length())
    packed = kernels.pack_hashes(keys, bits)
    packed.sort()
    win_keys, winners, dead = kernels.resolve_runs(packed, keys, bits, record_count)
    deleted_keys = np.sort(dead)
    n = int(winners.shape[0])
    if n > MAX_ROWS:
        raise ValueError(f"{n} records in one shard; at most {MAX_ROWS} (use more shards)")
    candidate = 2**64 - 1
    while kernels.is_live(packed, keys, bits, record_count, np.uint64(candidate)):
        candidate -= 1  # ends: at most n candidates can be taken
    del packed
    bucket_count = bucket_count_for(n, load_factor)
    for room in (_SLACK_BUCKETS, n // WINDOW + 2):
        slot_keys = np.empty((bucket_count + room + 1) * WINDOW, dtype=np.uint64)
        bucket_rows = np.empty(bucket_count + room + 1, dtype=np.uint32)
        total, max_probe = kernels.place(
            win_keys, bucket_count, np.uint64(candidate), slot_keys, bucket_rows
        )
        if total > 0:
            break
    table = HashTable(
        slot_keys[: total * WINDOW],
        bucket_rows[:total],
        deleted_keys,
        bucket_count,
        candidate,
        int(max_probe),
    )
    return BuiltTable(table, winners, int(deleted_keys.shape[0]))


# Multiplying a one-hot 8-byte mask (byte j set) by this puts j in the top byte.
_BYTE_INDEX = np.uint64(sum(j << (56 - 8 * j) for j in range(WINDOW)))
_S56 = np.uint64(56)
_S3 = np.int64(3)
_NOTHING = np.empty(0, dtype=np.int64)
_LOW_WORD = 0 if sys.byteorder == "little" else 1  # of a uint64 viewed as two uint32
_BUCKET = np.dtype((np.void, 8 * WINDOW))  # one bucket of keys as one item: take moves rows


def lookup(table: HashTable, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Probe a batch: return (rows uint32, found bool). A deleted key is found with row
    TOMBSTONE.

    Every numpy call costs ~1 µs whatever its size, so the home buckets are computed in place
    on the hashes and the common case (the key in its home bucket) takes one pass."""
    buckets = fmix64(keys)  # a fresh array: home_buckets' steps in place, no astype copy
    buckets >>= _SHIFT32
    buckets *= np.uint64(table.bucket_count)
    buckets >>= _SHIFT32
    buckets = buckets.view(np.int64)  # < bucket_count: the same values
    rows, found, pending = _probe(table, keys, buckets)
    step = 1
    while pending.shape[0] and step <= table.max_probe:
        # A full bucket ends at or before the last used bucket, so the next one exists.
        sub_rows, sub_found, unresolved = _probe(table, keys[pending], buckets[pending] + step)
        rows[pending] = sub_rows
        found[pending] = sub_found
        pending = pending[unresolved]
        step += 1
    if keys.shape[0]:
        found &= keys != np.uint64(table.empty_key)  # it matched an empty slot
    if table.deleted_keys.shape[0]:
        _mark_deleted(table.deleted_keys, keys, rows, found)
    return rows, found


def _probe(
    table: HashTable, keys: np.ndarray, buckets: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Read one bucket per key: rows, found, and the keys whose bucket was full without them."""
    # One 64-byte item per bucket: a 1-D take of whole rows is cheaper than a 2-D axis=0 take.
    candidates = table.slot_keys.view(_BUCKET).take(buckets).view(np.uint64)
    # Compare flat against each key repeated 8 times: a broadcast over an inner axis of 8 costs
    # twice as much in numpy.
    matches = candidates == keys.repeat(WINDOW)
    # A key occurs at most once in a table: the (n, 8) bool mask is a one-hot uint64 per key.
    onehot = matches.view(np.uint64)
    found = onehot != 0
    onehot *= _BYTE_INDEX
    onehot >>= _S56  # the matching slot's place in its bucket, 0..7
    # (a key equal to empty_key matches several slots: garbage here, lookup() clears found)
    rows = table.bucket_rows.take(buckets)
    rows += onehot.view(np.uint32)[_LOW_WORD::2]  # 0..7 fits the low word: no casting pass
    if table.max_probe == 0 or np.count_nonzero(found) == found.shape[0]:
        return rows, found, _NOTHING
    # A bucket's occupied slots are a prefix of it, so a bucket is full exactly when its last
    # slot is occupied.
    full = candidates[WINDOW - 1 :: WINDOW] != np.uint64(table.empty_key)
    full &= ~found
    return rows, found, np.flatnonzero(full)


def _mark_deleted(
    deleted_keys: np.ndarray, keys: np.ndarray, rows: np.ndarray, found: np.ndarray
) -> None:
    """Report the keys in `deleted_keys` found with row TOMBSTONE (in place)."""
    at = np.searchsorted(deleted_keys, keys)
    np.minimum(at, deleted_keys.shape[0] - 1, out=at)
    deleted = deleted_keys.take(at) == keys
    found |= deleted
    rows[deleted] = TOMBSTONE


def is_tombstone(rows: np.ndarray) -> np.ndarray:
    return np.asarray(rows == _TOMBSTONE_U4)
