"""The leaf under the lookup and build kernels: the index's constants, the builder's value
locations, and whether compiled loops run. It imports nothing of cube, so cube.index,
cube.kernel, cube._jit, cube._kernel_jit and cube.build_kernels all take these from here and
import one another without a cycle (tests/test_architecture.py checks it). The index's layout:
cube/index.py; the kernels: cube/kernel.py, cube/build_kernels.py; docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import importlib.util
import os

# The index (cube.index): the row of a key a delta deletes, and the most rows a shard may have (so
# that TOMBSTONE and MISS are free).
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

# The TCP lane's compiled request pass (cube.lane_kernel drives cube._lane_jit). A version's
# layers, newest last, as rows of a uint64 array: the columns below. Addresses are of arrays the
# version keeps mapped for as long as it is served (the pass runs synchronously in the event
# loop's thread, so a version cannot be unmapped during one).
(
    L_STARTS,  # address of the index's bucket starts (uint32, 2**bits + 1)
    L_REMAINDERS,  # address of its remainders (uint8, rows x remainder bytes)
    L_DELETED,  # address of the sorted deleted keys (uint64)
    L_DELETED_COUNT,
    L_BITS,  # the index's bucket bits
    L_ROWS,  # the index's rows
    L_VALUES,  # address of the value bytes
    L_WIDTH,  # the layer's value width, 0: variable (L_OFFSETS)
    L_OFFSETS,  # address of the value offsets (int64, count + 1) when variable
    L_COUNT,  # values in the layer
) = range(10)
LAYER_FIELDS = 10
# The pass's inputs (int64 array `limits`): the server's bounds and the connection's bytes.
(
    P_MAX_FRAME,
    P_MAX_BATCH,
    P_MAX_ANSWER,  # --max_answer_bytes
    P_MAX_VALUE,  # the version's longest value
    P_WIDTH,  # the version's value width (0: variable)
    P_OUTSTANDING,  # the connection's queued + unsent answer bytes
    P_TOTAL,  # the worker's bytes (Bounds.total_bytes)
    P_BUFFERED,  # the connection's unparsed input bytes (its buffer)
    P_BUDGET,  # Bounds' budget_bytes
    P_CONNECTION,  # connection_bytes
    P_SHARD_NUM,  # routing of the version (misses are checked for keys of other shards)
    P_SHARD,
    P_PARTITIONER,  # 0 mod, 1 murmur3
    P_AHEAD,  # keys between a prefetch and its use
) = range(14)
LIMIT_FIELDS = 14
# What the pass reports (int64 array `result`), and why it stopped.
R_POS, R_OUT, R_REASON, R_NEEDED = range(4)
STOP_MORE = 0  # no whole frame left: read on
STOP_BAIL = 1  # the frame at R_POS needs the Python path (an error, a pinned version, ...)
STOP_HELD = 2  # the byte bounds hold the next frame back
STOP_FULL = 3  # the answer buffer needs R_NEEDED bytes more
# Counters it adds to (int64 array `tally`): then the keys-per-request histogram's buckets.
T_REQUESTS, T_KEYS, T_MISSES = range(3)
TALLY_BUCKETS = 3
