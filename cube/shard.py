"""Shard files on disk: map and probe them (server, demo, tests); `write_shard` (in
cube.shard_writer, which the builder imports without the lookup kernel) writes them.

A shard opens in constant time: the header is checked and the sections are mapped, nothing is
rebuilt; several processes mapping the same files share one copy in the page cache. `verify()`
reads everything once and checks every section's crc32 (the server does it at load).

`ShardStack` layers deltas over a base without copying it: lookups go newest first, and a
tombstone in a newer layer hides the key in the older ones.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from cube import format as fmt
from cube import kernel
from cube.hashing import fmix64
from cube.index import (
    MAX_BITS,
    TOMBSTONE,
    BuiltTable,
    HashTable,
    from_hash_ordered,
    remainder_bytes,
)
from cube.shard_writer import DATA_FILE, INDEX_FILE, ValueSource, Writeback, write_shard
from cube.values import ValueColumn

__all__ = [
    "DATA_FILE",
    "INDEX_FILE",
    "LookupResult",
    "Shard",
    "ShardStack",
    "ValueSource",
    "Writeback",
    "write_shard",
]


FileHook = Callable[[int, Path], None]
log = logging.getLogger("cube.shard")


_MADV_POPULATE_READ = 22  # Linux 5.14: fault a range in, readable


def _map_random(fd: int, size: int, populate: bool) -> mmap.mmap:
    """Map a shard file read-only for lookups that fault it in page by page (a table larger
    than the memory it may hold): no readahead around each fault (MADV_RANDOM), no huge
    pages. A fault then reads 4 KiB, not the 128 KiB of readahead or the 2 MiB of a huge
    page, most of which no lookup wants and which pushes hot pages out of the page cache:
    14x the uniform lookups, 15x the Zipf(0.99) ones at 20M x 64 B in a cgroup of a quarter
    of the table (bench/RESULTS.md, issue 37)."""
    flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
    buffer = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
    if not populate:
        buffer.madvise(mmap.MADV_RANDOM)
    return buffer


def _map(fd: int, size: int, populate: bool, huge_pages: bool) -> mmap.mmap:
    """Map a shard file read-only. With `huge_pages`, ask for 2 MiB mappings where the kernel
    and filesystem have them (transparent huge pages in the page cache: ext4 and xfs on recent
    kernels, tmpfs mounted huge=): with `populate`, pages nobody maps are dropped first (the
    builder's or the agent's writes left them in 4 KiB pieces) so that faulting the mapping in
    reads them again in 2 MiB pieces. A lookup then misses the TLB once per 2 MiB instead of
    once per 4 KiB: the lane pass is 11% cheaper at 20M keys x 64 B, 23% at 100M
    (bench/RESULTS.md, issue 28). Elsewhere it changes nothing but the re-read."""
    if not huge_pages:
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
    if populate:  # (without, dropping them would send the first lookups to the disk)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # (pages mapped elsewhere stay)
    buffer = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    try:
        buffer.madvise(mmap.MADV_HUGEPAGE)
        if populate:
            buffer.madvise(_MADV_POPULATE_READ)
    except OSError:  # a kernel without them: fault in as without huge pages
        buffer.close()
        return _map(fd, size, populate, False)
    return buffer


def pmd_mapped_bytes(addresses: set[int]) -> int:
    """Bytes on 2 MiB page table entries of this process's file mappings that start at
    `addresses` (from /proc/self/smaps; -1 where it cannot be read): whether `huge_pages` took
    effect. It walks the process's page tables: call it once per load, not per request."""
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return -1
    total = 0
    mine = False
    for line in text.splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
            mine = int(head.split("-", 1)[0], 16) in addresses
        elif mine and line.startswith("FilePmdMapped:"):
            total += int(line.split()[1]) * 1024
    return total


class _MappedFile:
    """One shard file, header checked, contents mapped (or read) read-only.

    With `on_open`, the hook sees the descriptor right after the open, before anything is read
    (cube-server takes a lease there so that another process cannot truncate or rewrite the
    file unnoticed), and the descriptor stays open until `close`."""

    def __init__(
        self,
        path: Path,
        kind: str,
        populate: bool,
        on_open: FileHook | None = None,
        huge_pages: bool = False,
        random_access: bool = False,
    ) -> None:
        self.path = path
        self.fd = -1
        self.drop_behind = random_access and not populate  # (see verify)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError as exc:
            raise fmt.ShardFormatError(str(path), "missing") from exc
        try:
            if on_open is not None:
                on_open(fd, path)
            size = os.fstat(fd).st_size
            header = os.pread(fd, fmt.HEADER_SIZE, 0)
            self.fields = fmt.decode_header(kind, header, str(path), size)
            self.format = fmt.header_format(header)
            self.size = size
            if random_access:
                self.buffer = _map_random(fd, size, populate)
            else:
                self.buffer = _map(fd, size, populate, huge_pages)
        except BaseException:
            os.close(fd)
            raise
        if on_open is None:
            os.close(fd)
        else:
            self.fd = fd

    @property
    def address(self) -> int:
        """Where the mapping starts in this process."""
        return int(np.frombuffer(self.buffer, dtype=np.uint8, count=1).ctypes.data)

    def section(self, name: str, dtype: str, length: int | None = None) -> np.ndarray:
        """A section as an array; ShardFormatError when it is missing, or when `length` (in
        bytes) is given and it holds another."""
        sections = self.fields.get("sections", {})
        if name not in sections:
            raise fmt.ShardFormatError(str(self.path), f"section {name} missing")
        offset, size, _crc = sections[name]
        itemsize = np.dtype(dtype).itemsize
        if (length is not None and size != length) or size % itemsize:
            expected = length if length is not None else f"a multiple of {itemsize}"
            raise fmt.ShardFormatError(
                str(self.path),
                f"section {name} is {size} bytes, {expected} expected (truncated or corrupt)",
                offset,
            )
        return np.frombuffer(self.buffer, dtype=dtype, count=size // itemsize, offset=offset)

    def verify(self, cancelled: Callable[[], bool] | None = None) -> None:
        """Check every section's crc32; `cancelled` is asked between 64 MiB steps (a load
        that must stop, e.g. because the file is being rewritten, stops there). A file mapped
        for random access (larger than memory) is dropped from the page cache behind the
        check: streamed through a full memory group, it would push out the pages the process
        runs on (its code, the version it serves), stalling lookups for seconds."""
        checked = self._drop if self.drop_behind else None
        for name, (offset, length, crc) in self.fields["sections"].items():
            if fmt.section_crc(self.buffer, offset, length, cancelled, checked) != crc:
                raise fmt.ShardFormatError(
                    str(self.path), f"section {name} checksum mismatch (corrupted data)", offset
                )

    def _drop(self, offset: int, length: int) -> None:
        self.buffer.madvise(mmap.MADV_DONTNEED, offset - offset % mmap.PAGESIZE, length)
        fd = os.open(self.path, os.O_RDONLY) if self.fd < 0 else self.fd
        try:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
        finally:
            if fd != self.fd:
                os.close(fd)

    def close(self) -> bool:
        """Unmap and close the descriptor; False when arrays still point into the mapping
        (it goes when they do, and the descriptor stays open until then)."""
        try:
            self.buffer.close()
        except BufferError:
            return False
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        return True


class Shard:
    """One built shard (base or delta) mapped read-only."""

    def __init__(self, directory: Path, index: _MappedFile, data: _MappedFile) -> None:
        self.directory = directory
        self._files: tuple[_MappedFile, ...] = (index, data)
        self.meta = index.fields
        self.converted_s: float | None = None  # seconds a format-2 index took to convert
        if index.format == 2:
            self.table = self._convert_format_2(index)
        else:
            self.table = self._open_index(index)
        self.kernel_table = kernel.prepare(self.table)
        count = int(self.meta["record_count"])
        width = int(self.meta["value_width"])
        blob = data.section("values", "u1")
        if width:
            self.values = ValueColumn.fixed(blob, width)
        else:
            self.values = ValueColumn.variable(
                blob, data.section("offsets", "<u8").astype(np.int64)
            )
        if self.values.count != count:
            raise fmt.ShardFormatError(
                str(data.path), f"{self.values.count} values for {count} records"
            )

    def _open_index(self, index: _MappedFile) -> HashTable:
        """The index's arrays, checked against its header (sizes, bucket bits) in constant
        time: a truncated or inconsistent section is refused naming the file and section."""
        path = str(index.path)
        count = int(self.meta["record_count"])
        bits = self.meta.get("bucket_bits")
        if not isinstance(bits, int) or not 1 <= bits <= MAX_BITS:
            raise fmt.ShardFormatError(path, f"bucket_bits {bits!r} outside [1, {MAX_BITS}]")
        size = remainder_bytes(bits)
        if self.meta.get("remainder_bytes") != size:
            raise fmt.ShardFormatError(
                path, f"remainder_bytes {self.meta.get('remainder_bytes')!r}, {size} expected"
            )
        starts = index.section("bucket_starts", "<u4", 4 * ((1 << bits) + 1))
        remainders = index.section("remainders", "u1", count * size)
        if int(starts[-1]) != count:
            offset = index.fields["sections"]["bucket_starts"][0] + starts.nbytes - 4
            raise fmt.ShardFormatError(
                path, f"section bucket_starts ends at row {starts[-1]}, not {count}", offset
            )
        max_bucket = self.meta.get("max_bucket")
        if not isinstance(max_bucket, int) or not 0 <= max_bucket <= count:
            raise fmt.ShardFormatError(path, f"max_bucket {max_bucket!r} out of range")
        deleted = index.section("deleted_keys", "<u8")
        return HashTable(starts, remainders, deleted, bits, max_bucket)

    def _convert_format_2(self, index: _MappedFile) -> HashTable:
        """A format-2 index (the releases before format 3: a table of slots in hash order) as
        format 3, built in memory from its keys, and said in the log: a server upgraded in
        place keeps serving the versions on its disk."""
        started = time.perf_counter()
        count = int(self.meta["record_count"])
        slot_keys = index.section("slot_keys", "<u8")
        keys = slot_keys[slot_keys != np.uint64(int(self.meta["empty_key"]))]
        hashes = fmix64(keys)
        if keys.shape[0] != count or (hashes[1:] <= hashes[:-1]).any():
            raise fmt.ShardFormatError(
                str(index.path), f"section slot_keys: not {count} keys in hash order (format 2)"
            )
        del hashes
        table = replace(from_hash_ordered(keys), deleted_keys=index.section("deleted_keys", "<u8"))
        self.converted_s = time.perf_counter() - started
        log.warning(
            "%s: index format 2 converted to format 3 in memory in %.2f s (%d keys); rebuild"
            " it with this release's cube-builder to skip this",
            index.path, self.converted_s, count,
        )  # fmt: skip
        return table

    @classmethod
    def in_memory(cls, built: BuiltTable, values: ValueColumn) -> Shard:
        """A shard in anonymous memory, with no files (a server's hot cache,
        cube.server.hot): `built` is index.build_table of keys whose values are `values`, in
        the keys' order; the values are copied in row order."""
        shard = cls.__new__(cls)
        shard.directory = Path("<memory>")
        shard._files = ()
        shard.converted_s = None
        rows = values.take(built.live_order)
        shard.meta = {
            "record_count": int(built.live_order.shape[0]),
            "value_width": rows.width,
            "tombstone_count": built.tombstone_count,
        }
        shard.table = built.table
        shard.kernel_table = kernel.prepare(built.table)
        shard.values = rows
        return shard

    @classmethod
    def open(
        cls,
        directory: str | os.PathLike[str],
        *,
        verify: bool = False,
        populate: bool = False,
        on_open: FileHook | None = None,
        cancelled: Callable[[], bool] | None = None,
        huge_pages: bool = False,
        random_access: bool = False,
        populate_index: bool = False,
    ) -> Shard:
        """Map a shard directory. `verify` checks every checksum (reads all bytes);
        `populate` faults every page in now rather than on first use (`populate_index`: the
        index's only); `on_open` sees each file's descriptor right after it is opened (and
        keeps it open while mapped); `cancelled` can stop a long verify; `huge_pages`: 2 MiB
        mappings where the kernel has them (`_map`); `random_access`: a table larger than
        memory, faulted in 4 KiB at a time (`_map_random`; huge_pages ignored)."""
        directory = Path(directory)
        index = _MappedFile(
            directory / INDEX_FILE, "index", populate or populate_index, on_open, huge_pages,
            random_access,
        )  # fmt: skip
        try:
            data = _MappedFile(
                directory / DATA_FILE, "data", populate, on_open, huge_pages, random_access
            )
        except BaseException:
            index.close()
            raise
        try:
            if index.fields.get("build_id") != data.fields.get("build_id"):
                raise fmt.ShardFormatError(
                    str(directory), f"{INDEX_FILE} and {DATA_FILE} come from different builds"
                )
            if index.fields.get("data_file_size") != data.fields["file_size"]:
                raise fmt.ShardFormatError(
                    str(data.path), "size differs from what the index expects"
                )
            shard = cls(directory, index, data)
        except BaseException:
            index.close()
            data.close()
            raise
        if verify:
            try:
                shard.verify(cancelled)
            except BaseException:
                shard.close()
                raise
        return shard

    @property
    def record_count(self) -> int:
        return int(self.meta["record_count"])

    @property
    def value_width(self) -> int:
        return int(self.meta["value_width"])

    @property
    def files(self) -> tuple[_MappedFile, ...]:
        """The index and data files (path, descriptor when kept open, mapped size); none for
        a shard `in_memory`."""
        return self._files

    def verify(self, cancelled: Callable[[], bool] | None = None) -> None:
        for f in self._files:
            f.verify(cancelled)

    def pmd_mapped_bytes(self) -> int:
        """How much of this shard's files this process maps on 2 MiB pages (`pmd_mapped_bytes`)."""
        return pmd_mapped_bytes({f.address for f in self._files})

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows, found); tombstones are found with row TOMBSTONE."""
        return kernel.lookup(self.kernel_table, keys)

    def close(self) -> bool:
        """Drop the arrays and unmap; False when some array still points into a mapping."""
        self.table = None  # type: ignore[assignment]
        self.kernel_table = None  # type: ignore[assignment]
        self.values = None  # type: ignore[assignment]
        closed = [f.close() for f in self._files]
        return all(closed)


@dataclass(frozen=True)
class LookupResult:
    found: np.ndarray  # bool; False for misses and deleted keys
    layer: np.ndarray  # int16 layer index per key, -1 when not found
    rows: np.ndarray  # uint32 row within that layer


class ShardStack:
    """A base shard plus deltas applied in order (layers[0] is the base)."""

    def __init__(self, layers: list[Shard]) -> None:
        if not layers:
            raise ValueError("a shard stack needs at least a base")
        self.layers = list(layers)
        # One width when every layer that holds values agrees on it; else variable (0).
        widths = {s.value_width for s in self.layers if s.record_count}
        self.value_width = widths.pop() if len(widths) == 1 else 0

    def lookup(self, keys: np.ndarray) -> LookupResult:
        n = keys.shape[0]
        if len(self.layers) == 1:
            rows, found = self.layers[0].lookup(keys)
            if self.layers[0].meta.get("tombstone_count"):
                found &= rows != np.uint32(TOMBSTONE)
            layer = np.where(found, 0, -1).astype(np.int16)
            return LookupResult(found, layer, rows)
        layer = np.full(n, -1, dtype=np.int16)
        rows = np.zeros(n, dtype=np.uint32)
        settled = np.zeros(n, dtype=bool)
        pending = np.arange(n)
        for index in range(len(self.layers) - 1, -1, -1):
            sub_rows, sub_found = self.layers[index].lookup(keys[pending])
            hit = pending[sub_found]
            settled[hit] = True
            layer[hit] = index
            rows[hit] = sub_rows[sub_found]
            pending = pending[~sub_found]
            if not pending.shape[0]:
                break
        deleted = settled & (rows == np.uint32(TOMBSTONE))
        layer[deleted] = -1
        return LookupResult(settled & ~deleted, layer, rows)

    def gather_fixed(self, result: LookupResult) -> np.ndarray:
        """(n, value_width) uint8, zero rows for keys not found. Needs a fixed value width."""
        width = self.value_width
        if not width:
            raise ValueError("gather_fixed needs values of one width")
        if len(self.layers) == 1:
            rows = np.where(result.found, result.rows, 0)
            values = self.layers[0].values
            if values.count == 0:
                return np.zeros((rows.shape[0], width), dtype=np.uint8)
            out = values.as_rows().take(rows, axis=0)
            if not result.found.all():
                out[~result.found] = 0
            return out
        out = np.zeros((result.rows.shape[0], width), dtype=np.uint8)
        for index, shard in enumerate(self.layers):
            mine = np.flatnonzero(result.layer == index)
            if mine.shape[0]:
                out[mine] = shard.values.as_rows().take(result.rows[mine], axis=0)
        return out

    def value_bytes(self, result: LookupResult) -> int:
        """How many value bytes `gather(result)` would produce, without gathering."""
        if self.value_width:
            return int(np.count_nonzero(result.found)) * self.value_width
        total = 0
        for index, shard in enumerate(self.layers):
            rows = result.rows[(result.layer == index) & result.found].astype(np.int64)
            if rows.shape[0]:
                offsets = shard.values.offsets
                total += int((offsets.take(rows + 1) - offsets.take(rows)).sum())
        return total

    def gather(self, result: LookupResult) -> ValueColumn:
        """Values of all keys in request order; a key not found gets an empty value."""
        n = result.rows.shape[0]
        if self.value_width:
            fixed = self.gather_fixed(result)
            lengths = np.where(result.found, self.value_width, 0)
            offsets = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])
            return ValueColumn.variable(fixed[result.found].reshape(-1), offsets)
        lengths = np.zeros(n, dtype=np.int64)
        pieces = []
        for index, shard in enumerate(self.layers):
            mine = np.flatnonzero(result.layer == index)
            if mine.shape[0]:
                gathered = shard.values.take(result.rows[mine])
                lengths[mine] = gathered.lengths()
                pieces.append((mine, gathered.as_variable()))
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        blob = np.empty(int(offsets[-1]), dtype=np.uint8)
        for mine, gathered in pieces:
            # each gathered byte goes to its key's output offset + its place in the value
            dest = np.repeat(offsets[mine] - gathered.offsets[:-1], gathered.lengths())
            dest += np.arange(gathered.nbytes, dtype=np.int64)
            blob[dest] = gathered.blob[: gathered.nbytes]
        return ValueColumn.variable(blob, offsets)

    def close(self) -> None:
        for shard in self.layers:
            shard.close()
