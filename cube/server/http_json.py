"""The original cube-server's HTTP+JSON face, on a port of its own (`--http_port`).

    POST /DictService/seek      {"keys": [...], "version_required": bool}
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

Control runs the same commands as the control port (cube.server.control), under the same rule:
with --control_token every call needs `Authorization: Bearer <token>` (401 without); without
one, control is answered only when this port is bound to loopback or with --insecure (403
otherwise: the lookup port must not let whoever reaches it switch versions). Answers are 200
with {"cur_version", "bg_version", "status"} (+ "message"), as the original cube-agent reads
them; a failed command is 4xx/5xx with the reason as text (the original answered 500).
"""

from __future__ import annotations

import logging
import ssl as ssl_module

import grpc
from aiohttp import web

from cube.security import bearer_token, is_loopback, token_matches
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


def max_body_bytes(max_message: int, max_batch: int) -> int:
    """The most bytes a request body may have: the gRPC message bound, or room for --max_batch
    keys written as JSON, whichever is larger."""
    return max(max_message, max_batch * _KEY_TEXT + (1 << 16))


def _text(status: int, message: str) -> web.Response:
    return web.Response(status=status, text=message + "\n", content_type="text/plain")


class HttpFace:
    """The HTTP+JSON listener of one worker."""

    def __init__(
        self,
        service: SeekService,
        control: ControlRunner | None,
        *,
        host: str,
        token: str,
        insecure: bool,
        max_body: int,
    ) -> None:
        self.service = service
        self.control = control
        self.host = host
        self.token = token
        self.insecure = insecure
        self.max_body = max_body
        self.runner: web.AppRunner | None = None
        self.port = 0

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body)
        for prefix in ("", "rec.mcube."):
            app.router.add_post(f"/{prefix}DictService/seek", self.seek)
            app.router.add_post(f"/{prefix}ControlService/cmd", self.cmd)
        return app

    async def _body(self, request: web.Request, what: str) -> bytes | RequestError:
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            return RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{what}: the body exceeds this server's {self.max_body} bytes (set by"
                " --max_batch): split the batch",
            )

    # -- DictService/seek ----------------------------------------------------------------

    async def seek(self, request: web.Request) -> web.Response:
        body = await self._body(request, "seek")
        if isinstance(body, RequestError):
            self.service.refused(API, body)
            return _text(413, body.message)
        proto = request.content_type in PROTO_TYPES
        try:
            answer = self.service.timed(API, lambda: self._seek(body, proto))
        except RequestError as exc:  # counted and logged by `timed`
            return _text(http_status(exc.code), exc.message)
        answer_type = request.content_type if proto else "application/json"
        return web.Response(body=answer, content_type=answer_type)

    def _seek(self, body: bytes, proto: bool) -> bytes:
        service = self.service
        if proto:
            return service.seek_original(body, API)
        items, version_required = seek_request(body)
        service.check_key_count(len(items), "seek")
        answer, name = service.answer_original(keys_array(items), API)
        return seek_json(answer, name if version_required else None)

    # -- ControlService/cmd --------------------------------------------------------------

    def _control_refusal(self, request: web.Request) -> web.Response | None:
        if self.token:
            given = bearer_token(request.headers.get("Authorization"))
            if token_matches(given, self.token):
                return None
            response = _text(
                401,
                "ControlService/cmd needs 'Authorization: Bearer <token>' (cube-server"
                " --control_token)",
            )
            response.headers["WWW-Authenticate"] = "Bearer"
            return response
        if self.insecure or is_loopback(self.host):
            return None
        return _text(
            403,
            f"ControlService/cmd is not served on {self.host}: beyond loopback it needs"
            " cube-server --control_token (or --insecure)",
        )

    async def cmd(self, request: web.Request) -> web.Response:
        refusal = self._control_refusal(request)
        if refusal is not None:
            return refusal
        if self.control is None:
            return _text(503, "ControlService/cmd: this worker has no control service")
        body = await self._body(request, "ControlService/cmd")
        if isinstance(body, RequestError):
            return _text(413, body.message)
        try:
            command = control_request(body)
            response = await self.control.run(command)
        except (RequestError, ControlError) as exc:
            return _text(http_status(exc.code), exc.message)
        return web.Response(body=control_json(response), content_type="application/json")

    # -- the listener --------------------------------------------------------------------

    async def start(
        self, port: int, ssl: ssl_module.SSLContext | None = None, grace: float = 5.0
    ) -> int:
        """Listen on host:port (0: any free port); returns the bound port. OSError when the
        port cannot be bound."""
        runner = web.AppRunner(self.app(), access_log=None)
        await runner.setup()
        try:
            site = web.TCPSite(
                runner, self.host, port, ssl_context=ssl, shutdown_timeout=grace, backlog=1024
            )
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self.runner = runner
        self.port = int(runner.addresses[0][1])
        if not self.token and not self.insecure and not is_loopback(self.host):
            log.warning(
                "HTTP port %d: ControlService/cmd refused on %s without --control_token",
                self.port,
                self.host,
            )
        return self.port

    async def stop(self, _grace: float = 0.0) -> None:
        """Stop listening; requests in flight get the grace given to `start`."""
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None
