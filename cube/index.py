"""The shard hash table: built once by the builder, probed in place from an mmap by servers.

Pure numpy, no I/O. Layout, chosen so that loading is free and a batch resolves in one pass:

- Slots come in buckets of `WINDOW` = 8 (64 bytes of keys: one cache line). A key's home
  bucket is `((fmix64(key) >> 32) * bucket_count) >> 32` ("fastrange": monotonic in the hash).
- Keys are placed in order of their hash with linear probing and no wrap-around, so the table
  is a Robin Hood table built in one vectorized pass: with home slots `8 * bucket` sorted,
  `pos[i] = max(home[i], pos[i-1] + 1)`, which is `maximum.accumulate(home - i) + i`.
- Two parallel arrays: `slot_keys` (uint64) and `slot_rows` (uint32 row of the key's value).
  Empty slots hold `empty_key`, a value chosen to be absent from the shard. A padding bucket
  at the end keeps every probe inside the arrays.
- A probe reads each key's home bucket in one numpy pass and compares. If the key is not there
  and the bucket has an empty slot, the key is absent (a bucket's keys start inside it and are
  contiguous). The few keys left (2.5% at load 0.6) read the next bucket, and so on, bounded
  by `max_probe`, the largest bucket displacement in the table.
- Rows are numbered in slot order; `TOMBSTONE` marks a key deleted by a delta.

Overhead at the default load factor 0.6: 12 bytes per slot / 0.6 = 20 bytes per key.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cube.hashing import fmix64

WINDOW = 8
LOAD_FACTOR = 0.6
TOMBSTONE = 0xFFFFFFFF
MAX_ROWS = TOMBSTONE - 1
_TOMBSTONE_U4 = np.uint32(TOMBSTONE)
_SHIFT32 = np.uint64(32)


@dataclass(frozen=True)
class HashTable:
    """A probe-ready table; arrays may be views on an mmap."""

    slot_keys: np.ndarray  # uint64, (bucket_count + overflow + 1) * WINDOW slots
    slot_rows: np.ndarray  # uint32, same length
    bucket_count: int  # number of home buckets
    empty_key: int
    max_probe: int  # largest (bucket of position - home bucket) in the table

    @property
    def slot_count(self) -> int:
        return int(self.slot_keys.shape[0])

    @property
    def buckets(self) -> np.ndarray:
        """`slot_keys` as a (buckets, WINDOW) array: one row per cache line."""
        return self.slot_keys.reshape(-1, WINDOW)


@dataclass(frozen=True)
class BuiltTable:
    """Output of `build_table`: the table plus which input records became rows, in row order."""

    table: HashTable
    live_order: np.ndarray  # int64 positions into the input keys; row r holds record live_order[r]
    tombstone_count: int


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
    hashes = fmix64(keys)
    order, sorted_hashes = stable_hash_order(hashes)
    del hashes
    last_of_run = np.ones(sorted_hashes.shape[0], dtype=bool)
    np.not_equal(sorted_hashes[:-1], sorted_hashes[1:], out=last_of_run[:-1])
    winners = order[last_of_run]
    sorted_hashes = sorted_hashes[last_of_run]
    del order, last_of_run

    is_tombstone = winners >= record_count
    live_count = int(winners.shape[0] - np.count_nonzero(is_tombstone))
    if live_count > MAX_ROWS:
        raise ValueError(f"{live_count} records in one shard; at most {MAX_ROWS} (use more shards)")

    n = int(winners.shape[0])
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
    slot_count = (used_buckets + 1) * WINDOW  # + one empty padding bucket

    empty_key = _choose_empty_key(sorted_hashes)
    slot_keys = np.full(slot_count, empty_key, dtype=np.uint64)
    slot_keys[positions] = keys[winners]
    slot_rows = np.zeros(slot_count, dtype=np.uint32)
    if n == live_count:  # no tombstones: rows are the slot order
        slot_rows[positions] = np.arange(n, dtype=np.uint32)
        live_order = winners
    else:
        rows = np.cumsum(~is_tombstone, dtype=np.int64) - 1
        slot_rows[positions] = np.where(is_tombstone, TOMBSTONE, rows).astype(np.uint32)
        live_order = winners[~is_tombstone]

    table = HashTable(slot_keys, slot_rows, bucket_count, empty_key, max_probe)
    return BuiltTable(table, live_order, n - live_count)


# Multiplying a one-hot 8-byte mask (byte j set) by this puts j in the top byte.
_BYTE_INDEX = np.uint64(sum(j << (56 - 8 * j) for j in range(WINDOW)))
_S56 = np.uint64(56)
_S3 = np.int64(3)
_NOTHING = np.empty(0, dtype=np.int64)
_BUCKET = np.dtype((np.void, 8 * WINDOW))  # one bucket of keys as one item: take moves rows


def lookup(table: HashTable, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Probe a batch: return (rows uint32, found bool). A tombstone is found with row TOMBSTONE.

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
    onehot >>= _S56
    positions = onehot.view(np.int64)  # 0..7, in place
    positions += buckets << _S3
    # clip: a key equal to empty_key matches several slots; lookup() clears its found flag
    rows = table.slot_rows.take(positions, mode="clip")
    if table.max_probe == 0 or np.count_nonzero(found) == found.shape[0]:
        return rows, found, _NOTHING
    # A bucket's occupied slots are a prefix of it (keys sit at max(home slot, previous + 1)
    # in home order), so a bucket is full exactly when its last slot is occupied.
    full = candidates[WINDOW - 1 :: WINDOW] != np.uint64(table.empty_key)
    full &= ~found
    return rows, found, np.flatnonzero(full)


def is_tombstone(rows: np.ndarray) -> np.ndarray:
    return rows == _TOMBSTONE_U4
