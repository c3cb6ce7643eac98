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

Memory is bounded in bytes, whatever the peers do, by the worker's `Bounds`
(cube.server.bounds, shared with the baidu_std and HTTP+JSON ports; `LaneLimits`):
- a connection buffers at most one frame of input (`max_frame`);
- its answers are estimated at parse time (keys x the version's longest value, exact for fixed
  width); frames are left unparsed in its buffer, and its socket unread, while the answers it
  already has queued or unsent exceed `connection_bytes` (one request is always let through),
  so a client that does not read its answers stops being read;
- across the worker's connections, input buffers plus queued and unsent answers stay under
  `budget_bytes`: beyond it no connection gets a new frame parsed until it drops; a connection
  that pushes its own input buffer over the budget is told UNAVAILABLE and closed;
- a connection holding a partial frame, or unsent answers, without progress for
  `stall_timeout` seconds is closed (a stalled or malicious peer frees what it holds);
- a connection that sends nothing for `idle_timeout` seconds after it connected or was last
  answered is closed, as is one that does not complete a frame within `request_timeout`
  seconds of its first byte (told DEADLINE_EXCEEDED);
- at most `max_connections` connections per worker (all its socket ports); the next makes
  room by closing the connection idle longest, or, when every one is being answered, is
  told UNAVAILABLE and closed.

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
import ssl as ssl_module
import time

import grpc
import numpy as np

from cube import kernel, wire
from cube.kernel_constants import (
    R_NEEDED,
    R_OUT,
    R_POS,
    R_REASON,
    STOP_FULL,
    STOP_HELD,
    T_KEYS,
    T_MISSES,
    T_REQUESTS,
    TALLY_BUCKETS,
)
from cube.server.bounds import BoundedProtocol, Bounds, LaneLimits
from cube.server.service import (
    BATCH_BUCKETS,
    ParsedSeek,
    RequestError,
    SeekService,
    lane_target,
)
from cube.wire import LANE_MAGIC, Buffer, FrameTooLarge, answer_header, next_frame

log = logging.getLogger("cube.server")

MAGIC = LANE_MAGIC
_ANSWER_OVERHEAD = 64  # header and fields of an answer besides its values (estimate)

__all__ = ["MAGIC", "Lane", "LaneLimits", "LaneProtocol", "error_frame"]


def error_frame(code: grpc.StatusCode, message: str) -> bytes:
    return wire.error_frame(code.value[0], message)


class LaneProtocol(BoundedProtocol):
    """One client connection: frames in, answers out, all in the event loop's thread (the
    lookup is synchronous numpy work, like the gRPC handlers). Its bytes are accounted by
    `BoundedProtocol`."""

    kind = "lane"
    label = "TCP lane"

    def __init__(self, lane: Lane) -> None:
        super().__init__(lane.bounds)
        self.lane = lane
        self.service = lane.service
        self.max_frame = lane.limits.max_frame
        self.greeted = False
        self.pending = 0  # items in the lane's queue: later frames wait behind them

    def refuse_connection(self, transport: asyncio.Transport, reason: str) -> None:
        transport.write(error_frame(grpc.StatusCode.UNAVAILABLE, f"TCP lane: {reason}"))

    def expire(self, reason: str, slow: bool = False) -> None:
        """Closed by the idle policy: a peer part-way through a frame is told why (an idle
        one is not: a client about to reuse its connection sees it closed, and resends)."""
        if self.buffer and self.transport is not None:
            code = grpc.StatusCode.DEADLINE_EXCEEDED if slow else grpc.StatusCode.UNAVAILABLE
            message = f"TCP lane: {reason}; connection closed"
            self.transport.write(error_frame(code, message))
        super().expire(reason, slow)

    # -- frames -------------------------------------------------------------------------

    def _consume(self, source: bytes | bytearray) -> None:
        """Parse the frames `source` holds (as far as the byte bounds allow) and keep the
        rest in the buffer. Frames are read in place (memoryview slices; upb parses them
        without a copy)."""
        start = 0
        if not self.greeted:
            if len(source) < len(MAGIC):
                self._keep(source, 0)
                return
            if source[: len(MAGIC)] != MAGIC:
                log.warning("TCP lane: a client did not open with the lane's magic; closed")
                self._close()
                return
            self.greeted = True
            start = len(MAGIC)
        end = len(source)
        if not self.pending and self.lane.compiled is not None:
            start = self.lane.answer_compiled(self, source, start, end)
            if self.transport is None:
                return
        oversized = 0
        with memoryview(source) as view:
            while True:
                try:
                    found = next_frame(view, start, end, answers=False, max_frame=self.max_frame)
                except FrameTooLarge as exc:
                    oversized = exc.length
                    break
                if found is None or self.held():
                    break
                frame = view[found.start : found.stop]
                try:
                    item = self._parse(frame)
                finally:
                    frame.release()  # no export may outlive the view (the buffer is resized)
                start = found.stop
                if isinstance(item, ParsedSeek):
                    self.queued += _ANSWER_OVERHEAD + item.answer_bound
                    self._account()
                self.lane.enqueue(self, item)
        if oversized:
            message = (
                f"TCP lane: a request frame of {oversized} bytes exceeds this server's"
                f" {self.max_frame} (--max_batch): split the batch"
            )
            self._refuse(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
            return
        self._keep(source, start)
        total = self.bounds.total_bytes
        if self.buffer and not (self.queued + self.unsent) and total > self.budget:
            self._refuse(
                grpc.StatusCode.UNAVAILABLE,
                "TCP lane: the server's input buffers are full; retry on another replica",
            )
            return
        self._update_reading()

    def _refuse(self, code: grpc.StatusCode, message: str) -> None:
        """Answer what came before with its answers, then this error, then close."""
        self.closing = True
        self.buffer = bytearray()
        self._account()
        self._update_reading()
        self.lane.enqueue(self, RequestError(code, message))
        self.lane.enqueue(self, None)  # close once the answers before it are written

    def _parse(self, raw: memoryview) -> ParsedSeek | RequestError:
        try:
            return self.service.parse_seek(raw)
        except RequestError as exc:
            return exc

    def resume(self) -> None:
        """Answers drained (ours or the worker's): parse what was held back, read again."""
        if self.closing or self.transport is None:
            return
        if self.buffer and not self.held():
            self._consume(self.buffer)
        else:
            self._update_reading()

    def send(self, answers: memoryview) -> None:
        """Write answer frames now (the compiled pass's, in a buffer of their own)."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        transport.write(answers)
        self.progress_at = time.monotonic()
        self.sample_unsent()

    def write(self, buffers: list[Buffer], answered: int) -> None:
        """Write answers; `answered` is their estimate, leaving the queue."""
        self.queued = max(0, self.queued - answered)
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.writelines(buffers)
            self.progress_at = time.monotonic()
        self.sample_unsent()


# What a connection asked, in order: a parsed request, a refusal, or None (close it).
_Item = ParsedSeek | RequestError | None


class Lane:
    """The lane's listening socket and its connections.

    With the compiled kernel, the frames a connection delivers are answered as they arrive,
    by one compiled call over all of them (`kernel.LanePass`: parse, lookup over the version's
    layers, answer frames into a reused buffer, one write), from the version current at that
    moment; the counters are folded in once per loop turn. A frame that pass does not answer
    (an error, a version pinned other than the current, several splits...) and every frame
    after it on that connection in that turn take the Python path below, the reference: their
    answers are the same bytes by construction (tests/test_lane.py compares them).

    The Python path answers once per event-loop turn, all together: the frames every
    connection delivered in that turn go through one `SeekService.answer_seeks` (one lookup
    over all their keys), then each connection gets its answers in its own request order."""

    def __init__(
        self,
        service: SeekService,
        limits: LaneLimits | None = None,
        busy_poll_s: float = 0.0,
        bounds: Bounds | None = None,
    ) -> None:
        self.service = service
        self.bounds = bounds or Bounds(limits)  # the worker's, shared with its other ports
        self.limits = limits or self.bounds.limits
        self.busy_poll_s = busy_poll_s
        self._polling = False
        self._poll_until = 0.0
        self.server: asyncio.Server | None = None
        self.port = 0
        self._queue: list[tuple[LaneProtocol, _Item]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self.compiled: kernel.LanePass | None = None
        if kernel.COMPILED:
            self.compiled = kernel.LanePass(
                sorted(service.accepted_names),
                self.limits.max_frame,
                service.max_batch,
                service.max_answer_bytes,
                BATCH_BUCKETS,
            )
        self._fold_due = False

    def enqueue(self, connection: LaneProtocol, item: _Item) -> None:
        if not self._queue:
            assert self._loop is not None
            self._loop.call_soon(self._answer_queued)
        self._queue.append((connection, item))
        connection.pending += 1

    def answer_compiled(
        self, connection: LaneProtocol, source: bytes | bytearray, start: int, end: int
    ) -> int:
        """Answer the frames of source[start:end] the compiled pass can, from the current
        version, and write their answers; returns where it stopped (the Python path takes
        the frames from there)."""
        compiled = self.compiled
        assert compiled is not None
        slots = self.service.slots
        version = slots.current
        if (
            version is None
            or slots.not_ready
            or version.broken
            or version.closed
            or not kernel.compiled_ready()
        ):
            return start
        target = lane_target(version)
        if target is None:
            return start
        data = np.frombuffer(source, dtype=np.uint8)
        if data.flags.writeable:  # the connection's buffer (a bytearray)
            data = kernel.read_only(data)
        tally = compiled.tally
        result = compiled.result
        needed = 0
        while True:
            before = int(tally[T_REQUESTS])
            bytes_now = (
                connection.queued + connection.unsent,
                self.bounds.total_bytes,
                len(connection.buffer),
                connection.budget,
                connection.connection_bytes,
            )
            started = time.perf_counter()
            if not compiled.run(data, start, end, target, bytes_now, needed):
                break
            needed = 0
            passed = time.perf_counter() - started
            start = int(result[R_POS])
            produced = int(result[R_OUT])
            if produced:
                connection.send(compiled.out[:produced].data)
                self._answered(int(tally[T_REQUESTS]) - before, passed)
            reason = result[R_REASON]
            if reason == STOP_HELD and produced and not connection.held():
                continue  # the transport sent what it was given: the bounds allow more
            if reason != STOP_FULL:
                break
            needed = int(result[R_NEEDED])
        del data  # (a view of the connection's buffer, which is resized next)
        return start

    def _answered(self, requests: int, passed: float) -> None:
        """Count a compiled pass (the requests themselves are folded in once per turn)."""
        counters = self.service.counters
        counters.lane_batches += 1
        counters.api["lane"].latency.observe(passed, requests)
        self._poll_on()
        if not self._fold_due:
            self._fold_due = True
            assert self._loop is not None
            self._loop.call_soon(self.fold_counts)

    def fold_counts(self) -> None:
        """The compiled passes' counts into the lane's counters."""
        self._fold_due = False
        compiled = self.compiled
        if compiled is None:
            return
        counts = compiled.tally.tolist()
        compiled.tally[:] = 0
        counters = self.service.counters.api["lane"]
        counters.requests += counts[T_REQUESTS]
        counters.keys += counts[T_KEYS]
        counters.misses += counts[T_MISSES]
        counters.batch.add(counts[TALLY_BUCKETS:], counts[T_KEYS])

    def _poll_on(self) -> None:
        """Busy polling after an answer (`_keep_polling`)."""
        if self.busy_poll_s:
            self._poll_until = time.perf_counter() + self.busy_poll_s
            if not self._polling:
                assert self._loop is not None
                self._polling = True
                self._loop.call_soon(self._keep_polling)

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
        self._poll_on()
        queue, self._queue = self._queue, []
        for connection, _ in queue:
            connection.pending -= 1
        seeks = [item for _, item in queue if isinstance(item, ParsedSeek)]
        counters = self.service.counters
        counters.lane_batches += 1
        lane = counters.api["lane"]
        started = time.perf_counter()
        try:
            answers = iter(self.service.answer_seeks(seeks, "lane", frames=True))
            failure = None
        except Exception:  # a bug: answer it rather than hang the clients' pipelines
            log.exception("TCP lane: %d requests failed", len(seeks))
            answers = iter(())
            failure = RequestError(grpc.StatusCode.INTERNAL, "the lookup failed (see the log)")
        passed = time.perf_counter() - started
        output: dict[LaneProtocol, list[Buffer]] = {}
        answered: dict[LaneProtocol, int] = {}
        closing = []
        for connection, item in queue:
            if item is None:
                closing.append(connection)
                continue
            if isinstance(item, ParsedSeek):
                answered[connection] = (
                    answered.get(connection, 0) + _ANSWER_OVERHEAD + item.answer_bound
                )
                answer = next(answers) if failure is None else failure
            else:
                answer = item
            if isinstance(answer, RequestError):
                self.service.refused("lane", answer)
                frame: list[Buffer] = [error_frame(answer.code, answer.message)]
            else:
                if isinstance(answer, memoryview):  # a whole frame already
                    frame = [answer]
                else:
                    frame = [answer_header(sum(len(p) for p in answer)), *answer]
                lane.latency.observe(passed)  # the kernel pass that answered it
            output.setdefault(connection, []).extend(frame)
        for connection, buffers in output.items():
            connection.write(buffers, answered.get(connection, 0))
        for connection in closing:
            connection._close()
        self.bounds.resume_held()

    def connections(self) -> list[LaneProtocol]:
        return [c for c in self.bounds.of_kind(LaneProtocol.kind) if c.lane is self]

    async def start(self, host: str, port: int, ssl: ssl_module.SSLContext | None = None) -> int:
        """Listen on host:port (0: any free port), over TLS with `ssl`; returns the port."""
        self._loop = asyncio.get_running_loop()
        self.server, self.port = await self.bounds.listen(
            lambda: LaneProtocol(self), host, port, ssl, "--tcp_ports"
        )
        return self.port

    async def stop(self, grace: float) -> None:
        """Stop listening; close every connection once its answers are written (each answer
        is built synchronously, so none is half done), waiting at most `grace` seconds."""
        self.busy_poll_s = 0.0
        if self.server is None:
            return
        self.server.close()
        self.server = None
        for connection in self.connections():
            connection._close()  # closes after the buffered answers are sent
        deadline = asyncio.get_running_loop().time() + grace
        while self.connections() and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        for connection in self.connections():
            if connection.transport is not None:
                connection.transport.abort()
        self.bounds.detach()
