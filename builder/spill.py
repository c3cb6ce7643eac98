"""Per-shard spill files, so a table larger than RAM builds in bounded memory.

Record batches are routed to shards as they stream in (one vectorized grouping per batch) and
appended, in record order, to raw files per shard:
- `<shard>.keys`: the keys, uint64 little-endian;
- `<shard>.locs`: where each value is, uint64 `source << 40 | byte offset`;
- `<shard>.lengths`: uint32 value lengths, only once a shard has seen values of different widths
  (fixed-width shards, the embedding case, need no lengths at all);
- `<shard>.values`: value bytes that are not in an input file as they are (compressed input).

A value's source is one of the reader's input files (an uncompressed SequenceFile holds its
values verbatim, so routing copies 16 bytes per record instead of the whole value) or the
shard's own `.values` file. Finishing a shard maps its keys and locations and reads each value
from its source when it writes it in row order; the input files are checked to be the ones
read (size, mtime, inode) when mapped and again when done.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cube.index import compiled_kernels
from cube.kernel_constants import OFFSET_BITS
from cube.routing import shard_of
from cube.seqfile import ValueLocations
from cube.values import ValueColumn, gather_ranges

_LENGTH_DTYPE = np.dtype("<u4")
_LOC_DTYPE = np.dtype("<u8")
_MAX_VALUE_LENGTH = 2**32 - 1
SPILL_KINDS = ("keys", "locs", "lengths", "values")
MAX_SOURCE_BYTES = 1 << OFFSET_BITS
OWN_SOURCE = (1 << (64 - OFFSET_BITS)) - 1  # source number of the shard's own `.values` file
_OFFSET_MASK = np.uint64(MAX_SOURCE_BYTES - 1)
_SOURCE_SHIFT = np.uint64(OFFSET_BITS)


@dataclass(frozen=True)
class SourceFile:
    """A file that values are read from when a shard is finished, with what identifies its
    contents: finishing refuses a file that changed since it was read."""

    path: str
    size: int
    mtime_ns: int
    inode: int

    @classmethod
    def of(cls, path: str, info: os.stat_result) -> SourceFile:
        return cls(path, info.st_size, info.st_mtime_ns, info.st_ino)

    def check(self, info: os.stat_result) -> None:
        if (info.st_size, info.st_mtime_ns, info.st_ino) != (self.size, self.mtime_ns, self.inode):
            raise ValueError(
                f"{self.path}: the file changed during the build (its values are read again"
                " while the shards are written: leave inputs alone until the build ends)"
            )


@dataclass(frozen=True)
class SpillPart:
    """What finishing one shard needs to find its spilled records (picklable)."""

    shard: int
    directory: str
    count: int
    width: int  # > 0: every value has this width; 0: lengths file (or no values at all)
    value_bytes: int  # bytes in this part's own `.values` file
    sources: tuple[SourceFile, ...] = ()  # the input files that `.locs` source numbers name

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
        """Append records whose values are copied into this shard's own `.values` file."""
        n = int(keys.shape[0])
        if n == 0:
            return
        values = values.compact()
        blob = _value_bytes(values)
        if values.width:
            starts = np.arange(n, dtype=np.uint64) * np.uint64(values.width)
        else:
            starts = (values.offsets[:-1] - values.offsets[0]).astype(np.uint64)
        starts += np.uint64(self.value_bytes | (OWN_SOURCE << OFFSET_BITS))
        if self.value_bytes + blob.shape[0] > MAX_SOURCE_BYTES:
            raise ValueError(
                f"more than {MAX_SOURCE_BYTES} value bytes in one shard's spill: use more shards"
                " (-shard_num)"
            )
        lengths = None if values.width else values.lengths()
        self._append(keys, starts, values.width, lengths)
        if blob.shape[0]:
            self._write("values", blob)
        self.value_bytes += int(blob.shape[0])
        self._done()

    def append_located(self, keys: np.ndarray, locs: np.ndarray, width: int, lengths: Any) -> None:
        """Append records whose values stay where `locs` (source << 40 | offset) says."""
        if keys.shape[0]:
            self._append(keys, locs, width, lengths)
            self._done()

    def _append(self, keys: np.ndarray, locs: np.ndarray, width: int, lengths: Any) -> None:
        if self.width is None:
            self.width = width
        if self.width and width != self.width:
            # widths differ from now on: the records so far get their (equal) lengths
            self._write_lengths_of_fixed(self.count, self.width)
            self.width = 0
        if self.width == 0:
            if lengths is None:
                lengths = np.full(keys.shape[0], width, dtype=np.int64)
            if lengths.shape[0] and int(lengths.max()) > _MAX_VALUE_LENGTH:
                raise ValueError(f"a value of {int(lengths.max())} bytes is too long to spill")
            self._write("lengths", lengths.astype(_LENGTH_DTYPE))
        self._write("keys", keys.astype("<u8", copy=False))
        self._write("locs", locs.astype(_LOC_DTYPE, copy=False))
        self.count += int(keys.shape[0])

    def _done(self) -> None:
        if not self.keep_open:
            self.close()

    def _write_lengths_of_fixed(self, count: int, width: int) -> None:
        for start in range(0, count, 1 << 22):
            self._write("lengths", np.full(min(1 << 22, count - start), width, _LENGTH_DTYPE))

    def _write(self, kind: str, array: np.ndarray) -> None:
        out = self._files.get(kind)
        if out is None:
            path = Path(self.directory) / f"{self.shard}.{kind}"
            out = self._files[kind] = open(path, "ab", buffering=0)  # noqa: SIM115
        view = np.ascontiguousarray(array).data.cast("B")
        while view:
            view = view[out.write(view) :]

    def close(self) -> None:
        for out in self._files.values():
            out.close()
        self._files = {}

    def part(self, sources: tuple[SourceFile, ...] = ()) -> SpillPart:
        return SpillPart(
            self.shard, str(self.directory), self.count, self.width or 0, self.value_bytes, sources
        )


def _value_bytes(values: ValueColumn) -> np.ndarray:
    """The column's value bytes back to back (a view: offsets of a column only grow)."""
    if values.width:
        return values.blob[: values.count * values.width]
    return values.blob[int(values.offsets[0]) : int(values.offsets[-1])]


class Spiller:
    """Routes record batches to per-shard spills. Each batch is grouped by shard and written
    straight through, so memory stays at about one batch. Values of uncompressed input files
    are not copied: `add_located` spills where they are (`add_source` registers the file)."""

    def __init__(
        self, directory: Path, shard_num: int, partitioner: str, max_open_shards: int = 256
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.shard_num = shard_num
        self.partitioner = partitioner
        keep_open = shard_num <= max_open_shards  # else open and close per append (fd limits)
        self.shards = [ShardSpill(self.directory, s, keep_open) for s in range(shard_num)]
        self.sources: list[SourceFile] = []

    def add(self, keys: np.ndarray, values: ValueColumn) -> None:
        """Route one batch, copying its values; records keep their order within each shard."""
        n = int(keys.shape[0])
        if n != values.count:
            raise ValueError(f"{n} keys for {values.count} values")
        if n == 0:
            return
        for shard, shard_keys, shard_values in route_batch(keys, values, self._owners(keys)):
            self.shards[shard].append(shard_keys, shard_values)

    def add_source(self, source: SourceFile) -> int:
        """Register an input file whose values `add_located` will point into; its number."""
        if source.size > MAX_SOURCE_BYTES:
            raise ValueError(f"{source.path}: larger than {MAX_SOURCE_BYTES} bytes")
        if len(self.sources) >= OWN_SOURCE:
            raise ValueError(f"more than {OWN_SOURCE} input files in one reader")
        self.sources.append(source)
        return len(self.sources) - 1

    def add_located(self, keys: np.ndarray, source: int, located: ValueLocations) -> None:
        """Route one batch of values that stay in input file `source` (see `add_source`)."""
        n = int(keys.shape[0])
        if n != len(located):
            raise ValueError(f"{n} keys for {len(located)} values")
        if n == 0:
            return
        locs = located.starts.astype(np.uint64)
        locs |= np.uint64(source << OFFSET_BITS)
        lengths = located.lengths
        if self.shard_num == 1:
            self.shards[0].append_located(keys, locs, located.width, lengths)
            return
        order, bounds = group_positions(self._owners(keys), self.shard_num)
        keys, locs = keys.take(order), locs.take(order)
        lengths = None if lengths is None else lengths.take(order)
        for shard in np.flatnonzero(np.diff(bounds)).tolist():
            lo, hi = int(bounds[shard]), int(bounds[shard + 1])
            self.shards[shard].append_located(
                keys[lo:hi],
                locs[lo:hi],
                located.width,
                None if lengths is None else lengths[lo:hi],
            )

    def _owners(self, keys: np.ndarray) -> np.ndarray:
        return shard_owners(keys, self.shard_num, self.partitioner)

    def finish(self) -> list[SpillPart]:
        for spill in self.shards:
            spill.close()
        sources = tuple(self.sources)
        return [spill.part(sources) for spill in self.shards]


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


def shard_owners(keys: np.ndarray, shard_num: int, partitioner: str) -> np.ndarray:
    """Each key's shard as int64 (cube.routing's rule; a power-of-two `mod` is a mask)."""
    if partitioner == "mod" and shard_num & (shard_num - 1) == 0:
        return (keys & np.uint64(shard_num - 1)).astype(np.int64)
    return shard_of(keys, shard_num, partitioner)


def route_batch(
    keys: np.ndarray, values: ValueColumn, owners: np.ndarray
) -> Iterator[tuple[int, np.ndarray, ValueColumn]]:
    """(shard, keys, values) for every shard that owns records of the batch, in shard order,
    input order kept within each shard; `owners` is each record's shard (cube.routing)."""
    if owners.shape[0] and (owners == owners[0]).all():
        yield int(owners[0]), keys, values
        return
    order, bounds = group_positions(owners, int(owners.max()) + 1)
    keys = keys.take(order)
    if values.width:
        items = values.blob[: keys.shape[0] * values.width].view(f"V{values.width}")
        values = ValueColumn.fixed(items.take(order).view(np.uint8), values.width)
    else:
        values = values.take(order)
    for shard in np.flatnonzero(np.diff(bounds)).tolist():
        lo, hi = int(bounds[shard]), int(bounds[shard + 1])
        yield shard, keys[lo:hi], slice_values(values, lo, hi)


def slice_values(values: ValueColumn, lo: int, hi: int) -> ValueColumn:
    if values.width:
        w = values.width
        return ValueColumn.fixed(values.blob[lo * w : hi * w], w)
    return ValueColumn.variable(values.blob, values.offsets[lo : hi + 1])


# ---------------------------------------------------------------------------------------------
# Reading a shard's spill back


class LocatedValues:
    """A shard's values in record order, each read from its source file when taken.

    All sources are mapped side by side in one address range (`_Region`), so gathering a chunk
    of values is one numpy fancy index whatever the mix of sources; `take` is what
    `cube.shard.write_shard` asks for, in row order, a chunk at a time."""

    def __init__(
        self,
        region: np.ndarray,
        bases: np.ndarray,
        locs: np.ndarray,
        width: int,
        lengths: np.ndarray | None,
    ) -> None:
        self._region = region  # uint8, read-only: every source at its base
        self._bases = bases  # uint64 region offset of each source number
        self._locs = locs
        self.width = width
        self._lengths = lengths
        self.count = int(locs.shape[0])
        # the region as overlapping `width`-byte items, one starting at every byte
        self._items = _item_view(region, width) if width else None
        self._kernels = compiled_kernels(self.count)

    def __len__(self) -> int:
        return self.count

    def lengths(self) -> np.ndarray:
        if self.width:
            return np.full(self.count, self.width, dtype=np.int64)
        assert self._lengths is not None
        return self._lengths.astype(np.int64)

    def take(self, rows: np.ndarray) -> ValueColumn:
        """Values of records `rows`, in that order, as a new contiguous column."""
        rows = np.asarray(rows, dtype=np.int64)
        if self._items is not None and self._kernels is not None:
            out = np.empty(rows.shape[0] * self.width, dtype=np.uint8)
            self._kernels.gather_fixed(self._region, self._bases, self._locs, rows, self.width, out)
            return ValueColumn.fixed(out, self.width)
        locs = self._locs.take(rows)
        sources = locs >> _SOURCE_SHIFT
        locs &= _OFFSET_MASK
        locs += self._bases.take(sources.view(np.int64))
        at = locs.view(np.int64)
        if self._items is not None:
            return ValueColumn.fixed(self._items[at].view(np.uint8), self.width)
        if self.width:  # fixed width, nothing mapped: every record is empty-sourced
            return ValueColumn.fixed(np.empty(0, np.uint8), self.width)
        assert self._lengths is not None
        lengths = self._lengths.take(rows).astype(np.int64)
        return ValueColumn.variable(*gather_ranges(self._region, at, lengths))

    def to_list(self) -> list[bytes]:
        """Every value as bytes (tests, small spills)."""
        return self.take(np.arange(self.count, dtype=np.int64)).to_list()


def _item_view(source: np.ndarray, width: int) -> np.ndarray:
    """`source` as `width`-byte items starting at every byte: item i is source[i : i + width],
    so a fancy index by byte offsets gathers whole values in one numpy call."""
    count = max(source.shape[0] - width + 1, 0)
    return np.ndarray((count,), dtype=f"V{width}", buffer=source, strides=(1,))


class _Region:
    """Files mapped read-only next to each other in one reserved address range (Linux mmap
    with MAP_FIXED through libc), seen as one uint8 array; unmapped when the last array over
    it goes. Where that is not possible the files are read into one buffer instead."""

    def __init__(self, entries: list[tuple[SourceFile | None, str, int]]) -> None:
        sizes = [size for _, _, size in entries]
        self.bases = np.zeros(len(entries), dtype=np.uint64)
        total = 0
        for number, size in enumerate(sizes):
            self.bases[number] = total
            total += -(-size // _ALIGN) * _ALIGN
        self.checks: list[tuple[SourceFile, int]] = []  # inputs to check again when done
        self.array = np.empty(0, dtype=np.uint8)
        fds = []
        try:
            for entry in entries:
                fds.append(_open_source(entry) if entry[2] else -1)
            if total:
                try:
                    if not sys.platform.startswith("linux"):
                        raise OSError("not Linux: no MAP_FIXED mapping side by side")
                    self.array = _map_side_by_side(fds, sizes, self.bases, total)
                except OSError:
                    paths = [path for _, path, _ in entries]
                    self.array = _read_side_by_side(fds, paths, sizes, self.bases, total)
            for (source, _, _), fd in zip(entries, fds, strict=True):
                if source is not None and fd >= 0:
                    self.checks.append((source, os.dup(fd)))
        finally:
            for fd in fds:
                if fd >= 0:
                    os.close(fd)

    def check_unchanged(self) -> None:
        """The input files must still be the ones read (same size, mtime and inode)."""
        for source, fd in self.checks:
            source.check(os.fstat(fd))

    def close(self) -> None:
        for _, fd in self.checks:
            os.close(fd)
        self.checks = []
        self.array = np.empty(0, dtype=np.uint8)


def _open_source(entry: tuple[SourceFile | None, str, int]) -> int:
    source, path, length = entry
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise ValueError(f"{path}: cannot open: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if source is not None:
            source.check(info)
        elif info.st_size != length:
            raise ValueError(f"{path}: spill holds {info.st_size} bytes, expected {length}")
    except BaseException:
        os.close(fd)
        raise
    return fd


# Sources start 2 MiB apart (a huge page): the kernel can then map the page cache's large
# folios whole, which makes mapping and the random reads of the gather several times cheaper.
_ALIGN = 2 << 20
_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000
_libc: Any = None


def _map_side_by_side(
    fds: list[int], sizes: list[int], bases: np.ndarray, total: int
) -> np.ndarray:
    """Reserve `total` bytes of address space, map each file at its base inside it."""
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc = libc
    failed = ctypes.c_void_p(-1).value
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
    reserved = total + _ALIGN
    address = _libc.mmap(None, reserved, 0, flags, -1, 0)  # PROT_NONE
    if address in (None, failed):
        raise OSError(ctypes.get_errno(), "cannot reserve address space for the sources")
    start = -(-address // _ALIGN) * _ALIGN
    try:
        flags = mmap.MAP_SHARED | _MAP_FIXED | getattr(mmap, "MAP_POPULATE", 0)
        for fd, size, base in zip(fds, sizes, bases.tolist(), strict=True):
            if size:
                got = _libc.mmap(start + base, size, mmap.PROT_READ, flags, fd, 0)
                if got != start + base:
                    raise OSError(ctypes.get_errno(), "cannot map a source file")
        buffer = (ctypes.c_uint8 * total).from_address(start)
        weakref.finalize(buffer, _libc.munmap, address, reserved)
    except BaseException:
        _libc.munmap(address, reserved)
        raise
    # a ctypes array is a buffer; numpy's stubs (for Python 3.11) do not say so
    array: np.ndarray = np.frombuffer(buffer, dtype=np.uint8)  # type: ignore[call-overload]
    array.flags.writeable = False  # mapped read-only: a write would crash
    return array


def _read_side_by_side(
    fds: list[int], paths: list[str], sizes: list[int], bases: np.ndarray, total: int
) -> np.ndarray:
    """The portable fallback: every file read into one buffer at its base."""
    array = np.empty(total, dtype=np.uint8)
    for fd, path, size, base in zip(fds, paths, sizes, bases.tolist(), strict=True):
        view = array[base : base + size].data
        done = 0
        while done < size:
            got = os.preadv(fd, [view[done:]], done)
            if not got:
                raise ValueError(
                    f"{path}: ended after {done} of {size} bytes (changed during the build?)"
                )
            done += got
    array.flags.writeable = False
    return array


@contextmanager
def open_parts(parts: list[SpillPart]) -> Iterator[tuple[np.ndarray, LocatedValues]]:
    """One shard's spill parts (from several readers, in input order) as (keys, values in
    record order). Keys and locations are read into memory (the table needs the keys anyway);
    the sources stay mapped while the block runs, then the input files are checked unchanged
    (a file changed under the build fails it instead of giving wrong values)."""
    filled = [p for p in parts if p.count]
    total = sum(p.count for p in filled)
    keys = np.empty(total, dtype=np.uint64)
    locs = np.empty(total, dtype=np.uint64)
    width = filled[0].width if filled else 0
    fixed = width > 0 and all(p.width == width for p in filled)
    lengths = None if fixed or not filled else np.empty(total, dtype=_LENGTH_DTYPE)
    table: list[tuple[SourceFile | None, str, int]] = []  # (input or None, path, size)
    at = 0
    for part in filled:
        _read_into(part.path("keys"), keys[at : at + part.count])
        _read_into(part.path("locs"), locs[at : at + part.count])
        if lengths is not None:
            if part.width:
                lengths[at : at + part.count] = part.width
            else:
                _read_into(part.path("lengths"), lengths[at : at + part.count])
        own = len(table) + len(part.sources)
        _renumber(locs[at : at + part.count], len(table), own)
        table += [(source, source.path, source.size) for source in part.sources]
        table.append((None, str(part.path("values")), part.value_bytes))
        at += part.count
    region = _Region(table)
    try:
        value_width = width if fixed else 0
        opened = [keys, LocatedValues(region.array, region.bases, locs, value_width, lengths)]
        del keys, locs, lengths
        # handed over, not kept: the caller can free the keys once the table is built
        yield _hand_over(opened)
        region.check_unchanged()
    finally:
        region.close()


def _hand_over(items: list[Any]) -> tuple[Any, ...]:
    """The items as a tuple, the list emptied (no reference left behind)."""
    out = tuple(items)
    items.clear()
    return out


@contextmanager
def open_spill(part: SpillPart) -> Iterator[tuple[np.ndarray, LocatedValues]]:
    """One part alone (see `open_parts`)."""
    with open_parts([part]) as opened:
        yield opened


def _renumber(locs: np.ndarray, base: int, own: int) -> None:
    """A part's input source numbers i become base + i and its own `.values` file `own`, the
    numbers of the shard's combined source table (in place)."""
    is_own = (locs >> _SOURCE_SHIFT) == np.uint64(OWN_SOURCE)
    if is_own.any():
        locs[is_own] = (locs[is_own] & _OFFSET_MASK) | np.uint64(own << OFFSET_BITS)
        if base:
            locs[~is_own] += np.uint64(base << OFFSET_BITS)
    elif base:
        locs += np.uint64(base << OFFSET_BITS)


def _read_into(path: Path, out: np.ndarray) -> None:
    """Fill `out` from a spill file that must hold exactly its bytes."""
    view = out.data.cast("B")
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if size != view.nbytes:
            raise ValueError(f"{path}: spill holds {size} bytes, expected {view.nbytes}")
        done = 0
        while done < view.nbytes:
            got = f.readinto(view[done:])
            if not got:
                raise ValueError(f"{path}: spill ended after {done} of {view.nbytes} bytes")
            done += got


def remove_part(part: SpillPart) -> None:
    for kind in SPILL_KINDS:
        part.path(kind).unlink(missing_ok=True)
