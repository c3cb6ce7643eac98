"""cube.v1 wire bytes (proto/cube_fast.proto), written and read without protobuf objects.

Pure: no I/O. The SDK and cube-server share these functions, so both ends of the fast API
agree by construction (tests check the bytes against the generated protobuf classes):

- `encode_seek_request`: the SDK's SeekRequest, keys as one packed field.
- `seek_response_parts`: the server's SeekResponse as buffers to write in order, the found
  flags and values as views of numpy arrays (no copy; the TCP lane writes them with writev).
- `decode_seek_response`: the SDK's reading of a SeekResponse, values left in the received
  buffer (`np.frombuffer`).
- `fixed_answer_frame`: a whole TCP-lane answer of fixed-width values in one buffer, left for
  the server's kernel to fill (the same bytes as `answer_header` + `seek_response_parts`).
- `varint`, `length_delimited`, `read_varint`: protobuf's encoding basics, also used by the
  server's encoder of the original rec.mcube.DictResponse.
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


@dataclass(eq=False, slots=True)  # (not frozen: that costs per answer; do not change one)
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


# ---------------------------------------------------------------------------------------------
# cube.v1.SeekRequest / SeekResponse


def encode_seek_request(
    keys: np.ndarray,
    dict_name: str = "",
    version: str | None = "",
    request_id: int = 0,
    table: str = "",
) -> bytes:
    """`cube.v1.SeekRequest` bytes: keys as one packed little-endian uint64 field (`version`
    None or "": any version; `table` "": the version's one unnamed table)."""
    packed = np.ascontiguousarray(keys, dtype=_KEY_DTYPE).data
    tail = _request_tail(dict_name, version, table)
    if request_id:
        return b"".join(
            (b"\x0a", varint(packed.nbytes), packed, tail, b"\x20", _varint(request_id))
        )
    return b"".join((b"\x0a", varint(packed.nbytes), packed, tail))


@functools.lru_cache(maxsize=256)  # a client sends the same dict name, tables, few versions
def _request_tail(dict_name: str, version: str | None, table: str = "") -> bytes:
    """A SeekRequest's dict_name, version and table fields."""
    return b"".join(
        length_delimited(0x12, dict_name.encode())
        + length_delimited(0x1A, (version or "").encode())
        + length_delimited(0x3A, table.encode())
    )


def _varint(value: int) -> bytes:
    """`varint` for values that change with every call (request ids, which a client counts
    up): the bytes of `value >> 7` are kept from the last call, so most calls only add the
    low seven bits."""
    global _HIGH
    if value < 0x80:
        return bytes((value,))
    high = value >> 7
    kept = _HIGH
    if kept[0] != high:
        kept = _HIGH = (high, varint(high) if high < 0x4000 else _varint_uncached(high))
    return _LOW_BYTES[value & 0x7F] + kept[1]


_varint_uncached = varint.__wrapped__  # for values that rarely repeat (request ids)


_KEY_DTYPE = np.dtype("<u8")
_HIGH: tuple[int, bytes] = (-1, b"")  # (value >> 7, its varint) of the last `_varint`
_LOW_BYTES = tuple(bytes((low | 0x80,)) for low in range(0x80))  # a varint's first byte


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
        parts.append(_fixed_tail(width, version))
    else:
        assert offsets is not None
        parts += length_delimited(0x22, offsets.astype(_OFFSET_DTYPE, copy=False).tobytes())
        parts += length_delimited(0x2A, version.encode())
    if request_id:
        parts += [b"\x30", _varint(request_id)]
    return parts


@functools.lru_cache(maxsize=256)  # a server answers from few versions
def _fixed_tail(width: int, version: str) -> bytes:
    """A fixed-width SeekResponse's fields after the values: the width and the version."""
    return b"".join([b"\x18", varint(width), *length_delimited(0x2A, version.encode())])


def fixed_answer_frame(
    n: int, width: int, version: str, request_id: int, word: np.dtype
) -> tuple[memoryview, np.ndarray, np.ndarray]:
    """A TCP-lane answer frame of n fixed-width values (`answer_header` + the bytes of
    `seek_response_parts`) in one buffer, with the found flags and values left to be written:
    (frame, found view (n,) bool, values view (n, width / word size) of `word`). The answer
    then leaves in one write with no copy of the values; the frame starts where the values
    land 8-byte aligned, so a kernel can copy whole words. n > 0 and width > 0."""
    found_head, values_head = b"\x0a" + varint(n), b"\x12" + varint(n * width)
    tail = _fixed_tail(width, version)
    if request_id:
        tail += b"\x30" + _varint(request_id)
    found_at = ANSWER_HEADER.size + len(found_head)
    values_at = found_at + n + len(values_head)
    size = values_at + n * width + len(tail)
    shift = -values_at % 8
    frame = np.empty(size + shift, dtype=np.uint8)[shift:]  # no zero fill: all is written
    view = frame.data
    view[: ANSWER_HEADER.size] = ANSWER_HEADER.pack(size - ANSWER_HEADER.size, 0)
    view[ANSWER_HEADER.size : found_at] = found_head
    view[found_at + n : values_at] = values_head
    view[size - len(tail) :] = tail
    found = frame[found_at : found_at + n].view(bool)
    values = frame[values_at : values_at + n * width].view(word).reshape(n, -1)
    return view, found, values


def _utf8(data: Buffer, at: int, length: int) -> str:
    """A string field as protobuf reads it: BadMessage unless it is UTF-8."""
    try:
        return str(data[at : at + length], "utf-8")
    except UnicodeDecodeError as exc:
        raise BadMessage(f"version is not UTF-8: {exc}") from None


def decode_seek_response(data: Buffer, n: int) -> Answer:
    """The answer in `cube.v1.SeekResponse` bytes for `n` keys; its arrays are views of `data`
    (bytes, or a memoryview of a received buffer)."""
    return answer_of(data, n, _scan_response(data))


def answer_of(
    data: Buffer, n: int, fields: tuple[int, int, int, int, int, int, int, str]
) -> Answer:
    """The answer for `n` keys of the SeekResponse in `data` whose `fields` were found (as
    `_scan_response` returns them; the SDK's compiled scan finds the same)."""
    found_at, found_length, values_at, values_length, width, offsets_at, offsets_length, version = (
        fields
    )
    if found_length != n:
        raise BadMessage(f"{found_length} found flags for {n} keys")
    # Viewed, not compared: a ufunc over 1000+ elements releases the GIL, and taking it back
    # costs a thread switch when other threads share the client (any nonzero byte is True).
    found = np.frombuffer(data, np.bool_, n, found_at)
    if width:
        if values_length != n * width:
            raise BadMessage(f"{values_length} value bytes for {n} keys of width {width}")
        blob = np.frombuffer(data, np.uint8, values_length, values_at)
        return Answer(found, ValueColumn(blob, _NO_OFFSETS, width, n), version)
    if offsets_length != 8 * (n + 1):
        raise BadMessage(f"{offsets_length // 8} offsets for {n} keys (want {n + 1})")
    offsets = np.frombuffer(data, _OFFSET_DTYPE, n + 1, offsets_at).astype(np.int64)
    if n and (offsets[0] < 0 or offsets[-1] > values_length or (np.diff(offsets) < 0).any()):
        raise BadMessage(f"value offsets out of order or beyond {values_length} value bytes")
    blob = np.frombuffer(data, np.uint8, values_length, values_at) if values_length else _EMPTY_U8
    return Answer(found, ValueColumn.variable(blob, offsets), version)


_NO_OFFSETS = np.empty(0, dtype=np.int64)


def answer_width(body: Buffer) -> int:
    """The value width of a SeekResponse laid out as servers write it (found flags first,
    then fixed-width values); 0 for another layout. With `answer_values_at`, receivers place
    answers so that their values come out aligned."""
    try:
        if body[0] != 0x0A:
            return 0
        n, pos = read_varint(body, 1)
        pos += n
        if body[pos] != 0x12:
            return 0
        length = read_varint(body, pos + 1)[0]
    except (IndexError, BadMessage):
        return 0
    return length // n if n and length % n == 0 else 0


def answer_values_at(request: Buffer, width: int) -> int:
    """Where the values of the answer to `request` (SeekRequest bytes) start in its body,
    when they are `width` bytes each and laid out as `answer_width` reads them."""
    if len(request) < 3:
        return 0
    low, middle = request[1], request[2]  # the keys field comes first (tag 0x0a)
    if low < 0x80:
        n = low >> 3
    elif middle < 0x80:
        n = ((low & 0x7F) | middle << 7) >> 3
    else:
        try:
            n = read_varint(request, 1)[0] >> 3
        except BadMessage:
            return 0
    return 2 + _varint_size(n) + n + _varint_size(n * width)


def _varint_size(value: int) -> int:
    return 1 if value < 0x80 else 2 if value < 0x4000 else (value.bit_length() + 6) // 7


def _scan_response(data: Buffer) -> tuple[int, int, int, int, int, int, int, str]:
    """A SeekResponse's fields: (found offset, length, values offset, length, width, offsets
    offset, length, version), as protobuf reads them (the last occurrence of a field wins,
    unknown fields are skipped), in one pass with few Python operations (this runs on every
    answer): short varints are read inline, and varints whose value is not needed (the
    request id) are skipped with bytes methods."""
    found_at = found_length = values_at = values_length = width = 0
    offsets_at = offsets_length = version_at = version_length = 0
    pos, end = 0, len(data)
    while pos < end:
        tag = data[pos]
        if tag < 0x80:
            pos += 1
        else:
            tag, pos = read_varint(data, pos, end)
        wire_type = tag & 7
        if wire_type == 0 and tag != 0x18:  # an int we do not use: skip its varint
            size = bytes(data[pos : pos + 10]).translate(_VARINT_ENDS).find(0) + 1
            if size == 0:
                read_varint(data, pos, end)  # raises: truncated
            pos += size
            continue
        if wire_type != 0 and wire_type != 2:
            if wire_type == 1:
                pos += 8
            elif wire_type == 5:
                pos += 4
            else:
                raise BadMessage(f"unsupported wire type {wire_type} for field {tag >> 3}")
            continue
        # the value: the width, or a length (inline up to three bytes)
        if pos + 2 < end:
            low = data[pos]
            if low < 0x80:
                value = low
                pos += 1
            elif (middle := data[pos + 1]) < 0x80:
                value = (low & 0x7F) | middle << 7
                pos += 2
            elif (high := data[pos + 2]) < 0x80:
                value = (low & 0x7F) | (middle & 0x7F) << 7 | high << 14
                pos += 3
            else:
                value, pos = read_varint(data, pos, end)
        else:
            value, pos = read_varint(data, pos, end)
        if wire_type == 0:
            width = value
            continue
        if pos + value > end:
            raise BadMessage(f"field {tag >> 3} runs past the end of the message")
        if tag == 0x0A:
            found_at, found_length = pos, value
        elif tag == 0x12:
            values_at, values_length = pos, value
        elif tag == 0x22:
            offsets_at, offsets_length = pos, value
        elif tag == 0x2A:
            if version_length:  # repeated: the last wins, but every one must be UTF-8
                _utf8(data, version_at, version_length)
            version_at, version_length = pos, value
        pos += value
    if pos != end:
        raise BadMessage("truncated message")
    version = _utf8(data, version_at, version_length)
    return (
        found_at,
        found_length,
        values_at,
        values_length,
        width,
        offsets_at,
        offsets_length,
        version,
    )


# bytes.translate table: a varint's last byte (high bit clear) -> 0, others -> 1
_VARINT_ENDS = bytes(0 if b < 0x80 else 1 for b in range(256))


# What an empty Seek (a client's first contact) is told in its initial metadata, beside the
# lane's port and the served routing: the most keys one request may carry (the server's
# --max_batch), so that the SDK splits larger batches instead of being refused.
MAX_BATCH_METADATA = "cube-max-batch"


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
