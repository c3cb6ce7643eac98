"""The numba-compiled loops behind cube.kernel (imported only when a lookup first needs them,
so commands that never look up do not pay numba's ~0.4 s import). See cube.kernel for what
they compute and why; these functions take the arrays `cube.kernel.prepare` makes, and the
index is cube.index's (bucket starts, packed remainders).
"""

from __future__ import annotations

import numpy as np

from cube._jit import fmix64, jit, jit_inline, load_word_in, prefetch
from cube.kernel_constants import MAX_ROWS, TOMBSTONE

_TOMB = np.uint32(TOMBSTONE)
_MISS = np.uint32(MAX_ROWS)  # cube.kernel.MISS
_ONE = np.uint64(1)

_AHEAD = 12  # keys between a prefetch and its use: enough misses in flight to hide DRAM
_SCAN = 8  # the rows of a bucket `_probe_run` reads without a branch
_GATHER_AHEAD = 8  # values between a prefetch and its copy (as before format 3)


@jit
def _shape(bits):
    """(shift, mask, remainder bytes) of an index of `bits` bucket bits."""
    shift = np.uint64(64 - bits)
    return shift, (_ONE << shift) - _ONE, np.int64((64 - bits + 7) // 8)


@jit_inline
def _remainder(remainders, size, mask, row):
    """Row `row`'s remainder: a word read at its first byte, but for a word that would run
    past the array (the last row's), read byte by byte."""
    at = row * size
    if at + 8 <= remainders.shape[0]:
        return load_word_in(remainders, at) & mask
    value = np.uint64(0)
    for b in range(size):
        value |= np.uint64(remainders[at + b]) << np.uint64(8 * b)
    return value


@jit
def _scan(remainders, size, mask, row, end, want):
    """`_probe_run`'s row code of remainder `want` in rows [row, end), a row at a time."""
    while row < end:
        got = _remainder(remainders, size, mask, row)
        if got >= want:
            return np.uint32(row) if got == want else _MISS
        row += 1
    return _MISS


@jit_inline
def _prefetch_bucket(starts, remainders, size, shift, h):
    """Prefetch the remainders of the bucket of `h` (their first and last byte: a bucket
    straddles two cache lines about a third of the time). Reads its start: prefetched
    earlier (`_probe_run`)."""
    bucket = h >> shift
    first = np.int64(starts[bucket]) * size
    last = np.int64(starts[bucket + _ONE]) * size - 1
    if first <= last < remainders.shape[0]:
        prefetch(remainders, first)
        prefetch(remainders, last)


@jit
def _probe_run(starts, remainders, bits, hashes, pending, count, rows, ahead):
    """rows[i] = the row code (cube.kernel's module docstring) of hashes[i] for i = pending[j],
    j < count (pending None: for i < count); deleted keys are `_mark_deleted`'s.

    Long: the probe is written in the loop (as a function it was 1.35x slower at 20K keys,
    inlined by numba too). A pipeline of prefetches: while key j is probed, the bucket start
    of key j + 2 x ahead and the remainders of key j + ahead (whose start is in cache by then)
    are prefetched, so that each key's two dependent misses overlap those of other keys.
    (Adding a prefetch of each key's value row as soon as its row is known made `_seek_fixed`
    14% slower at 20M keys x 64 B: more misses in flight than the CPU tracks; the gather
    prefetches them instead.)

    The probe: a bucket's remainders ascend, so the key's place is the count of those below
    it. A bucket of up to _SCAN rows (nearly all: 2.5-5 on average) is read whole without a
    branch per row (where a scan stops is random: a branch on it is mispredicted about once
    per key); its reads past the end read its last row again (counted at most `count` times
    then), so only the bucket's cache lines are touched. Larger buckets, and the last rows
    (whose 8-byte word would run past the array), `_scan`. A corrupt bucket start cannot send
    it past the remainders: the end is bounded by `limit`, the row count."""
    shift, mask, size = _shape(bits)
    limit = remainders.shape[0] // size
    far = 2 * ahead
    for j in range(min(far, count)):
        i = j if pending is None else pending[j]
        prefetch(starts, hashes[i] >> shift)
    for j in range(min(ahead, count)):
        i = j if pending is None else pending[j]
        _prefetch_bucket(starts, remainders, size, shift, hashes[i])
    for j in range(count):
        if j + far < count:
            k = j + far if pending is None else pending[j + far]
            prefetch(starts, hashes[k] >> shift)
        if j + ahead < count:
            k = j + ahead if pending is None else pending[j + ahead]
            _prefetch_bucket(starts, remainders, size, shift, hashes[k])
        i = j if pending is None else pending[j]
        h = hashes[i]
        bucket = h >> shift
        start = np.int64(starts[bucket])
        end = min(np.int64(starts[bucket + _ONE]), limit)
        want = h & mask
        rows_in = end - start
        if rows_in <= 0 or rows_in > _SCAN or (end + 1) * size > remainders.shape[0]:
            rows[i] = _scan(remainders, size, mask, start, end, want)
            continue
        at = start * size
        last = (end - 1) * size
        below = np.int64(0)
        for _ in range(_SCAN):
            got = load_word_in(remainders, min(at, last)) & mask
            below += np.int64(got < want)
            at += size
        row = min(start + below, end - 1)
        found = (load_word_in(remainders, row * size) & mask) == want
        rows[i] = np.uint32(row) if found else _MISS


@jit
def _probe_all(starts, remainders, bits, keys):
    """The row code of every key (prefetched ahead: `_probe_run`)."""
    n = keys.shape[0]
    hashes = np.empty(n, dtype=np.uint64)
    for i in range(n):
        hashes[i] = fmix64(keys[i])
    rows = np.empty(n, dtype=np.uint32)
    _probe_run(starts, remainders, bits, hashes, None, n, rows, _AHEAD)
    return rows


@jit
def _mark_deleted(deleted_keys, keys, rows):
    """A pass of its own over the misses (inside the probe loop the search made the whole
    loop 2-3x slower): a key the table lacks and the delta deletes gets row TOMBSTONE."""
    count = deleted_keys.shape[0]
    for i in range(keys.shape[0]):
        if rows[i] == _MISS:
            at = np.searchsorted(deleted_keys, keys[i])
            if at < count and deleted_keys[at] == keys[i]:
                rows[i] = _TOMB


@jit
def _lookup_rows(starts, remainders, deleted_keys, bits, keys):
    rows = _probe_all(starts, remainders, bits, keys)
    if deleted_keys.shape[0]:
        _mark_deleted(deleted_keys, keys, rows)
    return rows


@jit
def _seek_fixed(starts, remainders, deleted_keys, bits, values, keys, found, out):
    """Single-layer lookup + gather: out[i] = the key's value (rows of words), zeros when
    it is not served (missing or deleted); returns how many were not. The value rows are
    prefetched _GATHER_AHEAD keys ahead of the copy, like the index lines in `_probe_all`."""
    n = keys.shape[0]
    rows = _probe_all(starts, remainders, bits, keys)
    if deleted_keys.shape[0]:  # tombstones are not served: they only count as misses
        _mark_deleted(deleted_keys, keys, rows)
    for i in range(min(_GATHER_AHEAD, n)):
        if rows[i] < _MISS:
            prefetch(values, rows[i])
    words = values.shape[1]
    misses = 0
    for i in range(n):
        if i + _GATHER_AHEAD < n and rows[i + _GATHER_AHEAD] < _MISS:
            prefetch(values, rows[i + _GATHER_AHEAD])
        row = rows[i]
        if row < _MISS:
            found[i] = True
            for w in range(words):
                out[i, w] = values[row, w]
        else:
            found[i] = False
            for w in range(words):
                out[i, w] = 0
            misses += 1
    return misses
