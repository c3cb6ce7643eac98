"""cube.v1 wire bytes (proto/cube_fast.proto), written and read without protobuf objects.

Pure: no I/O. The SDK and cube-server share these functions, so both ends of the fast API
agree by construction (tests check the bytes against the generated protobuf classes):

- `encode_seek_request`: the SDK's SeekRequest, keys as one packed field.
- `seek_response_parts`: the server's SeekResponse as buffers to write in order, the found
  flags and values as views of numpy arrays (no copy; the TCP lane writes them with writev).
- `decode_seek_response`: the SDK's reading of a SeekResponse, values left in the received
  buffer (`np.frombuffer`).
- `varint`, `length_delimited`, `read_varint`, `scan_fields`: protobuf's encoding basics, also
  used by the server's encoder of the original rec.mcube.DictResponse.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from typing import NamedTuple, TypeAlias

import numpy as np

from cube.values import ValueColumn

Buffer: TypeAlias = bytes | memoryview
_OFFSET_DTYPE = np.dtype("<u8")
_EMPTY_U8 = np.empty(0, dtype=np.uint8)


class BadMessage(ValueError):
    """Bytes that do not form the expected message (truncated, wrong counts, bad offsets)."""


@dataclass(frozen=True, eq=False)
class Answer:
    """What a lookup answered for n keys: found flags, values (fixed width zero-filled, or
    variable), and the version that answered."""

    found: np.ndarray  # bool, (n,)
    column: ValueColumn
    version: str


# ---------------------------------------------------------------------------------------------
# protobuf encoding basics


@functools.lru_cache(maxsize=4096)  # messages repeat the same few lengths
def varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def length_delimited(tag: int, data: Buffer) -> list[Buffer]:
    """A bytes/string field as buffers (proto3: nothing when empty). `tag` is one byte."""
    return [bytes((tag,)), varint(len(data)), data] if len(data) else []


def read_varint(data: Buffer, pos: int, end: int | None = None) -> tuple[int, int]:
    """(value, position after it); `end` (default: the end of `data`) bounds the read."""
    end = len(data) if end is None else end
    result = shift = 0
    while pos < end and shift <= 63:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
    raise BadMessage("truncated varint")


def scan_fields(data: Buffer) -> tuple[dict[int, tuple[int, int]], dict[int, int]]:
    """(length-delimited fields as (offset, length), varint fields) of a message; the last
    occurrence of a field wins, as in protobuf."""
    spans: dict[int, tuple[int, int]] = {}
    ints: dict[int, int] = {}
    pos, end = 0, len(data)
    while pos < end:
        tag = data[pos]
        if tag < 0x80:  # every field number of ours fits one tag byte
            pos += 1
        else:
            tag, pos = read_varint(data, pos, end)
        number, wire_type = tag >> 3, tag & 7
        if wire_type == 2:
            length, pos = read_varint(data, pos, end)
            if pos + length > end:
                raise BadMessage(f"field {number} runs past the end of the message")
            spans[number] = (pos, length)
            pos += length
        elif wire_type == 0:
            ints[number], pos = read_varint(data, pos, end)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        else:
            raise BadMessage(f"unsupported wire type {wire_type} for field {number}")
    if pos != end:
        raise BadMessage("truncated message")
    return spans, ints


# ---------------------------------------------------------------------------------------------
# cube.v1.SeekRequest / SeekResponse


def encode_seek_request(
    keys: np.ndarray, dict_name: str = "", version: str = "", request_id: int = 0
) -> bytes:
    """`cube.v1.SeekRequest` bytes: keys as one packed little-endian uint64 field."""
    packed = np.ascontiguousarray(keys, dtype="<u8").tobytes()
    parts: list[Buffer] = [b"\x0a", varint(len(packed)), packed]
    parts += length_delimited(0x12, dict_name.encode())
    parts += length_delimited(0x1A, version.encode())
    if request_id:
        parts += [b"\x20", varint(request_id)]
    return b"".join(parts)


def seek_response_parts(
    found: np.ndarray,
    values: np.ndarray,
    width: int,
    offsets: np.ndarray | None,
    version: str,
    request_id: int,
) -> list[Buffer]:
    """`cube.v1.SeekResponse` as buffers to write in order (proto3: default fields omitted).

    `found`: bool per key. `values`: uint8, n * width bytes when `width` > 0 (zero rows for
    misses), else the found values back to back with `offsets` (n + 1)."""
    flags = found.view(np.uint8)
    parts: list[Buffer] = []
    if flags.shape[0]:
        parts += [b"\x0a", varint(flags.shape[0]), flags.data]
    blob = np.ascontiguousarray(values).reshape(-1)
    if blob.shape[0]:
        parts += [b"\x12", varint(blob.shape[0]), blob.data]
    if width:
        parts += [b"\x18", varint(width)]
    else:
        assert offsets is not None
        parts += length_delimited(0x22, offsets.astype(_OFFSET_DTYPE, copy=False).tobytes())
    parts += length_delimited(0x2A, version.encode())
    if request_id:
        parts += [b"\x30", varint(request_id)]
    return parts


def decode_seek_response(data: Buffer, n: int) -> Answer:
    """The answer in `cube.v1.SeekResponse` bytes for `n` keys; its arrays are views of `data`
    (bytes, or a memoryview of a received buffer)."""
    spans, ints = scan_fields(data)
    offset, length = spans.get(1, (0, 0))
    if length != n:
        raise BadMessage(f"{length} found flags for {n} keys")
    # Viewed, not compared: a ufunc over 1000+ elements releases the GIL, and taking it back
    # costs a thread switch when other threads share the client (any nonzero byte is True).
    found = np.frombuffer(data, np.bool_, n, offset)
    width = ints.get(3, 0)
    v_offset, v_length = spans.get(2, (0, 0))
    if width:
        if v_length != n * width:
            raise BadMessage(f"{v_length} value bytes for {n} keys of width {width}")
        column = ValueColumn.fixed(np.frombuffer(data, np.uint8, v_length, v_offset), width)
    else:
        o_offset, o_length = spans.get(4, (0, 0))
        if o_length != 8 * (n + 1):
            raise BadMessage(f"{o_length // 8} offsets for {n} keys (want {n + 1})")
        offsets = np.frombuffer(data, _OFFSET_DTYPE, n + 1, o_offset).astype(np.int64)
        if n and (offsets[0] < 0 or offsets[-1] > v_length or (np.diff(offsets) < 0).any()):
            raise BadMessage(f"value offsets out of order or beyond {v_length} value bytes")
        blob = np.frombuffer(data, np.uint8, v_length, v_offset) if v_length else _EMPTY_U8
        column = ValueColumn.variable(blob, offsets)
    v_offset, v_length = spans.get(5, (0, 0))
    try:
        version = bytes(data[v_offset : v_offset + v_length]).decode()
    except UnicodeDecodeError as exc:
        raise BadMessage(f"version is not UTF-8: {exc}") from None
    return Answer(found, column, version)


# ---------------------------------------------------------------------------------------------
# TCP lane frames (cube.server.lane serves them, cube.client._transport speaks them)
#
# The client opens a connection with LANE_MAGIC. A request frame is a u32 length then the
# SeekRequest bytes; an answer frame is a u32 length, a u8 status (0: a SeekResponse follows;
# else a gRPC status code number and a UTF-8 message), then the bytes. All little-endian.

LANE_MAGIC = b"CUBETCP1"
REQUEST_HEADER = struct.Struct("<I")
ANSWER_HEADER = struct.Struct("<IB")


class FrameTooLarge(BadMessage):
    """A frame longer than the reader accepts (`max_frame`)."""

    def __init__(self, length: int) -> None:
        super().__init__(f"a frame of {length} bytes")
        self.length = length


class Frame(NamedTuple):
    """A complete frame in a buffer: its body is `buffer[start:stop]`; `status` for answers."""

    start: int
    stop: int
    status: int = 0


def next_frame(
    data: Buffer | bytearray, pos: int, end: int, answers: bool, max_frame: int = 0
) -> Frame | None:
    """The complete frame at `data[pos:end]`, or None when it has not all arrived (the caller
    keeps the bytes and reads on). Requests, or answers with `answers`; FrameTooLarge past
    `max_frame` (0: no bound), found from the header alone."""
    header = ANSWER_HEADER if answers else REQUEST_HEADER
    if end - pos < header.size:
        return None
    fields = header.unpack_from(data, pos)
    length = fields[0]
    if max_frame and length > max_frame:
        raise FrameTooLarge(length)
    start = pos + header.size
    if end - start < length:
        return None
    return Frame(start, start + length, fields[1] if answers else 0)


def request_header(length: int) -> bytes:
    return REQUEST_HEADER.pack(length)


def answer_header(length: int, status: int = 0) -> bytes:
    return ANSWER_HEADER.pack(length, status)


def error_frame(status: int, message: str) -> bytes:
    """An answer frame refusing a request: the gRPC status number and the message."""
    body = message.encode("utf-8", "replace")
    return ANSWER_HEADER.pack(len(body), status) + body
