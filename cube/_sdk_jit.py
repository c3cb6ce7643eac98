"""The SDK's compiled loops (numba), behind cube/client/_compiled.py: a batch routed and
grouped by shard in one pass, a SeekResponse's fields found in one scan, and shard answers
scattered into the caller's arrays. The numpy paths (cube.routing, cube.wire, cube.client._core)
stay the reference: tests/test_client_compiled.py checks the answers are the same bytes, and
every case these loops do not take (an unusual encoding, a message in error) is handed back
to those paths, so their errors are the reference's by construction.
"""

from __future__ import annotations

import numpy as np

# (each runs for a microsecond or so: releasing the GIL around it would cost a thread switch
# to a client's other threads, and another to take it back)
from cube._jit import copy, jit_holding_gil
from cube._lane_jit import _murmur3_32, _read_varint

# scan_answer's fields (int64 array of FIELDS)
(
    F_FOUND_AT,
    F_FOUND_LENGTH,
    F_VALUES_AT,
    F_VALUES_LENGTH,
    F_WIDTH,
    F_OFFSETS_AT,
    F_OFFSETS_LENGTH,
    F_VERSION_AT,
    F_VERSION_LENGTH,
) = range(9)
FIELDS = 9


@jit_holding_gil
def group_keys(keys, shard_num, partitioner, order, grouped, bounds):  # pragma: no cover
    """Route every key (partitioner 0: `key % shard_num`, 1: murmur3, cube.routing.shard_of)
    and group the batch by shard in one stable counting pass: shard s holds request positions
    `order[bounds[s]:bounds[s + 1]]`, whose keys are `grouped[...]` (what
    cube.routing.group_by_owner and a gather make). Returns True (None: not run)."""
    n = keys.shape[0]
    count = np.uint64(shard_num)
    owner = np.empty(n, np.int32)
    for s in range(shard_num + 1):
        bounds[s] = 0
    for i in range(n):
        key = keys[i]
        shard = key % count if partitioner == 0 else _murmur3_32(key) % count
        owner[i] = shard
        bounds[shard + 1] += 1
    for s in range(shard_num):
        bounds[s + 1] += bounds[s]
    at = bounds[:shard_num].copy()
    for i in range(n):
        shard = owner[i]
        j = at[shard]
        order[j] = i
        grouped[j] = keys[i]
        at[shard] = j + 1
    return True


@jit_holding_gil
def scan_answer(data, fields):  # pragma: no cover
    """The fields of the SeekResponse in `data` (uint8) into `fields` (positions and lengths,
    as cube.wire._scan_response reads them); False for anything that path should read
    instead: a malformed message (it raises the error), or a version field repeated (it
    checks each one)."""
    for k in range(FIELDS):
        fields[k] = 0
    pos = 0
    end = data.shape[0]
    while pos < end:
        tag = np.uint64(data[pos])
        if tag < 0x80:
            pos += 1
        else:
            tag, pos = _read_varint(data, pos, end)
            if pos < 0:
                return False
        wire_type = tag & np.uint64(7)
        if wire_type == 0:
            value, pos = _read_varint(data, pos, end)
            if pos < 0 or value >= np.uint64(1 << 62):
                return False
            if tag == 0x18:
                fields[F_WIDTH] = value
            continue
        if wire_type == 1:
            pos += 8
            continue
        if wire_type == 5:
            pos += 4
            continue
        if wire_type != 2:
            return False
        length, pos = _read_varint(data, pos, end)
        if pos < 0 or length > np.uint64(end - pos):
            return False
        if tag == 0x0A:
            fields[F_FOUND_AT] = pos
            fields[F_FOUND_LENGTH] = length
        elif tag == 0x12:
            fields[F_VALUES_AT] = pos
            fields[F_VALUES_LENGTH] = length
        elif tag == 0x22:
            fields[F_OFFSETS_AT] = pos
            fields[F_OFFSETS_LENGTH] = length
        elif tag == 0x2A:
            if fields[F_VERSION_LENGTH]:
                return False
            fields[F_VERSION_AT] = pos
            fields[F_VERSION_LENGTH] = length
        pos += np.int64(length)
    return pos == end


@jit_holding_gil
def scatter_fixed(found, rows, width, where, piece_found, piece_values):  # pragma: no cover
    """A fixed-width piece answer into the batch's arrays: key j of the piece is position
    `where[j]` of the batch; its found flag byte (`found` and `piece_found` viewed as uint8)
    and its `width` value bytes, a miss's included (what the answer holds: zeros from a
    server), as cube.client._core.assemble copies them. Returns True (None: not run)."""
    for j in range(where.shape[0]):
        i = where[j]
        found[i] = piece_found[j]
        copy(rows, i * width, piece_values, j * width, width)
    return True


def warm() -> None:
    """Run every loop once with each signature a client calls it with (keys and received
    bytes read-only or not), so that numba compiles them into the kernel cache or loads them
    from it: `python -m cube.kernel_cache` (with no gRPC to import) and a client's
    background load (cube.client._compiled) both call this."""
    from cube.kernel import read_only

    keys = np.arange(1, 9, dtype=np.uint64)
    order = np.empty(8, np.int64)
    grouped = np.empty(8, np.uint64)
    bounds = np.empty(3, np.int64)
    for batch in (keys, read_only(keys)):  # a caller's keys may be a read-only array
        for partitioner in (0, 1):
            group_keys(batch, 2, partitioner, order, grouped, bounds)
    answer = np.frombuffer(b"\x0a\x01\x01\x12\x01\x07\x18\x01\x2a\x01\x31", np.uint8)
    fields = np.empty(FIELDS, np.int64)
    for data in (answer, answer.copy()):  # received bytes: read-only (bytes) or not (lanes)
        scan_answer(data, fields)
    found, rows, where = np.zeros(8, np.uint8), np.zeros(16, np.uint8), order[:4]
    for piece in (answer, answer.copy()):
        scatter_fixed(found, rows, 2, where, piece[:4], piece[:8])
