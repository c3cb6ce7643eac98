"""The builder's inputs wherever they are: a local path, or `s3://bucket/prefix` and
`webhdfs://namenode:port/path` through fsspec, `hdfs://` and `afs://` through the Hadoop client
(cube/remote.py). The one place the builder side lists and fetches inputs: cube-builder
(-input_path, -delete_path), the Spark build and the transfer's mirrors of remote inputs use
it. Through the Hadoop client, a listing is one run (`-ls -R`) and a fetch one run for all
the files (`-get`; more when names repeat in sub-directories): a JVM starts for each.

A remote input is listed as a local one is (`builder.build.list_input_files`): every regular,
non-empty file under the path, recursively, no name starting with "." at any level, sorted by
path components compared as bytes (depth first); the same files fetched under a local
directory with their relative paths are listed there in the same order (`fetch_inputs`).
Errors are BuildError naming the URL and a short reason of our own (never what a server sent,
never a credential). Every remote step has a timeout of wall time (a listing included: the
caller's, e.g. -fetch_timeout, bounds the listing and the fetch together), cube.remote.call.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from cube import remote
from cube.builder.build import BuildError, list_input_files, parse_delete_keys, read_delete_keys

FETCH_TIMEOUT = 3600.0  # seconds for one file
IO_TIMEOUT = 60.0  # one connect or one stalled read
LIST_TIMEOUT = 600.0


@dataclass(frozen=True)
class InputFile:
    url: str  # a local path, or the file's URL
    size: int


def _local(path: str) -> str:
    return urlsplit(path).path if path.startswith("file://") else path


def _open(url: str, timeout: float) -> tuple[Any, str]:
    try:
        return remote.open_fs(url, min(IO_TIMEOUT, timeout))
    except remote.RemoteError as exc:
        raise BuildError(f"{remote.redact(url)}: {exc}") from None


def _left(deadline: float, url: str, timeout: float) -> float:
    """Seconds left before `deadline`; BuildError naming `url` when none are."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise BuildError(f"{remote.redact(url)}: not fetched within {timeout:g} s")
    return left


def list_inputs(
    path: str, timeout: float = LIST_TIMEOUT, include_empty: bool = False
) -> list[InputFile]:
    """Every regular, non-empty, non-hidden file under `path` (or `path` itself when it is a
    file), in the order the builder reads them; empty files too with `include_empty`.
    BuildError when `path` does not exist or cannot be listed within `timeout` seconds."""
    if not remote.is_remote(path):
        files = list_input_files(_local(path), include_empty)
        return [InputFile(str(file), file.stat().st_size) for file in files]
    fs, root = _open(path, timeout)
    return _list_remote(fs, root, path, time.monotonic() + timeout, include_empty)


def _list_remote(
    fs: Any, root: str, path: str, deadline: float, include_empty: bool = False
) -> list[InputFile]:
    base = path.rstrip("/")
    try:
        if getattr(fs, "bounded", False):  # the Hadoop client: one run (-ls -R), not two
            found = remote.find_files(fs, root, max(deadline - time.monotonic(), 0.001))
            if root in found:  # the path is a file: the listing names it alone
                return [InputFile(base, found[root])] if found[root] or include_empty else []
            return _under(root, base, found, include_empty)
        info = remote.call(fs, "info", root, timeout=max(deadline - time.monotonic(), 0.001))
        if info.get("type") != "directory":
            size = int(info.get("size") or 0)
            return [InputFile(base, size)] if size or include_empty else []
        found = remote.find_files(fs, root, max(deadline - time.monotonic(), 0.001))
    except remote.RemoteError as exc:
        raise BuildError(f"{remote.redact(path)}: {exc}") from None
    return _under(root, base, found, include_empty)


def _under(root: str, base: str, found: dict[str, int], include_empty: bool) -> list[InputFile]:
    """The input files of a listing of the directory `root` (its URL: `base`), in order."""
    prefix = root.rstrip("/") + "/"
    keyed = []
    for name, size in found.items():
        if not name.startswith(prefix) or not (size or include_empty):
            continue  # outside the directory (fsspec should not list it), or empty
        relative = name[len(prefix) :]
        parts = relative.split("/")
        if any(not part or part.startswith(".") for part in parts):
            continue  # hidden at some level (or a marker object ending in '/')
        keyed.append((tuple(os.fsencode(part) for part in parts), relative, size))
    keyed.sort(key=lambda item: item[0])  # as list_input_files: components as bytes
    return [InputFile(f"{base}/{relative}", size) for _key, relative, size in keyed]


def relative_name(root: str, url: str) -> str:
    """The path of `url` under the input `root` (its base name when `url` is the root)."""
    base = root.rstrip("/")
    if url == base:
        return base.rsplit("/", 1)[-1]
    if not url.startswith(base + "/"):
        raise BuildError(f"{remote.redact(url)} is not under {remote.redact(root)}")
    return url[len(base) + 1 :]


def fetch_input(url: str, dest: Path, timeout: float = FETCH_TIMEOUT, fs: Any = None) -> Path:
    """Copy the remote file `url` to `dest` (a temp file beside it, renamed when complete, so
    `dest` is whole or absent), within `timeout` seconds. BuildError naming the URL. `fs`:
    a filesystem of the same bucket or namenode to reuse (cube.remote.open_fs)."""
    tmp = dest.with_name(f".{dest.name}.part-{os.getpid()}")
    deadline = time.monotonic() + timeout
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        reader = remote.Reader(url, min(IO_TIMEOUT, timeout), fs=fs, deadline=deadline)
        with reader, open(tmp, "wb") as out:
            for block in reader.blocks(0):
                out.write(block)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, dest)
    except remote.RemoteError as exc:
        raise BuildError(f"{remote.redact(url)}: {exc}") from None
    except OSError as exc:
        raise BuildError(f"{remote.redact(url)}: cannot write {dest}: {exc.strerror}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def fetch_inputs(
    path: str,
    dest: Path,
    timeout: float = FETCH_TIMEOUT,
    allow_empty: bool = False,
    include_empty: bool = False,
) -> list[Path]:
    """Fetch every input file of the remote `path` (list_inputs) to the same relative path
    under the directory `dest`, so that building from `dest` reads the same files in the same
    order; all within `timeout` seconds, the listing included. Returns the local files.
    BuildError when there is no input file at all, unless `allow_empty` (then `dest` is an
    empty directory). `include_empty`: empty files too (a parameter-server save's empty
    shards: its layout is told by its file names)."""
    deadline = time.monotonic() + timeout
    fs, root = _open(path, timeout)  # one client for the listing and every file
    files = _list_remote(fs, root, path, deadline, include_empty)
    if not files and allow_empty:
        dest.mkdir(parents=True, exist_ok=True)
    elif not files:
        raise BuildError(f"{remote.redact(path)}: no input files (only empty or hidden ones)")
    if hasattr(fs, "get_files"):  # the Hadoop client: one run for many files, not one each
        batch = [(remote.path_of(f.url), dest / relative_name(path, f.url), f.size) for f in files]
        try:
            remote.call(fs, "get_files", batch, timeout=_left(deadline, path, timeout))
        except remote.RemoteError as exc:
            raise BuildError(f"{remote.redact(path)}: {exc}") from None
        return [local for _remote, local, _size in batch]
    local = []
    for file in files:
        left = _left(deadline, path, timeout)
        local.append(fetch_input(file.url, dest / relative_name(path, file.url), left, fs))
    return local


def read_bytes(url: str, limit: int, timeout: float = FETCH_TIMEOUT) -> bytes:
    """The content of a small remote file, within `timeout` seconds; BuildError when it holds
    more than `limit` bytes."""
    try:
        return remote.read_bytes(url, limit, timeout, min(IO_TIMEOUT, timeout))
    except remote.RemoteError as exc:
        raise BuildError(f"{remote.redact(url)}: {exc}") from None


def read_delete_list(path: str, limit: int, timeout: float = FETCH_TIMEOUT) -> np.ndarray:
    """Every key a delete list holds (a file or a directory of files, local or remote; see
    `parse_delete_keys`), listed and read within `timeout` seconds; a remote file over
    `limit` bytes is a BuildError."""
    if not remote.is_remote(path):
        return read_delete_keys(path)
    deadline = time.monotonic() + timeout
    chunks = [
        parse_delete_keys(read_bytes(f.url, limit, _left(deadline, path, timeout)), f.url)
        for f in list_inputs(path, timeout)
    ]
    return np.concatenate(chunks) if chunks else np.empty(0, np.uint64)
