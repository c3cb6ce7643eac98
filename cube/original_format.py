"""The original Cube's shard files (PaddlePaddle Serving's C++ cube-builder writes them, its
cube-server loads them), read from buffers the caller maps: pure, no I/O.

`cube-import` (cube/builder/import_original.py) finds the files, maps them and hands this
module bytes and uint8 arrays; what comes back is keys and a value source for the project's
own shard writer. Everything is checked, and a problem names the file and the byte offset.

The format, as the original's sources define it (file names under core/cube/ of
PaddlePaddle/Serving; all integers are little-endian, the builder's machine order):

- One shard of one version is a directory `<dict>_part<shard>/` (cube-builder/src/main.cpp)
  holding numbered data and index files and two lists. A *version* adds files; it never
  rewrites those of earlier versions (cube-builder/src/crovl_builder_increment.cpp).
- `data.<j>`: records back to back, each a uint32 `length` counting itself (the value is
  `length - 4` bytes) followed by the value bytes. A new file starts when the next record would
  pass the builder's data file limit (1 GiB, `MAX_BLOCK_SIZE` in cube-builder's define.h), so a
  file holds whole records only. `j` counts on across versions: a patch's first data file is
  numbered after the last one of the version it follows.
- `index.<k>`: one file per version that has records, `k` counting versions with records
  (index.0 is the base's). Pairs of uint64 `(key, address)`, 16 bytes a record, in the order the
  builder added them, with `address = data file number << 32 | byte offset` of the record in
  that file. Every record written to a data file has its index pair, so the addresses of a
  version tile its data files exactly.
- `data.n`: uint32 count, then one uint32 size per data file, for *every* data file up to this
  version (the earlier versions' first).
- `index.n`: uint32 index type (0, the hash index, the only one the incremental builder
  writes), uint32 count of records added up to and including this version (duplicates counted),
  uint32 count of index files, then one uint64 size per index file (earlier versions' first).
  A version without records writes no index or data file and repeats the previous lists.
- A key goes to shard `key % shard_num` (cube-builder/src/builder_job.cpp; the client routes
  the same way, cube-api/src/cube_api.cpp). Duplicate keys: the index is loaded file by file,
  record by record, and a later pair replaces an earlier one (cube-server/src/dict.cpp,
  include/cube/slim_hash_map.h: `load`), so the last record added wins, across versions too.
- The format has no deletions, no checksums and no version names: the names are the
  directories' (`<depend>_<cur>` from the builder, `<depend>` or `<depend>_<cur>` in a
  deployment's `cube_data/<shard>/` and `data/`, cube-agent/src/agent/work.go).
- The server loads a patch over its base by checking that the base's index file sizes are a
  prefix of the patch's `index.n` list (slim_hash_map.h: `check_file_len`); here the order of
  versions is found and checked the same way, with `data.n` as well.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NoReturn

import numpy as np

from cube.values import ValueColumn, gather_ranges

INDEX_LIST = "index.n"
DATA_LIST = "data.n"
HASH_INDEX = 0  # IT_HASH: the index type the original's incremental builder writes
RECORD_BYTES = 16  # an index pair: uint64 key, uint64 address
LENGTH_BYTES = 4  # a data record's uint32 length field, counted in the length
_NUMBERED = re.compile(r"(data|index)\.(0|[1-9][0-9]{0,8})")
_U32 = np.dtype("<u4")
_LOW32 = np.uint64(0xFFFFFFFF)
_SHIFT32 = np.uint64(32)


class OriginalFormatError(ValueError):
    """Original files that cannot be imported; the message names the file, the offset (when
    there is one) and what is wrong."""

    def __init__(self, file: str, problem: str, offset: int | None = None) -> None:
        where = f"{file} at offset {offset}" if offset is not None else file
        super().__init__(f"{where}: {problem}")
        self.file = file
        self.offset = offset


def numbered_file(name: str) -> tuple[str, int] | None:
    """`data.<j>` -> ("data", j), `index.<k>` -> ("index", k); None for any other name (the
    lists `data.n` and `index.n` included)."""
    match = _NUMBERED.fullmatch(name)
    return (match.group(1), int(match.group(2))) if match else None


# ---------------------------------------------------------------------------------------------
# the two lists


@dataclass(frozen=True)
class IndexList:
    """`index.n`: index type, records added so far, the size of every index file so far."""

    index_type: int
    count: int
    lengths: tuple[int, ...]


@dataclass(frozen=True)
class DataList:
    """`data.n`: the size of every data file so far."""

    lengths: tuple[int, ...]


def parse_index_list(data: bytes, file: str) -> IndexList:
    """Parse `index.n` (its exact size is 12 + 8 * file count)."""
    if len(data) < 12:
        raise OriginalFormatError(
            file, f"{len(data)} bytes, shorter than its 12-byte head (truncated)", len(data)
        )
    index_type, count, files = np.frombuffer(data, _U32, count=3).tolist()
    if index_type != HASH_INDEX:
        raise OriginalFormatError(
            file, f"index type {index_type}; only the hash index (0) is written by the "
            "original's incremental builder", 0,
        )  # fmt: skip
    want = 12 + 8 * files
    if len(data) != want:
        state = "truncated" if len(data) < want else "trailing bytes"
        raise OriginalFormatError(
            file, f"file count {files} needs {want} bytes, the file has {len(data)} ({state})", 8
        )
    lengths = tuple(np.frombuffer(data, "<u8", count=files, offset=12).tolist())
    for number, length in enumerate(lengths):
        if length % RECORD_BYTES:
            raise OriginalFormatError(
                file, f"index.{number} size {length} is not a multiple of {RECORD_BYTES}",
                12 + 8 * number,
            )  # fmt: skip
    if sum(lengths) != count * RECORD_BYTES:
        raise OriginalFormatError(
            file, f"record count {count} disagrees with the index file sizes listed "
            f"({sum(lengths) // RECORD_BYTES} records)", 4,
        )  # fmt: skip
    return IndexList(index_type, count, lengths)


def parse_data_list(data: bytes, file: str) -> DataList:
    """Parse `data.n` (its exact size is 4 + 4 * file count)."""
    if len(data) < 4:
        raise OriginalFormatError(
            file, f"{len(data)} bytes, shorter than its 4-byte count (truncated)", len(data)
        )
    files = int(np.frombuffer(data, _U32, count=1)[0])
    want = 4 + 4 * files
    if len(data) != want:
        state = "truncated" if len(data) < want else "trailing bytes"
        raise OriginalFormatError(
            file, f"file count {files} needs {want} bytes, the file has {len(data)} ({state})", 0
        )
    return DataList(tuple(np.frombuffer(data, _U32, count=files, offset=4).tolist()))


# ---------------------------------------------------------------------------------------------
# one shard of one version


@dataclass(frozen=True)
class Layer:
    """What one shard of one version holds: its lists and the numbered files that are its own
    (index_files, data_files: contiguous ranges ending at the lists' last file; empty for a
    version without records in this shard). `where` prefixes file names in messages."""

    where: str
    index_list: IndexList
    data_list: DataList
    index_files: range
    data_files: range
    no_files: bool = False  # a base shard without records: the builder wrote none of its files

    @property
    def is_base(self) -> bool:
        """A base holds index.0 (a patch's index files come after its base's)."""
        return self.no_files or (len(self.index_files) > 0 and self.index_files.start == 0)

    @classmethod
    def empty_base(cls, where: str) -> Layer:
        """A base shard that got no record. The original builder then stops before writing
        its lists (`done()` fails without a data file), leaving an empty directory or tar."""
        return cls(where, IndexList(HASH_INDEX, 0, ()), DataList(()), range(0), range(0), True)

    def name(self, file: str) -> str:
        return f"{self.where}/{file}"


def plan_layer(
    where: str,
    index_list: bytes,
    data_list: bytes,
    index_sizes: Mapping[int, int],
    data_sizes: Mapping[int, int],
) -> Layer:
    """Check one shard of one version from its lists and the sizes of the numbered files it
    holds (number -> size): the files must be the lists' last ones, in one run, of the sizes
    the lists give."""
    index = parse_index_list(index_list, f"{where}/{INDEX_LIST}")
    data = parse_data_list(data_list, f"{where}/{DATA_LIST}")
    index_files = _own_run(where, "index", index_sizes, index.lengths, INDEX_LIST, 12, 8)
    data_files = _own_run(where, "data", data_sizes, data.lengths, DATA_LIST, 4, 4)
    if bool(index_files) != bool(data_files):
        has, lacks = ("index", "data") if index_files else ("data", "index")
        raise OriginalFormatError(
            where, f"holds {has} files but no {lacks} file of the same version (incomplete copy)"
        )
    if index_files and (index_files.start == 0) != (data_files.start == 0):
        raise OriginalFormatError(
            where, f"index.{index_files.start} and data.{data_files.start} cannot start one "
            "version (a base has index.0 and data.0)",
        )  # fmt: skip
    return Layer(where, index, data, index_files, data_files)


def _own_run(
    where: str,
    kind: str,
    sizes: Mapping[int, int],
    listed: Sequence[int],
    list_name: str,
    list_head: int,
    entry_bytes: int,
) -> range:
    numbers = sorted(sizes)
    if not numbers:
        return range(0)
    first, last = numbers[0], numbers[-1]
    if last - first + 1 != len(numbers):
        gap = next(n for n in range(first, last) if n not in sizes)
        raise OriginalFormatError(where, f"has {kind}.{first} to {kind}.{last} but no {kind}.{gap}")
    if last != len(listed) - 1:
        raise OriginalFormatError(
            f"{where}/{list_name}", f"lists {len(listed)} {kind} files, but {kind}.{last} is here "
            f"(a {list_name} of another version?)", 0,
        )  # fmt: skip
    for number in numbers:
        if sizes[number] != listed[number]:
            raise OriginalFormatError(
                f"{where}/{kind}.{number}",
                f"{sizes[number]} bytes, {list_name} says {listed[number]} "
                f"({'truncated' if sizes[number] < listed[number] else 'grown'}; "
                f"{list_name} entry at offset {list_head + entry_bytes * number})",
            )
    return range(first, last + 1)


# ---------------------------------------------------------------------------------------------
# versions of one shard, in order


def order_layers(layers: Mapping[str, Layer], cur_of: Mapping[str, int]) -> list[str]:
    """The versions of one base (names -> layers of one shard) in the order they were built:
    by how many index and data files their lists hold (ties: versions without records, by
    `cur_of`). Checked like the original server checks a patch against its base: each
    version's lists start with the previous version's lists, and its files are the next
    ones. OriginalFormatError names the versions when they do not continue each other."""
    names = sorted(
        layers,
        key=lambda n: (
            len(layers[n].index_list.lengths),
            len(layers[n].data_list.lengths),
            cur_of[n],
        ),
    )
    bases = [n for n in names if layers[n].is_base]
    if not bases:
        raise OriginalFormatError(
            layers[names[0]].where, "no base among these versions (none holds index.0): "
            f"{', '.join(names)}",
        )  # fmt: skip
    if len(bases) > 1:
        raise OriginalFormatError(
            layers[bases[-1]].where, "more than one version holds a base's files (index.0): "
            f"{', '.join(bases)}",
        )  # fmt: skip
    base, first = bases[0], names[0]
    if first != base:
        old, new = layers[base], layers[first]
        raise OriginalFormatError(
            new.where, f"version {first} cannot be a patch of base {base}: it lists "
            f"{len(new.index_list.lengths)} index and {len(new.data_list.lengths)} data files, "
            f"the base {len(old.index_list.lengths)} and {len(old.data_list.lengths)}, and a "
            "patch lists its base's files and then its own (a patch of another build of that "
            "base?)",
        )  # fmt: skip
    for before, after in itertools.pairwise(names):
        _check_continues(before, layers[before], after, layers[after])
    return names


def _check_continues(before: str, old: Layer, after: str, new: Layer) -> None:
    for kind, old_list, new_list, own, list_name in (
        ("index", old.index_list.lengths, new.index_list.lengths, new.index_files, INDEX_LIST),
        ("data", old.data_list.lengths, new.data_list.lengths, new.data_files, DATA_LIST),
    ):
        if new_list[: len(old_list)] != old_list:
            raise OriginalFormatError(
                new.name(list_name), f"version {after} does not continue {before}: its "
                f"{kind} file sizes {_clip(new_list)} do not start with {before}'s "
                f"{_clip(old_list)} (built over another version?)",
            )  # fmt: skip
        if own and own.start != len(old_list):
            missing = f"{kind}.{len(old_list)}" + (
                f" to {kind}.{own.start - 1}" if own.start - 1 > len(old_list) else ""
            )
            raise OriginalFormatError(
                new.where, f"version {after} starts at {kind}.{own.start}, but {before} ends "
                f"at {kind}.{len(old_list) - 1}: the version(s) that wrote {missing} are missing",
            )  # fmt: skip
        if not own and len(new_list) != len(old_list):
            raise OriginalFormatError(
                new.name(list_name), f"version {after} lists {len(new_list)} {kind} files but "
                f"holds none of its own, and {before} ends at {len(old_list)}: versions are "
                "missing",
            )  # fmt: skip


def _clip(values: Sequence[int], limit: int = 6) -> str:
    shown = ", ".join(map(str, values[:limit]))
    return f"[{shown}{', ...' if len(values) > limit else ''}]"


# ---------------------------------------------------------------------------------------------
# records


@dataclass(frozen=True)
class LayerRecords:
    """One shard of one version read: keys in the order the builder added them, and their
    values where they are (`values.take` gathers them for the shard writer)."""

    keys: np.ndarray  # uint64
    values: OriginalValues


_CHUNK = 1 << 20  # records per step where a step makes 8-byte temporaries


def read_layer(
    layer: Layer,
    index_files: Mapping[int, np.ndarray],
    data_files: Mapping[int, np.ndarray],
    shard: int,
    shard_num: int,
) -> LayerRecords:
    """Read and check the records of one shard of one version. `index_files` and
    `data_files` map the layer's own file numbers to their bytes (uint8 arrays, e.g. views of
    a mapping; kept by the returned values). Checks: every key belongs to `shard` by the
    original's rule (key % shard_num), every address points into a data file of this version,
    the addresses increase as the builder wrote them, every length field fits its file, and
    the records tile the data files exactly.

    Kept per record: the key (8 bytes), the value's offset and length (4 each: data.n gives
    file sizes as uint32) and, with several data files, the file (2 bytes up to 65535 files,
    else 4); the addresses are read from the index files in steps, never copied whole."""
    _check_files_given(layer, index_files, data_files)
    pairs = [np.asarray(index_files[k]).view("<u8").reshape(-1, 2) for k in layer.index_files]
    starts_of = np.cumsum([0] + [p.shape[0] for p in pairs], dtype=np.int64)
    n = int(starts_of[-1])  # record number where each index file starts, then the count
    keys = np.concatenate([p[:, 0] for p in pairs]) if pairs else np.empty(0, np.uint64)

    def at_record(position: int) -> tuple[str, int]:
        file = int(np.searchsorted(starts_of, position, side="right")) - 1
        return layer.name(f"index.{layer.index_files[file]}"), int(
            (position - starts_of[file]) * RECORD_BYTES
        )

    if shard_num > 1 and n:
        _check_owners(keys, shard, shard_num, at_record)
    file_of, offsets = _read_addresses(layer, pairs, starts_of, keys, at_record)
    del pairs
    lengths = _value_lengths(layer, data_files, file_of, offsets, keys, at_record)
    offsets += np.uint32(LENGTH_BYTES)  # < a file size listed as uint32: no overflow
    value_files = [np.asarray(data_files[number]) for number in layer.data_files]
    return LayerRecords(keys, OriginalValues(value_files, file_of, offsets, lengths))


def _check_files_given(
    layer: Layer, index_files: Mapping[int, np.ndarray], data_files: Mapping[int, np.ndarray]
) -> None:
    for kind, files, own in (
        ("index", index_files, layer.index_files),
        ("data", data_files, layer.data_files),
    ):
        if sorted(files) != list(own):
            raise ValueError(f"{layer.where}: {kind} files {sorted(files)} given, {list(own)} held")


def _check_owners(
    keys: np.ndarray, shard: int, shard_num: int, at_record: Callable[[int], tuple[str, int]]
) -> None:
    """Every key belongs to `shard` by the original's rule (key % shard_num)."""
    owners = keys % np.uint64(shard_num)
    wrong = np.flatnonzero(owners != np.uint64(shard))
    if wrong.shape[0]:
        file, offset = at_record(int(wrong[0]))
        key = int(keys[wrong[0]])
        raise OriginalFormatError(
            file, f"key {key} belongs to shard {key % shard_num} of {shard_num} by the "
            f"original's rule (key % shard_num), not to shard {shard} ({wrong.shape[0]} "
            "such keys): -shard_num is not the original build's, or this is not shard "
            f"{shard}", offset,
        )  # fmt: skip


def _read_addresses(
    layer: Layer,
    pairs: list[np.ndarray],
    starts_of: np.ndarray,
    keys: np.ndarray,
    at_record: Callable[[int], tuple[str, int]],
) -> tuple[np.ndarray, np.ndarray]:
    """Each record's data file (its position in layer.data_files; empty with one file) and
    the offset of its length field, read from the index in steps of _CHUNK records. Every
    address must point into this version's data files and be above the one before."""
    n = int(starts_of[-1])
    own = layer.data_files
    several = len(own) > 1
    file_type = np.uint16 if len(own) < 1 << 16 else np.uint32  # holds len(own) too
    file_of = np.empty(n if several else 0, dtype=file_type)  # position in `own`
    offsets = np.empty(n, dtype=np.uint32)  # of the length fields, then of the values
    lowest, first_file = np.uint64(own.start << 32), np.uint64(own.start)
    beyond = own.stop << 32  # the first address past this version's data files
    previous = -1  # the address of the record before
    for pair, first in zip(pairs, starts_of[:-1].tolist(), strict=True):
        for lo in range(0, pair.shape[0], _CHUNK):
            addresses = pair[lo : lo + _CHUNK, 1]  # a strided view of the index bytes
            outside = addresses < lowest
            if beyond < 1 << 64:
                outside |= addresses >= np.uint64(beyond)
            if outside.any():
                i = int(np.flatnonzero(outside)[0])
                file, offset = at_record(first + lo + i)
                held = f"data.{own.start} to data.{own.stop - 1}" if own else "no data file"
                raise OriginalFormatError(
                    file, f"key {int(keys[first + lo + i])} points at "
                    f"data.{int(addresses[i]) >> 32}, but this version holds {held}", offset + 8,
                )  # fmt: skip
            back = np.flatnonzero(addresses[1:] <= addresses[:-1])
            if int(addresses[0]) <= previous or back.shape[0]:
                i = 0 if int(addresses[0]) <= previous else int(back[0]) + 1
                before = previous if i == 0 else int(addresses[i - 1])
                _out_of_order(layer, keys, first + lo + i, int(addresses[i]), before, at_record)
            previous = int(addresses[-1])
            offsets[first + lo : first + lo + addresses.shape[0]] = addresses & _LOW32
            if several:
                file_of[first + lo : first + lo + addresses.shape[0]] = (
                    addresses >> _SHIFT32
                ) - first_file
    return file_of, offsets


def _value_lengths(
    layer: Layer,
    data_files: Mapping[int, np.ndarray],
    file_of: np.ndarray,
    offsets: np.ndarray,
    keys: np.ndarray,
    at_record: Callable[[int], tuple[str, int]],
) -> np.ndarray:
    """Each record's value length, checking that each data file's records tile it exactly."""
    own = layer.data_files
    n = offsets.shape[0]
    lengths = np.empty(n, dtype=np.uint32)  # of the values
    if len(own) > 1:  # addresses increase: each file's records are one run
        bounds = np.searchsorted(file_of, np.arange(len(own) + 1, dtype=file_of.dtype)).tolist()
    else:
        bounds = [0, n] if own else [0]
    for number, lo, hi in zip(own, bounds[:-1], bounds[1:], strict=True):
        file = layer.name(f"data.{number}")
        data = np.asarray(data_files[number])
        if lo == hi:
            raise OriginalFormatError(
                file, f"{data.shape[0]} bytes, but no index record points into it"
            )

        def record(i: int, lo: int = lo) -> str:
            index_file, offset = at_record(lo + i)
            return f"the record of key {int(keys[lo + i])} ({index_file} at offset {offset})"

        lengths[lo:hi] = _check_tiling(file, data, offsets[lo:hi], record)
    return lengths


def _out_of_order(
    layer: Layer,
    keys: np.ndarray,
    position: int,
    address: int,
    before: int,
    at_record: Callable[[int], tuple[str, int]],
) -> NoReturn:
    file, offset = at_record(position)
    raise OriginalFormatError(
        file, f"index records not in the builder's order: the record of key "
        f"{int(keys[position])} points at data.{address >> 32} offset {address & 0xFFFFFFFF}, "
        f"not past the record before it (data.{before >> 32} offset {before & 0xFFFFFFFF}); "
        "the builder appends each value after the previous one and indexes it in that order "
        "(corrupt or rewritten index)", offset + 8,
    )  # fmt: skip


def _check_tiling(
    file: str, data: np.ndarray, offsets: np.ndarray, describe: Callable[[int], str]
) -> np.ndarray:
    """The value lengths (uint32) of the records whose length fields are at `offsets` (uint32,
    increasing) in one data file, checked: each length field fits the file, and the records
    cover it end to end with no gap or overlap. `describe(i)` tells which record the i-th
    offset is (for messages)."""
    size = int(data.shape[0])
    past = np.flatnonzero(offsets > size - LENGTH_BYTES) if size >= LENGTH_BYTES else [0]
    if len(past):
        i = int(past[0])
        raise OriginalFormatError(
            file, f"{describe(i)} points here, past the last length field of this {size}-byte "
            "file (truncated?)", int(offsets[i]),
        )  # fmt: skip
    fields = _u32_at(data, offsets)
    short = np.flatnonzero(fields < LENGTH_BYTES)
    if short.shape[0]:
        i = int(short[0])
        raise OriginalFormatError(
            file, f"length field {int(fields[i])} is less than the field's own 4 bytes "
            f"({describe(i)}; corrupt)", int(offsets[i]),
        )  # fmt: skip
    ends = offsets.astype(np.int64)
    ends += fields
    over = np.flatnonzero(ends > size)
    if over.shape[0]:
        i = int(over[0])
        raise OriginalFormatError(
            file, f"length field {int(fields[i])} runs to offset {int(ends[i])}, past the end of "
            f"this {size}-byte file ({describe(i)}; truncated or corrupt)", int(offsets[i]),
        )  # fmt: skip
    if int(offsets[0]) != 0:
        raise OriginalFormatError(
            file, f"bytes 0 to {int(offsets[0])} belong to no indexed record (corrupt index or "
            "data)", 0,
        )  # fmt: skip
    mismatch = np.flatnonzero(offsets[1:] != ends[:-1])
    if mismatch.shape[0]:
        i = int(mismatch[0])
        end, following = int(ends[i]), int(offsets[i + 1])
        what = (
            f"the record here (length field {int(fields[i])}) ends at {end}, but the next "
            f"indexed record starts at {following}"
        )
        raise OriginalFormatError(
            file, f"{what} ({'overlap' if following < end else 'a gap'}; {describe(i)}; "
            "corrupt length field or index)", int(offsets[i]),
        )  # fmt: skip
    if int(ends[-1]) != size:
        raise OriginalFormatError(
            file, f"bytes {int(ends[-1])} to {size} belong to no indexed record (corrupt length "
            "field or index)", int(ends[-1]),
        )  # fmt: skip
    del ends
    fields -= np.uint32(LENGTH_BYTES)
    return fields


def _u32_at(data: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """The little-endian uint32 at each byte offset (offsets + 4 <= len(data))."""
    if data.shape[0] < LENGTH_BYTES:
        return np.empty(0, dtype=np.uint32)
    words = np.ndarray(
        (data.shape[0] - LENGTH_BYTES + 1,), dtype=_U32, buffer=data, strides=(1,)
    )  # a 4-byte item starting at every byte
    picked: np.ndarray = words[offsets]  # indexing: far faster than take on strided items
    return picked.astype(np.uint32, copy=False)


# ---------------------------------------------------------------------------------------------
# values where they are


class OriginalValues:
    """Values of one shard of one version, in record order, read from the original's data
    files (uint8 arrays, e.g. mapped) when taken: what `cube.shard_writer.write_shard` takes
    (`cube.shard_writer.ValueSource`). Fixed width when every value has one non-zero length."""

    def __init__(
        self,
        files: Sequence[np.ndarray],
        file_of: np.ndarray,
        starts: np.ndarray,
        lengths: np.ndarray,
    ) -> None:
        self._files = list(files)
        self._file_of = file_of  # position in files of each record's data file (empty with one
        # file): uint16, or uint32 past 65535 files
        self._starts = starts  # uint32: byte offset of each value in its file
        self._lengths = lengths  # uint32
        self.count = int(lengths.shape[0])
        width = int(lengths[0]) if self.count else 0
        self.width = width if width and bool((lengths == width).all()) else 0

    def __len__(self) -> int:
        return self.count

    def lengths(self) -> np.ndarray:
        return self._lengths

    def take(self, rows: np.ndarray) -> ValueColumn:
        """Values of records `rows`, in that order, as a new contiguous column."""
        rows = np.asarray(rows, dtype=np.int64)
        starts = self._starts.take(rows)
        single = len(self._files) == 1
        files = None if single else self._file_of.take(rows)
        if self.width:
            width = self.width
            out = np.empty(rows.shape[0], dtype=f"V{width}")
            for data, picked in self._groups(files):
                items = np.ndarray(
                    (max(data.shape[0] - width + 1, 0),), f"V{width}", buffer=data, strides=(1,)
                )
                # indexing, not take: take copies strided items slowly (100x at 32 bytes)
                if picked is None:
                    out[:] = items[starts]
                else:
                    out[picked] = items[starts[picked]]
            return ValueColumn.fixed(out.view(np.uint8), width)
        lengths = self._lengths.take(rows)
        if single:
            return ValueColumn.variable(*gather_ranges(self._files[0], starts, lengths))
        offsets = np.zeros(rows.shape[0] + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        blob = np.empty(int(offsets[-1]), dtype=np.uint8)
        for data, picked in self._groups(files):
            assert picked is not None
            piece, piece_offsets = gather_ranges(data, starts[picked], lengths[picked])
            # each gathered byte goes to its record's output offset + its place in the value
            dest = np.repeat(offsets[picked] - piece_offsets[:-1], lengths[picked])
            dest += np.arange(piece.shape[0], dtype=np.int64)
            blob[dest] = piece
        return ValueColumn.variable(blob, offsets)

    def _groups(self, files: np.ndarray | None) -> Iterable[tuple[np.ndarray, np.ndarray | None]]:
        """(a data file's bytes, positions of the taken rows in it; None: all of them)."""
        if files is None:
            yield self._files[0], None
            return
        for number in np.unique(files).tolist():
            yield self._files[number], np.flatnonzero(files == number)
