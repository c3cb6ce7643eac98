"""A lookup's answer and its wire bytes, written from numpy buffers without a protobuf object
per key: cube.v1 SeekResponse (`seek_response_parts`: the found flags and values as views, for
gRPC and the TCP lane) and the original's rec.mcube DictResponse (`encode_dict_response`: one
DictValue per key laid out by a few vectorized passes). tests/test_server_units.py checks the
bytes parse back with the generated classes.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from cube import wire
from cube.wire import Buffer, length_delimited, varint

MISS_STATUS = 0xFFFFFFFF  # a DictValue's status for a key not found


@dataclass(slots=True)
class Answer:
    found: np.ndarray  # bool, one per key
    values: np.ndarray  # uint8: (n, width) zero-filled when width > 0, else found values
    width: int
    offsets: np.ndarray | None  # int64 (n + 1,) when width == 0
    frame: memoryview | None = None  # the whole lane answer, when found/values are views of it


def empty_answer(n: int) -> Answer:
    return Answer(
        np.zeros(n, dtype=bool), np.empty(0, np.uint8), 0, np.zeros(n + 1, dtype=np.int64)
    )


def seek_response_parts(answer: Answer, version: str, request_id: int) -> list[Buffer]:
    """cube.v1.SeekResponse wire bytes as buffers to write in order; the found flags and
    values are views of the answer's arrays, not copies."""
    return wire.seek_response_parts(
        answer.found, answer.values, answer.width, answer.offsets, version, request_id
    )


def encode_seek_response(answer: Answer, version: str, request_id: int) -> bytes:
    """cube.v1.SeekResponse wire bytes."""
    return b"".join(seek_response_parts(answer, version, request_id))


def split_answer(answer: Answer, bounds: list[int]) -> list[Answer]:
    """The answers of consecutive key ranges [bounds[i], bounds[i+1]) of one answer (views)."""
    pieces = []
    for start, stop in itertools.pairwise(bounds):
        found = answer.found[start:stop]
        if answer.width:
            pieces.append(Answer(found, answer.values[start:stop], answer.width, None))
            continue
        offsets = answer.offsets
        assert offsets is not None  # a variable-width answer has them
        first, last = int(offsets[start]), int(offsets[stop])
        local = offsets[start : stop + 1] - first
        pieces.append(Answer(found, answer.values[first:last], 0, local))
    return pieces


def _varint_sizes(values: np.ndarray) -> np.ndarray:
    """Bytes of each value's varint (values < 2**35)."""
    sizes = np.ones(values.shape[0], dtype=np.int64)
    if values.shape[0] and int(values.max()) < 128:  # the common case: one byte each
        return sizes
    for bits in (7, 14, 21, 28):
        sizes += values >= (1 << bits)
    return sizes


def _varint_columns(
    out: np.ndarray, used: np.ndarray, values: np.ndarray, sizes: np.ndarray
) -> None:
    """Write each value's varint into its row of `out` (n, 5), marking the bytes `used`."""
    longest = int(sizes.max()) if sizes.shape[0] else 0
    for k in range(longest):
        more = sizes > k + 1
        out[:, k] = ((values >> (7 * k)) & 0x7F) | np.where(more, 0x80, 0)
        used[:, k] = sizes > k


_FOUND_STATUS = b"\x08\x00"
_MISS_STATUS = b"\x08" + varint(MISS_STATUS)
_MISS_ENTRY = b"\x0a" + varint(len(_MISS_STATUS) + 2) + _MISS_STATUS + b"\x12\x00"
_MISS_ENTRY_ROW = np.frombuffer(_MISS_ENTRY, dtype=np.uint8)


def encode_dict_response(answer: Answer, version: str | None) -> bytes:
    """rec.mcube.DictResponse wire bytes: one DictValue {status, value} per key, in order
    (found: status 0 and the value; miss: status 0xFFFFFFFF and an empty value)."""
    n = answer.found.shape[0]
    found = answer.found
    tail = length_delimited(0x12, version.encode()) if version else []
    if version == "":
        tail = [b"\x12\x00"]
    if n == 0:
        return b"".join(tail)
    width = answer.width
    if width:
        # Every found entry has the same bytes around its value: one (n, entry) matrix; a
        # miss is a shorter constant entry written over its row's start, the rest masked out.
        inner = len(_FOUND_STATUS) + 1 + len(varint(width)) + width
        head = b"\x0a" + varint(inner) + _FOUND_STATUS + b"\x12" + varint(width)
        rows = np.empty((n, len(head) + width), dtype=np.uint8)
        rows[:, : len(head)] = np.frombuffer(head, dtype=np.uint8)
        rows[:, len(head) :] = answer.values
        if found.all():
            return b"".join([rows.tobytes(), *tail])
        if rows.shape[1] >= len(_MISS_ENTRY):
            missing = ~found
            rows[missing, : len(_MISS_ENTRY)] = _MISS_ENTRY_ROW
            keep = np.ones(rows.shape, dtype=bool)
            keep[missing, len(_MISS_ENTRY) :] = False
            return b"".join([rows[keep].tobytes(), *tail])
    if width:
        lengths = np.where(found, width, 0).astype(np.int64)
        value_bytes = answer.values[found].reshape(-1)
    else:
        offsets = answer.offsets
        assert offsets is not None  # a variable-width answer has them
        lengths = np.diff(offsets)
        value_bytes = answer.values[offsets[0] : offsets[-1]]
    value_starts = np.cumsum(lengths) - lengths  # of each value among the value bytes
    # Each head is [0x0a][varint inner][status: 2 or 6 bytes][0x12][varint length], laid out
    # in fixed column groups of an (n, 18) matrix; a mask drops each row's unused columns.
    status_size = np.where(found, len(_FOUND_STATUS), len(_MISS_STATUS))
    length_size = _varint_sizes(lengths)
    inner = status_size + 1 + length_size + lengths
    inner_size = _varint_sizes(inner)
    heads = np.zeros((n, 18), dtype=np.uint8)
    used = np.zeros((n, 18), dtype=bool)
    heads[:, 0] = 0x0A
    used[:, 0] = True
    _varint_columns(heads[:, 1:6], used[:, 1:6], inner, inner_size)
    heads[:, 6] = 0x08
    heads[~found, 7:11] = 0xFF
    heads[~found, 11] = 0x0F
    used[:, 6:12] = np.arange(6) < status_size[:, None]
    heads[:, 12] = 0x12
    used[:, 12] = True
    _varint_columns(heads[:, 13:18], used[:, 13:18], lengths, length_size)
    head_size = 2 + inner_size + status_size + length_size
    head_bytes = heads[used]
    # The values are already in answer order: put the heads between them. Head byte j of
    # entry i goes to (head bytes before it) + (value bytes before entry i); the value bytes
    # fill the other positions, in order, in one masked copy.
    head_dest = np.repeat(value_starts, head_size)
    head_dest += np.arange(head_bytes.shape[0], dtype=np.int64)
    total = head_bytes.shape[0] + value_bytes.shape[0]
    out = np.empty(total, dtype=np.uint8)
    out[head_dest] = head_bytes
    is_value = np.ones(total, dtype=bool)
    is_value[head_dest] = False
    out[is_value] = value_bytes
    return b"".join([out.tobytes(), *tail])
