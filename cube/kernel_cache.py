"""`python -m cube.kernel_cache`: compile the lookup kernel into its cache ahead of any server
(`cube._jit.kernel_cache_dir`), as the wheel build (setup.py), `make install` and the image
do, so that no server compiles it at its first start; and the SDK's codec (cube/_sdk_jit.py),
which clients load where numba is installed; prints where, and what it compiled.

    python -m cube.kernel_cache [--require]   (--require: exit 1 when nothing can compile:
                                               no numba, or CUBE_KERNEL=numpy)
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
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


if __name__ == "__main__":
    sys.exit(main())
