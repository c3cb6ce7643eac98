"""The deploy directory of one instance, version names, and the retention rule.

`deploy_path/data/` is the cube-server's `--data_dir`: `data/<version>/` holds a placed shard
(index.cube, data.cube, CHAIN for a delta) and `data/VERSION` names the version to serve at start.
`cube_data/<shard_seq>/<version>/` holds downloads, `agent_state/` the agent's journal, and
`.cube-agent.lock` is held (flock) by the one agent process that manages the directory.

Everything that decides (name checks, version names, what retention deletes, which deploy paths
overlap) is pure; the few file helpers write through a temp name and rename so a reader never
sees half a file. `DeployLock` makes a deploy directory one agent's.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cube.backoff import Backoff, retrying
from cube.fsutil import atomic_write_text
from cube.layout import (
    CHAIN_FILE,
    VERSION_FILE,
    LayoutError,
    is_name,
    parse_chain,
    parse_version,
    version_text,
)

TMP_PREFIX = ".tmp-"
LOCK_FILE = ".cube-agent.lock"


@dataclass(frozen=True)
class Layout:
    """Paths under one deploy_path."""

    deploy_path: Path

    @property
    def data_dir(self) -> Path:
        return self.deploy_path / "data"

    @property
    def state_dir(self) -> Path:
        return self.deploy_path / "agent_state"

    @property
    def downloads_dir(self) -> Path:
        return self.deploy_path / "cube_data"

    @property
    def version_file(self) -> Path:
        return self.data_dir / VERSION_FILE

    def version_dir(self, version: str) -> Path:
        return self.data_dir / version

    def download_dir(self, shard_seq: int, version: str) -> Path:
        return self.downloads_dir / str(shard_seq) / version

    def extract_dir(self, version: str) -> Path:
        return self.data_dir / f"{TMP_PREFIX}{version}-{os.getpid()}"

    @property
    def lock_file(self) -> Path:
        return self.deploy_path / LOCK_FILE

    def create(self) -> None:
        for path in (self.data_dir, self.state_dir, self.downloads_dir):
            path.mkdir(parents=True, exist_ok=True)


def overlap(first: Path, second: Path) -> str | None:
    """Why two deploy paths cannot be managed apart ('' never): the same directory, or one
    inside the other (its agent would take the other's files for versions, downloads or
    leftovers); None when they are apart. Real paths are compared (symlinks resolved)."""
    real_first, real_second = first.resolve(), second.resolve()
    if real_first == real_second:
        return f"deploy_path {first} and {second} are one directory ({real_first})"
    for outer, inner, real_outer, real_inner in (
        (first, second, real_first, real_second),
        (second, first, real_second, real_first),
    ):
        if real_inner.is_relative_to(real_outer):
            return (
                f"deploy_path {inner} lies inside deploy_path {outer} ({real_inner} is in "
                f"{real_outer})"
            )
    return None


class DeployPathTaken(Exception):
    """Another cube-agent process manages this deploy path, or one it lies in or holds."""


LOCK_TRIES = 25  # x 20 ms: another agent's check holds a lock file for a moment only
_LOCK_PAUSE = Backoff(0.02, 0.02)
WALK_LIMIT = 10_000  # directories searched for nested deploy paths


class DeployLock:
    """`<deploy_path>/.cube-agent.lock`, flock'ed exclusively for the agent's life (released by
    the kernel when the process ends, however it ends): a second agent process on the same
    directory, by any path (a symlink), is refused, and so is one whose deploy path lies inside
    a directory another agent holds, or holds one (found by their lock files: the ancestors of
    the real path, and its tree up to WALK_LIMIT directories). The file names the holder's pid
    and real path, for the message."""

    def __init__(self, deploy_path: Path) -> None:
        self.deploy_path = deploy_path
        self.path = deploy_path / LOCK_FILE
        self.fd: int | None = None

    def acquire(self) -> None:
        """DeployPathTaken (naming both directories and the other agent's pid) when another
        agent process holds this directory or one it lies in or holds."""
        real = self.deploy_path.resolve()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            if not _lock(fd, fcntl.LOCK_EX, LOCK_TRIES):
                raise DeployPathTaken(
                    f"deploy_path {self.deploy_path} ({real}) is managed by another cube-agent "
                    f"{_holder(fd)}: one agent per directory"
                )
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n{real}\n".encode(), 0)
            self._check_nesting(real)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd

    def _check_nesting(self, real: Path) -> None:
        for parent in real.parents:
            holder = _held_by_another(parent / LOCK_FILE)
            if holder is not None:
                raise DeployPathTaken(
                    f"deploy_path {self.deploy_path} ({real}) lies inside {parent}, which "
                    f"another cube-agent {holder} manages: one agent per directory tree"
                )
        for walked, (top, _dirs, files) in enumerate(os.walk(real)):
            if walked >= WALK_LIMIT:
                break
            if top != str(real) and LOCK_FILE in files:
                holder = _held_by_another(Path(top) / LOCK_FILE)
                if holder is not None:
                    raise DeployPathTaken(
                        f"deploy_path {self.deploy_path} ({real}) holds {top}, which another "
                        f"cube-agent {holder} manages: one agent per directory tree"
                    )

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # the lock goes with the descriptor
            self.fd = None


def _held(error: Exception) -> bool:
    """A non-blocking flock's "another holds it"."""
    return isinstance(error, OSError) and error.errno in (errno.EWOULDBLOCK, errno.EAGAIN)


def _lock(fd: int, kind: int, tries: int) -> bool:
    """flock without waiting, tried `tries` times (at least once) 20 ms apart; whether it
    was got."""

    def attempt(_number: int) -> bool:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
        return True

    try:
        return retrying(attempt, _LOCK_PAUSE, tries, _held)
    except OSError as exc:
        if _held(exc):
            return False
        raise


def _holder(fd: int) -> str:
    """'(pid N, at PATH)' from a lock file's content, as its holder wrote it."""
    try:
        lines = os.pread(fd, 4096, 0).decode("utf-8", "replace").splitlines()
    except OSError:
        lines = []
    pid = lines[0].strip() if lines and lines[0].strip().isdigit() else "?"
    at = f", at {lines[1].strip()}" if len(lines) > 1 and lines[1].strip() else ""
    return f"(pid {pid}{at})"


def _held_by_another(lock_file: Path) -> str | None:
    """'(pid N, at PATH)' when an agent process holds `lock_file`, else None (no such file,
    or nobody holds it: a stale one)."""
    try:
        fd = os.open(lock_file, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if _lock(fd, fcntl.LOCK_SH, 1):
            return None  # (closing the descriptor releases the shared lock at once)
        return _holder(fd)
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


def read_version_file(layout: Layout) -> str:
    """The version data/VERSION names (cube.layout.parse_version), or '' when there is none."""
    try:
        text = layout.version_file.read_text(encoding="utf-8")
    except FileNotFoundError:
        return ""
    return parse_version(text) or ""


def write_version_file(layout: Layout, version: str) -> None:
    atomic_write_text(layout.version_file, version_text(version))


def read_chain(layout: Layout, version: str) -> list[str]:
    """A placed version's chain: the CHAIN file of a delta, `[version]` for a base. A line that
    is not a version name is left out (a chain never leads outside data/); the placed-files
    check reports such a CHAIN as damaged."""
    try:
        text = (layout.version_dir(version) / CHAIN_FILE).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return [version]
    return [name for name in _chain_lines(text) if is_name(name)] or [version]


def chain_is_valid(layout: Layout, version: str) -> bool:
    """Whether data/<version>/CHAIN is a chain the server accepts (cube.layout.parse_chain)."""
    try:
        text = (layout.version_dir(version) / CHAIN_FILE).read_text(encoding="utf-8")
        parse_chain(text, version)
    except (OSError, UnicodeDecodeError, LayoutError):
        return False
    return True


def _chain_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


def placed_versions(layout: Layout) -> list[str]:
    """Version directories in data/ (hidden temp dirs excluded), by name."""
    try:
        entries = list(os.scandir(layout.data_dir))
    except FileNotFoundError:
        return []
    return sorted(e.name for e in entries if e.is_dir() and not e.name.startswith("."))


def plan_retention(newest_first: Sequence[str], keep: int, protected: Iterable[str]) -> list[str]:
    """Versions to delete: all but the `keep` newest and the protected ones (serving, loading,
    the current chain). Pure, so the rule is tested without files."""
    protected_set = set(protected)
    kept = set(newest_first[: max(keep, 0)])
    return [v for v in newest_first if v not in kept and v not in protected_set]
