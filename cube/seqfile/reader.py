"""SequenceFileReader: a file streamed as uint64-key record batches (or raw records) with bounded
memory, about `batch_bytes` of input at a time.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np

import cube.seqfile.limits as limits
from cube.codecs import Codec, CodecError, codec_for_class
from cube.seqfile.base import (
    _BLOCK_SECTIONS,
    _MAX_VINT_BYTES,
    BYTES_WRITABLE,
    KEY_FORMATS,
    LONG_WRITABLE,
    SYNC_ESCAPE,
    SYNC_SIZE,
    TEXT,
    LocatedBatch,
    RecordBatch,
    SequenceFileError,
    ValueLocations,
)
from cube.seqfile.decode import (
    _column,
    _decode_keys,
    _decode_values,
    _locate_values,
    _strip_framing,
    concat_columns,
)
from cube.seqfile.header import _Cursor, _open, _parse_header
from cube.seqfile.records import (
    _decompress_values,
    _fixed_chunk,
    _Raw,
    _read_into,
    _Scratch,
    _vint_lengths,
    _walk_chunk,
)
from cube.values import ValueColumn


class SequenceFileReader:
    """Stream a SequenceFile as uint64-key record batches (or raw records), bounded memory.

    `key_format` after construction is the resolved one: "auto" picks cube / bytes_be (from the
    first key's length under a BytesWritable header), long (LongWritable) or text (Text) once
    per file; for any other key class it stays "auto", records() still works and batches()
    asks for an explicit format. The file stays open until close() (or the with block ends)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        key_format: str = "auto",
        batch_bytes: int = 64 << 20,
        end: int | None = None,
    ):
        """`end`: read the file as if it ended at that byte (kvtool reads the records before a
        damaged one this way)."""
        if key_format not in KEY_FORMATS:
            raise ValueError(f"key_format {key_format!r} is not one of {', '.join(KEY_FORMATS)}")
        self.path = str(path)
        self.batch_bytes = max(int(batch_bytes), 64)
        self._file = _open(path)
        try:
            self.file_size = os.fstat(self._file.fileno()).st_size
            if end is not None:
                self.file_size = min(self.file_size, max(end, 0))
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
            ranges = raw.ranges()
            key_starts, key_lens = _strip_framing(
                self.key_framing,
                ranges.key_buf,
                ranges.key_starts,
                ranges.key_lens,
                raw.offsets,
                "key",
                self.path,
            )
            keys = _column(ranges.key_buf, key_starts, key_lens)
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
            if count > limits.MAX_BLOCK_RECORDS:
                raise cur.error(
                    f"a block's record count {count} exceeds the limit of"
                    f" {limits.MAX_BLOCK_RECORDS}",
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
                if size > 2 * limits.MAX_BLOCK_BYTES:
                    raise cur.error(
                        f"block {what} of {size} compressed bytes exceed the limit of "
                        f"{2 * limits.MAX_BLOCK_BYTES} bytes",
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
            if total > limits.MAX_BLOCK_BYTES:
                raise SequenceFileError(
                    self.path,
                    block_start,
                    f"block {what}: their lengths add up to "
                    f"{key_total if what == 'keys' else val_total} bytes, over the limit of "
                    f"{limits.MAX_BLOCK_BYTES} for a block's keys and values",
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
