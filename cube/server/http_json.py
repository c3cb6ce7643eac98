"""The original cube-server's HTTP+JSON face, on a port of its own (`--http_port`).

    POST /DictService/seek      {"keys": [...], "version_required": bool, "table": str}
    POST /ControlService/cmd    {"cmd": ..., "version_path": ..., "version": ...}

These are the requests the original's Python and Go demo clients, curl and the original
cube-agent send to brpc's HTTP port (the bodies: cube.server.original). As brpc does, the
paths also take a service's full name (`/rec.mcube.DictService/seek`), and a seek body is
JSON whatever its Content-Type (curl -d sends form-urlencoded) except `application/proto` (or
`application/x-protobuf`): the DictRequest's protobuf bytes, answered with DictResponse
bytes.

Lookups go through the same `SeekService.answer_original` as rec.mcube.DictService over gRPC
(counted under api="http"); a refusal is an HTTP status with a one-line text body:
400 a bad body (the message names the field; it never repeats what was sent), too many keys
(--max_batch) or an answer over --max_answer_bytes; 413 a body over the byte bound (derived
from --max_batch); 503 a replica that cannot serve (never silent misses).

Control runs the same commands as the control port (cube.server.control), under the same rule
(`cube.security.control_refusal`): with --control_token every call needs
`Authorization: Bearer <token>` (401 without); without one, control is answered only when this
port is bound to loopback or with --insecure (403 otherwise: the lookup port must not let
whoever reaches it switch versions). Answers are 200 with {"cur_version", "bg_version",
"status"} (+ "message"), as the original cube-agent reads them; a failed command is 4xx/5xx
with the reason as text (the original answered 500).

Bounds, the worker's `Bounds` shared with the TCP lane and baidu_std (cube.server.bounds):
at most --lane_max_connections connections per worker (the next, when none waits idle to make
room for it, is answered 503 and closed);
a request body is charged against --lane_budget_bytes before it is read, by its
Content-Length (a chunked body: by the byte bound), until its answer is built (503 when the
budget is spent); a body that makes no progress for --lane_stall_timeout, or is not whole
within --lane_request_timeout, is answered 408 and its connection closed, as is a connection
holding part of a request, or answers its peer does not read, that long. A connection that
sends nothing for --lane_idle_timeout after it connected or was last answered is closed, and
one of them makes room when the worker has its most connections (cube.idle). aiohttp serves
the protocol: each connection goes through an `HttpConnection`, which counts it, what it has
not sent and how long it has waited.
"""

from __future__ import annotations

import asyncio
import logging
import ssl as ssl_module
import time
from collections.abc import Awaitable, Callable

import grpc
from aiohttp import web

from cube.idle import Waiting
from cube.security import TokenLike, bearer_token, control_refusal
from cube.server.bounds import Bounds
from cube.server.control import ControlError, ControlRunner
from cube.server.original import (
    control_json,
    control_request,
    http_status,
    keys_array,
    seek_json,
    seek_request,
)
from cube.server.service import RequestError, SeekService

log = logging.getLogger("cube.server")

API = "http"  # the metrics' api label
PROTO_TYPES = ("application/proto", "application/x-protobuf")  # as brpc reads Content-Type
_KEY_TEXT = 32  # JSON bytes a key may take in a body ("18446744073709551615", quotes, comma)
_FLUSH = 1.0  # seconds a stop gives answers still being written, after the grace
# After a refusal that left a body unread (413, 408), aiohttp reads on for this long before it
# closes, so that the peer sees the answer rather than a reset; its default, 10 s, let a
# stalled peer keep its connection ten times --lane_stall_timeout's second.
_LINGER = 1.0


def max_body_bytes(max_message: int, max_batch: int) -> int:
    """The most bytes a request body may have: the gRPC message bound, or room for --max_batch
    keys written as JSON, whichever is larger."""
    return max(max_message, max_batch * _KEY_TEXT + (1 << 16))


def _text(status: int, message: str) -> web.Response:
    return web.Response(status=status, text=message + "\n", content_type="text/plain")


def _closing_text(status: int, message: str) -> web.Response:
    response = _text(status, message)
    response.force_close()
    return response


def status_bytes(status: int, phrase: str, message: str) -> bytes:
    """A whole response with a one-line text body, written to a connection aiohttp does not
    answer (refused before it sends anything, or closed before its request came whole)."""
    text = f"{message}\n".encode()
    head = (
        f"HTTP/1.1 {status} {phrase}\r\nContent-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(text)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + text


class HttpConnection(asyncio.Protocol):
    """One HTTP connection as the worker's `Bounds` see it, in front of aiohttp's own
    protocol (`handler`), to which it passes everything: it counts the connection against
    the limit, samples the bytes its transport has not sent, tells the watchdog when it
    stalls and the idle policy (cube.idle) how long it has waited for a request: idle after
    connecting or between requests, it is closed after --lane_idle_timeout; a request's
    head not whole within --lane_request_timeout of its first byte is answered 408."""

    kind = "http"
    buffer = b""  # never held back by the bounds (Bounds.resume_held skips it)

    def __init__(self, face: HttpFace, handler: web.RequestHandler) -> None:
        self.face = face
        self.bounds = face.bounds
        self.handler = handler
        self.transport: asyncio.Transport | None = None
        self.refused = False
        self.unsent = 0  # sampled by the watchdog
        self.counted = 0
        now = time.monotonic()
        self.sent_at = now  # the last progress of the answers being written
        self.data_at = 0.0  # when bytes last came in
        self.read_at = now  # when the request being handled had come in whole
        self.idle_since = now  # no request being handled since (its bytes all read)
        self.request_from = now  # the first byte of the request coming
        self.answered_at = now  # connected, or the last request's handler ended
        self.busy = 0  # requests being handled

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        reason = self.bounds.admit(self)
        if reason is not None:
            self.refused = True
            self.transport.write(  # type: ignore[union-attr]
                status_bytes(503, "Service Unavailable", f"HTTP: {reason}")
            )
            transport.close()
            return
        self.face.tracked[transport] = self
        self.handler.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self.refused:
            now = time.monotonic()
            if self.data_at <= self.read_at:  # the first bytes since a request was read
                self.request_from = now
            self.data_at = now
            self.handler.data_received(data)

    def eof_received(self) -> None:  # None: the transport closes itself
        if not self.refused:
            self.handler.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.bounds.leave(self)
        self.face.tracked.pop(self.transport, None)
        self.unsent = 0
        self._account()
        if not self.refused:
            self.handler.connection_lost(exc)

    def pause_writing(self) -> None:
        if not self.refused:
            self.handler.pause_writing()

    def resume_writing(self) -> None:
        if not self.refused:
            self.handler.resume_writing()

    def _account(self) -> None:
        self.bounds.total_bytes += self.unsent - self.counted
        self.counted = self.unsent

    def watch(self, now: float) -> None:
        """The watchdog's round: sample unsent bytes; close the connection when a request
        came in part and stopped, or its answers are not read, for the stall timeout."""
        transport = self.transport
        if transport is None or self.refused:
            return
        unsent = transport.get_write_buffer_size()
        if unsent < self.unsent or not self.unsent:
            self.sent_at = now
        self.unsent = unsent
        self._account()
        stall = self.face.stall_timeout
        if unsent and now - self.sent_at > stall:
            what = f"{unsent} bytes of answers not read"
        elif not self.busy and self.data_at > self.idle_since and now - self.data_at > stall:
            what = "a request cut short"
        else:
            return
        log.warning("HTTP: closing a connection stalled for over %.0f s (%s)", stall, what)
        transport.abort()

    def waiting(self) -> Waiting | None:
        """For the idle policy (cube.idle): since when it has waited for a request (part of
        one came: since its first byte), or None while a request is handled or answered."""
        transport = self.transport
        if self.refused or self.busy or self.unsent or transport is None:
            return None
        if transport.is_closing():
            return None
        if self.data_at > self.idle_since:
            return Waiting(self.request_from, partial=True)
        return Waiting(self.answered_at)

    def expire(self, reason: str, slow: bool = False) -> None:
        """Close the connection for the idle policy; one part-way through a request's head
        is told why first (408 when it was too slow to send it, else 503)."""
        transport = self.transport
        if transport is None:
            return
        if self.data_at > self.idle_since:
            status, phrase = (408, "Request Timeout") if slow else (503, "Service Unavailable")
            transport.write(status_bytes(status, phrase, f"HTTP: {reason}"))
        transport.close()


class HttpFace:
    """The HTTP+JSON listener of one worker."""

    def __init__(
        self,
        service: SeekService,
        control: ControlRunner,
        *,
        host: str,
        token: TokenLike,
        insecure: bool,
        max_body: int,
        bounds: Bounds,
    ) -> None:
        self.service = service
        self.control = control
        self.host = host
        self.token = token
        self.insecure = insecure
        self.max_body = max_body
        self.bounds = bounds
        self.stall_timeout = bounds.limits.stall_timeout
        self.request_timeout = bounds.limits.request_timeout
        self.tracked: dict[object, HttpConnection] = {}  # by transport
        self.runner: web.AppRunner | None = None
        self.listener: asyncio.Server | None = None
        self.port = 0

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body, middlewares=[self._track])
        for prefix in ("", "rec.mcube."):
            app.router.add_post(f"/{prefix}DictService/seek", self.seek)
            app.router.add_post(f"/{prefix}ControlService/cmd", self.cmd)
        return app

    @web.middleware
    async def _track(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Whether a connection is handling a request (then it is not stalled in one)."""
        connection = self.tracked.get(request.transport)
        if connection is None:
            return await handler(request)
        connection.busy += 1
        connection.read_at = time.monotonic()
        try:
            return await handler(request)
        finally:
            connection.busy -= 1
            connection.idle_since = connection.read_at
            connection.answered_at = time.monotonic()

    # -- request bodies ------------------------------------------------------------------

    def _charge(self, request: web.Request, what: str) -> int | RequestError:
        """Charge the body's bytes to the worker's budget before it is read: its
        Content-Length, or the byte bound when it is chunked."""
        if not request.body_exists:
            return 0
        size = request.content_length
        if size is not None and size > self.max_body:
            return self._too_large(what)
        charge = self.max_body if size is None else size
        if not self.bounds.charge(charge):
            return RequestError(
                grpc.StatusCode.UNAVAILABLE,
                f"{what}: the server's buffers are full (--lane_budget_bytes); retry on another"
                " replica",
            )
        return charge

    def _too_large(self, what: str) -> RequestError:
        return RequestError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{what}: the body exceeds this server's {self.max_body} bytes (set by"
            " --max_batch): split the batch",
        )

    async def _read(self, request: web.Request, what: str) -> bytes | RequestError:
        """The body, unless it passes the byte bound, stops coming for the stall timeout or
        is not whole within the request timeout (a drip)."""
        content = request.content
        parts = []
        size = 0
        loop = asyncio.get_running_loop()
        stall, whole = self.stall_timeout, loop.time() + self.request_timeout
        try:
            async with asyncio.timeout_at(min(loop.time() + stall, whole)) as timer:
                while True:
                    chunk = await content.readany()
                    if not chunk:
                        break
                    size += len(chunk)
                    if size > self.max_body:
                        return self._too_large(what)
                    parts.append(chunk)
                    timer.reschedule(min(loop.time() + stall, whole))
        except TimeoutError:
            if loop.time() >= whole:
                why = f"did not come whole within {self.request_timeout:g} s"
                flag = "--lane_request_timeout"
            else:
                why, flag = f"stopped coming for {stall:g} s", "--lane_stall_timeout"
            log.warning("HTTP: a body %s; connection closed", why)
            return RequestError(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"{what}: the body {why} ({flag})"
            )
        connection = self.tracked.get(request.transport)
        if connection is not None:
            connection.read_at = time.monotonic()
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def _body(self, request: web.Request, what: str, charged: int) -> bytes | RequestError:
        return await self._read(request, what) if charged else b""

    # -- DictService/seek ----------------------------------------------------------------

    async def seek(self, request: web.Request) -> web.Response:
        charged = self._charge(request, "seek")
        if isinstance(charged, RequestError):
            self.service.refused(API, charged)
            return _closing_text(http_status(charged.code, body=True), charged.message)
        proto = request.content_type in PROTO_TYPES
        try:
            body = await self._body(request, "seek", charged)
            if isinstance(body, RequestError):
                self.service.refused(API, body)
                return _closing_text(http_status(body.code, body=True), body.message)
            try:
                answer = self.service.timed(API, lambda: self._seek(body, proto))
            except RequestError as exc:  # counted and logged by `timed`
                return _text(http_status(exc.code), exc.message)
        finally:
            self.bounds.release(charged)
        answer_type = request.content_type if proto else "application/json"
        return web.Response(body=answer, content_type=answer_type)

    def _seek(self, body: bytes, proto: bool) -> bytes:
        service = self.service
        if proto:
            return service.seek_original(body, API)
        items, version_required, table = seek_request(body)
        service.check_key_count(len(items), "seek")
        answer, name = service.answer_original(keys_array(items), API, table)
        return seek_json(answer, name if version_required else None)

    # -- ControlService/cmd --------------------------------------------------------------

    def control_refused(self, request: web.Request) -> web.Response | None:
        """The token rule (cube.security.control_refusal) as 401 or 403."""
        given = bearer_token(request.headers.get("Authorization"))
        code = control_refusal(self.host, self.token, self.insecure, given)
        if code is None:
            return None
        if code == grpc.StatusCode.UNAUTHENTICATED:
            response = _text(
                401,
                "ControlService/cmd needs 'Authorization: Bearer <token>' (cube-server"
                " --control_token)",
            )
            response.headers["WWW-Authenticate"] = "Bearer"
            return response
        return _text(
            403,
            f"ControlService/cmd is not served on {self.host}: beyond loopback it needs"
            " cube-server --control_token (or --insecure)",
        )

    async def cmd(self, request: web.Request) -> web.Response:
        refusal = self.control_refused(request)
        if refusal is not None:
            return refusal
        charged = self._charge(request, "ControlService/cmd")
        if isinstance(charged, RequestError):
            return _closing_text(http_status(charged.code, body=True), charged.message)
        try:
            body = await self._body(request, "ControlService/cmd", charged)
        finally:
            self.bounds.release(charged)  # a command's JSON is small; a load takes minutes
        if isinstance(body, RequestError):
            return _closing_text(http_status(body.code, body=True), body.message)
        try:
            command = control_request(body)
            response = await self.control.run(command)
        except (RequestError, ControlError) as exc:
            return _text(http_status(exc.code), exc.message)
        return web.Response(body=control_json(response), content_type="application/json")

    # -- the listener --------------------------------------------------------------------

    async def start(self, port: int, ssl: ssl_module.SSLContext | None = None) -> int:
        """Listen on host:port (0: any free port); returns the bound port. OSError when the
        port cannot be bound."""
        runner = web.AppRunner(
            self.app(), access_log=None, shutdown_timeout=_FLUSH, lingering_time=_LINGER
        )
        await runner.setup()
        handlers = runner.server  # aiohttp's protocol factory
        assert handlers is not None
        try:
            self.listener, self.port = await self.bounds.listen(
                lambda: HttpConnection(self, handlers()), self.host, port, ssl, "--http_port"
            )
        except BaseException:
            await runner.cleanup()
            raise
        self.runner = runner
        refusal = control_refusal(self.host, self.token, self.insecure, None)
        if refusal == grpc.StatusCode.PERMISSION_DENIED:
            log.warning(
                "HTTP port %d: ControlService/cmd refused on %s without --control_token",
                self.port,
                self.host,
            )
        return self.port

    async def stop(self, grace: float) -> None:
        """Stop listening; close idle connections at once, the others once the request they
        handle is answered, waiting at most `grace` seconds (then aiohttp cancels them)."""
        if self.listener is None or self.runner is None:
            return
        self.listener.close()
        self.listener = None
        for connection in list(self.tracked.values()):
            if connection.busy:
                connection.handler.close()  # no more requests: closed once this one ends
            else:
                connection.handler.force_close()  # closed once what it wrote is sent
        deadline = asyncio.get_running_loop().time() + grace
        while self.tracked and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        await self.runner.cleanup()
        self.runner = None
        self.bounds.detach()
