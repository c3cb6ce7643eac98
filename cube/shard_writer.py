"""Writing a shard's two files (cube.shard reads them; cube.format has the layout).

Its own module so that the builder writes shards without importing the servers' compiled
lookup kernel (cube.kernel, and with it numba, ~0.4 s per process): a small build needs
neither. cube.shard re-exports everything here.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from cube import format as fmt
from cube.index import BuiltTable, HashTable
from cube.values import ValueColumn

INDEX_FILE = "index.cube"
DATA_FILE = "data.cube"
# Values are gathered into row order and written a few MB at a time: a chunk stays in cache
# from the gather through the crc to the write, and its buffer is reused (no fresh pages).
_WRITE_CHUNK_BYTES = 4 << 20
_WRITEBACK_BYTES = 32 << 20  # ask the kernel to start writing after this many new bytes


class ValueSource(Protocol):
    """Values by input record number: a ValueColumn, or the builder's values left in their
    input files (cube.builder.spill.LocatedValues)."""

    @property
    def width(self) -> int: ...
    @property
    def count(self) -> int: ...

    def lengths(self) -> np.ndarray: ...

    def take(self, rows: np.ndarray) -> ValueColumn: ...


def write_shard(
    directory: str | os.PathLike[str],
    built: BuiltTable,
    values: ValueSource,
    meta: dict[str, Any],
    sync: bool = True,
) -> dict[str, Any]:
    """Write `index.cube` and `data.cube` into `directory`.

    `values` holds the input records' values in input order (it may be a view of a spill file);
    row r of the shard gets `values[built.live_order[r]]`. `meta` is free-form description
    (dict_name, shard, version, ...) stored in both headers. Files appear under their final
    names only when complete; with `sync` (the default) only once they are on disk too, and
    without it the caller fsyncs them (the builder does, after the tar, so that the disk
    writes all of a shard's files while it works). Returns the index header fields.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    table = built.table
    order = built.live_order
    count = int(order.shape[0])
    width, lengths = _value_width(values, order)
    data_sections, value_bytes = _data_sections(values, order, width, lengths)
    index_sections = _index_sections(table)
    common = {
        **meta,
        "record_count": count,
        "tombstone_count": built.tombstone_count,
        "value_width": width,
        "value_bytes": value_bytes,
    }
    with (
        _SectionFile(directory / DATA_FILE, data_sections) as data_file,
        _SectionFile(directory / INDEX_FILE, index_sections) as index_file,
    ):
        data_file.write_sections()
        index_file.write_sections()
        common["build_id"] = content_build_id(
            common, data_file.section_table, index_file.section_table
        )
        data_header = data_file.finish("data", common, sync)
        index_fields = {
            **common,
            "bucket_bits": table.bits,
            "remainder_bytes": table.remainder_bytes,
            "max_bucket": table.max_bucket,
            "hash": "fmix64-quotient",
            "data_file_size": data_header["file_size"],
        }
        return index_file.finish("index", index_fields, sync)


def _value_width(values: ValueSource, order: np.ndarray) -> tuple[int, np.ndarray]:
    """The shard's value width (0: variable) and, when variable, each live row's length.

    The layout depends on the live values alone: fixed width when they all have one non-zero
    length, however the input was batched (a batch of mixed lengths reads as variable even
    where this shard's share of it is not)."""
    count = int(order.shape[0])
    width = values.width if count else 0
    lengths = np.empty(0, np.int64)
    if count and not width:
        lengths = values.lengths().take(order)
        if lengths[0] > 0 and (lengths == lengths[0]).all():
            width = int(lengths[0])
    return width, lengths


def _data_sections(
    values: ValueSource, order: np.ndarray, width: int, lengths: np.ndarray
) -> tuple[dict[str, Any], int]:
    """data.cube's sections (the values in row order, written in chunks of about
    _WRITE_CHUNK_BYTES, and the offsets when variable-width) and the values' byte count."""
    count = int(order.shape[0])
    if width:
        value_bytes = count * width
        step = max(1, _WRITE_CHUNK_BYTES // width)
    else:
        offsets = np.zeros(count + 1, dtype=np.uint64)
        np.cumsum(lengths, out=offsets[1:])
        value_bytes = int(offsets[-1])
        step = max(1, _WRITE_CHUNK_BYTES * count // max(value_bytes, 1))

    def value_chunks() -> Iterator[np.ndarray]:
        for start in range(0, count, step):
            yield values.take(order[start : start + step]).blob

    sections: dict[str, Any] = {"values": (value_bytes, value_chunks())}
    if not width:
        sections["offsets"] = (offsets.nbytes, iter([offsets.astype("<u8")]))
    return sections, value_bytes


def _index_sections(table: HashTable) -> dict[str, Any]:
    """index.cube's sections: the index's bucket starts and remainders, and the deleted keys."""
    return {
        "bucket_starts": (
            table.bucket_starts.nbytes,
            iter([table.bucket_starts.astype("<u4", copy=False)]),
        ),
        "remainders": (table.remainders.nbytes, iter([table.remainders])),
        "deleted_keys": (
            table.deleted_keys.nbytes,
            iter([table.deleted_keys.astype("<u8", copy=False)]),
        ),
    }


def content_build_id(fields: dict[str, Any], *section_tables: dict[str, list[int]]) -> str:
    """The id that pairs a shard's two files, derived from what they hold (the header fields
    and every section's length and crc32) rather than drawn at random: the same input and
    flags build the same bytes, on one machine or on a Spark cluster, and a shard rebuilt
    from other data gets another id."""
    described = json.dumps([fields, *section_tables], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(described.encode()).hexdigest()[:32]


class _SectionFile:
    """One shard file being written: sections first (under a temp name), the header last,
    once the caller knows every section's crc; renamed into place by `finish`. Removed if
    the `with` block ends without `finish`."""

    def __init__(self, path: Path, sections: dict[str, Any]) -> None:
        self.path = path
        self.sections = sections  # name -> (length, chunks)
        self.placed, self.file_size = fmt.layout_sections(
            {name: length for name, (length, _) in sections.items()}
        )
        self.tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        self.section_table: dict[str, list[int]] = {}
        self._out = open(self.tmp, "wb", buffering=0)  # noqa: SIM115 - closed by finish/exit

    def __enter__(self) -> _SectionFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._out.close()
        if self.tmp.exists():
            self.tmp.unlink()

    def write_sections(self) -> None:
        out = self._out
        out.truncate(self.file_size)
        writeback = Writeback(out.fileno())
        for name, (length, chunks) in self.sections.items():
            offset = self.placed[name][0]
            out.seek(offset)
            crc = 0
            written = 0
            for chunk in chunks:
                view = np.ascontiguousarray(chunk).data.cast("B")
                crc = zlib.crc32(view, crc)
                written += len(view)
                while view:
                    view = view[out.write(view) :]
                writeback.wrote(offset + written)
            if written != length:
                raise RuntimeError(f"{self.path}: section {name} wrote {written} of {length} bytes")
            self.section_table[name] = [offset, length, crc]

    def finish(self, kind: str, fields: dict[str, Any], sync: bool) -> dict[str, Any]:
        """Write the header, (fsync,) close and rename; returns the header fields."""
        header_fields = {**fields, "file_size": self.file_size, "sections": self.section_table}
        self._out.seek(0)
        self._out.write(fmt.encode_header(kind, header_fields))
        if sync:
            os.fsync(self._out.fileno())
        self._out.close()
        os.replace(self.tmp, self.path)
        return header_fields


class Writeback:
    """Starts the kernel writing a file's new pages every `_WRITEBACK_BYTES` (Linux
    sync_file_range, asynchronous), so the disk works while the writer computes and a final
    fsync waits only for the tail. Without it (other systems) it does nothing."""

    _call: Any = None

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.started = 0  # bytes [0, started) were handed to writeback

    def wrote(self, end: int) -> None:
        """The file now holds new bytes up to `end` (an offset); kick writeback if many."""
        if end - self.started >= _WRITEBACK_BYTES:
            call = self._function()
            if call is not None:
                call(self.fd, self.started, end - self.started, 2)  # SYNC_FILE_RANGE_WRITE
            self.started = end

    @classmethod
    def _function(cls) -> Any:
        if cls._call is None:
            cls._call = False
            if sys.platform.startswith("linux"):
                try:
                    function = ctypes.CDLL(None, use_errno=True).sync_file_range
                except (OSError, AttributeError):
                    return None
                function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
                function.restype = ctypes.c_int
                cls._call = function
        return cls._call or None
