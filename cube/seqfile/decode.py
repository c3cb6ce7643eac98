"""Keys and values out of raw records: Writable framing checked and stripped (raw, BytesWritable,
Text), keys as uint64 in a key format, values as a ValueColumn or as their places in the
file.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from cube.seqfile.base import _MAX_VINT_BYTES, SequenceFileError, ValueLocations
from cube.seqfile.records import _Raw
from cube.values import ValueColumn, gather_ranges


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
        ranges = raw.ranges()  # a chunk without a fixed layout has them
        bad = np.flatnonzero(ranges.key_lens != width)
        if bad.size:
            i = int(bad[0])
            message = _key_width_error(fmt, int(ranges.key_lens[i]))
            raise SequenceFileError(path, int(raw.offsets[i]), message)
        matrix = ranges.key_buf[ranges.key_starts[:, None] + np.arange(width)]
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
    ranges = raw.ranges()
    starts, lens = _strip_framing(
        framing, ranges.key_buf, ranges.key_starts, ranges.key_lens, raw.offsets, "key", path
    )
    keys = np.empty(starts.shape[0], dtype=np.uint64)
    blob = ranges.key_buf
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
                # the generic decoder reports the first bad record
                return _decode_values_generic(raw, framing, path)
            start, width = start + 4, width - 4
        if width == 0:
            return ValueColumn.variable(np.empty(0, np.uint8), np.zeros(raw.count + 1, np.int64))
        return ValueColumn.fixed(fixed.gather(start, f"V{width}").view(np.uint8), width)
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
    ranges = raw.ranges()
    starts, lens = _strip_framing(
        framing, ranges.val_buf, ranges.val_starts, ranges.val_lens, raw.offsets, "value", path
    )
    # key_starts - 8 is where each record starts in the chunk, raw.offsets in the file
    starts = starts + (raw.offsets - ranges.key_starts + 8)
    width = int(lens[0]) if lens.shape[0] else 0
    if width and (lens == width).all():
        return ValueLocations(starts, width)
    return ValueLocations(starts, 0, lens)


def _decode_values_generic(raw: _Raw, framing: str, path: str) -> ValueColumn:
    ranges = raw.ranges()
    starts, lens = _strip_framing(
        framing, ranges.val_buf, ranges.val_starts, ranges.val_lens, raw.offsets, "value", path
    )
    return _column(ranges.val_buf, starts, lens)


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
    order: Literal["little", "big"] = "little" if key_format in ("cube", "bytes_le") else "big"
    return int.from_bytes(key, order)
