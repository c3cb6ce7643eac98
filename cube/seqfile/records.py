"""Raw records: where each key and value of a chunk of a file sits, before any Writable framing
is stripped. A chunk whose records all share one layout is parsed with numpy in a few passes
(`_fixed_chunk`); anything else is walked record by record (`_walk_chunk`), which also gives
the precise error for bad input.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from io import BufferedReader

import numpy as np

import cube.seqfile.limits as limits
from cube.codecs import Codec, CodecError
from cube.seqfile.base import SYNC_ESCAPE, SYNC_SIZE, SequenceFileError, decode_vint


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


@dataclass(frozen=True)
class _Ranges:
    """A chunk's records as generic byte ranges: int64 starts and lengths into uint8 buffers."""

    key_buf: np.ndarray
    key_starts: np.ndarray
    key_lens: np.ndarray
    val_buf: np.ndarray
    val_starts: np.ndarray
    val_lens: np.ndarray


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

    def ranges(self) -> _Ranges:
        """The generic byte ranges, filled from the fixed layout first when the chunk has one
        (for the less common decoders)."""
        if self.key_starts is None and self.fixed is not None:
            fixed, n = self.fixed, self.count
            flat = fixed.gather(0, f"V{fixed.stride}").view(np.uint8)
            starts = np.arange(n, dtype=np.int64) * fixed.stride
            self.key_buf = self.val_buf = flat
            self.key_starts = starts + 8
            self.key_lens = np.full(n, fixed.key_len, dtype=np.int64)
            self.val_starts = starts + 8 + fixed.key_len
            self.val_lens = np.full(n, fixed.stride - 8 - fixed.key_len, dtype=np.int64)
        key_buf, key_starts, key_lens = self.key_buf, self.key_starts, self.key_lens
        val_buf, val_starts, val_lens = self.val_buf, self.val_starts, self.val_lens
        if (
            key_buf is None
            or key_starts is None
            or key_lens is None
            or val_buf is None
            or val_starts is None
            or val_lens is None
        ):
            raise AssertionError("a chunk holds neither byte ranges nor a fixed layout")
        return _Ranges(key_buf, key_starts, key_lens, val_buf, val_starts, val_lens)


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
    if record_len < 0 or not 0 <= key_len <= record_len or record_len > limits.MAX_RECORD_BYTES:
        return None, 0  # the walker reports it
    stride = record_len + 8
    header = bytes(buf[pos : pos + 8])
    first = buf.find(marker, pos, end) if marker else -1
    parts: list[tuple[int, int, int, int]] | None
    if first < 0:
        parts = [(pos, 1, (end - pos) // stride, 0)]
    else:
        parts = _regular_parts(buf, end, pos, first, stride, marker)
    fixed: _Fixed
    joined: _Joined | None = None
    if parts is not None:
        last_offset, _, last_count, _ = parts[-1]
        consumed = last_offset + last_count * stride
        fixed = _Fixed(buf, [p for p in parts if p[1] * p[2]], stride, key_len)
    else:
        joined = _joined_segments(buf, end, pos, first, stride, marker, scratch, key_len)
        if joined is None:
            return None, 0
        fixed = joined
    total = fixed.count
    if total == 0 or not fixed.all_headers_equal(header):
        return None, 0
    if joined is None:
        offsets = fixed.offsets(base)
    else:
        offsets, consumed = joined.offsets_in_file, joined.consumed
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
    offsets_in_file: np.ndarray
    consumed: int


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
        if record_len > limits.MAX_RECORD_BYTES:
            problem = (
                f"record length {record_len} exceeds the limit of {limits.MAX_RECORD_BYTES} bytes"
            )
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


def _read_into(file: BufferedReader, target: memoryview) -> int:
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
    ranges = raw.ranges()
    buf = ranges.val_buf
    parts = []
    total = 0
    for i, (start, length) in enumerate(
        zip(ranges.val_starts.tolist(), ranges.val_lens.tolist(), strict=True)
    ):
        if total >= budget:
            break
        try:
            part = codec.decompress(buf[start : start + length].tobytes(), limits.MAX_RECORD_BYTES)
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
    raw.key_starts, raw.key_lens = ranges.key_starts[:kept], ranges.key_lens[:kept]
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
