"""Which connections a server closes because their peers send nothing, and which one goes when
the server is full and a new connection comes: the policy, free of I/O (the caller passes the
time), shared by cube-server's socket ports (cube/server/bounds.py) and the metrics endpoint
(cube/metrics.py).

A connection the server owes nothing (no request being answered, no answer unsent) is
*waiting* for its peer's next request, since it connected or since its last answer:
- nothing of that request for `idle_timeout` seconds: closed (nginx's keepalive_timeout, and
  its client_header_timeout for a first request);
- part of it, but not the whole, `request_timeout` seconds after its first byte: closed (a
  peer dripping bytes, one a second, is closed however steady its drip).
When a new connection comes and the server has its most connections, a waiting one makes
room: the one idle longest first, then the one whose request has been coming longest. A
connection being answered is never chosen (the newcomer is refused when every one is).

The shell keeps one timestamp per connection, updated as bytes come and go, and sweeps its
connections periodically (`IdleConnections.sweep`): no work per request beyond that.
"""

from __future__ import annotations

import collections
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Generic, NamedTuple, Protocol, TypeVar


class Waiting(NamedTuple):
    """A connection waiting for its peer's next request: since when (connected, last answered,
    or, when part of the request has come (`partial`), its first byte)."""

    since: float
    partial: bool = False


class Watched(Protocol):
    def waiting(self) -> Waiting | None:
        """None while the server owes the peer something (an answer being made or sent)."""


C = TypeVar("C", bound=Watched)
IDLE = "idle"  # closed: nothing of a request for idle_timeout
SLOW = "slow"  # closed: a request not whole within request_timeout


@dataclass(frozen=True)
class IdlePolicy:
    """How long a waiting connection may wait (module docstring)."""

    idle_timeout: float = 60.0
    request_timeout: float = 30.0

    def overdue(self, waiting: Waiting, now: float) -> str | None:
        """Why the connection is closed now, `IDLE` or `SLOW` (None: not yet)."""
        if waiting.partial:
            return SLOW if now - waiting.since > self.request_timeout else None
        return IDLE if now - waiting.since > self.idle_timeout else None


def eviction_order(candidates: Iterable[tuple[Waiting, C]]) -> list[tuple[Waiting, C]]:
    """The connections that may make room, the first to go LAST (for pop()): idle ones before
    those part-way through a request, each the longest waiting first."""
    return sorted(candidates, key=lambda item: (item[0].partial, item[0].since), reverse=True)


class IdleConnections(Generic[C]):
    """The policy over a server's connections (anything with `waiting()`): which to close on a
    sweep, and which makes room for a newcomer. Pure: the caller passes the connections and
    the time, and closes what it is told to.

    A sweep ranks the waiting connections for eviction; `make_room` takes them in that order,
    then those admitted since (`admitted`), oldest first, skipping any that has closed or
    been active since: a connection answered a moment ago is not taken for one idle since it
    connected. So making room costs a few steps, never a pass over every connection, and a
    flood of newcomers against a server whose connections are all busy is refused at that
    cost."""

    def __init__(self, policy: IdlePolicy) -> None:
        self.policy = policy
        self._ranked: list[tuple[Waiting, C]] = []
        self._fresh: collections.deque[tuple[Waiting, C]] = collections.deque()

    def sweep(self, connections: Iterable[C], now: float) -> list[tuple[C, str]]:
        """The connections to close now, with why; the others that wait are ranked for
        eviction."""
        overdue = []
        candidates = []
        for connection in connections:
            waiting = connection.waiting()
            if waiting is None:
                continue
            reason = self.policy.overdue(waiting, now)
            if reason is None:
                candidates.append((waiting, connection))
            else:
                overdue.append((connection, reason))
        self._ranked = eviction_order(candidates)
        self._fresh.clear()
        return overdue

    def admitted(self, connection: C) -> None:
        """A connection came in since the last sweep (it may make room before the next)."""
        waiting = connection.waiting()
        if waiting is not None:
            self._fresh.append((waiting, connection))

    def make_room(self, connections: Collection[C]) -> C | None:
        """The connection to close so that a new one fits (None: every one is busy, or has
        been active since the last sweep)."""
        ranked, fresh = self._ranked, self._fresh
        while ranked or fresh:
            waiting, connection = ranked.pop() if ranked else fresh.popleft()
            if connection in connections and connection.waiting() == waiting:
                return connection
        return None
