"""Who may talk to a port: the rules every Cube process applies (docs/SECURITY.md).

- A control plane (cube-server's control port, cube-agent, cube-transfer's API) that listens
  beyond loopback needs a token, unless the operator says `--insecure` (`require_token`).
- Tokens travel as `Authorization: Bearer <token>` (HTTP; or a POST body's `token` field,
  `token_middleware` for the agent and the transfer) or the `authorization` gRPC metadata and
  are compared in constant time (`token_matches`). Whether one control call is answered is
  `control_refusal`, for every transport that carries control.
- TLS is optional and configured with PEM files: `server_context`, `client_context` for
  sockets (the TCP lane, aiohttp), `grpc_server_credentials` / `grpc_channel_credentials` for
  gRPC. Errors name the file at fault.
- Files that are renewed under a running process (a Kubernetes Secret volume swaps its
  `..data` symlink) are read again when they change, for new connections and calls:
  `Reloading` (a value made from files, re-made when a stat says they changed, at most once a
  second), used by `ServerTLS` (a server's certificate and key, for sockets and gRPC),
  `TrustedCA` (a client's CA bundle) and `Token` (a token given, or in a file).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import os
import ssl
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

import grpc

if TYPE_CHECKING:  # aiohttp is the agent's and transfer's extra, not the SDK's
    from aiohttp import web

LOOPBACK_NAMES = ("localhost", "ip6-localhost")
AUTH_METADATA = "authorization"
log = logging.getLogger("cube.security")


class SecurityError(ValueError):
    """A configuration that would expose a control plane, or TLS files that cannot be used."""


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps a port on this machine ("" and 0.0.0.0 do not)."""
    name = host.strip().strip("[]").lower()
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def require_token(
    what: str,
    host: str,
    token: TokenLike,
    insecure: bool,
    token_flag: str,
    insecure_flag: str = "pass --insecure",
) -> None:
    """Refuse to expose a control plane without a token: `what` listens on `host`.
    `token_flag` and `insecure_flag` say how this command takes a token or runs without."""
    if _control_allowed(host, token, insecure):
        return
    raise SecurityError(
        f"{what} would listen on {host or 'every interface'} without a token: anyone who can"
        f" reach it could command it. Set {token_flag}, or bind 127.0.0.1, or {insecure_flag}"
        " to run without one (docs/SECURITY.md)"
    )


def _control_allowed(host: str, token: TokenLike, insecure: bool) -> bool:
    """The token rule: control is open to callers with a token, or without one on loopback
    or with --insecure."""
    return bool(token) or insecure or is_loopback(host)


def control_refusal(
    host: str, token: TokenLike, insecure: bool, given: str | None
) -> grpc.StatusCode | None:
    """Why one control call on a port bound to `host` is refused (None: answer it), `given`
    being the token the caller sent (None: none). With a `token`, `given` must match it:
    UNAUTHENTICATED otherwise. Without one, control is answered only on loopback or with
    `insecure` (`require_token`'s rule): PERMISSION_DENIED otherwise. The transport says it in
    its own terms (gRPC status, HTTP 401/403, brpc ERPCAUTH) and how to send the token."""
    if token:
        return None if token_matches(given, token) else grpc.StatusCode.UNAUTHENTICATED
    if _control_allowed(host, token, insecure):
        return None
    return grpc.StatusCode.PERMISSION_DENIED


def token_matches(given: str | None, expected: TokenLike) -> bool:
    """Constant-time comparison; an empty expected token means auth is off (a `Token`: any
    of its tokens, `Token.accepts`)."""
    if isinstance(expected, Token):
        return expected.accepts(given)
    if not expected:
        return True
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


def bearer_token(header: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header (any case for the scheme)."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


FORM_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data")


async def _plain_json(request: web.Request) -> Any:
    return json.loads(await request.read())


async def body_token(
    request: web.Request, json_body: Callable[[web.Request], Awaitable[Any]] = _plain_json
) -> str:
    """The `token` field of a POST body (a form, or a JSON object read by `json_body`, which
    may keep what it parsed for the handler); "" when there is none. A body that does not
    parse carries no token: its sender learns nothing about it before authenticating."""
    if request.method != "POST" or not request.body_exists:
        return ""
    if request.content_type in FORM_TYPES:
        token = (await request.post()).get("token")
    else:
        try:
            body = await json_body(request)
        except ValueError:
            return ""
        token = body.get("token") if isinstance(body, dict) else None
    return token.strip() if isinstance(token, str) else ""


def token_middleware(
    token: TokenLike,
    refusal: Callable[[], web.StreamResponse],
    public: Callable[[web.Request], bool] = lambda request: False,
    json_body: Callable[[web.Request], Awaitable[Any]] = _plain_json,
) -> Callable[..., Awaitable[web.StreamResponse]]:
    """The aiohttp middleware of an HTTP control plane (cube-agent, cube-transfer's API): with
    a `token`, a request that is not `public` passes only with `Authorization: Bearer <token>`
    or, in a POST body, a `token` field; anything else gets `refusal()` (401)."""
    from aiohttp import web

    @web.middleware
    async def check_token(
        request: web.Request,
        handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    ) -> web.StreamResponse:
        if not token or public(request):
            return await handler(request)
        if token_matches(bearer_token(request.headers.get("Authorization")), token):
            return await handler(request)
        if token_matches(await body_token(request, json_body) or None, token):
            return await handler(request)
        return refusal()

    return check_token


def bearer_metadata(token: TokenLike) -> tuple[tuple[str, str], ...]:
    """gRPC call metadata carrying `token` (nothing when there is none); a `Token`'s as it is
    now: make it for each call."""
    value = token.value if isinstance(token, Token) else token
    return ((AUTH_METADATA, f"Bearer {value}"),) if value else ()


def token_from(value: str, env: str) -> str:
    """A flag's token, else the environment variable's (tokens stay out of `ps` that way)."""
    return value or os.environ.get(env, "")


# ---------------------------------------------------------------------------------------------
# TLS


@dataclass(frozen=True)
class TLSFiles:
    """PEM files of one process: its certificate and key (to serve TLS) and the CA bundle it
    trusts (to verify servers it calls). Empty strings: not used."""

    cert: str = ""
    key: str = ""
    ca: str = ""

    @property
    def serves(self) -> bool:
        return bool(self.cert)

    def check(self, flags: str = "--tls_cert/--tls_key") -> None:
        if bool(self.cert) != bool(self.key):
            raise SecurityError(f"{flags}: a certificate needs its key and the other way round")
        for path in (self.cert, self.key, self.ca):
            if path:
                read_pem(path)


def read_pem(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(1 << 20)
    except OSError as exc:
        raise SecurityError(f"TLS file {path}: {exc.strerror or exc}") from exc
    if b"-----BEGIN " not in data:
        raise SecurityError(f"TLS file {path}: not a PEM file (no -----BEGIN line)")
    return data


def _server_context(files: TLSFiles) -> ssl.SSLContext:
    """A socket server's TLS context with the certificate and key as the files hold them now
    (OpenSSL checks that the key is the certificate's)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(files.cert, files.key)
    except (OSError, ssl.SSLError) as exc:
        raise SecurityError(f"TLS certificate {files.cert} / key {files.key}: {exc}") from exc
    return context


def server_context(files: TLSFiles) -> ssl.SSLContext:
    """TLS for a socket server (the TCP lane, aiohttp), renewed certificates included
    (`ServerTLS.context`)."""
    return ServerTLS(files).context()


def client_context(ca: str) -> ssl.SSLContext:
    """TLS for a socket client that trusts `ca` (the system's CAs when empty), as the file is
    now (`TrustedCA` follows it)."""
    try:
        context = ssl.create_default_context(cafile=ca or None)
    except (OSError, ssl.SSLError) as exc:
        raise SecurityError(f"TLS CA bundle {ca}: {exc}") from exc
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def grpc_server_credentials(files: TLSFiles) -> grpc.ServerCredentials:
    """gRPC server credentials that serve renewed certificates (`ServerTLS.grpc_credentials`);
    one port's: each port needs its own."""
    return ServerTLS(files).grpc_credentials()


def grpc_channel_credentials(ca: str) -> grpc.ChannelCredentials:
    """Credentials that trust `ca` (the system's CAs when empty), as the file is now."""
    return grpc.ssl_channel_credentials(root_certificates=read_pem(ca) if ca else None)


# ---------------------------------------------------------------------------------------------
# Files renewed under a running process

RELOAD_CHECK_S = 1.0  # files are stat'ed at most this often (per Reloading)
MAX_TOKEN_FILE = 64 << 10

T = TypeVar("T")
Clock = Callable[[], float]
Stat = Callable[[str], os.stat_result]


def file_signature(path: str, stat: Stat = os.stat) -> tuple[Any, ...] | None:
    """What changes when `path` is rewritten or swapped: the file it leads to (symlinks
    followed: a Kubernetes Secret volume's `tls.crt -> ..data/tls.crt`, `..data -> ..<time>`),
    its size and times. None: it cannot be stat'ed now."""
    try:
        st = stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class Reloading(Generic[T]):
    """A value made from files by `load`, made again when they change, for whatever uses it
    next (a new connection, a new call): what a process does with certificates, keys, CA
    bundles and tokens that are renewed under it.

    A Kubernetes Secret volume is renewed by writing a new timestamped directory and renaming
    a new `..data` symlink over the old one; other tools rewrite files. Either way the files'
    signatures (`file_signature`) change. `current()` stats them when `interval` seconds have
    passed since the last look (one clock read otherwise; the first caller after that does
    it, the others do not wait) and loads them again when they changed. A load that fails
    (a half-written or mismatched pair) keeps the value before, with one warning per state of
    the files; a load during which the files changed again is not used (tried again at the
    next look). The first load happens in the constructor: its errors are the caller's."""

    def __init__(
        self,
        what: str,
        paths: Sequence[str],
        load: Callable[[], T],
        *,
        interval: float = RELOAD_CHECK_S,
        clock: Clock = time.monotonic,
        stat: Stat = os.stat,
    ) -> None:
        self.what = what
        self.paths = tuple(paths)
        self._load, self._interval, self._clock, self._stat = load, interval, clock, stat
        self._lock = threading.Lock()
        seen = self._signature()
        self._state: tuple[int, T] = (0, load())  # (generation, value): replaced as one
        self._seen = seen  # the files' signature when the value was made (or last tried)
        self._next = clock() + interval

    def _signature(self) -> tuple[tuple[Any, ...] | None, ...]:
        return tuple(file_signature(path, self._stat) for path in self.paths)

    def current(self) -> T:
        """The value from the files as they were at the last look (looking again when due)."""
        if self._clock() >= self._next:
            self.check()
        return self._state[1]

    def state(self) -> tuple[int, T]:
        """(generation, value): the generation counts the reloads (0: as first loaded)."""
        if self._clock() >= self._next:
            self.check()
        return self._state

    @property
    def generation(self) -> int:
        return self.state()[0]

    def check(self) -> bool:
        """Look at the files now and load them again if they changed; whether the value
        changed. Another thread looking meanwhile: False at once."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            self._next = self._clock() + self._interval
            before = self._signature()
            if before == self._seen:
                return False
            failure = ""
            try:
                value = self._load()
            except (SecurityError, OSError, ssl.SSLError, ValueError) as exc:
                failure = str(exc) or type(exc).__name__
            if self._signature() != before:
                return False  # changing as we read: the next look tries again
            self._seen = before
            if failure:
                log.warning(
                    "%s changed but cannot be used, the one before stays in use: %s",
                    self.what,
                    failure,
                )
                return False
            self._state = (self._state[0] + 1, value)
            log.info("%s changed: reloaded, new connections and calls use it", self.what)
            return True
        finally:
            self._lock.release()


@dataclass(frozen=True)
class _Pair:
    """A server's certificate and key, read together: a context for sockets, the PEM bytes
    for gRPC."""

    context: ssl.SSLContext
    cert: bytes
    key: bytes


class ServerTLS:
    """A server's certificate and key (`files.cert`, `files.key`), followed as they are
    renewed: each new connection is handshaken with the pair the files held at the last look
    (at most `interval` seconds old); connections in flight keep theirs. A pair that does not
    load (a key that is not the certificate's, a half-written file) is not used: the one
    before keeps serving (`Reloading`)."""

    def __init__(
        self,
        files: TLSFiles,
        *,
        interval: float = RELOAD_CHECK_S,
        clock: Clock = time.monotonic,
        stat: Stat = os.stat,
    ) -> None:
        self.files = files

        def load() -> _Pair:
            cert, key = read_pem(files.cert), read_pem(files.key)
            return _Pair(_server_context(files), cert, key)

        what = f"TLS certificate {files.cert} / key {files.key}"
        self.pair = Reloading(
            what, (files.cert, files.key), load, interval=interval, clock=clock, stat=stat
        )
        self._base: ssl.SSLContext | None = None

    def context(self) -> ssl.SSLContext:
        """The context of socket servers (the TCP lane, aiohttp): every handshake switches to
        the newest pair's context, from the server-name callback OpenSSL calls on each
        ClientHello (also without a server name). The same one for every caller."""
        if self._base is None:
            base = self.pair.current().context
            pair = self.pair

            def newest(conn: ssl.SSLObject | ssl.SSLSocket, name: str | None, _: Any) -> None:
                context = pair.current().context
                if context is not conn.context:
                    conn.context = context

            base.sni_callback = newest
            self._base = base
        return self._base

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """Credentials for one gRPC port (each port needs its own: gRPC asks them for a new
        configuration on a new handshake, and a port that missed one would keep the old)."""
        generation, pair = self.pair.state()
        served = [generation]

        def configuration(pair: _Pair) -> grpc.ServerCertificateConfiguration:
            return grpc.ssl_server_certificate_configuration([(pair.key, pair.cert)])

        def fetch() -> grpc.ServerCertificateConfiguration | None:
            generation, pair = self.pair.state()
            if generation == served[0]:
                return None
            served[0] = generation
            return configuration(pair)

        # (the stubs say the fetcher never returns None; gRPC reads None as "no change")
        fetcher = cast(Callable[[], grpc.ServerCertificateConfiguration], fetch)
        return grpc.dynamic_ssl_server_credentials(configuration(pair), fetcher, False)


@dataclass(frozen=True)
class _Trust:
    context: ssl.SSLContext
    pem: bytes | None  # None: the system's CAs


class TrustedCA:
    """The CA bundle a client trusts (`ca`; "" for the system's CAs), followed as it is
    renewed: new connections verify against the bundle the file held at the last look (a
    CA rotation first adds the new CA to the bundle, then issues certificates from it, then
    drops the old one). A bundle that does not load keeps the one before (`Reloading`)."""

    def __init__(
        self,
        ca: str,
        *,
        interval: float = RELOAD_CHECK_S,
        clock: Clock = time.monotonic,
        stat: Stat = os.stat,
    ) -> None:
        self.ca = ca

        def load() -> _Trust:
            if not ca:
                return _Trust(client_context(""), None)
            pem = read_pem(ca)
            try:
                context = ssl.create_default_context(cadata=pem.decode("ascii", "replace"))
            except (ssl.SSLError, ValueError) as exc:
                raise SecurityError(f"TLS CA bundle {ca}: {exc}") from exc
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            return _Trust(context, pem)

        paths = (ca,) if ca else ()
        self.trust = Reloading(
            f"TLS CA bundle {ca}", paths, load, interval=interval, clock=clock, stat=stat
        )

    def context(self) -> ssl.SSLContext:
        """The client context for a new connection (the same object until the file changes)."""
        return self.trust.current().context

    def credentials(self) -> grpc.ChannelCredentials:
        """gRPC channel credentials trusting the bundle as it is now (a channel keeps its
        credentials: `generation` says when to open new channels)."""
        return grpc.ssl_channel_credentials(root_certificates=self.trust.current().pem)

    @property
    def generation(self) -> int:
        return self.trust.generation


def _read_tokens(path: str) -> tuple[str, ...]:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_TOKEN_FILE + 1)
    except OSError as exc:
        raise SecurityError(f"token file {path}: {exc.strerror or exc}") from exc
    if len(data) > MAX_TOKEN_FILE:
        raise SecurityError(f"token file {path}: over {MAX_TOKEN_FILE} bytes")
    try:
        lines = data.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        raise SecurityError(f"token file {path}: not UTF-8 text") from None
    tokens = tuple(line.strip() for line in lines if line.strip())
    if not tokens:
        raise SecurityError(f"token file {path}: no token in it")
    if any(not token.isprintable() or " " in token for token in tokens):
        raise SecurityError(f"token file {path}: a token with spaces or control characters")
    return tokens


class Token:
    """A control plane's shared secret: `value` as given (a flag, an environment variable),
    or the tokens of the file `path`, one a line, read again when the file changes
    (`Reloading`: a mounted Secret renewed under the process). The first token is the one
    sent (`value`), every one is accepted (`accepts`): so a token is rotated without a
    refused call by writing `old` + `new`, then `new` + `old`, then `new` alone, each one
    everywhere before the next (docs/SECURITY.md). No token: auth off (false)."""

    def __init__(
        self,
        value: str = "",
        path: str = "",
        *,
        interval: float = RELOAD_CHECK_S,
        clock: Clock = time.monotonic,
        stat: Stat = os.stat,
    ) -> None:
        if value and path:
            raise SecurityError(f"a token and a token file ({path}): give one")
        self.path = path
        self._given = (value,) if value else ()
        self._file: Reloading[tuple[str, ...]] | None = None
        if path:
            load: Callable[[], tuple[str, ...]] = lambda: _read_tokens(path)  # noqa: E731
            what = f"token file {path}"
            self._file = Reloading(what, (path,), load, interval=interval, clock=clock, stat=stat)

    def __bool__(self) -> bool:
        return bool(self._given) or self._file is not None

    def __repr__(self) -> str:  # never the secret
        return f"Token(path={self.path!r})" if self.path else f"Token(given={bool(self._given)})"

    def tokens(self) -> tuple[str, ...]:
        return self._file.current() if self._file is not None else self._given

    @property
    def value(self) -> str:
        """The token to send ("" for none)."""
        tokens = self.tokens()
        return tokens[0] if tokens else ""

    def accepts(self, given: str | None) -> bool:
        """Whether `given` is one of the tokens, compared in constant time with each; true
        for anything when there is no token."""
        tokens = self.tokens()
        if not tokens:
            return True
        if given is None:
            return False
        sent = given.encode()
        matched = False
        for token in tokens:
            matched |= hmac.compare_digest(sent, token.encode())
        return matched


TokenLike = str | Token


def token_of(value: str, path: str, env: str) -> Token:
    """A command's token: its flag's `value`, else the file `path` (read again when it
    changes), else the environment variable `env`'s value (tokens stay out of `ps` either
    way). A value and a file together are refused."""
    if value and path:
        raise SecurityError(f"a token and a token file ({path}): give one")
    if path:
        return Token(path=path)
    return Token(value or os.environ.get(env, ""))
