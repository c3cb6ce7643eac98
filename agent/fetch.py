"""Fetch a shard tar from http(s)://, ftp://, s3://, file:// or a local path, resumably and
safely.

Bytes go to a `.part` file; a new attempt continues where the last one stopped (HTTP `Range`,
FTP `REST`, ranged reads from S3, a seek for local files), so a retry or an agent restart does
not start over. A `.part` that resuming cannot help (the source sent more than the declared
size, or failed permanently) is deleted. Attempts are bounded, spaced by exponential backoff,
and the whole fetch has one deadline. HTTP uses aiohttp, FTP the standard ftplib and S3 s3fs
through cube.remote (both in a worker thread; S3 credentials, endpoint and region from the AWS
environment); no protocol is hand-written and nothing runs a shell.

Whoever can reach the agent chooses the source, so the source is checked against the
deployment's `SourcePolicy` on its parsed parts (and so is every HTTP redirect, followed by
hand), and error messages never carry what a source sent (reason phrases, replies, md5 file
text): a source the agent may read is no way to read it. An s3:// source is read with the
agent's own credentials, so, like a local file, it must be under an s3:// prefix that
--allowed_sources lists (the bucket is the prefix's "host"; the key is matched literally, by
whole segments).
"""

from __future__ import annotations

import asyncio
import ftplib
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO
from urllib.parse import unquote, urljoin, urlsplit, urlunsplit

import aiohttp
import yarl

from cube import remote
from cube.backoff import Backoff, retrying_async
from cube.fsutil import md5_of_line
from cube.security import client_context

log = logging.getLogger("cube.agent")
ProgressFn = Callable[[int, "int | None"], None]
_CONTENT_RANGE_RE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)")
_UNSATISFIED_RE = re.compile(r"bytes\s+\*/(\d+)")
MAX_MD5_FILE = 64 * 1024
MAX_REDIRECTS = 5
_REDIRECTS = (301, 302, 303, 307, 308)
_DEFAULT_PORTS = {"http": 80, "https": 443, "ftp": 21}
_FLAGS_HINT = "--allowed_sources (comma-separated scheme://host[:port]/path prefixes)"
_FILES_HINT = "start cube-agent with --allow_file_sources, or list a file:// prefix in " + (
    "--allowed_sources"
)
_S3_HINT = "list its s3://bucket/prefix in --allowed_sources"
_BUCKET = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")


class FetchError(Exception):
    """A download that failed; `retryable` says whether another attempt may help, `keep_part`
    whether the `.part` file is worth resuming (by default: when retrying may help)."""

    def __init__(self, message: str, retryable: bool = True, keep_part: bool | None = None) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.keep_part = retryable if keep_part is None else keep_part


class SourceRefused(FetchError):
    """A source (or redirect target) the agent's flags do not allow; the message names the
    field or flag to change."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=False)


class _Stop(Exception):
    """Raised inside a worker thread's write callback to abort a transfer."""


# ---------------------------------------------------------------------------------------------
# which sources the deployment allows


@dataclass(frozen=True)
class Target:
    """A checked source: what is fetched (`url`: rebuilt from the checked parts; for a local
    file its resolved path) and the parts a prefix is matched on."""

    kind: str  # http | ftp | s3 | file
    url: str
    scheme: str
    host: str = ""
    port: int | None = None
    segments: tuple[str, ...] = ()


@dataclass(frozen=True)
class Prefix:
    """One --allowed_sources entry: scheme://host[:port]/path (or file:///path, or
    s3://bucket/prefix), matched on parsed parts and whole path segments, never on the raw
    string."""

    scheme: str
    host: str
    port: int | None
    segments: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> Prefix:
        entry = text.strip()
        parts = urlsplit(entry)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https", "ftp", "file", "s3"):
            raise ValueError(f"--allowed_sources: {entry!r}: scheme not http, https, ftp, s3, file")
        if parts.query or parts.fragment or "@" in parts.netloc or _unsafe_chars(entry):
            raise ValueError(
                f"--allowed_sources: {entry!r}: only scheme://host[:port]/path (no user, query, "
                "fragment, spaces or backslashes)"
            )
        if scheme == "s3":
            return cls._s3(entry, parts.netloc, parts.path)
        segments = _segments(unquote(parts.path))
        if segments is None:
            raise ValueError(f"--allowed_sources: {entry!r}: '.' or '..' in the path")
        if scheme == "file":
            if parts.netloc not in ("", "localhost"):
                raise ValueError(f"--allowed_sources: {entry!r}: a file:// prefix names no host")
            real = Path(os.path.realpath("/" + "/".join(segments)))
            return cls("file", "", None, real.parts[1:])
        try:
            port = parts.port or _DEFAULT_PORTS[scheme]
        except ValueError as exc:
            raise ValueError(f"--allowed_sources: {entry!r}: {exc}") from None
        if not parts.hostname:
            raise ValueError(f"--allowed_sources: {entry!r}: no host")
        return cls(scheme, parts.hostname, port, segments)

    @classmethod
    def _s3(cls, entry: str, bucket: str, path: str) -> Prefix:
        if not _BUCKET.fullmatch(bucket):
            raise ValueError(f"--allowed_sources: {entry!r}: s3://bucket/prefix needs a bucket")
        segments = _segments(path)  # S3 keys are literal: no percent-decoding
        if segments is None or "%" in path:
            raise ValueError(f"--allowed_sources: {entry!r}: '.', '..' or '%' in the path")
        return cls("s3", bucket, None, segments)

    def matches(self, target: Target) -> bool:
        place = (self.scheme, self.host, self.port) == (target.scheme, target.host, target.port)
        return place and target.segments[: len(self.segments)] == self.segments


@dataclass(frozen=True)
class SourcePolicy:
    """Sources a download may use. No prefixes: any http, https or ftp URL. Local files
    (file:// or a path) only with `allow_files` or under a file:// prefix; s3:// objects only
    under an s3:// prefix (both are read with the agent's own rights)."""

    prefixes: tuple[Prefix, ...] = ()
    allow_files: bool = False

    @classmethod
    def from_flags(cls, allowed_sources: str, allow_files: bool) -> SourcePolicy:
        """Raises ValueError naming the bad entry."""
        entries = [e for e in allowed_sources.split(",") if e.strip()]
        return cls(tuple(Prefix.parse(e) for e in entries), allow_files)


@dataclass(frozen=True)
class FetchPolicy:
    attempts: int = 5
    backoff: float = 1.0  # seconds before the 2nd attempt, doubled each time
    backoff_max: float = 30.0
    timeout: float = 3600.0  # whole fetch, all attempts
    io_timeout: float = 60.0  # one connect or one stalled read
    limit_rate: int = 0  # bytes per second, 0 = unlimited
    chunk: int = 1 << 20
    sources: SourcePolicy = field(default_factory=SourcePolicy)
    tls_ca: str = ""  # PEM CA bundle trusted for https:// (default: the system's)


def _unsafe_chars(text: str) -> bool:
    """Characters URL parsers disagree on (or that no URL holds): controls, spaces, '\\'."""
    return any(ord(c) <= 0x20 or ord(c) == 0x7F or c == "\\" for c in text)


def _segments(path: str) -> tuple[str, ...] | None:
    """The non-empty segments of a decoded path; None when one is '.' or '..'."""
    segments = tuple(s for s in path.split("/") if s)
    return None if any(s in (".", "..") for s in segments) else segments


def source_kind(source: str) -> str:
    """'http', 'ftp', 's3' or 'file'; anything else is refused (no shell, no surprises)."""
    try:
        scheme = urlsplit(source).scheme.lower()
    except ValueError:  # e.g. an unclosed '[' in the host
        raise SourceRefused("source: not a valid URL") from None
    if scheme in ("http", "https"):
        return "http"
    if scheme in ("ftp", "s3"):
        return scheme
    if scheme in ("file", ""):
        return "file"
    raise SourceRefused(
        f"source: unsupported scheme {scheme!r} (http, https, ftp, s3, file or a path)"
    )


def check_source(source: str, policy: SourcePolicy) -> Target:
    """The source as a Target, or SourceRefused naming the flag that would allow it."""
    if _unsafe_chars(source):
        raise SourceRefused("source: control characters, spaces or backslashes are not allowed")
    kind = source_kind(source)
    if kind == "file":
        return _check_file(source, policy)
    if kind == "s3":
        return _check_s3(source, policy)
    parts = urlsplit(source)
    scheme = parts.scheme.lower()
    try:
        port = parts.port or _DEFAULT_PORTS[scheme]
    except ValueError:
        raise SourceRefused(f"source {remote.redact(source)!r}: bad port") from None
    host = parts.hostname
    if not host:
        raise SourceRefused(f"source {remote.redact(source)!r}: no host")
    segments = _segments(unquote(parts.path))
    if segments is None:
        raise SourceRefused(f"source {remote.redact(source)!r}: '.' or '..' in the path")
    userinfo, at, _ = parts.netloc.rpartition("@")
    netloc = f"{userinfo}{at}{f'[{host}]' if ':' in host else host}:{port}"
    url = urlunsplit((scheme, netloc, parts.path or "/", parts.query, ""))
    try:  # what aiohttp will parse must be what was checked
        same = yarl.URL(url, encoded=True)
        agree = (same.host, same.port) == (host, port)
    except ValueError:
        agree = False
    if not agree:
        raise SourceRefused(f"source {remote.redact(source)!r}: ambiguous URL")
    target = Target(kind, url, scheme, host, port, segments)
    if policy.prefixes and not any(p.matches(target) for p in policy.prefixes):
        raise SourceRefused(
            f"source {remote.redact(source)!r} is not under an allowed prefix; to allow it, change "
            f"{_FLAGS_HINT}"
        )
    return target


def _check_file(source: str, policy: SourcePolicy) -> Target:
    if urlsplit(source).scheme:
        parts = urlsplit(source)
        if parts.netloc not in ("", "localhost"):
            raise SourceRefused(f"source {source!r}: a file:// URL names a remote host")
        if "?" in source or "#" in source:
            raise SourceRefused(f"source {source!r}: a file:// URL has no query or fragment")
        path = unquote(parts.path)
    else:
        path = source
    if not path.startswith("/"):
        raise SourceRefused(f"source {source!r}: a local path must be absolute")
    if _segments(path) is None:
        raise SourceRefused(f"source {source!r}: '.' or '..' in the path")
    real = Path(os.path.realpath(path))  # a symlink is judged by where it leads
    target = Target("file", str(real), "file", segments=real.parts[1:])
    if policy.allow_files or any(p.matches(target) for p in policy.prefixes):
        return target
    if any(p.scheme == "file" for p in policy.prefixes):
        raise SourceRefused(
            f"source {source!r} is not under an allowed file:// prefix; change --allowed_sources "
            "or start cube-agent with --allow_file_sources"
        )
    raise SourceRefused(f"source {source!r}: local files are not allowed; {_FILES_HINT}")


def _check_s3(source: str, policy: SourcePolicy) -> Target:
    """An s3://bucket/key source: a bucket, a key without '.' or '..' segments, nothing else
    (no user, port, query, fragment), under an s3:// prefix of --allowed_sources."""
    parts = urlsplit(source)
    problem = remote.check_url(source)
    where = remote.redact(source)
    if problem or not _BUCKET.fullmatch(parts.netloc):
        raise SourceRefused(f"source {where!r}: {problem or 'not s3://bucket/key'}")
    if "%" in parts.path:  # a key is literal: nothing to decode, nothing to disagree on
        raise SourceRefused(f"source {where!r}: no '%' in an s3:// key")
    if "//" in parts.path or parts.path.endswith("/"):  # a//b is its own key, not a/b
        raise SourceRefused(f"source {where!r}: an empty segment ('//' or a final '/') in the key")
    segments = _segments(parts.path)
    if segments is None:
        raise SourceRefused(f"source {where!r}: '.' or '..' in the key")
    if not segments:
        raise SourceRefused(f"source {where!r}: no key")
    url = f"s3://{parts.netloc}/{'/'.join(segments)}"
    target = Target("s3", url, "s3", parts.netloc, None, segments)
    if any(p.matches(target) for p in policy.prefixes):
        return target
    raise SourceRefused(f"source {where!r}: an s3:// source must be allowed; {_S3_HINT}")


def md5_source(source: str) -> str:
    """`<source>.md5`, for --md5_from_source: only for a source without query or fragment (with
    one, the suffix would land in the query and name another file)."""
    if "?" in source or "#" in source:
        raise SourceRefused(
            "source: --md5_from_source needs a source without '?' or '#'; send md5 instead"
        )
    return source + ".md5"


def source_basename(source: str) -> str:
    path = unquote(urlsplit(source).path) if source_kind(source) != "file" else str(source)
    return path.rstrip("/").rsplit("/", 1)[-1]


def parse_md5_text(text: str, where: str) -> str:
    """The md5 in an `md5sum`-style line ("<hex>  <name>"), lower-case. The error never quotes
    the text: it came from the source."""
    digest = md5_of_line(text)
    if digest is None:
        raise FetchError(f"{where}: no md5 hex digest at the start of the file", retryable=False)
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


def _open_part(part: Path, offset: int) -> BinaryIO:
    """The .part file positioned at `offset` (anything after it is dropped)."""
    f = open(part, "r+b" if part.exists() else "w+b")  # noqa: SIM115 - closed by caller
    f.truncate(offset)
    f.seek(offset)
    return f


@dataclass(frozen=True)
class _Bound:
    """The most bytes a fetch may bring: the declared `size` (exactly that many) or a `cap`
    (`why` says where it comes from)."""

    size: int | None = None
    cap: int | None = None
    why: str = ""

    def check_total(self, total: int | None, where: str) -> None:
        """Refuse before the first byte when the source announces another size."""
        if total is None:
            return
        if self.size is not None and total != self.size:
            raise FetchError(
                f"source {where} has {total} bytes, the request says size {self.size}",
                retryable=False,
            )
        if self.cap is not None and total > self.cap:
            raise FetchError(
                f"{where} has {total} bytes, more than {self.cap} ({self.why})", retryable=False
            )

    def check_done(self, done: int, where: str) -> None:
        """Abort as soon as more bytes arrive than may (the disk is not the source's to fill)."""
        if self.size is not None and done > self.size:
            raise FetchError(
                f"source {where} sent more than the declared size of {self.size} bytes; "
                "the transfer was stopped and the partial file deleted",
                retryable=False,
            )
        if self.cap is not None and done > self.cap:
            raise FetchError(
                f"{where} sent more than {self.cap} bytes ({self.why}); stopped", retryable=False
            )


@dataclass
class _Attempt:
    """What one attempt needs besides the target: where, from which offset, within which
    bound, at which pace, reporting progress to whom."""

    part: Path
    offset: int
    bound: _Bound
    policy: FetchPolicy
    progress: ProgressFn
    where: str  # the source as messages show it
    deadline: float | None = None  # time.monotonic() the whole fetch must end by
    token: str = ""  # sent as a bearer token (a peer agent's API); no redirect is followed


class _PartWriter:
    """The per-block step every protocol shares: check the bound, append to the .part file,
    report progress, and say how long to pause for --limit_rate."""

    def __init__(self, attempt: _Attempt, offset: int, total: int | None) -> None:
        attempt.bound.check_total(total, attempt.where)
        self.attempt = attempt
        self.pace = _Pace(attempt.policy.limit_rate)
        self.done = offset
        self.total = total
        self.file = _open_part(attempt.part, offset)

    def __enter__(self) -> _PartWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.file.close()

    def write(self, block: bytes) -> float:
        """Append `block`; the seconds to wait before the next one (0 when unlimited)."""
        self.attempt.bound.check_done(self.done + len(block), self.attempt.where)
        self.file.write(block)
        self.done += len(block)
        self.attempt.progress(self.done, self.total)
        return self.pace.delay(len(block))

    def write_in_thread(self, block: bytes, stop: threading.Event) -> None:
        """`write` for a worker thread: abort when the caller is cancelled, pace by `stop`."""
        if stop.is_set():
            raise _Stop
        wait = self.write(block)
        if wait:
            stop.wait(wait)


async def _http_once(target: Target, at: _Attempt) -> int | None:
    """One HTTP attempt from `at.offset`, following at most MAX_REDIRECTS redirects, each one
    checked like the source; returns the source's total size if it said so."""
    policy = at.policy
    timeout = aiohttp.ClientTimeout(
        total=None,
        connect=policy.io_timeout,
        sock_connect=policy.io_timeout,
        sock_read=policy.io_timeout,
    )
    headers = {"Accept-Encoding": "identity"}
    if at.offset:
        headers["Range"] = f"bytes={at.offset}-"
    if at.token:
        headers["Authorization"] = f"Bearer {at.token}"
    url = target.url
    connector = aiohttp.TCPConnector(ssl=client_context(policy.tls_ca))
    async with aiohttp.ClientSession(
        timeout=timeout, auto_decompress=False, connector=connector
    ) as session:
        for _hop in range(MAX_REDIRECTS + 1):
            async with session.get(
                yarl.URL(url, encoded=True), headers=headers, allow_redirects=False
            ) as resp:
                if resp.status in _REDIRECTS:
                    if at.token:  # a peer agent never redirects: its token goes nowhere else
                        raise FetchError(f"{at.where}: a redirect from a peer", retryable=False)
                    url = _redirect_target(url, resp.headers.get("Location"), at)
                    continue
                return await _http_body(resp, at)
    raise FetchError(f"{at.where}: more than {MAX_REDIRECTS} redirects", retryable=False)


def _redirect_target(url: str, location: str | None, at: _Attempt) -> str:
    """The checked URL a redirect leads to; the Location itself never goes into a message."""
    if not location:
        raise FetchError(f"{at.where}: a redirect without a Location", retryable=False)
    try:
        target = check_source(urljoin(url, location), at.policy.sources)
        if target.kind != "http":
            raise SourceRefused("not http")
    except SourceRefused:
        log.warning("redirect from %s to %r refused", remote.redact(url), location[:200])
        raise SourceRefused(
            f"source {at.where}: a redirect leads outside the allowed sources (only http(s) "
            f"URLs that {_FLAGS_HINT} allows are followed); not followed"
        ) from None
    return target.url


async def _http_body(resp: aiohttp.ClientResponse, at: _Attempt) -> int | None:
    """Write the body of a final (non-redirect) answer into the .part."""
    offset, where = at.offset, at.where
    if resp.status == 416 and offset:
        match = _UNSATISFIED_RE.search(resp.headers.get("Content-Range", ""))
        if match and int(match.group(1)) == offset:
            return offset  # the .part already holds everything
        _open_part(at.part, 0).close()
        raise FetchError(f"HTTP 416 from {where} resuming at {offset}; restarting from 0")
    if resp.status >= 400:
        retry = remote.retryable_status(resp.status)
        raise FetchError(f"{remote.status_text(resp.status)} from {where}", retryable=retry)
    total: int | None = None
    if resp.status == 206:
        match = _CONTENT_RANGE_RE.search(resp.headers.get("Content-Range", ""))
        if not match or int(match.group(1)) != offset:
            _open_part(at.part, 0).close()
            raise FetchError(f"bad Content-Range from {where} resuming at {offset}; restarting")
        total = None if match.group(3) == "*" else int(match.group(3))
    else:
        offset = 0  # the server ignored Range: take the whole body
        if resp.content_length is not None:
            total = resp.content_length
    with _PartWriter(at, offset, total) as writer:
        async for block in resp.content.iter_chunked(at.policy.chunk):
            wait = writer.write(block)
            if wait:
                await asyncio.sleep(wait)
    return total


def _ftp_reply(exc: BaseException) -> str:
    """`FTP reply 550`: the code of a server reply, never its text."""
    code = str(exc)[:3]
    return f"FTP reply {code}" if code.isdigit() else "an unexpected FTP reply"


def _ftp_once(target: Target, at: _Attempt, stop: threading.Event) -> int | None:
    """One FTP attempt from `at.offset` (REST), in a worker thread."""
    parts = urlsplit(target.url)
    path = unquote(parts.path)
    offset = at.offset
    ftp = ftplib.FTP(timeout=at.policy.io_timeout)
    try:
        ftp.connect(target.host, target.port or 21)
        ftp.login(unquote(parts.username or "anonymous"), unquote(parts.password or "anonymous@"))
        ftp.voidcmd("TYPE I")
        try:
            total: int | None = ftp.size(path)
        except ftplib.error_perm as exc:
            if str(exc).startswith("550"):
                raise FetchError(f"{_ftp_reply(exc)} for {at.where}", retryable=False) from None
            total = None
        if total is not None and offset > total:
            offset = 0
        if total is not None and offset == total:
            at.bound.check_total(total, at.where)
            _open_part(at.part, offset).close()
            return total
        with _PartWriter(at, offset, total) as writer:
            try:
                ftp.retrbinary(
                    f"RETR {path}",
                    lambda block: writer.write_in_thread(block, stop),
                    blocksize=at.policy.chunk,
                    rest=offset or None,
                )
            except ftplib.error_perm as exc:
                raise FetchError(f"{_ftp_reply(exc)} for {at.where}", retryable=False) from None
        return total
    finally:
        ftp.close()


def _s3_once(target: Target, at: _Attempt, stop: threading.Event) -> int | None:
    """One S3 attempt from `at.offset`: ranged reads of at least `chunk` bytes, in a worker
    thread, each (the size too) ending by the fetch's deadline, so that the thread does not
    outlive the fetch. A failure becomes a FetchError in words of our own
    (cube.remote.failure)."""
    window = max(at.policy.chunk, remote.BLOCK)
    try:
        with remote.Reader(target.url, at.policy.io_timeout, window,
                           deadline=at.deadline) as reader:  # fmt: skip
            total = reader.size
            offset = at.offset if at.offset <= total else 0
            if offset == total:
                at.bound.check_total(total, at.where)
                _open_part(at.part, offset).close()
                return total
            with _PartWriter(at, offset, total) as writer:
                for block in reader.blocks(offset):
                    view = memoryview(block)
                    for start in range(0, len(view), at.policy.chunk):
                        writer.write_in_thread(bytes(view[start : start + at.policy.chunk]), stop)
        return total
    except remote.RemoteError as exc:  # a .part of an object that is gone is no use
        raise FetchError(
            f"source {at.where}: {exc}", retryable=exc.retryable, keep_part=not exc.missing
        ) from None


def _file_once(target: Target, at: _Attempt, stop: threading.Event) -> int | None:
    """Copy a local regular file from `at.offset`, in a worker thread."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK  # no fifo wait, no late symlink swap
    try:
        fd = os.open(target.url, flags)
    except FileNotFoundError:
        raise FetchError(f"source {at.where!r}: no such file", retryable=False) from None
    except OSError as exc:
        raise FetchError(f"source {at.where!r}: {exc.strerror}", retryable=False) from None
    with open(fd, "rb") as src:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise FetchError(f"source {at.where!r}: not a regular file", retryable=False)
        total = info.st_size
        offset = at.offset if at.offset <= total else 0
        src.seek(offset)
        with _PartWriter(at, offset, total) as writer:
            while block := src.read(at.policy.chunk):
                writer.write_in_thread(block, stop)
    return total


async def _in_thread(
    fn: Callable[[Target, _Attempt, threading.Event], int | None], target: Target, at: _Attempt
) -> int | None:
    """Run a blocking attempt in a thread; cancelling the caller stops it at the next block."""
    stop = threading.Event()
    try:
        return await asyncio.to_thread(fn, target, at, stop)
    finally:
        stop.set()


async def fetch_file(
    source: str,
    part: Path,
    *,
    size: int | None,
    policy: FetchPolicy,
    progress: ProgressFn = lambda done, total: None,
    cap: int | None = None,
    cap_why: str = "",
    token: str = "",
) -> int:
    """Download `source` into `part`, resuming what is already there; returns the byte count.

    The result is complete as far as the source is concerned (its announced size, and `size`
    when given: more is refused as soon as it arrives; `cap` bounds a fetch of unknown size,
    `cap_why` says why in the error);
    the caller checks the md5. On a failure resuming cannot cure, `part` is deleted. A `token`
    (an http(s) peer agent's) is sent as a bearer token, and then no redirect is followed.
    """
    try:
        return await _fetch(source, part, _Bound(size, cap, cap_why), policy, progress, token)
    except FetchError as exc:
        if not exc.keep_part:
            part.unlink(missing_ok=True)
        raise


# What may pass if a download is tried again: a FetchError that says so, or these.
_TRANSIENT = (TimeoutError, aiohttp.ClientError, OSError, EOFError, ftplib.Error)


def _retryable(error: Exception) -> bool:
    if isinstance(error, FetchError):
        return error.retryable
    return isinstance(error, _TRANSIENT)


async def _fetch(
    source: str,
    part: Path,
    bound: _Bound,
    policy: FetchPolicy,
    progress: ProgressFn,
    token: str = "",
) -> int:
    target = check_source(source, policy.sources)
    if token and target.kind != "http":
        raise SourceRefused("source: a token is sent to http(s) peers only")
    where = remote.redact(source)
    part.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + policy.timeout

    async def attempt(_number: int) -> int:
        offset = part.stat().st_size if part.exists() else 0
        if bound.size is not None and offset > bound.size:
            offset = 0
            _open_part(part, 0).close()
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        at = _Attempt(part, offset, bound, policy, progress, where, deadline, token)
        async with asyncio.timeout(remaining):
            if target.kind == "http":
                total = await _http_once(target, at)
            elif target.kind == "ftp":
                total = await _in_thread(_ftp_once, target, at)
            elif target.kind == "s3":
                total = await _in_thread(_s3_once, target, at)
            else:
                total = await _in_thread(_file_once, target, at)
        got = part.stat().st_size
        bound.check_total(total, where)
        want = bound.size if bound.size is not None else total
        if want is not None and got != want:
            raise FetchError(f"transfer of {where} stopped at {got} of {want} bytes")
        return got

    backoff = Backoff(policy.backoff, policy.backoff_max)
    try:
        return await retrying_async(
            attempt, backoff, policy.attempts, _retryable, deadline=deadline, sleep=asyncio.sleep
        )
    except FetchError as exc:
        if not exc.retryable:
            raise
        last: Exception = exc
    except _TRANSIENT as exc:
        last = exc
    if time.monotonic() >= deadline:
        raise FetchError(
            f"download of {where} timed out after {policy.timeout:g} s (--download_timeout); "
            f"kept {part.name} to resume",
            retryable=False,
            keep_part=True,
        )
    raise FetchError(
        f"download of {where} failed after {policy.attempts} attempts: {_describe(last)}",
        retryable=False,
        keep_part=True,
    )


async def fetch_md5(source: str, dest: Path, policy: FetchPolicy) -> str:
    """Fetch `<source>.md5` (--md5_from_source; small: at most MAX_MD5_FILE bytes, fetched whole
    each time) into `dest` and return the digest."""
    source = md5_source(source)
    part = dest.with_name(dest.name + ".part")
    part.unlink(missing_ok=True)
    small = FetchPolicy(
        attempts=policy.attempts,
        backoff=policy.backoff,
        backoff_max=policy.backoff_max,
        timeout=min(policy.timeout, 300.0),
        io_timeout=policy.io_timeout,
        sources=policy.sources,
    )
    await fetch_file(source, part, size=None, policy=small, cap=MAX_MD5_FILE, cap_why="md5 file")
    text = part.read_text(encoding="utf-8", errors="replace")
    try:
        digest = parse_md5_text(text, remote.redact(source))
    except FetchError:
        part.unlink(missing_ok=True)
        raise
    part.replace(dest)
    return digest


def _describe(exc: Exception | None) -> str:
    """Why an attempt failed, in words that never come from the source: a reply, a banner or
    a certificate can be chosen by whoever runs the source."""
    if exc is None:
        return "no attempt made"
    if isinstance(exc, FetchError):
        return str(exc)
    if isinstance(exc, TimeoutError):
        return "timed out (--io_timeout)"
    if isinstance(exc, aiohttp.ClientConnectorError):
        cause = exc.os_error
        why = getattr(cause, "strerror", None) or type(cause).__name__
        return f"cannot connect to {exc.host}:{exc.port} ({why})"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "the server closed the connection"
    if isinstance(exc, aiohttp.ClientPayloadError):
        return "the body was cut short"
    if isinstance(exc, aiohttp.ClientResponseError):
        return "the answer is not valid HTTP"
    if isinstance(exc, ftplib.Error):
        return _ftp_reply(exc)
    if isinstance(exc, EOFError):
        return "the connection closed early"
    if isinstance(exc, OSError) and not isinstance(exc, aiohttp.ClientError):
        return f"{type(exc).__name__}: {exc.strerror or 'I/O error'}"
    return type(exc).__name__
