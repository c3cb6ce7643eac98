"""The original cube-server's baidu_std face (brpc's own binary protocol), on a port of its
own (`--baidu_std_port`): what the C++ cube-api, and so Paddle Serving's
general_dist_kv_infer_op, speaks with its default channel options.

Written from brpc's published description of the protocol (docs/cn/baidu_std.md,
src/brpc/policy/baidu_rpc_meta.proto); no brpc peer was available to test against, so the
tests build frames from that description (tests/helpers/brpc_client.py).

A frame, both ways: a 12-byte header, the 4 bytes "PRPC", then the body size and the meta
size as big-endian uint32; then the body: `meta_size` bytes of RpcMeta (proto/baidu_std.proto),
then the message, then `attachment_size` bytes of attachment. A request's meta names the
service and method (`rec.mcube.DictService` or `DictService`, `seek`; `ControlService`, `cmd`)
and a correlation_id, which the response echoes; the response's meta carries error_code (0 or
a brpc errno) and error_text.

- DictService.seek: a rec.mcube.DictRequest in, a DictResponse out, through the same
  `SeekService.seek_original` as gRPC (counted under api="baidu_std"). Refusals are error
  responses: EREQUEST (1003) for a bad request, too many keys or an answer over the byte
  bound, ELOGOFF (2003) for a replica that cannot serve (brpc's default retry policy tries
  another replica on it, as for a stopping server), ENOSERVICE/ENOMETHOD for other names.
  Every refusal is counted in the api="baidu_std" errors (ENOSERVICE and ENOMETHOD as
  UNIMPLEMENTED).
- ControlService.cmd: the original's message is empty and the command is JSON in the
  attachment (as brpc hands an HTTP body to it); the answer is JSON in the response's
  attachment. The token rule of every control transport (`cube.security.control_refusal`):
  with --control_token, the meta's authentication_data must be the token (or
  "Bearer <token>"); without one, control is answered only on a loopback port or with
  --insecure (ERPCAUTH, 1004, otherwise).
- compress_type other than 0 (none) is refused with EREQUEST; an attachment on a seek is
  ignored, as the original ignored it; an attachment_size beyond the body is EREQUEST.

Bounds: a frame's body over `max_frame` bytes (the gRPC message bound, from --max_batch, plus
64 KiB of meta), a meta over 64 KiB or over the body, a meta that does not parse or does not
name a method, or a wrong magic: the connection is closed and nothing is echoed. Everything
else is the worker's `Bounds` (cube.server.bounds), as on the TCP lane: input and unsent
answers count against --lane_budget_bytes with the worker's other connections, a connection
whose answers are not read stops being read past --lane_connection_bytes, one holding part of
a frame (its header included) or unread answers without progress for --lane_stall_timeout is
closed, at most --lane_max_connections connections per worker (the next is closed at once).
A connection idle between frames is left open.
"""

from __future__ import annotations

import asyncio
import logging
import ssl as ssl_module
import struct
import time

import grpc

from cube.idle import Waiting
from cube.pb.baidu_std_pb2 import RpcMeta
from cube.security import TokenLike, bearer_token, control_refusal
from cube.server.bounds import BoundedProtocol, Bounds
from cube.server.control import ControlError, ControlRunner
from cube.server.original import (
    ENOMETHOD,
    ENOSERVICE,
    EREQUEST,
    brpc_error,
    control_json,
    control_request,
)
from cube.server.service import RequestError, SeekService
from cube.wire import Buffer

log = logging.getLogger("cube.server")

API = "baidu_std"  # the metrics' api label
MAGIC = b"PRPC"
HEADER = struct.Struct(">4sII")  # magic, body size, meta size
MAX_META = 64 << 10
_SERVICES = {
    "rec.mcube.DictService": "DictService",
    "DictService": "DictService",
    "rec.mcube.ControlService": "ControlService",
    "ControlService": "ControlService",
}
_METHODS = {"DictService": "seek", "ControlService": "cmd"}


class BadFrame(Exception):
    """A frame that ends its connection (nothing is answered)."""


def response_frame(
    correlation_id: int,
    error_code: int = 0,
    error_text: str = "",
    message: Buffer = b"",
    attachment: Buffer = b"",
) -> list[Buffer]:
    """A response frame as buffers to write in order."""
    meta = RpcMeta(correlation_id=correlation_id, compress_type=0)
    meta.response.error_code = error_code
    if error_text:
        meta.response.error_text = error_text
    if attachment:
        meta.attachment_size = len(attachment)
    raw = meta.SerializeToString()
    size = len(raw) + len(message) + len(attachment)
    return [HEADER.pack(MAGIC, size, len(raw)) + raw, message, attachment]


class BaiduStdProtocol(BoundedProtocol):
    """One baidu_std connection: frames parsed as they arrive (while the worker's bounds
    allow), seeks answered at once, control commands when they end."""

    kind = "baidu_std"
    label = "baidu_std"

    def __init__(self, face: BaiduStdServer) -> None:
        super().__init__(face.bounds)
        self.face = face
        self.max_frame = face.max_frame
        self.commands: set[asyncio.Future[None]] = set()  # control commands under way

    def refuse_connection(self, transport: asyncio.Transport, reason: str) -> None:
        self.face.warn("%s: one closed", reason)  # baidu_std has no frame to say it in

    def waiting(self) -> Waiting | None:
        return None if self.commands else super().waiting()

    def resume(self) -> None:
        if self.closing or self.transport is None:
            return
        if self.buffer and not self.held():
            self._consume(self.buffer)
        else:
            self._update_reading()

    def _consume(self, source: bytes | bytearray) -> None:
        """Answer the whole frames `source` holds, as far as the byte bounds allow; keep the
        rest in the buffer."""
        start, end = 0, len(source)
        copy = not isinstance(source, bytes)  # the buffer is resized: nothing may point in it
        try:
            with memoryview(source) as view:
                while end - start >= HEADER.size and not self.held():
                    magic, body_size, meta_size = HEADER.unpack_from(source, start)
                    if magic != MAGIC:
                        raise BadFrame("a frame without the PRPC magic")
                    if body_size > self.max_frame:
                        raise BadFrame(f"a frame of {body_size} bytes, over {self.max_frame}")
                    if meta_size > body_size or meta_size > MAX_META:
                        raise BadFrame(f"a meta of {meta_size} bytes in a body of {body_size}")
                    stop = start + HEADER.size + body_size
                    if stop > end:
                        break
                    body = view[start + HEADER.size : stop]
                    start = stop
                    if copy:
                        with body:
                            copied = bytes(body)
                        body = memoryview(copied)
                    self._frame(body, meta_size)
        except BadFrame as exc:
            self.face.warn("%s; connection closed", exc)
            self._drop()
            return
        self._keep(source, start)
        if self.over_budget():
            self.face.warn("the worker's --lane_budget_bytes is spent; a connection closed")
            self._drop()
            return
        self._update_reading()

    def _frame(self, view: memoryview, meta_size: int) -> None:
        try:
            meta = RpcMeta.FromString(view[:meta_size])  # type: ignore[arg-type]
        except Exception:  # DecodeError
            raise BadFrame("a meta that does not parse") from None
        if not meta.HasField("request"):
            raise BadFrame("a meta without a request")
        answer = self.face.answer(meta, view[meta_size:], self)
        if answer is not None:
            self.write(answer)

    def write(self, buffers: list[Buffer]) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.writelines(buffers)
            self.progress_at = time.monotonic()
            self.sample_unsent()

    def _drop(self) -> None:
        """Close: what was answered is sent, nothing more is read."""
        self.closing = True
        self.buffer = bytearray()
        self._account()
        self._update_reading()
        self._close()

    def shut(self) -> None:
        """The server stops: read nothing more; close once the commands under way answered."""
        self.closing = True
        self._update_reading()
        if not self.commands:
            self._close()

    def command_done(self, command: asyncio.Future[None]) -> None:
        self.commands.discard(command)
        if self.closing and not self.commands:
            self._close()


class BaiduStdServer:
    """The baidu_std listener of one worker."""

    def __init__(
        self,
        service: SeekService,
        control: ControlRunner,
        *,
        host: str,
        token: TokenLike,
        insecure: bool,
        bounds: Bounds,
        max_frame: int,
    ) -> None:
        self.service = service
        self.control = control
        self.host = host
        self.token = token
        self.insecure = insecure
        self.bounds = bounds
        self.max_frame = max_frame
        self.server: asyncio.Server | None = None
        self.port = 0
        self._warned_at = 0.0

    def warn(self, message: str, *args: object) -> None:
        """A closed connection's reason, logged at most once a second."""
        now = time.monotonic()
        if now - self._warned_at >= 1.0:
            self._warned_at = now
            log.warning("baidu_std: " + message, *args)

    def connections(self) -> list[BaiduStdProtocol]:
        return [c for c in self.bounds.of_kind(BaiduStdProtocol.kind) if c.face is self]

    # -- requests ------------------------------------------------------------------------

    def _refused(
        self, correlation: int, code: grpc.StatusCode, error: int, text: str
    ) -> list[Buffer]:
        """An error response for a frame refused before it reached the service, counted in
        the api="baidu_std" errors under `code`."""
        self.service.refused(API, RequestError(code, text))
        return response_frame(correlation, error, text)

    def answer(
        self, meta: RpcMeta, payload: memoryview, connection: BaiduStdProtocol
    ) -> list[Buffer] | None:
        """The response frame of one request (None: a control command answers later)."""
        correlation = meta.correlation_id
        request = meta.request
        service = _SERVICES.get(request.service_name)
        unimplemented = grpc.StatusCode.UNIMPLEMENTED
        if service is None:
            text = f"no service {request.service_name!r} here"
            return self._refused(correlation, unimplemented, ENOSERVICE, text)
        if request.method_name != _METHODS[service]:
            text = f"no method {request.method_name!r} in {service} (it has {_METHODS[service]})"
            return self._refused(correlation, unimplemented, ENOMETHOD, text)
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        if meta.compress_type:
            text = (
                f"compress_type {meta.compress_type} is not served: send uncompressed requests"
                " (compress_type 0)"
            )
            return self._refused(correlation, invalid, EREQUEST, text)
        attachment = meta.attachment_size if meta.HasField("attachment_size") else 0
        if not 0 <= attachment <= len(payload):
            text = f"attachment_size={attachment} is beyond the request's {len(payload)} bytes"
            return self._refused(correlation, invalid, EREQUEST, text)
        split = len(payload) - attachment
        if service == "ControlService":
            refusal = self.control_refused(meta)
            if refusal is not None:
                return response_frame(correlation, brpc_error(refusal.code), refusal.message)
            command = asyncio.ensure_future(
                self._command(correlation, bytes(payload[split:]), connection)
            )
            connection.commands.add(command)
            command.add_done_callback(connection.command_done)
            return None
        message = payload[:split]
        try:
            answer = self.service.timed(API, lambda: self.service.seek_original(message, API))
        except RequestError as exc:  # counted and logged by `timed`
            return response_frame(correlation, brpc_error(exc.code), exc.message)
        return response_frame(correlation, message=answer)

    def control_refused(self, meta: RpcMeta) -> RequestError | None:
        """The token rule (cube.security.control_refusal) on the meta's
        authentication_data: the token, or "Bearer <token>"."""
        given = meta.authentication_data.decode(errors="replace")
        token = bearer_token(given) or given.strip()
        code = control_refusal(self.host, self.token, self.insecure, token)
        if code is None:
            return None
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return RequestError(
                code, "ControlService.cmd needs the control token as authentication_data"
            )
        return RequestError(
            code,
            f"ControlService.cmd is not served on {self.host}: beyond loopback it needs"
            " cube-server --control_token (or --insecure)",
        )

    async def _command(self, correlation: int, body: bytes, connection: BaiduStdProtocol) -> None:
        """Run a control command in a task of its own and write its answer when it ends (a
        load can take minutes; seeks on the connection go on meanwhile)."""
        try:
            response = await self.control.run(control_request(body))
            frame = response_frame(correlation, attachment=control_json(response))
        except (RequestError, ControlError) as exc:
            frame = response_frame(correlation, brpc_error(exc.code), exc.message)
        connection.write(frame)

    # -- the listener --------------------------------------------------------------------

    async def start(self, port: int, ssl: ssl_module.SSLContext | None = None) -> int:
        """Listen on host:port (0: any free port); returns the bound port."""
        self.server, self.port = await self.bounds.listen(
            lambda: BaiduStdProtocol(self), self.host, port, ssl, "--baidu_std_port"
        )
        return self.port

    async def stop(self, grace: float) -> None:
        """Stop listening and close the connections: at once for those idle or in a frame
        (seeks are answered synchronously, so none is half done), once its answer is written
        for a control command under way, which gets `grace` seconds and is then cancelled."""
        if self.server is None:
            return
        self.server.close()
        self.server = None
        for connection in self.connections():
            connection.shut()
        deadline = asyncio.get_running_loop().time() + grace
        while self.connections() and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        for connection in self.connections():
            for command in list(connection.commands):
                command.cancel()
            if connection.transport is not None:
                connection.transport.abort()
        self.bounds.detach()
