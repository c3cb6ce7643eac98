"""Transports: bytes in, bytes out (request and response (de)serialization is the core's, see
`cube.client._core`).

- gRPC: one channel per endpoint, created on first use and kept.
- The TCP lane (`cube.server.lane`): the same cube.v1 Seek bytes over plain length-prefixed
  frames, about 10x cheaper per call than gRPC in Python. For the fast protocol with
  `transport="auto"`, the first call to an endpoint asks it over gRPC (an empty Seek, answered
  with the `cube-tcp-port` metadata) and then uses the lane; endpoints without one (or with
  `transport="grpc"`) stay on gRPC unary calls. A lane that breaks is forgotten and asked for
  again on the next call (a restarted server listens on a new port), so failures surface as
  UNAVAILABLE attempts that the retry policy handles like gRPC's.
- First contact (the same empty Seek, whatever the transport) also reads `cube-routing`: the
  shard the server holds, checked by the client's `check_routing` against its configuration.
  A mismatch (wrong shard order, shard count, partitioner or dict) fails every call to that
  endpoint with CONFIG_MISMATCH until a later check (after LANE_RECHECK_S) finds it fixed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

import grpc
import grpc.aio
import numpy as np

from cube.client.errors import CubeError
from cube.routing import ShardRouting
from cube.security import client_context, grpc_channel_credentials
from cube.wire import (
    ANSWER_HEADER,
    LANE_MAGIC,
    REQUEST_HEADER,
    Buffer,
    answer_values_at,
    answer_width,
    next_frame,
)

# No message size limit (100k-key batches of large values), our own retries only, and a short
# reconnect backoff so a restarted replica is used again within seconds (grpc's default grows
# to 120 s).
CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
    ("grpc.enable_retries", 0),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.use_local_subchannel_pool", 1),
)


# The lane's wire constants (cube.server.lane; tests run the SDK against the real server).
LANE_PORT_METADATA = "cube-tcp-port"
ROUTING_METADATA = "cube-routing"
CONFIG_MISMATCH = "CONFIG_MISMATCH"  # a status of our own: the endpoint holds other keys
TRANSPORTS = ("auto", "grpc")
RoutingCheck = Callable[[str, ShardRouting | None], str | None]
_MAX_PENDING_CALLS = 1024  # per asyncio lane connection
_MAX_UNSENT_BYTES = 16 << 20  # per asyncio lane connection: beyond it, calls fail at once
_TIMEVAL = struct.Struct("@ll")
_STATUS_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}
_MAX_IDLE = 64  # idle blocking connections kept per endpoint
_ALIGN = 16  # answers are read so that their values start at this alignment (malloc's)
_MIN_READ = 4096  # an asyncio lane's new buffer has room for at least this much
_U8 = np.dtype(np.uint8)
_NO_BYTES = np.empty(0, _U8)
_CLOCK_RESOLUTION = time.get_clock_info("monotonic").resolution  # asyncio's timer slack
LANE_RECHECK_S = 5.0  # an endpoint found without a (reachable) lane is asked again after this


class TransportError(CubeError):
    """A call that failed: `code` is a gRPC status name (UNAVAILABLE, DEADLINE_EXCEEDED, ...)
    or one of ours (CONFIG_MISMATCH); `message` says what happened. Every transport raises
    it (the lanes, gRPC through `status_of`, a MockTransport's handler), so the retry policy
    sees one shape whichever moved the bytes."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class Transport(Protocol):
    """How a client moves a request's bytes to a server and the answer's bytes back. A
    transport passed as `transport=` replaces the built-in gRPC/TCP-lane one (MockTransport
    for tests): CubeClient calls `call`, AsyncCubeClient awaits `acall`; both return the
    cube.v1 SeekResponse bytes or raise TransportError."""

    def call(self, address: str, request: bytes, timeout_s: float) -> bytes: ...

    async def acall(self, address: str, request: bytes, timeout_s: float) -> bytes: ...

    def close(self) -> None: ...


def _status_name(number: int) -> str:
    return _STATUS_NAMES.get(number, "UNKNOWN")


def _lane_address(address: str, metadata: Any) -> tuple[str, int] | None:
    """The lane's (host, port) announced in `metadata`, on the host of `address`; None when
    there is none or it is not a port (then the endpoint is used over gRPC)."""
    for key, value in metadata or ():
        if key == LANE_PORT_METADATA:
            host = address.rpartition(":")[0].strip("[]")
            text = str(value)
            if not text.isdigit() or not 0 < int(text) < 65536:
                return None
            return host, int(text)
    return None


def _routing(metadata: Any) -> ShardRouting | None:
    for key, value in metadata or ():
        if key == ROUTING_METADATA:
            return ShardRouting.from_text(str(value))
    return None


def _no_check(address: str, routing: ShardRouting | None) -> str | None:
    return None


@dataclass(frozen=True)
class ClientTLS:
    """TLS to the servers (their --tls_cert): trust `ca` (a PEM bundle; "" for the system's
    CAs) and expect certificates for `server_name` (default: each address's host)."""

    ca: str = ""
    server_name: str = ""

    @cached_property
    def context(self) -> ssl.SSLContext:
        return client_context(self.ca)

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc_channel_credentials(self.ca)

    def options(self) -> tuple[tuple[str, str], ...]:
        return (("grpc.ssl_target_name_override", self.server_name),) if self.server_name else ()

    def wrap(self, sock: socket.socket, host: str) -> ssl.SSLSocket:
        """`sock` in TLS, its handshake not done yet (`do_handshake()`: the caller first lets
        a cancel reach the new socket object)."""
        return self.context.wrap_socket(
            sock, server_hostname=self.server_name or host, do_handshake_on_connect=False
        )


def open_channel(address: str, tls: ClientTLS | None) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.secure_channel(address, tls.credentials(), options=CHANNEL_OPTIONS + tls.options())


def open_aio_channel(address: str, tls: ClientTLS | None) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    options = CHANNEL_OPTIONS + tls.options()
    return grpc.aio.secure_channel(address, tls.credentials(), options=options)


def status_of(error: BaseException) -> tuple[str, str]:
    """(status code name, message) of a failed call."""
    if isinstance(error, TransportError):
        return error.code, error.message
    if isinstance(error, grpc.RpcError) and hasattr(error, "code"):
        code = error.code()
        name = code.name if isinstance(code, grpc.StatusCode) else str(code)
        return name, error.details() or ""
    return "UNKNOWN", f"{type(error).__name__}: {error}"


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
_REQUEST_HEADER = REQUEST_HEADER.pack


class _Placement:
    """Where in a buffer of its own to start receiving an answer (a frame) so that its values
    come out aligned, and get_embeddings can return a view of them: from the request's key
    count and the value width of the answers so far (as servers lay answers out)."""

    __slots__ = ("_pads", "length", "width")

    def __init__(self) -> None:
        self.width = 0  # of the answers' values; 0: not known (no padding)
        self.length = -1  # of the last answer: its width is read again when it changes
        # pad by request size: the same size is the same key count (but for a rare pinned
        # version of just the right length, which then costs get_embeddings a copy)
        self._pads: dict[int, int] = {}

    def pad(self, request: bytes) -> int:
        """Where the frame of the answer to `request` starts, modulo _ALIGN."""
        pad = self._pads.get(len(request))
        if pad is None:
            pad = 0
            if self.width:
                pad = -(ANSWER_HEADER.size + answer_values_at(request, self.width)) % _ALIGN
            if len(self._pads) >= 256:
                self._pads.clear()
            self._pads[len(request)] = pad
        return pad

    def learn(self, body: memoryview) -> None:
        if len(body) != self.length:
            self.length = len(body)
            width = answer_width(body)
            if width != self.width:
                self.width = width
                self._pads.clear()


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
        check_routing: RoutingCheck = _no_check,
        tls: ClientTLS | None = None,
    ) -> None:
        self._method = method
        self._tls = tls
        self._busy_poll = BusyPoll(busy_poll_s)
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._callables: dict[str, grpc.UnaryUnaryMultiCallable[bytes, bytes]] = {}
        self._use_lanes = lanes
        self._check_routing = check_routing
        self._lanes: dict[str, SyncLane | None] = {}  # None: no lane (until _recheck)
        self._recheck: dict[str, float] = {}
        self._mismatch: dict[str, str] = {}  # endpoints whose routing does not match
        self._closed = False

    def _callable(self, address: str) -> grpc.UnaryUnaryMultiCallable[bytes, bytes]:
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
        problem = self._check_routing(address, _routing(metadata))
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
            channels = list(self._channels.values())
            lanes = [lane for lane in self._lanes.values() if lane is not None]
            self._channels.clear()
            self._callables.clear()
            self._lanes.clear()
        for lane in lanes:
            lane.close()
        for channel in channels:
            channel.close()


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
        if transport.get_write_buffer_size() > _MAX_UNSENT_BYTES:
            future.set_exception(
                TransportError("UNAVAILABLE", "TCP lane: the server is not taking requests")
            )
            return future
        transport.write(_REQUEST_HEADER(len(request)) + request)  # (writelines joins too)
        sent_at = self._loop.time()
        deadline = sent_at + timeout_s
        self._pending.append((future, deadline, sent_at, timeout_s, self._place.pad(request)))
        if self._watchdog is None or deadline < self._watch_at:
            self._arm(deadline)
        return future

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
        check_routing: RoutingCheck = _no_check,
        tls: ClientTLS | None = None,
    ) -> None:
        self._method = method
        self._tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._callables: dict[str, grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]] = {}
        self._use_lanes = lanes
        self._check_routing = check_routing
        self._lanes: dict[str, AioLane | None] = {}  # None: no lane (until _recheck)
        self._recheck: dict[str, float] = {}
        self._mismatch: dict[str, str] = {}
        self._connecting: dict[str, asyncio.Task[Any]] = {}
        self._closed = False

    def _callable(self, address: str) -> grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]:
        call = self._callables.get(address)
        if call is None:
            if self._closed:
                raise RuntimeError("client is closed")
            channel = open_aio_channel(address, self._tls)
            self._channels[address] = channel
            call = self._callables[address] = channel.unary_unary(self._method)
        return call

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
        problem = self._check_routing(address, _routing(metadata))
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

        async def ready(address: str) -> bool:
            if self.lane(address) is not None:  # contact made, and its lane is up
                return True
            try:
                await asyncio.wait_for(self._first_contact(address, timeout_s), timeout_s)
                return address not in self._mismatch
            except (TimeoutError, grpc.aio.AioRpcError, TransportError):
                return False

        flags = await asyncio.gather(*(ready(a) for a in addresses))
        return [a for a, ok in zip(addresses, flags, strict=True) if not ok]

    async def close(self) -> None:
        self._closed = True
        for task in self._connecting.values():
            task.cancel()
        for lane in self._lanes.values():
            if lane is not None:
                lane.close()
        channels = list(self._channels.values())
        self._channels.clear()
        self._callables.clear()
        self._lanes.clear()
        for channel in channels:
            await channel.close()


def _failed_future(code: str, message: str) -> asyncio.Future[Any]:
    future = asyncio.get_running_loop().create_future()
    future.set_exception(TransportError(code, message))
    return future


_UNKNOWN = object()
