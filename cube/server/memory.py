"""How much memory this server may pin, and whether `--in_mem` may populate and mlock a version.

`--in_mem` faults a version's pages in and mlocks them so that no lookup waits for the disk.
On a table larger than the memory the process may use (its cgroup's limit, or the machine's),
pinning it gets the process OOM-killed at load; without pinning the kernel keeps the hot
pages in the page cache and serves the rest from disk. So before a load the server compares
the bytes it would pin with the limit and, when they do not fit, loads that version without
populating or locking it and says so once (`in_mem_refusal`, pure; `memory_limit` and
`locked_bytes` read /proc and the cgroup files).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

UNLIMITED = 1 << 62  # cgroup v1 writes 9223372036854771712 for "no limit"
HEADROOM_MIN = 256 << 20  # what the process needs beside its pinned shards (code, requests)
HEADROOM_SHARE = 0.10  # ... or this share of the limit, if more


def in_mem_refusal(new_bytes: int, held_bytes: int, limit: int, source: str) -> str:
    """Why a version of `new_bytes` must not be pinned while `held_bytes` are pinned already
    (the version being replaced stays until the switch), under a `limit` read from `source`;
    "" when it fits with room to spare for the process itself."""
    headroom = max(HEADROOM_MIN, int(limit * HEADROOM_SHARE))
    room = limit - headroom - held_bytes
    if new_bytes <= room:
        return ""
    return (
        f"--in_mem: the version's {_size(new_bytes)} do not fit the {_size(max(room, 0))} this"
        f" server may pin ({source} {_size(limit)}, {_size(held_bytes)} pinned by the version"
        f" it replaces, {_size(headroom)} kept for the process): loaded without populating or"
        " locking it, its pages served from the page cache"
    )


HOT_CACHE_SHARE = 0.20  # of the limit, for the hot caches of a version served paged


def hot_cache_budget(limit: int, workers: int, pinned_bytes: int = 0) -> int:
    """Bytes of hot cache (cube.server.hot) each of `workers` gives a version that does not
    fit `limit`, beside `pinned_bytes` pinned (its index): a share of the limit, at most half
    of what the process's headroom and the pinned bytes leave, the rest left to the page
    cache (the misses) and the process."""
    headroom = max(HEADROOM_MIN, int(limit * HEADROOM_SHARE))
    room = max(0, limit - headroom - pinned_bytes)
    return min(int(limit * HOT_CACHE_SHARE), room // 2) // max(1, workers)


def _size(count: int) -> str:
    return f"{count / (1 << 20):.0f} MiB"


def memory_limit(
    proc: Path = Path("/proc"), sys_fs: Path = Path("/sys/fs/cgroup")
) -> tuple[int, str]:
    """(bytes, where the limit comes from): the smallest of the machine's memory and the memory
    limits of this process's cgroup and its ancestors (cgroup v1 `memory.limit_in_bytes`, v2
    `memory.max`)."""
    best = (_mem_total(proc), "the machine's memory")
    for limit, source in _cgroup_limits(proc, sys_fs):
        if limit < best[0]:
            best = (limit, source)
    return best


def _mem_total(proc: Path) -> int:
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return UNLIMITED


def _cgroup_limits(proc: Path, sys_fs: Path) -> list[tuple[int, str]]:
    """The memory limits on this process's cgroup path, from it up to the root."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        number, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if "memory" in controllers.split(","):  # v1
            found += _walk(sys_fs / "memory", path, "memory.limit_in_bytes", "cgroup")
        elif number == "0" and not controllers:  # v2 (its own mount, or beside v1)
            for mount in (sys_fs, sys_fs / "unified"):
                found += _walk(mount, path, "memory.max", "cgroup")
    return found


def _walk(mount: Path, path: str, name: str, label: str) -> list[tuple[int, str]]:
    limits = []
    parts = [p for p in path.split("/") if p]
    for depth in range(len(parts), -1, -1):
        directory = mount.joinpath(*parts[:depth])
        try:
            text = (directory / name).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < UNLIMITED:
            limits.append((int(text), f"the {label} limit of {directory}"))
    return limits


def locked_bytes(proc: Path = Path("/proc")) -> int:
    """The bytes this process has mlocked now (VmLck)."""
    try:
        for line in (proc / "self" / "status").read_text().splitlines():
            if line.startswith("VmLck:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def major_faults(proc: Path = Path("/proc")) -> int:
    """Page faults this process waited on the disk for (majflt of /proc/self/stat): what a
    table larger than memory costs its lookups."""
    try:
        fields = (proc / "self" / "stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[9])  # field 12 of stat(5); fields[0] is field 3 (state)
    except (OSError, ValueError, IndexError):
        return 0


def files_bytes(paths: list[Path]) -> int:
    """The bytes of the files a load would map (missing ones count 0: the load says why)."""
    total = 0
    for path in paths:
        with contextlib.suppress(OSError):
            total += os.stat(path).st_size
    return total
