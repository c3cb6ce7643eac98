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
  quarter second (a stalled or malicious peer frees what it holds). A connection idle
  between requests holds nothing and is never closed for it.

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

log = logging.getLogger("cube.server")

WRITE_HIGH_WATER = 4 << 20  # the transport pauses us (and we stop reading) above this
WATCH_EVERY = 0.25  # seconds between the watchdog's rounds


@dataclass(frozen=True)
class LaneLimits:
    """Byte and time bounds of a worker's socket connections (module docstring); `max_frame`
    is the TCP lane's request frame bound."""

    max_frame: int = 4 << 20
    connection_bytes: int = 16 << 20
    budget_bytes: int = 256 << 20
    stall_timeout: float = 30.0
    max_connections: int = 1024


class Bounds:
    """One worker's connections on its socket ports and the bytes they hold (module
    docstring). A connection is anything with `kind`, `counted` (its bytes in `total_bytes`),
    `watch(now)` (sample what it holds, close it when stalled) and, when held back in
    `paused`, `resume()`."""

    def __init__(self, limits: LaneLimits | None = None) -> None:
        self.limits = limits or LaneLimits()
        self.total_bytes = 0  # input buffers + queued + unsent answers + HTTP bodies
        self.connections: set[Any] = set()
        self.kinds: dict[str, int] = {}  # connections per kind ("lane", "baidu_std", "http")
        self.paused: set[Any] = set()  # not read: held back by the bounds or answers unread
        self._users = 0
        self._watchdog: asyncio.Task[None] | None = None

    # -- connections ---------------------------------------------------------------------

    def admit(self, connection: Any) -> str | None:
        """Count a new connection in; the reason it is refused when the worker is full."""
        if len(self.connections) >= self.limits.max_connections:
            return (
                f"this server already has {len(self.connections)} connections (its limit,"
                " --lane_max_connections); try another replica or later"
            )
        self.connections.add(connection)
        self.kinds[connection.kind] = self.kinds.get(connection.kind, 0) + 1
        return None

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
        """For status: the TCP lane's connections (`connections`), the other ports', and the
        bytes they all hold."""
        kinds = self.kinds
        return {
            "connections": kinds.get("lane", 0),
            "baidu_std_connections": kinds.get("baidu_std", 0),
            "http_connections": kinds.get("http", 0),
            "bytes": self.total_bytes,
        }

    async def listen(
        self,
        protocol: Callable[[], asyncio.Protocol],
        host: str,
        port: int,
        ssl: ssl_module.SSLContext | None,
    ) -> tuple[asyncio.Server, int]:
        """A listener of one port under these bounds (0: any free port): the server and the
        bound port; the watchdog runs until it `detach`es."""
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            protocol, host, port, reuse_address=True, backlog=1024, ssl=ssl
        )
        self.attach()
        return server, int(server.sockets[0].getsockname()[1])

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
        """Every quarter second: sample unsent bytes (the transports drain on their own),
        close stalled connections, let held ones go on."""
        while True:
            await asyncio.sleep(WATCH_EVERY)
            now = time.monotonic()
            for connection in list(self.connections):
                connection.watch(now)
            self.resume_held()


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
        self.progress_at = time.monotonic()

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
        """Keep `source[start:]` as the buffer (in place when it is the buffer)."""
        if source is self.buffer:
            del self.buffer[:start]
        elif start < len(source):  # (else the buffer is empty already)
            self.buffer = bytearray(source[start:])
        self._account()

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()
