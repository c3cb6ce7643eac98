"""Hadoop SequenceFile reader and writer: genuine Hadoop files and the Cube tools' dialect.

File layout (all framing integers big-endian, strings Hadoop `Text` = vint length + UTF-8):
``"SEQ"`` version, key class, value class, [compressed, block-compressed, codec class],
[metadata: int32 count + Text pairs], 16-byte sync marker. Then records
``int32 record_len, int32 key_len, key, value`` with a sync escape (record_len -1 + the sync
marker) anywhere between records; or, block-compressed, per block a sync escape, a vint record
count and four (vint length + compressed buffer) sections: key lengths, keys, value lengths,
values.

The Cube tools write a dialect under a genuine BytesWritable/BytesWritable header: the key is the
raw 8-byte little-endian uint64 and the value the raw bytes, with no Writable length prefixes.
`key_format="auto"` tells the two apart once per file from the key class and the first record's
key length (8 = Cube dialect, 12 with an inner length of 8 = genuine BytesWritable).

Reading is streaming with bounded memory: about `batch_bytes` of input at a time. The common
case (uncompressed, every record the same length) is parsed with numpy in a few passes per chunk;
anything else falls back to a per-record walker for that chunk.

No length read from the file is believed before it is checked, so a hostile or truncated file
gets a SequenceFileError (file, offset, field), never a huge allocation: header strings and the
metadata count against the bytes left in the file and MAX_HEADER_TEXT_BYTES /
MAX_METADATA_ENTRIES; record lengths against the bytes left and MAX_RECORD_BYTES (also the most a
record-compressed value may decompress to); a block's record count against MAX_BLOCK_RECORDS and
its sections (compressed and decompressed) against MAX_BLOCK_BYTES and the lengths the block
states. Record-compressed chunks decompress about `batch_bytes` at a time.
"""

from __future__ import annotations

import os
import stat
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from cube.codecs import DEFAULT_CODEC, Codec, CodecError, codec_by_name, codec_for_class
from cube.values import ValueColumn, gather_ranges

MAGIC = b"SEQ"
CURRENT_VERSION = 6
SYNC_SIZE = 16
SYNC_ESCAPE = b"\xff\xff\xff\xff"
BYTES_WRITABLE = "org.apache.hadoop.io.BytesWritable"
LONG_WRITABLE = "org.apache.hadoop.io.LongWritable"
TEXT = "org.apache.hadoop.io.Text"
KEY_FORMATS = ("auto", "cube", "bytes_be", "bytes_le", "long", "text")
DIALECTS = ("cube", "byteswritable")
COMPRESSIONS = ("none", "record", "block")

# Hadoop's header versions: class names became Text at 4 (block compression), codec names at 5,
# metadata at 6; version 1 has no sync marker.
_BLOCK_COMPRESS_VERSION = 4
_CUSTOM_COMPRESS_VERSION = 5
_METADATA_VERSION = 6
# Where a writer puts sync escapes, per dialect. The Cube tools (kv_to_seqfile) write one once
# the record lengths since the last add up to CUBE_SYNC_INTERVAL; Hadoop 3's SequenceFile.Writer
# writes one before a record that starts HADOOP_SYNC_INTERVAL or more bytes past the last
# (5 * 1024 * (escape + marker)). Readers take escapes anywhere.
CUBE_SYNC_INTERVAL = 2000
HADOOP_SYNC_INTERVAL = 5 * 1024 * (len(SYNC_ESCAPE) + SYNC_SIZE)
BLOCK_BYTES = 1_000_000  # Hadoop's io.seqfile.compress.blocksize
_MAX_VINT_BYTES = 9
_BLOCK_SECTIONS = ("key lengths", "keys", "value lengths", "values")
# Sanity limits for lengths a file states (see the module docstring). Far above what Hadoop or
# the Cube tools write: class names are < 100 bytes, values are embeddings (KB), blocks ~1 MB.
MAX_HEADER_TEXT_BYTES = 4 << 20  # one class name, codec name or metadata key/value
MAX_METADATA_ENTRIES = 1 << 16
MAX_RECORD_BYTES = 256 << 20  # one record (key + value), and one decompressed value
MAX_BLOCK_RECORDS = 1 << 22  # records in one compressed block (~40 bytes of index each)
MAX_BLOCK_BYTES = 1 << 30  # a block's keys + values, decompressed (compressed: twice that)


class SequenceFileError(ValueError):
    """Bad or unsupported SequenceFile input, located by file and byte offset."""

    def __init__(self, path: str | os.PathLike, offset: int, problem: str):
        self.path = str(path)
        self.offset = int(offset)
        self.problem = problem
        super().__init__(f"{self.path} at offset {self.offset}: {problem}")


@dataclass(frozen=True)
class SequenceFileHeader:
    version: int
    key_class: str
    value_class: str
    compression: str  # "none" | "record" | "block"
    codec: str | None  # Java class name, None when uncompressed
    metadata: dict[str, str]
    sync: bytes  # 16 bytes (empty for version 1, which has no sync marker)
    data_offset: int  # where the first record (or block) starts


@dataclass(frozen=True)
class RecordBatch:
    keys: np.ndarray  # uint64
    values: ValueColumn
    path: str
    offsets: np.ndarray  # int64 file offset of each record (block start when block-compressed)

    def __len__(self) -> int:
        return int(self.keys.shape[0])


@dataclass(frozen=True)
class ValueLocations:
    """Where each record's value payload sits in its (uncompressed) file, Writable framing
    already checked and stripped: a builder reads the values from the file when it writes
    them in their final order, instead of copying every value once more while routing."""

    starts: np.ndarray  # int64 file offset of each value's first payload byte
    width: int  # > 0: every value is `width` bytes; 0: see `lengths`
    lengths: np.ndarray | None = None  # int64 per value when width == 0

    def __len__(self) -> int:
        return int(self.starts.shape[0])


@dataclass(frozen=True)
class LocatedBatch:
    keys: np.ndarray  # uint64
    locations: ValueLocations
    path: str
    offsets: np.ndarray  # int64 file offset of each record

    def __len__(self) -> int:
        return int(self.keys.shape[0])


# --------------------------------------------------------------------------------------------
# Hadoop vints (WritableUtils.writeVLong / readVLong)


def encode_vint(value: int) -> bytes:
    """Hadoop's zero-compressed long: one byte for -112..127, else a length byte + big-endian."""
    if -112 <= value <= 127:
        return struct.pack(">b", value)
    marker = -112
    if value < 0:
        value = ~value
        marker = -120
    size = (value.bit_length() + 7) // 8
    return struct.pack(">b", marker - size) + value.to_bytes(size, "big")


def vint_size(first: int) -> int:
    """Total encoded size from the first byte (signed)."""
    if first >= -112:
        return 1
    return (-119 - first) if first < -120 else (-111 - first)


def decode_vint(buf: bytes | bytearray | memoryview, pos: int) -> tuple[int, int]:
    """(value, position after it); IndexError when the buffer ends inside it."""
    first = buf[pos]
    if first >= 128:
        first -= 256
    size = vint_size(first)
    if size == 1:
        return first, pos + 1
    if pos + size > len(buf):
        raise IndexError("vint runs past the end of the buffer")
    value = int.from_bytes(buf[pos + 1 : pos + size], "big")
    return (~value if first < -120 else value), pos + size


def encode_text(text: str) -> bytes:
    data = text.encode("utf-8")
    return encode_vint(len(data)) + data


# --------------------------------------------------------------------------------------------
# Header


class _Cursor:
    """Exact reads from a file with offset tracking, for the header and block framing. A read
    is checked against the bytes left in the file before anything is allocated for it."""

    def __init__(self, file: BinaryIO, path: str, offset: int, size: int):
        self.file = file
        self.path = path
        self.offset = offset
        self.size = size  # of the file

    @property
    def left(self) -> int:
        return max(self.size - self.offset, 0)

    def error(self, problem: str, offset: int | None = None) -> SequenceFileError:
        return SequenceFileError(self.path, self.offset if offset is None else offset, problem)

    def read(self, n: int, what: str) -> bytes:
        if n > self.left:
            raise self.error(f"file ends inside {what} (needs {n} bytes, {self.left} left)")
        data = self.file.read(n)
        if len(data) != n:  # the file shrank under us
            raise self.error(f"file ends inside {what} (needs {n} bytes, {len(data)} left)")
        self.offset += n
        return data

    def read_vint(self, what: str) -> int:
        start = self.offset
        first = self.read(1, what)[0]
        signed = first - 256 if first >= 128 else first
        size = vint_size(signed)
        rest = self.read(size - 1, what) if size > 1 else b""
        value, _ = decode_vint(bytes([first]) + rest, 0)
        if value < 0:
            raise self.error(f"negative {what} {value}", start)
        return value

    def read_text(self, what: str) -> str:
        """A Hadoop Text; its length is checked against the file and MAX_HEADER_TEXT_BYTES."""
        start = self.offset
        size = self.read_vint(f"{what} length")
        if size > self.left:
            raise self.error(
                f"{what} length {size} exceeds the {self.left} bytes left in the file", start
            )
        if size > MAX_HEADER_TEXT_BYTES:
            raise self.error(
                f"{what} length {size} exceeds the limit of {MAX_HEADER_TEXT_BYTES} bytes", start
            )
        return self._utf8(self.read(size, what), what, start)

    def read_utf8(self, what: str) -> str:
        """Hadoop's old UTF8 class (2-byte length), used for class names before version 4."""
        start = self.offset
        (size,) = struct.unpack(">H", self.read(2, f"{what} length"))
        return self._utf8(self.read(size, what), what, start)

    def _utf8(self, data: bytes, what: str, start: int) -> str:
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise self.error(f"{what} is not UTF-8: {data[:40]!r}", start) from None

    def read_bool(self, what: str) -> bool:
        start = self.offset
        flag = self.read(1, what)[0]
        if flag > 1:
            raise self.error(f"{what} flag is {flag}, expected 0 or 1", start)
        return bool(flag)


def _parse_header(file: BinaryIO, path: str) -> SequenceFileHeader:
    cur = _Cursor(file, path, 0, os.fstat(file.fileno()).st_size)
    magic = cur.read(3, "the header magic")
    if magic != MAGIC:
        raise cur.error(f"not a SequenceFile: magic {magic!r}, expected {MAGIC!r}", 0)
    version = cur.read(1, "the header version")[0]
    if not 1 <= version <= CURRENT_VERSION:
        raise cur.error(f"unsupported SequenceFile version {version}", 3)
    read_name = cur.read_text if version >= _BLOCK_COMPRESS_VERSION else cur.read_utf8
    key_class = read_name("the key class name")
    value_class = read_name("the value class name")
    compressed = cur.read_bool("the compressed") if version > 2 else False
    block = cur.read_bool("the block-compressed") if version >= _BLOCK_COMPRESS_VERSION else False
    codec = None
    if compressed:
        if version >= _CUSTOM_COMPRESS_VERSION:
            codec = cur.read_text("the codec class name")
        else:
            codec = DEFAULT_CODEC
    elif block:
        raise cur.error("block-compressed flag set on an uncompressed file", cur.offset - 1)
    metadata: dict[str, str] = {}
    if version >= _METADATA_VERSION:
        start = cur.offset
        (count,) = struct.unpack(">i", cur.read(4, "the metadata count"))
        if count < 0:
            raise cur.error(f"negative metadata count {count}", start)
        if 2 * count > cur.left:  # each entry is two Texts of at least one byte
            raise cur.error(
                f"metadata count {count} needs at least {2 * count} bytes, more than the "
                f"{cur.left} bytes left in the file",
                start,
            )
        if count > MAX_METADATA_ENTRIES:
            raise cur.error(
                f"metadata count {count} exceeds the limit of {MAX_METADATA_ENTRIES}", start
            )
        for i in range(count):
            name = cur.read_text(f"metadata key {i}")
            metadata[name] = cur.read_text(f"metadata value {i}")
    sync = cur.read(SYNC_SIZE, "the sync marker") if version > 1 else b""
    compression = "block" if block else ("record" if compressed else "none")
    return SequenceFileHeader(
        version, key_class, value_class, compression, codec, metadata, sync, cur.offset
    )


def read_header(path: str | os.PathLike) -> SequenceFileHeader:
    """Parse only the header; raises SequenceFileError."""
    with _open(path) as file:
        return _parse_header(file, str(path))


def _open(path: str | os.PathLike) -> BinaryIO:
    """Open a regular file. Anything else is refused before open(): a FIFO would block until
    some writer came, and a device or directory has no size to check lengths against."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise SequenceFileError(path, 0, "not a regular file")
        return open(path, "rb")
    except OSError as exc:
        raise SequenceFileError(path, 0, f"cannot open: {exc.strerror}") from None


# --------------------------------------------------------------------------------------------
# Raw records: where each key and value sits, before any Writable framing is stripped


@dataclass
class _Fixed:
    """Records that all share one layout, as evenly spaced groups inside a chunk buffer.

    Each part is (offset, groups, per_group, group_stride): `groups` runs of `per_group`
    records `stride` bytes apart, the runs `group_stride` apart (a run plus one sync escape).
    Fields are read through strided numpy views, so no joined copy of the chunk is made."""

    buf: bytearray | memoryview
    parts: list[tuple[int, int, int, int]]
    stride: int
    key_len: int

    @property
    def count(self) -> int:
        return sum(groups * per_group for _, groups, per_group, _ in self.parts)

    def field(self, part: tuple[int, int, int, int], start: int, dtype: str) -> np.ndarray:
        offset, groups, per_group, group_stride = part
        return np.ndarray(
            (groups, per_group),
            dtype=dtype,
            buffer=self.buf,
            offset=offset + start,
            strides=(group_stride, self.stride),
        )

    def gather(self, start: int, dtype: str) -> np.ndarray:
        """The field at `start` of every record, as one new array (never a view of buf)."""
        out = np.empty(self.count, dtype=dtype)
        at = 0
        for part in self.parts:
            size = part[1] * part[2]
            out[at : at + size].reshape(part[1], part[2])[...] = self.field(part, start, dtype)
            at += size
        return out

    def offsets(self, base: int) -> np.ndarray:
        out = np.empty(self.count, dtype=np.int64)
        at = 0
        for offset, groups, per_group, group_stride in self.parts:
            size = groups * per_group
            grid = out[at : at + size].reshape(groups, per_group)
            grid[...] = np.arange(per_group, dtype=np.int64) * self.stride
            grid += (np.arange(groups, dtype=np.int64) * group_stride + (base + offset))[:, None]
            at += size
        return out

    def all_headers_equal(self, header: bytes) -> bool:
        expected = np.frombuffer(header, dtype="<u8")[0]
        return all(not (self.field(part, 0, "<u8") != expected).any() for part in self.parts)


@dataclass
class _Raw:
    """One chunk's records: generic byte ranges, or `fixed` when all share one layout."""

    offsets: np.ndarray  # int64 file offset per record
    key_buf: np.ndarray | None = None  # uint8
    key_starts: np.ndarray | None = None
    key_lens: np.ndarray | None = None
    val_buf: np.ndarray | None = None
    val_starts: np.ndarray | None = None
    val_lens: np.ndarray | None = None
    fixed: _Fixed | None = None
    input_bytes: int = 0

    @property
    def count(self) -> int:
        return int(self.offsets.shape[0])

    def ranges(self) -> _Raw:
        """Fill the generic byte ranges from the fixed layout (for the less common decoders)."""
        if self.key_starts is None and self.fixed is not None:
            fixed, n = self.fixed, self.count
            flat = fixed.gather(0, f"V{fixed.stride}").view(np.uint8)
            starts = np.arange(n, dtype=np.int64) * fixed.stride
            self.key_buf = self.val_buf = flat
            self.key_starts = starts + 8
            self.key_lens = np.full(n, fixed.key_len, dtype=np.int64)
            self.val_starts = starts + 8 + fixed.key_len
            self.val_lens = np.full(n, fixed.stride - 8 - fixed.key_len, dtype=np.int64)
        return self


class _Scratch:
    """A reusable buffer for joining irregularly spaced segments, chunk after chunk, without
    fresh (page-faulting) allocations."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def get(self, size: int) -> bytearray:
        if len(self.buf) < size:
            self.buf = bytearray(size)
        return self.buf


def _fixed_chunk(
    buf: bytearray, end: int, base: int, marker: bytes, scratch: _Scratch
) -> tuple[_Raw | None, int]:
    """Vectorized parse of buf[:end] when every record has the layout of the first one.

    Assumes the first record's stride everywhere and sync escapes at a constant spacing (what
    both the Cube tools and Hadoop write for fixed-length records); checks every predicted
    escape and every record's 8 length bytes in a few numpy passes. Irregular escape spacing
    falls back to finding each escape and joining the segments. Returns (None, 0) whenever the
    assumption fails; the caller then walks the chunk record by record, which also produces
    the precise error for bad input. The result views `buf` (or `scratch`)."""
    pos = 0
    while end - pos >= 4 and buf[pos : pos + 4] == SYNC_ESCAPE:
        if not marker or end - pos < 20 or buf[pos : pos + 20] != marker:
            return None, 0
        pos += 20
    if end - pos < 8:
        return None, 0
    record_len, key_len = struct.unpack_from(">ii", buf, pos)
    if record_len < 0 or not 0 <= key_len <= record_len or record_len > MAX_RECORD_BYTES:
        return None, 0  # the walker reports it
    stride = record_len + 8
    header = bytes(buf[pos : pos + 8])
    first = buf.find(marker, pos, end) if marker else -1
    if first < 0:
        parts = [(pos, 1, (end - pos) // stride, 0)]
    else:
        parts = _regular_parts(buf, end, pos, first, stride, marker)
    if parts is not None:
        last_offset, _, last_count, _ = parts[-1]
        consumed = last_offset + last_count * stride
        fixed = _Fixed(buf, [p for p in parts if p[1] * p[2]], stride, key_len)
    else:
        fixed = _joined_segments(buf, end, pos, first, stride, marker, scratch, key_len)
        if fixed is None:
            return None, 0
    total = fixed.count
    if total == 0 or not fixed.all_headers_equal(header):
        return None, 0
    if parts is not None:
        offsets = fixed.offsets(base)
    else:
        offsets, consumed = fixed.offsets_in_file, fixed.consumed
        offsets += base
    return _Raw(offsets, fixed=fixed, input_bytes=consumed), consumed


def _regular_parts(
    buf: bytearray, end: int, pos: int, first: int, stride: int, marker: bytes
) -> list[tuple[int, int, int, int]] | None:
    """Parts for escapes every `spacing` bytes from `first` on, or None when they are not."""
    if (first - pos) % stride:
        return None
    second = buf.find(marker, first + 20, end)
    if second < 0:
        spacing = end - first  # one escape: no full group, only head and tail
        escapes = 1
    else:
        spacing = second - first
        if (spacing - 20) % stride:
            return None
        escapes = (end - first - 20) // spacing + 1
        # Every predicted escape must be there (records between them are checked by header).
        at = first + np.arange(escapes, dtype=np.int64) * spacing
        window = np.frombuffer(buf, dtype=np.uint8, count=end)[at[:, None] + np.arange(20)]
        if (window != np.frombuffer(marker, dtype=np.uint8)).any():
            return None
    per_group = (spacing - 20) // stride
    last = first + (escapes - 1) * spacing
    parts = [(pos, 1, (first - pos) // stride, 0)]
    if escapes > 1:
        parts.append((first + 20, escapes - 1, per_group, spacing))
    parts.append((last + 20, 1, (end - last - 20) // stride, 0))
    return parts


@dataclass
class _Joined(_Fixed):
    offsets_in_file: np.ndarray | None = None
    consumed: int = 0


def _joined_segments(
    buf: bytearray,
    end: int,
    pos: int,
    first: int,
    stride: int,
    marker: bytes,
    scratch: _Scratch,
    key_len: int,
) -> _Joined | None:
    """Irregularly spaced escapes: find each, join the escape-free segments into `scratch`."""
    escapes = []
    at = first
    while at >= 0:
        escapes.append(at)
        at = buf.find(marker, at + 20, end)
    seg_starts = np.array([pos] + [e + 20 for e in escapes], dtype=np.int64)
    seg_lens = np.array([*escapes, end], dtype=np.int64) - seg_starts
    counts = seg_lens // stride
    if (seg_lens[:-1] % stride).any():
        return None
    total = int(counts.sum())
    data = scratch.get(max(total * stride, len(buf)))
    view = memoryview(buf)
    at = 0
    for start, count in zip(seg_starts.tolist(), counts.tolist(), strict=True):
        size = count * stride
        data[at : at + size] = view[start : start + size]
        at += size
    # Record i sits at i * stride in the joined rows, after one escape per segment before it.
    offsets = np.arange(total, dtype=np.int64) * stride + pos
    offsets += np.repeat(np.arange(len(escapes) + 1, dtype=np.int64) * 20, counts)
    consumed = int(seg_starts[-1] + counts[-1] * stride)
    return _Joined(data, [(0, 1, total, 0)], stride, key_len, offsets, consumed)


def _walk_chunk(
    buf: bytearray, end: int, base: int, sync: bytes, final: bool, path: str, file_left: int
) -> tuple[_Raw, int, int]:
    """Per-record walk of buf[:end]: (records, bytes consumed, bytes the next record needs).

    Record positions form a chain (each record's length gives the next one's start), so this
    loop is sequential; it does the least per record (one unpack, one append) and checks the
    key lengths afterwards in one numpy pass. `file_left` is the file's size from buf[0] on: a
    record length past it (or past MAX_RECORD_BYTES) is refused before any byte of the record
    is read, so `need` never asks for more. The result views `buf`.

    Long: the walk is one loop in one frame (a call per record would cost as much as the walk).
    """
    pos = 0
    need = 0
    positions: list[int] = []
    append = positions.append
    unpack = struct.Struct(">i").unpack_from
    problem = None  # reported after the records before it are checked (first error wins)
    last_header = end - 4  # a record length needs 4 bytes
    while True:
        if pos > last_header:
            need = 8
            break
        (record_len,) = unpack(buf, pos)
        if record_len < 0:
            if record_len != -1:
                problem = f"bad record length {record_len}"
                break
            if not sync:
                problem = "sync escape in a file without sync"
                break
            if end - pos < 4 + SYNC_SIZE:
                need = 4 + SYNC_SIZE
                break
            if buf[pos + 4 : pos + 4 + SYNC_SIZE] != sync:
                problem = "sync marker after the escape does not match the header's"
                break
            pos += 4 + SYNC_SIZE
            continue
        following = pos + 8 + record_len
        if following > file_left:
            left = max(file_left - pos - 8, 0)
            problem = (
                f"truncated file: record length {record_len} exceeds the {left} bytes "
                "left in the file"
            )
            break
        if record_len > MAX_RECORD_BYTES:
            problem = f"record length {record_len} exceeds the limit of {MAX_RECORD_BYTES} bytes"
            break
        if following > end:
            need = 8 + record_len
            break
        append(pos)
        pos = following
    starts = np.array(positions, dtype=np.int64)
    flat = np.frombuffer(buf, dtype=np.uint8, count=end)
    lengths = flat[starts[:, None] + np.arange(8)].view(">i4").astype(np.int64)
    record_lens, key_lens = lengths[:, 0], lengths[:, 1]
    bad = np.flatnonzero((key_lens < 0) | (key_lens > record_lens))
    if bad.size:
        i = int(bad[0])
        raise SequenceFileError(
            path,
            base + int(starts[i]),
            f"bad record lengths: record {int(record_lens[i])}, key {int(key_lens[i])}",
        )
    if problem is not None:
        raise SequenceFileError(path, base + pos, problem)
    if final and pos < end:
        raise SequenceFileError(
            path,
            base + pos,
            f"truncated file: ends inside a record (needs {need} bytes, {end - pos} left)",
        )
    raw = _Raw(
        offsets=starts + base,
        key_buf=flat,
        key_starts=starts + 8,
        key_lens=key_lens,
        val_buf=flat,
        val_starts=starts + 8 + key_lens,
        val_lens=record_lens - key_lens,
        input_bytes=pos,
    )
    return raw, pos, need


def _read_into(file: BinaryIO, target: memoryview) -> int:
    """Fill `target` from the file; fewer bytes only at end of file."""
    done = 0
    while done < len(target):
        got = file.readinto(target[done:])
        if not got:
            break
        done += got
    return done


def _decompress_values(raw: _Raw, codec: Codec, path: str, budget: int) -> tuple[_Raw, int]:
    """Record compression: each value is its own compressed buffer, of at most
    MAX_RECORD_BYTES decompressed. Stops after the value that brings the total to `budget`
    (a chunk of well-compressed values can hold far more than its size): returns the first
    records, decompressed, and how many were kept (at least one); the caller reads the rest
    again."""
    buf = raw.val_buf
    parts = []
    total = 0
    for i, (start, length) in enumerate(
        zip(raw.val_starts.tolist(), raw.val_lens.tolist(), strict=True)
    ):
        if total >= budget:
            break
        try:
            part = codec.decompress(buf[start : start + length].tobytes(), MAX_RECORD_BYTES)
        except CodecError as exc:
            raise SequenceFileError(path, int(raw.offsets[i]), f"value: {exc}") from None
        parts.append(part)
        total += len(part)
    kept = len(parts)
    lengths = np.fromiter((len(p) for p in parts), dtype=np.int64, count=kept)
    starts = np.zeros(kept, dtype=np.int64)
    if kept > 1:
        np.cumsum(lengths[:-1], out=starts[1:])
    raw.offsets = raw.offsets[:kept]
    raw.key_starts, raw.key_lens = raw.key_starts[:kept], raw.key_lens[:kept]
    raw.val_buf = np.frombuffer(b"".join(parts), dtype=np.uint8)
    raw.val_starts, raw.val_lens = starts, lengths
    raw.input_bytes = max(raw.input_bytes, total)  # what it holds, for batches() to merge by
    return raw, kept


def _vint_lengths(data: bytes, count: int, what: str, path: str, offset: int) -> np.ndarray:
    """`count` vints packed back to back (block-compressed key/value lengths)."""
    arr = np.frombuffer(data, dtype=np.int8)
    if arr.shape[0] == count and (arr >= 0).all():
        return arr.astype(np.int64)  # every length < 128: one byte each
    if count > len(data):  # a vint is at least one byte; checked before allocating `count`
        raise SequenceFileError(
            path, offset, f"block {what}: {len(data)} bytes cannot hold {count} lengths"
        )
    out = np.empty(count, dtype=np.int64)
    pos = 0
    try:
        for i in range(count):
            out[i], pos = decode_vint(data, pos)
    except IndexError:
        raise SequenceFileError(path, offset, f"block {what} end after {i} of {count}") from None
    if pos != len(data) or (out < 0).any():
        raise SequenceFileError(path, offset, f"block {what} do not decode to {count} lengths")
    return out


# --------------------------------------------------------------------------------------------
# Decoding keys and values


def _strip_framing(
    framing: str,
    buf: np.ndarray,
    starts: np.ndarray,
    lens: np.ndarray,
    offsets: np.ndarray,
    what: str,
    path: str,
) -> tuple[np.ndarray, np.ndarray]:
    """Starts and lengths of the payload inside each Writable: raw, BytesWritable or Text."""
    if framing == "raw" or starts.shape[0] == 0:
        return starts, lens
    n = starts.shape[0]
    if framing == "byteswritable":
        short = np.flatnonzero(lens < 4)
        if short.size:
            i = int(short[0])
            raise SequenceFileError(
                path,
                int(offsets[i]),
                f"{what} is {int(lens[i])} bytes, too short for a "
                "BytesWritable (4-byte length first)",
            )
        prefix = buf[starts[:, None] + np.arange(4)].view(">u4").reshape(n).astype(np.int64)
        bad = np.flatnonzero(prefix != lens - 4)
        if bad.size:
            i = int(bad[0])
            raise SequenceFileError(
                path,
                int(offsets[i]),
                f"{what} BytesWritable length {int(prefix[i])} does not "
                f"match its {int(lens[i]) - 4} payload bytes",
            )
        return starts + 4, lens - 4
    # Text: vint length, decoded for all records at once (at most 9 bytes each).
    empty = np.flatnonzero(lens < 1)
    if empty.size:
        i = int(empty[0])
        raise SequenceFileError(path, int(offsets[i]), f"{what} is empty, a Text needs a length")
    first = buf[starts].view(np.int8).astype(np.int64)
    sizes = np.where(first >= -112, 1, np.where(first < -120, -119 - first, -111 - first))
    if (first < -120).any() or (sizes > lens).any():
        i = int(np.flatnonzero((first < -120) | (sizes > lens))[0])
        raise SequenceFileError(path, int(offsets[i]), f"{what} has a bad Text length")
    values = np.where(sizes == 1, first, 0)
    for k in range(1, _MAX_VINT_BYTES):
        more = sizes > k
        if not more.any():
            break
        values = np.where(more, values * 256 + buf[np.where(more, starts + k, 0)], values)
    bad = np.flatnonzero(values != lens - sizes)
    if bad.size:
        i = int(bad[0])
        raise SequenceFileError(
            path,
            int(offsets[i]),
            f"{what} Text length {int(values[i])} does not match its "
            f"{int(lens[i] - sizes[i])} bytes",
        )
    return starts + sizes, lens - sizes


def _column(buf: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> ValueColumn:
    """The byte ranges as one column. The ranges of a chunk are in file order and never
    overlap, so a byte mask over their span (alternating skip/take runs) selects them in one
    pass; a general gather would build a 16-byte index per value byte."""
    count = starts.shape[0]
    offsets = np.zeros(count + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    if count == 0 or offsets[-1] == 0:
        return ValueColumn.variable(np.empty(0, np.uint8), offsets).compact()
    ends = starts + lens
    if count > 1 and ((starts[1:] < ends[:-1]).any() or (lens < 0).any()):
        return ValueColumn.variable(*gather_ranges(buf, starts, lens)).compact()
    low, high = int(starts[0]), int(ends[-1])
    runs = np.empty(2 * count, dtype=np.int64)  # skip, take, skip, take, ...
    runs[0] = 0
    runs[2::2] = starts[1:] - ends[:-1]
    runs[1::2] = lens
    inside = np.repeat(np.tile(np.array([False, True]), count), runs)
    return ValueColumn.variable(buf[low:high][inside], offsets).compact()


def _key_width_error(fmt: str, key_len: int, inner: int | None = None) -> str:
    if fmt == "cube":
        return f"key is {key_len} bytes, cube format needs 8 (raw little-endian uint64)"
    if fmt == "long":
        return f"key is {key_len} bytes, long format needs 8 (LongWritable)"
    if inner is not None:
        return f"BytesWritable key holds {inner} bytes, {fmt} format needs 8"
    return (
        f"key is {key_len} bytes, {fmt} format needs a BytesWritable holding 8 bytes "
        f"(12 with its length)"
    )


def _decode_keys(raw: _Raw, fmt: str, framing: str, path: str) -> np.ndarray:
    """uint64 keys of a chunk in the resolved key format; SequenceFileError on a misfit."""
    if fmt == "text":
        return _decode_text_keys(raw, framing, path)
    width = 12 if fmt in ("bytes_be", "bytes_le") else 8
    fixed = raw.fixed
    if fixed is not None:
        if fixed.key_len != width:
            raise SequenceFileError(path, int(raw.offsets[0]), _key_width_error(fmt, fixed.key_len))
        inner = fixed.gather(8, ">u4") if width == 12 else None
        payload_at = 8 + width - 8
        if fmt in ("cube", "bytes_le"):
            keys = fixed.gather(payload_at, "<u8")
        else:
            keys = fixed.gather(payload_at, ">u8").astype(np.uint64)
    else:
        bad = np.flatnonzero(raw.key_lens != width)
        if bad.size:
            i = int(bad[0])
            message = _key_width_error(fmt, int(raw.key_lens[i]))
            raise SequenceFileError(path, int(raw.offsets[i]), message)
        matrix = raw.key_buf[raw.key_starts[:, None] + np.arange(width)]
        inner = matrix[:, :4].copy().view(">u4").reshape(-1) if width == 12 else None
        payload = matrix[:, width - 8 :].copy()
        if fmt in ("cube", "bytes_le"):
            keys = payload.view("<u8").reshape(-1)
        else:
            keys = payload.view(">u8").reshape(-1).astype(np.uint64)
    if inner is not None:
        bad = np.flatnonzero(inner != 8)
        if bad.size:
            i = int(bad[0])
            message = _key_width_error(fmt, width, int(inner[i]))
            raise SequenceFileError(path, int(raw.offsets[i]), message)
    return keys


def _decode_text_keys(raw: _Raw, framing: str, path: str) -> np.ndarray:
    """Text keys holding decimal ids (a rare input: one Python step per key)."""
    raw.ranges()
    starts, lens = _strip_framing(
        framing, raw.key_buf, raw.key_starts, raw.key_lens, raw.offsets, "key", path
    )
    keys = np.empty(starts.shape[0], dtype=np.uint64)
    blob = raw.key_buf
    for i, (start, length) in enumerate(zip(starts.tolist(), lens.tolist(), strict=True)):
        text = blob[start : start + length].tobytes()
        if not (text.isdigit() and len(text) <= 20 and int(text) < 1 << 64):
            raise SequenceFileError(
                path,
                int(raw.offsets[i]),
                f"key {text[:40]!r} is not a decimal uint64 id (text key format)",
            )
        keys[i] = int(text)
    return keys


def _decode_values(raw: _Raw, framing: str, path: str) -> ValueColumn:
    fixed = raw.fixed
    if fixed is not None and framing != "text":
        start = 8 + fixed.key_len
        width = fixed.stride - start
        if framing == "byteswritable":
            if width < 4 or (fixed.gather(start, ">u4") != width - 4).any():
                raw.ranges()  # the generic decoder reports the first bad record
                return _decode_values_generic(raw, framing, path)
            start, width = start + 4, width - 4
        if width == 0:
            return ValueColumn.variable(np.empty(0, np.uint8), np.zeros(raw.count + 1, np.int64))
        return ValueColumn.fixed(fixed.gather(start, f"V{width}").view(np.uint8), width)
    raw.ranges()
    return _decode_values_generic(raw, framing, path)


def _locate_values(raw: _Raw, framing: str, path: str) -> ValueLocations:
    """File offsets of the value payloads of an uncompressed chunk (see ValueLocations); the
    framing checks are `_decode_values`', so bad input fails the same way."""
    fixed = raw.fixed
    if fixed is not None and framing != "text":
        start = 8 + fixed.key_len
        width = fixed.stride - start
        framed = framing == "byteswritable"
        # a bad BytesWritable length: the generic path below reports the first bad record
        if not framed or (width >= 4 and not (fixed.gather(start, ">u4") != width - 4).any()):
            if framed:
                start, width = start + 4, width - 4
            starts = raw.offsets + start
            if width == 0:
                return ValueLocations(starts, 0, np.zeros(raw.count, np.int64))
            return ValueLocations(starts, width)
    raw.ranges()
    starts, lens = _strip_framing(
        framing, raw.val_buf, raw.val_starts, raw.val_lens, raw.offsets, "value", path
    )
    # raw.key_starts - 8 is where each record starts in the chunk, raw.offsets in the file
    starts = starts + (raw.offsets - raw.key_starts + 8)
    width = int(lens[0]) if lens.shape[0] else 0
    if width and (lens == width).all():
        return ValueLocations(starts, width)
    return ValueLocations(starts, 0, lens)


def _decode_values_generic(raw: _Raw, framing: str, path: str) -> ValueColumn:
    starts, lens = _strip_framing(
        framing, raw.val_buf, raw.val_starts, raw.val_lens, raw.offsets, "value", path
    )
    return _column(raw.val_buf, starts, lens)


def concat_columns(columns: list[ValueColumn]) -> ValueColumn:
    """One column from many, with a single copy (ValueColumn.concat pairs would be quadratic)."""
    columns = [c for c in columns if c.count]
    if not columns:
        return ValueColumn.empty()
    if len(columns) == 1:
        return columns[0]
    width = columns[0].width
    if width and all(c.width == width for c in columns):
        return ValueColumn.fixed(np.concatenate([c.blob[: c.nbytes] for c in columns]), width)
    parts = [c.as_variable() for c in columns]
    blob = np.concatenate([p.blob[p.offsets[0] : p.offsets[-1]] for p in parts])
    offsets = np.zeros(sum(p.count for p in parts) + 1, dtype=np.int64)
    at, shift = 1, 0
    for p in parts:
        offsets[at : at + p.count] = p.offsets[1:] - p.offsets[0] + shift
        at += p.count
        shift += p.nbytes
    return ValueColumn.variable(blob, offsets).compact()


def decode_key(key: bytes, key_format: str) -> int:
    """One Writable-stripped key (as `records()` yields it) as a uint64, for tools and tests."""
    if key_format == "text":
        if not (key.isdigit() and len(key) <= 20 and int(key) < 1 << 64):
            raise ValueError(f"key {key[:40]!r} is not a decimal uint64 id")
        return int(key)
    if len(key) != 8:
        raise ValueError(f"key is {len(key)} bytes, {key_format} format needs 8")
    order = "little" if key_format in ("cube", "bytes_le") else "big"
    return int.from_bytes(key, order)


# --------------------------------------------------------------------------------------------
# Reader


class SequenceFileReader:
    """Stream a SequenceFile as uint64-key record batches (or raw records), bounded memory.

    `key_format` after construction is the resolved one: "auto" picks cube / bytes_be (from the
    first key's length under a BytesWritable header), long (LongWritable) or text (Text) once
    per file; for any other key class it stays "auto", records() still works and batches()
    asks for an explicit format. The file stays open until close() (or the with block ends)."""

    def __init__(
        self, path: str | os.PathLike, key_format: str = "auto", batch_bytes: int = 64 << 20
    ):
        if key_format not in KEY_FORMATS:
            raise ValueError(f"key_format {key_format!r} is not one of {', '.join(KEY_FORMATS)}")
        self.path = str(path)
        self.batch_bytes = max(int(batch_bytes), 64)
        self._file = _open(path)
        try:
            self.file_size = os.fstat(self._file.fileno()).st_size
            self.header = _parse_header(self._file, self.path)
            self.codec: Codec | None = None
            if self.header.codec is not None:
                self.codec = codec_for_class(self.header.codec)
                if self.codec is None:
                    raise SequenceFileError(
                        self.path,
                        self.header.data_offset,
                        f"unsupported compression codec {self.header.codec}",
                    )
            self.key_format = self._resolve(key_format)
        except BaseException:
            self._file.close()
            raise

    def _resolve(self, key_format: str) -> str:
        """The key format, decided once per file from the key class and the first key's size."""
        if key_format != "auto":
            return key_format
        key_class = self.header.key_class
        if key_class == LONG_WRITABLE:
            return "long"
        if key_class == TEXT:
            return "text"
        if key_class == BYTES_WRITABLE:
            first = self._first_key_len()
            return "cube" if first is None or first == 8 else "bytes_be"
        return "auto"  # unknown class: records() works, batches() asks for a key_format

    @property
    def dialect(self) -> str:
        """Cube dialect (raw keys and BytesWritable values, no framing) or "writable"."""
        return "cube" if self.key_format == "cube" else "writable"

    def _first_key_len(self) -> int | None:
        """Length of the first record's key, or None when the file has no records."""
        for raw in self._raw_chunks(limit_bytes=4096, first_only=True):
            if raw.count:
                return int(raw.ranges().key_lens[0])
        return None

    @property
    def key_framing(self) -> str:
        key_class = self.header.key_class
        if key_class == BYTES_WRITABLE:
            return "raw" if self.dialect == "cube" else "byteswritable"
        if key_class == TEXT:
            return "text"
        return "raw"

    @property
    def value_framing(self) -> str:
        value_class = self.header.value_class
        if self.dialect == "cube" and value_class == BYTES_WRITABLE:
            return "raw"
        if value_class == BYTES_WRITABLE:
            return "byteswritable"
        if value_class == TEXT:
            return "text"
        return "raw"

    # -- public iteration --

    def batches(self) -> Iterator[RecordBatch]:
        """Record batches of about `batch_bytes` input each, keys decoded as `key_format`.

        Keys, values and offsets are fresh arrays the caller may keep. A record that does not
        fit the key format is a SequenceFileError naming the file and the record's offset.
        Record-compressed values take their decompressed size in memory on top."""
        self._check_key_format()
        pending: list[tuple[np.ndarray, ValueColumn, np.ndarray]] = []
        pending_bytes = 0
        for raw in self._raw_chunks():
            if not raw.count:
                continue
            keys = _decode_keys(raw, self.key_format, self.key_framing, self.path)
            values = _decode_values(raw, self.value_framing, self.path)
            pending.append((keys, values, raw.offsets))
            pending_bytes += raw.input_bytes
            # Stream chunks are ~batch_bytes already (less a partial record); blocks are merged.
            if pending_bytes >= self.batch_bytes // 2:
                yield self._merge(pending)
                pending, pending_bytes = [], 0
        if pending:
            yield self._merge(pending)

    @property
    def values_in_place(self) -> bool:
        """Whether every value's bytes sit verbatim in the file (no compression), so that
        `located_batches` can say where instead of copying them."""
        return self.header.compression == "none"

    def located_batches(self) -> Iterator[LocatedBatch]:
        """Like `batches`, but each value is returned as its place in the file (an
        uncompressed file only, see `values_in_place`): keys are decoded and every record's
        framing checked as by `batches`, value bytes are not copied."""
        if not self.values_in_place:
            raise ValueError(f"{self.path}: values of a compressed file are not in place")
        self._check_key_format()
        pending: list[tuple[np.ndarray, ValueLocations, np.ndarray]] = []
        pending_bytes = 0
        for raw in self._raw_chunks():
            if not raw.count:
                continue
            keys = _decode_keys(raw, self.key_format, self.key_framing, self.path)
            located = _locate_values(raw, self.value_framing, self.path)
            pending.append((keys, located, raw.offsets))
            pending_bytes += raw.input_bytes
            if pending_bytes >= self.batch_bytes // 2:
                yield self._merge_located(pending)
                pending, pending_bytes = [], 0
        if pending:
            yield self._merge_located(pending)

    def _check_key_format(self) -> None:
        if self.key_format == "auto":
            raise SequenceFileError(
                self.path,
                self.header.data_offset,
                f"cannot choose a key format for key class {self.header.key_class}; pass "
                f"key_format (one of {', '.join(KEY_FORMATS[1:])})",
            )

    def _merge_located(
        self, parts: list[tuple[np.ndarray, ValueLocations, np.ndarray]]
    ) -> LocatedBatch:
        if len(parts) == 1:
            keys, located, offsets = parts[0]
            return LocatedBatch(keys, located, self.path, offsets)
        keys = np.concatenate([p[0] for p in parts])
        offsets = np.concatenate([p[2] for p in parts])
        starts = np.concatenate([p[1].starts for p in parts])
        width = parts[0][1].width
        if width and all(p[1].width == width for p in parts):
            located = ValueLocations(starts, width)
        else:
            lengths = np.concatenate(
                [
                    p[1].lengths if p[1].lengths is not None else np.full(len(p[1]), p[1].width)
                    for p in parts
                ]
            )
            located = ValueLocations(starts, 0, lengths.astype(np.int64, copy=False))
        return LocatedBatch(keys, located, self.path, offsets)

    def _merge(self, parts: list[tuple[np.ndarray, ValueColumn, np.ndarray]]) -> RecordBatch:
        if len(parts) == 1:
            keys, values, offsets = parts[0]
        else:
            keys = np.concatenate([p[0] for p in parts])
            values = concat_columns([p[1] for p in parts])
            offsets = np.concatenate([p[2] for p in parts])
        return RecordBatch(keys, values, self.path, offsets)

    def records(self) -> Iterator[tuple[bytes, bytes]]:
        """(key, value) payloads with the Writable framing stripped, for any key class."""
        for _offset, key, value in self.records_with_offsets():
            yield key, value

    def records_with_offsets(self) -> Iterator[tuple[int, bytes, bytes]]:
        """Like records(), with each record's file offset (block start when block-compressed)."""
        for raw in self._raw_chunks():
            if not raw.count:
                continue
            raw.ranges()
            key_starts, key_lens = _strip_framing(
                self.key_framing,
                raw.key_buf,
                raw.key_starts,
                raw.key_lens,
                raw.offsets,
                "key",
                self.path,
            )
            keys = _column(raw.key_buf, key_starts, key_lens)
            values = _decode_values(raw, self.value_framing, self.path)
            for i, offset in enumerate(raw.offsets.tolist()):
                yield offset, keys.get(i), values.get(i)

    # -- chunking --

    def _raw_chunks(self, limit_bytes: int = 0, first_only: bool = False) -> Iterator[_Raw]:
        if self.header.compression == "block":
            yield from self._block_chunks(first_only)
        else:
            yield from self._stream_chunks(limit_bytes or self.batch_bytes, first_only)

    def _stream_chunks(self, chunk_bytes: int, first_only: bool) -> Iterator[_Raw]:
        """Uncompressed and record-compressed files: chunks of whole records, the partial
        record at a chunk's end carried over to the front of the next.

        One input buffer (and one join buffer) is reused for the whole file, so each _Raw is
        valid only until the next one is requested; every consumer here decodes (copies) it
        first. Memory: about chunk_bytes, or one record when a record is larger; for
        record-compressed files about chunk_bytes of decompressed values on top."""
        file, sync = self._file, self.header.sync
        marker = SYNC_ESCAPE + sync if sync else b""
        base = self.header.data_offset  # file offset of buf[0]
        file.seek(base)
        buf = bytearray()
        scratch = _Scratch()
        carry = 0  # bytes of a partial record at buf[:carry]
        need = 0  # bytes the partial record needs in all
        fast = self.header.compression == "none"
        while True:
            remaining = max(self.file_size - base - carry, 0)
            want = min(max(chunk_bytes - carry, need - carry, 4096), remaining)
            if carry + want > len(buf):
                grown = bytearray(carry + want)
                grown[:carry] = buf[:carry]
                buf = grown
            got = _read_into(file, memoryview(buf)[carry : carry + want])
            end = carry + got
            final = got >= remaining or got < want
            raw, consumed = _fixed_chunk(buf, end, base, marker, scratch) if fast else (None, 0)
            if raw is None or (final and consumed < end):
                # The walker also finishes (or reports) whatever the fast path left at the end.
                file_left = self.file_size - base
                raw, consumed, need = _walk_chunk(buf, end, base, sync, final, self.path, file_left)
                if self.codec is not None and raw.count:
                    offsets = raw.offsets
                    raw, kept = _decompress_values(raw, self.codec, self.path, chunk_bytes)
                    if kept < offsets.shape[0]:  # over budget: carry the rest over
                        consumed, need, final = int(offsets[kept]) - base, 0, False
            else:
                need = 0
            yield raw
            if final or (first_only and raw.count):
                return
            carry = end - consumed
            buf[:carry] = buf[consumed:end]
            base += consumed

    def _block_chunks(self, first_only: bool) -> Iterator[_Raw]:
        """Block-compressed files: one _Raw per block (Hadoop blocks are ~1 MB)."""
        file, sync, codec = self._file, self.header.sync, self.codec
        assert codec is not None
        file.seek(self.header.data_offset)
        cur = _Cursor(file, self.path, self.header.data_offset, self.file_size)
        while cur.offset < self.file_size:
            block_start = cur.offset
            head = file.read(4)
            if head != SYNC_ESCAPE:  # Hadoop always writes one; a vint count never starts 0xff
                file.seek(block_start)
            else:
                cur.offset += 4
                if cur.read(SYNC_SIZE, "a sync marker") != sync:
                    raise cur.error(
                        "sync marker after the escape does not match the header's", block_start
                    )
                if cur.offset == self.file_size:
                    return
            at = cur.offset
            count = cur.read_vint("a block's record count")
            if count > MAX_BLOCK_RECORDS:
                raise cur.error(
                    f"a block's record count {count} exceeds the limit of {MAX_BLOCK_RECORDS}",
                    at,
                )
            packed = []  # (offset, compressed bytes) of each section
            for what in _BLOCK_SECTIONS:
                at = cur.offset
                size = cur.read_vint(f"the block's {what} size")
                if size > self.file_size - cur.offset:
                    raise cur.error(
                        f"truncated file: block {what} of {size} bytes run past the end", at
                    )
                if size > 2 * MAX_BLOCK_BYTES:
                    raise cur.error(
                        f"block {what} of {size} compressed bytes exceed the limit of "
                        f"{2 * MAX_BLOCK_BYTES} bytes",
                        at,
                    )
                packed.append((at, cur.read(size, f"the block's {what}")))
            key_lens, keys, val_lens, values = self._block_sections(count, packed, block_start)
            yield _Raw(
                offsets=np.full(count, block_start, dtype=np.int64),
                key_buf=np.frombuffer(keys, dtype=np.uint8),
                key_starts=_starts(key_lens),
                key_lens=key_lens,
                val_buf=np.frombuffer(values, dtype=np.uint8),
                val_starts=_starts(val_lens),
                val_lens=val_lens,
                # Count what the block holds in memory, not only its compressed size.
                input_bytes=max(cur.offset - block_start, len(keys) + len(values)),
            )
            if first_only and count:
                return

    def _block_sections(
        self, count: int, packed: list[tuple[int, bytes]], block_start: int
    ) -> tuple[np.ndarray, bytes, np.ndarray, bytes]:
        """Decompress a block's four sections, each capped before it is produced: the length
        sections at 9 bytes (the longest vint) per record, keys and values at the sums of their
        stated lengths, which together must stay within MAX_BLOCK_BYTES."""
        codec = self.codec
        assert codec is not None

        def unpack(index: int, limit: int) -> bytes:
            at, data = packed[index]
            try:
                return codec.decompress(data, limit)
            except CodecError as exc:
                raise SequenceFileError(
                    self.path, at, f"block {_BLOCK_SECTIONS[index]}: {exc}"
                ) from None

        lengths_limit = _MAX_VINT_BYTES * count
        key_lens = _vint_lengths(
            unpack(0, lengths_limit), count, "key lengths", self.path, block_start
        )
        val_lens = _vint_lengths(
            unpack(2, lengths_limit), count, "value lengths", self.path, block_start
        )
        key_total, val_total = int(key_lens.sum()), int(val_lens.sum())
        for what, total in (("keys", key_total), ("values", key_total + val_total)):
            if total > MAX_BLOCK_BYTES:
                raise SequenceFileError(
                    self.path,
                    block_start,
                    f"block {what}: their lengths add up to "
                    f"{key_total if what == 'keys' else val_total} bytes, over the limit of "
                    f"{MAX_BLOCK_BYTES} for a block's keys and values",
                )
        keys, values = unpack(1, key_total), unpack(3, val_total)
        for what, data, total in (("keys", keys, key_total), ("values", values, val_total)):
            if len(data) != total:
                raise SequenceFileError(
                    self.path,
                    block_start,
                    f"block {what} are {len(data)} bytes, their lengths add up to {total}",
                )
        return key_lens, keys, val_lens, values

    def fileno(self) -> int:
        """The open file's descriptor (to fstat the very file being read)."""
        return self._file.fileno()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> SequenceFileReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _starts(lengths: np.ndarray) -> np.ndarray:
    starts = np.zeros(lengths.shape[0], dtype=np.int64)
    if lengths.shape[0] > 1:
        np.cumsum(lengths[:-1], out=starts[1:])
    return starts


# --------------------------------------------------------------------------------------------
# Writer


def encode_header(
    key_class: str,
    value_class: str,
    compression: str = "none",
    codec_class: str | None = None,
    metadata: dict[str, str] | None = None,
    sync: bytes = b"",
) -> bytes:
    """A version-6 header, byte for byte as Hadoop's SequenceFile.Writer writes it."""
    parts = [MAGIC, bytes([CURRENT_VERSION]), encode_text(key_class), encode_text(value_class)]
    parts.append(bytes([compression != "none", compression == "block"]))
    if compression != "none":
        parts.append(encode_text(codec_class or DEFAULT_CODEC))
    items = sorted((metadata or {}).items())  # Hadoop keeps metadata in a TreeMap
    parts.append(struct.pack(">i", len(items)))
    for name, value in items:
        parts += [encode_text(name), encode_text(value)]
    parts.append(sync)
    return b"".join(parts)


class SequenceFileWriter:
    """Write a SequenceFile in the Cube dialect (raw LE uint64 keys, raw values) or as genuine
    BytesWritable/BytesWritable, uncompressed or record/block-compressed.

    Writes to a dot-prefixed temp name in the same directory and renames on close, so a reader
    never sees half a file (and directory scans that skip dot files ignore the temp)."""

    def __init__(
        self,
        path: str | os.PathLike,
        dialect: str = "cube",
        compression: str = "none",
        codec: str | None = None,
        metadata: dict[str, str] | None = None,
        sync: bytes | None = None,
        block_bytes: int = BLOCK_BYTES,
    ):
        if dialect not in DIALECTS:
            raise ValueError(f"dialect {dialect!r} is not one of {', '.join(DIALECTS)}")
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression {compression!r} is not one of {COMPRESSIONS}")
        if compression == "none" and codec is not None:
            raise ValueError("a codec needs compression 'record' or 'block'")
        self.codec = codec_by_name(codec or "default") if compression != "none" else None
        self.sync = os.urandom(SYNC_SIZE) if sync is None else bytes(sync)
        if len(self.sync) != SYNC_SIZE:
            raise ValueError(f"sync marker must be {SYNC_SIZE} bytes, got {len(self.sync)}")
        self.path = Path(path)
        self.dialect = dialect
        self.compression = compression
        self.block_bytes = block_bytes
        self._escape = SYNC_ESCAPE + self.sync
        self._tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        self._out = open(self._tmp, "wb")  # noqa: SIM115 - closed in close()/abort()
        header = encode_header(
            BYTES_WRITABLE,
            BYTES_WRITABLE,
            compression,
            self.codec.class_name if self.codec else None,
            metadata,
            self.sync,
        )
        self._out.write(header)
        self._pos = len(header)
        self._since_sync = 0  # Cube rule: record bytes since the last sync escape
        # Hadoop rule: file position of the last sync escape. Hadoop's Writer starts it at 0,
        # not at the header's end (its Snappy file in tests/data/hadoop_written has its first
        # escape at 102428, before 102400 + its 137-byte header).
        self._last_sync = 0
        self._block: list[bytearray] = [bytearray(), bytearray(), bytearray(), bytearray()]
        self._block_records = 0
        self.count = 0
        self._closed = False

    # -- single records --

    def _key_bytes(self, key: int) -> bytes:
        if not 0 <= key < 1 << 64:
            raise ValueError(f"key {key} is not a uint64")
        if self.dialect == "cube":
            return struct.pack("<Q", key)
        return struct.pack(">IQ", 8, key)

    def _value_bytes(self, value: bytes) -> bytes:
        if self.dialect == "cube":
            return bytes(value)
        return struct.pack(">I", len(value)) + bytes(value)

    def write(self, key: int, value: bytes) -> None:
        key_bytes = self._key_bytes(int(key))
        value_bytes = self._value_bytes(value)
        if self.compression == "block":
            self._append_to_block(key_bytes, value_bytes)
        else:
            if self.compression == "record":
                value_bytes = self.codec.compress(value_bytes)
            self._write_record(key_bytes, value_bytes)
        self.count += 1

    def _write_record(self, key_bytes: bytes, value_bytes: bytes) -> None:
        record_len = len(key_bytes) + len(value_bytes)
        if self.dialect == "byteswritable" and self._pos >= self._last_sync + HADOOP_SYNC_INTERVAL:
            self._write_sync()
        data = struct.pack(">ii", record_len, len(key_bytes)) + key_bytes + value_bytes
        self._out.write(data)
        self._pos += len(data)
        if self.dialect == "cube":
            self._since_sync += record_len
            if self._since_sync >= CUBE_SYNC_INTERVAL:
                self._write_sync()

    def _write_sync(self) -> None:
        self._out.write(self._escape)
        self._pos += len(self._escape)
        self._last_sync = self._pos
        self._since_sync = 0

    def _append_to_block(self, key_bytes: bytes, value_bytes: bytes) -> None:
        key_lens, keys, value_lens, values = self._block
        key_lens += encode_vint(len(key_bytes))
        keys += key_bytes
        value_lens += encode_vint(len(value_bytes))
        values += value_bytes
        self._block_records += 1
        if len(keys) + len(values) >= self.block_bytes:
            self._flush_block()

    def _flush_block(self) -> None:
        if not self._block_records:
            return
        parts = [self._escape, encode_vint(self._block_records)]
        for buffer in self._block:
            packed = self.codec.compress(bytes(buffer))
            parts += [encode_vint(len(packed)), packed]
        data = b"".join(parts)
        self._out.write(data)
        self._pos += len(data)
        self._last_sync = self._pos
        self._block = [bytearray(), bytearray(), bytearray(), bytearray()]
        self._block_records = 0

    # -- batches --

    def write_batch(self, keys: np.ndarray, values: ValueColumn) -> None:
        """Many records; one numpy pass for the common case (uncompressed, fixed width)."""
        keys = np.asarray(keys)
        if keys.shape[0] != values.count:
            raise ValueError(f"{keys.shape[0]} keys but {values.count} values")
        if keys.dtype.kind not in "iu":  # a float cast truncates, and loses ids past 2**53
            raise ValueError(f"keys must be an integer array (uint64), got {keys.dtype}")
        if keys.dtype != np.uint64:
            if keys.size and (keys.min() < 0):
                raise ValueError("keys must be uint64 (found a negative key)")
            keys = keys.astype(np.uint64)
        if self.compression == "none" and values.width and keys.shape[0]:
            self._write_fixed(keys, values)
            return
        for i in range(keys.shape[0]):
            self.write(int(keys[i]), values.get(i))

    def _write_fixed(self, keys: np.ndarray, values: ValueColumn) -> None:
        n, width = keys.shape[0], values.width
        if self.dialect == "cube":
            key_cols = keys.astype("<u8").view(np.uint8).reshape(n, 8)
            value_prefix = b""
        else:
            key_cols = np.empty((n, 12), dtype=np.uint8)
            key_cols[:, :4] = np.frombuffer(struct.pack(">I", 8), dtype=np.uint8)
            key_cols[:, 4:] = keys.astype(">u8").view(np.uint8).reshape(n, 8)
            value_prefix = struct.pack(">I", width)
        key_len = key_cols.shape[1]
        record_len = key_len + len(value_prefix) + width
        stride = 8 + record_len
        rows = np.empty((n, stride), dtype=np.uint8)
        rows[:, :8] = np.frombuffer(struct.pack(">ii", record_len, key_len), dtype=np.uint8)
        rows[:, 8 : 8 + key_len] = key_cols
        at = 8 + key_len
        if value_prefix:
            rows[:, at : at + 4] = np.frombuffer(value_prefix, dtype=np.uint8)
            at += 4
        rows[:, at:] = values.as_rows()
        # Sync escapes go before record indices first, first + every, first + 2 * every, ...
        if self.dialect == "cube":  # after the record that brings the total to >= interval
            every = -(-CUBE_SYNC_INTERVAL // record_len)
            first = -(-(CUBE_SYNC_INTERVAL - self._since_sync) // record_len)
            lo, hi = 1, n
        else:  # before a record that starts >= interval past the last escape
            every = -(-HADOOP_SYNC_INTERVAL // stride)
            first = max(0, -(-(self._last_sync + HADOOP_SYNC_INTERVAL - self._pos) // stride))
            lo, hi = 0, n - 1
        cuts = list(range(first, hi + 1, every)) if first >= lo else []
        self._write_rows_with_escapes(rows, cuts, every)
        last_cut = cuts[-1] if cuts else None
        if self.dialect == "cube":
            done = n - last_cut if last_cut is not None else n
            self._since_sync = (0 if last_cut is not None else self._since_sync) + done * record_len
        else:
            if last_cut is not None:
                self._last_sync = self._pos - (n - last_cut) * stride
        self.count += n

    def _write_rows_with_escapes(self, rows: np.ndarray, cuts: list[int], every: int) -> None:
        """Write `rows` with a sync escape before each index in `cuts` (evenly spaced)."""
        n, stride = rows.shape
        flat = rows.reshape(-1)
        if not cuts:
            self._out.write(flat.data)
            self._pos += flat.nbytes
            return
        escape = np.frombuffer(self._escape, dtype=np.uint8)
        first = cuts[0]
        self._out.write(flat[: first * stride].data)
        # Full groups of `every` records after each escape, laid out in one array.
        groups = min(len(cuts), (n - first) // every)
        if groups:
            block = np.empty((groups, len(escape) + every * stride), dtype=np.uint8)
            block[:, : len(escape)] = escape
            block[:, len(escape) :] = rows[first : first + groups * every].reshape(groups, -1)
            self._out.write(block.data)
        tail_cuts = cuts[groups:]
        at = first + groups * every
        for cut in tail_cuts:
            self._out.write(flat[at * stride : cut * stride].data)
            self._out.write(self._escape)
            at = cut
        self._out.write(flat[at * stride :].data)
        self._pos += flat.nbytes + len(cuts) * len(escape)

    # -- lifecycle --

    def close(self) -> None:
        """Flush, then rename the temp file into place."""
        if self._closed:
            return
        if self.compression == "block":
            self._flush_block()
        self._out.close()
        os.replace(self._tmp, self.path)
        self._closed = True

    def abort(self) -> None:
        """Drop the temp file; the target path is left as it was."""
        if self._closed:
            return
        self._out.close()
        self._tmp.unlink(missing_ok=True)
        self._closed = True

    def __enter__(self) -> SequenceFileWriter:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
