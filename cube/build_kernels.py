"""Compiled loops for building a shard: the index's hash order and directory
(cube.index.build_table) and the builder's gather of values from their input files.

Why: the numpy build makes ~15 passes over a shard's keys with as many fresh temporaries (at
5M keys each is 40 MB of page faults), and a numpy gather of 64-byte values at random places
pays a memmove call and a cache miss per value one after another. Here each step is one loop
that keeps its state in registers, and the gather prefetches a few values ahead so that their
cache misses overlap. Compiled by numba (`cache=True`: a process loads the machine code from
the cache instead of compiling; `nogil=True`).

Imported only when a build is large enough to repay numba's import (cube.index decides), never
by the servers or the SDK. `COMPILED` is False without numba or with `CUBE_KERNEL=numpy`; the
numpy code in cube.index and cube.builder.spill then does the same work, and stays the oracle
the tests compare these loops against.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cube.kernel_constants import COMPILED as COMPILED  # numba installed, not CUBE_KERNEL=numpy
from cube.kernel_constants import OFFSET_BITS

# Filled in below when COMPILED; typed loosely so the module imports without numba.
pack_hashes: Any = None
resolve_runs: Any = None
place: Any = None
gather_fixed: Any = None

if COMPILED:
    from cube._jit import copy as _copy
    from cube._jit import fmix64 as _fmix64
    from cube._jit import jit as _jit
    from cube._jit import prefetch as _prefetch
    from cube._jit import store_word as _store_word

    _S32 = np.uint64(32)
    _AHEAD = 8  # values between a prefetch and its copy
    _AHEAD_KEYS = 16  # keys between a prefetch and their read

    @_jit
    def _pack_hashes(keys, bits):  # type: ignore[no-untyped-def]
        """fmix64 of each key with its low `bits` replaced by its position (see
        cube.index.stable_hash_order): one sort then orders by (hash prefix, position)."""
        n = keys.shape[0]
        low = np.uint64((1 << bits) - 1)
        high = ~low
        packed = np.empty(n, dtype=np.uint64)
        for i in range(n):
            packed[i] = (_fmix64(keys[i]) & high) | np.uint64(i)
        return packed

    @_jit
    def _keep(keys, pos, record_count, win_keys, win_pos, dead, live, dropped):  # type: ignore[no-untyped-def]
        """Keep the winning record at `pos` (the last of its key): a live row, or a key to
        delete when it is one of the deletes (after the records). Returns (live, dropped)."""
        if pos < record_count:
            win_keys[live] = keys[pos]
            win_pos[live] = pos
            return live + 1, dropped
        dead[dropped] = keys[pos]
        return live, dropped + 1

    @_jit
    def _resolve_runs(packed, keys, bits, record_count):  # type: ignore[no-untyped-def]
        """From the sorted packed hashes: the keys that win (last record of each key) in exact
        (hash, position) order, their positions, and the deleted keys that won (unsorted).

        Equal prefixes are rare runs: equal keys (duplicates) or a prefix collision, put in
        exact order by (full hash, position) before the last of each key is taken."""
        n = packed.shape[0]
        low = np.uint64((1 << bits) - 1)
        high = ~low
        win_keys = np.empty(n, dtype=np.uint64)
        win_pos = np.empty(n, dtype=np.int64)
        dead = np.empty(n - record_count, dtype=np.uint64)
        live = 0
        dropped = 0
        for j in range(min(_AHEAD_KEYS, n)):
            _prefetch(keys, np.int64(packed[j] & low))
        i = 0
        while i < n:
            if i + _AHEAD_KEYS < n:  # keys are read in hash order: at random places
                _prefetch(keys, np.int64(packed[i + _AHEAD_KEYS] & low))
            prefix = packed[i] & high
            end = i + 1
            while end < n and (packed[end] & high) == prefix:
                end += 1
            if end == i + 1:  # the common case: a key alone under its prefix
                pos = np.int64(packed[i] & low)
                live, dropped = _keep(
                    keys, pos, record_count, win_keys, win_pos, dead, live, dropped
                )
                i = end
                continue
            count = end - i
            run_pos = np.empty(count, dtype=np.int64)
            run_hash = np.empty(count, dtype=np.uint64)
            mixed = False
            for j in range(count):
                pos = np.int64(packed[i + j] & low)
                run_pos[j] = pos
                run_hash[j] = _fmix64(keys[pos])
                if run_hash[j] != run_hash[0]:
                    mixed = True
            if mixed:  # positions ascend within the run: a stable sort by hash finishes it
                order = np.argsort(run_hash, kind="mergesort")
                run_pos = run_pos[order]
                run_hash = run_hash[order]
            for j in range(count):
                if j + 1 < count and run_hash[j + 1] == run_hash[j]:
                    continue  # not the last record of its key
                live, dropped = _keep(
                    keys, run_pos[j], record_count, win_keys, win_pos, dead, live, dropped
                )
            i = end
        return win_keys[:live], win_pos[:live], dead[:dropped]

    @_jit
    def _place(keys, bits, starts, remainders):  # type: ignore[no-untyped-def]
        """The directory of keys in hash order (cube.index's module docstring), in one
        sequential pass: bucket_starts (2**bits + 1 entries) and each row's remainder stored
        as a whole little-endian word at row x remainder bytes (the next row overwrites the
        extra bytes; `remainders` has 8 bytes of room past the last row). Returns the most
        rows in a bucket."""
        n = keys.shape[0]
        shift = np.uint64(64 - bits)
        mask = (np.uint64(1) << shift) - np.uint64(1)
        size = (64 - bits + 7) // 8
        buckets = np.int64(1) << np.int64(bits)
        next_bucket = 0
        largest = 0
        first = 0  # the current bucket's first row
        for i in range(n):
            h = _fmix64(keys[i])
            bucket = np.int64(h >> shift)
            if bucket >= next_bucket:
                if i - first > largest:
                    largest = i - first
                first = i
                while next_bucket <= bucket:
                    starts[next_bucket] = i
                    next_bucket += 1
            _store_word(remainders, i * size, h & mask)
        if n - first > largest:
            largest = n - first
        while next_bucket <= buckets:
            starts[next_bucket] = n
            next_bucket += 1
        return largest

    @_jit
    def _gather_fixed(region, bases, locs, rows, width, out):  # type: ignore[no-untyped-def]
        """out[i] = the `width` bytes at location locs[rows[i]] (source << 40 | offset, the
        source's base in `region` from `bases`). Both random reads are prefetched ahead."""
        n = rows.shape[0]
        mask = np.uint64((1 << OFFSET_BITS) - 1)
        shift = np.uint64(OFFSET_BITS)
        for i in range(min(2 * _AHEAD, n)):
            _prefetch(locs, rows[i])
        for i in range(n):
            if i + 2 * _AHEAD < n:
                _prefetch(locs, rows[i + 2 * _AHEAD])
            if i + _AHEAD < n:
                ahead = locs[rows[i + _AHEAD]]
                _prefetch(region, bases[ahead >> shift] + (ahead & mask))
            here = locs[rows[i]]
            _copy(out, i * width, region, bases[here >> shift] + (here & mask), width)

    pack_hashes = _pack_hashes
    resolve_runs = _resolve_runs
    place = _place
    gather_fixed = _gather_fixed


def warm() -> None:
    """Load every loop's machine code now (from numba's cache, compiling on a first run), so
    that processes forked after this have them ready."""
    if not COMPILED:
        return
    keys = np.array([3, 1, 3, 2], dtype=np.uint64)
    packed = pack_hashes(keys, 2)
    packed.sort()
    win_keys, _, _ = resolve_runs(packed, keys, 2, 3)
    place(win_keys, 1, np.empty(3, np.uint32), np.empty(3 * 8 + 8, np.uint8))
    region = np.zeros(16, dtype=np.uint8)
    region.flags.writeable = False  # the mapped sources are read-only: the same signature
    gather_fixed(
        region,
        np.zeros(1, np.uint64),
        np.zeros(2, np.uint64),
        np.zeros(1, np.int64),
        4,
        np.empty(4, np.uint8),
    )
