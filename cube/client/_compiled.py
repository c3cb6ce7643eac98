"""The SDK's compiled codec (cube/_sdk_jit.py) where numba is importable (the server extra
brings it; the client extra does not), the numpy paths otherwise and as the reference.

numba's import (~0.4-0.6 s of CPU) and its cached machine code (`python -m cube.kernel_cache`
puts the SDK's loops in the shipped cache with the server's) load in `wait_ready()`, the step a
program takes before it serves (`load`), once per process; without it calls take the numpy
paths, so a short-lived program (cube-cli, a script of a few lookups) never pays for them.
Never in the background of a client that is serving: the import holds the GIL in C for tens of
milliseconds at a time (47-67 ms measured on a 2-core VM, hundreds under load), which stalled
every thread of the process; a CTR predictor's 500 ms lookup timed out that way. Once warm,
the loops are sealed: a signature not compiled ahead takes the numpy path (logged once, in
`unwarmed`) instead of compiling in a request.
`CUBE_KERNEL=numpy` turns them off, as for the server.

What they replace, per call of 1000 keys (bench/RESULTS.md, issue 28): routing and grouping
a batch over several shards (a modulo or murmur3, an argsort, a gather: one counting pass),
reading a SeekResponse's fields (a Python loop over them: one scan), and scattering shard
answers into the batch's arrays (fancy indexing: one copy loop).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from cube.kernel_constants import COMPILED
from cube.wire import Answer, Buffer, _utf8, answer_of, decode_seek_response

log = logging.getLogger("cube.client")

_loops: Any = None  # cube._sdk_jit once warm and sealed: the compiled paths run
_started = False
_lock = threading.Lock()
unwarmed: set[str] = set()  # signatures the sealed loops refused (answered on numpy)
_U8 = np.dtype(np.uint8)


def pending() -> bool:
    """Whether `load` still has something to do (the asyncio client skips its thread then)."""
    return COMPILED and not _started


def load() -> bool:
    """Load the compiled loops now, once per process (a client's `wait_ready` calls it, in
    the caller's thread: the GIL it holds costs nothing before the program serves); False
    when they do not run (no numba, CUBE_KERNEL=numpy, or a compile error, logged once)."""
    global _started
    if not COMPILED:
        return False
    with _lock:
        if not _started:
            _started = True
            try:
                warm()
            except Exception as exc:  # the numpy paths answer; say why once
                log.warning("cube SDK: compiled codec unavailable, using numpy: %s", exc)
    return _loops is not None


def warm() -> bool:
    """Load (or compile, into the kernel cache) every signature the SDK calls, seal them and
    switch the client onto them; False when there is nothing to load (no numba)."""
    global _loops
    if not COMPILED:
        return False
    from cube import _sdk_jit as loops

    loops.warm()
    for dispatcher in dispatchers(loops):
        dispatcher.disable_compile()
    _loops = loops
    return True


def dispatchers(loops: Any = None) -> list[Any]:
    """The compiled loops (warmed and sealed together; tests count their signatures)."""
    if loops is None:
        from cube import _sdk_jit as loops
    return [loops.group_keys, loops.scan_answer, loops.scatter_fixed]


def ready() -> bool:
    """Whether calls take the compiled paths now."""
    return _loops is not None


def _sealed(function: Any, *args: Any) -> Any:
    """`function(*args)`, or None when that signature was not compiled ahead (the caller then
    takes the numpy path: a compile would hold the request for a second)."""
    try:
        return function(*args)
    except TypeError:
        signature = ", ".join(
            f"{a.dtype}[{a.ndim}d{'' if a.flags.writeable else ' readonly'}]"
            if isinstance(a, np.ndarray)
            else type(a).__name__
            for a in args
        )
        if signature not in unwarmed:
            unwarmed.add(signature)
            log.warning(
                "cube SDK: %s(%s) was not compiled ahead: the numpy path answers",
                function.__name__, signature,
            )  # fmt: skip
        return None


def group(
    keys: np.ndarray, shard_num: int, partitioner: str
) -> tuple[np.ndarray, np.ndarray, list[int]] | None:
    """(order, grouped keys, bounds) of a batch over `shard_num` shards (see
    cube._sdk_jit.group_keys), or None: the numpy path's to do."""
    loops = _loops
    if loops is None:
        return None
    n = keys.shape[0]
    order = np.empty(n, np.int64)
    grouped = np.empty(n, np.uint64)
    bounds = np.empty(shard_num + 1, np.int64)
    code = 0 if partitioner == "mod" else 1
    if _sealed(loops.group_keys, keys, shard_num, code, order, grouped, bounds) is None:
        return None
    return order, grouped, bounds.tolist()


def decode(data: Buffer, n: int) -> Answer:
    """cube.wire.decode_seek_response, its field scan compiled (the same answer and the same
    errors: every message the scan does not take is read by the reference)."""
    loops = _loops
    if loops is not None:
        fields = np.empty(9, np.int64)
        if _sealed(loops.scan_answer, np.frombuffer(data, _U8), fields):
            f: list[int] = fields.tolist()
            version = _utf8(data, f[7], f[8])
            return answer_of(data, n, (f[0], f[1], f[2], f[3], f[4], f[5], f[6], version))
    return decode_seek_response(data, n)


def scatter_fixed(
    found: np.ndarray,
    rows: np.ndarray,
    width: int,
    pieces: Sequence[tuple[slice | np.ndarray, Answer]],
) -> bool:
    """Every (positions, answer) of `pieces` (fixed `width`) into `found` and `rows` (uint8
    views of the batch's arrays) in one compiled call each; False when the numpy path should
    do it (not compiled here, or positions given as a slice: a plain copy)."""
    loops = _loops
    if loops is None or not all(type(where) is np.ndarray for where, _ in pieces):
        return False
    for where, answer in pieces:
        column = answer.column
        done = _sealed(
            loops.scatter_fixed,
            found,
            rows,
            width,
            where,
            answer.found.view(np.uint8),
            column.blob,
        )
        if done is None:
            return False
    return True
