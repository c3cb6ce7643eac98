"""A SequenceFile's header, read (each field checked against the bytes left in the file and the
limits before anything is allocated for it) and written; `_Cursor` also reads the framing
of compressed blocks.
"""

from __future__ import annotations

import os
import stat
import struct
from io import BufferedReader
from typing import BinaryIO

import cube.seqfile.limits as limits
from cube.codecs import DEFAULT_CODEC
from cube.seqfile.base import (
    _BLOCK_COMPRESS_VERSION,
    _CUSTOM_COMPRESS_VERSION,
    _METADATA_VERSION,
    CURRENT_VERSION,
    MAGIC,
    SYNC_SIZE,
    SequenceFileError,
    SequenceFileHeader,
    decode_vint,
    encode_text,
    vint_size,
)


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
        """A Hadoop Text; its length is checked against the file and the limit."""
        start = self.offset
        size = self.read_vint(f"{what} length")
        if size > self.left:
            raise self.error(
                f"{what} length {size} exceeds the {self.left} bytes left in the file", start
            )
        if size > limits.MAX_HEADER_TEXT_BYTES:
            raise self.error(
                f"{what} length {size} exceeds the limit of {limits.MAX_HEADER_TEXT_BYTES} bytes",
                start,
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
        if count > limits.MAX_METADATA_ENTRIES:
            raise cur.error(
                f"metadata count {count} exceeds the limit of {limits.MAX_METADATA_ENTRIES}", start
            )
        for i in range(count):
            name = cur.read_text(f"metadata key {i}")
            metadata[name] = cur.read_text(f"metadata value {i}")
    sync = cur.read(SYNC_SIZE, "the sync marker") if version > 1 else b""
    compression = "block" if block else ("record" if compressed else "none")
    return SequenceFileHeader(
        version, key_class, value_class, compression, codec, metadata, sync, cur.offset
    )


def read_header(path: str | os.PathLike[str]) -> SequenceFileHeader:
    """Parse only the header; raises SequenceFileError."""
    with _open(path) as file:
        return _parse_header(file, str(path))


def _open(path: str | os.PathLike[str]) -> BufferedReader:
    """Open a regular file. Anything else is refused before open(): a FIFO would block until
    some writer came, and a device or directory has no size to check lengths against."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise SequenceFileError(path, 0, "not a regular file")
        return open(path, "rb")
    except OSError as exc:
        raise SequenceFileError(path, 0, f"cannot open: {exc.strerror}") from None


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
