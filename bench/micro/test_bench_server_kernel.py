"""The server's handler kernel, in process: request bytes in -> response bytes out, exactly what
the gRPC handlers run per call (parse, lookup, gather, encode), minus gRPC itself.

1M keys, 40-byte values, a fresh random batch of 1000 keys each round. Target context
(perf-notes): a prototype kernel took 134 µs; the server budget is <= 300 µs of CPU per
1000-key request including gRPC's ~200 µs per-call floor.
Run: .venv/bin/pytest bench/micro/test_bench_server_kernel.py --benchmark-enable
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

import numpy as np
import pytest
from pytest_benchmark.fixture import BenchmarkFixture

from cube.bench.e2e import key_batches
from cube.index import build_table
from cube.pb import cube_fast_pb2, cube_pb2
from cube.server.service import SeekService
from cube.server.versions import LoadOptions, VersionSlots, load_base
from cube.shard import write_shard
from cube.values import ValueColumn

COUNT = 1_000_000
WIDTH = 40
BATCH = 1000


@pytest.fixture(scope="module")
def service_and_keys(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[SeekService, np.ndarray]]:
    root = tmp_path_factory.mktemp("kernel")
    rng = np.random.default_rng(11)
    keys = rng.integers(0, 2**64 - 1, COUNT, dtype=np.uint64)
    values = ValueColumn.fixed(rng.integers(0, 256, COUNT * WIDTH, dtype=np.uint8), WIDTH)
    write_shard(root / "1", build_table(keys), values, {"version": "1"})
    slots = VersionSlots()
    slots.install(load_base([root], "1", LoadOptions(populate=True)))
    yield SeekService(slots, max_batch=100_000), keys
    slots.close()


def fresh_batches(keys: np.ndarray, count: int = 512) -> list[np.ndarray]:
    return key_batches(keys, BATCH, count, seed=3)


def test_fast_seek_kernel(
    benchmark: BenchmarkFixture, service_and_keys: tuple[SeekService, np.ndarray]
) -> None:
    service, keys = service_and_keys
    requests = [
        cube_fast_pb2.SeekRequest(
            keys=b.astype("<u8").tobytes(), request_id=i + 1
        ).SerializeToString()
        for i, b in enumerate(fresh_batches(keys))
    ]
    cycle = itertools.cycle(requests)
    raw = benchmark(lambda: service.seek(next(cycle)))
    response = cube_fast_pb2.SeekResponse.FromString(raw)
    assert response.found == b"\x01" * BATCH and len(response.values) == BATCH * WIDTH


def test_fast_seek_kernel_half_misses(
    benchmark: BenchmarkFixture, service_and_keys: tuple[SeekService, np.ndarray]
) -> None:
    service, keys = service_and_keys
    rng = np.random.default_rng(5)
    requests = []
    for batch in fresh_batches(keys):
        batch[::2] = rng.integers(0, 2**64 - 1, BATCH // 2, dtype=np.uint64)
        requests.append(cube_fast_pb2.SeekRequest(keys=batch.tobytes()).SerializeToString())
    cycle = itertools.cycle(requests)
    raw = benchmark(lambda: service.seek(next(cycle)))
    assert len(cube_fast_pb2.SeekResponse.FromString(raw).values) == BATCH * WIDTH


def test_original_seek_kernel(
    benchmark: BenchmarkFixture, service_and_keys: tuple[SeekService, np.ndarray]
) -> None:
    """rec.mcube.DictService.seek: 1000 keys in, 1000 DictValue out (vectorized encoding)."""
    service, keys = service_and_keys
    requests = [
        cube_pb2.DictRequest(keys=b.tolist()).SerializeToString() for b in fresh_batches(keys)
    ]
    cycle = itertools.cycle(requests)
    raw = benchmark(lambda: service.seek_original(next(cycle)))
    assert len(cube_pb2.DictResponse.FromString(raw).values) == BATCH


class _Transport:
    """Enough of an asyncio transport for the lane's protocol: counts what is written."""

    def __init__(self) -> None:
        self.frames = 0

    def get_extra_info(self, name: str) -> None:
        return None

    def set_write_buffer_limits(self, high: int | None = None) -> None:
        pass

    def writelines(self, buffers: Iterable[bytes | bytearray | memoryview]) -> None:
        self.frames += 1

    def write(self, data: bytes) -> None:
        self.frames += 1

    def is_closing(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return 0

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.mark.parametrize("path", ["compiled", "python"])
def test_lane_request_path(
    benchmark: BenchmarkFixture, service_and_keys: tuple[SeekService, np.ndarray], path: str
) -> None:
    """One lane request as the server handles it: a frame arrives (`data_received`: framing,
    byte accounting, parse, the version held), is answered (the compiled pass at once, or
    the Python path's loop turn, `_answer_queued`: lookup, encode, write), without the
    sockets. `--benchmark-timer time.process_time` for CPU time on a shared machine."""
    import asyncio
    import struct

    from cube.server.lane import MAGIC, Lane, LaneProtocol

    service, keys = service_and_keys
    frames = []
    for i, batch in enumerate(fresh_batches(keys)):
        raw = cube_fast_pb2.SeekRequest(keys=batch.astype("<u8").tobytes(), request_id=i + 1)
        body = raw.SerializeToString()
        frames.append(struct.pack("<I", len(body)) + body)
    cycle = itertools.cycle(frames)
    loop = asyncio.new_event_loop()
    try:
        lane = Lane(service)
        lane._loop = loop
        if path == "python":
            lane.compiled = None
        connection = LaneProtocol(lane)
        transport = _Transport()
        connection.connection_made(transport)  # type: ignore[arg-type]
        connection.data_received(MAGIC)

        def one() -> None:
            connection.data_received(next(cycle))
            if lane._queue:
                lane._answer_queued()
            if lane._fold_due:
                lane.fold_counts()

        benchmark(one)
        assert transport.frames >= 1
        assert service.counters.api["lane"].requests >= 1
    finally:
        loop.close()
