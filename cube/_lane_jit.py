"""The TCP lane's request pass, compiled (numba): received bytes in, answer frames out, in one
call per batch of frames. cube/lane_kernel.py prepares its arrays and drives it; the Python
path (cube.server.lane + cube.server.service) stays the reference, and answers every frame this
pass does not (`STOP_BAIL`: errors, pinned versions, empty requests, unusual encodings), so
error answers are that path's by construction. tests/test_lane_kernel.py checks the bytes.

Per frame: the u32 length, the SeekRequest's fields (each at most once, known tags only), the
dict name against the accepted ones, the version against the served one, the key count against
--max_batch and the answer's bound; the keys copied out, hashed once, probed layer by layer
newest first (the base's `_probe_run`, with the index lines prefetched ahead, tombstones in a
pass of their own, as cube._kernel_jit does), the misses checked for keys of another shard; then the
answer frame (u8 status 0 + SeekResponse, the bytes cube.wire writes) into `out`.
"""

from __future__ import annotations

import numpy as np
from numba import carray  # type: ignore[attr-defined]

from cube._jit import copy, fmix64, jit, load_word, pointer, prefetch_at, store_word
from cube._kernel_jit import _probe_run
from cube.kernel_constants import (
    L_BITS,
    L_COUNT,
    L_DELETED,
    L_DELETED_COUNT,
    L_OFFSETS,
    L_REMAINDERS,
    L_ROWS,
    L_STARTS,
    L_VALUES,
    L_WIDTH,
    MAX_ROWS,
    P_AHEAD,
    P_BUDGET,
    P_BUFFERED,
    P_CONNECTION,
    P_MAX_ANSWER,
    P_MAX_BATCH,
    P_MAX_FRAME,
    P_MAX_VALUE,
    P_OUTSTANDING,
    P_PARTITIONER,
    P_SHARD,
    P_SHARD_NUM,
    P_TOTAL,
    P_WIDTH,
    R_NEEDED,
    R_OUT,
    R_POS,
    R_REASON,
    STOP_BAIL,
    STOP_FULL,
    STOP_HELD,
    STOP_MORE,
    T_KEYS,
    T_MISSES,
    T_REQUESTS,
    TALLY_BUCKETS,
    TOMBSTONE,
)

_S32 = np.uint64(32)
_MISS = np.uint32(MAX_ROWS)
_TOMB = np.uint32(TOMBSTONE)
_LOW7 = np.uint64(0x7F)
_SEVEN = np.uint64(7)
_MASK32 = np.uint64(0xFFFFFFFF)
# Keys between an index prefetch and its probe (`_probe_run`; the value gather's distance is
# the pass's P_AHEAD): a constant, since with a runtime distance the probe loop compiled 1.8x
# slower (13.9 against 24.5 µs a 1000-key frame at 1M keys).
_INDEX_AHEAD = 16


@jit
def _read_varint(data, p, end):
    """(value, position after it) of the varint at data[p]; position -1 when it runs past
    `end` or does not fit 64 bits."""
    value = np.uint64(0)
    shift = np.uint64(0)
    for _ in range(10):
        if p >= end:
            return value, -1
        byte = np.uint64(data[p])
        p += 1
        if shift == np.uint64(63) and byte > np.uint64(1):
            return value, -1
        value |= (byte & _LOW7) << shift
        if byte < np.uint64(0x80):
            return value, p
        shift += _SEVEN
    return value, -1


@jit
def _varint_size(value):
    size = 1
    value = np.uint64(value)
    while value >= np.uint64(0x80):
        value >>= _SEVEN
        size += 1
    return size


@jit
def _put_varint(out, at, value):
    value = np.uint64(value)
    while value >= np.uint64(0x80):
        out[at] = np.uint8((value & _LOW7) | np.uint64(0x80))
        value >>= _SEVEN
        at += 1
    out[at] = np.uint8(value)
    return at + 1


@jit
def _put_field(out, at, tag, data, start, length):
    """A length-delimited field (tag, varint length, bytes of data[start:start+length])."""
    out[at] = tag
    at = _put_varint(out, at + 1, length)
    if length:
        copy(out, at, data, start, length)
    return at + length


@jit
def _same(data, start, length, other, other_start):
    for j in range(length):  # noqa: SIM110 - numba compiles no generator
        if data[start + j] != other[other_start + j]:
            return False
    return True


@jit
def _pinned_ok(data, at, length, version):
    """Whether a request's version field (empty: any) names the version served."""
    if length == 0:
        return True
    return length == version.shape[0] and _same(data, at, length, version, 0)


@jit
def _accepted(data, at, length, names, name_ends):
    """Whether data[at:at+length] is one of the accepted dict names (concatenated)."""
    begin = 0
    for k in range(name_ends.shape[0]):
        end = name_ends[k]
        if end - begin == length and _same(data, at, length, names, begin):
            return True
        begin = end
    return False


@jit
def _rotl32(x, r):
    return ((x << np.uint64(r)) | (x >> np.uint64(32 - r))) & _MASK32


@jit
def _murmur3_32(key):
    """MurmurHash3_x86_32 of the key's 8 little-endian bytes, seed 0 (cube.hashing)."""
    h = np.uint64(0)
    for block in (key & _MASK32, key >> _S32):
        k = (block * np.uint64(0xCC9E2D51)) & _MASK32
        k = _rotl32(k, 15)
        k = (k * np.uint64(0x1B873593)) & _MASK32
        h ^= k
        h = _rotl32(h, 13)
        h = (h * np.uint64(5) + np.uint64(0xE6546B64)) & _MASK32
    h ^= np.uint64(8)
    h ^= h >> np.uint64(16)
    h = (h * np.uint64(0x85EBCA6B)) & _MASK32
    h ^= h >> np.uint64(13)
    h = (h * np.uint64(0xC2B2AE35)) & _MASK32
    h ^= h >> np.uint64(16)
    return h


@jit
def _foreign(key, shard_num, shard, partitioner):
    """Whether `key` routes to another shard than `shard` (cube.routing.shard_of)."""
    count = np.uint64(shard_num)
    owner = key % count if partitioner == 0 else _murmur3_32(key) % count
    return owner != np.uint64(shard)


@jit
def _table_of(layers, index):
    """Layer `index`'s index as `_probe_run` takes it: (bucket starts, remainders, bits)."""
    bits = np.int64(layers[index, L_BITS])
    size = np.uint64((64 - bits + 7) // 8)
    buckets = (np.uint64(1) << np.uint64(bits)) + np.uint64(1)
    starts = carray(pointer(layers[index, L_STARTS]), buckets, np.uint32)  # type: ignore[call-overload]  # (numba: a uint64 shape)
    rows = layers[index, L_ROWS]
    remainders = carray(pointer(layers[index, L_REMAINDERS]), rows * size, np.uint8)
    return starts, remainders, bits


@jit
def _probe_layer(layers, index, keys, hashes, pending, count, rows, layer_of):
    """Probe keys[pending[:count]] in layer `index`: found keys (a row, or TOMBSTONE for a key
    the layer deletes) get rows[i] and layer_of[i]; returns how many are left, moved to the
    front of `pending` (for the older layers)."""
    starts, remainders, bits = _table_of(layers, index)
    _probe_run(starts, remainders, bits, hashes, pending, count, rows, _INDEX_AHEAD)
    deleted_count = layers[index, L_DELETED_COUNT]
    deleted = carray(pointer(layers[index, L_DELETED]), deleted_count, np.uint64)
    left = 0
    for j in range(count):  # a pass of its own, as cube._kernel_jit._mark_deleted
        i = pending[j]
        row = rows[i]
        if row == _MISS and deleted_count:
            at = np.searchsorted(deleted, keys[i])
            if at < deleted_count and deleted[at] == keys[i]:
                row = _TOMB
        if row == _MISS:
            pending[left] = i
            left += 1
        else:
            rows[i] = row
            layer_of[i] = index
    return left


@jit
def _value_at(layers, index, row):
    """(address, length) of a layer's value `row`."""
    width = np.int64(layers[index, L_WIDTH])
    base = np.int64(layers[index, L_VALUES])
    if width:
        return base + np.int64(row) * width, width
    offsets = carray(
        pointer(layers[index, L_OFFSETS]), layers[index, L_COUNT] + np.uint64(1), np.int64
    )
    start = offsets[row]
    return base + start, offsets[row + 1] - start


@jit
def _copy_value(out, at, address, length):
    """out[at:at+length] = the bytes at `address`: in 8-byte words, then bytes."""
    words = length >> 3
    for w in range(words):
        store_word(out, at + 8 * w, load_word(np.uint64(address + 8 * w)))
    if length & 7:  # (bytes: a word could reach past the end of the mapping)
        source = carray(pointer(np.uint64(address)), length, np.uint8)
        for b in range(words << 3, length):
            out[at + b] = source[b]


@jit
def _gather(out, at, sources, lengths, width, ahead):
    """The values (fixed `width`: zero bytes for keys not served) from out[at:] on, each
    prefetched `ahead` keys before its copy; returns the end."""
    n = sources.shape[0]
    for i in range(min(ahead, n)):
        if lengths[i] > 0:
            prefetch_at(np.uint64(sources[i]))
            prefetch_at(np.uint64(sources[i] + lengths[i] - 1))
    for i in range(n):
        k = i + ahead
        if k < n and lengths[k] > 0:
            prefetch_at(np.uint64(sources[k]))
            prefetch_at(np.uint64(sources[k] + lengths[k] - 1))
        length = lengths[i]
        if length >= 0:
            _copy_value(out, at, sources[i], length)
            at += length
        elif width:
            out[at : at + width] = 0
            at += width
    return at


@jit
def _held(limits, produced):
    """cube.server.bounds.BoundedProtocol.held with `produced` answer bytes more queued."""
    outstanding = limits[P_OUTSTANDING] + produced
    total = limits[P_TOTAL] + produced
    if outstanding == 0:
        return total - limits[P_BUFFERED] >= limits[P_BUDGET]
    return outstanding >= limits[P_CONNECTION] or total >= limits[P_BUDGET]


@jit
def _parse_request(data, p, end):
    """The fields of the SeekRequest in data[p:end], when it is plainly encoded (each field
    at most once, known tags only): (ok, keys at, keys length, dict name at, its length,
    version at, its length, request id); an absent field's offset is -1."""
    keys_at = name_at = version_at = -1
    keys_length = name_length = version_length = np.int64(0)
    request_id = np.uint64(0)
    seen_id = False
    while p < end:
        tag = data[p]
        p += 1
        if tag == 0x20:
            if seen_id:
                return False, 0, 0, 0, 0, 0, 0, request_id
            request_id, p = _read_varint(data, p, end)
            seen_id = True
            if p < 0:
                return False, 0, 0, 0, 0, 0, 0, request_id
            continue
        size, p = _read_varint(data, p, end)
        if p < 0 or size > np.uint64(end - p):
            return False, 0, 0, 0, 0, 0, 0, request_id
        length = np.int64(size)
        if tag == 0x0A and keys_at < 0:
            keys_at, keys_length = p, length
        elif tag == 0x12 and name_at < 0:
            name_at, name_length = p, length
        elif tag == 0x1A and version_at < 0:
            version_at, version_length = p, length
        else:  # another field, or one seen twice
            return False, 0, 0, 0, 0, 0, 0, request_id
        p += length
    return (
        True, keys_at, keys_length, name_at, name_length, version_at, version_length, request_id
    )  # fmt: skip


@jit
def _probe_base(layers, keys, rows, layer_of):
    """`_probe_layer` for a stack of one layer without deletions (a base, the common case):
    every key probed in order, no list of keys left."""
    n = keys.shape[0]
    starts, remainders, bits = _table_of(layers, 0)
    hashes = np.empty(n, dtype=np.uint64)
    for i in range(n):
        hashes[i] = fmix64(keys[i])
    _probe_run(starts, remainders, bits, hashes, None, n, rows, _INDEX_AHEAD)
    for i in range(n):
        layer_of[i] = 0 if rows[i] != _MISS else -1


@jit
def _lookup(layers, data, keys_at, n):
    """(keys, rows, layer of each key: -1 not found) of the n keys at data[keys_at:], every
    layer probed newest first."""
    keys = np.empty(n, dtype=np.uint64)
    copy(keys, 0, data, keys_at, n * 8)
    rows = np.empty(n, dtype=np.uint32)
    layer_of = np.empty(n, dtype=np.int64)
    if layers.shape[0] == 1 and layers[0, L_DELETED_COUNT] == 0:  # a base alone: one pass
        _probe_base(layers, keys, rows, layer_of)
        return keys, rows, layer_of
    layer_of[:] = -1
    hashes = np.empty(n, dtype=np.uint64)
    pending = np.empty(n, dtype=np.int64)
    for i in range(n):
        hashes[i] = fmix64(keys[i])
        pending[i] = i
    left = n
    for index in range(layers.shape[0] - 1, -1, -1):
        left = _probe_layer(layers, index, keys, hashes, pending, left, rows, layer_of)
        if left == 0:
            break
    return keys, rows, layer_of


@jit
def _locate(layers, keys, rows, layer_of, limits):
    """Where each served value is: (addresses, lengths with -1 for a key not served, misses,
    value bytes, whether a missed key routes to another shard)."""
    n = keys.shape[0]
    shard_num = limits[P_SHARD_NUM]
    sources = np.empty(n, dtype=np.int64)
    lengths = np.empty(n, dtype=np.int64)
    misses = 0
    total = 0
    foreign = False
    for i in range(n):
        layer = layer_of[i]
        if layer < 0 or rows[i] == _TOMB:  # missing, or deleted by a layer: not served
            lengths[i] = -1
            misses += 1
            if shard_num > 1 and not foreign:
                foreign = _foreign(keys[i], shard_num, limits[P_SHARD], limits[P_PARTITIONER])
        else:
            sources[i], lengths[i] = _value_at(layers, layer, rows[i])
            total += lengths[i]
    return sources, lengths, misses, total, foreign


@jit
def _answer_size(n, width, total, version, request_id):
    """The SeekResponse's bytes (cube.wire.seek_response_parts' layout)."""
    offsets = 8 * (n + 1)
    size = 1 + _varint_size(width) if width else 1 + _varint_size(offsets) + offsets
    if version.shape[0]:
        size += 1 + _varint_size(version.shape[0]) + version.shape[0]
    if request_id:
        size += 1 + _varint_size(request_id)
    size += 1 + _varint_size(n) + n
    if total:
        size += 1 + _varint_size(total) + total
    return size


@jit
def _answer_head(out, at, body, n):
    """An answer frame's start at out[at:]: u32 length `body`, status 0, and the found
    flags' tag and length (n); returns where the flags go."""
    for b in range(4):
        out[at + b] = np.uint8((body >> (8 * b)) & 0xFF)
    out[at + 4] = 0
    out[at + 5] = 0x0A
    return _put_varint(out, at + 6, n)


@jit
def _answer_tail(out, at, version, request_id):
    """An answer's last fields, the version and the request id (each when set); returns
    the end."""
    if version.shape[0]:
        at = _put_field(out, at, 0x2A, version, 0, version.shape[0])
    if request_id:
        out[at] = 0x30
        at = _put_varint(out, at + 1, request_id)
    return at


@jit
def _write_answer(out, at, body, sources, lengths, width, total, version, request_id, ahead):
    """The answer frame (u32 length, status 0, the SeekResponse of `body` bytes) at out[at:];
    returns its end."""
    n = lengths.shape[0]
    at = _answer_head(out, at, body, n)
    for i in range(n):
        out[at + i] = np.uint8(lengths[i] >= 0)
    at += n
    if total:
        out[at] = 0x12
        at = _put_varint(out, at + 1, total)
        at = _gather(out, at, sources, lengths, width, ahead)
    if width:
        out[at] = 0x18
        at = _put_varint(out, at + 1, width)
    else:  # the offsets of the served values, from 0 (uint64 little-endian)
        out[at] = 0x22
        at = _put_varint(out, at + 1, 8 * (n + 1))
        offset = 0
        store_word(out, at, offset)
        for i in range(n):
            if lengths[i] > 0:
                offset += lengths[i]
            store_word(out, at + 8 * (i + 1), offset)
        at += 8 * (n + 1)
    at = _answer_tail(out, at, version, request_id)
    return at


@jit
def _write_fixed(out, at, body, layers, keys, rows, layer_of, width, version, request_id, limits):
    """`_write_answer` for fixed-width values, without `_locate`'s address arrays: each
    value's address is its layer's base + row x width, computed where it is prefetched and
    copied. Returns (end, misses, whether a missed key routes to another shard); on the
    latter the caller bails (what was written past its `at` is not sent)."""
    n = keys.shape[0]
    ahead = limits[P_AHEAD]
    shard_num = limits[P_SHARD_NUM]
    bases = np.empty(layers.shape[0], dtype=np.int64)
    for index in range(layers.shape[0]):
        bases[index] = np.int64(layers[index, L_VALUES])
    at = _answer_head(out, at, body, n)
    misses = 0
    foreign = False
    for i in range(n):
        served = layer_of[i] >= 0 and rows[i] != _TOMB
        out[at + i] = np.uint8(served)
        if not served:
            layer_of[i] = -1
            misses += 1
            if shard_num > 1 and not foreign:
                foreign = _foreign(keys[i], shard_num, limits[P_SHARD], limits[P_PARTITIONER])
    if foreign:
        return at, misses, foreign
    at += n
    out[at] = 0x12
    at = _put_varint(out, at + 1, n * width)
    for i in range(min(ahead, n)):
        if layer_of[i] >= 0:
            address = bases[layer_of[i]] + np.int64(rows[i]) * width
            prefetch_at(np.uint64(address))
            prefetch_at(np.uint64(address + width - 1))
    for i in range(n):
        k = i + ahead
        if k < n and layer_of[k] >= 0:
            address = bases[layer_of[k]] + np.int64(rows[k]) * width
            prefetch_at(np.uint64(address))
            prefetch_at(np.uint64(address + width - 1))
        if layer_of[i] >= 0:
            _copy_value(out, at, bases[layer_of[i]] + np.int64(rows[i]) * width, width)
        else:
            out[at : at + width] = 0
        at += width
    out[at] = 0x18
    at = _put_varint(out, at + 1, width)
    at = _answer_tail(out, at, version, request_id)
    return at, misses, foreign


@jit
def _frame_length(data, pos):
    return (
        np.int64(data[pos])
        | np.int64(data[pos + 1]) << 8
        | np.int64(data[pos + 2]) << 16
        | np.int64(data[pos + 3]) << 24
    )


@jit
def lane_pass(
    data, start, end, out, out_at, layers, names, name_ends, version, limits, batch_bounds,
    tally, result,
):  # fmt: skip
    """Answer the whole frames of data[start:end] into out[out_at:], until one needs the
    Python path, the byte bounds hold the next back, `out` is full or none is left;
    result[R_POS / R_OUT / R_REASON / R_NEEDED] say where and why it stopped (returns the
    reason too); `tally` counts the requests, keys, misses and the keys-per-request buckets of
    `batch_bounds`."""
    pos = start
    produced = 0
    reason = STOP_MORE
    needed = 0
    width = limits[P_WIDTH]
    while end - pos >= 4:
        length = _frame_length(data, pos)
        if length > limits[P_MAX_FRAME]:
            reason = STOP_BAIL  # FrameTooLarge: the Python path refuses it
            break
        frame_end = pos + 4 + length
        if frame_end > end:
            break
        if _held(limits, produced):
            reason = STOP_HELD
            break
        ok, keys_at, keys_length, name_at, name_length, version_at, version_length, request_id = (
            _parse_request(data, pos + 4, frame_end)
        )
        n = keys_length // 8
        if (
            not ok
            or keys_length % 8
            or n == 0
            or n > limits[P_MAX_BATCH]
            or n * limits[P_MAX_VALUE] > limits[P_MAX_ANSWER]
            or not _accepted(data, name_at, name_length, names, name_ends)
            or not _pinned_ok(data, version_at, version_length, version)
        ):
            reason = STOP_BAIL
            break
        keys, rows, layer_of = _lookup(layers, data, keys_at, n)
        if width:  # (every layer has this width: cube.kernel.lane_target)
            body = _answer_size(n, width, n * width, version, request_id)
            if out_at + 5 + body > out.shape[0]:
                reason = STOP_FULL
                needed = 5 + body
                break
            at, misses, foreign = _write_fixed(
                out, out_at, body, layers, keys, rows, layer_of, width, version, request_id,
                limits,
            )  # fmt: skip
        else:
            sources, lengths, misses, total, foreign = _locate(layers, keys, rows, layer_of, limits)
            body = _answer_size(n, width, total, version, request_id)
            if not foreign and out_at + 5 + body > out.shape[0]:
                reason = STOP_FULL
                needed = 5 + body
                break
            if not foreign:
                at = _write_answer(
                    out, out_at, body, sources, lengths, width, total, version, request_id,
                    limits[P_AHEAD],
                )  # fmt: skip
        if foreign:  # a key of another shard: the Python path refuses the request
            reason = STOP_BAIL
            break
        produced += at - out_at
        out_at = at
        pos = frame_end
        tally[T_REQUESTS] += 1
        tally[T_KEYS] += n
        tally[T_MISSES] += misses
        tally[TALLY_BUCKETS + np.searchsorted(batch_bounds, n)] += 1
    result[R_POS] = pos
    result[R_OUT] = out_at
    result[R_REASON] = reason
    result[R_NEEDED] = needed
    return reason
