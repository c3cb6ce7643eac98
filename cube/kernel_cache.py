"""`python -m cube.kernel_cache`: compile the lookup kernel into its cache ahead of any server
(`cube._jit.kernel_cache_dir`), as the wheel build (setup.py), `make install` and the image
do, so that no server compiles it at its first start; and the SDK's codec (cube/_sdk_jit.py),
which clients load where numba is installed; prints where, and what it compiled.

    python -m cube.kernel_cache [--require]   (--require: exit 1 when nothing can compile:
                                               no numba, or CUBE_KERNEL=numpy)
    python -m cube.kernel_cache --check       (exit 1 unless the installed package's shipped
                                               kernel loads with nothing left to compile)

`--check` is how an image build and the packaging tests prove a wheel ships its kernel: it
loads the shipped files from a scratch copy, so that nothing compiled now lands in them.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import cube

SHIPPED = Path(cube.__file__).resolve().parent / "_numba_cache"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--check" in args:
        with tempfile.TemporaryDirectory(prefix="cube-kernel-check-") as scratch:
            for shipped in SHIPPED.glob("*.nb[ic]"):
                shutil.copy2(shipped, scratch)
            os.environ["CUBE_KERNEL_CACHE"] = scratch  # read before cube._jit is imported
            return check()
    require = "--require" in args
    from cube import kernel

    if not kernel.COMPILED:
        print(f"lookup kernel: {kernel.describe()}: nothing to compile")
        return 1 if require else 0
    seconds = kernel.warm()
    from cube._jit import kernel_cache_dir

    print(f"lookup kernel: {kernel.describe()} in {seconds:.1f} s; cache: {kernel_cache_dir()}")
    from cube import _sdk_jit  # not through cube.client: a wheel build has no grpc

    started = time.perf_counter()
    _sdk_jit.warm()
    loops = (_sdk_jit.group_keys, _sdk_jit.scan_answer, _sdk_jit.scatter_fixed)
    compiled = sum(len(d.stats.cache_misses) for d in loops)
    source = f"{compiled} signatures compiled now" if compiled else "loaded from its cache"
    print(f"SDK codec: compiled ({source}) in {time.perf_counter() - started:.1f} s")
    return 0


def check() -> int:
    """Load the kernel and the SDK codec from the cache; 1 if anything had to compile."""
    from cube import _sdk_jit, kernel

    if not kernel.COMPILED:
        print(f"lookup kernel: {kernel.describe()}: no compiled kernel to check")
        return 1
    started = time.perf_counter()
    kernel.warm()
    _sdk_jit.warm()
    loops = (_sdk_jit.group_keys, _sdk_jit.scan_answer, _sdk_jit.scatter_fixed)
    compiled = kernel.compiled_now() + sum(len(d.stats.cache_misses) for d in loops)
    seconds = time.perf_counter() - started
    if compiled:
        print(
            f"the shipped kernel in {SHIPPED} is missing {compiled} signatures (compiled now):"
            " this install would compile them at every server's first start"
        )
        return 1
    print(f"the shipped kernel in {SHIPPED} loads with nothing to compile ({seconds:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
