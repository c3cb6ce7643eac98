"""What the SequenceFile modules share: the format's constants, the error, the batches a reader
yields, Hadoop's vints and Text. The format: docs/ARCHITECTURE.md (SequenceFiles).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import numpy as np

from cube.values import ValueColumn

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


class SequenceFileError(ValueError):
    """Bad or unsupported SequenceFile input, located by file and byte offset."""

    def __init__(self, path: str | os.PathLike[str], offset: int, problem: str):
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
