"""cube-import: tables the original Cube built, converted into this project's format.

Thin shell over `cube.original_format` (the format, its checks, the values): this module finds
the original's files, maps them, and writes each shard with the builder's own writer and
packer (`cube.shard_writer.write_shard`, `cube.builder.build.package_shard`,
`write_meta_infos`, `Workspace`), one shard of one version at a time: one shard's keys and
addresses in memory (16 bytes a record, plus the table), its values read from the mapped
files as they are written.

Inputs (-input_path, comma-separated for several), found by their layout:
- the original cube-builder's output: its -output_path (version directories `<depend>_<cur>`),
  one version directory (`<dict>_part<i>/` directories and/or `<dict>_part<i>.tar`), one shard
  directory or one shard tar;
- a deployment of the original: its deploy path, its `cube_data/` (downloads,
  `<shard>/<version>/`, unpacked next to the tar) or its `data/` (`VERSION` and
  `<version>/`, whose files link into `cube_data/`), or a local-mode `data/` holding one
  version's files (give -version).

Outputs, each version written aside and renamed into place only when all are complete:
- -output_path: build output as cube-builder writes it, `<depend>_<cur>/<dict>_part<i>/`, tar,
  md5 and `meta_info/`: what cube-transfer checks and cube-agent places;
- -data_dir: a cube-server data directory for one shard, `<version>/` (with CHAIN for a
  patch) and VERSION naming the version the deployment served (else the newest).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import mmap
import os
import re
import shutil
import signal
import sys
import tarfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as cube-builder: no BLAS threads needed

import numpy as np

from cube.builder.build import (
    BuildConfig,
    BuildError,
    Workspace,
    abort_active_builds,
    package_shard,
    shard_header_meta,
    write_meta_infos,
)
from cube.builder.meta import ShardOutput
from cube.flags import FlagError, FlagSet, one_line, run_cli
from cube.fsutil import atomic_write_text, fsync_dir, md5_of_line
from cube.index import build_table
from cube.layout import (
    CHAIN_FILE,
    VERSION_FILE,
    chain_text,
    is_name,
    parse_version,
    served_version,
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
_VERSION_RE = re.compile(r"(0|[1-9][0-9]{0,18})(?:_(0|[1-9][0-9]{0,18}))?")
_PART_RE = re.compile(r"(?P<dict>.+)_part(?P<shard>0|[1-9][0-9]{0,5})")
_MD5_CHUNK = 8 << 20
_staging: list[Path] = []  # -data_dir versions being written (removed on failure or signal)


class ImportError_(RuntimeError):
    """An import that cannot go on; the message is one line for the user."""


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
    notes: list[str] = field(default_factory=list)

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
    version: str | None  # -version


def parse_version_name(name: str) -> tuple[int, int] | None:
    """`<depend>_<cur>` or `<depend>` (a base: cur = depend) -> (depend, cur); None when the
    name is not one, or names version 0 (the original's local mode builds `0_0`)."""
    match = _VERSION_RE.fullmatch(name)
    if not match:
        return None
    depend = int(match.group(1))
    cur = int(match.group(2)) if match.group(2) is not None else depend
    return (depend, cur) if depend > 0 and cur > 0 else None


def _is_shard_dir(path: Path) -> bool:
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return any(n in (INDEX_LIST, DATA_LIST) or numbered_file(n) for n in names)


def _version_of(name: str, where: Path, hints: Hints) -> str:
    if parse_version_name(name):
        return name
    if hints.version:
        return hints.version
    raise ImportError_(
        f"{where}: cannot tell which version this is ({name!r} is not a version name such as "
        "<depend>_<cur>, or it is version 0): give -version"
    )


def _shard_hint(where: Path, hints: Hints) -> int:
    if hints.shard is None:
        raise ImportError_(f"{where}: cannot tell which shard this is: give -shard")
    return hints.shard


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
            _add_version_dir(inventory, path, path.name, hints)
        elif (path / "cube_data").is_dir():
            served = path / "data" / VERSION_FILE
            _add_cube_data(inventory, path / "cube_data", hints, served)
        elif (path / "data").is_dir() and (path / "data" / VERSION_FILE).is_file():
            _add_data_dir(inventory, path / "data", hints)
        elif _shard_seq_dirs(path):
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
                _add_version_dir(inventory, version, version.name, hints)
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
    match = _PART_RE.fullmatch(path.name.removesuffix(".tar"))
    if not path.name.endswith(".tar"):
        raise ImportError_(f"{path}: not a shard tar (<dict>_part<i>.tar) nor a directory")
    shard = int(match["shard"]) if match else _shard_hint(path, hints)
    if match and hints.shard is not None and shard != hints.shard:
        raise ImportError_(f"{path} is shard {shard}, not -shard {hints.shard}")
    version = _version_of(path.parent.name, path, hints)
    inventory.add(Source(version, shard, "tar", path))


def _add_shard_dir(inventory: Inventory, path: Path, hints: Hints) -> None:
    match = _PART_RE.fullmatch(path.name)
    if match:  # the builder's <dict>_part<i>/ inside <depend>_<cur>/
        shard, version = int(match["shard"]), _version_of(path.parent.name, path, hints)
    else:  # a deployment's cube_data/<shard>/<version>/ or data/<version>/, or local mode
        version = _version_of(path.name, path, hints)
        seq = path.parent.name
        in_downloads = seq.isdigit() and path.parent.parent.name == "cube_data"
        shard = int(seq) if in_downloads else _shard_hint(path, hints)
        if hints.shard is not None and shard != hints.shard:
            raise ImportError_(f"{path} is shard {shard}, not -shard {hints.shard}")
    inventory.add(Source(version, shard, "dir", path))


def _add_version_dir(inventory: Inventory, path: Path, name: str, hints: Hints) -> None:
    version = _version_of(name, path, hints)
    for shard in _parts(path, hints.dict_name):
        if hints.shard is not None and shard != hints.shard:
            continue
        directory = path / f"{hints.dict_name}_part{shard}"
        tar = directory.with_name(directory.name + ".tar")
        if directory.is_dir() and _is_shard_dir(directory):
            inventory.add(Source(version, shard, "dir", directory))
        elif tar.is_file():
            inventory.add(Source(version, shard, "tar", tar))
        elif directory.is_dir() and not os.listdir(directory):
            inventory.add(Source(version, shard, "empty", directory))
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
    if served_dir is None:
        text = (path / VERSION_FILE).read_text(encoding="utf-8", errors="replace")
        named = parse_version(text) or ""
        if named and (path / "0" / named).is_dir():
            raise ImportError_(
                f"{path}: a dict_split layout (data/<split>/<version>/): not supported, the "
                "original cube-builder builds one split per shard"
            )
        raise ImportError_(f"{path}/{VERSION_FILE} names {named!r}, which holds no shard files")
    inventory.served, inventory.served_from = served_dir.name, str(path / VERSION_FILE)
    homes: dict[Path, None] = {}
    for name in sorted(os.listdir(served_dir)):
        if name in (INDEX_LIST, DATA_LIST) or numbered_file(name):
            homes[Path(os.path.realpath(served_dir / name)).parent] = None
    if list(homes) == [Path(os.path.realpath(served_dir))]:
        inventory.add(Source(served_dir.name, _data_shard(served_dir, hints), "dir", served_dir))
        return
    for home in homes:
        _add_shard_dir(inventory, home, hints)


def _data_shard(served_dir: Path, hints: Hints) -> int:
    if hints.shard is None:
        raise ImportError_(
            f"{served_dir}: cannot tell which shard this deployment serves: give -shard"
        )
    return hints.shard


def _shard_seq_dirs(path: Path) -> list[Path]:
    """cube_data/<shard_seq>/ directories holding version directories."""
    found = []
    for entry in sorted(path.iterdir()):
        if entry.is_dir() and entry.name.isdigit():
            children = [c for c in entry.iterdir() if c.is_dir()]
            if any(_VERSION_RE.fullmatch(c.name) for c in children):
                found.append(entry)
    return found


def _add_cube_data(inventory: Inventory, path: Path, hints: Hints, served: Path | None) -> None:
    """A deployment's cube_data/: <shard_seq>/<version>/ per download, the tar unpacked next to
    it. VERSION: data/VERSION (what the server loads at start) else cube_data/VERSION."""
    for seq in _shard_seq_dirs(path):
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
            if not _VERSION_RE.fullmatch(entry.name):
                inventory.notes.append(f"skipped {entry} (not a version directory)")
                continue
            tars = sorted(entry.glob("*.tar"))
            if _is_shard_dir(entry):
                inventory.add(Source(entry.name, shard, "dir", entry))
            elif len(tars) == 1:
                inventory.add(Source(entry.name, shard, "tar", tars[0]))
            else:
                what = "several tars" if tars else "no tar and no unpacked files"
                inventory.notes.append(f"skipped {entry} ({what}: an unfinished download?)")
    for candidate in (served, path / VERSION_FILE):
        if candidate is not None and candidate.is_file():
            text = candidate.read_text(encoding="utf-8", errors="replace")
            named = parse_version(text)
            if named:
                inventory.served, inventory.served_from = named.split("-")[0], str(candidate)
                break


# ---------------------------------------------------------------------------------------------
# opening one source


@dataclass
class _Files:
    """A source's files: each name -> (bytes as a uint8 array, or None until mapped; size)."""

    where: str
    arrays: dict[str, np.ndarray]
    maps: list[mmap.mmap]

    def close(self) -> None:
        self.arrays.clear()
        for mapped in self.maps:
            with contextlib.suppress(BufferError):  # a view still held: unmapped when freed
                mapped.close()
        self.maps.clear()


def _map(path: Path) -> tuple[np.ndarray, mmap.mmap | None]:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if not size:
            return np.empty(0, dtype=np.uint8), None
        mapped = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
    return np.frombuffer(mapped, dtype=np.uint8), mapped


def _wanted(name: str) -> bool:
    return name in (INDEX_LIST, DATA_LIST) or numbered_file(name) is not None


@contextlib.contextmanager
def open_source(source: Source, check_md5: bool) -> Iterator[_Files]:
    """The source's files of the format, mapped read-only (closed at the end)."""
    files = _Files(str(source.path), {}, [])
    try:
        if source.kind == "dir":
            for name in sorted(os.listdir(source.path)):
                if _wanted(name) and (source.path / name).is_file():
                    array, mapped = _map(source.path / name)
                    files.arrays[name] = array
                    if mapped is not None:
                        files.maps.append(mapped)
                elif _wanted(name):
                    raise ImportError_(f"{source.path / name}: not a regular file")
        elif source.kind == "tar":
            if check_md5:
                _check_md5(source.path)
            members = _tar_members(source.path)
            if members:
                whole, mapped = _map(source.path)
                if mapped is not None:
                    files.maps.append(mapped)
                for name, (offset, size) in members.items():
                    files.arrays[name] = whole[offset : offset + size]
        yield files
    finally:
        files.close()


def _tar_members(path: Path) -> dict[str, tuple[int, int]]:
    """The format's files in a shard tar (the original packs `./data.0`, ..., `./index.n`):
    name -> (offset, size) of its bytes in the tar. Checked against the tar's size."""
    found: dict[str, tuple[int, int]] = {}
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            with tarfile.open(fileobj=f, mode="r:") as tar:
                for member in tar:
                    name = member.name.removeprefix("./").strip("/")
                    if not _wanted(name):
                        continue
                    if not member.isreg():
                        raise ImportError_(
                            f"{path}: member {member.name} is not a regular file (at offset "
                            f"{member.offset})"
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
    return found


def _check_md5(tar: Path) -> None:
    """Against `<tar>.md5` (md5sum's line, as the original writes it) when there is one."""
    md5_file = tar.with_name(tar.name + ".md5")
    if not md5_file.is_file():
        return
    expected = md5_of_line(md5_file.read_text(encoding="utf-8", errors="replace"))
    if expected is None:
        raise ImportError_(f"{md5_file}: not an md5sum line")
    digest = hashlib.md5(usedforsecurity=False)
    with open(tar, "rb") as f:
        while block := f.read(_MD5_CHUNK):
            digest.update(block)
    if digest.hexdigest() != expected:
        raise ImportError_(
            f"{tar}: md5 {digest.hexdigest()} does not match {md5_file.name} ({expected}): the "
            "tar is damaged (-check_md5=false skips this check)"
        )


def plan_source(source: Source, files: _Files) -> Layer:
    """The layer a source holds (cube.original_format.plan_layer on its lists and sizes)."""
    arrays = files.arrays
    if source.kind == "empty" or not arrays:  # a dir or tar holding none of the files
        return Layer.empty_base(str(source.path))
    for name in (INDEX_LIST, DATA_LIST):
        if name not in arrays:
            raise ImportError_(f"{files.where}: no {name} (an incomplete copy?)")
    sizes: dict[str, dict[int, int]] = {"index": {}, "data": {}}
    for name, array in arrays.items():
        numbered = numbered_file(name)
        if numbered:
            sizes[numbered[0]][numbered[1]] = int(array.shape[0])
    return plan_layer(
        files.where,
        arrays[INDEX_LIST].tobytes(),
        arrays[DATA_LIST].tobytes(),
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


def make_plan(inventory: Inventory, shard_num: int, check_md5: bool) -> Plan:
    """Every source's layer checked (tars against their .md5 files too), the versions grouped
    by base and ordered."""
    layers: dict[tuple[str, int], Layer] = {}
    for key, source in sorted(inventory.sources.items()):
        if source.shard >= shard_num:
            raise ImportError_(
                f"{source.path} is shard {source.shard}, but -shard_num is {shard_num}"
            )
        with open_source(source, check_md5) as files:
            layers[key] = plan_source(source, files)
        pair = parse_version_name(source.version)
        if layers[key].no_files and pair is not None and pair[0] != pair[1]:
            raise ImportError_(f"{source.path}: holds none of the original's shard files")
    names = {version for version, _shard in layers}
    parsed = {}
    for name in names:
        pair = parse_version_name(name)
        if pair is None:  # -version gave it; a base
            raise ImportError_(f"-version {name!r}: not a version (a positive number)")
        parsed[name] = pair
    by_depend: dict[int, list[str]] = {}
    for name in names:
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
                what = "a base's" if is_base else "a patch's"
                raise ImportError_(
                    f"version {name}: its name says {'base' if dep == cur else 'patch'}, but it "
                    f"holds {what} files ({'index.0' if is_base else 'no index.0'})"
                )
            versions.append(Version(name, dep, cur, is_base))
        families.append(versions)
    return Plan(families, layers, shards, inventory.served)


# ---------------------------------------------------------------------------------------------
# writing


@dataclass
class Totals:
    records: int = 0  # index records read (duplicates included)
    shards: int = 0
    versions: list[str] = field(default_factory=list)


@contextlib.contextmanager
def _records(
    source: Source, layer: Layer, shard: int, shard_num: int
) -> Iterator[tuple[np.ndarray, OriginalValues]]:
    """The keys and values of one shard of one version, its files mapped while the block runs
    (a tar's md5 was checked by make_plan)."""
    with open_source(source, check_md5=False) as files:
        if not layer.index_files:
            none = np.empty(0, np.int64)
            yield np.empty(0, np.uint64), OriginalValues([], none, none, none)
            return
        index = {k: files.arrays[f"index.{k}"] for k in layer.index_files}
        data = {j: files.arrays[f"data.{j}"] for j in layer.data_files}
        records = read_layer(layer, index, data, shard, shard_num)
        del index, data
        yield records.keys, records.values


def convert_shard(
    source: Source,
    layer: Layer,
    config: BuildConfig,
    shard: int,
    directory: Path,
    totals: Totals,
    sync: bool,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One shard of one version written into `directory` (index.cube + data.cube); returns the
    index header fields and the meta stored in the headers."""
    meta = shard_header_meta(config, shard, (KEY_FORMAT,))
    with _records(source, layer, shard, config.shard_num) as (keys, values):
        built = build_table(keys)
        totals.records += int(keys.shape[0])
        del keys
        header = write_shard(directory, built, values, meta, sync=sync)
        del built, values
    totals.shards += 1
    return header, meta


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


def write_build_outputs(
    plan: Plan,
    inventory: Inventory,
    dict_name: str,
    output: Path,
    shard_num: int,
    totals: Totals,
) -> list[Path]:
    """Every version as cube-builder's output under `output`; all staged, then published."""
    for family in plan.families:
        for version in family:
            missing = [s for s in range(shard_num) if (version.original, s) not in plan.layers]
            if missing:
                raise ImportError_(
                    f"version {version.original} has no shard {missing[0]} of {shard_num}: a build "
                    "output needs every shard (a deployment holds one: import it with -data_dir)"
                )
    staged: list[tuple[Workspace, BuildConfig, list[ShardOutput]]] = []
    try:
        for family in plan.families:
            for version in family:
                config = _config(version, dict_name, output, shard_num)
                try:
                    workspace = Workspace(config)
                except BuildError as exc:
                    raise ImportError_(str(exc)) from None
                outputs: list[ShardOutput] = []
                staged.append((workspace, config, outputs))
                for shard in range(shard_num):
                    source = inventory.sources[(version.original, shard)]
                    name = config.shard_name(shard)
                    directory = workspace.staging / name
                    header, meta = convert_shard(
                        source,
                        plan.layers[(version.original, shard)],
                        config,
                        shard,
                        directory,
                        totals,
                        sync=False,
                    )
                    outputs.append(
                        package_shard(header, directory, workspace.staging / f"{name}.tar", meta)
                    )
                totals.versions.append(config.version_dir_name)
        published = [stage[0].publish() for stage in staged]
    finally:
        for stage in staged:
            stage[0].close()
    for _workspace, config, outputs in staged:
        write_meta_infos(config, outputs, (KEY_FORMAT,))
    return published


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
        inventory.notes.append(
            f"several bases found; importing the newest, {family[0].served}, and its patches"
        )
    return family, family[-1].served


def write_data_dir(
    plan: Plan,
    inventory: Inventory,
    dict_name: str,
    data_dir: Path,
    shard_num: int,
    shard: int | None,
    totals: Totals,
) -> tuple[list[Path], str]:
    """One shard's versions as a cube-server data directory: `<version>/` (+ CHAIN for a
    patch), then VERSION. Every version is written aside and renamed in when all are done."""
    if shard is None:
        if len(plan.shards) != 1:
            raise ImportError_(
                f"the input holds shards {', '.join(map(str, plan.shards))}; a data directory "
                "serves one: give -shard"
            )
        shard = plan.shards[0]
    if shard not in plan.shards:
        raise ImportError_(f"no shard {shard} in the input (it holds {plan.shards})")
    family, serve = _pick_family(plan, inventory)
    version_file = data_dir / VERSION_FILE
    if version_file.is_file():
        named = parse_version(version_file.read_text(encoding="utf-8", errors="replace"))
        if named and named != serve:
            raise ImportError_(
                f"{version_file} names {named}; refusing to change what that server loads at "
                f"start to {serve} (import into an empty directory)"
            )
    for version in family:
        if os.path.lexists(data_dir / version.served):
            raise ImportError_(f"{data_dir / version.served} already exists; not replacing it")
    data_dir.mkdir(parents=True, exist_ok=True)
    placed: list[tuple[Path, Path]] = []
    chain: list[str] = []
    try:
        for version in family:
            chain.append(version.served)
            tmp = data_dir / f".tmp-{version.served}-{os.getpid()}"
            _staging.append(tmp)
            shutil.rmtree(tmp, ignore_errors=True)
            config = _config(version, dict_name, data_dir, shard_num)
            convert_shard(
                inventory.sources[(version.original, shard)],
                plan.layers[(version.original, shard)],
                config,
                shard,
                tmp,
                totals,
                sync=True,
            )
            if not version.is_base:
                atomic_write_text(tmp / CHAIN_FILE, chain_text(chain))
            fsync_dir(tmp)
            placed.append((tmp, data_dir / version.served))
            totals.versions.append(version.served)
        for tmp, target in placed:
            if os.path.lexists(target):
                raise ImportError_(f"{target} appeared during the import; not replacing it")
            os.rename(tmp, target)
            _staging.remove(tmp)
        fsync_dir(data_dir)
        atomic_write_text(version_file, version_text(serve))
    finally:
        for tmp in list(_staging):
            shutil.rmtree(tmp, ignore_errors=True)
            _staging.remove(tmp)
    return [target for _tmp, target in placed], serve


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
  (<shard>/<version>/ downloads). A local-mode data/ (one version's files, no VERSION) needs
  -version and -shard.

The versions and their order come from the original's files: a base holds index.0, each
patch's index.n and data.n lists start with those of the version before it (the check the
original server makes), and its files are the next ones. Every key must belong to its shard by
the original's rule, key % shard_num (the same as -partitioner mod here): a wrong -shard_num is
refused. Every address, length field and byte of the data files is checked; a problem names
the file and offset. The original has no deletions and no checksums (a tar's .md5 aside).

Output (exactly one):
  -output_path OUT  build output as cube-builder writes it: OUT/<depend>_<cur>/<dict>_part<i>/
                    {index.cube,data.cube}, .tar, .tar.md5 and OUT/meta_info/, for every
                    version (each needs all -shard_num shards); cube-transfer and cube-agent
                    take it as any build
  -data_dir DIR     a cube-server --data_dir for one shard (-shard, or the only one found):
                    DIR/<version>/ (a patch with CHAIN) and DIR/VERSION naming the version the
                    deployment's VERSION named (else the newest); an existing version directory
                    or a VERSION naming another version is refused
Each version is written aside and renamed into place once every one is complete: an import that
fails publishes nothing. Memory: one shard's keys and addresses (16 bytes a record) and its
table; values are read from the mapped original files.

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
        .add("quiet", bool, False, "no summary line")
    )


def _check_flags(flags: dict[str, Any]) -> None:
    if not flags["dict_name"] or not is_name(flags["dict_name"]):
        raise FlagError(f"--dict_name {flags['dict_name']!r} must be a plain name")
    if flags["shard_num"] < 1:
        raise FlagError(f"--shard_num must be >= 1, got {flags['shard_num']}")
    if bool(flags["output_path"]) == bool(flags["data_dir"]):
        raise FlagError("give exactly one of --output_path (build output) and --data_dir")
    if flags["shard"] < -1 or flags["shard"] >= flags["shard_num"]:
        raise FlagError(f"--shard must be in 0..{flags['shard_num'] - 1}, got {flags['shard']}")
    version = flags["version"]
    if version and (not version.isdigit() or int(version) <= 0 or len(version) > 19):
        raise FlagError(f"--version must be a positive number (a base's version), got {version!r}")


def _terminate(signum: int, _frame: Any) -> None:
    abort_active_builds()
    for path in list(_staging):
        shutil.rmtree(path, ignore_errors=True)
    os.write(2, f"error: stopped by signal {signum}; nothing was published\n".encode())
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
    started = time.monotonic()
    totals = Totals()
    collecting = gc.isenabled()
    gc.disable()
    try:
        inventory = find_sources(paths, hints)
        plan = make_plan(inventory, flags["shard_num"], flags["check_md5"])
        if flags["output_path"]:
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
                hints.shard,
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
        for note in inventory.notes:
            print(f"note: {note}")
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
