"""Opt-in client-side statistics: `CubeClient(..., stats=ClientStats())` counts every call
(its latency, its outcome) and every sub-request per shard (retries, backup requests sent and
won, failovers, failed attempts by status). Plain counters, read with `snapshot()`; an
application that exports Prometheus metrics registers `cube.client.prometheus.ClientCollector`
(the SDK itself does not depend on prometheus_client)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from cube.client._core import PieceOutcome
from cube.metrics import Histogram

# client-side time of a seek() call, seconds
CALL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
SHARD_FIELDS = ("sub_requests", "retries", "hedges", "hedges_won", "failovers", "failed")


class ClientStats:
    """Counters of one or more clients; safe to share between threads and clients."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls: dict[str, int] = {}  # outcome ("ok" or the error class) -> calls
        self.latency = Histogram(CALL_BUCKETS)
        self.shards: dict[int, dict[str, int]] = {}
        self.attempt_errors: dict[tuple[int, str], int] = {}  # (shard, status) -> attempts

    def call(self, outcome: str, seconds: float) -> None:
        with self._lock:
            self.calls[outcome] = self.calls.get(outcome, 0) + 1
            self.latency.observe(seconds)

    def round(self, shards: Sequence[int], outcomes: Sequence[PieceOutcome]) -> None:
        """One round of sub-requests ended: `shards[i]` is the shard of `outcomes[i]`."""
        with self._lock:
            for shard, outcome in zip(shards, outcomes, strict=True):
                counts = self.shards.setdefault(shard, dict.fromkeys(SHARD_FIELDS, 0))
                counts["sub_requests"] += 1
                counts["retries"] += outcome.retries
                counts["hedges"] += outcome.hedges
                counts["hedges_won"] += int(outcome.hedge_won)
                counts["failovers"] += int(outcome.failover)
                counts["failed"] += int(outcome.answer is None)
                for attempt in outcome.attempts:
                    key = (shard, attempt.code)
                    self.attempt_errors[key] = self.attempt_errors.get(key, 0) + 1

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "calls": dict(self.calls),
                "latency": self.latency.snapshot(),
                "shards": {shard: dict(counts) for shard, counts in self.shards.items()},
                "attempt_errors": [[s, c, n] for (s, c), n in self.attempt_errors.items()],
            }
