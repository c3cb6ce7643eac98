"""SDK costs: the pure per-call work (route, group, encode, decode, scatter) of a 1000-key batch
across 2 shards, and whole seeks against local cube-server processes.

The seek benchmarks compare the two ways a blocking client can run gRPC (the choice made in
cube.client.sync): blocking calls inline / on a thread pool (CubeClient) versus an asyncio
client on a private event-loop thread; and AsyncCubeClient inside its own loop.
Run: .venv/bin/pytest bench/micro/test_bench_sdk.py --benchmark-enable
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from cube.client import AsyncCubeClient, CubeClient
from cube.client._core import assemble, make_plan
from cube.pb import cube_fast_pb2
from cube.routing import shard_of
from cube.wire import decode_seek_response, encode_seek_request

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from procs import fixed_values, start_server, write_version

BATCH = 1000
WIDTH = 40
COUNT = 200_000


def _response(keys: np.ndarray, version: str = "1") -> bytes:
    """What a server holding every key answers (fixed width)."""
    return cube_fast_pb2.SeekResponse(
        found=b"\x01" * keys.shape[0],
        values=fixed_values(keys, WIDTH).blob.tobytes(),
        value_width=WIDTH,
        version=version,
    ).SerializeToString()


@pytest.fixture(scope="module")
def batch():
    return np.random.default_rng(1).integers(0, 2**63, BATCH, dtype=np.uint64)


def test_plan_1000_keys_2_shards(benchmark, batch):
    pieces = benchmark(make_plan, batch, 2, "mod")
    assert sum(p.size for p in pieces) == BATCH


def test_route_and_scatter_1000_keys_2_shards(benchmark, batch):
    """Everything the SDK does per call except the network: plan, request bytes, response
    parsing, scatter into one (n, width) buffer."""
    responses = {p.shard: _response(p.keys) for p in make_plan(batch, 2, "mod")}

    def call():
        pieces = make_plan(batch, 2, "mod")
        for piece in pieces:
            encode_seek_request(piece.keys)
        answers = [decode_seek_response(responses[p.shard], p.size) for p in pieces]
        return assemble(batch, pieces, answers)

    result = benchmark(call)
    assert (
        result.found.all()
        and (result.column.as_rows() == fixed_values(batch, WIDTH).as_rows()).all()
    )


def test_route_and_scatter_1000_keys_2_shards_murmur3(benchmark, batch):
    responses = {p.shard: _response(p.keys) for p in make_plan(batch, 2, "murmur3")}

    def call():
        pieces = make_plan(batch, 2, "murmur3")
        answers = [decode_seek_response(responses[p.shard], p.size) for p in pieces]
        return assemble(batch, pieces, answers)

    assert benchmark(call).found.all()


# ---------------------------------------------------------------------------------------------
# Seeks against local servers: 2 shards (one server each), 200k keys, 40-byte values.


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("sdk")
    keys = np.arange(COUNT, dtype=np.uint64)
    owner = shard_of(keys, 2)
    dirs = []
    for shard in range(2):
        mine = keys[owner == shard]
        dirs.append(root / f"shard{shard}")
        write_version(dirs[-1], "1", mine, fixed_values(mine, WIDTH), current=True)
    servers = []
    try:
        for data in dirs:
            servers.append(start_server(data, wait=False))
        for server in servers:
            server.wait_serving()
        yield [s.address for s in servers]
    finally:
        for server in servers:
            server.stop()


def _batches(shards: int, count: int = 64):
    """Fresh random batches; for one shard, only keys that shard 0 holds."""
    rng = np.random.default_rng(2)
    step = 2 if shards == 1 else 1
    return itertools.cycle(
        [rng.integers(0, COUNT // step, BATCH, dtype=np.uint64) * step for _ in range(count)]
    )


@pytest.mark.parametrize("shards", [1, 2])
def test_seek_blocking_client(benchmark, cluster, shards):
    batches = _batches(shards)
    with CubeClient(shards=[[a] for a in cluster[:shards]]) as client:
        client.seek(next(batches))
        result = benchmark(lambda: client.seek(next(batches)))
    assert result.found.all()


@pytest.mark.parametrize("shards", [1, 2])
def test_seek_async_client_on_a_private_loop_thread(benchmark, cluster, shards):
    """The alternative design for a blocking client: AsyncCubeClient on its own loop thread."""
    batches = _batches(shards)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    client = AsyncCubeClient(shards=[[a] for a in cluster[:shards]])

    def seek():
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
def test_seek_async_client_in_its_loop(benchmark, cluster, shards):
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
