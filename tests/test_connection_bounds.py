"""Idle connections cannot starve a server (issue 24), the policy on a fake clock: cube.idle
(which connections close, which one makes room for a newcomer) and the worker's `Bounds`
that applies it to the TCP lane, HTTP+JSON and baidu_std. The real sockets:
tests/test_server_hardening.py (3000 idle connections a face) and test_server_metrics.py."""

from __future__ import annotations

import asyncio

import pytest

from cube.idle import IDLE, SLOW, IdleConnections, IdlePolicy, Waiting, eviction_order
from cube.metrics import MetricsEndpoint
from cube.server.bounds import Bounds, LaneLimits


class Fake:
    """A connection as the policy sees it: waiting since `since` (part of a request came:
    `partial`), or busy (owed an answer)."""

    kind = "lane"
    buffer = b""
    counted = 0

    def __init__(self, name: str, since: float, partial: bool = False, busy: bool = False) -> None:
        self.name = name
        self.since = since
        self.partial = partial
        self.busy = busy
        self.closed = ""  # the reason it was closed for

    def waiting(self) -> Waiting | None:
        if self.busy or self.closed:
            return None
        return Waiting(self.since, self.partial)

    def watch(self, now: float) -> None:
        pass

    def expire(self, reason: str, slow: bool = False) -> None:
        self.closed = reason

    def __repr__(self) -> str:
        return self.name


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# ---------------------------------------------------------------------------------------------
# cube.idle


def test_idle_connections_close_after_the_idle_timeout_dripping_ones_after_the_request_one() -> (
    None
):
    policy = IdlePolicy(idle_timeout=60.0, request_timeout=30.0)
    idle = Waiting(since=100.0)
    assert policy.overdue(idle, 160.0) is None
    assert policy.overdue(idle, 160.5) == IDLE
    # a drip: part of a request since 100, a byte a second since; its first byte counts
    drip = Waiting(since=100.0, partial=True)
    assert policy.overdue(drip, 130.0) is None
    assert policy.overdue(drip, 130.5) == SLOW


def test_eviction_takes_the_idle_longest_then_the_request_coming_longest() -> None:
    a, b, c, d = (Fake(n, 0) for n in "abcd")
    order = eviction_order(
        [(Waiting(5.0, True), a), (Waiting(3.0), b), (Waiting(1.0), c), (Waiting(2.0, True), d)]
    )
    assert [order.pop()[1] for _ in range(4)] == [c, b, d, a]


def test_make_room_skips_what_closed_or_was_active_since_and_takes_newcomers_last() -> None:
    old, older, oldest = Fake("old", 3.0), Fake("older", 2.0), Fake("oldest", 1.0)
    connections = {old, older, oldest}
    tracker = IdleConnections[Fake](IdlePolicy())
    assert tracker.sweep(connections, 4.0) == []  # none overdue; ranked
    oldest.since = 4.5  # answered since the sweep: idle, but not for long
    connections.discard(older)  # closed by its peer since the sweep
    new, newer = Fake("new", 5.0), Fake("newer", 6.0)
    for connection in (new, newer):  # came in since the sweep
        connections.add(connection)
        tracker.admitted(connection)
    new.busy = True  # its request is being answered
    assert tracker.make_room(connections) is old
    connections.discard(old)
    assert tracker.make_room(connections) is newer
    connections.discard(newer)
    assert tracker.make_room(connections) is None  # oldest: ranked again at the next sweep
    assert tracker.sweep(connections, 7.0) == []
    assert tracker.make_room(connections) is oldest


# ---------------------------------------------------------------------------------------------
# a worker's Bounds


def bounds(clock: Clock, max_connections: int = 3) -> Bounds:
    limits = LaneLimits(max_connections=max_connections, idle_timeout=60.0, request_timeout=30.0)
    return Bounds(limits, clock=clock)


def test_a_full_worker_admits_a_new_connection_by_closing_the_idle_longest() -> None:
    clock = Clock()
    worker = bounds(clock)
    busy = Fake("busy", 1.0, busy=True)
    idle_long, idle_short = Fake("idle long", 2.0), Fake("idle short", 3.0)
    for connection in (busy, idle_long, idle_short):
        assert worker.admit(connection) is None
    newcomer = Fake("new", clock.now)
    assert worker.admit(newcomer) is None
    assert "--lane_max_connections" in idle_long.closed and not idle_short.closed
    assert worker.connections == {busy, idle_short, newcomer}
    assert worker.stats()["evicted"] == 1
    # every connection busy: the next one is refused, nobody is closed
    idle_short.busy = newcomer.busy = True
    refusal = worker.admit(Fake("refused", clock.now))
    assert refusal is not None and "all busy" in refusal and "--lane_max_connections" in refusal
    assert worker.connections == {busy, idle_short, newcomer}


def test_a_flood_of_idle_connections_never_keeps_a_new_one_out() -> None:
    """3000 connections that send nothing, against a limit of 1024: each admitted, the
    oldest closed to make room; the one after them (the SDK) too."""
    clock = Clock()
    worker = bounds(clock, max_connections=1024)
    flood = []
    for i in range(3000):
        clock.now += 0.001
        flood.append(Fake(f"idle {i}", clock.now))
        assert worker.admit(flood[-1]) is None
        if i % 250 == 0:
            worker.sweep(clock.now)
    sdk = Fake("sdk", clock.now)
    assert worker.admit(sdk) is None
    assert sdk in worker.connections and len(worker.connections) == 1024
    assert all(c.closed for c in flood[:1977]) and not any(c.closed for c in flood[1977:])
    assert worker.stats()["evicted"] == 1977


def test_the_sweep_closes_idle_and_dripping_connections() -> None:
    clock = Clock(0.0)
    worker = bounds(clock, max_connections=10)
    idle = Fake("idle", 0.0)
    drip = Fake("drip", 10.0, partial=True)  # its request began at 10 and keeps coming
    busy = Fake("busy", 0.0, busy=True)
    for connection in (idle, drip, busy):
        worker.admit(connection)
    clock.now = 40.0
    worker.sweep(clock.now)
    assert not idle.closed and not drip.closed
    clock.now = 40.5
    worker.sweep(clock.now)
    assert "--lane_request_timeout" in drip.closed and not idle.closed
    clock.now = 60.5
    worker.sweep(clock.now)
    assert "--lane_idle_timeout" in idle.closed and not busy.closed
    assert worker.connections == {busy}
    stats = worker.stats()
    assert (stats["closed_idle"], stats["closed_slow"], stats["evicted"]) == (1, 1, 0)


# ---------------------------------------------------------------------------------------------
# the metrics endpoint (the same policy, in-process on real sockets)


@pytest.mark.parametrize("held", [0, 100])
def test_metrics_endpoint_answers_whatever_idle_connections_hold(held: int) -> None:
    from prometheus_client import CollectorRegistry, Counter

    registry = CollectorRegistry()
    Counter("probe", "a counter", registry=registry).inc()

    async def main() -> bytes:
        endpoint = MetricsEndpoint(registry, max_connections=8, timeout=30.0)
        port = await endpoint.start("127.0.0.1", 0, "--metrics_port")
        idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(held)]
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            assert len(endpoint.connections) <= 8
            return answer
        finally:
            for _, w in idle:
                w.close()
            await endpoint.close()

    answer = asyncio.run(main())
    assert answer.startswith(b"HTTP/1.1 200 OK") and b"probe_total 1.0" in answer
