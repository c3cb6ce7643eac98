"""End to end: the SDK against `cube-server --workers 2` on issue 3's workload (1M keys, 40-byte
values, 1000-key batches of fresh random keys, client and server on the same machine).

- one request in flight: latency of `CubeClient.seek` (target: p99 <= 1.2 ms);
- eight in flight (8 threads sharing one CubeClient): a round is 64 seeks; keys/s and the
  server's CPU per request go to extra_info (targets: >= 3.3M keys/s, <= 300 µs per request).
The same workload with a CLI, levels and disturbance checks: `python -m cube.bench.e2e`.
Run: .venv/bin/pytest bench/micro/test_bench_e2e.py --benchmark-enable
"""

from __future__ import annotations

import itertools
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from pytest_benchmark.fixture import BenchmarkFixture

from cube.bench.e2e import Server, build_data, key_batches
from cube.client import CubeClient
from cube.processes import cpu_seconds

COUNT = 1_000_000
WIDTH = 40
BATCH = 1000
INFLIGHT = 8
ROUND = 64  # seeks per benchmark round at 8 in flight


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Server, list[np.ndarray]]]:
    """A 2-worker server on the shard (built once per machine under the temp dir) and fresh
    key batches."""
    data_dir, keys = build_data(Path(tempfile.gettempdir()) / "cube-e2e", COUNT, WIDTH, 7)
    server = Server(data_dir, 2, [], tmp_path_factory.mktemp("e2e") / "server.log")
    try:
        server.wait_serving()
        yield server, key_batches(keys, BATCH, 2048, 21)
    finally:
        server.stop()


def test_e2e_one_in_flight(
    benchmark: BenchmarkFixture, served: tuple[Server, list[np.ndarray]]
) -> None:
    server, batches = served
    cycle = itertools.cycle(batches)
    with CubeClient(shards=[server.addresses], timeout=10.0) as client:
        for _ in range(20):  # connect both workers' lanes
            client.seek(next(cycle))
        result = benchmark(lambda: client.seek(next(cycle)))
    stats = getattr(benchmark, "stats", None)
    if stats is not None and stats.stats.data:  # absent with --benchmark-disable
        benchmark.extra_info["p99_us"] = round(float(np.percentile(stats.stats.data, 99)) * 1e6)
    assert result.found.all() and result.width == WIDTH


def test_e2e_eight_in_flight(
    benchmark: BenchmarkFixture, served: tuple[Server, list[np.ndarray]]
) -> None:
    server, batches = served
    cycle = itertools.cycle(batches)
    lock = threading.Lock()
    found: list[bool] = []

    def one() -> None:
        with lock:
            keys = next(cycle)
        result = client.seek(keys)
        found.append(bool(result.found.all()))

    def round_() -> None:
        list(pool.map(lambda _: one(), range(ROUND)))

    pids = server.pids()
    with (
        CubeClient(shards=[server.addresses], timeout=10.0) as client,
        ThreadPoolExecutor(INFLIGHT) as pool,
    ):
        round_()
        cpu, started = cpu_seconds(pids), time.perf_counter()
        benchmark.pedantic(round_, rounds=10, iterations=1)  # type: ignore[no-untyped-call]  # pytest-benchmark is unannotated
        seconds, cpu = time.perf_counter() - started, cpu_seconds(pids) - cpu
    seeks = len(found) - ROUND  # after the warm-up round
    benchmark.extra_info["keys_per_s"] = round(seeks * BATCH / seconds)
    benchmark.extra_info["server_cpu_us_per_request"] = round(cpu / seeks * 1e6, 1)
    assert all(found)
