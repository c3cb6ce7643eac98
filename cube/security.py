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
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

if TYPE_CHECKING:  # aiohttp is the agent's and transfer's extra, not the SDK's
    from aiohttp import web

LOOPBACK_NAMES = ("localhost", "ip6-localhost")
AUTH_METADATA = "authorization"


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
    token: str,
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


def _control_allowed(host: str, token: str, insecure: bool) -> bool:
    """The token rule: control is open to callers with a token, or without one on loopback
    or with --insecure."""
    return bool(token) or insecure or is_loopback(host)


def control_refusal(
    host: str, token: str, insecure: bool, given: str | None
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


def token_matches(given: str | None, expected: str) -> bool:
    """Constant-time comparison; an empty expected token means auth is off."""
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
    token: str,
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


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """gRPC call metadata carrying `token` (nothing when there is none)."""
    return ((AUTH_METADATA, f"Bearer {token}"),) if token else ()


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


def server_context(files: TLSFiles) -> ssl.SSLContext:
    """TLS for a socket server (the TCP lane, aiohttp)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(files.cert, files.key)
    except (OSError, ssl.SSLError) as exc:
        raise SecurityError(f"TLS certificate {files.cert} / key {files.key}: {exc}") from exc
    return context


def client_context(ca: str) -> ssl.SSLContext:
    """TLS for a socket client that trusts `ca` (the system's CAs when empty)."""
    try:
        context = ssl.create_default_context(cafile=ca or None)
    except (OSError, ssl.SSLError) as exc:
        raise SecurityError(f"TLS CA bundle {ca}: {exc}") from exc
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def grpc_server_credentials(files: TLSFiles) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials([(read_pem(files.key), read_pem(files.cert))])


def grpc_channel_credentials(ca: str) -> grpc.ChannelCredentials:
    """Credentials that trust `ca` (the system's CAs when empty)."""
    return grpc.ssl_channel_credentials(root_certificates=read_pem(ca) if ca else None)
