"""The SDK's settings as small objects (httpx / redis-py style): how long an attempt may take
and when to send a backup request (`Timeouts`), how often and how soon to retry (`Retry`,
with a `cube.backoff.Backoff`), and the string choices as `Literal` types."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from cube.backoff import Backoff
from cube.client.errors import ConfError

Partitioner = Literal["mod", "murmur3"]
LoadBalancer = Literal["rr", "random", "la"]
WireProtocol = Literal["fast", "original"]
TransportName = Literal["auto", "grpc"]


@dataclass(frozen=True)
class Timeouts:
    """`attempt`: seconds one attempt may take before it counts as failed (DEADLINE_EXCEEDED).
    `backup_after`: seconds without an answer before the same request also goes to another
    replica (the first answer wins, the other attempt is cancelled); None: no backup
    requests. cube.conf's `timeout` and `backup_request` (milliseconds) map to these."""

    attempt: float = 1.0
    backup_after: float | None = None

    def __post_init__(self) -> None:
        if not self.attempt > 0:
            raise ConfError(f"Timeouts.attempt must be > 0 s, got {self.attempt}")
        if self.backup_after is not None and not self.backup_after > 0:
            raise ConfError(f"Timeouts.backup_after must be > 0 s or None, got {self.backup_after}")


@dataclass(frozen=True)
class Retry:
    """`attempts`: extra attempts after the first, on the shard's other replicas first (a
    status that says the request itself is wrong is never retried). `backoff`: the wait
    before each retry. `cooldown`: how long a replica that failed is avoided (doubling with
    each failure in a row)."""

    attempts: int = 2
    backoff: Backoff = field(default_factory=lambda: Backoff(0.002, 0.1, jitter=0.5))
    cooldown: Backoff = field(default_factory=lambda: Backoff(0.1, 2.0))

    def __post_init__(self) -> None:
        if self.attempts < 0:
            raise ConfError(f"Retry.attempts must be >= 0, got {self.attempts}")
