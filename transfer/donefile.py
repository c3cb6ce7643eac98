"""Donefiles for cube-transfer: where they and their inputs come from (the line format itself
is cube.donefile). Fetching the text (a local directory, `http(s)://`, `ftp://`, `s3://`,
`webhdfs://`, `hdfs://` or `afs://`) and mirroring an input directory use fsspec, or the Hadoop
client for hdfs:// and afs:// (run without a shell). Object stores, WebHDFS and the Hadoop
client go through cube.remote (lazy s3fs, timeouts, messages of our own) and, for inputs,
through the builder's own lister (cube.builder.sources), so a mirror holds exactly the files,
in the order, that the builder would read there.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from cube import remote
from cube.remote import redact

# redact: one rule for URLs in messages, also the API's (views)


def short_error(exc: BaseException, limit: int = 200) -> str:
    """An exception from a remote source as `Type: text`, the text cut to `limit` characters
    (it may quote what a server sent, e.g. a reason phrase)."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


URL_SCHEMES = ("http", "https", "ftp", "file", *remote.SCHEMES)
DONEFILE_LIMIT = 64 << 20  # bytes of a donefile read from an object store or (Web)HDFS


def is_url(address: str) -> bool:
    return urlsplit(address).scheme in URL_SCHEMES


def address_problem(address: str) -> str | None:
    """Why a donefile address (or upload address) URL cannot be used, None when it can: an
    unknown scheme, an s3:// URL without a bucket, a password in the URL, ..."""
    scheme = remote.scheme_of(address)
    if scheme in ("", "file"):
        return None
    if scheme not in URL_SCHEMES:
        kinds = "a directory, file://, http(s)://, ftp://, s3://, webhdfs://, hdfs:// or afs://"
        return f"unsupported scheme {scheme!r} ({kinds})"
    if scheme in remote.SCHEMES:
        return remote.check_url(address)
    return None


def resolve_input(donefile_address: str, source: str) -> str:
    """Where an entry's input lives: a URL stays as it is; a path is local when the donefile is
    local (relative paths relative to the donefile directory), and on the donefile's server
    (same scheme, host and port) when the donefile is a URL, as the original resolved it."""
    if is_url(source):
        return source
    if not is_url(donefile_address):
        path = Path(source)
        return str(path if path.is_absolute() else (Path(donefile_address) / path))
    parts = urlsplit(donefile_address)
    if parts.scheme == "file":
        path = Path(source)
        return str(path if path.is_absolute() else (Path(parts.path) / path))
    url_path = source if source.startswith("/") else parts.path.rstrip("/") + "/" + source
    return urlunsplit((parts.scheme, parts.netloc, url_path, "", ""))


class SourceUnavailable(Exception):
    """A donefile or input that could not be read this time (the message says why)."""


def local_donefile_dir(address: str) -> Path | None:
    """The directory a local donefile address names (a path, or a file:// URL); None for a
    remote one."""
    if not is_url(address):
        return Path(address)
    parts = urlsplit(address)
    return Path(parts.path) if parts.scheme == "file" else None


def donefile_urls(address: str, names: list[str]) -> list[str]:
    """Where each donefile `names` is read, as the log may show it (credentials hidden)."""
    local = local_donefile_dir(address)
    if local is not None:
        return [str(local / name) for name in names]
    return [redact(address.rstrip("/") + "/" + name) for name in names]


def ensure_donefile_dir(address: str, create: bool) -> bool:
    """Check that a local donefile address names an existing directory (a typo would
    otherwise be watched, empty, forever); with `create`, make it (and its parents) when
    missing. True when it was created now. SourceUnavailable names the directory and what is
    wrong. A remote address is not checked (its first read says)."""
    directory = local_donefile_dir(address)
    if directory is None or directory.is_dir():
        return False
    if os.path.lexists(directory):
        raise SourceUnavailable(f"donefile directory {directory}: not a directory")
    if not create:
        raise SourceUnavailable(f"donefile directory {directory}: no such directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SourceUnavailable(
            f"donefile directory {directory}: cannot create it: {exc.strerror}"
        ) from None
    return True


async def read_donefile(address: str, name: str, timeout: float = 30.0) -> str:
    """The text of `<address>/<name>`; '' when it does not exist yet. A local donefile
    directory that is gone (its volume unmounted, the directory moved) is SourceUnavailable,
    not a file not written yet: the transfer checked it at start (ensure_donefile_dir)."""
    if not is_url(address) or urlsplit(address).scheme == "file":
        base = Path(urlsplit(address).path if is_url(address) else address)
        try:
            data = await asyncio.to_thread((base / name).read_bytes)
        except FileNotFoundError:
            if not await asyncio.to_thread(base.is_dir):
                raise SourceUnavailable(f"donefile directory {base}: no such directory") from None
            return ""
        except OSError as exc:
            raise SourceUnavailable(f"{base / name}: {exc.strerror}") from exc
        return data.decode("utf-8", errors="replace")
    url = address.rstrip("/") + "/" + name
    if remote.is_remote(url) and urlsplit(url).scheme not in ("http", "https", "ftp"):
        return await _read_remote(url, timeout)
    try:
        data = await asyncio.wait_for(asyncio.to_thread(_cat_url, url), timeout)
    except FileNotFoundError:
        return ""
    except (TimeoutError, OSError, ValueError, RuntimeError) as exc:
        raise SourceUnavailable(f"{url}: {short_error(exc)}") from exc
    return data.decode("utf-8", errors="replace")


async def _read_remote(url: str, timeout: float) -> str:
    """A donefile in an object store or on (Web)HDFS: '' when the file does not exist."""
    read = asyncio.to_thread(remote.read_bytes, url, DONEFILE_LIMIT, timeout, min(timeout, 30.0))
    try:  # read_bytes bounds itself; wait_for too, as the other branch, whatever a client does
        data = await asyncio.wait_for(read, timeout + 1.0)
    except TimeoutError:
        raise SourceUnavailable(f"{redact(url)}: timed out") from None
    except remote.RemoteError as exc:
        if exc.missing:
            return ""
        raise SourceUnavailable(f"{redact(url)}: {exc}") from None
    return data.decode("utf-8", errors="replace")


def _filesystem(url: str) -> tuple[Any, str]:
    """An fsspec filesystem for `url` and the path to use with it (a fresh instance: nothing
    cached between polls)."""
    from fsspec.core import url_to_fs  # imported lazily: only remote donefiles need it

    found: tuple[Any, str] = url_to_fs(url, skip_instance_cache=True)
    return found


def _cat_url(url: str) -> bytes:
    fs, path = _filesystem(url)
    data: bytes = fs.cat_file(path)
    return data


def mirror_input(
    source: str, dest: Path, timeout: float = 3600.0, include_empty: bool = False
) -> list[str]:
    """Copy the files of the input directory `source` (a URL) into `dest` (replaced), through
    fsspec. HTTP directory index pages and FTP listings: the files of the directory itself,
    sub-directories and hidden files skipped. s3://, webhdfs://, hdfs://, afs://: every file
    the builder would read there (recursively, same rules), at the same relative paths, within
    `timeout` seconds; empty files too with `include_empty` (a parameter-server save's empty
    shards: its layout is told by its file names). Returns the file names (relative paths).
    Blocking: run in a thread."""
    if urlsplit(source).scheme not in ("http", "https", "ftp"):
        return _mirror_remote(source, dest, timeout, include_empty)
    fs, base = _filesystem(source.rstrip("/"))
    base = base.rstrip("/")
    try:
        listing = fs.ls(base + "/" if "://" in base else base, detail=True)
    except FileNotFoundError as exc:
        raise SourceUnavailable(f"input {source}: not found") from exc
    except (OSError, ValueError, RuntimeError) as exc:
        raise SourceUnavailable(f"input {source}: cannot list: {short_error(exc)}") from exc
    files: dict[str, str] = {}
    for item in listing:
        full = str(item["name"])
        name = full.rstrip("/").rsplit("/", 1)[-1]
        if item.get("type") == "directory" or full.endswith("/"):
            continue
        if not name or name.startswith(".") or name in ("index.html", "index.htm"):
            continue
        if not full.startswith(base + "/"):
            continue  # a link out of the directory (parent, elsewhere)
        files[name] = full
    if not files:
        raise SourceUnavailable(f"input {source}: no files")
    tmp = dest.with_name(dest.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name, full in sorted(files.items()):
        try:
            fs.get_file(full, str(tmp / name))
        except (OSError, ValueError, RuntimeError) as exc:
            raise SourceUnavailable(f"input {full}: {short_error(exc)}") from exc
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return sorted(files)


def _mirror_remote(source: str, dest: Path, timeout: float, include_empty: bool) -> list[str]:
    from cube.builder.build import BuildError  # imported here: the transfer reads few inputs
    from cube.builder.sources import fetch_inputs

    tmp = dest.with_name(dest.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        files = fetch_inputs(source, tmp, timeout, include_empty=include_empty)
    except BuildError as exc:  # it names the URL (credential-free) and says why
        shutil.rmtree(tmp, ignore_errors=True)
        raise SourceUnavailable(f"input {redact(str(exc))}") from None
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return [str(path.relative_to(tmp)) for path in files]
