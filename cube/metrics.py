"""Metrics shared by the servers: a cheap histogram the hot paths update (one bisect and two
additions), its Prometheus form, and the scrape endpoint. The servers keep plain counters and
turn snapshots of them into metric families only when scraped (a custom Collector), which
costs the hot path nothing beyond the additions.
"""

from __future__ import annotations

import asyncio
import bisect
import errno
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

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

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

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


def serve_collector(
    host: str,
    port: int,
    collector: Callable[[Callable[[], T]], Any],
    snapshot: Callable[[], Coroutine[Any, Any, T]],
    loop: asyncio.AbstractEventLoop,
    timeout: float = 10.0,
) -> tuple[Any, int]:
    """Serve `collector(read)` at http://host:port/metrics (0: any free port) from
    prometheus_client's own thread, where `read()` runs `snapshot()` on `loop` (the service's
    state lives there) and waits at most `timeout`. Returns (the server, to `shutdown()`; its
    port). No token: the metrics say counts, versions and timings, never data."""
    from prometheus_client import start_http_server
    from prometheus_client.registry import CollectorRegistry

    def read() -> T:
        return asyncio.run_coroutine_threadsafe(snapshot(), loop).result(timeout)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector(read))
    try:
        server, _thread = start_http_server(port, host, registry=registry)
    except OSError as exc:  # the same words from every command
        reason = "port in use" if exc.errno == errno.EADDRINUSE else exc.strerror
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        message = f"cannot serve metrics on {where} (--metrics_port): {reason}"
        raise OSError(exc.errno, message) from exc
    return server, int(server.server_port)
