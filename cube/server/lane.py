"""The TCP lane: cube.v1 Seek over plain length-prefixed TCP frames, beside gRPC.

Why: on this kind of machine a gRPC message costs Python 200-450 µs of CPU on each side
(thread hops between gRPC's poller and the event loop; see bench/e2e.py), more than the lookup
itself. The same SeekRequest/SeekResponse bytes over a plain uvloop socket cost ~25 µs.

Wire (every integer little-endian):
- the client opens with the 8 bytes `MAGIC`;
- request frame: u32 length, then `cube.v1.SeekRequest` bytes;
- response frame: u32 length, u8 status, then `length` bytes: `cube.v1.SeekResponse` when
  status is 0, else the UTF-8 error message and status is the gRPC status code number
  (e.g. 3 INVALID_ARGUMENT, 9 FAILED_PRECONDITION).
Responses come in request order, so a client may pipeline many requests on a connection. A
frame longer than `max_frame` or a wrong magic ends the connection (after an error frame for
the former).

Busy polling (`--busy_poll_us`): after answering, the worker keeps its event loop polling the
sockets without sleeping for that long, so a request arriving soon after is read at once. On a
VM an idle vCPU halts and waking it costs the next request a hypervisor round trip and cold
caches (on the 2-vCPU test machine, 1-in-flight p99 about halves with client and server
polling). It costs CPU only while idle: under load the loop never waits. Each polling turn
yields the CPU (sched_yield), so a process runnable on the same CPU (a co-located client) runs
first: without that, on a 2-vCPU box the poller took the CPU its own client needed and the
latency tripled.

Discovery: a unary `Seek` with an empty request is answered with initial metadata
`cube-tcp-port: <port>` (see SeekService), so clients need only the gRPC address.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
import time

import grpc

from cube.server.service import ParsedSeek, RequestError, SeekService
from cube.wire import Buffer

log = logging.getLogger("cube.server")

MAGIC = b"CUBETCP1"
PORT_METADATA = "cube-tcp-port"
_LENGTH = struct.Struct("<I")
_HEADER = struct.Struct("<IB")
_OK = 0
_WRITE_HIGH_WATER = 4 << 20  # pause reading a client that does not read its answers


def error_frame(code: grpc.StatusCode, message: str) -> bytes:
    body = message.encode("utf-8", "replace")
    return _HEADER.pack(len(body), code.value[0]) + body


class LaneProtocol(asyncio.Protocol):
    """One client connection: frames in, answers out, all in the event loop's thread (the
    lookup is synchronous numpy work, like the gRPC handlers)."""

    def __init__(self, service: SeekService, max_frame: int, lane: Lane) -> None:
        self.service = service
        self.max_frame = max_frame
        self.lane = lane
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.greeted = False
        self.refused = False  # sent a frame too long: read nothing more, close when answered

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's TCPTransport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        transport.set_write_buffer_limits(high=_WRITE_HIGH_WATER)
        self.lane.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lane.connections.discard(self)
        self.transport = None

    def pause_writing(self) -> None:
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and not self.refused:
            self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        # Frames are read in place (memoryview slices; upb parses them without a copy); only
        # an incomplete tail is kept for the next read.
        if self.refused:
            return
        source: bytes | bytearray = data
        if self.buffer:
            self.buffer += data
            source = self.buffer
        start = 0
        if not self.greeted:
            if len(source) < len(MAGIC):
                self.buffer = bytearray(source)
                return
            if source[: len(MAGIC)] != MAGIC:
                log.warning("TCP lane: a client did not open with the lane's magic; closed")
                self._close()
                return
            self.greeted = True
            start = len(MAGIC)
        end = len(source)
        refused = False
        with memoryview(source) as view:
            while end - start >= 4:
                (length,) = _LENGTH.unpack_from(view, start)
                if length > self.max_frame:
                    refused = True
                    break
                if end - start - 4 < length:
                    break
                frame = view[start + 4 : start + 4 + length]
                try:
                    self.lane.enqueue(self, self._parse(frame))
                finally:
                    frame.release()  # no export may outlive the view (the buffer is resized)
                start += 4 + length
        if refused:
            self.refused = True
            if self.transport is not None:
                self.transport.pause_reading()
            message = (
                f"TCP lane: a request frame of {length} bytes exceeds this server's"
                f" {self.max_frame} (--max_batch): split the batch"
            )
            self.lane.enqueue(self, RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, message))
            self.lane.enqueue(self, None)  # close once the answers before it are written
            return
        if source is self.buffer:
            del self.buffer[:start]
        elif start < end:
            self.buffer = bytearray(data[start:])

    def _parse(self, raw: memoryview) -> ParsedSeek | RequestError:
        try:
            return self.service.parse_seek(raw)
        except RequestError as exc:
            return exc

    def write(self, buffers: list[Buffer]) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.writelines(buffers)

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()


# What a connection asked, in order: a parsed request, a refusal, or None (close it).
_Item = ParsedSeek | RequestError | None


class Lane:
    """The lane's listening socket and its connections.

    Requests are answered once per event-loop turn, all together: the frames every connection
    delivered in that turn go through one `SeekService.answer_seeks` (one lookup over all
    their keys), then each connection gets its answers in its own request order. Under
    pipelined load this spreads the kernel's fixed cost over several requests; a lone
    request is answered at the next turn, as before."""

    def __init__(self, service: SeekService, max_frame: int, busy_poll_s: float = 0.0) -> None:
        self.service = service
        self.max_frame = max_frame
        self.busy_poll_s = busy_poll_s
        self._polling = False
        self._poll_until = 0.0
        self.connections: set[LaneProtocol] = set()
        self.server: asyncio.Server | None = None
        self.port = 0
        self._queue: list[tuple[LaneProtocol, _Item]] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    def enqueue(self, connection: LaneProtocol, item: _Item) -> None:
        if not self._queue:
            assert self._loop is not None
            self._loop.call_soon(self._answer_queued)
        self._queue.append((connection, item))

    def _keep_polling(self) -> None:
        """Busy polling: while a callback is pending, uvloop polls its sockets with a zero
        timeout instead of sleeping, until `_poll_until` (moved on by every answer)."""
        if not self.busy_poll_s or time.perf_counter() >= self._poll_until:
            self._polling = False
            return
        assert self._loop is not None
        os.sched_yield()  # a process runnable on this CPU (a client?) goes first
        self._loop.call_soon(self._keep_polling)

    def _answer_queued(self) -> None:
        if self.busy_poll_s:
            self._poll_until = time.perf_counter() + self.busy_poll_s
            if not self._polling:
                assert self._loop is not None
                self._polling = True
                self._loop.call_soon(self._keep_polling)
        queue, self._queue = self._queue, []
        seeks = [item for _, item in queue if isinstance(item, ParsedSeek)]
        counters = self.service.counters
        counters.lane_batches += 1
        try:
            answers = iter(self.service.answer_seeks(seeks))
            failure = None
        except Exception as exc:  # a bug: answer it rather than hang the clients' pipelines
            log.exception("TCP lane: %d requests failed", len(seeks))
            answers = iter(())
            failure = RequestError(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        output: dict[LaneProtocol, list[Buffer]] = {}
        closing = []
        for connection, item in queue:
            if isinstance(item, ParsedSeek) and failure is None:
                parts = next(answers)
                frame = [_HEADER.pack(sum(len(p) for p in parts), _OK), *parts]
                counters.lane_messages += 1
            elif item is None:
                closing.append(connection)
                continue
            else:
                error = failure if isinstance(item, ParsedSeek) else item
                assert error is not None
                counters.errors += 1
                frame = [error_frame(error.code, error.message)]
            output.setdefault(connection, []).extend(frame)
        for connection, buffers in output.items():
            connection.write(buffers)
        for connection in closing:
            connection._close()

    async def start(self, host: str, port: int) -> int:
        """Listen on host:port (0: any free port); returns the port."""
        loop = self._loop = asyncio.get_running_loop()
        self.server = await loop.create_server(
            lambda: LaneProtocol(self.service, self.max_frame, self),
            host,
            port,
            reuse_address=True,
            backlog=1024,
        )
        self.port = int(self.server.sockets[0].getsockname()[1])
        return self.port

    async def stop(self, grace: float) -> None:
        """Stop listening; close every connection once its answers are written (each answer
        is built synchronously, so none is half done), waiting at most `grace` seconds."""
        self.busy_poll_s = 0.0
        if self.server is not None:
            self.server.close()
        for connection in list(self.connections):
            connection._close()  # closes after the buffered answers are sent
        deadline = asyncio.get_running_loop().time() + grace
        while self.connections and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        for connection in list(self.connections):
            if connection.transport is not None:
                connection.transport.abort()
