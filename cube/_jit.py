"""What the numba-compiled loops share (cube._kernel_jit for lookups, cube.build_kernels for
builds): whether to compile, the decorator, the CPU prefetch and memcpy intrinsics, fmix64.

Imported only by those modules, which are imported only when compiled loops are wanted, so a
process that never needs them does not pay numba's ~0.4 s import. Without numba, or with
`CUBE_KERNEL=numpy`, nothing imports this module and the numpy paths do the work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from cube.kernel import COMPILED

if COMPILED:
    import numba
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    def jit(function: Callable[..., Any]) -> Any:
        """Compile lazily; cache the machine code on disk when a cache directory is writable
        (`__pycache__` beside the module, else NUMBA_CACHE_DIR or the user's cache), else
        compile in every process (a read-only install without a cache directory)."""
        options: dict[str, Any] = {"nogil": True, "boundscheck": False, "error_model": "numpy"}
        try:
            return numba.njit(cache=True, **options)(function)
        except RuntimeError:  # "cannot cache function ...: no locator available"
            return numba.njit(**options)(function)

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

    prefetch: Any = intrinsic(_prefetch_typer)
    copy: Any = intrinsic(_copy_typer)

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
