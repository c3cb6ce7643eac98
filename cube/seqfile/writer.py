"""SequenceFileWriter: the Cube tools' dialect or genuine BytesWritable records, uncompressed,
record- or block-compressed, written under a temporary name and renamed when closed.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from cube.codecs import codec_by_name
from cube.seqfile.base import (
    BLOCK_BYTES,
    BYTES_WRITABLE,
    COMPRESSIONS,
    CUBE_SYNC_INTERVAL,
    DIALECTS,
    HADOOP_SYNC_INTERVAL,
    SYNC_ESCAPE,
    SYNC_SIZE,
    encode_vint,
)
from cube.seqfile.header import encode_header
from cube.values import ValueColumn


class SequenceFileWriter:
    """Write a SequenceFile in the Cube dialect (raw LE uint64 keys, raw values) or as genuine
    BytesWritable/BytesWritable, uncompressed or record/block-compressed.

    Writes to a dot-prefixed temp name in the same directory and renames on close, so a reader
    never sees half a file (and directory scans that skip dot files ignore the temp)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
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
            if self.compression == "record" and self.codec is not None:  # it has one
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
        codec = self.codec
        assert codec is not None  # block compression has one
        parts = [self._escape, encode_vint(self._block_records)]
        for buffer in self._block:
            packed = codec.compress(bytes(buffer))
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
