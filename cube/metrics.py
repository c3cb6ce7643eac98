"""Metrics shared by the servers: a cheap histogram the hot paths update (one bisect and two
additions), its Prometheus form, and the scrape endpoint (`MetricsEndpoint`, bounded in
connections and threads). The servers keep plain counters and turn snapshots of them into
metric families only when scraped (a custom Collector), which costs the hot path nothing
beyond the additions.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, cast

from cube.idle import IdleConnections, IdlePolicy, Waiting
from cube.listen import listen_socket

log = logging.getLogger("cube.metrics")

INF = float("inf")
T = TypeVar("T")


class Histogram:
    """Counts per bucket (bounds are upper bounds; the last bucket is +Inf) and the sum: one
    bisect and two additions an observation, snapshotted for the metrics at scrape time."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.total += value * times

    def add(self, counts: list[int], total: float) -> None:
        """Observations counted elsewhere (per bucket, and their sum): cube.server.lane's
        compiled pass counts its requests' sizes itself."""
        for index, count in enumerate(counts):
            if count:
                self.counts[index] += count
        self.total += total

    def snapshot(self) -> dict[str, Any]:
        return {"counts": list(self.counts), "sum": self.total}


def cumulative_buckets(
    bounds: tuple[float, ...], snapshot: dict[str, Any]
) -> list[tuple[str, float]]:
    """Prometheus histogram buckets (cumulative, ending with +Inf) from a Histogram snapshot."""
    out, running = [], 0
    for bound, count in zip((*bounds, INF), snapshot["counts"], strict=True):
        running += count
        out.append(("+Inf" if bound == INF else repr(float(bound)), running))
    return out


# The scrape endpoint's bounds: a scraper connects, asks, reads and goes.
SCRAPE_CONNECTIONS = 32  # at most; a new one closes the one idle longest to make room
SCRAPE_TIMEOUT = 10.0  # seconds to send a request after connecting, or to read its answer
MAX_HEAD = 16 << 10  # bytes of a request's head
_SWEEP_EVERY = 1.0
_BACKLOG = 128


class MetricsEndpoint:
    """The scrape endpoint, served from the event loop of the command it belongs to: a
    connection's request head is read by asyncio, the registry rendered on one thread of our
    own (a collector waits for the event loop, so it never runs there), the answer written
    and the connection closed. Bounded, whatever its peers do: `SCRAPE_CONNECTIONS`
    connections (at that many, a new one closes the one waiting longest, as cube.idle
    ranks them, or is closed itself when every one is being answered), one thread, a
    request head of `MAX_HEAD` bytes sent within `SCRAPE_TIMEOUT` of connecting, an answer
    read within `SCRAPE_TIMEOUT` of being written. (prometheus_client's own server started a
    thread a connection, with no bound: 500 idle connections made 515 threads.)"""

    def __init__(
        self,
        registry: Any,
        max_connections: int = SCRAPE_CONNECTIONS,
        timeout: float = SCRAPE_TIMEOUT,
    ) -> None:
        self.registry = registry
        self.max_connections = max_connections
        self.connections: set[_ScrapeConnection] = set()
        self.idle = IdleConnections[_ScrapeConnection](IdlePolicy(timeout, timeout))
        self.server: asyncio.Server | None = None
        self.port = 0
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="metrics")
        self._sweeper: asyncio.TimerHandle | None = None

    async def start(self, host: str, port: int, what: str) -> int:
        """Listen on host:port (0: any free port); the bound port. ListenError when the port
        cannot be listened on (`what` names its flag)."""
        sock = listen_socket(host, port, what, backlog=_BACKLOG)
        loop = asyncio.get_running_loop()
        try:  # (the backlog again: create_server listens anew)
            self.server = await loop.create_server(
                lambda: _ScrapeConnection(self), sock=sock, backlog=_BACKLOG
            )
        except BaseException:
            sock.close()
            raise
        self.port = int(sock.getsockname()[1])
        self._sweeper = loop.call_later(_SWEEP_EVERY, self._sweep)
        return self.port

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self.server is not None:
            self.server.close()
        for connection in list(self.connections):
            connection.expire()
        self.connections.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def admit(self, connection: _ScrapeConnection) -> bool:
        if len(self.connections) >= self.max_connections:
            victim = self.idle.make_room(self.connections)
            if victim is None:
                return False
            victim.expire()
            self.connections.discard(victim)
        self.connections.add(connection)
        self.idle.admitted(connection)
        return True

    def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        for connection, _reason in self.idle.sweep(list(self.connections), loop.time()):
            connection.expire()
            self.connections.discard(connection)
        self._sweeper = loop.call_later(_SWEEP_EVERY, self._sweep)

    async def answer(self, head: bytes) -> bytes:
        """The whole HTTP answer to a request head."""
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return _http(400, "Bad Request", b"not an HTTP request\n", "text/plain")
        if parts[0] != "GET":
            return _http(405, "Method Not Allowed", b"GET /metrics\n", "text/plain")
        accept = ""
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "accept":
                accept = value.strip()
        loop = asyncio.get_running_loop()
        try:
            body, content_type = await loop.run_in_executor(self._executor, self._render, accept)
        except Exception as exc:  # a collector's bug: say so in the log, answer 500
            log.warning("metrics: the scrape failed: %s", exc)
            return _http(500, "Internal Server Error", b"scrape failed\n", "text/plain")
        return _http(200, "OK", body, content_type)

    def _render(self, accept: str) -> tuple[bytes, str]:
        from prometheus_client.exposition import choose_encoder

        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type


def _http(status: int, phrase: str, body: bytes, content_type: str) -> bytes:
    head = (
        f"HTTP/1.1 {status} {phrase}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body


class _ScrapeConnection(asyncio.Protocol):
    """One connection to the endpoint: a request head, then its answer, then closed."""

    def __init__(self, endpoint: MetricsEndpoint) -> None:
        self.endpoint = endpoint
        self.transport: asyncio.Transport | None = None
        self.head = bytearray()
        self.answering = False  # the answer is being made (not idle)
        self.since = 0.0  # connected, then answered (the loop's clock)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        tcp = cast(asyncio.Transport, transport)  # (uvloop's is not a registered subclass)
        self.transport = tcp
        self.since = asyncio.get_running_loop().time()
        if not self.endpoint.admit(self):
            tcp.abort()  # every connection is being answered: come back later

    def connection_lost(self, exc: Exception | None) -> None:
        self.endpoint.connections.discard(self)
        self.transport = None

    def data_received(self, data: bytes) -> None:
        if self.answering or self.transport is None:
            return  # one request a connection
        self.head += data
        end = self.head.find(b"\r\n\r\n")
        if end < 0 and len(self.head) <= MAX_HEAD:
            return
        self.answering = True
        self.transport.pause_reading()
        if end < 0:
            self._send(_http(431, "Request Header Fields Too Large", b"", "text/plain"))
            return
        answer = asyncio.ensure_future(self.endpoint.answer(bytes(self.head[:end])))
        answer.add_done_callback(self._answered)

    def _answered(self, answer: asyncio.Future[bytes]) -> None:
        if not answer.cancelled():
            self._send(answer.result())

    def _send(self, answer: bytes) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        transport.write(answer)
        transport.close()  # once written; the sweep aborts it if it is not read in time
        self.answering = False
        self.since = asyncio.get_running_loop().time()

    def waiting(self) -> Waiting | None:
        """For cube.idle: waiting for its request since it connected (part of it came:
        partial), or for its answer to be read since it was written; None while answered."""
        if self.answering or self.transport is None:
            return None
        return Waiting(self.since, partial=bool(self.head))

    def expire(self) -> None:
        if self.transport is not None:
            self.transport.abort()


async def serve_collector(
    host: str,
    port: int,
    collector: Callable[[Callable[[], T]], Any],
    snapshot: Callable[[], Coroutine[Any, Any, T]],
    what: str = "--metrics_port",
    timeout: float = 10.0,
) -> MetricsEndpoint:
    """Serve `collector(read)` at http://host:port/metrics (0: any free port) from a
    `MetricsEndpoint` in the running event loop, where `read()` runs `snapshot()` on that
    loop (the service's state lives there) and waits at most `timeout`. Returns the endpoint
    (its `port`; `close()` it). ListenError when the port cannot be listened on (`what`
    names its flag). No token: the metrics say counts, versions and timings, never data."""
    from prometheus_client.registry import CollectorRegistry

    loop = asyncio.get_running_loop()

    def read() -> T:
        return asyncio.run_coroutine_threadsafe(snapshot(), loop).result(timeout)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector(read))
    endpoint = MetricsEndpoint(registry)
    await endpoint.start(host, port, what)
    return endpoint
