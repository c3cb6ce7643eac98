"""The asyncio transport (AsyncCubeClient): grpc.aio channels and pipelined TCP lane connections
(`AioLane`), bound to the event loop they were first used in.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import socket
import time
from typing import Any

import grpc
import grpc.aio
import numpy as np

from cube.client._transport import (
    _ALIGN,
    _REQUEST_HEADER,
    _U8,
    _UNKNOWN,
    CHANNEL_OPTIONS,
    CONFIG_MISMATCH,
    LANE_RECHECK_S,
    RETIRED_CHANNEL_S,
    ClientTLS,
    ContactCheck,
    _lane_address,
    _no_check,
    _Placement,
    _status_name,
    contact_of,
)
from cube.client.errors import TransportError
from cube.wire import (
    ANSWER_HEADER,
    LANE_MAGIC,
    next_frame,
)

_MAX_PENDING_CALLS = 1024  # per asyncio lane connection


_MAX_UNSENT_BYTES = 16 << 20  # per asyncio lane connection: beyond it, calls fail at once


_MIN_READ = 4096  # an asyncio lane's new buffer has room for at least this much


_NO_BYTES = np.empty(0, _U8)


_CLOCK_RESOLUTION = time.get_clock_info("monotonic").resolution  # asyncio's timer slack


def open_aio_channel(address: str, tls: ClientTLS | None) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    options = CHANNEL_OPTIONS + tls.options()
    return grpc.aio.secure_channel(address, tls.credentials(), options=options)


class AioLane(asyncio.BufferedProtocol):
    """One pipelined connection to a worker's TCP lane: frames go out as calls start, answers
    come back in order and complete the calls' futures. A call past its timeout fails with
    DEADLINE_EXCEEDED and a cancelled one is dropped; their answers are skipped on arrival.

    Bounded: a call that expires while nothing at all has arrived since it was sent means the
    server stopped answering (SIGSTOP, a dead host): the connection is dropped, its pending
    calls fail UNAVAILABLE and the next call connects again. More than `_MAX_PENDING_CALLS`
    calls in flight, or more than `_MAX_UNSENT_BYTES` the socket has not taken, fail new
    calls at once (UNAVAILABLE, retried elsewhere) instead of queueing without end.

    Cheap per call: answers are received into buffers of our own (numpy, writable) that are
    never reused, so each answer is handed out as a view, placed so that its values start
    aligned (get_embeddings returns a view of them); one timer (the watchdog) stands for all
    the calls' timeouts, armed at the earliest deadline, instead of a timer per call."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.lost = False
        # (future, deadline, when sent, timeout, pad) per call, in the order the answers come
        self._pending: collections.deque[tuple[asyncio.Future[Any], float, float, float, int]] = (
            collections.deque()
        )
        self._loop = asyncio.get_running_loop()
        self._received_at = 0.0  # when bytes last arrived
        self._watchdog: asyncio.TimerHandle | None = None
        self._watch_at = 0.0
        # Received bytes not yet handed out are _buffer[_start:_end]; bytes before _start
        # belong to answers handed out (views), so a buffer is only ever written past _end.
        self._buffer = _NO_BYTES
        self._view = _NO_BYTES.data
        self._start = self._end = 0
        self._expect = 1 << 16  # bytes of the last answer frame: room for the next one
        self._place = _Placement()
        self._unsent: list[bytes] = []  # frames of this loop turn, written by _flush
        self._unsent_bytes = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        transport.write(LANE_MAGIC)  # type: ignore[attr-defined]

    def send(self, request: bytes, timeout_s: float) -> asyncio.Future[Any]:
        future = self._loop.create_future()
        transport = self.transport
        if self.lost or transport is None:
            future.set_exception(TransportError("UNAVAILABLE", "TCP lane: connection lost"))
            return future
        if len(self._pending) >= _MAX_PENDING_CALLS:
            future.set_exception(
                TransportError("UNAVAILABLE", f"TCP lane: {len(self._pending)} calls in flight")
            )
            return future
        if transport.get_write_buffer_size() + self._unsent_bytes > _MAX_UNSENT_BYTES:
            future.set_exception(
                TransportError("UNAVAILABLE", "TCP lane: the server is not taking requests")
            )
            return future
        frame = _REQUEST_HEADER(len(request)) + request
        if self._pending:  # calls in flight: this loop turn's frames leave in one write
            if not self._unsent:
                self._loop.call_soon(self._flush)
            self._unsent.append(frame)
            self._unsent_bytes += len(frame)
        else:
            transport.write(frame)
        sent_at = self._loop.time()
        deadline = sent_at + timeout_s
        self._pending.append((future, deadline, sent_at, timeout_s, self._place.pad(request)))
        if self._watchdog is None or deadline < self._watch_at:
            self._arm(deadline)
        return future

    def _flush(self) -> None:
        """Write the frames of the calls started since the last write, in one write (one
        syscall for the client; for the server, one read and one pass over them all)."""
        unsent, self._unsent, self._unsent_bytes = self._unsent, [], 0
        if unsent and not self.lost and self.transport is not None:
            self.transport.writelines(unsent)

    def _arm(self, when: float) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        self._watch_at = when
        self._watchdog = self._loop.call_at(when, self._expire)

    def _expire(self) -> None:
        """The watchdog: fail the calls past their deadline, re-arm for the next deadline."""
        self._watchdog = None
        now = self._loop.time() + _CLOCK_RESOLUTION  # as the loop decides a timer is due
        earliest = None
        for future, deadline, sent_at, timeout_s, _ in self._pending:
            if future.done():
                continue
            if deadline > now:
                earliest = deadline if earliest is None else min(earliest, deadline)
                continue
            future.set_exception(
                TransportError("DEADLINE_EXCEEDED", f"TCP lane: no answer in {timeout_s:.3f} s")
            )
            if self._received_at < sent_at:  # not a byte since it was sent: the peer is gone
                self._fail(f"TCP lane: nothing received for {timeout_s:.3f} s; connection dropped")
                return
        if earliest is not None:
            self._arm(earliest)

    def get_buffer(self, sizehint: int) -> memoryview:
        """Where the next bytes go: after the bytes held, with room for the rest of the
        frame they start (or for an answer like the last one); a new buffer when the current
        one has not that room (the partial frame, if any, moves over)."""
        start, end = self._start, self._end
        pad = self._pending[0][4] if self._pending else 0  # of the answer coming next
        if start == end:  # between answers: start the next one where its values will align
            start = end = end + (pad - end) % _ALIGN
            room = self._expect
        elif end - start >= ANSWER_HEADER.size:
            room = ANSWER_HEADER.size + ANSWER_HEADER.unpack_from(self._view, start)[0]
            room -= end - start
        else:
            room = self._expect
        if self._buffer.shape[0] - end < room:
            held = end - start
            buffer = np.empty(pad + held + max(room, _MIN_READ), _U8)
            if held:
                buffer[pad : pad + held] = self._buffer[start:end]
            self._buffer, self._view = buffer, buffer.data
            start, end = pad, pad + held
        self._start, self._end = start, end
        return self._view[end:]

    def buffer_updated(self, nbytes: int) -> None:
        self._received_at = self._loop.time()
        self._end += nbytes
        start, end, view = self._start, self._end, self._view
        pending = self._pending
        while (frame := next_frame(view, start, end, answers=True)) is not None:
            if not pending:
                self._fail("TCP lane: an answer nobody asked for")
                return
            future = pending.popleft()[0]
            body = view[frame.start : frame.stop]
            self._expect = frame.stop - start
            self._place.learn(body)
            if not future.done():
                if frame.status:
                    text = bytes(body).decode("utf-8", "replace")
                    future.set_exception(TransportError(_status_name(frame.status), text))
                else:
                    future.set_result(body)  # a view: the buffer is never written there again
            start = frame.stop
        self._start = start  # (the watchdog stays armed: when it fires, it finds no call)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(f"TCP lane: connection lost ({exc or 'closed by the server'})")

    def _fail(self, message: str) -> None:
        self.lost = True
        pending, self._pending = self._pending, collections.deque()
        self._unsent, self._unsent_bytes = [], 0
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        for future, *_ in pending:
            if not future.done():
                future.set_exception(TransportError("UNAVAILABLE", message))
        self._buffer, self._view = _NO_BYTES, _NO_BYTES.data
        self._start = self._end = 0
        if self.transport is not None:
            self.transport.abort()  # drop what is still unsent

    def close(self) -> None:
        self._fail("TCP lane: client closed")


class AioChannels:
    """grpc.aio channels (and TCP lanes with `lanes`), bound to the event loop they were first
    used in. First contact with an endpoint checks its routing (module docstring)."""

    def __init__(
        self,
        method: str,
        lanes: bool = False,
        on_contact: ContactCheck = _no_check,
        tls: ClientTLS | None = None,
    ) -> None:
        self._method = method
        self._tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._callables: dict[str, grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]] = {}
        self._tls_generation = 0  # of the CA bundle the channels were made with
        self._retired: dict[grpc.aio.Channel, asyncio.Task[None]] = {}  # closing gracefully
        self._use_lanes = lanes
        self._on_contact = on_contact
        self._lanes: dict[str, AioLane | None] = {}  # None: no lane (until _recheck)
        self._recheck: dict[str, float] = {}
        self._mismatch: dict[str, str] = {}
        self._connecting: dict[str, asyncio.Task[Any]] = {}
        self._closed = False

    def _callable(self, address: str) -> grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]:
        if self._tls is not None and self._tls.generation != self._tls_generation:
            self._renew_channels()
        call = self._callables.get(address)
        if call is None:
            if self._closed:
                raise RuntimeError("client is closed")
            channel = open_aio_channel(address, self._tls)
            self._channels[address] = channel
            call = self._callables[address] = channel.unary_unary(self._method)
        return call

    def _renew_channels(self) -> None:
        """The CA bundle changed: calls from now on get new channels (their connections trust
        the new bundle); the old ones close once their calls in flight are done (at most
        RETIRED_CHANNEL_S later: grpc.aio's graceful close)."""
        assert self._tls is not None
        self._tls_generation = self._tls.generation
        for channel in self._channels.values():
            task = asyncio.ensure_future(channel.close(grace=RETIRED_CHANNEL_S))
            self._retired[channel] = task
            task.add_done_callback(functools.partial(self._closed_retired, channel))
        self._channels.clear()
        self._callables.clear()

    def _closed_retired(self, channel: grpc.aio.Channel, _: asyncio.Task[None]) -> None:
        self._retired.pop(channel, None)

    def lane(self, address: str) -> AioLane | None:
        """The endpoint's lane when it has a live one now (else `start` finds the way)."""
        lane = self._lanes.get(address)
        return lane if lane is not None and not lane.lost else None

    def start(self, address: str, request: bytes, timeout_s: float) -> Any:
        """A call in flight: an awaitable with cancel() and add_done_callback() (a grpc.aio
        call, or a future of the lane)."""
        lane = self._lanes.get(address, _UNKNOWN)
        if isinstance(lane, AioLane):
            if not lane.lost:
                return lane.send(request, timeout_s)
            self._forget(address, lane)
            lane = _UNKNOWN
        elif lane is None and time.monotonic() > self._recheck.get(address, 0.0):
            lane = _UNKNOWN  # time to ask again (a lane, a fixed routing)
        if lane is _UNKNOWN:
            return asyncio.ensure_future(self._connect_and_send(address, request, timeout_s))
        mismatch = self._mismatch.get(address)
        if mismatch is not None:
            return _failed_future(CONFIG_MISMATCH, mismatch)
        return self._grpc_call(address, request, timeout_s)

    def _grpc_call(self, address: str, request: bytes, timeout_s: float) -> Any:
        return self._callable(address)(request, timeout=timeout_s)

    async def _connect_and_send(self, address: str, request: bytes, timeout_s: float) -> bytes:
        deadline = time.monotonic() + timeout_s
        lane = await self._first_contact(address, timeout_s)
        mismatch = self._mismatch.get(address)
        if mismatch is not None:
            raise TransportError(CONFIG_MISMATCH, mismatch)
        remaining = max(deadline - time.monotonic(), 1e-3)
        if lane is None:
            answer: bytes = await self._grpc_call(address, request, remaining)
        else:
            answer = await lane.send(request, remaining)
        return answer

    def _first_contact(self, address: str, timeout_s: float) -> Any:
        """An awaitable of the endpoint's first contact (`_connect`), one at a time per
        endpoint; a cancelled caller leaves it to the others."""
        task = self._connecting.get(address)
        if task is None:
            task = asyncio.ensure_future(self._connect(address, timeout_s))
            self._connecting[address] = task
            task.add_done_callback(lambda t: self._connected(address, t))
        return asyncio.shield(task)

    def _connected(self, address: str, task: asyncio.Task[Any]) -> None:
        self._connecting.pop(address, None)
        if not task.cancelled():
            task.exception()  # retrieved here: its callers may all have gone

    async def _connect(self, address: str, timeout_s: float) -> AioLane | None:
        """First contact: check the routing, and connect to the lane when there is one (None:
        use gRPC)."""
        call = self._callable(address)(b"", timeout=timeout_s)
        await call
        metadata = await call.initial_metadata()
        problem = self._on_contact(address, contact_of(metadata))
        if problem is None:
            self._mismatch.pop(address, None)
        else:
            self._mismatch[address] = problem
        where = _lane_address(address, metadata) if self._use_lanes else None
        lane = None
        if where is not None and problem is None:
            loop = asyncio.get_running_loop()
            tls = self._tls
            secure: dict[str, Any] = {}
            if tls is not None:
                secure = {"ssl": tls.context, "server_hostname": tls.server_name or where[0]}
            try:
                _, lane = await asyncio.wait_for(
                    loop.create_connection(AioLane, where[0], where[1], **secure), timeout_s
                )
            except (OSError, TimeoutError, ValueError, OverflowError):
                lane = None  # announced but unreachable (e.g. a firewall): gRPC for a while
        if lane is None:
            self._recheck[address] = time.monotonic() + LANE_RECHECK_S
        if self._closed:
            if lane is not None:
                lane.close()
            raise TransportError("CANCELLED", "client is closed")
        self._lanes[address] = lane
        return lane

    def _forget(self, address: str, lane: AioLane | None) -> None:
        if address in self._lanes and self._lanes[address] is lane:
            del self._lanes[address]

    async def wait_ready(self, addresses: list[str], timeout_s: float) -> list[str]:
        """As SyncChannels.wait_ready, the endpoints in parallel."""

        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s

        async def ready(address: str) -> bool:
            pause = 0.05  # a replica still loading refuses at once: ask again until the deadline
            while True:
                if self.lane(address) is not None:  # contact made, and its lane is up
                    return True
                left = deadline - loop.time()
                try:
                    await asyncio.wait_for(self._first_contact(address, left), left)
                    return address not in self._mismatch
                except (TimeoutError, grpc.aio.AioRpcError, TransportError):
                    if loop.time() + pause >= deadline:
                        return False
                await asyncio.sleep(pause)
                pause = min(pause * 2, 0.5)

        flags = await asyncio.gather(*(ready(a) for a in addresses))
        return [a for a, ok in zip(addresses, flags, strict=True) if not ok]

    async def close(self) -> None:
        self._closed = True
        for task in self._connecting.values():
            task.cancel()
        for lane in self._lanes.values():
            if lane is not None:
                lane.close()
        channels = [*self._channels.values(), *self._retired]
        self._channels.clear()
        self._callables.clear()
        self._lanes.clear()
        for channel in channels:
            await channel.close()  # (a retired one's graceful close returns with it)


def _failed_future(code: str, message: str) -> asyncio.Future[Any]:
    future = asyncio.get_running_loop().create_future()
    future.set_exception(TransportError(code, message))
    return future
