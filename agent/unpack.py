"""Safe extraction of a shard tar.

Every member is checked before anything is written: only regular files and directories with
relative names that stay inside the target are allowed; absolute names, `..`, symlinks, hard
links, devices and fifos make the whole tar refused with a message naming the member. A tar that
cannot be read to its end (truncated, garbage) is refused too. Extraction goes into a hidden temp
directory that the caller renames into place, so a half-extracted version is never visible.

Messages name members (clipped) but never quote file contents: a shard header that does not open
is reported by file and offset, its details go to the agent's log only.
"""

from __future__ import annotations

import logging
import os
import shutil
import tarfile
from pathlib import Path, PurePosixPath

from cube.format import ShardFormatError
from cube.layout import clip, member_problem
from cube.shard import DATA_FILE, INDEX_FILE, Shard

log = logging.getLogger("cube.agent")

REQUIRED_FILES = (INDEX_FILE, DATA_FILE)


class UnsafeTar(ValueError):
    """A tar the agent refuses to extract; the message names the tar and the member."""


def relative_name(member: tarfile.TarInfo) -> str:
    """`./index.cube` -> `index.cube`; '' for the top directory itself."""
    parts = [p for p in PurePosixPath(member.name).parts if p != "."]
    return "/".join(parts)


def check_members(members: list[tarfile.TarInfo], where: str) -> None:
    for member in members:
        problem = member_problem(member)
        if problem:
            raise UnsafeTar(f"{where}: refused member {clip(member.name)}: {problem}")


def extract_shard_tar(tar_path: Path, dest: Path) -> list[str]:
    """Check then extract `tar_path` into the new directory `dest`; returns the file names.

    `dest` must not exist. The shard headers are opened once so a tar holding something else
    than a shard is refused here rather than by the server. Files are fsynced before returning.
    """
    where = f"tar {tar_path.name}"
    try:
        with tarfile.open(tar_path, "r:*") as tar:
            members = tar.getmembers()
            check_members(members, where)
            names = {relative_name(m) for m in members if m.isreg()}
            missing = [f for f in REQUIRED_FILES if f not in names]
            if missing:
                raise UnsafeTar(f"{where}: no {', '.join(missing)} at the top level")
            unpacked = sum(m.size for m in members if m.isreg())
            dest.parent.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(dest.parent).free
            if unpacked > free:
                raise UnsafeTar(f"{where}: unpacks to {unpacked} bytes, {free} free on the disk")
            dest.mkdir(parents=True)
            tar.extractall(dest, members=members, filter="data")
    except UnsafeTar:
        raise
    except (tarfile.TarError, EOFError, OSError, ValueError) as exc:
        log.warning("%s: %r", where, str(exc))
        if isinstance(exc, OSError) and exc.strerror:
            raise  # a local problem (e.g. a full disk), not the tar's
        raise UnsafeTar(f"{where}: corrupt or truncated tar ({type(exc).__name__})") from exc
    _fsync_tree(dest)
    try:
        Shard.open(dest).close()
    except ShardFormatError as exc:  # its text can quote header bytes: the log only
        log.warning("%s: %r", where, str(exc))
        at = f" at offset {exc.offset}" if exc.offset is not None else ""
        raise UnsafeTar(
            f"{where}: does not hold a valid shard: {Path(exc.path).name}{at} is not a readable "
            "shard file of this format (bad header, size or pairing; details in the agent's log)"
        ) from exc
    except (OSError, ValueError) as exc:
        log.warning("%s: %r", where, str(exc))
        raise UnsafeTar(f"{where}: does not hold a valid shard ({type(exc).__name__})") from exc
    return sorted(names)


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(dirpath, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
