"""cube-import, opening one source: its data.N/index.N files (in a directory or a tar, md5
checked), mapped for the conversion, and the layer `cube.original_format` plans from them.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import numpy as np

from cube.builder.import_original.base import ImportError_, is_original_file
from cube.builder.import_original.discover import Source, _foreign
from cube.fsutil import Md5Error, check_md5_file
from cube.original_format import (
    DATA_LIST,
    INDEX_LIST,
    Layer,
    numbered_file,
    plan_layer,
)


@dataclass(frozen=True)
class _Extent:
    """Where the bytes of one of the format's files are: a file of its own (offset 0) or a
    member of a tar."""

    path: Path
    offset: int
    size: int


_Stamp = tuple[int, int, int, int]  # (device, inode, size, mtime in ns) of a file


def _stamp(path: Path) -> _Stamp:
    info = os.stat(path)
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)


@dataclass
class _Files:
    """A source's files of the format (name -> where its bytes are), the names of the other
    regular files it holds, and each file's stamp when it was checked: the conversion refuses
    a file that changed since, and a worker killed while reading is explained by them."""

    where: str
    extents: dict[str, _Extent] = field(default_factory=dict)
    others: list[str] = field(default_factory=list)
    stamps: dict[Path, _Stamp] = field(default_factory=dict)

    def changed(self) -> str:
        """What happened to the files since they were checked ('' when nothing did): the
        first one cut short (at which offset), gone or rewritten."""
        for path, (device, inode, size, mtime) in self.stamps.items():
            try:
                now = _stamp(path)
            except OSError:
                return f"{path}: gone while cube-import read it"
            if now[2] < size:
                lost = sorted(n for n, e in self.extents.items()
                              if e.path == path and e.offset + e.size > now[2])  # fmt: skip
                members = f"; it held {', '.join(lost)}" if path.suffix == ".tar" and lost else ""
                return (
                    f"{path} at offset {now[2]}: cut short while cube-import read it "
                    f"({size} bytes when checked, {now[2]} now{members})"
                )
            if now != (device, inode, size, mtime):
                return f"{path}: changed while cube-import read it"
        return ""


def list_source(source: Source, check_md5: bool) -> _Files:
    """The source's files of the format, found and stamped, none of their bytes read but a
    tar's headers (and its md5 when `check_md5`)."""
    files = _Files(str(source.path))
    if source.kind == "dir":
        for name in sorted(os.listdir(source.path)):
            path = source.path / name
            if is_original_file(name) and path.is_file():
                files.stamps[path] = _stamp(path)
                files.extents[name] = _Extent(path, 0, files.stamps[path][2])
            elif is_original_file(name):
                raise ImportError_(f"{path}: not a regular file")
            else:
                files.others.append(name)
    elif source.kind == "tar":
        files.stamps[source.path] = _stamp(source.path)
        if check_md5:
            _check_md5(source.path)
        members, files.others = _tar_members(source.path)
        for name, (offset, size) in members.items():
            files.extents[name] = _Extent(source.path, offset, size)
    return files


def _read_small(name: str, extent: _Extent) -> bytes:
    """The bytes of a small file (a list), read, not mapped."""
    with open(extent.path, "rb") as f:
        data = os.pread(f.fileno(), extent.size, extent.offset)
    if len(data) != extent.size:
        raise ImportError_(f"{extent.path} at offset {extent.offset + len(data)}: {name} "
                           f"ends early (cut short since it was listed?)")  # fmt: skip
    return data


@contextlib.contextmanager
def mapped(files: _Files) -> Iterator[dict[str, np.ndarray]]:
    """The source's files of the format as uint8 arrays, mapped read-only (unmapped at the
    end); ImportError_ when a file is not the one `files` stamped (changed since it was
    checked). To be used in a worker process only (see `convert_shard`)."""
    arrays: dict[str, np.ndarray] = {}
    maps: list[mmap.mmap] = []
    whole: dict[Path, np.ndarray] = {}
    try:
        for path, stamp in files.stamps.items():
            with open(path, "rb") as f:
                info = os.fstat(f.fileno())
                now = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
                if now != stamp:
                    was = f"{stamp[2]} bytes" if now[2] != stamp[2] else "another modification time"
                    raise ImportError_(f"{path}: changed since it was checked ({now[2]} bytes, "
                                       f"{was} then)")  # fmt: skip
                if not info.st_size:
                    whole[path] = np.empty(0, dtype=np.uint8)
                    continue
                maps.append(mmap.mmap(f.fileno(), info.st_size, prot=mmap.PROT_READ))
                whole[path] = np.frombuffer(maps[-1], dtype=np.uint8)
        for name, extent in files.extents.items():
            arrays[name] = whole[extent.path][extent.offset : extent.offset + extent.size]
        whole.clear()
        yield arrays
    finally:
        arrays.clear()
        whole.clear()
        for mapping in maps:
            with contextlib.suppress(BufferError):  # a view still held: unmapped when freed
                mapping.close()


def _tar_members(path: Path) -> tuple[dict[str, tuple[int, int]], list[str]]:
    """The format's files in a shard tar (the original packs `./data.0`, ..., `./index.n`):
    name -> (offset, size) of its bytes in the tar, checked against the tar's size; and the
    names of its other regular files."""
    found: dict[str, tuple[int, int]] = {}
    others: list[str] = []
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            with tarfile.open(fileobj=f, mode="r:") as tar:
                for member in tar:
                    name = "/".join(PurePosixPath(member.name).parts)  # ./x, ././x -> x
                    if not is_original_file(name):
                        if not member.isdir():
                            others.append(name)
                        continue
                    if not member.isreg():
                        raise ImportError_(
                            f"{path}: member {member.name} is not a regular file (at offset "
                            f"{member.offset})"
                        )
                    if member.issparse():
                        raise ImportError_(
                            f"{path}: member {member.name} is a sparse file (at offset "
                            f"{member.offset}): its bytes are not stored in one piece; the "
                            "original's tars hold plain files"
                        )
                    end = member.offset_data + member.size
                    if end > size:
                        raise ImportError_(
                            f"{path} at offset {member.offset_data}: member {member.name} "
                            f"claims {member.size} bytes, the tar ends at {size} (truncated)"
                        )
                    found[name] = (member.offset_data, member.size)
    except tarfile.TarError as exc:
        raise ImportError_(f"{path}: not a readable plain tar ({exc})") from None
    return found, others


def _check_md5(tar: Path) -> None:
    """Against `<tar>.md5` (md5sum's line, as the original writes it) when there is one."""
    try:
        check_md5_file(tar)
    except Md5Error as exc:
        raise ImportError_(f"{exc} (-check_md5=false skips this check)") from None


def plan_source(source: Source, files: _Files) -> Layer:
    """The layer a source holds (cube.original_format.plan_layer on its lists and sizes). A
    source without any regular file is an empty base shard, as the original leaves it; one
    holding other files only is not the original's."""
    extents = files.extents
    if source.kind == "empty" or not extents:
        if files.others:
            raise _foreign(files.where, files.others)
        return Layer.empty_base(str(source.path))
    for name in (INDEX_LIST, DATA_LIST):
        if name not in extents:
            raise ImportError_(f"{files.where}: no {name} (an incomplete copy?)")
    sizes: dict[str, dict[int, int]] = {"index": {}, "data": {}}
    for name, extent in extents.items():
        numbered = numbered_file(name)
        if numbered:
            sizes[numbered[0]][numbered[1]] = extent.size
    return plan_layer(
        files.where,
        _read_small(INDEX_LIST, extents[INDEX_LIST]),
        _read_small(DATA_LIST, extents[DATA_LIST]),
        sizes["index"],
        sizes["data"],
    )
