"""The shard index: an exact quotiented hash directory, built once by the builder and probed in
place from an mmap by servers. Pure numpy, no I/O. Design notes: docs/reference/data-layout.md.

- h = fmix64(key), a bijection: h identifies the key. Rows are numbered in hash order.
- The top `bits` of h pick one of 2**bits buckets (~2.5-5 keys each); `bucket_starts` (uint32,
  2**bits + 1) holds each bucket's first row, and last the row count.
- `remainders` holds each row's low 64 - bits of h in `remainder_bytes` bytes (little-endian,
  packed): a bucket's are contiguous and ascending, so a probe scans its bucket and stops at
  the first remainder >= the one sought; `max_bucket` bounds the scan.
- A delta's deleted keys are not rows: `deleted_keys` (sorted uint64) lists them, and a lookup
  reports them found with row `TOMBSTONE` (a newer layer's tombstone hides the key in older
  layers, see cube.shard.ShardStack).
- Bytes a key: remainder_bytes + 4 * 2**bits / n: 7.05 at 1M keys, 6.3-6.9 at 10M-100M.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from types import ModuleType

import numpy as np

from cube.hashing import fmix64, fmix64_inverse

# The index's constants live in the kernels' leaf module; importable from here too.
from cube.kernel_constants import MAX_ROWS as MAX_ROWS
from cube.kernel_constants import TOMBSTONE as TOMBSTONE

_TOMBSTONE_U4 = np.uint32(TOMBSTONE)
MAX_BITS = 32  # 2**32 buckets: a row count's worth; so remainders take 4 to 8 bytes
_BUCKET_LOAD = (2.5, 5.0)  # the average keys a bucket that bits_for aims at
_WINDOW = 8  # remainders the numpy lookup reads at once from each key's bucket


def remainder_bytes(bits: int) -> int:
    """Bytes of a row's remainder (the hash's low 64 - bits bits)."""
    return (64 - bits + 7) // 8


def bits_for(count: int) -> int:
    """Bucket bits for `count` keys: of those giving 2.5-5 keys a bucket on average, the one
    with the fewest index bytes (remainders + bucket starts)."""
    best = max(1, min(MAX_BITS, round(float(np.log2(max(count, 1) / 4)))))
    best_bytes = None
    for bits in range(1, MAX_BITS + 1):
        if _BUCKET_LOAD[0] <= count / (1 << bits) <= _BUCKET_LOAD[1]:
            size = count * remainder_bytes(bits) + 4 * ((1 << bits) + 1)
            if best_bytes is None or size < best_bytes:
                best, best_bytes = bits, size
    return best


@dataclass(frozen=True)
class HashTable:
    """A probe-ready index; arrays may be views on an mmap."""

    bucket_starts: np.ndarray  # uint32, 2**bits + 1: each bucket's first row, then the count
    remainders: np.ndarray  # uint8, row_count * remainder_bytes: rows' low hash bits, LE
    deleted_keys: np.ndarray  # uint64, sorted: keys this delta deletes (tombstones)
    bits: int  # bucket = h >> (64 - bits)
    max_bucket: int  # the most rows a bucket holds (bounds a probe's scan)
    # numpy's view of the remainders as words (see _remainder_words), made once
    _words: tuple[np.ndarray, int, np.ndarray] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_words", _remainder_words(self.remainders, self.remainder_bytes))

    @property
    def remainder_bytes(self) -> int:
        return remainder_bytes(self.bits)

    @property
    def row_count(self) -> int:
        return int(self.remainders.shape[0]) // self.remainder_bytes

    @property
    def nbytes(self) -> int:
        """The index's bytes (what a lookup reads), tombstones aside."""
        return int(self.bucket_starts.nbytes + self.remainders.nbytes)


@dataclass(frozen=True)
class BuiltTable:
    """Output of `build_table`: the table plus which input records became rows, in row order."""

    table: HashTable
    live_order: np.ndarray  # int64 positions into the input keys; row r holds record live_order[r]
    tombstone_count: int  # deleted keys (table.deleted_keys)


def _remainder_words(remainders: np.ndarray, size: int) -> tuple[np.ndarray, int, np.ndarray]:
    """No-copy views of the remainders for numpy: (words, the last row's remainder, windows).
    words[i] is an unaligned little-endian uint64 at row i's first byte (it holds the row's
    bytes and then the next rows'), for the rows whose 8 bytes lie inside the array: with 4 to 8
    bytes a row, all rows but the last. windows[i] is the `_WINDOW` rows from row i as one item
    of bytes (a fancy index copies each with one memcpy: 2.4x faster than gathering 8 words
    per row at 20M keys). Index them with [], not take(): take copies an unaligned array
    whole."""
    length = int(remainders.shape[0])
    rows = length // size
    fit = (length - 8) // size + 1 if length >= 8 else 0
    words = np.ndarray((fit,), dtype="<u8", buffer=remainders, strides=(size,))
    last = int.from_bytes(bytes(remainders[length - size :]), "little") if rows else 0
    item = np.dtype((np.void, _WINDOW * size))
    windows = np.ndarray(
        (max(rows - _WINDOW + 1, 0),), dtype=item, buffer=remainders, strides=(size,)
    )
    return words, last, windows


def read_remainders(table: HashTable, rows: np.ndarray) -> np.ndarray:
    """The remainder of each row (int64 row numbers < row_count), uint64."""
    words, last, _windows = table._words
    fit = words.shape[0]
    got: np.ndarray
    if fit == table.row_count:
        got = words[rows]  # (not take: it copies an unaligned array whole)
    else:  # the last row has no word of its own: it reads `last`
        got = words[np.minimum(rows, fit - 1)] if fit else np.zeros(rows.shape, np.uint64)
        got[rows >= fit] = last
    got &= np.uint64((1 << (64 - table.bits)) - 1)
    return got


def directory(
    sorted_hashes: np.ndarray, bits: int | None = None
) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(bucket_starts, remainders, bits, max_bucket) of distinct hashes in ascending order."""
    n = int(sorted_hashes.shape[0])
    bits = bits_for(n) if bits is None else bits
    if not 1 <= bits <= MAX_BITS:
        raise ValueError(f"bucket bits {bits} outside [1, {MAX_BITS}]")
    shift = np.uint64(64 - bits)
    size = remainder_bytes(bits)
    counts = np.bincount((sorted_hashes >> shift).view(np.int64), minlength=1 << bits)
    starts = np.zeros((1 << bits) + 1, dtype=np.uint32)
    np.cumsum(counts, out=starts[1:], dtype=np.uint32)
    max_bucket = int(counts.max()) if n else 0
    del counts
    low = sorted_hashes & np.uint64((1 << (64 - bits)) - 1)
    as_bytes = low.astype("<u8", copy=False).view(np.uint8).reshape(n, 8)
    remainders = np.ascontiguousarray(as_bytes[:, :size]).reshape(-1)
    return starts, remainders, bits, max_bucket


def from_hash_ordered(keys: np.ndarray, bits: int | None = None) -> HashTable:
    """The index of distinct keys already in ascending hash order (the builder's winners, a
    format-2 index's slot keys), no tombstones: compiled when the build loops are loaded."""
    n = int(keys.shape[0])
    bits = bits_for(n) if bits is None else bits
    if not 1 <= bits <= MAX_BITS:
        raise ValueError(f"bucket bits {bits} outside [1, {MAX_BITS}]")
    kernels = compiled_kernels(n)
    if kernels is None:
        starts, remainders, bits, max_bucket = directory(fmix64(keys), bits)
        return HashTable(starts, remainders, np.empty(0, np.uint64), bits, max_bucket)
    size = remainder_bytes(bits)
    starts = np.empty((1 << bits) + 1, dtype=np.uint32)
    remainders = np.empty(n * size + 8, dtype=np.uint8)  # + 8: the loop stores whole words
    max_bucket = kernels.place(keys, bits, starts, remainders)
    return HashTable(starts, remainders[: n * size], np.empty(0, np.uint64), bits, int(max_bucket))


def keys_at(table: HashTable, rows: np.ndarray) -> np.ndarray:
    """The keys of rows (int64 < row_count): their hashes are bucket and remainder, and fmix64
    is a bijection. How a warm-up or a test gets keys the index holds without the input."""
    rows = np.asarray(rows, dtype=np.int64)
    buckets = np.searchsorted(table.bucket_starts, rows, side="right") - 1
    hashes = buckets.astype(np.uint64) << np.uint64(64 - table.bits)
    hashes |= read_remainders(table, rows)
    return fmix64_inverse(hashes)


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
    bits: int | None = None,
) -> BuiltTable:
    """Build a table from record keys (duplicates allowed: the last record wins) and keys to
    delete (they become tombstones and win over records with the same key); `bits` forces
    the bucket bits (tests: crowded buckets), else `bits_for` the row count.

    fmix64 is a bijection, so sorting by hash both orders the table and brings duplicates of a
    key together; a stable sort keeps them in input order, so the last of a run is the winner.
    """
    keys = np.ascontiguousarray(keys, dtype=np.uint64)
    record_count = keys.shape[0]
    if deleted is not None and deleted.shape[0]:
        keys = np.concatenate([keys, np.ascontiguousarray(deleted, dtype=np.uint64)])
    kernels = compiled_kernels(keys.shape[0])
    if kernels is not None:
        return _build_compiled(kernels, keys, record_count, bits)
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
    starts, remainders, bits, max_bucket = directory(sorted_hashes, bits)
    table = HashTable(starts, remainders, deleted_keys, bits, max_bucket)
    return BuiltTable(table, winners, int(deleted_keys.shape[0]))


# Below this many keys the numpy build is fast enough not to import numba and load the
# compiled loops for it (~0.7 s); once something in the process loaded them, they are used.
COMPILED_MIN_KEYS = 4 << 20


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
    kernels: ModuleType, keys: np.ndarray, record_count: int, bits: int | None
) -> BuiltTable:
    """build_table's work in three compiled loops and one numpy sort, same bytes out: pack
    (hash prefix, position) as in stable_hash_order, sort, resolve runs (exact hash order,
    last record wins, deletions win and leave), place (bucket starts and remainders)."""
    prefix_bits = max(1, (keys.shape[0] - 1).bit_length())
    packed = kernels.pack_hashes(keys, prefix_bits)
    packed.sort()
    win_keys, winners, dead = kernels.resolve_runs(packed, keys, prefix_bits, record_count)
    del packed
    deleted_keys = np.sort(dead)
    n = int(winners.shape[0])
    if n > MAX_ROWS:
        raise ValueError(f"{n} records in one shard; at most {MAX_ROWS} (use more shards)")
    table = replace(from_hash_ordered(np.asarray(win_keys), bits), deleted_keys=deleted_keys)
    return BuiltTable(table, winners, int(deleted_keys.shape[0]))


# word c: c leading bytes 1 (8 bools as one uint64), for c = 0..8
_PREFIXES = np.tri(_WINDOW + 1, _WINDOW, -1, dtype=bool).view(np.uint64).reshape(-1)
_SUM_BYTES = np.uint64(0x0101010101010101)  # x * this: the sum of x's bytes in the top byte
_S56 = np.uint64(56)


def lookup(table: HashTable, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Probe a batch: return (rows uint32, found bool). A deleted key is found with row
    TOMBSTONE; the row of a key not found is undefined.

    Vectorized across the keys, in few numpy calls (each costs ~1 µs whatever its size): one
    read takes the next `_WINDOW` remainders of every key's bucket as an (n, 8) array (a view
    of the remainders with rows 8 words long, `_remainder_words`); the rows of a bucket below
    the key are counted, and that count is where the key is if it is there. A bucket holds
    2.5-5 keys on average: the few whose bucket goes on past the window read the next window
    (at most max_bucket / 8 reads); keys of the last rows (no window there) `_scan`."""
    n = keys.shape[0]
    rows = np.zeros(n, dtype=np.int64)
    found = np.zeros(n, dtype=bool)
    if not (n and table.row_count):
        return _finish(table, keys, rows, found)
    hashes = fmix64(keys)
    buckets = hashes >> np.uint64(64 - table.bits)
    start = table.bucket_starts.take(buckets.view(np.int64)).astype(np.int64)
    buckets += np.uint64(1)
    count = table.bucket_starts.take(buckets.view(np.int64)).astype(np.int64)
    count -= start
    want = hashes
    want &= np.uint64((1 << (64 - table.bits)) - 1)
    window = table._words[2]
    # every window read starts before the bucket's end: the keys of the last rows, which
    # windows do not reach, scan instead
    near_end = start + np.maximum(count, 1) > window.shape[0]
    if near_end.any():  # rare: the last bucket or two
        pick = np.flatnonzero(near_end)
        found[pick], rows[pick] = _scan(table, want[pick], start[pick], (start + count)[pick])
        pick = np.flatnonzero(~near_end)
        if pick.shape[0]:
            found[pick], rows[pick] = _windows(table, window, want[pick], start[pick], count[pick])
    else:
        found, rows = _windows(table, window, want, start, count)
    return _finish(table, keys, rows, found)


def _windows(
    table: HashTable, window: np.ndarray, want: np.ndarray, start: np.ndarray, count: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(found, row) of each remainder `want` in rows [start, start + count), a window of
    `_WINDOW` rows at a time (every row read lies inside a window)."""
    mask = np.uint64((1 << (64 - table.bits)) - 1)
    size = table.remainder_bytes
    found = np.zeros(want.shape[0], dtype=bool)
    rows = np.zeros(want.shape[0], dtype=np.int64)
    index = None  # the keys of this pass: all, then those whose bucket goes on
    for _ in range(table.max_bucket // _WINDOW + 1):
        n = want.shape[0]
        items = np.empty(n + 1, dtype=window.dtype)  # + 1: the last word reads past its item
        items[:n] = window[start]
        words = np.ndarray((n, _WINDOW), "<u8", buffer=items, strides=(_WINDOW * size, size))
        got = words & mask
        below = got.reshape(-1) < want.repeat(_WINDOW)  # flat: a broadcast costs twice as much
        ahead = below.view(np.uint64)  # a key's 8 flags as one word
        ahead &= _PREFIXES.take(np.minimum(count, _WINDOW))  # the bucket's rows only
        ahead *= _SUM_BYTES
        ahead >>= _S56
        at = ahead.view(np.int64)  # rows of the bucket below the key: where it is if it is there
        flat = np.minimum(at, _WINDOW - 1)
        flat += np.arange(0, n * _WINDOW, _WINDOW)
        hit = got.reshape(-1).take(flat) == want
        hit &= at < count
        at += start
        if index is None:
            found, rows = hit, at
        else:
            found[index], rows[index] = hit, at
        more = at == start + _WINDOW
        more &= count > _WINDOW  # the bucket goes on past the window
        if not more.any():
            break
        pick = np.flatnonzero(more)
        index = pick if index is None else index[pick]
        want, start, count = want[pick], start[pick] + _WINDOW, count[pick] - _WINDOW
    return found, rows


def _finish(
    table: HashTable, keys: np.ndarray, rows: np.ndarray, found: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """lookup's answer: rows as uint32, and the deleted keys found with row TOMBSTONE."""
    rows32 = rows.astype(np.uint32)
    if table.deleted_keys.shape[0]:
        _mark_deleted(table.deleted_keys, keys, rows32, found)
    return rows32, found


def _scan(
    table: HashTable, want: np.ndarray, pos: np.ndarray, end: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(found, row) of each remainder `want` in rows [pos, end) (ascending remainders): one
    offset at a time across the keys, the keys still scanning filtered at each step (at most
    max_bucket steps)."""
    found = np.zeros(want.shape[0], dtype=bool)
    rows = pos.copy()
    index = np.arange(want.shape[0])
    for _ in range(table.max_bucket):
        live = pos < end
        index, pos, end, want = index[live], pos[live], end[live], want[live]
        if not index.shape[0]:
            break
        got = read_remainders(table, pos)
        rows[index] = pos
        found[index] = got == want
        keep = got < want
        index, pos, end, want = index[keep], pos[keep] + 1, end[keep], want[keep]
    return found, rows


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
