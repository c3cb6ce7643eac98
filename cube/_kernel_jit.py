"""The numba-compiled loops behind cube.kernel (imported only when a lookup first needs them,
so commands that never look up do not pay numba's ~0.4 s import). See cube.kernel for what
they compute and why; these functions take the arrays `cube.kernel.prepare` makes.
"""

from __future__ import annotations

import numpy as np

from cube._jit import fmix64, jit, prefetch
from cube.kernel_constants import MAX_ROWS, TOMBSTONE, WINDOW

_S32 = np.uint64(32)
_W = np.uint64(WINDOW)
_TOMB = np.uint32(TOMBSTONE)
_MISS = np.uint32(MAX_ROWS)  # cube.kernel.MISS

_AHEAD = 8  # keys between a prefetch and its use: enough misses in flight to hide DRAM


@jit
def _home_buckets(keys, bucket_count):
    """Each key's home bucket: fmix64 then fastrange (cube.index.home_buckets)."""
    buckets = np.empty(keys.shape[0], dtype=np.uint64)
    for i in range(keys.shape[0]):
        buckets[i] = ((fmix64(keys[i]) >> _S32) * bucket_count) >> _S32
    return buckets


@jit
def _probe(slot_keys, bucket_rows, empty_key, max_probe, key, bucket):
    """Row code (module docstring) of one key, from its home bucket on; deleted keys are
    `_mark_deleted`'s. The eight slots are compared into a bit mask, without a branch per
    slot (where a key sits in its bucket is random: a branch on it is mispredicted about
    once per key, which made the loop twice as slow)."""
    row = _MISS
    here = bucket
    step = 0
    while True:  # ends: at most max_probe + 1 buckets
        start = here * _W
        mask = np.uint32(0)
        for j in range(WINDOW):
            mask |= np.uint32(slot_keys[start + np.uint64(j)] == key) << np.uint32(j)
        if mask:  # one bit (a key is in a table once): its position is popcount(mask - 1)
            below = mask - np.uint32(1)
            below -= (below >> np.uint32(1)) & np.uint32(0x55)
            below = (below & np.uint32(0x33)) + ((below >> np.uint32(2)) & np.uint32(0x33))
            row = bucket_rows[here] + ((below + (below >> np.uint32(4))) & np.uint32(0x0F))
            break
        # a bucket's keys start in it and are contiguous: a bucket with an empty slot (its
        # last one) ends the search
        if slot_keys[start + _W - np.uint64(1)] == empty_key or step >= max_probe:
            break
        step += 1
        here += np.uint64(1)
    if key == empty_key:  # it matched empty slots
        row = _MISS
    return row


@jit
def _probe_all(slot_keys, bucket_rows, bucket_count, empty_key, max_probe, keys):
    """The row code of every key. While key i is probed, the key line and first row of
    key i + _AHEAD are prefetched, so their cache misses overlap instead of coming one
    after another (about 2x faster than probing alone, and than prefetching all first)."""
    n = keys.shape[0]
    buckets = _home_buckets(keys, bucket_count)
    for i in range(min(_AHEAD, n)):
        prefetch(slot_keys, buckets[i] * _W)
        prefetch(bucket_rows, buckets[i])
    rows = np.empty(n, dtype=np.uint32)
    for i in range(n):
        if i + _AHEAD < n:
            ahead = buckets[i + _AHEAD]
            prefetch(slot_keys, ahead * _W)
            prefetch(bucket_rows, ahead)
        rows[i] = _probe(slot_keys, bucket_rows, empty_key, max_probe, keys[i], buckets[i])
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
def _lookup_rows(slot_keys, bucket_rows, deleted_keys, bucket_count, empty_key, max_probe, keys):
    rows = _probe_all(slot_keys, bucket_rows, bucket_count, empty_key, max_probe, keys)
    if deleted_keys.shape[0]:
        _mark_deleted(deleted_keys, keys, rows)
    return rows


@jit
def _seek_fixed(
    slot_keys,
    bucket_rows,
    deleted_keys,
    bucket_count,
    empty_key,
    max_probe,
    values,
    keys,
    found,
    out,
):
    """Single-layer lookup + gather: out[i] = the key's value (rows of words), zeros when
    it is not served (missing or deleted); returns how many were not. The value rows are
    prefetched _AHEAD keys ahead of the copy, like the key lines in `_probe_all`."""
    n = keys.shape[0]
    rows = _probe_all(slot_keys, bucket_rows, bucket_count, empty_key, max_probe, keys)
    if deleted_keys.shape[0]:  # tombstones are not served: they only count as misses
        _mark_deleted(deleted_keys, keys, rows)
    for i in range(min(_AHEAD, n)):
        if rows[i] < _MISS:
            prefetch(values, rows[i])
    words = values.shape[1]
    misses = 0
    for i in range(n):
        if i + _AHEAD < n and rows[i + _AHEAD] < _MISS:
            prefetch(values, rows[i + _AHEAD])
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
