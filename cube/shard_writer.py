"""Writing a shard's two files (cube.shard reads them; cube.format has the layout).

Its own module so that the builder writes shards without importing the servers' compiled
lookup kernel (cube.kernel, and with it numba, ~0.4 s per process): a small build needs
neither. cube.shard re-exports everything here.
"""

from __future__ import annotations

import ctypes
import os
import sys
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from cube import format as fmt
from cube.index import BuiltTable
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

    width: int
    count: int

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
    width = values.width if count else 0
    build_id = uuid.uuid4().hex

    if width:
        value_bytes = count * width
        step = max(1, _WRITE_CHUNK_BYTES // width)
    else:
        lengths = values.lengths().take(order) if count else np.empty(0, np.int64)
        offsets = np.zeros(count + 1, dtype=np.uint64)
        np.cumsum(lengths, out=offsets[1:])
        value_bytes = int(offsets[-1])
        step = max(1, _WRITE_CHUNK_BYTES * count // max(value_bytes, 1))

    def value_chunks() -> Iterator[np.ndarray]:
        for start in range(0, count, step):
            yield values.take(order[start : start + step]).blob

    data_sections: dict[str, Any] = {"values": (value_bytes, value_chunks())}
    if not width:
        data_sections["offsets"] = (offsets.nbytes, iter([offsets.astype("<u8")]))
    common = {
        **meta,
        "build_id": build_id,
        "record_count": count,
        "tombstone_count": built.tombstone_count,
        "value_width": width,
        "value_bytes": value_bytes,
    }
    data_header = _write_file(directory / DATA_FILE, "data", common, data_sections, sync)
    index_fields = {
        **common,
        "bucket_count": table.bucket_count,
        "slot_count": table.slot_count,
        "empty_key": str(table.empty_key),
        "max_probe": table.max_probe,
        "hash": "fmix64-fastrange-bucket8",
        "data_file_size": data_header["file_size"],
    }
    index_sections = {
        "slot_keys": (table.slot_keys.nbytes, iter([table.slot_keys.astype("<u8", copy=False)])),
        "bucket_rows": (
            table.bucket_rows.nbytes,
            iter([table.bucket_rows.astype("<u4", copy=False)]),
        ),
        "deleted_keys": (
            table.deleted_keys.nbytes,
            iter([table.deleted_keys.astype("<u8", copy=False)]),
        ),
    }
    return _write_file(directory / INDEX_FILE, "index", index_fields, index_sections, sync)


def _write_file(
    path: Path, kind: str, fields: dict[str, Any], sections: dict[str, Any], sync: bool = True
) -> dict[str, Any]:
    """Write header + sections to a temp name, (fsync,) rename. Sections are (length, chunks)."""
    placed, file_size = fmt.layout_sections(
        {name: length for name, (length, _) in sections.items()}
    )
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    section_table = {}
    try:
        with open(tmp, "wb", buffering=0) as out:
            out.truncate(file_size)
            writeback = Writeback(out.fileno())
            for name, (length, chunks) in sections.items():
                offset = placed[name][0]
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
                    raise RuntimeError(f"{path}: section {name} wrote {written} of {length} bytes")
                section_table[name] = [offset, length, crc]
            header_fields = {**fields, "file_size": file_size, "sections": section_table}
            out.seek(0)
            out.write(fmt.encode_header(kind, header_fields))
            if sync:
                os.fsync(out.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
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
