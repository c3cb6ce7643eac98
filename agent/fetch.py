"""Fetch a shard tar from http(s)://, ftp://, file:// or a local path, resumably.

Bytes go to a `.part` file; a new attempt continues where the last one stopped (HTTP `Range`,
FTP `REST`, a seek for local files), so a retry or an agent restart does not start over.
Attempts are bounded, spaced by exponential backoff, and the whole fetch has one deadline.
HTTP uses aiohttp and FTP the standard ftplib (in a worker thread); no protocol is hand-written
and nothing runs a shell.
"""

from __future__ import annotations

import asyncio
import ftplib
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import aiohttp

from cube.fsutil import md5_of_line

ProgressFn = Callable[[int, "int | None"], None]
_CONTENT_RANGE_RE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)")
_UNSATISFIED_RE = re.compile(r"bytes\s+\*/(\d+)")
MAX_MD5_FILE = 64 * 1024


class FetchError(Exception):
    """A download that failed; `retryable` says whether another attempt may help."""

    def __init__(self, message: str, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


class _Stop(Exception):
    """Raised inside a worker thread's write callback to abort a transfer."""


@dataclass(frozen=True)
class FetchPolicy:
    attempts: int = 5
    backoff: float = 1.0  # seconds before the 2nd attempt, doubled each time
    backoff_max: float = 30.0
    timeout: float = 3600.0  # whole fetch, all attempts
    io_timeout: float = 60.0  # one connect or one stalled read
    limit_rate: int = 0  # bytes per second, 0 = unlimited
    chunk: int = 1 << 20


def source_kind(source: str) -> str:
    """'http', 'ftp' or 'file'; anything else is refused (no shell, no surprises)."""
    scheme = urlsplit(source).scheme.lower()
    if scheme in ("http", "https"):
        return "http"
    if scheme == "ftp":
        return "ftp"
    if scheme in ("file", ""):
        return "file"
    raise FetchError(
        f"source {source!r}: unsupported scheme {scheme!r} (http, https, ftp, file or a path)",
        retryable=False,
    )


def local_path(source: str) -> Path:
    parts = urlsplit(source)
    if parts.scheme.lower() == "file":
        if parts.netloc not in ("", "localhost"):
            raise FetchError(f"source {source!r}: file:// URL names a remote host", False)
        return Path(unquote(parts.path))
    return Path(source)


def source_basename(source: str) -> str:
    path = unquote(urlsplit(source).path) if source_kind(source) != "file" else str(source)
    return path.rstrip("/").rsplit("/", 1)[-1]


def parse_md5_text(text: str, where: str) -> str:
    """The md5 in an `md5sum`-style line ("<hex>  <name>"), lower-case."""
    digest = md5_of_line(text)
    if digest is None:
        raise FetchError(f"{where}: no md5 hex digest in {text[:80]!r}", retryable=False)
    return digest


class _Pace:
    """--limit_rate: how long to wait so the average stays under `rate` bytes/s."""

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self.start = time.monotonic()
        self.sent = 0

    def delay(self, nbytes: int) -> float:
        self.sent += nbytes
        if self.rate <= 0:
            return 0.0
        return max(0.0, self.sent / self.rate - (time.monotonic() - self.start))


def _open_part(part: Path, offset: int):
    """The .part file positioned at `offset` (anything after it is dropped)."""
    f = open(part, "r+b" if part.exists() else "w+b")  # noqa: SIM115 - closed by caller
    f.truncate(offset)
    f.seek(offset)
    return f


class _PartWriter:
    """The per-block step every protocol shares: append to the .part file, report progress,
    and say how long to pause for --limit_rate."""

    def __init__(
        self, part: Path, offset: int, total: int | None, policy: FetchPolicy, progress: ProgressFn
    ) -> None:
        self.pace = _Pace(policy.limit_rate)
        self.done = offset
        self.total = total
        self.progress = progress
        self.file = _open_part(part, offset)

    def __enter__(self) -> _PartWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.file.close()

    def write(self, block: bytes) -> float:
        """Append `block`; the seconds to wait before the next one (0 when unlimited)."""
        self.file.write(block)
        self.done += len(block)
        self.progress(self.done, self.total)
        return self.pace.delay(len(block))

    def write_in_thread(self, block: bytes, stop: threading.Event) -> None:
        """`write` for a worker thread: abort when the caller is cancelled, pace by `stop`."""
        if stop.is_set():
            raise _Stop
        wait = self.write(block)
        if wait:
            stop.wait(wait)


async def _http_once(
    url: str, part: Path, offset: int, policy: FetchPolicy, progress: ProgressFn
) -> int | None:
    """One HTTP attempt from `offset`; returns the source's total size if it said so."""
    timeout = aiohttp.ClientTimeout(
        total=None,
        connect=policy.io_timeout,
        sock_connect=policy.io_timeout,
        sock_read=policy.io_timeout,
    )
    headers = {"Accept-Encoding": "identity"}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    async with (
        aiohttp.ClientSession(timeout=timeout, auto_decompress=False) as session,
        session.get(url, headers=headers) as resp,
    ):
        if resp.status == 416 and offset:
            match = _UNSATISFIED_RE.search(resp.headers.get("Content-Range", ""))
            if match and int(match.group(1)) == offset:
                return offset  # the .part already holds everything
            _open_part(part, 0).close()
            raise FetchError(f"HTTP 416 from {url} resuming at {offset}; restarting from 0")
        if resp.status >= 400:
            retry = resp.status >= 500 or resp.status in (408, 429)
            raise FetchError(f"HTTP {resp.status} {resp.reason} from {url}", retryable=retry)
        total: int | None = None
        if resp.status == 206:
            match = _CONTENT_RANGE_RE.search(resp.headers.get("Content-Range", ""))
            if not match or int(match.group(1)) != offset:
                _open_part(part, 0).close()
                raise FetchError(f"bad Content-Range from {url} resuming at {offset}; restarting")
            total = None if match.group(3) == "*" else int(match.group(3))
        else:
            offset = 0  # the server ignored Range: take the whole body
            if resp.content_length is not None:
                total = resp.content_length
        with _PartWriter(part, offset, total, policy, progress) as writer:
            async for block in resp.content.iter_chunked(policy.chunk):
                wait = writer.write(block)
                if wait:
                    await asyncio.sleep(wait)
        return total


def _ftp_once(
    url: str,
    part: Path,
    offset: int,
    policy: FetchPolicy,
    progress: ProgressFn,
    stop: threading.Event,
) -> int | None:
    """One FTP attempt from `offset` (REST), in a worker thread."""
    parts = urlsplit(url)
    if not parts.hostname:
        raise FetchError(f"source {url!r}: ftp URL without a host", retryable=False)
    path = unquote(parts.path)
    ftp = ftplib.FTP(timeout=policy.io_timeout)
    try:
        ftp.connect(parts.hostname, parts.port or 21)
        ftp.login(unquote(parts.username or "anonymous"), unquote(parts.password or "anonymous@"))
        ftp.voidcmd("TYPE I")
        try:
            total: int | None = ftp.size(path)
        except ftplib.error_perm as exc:
            if str(exc).startswith("550"):
                raise FetchError(f"FTP {url}: {exc}", retryable=False) from exc
            total = None
        if total is not None and offset > total:
            offset = 0
        if total is not None and offset == total:
            _open_part(part, offset).close()
            return total
        with _PartWriter(part, offset, total, policy, progress) as writer:
            try:
                ftp.retrbinary(
                    f"RETR {path}",
                    lambda block: writer.write_in_thread(block, stop),
                    blocksize=policy.chunk,
                    rest=offset or None,
                )
            except ftplib.error_perm as exc:
                raise FetchError(f"FTP {url}: {exc}", retryable=False) from exc
        return total
    finally:
        ftp.close()


def _file_once(
    source: str,
    part: Path,
    offset: int,
    policy: FetchPolicy,
    progress: ProgressFn,
    stop: threading.Event,
) -> int | None:
    """Copy a local file from `offset`, in a worker thread."""
    path = local_path(source)
    try:
        src = open(path, "rb")  # noqa: SIM115 - closed below
    except FileNotFoundError as exc:
        raise FetchError(f"source {source!r}: no such file", retryable=False) from exc
    except IsADirectoryError as exc:
        raise FetchError(f"source {source!r}: is a directory", retryable=False) from exc
    with src:
        total = path.stat().st_size
        if offset > total:
            offset = 0
        src.seek(offset)
        with _PartWriter(part, offset, total, policy, progress) as writer:
            while block := src.read(policy.chunk):
                writer.write_in_thread(block, stop)
    return total


async def _in_thread(fn, *args) -> int | None:
    """Run a blocking attempt in a thread; cancelling the caller stops it at the next block."""
    stop = threading.Event()
    try:
        return await asyncio.to_thread(fn, *args, stop)
    finally:
        stop.set()


async def fetch_file(
    source: str,
    part: Path,
    *,
    size: int | None,
    policy: FetchPolicy,
    progress: ProgressFn = lambda done, total: None,
) -> int:
    """Download `source` into `part`, resuming what is already there; returns the byte count.

    The result is complete as far as the source is concerned (its announced size, and `size`
    when given); the caller checks the md5.
    """
    kind = source_kind(source)
    part.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + policy.timeout
    last: Exception | None = None
    for attempt in range(1, max(policy.attempts, 1) + 1):
        offset = part.stat().st_size if part.exists() else 0
        if size is not None and offset > size:
            offset = 0
            _open_part(part, 0).close()
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            async with asyncio.timeout(remaining):
                if kind == "http":
                    total = await _http_once(source, part, offset, policy, progress)
                elif kind == "ftp":
                    total = await _in_thread(_ftp_once, source, part, offset, policy, progress)
                else:
                    total = await _in_thread(_file_once, source, part, offset, policy, progress)
            got = part.stat().st_size
            if total is not None and size is not None and total != size:
                raise FetchError(
                    f"source {source} has {total} bytes, the request says size {size}",
                    retryable=False,
                )
            want = size if size is not None else total
            if want is not None and got != want:
                raise FetchError(f"transfer of {source} stopped at {got} of {want} bytes")
            return got
        except FetchError as exc:
            if not exc.retryable:
                raise
            last = exc
        except (TimeoutError, aiohttp.ClientError, OSError, EOFError, ftplib.Error) as exc:
            if time.monotonic() >= deadline:
                break
            last = exc
        if attempt < policy.attempts:
            pause = min(policy.backoff * 2 ** (attempt - 1), policy.backoff_max)
            await asyncio.sleep(max(0.0, min(pause, deadline - time.monotonic())))
    if time.monotonic() >= deadline:
        raise FetchError(
            f"download of {source} timed out after {policy.timeout:g} s (--download_timeout); "
            f"kept {part.name} to resume",
            retryable=False,
        )
    raise FetchError(
        f"download of {source} failed after {policy.attempts} attempts: {_describe(last)}",
        retryable=False,
    )


async def fetch_md5(source: str, dest: Path, policy: FetchPolicy) -> str:
    """Fetch `<source>.md5` (small; fetched whole each time) and return the digest."""
    part = dest.with_name(dest.name + ".part")
    part.unlink(missing_ok=True)
    small = FetchPolicy(
        attempts=policy.attempts,
        backoff=policy.backoff,
        backoff_max=policy.backoff_max,
        timeout=min(policy.timeout, 300.0),
        io_timeout=policy.io_timeout,
    )
    await fetch_file(source + ".md5", part, size=None, policy=small)
    if part.stat().st_size > MAX_MD5_FILE:
        raise FetchError(f"{source}.md5 is larger than {MAX_MD5_FILE} bytes", retryable=False)
    text = part.read_text(encoding="utf-8", errors="replace")
    digest = parse_md5_text(text, f"{source}.md5")
    part.replace(dest)
    return digest


def _describe(exc: Exception | None) -> str:
    if exc is None:
        return "no attempt made"
    text = str(exc) or type(exc).__name__
    return text if isinstance(exc, FetchError) else f"{type(exc).__name__}: {text}"
