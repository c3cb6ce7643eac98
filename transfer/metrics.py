"""Prometheus metrics of cube-transfer: where each dictionary stands (the live version, since
when, the rollout in progress, its phase and since when), how rollouts end, how long each
phase takes, failed versions tried again or abandoned and the next retry, each replica's state
and whether it is behind, and donefile poll errors.

`RolloutCounters` is updated by the service as rollouts end (plain counters, monotonic for the
life of the process); `TransferCollector` reads a snapshot taken on the event loop at scrape
time. Labels are bounded: the dict, an outcome, a phase, a replica's shard and replica number
from transfer.conf, an instance status; a version appears only in `cube_transfer_live_version_info`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from cube.metrics import Histogram, cumulative_buckets

OUTCOMES = ("committed", "aborted", "refused", "rolled_back", "rollback_failed")
PHASES = ("build", "download", "reload", "enable")
# rollout phases take seconds to an hour
PHASE_BUCKETS = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
# (phase, the record time it starts at, the one it ends at)
PHASE_TIMES = (
    ("build", "build_start", "built"),
    ("download", "built", "downloaded"),
    ("reload", "downloaded", "reloaded"),
    ("enable", "reloaded", "enabled"),
)


class RolloutCounters:
    """How rollouts ended and how long their phases took, since the transfer started."""

    def __init__(self) -> None:
        self.outcomes = dict.fromkeys(OUTCOMES, 0)
        self.phases = {phase: Histogram(PHASE_BUCKETS) for phase in PHASES}
        self.donefile_errors = 0
        self.last_success = 0.0  # when the last rollout (or rollback) made a version live
        self.retries = 0  # rollouts begun again after a failure
        self.abandoned = 0  # failed versions that will not be tried again

    def ended(self, outcome: str, times: dict[str, float] | None = None, at: float = 0.0) -> None:
        """A rollout ended with `outcome`; a committed one's phase durations from `times`."""
        self.outcomes[outcome] += 1
        if outcome in ("committed", "rolled_back"):
            self.last_success = at
        committed = times if times and outcome == "committed" else {}
        for phase, start, end in PHASE_TIMES if committed else ():
            if start in committed and end in committed:
                self.phases[phase].observe(committed[end] - committed[start])

    def snapshot(self) -> dict[str, Any]:
        return {
            "outcomes": dict(self.outcomes),
            "phases": {phase: h.snapshot() for phase, h in self.phases.items()},
            "donefile_errors": self.donefile_errors,
            "last_success": self.last_success,
            "retries": self.retries,
            "abandoned": self.abandoned,
        }


class TransferCollector(Collector):
    """Metric families from `snapshot()`, a dict taken on the event loop (`service_snapshot`)."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot()
        yield from _rollout_families(s)
        yield from _retry_families(s)
        yield from _instance_families(s)


def _rollout_families(s: dict[str, Any]) -> tuple[Metric, ...]:
    """Where the dict stands: the live version and since when, how rollouts ended and how
    long their phases took, the phase in progress, and donefile poll errors."""
    d = s["dict"]
    live = GaugeMetricFamily(
        "cube_transfer_live_version_info", "The version live now", labels=["dict", "version"]
    )
    if s["live_version"]:
        live.add_metric([d, s["live_version"]], 1.0)
    since = GaugeMetricFamily(
        "cube_transfer_live_since_timestamp_seconds",
        "When the live version went live (Unix time; 0: none yet)",
        labels=["dict"],
    )
    since.add_metric([d], s["live_since"])
    success = GaugeMetricFamily(
        "cube_transfer_last_success_timestamp_seconds",
        "When a rollout or rollback last made a version live, in this process (Unix time)",
        labels=["dict"],
    )
    success.add_metric([d], s["counters"]["last_success"])
    rollouts = CounterMetricFamily(
        "cube_transfer_rollouts", "Rollouts ended, by outcome", labels=["dict", "outcome"]
    )
    for outcome, count in s["counters"]["outcomes"].items():
        rollouts.add_metric([d, outcome], count)
    phases = HistogramMetricFamily(
        "cube_transfer_phase_duration_seconds",
        "Duration of each phase of committed rollouts",
        labels=["dict", "phase"],
    )
    for phase, snapshot in s["counters"]["phases"].items():
        buckets = cumulative_buckets(PHASE_BUCKETS, snapshot)
        phases.add_metric([d, phase], buckets, snapshot["sum"])
    deploying = GaugeMetricFamily(
        "cube_transfer_rollout_phase",
        "1 for the phase of the rollout in progress (none: no rollout)",
        labels=["dict", "phase"],
    )
    if s["phase"]:
        deploying.add_metric([d, s["phase"]], 1.0)
    started = GaugeMetricFamily(
        "cube_transfer_rollout_started_timestamp_seconds",
        "When the rollout (or rollback) in progress began (Unix time; 0: none)",
        labels=["dict"],
    )
    started.add_metric([d], s["rollout_started"])
    errors = CounterMetricFamily(
        "cube_transfer_donefile_poll_errors",
        "Donefile reads that failed",
        labels=["dict"],
    )
    errors.add_metric([d], s["counters"]["donefile_errors"])
    return (live, since, success, rollouts, phases, deploying, started, errors)


def _retry_families(s: dict[str, Any]) -> tuple[Metric, ...]:
    """Failed versions tried again, given up on, awaiting a retry, and the next retry."""
    d = s["dict"]
    retries = CounterMetricFamily(
        "cube_transfer_version_retries",
        "Rollouts of a failed version begun again (its retry)",
        labels=["dict"],
    )
    retries.add_metric([d], s["counters"]["retries"])
    abandoned = CounterMetricFamily(
        "cube_transfer_versions_abandoned",
        "Failed versions given up on (attempts spent, superseded, or not retryable)",
        labels=["dict"],
    )
    abandoned.add_metric([d], s["counters"]["abandoned"])
    awaiting = GaugeMetricFamily(
        "cube_transfer_versions_awaiting_retry",
        "Failed versions with a retry scheduled",
        labels=["dict"],
    )
    awaiting.add_metric([d], s["retry"]["awaiting"])
    next_retry = GaugeMetricFamily(
        "cube_transfer_next_retry_timestamp_seconds",
        "When the next retry of a failed version is due (Unix time; 0: none scheduled)",
        labels=["dict"],
    )
    next_retry.add_metric([d], s["retry"]["next_at"])
    return (retries, abandoned, awaiting, next_retry)


def _instance_families(s: dict[str, Any]) -> tuple[Metric, ...]:
    """Each replica's status, whether it is behind or unreachable, its failed catch-ups; a
    replica (instance `<shard>_<replica>` of transfer.conf) by its `shard` and `replica`
    labels: an `instance` label would clash with the one Prometheus gives every target."""
    d = s["dict"]
    state = GaugeMetricFamily(
        "cube_transfer_instance_status",
        "1 for each replica's status (the original's Instance.status names)",
        labels=["dict", "shard", "replica", "status"],
    )
    behind = GaugeMetricFamily(
        "cube_transfer_instance_behind",
        "1 when a replica does not serve the live version",
        labels=["dict", "shard", "replica"],
    )
    reachable = GaugeMetricFamily(
        "cube_transfer_instance_reachable",
        "1 when the replica's agent and server answer",
        labels=["dict", "shard", "replica"],
    )
    failures = GaugeMetricFamily(
        "cube_transfer_instance_catch_up_failures",
        "Consecutive failed catch-ups of a replica",
        labels=["dict", "shard", "replica"],
    )
    for name, inst in s["instances"].items():
        shard, _, replica = name.partition("_")
        state.add_metric([d, shard, replica, inst["status"]], 1.0)
        lagging = bool(s["live_version"]) and inst["version"] != s["live_version"]
        behind.add_metric([d, shard, replica], 1.0 if lagging else 0.0)
        reachable.add_metric([d, shard, replica], 1.0 if inst["reachable"] else 0.0)
        failures.add_metric([d, shard, replica], inst["catch_up_failures"])
    return (state, behind, reachable, failures)
