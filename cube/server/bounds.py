"""What a worker's socket connections may hold, whatever port they came in on: the TCP lane
(cube.server.lane), baidu_std (cube.server.baidu_std) and HTTP+JSON (cube.server.http_json)
share one `Bounds` per worker (`LaneLimits`, from the --lane_* flags):

- at most `max_connections` connections across those ports; the next is refused (each port
  says so in its own protocol) and closed;
- the bytes they hold, input buffers and queued or unsent answers (an HTTP request body is
  charged while it is read and answered), stay under `budget_bytes` for the worker: beyond
  it no connection gets a new frame parsed until they drop, and a connection that pushes its
  own input over it is closed (HTTP: 503);
- a connection's queued and unsent answers past `connection_bytes` stop it being read (one
  request is always let through), so a client that does not read its answers stops being
  read;
- a connection holding a partial frame (or request), or answers the peer does not take,
  without progress for `stall_timeout` seconds is closed by the watchdog, which runs every
  quarter second (a stalled or malicious peer frees what it holds);
- a connection the server owes nothing is closed when its peer sends nothing for
  `idle_timeout` seconds after it connected or was last answered, or does not complete a
  request it began within `request_timeout` seconds; and when a new connection comes to a
  full worker, the connection idle longest makes room for it (cube/idle.py: the policy).
  So idle connections, however many, cannot keep the SDK out.

`BoundedProtocol` is the accounting of one framed connection (the lane's and baidu_std's):
its input buffer, its answers' bytes, whether it is held back; the subclasses parse and answer
their frames. The lane's per-request path stays what it was (a few attribute updates): the
watchdog, not the requests, samples transports and checks stalls.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl as ssl_module
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cube.idle import IDLE, SLOW, IdleConnections, IdlePolicy, Waiting
from cube.listen import BACKLOG, listen_socket

log = logging.getLogger("cube.server")

WRITE_HIGH_WATER = 4 << 20  # the transport pauses us (and we stop reading) above this
WATCH_EVERY = 0.25  # seconds between the watchdog's rounds
REPORT_EVERY = 10.0  # seconds between log lines about connections closed for the bounds
EVICTED = "evicted"  # closed to make room for a new connection (besides cube.idle's reasons)


@dataclass(frozen=True)
class LaneLimits:
    """Byte and time bounds of a worker's socket connections (module docstring); `max_frame`
    is the TCP lane's request frame bound."""

    max_frame: int = 4 << 20
    connection_bytes: int = 16 << 20
    budget_bytes: int = 256 << 20
    stall_timeout: float = 30.0
    max_connections: int = 1024
    idle_timeout: float = 60.0
    request_timeout: float = 30.0


class Bounds:
    """One worker's connections on its socket ports and the bytes they hold (module
    docstring). A connection is anything with `kind`, `counted` (its bytes in `total_bytes`),
    `watch(now)` (sample what it holds, close it when stalled), `waiting()` (cube.idle),
    `expire(reason, slow)` (close it: idle, to make room, or `slow` to send its request) and,
    when held back in `paused`, `resume()`. `clock` is time.monotonic, or a test's."""

    def __init__(
        self, limits: LaneLimits | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.limits = limits = limits or LaneLimits()
        self.clock = clock
        self.total_bytes = 0  # input buffers + queued + unsent answers + HTTP bodies
        self.connections: set[Any] = set()
        self.kinds: dict[str, int] = {}  # connections per kind ("lane", "baidu_std", "http")
        self.paused: set[Any] = set()  # not read: held back by the bounds or answers unread
        self.idle = IdleConnections[Any](IdlePolicy(limits.idle_timeout, limits.request_timeout))
        self.reasons = {
            IDLE: f"idle for {limits.idle_timeout:g} s (--lane_idle_timeout)",
            SLOW: (
                f"a request not whole within {limits.request_timeout:g} s (--lane_request_timeout)"
            ),
            EVICTED: (
                f"closed for a new connection: the worker had its {limits.max_connections}"
                " (--lane_max_connections)"
            ),
        }
        self.closed = dict.fromkeys(self.reasons, 0)  # connections closed, by reason
        self.refused = 0  # connections refused: the worker full, every connection busy
        self._reported = dict(self.closed)
        self._reported_at = clock()
        self._users = 0
        self._watchdog: asyncio.Task[None] | None = None

    # -- connections ---------------------------------------------------------------------

    def admit(self, connection: Any) -> str | None:
        """Count a new connection in; the reason it is refused when the worker is full and
        no connection is idle to make room."""
        if len(self.connections) >= self.limits.max_connections:
            victim = self.idle.make_room(self.connections)
            if victim is None:
                self.refused += 1
                return (
                    f"this server already has {len(self.connections)} connections, all busy"
                    " (its limit, --lane_max_connections); try another replica or later"
                )
            self._expire(victim, EVICTED)
        self.connections.add(connection)
        self.kinds[connection.kind] = self.kinds.get(connection.kind, 0) + 1
        self.idle.admitted(connection)
        return None

    def _expire(self, connection: Any, reason: str) -> None:
        """Close a connection the server owes nothing (`reason`: a key of `reasons`); its
        place is free at once."""
        self.closed[reason] += 1
        connection.expire(self.reasons[reason], slow=reason == SLOW)
        self.leave(connection)

    def leave(self, connection: Any) -> None:
        """A connection closed (admitted or not)."""
        self.paused.discard(connection)
        if connection in self.connections:
            self.connections.remove(connection)
            self.kinds[connection.kind] -= 1

    def of_kind(self, kind: str) -> list[Any]:
        return [c for c in self.connections if c.kind == kind]

    def charge(self, size: int) -> bool:
        """Count `size` bytes held outside a connection's own accounting (an HTTP body being
        read); False, and nothing counted, when they do not fit in the budget."""
        if self.total_bytes + size > self.limits.budget_bytes:
            return False
        self.total_bytes += size
        return True

    def release(self, size: int) -> None:
        self.total_bytes -= size
        self.resume_held()

    def resume_held(self) -> None:
        """Let connections held back by the byte bounds go on, while the bounds allow."""
        if self.paused:
            for connection in list(self.paused):
                if connection.buffer:
                    connection.resume()

    def stats(self) -> dict[str, int]:
        """For status: the TCP lane's connections (`connections`), the other ports', the
        bytes they all hold, how many were closed idle, too slow or to make room, and how many
        were refused (every connection busy)."""
        kinds = self.kinds
        return {
            "connections": kinds.get("lane", 0),
            "baidu_std_connections": kinds.get("baidu_std", 0),
            "http_connections": kinds.get("http", 0),
            "bytes": self.total_bytes,
            "closed_idle": self.closed[IDLE],
            "closed_slow": self.closed[SLOW],
            "evicted": self.closed[EVICTED],
            "refused": self.refused,
        }

    async def listen(
        self,
        protocol: Callable[[], asyncio.Protocol],
        host: str,
        port: int,
        ssl: ssl_module.SSLContext | None,
        what: str,
    ) -> tuple[asyncio.Server, int]:
        """A listener of one port under these bounds (0: any free port; `what`: the flag
        that chose it, for cube.listen's ListenError): the server and the bound port; the
        watchdog runs until it `detach`es."""
        sock = listen_socket(host, port, what)
        loop = asyncio.get_running_loop()
        # (the backlog again: create_server listens anew, by default with 100); a TLS
        # handshake, before the connection is counted, gets the time a request gets
        handshake = self.limits.request_timeout if ssl is not None else None
        try:
            server = await loop.create_server(
                protocol, sock=sock, ssl=ssl, backlog=BACKLOG, ssl_handshake_timeout=handshake
            )
        except BaseException:
            sock.close()
            raise
        self.attach()
        return server, int(sock.getsockname()[1])

    # -- the watchdog --------------------------------------------------------------------

    def attach(self) -> None:
        """A port starts using these bounds (in the event loop): the watchdog runs while any
        does."""
        self._users += 1
        if self._watchdog is None:
            self._watchdog = asyncio.ensure_future(self._watch())

    def detach(self) -> None:
        self._users -= 1
        if self._users <= 0 and self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_EVERY)
            self.sweep(self.clock())

    def sweep(self, now: float) -> None:
        """The watchdog's round, every quarter second: sample unsent bytes (the transports
        drain on their own), close stalled connections and those idle or too slow for the
        policy, let held ones go on; now and then, say how many were closed."""
        for connection in list(self.connections):
            connection.watch(now)
        for connection, reason in self.idle.sweep(list(self.connections), now):
            self._expire(connection, reason)
        self.resume_held()
        if now - self._reported_at >= REPORT_EVERY:
            self._report(now)

    def _report(self, now: float) -> None:
        counts = {key: self.closed[key] - self._reported[key] for key in self.closed}
        self._reported, self._reported_at = dict(self.closed), now
        said = [f"{count} {self.reasons[key]}" for key, count in counts.items() if count]
        if said:
            level = logging.WARNING if counts[EVICTED] or counts[SLOW] else logging.INFO
            text = "; ".join(said)
            log.log(level, "connections closed in the last %.0f s: %s", REPORT_EVERY, text)


class BoundedProtocol(asyncio.Protocol):
    """One framed connection's share of the `Bounds`: its unparsed input (`buffer`), the
    answers it has queued (`queued`, estimated by the subclass) and the bytes its transport
    has not sent (`unsent`, sampled). Subclasses parse `buffer` while `held()` allows, call
    `_account()` when those change, and implement `resume()`."""

    kind = ""  # the Bounds' name for this port
    label = ""  # what log lines call it

    def __init__(self, bounds: Bounds) -> None:
        self.bounds = bounds
        limits = bounds.limits
        self.budget = limits.budget_bytes
        self.connection_bytes = limits.connection_bytes
        self.stall_timeout = limits.stall_timeout
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()  # unparsed input: a partial frame, or frames held back
        self.closing = False  # refused: read nothing more, close once answered
        self.write_paused = False  # the transport's buffer is above its high-water mark
        self.reading = True
        self.queued = 0  # estimated bytes of answers queued, not yet written
        self.unsent = 0  # bytes the transport still holds (sampled)
        self.counted = 0  # what this connection adds to the worker's total
        self.progress_at = time.monotonic()  # bytes last came in or went out
        self.partial_since = self.progress_at  # the first byte of the partial frame held

    # -- accounting ----------------------------------------------------------------------

    def _account(self) -> None:
        """Bring the worker's total up to date with this connection's bytes."""
        mine = len(self.buffer) + self.queued + self.unsent
        self.bounds.total_bytes += mine - self.counted
        self.counted = mine

    def outstanding(self) -> int:
        return self.queued + self.unsent

    def sample_unsent(self) -> None:
        transport = self.transport
        unsent = transport.get_write_buffer_size() if transport is not None else 0
        if unsent < self.unsent:
            self.progress_at = time.monotonic()
        self.unsent = unsent
        self._account()

    def stalled(self, now: float) -> bool:
        """Holding a partial frame, or answers the peer does not take, with no progress."""
        waiting = (self.buffer and not self.held()) or self.unsent
        return bool(waiting) and now - self.progress_at > self.stall_timeout

    def held(self) -> bool:
        """Whether the next frame must wait for answers to drain (ours or the worker's)."""
        outstanding = self.queued + self.unsent
        if outstanding == 0:
            return self.bounds.total_bytes - len(self.buffer) >= self.budget
        return outstanding >= self.connection_bytes or self.bounds.total_bytes >= self.budget

    def over_budget(self) -> bool:
        """Whether this connection's own input pushed the worker over its budget (it holds no
        answers it could wait for): it is refused and closed."""
        return (
            bool(self.buffer) and not self.outstanding() and self.bounds.total_bytes > self.budget
        )

    def _update_reading(self) -> None:
        want = not (self.closing or self.write_paused or (self.buffer and self.held()))
        if want != self.reading and self.transport is not None:
            self.reading = want
            if want:
                self.bounds.paused.discard(self)
                self.transport.resume_reading()
            else:
                self.bounds.paused.add(self)
                self.transport.pause_reading()

    def watch(self, now: float) -> None:
        """The watchdog's round: sample unsent bytes; close the connection when stalled."""
        if self.unsent:
            self.sample_unsent()
        if self.stalled(now) and self.transport is not None:
            log.warning(
                "%s: closing a connection stalled for %.0f s (%d bytes held)",
                self.label,
                now - self.progress_at,
                self.counted,
            )
            self.transport.abort()

    def waiting(self) -> Waiting | None:
        """For the idle policy (cube.idle): since when the connection has waited for its
        peer's next frame, or None while it is owed answers, held back or closing."""
        transport = self.transport
        if self.queued or self.unsent or self.closing or transport is None:
            return None
        if transport.is_closing():
            return None
        if self.buffer:
            return None if self.held() else Waiting(self.partial_since, partial=True)
        return Waiting(self.progress_at)

    def expire(self, reason: str, slow: bool = False) -> None:
        """Close the connection for the idle policy (nothing is owed to it)."""
        self.closing = True
        self._update_reading()
        self._close()

    def resume(self) -> None:
        """Answers drained (ours or the worker's): parse what was held back, read again."""
        raise NotImplementedError

    def _consume(self, source: bytes | bytearray) -> None:
        """Parse and answer the whole frames at the start of `source` (the buffer, or bytes
        just read while the buffer was empty), keeping the rest (`_keep`)."""
        raise NotImplementedError

    def refuse_connection(self, transport: asyncio.Transport, reason: str) -> None:
        """The worker has its connections' limit: say so (in the port's protocol) before the
        connection is closed."""

    # -- asyncio callbacks ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's TCPTransport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)  # type: ignore[attr-defined]
        refusal = self.bounds.admit(self)
        if refusal is not None:
            self.refuse_connection(self.transport, refusal)  # type: ignore[arg-type]
            self.closing = True
            transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.bounds.leave(self)
        self.buffer = bytearray()
        self.queued = self.unsent = 0
        self._account()
        self.transport = None

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        self.progress_at = time.monotonic()
        if self.buffer:
            self.buffer += data
            self._consume(self.buffer)
        else:
            self._consume(data)  # no copy into the buffer when whole frames came

    def pause_writing(self) -> None:
        self.write_paused = True
        self._update_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        self.sample_unsent()
        self.resume()

    def _keep(self, source: bytes | bytearray, start: int) -> None:
        """Keep `source[start:]` as the buffer (in place when it is the buffer). A frame
        left partial after whole ones, or begun in bytes just read, began when bytes last
        came (`partial_since`, for the idle policy)."""
        if source is self.buffer:
            if start:
                del self.buffer[:start]
                self.partial_since = self.progress_at
        elif start < len(source):  # (else the buffer is empty already)
            self.buffer = bytearray(source[start:])
            self.partial_since = self.progress_at
        self._account()

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()
