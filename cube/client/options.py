"""The SDK's settings as small objects (httpx / redis-py style): how long an attempt and the
whole call may take and when to send a backup request (`Timeouts`), how often and how soon to
retry (`Retry`, with a `cube.backoff.Backoff`), and the string choices as `Literal` types."""

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
    """How long a call may take.

    `attempt`: seconds one attempt (one sub-request to one replica) may take before it counts
    as failed (DEADLINE_EXCEEDED) and is retried on another replica, while the retry budget
    and `total` allow.
    `backup_after`: seconds without an answer before the same request also goes to another
    replica (the first answer wins, the other attempt is cancelled); None: no backup
    requests.
    `total`: seconds the whole call may take: every shard, retry, backoff, backup request and
    version re-ask included. Attempts are cut to what remains, nothing new starts past it,
    and when it passes the call raises `DeadlineExceededError` (a `ShardUnavailableError`
    and a `TimeoutError`) naming the dict and the shards without an answer. None: no bound on
    the whole call (each round of sub-requests still ends within its attempts' timeouts and
    backoffs).

    Defaults: `CubeClient(timeout=0.3)` means `Timeouts(attempt=0.3)`: per attempt, no `total`
    (as before). `from_conf` follows the original, where cube.conf's `timeout` is brpc's
    `timeout_ms`, a deadline for the whole call including its retries and backup requests:
    `Timeouts(attempt=attempt_timeout or timeout, backup_after=backup_request,
    total=timeout)`, all converted from milliseconds (see docs/reference/cube-conf.md)."""

    attempt: float = 1.0
    backup_after: float | None = None
    total: float | None = None

    def __post_init__(self) -> None:
        if not self.attempt > 0:
            raise ConfError(f"Timeouts.attempt must be > 0 s, got {self.attempt}")
        if self.backup_after is not None and not self.backup_after > 0:
            raise ConfError(f"Timeouts.backup_after must be > 0 s or None, got {self.backup_after}")
        if self.total is not None and not self.total > 0:
            raise ConfError(f"Timeouts.total must be > 0 s or None, got {self.total}")


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
