"""Versions one server process holds: names and chains on disk, loading them into ShardStacks,
and the slots (current, background, staged) requests and control commands work on.

Layout (the original's): `<data_dir>/VERSION` names the version to serve at start and
`<data_dir>/<version>/` holds `index.cube` + `data.cube`; with `dict_split` D > 1 every split
has its own `<data_dir>/<split>/VERSION` and `<data_dir>/<split>/<version>/`.

A version named `<base>_<cur>` is a delta on `<base>`. Its chain (base first, ending with the
delta) is the `CHAIN` file in its directory, one name per line; the agent writes it when it
places a delta and the server writes it when it loads a patch without one. Without a CHAIN
file the chain is rebuilt from the directory names: the base plus every `<base>_*` delta up to
the named one. A delta layers over the shards already mapped: nothing is copied.

A version with several tables (a model's sparse tables, cube/layout.py `TABLES`) holds one
`<table>/` of shard files per table in each version directory; it loads as one
`LoadedVersion` owning one child per table (`table`), so its tables are served, switched and
unmapped together, and every request names the table it reads.

Everything here runs either on the event loop thread (slots, request reference counts) or in
one loader thread (loading) while the control lock is held, so the only shared mutable state
across threads is the shard reference count, guarded by a lock.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from cube.format import ShardFormatError, VerifyCancelled
from cube.fsutil import atomic_write_text
from cube.layout import (
    CHAIN_FILE,
    NAME_RULE,
    PART_RE,
    TABLES_FILE,
    VERSION_FILE,
    LayoutError,
    base_of,
    chain_text,
    clip,
    delta_order,
    is_delta,
    is_name,
    parse_chain,
    parse_tables,
    parse_version,
    version_text,
)
from cube.routing import ShardRouting
from cube.server import memory
from cube.server.guard import FileWatch
from cube.shard import Shard, ShardStack

log = logging.getLogger("cube.server")


class VersionError(Exception):
    """A version that cannot be named, found or loaded. `code` is a grpc.StatusCode name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# ---------------------------------------------------------------------------------------------
# names and paths (pure)


def version_name_from_path(version_path: str, data_dir: str | os.PathLike[str]) -> str:
    """The version directory a control command names: "/<dir>" (the original's form, relative
    to the data dir), "<dir>", or an absolute path inside the data dir. Anything that is not one
    directory directly under the data dir is refused (`..`, other absolute paths, nesting), and
    so is a name that is not a version name (cube.layout.is_name): a hidden directory is an
    agent's staging or removal folder (`.tmp-*`), half-written or half-deleted."""
    text = (version_path or "").strip()
    if not text:
        raise VersionError("INVALID_ARGUMENT", "version_path is empty")
    if "\x00" in text or "\\" in text:
        raise VersionError("INVALID_ARGUMENT", f"version_path {text!r}: bad character")
    root = str(Path(data_dir).resolve())
    if text.startswith(root + "/"):
        text = text[len(root) :]
    name = text.strip("/")
    if not name or "/" in name or name in (".", ".."):
        raise VersionError(
            "INVALID_ARGUMENT",
            f"version_path {version_path!r} is not one version directory under the data dir"
            f" {root} (expected '/<version>' or '<version>')",
        )
    if not is_name(name):
        hidden = "; a name starting with '.' is an agent's staging folder" if name[0] == "." else ""
        raise VersionError(
            "INVALID_ARGUMENT",
            f"version_path {version_path!r}: {clip(name)} is not a version name "
            f"(it starts with a letter or digit; {NAME_RULE}){hidden}",
        )
    return name


def split_dirs(data_dir: str | os.PathLike[str], dict_split: int) -> list[Path]:
    root = Path(data_dir)
    if dict_split <= 1:
        return [root]
    return [root / str(i) for i in range(dict_split)]


def read_version_file(split_dir: Path) -> str | None:
    """The version VERSION names, or None when there is no such file (or it is blank)."""
    try:
        text = (split_dir / VERSION_FILE).read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise VersionError("FAILED_PRECONDITION", f"{split_dir / VERSION_FILE}: {exc}") from exc
    return parse_version(text)


_SHARD_FILES = ("index.cube", "data.cube")
WAITING = "holds no version yet: waiting for cube-agent to load one"  # an empty data dir
LAYOUT_HINT = (
    "the server reads <data_dir>/VERSION, which names a version directory"
    " <data_dir>/<version>/ holding index.cube and data.cube (cube-agent lays it out; by hand:"
    " mkdir -p DATA/V && tar -xf <dict>_part<shard>.tar -C DATA/V && echo V > DATA/VERSION)"
)


def diagnose_data_dir(data_dir: Path, dirs: list[Path]) -> str:
    """Why a data dir without a start-up version serves nothing, in words an operator can act
    on: a typo, a builder output folder, shard files outside a version directory, version
    directories nobody named in VERSION, or simply empty (waiting for cube-agent: `WAITING`,
    the normal start of a replica, which is no warning)."""
    if not data_dir.exists():
        if data_dir.parent.is_dir():  # the agent beside it makes it with its first version
            return f"{data_dir} does not exist yet: {WAITING}"
        return (
            f"--data_dir {data_dir} does not exist, nor does its parent (a typo? cube-agent"
            " creates it as <deploy_path>/data); waiting for a version to be loaded"
        )
    if not data_dir.is_dir():
        return f"--data_dir {data_dir} is not a directory"
    try:
        names = sorted(p.name for p in data_dir.iterdir())
    except OSError as exc:
        return f"--data_dir {data_dir} cannot be read: {exc}"
    built = [n for n in names if PART_RE.fullmatch(n) or n == "meta_info"]
    nested = [
        f"{n}/{m.name}"
        for n in names
        if re.fullmatch(r"\d+_\d+", n) and (data_dir / n).is_dir()
        for m in (data_dir / n).iterdir()
        if PART_RE.fullmatch(m.name)
    ][:3]
    if built or nested:
        found = ", ".join((built or nested)[:3])
        return f"--data_dir {data_dir} looks like cube-builder output ({found}); {LAYOUT_HINT}"
    if any(n in names for n in _SHARD_FILES):
        return (
            f"--data_dir {data_dir} holds shard files directly; put them in a version"
            f" directory and name it in VERSION: {LAYOUT_HINT}"
        )
    versions = [
        n for d in dirs if d.is_dir() for n in sorted(x.name for x in d.iterdir() if x.is_dir())
    ]
    versions = [n for n in versions if not n.startswith(".")]
    if versions:
        return (
            f"{data_dir} has version directories ({', '.join(versions[:5])}) but no VERSION"
            " file naming the one to serve (echo <version> > VERSION, or let cube-agent enable"
            " one)"
        )
    return f"{data_dir} {WAITING}"


def startup_version(dirs: list[Path]) -> str | None:
    """The version every split's VERSION names, None when none has one; splits that disagree
    are an error (a server serves one version name)."""
    names = [read_version_file(d) for d in dirs]
    present = {n for n in names if n}
    if not present:
        return None
    if len(present) > 1 or None in names:
        listing = ", ".join(f"{d / VERSION_FILE}={n!r}" for d, n in zip(dirs, names, strict=True))
        raise VersionError("FAILED_PRECONDITION", f"splits name different versions: {listing}")
    return present.pop()


def read_chain(split_dir: Path, name: str) -> list[str] | None:
    """The CHAIN file of version `name`, checked (cube.layout.parse_chain); None if absent."""
    path = split_dir / name / CHAIN_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise VersionError("FAILED_PRECONDITION", f"{path}: {exc}") from exc
    try:
        return parse_chain(text, name)
    except LayoutError as exc:
        raise VersionError("FAILED_PRECONDITION", f"{path}: {exc}") from None


def read_tables(version_dir: Path) -> list[str]:
    """The tables a version directory's TABLES file lists ([]: no file, one unnamed table)."""
    path = version_dir / TABLES_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError) as exc:
        raise VersionError("FAILED_PRECONDITION", f"{path}: {exc}") from exc
    try:
        return parse_tables(text)
    except LayoutError as exc:
        raise VersionError("FAILED_PRECONDITION", f"{path}: {exc}") from None


def chain_tables(split_dir: Path, chain: list[str]) -> list[str]:
    """The tables every layer of `chain` holds ([]: one unnamed table); a layer with other
    tables than its chain's is refused (a delta is built from a save of the same model)."""
    tables = read_tables(split_dir / chain[-1])
    for link in chain[:-1]:
        theirs = read_tables(split_dir / link)
        if theirs != tables:
            raise VersionError(
                "FAILED_PRECONDITION",
                f"{split_dir / chain[-1]} holds tables {tables or ['(one unnamed)']} but"
                f" {split_dir / link} of its chain holds {theirs or ['(one unnamed)']}: every"
                " version of a chain must hold the same tables",
            )
    return tables


def resolve_chain(split_dir: Path, name: str) -> list[str]:
    """Base first, ending with `name`: CHAIN when present, else rebuilt from directory names."""
    chain = read_chain(split_dir, name)
    if chain is None:
        if not is_delta(name):
            chain = [name]
        else:
            base = base_of(name)
            try:
                entries = [p.name for p in split_dir.iterdir() if p.is_dir()]
            except OSError as exc:
                raise VersionError("NOT_FOUND", f"{split_dir}: {exc}") from exc
            deltas = sorted(
                (n for n in entries if is_delta(n) and base_of(n) == base), key=delta_order
            )
            upto = delta_order(name)
            chain = [base, *(d for d in deltas if delta_order(d) <= upto)]
    for link in chain:
        if not (split_dir / link).is_dir():
            raise VersionError(
                "NOT_FOUND",
                f"version {name!r} needs {link!r} (chain {' > '.join(chain)}) but"
                f" {split_dir / link} does not exist",
            )
    return chain


def write_chain(split_dir: Path, name: str, chain: list[str]) -> None:
    """Record a patch's chain in `<version>/CHAIN` (durably, all or nothing); best effort on a
    read-only data dir."""
    path = split_dir / name / CHAIN_FILE
    try:
        atomic_write_text(path, chain_text(chain))
    except OSError as exc:
        log.warning("could not record the chain of %s in %s: %s", name, path, exc)


def write_version_file(split_dir: Path, name: str) -> None:
    """Name the version to serve at start in `VERSION` (durably, all or nothing)."""
    atomic_write_text(split_dir / VERSION_FILE, version_text(name))


# ---------------------------------------------------------------------------------------------
# shards shared between versions


class ShardHandle:
    """A mapped shard that several versions may share (a delta layers over the current base):
    it is closed when the last version holding it lets go (its files leave the watch first)."""

    _lock = threading.Lock()

    def __init__(self, shard: Shard, watch: FileWatch | None = None) -> None:
        self.shard = shard
        self.refs = 1
        self.watch = watch
        self.max_value_bytes = _max_value_bytes(shard)
        self.mapped_bytes = sum(int(a.nbytes) for a in mapped_arrays(shard))
        self.locked_bytes = 0  # set by the load with --in_mem
        self.pmd_mapped_bytes = 0  # set by the load with --huge_pages: on 2 MiB pages

    @property
    def fds(self) -> list[int]:
        return [f.fd for f in self.shard.files if f.fd >= 0]

    def acquire(self) -> ShardHandle:
        with self._lock:
            self.refs += 1
        return self

    def release(self) -> None:
        with self._lock:
            self.refs -= 1
            last = self.refs == 0
        if last:
            if self.watch is not None:
                self.watch.forget(self.fds)
            if not self.shard.close():
                log.warning("%s still referenced after close: unmapped later", self.shard.directory)


def _max_value_bytes(shard: Shard) -> int:
    """The longest value of a shard (its width when fixed): bounds an answer's size."""
    values = shard.values
    if values.width or not values.count:
        return values.width
    return int(np.diff(values.offsets).max())


_libc: Any = None


def mapped_arrays(shard: Shard, index_only: bool = False) -> list[np.ndarray]:
    """The sections of a shard that lookups read: the index and the values."""
    index = [shard.table.bucket_starts, shard.table.remainders]
    return index if index_only else [*index, shard.values.blob]


def unlock_memory(shard: Shard) -> int:
    """munlock a shard's mapped sections; the bytes unlocked."""
    _load_libc()
    unlocked = 0
    for array in mapped_arrays(shard):
        if array.nbytes:
            start = array.ctypes.data
            page = start & ~(4096 - 1)
            _libc.munlock(ctypes.c_void_p(page), ctypes.c_size_t(array.nbytes + start - page))
            unlocked += array.nbytes
    return unlocked


def _load_libc() -> None:
    global _libc
    if _libc is None:
        # the symbols already in the process (libc among them): find_library would spawn
        # `ldconfig -p`, a child process a PID count or a CPU meter would catch
        _libc = ctypes.CDLL(None, use_errno=True)


PIN_CHUNK = 32 << 20  # bytes read ahead and mlocked at a time (see lock_in_memory)
_MADV_WILLNEED = 3


def lock_in_memory(shard: Shard, index_only: bool = False) -> int:
    """Best effort mlock of a shard's mapped sections (`--in_mem true`; `index_only`: a table
    larger than memory whose index fits); the bytes locked (fewer than mapped when refused:
    RLIMIT_MEMLOCK).

    PIN_CHUNK at a time, each read ahead first (MADV_WILLNEED reads without holding the
    process's mmap lock): one mlock of a whole version faults it in from disk holding that lock
    for as long, and any mmap of the process (a large numpy array) queued behind it stalls
    every page fault after it, those of requests served paged meanwhile among them."""
    _load_libc()
    locked = 0
    for array in mapped_arrays(shard, index_only):
        if not array.nbytes:
            continue
        start = array.ctypes.data
        page = start & ~(4096 - 1)
        end = start + array.nbytes
        for chunk in range(page, end, PIN_CHUNK):
            length = ctypes.c_size_t(min(PIN_CHUNK, end - chunk))
            _libc.madvise(ctypes.c_void_p(chunk), length, _MADV_WILLNEED)
            if _libc.mlock(ctypes.c_void_p(chunk), length) != 0:
                errno = ctypes.get_errno()
                log.warning(
                    "mlock of %d bytes of %s failed: %s (serving from the page cache;"
                    " raise RLIMIT_MEMLOCK to pin shards)",
                    length.value,
                    shard.directory,
                    os.strerror(errno),
                )
                _libc.munlock(ctypes.c_void_p(page), ctypes.c_size_t(chunk - page))
                return locked
        locked += array.nbytes
    return locked


@dataclass
class SplitData:
    """One split of a loaded version: its chain, the stack that serves it, and the routing its
    shard headers record (None when they do not say)."""

    directory: Path
    chain: list[str]
    handles: list[ShardHandle]
    stack: ShardStack
    routing: ShardRouting | None = None

    def describe(self) -> dict[str, Any]:
        layers = [h.shard for h in self.handles]
        return {
            "dir": str(self.directory),
            "chain": self.chain,
            "value_width": self.stack.value_width,
            "record_count": sum(s.record_count for s in layers),
            "base_record_count": layers[0].record_count,
            "tombstone_count": sum(int(s.meta.get("tombstone_count", 0)) for s in layers),
            "data_bytes": sum(
                int(s.meta.get("value_bytes", 0)) + int(s.meta.get("data_file_size", 0))
                for s in layers
            ),
            "dict_name": layers[-1].meta.get("dict_name"),
            "mapped_bytes": sum(h.mapped_bytes for h in self.handles),
            "locked_bytes": sum(h.locked_bytes for h in self.handles),
            "pmd_mapped_bytes": sum(h.pmd_mapped_bytes for h in self.handles),
        }


@dataclass(eq=False)
class LoadedVersion:
    """A version ready to serve. Requests hold it between `acquire` and `release`; once it has
    left every slot (`retire`) the last release unmaps its shards. `fail` unmaps it at once
    (its files changed under the server): requests still holding it get an error.

    A version of several tables (`with_tables`) owns one child LoadedVersion per table:
    lookups read a child (`table`), whose acquire, release, retire and fail are its owner's,
    so the tables live and die together. The owner's `splits` are its first table's (chains,
    split listings); `all_splits` are every table's (files, bytes, unmapping)."""

    name: str
    splits: list[SplitData]
    load_seconds: float = 0.0
    loaded_at: float = field(default_factory=time.time)
    inflight: int = 0
    retired: bool = False
    closed: bool = False
    broken: str = ""  # why it must not be read any more (set by `fail`)
    tables: dict[str, LoadedVersion] = field(default_factory=dict)
    owner: LoadedVersion | None = None  # a table's version: the version holding it
    memory_note: str = ""  # why --in_mem did not pin it (cube.server.memory), if it did not
    # bytes of its hot cache (cube.server.hot) while it is served paged (memory_note set)
    hot_cache_bytes: int = 0

    def __post_init__(self) -> None:
        self.all_splits = [s for t in self.tables.values() for s in t.splits] or self.splits
        widths = {s.stack.value_width for s in self.splits}
        # One width for the whole answer only when every split agrees; else variable.
        self.value_width = widths.pop() if len(widths) == 1 else 0
        self.stacks = [s.stack for s in self.splits]
        # The keys this version holds, when every split's headers agree on it.
        routings = {s.routing for s in self.all_splits}
        self.routing: ShardRouting | None = routings.pop() if len(routings) == 1 else None
        # Longest value: bounds the bytes of an answer before it is built.
        self.max_value_bytes = max(
            (h.max_value_bytes for s in self.splits for h in s.handles), default=0
        )
        # views the request kernel prepares on the mapped shards (dropped before unmapping)
        self.kernel_cache: dict[str, Any] = {}
        for table in self.tables.values():
            table.owner = self

    @classmethod
    def with_tables(
        cls, name: str, tables: dict[str, list[SplitData]], load_seconds: float = 0.0
    ) -> LoadedVersion:
        """A version of several tables, each from its splits (in split order)."""
        children = {t: cls(name, splits, load_seconds) for t, splits in tables.items()}
        first = next(iter(children.values()))
        return cls(name, first.splits, load_seconds, tables=children)

    def table(self, name: str) -> LoadedVersion | None:
        """The version a lookup of table `name` reads ("" for a version of one unnamed
        table: itself); None when this version has no such table."""
        if not self.tables:
            return None if name else self
        return self.tables.get(name)

    @property
    def chain(self) -> list[str]:
        return self.splits[0].chain

    @property
    def fds(self) -> list[int]:
        """Descriptors of every mapped file (kept open when the files are watched)."""
        return [fd for s in self.all_splits for h in s.handles for fd in h.fds]

    def acquire(self) -> LoadedVersion:
        if self.owner is not None:
            self.owner.acquire()
            return self
        self.inflight += 1
        return self

    def release(self) -> None:
        if self.owner is not None:
            self.owner.release()
            return
        self.inflight -= 1
        if self.retired and self.inflight == 0:
            self._close()

    def retire(self) -> None:
        if self.owner is not None:
            self.owner.retire()
            return
        self.retired = True
        if self.inflight == 0:
            self._close()

    def fail(self, reason: str) -> None:
        """Never read this version again and unmap it now, whoever still holds it (requests
        that do get an error): its files are being changed by another process."""
        if self.owner is not None:
            self.owner.fail(reason)
            return
        self.broken = reason
        for table in self.tables.values():
            table.broken = reason
        self.retired = True
        self._close()

    def _close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.kernel_cache.clear()  # its array views would keep the mappings alive
        for table in self.tables.values():
            table.closed = True
            table.kernel_cache.clear()
        for split in self.all_splits:
            for handle in split.handles:
                handle.release()
        log.info("version %s unmapped", self.name)

    def describe(self) -> dict[str, Any]:
        splits = [s.describe() for s in self.all_splits]
        routing = self.routing
        described = {
            "version": self.name,
            "chain": self.chain,
            "value_width": self.value_width,
            "record_count": sum(s["record_count"] for s in splits),
            "data_bytes": sum(s["data_bytes"] for s in splits),
            "load_seconds": round(self.load_seconds, 3),
            "mapped_bytes": sum(s["mapped_bytes"] for s in splits),
            "locked_bytes": sum(s["locked_bytes"] for s in splits),
            "pmd_mapped_bytes": sum(s["pmd_mapped_bytes"] for s in splits),
            "loaded_at": self.loaded_at,
            "routing": routing.describe() if routing else None,
            "splits": [s.describe() for s in self.splits],
            "memory_note": self.memory_note,
        }
        caches = [  # PagedGather's (cube.server.hot) while it is served paged
            gather.cache.describe()
            for part in [self, *self.tables.values()]
            for gather in part.kernel_cache.get("gatherers", ())
            if getattr(gather, "cache", None) is not None
        ]
        if caches:
            described["hot_cache"] = {k: sum(c[k] for c in caches) for k in caches[0]}
        if self.tables:
            described["value_width"] = None  # each table has its own
            described["tables"] = {
                name: {
                    "value_width": table.value_width,
                    "record_count": sum(s.describe()["record_count"] for s in table.splits),
                    "splits": [s.describe() for s in table.splits],
                }
                for name, table in self.tables.items()
            }
        return described


# ---------------------------------------------------------------------------------------------
# loading (runs in a loader thread)


@dataclass(frozen=True)
class LoadOptions:
    verify: bool = True
    populate: bool = False  # --in_mem: fault every page in at load
    lock_memory: bool = False  # --in_mem: mlock, best effort
    huge_pages: bool = False  # --huge_pages: 2 MiB mappings where the kernel has them
    delay: float = 0.0  # --load_delay (tests: makes a load last long enough to race it)
    watch: FileWatch | None = None  # leases / polls the mapped files (cube.server.guard)
    dict_name: str = ""  # --dict_name: a version of another dict is refused
    shard: int = -1  # --shard: a version of another shard is refused
    random_access: bool = False  # larger than memory: faulted 4 KiB at a time (Shard.open)
    pin_index: bool = False  # larger than memory but its index fits: the index pinned alone
    hot_cache_bytes: int = -1  # --hot_cache_mb for a version served paged, -1: a share
    workers: int = 1  # --workers: an automatic hot cache is shared out among them


def _open_layer(directory: Path, options: LoadOptions) -> ShardHandle:
    watch = options.watch
    opened: list[int] = []

    def on_open(fd: int, path: Path) -> None:
        assert watch is not None
        watch.on_open(fd, path)
        opened.append(fd)

    def cancelled() -> bool:
        return bool(watch is not None and watch.changed(opened))

    try:
        shard = Shard.open(
            directory,
            verify=options.verify,
            populate=options.populate,
            huge_pages=options.huge_pages,
            on_open=on_open if watch is not None else None,
            cancelled=cancelled if watch is not None else None,
            random_access=options.random_access,
            populate_index=options.pin_index,
        )
        changed = cancelled() and watch.changed(opened)  # type: ignore[union-attr]
        if changed:
            watch.forget(opened)  # type: ignore[union-attr]
            shard.close()
            raise VersionError("DATA_LOSS", f"refused {directory}: {changed} during the load")
    except VersionError:
        raise
    except BaseException as exc:
        reason = watch.changed(opened) if watch is not None else ""
        if watch is not None:
            watch.forget(opened)  # Shard.open closed what it had opened
        if isinstance(exc, VerifyCancelled):
            message = f"refused {directory}: {reason} during the load"
            raise VersionError("DATA_LOSS", message) from exc
        if isinstance(exc, ShardFormatError):
            raise VersionError("DATA_LOSS", f"refused {directory}: {exc}") from exc
        if isinstance(exc, OSError):
            raise VersionError("NOT_FOUND", f"cannot open {directory}: {exc}") from exc
        raise
    handle = ShardHandle(shard, watch)
    if options.lock_memory or options.pin_index:
        handle.locked_bytes = lock_in_memory(shard, index_only=not options.lock_memory)
    if options.huge_pages and handle.mapped_bytes >= PMD_MEASURED_BYTES:
        handle.pmd_mapped_bytes = shard.pmd_mapped_bytes()
    return handle


# Layers this large have their huge-page share measured at load (`Shard.pmd_mapped_bytes`):
# it walks every mapping of the process, the base below a patch too (2.1 s of a 1M-key patch's
# load onto a 300M-key base), and a patch's few MiB gain little from huge pages.
PMD_MEASURED_BYTES = 256 << 20


def _layer_routing(
    handles: list[ShardHandle], directory: Path, options: LoadOptions
) -> ShardRouting | None:
    """The routing every layer of a chain agrees on, checked against --dict_name/--shard."""
    routings = {ShardRouting.from_meta(h.shard.meta) for h in handles}
    routings.discard(None)
    if len(routings) > 1:
        listing = "; ".join(
            f"{h.shard.directory.name}: {r.describe() if r else 'unknown'}"
            for h in handles
            for r in [ShardRouting.from_meta(h.shard.meta)]
        )
        raise VersionError(
            "FAILED_PRECONDITION",
            f"{directory}: the layers of this chain were built for different shards ({listing});"
            " every delta must be built with its base's dict, shard count and partitioner",
        )
    routing = routings.pop() if routings else None
    if routing is not None:
        if options.dict_name and routing.dict_name and routing.dict_name != options.dict_name:
            raise VersionError(
                "FAILED_PRECONDITION",
                f"{directory} holds {routing.describe()}, but this server is --dict_name"
                f" {options.dict_name!r}",
            )
        if options.shard >= 0 and routing.shard != options.shard:
            raise VersionError(
                "FAILED_PRECONDITION",
                f"{directory} holds {routing.describe()}, but this server is --shard"
                f" {options.shard}",
            )
    return routing


def _build_split(
    directory: Path,
    chain: list[str],
    reuse: list[ShardHandle],
    options: LoadOptions,
    table: str = "",
) -> SplitData:
    """Open the layers of `chain` after the `reuse`d ones (already mapped by another version);
    `table`: the table's folder in each layer ("" for a version of one unnamed table)."""
    handles = [h.acquire() for h in reuse]
    try:
        for link in chain[len(reuse) :]:
            handles.append(_open_layer(directory / link / table, options))
        widths = {h.shard.value_width for h in handles if h.shard.record_count}
        if len(widths) > 1:
            log.info("%s: layers of widths %s served as variable width", directory, widths)
        routing = _layer_routing(handles, directory / chain[-1] / table, options)
        stack = ShardStack([h.shard for h in handles])
    except BaseException:
        for handle in handles:
            handle.release()
        raise
    return SplitData(directory / chain[-1] / table, chain, handles, stack, routing)


def _require_dir(split_dir: Path, name: str) -> None:
    if not (split_dir / name).is_dir():
        raise VersionError("NOT_FOUND", f"version directory {split_dir / name} does not exist")


def load_base(dirs: list[Path], name: str, options: LoadOptions) -> LoadedVersion:
    """Load `name` from disk alone (a delta brings its whole chain: base + deltas)."""
    started = time.monotonic()
    time.sleep(options.delay)
    chains = []
    for split_dir in dirs:
        _require_dir(split_dir, name)
        chain = resolve_chain(split_dir, name)
        chains.append((split_dir, chain, chain_tables(split_dir, chain)))
    tables = _same_tables(chains)
    built: dict[str, list[SplitData]] = {table: [] for table in tables or [""]}
    layers = [(split_dir, link) for split_dir, chain, _ in chains for link in chain]
    options, note = _pinning(options, name, layers, list(built))
    try:
        for split_dir, chain, _ in chains:
            for table, splits in built.items():
                splits.append(_build_split(split_dir, chain, [], options, table))
    except BaseException:
        _release_all([s for splits in built.values() for s in splits])
        raise
    return _loaded(name, built, started, note, options.hot_cache_bytes)


def _pinning(
    options: LoadOptions, name: str, layers: list[tuple[Path, str]], tables: list[str]
) -> tuple[LoadOptions, str]:
    """The options to load `layers` (split dir, version) with: --in_mem's populate and mlock
    unless the files would not fit the memory this server may pin (cube.server.memory); then
    the version is mapped for random access (Shard.open), its index alone pinned when that
    fits, said once in the log and in the version's status."""
    if not (options.populate or options.lock_memory):
        return options, ""
    directories = [d / link / t for d, link in layers for t in tables]
    limit, source = memory.memory_limit()
    held = memory.locked_bytes()
    files = [d / name for d in directories for name in _SHARD_FILES]
    note = memory.in_mem_refusal(memory.files_bytes(files), held, limit, source)
    if not note:
        return options, ""
    index_bytes = memory.files_bytes([d / _SHARD_FILES[0] for d in directories])
    pin_index = not memory.in_mem_refusal(index_bytes, held, limit, source)
    note += "; its index pinned alone" if pin_index else "; its index does not fit either"
    hot = options.hot_cache_bytes
    if hot < 0:
        pinned = held + (index_bytes if pin_index else 0)
        hot = memory.hot_cache_budget(limit, options.workers, pinned)
    note += f"; a hot cache of {hot >> 20} MiB a worker in front of it" if hot else "; no hot cache"
    log.warning("version %s: %s", name, note)
    fallback = replace(options, populate=False, lock_memory=False, huge_pages=False)
    return replace(fallback, random_access=True, pin_index=pin_index, hot_cache_bytes=hot), note


def settle_memory(current: LoadedVersion | None, background: LoadedVersion | None) -> bool:
    """--in_mem after a switch that could not hold two versions: the current version, loaded
    unpinned for want of room beside the one it replaced (`memory_note`), is pinned once it
    fits, the background version (kept to roll back to) giving its pinned pages back first
    (munlock: they stay in the page cache while memory allows). Runs in the loader thread
    after the slots change; mlock faults the pages in while the version serves. Whether the
    current version is pinned now."""
    if current is None or not current.memory_note or current.closed:
        return False
    mine = {id(h): h for s in current.all_splits for h in s.handles}
    if background is not None and not background.closed:
        for split in background.all_splits:
            for handle in split.handles:
                if id(handle) not in mine and handle.locked_bytes:
                    handle.locked_bytes -= unlock_memory(handle.shard)
    unpinned = sum(h.mapped_bytes - h.locked_bytes for h in mine.values())
    limit, source = memory.memory_limit()
    if memory.in_mem_refusal(unpinned, memory.locked_bytes(), limit, source):
        return False
    for handle in mine.values():
        if handle.locked_bytes < handle.mapped_bytes:
            handle.locked_bytes = lock_in_memory(handle.shard)
    current.memory_note = ""
    for part in [current, *current.tables.values()]:  # served from memory now: no hot cache
        part.hot_cache_bytes = 0
        part.kernel_cache.clear()  # (requests in flight keep the gatherers they hold)
    log.info("version %s pinned in memory now (%d bytes more): it fits", current.name, unpinned)
    return True


def _same_tables(chains: list[tuple[Path, list[str], list[str]]]) -> list[str]:
    """The tables every split holds (they must agree: a version's shard tar is one build)."""
    tables = chains[0][2]
    for split_dir, chain, theirs in chains[1:]:
        if theirs != tables:
            raise VersionError(
                "FAILED_PRECONDITION",
                f"{split_dir / chain[-1]} holds tables {theirs or ['(one unnamed)']} but"
                f" {chains[0][0] / chains[0][1][-1]} holds {tables or ['(one unnamed)']}",
            )
    return tables


def _loaded(
    name: str,
    built: dict[str, list[SplitData]],
    started: float,
    note: str = "",
    hot_cache_bytes: int = 0,
) -> LoadedVersion:
    """The LoadedVersion of splits opened per table (the key "" alone: one unnamed table);
    `note` says why it is served paged, with a hot cache of `hot_cache_bytes` then."""
    seconds = time.monotonic() - started
    if list(built) == [""]:
        version = LoadedVersion(name, built[""], seconds)
    else:
        version = LoadedVersion.with_tables(name, built, seconds)
    version.memory_note = note
    if note:
        for part in [version, *version.tables.values()]:
            part.hot_cache_bytes = max(0, hot_cache_bytes) // max(1, len(version.tables))
    return version


def flat_layout(dirs: list[Path]) -> bool:
    """The original's local mode: no VERSION, and `index.cube` + `data.cube` directly in every
    split directory (a shard's files copied into ./data, which the original serves as is)."""
    return all(
        not (d / VERSION_FILE).exists() and all((d / f).is_file() for f in _SHARD_FILES)
        for d in dirs
    )


def load_flat(dirs: list[Path], options: LoadOptions) -> LoadedVersion:
    """Serve the shard files of a `flat_layout` data dir as the version their headers name. A
    delta's files alone are refused: without its base they would answer misses for its keys."""
    started = time.monotonic()
    splits: list[SplitData] = []
    names: set[str] = set()
    try:
        for split_dir in dirs:
            handle = _open_layer(split_dir, options)
            try:  # until the split holds it, the handle is released here
                meta = handle.shard.meta
                name = str(meta.get("version") or "")
                if meta.get("mode") == "delta" or is_delta(name):
                    raise VersionError(
                        "FAILED_PRECONDITION",
                        f"{split_dir} holds the files of delta {name!r}; a delta needs its"
                        f" base: {LAYOUT_HINT}",
                    )
                routing = _layer_routing([handle], split_dir, options)
                split = SplitData(split_dir, [name], [handle], ShardStack([handle.shard]), routing)
            except BaseException:
                handle.release()
                raise
            names.add(name)
            splits.append(split)
        if len(names) != 1 or not next(iter(names)):
            raise VersionError(
                "FAILED_PRECONDITION",
                f"the shard files in {', '.join(map(str, dirs))} name versions {sorted(names)}",
            )
    except BaseException:
        _release_all(splits)
        raise
    return LoadedVersion(names.pop(), splits, time.monotonic() - started)


def load_patch(
    dirs: list[Path], name: str, on: LoadedVersion | None, options: LoadOptions
) -> LoadedVersion:
    """Layer delta `name` over the version `on` serves now, reusing its mapped shards. The
    result's chain is the CHAIN file when there is one (which must extend `on`'s chain; the
    deltas `on` lacks are opened too), else `on`'s chain + `name`, then recorded in CHAIN.
    A version of several tables layers each table over the same table of `on`."""
    if not is_delta(name):
        raise VersionError(
            "INVALID_ARGUMENT", f"{name!r} is not a delta name (<base>_<version>); use bg_load_base"
        )
    if on is None:
        raise VersionError(
            "FAILED_PRECONDITION", f"no current version to apply patch {name!r} to; load a base"
        )
    if base_of(name) != on.chain[0]:
        raise VersionError(
            "FAILED_PRECONDITION",
            f"patch {name!r} is on base {base_of(name)!r} but the current version"
            f" {on.name!r} is on base {on.chain[0]!r}",
        )
    started = time.monotonic()
    time.sleep(options.delay)
    current_tables = on.tables or {"": on}
    built: dict[str, list[SplitData]] = {table: [] for table in current_tables}
    unrecorded = []
    chains = [
        _patch_chain(d, name, on, current) for d, current in zip(dirs, on.splits, strict=True)
    ]
    added = [
        (d, link) for d, (c, _) in zip(dirs, chains, strict=True) for link in c[len(on.chain) :]
    ]
    options, note = _pinning(options, name, added, list(built))
    try:
        for i, (split_dir, (chain, recorded)) in enumerate(zip(dirs, chains, strict=True)):
            tables = chain_tables(split_dir, chain)
            if (tables or [""]) != list(current_tables):
                raise VersionError(
                    "FAILED_PRECONDITION",
                    f"patch {name!r} holds tables {tables or ['(one unnamed)']} but"
                    f" {on.name!r} holds {list(on.tables) or ['(one unnamed)']}; load it"
                    " with bg_load_base",
                )
            for table, splits in built.items():
                reuse = current_tables[table].splits[i].handles
                splits.append(_build_split(split_dir, chain, reuse, options, table))
            if not recorded:
                unrecorded.append((split_dir, chain))
        for split_dir, chain in unrecorded:
            write_chain(split_dir, name, chain)
    except BaseException:
        _release_all([s for splits in built.values() for s in splits])
        raise
    return _loaded(name, built, started, note, options.hot_cache_bytes)


def _patch_chain(
    split_dir: Path, name: str, on: LoadedVersion, current: SplitData
) -> tuple[list[str], bool]:
    """The chain patch `name` makes over `current` (one split of `on`), and whether its
    CHAIN file records it."""
    _require_dir(split_dir, name)
    if name in current.chain:
        raise VersionError(
            "FAILED_PRECONDITION",
            f"patch {name!r} is already applied in {on.name!r} ({' > '.join(on.chain)})",
        )
    recorded = read_chain(split_dir, name)
    chain = recorded if recorded is not None else [*current.chain, name]
    if chain[: len(current.chain)] != current.chain:
        raise VersionError(
            "FAILED_PRECONDITION",
            f"{split_dir / name / CHAIN_FILE} lists {' > '.join(chain)}, which does not"
            f" extend the current {' > '.join(current.chain)}; load it with bg_load_base",
        )
    for link in chain[len(current.chain) :]:
        _require_dir(split_dir, link)
    return chain, recorded is not None


def _release_all(splits: list[SplitData]) -> None:
    for split in splits:
        for handle in split.handles:
            handle.release()


# ---------------------------------------------------------------------------------------------
# slots (event loop thread only)


class VersionSlots:
    """current (serving), background (loaded, ready to switch to; after a switch it is the
    previous version, kept until bg_unload so the switch can be undone) and staged (loaded by
    the first phase of a multi-worker load, not yet visible).

    Serving state: the replica serves when it has a current version, or, with `allow_empty`
    (`--allow_empty`), when it holds nothing by design, and when nothing it needs to answer at
    its normal latency is still on its way (`not_ready`: the compiled lookup kernel loading).
    A replica that was meant to serve a version and cannot (its start-up load failed, its
    files changed under it) records why in `problem` and does not serve, empty or not, until
    a version is current again. Listeners hear every change (health status)."""

    def __init__(self, allow_empty: bool = False) -> None:
        self.current: LoadedVersion | None = None
        self.background: LoadedVersion | None = None
        self.staged: LoadedVersion | None = None
        self.background_was_current = False
        self.allow_empty = allow_empty
        self.problem = ""
        self.idle_reason = "no version has been loaded yet"
        self.not_ready = ""  # why it cannot answer fast yet, though it may hold a version
        self.listeners: list[Callable[[], None]] = []

    @property
    def serving(self) -> bool:
        holds = self.current is not None or (self.allow_empty and not self.problem)
        return holds and not self.not_ready

    def why_not_serving(self) -> str:
        if self.current is None and (self.problem or not self.allow_empty):
            return self.problem or self.idle_reason
        return self.not_ready

    def set_not_ready(self, reason: str) -> None:
        """Not serving until `set_not_ready("")`, for `reason` (health follows)."""
        self.not_ready = reason
        for listener in self.listeners:
            listener()

    def get(self, name: str) -> LoadedVersion | None:
        """The version a request asks for: "" = current; else current or background by name."""
        current = self.current
        if not name or (current is not None and current.name == name):
            return current
        background = self.background
        if background is not None and background.name == name:
            return background
        return None

    def stage(self, version: LoadedVersion) -> None:
        self.abort()
        self.staged = version

    def commit(self) -> None:
        """The staged version becomes the background one (the old background is dropped)."""
        if self.staged is None:
            raise VersionError("FAILED_PRECONDITION", "nothing staged to commit")
        old, self.background = self.background, self.staged
        self.staged = None
        self.background_was_current = False
        if old is not None:
            old.retire()

    def abort(self) -> None:
        staged, self.staged = self.staged, None
        if staged is not None:
            staged.retire()

    def switch(self) -> None:
        if self.background is None:
            raise VersionError("FAILED_PRECONDITION", "no background version to switch to")
        self.current, self.background = self.background, self.current
        self.background_was_current = self.background is not None
        self._changed()

    def unload_background(self) -> None:
        old, self.background = self.background, None
        self.background_was_current = False
        if old is not None:
            old.retire()

    def install(self, version: LoadedVersion) -> None:
        """Serve `version` now (start-up)."""
        old, self.current = self.current, version
        if old is not None:
            old.retire()
        self._changed()

    def fail_startup(self, reason: str) -> None:
        """The version this replica was meant to serve at start could not be loaded."""
        self.problem = reason
        self._changed()

    def drop_changed(self, fds: set[int], reason_of: Callable[[LoadedVersion], str]) -> list[str]:
        """Stop using every version that maps one of `fds` (files changed under the server):
        unmap it now and leave its slot empty. Returns what was dropped, for the log."""
        dropped = []
        for slot in ("current", "background", "staged"):
            version: LoadedVersion | None = getattr(self, slot)
            if version is None or not fds.intersection(version.fds):
                continue
            reason = reason_of(version)
            setattr(self, slot, None)
            if slot == "current":
                self.problem = f"version {version.name} was dropped: {reason}"
            elif slot == "background":
                self.background_was_current = False
            version.fail(reason)
            dropped.append(f"{slot} version {version.name}: {reason}")
        if dropped:
            self._changed()
        return dropped

    def _changed(self) -> None:
        if self.current is not None:
            self.problem = ""
        for listener in self.listeners:
            listener()

    def close(self) -> None:
        for version in (self.current, self.background, self.staged):
            if version is not None:
                version.retire()
        self.current = self.background = self.staged = None
