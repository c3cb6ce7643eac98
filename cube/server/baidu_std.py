"""The original cube-server's baidu_std face (brpc's own binary protocol), on a port of its
own (`--baidu_std_port`): what the C++ cube-api, and so Paddle Serving's
general_dist_kv_infer_op, speaks with its default channel options.

Written from brpc's published description of the protocol (docs/cn/baidu_std.md,
src/brpc/policy/baidu_rpc_meta.proto); no brpc peer was available to test against, so the
tests build frames from that description (tests/brpc_client.py).

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
- ControlService.cmd: the original's message is empty and the command is JSON in the
  attachment (as brpc hands an HTTP body to it); the answer is JSON in the response's
  attachment. The same token rule as the HTTP face: with --control_token, the meta's
  authentication_data must be the token (or "Bearer <token>"); without one, control is
  answered only on a loopback port or with --insecure (ERPCAUTH, 1004, otherwise).
- compress_type other than 0 (none) is refused with EREQUEST; an attachment on a seek is
  ignored, as the original ignored it; an attachment_size beyond the body is EREQUEST.

Bounds: a frame's body over `max_frame` bytes (--max_batch's gRPC message bound), a meta over
64 KiB or over the body, a meta that does not parse or does not name a method, or a wrong
magic: the connection is closed and nothing is echoed. Bodies being read count against a
budget shared by the worker's connections (--lane_budget_bytes; over it, the connection is
closed); at most --lane_max_connections connections; a frame that stalls for
--lane_stall_timeout seconds closes its connection. A peer that does not read its answers is
not read either (the transport's write buffer is drained before the next frame).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl as ssl_module
import struct
import time

import grpc

from cube.pb.baidu_std_pb2 import RpcMeta
from cube.security import is_loopback, token_matches
from cube.server.control import ControlError, ControlRunner
from cube.server.lane import LaneLimits
from cube.server.original import (
    ENOMETHOD,
    ENOSERVICE,
    EREQUEST,
    ERPCAUTH,
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
_DRAIN_ABOVE = 4 << 20  # unsent answer bytes beyond which the next frame waits
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


class BaiduStdServer:
    """The baidu_std listener of one worker."""

    def __init__(
        self,
        service: SeekService,
        control: ControlRunner | None,
        *,
        host: str,
        token: str,
        insecure: bool,
        limits: LaneLimits,
    ) -> None:
        self.service = service
        self.control = control
        self.host = host
        self.token = token
        self.insecure = insecure
        self.limits = limits
        self.server: asyncio.Server | None = None
        self.port = 0
        self.connections: set[asyncio.Task[None]] = set()
        self.idle: set[asyncio.Task[None]] = set()  # connections waiting for their next frame
        self.reading_bytes = 0  # bodies being read, across connections (the budget)
        self._commands: set[asyncio.Future[None]] = set()  # control commands under way
        self._warned_at = 0.0

    def _warn(self, message: str, *args: object) -> None:
        """A closed connection's reason, logged at most once a second."""
        now = time.monotonic()
        if now - self._warned_at >= 1.0:
            self._warned_at = now
            log.warning("baidu_std: " + message, *args)

    # -- connections ---------------------------------------------------------------------

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(self.connections) >= self.limits.max_connections:
            self._warn("%d connections already (the limit): one closed", len(self.connections))
            writer.close()
            return
        self.connections.add(task)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            await self._serve(task, reader, writer)
        except BadFrame as exc:
            self._warn("%s; connection closed", exc)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            pass  # the peer went away, or stalled mid-frame
        finally:
            self.connections.discard(task)
            self.idle.discard(task)
            writer.close()

    async def _serve(
        self, task: asyncio.Task[None], reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        limits = self.limits
        transport = writer.transport
        while True:
            self.idle.add(task)  # between frames: stopping the server closes it at once
            try:
                header = await reader.readexactly(HEADER.size)
            except asyncio.IncompleteReadError as exc:
                if exc.partial:
                    raise BadFrame("a frame cut short in its header") from None
                return  # closed between frames
            finally:
                self.idle.discard(task)
            magic, body_size, meta_size = HEADER.unpack(header)
            if magic != MAGIC:
                raise BadFrame("a frame without the PRPC magic")
            if body_size > limits.max_frame:
                raise BadFrame(f"a frame of {body_size} bytes, over {limits.max_frame}")
            if meta_size > body_size or meta_size > MAX_META:
                raise BadFrame(f"a meta of {meta_size} bytes in a body of {body_size}")
            if self.reading_bytes + body_size > limits.budget_bytes:
                raise BadFrame("the worker's budget for request bodies is spent")
            self.reading_bytes += body_size
            try:
                async with asyncio.timeout(limits.stall_timeout):
                    body = await reader.readexactly(body_size)
            finally:
                self.reading_bytes -= body_size
            view = memoryview(body)
            try:
                meta = RpcMeta.FromString(view[:meta_size])  # type: ignore[arg-type]
            except Exception:  # DecodeError
                raise BadFrame("a meta that does not parse") from None
            if not meta.HasField("request"):
                raise BadFrame("a meta without a request")
            answer = self._answer(meta, view[meta_size:], writer)
            if answer is not None:
                writer.writelines(answer)
            if transport.get_write_buffer_size() > _DRAIN_ABOVE:
                await writer.drain()

    # -- requests ------------------------------------------------------------------------

    def _answer(
        self, meta: RpcMeta, payload: memoryview, writer: asyncio.StreamWriter
    ) -> list[Buffer] | None:
        """The response frame of one request (None: a control command answers later)."""
        correlation = meta.correlation_id
        request = meta.request
        service = _SERVICES.get(request.service_name)
        if service is None:
            return response_frame(
                correlation, ENOSERVICE, f"no service {request.service_name!r} here"
            )
        if request.method_name != _METHODS[service]:
            return response_frame(
                correlation,
                ENOMETHOD,
                f"no method {request.method_name!r} in {service} (it has {_METHODS[service]})",
            )
        if meta.compress_type:
            return response_frame(
                correlation,
                EREQUEST,
                f"compress_type {meta.compress_type} is not served: send uncompressed requests"
                " (compress_type 0)",
            )
        attachment = meta.attachment_size if meta.HasField("attachment_size") else 0
        if not 0 <= attachment <= len(payload):
            return response_frame(
                correlation,
                EREQUEST,
                f"attachment_size={attachment} is beyond the request's {len(payload)} bytes",
            )
        split = len(payload) - attachment
        if service == "ControlService":
            refusal = self._control_refusal(meta)
            if refusal:
                return response_frame(correlation, ERPCAUTH, refusal)
            command = asyncio.ensure_future(self._command(meta, bytes(payload[split:]), writer))
            self._commands.add(command)
            command.add_done_callback(self._commands.discard)
            return None
        message = payload[:split]
        try:
            answer = self.service.timed(API, lambda: self.service.seek_original(message, API))
        except RequestError as exc:  # counted and logged by `timed`
            return response_frame(correlation, brpc_error(exc.code), exc.message)
        return response_frame(correlation, message=answer)

    def _control_refusal(self, meta: RpcMeta) -> str:
        if self.token:
            given = meta.authentication_data.decode(errors="replace").strip()
            scheme, _, rest = given.partition(" ")
            if scheme.lower() == "bearer":
                given = rest.strip()
            if token_matches(given, self.token):
                return ""
            return "ControlService.cmd needs the control token as authentication_data"
        if self.insecure or is_loopback(self.host):
            return ""
        return (
            f"ControlService.cmd is not served on {self.host}: beyond loopback it needs"
            " cube-server --control_token (or --insecure)"
        )

    async def _command(self, meta: RpcMeta, body: bytes, writer: asyncio.StreamWriter) -> None:
        """Run a control command in a task of its own and write its answer when it ends (a
        load can take minutes; seeks on the connection go on meanwhile)."""
        correlation = meta.correlation_id
        if self.control is None:
            frame = response_frame(correlation, brpc_error(grpc.StatusCode.UNAVAILABLE), "none")
        else:
            try:
                response = await self.control.run(control_request(body))
                frame = response_frame(correlation, attachment=control_json(response))
            except (RequestError, ControlError) as exc:
                frame = response_frame(correlation, brpc_error(exc.code), exc.message)
        if not writer.is_closing():
            writer.writelines(frame)

    # -- the listener --------------------------------------------------------------------

    async def start(self, port: int, ssl: ssl_module.SSLContext | None = None) -> int:
        """Listen on host:port (0: any free port); returns the bound port."""
        self.server = await asyncio.start_server(
            self._connection, self.host, port, reuse_address=True, backlog=1024, ssl=ssl
        )
        self.port = int(self.server.sockets[0].getsockname()[1])
        return self.port

    async def stop(self, grace: float) -> None:
        """Stop listening and close idle connections; a frame being read and a control
        command under way get `grace` seconds to be answered, then are cancelled."""
        if self.server is not None:
            self.server.close()
        for task in list(self.idle):
            task.cancel()
        pending: list[asyncio.Future[None]] = [*self.connections, *self._commands]
        if pending:
            _done, late = await asyncio.wait(pending, timeout=grace)
            for future in late:
                future.cancel()
