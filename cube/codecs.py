"""Hadoop compression codecs a SequenceFile may name, as pure bytes -> bytes functions.

A SequenceFile header names its codec by Java class. Record compression compresses each value on
its own; block compression compresses each of a block's four buffers on its own, so every codec
here only needs whole-buffer `compress` / `decompress`. Decoding errors raise `CodecError`; the
SequenceFile reader adds the file name and offset.

Lz4 uses Hadoop's block framing (BlockCompressorStream), not the lz4 frame format: per block a
big-endian uint32 uncompressed length, then chunks of big-endian uint32 compressed length + one
raw lz4 block each, until the chunks add up to the block's length.

`decompress(data, limit)` refuses (CodecError) output past `limit` bytes before producing it, so
a small hostile buffer (a "decompression bomb", or an lz4 header claiming 4 GB) costs at most
`limit` bytes of memory; the SequenceFile reader always passes one.
"""

from __future__ import annotations

import bz2
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Protocol

DEFAULT_CODEC = "org.apache.hadoop.io.compress.DefaultCodec"
GZIP_CODEC = "org.apache.hadoop.io.compress.GzipCodec"
BZIP2_CODEC = "org.apache.hadoop.io.compress.BZip2Codec"
LZ4_CODEC = "org.apache.hadoop.io.compress.Lz4Codec"

# Hadoop's io.compression.codec.lz4.buffersize default, and the input share of it that
# BlockCompressorStream compresses per chunk (buffer minus lz4's worst-case overhead).
_LZ4_BUFFER = 256 * 1024
_LZ4_MAX_INPUT = _LZ4_BUFFER - (_LZ4_BUFFER // 255 + 16)


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
    return lz4.block


class Decompress(Protocol):
    def __call__(self, data: bytes, limit: int | None = None) -> bytes: ...


@dataclass(frozen=True)
class Codec:
    name: str  # short name: default, gzip, bzip2, lz4
    class_name: str  # the Java class a SequenceFile header carries
    compress: Callable[[bytes], bytes]
    decompress: Decompress  # (data, limit=None): CodecError past `limit` output bytes


def _too_much(what: str, limit: int) -> CodecError:
    return CodecError(f"{what} data decompresses to more than {limit} bytes")


def _streams(data: bytes, new_decoder: Callable, what: str, limit: int | None) -> bytes:
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


def lz4_hadoop_compress(data: bytes) -> bytes:
    """Hadoop Lz4Codec framing: one block per MAX_INPUT slice, one chunk per block."""
    lz4_block = _lz4_block()
    out = []
    view = memoryview(data)
    for start in range(0, len(data), _LZ4_MAX_INPUT):
        piece = view[start : start + _LZ4_MAX_INPUT]
        packed = lz4_block.compress(piece, store_size=False)
        out.append(struct.pack(">II", len(piece), len(packed)))
        out.append(packed)
    return b"".join(out)


def lz4_hadoop_decompress(data: bytes, limit: int | None = None) -> bytes:
    """Undo Hadoop's block framing; every chunk is an independent raw lz4 block. A block's
    stated length is checked against `limit` before lz4 allocates it."""
    lz4_block = _lz4_block()
    out = []
    pos, end = 0, len(data)
    total = 0
    while pos < end:  # every pass consumes at least 4 bytes
        if end - pos < 4:
            raise CodecError(f"lz4: truncated block header at byte {pos}")
        (block_len,) = struct.unpack_from(">I", data, pos)
        if limit is not None and block_len > limit - total:
            raise CodecError(
                f"lz4 data decompresses to more than {limit} bytes "
                f"(block of {block_len} bytes at byte {pos})"
            )
        total += block_len
        pos += 4
        produced = 0
        while produced < block_len:
            if end - pos < 4:
                raise CodecError(f"lz4: truncated chunk header at byte {pos}")
            (chunk_len,) = struct.unpack_from(">I", data, pos)
            pos += 4
            if chunk_len > end - pos:
                raise CodecError(f"lz4: chunk of {chunk_len} bytes at byte {pos} is truncated")
            try:
                piece = lz4_block.decompress(
                    data[pos : pos + chunk_len], uncompressed_size=block_len - produced
                )
            except lz4_block.LZ4BlockError as exc:
                raise CodecError(f"lz4: bad chunk at byte {pos}: {exc}") from None
            pos += chunk_len
            if not piece:
                raise CodecError(f"lz4: empty chunk at byte {pos - chunk_len}")
            produced += len(piece)
            out.append(piece)
    return b"".join(out)


CODECS: dict[str, Codec] = {
    codec.class_name: codec
    for codec in (
        Codec("default", DEFAULT_CODEC, _deflate, _inflate),
        Codec("gzip", GZIP_CODEC, _gzip, _gunzip),
        Codec("bzip2", BZIP2_CODEC, _bzip2, _bunzip2),
        Codec("lz4", LZ4_CODEC, lz4_hadoop_compress, lz4_hadoop_decompress),
    )
}
_BY_SHORT_NAME = {codec.name: codec for codec in CODECS.values()}
# DeflateCodec is Hadoop's DefaultCodec under another name (same zlib streams).
CODECS["org.apache.hadoop.io.compress.DeflateCodec"] = CODECS[DEFAULT_CODEC]


def codec_for_class(class_name: str) -> Codec | None:
    """The codec a header names, or None when it is not supported."""
    return CODECS.get(class_name)


def codec_by_name(name: str) -> Codec:
    """A codec by short name (default, gzip, bzip2, lz4) or Java class name, for writers."""
    codec = _BY_SHORT_NAME.get(name) or CODECS.get(name)
    if codec is None:
        known = ", ".join(sorted(_BY_SHORT_NAME))
        raise ValueError(f"unknown codec {name!r}; supported: {known} (or their Java class names)")
    return codec
