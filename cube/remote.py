"""Remote files through fsspec: `s3://bucket/key` (s3fs) and `webhdfs://namenode:port/path`
(fsspec's own WebHDFS client); `hdfs://` and `afs://` through the Hadoop client command, as
PaddlePaddle's HDFSClient reads them (cube/hadoop.py, which answers the same calls). The one
place for what every reader of them needs:

- which URLs are accepted (`check_url`): credentials in a URL are refused (they belong in the
  environment, or for hdfs:// and afs:// in the client's hadoop.job.ugi setting);
- a filesystem per endpoint (`open_fs`), with connect and read timeouts, kept for at most
  REUSE_SECONDS (a new S3 client costs a few hundred milliseconds) and dropped at once after
  a failure of the credentials or the connection, so that fixed credentials or a moved
  endpoint are used at the next try. No listing is cached. S3 credentials, endpoint and
  region come from what botocore reads (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
  AWS_SESSION_TOKEN, AWS_ENDPOINT_URL, AWS_DEFAULT_REGION, AWS_PROFILE, config files, instance
  roles) and fsspec's FSSPEC_S3_* variables;
- s3fs imported lazily, its absence an error saying what to install;
- failures in words of our own (`failure`): never the text a server sent, never a credential;
- every call bounded in wall time (`call`): the Hadoop client by its own deadline (the
  process group is stopped), S3 by fsspec's own timeout (the coroutine is cancelled), WebHDFS
  by a watchdog that cuts the call's HTTP connections at its deadline (requests has no total
  timeout: a server that answers a byte now and then, or a listing of many directories, would
  go on for ever), each request's own timeouts also shortened to what is left.

A shell helper (network I/O), like cube/security.py: used by builder/sources.py (the builder's
inputs), transfer/donefile.py (donefiles and input mirrors), transfer/upload.py (download_mode
s3) and agent/fetch.py (s3:// shard sources).
"""

from __future__ import annotations

import contextlib
import functools
import http
import math
import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

from cube import hadoop

SCHEMES = ("s3", "webhdfs", *hadoop.SCHEMES)  # what open_fs reads
S3_INSTALL = "pip install 'cube-py[s3]'"
CREDENTIALS = "check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY/AWS_SESSION_TOKEN or AWS_PROFILE"
BLOCK = 8 << 20  # bytes per ranged read


_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)([^/\s]*)@")


def redact(text: str) -> str:
    """`text` with the user and password of every URL in it hidden (`ftp://***@host/...`):
    what messages and APIs show of addresses and inputs must not hand out credentials."""
    return _USERINFO.sub(r"\1***@", text)


class RemoteError(Exception):
    """A remote file that could not be used; the message is short and credential-free.
    `missing`: the object or path does not exist; `retryable`: another attempt may help."""

    def __init__(
        self, message: str, *, missing: bool = False, retryable: bool = False, denied: bool = False
    ) -> None:
        super().__init__(message)
        self.missing = missing
        self.retryable = retryable
        self.denied = denied  # the credentials (or their rights) were refused


_HADOOP_SHORT = re.compile(r"(?i)(hdfs|afs):/(?!/)")  # hdfs:/path: the cluster of fs.default.name


def scheme_of(url: str) -> str:
    """The lower-cased scheme of `url` ('' for a path or a malformed URL). `hdfs:/path` and
    `afs:/path` (no host: the cluster of the client's fs.default.name) are URLs too."""
    if "://" not in url:
        short = _HADOOP_SHORT.match(url)
        return short.group(1).lower() if short else ""
    try:
        return urlsplit(url).scheme.lower()
    except ValueError:
        return ""


def is_remote(path: str) -> bool:
    """Whether `path` is a URL with a scheme other than file:// (a local path has none)."""
    return scheme_of(path) not in ("", "file")


def check_url(url: str) -> str | None:
    """Why `url` cannot be read here (None when it can): a scheme open_fs does not read, a
    bucket or namenode missing, credentials or a query in the URL."""
    scheme = scheme_of(url)
    if scheme not in SCHEMES:
        kinds = "s3://, webhdfs://, hdfs:// or afs://"
        return f"unsupported scheme {scheme or '(none)'!r} ({kinds})"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return "not a valid URL (bad host or port)"
    if parts.query or parts.fragment:
        return "a query or fragment ('?', '#') is not allowed"
    if scheme == "s3" and "@" in parts.netloc:
        return f"credentials do not belong in an s3:// URL: {CREDENTIALS}"
    if scheme in hadoop.SCHEMES:
        if "@" in parts.netloc:
            return (
                f"a user or password does not belong in an {scheme}:// URL (set hadoop.job.ugi "
                f"in the client's settings: {hadoop.ENV_CONFIGS} or -hadoop_configs)"
            )
        return None  # no host: fs.default.name's cluster
    if parts.password is not None:
        return "a password does not belong in the URL (webhdfs://<user>@<namenode>:<port>/<path>)"
    if not parts.hostname:
        return "no bucket" if scheme == "s3" else "no namenode host"
    if scheme == "s3" and port is not None:
        return "an s3:// URL names a bucket, not host:port (set AWS_ENDPOINT_URL for the endpoint)"
    if scheme == "webhdfs" and port is None:
        return "no port: webhdfs://<namenode>:<http port>/<path> (9870 on Hadoop 3)"
    return None


REUSE_SECONDS = 300.0
_ENV_PREFIXES = ("AWS_", "FSSPEC_", "CUBE_HADOOP_", "HADOOP_")  # what a client was made from
_filesystems: dict[tuple[Any, ...], tuple[float, Any]] = {}
_lock = threading.Lock()


def open_fs(url: str, io_timeout: float = 60.0) -> tuple[Any, str]:
    """An fsspec filesystem for `url` and the path to use with it. `io_timeout` bounds one
    connect and one stalled read. RemoteError for a URL check_url refuses or a missing package.

    The filesystem of the same endpoint, settings and environment (AWS_*, FSSPEC_*) is reused
    for REUSE_SECONDS, unless a call through it failed on credentials or the connection."""
    problem = check_url(url)
    if problem:
        raise RemoteError(problem)
    parts = urlsplit(url)
    scheme = scheme_of(url)
    settings = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)))
    key = (scheme, parts.hostname if scheme != "s3" else "", parts.port, parts.username,
           io_timeout, settings)  # fmt: skip
    now = time.monotonic()
    with _lock:
        for old in [k for k, (born, _fs) in _filesystems.items() if now - born > REUSE_SECONDS]:
            del _filesystems[old]
        if key in _filesystems:
            return _filesystems[key][1], path_of(url)
    fs = _new_fs(url, io_timeout)
    fs._cube_key = key
    with _lock:
        _filesystems[key] = (now, fs)
    return fs, path_of(url)


def forget(fs: Any) -> None:
    """Stop reusing `fs` (after a failure that a new client may not have)."""
    with _lock:
        _filesystems.pop(getattr(fs, "_cube_key", None), None)  # type: ignore[arg-type]


def _new_fs(url: str, io_timeout: float) -> Any:
    parts = urlsplit(url)
    if scheme_of(url) in hadoop.SCHEMES:
        try:
            return hadoop.HadoopFileSystem(scheme_of(url), parts.netloc, hadoop.settings())
        except hadoop.HadoopError as exc:
            raise RemoteError(str(exc)) from None
    if scheme_of(url) == "s3":
        try:
            import fsspec.config
            import s3fs
        except ImportError:
            raise RemoteError(f"s3:// needs s3fs: {S3_INSTALL}") from None
        settings = fsspec.config.conf.get("s3", {})
        config = {"connect_timeout": io_timeout, "read_timeout": io_timeout}
        config.update(settings.get("config_kwargs") or {})  # FSSPEC_S3_CONFIG_KWARGS wins
        # retries=1: s3fs's own retry loop (5 tries by default) would multiply every timeout;
        # callers retry with their own backoff and deadlines (botocore's attempts,
        # AWS_MAX_ATTEMPTS, stay the operator's, and `call` bounds them all in wall time)
        fs = s3fs.S3FileSystem(
            skip_instance_cache=True, use_listings_cache=False, config_kwargs=config
        )
        fs.retries = 1  # (a class attribute, not a constructor argument)
        return fs
    try:
        from fsspec.implementations.webhdfs import WebHDFS
    except ImportError:
        raise RemoteError(f"webhdfs:// needs fsspec and requests: {S3_INSTALL} requests") from None
    webhdfs = WebHDFS(parts.hostname, parts.port, user=parts.username, skip_instance_cache=True)
    # requests waits forever by default: every request of this session gets the timeouts (no
    # more than what is left of the call), on connections a call's watchdog can cut
    webhdfs.session.request = functools.partial(_bounded_request, webhdfs.session.request,
                                                io_timeout)  # fmt: skip
    adapter = _cuttable_adapter()()
    webhdfs.session.mount("http://", adapter)
    webhdfs.session.mount("https://", adapter)
    return webhdfs


def path_of(url: str) -> str:
    """The path of `url` for its open_fs filesystem: `bucket/key` for s3://, `/path` for
    webhdfs:// (a filesystem serves every URL of its bucket or namenode)."""
    if scheme_of(url) in hadoop.SCHEMES:  # literally: a listed name may hold '#' or '?'
        return hadoop.entry_path(url).rstrip("/") or "/"
    parts = urlsplit(url)
    if scheme_of(url) == "s3":
        return f"{parts.netloc}{parts.path}".rstrip("/")
    return parts.path.rstrip("/") or "/"


def require(url: str) -> None:
    """RemoteError when the packages `url` needs are not installed (a start-up check, so that
    a daemon says so at once rather than at its first poll)."""
    if is_remote(url) and check_url(url) is None:
        open_fs(url)


def call(fs: Any, method: str, *args: Any, timeout: float | None, **kwargs: Any) -> Any:
    """`fs.<method>(*args, **kwargs)` within `timeout` seconds of wall time, whatever the
    server does (accepts and never answers, answers a byte at a time) and however many
    requests the call makes (a listing); RemoteError("timed out") past it, any failure as a
    RemoteError (`failure`). The Hadoop client (`bounded`): the call gets the timeout and
    stops the client at it. S3 (fsspec's async filesystem): fsspec cancels the call at the
    timeout. WebHDFS (requests, blocking): each request waits no longer than what is left,
    and a watchdog cuts the call's connections at the deadline (`_Cut`)."""
    if getattr(fs, "bounded", False):
        kwargs["timeout"] = timeout if timeout is not None else 3600.0
        cut = None
    elif timeout is not None and getattr(fs, "async_impl", False):
        kwargs["timeout"] = timeout
        cut = None
    else:
        cut = _Cut(timeout) if timeout is not None else None
    try:
        with cut or contextlib.nullcontext():
            result = getattr(fs, method)(*args, **kwargs)
    except RemoteError:
        raise
    except Exception as exc:
        if cut is not None and cut.expired:
            forget(fs)  # its connections were cut
            raise RemoteError("timed out", retryable=True) from exc
        raise _failed(fs, exc) from exc
    return result


# ---------------------------------------------------------------------------------------------
# WebHDFS calls bounded in wall time

_current = threading.local()  # .cut: the bounded call running on this thread (a _Cut)
CUT_REPEAT = 0.05  # seconds between two cuts of a call past its deadline
CUT_FOR = 10.0  # seconds a watchdog keeps cutting before it leaves the call to its timeouts


class _Cut:
    """The deadline of one blocking call and the HTTP connections it has used: past the
    deadline, a watchdog thread shuts their sockets down (a blocked read returns at once) and
    keeps doing so for what the call opens next, until the call returns."""

    def __init__(self, timeout: float) -> None:
        self.deadline = time.monotonic() + timeout
        self.expired = False
        self.connections: list[Any] = []  # urllib3 connections (their .sock)
        self._done = threading.Event()
        self._outer: _Cut | None = None

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def __enter__(self) -> _Cut:
        self._outer = getattr(_current, "cut", None)
        _current.cut = self
        threading.Thread(target=self._watch, name="cube-remote-cut", daemon=True).start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._done.set()
        _current.cut = self._outer

    def _watch(self) -> None:
        if self._done.wait(max(self.left(), 0.0)):
            return
        self.expired = True
        for _ in range(int(CUT_FOR / CUT_REPEAT)):
            for connection in list(self.connections):
                sock = getattr(connection, "sock", None)
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)
            if self._done.wait(CUT_REPEAT):
                return


def _bounded_request(request: Any, io_timeout: float, *args: Any, **kwargs: Any) -> Any:
    """A WebHDFS session's request: connect and read timeouts of `io_timeout`, or what is
    left of the call when less; TimeoutError when nothing is left."""
    wait = io_timeout
    cut = getattr(_current, "cut", None)
    if cut is not None:
        left = cut.left()
        if left <= 0:
            cut.expired = True
            raise TimeoutError("the call's deadline has passed")
        wait = min(wait, left)
    kwargs["timeout"] = (wait, wait)
    return request(*args, **kwargs)


@functools.cache
def _cuttable_adapter() -> Any:
    """A requests adapter whose connections tell the bounded call running on their thread
    (`_Cut`) that they are in use, so that its watchdog can cut them."""
    from requests.adapters import HTTPAdapter
    from urllib3.connection import HTTPConnection, HTTPSConnection
    from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

    def note(connection: Any) -> None:
        cut = getattr(_current, "cut", None)
        if cut is not None and connection not in cut.connections:
            cut.connections.append(connection)

    class Connection(HTTPConnection):
        def request(self, *args: Any, **kwargs: Any) -> None:
            note(self)
            super().request(*args, **kwargs)

    class SecureConnection(HTTPSConnection):
        def request(self, *args: Any, **kwargs: Any) -> None:
            note(self)
            super().request(*args, **kwargs)

    class Pool(HTTPConnectionPool):
        ConnectionCls = Connection

    class SecurePool(HTTPSConnectionPool):
        ConnectionCls = SecureConnection

    class Adapter(HTTPAdapter):
        def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
            super().init_poolmanager(*args, **kwargs)
            self.poolmanager.pool_classes_by_scheme = {"http": Pool, "https": SecurePool}

    return Adapter


def _failed(fs: Any, exc: BaseException) -> RemoteError:
    """`exc` in our words; a failure a new client might not have stops the reuse of `fs`."""
    error = failure(exc, _scheme(fs))
    if error.retryable or error.denied:
        forget(fs)
    return error


def _scheme(fs: Any) -> str:
    protocol = getattr(fs, "protocol", "")
    return str(protocol[0] if isinstance(protocol, (tuple, list)) else protocol).lower()


def find_files(fs: Any, path: str, timeout: float) -> dict[str, int]:
    """Every file under the directory `path`: its path -> size. Errors raise (fsspec's walk
    would silently skip a directory it cannot list)."""
    kwargs: dict[str, Any] = {"detail": True, "withdirs": False}
    if not getattr(fs, "async_impl", False):
        kwargs["on_error"] = "raise"
    found = call(fs, "find", path, timeout=timeout, **kwargs)
    return {
        str(name): int(info.get("size") or 0)
        for name, info in found.items()
        if info.get("type", "file") == "file"
    }


class Reader:
    """Ranged reads of one remote file: `size`, then `blocks(offset)` yields what follows
    `offset` in reads of `block` bytes (one request each, so a failed read loses one block).
    `fs`: an open_fs filesystem of the same bucket or namenode to reuse (a new S3 client
    costs a few hundred milliseconds). `deadline` (time.monotonic()): when the size and every
    read must be done by (RemoteError "timed out" past it), besides one io_timeout each.
    `size`: the file's size when the caller knows it (a listing said it), not asked again.
    Through the Hadoop client, `blocks` is one streamed `-cat` (a run per ranged read would
    start a JVM per block)."""

    def __init__(
        self,
        url: str,
        io_timeout: float = 60.0,
        block: int = BLOCK,
        fs: Any = None,
        deadline: float | None = None,
        size: int | None = None,
    ) -> None:
        self.url = url
        self.block = block
        self.io_timeout = io_timeout
        self.deadline = deadline
        if fs is None:
            fs, path = open_fs(url, io_timeout)
        else:
            path = path_of(url)
        self.fs = fs
        self.path = path
        if size is None:
            size = int(call(fs, "info", path, timeout=self._bound(deadline))["size"])
        self.size = size

    def _bound(self, deadline: float | None) -> float:
        """One call's timeout: io_timeout, or what is left before `deadline` when less."""
        if deadline is None:
            return self.io_timeout
        left = deadline - time.monotonic()
        if left <= 0:
            raise RemoteError("timed out", retryable=True)
        return min(self.io_timeout, left)

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Nothing stays open between reads (each is one ranged request)."""

    def blocks(self, offset: int = 0, deadline: float | None = None) -> Iterator[bytes]:
        """Yield the bytes from `offset` to the end; RemoteError on a failed read, a read that
        ends short of `size`, or `deadline` (time.monotonic(); default: the reader's) passed.
        Each read is bounded in wall time by the I/O timeout and by what is left."""
        position = offset
        if deadline is None:
            deadline = self.deadline
        if getattr(self.fs, "bounded", False):
            yield from self._streamed(offset, deadline)
            return
        while position < self.size:
            bound = self._bound(deadline)
            want = min(self.block, self.size - position)
            data = call(
                self.fs, "cat_file", self.path, start=position, end=position + want, timeout=bound
            )
            if len(data) != want:
                raise RemoteError(
                    f"a read at offset {position} got {len(data)} of {want} bytes", retryable=True
                )
            position += len(data)
            yield data

    def _streamed(self, offset: int, deadline: float | None) -> Iterator[bytes]:
        """blocks() through a filesystem that streams a file in one run (the Hadoop client)."""
        if offset >= self.size:
            return
        end = deadline if deadline is not None else math.inf  # each read: io_timeout
        self._bound(deadline)  # "timed out" when nothing is left
        try:
            yield from self.fs.stream(
                self.path, offset, self.size, self.block, self.io_timeout, end
            )
        except Exception as exc:
            raise _failed(self.fs, exc) from None


def read_bytes(url: str, limit: int, timeout: float, io_timeout: float = 60.0) -> bytes:
    """The whole of a small remote file; RemoteError when it holds more than `limit` bytes."""
    fs, path = open_fs(url, min(io_timeout, timeout))
    if getattr(fs, "bounded", False):  # one run of the client, not one for the size and one more
        return bytes(call(fs, "read_limited", path, limit, timeout=timeout))
    deadline = time.monotonic() + timeout
    with Reader(url, min(io_timeout, timeout), fs=fs, deadline=deadline) as reader:
        if reader.size > limit:
            raise RemoteError(f"{reader.size} bytes, more than the {limit} allowed")
        return b"".join(reader.blocks(0))


def put_file(local: str, url: str, timeout: float, io_timeout: float = 60.0) -> None:
    """Upload the local file `local` to `url` (one object, visible whole or not at all)."""
    fs, path = open_fs(url, io_timeout)
    call(fs, "put_file", local, path, timeout=timeout)


# ---------------------------------------------------------------------------------------------
# failures, in our words


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _named(exc: BaseException, *names: str) -> bool:
    return any(cls.__name__ in names for cls in type(exc).__mro__)


def _s3_error(exc: BaseException) -> tuple[str, int]:
    """(error code, HTTP status) of the botocore ClientError behind `exc`, if any."""
    for link in _chain(exc):
        response = getattr(link, "response", None)
        if isinstance(response, dict) and "Error" in response:
            code = str(response.get("Error", {}).get("Code") or "")
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            return code, int(status)
    return "", 0


def status_text(status: int) -> str:
    """`HTTP 404 Not Found`: the standard phrase, never the reason the server sent (the
    agent's HTTP downloads say it in the same words)."""
    try:
        return f"HTTP {status} {http.HTTPStatus(status).phrase}"
    except ValueError:
        return f"HTTP {status}"


def retryable_status(status: int) -> bool:
    """Whether another attempt may get another answer: a server error, a timeout, throttling."""
    return status >= 500 or status in (408, 429)


def _endpoint(exc: BaseException) -> str:
    """scheme://host[:port] of the endpoint a botocore connection error names."""
    for link in _chain(exc):
        url = (getattr(link, "kwargs", None) or {}).get("endpoint_url")
        if url:
            parts = urlsplit(str(url))
            return f" {parts.scheme}://{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return ""


def failure(exc: BaseException, scheme: str = "s3") -> RemoteError:
    """`exc`, raised by s3fs, botocore, fsspec or requests reading a `scheme` URL, as a
    RemoteError whose message is ours: what happened and what to check, never the server's
    text (an S3 message, a namenode's RemoteException, a reason phrase), never a credential."""
    if isinstance(exc, RemoteError):
        return exc
    if isinstance(exc, hadoop.HadoopError):  # already in our words
        return RemoteError(
            str(exc), missing=exc.missing, retryable=exc.retryable, denied=exc.denied
        )
    code, status = _s3_error(exc)
    response = getattr(exc, "response", None)  # requests' HTTPError
    if not status and isinstance(getattr(response, "status_code", None), int):
        status = int(response.status_code)  # type: ignore[union-attr]
    if code == "NoSuchBucket":
        return RemoteError("the bucket does not exist")
    if isinstance(exc, FileNotFoundError) or code == "NoSuchKey" or status == 404:
        return RemoteError("not found", missing=True)
    if isinstance(exc, PermissionError) or status in (401, 403):
        if scheme == "webhdfs":
            return RemoteError(
                "access denied (check the user, webhdfs://<user>@<namenode>:<port>/<path>, and "
                "the HDFS permissions)",
                denied=True,
            )
        return RemoteError(f"access denied ({CREDENTIALS}, and the permissions)", denied=True)
    if _named(exc, "NoCredentialsError", "PartialCredentialsError", "NoAuthTokenError"):
        return RemoteError(f"no S3 credentials found ({CREDENTIALS})", denied=True)
    if _named(exc, "FSTimeoutError", "TimeoutError", "Timeout", "ReadTimeoutError",
              "ConnectTimeoutError"):  # fmt: skip
        return RemoteError("timed out", retryable=True)
    if _named(exc, "EndpointConnectionError", "ConnectionClosedError", "ProxyConnectionError"):
        return RemoteError(f"cannot connect to the S3 endpoint{_endpoint(exc)}", retryable=True)
    if _named(exc, "ConnectionResetError", "BrokenPipeError", "ServerDisconnectedError",
              "ChunkedEncodingError", "IncompleteRead", "ClientPayloadError"):  # fmt: skip
        return RemoteError("the connection was lost", retryable=True)
    if _named(exc, "ConnectionError", "ConnectionRefusedError", "ClientConnectorError"):
        return RemoteError("cannot connect", retryable=True)
    if status:
        return RemoteError(status_text(status), retryable=retryable_status(status))
    if isinstance(exc, ValueError) and _named(exc, "JSONDecodeError"):
        return RemoteError("the answer is not what the protocol says (not JSON)")
    if isinstance(exc, (ValueError, RuntimeError)):
        return RemoteError(f"the server refused the request ({type(exc).__name__})")
    return RemoteError(f"failed ({type(exc).__name__})", retryable=True)
