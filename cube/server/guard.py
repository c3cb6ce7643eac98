"""Shard files that change under a running server.

A mapped file that another process truncates turns the next read of a missing page into SIGBUS,
which kills the process; a file rewritten in place changes answers silently. cube-server never
writes shard files (a new version is a new directory), but an operator, a tool or a restore can.
So every shard file the server maps is watched:

- With a read lease (fcntl F_SETLEASE F_RDLCK) when the kernel grants one (the file's owner or
  CAP_LEASE, on a local filesystem). A process that opens the file for writing or truncates it
  is held back by the kernel (up to /proc/sys/fs/lease-break-time, 45 s by default) and this
  process gets SIGIO. The server then stops serving every version that maps the file, unmaps it
  and closes it, which releases the lease; only then does the writer go on. No request reads a
  changed page.
- Otherwise by polling (`check` every second or so): the size and modification time of each
  watched descriptor against what was mapped. A truncation found this way leaves a window (up to
  one polling interval) in which a request can still touch a missing page; docs/SECURITY.md
  says so.

The registry is keyed by descriptor: the loader thread adds files as it opens them, the event
loop thread checks and forgets them (before the descriptor is closed, so a reused number is
never confused with an old file).
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("cube.server")

F_SETLEASE = getattr(fcntl, "F_SETLEASE", 1024)  # Linux values, when the module lacks them
F_GETLEASE = getattr(fcntl, "F_GETLEASE", 1025)


@dataclass
class WatchedFile:
    path: Path
    fd: int
    leased: bool
    size: int
    mtime_ns: int
    changed: str = ""  # what happened to it, once noticed


class FileWatch:
    """The shard files one server process maps, and whether another process changed them."""

    def __init__(self, use_leases: bool = True) -> None:
        self.use_leases = use_leases
        self._files: dict[int, WatchedFile] = {}
        self._lock = threading.Lock()
        self._lease_refusal_logged = False

    def on_open(self, fd: int, path: Path) -> None:
        """`Shard.open`'s hook: lease (or remember the size and mtime of) a file just opened."""
        leased = False
        if self.use_leases:
            try:
                fcntl.fcntl(fd, F_SETLEASE, fcntl.F_RDLCK)
                leased = True
            except OSError as exc:
                if not self._lease_refusal_logged:
                    self._lease_refusal_logged = True
                    log.warning(
                        "no file lease on %s (%s): shard files are watched by polling, so a"
                        " file truncated under the server can still fault a request in the"
                        " moment before it is noticed (see docs/SECURITY.md)",
                        path,
                        os.strerror(exc.errno or 0),
                    )
        stat = os.fstat(fd)
        with self._lock:
            self._files[fd] = WatchedFile(path, fd, leased, stat.st_size, stat.st_mtime_ns)

    def forget(self, fds: Iterable[int]) -> None:
        """Stop watching these descriptors (called just before they are closed)."""
        with self._lock:
            for fd in fds:
                self._files.pop(fd, None)

    def check(self) -> list[WatchedFile]:
        """Files found changed since the last check; each is reported once."""
        with self._lock:
            files = [f for f in self._files.values() if not f.changed]
        found = []
        for watched in files:
            problem = _problem(watched)
            if problem:
                watched.changed = problem
                found.append(watched)
        return found

    def changed(self, fds: Iterable[int]) -> str:
        """Why one of these descriptors' files changed ("" when none did), checking now."""
        with self._lock:
            files = [self._files[fd] for fd in fds if fd in self._files]
        for watched in files:
            if not watched.changed:
                watched.changed = _problem(watched)
            if watched.changed:
                return f"{watched.path} {watched.changed}"
        return ""

    def __len__(self) -> int:
        return len(self._files)


def _problem(watched: WatchedFile) -> str:
    if watched.leased:
        try:
            state = fcntl.fcntl(watched.fd, F_GETLEASE)
        except OSError as exc:
            return f"cannot be checked ({os.strerror(exc.errno or 0)})"
        if state != fcntl.F_RDLCK:
            return "was opened for writing or truncated by another process"
        return ""
    try:
        stat = os.fstat(watched.fd)
    except OSError as exc:
        return f"cannot be checked ({os.strerror(exc.errno or 0)})"
    if stat.st_size != watched.size:
        return f"changed size from {watched.size} to {stat.st_size} bytes under the server"
    if stat.st_mtime_ns != watched.mtime_ns:
        return "was rewritten under the server (its modification time changed)"
    return ""
