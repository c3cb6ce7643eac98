"""Prometheus metrics of a cube-server, one scrape endpoint for all its workers.

The hot path only adds to plain per-worker counters (`service.Counters`: once per request,
misses once per kernel pass, never per key). At scrape time worker 0 gathers every worker's
snapshot over the internal control channel (`Coordinator.worker_states`) and `ServerCollector`
turns them into metric families, each labelled by `worker` (a restarted worker's counters
restart at zero, which Prometheus reads as a counter reset). `cube.metrics.MetricsEndpoint`
serves them from worker 0's event loop; its thread renders them and asks the loop for the
snapshots.
Names and units follow Prometheus conventions; no label takes a key, and a version appears
only in `cube_server_version_info` (at most two series per worker at a time).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from cube.metrics import cumulative_buckets
from cube.server.service import APIS, BATCH_BUCKETS, LATENCY_BUCKETS

log = logging.getLogger("cube.server")


class ServerCollector(Collector):
    """Metric families from the workers' states (`LocalWorker.state()` dicts)."""

    def __init__(self, gather: Callable[[], list[dict[str, Any]]]) -> None:
        self.gather = gather

    def collect(self) -> Iterator[Metric]:
        try:
            states = self.gather()
        except Exception as exc:  # a scrape must answer; say what failed in the log
            log.warning("metrics: cannot gather the workers' state: %s", exc)
            states = []
        workers, requests, versions = _WorkerFamilies(), _RequestFamilies(), _VersionFamilies()
        for state in states:
            worker = str(state.get("worker", "?"))
            up = "error" not in state
            workers.up.add_metric([worker], 1.0 if up else 0.0)
            if not up:
                continue
            requests.add(worker, state["metrics"])
            workers.add(worker, state)
            versions.add(worker, state)
        yield workers.up
        yield from requests.families()
        yield from workers.families()
        yield from versions.families()


class _RequestFamilies:
    """Per worker and API: requests, keys by outcome, errors by code, latency and batch size."""

    def __init__(self) -> None:
        self.requests = CounterMetricFamily(
            "cube_server_requests", "Lookup requests answered", labels=["worker", "api"]
        )
        self.keys = CounterMetricFamily(
            "cube_server_keys", "Keys looked up, by outcome", labels=["worker", "api", "outcome"]
        )
        self.errors = CounterMetricFamily(
            "cube_server_request_errors",
            "Lookup requests refused, by gRPC status",
            labels=["worker", "api", "code"],
        )
        self.latency = HistogramMetricFamily(
            "cube_server_request_duration_seconds",
            "Server-side time to answer a request (the TCP lane: its kernel pass)",
            labels=["worker", "api"],
        )
        self.batch = HistogramMetricFamily(
            "cube_server_request_keys", "Keys per request", labels=["worker", "api"]
        )

    def add(self, worker: str, metrics: dict[str, Any]) -> None:
        for api in APIS:
            counters = metrics["api"][api]
            self.requests.add_metric([worker, api], counters["requests"])
            misses = counters["misses"]
            self.keys.add_metric([worker, api, "hit"], counters["keys"] - misses)
            self.keys.add_metric([worker, api, "miss"], misses)
            for code, count in sorted(counters["errors"].items()):
                self.errors.add_metric([worker, api, code], count)
            for family, bounds, name in (
                (self.latency, LATENCY_BUCKETS, "latency"),
                (self.batch, BATCH_BUCKETS, "batch"),
            ):
                snapshot = counters[name]
                buckets = cumulative_buckets(bounds, snapshot)
                family.add_metric([worker, api], buckets, snapshot["sum"])

    def families(self) -> tuple[Metric, ...]:
        return (self.requests, self.keys, self.errors, self.latency, self.batch)


class _WorkerFamilies:
    """Per worker: answered the scrape, in-flight calls, lane connections, and its state."""

    def __init__(self) -> None:
        self.up = GaugeMetricFamily(
            "cube_server_worker_up", "1 when the worker answered this scrape", labels=["worker"]
        )
        self.inflight = GaugeMetricFamily(
            "cube_server_inflight_requests", "gRPC lookups being answered", labels=["worker"]
        )
        self.connections = GaugeMetricFamily(
            "cube_server_lane_connections", "Open TCP lane connections", labels=["worker"]
        )
        self.serving = GaugeMetricFamily(
            "cube_server_serving", "1 when the worker serves a version", labels=["worker"]
        )
        self.loading = GaugeMetricFamily(
            "cube_server_loading", "1 while a version is being loaded", labels=["worker"]
        )
        self.major_faults = CounterMetricFamily(
            "cube_server_major_page_faults",
            "Page faults the worker waited on the disk for (a version larger than memory)",
            labels=["worker"],
        )
        self.draining = GaugeMetricFamily(
            "cube_server_draining",
            "1 once the worker is stopping: in-flight calls finish, no new ones",
            labels=["worker"],
        )

    def add(self, worker: str, state: dict[str, Any]) -> None:
        """The families besides `up` (set for every worker, answering or not)."""
        self.inflight.add_metric([worker], state["metrics"]["inflight"])
        self.connections.add_metric([worker], state.get("lane", {}).get("connections", 0))
        self.serving.add_metric([worker], 1.0 if state.get("serving") else 0.0)
        self.loading.add_metric([worker], 1.0 if state.get("loading") else 0.0)
        self.draining.add_metric([worker], 1.0 if state.get("draining") else 0.0)
        self.major_faults.add_metric([worker], state.get("major_faults", 0))

    def families(self) -> tuple[Metric, ...]:
        """All but `up`, which comes first of all."""
        return (
            self.inflight, self.connections, self.serving, self.loading, self.draining,
            self.major_faults,
        )  # fmt: skip


class _VersionFamilies:
    """Per worker and slot (current or background): the held version and its size."""

    def __init__(self) -> None:
        self.info = GaugeMetricFamily(
            "cube_server_version_info",
            "The versions a worker holds (slot: current or background)",
            labels=["worker", "slot", "version"],
        )
        self.records = GaugeMetricFamily(
            "cube_server_version_records", "Records of a held version", labels=["worker", "slot"]
        )
        self.data = GaugeMetricFamily(
            "cube_server_version_data_bytes",
            "Value bytes mapped for a held version",
            labels=["worker", "slot"],
        )
        self.mapped = GaugeMetricFamily(
            "cube_server_version_mapped_bytes",
            "Bytes of index and values mapped for a held version (a delta: its layers)",
            labels=["worker", "slot"],
        )
        self.locked = GaugeMetricFamily(
            "cube_server_version_locked_bytes",
            "Of those, bytes locked in memory (--in_mem; fewer when RLIMIT_MEMLOCK refuses)",
            labels=["worker", "slot"],
        )
        self.load = GaugeMetricFamily(
            "cube_server_version_load_seconds",
            "Time the held version took to load",
            labels=["worker", "slot"],
        )
        self.in_memory = GaugeMetricFamily(
            "cube_server_version_in_memory",
            "1 when the held version is served as --in_mem asks, 0 when it did not fit the"
            " memory the server may pin (served from the page cache, its index pinned alone"
            " if that fits: the status's memory_note says why)",
            labels=["worker", "slot"],
        )

        self.hot_bytes = GaugeMetricFamily(
            "cube_server_hot_cache_bytes",
            "Bytes of the hot cache in front of a version served paged (too large for the"
            " memory: cube.server.hot)",
            labels=["worker", "slot"],
        )
        self.hot_asked = CounterMetricFamily(
            "cube_server_hot_cache_lookups",
            "Keys looked up in a version served paged",
            labels=["worker", "slot"],
        )
        self.hot_hits = CounterMetricFamily(
            "cube_server_hot_cache_hits",
            "Of those, keys answered from its hot cache (the rest read from disk or the page"
            " cache)",
            labels=["worker", "slot"],
        )

    def add(self, worker: str, state: dict[str, Any]) -> None:
        for slot, version in state.get("versions", {}).items():
            hot = version.get("hot_cache")
            if hot:
                self.hot_bytes.add_metric([worker, slot], hot["bytes"])
                self.hot_asked.add_metric([worker, slot], hot["asked"])
                self.hot_hits.add_metric([worker, slot], hot["hits"])
            self.info.add_metric([worker, slot, version["version"]], 1.0)
            self.records.add_metric([worker, slot], version["record_count"])
            self.data.add_metric([worker, slot], version["data_bytes"])
            self.load.add_metric([worker, slot], version["load_seconds"])
            self.mapped.add_metric([worker, slot], version.get("mapped_bytes", 0))
            self.locked.add_metric([worker, slot], version.get("locked_bytes", 0))
            self.in_memory.add_metric([worker, slot], 0.0 if version.get("memory_note") else 1.0)

    def families(self) -> tuple[Metric, ...]:
        return (
            self.info, self.records, self.data, self.mapped, self.locked, self.load,
            self.in_memory, self.hot_bytes, self.hot_asked, self.hot_hits,
        )  # fmt: skip
