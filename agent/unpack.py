"""Safe extraction of a shard tar.

Every member is checked before anything is written: only regular files and directories with
relative names that stay inside the target are allowed; absolute names, `..`, symlinks, hard
links, devices and fifos make the whole tar refused with a message naming the member. A tar that
cannot be read to its end (truncated, garbage) is refused too. Extraction goes into a hidden temp
directory that the caller renames into place, so a half-extracted version is never visible.

What a tar may unpack to is bounded before a byte is written: a shard tar is a plain tar (as
cube-builder and the original write it), so its files hold at most the tar's own size, which its
build recorded (the `size` a download carries). A compressed tar is refused, and so is one whose
members claim more (a sparse member expanding to gigabytes); the files must also fit in the free
disk space with a margin (`DISK_MARGIN`), so that an extraction never fills the disk the server
and the other versions share. The members are read one by one and the first one past a bound
stops the check: nothing is decompressed or expanded beyond it.

Messages name members (clipped) but never quote file contents: a shard header that does not open
is reported by file and offset, its details go to the agent's log only.

A tar of a version of several tables (cube.layout's TABLES) holds a `TABLES` member listing the
tables and `<table>/index.cube` + `<table>/data.cube` for each: every listed table's files are
required (and opened), and a top-level index.cube beside TABLES is refused (which to serve?).
`shard_dirs` says where a placed version's shard files are.
"""

from __future__ import annotations

import copy
import logging
import os
import tarfile
from pathlib import Path, PurePosixPath

from cube.format import ShardFormatError
from cube.layout import TABLES_FILE, LayoutError, clip, member_problem, parse_tables
from cube.shard import DATA_FILE, INDEX_FILE, Shard

log = logging.getLogger("cube.agent")

REQUIRED_FILES = (INDEX_FILE, DATA_FILE)
MAX_TABLES_BYTES = 64 << 10  # a TABLES member: at most MAX_TABLES names of 128 characters
DISK_MARGIN = (64 << 20, 0.01)  # bytes kept free after an extraction: 64 MiB, or 1 % of the disk
_COMPRESSED = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz",
               b"\x28\xb5\x2f\xfd": "zstd"}  # fmt: skip


class UnsafeTar(ValueError):
    """A tar the agent refuses to extract; the message names the tar and the member."""


def relative_name(member: tarfile.TarInfo) -> str:
    """`./index.cube` -> `index.cube`; '' for the top directory itself."""
    parts = [p for p in PurePosixPath(member.name).parts if p != "."]
    return "/".join(parts)


def as_data(member: tarfile.TarInfo) -> tarfile.TarInfo:
    """What tarfile's `data` filter makes of a member that member_problem() passed, for a
    Python without extraction filters (before 3.11.4): owned by the user extracting (not by
    the tar's owner, when that user is root), no set-uid, set-gid, sticky or group/other write
    bit, a file its owner may read and write (executable only if it was for its owner)."""
    member = copy.copy(member)
    member.uid, member.gid, member.uname, member.gname = os.getuid(), os.getgid(), "", ""
    mode = member.mode & 0o755
    if member.isreg():
        mode = (mode if mode & 0o100 else mode & ~0o111) | 0o600
    else:
        mode |= 0o700  # (the filter leaves a directory's mode to mkdir)
    member.mode = mode
    return member


def free_for_extraction(directory: Path) -> int:
    """Bytes an extraction into `directory` may write: what statvfs says is free to this
    process, less the margin kept for the server and the other versions (DISK_MARGIN)."""
    fs = os.statvfs(directory)
    keep = max(DISK_MARGIN[0], int(DISK_MARGIN[1] * fs.f_blocks * fs.f_frsize))
    return fs.f_bavail * fs.f_frsize - keep


def compression_of(tar_path: Path) -> str | None:
    """The compression a file's first bytes announce (gzip, bzip2, xz, zstd), else None."""
    with open(tar_path, "rb") as f:
        head = f.read(6)
    return next((kind for magic, kind in _COMPRESSED.items() if head.startswith(magic)), None)


def extract_shard_tar(tar_path: Path, dest: Path, recorded: int | None = None) -> list[str]:
    """Check then extract `tar_path` into the new directory `dest`; returns the file names.

    `dest` must not exist. The members may unpack to at most `recorded` bytes (the tar's size
    its build recorded; default: the tar's size) and must fit in the free disk space
    (`free_for_extraction`): UnsafeTar otherwise, before anything is written. The shard headers
    are opened once so a tar holding something else than a shard is refused here rather than
    by the server. Files are fsynced before returning.
    """
    where = f"tar {tar_path.name}"
    try:
        size = tar_path.stat().st_size
        limit = size if recorded is None else recorded
        compression = compression_of(tar_path)
        if compression:
            raise UnsafeTar(
                f"{where}: a {compression}-compressed tar; a shard tar is a plain tar (as "
                "cube-builder writes it), which unpacks to no more than its own size"
            )
        dest.parent.mkdir(parents=True, exist_ok=True)
        room = free_for_extraction(dest.parent)
        with tarfile.open(tar_path, "r:") as tar:
            members = []
            unpacked = 0
            for member in tar:  # one by one: the first past a bound stops the reading
                problem = member_problem(member)
                if problem:
                    raise UnsafeTar(f"{where}: refused member {clip(member.name)}: {problem}")
                stored_end = member.offset_data + member.size
                if member.isreg() and not member.issparse() and stored_end > size:
                    raise UnsafeTar(
                        f"{where}: corrupt or truncated tar (member {clip(member.name)} at offset "
                        f"{member.offset} claims {member.size} bytes, the tar ends at {size})"
                    )
                members.append(member)
                unpacked += member.size if member.isreg() else 0
                if unpacked > limit:
                    raise UnsafeTar(
                        f"{where}: its files unpack to more than {limit} bytes, the size of the "
                        f"tar its build recorded (member {clip(member.name)} at offset "
                        f"{member.offset} brings them to {unpacked}; a sparse member?); refused "
                        "before extracting"
                    )
                if unpacked > room:
                    raise UnsafeTar(
                        f"{where}: its files unpack to {unpacked} bytes or more, and "
                        f"{dest.parent} has {max(room, 0)} bytes free beyond the margin kept "
                        "for the server and the other versions; refused before extracting"
                    )
            names = _required_files(tar, members, where)
            dest.mkdir(parents=True)
            if hasattr(tarfile, "data_filter"):
                tar.extractall(dest, members=members, filter="data")
            else:  # Python 3.11.0 to 3.11.3 (Debian bookworm's 3.11.2: the image's)
                tar.extractall(dest, members=[as_data(m) for m in members])
    except UnsafeTar:
        raise
    except (tarfile.TarError, EOFError, OSError, ValueError) as exc:
        log.warning("%s: %r", where, str(exc))
        if isinstance(exc, OSError) and exc.strerror:
            raise  # a local problem (e.g. a full disk), not the tar's
        raise UnsafeTar(f"{where}: corrupt or truncated tar ({type(exc).__name__})") from exc
    _fsync_tree(dest)
    try:
        for directory in shard_dirs(dest):
            Shard.open(directory).close()
    except ShardFormatError as exc:  # its text can quote header bytes: the log only
        log.warning("%s: %r", where, str(exc))
        at = f" at offset {exc.offset}" if exc.offset is not None else ""
        raise UnsafeTar(
            f"{where}: does not hold a valid shard: {_member_of(exc.path, dest)}{at} is not a "
            "readable "
            "shard file of this format (bad header, size or pairing; details in the agent's log)"
        ) from exc
    except (OSError, ValueError) as exc:
        log.warning("%s: %r", where, str(exc))
        raise UnsafeTar(f"{where}: does not hold a valid shard ({type(exc).__name__})") from exc
    return sorted(names)


def _member_of(path: str, dest: Path) -> str:
    """A shard file's name in the tar (`000/index.cube` for a table's)."""
    try:
        return str(Path(path).relative_to(dest))
    except ValueError:
        return Path(path).name


def _required_files(tar: tarfile.TarFile, members: list[tarfile.TarInfo], where: str) -> set[str]:
    """The names of the tar's files (relative), once the shard files are found among them:
    index.cube and data.cube at the top, or for a version of several tables (a TABLES
    member) each listed table's, and no top-level index.cube beside them. UnsafeTar if not."""
    names = {relative_name(m) for m in members if m.isreg()}
    tables = _listed_tables(tar, members, where)
    if tables is None:
        missing = [f for f in REQUIRED_FILES if f not in names]
        if missing:
            raise UnsafeTar(f"{where}: no {', '.join(missing)} at the top level")
        return names
    if INDEX_FILE in names:
        raise UnsafeTar(f"{where}: both {TABLES_FILE} and a top-level {INDEX_FILE}")
    wanted = [f"{t}/{f}" for t in tables for f in REQUIRED_FILES]
    missing = [f for f in wanted if f not in names]
    if missing:
        raise UnsafeTar(f"{where}: no {clip(missing[0])} ({TABLES_FILE} lists its table)")
    return names


def _listed_tables(
    tar: tarfile.TarFile, members: list[tarfile.TarInfo], where: str
) -> list[str] | None:
    """The tables a tar's TABLES member lists (checked: cube.layout.parse_tables); None when it
    has none (a version of one table). UnsafeTar for a malformed one."""
    found = [m for m in members if m.isreg() and relative_name(m) == TABLES_FILE]
    if not found:
        return None
    member = found[-1]
    if member.size > MAX_TABLES_BYTES:
        raise UnsafeTar(f"{where}: a {TABLES_FILE} of {member.size} bytes; refused")
    handle = tar.extractfile(member)
    assert handle is not None  # a regular file
    try:
        return parse_tables(handle.read(MAX_TABLES_BYTES).decode("utf-8"))
    except (LayoutError, UnicodeDecodeError) as exc:
        raise UnsafeTar(
            f"{where}: its {TABLES_FILE} is not a list of table names ({exc})"
        ) from None


def shard_dirs(version_dir: Path) -> list[Path]:
    """Where a placed version's shard files are: the directory itself, or for a version of
    several tables (a TABLES file) each table's subdirectory, in TABLES order. LayoutError
    for a TABLES file that is not a list of table names; OSError when it cannot be read."""
    try:
        text = (version_dir / TABLES_FILE).read_text(encoding="utf-8")
    except FileNotFoundError:
        return [version_dir]
    except UnicodeDecodeError as exc:
        raise LayoutError(f"{TABLES_FILE} is not text ({exc.reason})") from None
    return [version_dir / name for name in parse_tables(text)]


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
