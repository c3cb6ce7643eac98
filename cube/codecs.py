"""Hadoop compression codecs a SequenceFile may name, as pure bytes -> bytes functions.

A SequenceFile header names its codec by Java class. Record compression compresses each value on
its own; block compression compresses each of a block's four buffers on its own, so every codec
here only needs whole-buffer `compress` / `decompress`. Decoding errors raise `CodecError`; the
SequenceFile reader adds the file name and offset.

Lz4 and Snappy use Hadoop's block framing (BlockCompressorStream), not their own frame formats:
per block a big-endian uint32 uncompressed length, then chunks of big-endian uint32 compressed
length + one raw lz4 / snappy block each, until the chunks add up to the block's length. One
framing function serves both, given the raw block codec.

ZStandard is not framed by Hadoop (its codec writes through a plain CompressorStream): the bytes
are standard zstd frames, one per compressed buffer, and a reader accepts several concatenated.

`decompress(data, limit)` refuses (CodecError) output past `limit` bytes before producing it, so
a small hostile buffer (a "decompression bomb", an lz4 or snappy header claiming 4 GB, a zstd
frame stating a huge content size or none at all) costs at most `limit` bytes of memory; the
SequenceFile reader always passes one.

Libraries, imported on first use so that the SDK and the formats install without them (they
come with cube-py[builder]): `lz4` for Lz4Codec, `cramjam` for Snappy and ZStandard. cramjam is
one well-kept wheel (Rust, no system library) with both raw snappy blocks (Hadoop's framing
needs raw blocks, not snappy's framed format) and zstd, and its `decompress_into` decodes zstd
as a stream into a buffer the caller sizes, failing when the buffer is full: that is what bounds
zstd output (its `output_len` is only a size hint, and its streaming Decompressor collects
everything). The snappy raw format states its length up front, checked before decoding.
"""

from __future__ import annotations

import bz2
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

import numpy as np

DEFAULT_CODEC = "org.apache.hadoop.io.compress.DefaultCodec"
GZIP_CODEC = "org.apache.hadoop.io.compress.GzipCodec"
BZIP2_CODEC = "org.apache.hadoop.io.compress.BZip2Codec"
LZ4_CODEC = "org.apache.hadoop.io.compress.Lz4Codec"
SNAPPY_CODEC = "org.apache.hadoop.io.compress.SnappyCodec"
ZSTD_CODEC = "org.apache.hadoop.io.compress.ZStandardCodec"

# Hadoop's io.compression.codec.{lz4,snappy}.buffersize default, and the input share of it that
# BlockCompressorStream compresses per chunk: the buffer less the codec's worst-case growth.
_HADOOP_BUFFER = 256 * 1024
_LZ4_MAX_INPUT = _HADOOP_BUFFER - (_HADOOP_BUFFER // 255 + 16)
_SNAPPY_MAX_INPUT = _HADOOP_BUFFER - (_HADOOP_BUFFER // 6 + 32)
# Hadoop's io.compression.codec.zstd.level default.
_ZSTD_LEVEL = 3
# zstd frame layout (RFC 8878): the frame magic, skippable frames' magic (low 4 bits free), and
# the most one block decompresses to (Block_Maximum_Size never exceeds it).
_ZSTD_MAGIC = 0xFD2FB528
_ZSTD_SKIPPABLE_MAGIC = 0x184D2A50
_ZSTD_MAX_BLOCK = 128 * 1024


class CodecError(ValueError):
    """Compressed bytes that do not decode; the message says what is wrong."""


def _lz4_block() -> ModuleType:
    """The lz4 package, imported on first use: the SDK and the formats install without it
    (it comes with cube-py[builder]); only an Lz4Codec file needs it."""
    try:
        import lz4.block
    except ImportError:
        raise CodecError(
            "an Lz4Codec SequenceFile needs the lz4 package: pip install 'cube-py[builder]'"
        ) from None
    block: ModuleType = lz4.block  # untyped: no stubs
    return block


def _cramjam(codec: str) -> ModuleType:
    """The cramjam package, imported on first use like lz4; only SnappyCodec and ZStandardCodec
    files need it."""
    try:
        import cramjam
    except ImportError:
        raise CodecError(
            f"a {codec} SequenceFile needs the cramjam package: pip install 'cube-py[builder]'"
        ) from None
    return cramjam


class Decompress(Protocol):
    def __call__(self, data: bytes, limit: int | None = None) -> bytes: ...


@dataclass(frozen=True)
class Codec:
    name: str  # short name: default, gzip, bzip2, lz4, snappy, zstd
    class_name: str  # the Java class a SequenceFile header carries
    compress: Callable[[bytes], bytes]
    decompress: Decompress  # (data, limit=None): CodecError past `limit` output bytes


def _too_much(what: str, limit: int) -> CodecError:
    return CodecError(f"{what} data decompresses to more than {limit} bytes")


def _streams(data: bytes, new_decoder: Callable[..., Any], what: str, limit: int | None) -> bytes:
    """Decode one or more concatenated streams (Hadoop's streams may be concatenated), never
    producing more than limit + 1 bytes. Each pass ends one stream, so the loop is bounded by
    the input's length."""
    parts = []
    produced = 0
    rest = bytes(data)
    while rest:
        decoder = new_decoder()
        # Room for one byte past the limit, to tell "exactly the limit" from "more".
        room = -1 if limit is None else limit - produced + 1
        try:
            part = decoder.decompress(rest, room) if room > 0 else decoder.decompress(rest)
        except (zlib.error, OSError, ValueError, EOFError) as exc:
            raise CodecError(f"bad {what} data: {exc}") from None
        produced += len(part)
        if limit is not None and produced > limit:
            raise _too_much(what, limit)
        if not decoder.eof:  # below the room, so all input was used up inside the stream
            raise CodecError(f"truncated {what} stream")
        parts.append(part)
        rest = decoder.unused_data
    return b"".join(parts)


def _zlib_decompress(data: bytes, wbits: int, what: str, limit: int | None) -> bytes:
    return _streams(data, lambda: zlib.decompressobj(wbits), what, limit)


def _deflate(data: bytes) -> bytes:
    return zlib.compress(data)


def _inflate(data: bytes, limit: int | None = None) -> bytes:
    return _zlib_decompress(data, zlib.MAX_WBITS, "zlib", limit)


def _gzip(data: bytes) -> bytes:
    encoder = zlib.compressobj(wbits=16 + zlib.MAX_WBITS)
    return encoder.compress(data) + encoder.flush()


def _gunzip(data: bytes, limit: int | None = None) -> bytes:
    return _zlib_decompress(data, 16 + zlib.MAX_WBITS, "gzip", limit)


def _bzip2(data: bytes) -> bytes:
    return bz2.compress(data, 9)


def _bunzip2(data: bytes, limit: int | None = None) -> bytes:
    return _streams(data, bz2.BZ2Decompressor, "bzip2", limit)


# --------------------------------------------------------------------------------------------
# Hadoop's block framing, around raw lz4 or snappy blocks


@dataclass(frozen=True)
class _RawBlocks:
    """A raw block codec that Hadoop's BlockCompressorStream frames."""

    name: str  # for messages
    max_input: int  # bytes compressed into one chunk
    compress: Callable[[memoryview], bytes]
    # (chunk, room) -> the chunk's bytes; CodecError when bad or when they would pass `room`,
    # which is checked before the output is allocated.
    decompress: Callable[[bytes, int], bytes]


def _lz4_compress_chunk(piece: memoryview) -> bytes:
    packed: bytes = _lz4_block().compress(piece, store_size=False)
    return packed


def _lz4_decompress_chunk(chunk: bytes, room: int) -> bytes:
    lz4_block = _lz4_block()
    try:  # lz4 stops at uncompressed_size: a chunk that needs more is an error
        piece: bytes = lz4_block.decompress(chunk, uncompressed_size=room)
    except lz4_block.LZ4BlockError as exc:
        raise CodecError(str(exc)) from None
    return piece


def _snappy_compress_chunk(piece: memoryview) -> bytes:
    return bytes(_cramjam("SnappyCodec").snappy.compress_raw(piece))


def _snappy_decompress_chunk(chunk: bytes, room: int) -> bytes:
    """A raw snappy block starts with its uncompressed length (a varint); it is checked
    against `room` before snappy allocates it, and snappy checks the block produces exactly
    that many bytes."""
    cramjam = _cramjam("SnappyCodec")
    try:
        size = cramjam.snappy.decompress_raw_len(chunk)
        if size > room:
            raise CodecError(f"it states {size} bytes, more than the {room} left in its block")
        return bytes(cramjam.snappy.decompress_raw(chunk))
    except cramjam.DecompressionError as exc:
        raise CodecError(str(exc)) from None


_LZ4_BLOCKS = _RawBlocks("lz4", _LZ4_MAX_INPUT, _lz4_compress_chunk, _lz4_decompress_chunk)
_SNAPPY_BLOCKS = _RawBlocks(
    "snappy", _SNAPPY_MAX_INPUT, _snappy_compress_chunk, _snappy_decompress_chunk
)


def _hadoop_blocks_compress(data: bytes, raw: _RawBlocks) -> bytes:
    """Hadoop's block framing: one block per `max_input` slice, one chunk per block (Hadoop
    itself may put several chunks in a block; readers take both)."""
    out = []
    view = memoryview(data)
    for start in range(0, len(data), raw.max_input):
        piece = view[start : start + raw.max_input]
        packed = raw.compress(piece)
        out.append(struct.pack(">II", len(piece), len(packed)))
        out.append(packed)
    return b"".join(out)


def _hadoop_blocks_decompress(data: bytes, limit: int | None, raw: _RawBlocks) -> bytes:
    """Undo Hadoop's block framing; every chunk is an independent raw block. A block's stated
    length is checked against `limit` before anything is decoded, and each chunk against what
    is left of its block."""
    name = raw.name
    out = []
    pos, end = 0, len(data)
    total = 0
    while pos < end:  # every pass consumes at least 4 bytes
        if end - pos < 4:
            raise CodecError(f"{name}: truncated block header at byte {pos}")
        (block_len,) = struct.unpack_from(">I", data, pos)
        if limit is not None and block_len > limit - total:
            raise CodecError(
                f"{name} data decompresses to more than {limit} bytes "
                f"(block of {block_len} bytes at byte {pos})"
            )
        total += block_len
        pos += 4
        produced = 0
        while produced < block_len:
            if end - pos < 4:
                raise CodecError(f"{name}: truncated chunk header at byte {pos}")
            (chunk_len,) = struct.unpack_from(">I", data, pos)
            pos += 4
            if chunk_len > end - pos:
                raise CodecError(f"{name}: chunk of {chunk_len} bytes at byte {pos} is truncated")
            try:
                piece = raw.decompress(data[pos : pos + chunk_len], block_len - produced)
            except CodecError as exc:
                raise CodecError(f"{name}: bad chunk at byte {pos}: {exc}") from None
            pos += chunk_len
            if not piece:
                raise CodecError(f"{name}: empty chunk at byte {pos - chunk_len}")
            produced += len(piece)
            out.append(piece)
    return b"".join(out)


def lz4_hadoop_compress(data: bytes) -> bytes:
    """Hadoop Lz4Codec framing around raw lz4 blocks."""
    return _hadoop_blocks_compress(data, _LZ4_BLOCKS)


def lz4_hadoop_decompress(data: bytes, limit: int | None = None) -> bytes:
    return _hadoop_blocks_decompress(data, limit, _LZ4_BLOCKS)


def snappy_hadoop_compress(data: bytes) -> bytes:
    """Hadoop SnappyCodec framing around raw snappy blocks (not snappy's framed format)."""
    return _hadoop_blocks_compress(data, _SNAPPY_BLOCKS)


def snappy_hadoop_decompress(data: bytes, limit: int | None = None) -> bytes:
    return _hadoop_blocks_decompress(data, limit, _SNAPPY_BLOCKS)


# --------------------------------------------------------------------------------------------
# ZStandard: plain zstd frames


def zstd_compress(data: bytes) -> bytes:
    """One zstd frame at Hadoop's default level. It states its content size (Hadoop's own
    frames do not), which lets a reader size its buffer exactly."""
    return bytes(_cramjam("ZStandardCodec").zstd.compress(data, level=_ZSTD_LEVEL))


def _zstd_bound(data: bytes, limit: int | None) -> int:
    """The most the zstd frames in `data` can decompress to, from their headers alone: a frame
    that states its content size is held to it by the decoder; otherwise raw and RLE blocks
    state their size and a compressed block gives at most 128 KiB. Stated content sizes past
    `limit` are refused here, before anything is decoded; a frame cut short, or bytes that are
    no frame, are a CodecError at their byte. One step per frame and per block (<= 128 KiB)."""
    pos, end = 0, len(data)
    bound = stated = 0
    while pos < end:
        start = pos
        if end - pos < 4:
            raise CodecError(f"zstd: truncated frame at byte {start}")
        (magic,) = struct.unpack_from("<I", data, pos)
        if magic & ~0xF == _ZSTD_SKIPPABLE_MAGIC:  # user data a decoder skips
            if end - pos < 8:
                raise CodecError(f"zstd: truncated skippable frame at byte {start}")
            (size,) = struct.unpack_from("<I", data, pos + 4)
            if size > end - pos - 8:
                raise CodecError(f"zstd: truncated skippable frame at byte {start}")
            pos += 8 + size
            continue
        if magic != _ZSTD_MAGIC:
            raise CodecError(f"zstd: no zstd frame at byte {start} (magic {magic:#010x})")
        pos += 4
        if pos == end:
            raise CodecError(f"zstd: truncated frame header at byte {start}")
        descriptor = data[pos]
        pos += 1
        if descriptor & 0x08:
            raise CodecError(f"zstd: reserved bit set in the frame header at byte {start}")
        single_segment = descriptor & 0x20
        has_checksum = descriptor & 0x04
        fcs_size = (1 if single_segment else 0, 2, 4, 8)[descriptor >> 6]
        skip = (0 if single_segment else 1) + (0, 1, 2, 4)[descriptor & 3]  # window, dict id
        if skip + fcs_size > end - pos:
            raise CodecError(f"zstd: truncated frame header at byte {start}")
        pos += skip
        content = None
        if fcs_size:
            content = int.from_bytes(data[pos : pos + fcs_size], "little")
            content += 256 if fcs_size == 2 else 0
            pos += fcs_size
            stated += content
            if limit is not None and stated > limit:
                raise CodecError(
                    f"zstd data decompresses to more than {limit} bytes "
                    f"(frame at byte {start} states {content} bytes)"
                )
        blocks = 0
        last = 0
        while not last:
            if end - pos < 3:
                raise CodecError(f"zstd: truncated block header at byte {pos}")
            head = int.from_bytes(data[pos : pos + 3], "little")
            last, kind, size = head & 1, head >> 1 & 3, head >> 3
            if kind == 3:
                raise CodecError(f"zstd: reserved block type at byte {pos}")
            wire = 1 if kind == 1 else size  # an RLE block is one byte repeated `size` times
            if wire > end - pos - 3:
                raise CodecError(f"zstd: block of {wire} bytes at byte {pos} is truncated")
            pos += 3 + wire
            blocks += _ZSTD_MAX_BLOCK if kind == 2 else size
        if has_checksum:
            if end - pos < 4:
                raise CodecError(f"zstd: truncated frame checksum at byte {pos}")
            pos += 4
        bound += blocks if content is None else min(content, blocks)
    return bound


def zstd_decompress(data: bytes, limit: int | None = None) -> bytes:
    """One or more concatenated zstd frames (skippable frames skipped), decoded into a buffer
    of at most limit + 1 bytes (less when the frame headers bound the output lower), so that a
    frame with a huge or no stated content size costs no more: the decoder streams into the
    buffer and fails when it is full."""
    if not data:
        return b""
    cramjam = _cramjam("ZStandardCodec")
    bound = _zstd_bound(data, limit)
    room = bound if limit is None else min(bound, limit + 1)
    out = np.empty(room, np.uint8)  # not zero-filled: a 64 MB bound costs no page until used
    try:
        size = cramjam.zstd.decompress_into(data, out)
    except cramjam.DecompressionError as exc:
        if "whole buffer" not in str(exc):
            raise CodecError(f"bad zstd data: {exc}") from None
        if limit is not None and room > limit:
            raise _too_much("zstd", limit) from None
        raise CodecError(
            f"bad zstd data: its frames decode to more than the {bound} bytes their headers state"
        ) from None
    if limit is not None and size > limit:
        raise _too_much("zstd", limit)
    return out[:size].tobytes()


CODECS: dict[str, Codec] = {
    codec.class_name: codec
    for codec in (
        Codec("default", DEFAULT_CODEC, _deflate, _inflate),
        Codec("gzip", GZIP_CODEC, _gzip, _gunzip),
        Codec("bzip2", BZIP2_CODEC, _bzip2, _bunzip2),
        Codec("lz4", LZ4_CODEC, lz4_hadoop_compress, lz4_hadoop_decompress),
        Codec("snappy", SNAPPY_CODEC, snappy_hadoop_compress, snappy_hadoop_decompress),
        Codec("zstd", ZSTD_CODEC, zstd_compress, zstd_decompress),
    )
}
_BY_SHORT_NAME = {codec.name: codec for codec in CODECS.values()}
# DeflateCodec is Hadoop's DefaultCodec under another name (same zlib streams).
CODECS["org.apache.hadoop.io.compress.DeflateCodec"] = CODECS[DEFAULT_CODEC]


def codec_for_class(class_name: str) -> Codec | None:
    """The codec a header names, or None when it is not supported."""
    return CODECS.get(class_name)


def codec_by_name(name: str) -> Codec:
    """A codec by short name (default, gzip, bzip2, lz4, snappy, zstd) or Java class name, for
    writers."""
    codec = _BY_SHORT_NAME.get(name) or CODECS.get(name)
    if codec is None:
        known = ", ".join(sorted(_BY_SHORT_NAME))
        raise ValueError(f"unknown codec {name!r}; supported: {known} (or their Java class names)")
    return codec
