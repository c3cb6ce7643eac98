"""Compiled lookup kernels: hash, probe, tombstone check and value gather in one loop per batch.

Why: the numpy path (cube.index.lookup) makes a dozen passes over a 1000-key batch, each with
its own temporaries and ~1-5 µs of call overhead, and gathers values in another pass; one
compiled loop does the same work per key while the key's cache lines are still being fetched,
and several keys' misses overlap in the CPU. Compiled by numba (`cache=True`, so a process
loads the machine code from the cache instead of compiling; `nogil=True`, so a thread that
looks up lets the others run).

Pure: arrays in, arrays out, the same tables as cube.index. When numba is not installed, or
`CUBE_KERNEL=numpy` is set, every function here falls back to the numpy path, which stays the
oracle the tests compare this kernel against.

Row codes of `lookup_rows`: a row number, `TOMBSTONE` for a key a delta deletes, `MISS` for a
key the table does not hold (rows stop at `MAX_ROWS` - 1, so both codes are free).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from cube.index import MAX_ROWS, TOMBSTONE, WINDOW, HashTable
from cube.index import lookup as numpy_lookup

MISS = MAX_ROWS  # 0xFFFFFFFE: no row has it

try:  # an optional accelerator: the numpy path answers the same without it
    import numba

    _HAVE_NUMBA = True
except ImportError:  # pragma: no cover - exercised by CUBE_KERNEL=numpy in the tests
    _HAVE_NUMBA = False

COMPILED = _HAVE_NUMBA and os.environ.get("CUBE_KERNEL", "compiled") != "numpy"

if COMPILED:
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    def _jit(function):
        """Compile lazily; cache the machine code on disk when a cache directory is writable
        (`__pycache__` beside this file, else NUMBA_CACHE_DIR or the user's cache), else
        compile in every process (a read-only install without a cache directory)."""
        try:
            return numba.njit(cache=True, nogil=True, boundscheck=False, error_model="numpy")(
                function
            )
        except RuntimeError:  # "cannot cache function ...: no locator available"
            return numba.njit(nogil=True, boundscheck=False, error_model="numpy")(function)

    def _prefetch_typer(typingctx, array, index):
        """Ask the CPU to start loading item `index` of a 1-D array (row `index` of a 2-D
        one) into cache, without waiting for it: `llvm.prefetch`, read, high locality."""

        def codegen(context, builder, signature, args):
            array_type, index_type = signature.args
            ary = context.make_array(array_type)(context, builder, args[0])
            stride = builder.extract_value(ary.strides, 0)
            offset = builder.mul(context.cast(builder, args[1], index_type, types.intp), stride)
            byte = ir.IntType(8).as_pointer()
            address = builder.gep(builder.bitcast(ary.data, byte), [offset])
            i32 = ir.IntType(32)
            function = cgutils.get_or_insert_function(
                builder.module,
                ir.FunctionType(ir.VoidType(), [byte, i32, i32, i32]),
                "llvm.prefetch.p0",
            )
            builder.call(function, [address, i32(0), i32(3), i32(1)])
            return context.get_dummy_value()

        return types.void(array, index), codegen

    _prefetch: Any = intrinsic(_prefetch_typer)

    _M1 = np.uint64(0xFF51AFD7ED558CCD)
    _M2 = np.uint64(0xC4CEB9FE1A85EC53)
    _S32 = np.uint64(32)
    _S33 = np.uint64(33)
    _W = np.uint64(WINDOW)
    _TOMB = np.uint32(TOMBSTONE)
    _MISS = np.uint32(MISS)

    _AHEAD = 8  # keys between a prefetch and its use: enough misses in flight to hide DRAM

    @_jit
    def _home_buckets(keys, bucket_count):
        """Each key's home bucket: fmix64 then fastrange (cube.index.home_buckets)."""
        buckets = np.empty(keys.shape[0], dtype=np.uint64)
        for i in range(keys.shape[0]):
            key = keys[i]
            h = key ^ (key >> _S33)
            h *= _M1
            h ^= h >> _S33
            h *= _M2
            h ^= h >> _S33
            buckets[i] = ((h >> _S32) * bucket_count) >> _S32
        return buckets

    @_jit
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

    @_jit
    def _probe_all(slot_keys, bucket_rows, bucket_count, empty_key, max_probe, keys):
        """The row code of every key. While key i is probed, the key line and first row of
        key i + _AHEAD are prefetched, so their cache misses overlap instead of coming one
        after another (about 2x faster than probing alone, and than prefetching all first)."""
        n = keys.shape[0]
        buckets = _home_buckets(keys, bucket_count)
        for i in range(min(_AHEAD, n)):
            _prefetch(slot_keys, buckets[i] * _W)
            _prefetch(bucket_rows, buckets[i])
        rows = np.empty(n, dtype=np.uint32)
        for i in range(n):
            if i + _AHEAD < n:
                ahead = buckets[i + _AHEAD]
                _prefetch(slot_keys, ahead * _W)
                _prefetch(bucket_rows, ahead)
            rows[i] = _probe(slot_keys, bucket_rows, empty_key, max_probe, keys[i], buckets[i])
        return rows

    @_jit
    def _mark_deleted(deleted_keys, keys, rows):
        """A pass of its own over the misses (inside the probe loop the search made the whole
        loop 2-3x slower): a key the table lacks and the delta deletes gets row TOMBSTONE."""
        count = deleted_keys.shape[0]
        for i in range(keys.shape[0]):
            if rows[i] == _MISS:
                at = np.searchsorted(deleted_keys, keys[i])
                if at < count and deleted_keys[at] == keys[i]:
                    rows[i] = _TOMB

    @_jit
    def _lookup_rows(
        slot_keys, bucket_rows, deleted_keys, bucket_count, empty_key, max_probe, keys
    ):
        rows = _probe_all(slot_keys, bucket_rows, bucket_count, empty_key, max_probe, keys)
        if deleted_keys.shape[0]:
            _mark_deleted(deleted_keys, keys, rows)
        return rows

    @_jit
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
                _prefetch(values, rows[i])
        words = values.shape[1]
        misses = 0
        for i in range(n):
            if i + _AHEAD < n and rows[i + _AHEAD] < _MISS:
                _prefetch(values, rows[i + _AHEAD])
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


def _read_only(array: np.ndarray) -> np.ndarray:
    """A read-only view (no copy): the compiled kernels are specialised on writability, and
    everything they read (mmap'd shards, request buffers) is read-only, so writable inputs
    are viewed the same way rather than compiled for again."""
    if not array.flags.writeable:
        return array
    view = array.view()
    view.flags.writeable = False
    return view


def _keys(keys: np.ndarray) -> np.ndarray:
    return _read_only(np.ascontiguousarray(keys, dtype=np.uint64))


@dataclass(frozen=True, slots=True)
class KernelTable:
    """A table's arrays and parameters as the compiled kernels take them; made once per
    shard (`prepare`), not per lookup."""

    table: HashTable
    args: tuple[Any, ...]


def prepare(table: HashTable) -> KernelTable:
    args = (
        _read_only(np.ascontiguousarray(table.slot_keys, dtype=np.uint64)),
        _read_only(np.ascontiguousarray(table.bucket_rows, dtype=np.uint32)),
        _read_only(np.ascontiguousarray(table.deleted_keys, dtype=np.uint64)),
        np.uint64(table.bucket_count),
        np.uint64(table.empty_key),
        np.int64(table.max_probe),
    )
    return KernelTable(table, args)


def lookup_rows(prepared: KernelTable, keys: np.ndarray) -> np.ndarray:
    """Row code (module docstring) of each key, uint32."""
    if COMPILED:
        return _lookup_rows(*prepared.args, _keys(keys))  # type: ignore[no-any-return]
    found_rows, found = numpy_lookup(prepared.table, keys)
    rows = found_rows.astype(np.uint32)
    rows[~found] = MISS
    return rows


def lookup(prepared: KernelTable, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cube.index.lookup's contract (rows, found; deleted keys found with row TOMBSTONE)."""
    if not COMPILED:
        return numpy_lookup(prepared.table, keys)
    rows = lookup_rows(prepared, keys)
    return rows, rows != np.uint32(MISS)


def value_words(rows: np.ndarray) -> np.ndarray:
    """A (count, width) uint8 value array as the widest words that tile a row (uint64 when
    the width is a multiple of 8), read-only: the gather copies words, not bytes."""
    return _read_only(_words(rows))


def _words(rows: np.ndarray) -> np.ndarray:
    width = rows.shape[1]
    for dtype in (np.uint64, np.uint32, np.uint16):
        size = np.dtype(dtype).itemsize
        if width % size == 0 and rows.strides[1] == 1 and rows.strides[0] % size == 0:
            return rows.view(dtype)
    return rows


def seek_fixed(
    prepared: KernelTable, words: np.ndarray, keys: np.ndarray, width: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """Lookup and gather of fixed-width values from one layer: (found, (n, width) uint8 values
    with zero rows where not found, count not found). `words` is `value_words` of the layer's
    (count, width) uint8 values."""
    n = keys.shape[0]
    found = np.empty(n, dtype=bool)
    out = np.empty((n, width), dtype=np.uint8)
    return found, out, seek_fixed_into(prepared, words, keys, found, _words(out))


def seek_fixed_into(
    prepared: KernelTable, words: np.ndarray, keys: np.ndarray, found: np.ndarray, out: np.ndarray
) -> int:
    """`seek_fixed` into given arrays (e.g. views of an answer's wire buffer): found (n,) bool
    and out (n, words per row) of `words.dtype`, aligned; returns the count not found."""
    if COMPILED:
        return int(_seek_fixed(*prepared.args, words, _keys(keys), found, out))
    rows, hit = numpy_lookup(prepared.table, keys)
    hit &= rows != np.uint32(TOMBSTONE)
    out_bytes = out.view(np.uint8)
    by_row = words.view(np.uint8).reshape(-1, out_bytes.shape[1])
    if by_row.shape[0]:
        by_row.take(np.where(hit, rows, 0), axis=0, out=out_bytes)
    out_bytes[~hit] = 0
    found[:] = hit
    return keys.shape[0] - int(np.count_nonzero(hit))


def describe() -> str:
    """Which kernel runs, for logs and status."""
    if COMPILED:
        return f"compiled (numba {numba.__version__})"
    if _HAVE_NUMBA:
        return "numpy (CUBE_KERNEL=numpy)"
    return "numpy (numba is not installed)"


def warm() -> float:
    """Compile (or load from numba's cache) the kernels a server runs, so that no request pays
    for it; returns the seconds it took."""
    started = time.perf_counter()
    if COMPILED:
        from cube.index import build_table

        keys = np.arange(1, 65, dtype=np.uint64)
        prepared = prepare(build_table(keys, deleted=np.array([99], dtype=np.uint64)).table)
        lookup_rows(prepared, keys)
        for width in (8, 4, 2, 3):  # each word size value_words can pick
            values = np.zeros((keys.shape[0], width), dtype=np.uint8)
            seek_fixed(prepared, value_words(values), keys, width)
    return time.perf_counter() - started
