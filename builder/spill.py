"""Per-shard spill files, so a table larger than RAM builds in bounded memory.

Record batches are routed to shards as they stream in (one vectorized grouping per batch) and
appended, in record order, to three raw files per shard:
- `<shard>.keys`: the keys, uint64 little-endian;
- `<shard>.values`: the value bytes back to back;
- `<shard>.lengths`: uint32 value lengths, only once a shard has seen values of different widths
  (fixed-width shards, the embedding case, need no lengths at all).
A shard is then finished from an mmap of its files (`open_spill`): only its keys and table
need RAM.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cube.routing import shard_of
from cube.values import ValueColumn

_LENGTH_DTYPE = np.dtype("<u4")
_MAX_VALUE_LENGTH = 2**32 - 1
SPILL_KINDS = ("keys", "values", "lengths")


@dataclass(frozen=True)
class SpillPart:
    """What finishing one shard needs to find its spilled records (picklable)."""

    shard: int
    directory: str
    count: int
    width: int  # > 0: every value has this width; 0: lengths file (or no values at all)
    value_bytes: int

    def path(self, kind: str) -> Path:
        return Path(self.directory) / f"{self.shard}.{kind}"


class ShardSpill:
    """Append-only spill of one shard's records, written through to its files."""

    def __init__(self, directory: Path, shard: int, keep_open: bool = True) -> None:
        self.directory = directory
        self.shard = shard
        self.keep_open = keep_open
        self.count = 0
        self.value_bytes = 0
        self.width: int | None = None  # None until the first value; 0 once widths vary
        self._files: dict[str, Any] = {}

    def append(self, keys: np.ndarray, values: ValueColumn) -> None:
        """Append records (keys uint64, values in the same order)."""
        n = int(keys.shape[0])
        if n == 0:
            return
        values = values.compact()
        if self.width is None:
            self.width = values.width
        if self.width and values.width != self.width:
            # widths differ from now on: the records so far get their (equal) lengths
            self._write_lengths_of_fixed(self.count, self.width)
            self.width = 0
        if self.width == 0:
            lengths = values.lengths()
            if int(lengths.max()) > _MAX_VALUE_LENGTH:
                raise ValueError(f"a value of {int(lengths.max())} bytes is too long to spill")
            self._write("lengths", lengths.astype(_LENGTH_DTYPE))
        self._write("keys", keys.astype("<u8", copy=False))
        blob = _value_bytes(values)
        if blob.shape[0]:
            self._write("values", blob)
        self.count += n
        self.value_bytes += int(blob.shape[0])
        if not self.keep_open:
            self.close()

    def _write_lengths_of_fixed(self, count: int, width: int) -> None:
        for start in range(0, count, 1 << 22):
            self._write("lengths", np.full(min(1 << 22, count - start), width, _LENGTH_DTYPE))

    def _write(self, kind: str, array: np.ndarray) -> None:
        out = self._files.get(kind)
        if out is None:
            out = self._files[kind] = open(self.part().path(kind), "ab", buffering=0)  # noqa: SIM115
        view = memoryview(np.ascontiguousarray(array)).cast("B")
        while view:
            view = view[out.write(view) :]

    def close(self) -> None:
        for out in self._files.values():
            out.close()
        self._files = {}

    def part(self) -> SpillPart:
        return SpillPart(
            self.shard, str(self.directory), self.count, self.width or 0, self.value_bytes
        )


def _value_bytes(values: ValueColumn) -> np.ndarray:
    """The column's value bytes back to back (a view: offsets of a column only grow)."""
    if values.width:
        return values.blob[: values.count * values.width]
    return values.blob[int(values.offsets[0]) : int(values.offsets[-1])]


class Spiller:
    """Routes record batches to per-shard spills. Each batch is grouped by shard into buffers
    that are reused from batch to batch (no fresh, page-faulting memory per batch) and written
    straight through, so memory stays at about one batch."""

    def __init__(
        self, directory: Path, shard_num: int, partitioner: str, max_open_shards: int = 256
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.shard_num = shard_num
        self.partitioner = partitioner
        keep_open = shard_num <= max_open_shards  # else open and close per append (fd limits)
        self.shards = [ShardSpill(self.directory, s, keep_open) for s in range(shard_num)]
        self._scratch: dict[str, np.ndarray] = {}

    def add(self, keys: np.ndarray, values: ValueColumn) -> None:
        """Route one batch; records keep their order within each shard."""
        n = int(keys.shape[0])
        if n != values.count:
            raise ValueError(f"{n} keys for {values.count} values")
        if n == 0:
            return
        if self.shard_num == 1:
            self.shards[0].append(keys, values)
            return
        owners = shard_of(keys, self.shard_num, self.partitioner)
        order, bounds = group_positions(owners, self.shard_num)
        keys = np.take(keys, order, out=self._buffer("keys", n, np.dtype(np.uint64)))
        if values.width:
            items = values.blob[: n * values.width].view(f"V{values.width}")
            out = self._buffer("values", n, items.dtype)
            values = ValueColumn.fixed(np.take(items, order, out=out).view(np.uint8), values.width)
        else:
            values = values.take(order)
        for shard in np.flatnonzero(np.diff(bounds)).tolist():
            lo, hi = int(bounds[shard]), int(bounds[shard + 1])
            self.shards[shard].append(keys[lo:hi], slice_values(values, lo, hi))

    def _buffer(self, name: str, count: int, dtype: np.dtype) -> np.ndarray:
        """`count` items of `dtype` in a scratch buffer kept across batches."""
        need = count * dtype.itemsize
        scratch = self._scratch.get(name)
        if scratch is None or scratch.shape[0] < need:
            scratch = self._scratch[name] = np.empty(need + need // 4, dtype=np.uint8)
        return scratch[:need].view(dtype)

    def finish(self) -> list[SpillPart]:
        for spill in self.shards:
            spill.close()
        self._scratch = {}
        return [spill.part() for spill in self.shards]


def group_positions(owners: np.ndarray, owner_count: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions grouped by owner, input order kept within a group (a stable counting sort:
    numpy's stable sort is a radix sort for 16-bit and narrower integers)."""
    if owner_count <= 1 << 16:
        narrow = owners.astype(np.uint16 if owner_count > 256 else np.uint8)
        order = np.argsort(narrow, kind="stable")
    else:
        order = np.argsort(owners, kind="stable")
    bounds = np.zeros(owner_count + 1, dtype=np.int64)
    np.cumsum(np.bincount(owners, minlength=owner_count), out=bounds[1:])
    return order, bounds


def slice_values(values: ValueColumn, lo: int, hi: int) -> ValueColumn:
    if values.width:
        w = values.width
        return ValueColumn.fixed(values.blob[lo * w : hi * w], w)
    return ValueColumn.variable(values.blob, values.offsets[lo : hi + 1])


@contextmanager
def open_spill(part: SpillPart) -> Iterator[tuple[np.ndarray, ValueColumn]]:
    """Map a shard's spill: (keys, values in record order). Keys are read into memory (the
    table needs them anyway); values stay on the mmap."""
    keys = _read_array(part.path("keys"), np.dtype("<u8"), part.count)
    maps: list[mmap.mmap] = []
    try:
        blob = _map_bytes(part.path("values"), part.value_bytes, maps)
        if part.count == 0:
            values = ValueColumn.empty()
        elif part.width:
            values = ValueColumn.fixed(blob, part.width)
        else:
            lengths = _read_array(part.path("lengths"), _LENGTH_DTYPE, part.count)
            offsets = np.zeros(part.count + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])
            del lengths
            values = ValueColumn.variable(blob, offsets)
        yield keys, values
    finally:
        for m in maps:
            with contextlib.suppress(BufferError):  # arrays still use it; it goes with them
                m.close()


def _read_array(path: Path, dtype: np.dtype, count: int) -> np.ndarray:
    if count == 0:
        return np.empty(0, dtype=dtype)
    array = np.fromfile(path, dtype=dtype)
    if array.shape[0] != count:
        raise ValueError(f"{path}: spill holds {array.shape[0]} items, expected {count}")
    return array


def _map_bytes(path: Path, length: int, maps: list[mmap.mmap]) -> np.ndarray:
    if length == 0:
        return np.empty(0, dtype=np.uint8)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size != length:
            raise ValueError(f"{path}: spill holds {size} bytes, expected {length}")
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # read whole anyway
        m = mmap.mmap(f.fileno(), length, prot=mmap.PROT_READ, flags=flags)
    maps.append(m)
    return np.frombuffer(m, dtype=np.uint8)


def remove_part(part: SpillPart) -> None:
    if not part.count:  # nothing was ever written for it
        return
    for kind in SPILL_KINDS:
        part.path(kind).unlink(missing_ok=True)


def merge_parts(parts: list[SpillPart]) -> SpillPart:
    """One shard's spill parts (from several readers, in input order) as one: the later parts'
    files are appended to the first non-empty part's with a kernel-side copy, then removed."""
    filled = [p for p in parts if p.count]
    if len(filled) <= 1:
        return filled[0] if filled else parts[0]
    first = filled[0]
    fixed = first.width > 0 and all(p.width == first.width for p in filled)
    if not fixed and first.width:
        _append_lengths(first.path("lengths"), first.count, first.width)
    for part in filled[1:]:
        _append_file(part.path("keys"), first.path("keys"))
        if part.value_bytes:
            _append_file(part.path("values"), first.path("values"))
        if not fixed:
            if part.width:
                _append_lengths(first.path("lengths"), part.count, part.width)
            else:
                _append_file(part.path("lengths"), first.path("lengths"))
        remove_part(part)
    return SpillPart(
        first.shard,
        first.directory,
        sum(p.count for p in filled),
        first.width if fixed else 0,
        sum(p.value_bytes for p in filled),
    )


def _append_lengths(path: Path, count: int, width: int) -> None:
    with open(path, "ab") as out:
        for start in range(0, count, 1 << 22):
            out.write(np.full(min(1 << 22, count - start), width, dtype=_LENGTH_DTYPE).data)


def _append_file(source: Path, target: Path) -> None:
    """Append `source` to `target` (copy_file_range: the bytes never enter this process)."""
    with open(source, "rb") as src, open(target, "r+b") as dst:
        size = os.fstat(src.fileno()).st_size
        start = os.fstat(dst.fileno()).st_size
        copied = 0
        try:
            while copied < size:
                step = os.copy_file_range(
                    src.fileno(), dst.fileno(), size - copied, copied, start + copied
                )
                if step == 0:
                    raise OSError(f"{source}: ended after {copied} of {size} bytes")
                copied += step
        except OSError as exc:
            if exc.errno is None:
                raise
            src.seek(copied)
            dst.seek(start + copied)
            shutil.copyfileobj(src, dst, 8 << 20)
