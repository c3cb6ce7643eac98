"""The SDK against configuration drift and a server that stops answering, on real servers:
routing checked on first contact (shard order, shard count, partitioner, dict), and an
asyncio client whose lane connection to a SIGSTOP'd server stays bounded and recovers."""

from __future__ import annotations

import asyncio
import gc
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest
from helpers.procs import ServerProc, fixed_values, start_server, write_version

from cube.client import (
    AsyncCubeClient,
    ConfigMismatchError,
    CubeClient,
    Partitioner,
    TransportName,
)
from cube.routing import shard_of

pytestmark = pytest.mark.slow  # real processes end to end: `make quick` skips them

KEYS = np.arange(1, 30_001, 3, dtype=np.uint64)
WIDTH = 16


@pytest.fixture(scope="module")
def two_shards(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """Shards 0 and 1 of a 2-shard murmur3 build of dict test_dict, one server each."""
    root = tmp_path_factory.mktemp("routing")
    owner = shard_of(KEYS, 2, "murmur3")
    servers: list[ServerProc] = []
    try:
        for shard in range(2):
            mine = KEYS[owner == shard]
            routing = {"shard": shard, "shard_num": 2, "partitioner": "murmur3"}
            data = root / f"shard{shard}"
            write_version(
                data, "9", mine, fixed_values(mine, WIDTH, shard), current=True, routing=routing
            )
            servers.append(start_server(data))
        yield [s.address for s in servers]
    finally:
        for server in servers:
            server.stop()


def test_right_configuration_answers(two_shards: list[str]) -> None:
    with CubeClient(shards=[[a] for a in two_shards], partitioner="murmur3") as client:
        assert client.seek(KEYS[:500]).found.all()


@pytest.mark.parametrize("transport", ["auto", "grpc"])
@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("swapped", "lists it for shard"),
        ("partitioner", r"over 2 shards \(mod\)"),
        ("count", "over 3 shards"),
        ("dict", "asks for dict 'other'"),
    ],
)
def test_drift_is_a_config_error_on_first_contact(
    two_shards: list[str], transport: TransportName, case: str, words: str
) -> None:
    """Today each of these answered with a hit rate of 0.0 / 0.5 / low and no error."""
    shards = [[a] for a in two_shards]
    partitioner: Partitioner = "murmur3"
    dict_name = ""  # the default: any dict
    if case == "swapped":
        shards = shards[::-1]
    elif case == "partitioner":
        partitioner = "mod"
    elif case == "count":
        shards = [*shards, shards[0]]
    else:
        dict_name = "other"
    with CubeClient(
        shards=shards, retry=0, partitioner=partitioner, transport=transport, dict_name=dict_name
    ) as client:
        with pytest.raises(ConfigMismatchError, match=words) as caught:
            client.seek(KEYS[:500])
        assert "holds shard" in str(caught.value)

    async def seek_async() -> None:
        async with AsyncCubeClient(
            shards=shards,
            retry=0,
            partitioner=partitioner,
            transport=transport,
            dict_name=dict_name,
        ) as client:
            await client.seek(KEYS[:500])

    with pytest.raises(ConfigMismatchError, match=words):
        asyncio.run(seek_async())


def test_async_client_bounded_and_recovering_when_a_server_stops(tmp_path: Path) -> None:
    """A SIGSTOP'd server: every call fails with its deadline; the lane connection that gets
    no byte back is dropped (not fed forever: it used to grow by ~460 MB in 15 s), and once the
    server runs again the client answers."""
    data = tmp_path / "data"
    keys = np.arange(50_000, dtype=np.uint64)
    write_version(data, "1", keys, fixed_values(keys, 64), current=True)
    server = start_server(data)
    me = psutil.Process()
    try:

        async def run() -> tuple[int, int, int]:
            async with AsyncCubeClient(shards=[[server.address]], timeout=0.3, retry=0) as client:
                assert (await client.seek(keys[:100])).found.all()
                gc.collect()
                before = me.memory_info().rss
                server.signal(signal.SIGSTOP)
                failures = 0
                deadline = time.monotonic() + 8
                big = np.resize(keys, 100_000)  # 800 KB a request

                async def hammer() -> None:
                    nonlocal failures
                    while time.monotonic() < deadline:
                        try:
                            await client.seek(big)
                        except Exception:
                            failures += 1

                await asyncio.gather(*(hammer() for _ in range(16)))
                gc.collect()
                grown = me.memory_info().rss - before
                server.signal(signal.SIGCONT)
                recovered = 0
                for _ in range(50):
                    try:
                        recovered = int((await client.seek(keys[:100])).found.sum())
                        break
                    except Exception:
                        await asyncio.sleep(0.1)
                return failures, grown, recovered

        failures, grown, recovered = asyncio.run(run())
        assert failures > 0
        assert grown < 150 << 20, f"the client grew by {grown >> 20} MiB"
        assert recovered == 100
    finally:
        server.signal(signal.SIGCONT)
        server.stop()
