"""SDK costs: the pure per-call work (route, group, encode, decode, scatter) of a 1000-key batch
across 2 shards, and whole seeks against local cube-server processes.

The seek benchmarks compare the two ways a blocking client can run gRPC (the choice made in
cube.client.sync): blocking calls inline / on a thread pool (CubeClient) versus an asyncio
client on a private event-loop thread; and AsyncCubeClient inside its own loop.

The `sdk-cpu` group measures the client process's CPU time (time.process_time: every thread
of this process, the server's excluded) of 1000 requests of 1000 keys against one local
cube-server over the TCP lane: its figures in milliseconds are microseconds of SDK CPU per
request (issue 13's targets: seek <= 60 us, get_embeddings <= 70 us).
Run: .venv/bin/pytest bench/micro/test_bench_sdk.py --benchmark-enable
(only the CPU group: add `-k cpu`)
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from functools import partial
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest

from cube.client import AsyncCubeClient, CubeClient, SeekResult, _compiled
from cube.client._core import FastProtocol, assemble, make_plan
from cube.pb import cube_fast_pb2
from cube.routing import shard_of
from cube.wire import encode_seek_request

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from helpers.procs import ServerProc, fixed_values, start_server, write_version
from pytest_benchmark.fixture import BenchmarkFixture

BATCH = 1000
WIDTH = 40
COUNT = 200_000

R = TypeVar("R")  # what a benchmarked call returns


def _response(keys: np.ndarray, version: str = "1") -> bytes:
    """What a server holding every key answers (fixed width)."""
    return cube_fast_pb2.SeekResponse(
        found=b"\x01" * keys.shape[0],
        values=fixed_values(keys, WIDTH).blob.tobytes(),
        value_width=WIDTH,
        version=version,
    ).SerializeToString()


@pytest.fixture(params=["compiled", "numpy"])
def codec(request: pytest.FixtureRequest) -> Iterator[str]:
    """The SDK's codec: compiled (cube/_sdk_jit.py, loaded now, as a busy client loads it in
    the background) or the numpy paths (the reference; what runs without numba)."""
    if request.param == "compiled" and not _compiled.warm():
        pytest.skip("numba not installed, or CUBE_KERNEL=numpy")
    loops = _compiled._loops
    if request.param == "numpy":
        _compiled._loops = None
    try:
        yield request.param
    finally:
        _compiled._loops = loops


@pytest.fixture(scope="module")
def batch() -> np.ndarray:
    return np.random.default_rng(1).integers(0, 2**63, BATCH, dtype=np.uint64)


def test_plan_1000_keys_2_shards(
    benchmark: BenchmarkFixture, batch: np.ndarray, codec: str
) -> None:
    pieces = benchmark(make_plan, batch, 2, "mod")
    assert sum(p.size for p in pieces) == BATCH


def test_route_and_scatter_1000_keys_2_shards(
    benchmark: BenchmarkFixture, batch: np.ndarray, codec: str
) -> None:
    """Everything the SDK does per call except the network: plan, request bytes, response
    parsing, scatter into one (n, width) buffer."""
    responses = {p.shard: _response(p.keys) for p in make_plan(batch, 2, "mod")}

    def call() -> SeekResult:
        pieces = make_plan(batch, 2, "mod")
        for piece in pieces:
            encode_seek_request(piece.keys)
        answers = [FastProtocol.decode(responses[p.shard], p.size) for p in pieces]
        return assemble(batch, pieces, answers)

    result = benchmark(call)
    assert (
        result.found.all()
        and (result.column.as_rows() == fixed_values(batch, WIDTH).as_rows()).all()
    )


def test_route_and_scatter_1000_keys_2_shards_murmur3(
    benchmark: BenchmarkFixture, batch: np.ndarray, codec: str
) -> None:
    responses = {p.shard: _response(p.keys) for p in make_plan(batch, 2, "murmur3")}

    def call() -> SeekResult:
        pieces = make_plan(batch, 2, "murmur3")
        answers = [FastProtocol.decode(responses[p.shard], p.size) for p in pieces]
        return assemble(batch, pieces, answers)

    assert benchmark(call).found.all()


# ---------------------------------------------------------------------------------------------
# Seeks against local servers: 2 shards (one server each), 200k keys, 40-byte values.


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    root = tmp_path_factory.mktemp("sdk")
    keys = np.arange(COUNT, dtype=np.uint64)
    owner = shard_of(keys, 2)
    dirs = []
    for shard in range(2):
        mine = keys[owner == shard]
        dirs.append(root / f"shard{shard}")
        write_version(dirs[-1], "1", mine, fixed_values(mine, WIDTH), current=True)
    servers: list[ServerProc] = []
    try:
        for data in dirs:
            servers.append(start_server(data, wait=False))
        for server in servers:
            server.wait_serving()
        yield [s.address for s in servers]
    finally:
        for server in servers:
            server.stop()


def _batches(shards: int, count: int = 64) -> Iterator[np.ndarray]:
    """Fresh random batches; for one shard, only keys that shard 0 holds."""
    rng = np.random.default_rng(2)
    step = 2 if shards == 1 else 1
    return itertools.cycle(
        [rng.integers(0, COUNT // step, BATCH, dtype=np.uint64) * step for _ in range(count)]
    )


@pytest.mark.parametrize("shards", [1, 2])
def test_seek_blocking_client(benchmark: BenchmarkFixture, cluster: list[str], shards: int) -> None:
    batches = _batches(shards)
    with CubeClient(shards=[[a] for a in cluster[:shards]]) as client:
        client.seek(next(batches))
        result = benchmark(lambda: client.seek(next(batches)))
    assert result.found.all()


@pytest.mark.parametrize("shards", [1, 2])
def test_seek_async_client_on_a_private_loop_thread(
    benchmark: BenchmarkFixture, cluster: list[str], shards: int
) -> None:
    """The alternative design for a blocking client: AsyncCubeClient on its own loop thread."""
    batches = _batches(shards)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    client = AsyncCubeClient(shards=[[a] for a in cluster[:shards]])

    def seek() -> SeekResult:
        return asyncio.run_coroutine_threadsafe(client.seek(next(batches)), loop).result(30)

    try:
        seek()
        result = benchmark(seek)
    finally:
        asyncio.run_coroutine_threadsafe(client.close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()
    assert result.found.all()


@pytest.mark.parametrize("shards", [1, 2])
def test_seek_async_client_in_its_loop(
    benchmark: BenchmarkFixture, cluster: list[str], shards: int
) -> None:
    batches = _batches(shards)
    loop = asyncio.new_event_loop()
    client = AsyncCubeClient(shards=[[a] for a in cluster[:shards]])
    try:
        loop.run_until_complete(client.seek(next(batches)))
        result = benchmark(lambda: loop.run_until_complete(client.seek(next(batches))))
        loop.run_until_complete(client.close())
    finally:
        loop.close()
    assert result.found.all()


# ---------------------------------------------------------------------------------------------
# SDK CPU per request: one shard, 1000 keys, over the TCP lane (transport "auto"). One round
# is REQUESTS requests; the timer is this process's CPU time, so a round's milliseconds are
# microseconds of client CPU per request. Async requests run inside one coroutine per round
# (run_until_complete's own cost, a loop iteration and a task, is not the SDK's).

REQUESTS = 1000
DIM = 16  # float32[16]: 64-byte rows
CPU = {"group": "sdk-cpu", "timer": time.process_time}


@pytest.fixture(scope="module")
def one_shard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """{"seek": address, "emb": address}: one server of 40-byte values, one of float32[16]."""
    root = tmp_path_factory.mktemp("sdk-cpu")
    keys = np.arange(COUNT, dtype=np.uint64)
    servers: dict[str, ServerProc] = {}
    try:
        for name, width in (("seek", WIDTH), ("emb", DIM * 4)):
            write_version(root / name, "1", keys, fixed_values(keys, width), current=True)
            servers[name] = start_server(root / name, wait=False)
        for server in servers.values():
            server.wait_serving()
        yield {name: server.address for name, server in servers.items()}
    finally:
        for server in servers.values():
            server.stop()


def _one_shard_batches(count: int = 64) -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    return [rng.integers(0, COUNT, BATCH, dtype=np.uint64) for _ in range(count)]


def _sync_round(call: Callable[[np.ndarray], R]) -> tuple[Callable[[], R], list[float]]:
    """A round of REQUESTS blocking calls; wall microseconds per request in `wall`."""
    batches = _one_shard_batches()
    wall: list[float] = []

    def run() -> R:
        started = time.perf_counter()
        for i in range(REQUESTS):
            result = call(batches[i % len(batches)])
        wall.append((time.perf_counter() - started) / REQUESTS * 1e6)
        return result

    return run, wall


def _async_round(
    loop: asyncio.AbstractEventLoop, call: Callable[[np.ndarray], Awaitable[R]]
) -> tuple[Callable[[], R], list[float]]:
    batches = _one_shard_batches()
    wall: list[float] = []

    async def many() -> R:
        for i in range(REQUESTS):
            result = await call(batches[i % len(batches)])
        return result

    def run() -> R:
        started = time.perf_counter()
        result = loop.run_until_complete(many())
        wall.append((time.perf_counter() - started) / REQUESTS * 1e6)
        return result

    return run, wall


def _timed_async(
    benchmark: BenchmarkFixture, client: AsyncCubeClient, call: Callable[[np.ndarray], Awaitable[R]]
) -> R:
    """Rounds of an asyncio client's `call` on an event loop of their own (`_async_round`),
    recorded; the client is closed after. Returns the last answer."""
    loop = asyncio.new_event_loop()
    try:
        run, wall = _async_round(loop, call)
        run()
        result: R = benchmark.pedantic(run, rounds=7, iterations=1)  # type: ignore[no-untyped-call]  # pytest-benchmark is unannotated
        loop.run_until_complete(client.close())
    finally:
        loop.close()
    _record(benchmark, wall)
    return result


def _record(benchmark: BenchmarkFixture, wall: list[float]) -> None:
    if benchmark.stats is None:  # --benchmark-disable (the default): ran once, as a test
        return
    stats = benchmark.stats.stats
    benchmark.extra_info["cpu_us_per_request_median"] = round(stats.median * 1e6 / REQUESTS, 1)
    benchmark.extra_info["wall_us_per_request_median"] = round(float(np.median(wall)), 1)


@pytest.mark.benchmark(**CPU)
@pytest.mark.parametrize("api", ["seek", "get_embeddings"])
def test_cpu_x1000_blocking_client(
    benchmark: BenchmarkFixture, one_shard: dict[str, str], api: str, codec: str
) -> None:
    server = one_shard["seek" if api == "seek" else "emb"]
    with CubeClient(shards=[[server]]) as client:
        run: Callable[[], SeekResult | np.ndarray]
        if api == "seek":
            run, wall = _sync_round(client.seek)
        else:
            run, wall = _sync_round(lambda keys: client.get_embeddings(keys, DIM))
        run()  # connect, warm up
        result = benchmark.pedantic(run, rounds=7, iterations=1)  # type: ignore[no-untyped-call]  # pytest-benchmark is unannotated
    _record(benchmark, wall)
    if api == "seek":
        assert result.found.all() and result.width == WIDTH
    else:
        assert result.shape == (BATCH, DIM) and result.dtype == np.float32


@pytest.mark.benchmark(**CPU)
@pytest.mark.parametrize("api", ["seek", "get_embeddings"])
def test_cpu_x1000_async_client(
    benchmark: BenchmarkFixture, one_shard: dict[str, str], api: str, codec: str
) -> None:
    server = one_shard["seek" if api == "seek" else "emb"]
    client = AsyncCubeClient(shards=[[server]])
    call: Callable[[np.ndarray], Awaitable[SeekResult | np.ndarray]] = client.seek
    if api == "get_embeddings":
        call = partial(client.get_embeddings, dim=DIM)
    result = _timed_async(benchmark, client, call)
    if isinstance(result, SeekResult):
        assert api == "seek" and result.found.all() and result.width == WIDTH
    else:
        assert api == "get_embeddings"
        assert result.shape == (BATCH, DIM) and result.dtype == np.float32


# The same over 2 shards (one server each, `cluster`): each request is routed, split in two
# sub-requests and its answers scattered back, where the compiled codec does most.


@pytest.mark.benchmark(**CPU)
def test_cpu_x1000_blocking_client_2_shards(
    benchmark: BenchmarkFixture, cluster: list[str], codec: str
) -> None:
    with CubeClient(shards=[[a] for a in cluster]) as client:
        run, wall = _sync_round(client.seek)
        run()
        result = benchmark.pedantic(run, rounds=7, iterations=1)  # type: ignore[no-untyped-call]  # pytest-benchmark is unannotated
    _record(benchmark, wall)
    assert result.found.all() and result.width == WIDTH


@pytest.mark.benchmark(**CPU)
def test_cpu_x1000_async_client_2_shards(
    benchmark: BenchmarkFixture, cluster: list[str], codec: str
) -> None:
    client = AsyncCubeClient(shards=[[a] for a in cluster])
    result = _timed_async(benchmark, client, client.seek)
    assert result.found.all() and result.width == WIDTH
