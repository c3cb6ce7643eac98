"""The blocking transport (CubeClient): gRPC's blocking calls and blocking TCP lane connections; a
call runs in the calling thread (or a pool thread of the client's) and another thread may cancel
it (`CallHandle`).
"""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import struct
import threading
import time
from typing import Any

import grpc
import grpc.aio
import numpy as np

from cube.client._transport import (
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
    status_of,
)
from cube.client.errors import TransportError
from cube.wire import (
    ANSWER_HEADER,
    LANE_MAGIC,
    Buffer,
)

_TIMEVAL = struct.Struct("@ll")


_MAX_IDLE = 64  # idle blocking connections kept per endpoint


def open_channel(address: str, tls: ClientTLS | None) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.secure_channel(address, tls.credentials(), options=CHANNEL_OPTIONS + tls.options())


class _Stale(Exception):
    """A reused idle connection was closed by the server before answering (safe to resend:
    lookups are idempotent)."""


class _Connection:
    """A blocking lane socket whose timeouts are the kernel's (SO_RCVTIMEO/SO_SNDTIMEO): one
    syscall per send or receive, where a Python-level timeout adds a poll() to each."""

    __slots__ = ("sock", "timeout_s", "tls")

    def __init__(self, sock: socket.socket) -> None:
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.timeout_s = 0.0
        self.tls = isinstance(sock, ssl.SSLSocket)

    def set_timeout(self, timeout_s: float) -> None:
        """Bound each blocking send/receive by `timeout_s` (kept when within 10% of it)."""
        timeout_s = max(timeout_s, 1e-3)  # 0 would mean "no timeout" to the kernel
        if abs(timeout_s - self.timeout_s) <= 0.1 * timeout_s:
            return
        if self.tls:  # TLS reads more than it returns: Python's
            self.sock.settimeout(timeout_s)  # own timeout, not the kernel's per syscall
            self.timeout_s = timeout_s
            return
        seconds = int(timeout_s)
        value = _TIMEVAL.pack(seconds, int((timeout_s - seconds) * 1e6))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
        self.timeout_s = timeout_s


class BusyPoll:
    """Wait for an answer by polling the socket for up to `seconds` before a blocking receive
    (`busy_poll_us` of the blocking client; the server's `--busy_poll_us` is the other half).

    A thread asleep in recv() lets its vCPU halt, and on a VM waking it costs the answer a
    hypervisor round trip and cold caches. Polling happens only while a single lane call in
    the whole process waits (all clients count): with several in flight the CPU has other
    work and pollers would take it from them (and from a server on the same machine), so the
    calls then sleep as usual."""

    _lock = threading.Lock()
    _waiting = 0  # lane calls of this process waiting for an answer (class-wide on purpose)

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def recv_into(self, sock: socket.socket, view: memoryview, deadline: float) -> int:
        """`sock.recv_into(view)`, polling first (until `deadline` at most, monotonic) when
        this is the only call waiting."""
        if self.seconds <= 0 or isinstance(sock, ssl.SSLSocket):  # (no MSG_DONTWAIT on TLS)
            return sock.recv_into(view)
        cls = BusyPoll
        with cls._lock:
            cls._waiting += 1
        try:
            until = min(time.monotonic() + self.seconds, deadline)
            while cls._waiting == 1 and time.monotonic() < until:
                try:
                    return sock.recv_into(view, 0, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    os.sched_yield()  # a thread runnable on this CPU (the server?) goes first
            return sock.recv_into(view)
        finally:
            with cls._lock:
                cls._waiting -= 1


NO_BUSY_POLL = BusyPoll(0.0)


_CANCELLED = ("CANCELLED", "TCP lane: the call was cancelled (another attempt answered)")


class CallHandle:
    """A blocking lane call that another thread may cancel (a backup request's loser, or
    every call in flight when the client closes): the cancel shuts the call's socket down,
    which ends a send, a receive and also a connect that hangs (a link down: SYNs go
    unanswered), so the call returns CANCELLED at once instead of holding its thread until
    its timeout. A gRPC call ignores its handle (closing the client's channels ends it)."""

    __slots__ = ("_lock", "_sock", "cancelled")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self.cancelled = False

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def attach(self, sock: socket.socket | None) -> bool:
        """Let cancel() reach `sock` (None: detach). False when already cancelled."""
        with self._lock:
            self._sock = None if self.cancelled else sock
            return not self.cancelled


class _Uncancellable(CallHandle):
    """The handle of a call nobody can cancel (run inline by its caller): no lock, no state."""

    def attach(self, sock: socket.socket | None) -> bool:
        return True


_INLINE = _Uncancellable()


class SyncLane:
    """Blocking connections to one worker's TCP lane. A call takes an idle connection (or
    opens one), writes its frame and reads the answer in the calling thread: no thread hop,
    and usually one send and one receive syscall (the answer is read into a buffer sized
    like the previous answer)."""

    def __init__(
        self,
        host: str,
        port: int,
        busy_poll: BusyPoll = NO_BUSY_POLL,
        tls: ClientTLS | None = None,
    ) -> None:
        self.host, self.port = host, port
        self.busy_poll = busy_poll
        self.tls = tls
        self.broken = False  # a connection failed: the caller should ask for the lane again
        self.unreachable = False  # could not even connect: use gRPC for a while
        self._idle: list[_Connection] = []
        self._lock = threading.Lock()
        self._closed = False
        self._expect = 1 << 16  # bytes of the last answer, header included: the next read size
        self._place = _Placement()
        self._poll = busy_poll.seconds > 0

    def call(
        self, request: bytes, timeout_s: float, handle: CallHandle | None = None
    ) -> tuple[bool, Any]:
        """(True, response bytes) or (False, (status name, message)); never raises."""
        handle = handle or _INLINE
        try:
            return self._call(request, timeout_s, handle)
        finally:
            handle.attach(None)

    def _call(self, request: bytes, timeout_s: float, handle: CallHandle) -> tuple[bool, Any]:
        deadline = time.monotonic() + timeout_s
        header = _REQUEST_HEADER(len(request))
        for _ in range(2):  # a stale idle connection is replaced once
            connection = self._take()
            reused = connection is not None
            if connection is not None and not handle.attach(connection.sock):
                self._give_back(connection)
                return False, _CANCELLED
            try:
                if connection is None:
                    try:
                        connection = self._connect(deadline, handle)
                    except OSError:
                        if handle.cancelled:  # our own shutdown ended the connect
                            return False, _CANCELLED
                        self.unreachable = self.broken = True
                        raise
                    header = LANE_MAGIC + header
                connection.set_timeout(deadline - time.monotonic())
                try:
                    _send(connection, header, request)
                except (BrokenPipeError, ConnectionResetError):
                    if not reused:
                        raise
                    raise _Stale from None
                pad = self._place.pad(request)
                status, body = self._read_answer(connection, deadline, reused, pad)
            except _Stale:
                assert connection is not None
                connection.sock.close()
                if handle.cancelled:  # our own shutdown, not the server's
                    return False, _CANCELLED
                self._drop_idle()
                continue
            except (TimeoutError, BlockingIOError):  # BlockingIOError: SO_RCVTIMEO passed
                if connection is not None:
                    connection.sock.close()  # an answer may still come: out of step
                return False, ("DEADLINE_EXCEEDED", f"TCP lane: no answer in {timeout_s:.3f} s")
            except OSError as exc:
                if connection is not None:
                    connection.sock.close()
                if handle.cancelled:
                    return False, _CANCELLED
                self._drop_idle()
                self.broken = True
                return False, ("UNAVAILABLE", f"TCP lane {self.host}:{self.port}: {exc}")
            if handle.attach(None):  # detached first: a late cancel must not hit a pooled socket
                self._give_back(connection)
            else:  # cancelled while the answer came: the socket may be shut down
                connection.sock.close()
            if status:
                return False, (_status_name(status), bytes(body).decode("utf-8", "replace"))
            return True, body
        self.broken = True
        return False, ("UNAVAILABLE", f"TCP lane {self.host}:{self.port}: connection closed")

    def _connect(self, deadline: float, handle: CallHandle) -> _Connection:
        """A new connection (and its TLS handshake) by `deadline`. Its socket is attached to
        `handle` before it connects, so that a cancel ends a connect that hangs; OSError
        when it could not connect, was cancelled (`handle.cancelled`) or timed out."""
        error: OSError = ConnectionError(f"{self.host}:{self.port}: no address")
        for family, kind, proto, _, address in socket.getaddrinfo(
            self.host, self.port, type=socket.SOCK_STREAM
        ):
            sock: socket.socket = socket.socket(family, kind, proto)
            try:
                if not handle.attach(sock):
                    raise ConnectionAbortedError("cancelled")
                sock.settimeout(max(deadline - time.monotonic(), 1e-3))
                sock.connect(address)
                if self.tls is not None:
                    sock = self.tls.wrap(sock, self.host)
                    if not handle.attach(sock):
                        raise ConnectionAbortedError("cancelled")
                    sock.settimeout(max(deadline - time.monotonic(), 1e-3))
                    sock.do_handshake()  # within the timeout
                return _Connection(sock)
            except OSError as exc:
                sock.close()
                if handle.cancelled:
                    raise
                error = exc
        raise error

    def _read_answer(
        self, connection: _Connection, deadline: float, reused: bool, pad: int
    ) -> tuple[int, memoryview]:
        """Read one answer frame: (status, body view). The buffer is the answer's own (its
        arrays are views of it), read from `pad` on (see _Placement)."""
        buffer = np.empty(pad + self._expect, _U8)  # not zero-filled, unlike bytearray(n)
        view = buffer.data
        sock = connection.sock
        poll = self._poll and not connection.tls
        got, need = pad, pad + ANSWER_HEADER.size
        status = 0
        while got < need:
            if got > pad and time.monotonic() > deadline:
                raise TimeoutError
            try:
                if poll:
                    count = self.busy_poll.recv_into(sock, view[got:], deadline)
                else:
                    count = sock.recv_into(view[got:])
            except (ConnectionResetError, BrokenPipeError):
                if reused and got == pad:
                    raise _Stale from None
                raise
            if count == 0:
                if reused and got == pad:
                    raise _Stale
                raise ConnectionError("the server closed the connection")
            got += count
            if need == pad + ANSWER_HEADER.size and got >= need:
                length, status = ANSWER_HEADER.unpack_from(view, pad)
                need += length
                if need > buffer.shape[0]:  # larger than the last answer: grow, keep what came
                    grown = np.empty(need, np.uint8)
                    grown[:got] = buffer[:got]
                    buffer, view = grown, grown.data
        body = view[pad + ANSWER_HEADER.size : need]
        self._expect = need - pad
        self._place.learn(body)
        return status, body

    def _take(self) -> _Connection | None:
        with self._lock:  # (not a bare pop: _drop_idle may be closing the list it holds)
            return self._idle.pop() if self._idle else None

    def _give_back(self, connection: _Connection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < _MAX_IDLE:
                self._idle.append(connection)
                return
        connection.sock.close()

    def _drop_idle(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.sock.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._drop_idle()


def _send(connection: _Connection, header: bytes, request: bytes) -> None:
    """Write header + request in one sendmsg (no joined copy); finish a partial send."""
    sock = connection.sock
    if connection.tls:  # no sendmsg over TLS
        sock.sendall(header + request)
        return
    sent = sock.sendmsg((header, request))
    total = len(header) + len(request)
    if sent < total:
        rest = (header + request)[sent:] if sent < len(header) else request[sent - len(header) :]
        sock.sendall(rest)


class SyncChannels:
    """Blocking-API transport. `call` blocks the calling thread: gRPC's sync `future()` starts
    a polling thread per call when none is running, which costs more than the call itself
    here, so the client runs blocking calls inline or on its own thread pool instead.
    With `lanes`, endpoints that offer a TCP lane are called over it (module docstring)."""

    def __init__(
        self,
        method: str,
        lanes: bool = False,
        busy_poll_s: float = 0.0,
        on_contact: ContactCheck = _no_check,
        tls: ClientTLS | None = None,
    ) -> None:
        self._method = method
        self._tls = tls
        self._busy_poll = BusyPoll(busy_poll_s)
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._callables: dict[str, grpc.UnaryUnaryMultiCallable[bytes, bytes]] = {}
        self._tls_generation = 0  # of the CA bundle the channels were made with
        self._retired: list[tuple[float, grpc.Channel]] = []  # (when, channel): closed later
        self._use_lanes = lanes
        self._on_contact = on_contact
        self._lanes: dict[str, SyncLane | None] = {}  # None: no lane (until _recheck)
        self._recheck: dict[str, float] = {}
        self._mismatch: dict[str, str] = {}  # endpoints whose routing does not match
        self._closed = False

    def _callable(self, address: str) -> grpc.UnaryUnaryMultiCallable[bytes, bytes]:
        if self._tls is not None and self._tls.generation != self._tls_generation:
            self._renew_channels()
        call = self._callables.get(address)
        if call is None:
            with self._lock:
                if self._closed:
                    raise RuntimeError("client is closed")
                call = self._callables.get(address)
                if call is None:
                    channel = open_channel(address, self._tls)
                    self._channels[address] = channel
                    call = channel.unary_unary(self._method)
                    self._callables[address] = call
        return call

    def _renew_channels(self) -> None:
        """The CA bundle changed: calls from now on get new channels (their connections trust
        the new bundle); the old ones finish their calls in flight and are closed
        RETIRED_CHANNEL_S later (at a later renewal, or at close())."""
        assert self._tls is not None
        now = time.monotonic()
        with self._lock:
            generation = self._tls.generation
            if generation == self._tls_generation:
                return
            self._tls_generation = generation
            old = now - RETIRED_CHANNEL_S
            closing = [channel for when, channel in self._retired if when < old]
            self._retired = [(when, channel) for when, channel in self._retired if when >= old]
            self._retired += [(now, channel) for channel in self._channels.values()]
            self._channels.clear()
            self._callables.clear()
        for channel in closing:
            channel.close()

    def call(
        self, address: str, request: bytes, timeout_s: float, handle: CallHandle | None = None
    ) -> Buffer:
        """The response bytes (a view of the received buffer on a lane); TransportError when
        the call failed. `handle` lets another
        thread cancel the call while it runs on a lane."""
        deadline = time.monotonic() + timeout_s
        lane = self._lanes.get(address, _UNKNOWN)
        if type(lane) is not SyncLane or address in self._mismatch:  # not the usual case
            lane = self._resolve(address, lane, timeout_s)
        if lane is not None:
            ok, payload = lane.call(request, max(deadline - time.monotonic(), 1e-3), handle)
            if not lane.unreachable:
                if lane.broken:
                    self._forget(address, lane)
                if ok:
                    body: Buffer = payload
                    return body
                raise TransportError(*payload)
            self._forget(address, lane)  # e.g. a firewall: this attempt goes over gRPC
            self._no_lane(address)
        timeout_s = max(deadline - time.monotonic(), 1e-3)
        try:
            answer: bytes = self._callable(address)(request, timeout=timeout_s)
        except Exception as exc:
            raise TransportError(*status_of(exc)) from None
        return answer

    def _resolve(self, address: str, lane: Any, timeout_s: float) -> SyncLane | None:
        """The endpoint's lane (None: gRPC), after first contact or a recheck when due;
        TransportError when that failed or the endpoint's routing does not match."""
        if lane is None and time.monotonic() > self._recheck.get(address, 0.0):
            lane = _UNKNOWN  # time to ask again (a lane, a fixed routing)
        if lane is _UNKNOWN:
            failure = self._discover(address, timeout_s)
            if failure is not None:
                raise TransportError(*failure)
            lane = self._lanes.get(address)
        mismatch = self._mismatch.get(address)
        if mismatch is not None:
            raise TransportError(CONFIG_MISMATCH, mismatch)
        return lane if isinstance(lane, SyncLane) else None

    def _no_lane(self, address: str) -> None:
        with self._lock:
            self._lanes[address] = None
            self._recheck[address] = time.monotonic() + LANE_RECHECK_S

    def _discover(self, address: str, timeout_s: float) -> tuple[str, str] | None:
        """First contact (an empty Seek): the lane, and the routing checked; None, or the
        failure of the ask."""
        try:
            _, call = self._callable(address).with_call(b"", timeout=timeout_s)
            metadata = call.initial_metadata()
        except Exception as exc:
            return status_of(exc)
        problem = self._on_contact(address, contact_of(metadata))
        where = _lane_address(address, metadata) if self._use_lanes else None
        with self._lock:
            if self._closed:
                return ("CANCELLED", "client is closed")
            if problem is None:
                self._mismatch.pop(address, None)
            else:
                self._mismatch[address] = problem
        if where is None or problem is not None:
            self._no_lane(address)
            return None
        with self._lock:
            if not isinstance(self._lanes.get(address), SyncLane):
                self._lanes[address] = SyncLane(*where, self._busy_poll, self._tls)
        return None

    def _forget(self, address: str, lane: SyncLane | None) -> None:
        with self._lock:
            if address in self._lanes and self._lanes[address] is lane:
                del self._lanes[address]
        if lane is not None:
            lane.close()

    def wait_ready(self, addresses: list[str], timeout_s: float) -> list[str]:
        """First contact with every address (connection, routing check, lane), as a call
        would make it; return those that did not answer ready (a replica that cannot serve
        yet refuses it) within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        futures = {}
        for address in addresses:
            self._callable(address)
            futures[address] = grpc.channel_ready_future(self._channels[address])
        not_ready = []
        for address, future in futures.items():
            try:
                future.result(timeout=max(deadline - time.monotonic(), 1e-3))
            except grpc.FutureTimeoutError:
                future.cancel()
                not_ready.append(address)
                continue
            failure = self._discover(address, max(deadline - time.monotonic(), 1e-3))
            if failure is not None or address in self._mismatch:
                not_ready.append(address)
        return not_ready

    def close(self) -> None:
        with self._lock:
            self._closed = True
            channels = [*self._channels.values(), *(channel for _, channel in self._retired)]
            lanes = [lane for lane in self._lanes.values() if lane is not None]
            self._retired.clear()
            self._channels.clear()
            self._callables.clear()
            self._lanes.clear()
        for lane in lanes:
            lane.close()
        for channel in channels:
            channel.close()
