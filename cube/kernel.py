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

import importlib.metadata
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from cube.index import HashTable
from cube.index import lookup as numpy_lookup
from cube.kernel_constants import COMPILED as COMPILED  # (tests switch it off here)
from cube.kernel_constants import HAVE_NUMBA, TOMBSTONE
from cube.kernel_constants import MISS as MISS  # 0xFFFFFFFE: no row has it

_compiled: Any = None  # cube._kernel_jit, imported by the first lookup (or warm)
_warming = False  # warm() runs in the background: lookups take the numpy path meanwhile
_warm_failed = ""  # why the background warm() failed (lookups then stay on numpy)
_sealed = False  # seal(): the loops compile nothing more; an unforeseen signature takes numpy
unwarmed: set[str] = set()  # the signatures a sealed kernel refused (and answered on numpy)
log = logging.getLogger("cube.kernel")


def _use_compiled() -> bool:
    """The compiled loops, unless a background warm() is still compiling them (a lookup would
    otherwise compile them itself, holding its caller for seconds)."""
    return COMPILED and not _warming


def _loops() -> Any:
    global _compiled
    if _compiled is None:
        from cube import _kernel_jit

        _compiled = _kernel_jit
    return _compiled


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


def _sealed_call(function: Any, *args: Any) -> Any:
    """`function(*args)`, or None when the kernel is sealed and `args` need a compile: that
    compile would hold the request (and the event loop) for a second or more, so the caller
    answers on the numpy path instead, and the signature is logged once (warm() misses it)."""
    try:
        return function(*args)
    except TypeError:
        if not _sealed:
            raise
        signature = ", ".join(_describe_arg(a) for a in args)
        if signature not in unwarmed:
            unwarmed.add(signature)
            log.warning(
                "lookup kernel: %s(%s) was not compiled ahead (cube.kernel.warm): answering"
                " on the numpy path", function.__name__, signature,
            )  # fmt: skip
        return None


def _describe_arg(arg: Any) -> str:
    if isinstance(arg, np.ndarray):
        writable = "" if arg.flags.writeable else " readonly"
        layout = "C" if arg.flags.c_contiguous else "A"
        return f"{arg.dtype}[{arg.ndim}d {layout}{writable}]"
    return type(arg).__name__


def lookup_rows(prepared: KernelTable, keys: np.ndarray) -> np.ndarray:
    """Row code (module docstring) of each key, uint32."""
    if not keys.shape[0]:
        return np.empty(0, dtype=np.uint32)
    if _use_compiled():
        rows = _sealed_call(_loops()._lookup_rows, *prepared.args, _keys(keys))
        if rows is not None:
            return rows  # type: ignore[no-any-return]
    found_rows, found = numpy_lookup(prepared.table, keys)
    rows = found_rows.astype(np.uint32)
    rows[~found] = MISS
    return rows


def lookup(prepared: KernelTable, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cube.index.lookup's contract (rows, found; deleted keys found with row TOMBSTONE)."""
    if not _use_compiled():
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
    if not keys.shape[0]:  # no call: an empty (n, w) array has other strides, another compile
        return 0
    if _use_compiled():
        misses = _sealed_call(_loops()._seek_fixed, *prepared.args, words, _keys(keys), found, out)
        if misses is not None:
            return int(misses)
    rows, hit = numpy_lookup(prepared.table, keys)
    hit &= rows != np.uint32(TOMBSTONE)
    out_bytes = out.view(np.uint8)
    by_row = words.view(np.uint8).reshape(-1, out_bytes.shape[1])
    if by_row.shape[0]:
        by_row.take(np.where(hit, rows, 0), axis=0, out=out_bytes)
    out_bytes[~hit] = 0
    found[:] = hit
    return int(keys.shape[0]) - int(np.count_nonzero(hit))


def compiled_now() -> int:
    """How many of the lookup loops' signatures this process compiled rather than loaded from
    the cache (0 after a warm() that found them all: an install's shipped cache)."""
    if not COMPILED or _compiled is None:
        return 0
    loops = _compiled
    return sum(len(d.stats.cache_misses) for d in (loops._lookup_rows, loops._seek_fixed))


def describe() -> str:
    """Which kernel runs, for logs and status."""
    if COMPILED:
        version = importlib.metadata.version("numba")
        if _warm_failed:
            return f"numpy (numba {version} failed to compile: {_warm_failed})"
        if _warming:
            return f"numpy until the compiled one loads (numba {version})"
        compiled = compiled_now()
        source = f"{compiled} signatures compiled now" if compiled else "loaded from its cache"
        return f"compiled (numba {version}, {source})"
    if HAVE_NUMBA:
        return "numpy (CUBE_KERNEL=numpy)"
    return "numpy (numba is not installed)"


def warm() -> float:
    """Compile (or load from numba's cache) the kernels a server runs, so that no request pays
    for it; returns the seconds it took."""
    started = time.perf_counter()
    if COMPILED:
        from cube.index import build_table

        loops = _loops()
        keys = _keys(np.arange(1, 65, dtype=np.uint64))
        prepared = prepare(build_table(keys, deleted=np.array([99], dtype=np.uint64)).table)
        loops._lookup_rows(*prepared.args, keys)
        for width in (8, 4, 2, 3):  # each word size value_words can pick
            words = value_words(np.zeros((keys.shape[0], width), dtype=np.uint8))
            found = np.empty(keys.shape[0], dtype=bool)
            out = _words(np.empty((keys.shape[0], width), dtype=np.uint8))
            loops._seek_fixed(*prepared.args, words, keys, found, out)
    return time.perf_counter() - started


def seal() -> None:
    """Compile nothing more: after `warm`, a server's lookups run only the signatures it
    compiled, and one it did not foresee answers on the numpy path (logged, in `unwarmed`)
    instead of compiling for a second or more in the request path."""
    global _sealed
    if COMPILED:
        loops = _loops()
        for dispatcher in (loops._lookup_rows, loops._seek_fixed):
            dispatcher.disable_compile()
        _sealed = True


def warm_in_background(sealed: bool = False) -> Future[float]:
    """Run `warm` (then `seal` when `sealed`) in a thread of its own; until it is done,
    lookups take the numpy path (the same answers, slower) instead of compiling in their
    caller. A server reports itself ready only once this is done (cube.server.versions)."""
    global _warming
    done: Future[float] = Future()
    if not COMPILED:
        done.set_result(0.0)
        return done

    def run() -> None:
        global _warming, _warm_failed
        try:
            seconds = warm()
            if sealed:
                seal()
        except BaseException as exc:  # a compile error: stay on the numpy path, and say why
            _warm_failed = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            done.set_exception(exc)
            return
        _warming = False  # before the result: whoever waits for it finds the compiled path
        done.set_result(seconds)

    _warming = True
    threading.Thread(target=run, name="cube-kernel-warm", daemon=True).start()
    return done
