"""cube-import, finding the original's files: from each -input_path (build output, a version,
a shard, a deployment's data/ or cube_data/) an Inventory of sources, each a shard of a version.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cube.builder.import_original.base import (
    _VERSION_RE,
    _VERSION_RULE,
    FORMAT_FILES,
    ImportError_,
    is_original_file,
)
from cube.layout import (
    PART_NAME_RE,
    VERSION_FILE,
    is_name,
    parse_version,
    part_name,
    tar_name,
)


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
    return any(is_original_file(n) for n in names)


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
        match = PART_NAME_RE.fullmatch(name.removesuffix(".tar"))
        if match and (name.endswith(".tar") or (directory / name).is_dir()):
            found.append(match)
    return found


def _parts(directory: Path, dict_name: str) -> list[int]:
    """Shard numbers of `<dict>_part<i>` directories or tars in a builder version directory."""
    return sorted({int(m["shard"]) for m in _part_matches(directory) if m["dict"] == dict_name})


def _add_tar(inventory: Inventory, path: Path, hints: Hints) -> None:
    if not path.name.endswith(".tar"):
        raise ImportError_(f"{path}: not a shard tar (<dict>_part<i>.tar) nor a directory")
    match = PART_NAME_RE.fullmatch(path.name.removesuffix(".tar"))
    if match:
        _check_dict(path, match, hints)
    shard = int(match["shard"]) if match else _shard_hint(path, hints)
    if match and hints.shard is not None and shard != hints.shard:
        raise ImportError_(f"{path} is shard {shard}, not -shard {hints.shard}")
    inventory.add(Source(_version_of(path.parent, path, hints), shard, "tar", path))


def _add_shard_dir(inventory: Inventory, path: Path, hints: Hints) -> None:
    match = PART_NAME_RE.fullmatch(path.name)
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
        if is_original_file(name):
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
                match = PART_NAME_RE.fullmatch(tar.name.removesuffix(".tar"))
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
