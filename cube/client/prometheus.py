"""Prometheus metrics of the SDK, for applications that export their own: register a
`ClientCollector` over the `ClientStats` given to the client(s).

    stats = ClientStats()
    client = CubeClient.from_conf("cube.conf", stats=stats)
    prometheus_client.REGISTRY.register(ClientCollector(stats, dict_name="emb"))
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from cube.client.stats import CALL_BUCKETS, SHARD_FIELDS, ClientStats
from cube.metrics import cumulative_buckets

_SHARD_HELP = {
    "sub_requests": "Sub-requests sent to a shard (one per shard and round)",
    "retries": "Attempts after a failure",
    "hedges": "Backup requests sent",
    "hedges_won": "Answers that came from a backup request",
    "failovers": "Answers from another replica than the one tried first",
    "failed": "Sub-requests that failed on every replica tried",
}


class ClientCollector(Collector):
    def __init__(self, stats: ClientStats, dict_name: str = "") -> None:
        self.stats = stats
        self.dict_name = dict_name

    def collect(self) -> Iterator[Metric]:
        s = self.stats.snapshot()
        d = self.dict_name
        calls = CounterMetricFamily(
            "cube_client_calls", "seek() calls, by outcome", labels=["dict", "outcome"]
        )
        for outcome, count in sorted(s["calls"].items()):
            calls.add_metric([d, outcome], count)
        latency = HistogramMetricFamily(
            "cube_client_call_duration_seconds", "Client-side time of a seek() call",
            labels=["dict"],
        )  # fmt: skip
        latency.add_metric([d], cumulative_buckets(CALL_BUCKETS, s["latency"]), s["latency"]["sum"])
        yield from (calls, latency)
        for field in SHARD_FIELDS:
            family = CounterMetricFamily(
                f"cube_client_shard_{field}", _SHARD_HELP[field], labels=["dict", "shard"]
            )
            for shard, counts in sorted(s["shards"].items()):
                family.add_metric([d, str(shard)], counts[field])
            yield family
        errors = CounterMetricFamily(
            "cube_client_attempt_errors",
            "Failed attempts, by shard and status",
            labels=["dict", "shard", "code"],
        )
        for shard, code, count in sorted(s["attempt_errors"]):
            errors.add_metric([d, str(shard), code], count)
        yield errors
