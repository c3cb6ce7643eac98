"""The leaf under the lookup and build kernels: the hash table's constants, the builder's value
locations, and whether compiled loops run. It imports nothing of cube, so cube.index,
cube.kernel, cube._jit, cube._kernel_jit and cube.build_kernels all take these from here and
import one another without a cycle (tests/test_architecture.py checks it). The table's layout:
cube/index.py; the kernels: cube/kernel.py, cube/build_kernels.py; docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import importlib.util
import os

# The hash table (cube.index): slots per bucket (64 bytes of keys: one cache line), the row of a
# key a delta deletes, and the most rows a shard may have (so that TOMBSTONE and MISS are free).
WINDOW = 8
TOMBSTONE = 0xFFFFFFFF
MAX_ROWS = TOMBSTONE - 1
MISS = MAX_ROWS  # cube.kernel's row code of a key the table does not hold

# The builder's value locations (cube.builder.spill): source << OFFSET_BITS | offset, so a source
# file may be up to 1 TiB.
OFFSET_BITS = 40

# numba is an optional accelerator: the numpy paths answer the same without it. This decides for
# every compiled loop (lookups in cube.kernel, builds in cube.build_kernels, cube._jit, the
# PaddlePaddle parser in cube.paddle_ps); `CUBE_KERNEL=numpy` turns them off.
HAVE_NUMBA = importlib.util.find_spec("numba") is not None
COMPILED = HAVE_NUMBA and os.environ.get("CUBE_KERNEL", "compiled") != "numpy"
