"""cube-import: tables the original Cube built, converted into this project's format.

Thin shell over `cube.original_format` (the format, its checks, the values): this module finds
the original's files and writes each shard with the builder's own writer and packer
(`cube.shard_writer.write_shard`, `cube.builder.build.package_shard`, `write_meta_infos`,
`Workspace`), one shard of one version at a time, in a worker process that maps the files (a
file cut short under it kills the worker with SIGBUS, not the import: `convert_shard`, which
says why). Memory follows one
shard of one version: its keys, value offsets and lengths (16 bytes a record, 18 with several
data files) and the table built from the keys; the values are read from the mapped files as
they are written. Peak traced memory, measured with tracemalloc over 1-2M-record shards: about
63 bytes a record (build_table's own peak included), whatever the value sizes.

Inputs (-input_path, comma-separated for several), found by their layout:
- the original cube-builder's output: its -output_path (version directories `<depend>_<cur>`),
  one version directory (`<dict>_part<i>/` directories and/or `<dict>_part<i>.tar`), one shard
  directory or one shard tar;
- a deployment of the original: its deploy path, its `cube_data/` (downloads,
  `<shard>/<version>/`, unpacked next to the tar; `<shard>/<version>-<dict>/`, the tar alone,
  in the agent's service mode) or its `data/` (`VERSION` and `<version>/`, whose files link
  into `cube_data/`), or a local-mode `data/` holding one version's files (give -version).

Outputs: every target is checked and staged before anything is converted, and all of them are
renamed into place (SIGINT and SIGTERM blocked meanwhile) only when every version is complete;
a failure or a signal before that leaves nothing published, a failed rename undoes the others:
- -output_path: build output as cube-builder writes it, `<depend>_<cur>/<dict>_part<i>/`, tar,
  md5 and `meta_info/`: what cube-transfer checks and cube-agent places;
- -data_dir: a cube-server data directory for one shard, `<version>/` (with CHAIN for a
  patch) and VERSION naming the version the deployment served (else the newest).
"""

from __future__ import annotations

import contextlib
import gc
import mmap
import os
import re
import shutil
import signal
import sys
import tarfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as cube-builder: no BLAS threads needed

import numpy as np

from cube.builder.build import (
    BuildConfig,
    BuildError,
    Workspace,
    _Pool,
    abort_active_builds,
    package_shard,
    shard_header_meta,
    write_meta_infos,
)
from cube.builder.meta import META_DIR, ShardOutput, meta_info_name
from cube.flags import FlagError, FlagSet, one_line, run_cli
from cube.fsutil import Md5Error, atomic_write_text, check_md5_file, fsync_dir
from cube.index import build_table
from cube.layout import (
    CHAIN_FILE,
    VERSION_FILE,
    chain_text,
    is_name,
    parse_version,
    part_name,
    served_version,
    tar_name,
    version_text,
)
from cube.original_format import (
    DATA_LIST,
    INDEX_LIST,
    Layer,
    OriginalFormatError,
    OriginalValues,
    numbered_file,
    order_layers,
    plan_layer,
    read_layer,
)
from cube.shard_writer import write_shard

EXIT_OK, EXIT_FAILED, EXIT_BAD_FLAGS = 0, 1, 2
# What the headers say the keys were read as: the original read a record's key as its raw 8
# bytes, little-endian (builder_job.cpp), cube-builder's "cube" key format.
KEY_FORMAT = "cube"
FORMAT_FILES = "data.N, index.N, data.n, index.n"  # the original's shard files, for messages
_VERSION_RE = re.compile(r"(0|[1-9][0-9]{0,18})(?:_(0|[1-9][0-9]{0,18}))?")
_VERSION_RULE = "<depend>_<cur> or <depend>, positive numbers without leading zeros"
_PART_RE = re.compile(r"(?P<dict>.+)_part(?P<shard>0|[1-9][0-9]{0,5})")
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


class ImportError_(RuntimeError):
    """An import that cannot go on; the message is one line for the user."""


def warn(message: str) -> None:
    """A warning: stderr, always (-quiet silences the summary only)."""
    print(f"warning: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# finding the original's files


@dataclass(frozen=True)
class Source:
    """One shard of one version of the original: a directory of its files, a tar of them, or
    nothing (a base shard that got no record: the original builder stops before writing its
    lists, leaving an empty directory or tar)."""

    version: str  # as the original names it: <depend>_<cur>, <depend>, ...
    shard: int
    kind: str  # "dir" | "tar" | "empty"
    path: Path


@dataclass
class Inventory:
    sources: dict[tuple[str, int], Source] = field(default_factory=dict)
    served: str | None = None  # the version a deployment's VERSION names
    served_from: str = ""
    notes: list[str] = field(default_factory=list)  # warnings for the user

    def add(self, source: Source) -> None:
        key = (source.version, source.shard)
        other = self.sources.get(key)
        if other is not None and other.path != source.path:
            raise ImportError_(
                f"version {source.version} shard {source.shard} is found twice: {other.path} "
                f"and {source.path}; give one of them"
            )
        self.sources[key] = source


@dataclass(frozen=True)
class Hints:
    dict_name: str
    shard: int | None  # -shard
    version: str | None  # -version (checked by parse_version_name)


def parse_version_name(name: str) -> tuple[int, int] | None:
    """`<depend>_<cur>` or `<depend>` (a base: cur = depend) -> (depend, cur); None when the
    name is not one, or names version 0 (the original's local mode builds `0_0`)."""
    match = _VERSION_RE.fullmatch(name)
    if not match:
        return None
    depend = int(match.group(1))
    cur = int(match.group(2)) if match.group(2) is not None else depend
    return (depend, cur) if depend > 0 and cur > 0 else None


def version_name(name: str, origin: str, hints: Hints | None = None) -> str:
    """Every version name the import uses comes through here: `name` when it is one, else
    -version when `hints` allow it (a directory's name: local mode, version 0), else
    ImportError_ saying where the name came from (`origin`: "<file> names",
    "<dir>: its directory name"). -version itself is checked as a flag (exit 2)."""
    if parse_version_name(name):
        return name
    if hints is not None and hints.version:
        return hints.version
    give = "; give -version" if hints is not None else ""
    raise ImportError_(
        f"{origin} {name!r}, not a version of the original ({_VERSION_RULE}; the local "
        f"mode's 0 is none){give}"
    )


def _is_shard_dir(path: Path) -> bool:
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return any(_wanted(n) for n in names)


def _version_of(directory: Path, where: Path, hints: Hints) -> str:
    """The version a directory's name gives (-version when it gives none)."""
    return version_name(directory.name, f"{where}: its directory name", hints)


def _shard_hint(where: Path, hints: Hints) -> int:
    if hints.shard is None:
        raise ImportError_(f"{where}: cannot tell which shard this is: give -shard")
    return hints.shard


def _check_dict(path: Path, match: re.Match[str], hints: Hints) -> None:
    if match["dict"] != hints.dict_name:
        raise ImportError_(
            f"{path} is a part of dict {match['dict']!r}, not of -dict_name {hints.dict_name!r}"
        )


def _foreign(where: Path | str, names: Sequence[str]) -> ImportError_:
    shown = ", ".join(sorted(names)[:6]) + (", ..." if len(names) > 6 else "")
    return ImportError_(f"{where}: holds {shown}: not the original's format ({FORMAT_FILES})")


def find_sources(paths: Sequence[Path], hints: Hints) -> Inventory:
    """Every shard of every version under `paths` (see the module docstring for layouts)."""
    inventory = Inventory()
    for path in paths:
        if not path.exists():
            raise ImportError_(f"{path}: no such file or directory")
        if path.is_file():
            _add_tar(inventory, path, hints)
        elif (path / VERSION_FILE).is_file() and _served_dir(path):
            _add_data_dir(inventory, path, hints)  # before: its links to files look like one
        elif _is_shard_dir(path):
            _add_shard_dir(inventory, path, hints)
        elif _parts(path, hints.dict_name):
            _add_version_dir(inventory, path, hints)
        elif (path / "cube_data").is_dir():
            served = path / "data" / VERSION_FILE
            _add_cube_data(inventory, path / "cube_data", hints, served)
        elif (path / "data").is_dir() and (path / "data" / VERSION_FILE).is_file():
            _add_data_dir(inventory, path / "data", hints)
        elif _shard_seq_dirs(path, hints.dict_name):
            _add_cube_data(inventory, path, hints, None)
        else:
            versions = [
                entry
                for entry in sorted(path.iterdir())
                if entry.is_dir() and _VERSION_RE.fullmatch(entry.name)
            ]
            found = [v for v in versions if _parts(v, hints.dict_name)]
            if not found:
                others = sorted({m["dict"] for v in versions for m in _part_matches(v)})
                hint = f" (parts of {', '.join(others)}: -dict_name?)" if others else ""
                raise ImportError_(
                    f"{path}: no files of the original Cube found for dict {hints.dict_name!r}"
                    f"{hint}; give the original builder's output, a version or shard directory "
                    "or tar, or a deployment's deploy path, data/ or cube_data/"
                )
            for version in found:
                _add_version_dir(inventory, version, hints)
    if not inventory.sources:
        raise ImportError_(
            f"no shard of dict {hints.dict_name!r} found in {', '.join(map(str, paths))}"
        )
    return inventory


def _part_matches(directory: Path) -> list[re.Match[str]]:
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = []
    for name in names:
        match = _PART_RE.fullmatch(name.removesuffix(".tar"))
        if match and (name.endswith(".tar") or (directory / name).is_dir()):
            found.append(match)
    return found


def _parts(directory: Path, dict_name: str) -> list[int]:
    """Shard numbers of `<dict>_part<i>` directories or tars in a builder version directory."""
    return sorted({int(m["shard"]) for m in _part_matches(directory) if m["dict"] == dict_name})


def _add_tar(inventory: Inventory, path: Path, hints: Hints) -> None:
    if not path.name.endswith(".tar"):
        raise ImportError_(f"{path}: not a shard tar (<dict>_part<i>.tar) nor a directory")
    match = _PART_RE.fullmatch(path.name.removesuffix(".tar"))
    if match:
        _check_dict(path, match, hints)
    shard = int(match["shard"]) if match else _shard_hint(path, hints)
    if match and hints.shard is not None and shard != hints.shard:
        raise ImportError_(f"{path} is shard {shard}, not -shard {hints.shard}")
    inventory.add(Source(_version_of(path.parent, path, hints), shard, "tar", path))


def _add_shard_dir(inventory: Inventory, path: Path, hints: Hints) -> None:
    match = _PART_RE.fullmatch(path.name)
    if match:  # the builder's <dict>_part<i>/ inside <depend>_<cur>/
        _check_dict(path, match, hints)
        shard, version = int(match["shard"]), _version_of(path.parent, path, hints)
    else:  # a deployment's cube_data/<shard>/<version>/ or data/<version>/, or local mode
        version = _version_of(path, path, hints)
        seq = path.parent.name
        in_downloads = seq.isdigit() and path.parent.parent.name == "cube_data"
        shard = int(seq) if in_downloads else _shard_hint(path, hints)
        if hints.shard is not None and shard != hints.shard:
            raise ImportError_(f"{path} is shard {shard}, not -shard {hints.shard}")
    inventory.add(Source(version, shard, "dir", path))


def _add_version_dir(inventory: Inventory, path: Path, hints: Hints) -> None:
    version = _version_of(path, path, hints)
    for shard in _parts(path, hints.dict_name):
        if hints.shard is not None and shard != hints.shard:
            continue
        directory = path / part_name(hints.dict_name, shard)
        tar = path / tar_name(hints.dict_name, shard)
        names = os.listdir(directory) if directory.is_dir() else []
        if names and _is_shard_dir(directory):
            inventory.add(Source(version, shard, "dir", directory))
        elif tar.is_file():
            inventory.add(Source(version, shard, "tar", tar))
        elif directory.is_dir() and not names:
            inventory.add(Source(version, shard, "empty", directory))
        elif names:
            raise _foreign(directory, names)
        else:
            raise ImportError_(f"{directory}: neither the shard's files nor its tar are here")


def _served_dir(path: Path) -> Path | None:
    """data/<VERSION>/ when it holds a shard's files."""
    try:
        served = parse_version((path / VERSION_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError):
        return None
    if served and is_name(served) and _is_shard_dir(path / served):
        return path / served
    return None


def _add_data_dir(inventory: Inventory, path: Path, hints: Hints) -> None:
    """A deployment's data/: VERSION names the served version; data/<version>/ holds (links to)
    the files of the base and of every patch loaded over it. Links are followed to the
    directories the versions were unpacked in (cube_data/<shard>/<version>/), each a version."""
    served_dir = _served_dir(path)
    version_file = path / VERSION_FILE
    if served_dir is None:
        text = version_file.read_text(encoding="utf-8", errors="replace")
        named = parse_version(text) or ""
        if named and (path / "0" / named).is_dir():
            raise ImportError_(
                f"{path}: a dict_split layout (data/<split>/<version>/): not supported, the "
                "original cube-builder builds one split per shard"
            )
        raise ImportError_(f"{version_file} names {named!r}, which holds no shard files")
    served = version_name(served_dir.name, f"{version_file} names")
    inventory.served, inventory.served_from = served, str(version_file)
    homes: dict[Path, None] = {}
    for name in sorted(os.listdir(served_dir)):
        if _wanted(name):
            homes[Path(os.path.realpath(served_dir / name)).parent] = None
    if list(homes) == [Path(os.path.realpath(served_dir))]:  # copies, or local mode
        inventory.add(Source(served, _shard_hint(served_dir, hints), "dir", served_dir))
        return
    for home in homes:
        _add_shard_dir(inventory, home, hints)


def _download_name(name: str, dict_name: str) -> str:
    """A download directory's version: the agent names it `<version>`, or `<version>-<dict>`
    in its service mode (and writes cube_data/VERSION the same way: agent/work.go,
    GetDownloadDirs and DoDownload)."""
    return name.removesuffix(f"-{dict_name}")


def _shard_seq_dirs(path: Path, dict_name: str) -> list[Path]:
    """cube_data/<shard_seq>/ directories holding version directories."""
    found = []
    for entry in sorted(path.iterdir()):
        if entry.is_dir() and entry.name.isdigit():
            children = [c.name for c in entry.iterdir() if c.is_dir()]
            if any(_VERSION_RE.fullmatch(_download_name(c, dict_name)) for c in children):
                found.append(entry)
    return found


def _add_cube_data(inventory: Inventory, path: Path, hints: Hints, served: Path | None) -> None:
    """A deployment's cube_data/: <shard_seq>/<version>/ per download, the tar unpacked next to
    it (<version>-<dict>/, the tar alone, in the agent's service mode). VERSION: data/VERSION
    (what the server loads at start), else cube_data/VERSION-<dict>, else cube_data/VERSION."""
    for seq in _shard_seq_dirs(path, hints.dict_name):
        shard = int(seq.name)
        if hints.shard is not None and shard != hints.shard:
            continue
        for entry in sorted(seq.iterdir()):
            if not entry.is_dir() or entry.name.startswith("."):
                continue
            split = entry.name.isdigit() and any(c.is_dir() for c in entry.iterdir())
            if split and not _is_shard_dir(entry):
                raise ImportError_(
                    f"{entry}: a dict_split layout (cube_data/<shard>/<split>/<version>/): "
                    "not supported, the original cube-builder builds one split per shard"
                )
            name = _download_name(entry.name, hints.dict_name)
            if not _VERSION_RE.fullmatch(name):
                inventory.notes.append(
                    f"skipped {entry} (not a download of a version of {hints.dict_name})"
                )
                continue
            version = version_name(name, f"{entry}: its directory name")
            tars = sorted(entry.glob("*.tar"))
            for tar in tars:
                match = _PART_RE.fullmatch(tar.name.removesuffix(".tar"))
                if match:
                    _check_dict(tar, match, hints)
            if _is_shard_dir(entry):
                inventory.add(Source(version, shard, "dir", entry))
            elif len(tars) == 1:
                inventory.add(Source(version, shard, "tar", tars[0]))
            else:
                what = "several tars" if tars else "no tar and no unpacked files"
                inventory.notes.append(f"skipped {entry} ({what}: an unfinished download?)")
    own = path / f"{VERSION_FILE}-{hints.dict_name}"  # the agent copies VERSION to it
    for candidate in (served, own, path / VERSION_FILE):
        if candidate is not None and candidate.is_file():
            text = candidate.read_text(encoding="utf-8", errors="replace")
            named = parse_version(text)
            if named:
                name = _download_name(named, hints.dict_name)
                inventory.served = version_name(name, f"{candidate} names")
                inventory.served_from = str(candidate)
                break


# ---------------------------------------------------------------------------------------------
# opening one source


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


def _wanted(name: str) -> bool:
    return name in (INDEX_LIST, DATA_LIST) or numbered_file(name) is not None


def list_source(source: Source, check_md5: bool) -> _Files:
    """The source's files of the format, found and stamped, none of their bytes read but a
    tar's headers (and its md5 when `check_md5`)."""
    files = _Files(str(source.path))
    if source.kind == "dir":
        for name in sorted(os.listdir(source.path)):
            path = source.path / name
            if _wanted(name) and path.is_file():
                files.stamps[path] = _stamp(path)
                files.extents[name] = _Extent(path, 0, files.stamps[path][2])
            elif _wanted(name):
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
                    if not _wanted(name):
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


# ---------------------------------------------------------------------------------------------
# the plan: families (a base and its patches), in order


@dataclass(frozen=True)
class Version:
    original: str  # the original's name of it
    depend: int
    cur: int
    is_base: bool

    @property
    def served(self) -> str:
        return served_version(str(self.depend), str(self.cur), self.is_base)


@dataclass
class Plan:
    families: list[list[Version]]  # each: a base then its patches, in order
    layers: dict[tuple[str, int], Layer]
    shards: list[int]
    served: str | None
    files: dict[tuple[str, int], _Files] = field(default_factory=dict)  # as checked


def keep_shard(inventory: Inventory, shard: int | None) -> int:
    """-data_dir: the one shard to import (-shard, or the only one found); the inventory keeps
    only its sources, so that nothing else is opened or hashed."""
    shards = sorted({source.shard for source in inventory.sources.values()})
    if shard is None:
        if len(shards) != 1:
            raise ImportError_(
                f"the input holds shards {', '.join(map(str, shards))}; a data directory "
                "serves one: give -shard"
            )
        shard = shards[0]
    if shard not in shards:
        raise ImportError_(
            f"no shard {shard} in the input (it holds {', '.join(map(str, shards))})"
        )
    inventory.sources = {k: s for k, s in inventory.sources.items() if s.shard == shard}
    return shard


def make_plan(inventory: Inventory, shard_num: int, check_md5: bool) -> Plan:
    """Every source's layer checked (tars against their .md5 files too), the versions grouped
    by base and ordered."""
    layers: dict[tuple[str, int], Layer] = {}
    checked: dict[tuple[str, int], _Files] = {}
    parsed: dict[str, tuple[int, int]] = {}
    for key, source in sorted(inventory.sources.items()):
        if source.shard >= shard_num:
            raise ImportError_(
                f"{source.path} is shard {source.shard}, but -shard_num is {shard_num}"
            )
        checked[key] = list_source(source, check_md5)
        layers[key] = plan_source(source, checked[key])
        pair = parse_version_name(source.version)
        assert pair is not None, source  # every name came through version_name
        parsed[source.version] = pair
        if layers[key].no_files and pair[0] != pair[1]:
            raise ImportError_(
                f"{source.path}: an empty shard, but version {source.version} is a patch, and "
                "the original writes data.n and index.n into every shard of a patch (an "
                "incomplete copy?)"
            )
    by_depend: dict[int, list[str]] = {}
    for name in sorted(parsed):
        by_depend.setdefault(parsed[name][0], []).append(name)
    shards = sorted({shard for _version, shard in layers})
    families = []
    for depend, members in sorted(by_depend.items()):
        order: list[str] | None = None
        for shard in shards:
            mine = {v: layers[(v, shard)] for v in members if (v, shard) in layers}
            if not mine:
                continue
            if set(mine) != set(members):
                lacking = sorted(set(members) - set(mine))
                raise ImportError_(
                    f"shard {shard} lacks version(s) {', '.join(lacking)} of base {depend} that "
                    "other shards have"
                )
            found = order_layers(mine, {v: parsed[v][1] for v in mine})
            if order is not None and found != order:
                raise ImportError_(
                    f"the shards disagree on the order of the versions of base {depend}: "
                    f"{', '.join(order)} vs {', '.join(found)}"
                )
            order = found
        assert order is not None
        versions = []
        for name in order:
            is_base = name == order[0]
            dep, cur = parsed[name]
            if is_base != (dep == cur):
                raise ImportError_(_misnamed(name, is_base))
            versions.append(Version(name, dep, cur, is_base))
            if all(layers[(name, shard)].no_files for shard in shards):
                inventory.notes.append(_empty_note(name, shards))
        families.append(versions)
    return Plan(families, layers, shards, inventory.served, checked)


def _empty_note(name: str, shards: Sequence[int]) -> str:
    """A version without records where it is imported (one empty shard among others is not
    worth a word). The original builder leaves an empty directory and a tar of ./ for a base
    shard that got no record; imported, it is an empty shard."""
    if len(shards) == 1:
        return (
            f"version {name} shard {shards[0]} holds no record (an empty directory or a tar "
            "of ./ only, what the original builder leaves for a shard that got none): "
            "imported as an empty shard"
        )
    return (
        f"version {name}: none of its {len(shards)} shards holds a record (each an empty "
        "directory or a tar of ./ only, what the original builder leaves for a base built "
        "from no input): imported as empty shards"
    )


def _misnamed(name: str, is_base: bool) -> str:
    if is_base:
        return (
            f"version {name}: its name says patch, but it holds a base's files (index.0): "
            "which version brought which file is lost, as when a deployment's data/<version>/ "
            "holds copies rather than the agent's links into cube_data/; give the deployment's "
            "cube_data/ (or the builder's output) instead"
        )
    return (
        f"version {name}: its name says base, but it holds a patch's files (no index.0): a "
        "patch's directory renamed? give it its <depend>_<cur> name"
    )


# ---------------------------------------------------------------------------------------------
# writing


@dataclass
class Totals:
    records: int = 0  # index records read (duplicates included)
    shards: int = 0
    versions: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _ShardTask:
    """One shard of one version to convert, as a worker process gets it."""

    files: _Files
    layer: Layer
    config: BuildConfig
    shard: int
    directory: Path
    sync: bool


def convert_shard(
    pool: _Pool,
    files: _Files,
    layer: Layer,
    config: BuildConfig,
    shard: int,
    directory: Path,
    totals: Totals,
    sync: bool,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One shard of one version written into `directory` (index.cube + data.cube); returns the
    index header fields and the meta stored in the headers.

    The original's files are mapped and read in a worker process (`pool`, isolated), never in
    this one. A mapped file that another process cuts short (a file being rewritten on NFS, a
    live deployment's) turns the next read of a missing page into SIGBUS, which kills the
    process: Python cannot recover from it (the faulting instruction runs again; a handler
    would run only after the C code returned), so this process would die with its staging
    folders in the output. The alternatives fall short: reading instead of mapping would hold
    the data files in memory (values are gathered in hash order, at random over files of up
    to 1 GiB) or cost a read per record; a read lease (what cube-server does,
    cube/server/guard.py) is granted only to the file's owner on a local filesystem (not on
    NFS, nor on another user's deployment), and would hold up the deployment's own writer.
    So a SIGBUS kills the worker only, and this process, which owns the staging, says which
    file changed (and from which offset it is gone: `_Files.changed`) and removes what it
    staged. A file changed between its check and its mapping is refused by the worker."""
    task = _ShardTask(files, layer, config, shard, directory, sync)
    try:
        [(header, meta, records)] = pool.run(_convert_task, [task], _ignore, _ignore)
    except BrokenProcessPool:
        what = files.changed() or (
            f"{files.where}: the process reading it was killed (out of memory? a signal?)"
        )
        raise ImportError_(f"{what}; nothing was published") from None
    totals.records += records
    totals.shards += 1
    return header, meta


def _ignore(_value: object) -> None:
    """A progress report nobody reads."""


def _convert_task(task: _ShardTask, _on_bytes: object = None) -> tuple[dict, dict, int]:
    """In the worker process: map, read and check the layer, write the shard; returns the
    index header fields, the meta and the count of records read. Each array is let go as
    soon as it has served."""
    layer, config, shard = task.layer, task.config, task.shard
    meta = shard_header_meta(config, shard, (KEY_FORMAT,))
    try:
        with mapped(task.files) as arrays:
            if layer.index_files:
                records = read_layer(
                    layer,
                    {k: arrays[f"index.{k}"] for k in layer.index_files},
                    {j: arrays[f"data.{j}"] for j in layer.data_files},
                    shard,
                    config.shard_num,
                )
                keys, values = records.keys, records.values
                del records
            else:
                none = np.empty(0, np.uint32)
                keys, values = np.empty(0, np.uint64), OriginalValues([], none, none, none)
            built = build_table(keys)
            count = int(keys.shape[0])
            del keys
            header = write_shard(task.directory, built, values, meta, sync=task.sync)
            del built, values
    except ImportError_ as exc:  # the pool sends back the message of a BuildError as it is
        raise BuildError(str(exc)) from None
    return header, meta, count


def _config(version: Version, dict_name: str, output: Path, shard_num: int) -> BuildConfig:
    return BuildConfig(
        dict_name=dict_name,
        output_path=output,
        shard_num=shard_num,
        mode="base" if version.is_base else "delta",
        cur_version=version.cur,
        depend_version=version.depend,
        partitioner="mod",
        key_format="auto",
        workers=1,
    )


@dataclass
class _State:
    """What a signal handler must know: whether targets are being renamed (the signals are
    blocked then; one that reaches the handler anyway waits) or all were."""

    publishing: bool = False
    published: bool = False
    deferred: int = 0


_state = _State()


@contextlib.contextmanager
def staged(targets: Sequence[tuple[BuildConfig, str | None]]) -> Iterator[list[Workspace]]:
    """A workspace for every target (config, target name), all created (each target checked
    absent) before the block runs; what is not published is removed at the end, as the
    builder's (abort_active_builds removes it on a signal)."""
    workspaces: list[Workspace] = []
    try:
        for config, name in targets:
            try:
                workspaces.append(Workspace(config, name))
            except BuildError as exc:
                raise ImportError_(str(exc)) from None
        yield workspaces
    finally:
        for workspace in workspaces:
            workspace.close()


def publish(workspaces: Sequence[Workspace], finish: Callable[[], None]) -> list[Path]:
    """Rename every staged version into place, then `finish` (meta_info, VERSION), with SIGINT
    and SIGTERM blocked; if anything fails, the targets already renamed are removed again."""
    published: list[Path] = []
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    _state.publishing = True
    try:
        try:
            for workspace in workspaces:
                published.append(workspace.publish())
            finish()
        except BaseException:
            for target in published:
                shutil.rmtree(target, ignore_errors=True)
            for parent in {target.parent for target in published}:
                with contextlib.suppress(OSError):
                    fsync_dir(parent)
            raise
        _state.published = True
    finally:
        _state.publishing = False
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
    if _state.deferred:
        _terminate(_state.deferred, None)
    return published


def write_build_outputs(
    plan: Plan,
    inventory: Inventory,
    dict_name: str,
    output: Path,
    shard_num: int,
    totals: Totals,
) -> list[Path]:
    """Every version as cube-builder's output under `output`; all staged, then published."""
    versions = [version for family in plan.families for version in family]
    for version in versions:
        missing = [s for s in range(shard_num) if (version.original, s) not in plan.layers]
        if missing:
            raise ImportError_(
                f"version {version.original} has no shard {missing[0]} of {shard_num}: a build "
                "output needs every shard (a deployment holds one: import it with -data_dir)"
            )
    configs = [_config(version, dict_name, output, shard_num) for version in versions]
    outputs: list[list[ShardOutput]] = [[] for _ in versions]
    with (
        staged([(config, None) for config in configs]) as workspaces,
        _Pool(1, isolate=True) as pool,
    ):
        for version, config, workspace, done in zip(
            versions, configs, workspaces, outputs, strict=True
        ):
            for shard in range(shard_num):
                name = config.shard_name(shard)
                directory = workspace.staging / name
                header, meta = convert_shard(
                    pool,
                    plan.files[(version.original, shard)],
                    plan.layers[(version.original, shard)],
                    config,
                    shard,
                    directory,
                    totals,
                    sync=False,
                )
                done.append(
                    package_shard(header, directory, workspace.staging / f"{name}.tar", meta)
                )
            totals.versions.append(config.version_dir_name)
        meta_dir = output / META_DIR
        metas = [
            meta_dir / meta_info_name(config.cur_version, config.depend_version, shard)
            for config in configs
            for shard in range(shard_num)
        ]
        new_metas = [path for path in metas if not os.path.lexists(path)]

        def write_metas() -> None:
            try:
                for config, done in zip(configs, outputs, strict=True):
                    write_meta_infos(config, done, (KEY_FORMAT,))
            except BaseException:
                for path in new_metas:
                    path.unlink(missing_ok=True)
                raise

        return publish(workspaces, write_metas)


def _pick_family(plan: Plan, inventory: Inventory) -> tuple[list[Version], str]:
    """-data_dir: the family of the version the deployment served (else the newest base's),
    and the version to name in VERSION."""
    if plan.served:
        for family in plan.families:
            for version in family:
                if plan.served in (version.original, version.served):
                    return family, version.served
        raise ImportError_(
            f"{inventory.served_from} names version {plan.served}, whose files were not found"
        )
    family = plan.families[-1]
    if len(plan.families) > 1:
        warn(f"several bases found; importing the newest, {family[0].served}, and its patches")
    return family, family[-1].served


def write_data_dir(
    plan: Plan,
    inventory: Inventory,
    dict_name: str,
    data_dir: Path,
    shard_num: int,
    shard: int,
    totals: Totals,
) -> tuple[list[Path], str]:
    """One shard's versions as a cube-server data directory: `<version>/` (+ CHAIN for a
    patch), then VERSION. Every version is staged first, and all are renamed in when all are
    done."""
    family, serve = _pick_family(plan, inventory)
    version_file = data_dir / VERSION_FILE
    if version_file.is_file():
        named = parse_version(version_file.read_text(encoding="utf-8", errors="replace"))
        if named and named != serve:
            raise ImportError_(
                f"{version_file} names {named}; refusing to change what that server loads at "
                f"start to {serve} (import into an empty directory)"
            )
    configs = [_config(version, dict_name, data_dir, shard_num) for version in family]
    targets = [(config, version.served) for config, version in zip(configs, family, strict=True)]
    with staged(targets) as workspaces, _Pool(1, isolate=True) as pool:
        chain: list[str] = []
        for version, config, workspace in zip(family, configs, workspaces, strict=True):
            chain.append(version.served)
            convert_shard(
                pool,
                plan.files[(version.original, shard)],
                plan.layers[(version.original, shard)],
                config,
                shard,
                workspace.staging,
                totals,
                sync=True,
            )
            if not version.is_base:
                atomic_write_text(workspace.staging / CHAIN_FILE, chain_text(chain))
            shutil.rmtree(workspace.spill, ignore_errors=True)  # not part of a version
            fsync_dir(workspace.staging)
            totals.versions.append(version.served)

        def write_version() -> None:
            fsync_dir(data_dir)
            atomic_write_text(version_file, version_text(serve))

        return publish(workspaces, write_version), serve


# ---------------------------------------------------------------------------------------------
# the command

DESCRIPTION = """\
Converts tables built by the original Cube (PaddlePaddle Serving's C++ cube-builder: data.N,
index.N, data.n, index.n per shard) into this project's format, base and patches, written by
this project's builder code.

-input_path (comma-separated for several) may be:
  the original builder's -output_path (version directories <depend>_<cur>), one version
  directory (<dict>_part<i>/ and/or <dict>_part<i>.tar, .tar.md5 checked when present), one
  shard directory or tar; or a deployment of the original: its deploy path, its data/ (VERSION
  names the served version; its links lead to the versions in cube_data/), or its cube_data/
  (<shard>/<version>/ downloads; <shard>/<version>-<dict>/ in the agent's service mode). A
  local-mode data/ (one version's files, no VERSION) needs -version and -shard.

The versions and their order come from the original's files: a base holds index.0, each
patch's index.n and data.n lists start with those of the version before it (the check the
original server makes), and its files are the next ones. Every key must belong to its shard by
the original's rule, key % shard_num (the same as -partitioner mod here): a wrong -shard_num is
refused. Every address, length field and byte of the data files is checked; a problem names
the file and offset. The original has no deletions and no checksums (a tar's .md5 aside).
Files of another format (e.g. this project's index.cube and data.cube) are refused, never
read as an empty shard.

Output (exactly one):
  -output_path OUT  build output as cube-builder writes it: OUT/<depend>_<cur>/<dict>_part<i>/
                    {index.cube,data.cube}, .tar, .tar.md5 and OUT/meta_info/, for every
                    version (each needs all -shard_num shards); cube-transfer and cube-agent
                    take it as any build
  -data_dir DIR     a cube-server --data_dir for one shard (-shard, or the only one found):
                    DIR/<version>/ (a patch with CHAIN) and DIR/VERSION naming the version the
                    deployment's VERSION named (else the newest); an existing version directory
                    or a VERSION naming another version is refused
Every target is checked and every version written aside before any is renamed into place:
an import that fails, or is stopped by SIGINT or SIGTERM, publishes nothing and leaves no
staging folder; an input file cut short or rewritten while it is read (a live deployment's)
fails the import, naming the file and the offset where it now ends. Memory: one
shard of one version at a time, about 63 bytes a record at the peak (its keys, value
offsets and lengths, and the table built from them); values are read from the mapped files.
Warnings (skipped downloads, several bases, empty versions) go to stderr, -quiet or not.

Exit status: 0 imported, 1 failed (nothing published), 2 bad flags."""


def flag_set() -> FlagSet:
    return (
        FlagSet("cube-import", DESCRIPTION)
        .add(
            "input_path",
            str,
            "",
            "the original's files (see above); comma-separated for several",
            required=True,
        )
        .add("dict_name", str, "", "the dict: its parts are <dict>_part<i>", required=True)
        .add(
            "shard_num",
            int,
            0,
            "shard count of the original build (key % shard_num)",
            required=True,
        )
        .add("output_path", str, "", "write build output here (see above)")
        .add("data_dir", str, "", "write a cube-server data directory here (see above)")
        .add("shard", int, -1, "the shard to import when the input does not say (or to pick one)")
        .add(
            "version",
            str,
            "",
            "the version of an input that names none (local mode) or names 0, e.g. 1700000000",
        )
        .add("check_md5", bool, True, "check each tar against its .md5 file when there is one")
        .add("quiet", bool, False, "no summary line (warnings still go to stderr)")
    )


def _check_flags(flags: dict[str, Any]) -> None:
    """Flag errors spell flags as this tool's other messages do: -name."""
    if not flags["dict_name"] or not is_name(flags["dict_name"]):
        raise FlagError(f"-dict_name {flags['dict_name']!r} must be a plain name")
    if flags["shard_num"] < 1:
        raise FlagError(f"-shard_num must be >= 1, got {flags['shard_num']}")
    if bool(flags["output_path"]) == bool(flags["data_dir"]):
        raise FlagError("give exactly one of -output_path (build output) and -data_dir")
    if flags["shard"] < -1 or flags["shard"] >= flags["shard_num"]:
        raise FlagError(f"-shard must be in 0..{flags['shard_num'] - 1}, got {flags['shard']}")
    version = flags["version"]
    if version and parse_version_name(version) is None:
        raise FlagError(f"-version {version!r} is not a version name ({_VERSION_RULE})")


def _terminate(signum: int, _frame: Any) -> None:
    if _state.publishing:  # blocked meanwhile, but delivered to another thread: after it
        _state.deferred = signum
        return
    abort_active_builds()  # the staged versions: removed
    done = "the import was published before" if _state.published else "nothing was published"
    os.write(2, f"error: stopped by signal {signum}; {done}\n".encode())
    os._exit(128 + signum)


def run(argv: Sequence[str]) -> int:
    flags = flag_set().parse(argv)
    _check_flags(flags)
    hints = Hints(
        flags["dict_name"],
        flags["shard"] if flags["shard"] >= 0 else None,
        flags["version"] or None,
    )
    paths = [Path(p.strip()) for p in flags["input_path"].split(",") if p.strip()]
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, _terminate)
    _state.published, _state.deferred = False, 0
    started = time.monotonic()
    totals = Totals()
    collecting = gc.isenabled()
    gc.disable()
    try:
        inventory = find_sources(paths, hints)
        for note in inventory.notes:
            warn(note)
        inventory.notes.clear()
        # -data_dir: one shard, chosen before any tar is opened or hashed
        shard = keep_shard(inventory, hints.shard) if flags["data_dir"] else None
        plan = make_plan(inventory, flags["shard_num"], flags["check_md5"])
        for note in inventory.notes:
            warn(note)
        if shard is None:
            written = write_build_outputs(
                plan,
                inventory,
                flags["dict_name"],
                Path(flags["output_path"]),
                flags["shard_num"],
                totals,
            )
            serving = ""
        else:
            written, serve = write_data_dir(
                plan,
                inventory,
                flags["dict_name"],
                Path(flags["data_dir"]),
                flags["shard_num"],
                shard,
                totals,
            )
            serving = f"; VERSION names {serve}"
    except (ImportError_, OriginalFormatError, BuildError, ValueError, OSError) as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return EXIT_FAILED
    except Exception as exc:  # a bug: still one line, and still nothing published
        print(f"error: internal error {type(exc).__name__}: {one_line(exc)}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        gc.freeze()
        if collecting:
            gc.enable()
    if not flags["quiet"]:
        seconds = time.monotonic() - started
        rate = totals.records / max(seconds, 1e-9)
        print(
            f"imported {len(written)} version(s) ({', '.join(totals.versions)}) of "
            f"{flags['dict_name']}: {totals.shards} shard files, {totals.records} records in "
            f"{seconds:.2f} s ({rate:,.0f} records/s) into "
            f"{flags['output_path'] or flags['data_dir']}{serving}"
        )
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    sys.exit(main())
