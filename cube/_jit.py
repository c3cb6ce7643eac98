"""What the numba-compiled loops share (cube._kernel_jit for lookups, cube.build_kernels for
builds, cube._lane_jit for the TCP lane): whether to compile, the decorator, the CPU prefetch,
memcpy and pointer intrinsics, fmix64.

Imported only by those modules, which are imported only when compiled loops are wanted, so a
process that never needs them does not pay numba's ~0.4 s import. Without numba, or with
`CUBE_KERNEL=numpy`, nothing imports this module and the numpy paths do the work.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from cube.kernel_constants import COMPILED

PACKAGE_DIR = Path(__file__).resolve().parent
SHIPPED_CACHE = PACKAGE_DIR / "_numba_cache"  # built with the wheel (setup.py), or by make
CACHE_ENV = "CUBE_KERNEL_CACHE"
# Machine code for a generic CPU of the architecture: a cache built on one machine (the
# wheel's, the image's) loads on every other; measured as fast as host-tuned code for these
# memory-bound loops (bench/RESULTS.md). Set before numba is imported, unless the user chose
# (and again on numba's config below, for a process that imported numba first).
CPU_CHOSEN_BY_USER = "NUMBA_CPU_NAME" in os.environ
os.environ.setdefault("NUMBA_CPU_NAME", "generic")


def _writable(path: Path) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError:
        return False
    return True


def _private_temp_folder() -> Path | None:
    """$TMPDIR/cube-kernel-<uid>, made 0700 and used only while it is ours alone: numba's
    cache files are pickles, so a folder another user can write is code they could run."""
    folder = Path(tempfile.gettempdir()) / f"cube-kernel-{os.getuid()}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        status = folder.lstat()
    except OSError:
        return None
    if not stat.S_ISDIR(status.st_mode) or status.st_uid != os.getuid():
        return None
    return folder if status.st_mode & 0o077 == 0 and _writable(folder) else None


def kernel_cache_dir() -> Path | None:
    """Where the compiled loops' machine code is cached: $CUBE_KERNEL_CACHE when set; else the
    package's own `_numba_cache` (what the wheel ships) when writable; else a per-user folder
    ($NUMBA_CACHE_DIR or ~/.cache, then cube-kernel; else a private one in the temp folder)
    seeded with the shipped files, so a read-only install, or one owned by another user,
    loads them too; None: no cache (every process compiles)."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit) if _writable(Path(explicit)) else None
    if _writable(SHIPPED_CACHE):
        return SHIPPED_CACHE
    root = os.environ.get("NUMBA_CACHE_DIR") or str(Path.home() / ".cache")
    folder = Path(root) / "cube-kernel"
    if not _writable(folder):
        private = _private_temp_folder()
        if private is None:
            return None
        folder = private
    for shipped in SHIPPED_CACHE.glob("*.nb[ic]"):
        copy = folder / shipped.name
        try:
            source = shipped.stat()
            if not copy.exists() or (copy.stat().st_size, copy.stat().st_mtime) != (
                source.st_size,
                source.st_mtime,
            ):
                shutil.copy2(shipped, copy)  # another wheel's files are replaced, not kept
        except OSError:
            break  # compiles what it lacks, and caches that
    return folder


if COMPILED:
    import numba
    from llvmlite import ir
    from numba import types
    from numba.core import caching, cgutils
    from numba.extending import intrinsic

    numba_config: Any = numba.config
    if not CPU_CHOSEN_BY_USER and numba_config.CPU_NAME is None:
        # numba was imported before this module: its config read no NUMBA_CPU_NAME, and
        # its host-tuned code would miss the shipped cache (keyed by CPU name and features)
        numba_config.CPU_NAME, numba_config.CPU_FEATURES = "generic", ""

    class _KernelCacheLocator(caching._SourceFileBackedLocatorMixin, caching._CacheLocator):
        """numba's cache locator for this package's compiled loops (`kernel_cache_dir`); the
        index stamps sources by content, so the cache is valid wherever the files land."""

        def __init__(self, py_func: Any, py_file: str, directory: Path) -> None:
            self._py_file = py_file
            self._lineno = py_func.__code__.co_firstlineno
            self._cache_path = str(directory)

        def get_cache_path(self) -> str:
            return self._cache_path

        @classmethod
        def from_function(cls, py_func: Any, py_file: str) -> Any:
            if Path(py_file).resolve().parent != PACKAGE_DIR:
                return None  # not ours: numba's own locators decide
            directory = kernel_cache_dir()
            return None if directory is None else cls(py_func, py_file, directory)

    _locators: list[Any] = caching.CacheImpl._locator_classes
    if _KernelCacheLocator not in _locators:
        _locators.insert(0, _KernelCacheLocator)

    def jit(function: Callable[..., Any], nogil: bool = True) -> Any:
        """Compile lazily; cache the machine code on disk (`kernel_cache_dir`), or, with no
        writable cache directory anywhere, compile in every process. `nogil`: release the
        GIL while it runs (not for loops of a microsecond: the SDK's, `jit_holding_gil`,
        where handing the GIL to another thread and taking it back costs more)."""
        options: dict[str, Any] = {"nogil": nogil, "boundscheck": False, "error_model": "numpy"}
        try:
            return numba.njit(cache=True, **options)(function)
        except RuntimeError:  # "cannot cache function ...: no locator available"
            return numba.njit(**options)(function)

    def jit_holding_gil(function: Callable[..., Any]) -> Any:
        return jit(function, nogil=False)

    def jit_inline(function: Callable[..., Any]) -> Any:
        """`jit` for a small helper of a hot loop (the lookup's prefetch of a bucket), inlined
        into its callers by numba: compiled apart, numba's functions stay calls."""
        options: dict[str, Any] = {"nogil": True, "boundscheck": False, "error_model": "numpy"}
        try:
            return numba.njit(cache=True, inline="always", **options)(function)
        except RuntimeError:  # no locator available: as `jit`
            return numba.njit(inline="always", **options)(function)

    def _address(context: Any, builder: Any, array_type: Any, array: Any, offset: Any) -> Any:
        """Address of byte `offset` of an array's data, as i8*."""
        data = context.make_array(array_type)(context, builder, array).data
        return builder.gep(builder.bitcast(data, ir.IntType(8).as_pointer()), [offset])

    def _prefetch_typer(typingctx: Any, array: Any, index: Any) -> Any:
        """Ask the CPU to start loading item `index` of a 1-D array (row `index` of a 2-D
        one) into cache, without waiting for it: `llvm.prefetch`, read, high locality."""

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            array_type, index_type = signature.args
            ary = context.make_array(array_type)(context, builder, args[0])
            stride = builder.extract_value(ary.strides, 0)
            offset = builder.mul(context.cast(builder, args[1], index_type, types.intp), stride)
            address = _address(context, builder, array_type, args[0], offset)
            i32 = ir.IntType(32)
            function = cgutils.get_or_insert_function(
                builder.module,
                ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), i32, i32, i32]),
                "llvm.prefetch.p0",
            )
            builder.call(function, [address, i32(0), i32(3), i32(1)])
            return context.get_dummy_value()

        return types.void(array, index), codegen

    def _copy_typer(
        typingctx: Any, dst: Any, dst_at: Any, src: Any, src_at: Any, count: Any
    ) -> Any:
        """memcpy of `count` bytes from byte `src_at` of `src` to byte `dst_at` of `dst`."""

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            dst_type, dst_at_type, src_type, src_at_type, count_type = signature.args
            intp = types.intp
            to = _address(
                context,
                builder,
                dst_type,
                args[0],
                context.cast(builder, args[1], dst_at_type, intp),
            )
            start = _address(
                context,
                builder,
                src_type,
                args[2],
                context.cast(builder, args[3], src_at_type, intp),
            )
            length = context.cast(builder, args[4], count_type, intp)
            one = context.get_value_type(intp)(1)
            cgutils.raw_memcpy(builder, to, start, length, one)
            return context.get_dummy_value()

        return types.void(dst, dst_at, src, src_at, count), codegen

    def _pointer_typer(typingctx: Any, address: Any) -> Any:
        """An integer address as a pointer, for `numba.carray` views of arrays the caller
        keeps alive (the lane's layers: mapped shard sections, cube.lane_kernel)."""

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return builder.inttoptr(args[0], ir.IntType(8).as_pointer())

        return types.voidptr(address), codegen

    def _load_word_typer(typingctx: Any, address: Any) -> Any:
        """The 8 bytes at an integer address as a uint64 (little-endian; any alignment)."""

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            i64 = ir.IntType(64)
            return builder.load(builder.inttoptr(args[0], i64.as_pointer()), align=1)

        return types.uint64(address), codegen

    def _store_word_typer(typingctx: Any, array: Any, at: Any, value: Any) -> Any:
        """Store a uint64 at byte `at` of an array's data (any alignment)."""

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            array_type, at_type, value_type = signature.args
            offset = context.cast(builder, args[1], at_type, types.intp)
            address = _address(context, builder, array_type, args[0], offset)
            i64 = ir.IntType(64)
            word = context.cast(builder, args[2], value_type, types.uint64)
            builder.store(word, builder.bitcast(address, i64.as_pointer()), align=1)
            return context.get_dummy_value()

        return types.void(array, at, value), codegen

    def _load_word_in_typer(typingctx: Any, array: Any, at: Any) -> Any:
        """The 8 bytes at byte `at` of an array's data as a uint64 (little-endian; any
        alignment): the index's remainders, read a row at a time."""

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            array_type, at_type = signature.args
            offset = context.cast(builder, args[1], at_type, types.intp)
            address = _address(context, builder, array_type, args[0], offset)
            i64 = ir.IntType(64)
            return builder.load(builder.bitcast(address, i64.as_pointer()), align=1)

        return types.uint64(array, at), codegen

    def _trailing_zeros_typer(typingctx: Any, value: Any) -> Any:
        """The trailing zero bits of a uint64 (64 for 0): llvm.cttz, one instruction (bsf or
        tzcnt) on x86-64."""

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            i64 = ir.IntType(64)
            word = context.cast(builder, args[0], signature.args[0], types.uint64)
            function = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(i64, [i64, ir.IntType(1)]), "llvm.cttz.i64"
            )
            return builder.call(function, [word, ir.IntType(1)(0)])

        return types.uint64(value), codegen

    def _prefetch_at_typer(typingctx: Any, address: Any) -> Any:
        """`prefetch` of the byte at an integer address."""

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            i8p = ir.IntType(8).as_pointer()
            i32 = ir.IntType(32)
            function = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                "llvm.prefetch.p0",
            )  # fmt: skip
            builder.call(function, [builder.inttoptr(args[0], i8p), i32(0), i32(3), i32(1)])
            return context.get_dummy_value()

        return types.void(address), codegen

    prefetch: Any = intrinsic(_prefetch_typer)
    prefetch_at: Any = intrinsic(_prefetch_at_typer)
    copy: Any = intrinsic(_copy_typer)
    pointer: Any = intrinsic(_pointer_typer)
    load_word: Any = intrinsic(_load_word_typer)
    load_word_in: Any = intrinsic(_load_word_in_typer)
    trailing_zeros: Any = intrinsic(_trailing_zeros_typer)
    store_word: Any = intrinsic(_store_word_typer)

    _M1 = np.uint64(0xFF51AFD7ED558CCD)
    _M2 = np.uint64(0xC4CEB9FE1A85EC53)
    _S33 = np.uint64(33)

    @jit
    def fmix64(key: Any) -> Any:
        """MurmurHash3's 64-bit finalizer of one key (cube.hashing.fmix64, vectorized)."""
        h = key ^ (key >> _S33)
        h *= _M1
        h ^= h >> _S33
        h *= _M2
        h ^= h >> _S33
        return h
