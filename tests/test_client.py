"""CubeClient / AsyncCubeClient against real cube-server processes on loopback.

Values against what was built (fixed and variable width), misses, embeddings, murmur3 routing,
batch splitting, every cube.conf type, replica failover (kill -9 under load), a dead shard
(error with partial result), backup requests past a stopped replica, version reconciliation
during a rollout, rejected requests, and cube-cli."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias, Unpack

import numpy as np
import pytest
from helpers.procs import (
    REPO,
    ServerProc,
    expected_fixed,
    fixed_values,
    running_server,
    start_server,
    write_version,
)
from test_server import control

from cube.client import (
    AsyncCubeClient,
    AsyncTransport,
    ClientOptions,
    CubeClient,
    CubeError,
    LoadBalancer,
    RequestRejectedError,
    SeekResult,
    ShardUnavailableError,
    Timeouts,
    TransportName,
    ValueSizeError,
    VersionMismatchError,
    cli,
)
from cube.processes import free_ports, poll_until
from cube.routing import shard_of
from cube.values import ValueColumn

if TYPE_CHECKING:
    from _pytest.capture import CaptureResult  # what capsys.readouterr() returns

# Every test here starts processes (servers, CLIs): make quick skips them.
pytestmark = pytest.mark.slow

WIDTH = 16  # 4 float32

# a cube-server to start: data dir, arguments, workers
ServerSpec: TypeAlias = tuple[Path, tuple[str, ...], int]
# the replicas of each shard (a port each), and the data's root
FixedCluster: TypeAlias = tuple[list[list[str]], Path]


@contextlib.contextmanager
def servers(*specs: ServerSpec) -> Iterator[list[ServerProc]]:
    """Start servers in parallel: specs are (data_dir, args, workers). Always stopped by PID
    (resumed first, in case a test stopped one with SIGSTOP)."""
    started: list[ServerProc] = []
    try:
        for data_dir, args, workers in specs:
            started.append(start_server(data_dir, *args, workers=workers, wait=False))
        for server in started:
            server.wait_up()
        yield started
    finally:
        for server in started:
            with contextlib.suppress(ProcessLookupError):
                server.signal(signal.SIGCONT)
            server.stop()


def build_shards(
    root: Path,
    keys: np.ndarray,
    values_for: Callable[[np.ndarray], ValueColumn],
    shard_num: int,
    partitioner: str = "mod",
    version: str = "100",
) -> list[Path]:
    """Write each shard's keys (routed like the builder) to root/shard<i>/data; the dirs."""
    owner = shard_of(keys, shard_num, partitioner)
    dirs = []
    for shard in range(shard_num):
        mine = keys[owner == shard]
        data = root / f"shard{shard}" / "data"
        write_version(data, version, mine, values_for(mine), current=True)
        dirs.append(data)
    return dirs


def variable_value(key: int) -> bytes:
    return (b"v%d-" % key) * (1 + key % 4)


# ---------------------------------------------------------------------------------------------
# A 2-shard fixed-width cluster: shard 0 = two server processes, shard 1 = one server with
# two workers (two ports). Every port is a replica.

KEYS = np.arange(1, 30_000, 3, dtype=np.uint64)


@pytest.fixture(scope="module")
def fixed_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FixedCluster]:
    root = tmp_path_factory.mktemp("fixed")
    dirs = build_shards(root, KEYS, lambda k: fixed_values(k, WIDTH, tag=1), 2)
    common = ("--dict_name", "test_dict", "--max_batch", "5000")
    specs: list[ServerSpec] = [
        (dirs[0], (*common, "--shard", "0"), 1),
        (dirs[0], (*common, "--shard", "0"), 1),
        (dirs[1], (*common, "--shard", "1"), 2),
    ]
    with servers(*specs) as procs:
        shards = [procs[0].addresses + procs[1].addresses, procs[2].addresses]
        yield shards, root


def query_keys(seed: int = 0, n: int = 1000) -> np.ndarray:
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, 30_000, n, dtype=np.uint64)
    keys[:3] = [2**64 - 1, 0, 1]
    keys[10:20] = keys[9]  # duplicates
    return keys


def check_fixed(result: SeekResult, keys: np.ndarray, tag: int = 1) -> None:
    expect_found = np.isin(keys, KEYS)
    assert result.found.tolist() == expect_found.tolist()
    assert result.answered.all()
    assert result.width == WIDTH
    rows = result.column.as_rows()
    assert (rows[expect_found] == expected_fixed(keys[expect_found], WIDTH, tag)).all()
    assert (rows[~expect_found] == 0).all()
    values = result.values
    assert values[1] is None and values[0] is None
    hit = int(np.flatnonzero(expect_found)[0])
    assert values[hit] == expected_fixed(keys[hit : hit + 1], WIDTH, tag).tobytes()


def test_seek_fixed_width_values_misses_and_order(fixed_cluster: FixedCluster) -> None:
    shards, _ = fixed_cluster
    keys = query_keys()
    with CubeClient(shards=shards, dict_name="test_dict") as client:
        assert client.wait_ready() == []
        result = client.seek(keys)
        check_fixed(result, keys)
        assert result.version == "100" and len(result) == len(keys)
        as_list = client.seek(keys.tolist())
        assert as_list.values == result.values
        assert len(client.seek([])) == 0
        with pytest.raises(CubeError, match="key -1 at position 1"):
            client.seek([5, -1])


@pytest.mark.parametrize("balancer", ["rr", "random", "la"])
def test_batches_split_by_max_batch_and_balancers(
    fixed_cluster: FixedCluster, balancer: LoadBalancer
) -> None:
    shards, _ = fixed_cluster
    keys = query_keys(seed=3, n=3000)
    with CubeClient(shards=shards, max_batch=64, load_balancer=balancer) as client:
        check_fixed(client.seek(keys), keys)


def test_get_embeddings(fixed_cluster: FixedCluster) -> None:
    shards, _ = fixed_cluster
    keys = query_keys(seed=4, n=200)
    with CubeClient(shards=shards) as client:
        emb = client.get_embeddings(keys, dim=4)
        assert emb.shape == (200, 4) and emb.dtype == np.float32
        found = np.isin(keys, KEYS)
        expect = expected_fixed(keys[found], WIDTH, 1).view(np.float32)
        assert np.array_equal(emb[found], expect, equal_nan=True)
        assert (emb[~found] == 0).all()
        with pytest.raises(ValueSizeError, match=r"value of key \d+ .position \d+. has 16 bytes"):
            client.get_embeddings(keys, dim=3)
        assert client.get_embeddings(keys, dim=2, dtype="float64").shape == (200, 2)


def test_server_rejections_are_raised_at_once(fixed_cluster: FixedCluster) -> None:
    shards, _ = fixed_cluster
    with CubeClient(shards=shards, dict_name="other_dict", retry=5) as client:
        with pytest.raises(RequestRejectedError, match=r"NOT_FOUND.*'other_dict'") as info:
            client.seek([1, 2, 3, 4])
        assert info.value.code == "NOT_FOUND"
    many = np.arange(0, 6000 * 2, 2, dtype=np.uint64)  # all on shard 0: > --max_batch
    # the original protocol has no handshake that states --max_batch: refused, as before
    with (
        CubeClient(shards=shards, max_batch=100_000, protocol="original") as client,
        pytest.raises(RequestRejectedError, match=r"RESOURCE_EXHAUSTED.*6000 keys"),
    ):
        client.seek(many)
    with CubeClient(shards=shards, max_batch=100_000) as client:  # learns it: splits
        assert client.seek(many).found.tolist() == np.isin(many, KEYS).tolist()
        assert client.batch_limits == (5000, 100_000)  # shard 1 not met yet


def test_batches_split_by_the_servers_max_batch_learned_on_first_contact(tmp_path: Path) -> None:
    """Servers started with --max_batch 7 state it on first contact: a client with the default
    max_batch splits a larger batch into requests of at most 7 keys per shard instead of
    being refused (the first call too: refused once by the server it just met, re-planned),
    the answer in request order; blocking (TCP lane, gRPC, one shard or two) and asyncio."""
    built = np.arange(1, 400, 3, dtype=np.uint64)
    dirs = build_shards(tmp_path, built, lambda k: fixed_values(k, WIDTH, tag=1), 2)
    query = np.random.default_rng(7).permutation(np.arange(0, 400, dtype=np.uint64))[:150]
    expected = np.isin(query, built)

    def check(result: SeekResult, keys: np.ndarray) -> None:
        found = np.isin(keys, built)
        assert result.found.tolist() == found.tolist() and result.version == "100"
        rows = result.column.as_rows()
        assert (rows[found] == expected_fixed(keys[found], WIDTH, 1)).all()

    with servers(*((d, ("--max_batch", "7"), 1) for d in dirs)) as procs:
        shards = [[p.address] for p in procs]
        transports: tuple[TransportName, ...] = ("auto", "grpc")
        for transport in transports:
            with CubeClient(shards, transport=transport, timeout=10.0) as client:
                assert client.batch_limits == (100_000, 100_000)
                check(client.seek(query), query)
                assert client.batch_limits == (7, 7)
                check(client.seek(query), query)  # planned within the limits at once
        with CubeClient([shards[0]], transport="auto", timeout=10.0) as one:  # the fast path
            mine = query[query % 2 == 0]
            check(one.seek(mine), mine)
        with CubeClient(shards, max_batch=4, timeout=10.0) as smaller:  # the client's own bound
            check(smaller.seek(query), query)
            assert smaller.batch_limits == (4, 4)

        async def run() -> tuple[SeekResult, np.ndarray]:
            async with AsyncCubeClient(shards, timeout=10.0) as aio:
                result = await aio.seek(query)
                return result, await aio.get_embeddings(query, dim=4)

        result, emb = asyncio.run(run())
        check(result, query)
        assert emb.shape == (150, 4) and (emb[~expected] == 0).all()


def test_async_client_parity(fixed_cluster: FixedCluster) -> None:
    shards, _ = fixed_cluster
    keys = query_keys(seed=5)

    async def main() -> tuple[list[SeekResult], np.ndarray]:
        async with AsyncCubeClient(
            shards=shards, max_batch=300, timeout=Timeouts(backup_after=0.05)
        ) as aio:
            assert await aio.wait_ready() == []
            results = await asyncio.gather(*(aio.seek(keys) for _ in range(4)))
            emb = await aio.get_embeddings(keys, dim=4)
            return results, emb

    results, emb = asyncio.run(main())
    with CubeClient(shards=shards) as client:
        expected = client.seek(keys)
        expected_emb = client.get_embeddings(keys, dim=4)
    for result in results:
        check_fixed(result, keys)
        assert result.values == expected.values and result.version == expected.version
    assert np.array_equal(emb, expected_emb, equal_nan=True)


def test_original_protocol(fixed_cluster: FixedCluster) -> None:
    shards, _ = fixed_cluster
    keys = query_keys(seed=6, n=300)
    with CubeClient(shards=shards, protocol="original") as client:
        result = client.seek(keys)
    found = np.isin(keys, KEYS)
    assert result.found.tolist() == found.tolist() and result.version == "100"
    assert result.values[int(np.flatnonzero(found)[0])] is not None
    with CubeClient(shards=shards) as fast:
        assert fast.seek(keys).values == result.values


def conf_file(tmp_path: Path, entries: list[dict[str, Any]]) -> Path:
    path = tmp_path / "cube.conf"
    path.write_text(json.dumps(entries))
    return path


def conf_entry(
    kind: str, nodes: Sequence[Mapping[str, object]], shard: int, **extra: Any
) -> dict[str, Any]:
    """One dict of a cube.conf (decoded JSON)."""
    return {
        "dict_name": "test_dict",
        "shard": shard,
        "dup": 2,
        "timeout": 2000,
        "retry": 2,
        "backup_request": 0,
        "type": kind,
        "nodes": nodes,
        **extra,
    }


def ipport(address: str) -> dict[str, str | int]:
    host, port = address.rsplit(":", 1)
    return {"ip": host, "port": int(port)}


def test_from_conf_ipport_list_and_ipport(fixed_cluster: FixedCluster, tmp_path: Path) -> None:
    shards, _ = fixed_cluster
    keys = query_keys(seed=7, n=500)
    nodes = [{"ipport_list": "list://" + ",".join(replicas)} for replicas in shards]
    other = conf_entry("ipport", [ipport(shards[0][0]), ipport(shards[1][1])], 2)
    other["dict_name"] = "second"
    path = conf_file(tmp_path, [conf_entry("ipport_list", nodes, 2, load_balancer="la"), other])
    with CubeClient.from_conf(path, dict_name="test_dict") as client:
        assert client.shards == tuple(tuple(r) for r in shards)
        check_fixed(client.seek(keys), keys)
    with CubeClient.from_conf(path, dict_name="second") as client:
        assert client.shards == ((shards[0][0],), (shards[1][1],))
        with pytest.raises(RequestRejectedError, match="'second'"):
            client.seek(keys)  # the servers hold test_dict


# ---------------------------------------------------------------------------------------------
# Variable-width values, murmur3 routing, and ipport_parallel against one whole-table server.

VAR_KEYS = np.arange(5, 50_000, 7, dtype=np.uint64)


def run_builder(root: Path, keys: np.ndarray, values: list[bytes], shard_num: int) -> list[Path]:
    """Build with the real cube-builder CLI (murmur3); each shard's data dir (version 1000)."""
    from cube.seqfile import SequenceFileWriter
    from cube.values import ValueColumn

    source = root / "input"
    source.mkdir(parents=True)
    with SequenceFileWriter(source / "part-00000") as writer:
        writer.write_batch(keys, ValueColumn.from_list(values))
    output = root / "output"
    command = [sys.executable, "-m", "cube.builder.cli", "--dict_name", "test_dict"]
    command += ["--input_path", str(source), "--output_path", str(output)]
    command += ["--shard_num", str(shard_num), "--partitioner", "murmur3", "--quiet"]
    command += ["--only_build", "false", "--cur_version", "1000", "--depend_version", "1000"]
    command += ["--workers", "1"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    dirs = []
    for shard in range(shard_num):
        data = root / f"shard{shard}" / "data"
        data.mkdir(parents=True)
        (data / "1000").symlink_to(output / "1000_1000" / f"test_dict_part{shard}")
        (data / "VERSION").write_text("1000\n")
        dirs.append(data)
    return dirs


@pytest.fixture(scope="module")
def variable_cluster(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[list[str], str]]:
    """3 shards built by cube-builder with murmur3 routing, variable-width values; plus one
    server holding the whole table (for ipport_parallel)."""
    root = tmp_path_factory.mktemp("variable")
    values = [variable_value(int(k)) for k in VAR_KEYS]
    dirs = run_builder(root, VAR_KEYS, values, 3)
    whole = root / "whole" / "data"
    write_version(whole, "7", VAR_KEYS, values, current=True)
    with servers(*[(d, (), 1) for d in dirs], (whole, (), 1)) as procs:
        yield [p.address for p in procs[:3]], procs[3].address


def check_variable(result: SeekResult, keys: np.ndarray) -> None:
    expect = [variable_value(int(k)) if k in set(VAR_KEYS.tolist()) else None for k in keys]
    assert result.values == expect
    assert result.found.tolist() == [v is not None for v in expect]


def test_variable_width_with_murmur3_routing_as_cube_builder_shards(
    variable_cluster: tuple[list[str], str], tmp_path: Path
) -> None:
    addresses, _ = variable_cluster
    keys = np.random.default_rng(8).integers(0, 50_000, 700, dtype=np.uint64)
    path = conf_file(
        tmp_path, [conf_entry("ipport", [ipport(a) for a in addresses], 3, partitioner="murmur3")]
    )
    with CubeClient.from_conf(path) as client:
        result = client.seek(keys)
        assert result.width == 0 and result.version == "1000"
        check_variable(result, keys)
        check_variable(client.seek(keys[:1]), keys[:1])
    # Routing by the wrong rule is refused (it used to find almost nothing, silently).
    with (
        CubeClient(shards=[[a] for a in addresses], partitioner="mod") as wrong,
        pytest.raises(CubeError, match="murmur3"),
    ):
        wrong.seek(keys)


def test_ipport_parallel_uses_node_zero_for_every_shard(
    variable_cluster: tuple[list[str], str], tmp_path: Path
) -> None:
    _, whole = variable_cluster
    keys = np.random.default_rng(9).integers(0, 50_000, 400, dtype=np.uint64)
    path = conf_file(tmp_path, [conf_entry("ipport_parallel", [ipport(whole)], 4)])
    with CubeClient.from_conf(path) as client:
        assert client.shard_num == 4 and client.shards == ((whole,),) * 4
        result = client.seek(keys)
        assert result.version == "7"
        check_variable(result, keys)


# ---------------------------------------------------------------------------------------------
# Failures


@pytest.fixture
def replicated_shard(tmp_path: Path) -> Iterator[list[ServerProc]]:
    """One shard served by two separate processes (replicas), fixed width."""
    (data,) = build_shards(tmp_path, KEYS, lambda k: fixed_values(k, WIDTH, tag=1), 1)
    with servers((data, (), 1), (data, (), 1)) as procs:
        yield procs


def test_failover_when_a_replica_is_killed_under_load(replicated_shard: list[ServerProc]) -> None:
    victim, survivor = replicated_shard
    shards = [[victim.address, survivor.address]]
    keys = query_keys(seed=10, n=500)
    errors: list[BaseException] = []
    done = {"calls": 0}
    stop = threading.Event()

    def load(client: CubeClient) -> None:
        while not stop.is_set():
            try:
                check_fixed(client.seek(keys), keys)
                done["calls"] += 1
            except BaseException as exc:
                errors.append(exc)
                return

    with CubeClient(shards=shards, retry=2, timeout=3.0) as client:
        threads = [threading.Thread(target=load, args=(client,)) for _ in range(3)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 20
        while done["calls"] < 30 and time.monotonic() < deadline and not errors:
            time.sleep(0.01)
        os.kill(victim.pid, signal.SIGKILL)
        victim.process.wait(timeout=10)
        killed_at = done["calls"]
        while done["calls"] < killed_at + 60 and time.monotonic() < deadline and not errors:
            time.sleep(0.01)
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
    assert not errors, errors[0]
    assert done["calls"] >= killed_at + 60


def test_failover_async(replicated_shard: list[ServerProc]) -> None:
    victim, survivor = replicated_shard
    keys = query_keys(seed=11, n=300)

    async def main() -> None:
        async with AsyncCubeClient(shards=[[victim.address, survivor.address]]) as client:
            for _ in range(5):
                check_fixed(await client.seek(keys), keys)
            os.kill(victim.pid, signal.SIGKILL)
            victim.process.wait(timeout=10)
            for _ in range(20):
                check_fixed(await client.seek(keys), keys)

    asyncio.run(main())


def test_dead_shard_raises_naming_shard_and_replicas_with_partial_result(tmp_path: Path) -> None:
    dirs = build_shards(tmp_path, KEYS, lambda k: fixed_values(k, WIDTH, tag=1), 2)
    with servers((dirs[0], (), 1), (dirs[1], (), 1), (dirs[1], (), 1)) as procs:
        for proc in procs[1:]:
            os.kill(proc.pid, signal.SIGKILL)
            proc.process.wait(timeout=10)
        dead = [procs[1].address, procs[2].address]
        keys = query_keys(seed=12, n=400)
        on_live = shard_of(keys, 2) == 0
        shards = [[procs[0].address], dead]
        for make in (CubeClient, AsyncCubeClient):
            with pytest.raises(ShardUnavailableError) as info:
                if make is CubeClient:
                    with CubeClient(shards=shards, retry=3, timeout=2.0) as client:
                        client.seek(keys)
                else:
                    asyncio.run(_async_seek(shards, keys, retry=3, timeout=2.0))
            error = info.value
            assert error.shard == 1 and error.shards == [1]
            message = str(error)
            assert "shard 1 failed" in message and all(a in message for a in dead)
            assert "UNAVAILABLE" in message
            assert {a.endpoint for a in error.failures[1]} == set(dead)
            assert len(error.failures[1]) == 4  # first try + 3 retries
            partial = error.result
            assert partial is not None
            assert partial.answered.tolist() == on_live.tolist()
            assert not partial.found[~on_live].any()
            assert all(
                v is None for v, live in zip(partial.values, on_live, strict=True) if not live
            )
            expect_found = np.isin(keys, KEYS) & on_live
            assert partial.found.tolist() == expect_found.tolist()
            hit = int(np.flatnonzero(expect_found)[0])
            assert partial.values[hit] == expected_fixed(keys[hit : hit + 1], WIDTH, 1).tobytes()


# A client process, against links of helpers/delay_relay.py (Link) in front of a replica. First,
# 30 calls to a shard of three: one behind a link that goes down (no reset: connects hang,
# bytes go unanswered), one behind a link far slower than the call's timeout, one healthy.
# Then a call to a replica whose lane port is cut off (as a firewall that drops it: the gRPC
# first contact answers, the lane connect hangs), with 30 s to wait, and the client closed
# while it waits. It prints what failed and how long that call took to end after close(),
# and exits (the links stay as they are: closing them would end hung connects).
PARTIAL_FAILURE_CLIENT = r"""
import json, sys, threading, time
import numpy as np
sys.path.insert(0, sys.argv[1])
from helpers.delay_relay import Link
from cube.client import CubeClient, CubeError, Timeouts

address, report = sys.argv[2], json.loads(sys.argv[3])
ports, lane_ports = report["ports"], report["tcp_ports"]
dead, slow, no_lane = (Link(ports + lane_ports, f"127.0.0.{i}") for i in (2, 3, 4))
port = ports[0]
keys = np.arange(1, 3000, 7, dtype=np.uint64)
timeouts = Timeouts(attempt=1.0, backup_after=0.02, total=1.0)
calls = CubeClient(
    [[f"127.0.0.2:{port}", f"127.0.0.3:{port}", address]], timeout=timeouts, load_balancer="rr"
)
for _ in range(3):  # rr: one call each: every replica connected, its lane known
    calls.seek(keys)
dead.cut()
slow.delay = 60.0
failed = []
for _ in range(30):
    try:
        calls.seek(keys)
    except CubeError as exc:
        failed.append(str(exc)[:400])
calls.close()

no_lane.cut(lane_ports)
stuck = CubeClient([[f"127.0.0.4:{port}"], [address]], timeout=30.0, retry=0)  # 2 shards
ended = []


def seek():
    try:
        stuck.seek(keys)  # shard 0's sub-request: on a pool thread, connecting to the lane
    except CubeError as exc:
        ended.append(str(exc)[:200])
    ended.append(time.monotonic())


waiting = threading.Thread(target=seek, daemon=True)
waiting.start()
time.sleep(1.0)
closed = time.monotonic()
stuck.close()
waiting.join(60)
print(json.dumps({"failed": failed, "ended": ended, "after_close": ended[-1] - closed}))
"""


def test_a_replica_behind_a_link_down_neither_fails_calls_nor_holds_the_exit(
    replicated_shard: list[ServerProc],
) -> None:
    """Issue 24, item 10, on loopback. Before: about one call in three failed by its deadline
    (its first attempt on the dead replica, its one backup request on the slow one, although
    the third answers at once: the dead replica never cooled down, its attempts being
    cancelled or ended by the deadline timer, never failed, and a call sent one backup
    request only); a closed client's call waited on a lane connect that could not be
    cancelled, and the process did not exit until that attempt's 30 s ran out (a
    ThreadPoolExecutor's threads are joined at exit)."""
    server, _ = replicated_shard
    report = server.written_ports()
    tests = str(Path(__file__).parent)
    process = subprocess.Popen(
        [sys.executable, "-c", PARTIAL_FAILURE_CLIENT, tests, server.address, json.dumps(report)],
        stdout=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        outcome = json.loads(process.stdout.readline() or "{}")
        printed = time.monotonic()
        process.wait(60)
        exit_s = time.monotonic() - printed
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    failed = outcome["failed"]
    assert failed == [], f"{len(failed)} of 30 calls failed: {failed[:3]}"
    assert outcome["after_close"] < 3, outcome  # the call in flight ended with close()
    assert "CANCELLED" in outcome["ended"][0], outcome
    assert process.returncode == 0
    assert exit_s < 5, f"the process exited {exit_s:.1f} s after closing its clients"


def test_backup_request_answers_past_a_stopped_replica(replicated_shard: list[ServerProc]) -> None:
    slow, fast = replicated_shard
    keys = query_keys(seed=13, n=300)
    timeout_ms = 20_000
    timeouts = Timeouts(timeout_ms / 1000, 0.03)
    with CubeClient(
        shards=[[slow.address, fast.address]], retry=0, timeout=timeouts, load_balancer="rr"
    ) as client:
        check_fixed(client.seek(keys), keys)  # connect both
        check_fixed(client.seek(keys), keys)
        os.kill(slow.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            for _ in range(6):  # rr: half of these go to the stopped replica first
                check_fixed(client.seek(keys), keys)
            sync_elapsed = time.monotonic() - started
            # The losing attempts (on the stopped replica's lane) were cancelled: no pool
            # thread still waits for them (they would until the 20 s timeout).
            assert poll_until(lambda: client._pool.busy == 0, timeout_ms / 1000 / 2, 0.01)
            assert time.monotonic() - started < timeout_ms / 1000 / 2

            async def hedged() -> float:
                async with AsyncCubeClient(
                    shards=[[slow.address, fast.address]],
                    retry=0,
                    timeout=timeouts,
                    load_balancer="rr",
                ) as aio:
                    begin = time.monotonic()
                    for _ in range(6):
                        check_fixed(await aio.seek(keys), keys)
                    return time.monotonic() - begin

            async_elapsed = asyncio.run(hedged())
        finally:
            os.kill(slow.pid, signal.SIGCONT)
    # Without the backup request, retry=0 would fail after the 20 s timeout: answering six
    # times in well under one timeout shows the backup answered.
    assert sync_elapsed < timeout_ms / 1000 / 2
    assert async_elapsed < timeout_ms / 1000 / 2


def test_timeout_then_retry_on_the_other_replica(replicated_shard: list[ServerProc]) -> None:
    slow, fast = replicated_shard
    keys = query_keys(seed=14, n=100)
    with CubeClient(shards=[[slow.address, fast.address]], retry=1, timeout=0.3) as client:
        check_fixed(client.seek(keys), keys)
        os.kill(slow.pid, signal.SIGSTOP)
        try:
            for _ in range(4):
                check_fixed(client.seek(keys), keys)
        finally:
            os.kill(slow.pid, signal.SIGCONT)


# ---------------------------------------------------------------------------------------------
# Versions


def test_version_reconciliation_during_a_rollout(tmp_path: Path) -> None:
    """Version 100 values carry tag 1, version 200 values tag 2."""
    for tag, version in ((1, "100"), (2, "200")):
        dirs = build_shards(
            tmp_path,
            KEYS,
            functools.partial(fixed_values, width=WIDTH, tag=tag),
            2,
            version=version,
        )
    for data in dirs:
        (data / "VERSION").write_text("100\n")
    keys = query_keys(seed=15, n=600)
    with servers((dirs[0], (), 1), (dirs[1], (), 1)) as (s0, s1):
        shards = [[s0.address], [s1.address]]
        with CubeClient(shards=shards) as client:
            check_fixed(client.seek(keys), keys, tag=1)
            # Shard 0 switches to 200 (keeps 100 as previous); shard 1 has only 100.
            control(s0.control_address, "bg_load_base", version_path="/200")
            control(s0.control_address, "enable", version="200")
            result = client.seek(keys)
            assert result.version == "100"
            check_fixed(result, keys, tag=1)
            async_result = asyncio.run(_async_seek(shards, keys))
            assert async_result.version == "100" and async_result.values == result.values
            # Shard 1 loads 200 in the background: 200 is everywhere now and wins.
            control(s1.control_address, "bg_load_base", version_path="/200")
            result = client.seek(keys)
            assert result.version == "200"
            check_fixed(result, keys, tag=2)
            # An explicit version is honoured.
            check_fixed(client.seek(keys, version="100"), keys, tag=1)
            # Neither holds the other's version any more: a clear error, not a mixed batch.
            control(s0.control_address, "bg_unload")
            control(s1.control_address, "bg_unload")
            with pytest.raises(VersionMismatchError, match=r"shard 0: 200.*shard 1: 100"):
                client.seek(keys)
            # One shard alone is trivially consistent.
            single = client.seek(keys[shard_of(keys, 2) == 1])
            assert single.version == "100"


async def _async_seek(
    shards: list[list[str]], keys: np.ndarray, **options: Unpack[ClientOptions[AsyncTransport]]
) -> SeekResult:
    async with AsyncCubeClient(shards=shards, **options) as client:
        return await client.seek(keys)


# ---------------------------------------------------------------------------------------------
# cube-cli


def run_cli(*args: object, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "cube.client.cli", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def test_cube_cli_prints_latency_and_qps(
    fixed_cluster: FixedCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shards, _ = fixed_cluster
    nodes = [{"ipport_list": "list://" + ",".join(replicas)} for replicas in shards]
    path = conf_file(tmp_path, [conf_entry("ipport_list", nodes, 2)])
    keys_file = tmp_path / "keys.txt"
    keys_file.write_text("\n".join(str(k) for k in query_keys(seed=16, n=300)) + "\n")
    args = ("--config_file", path, "--keys", keys_file, "--dict", "test_dict", "--batch", 50)
    done = run_cli(*args, "--thread_num", 2, "--requests", 20, "--timeout", 2000, "--retry", 1)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "2 shards, batch 50, 2 threads x 20 requests" in out
    assert "requests 40 (failed 0)" in out
    for word in ("avg", "p50", "p90", "p99", "p99.9", "qps", "keys/s"):
        assert word in out
    qps = float(out.split("qps ")[1].split()[0])
    assert qps > 0

    code = cli.main([*map(str, args), "--requests", "1", "--print_output"])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    lines = [line for line in printed.out.splitlines() if line.startswith("key:")]
    first = query_keys(seed=16, n=300)[:50]
    assert len(lines) == 50 and lines[0].startswith(f"key:{first[0]} ")
    hit = int(np.flatnonzero(np.isin(first, KEYS))[0])
    expected = expected_fixed(first[hit : hit + 1], WIDTH, 1).tobytes().hex().upper()
    assert lines[hit] == f"key:{first[hit]} value:{expected}"
    miss = int(np.flatnonzero(~np.isin(first, KEYS))[0])
    assert lines[miss] == f"key:{first[miss]} value:"  # as the original's cube_cli.cpp

    # a reader that stops reading (`cube-cli --print_output | head -1`): no traceback
    command = [sys.executable, "-m", "cube.client.cli", *map(str, args), "--print_output"]
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO
    ) as reader:
        assert reader.stdout is not None and reader.stderr is not None
        assert reader.stdout.readline().startswith("key:")
        reader.stdout.close()
        err = reader.stderr.read()
        assert reader.wait(timeout=60) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_cube_cli_prints_a_miss_as_the_original_did() -> None:
    """cube_cli.cpp printed `key:%lu value:%s` with the value's hex for every key, a miss's
    empty value as `value:`; so does cube-cli."""
    column = ValueColumn.from_list([b"", b"\x01\x02", b""])
    result = SeekResult(np.array([5, 6, 7], np.uint64), np.array([True, True, False]), column, "1")
    assert cli.format_batch(result) == "key:5 value:\nkey:6 value:0102\nkey:7 value:\n"


def test_cube_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def run(*args: object) -> tuple[int, CaptureResult[str]]:
        code = cli.main([str(a) for a in args])
        return code, capsys.readouterr()

    keys_file = tmp_path / "keys.txt"
    keys_file.write_text("1\n2\nx3\n")
    code, out = run("--config_file", tmp_path / "none.conf", "--keys", keys_file)
    assert code == 2 and "line 3: 'x3'" in out.err
    keys_file.write_text("1\n2\n")
    code, out = run("--config_file", tmp_path / "none.conf", "--keys", keys_file)
    assert code == 2 and "none.conf: cannot read" in out.err
    assert run("--bogus", 1)[0] == 2
    assert run("--keys", keys_file, "--batch", 0)[0] == 2
    dead = conf_file(tmp_path, [conf_entry("ipport", [{"ip": "127.0.0.1", "port": 9}], 1)])
    code, out = run("--config_file", dead, "--keys", keys_file, "--requests", 2, "--retry", 0)
    assert code == 1 and "requests 2 (failed 2)" in out.out
    assert "latency" not in out.out  # no figures from failures
    assert "shard 0 failed on 1 tries; last: 127.0.0.1:9" in out.err
    assert ".result" not in out.err  # CLI words, not the SDK's attribute names
    code, out = run("--config_file", dead, "--keys", keys_file, "--timeout", 0)
    assert code == 2 and "--timeout must be >= 1 (ms)" in out.err
    node = [{"ip": "127.0.0.1", "port": 9}]
    two = conf_file(
        tmp_path, [conf_entry("ipport", node, 1), conf_entry("ipport", node, 1, dict_name="b")]
    )
    code, out = run("--config_file", two, "--keys", keys_file)
    assert code == 2 and "defines 2 dicts (test_dict, b); pass --dict" in out.err


@pytest.mark.parametrize("args", [(), ("--allow_empty",)])
def test_a_shard_with_nothing_loaded_is_an_error_not_silent_misses(
    tmp_path: Path, args: tuple[str, ...]
) -> None:
    """A replica with nothing loaded refuses (UNAVAILABLE) or, with --allow_empty, answers
    without a version: either way the SDK reports the shard unavailable, never misses."""
    (loaded,) = build_shards(tmp_path / "a", KEYS, lambda k: fixed_values(k, WIDTH, tag=1), 1)
    with (
        servers((loaded, (), 1), (tmp_path / "empty", args, 1)) as (s0, s1),
        CubeClient(shards=[[s0.address], [s1.address]], retry=1) as client,
    ):
        with pytest.raises(ShardUnavailableError) as caught:
            client.seek(np.arange(100, dtype=np.uint64))
        assert caught.value.shards == [1]
        assert "serve" in str(caught.value)  # "serves no version" / "serves nothing"
        partial = caught.value.result
        assert partial is not None
        assert partial.answered[::2].all() and not partial.answered[1::2].any()
        assert client.seek([0, 2, 4]).version == "100"  # only shard 0 asked


def test_large_answers_beyond_grpc_default_message_size(tmp_path: Path) -> None:
    """30k keys x 256 bytes = 7.7 MB per answer (gRPC's default limit is 4 MB)."""
    keys = np.arange(30_000, dtype=np.uint64)
    (data,) = build_shards(tmp_path, keys, lambda k: fixed_values(k, 256), 1)
    with (
        servers((data, (), 1)) as (server,),
        CubeClient(shards=[[server.address]], timeout=30.0) as client,
    ):
        query = keys[::-1].copy()
        for max_batch in (100_000, 20_000):
            client.max_batch = max_batch
            result = client.seek(query)
            assert result.found.all()
            assert (result.column.as_rows() == expected_fixed(query, 256)).all()


@pytest.mark.slow
def test_both_clients_wait_ready_for_a_replica_still_loading(tmp_path: Path) -> None:
    """A server still loading its version refuses at once; wait_ready asks again until it is
    SERVING or the timeout passes (the asyncio client gave up at its first refusal)."""
    keys = np.arange(1, 101, dtype=np.uint64)
    write_version(tmp_path / "data", "1", keys, fixed_values(keys, 8, 1), current=True)
    for kind in ("sync", "async"):
        ports = free_ports(2)
        with running_server(
            tmp_path / "data", "--load_delay", "2", ports=ports[:1], control_ports=ports[1:],
            wait=False,
        ) as server:  # fmt: skip
            started = time.monotonic()
            if kind == "sync":
                with CubeClient(shards=[[server.address]]) as client:
                    not_ready = client.wait_ready(30)
            else:

                async def wait(address: str = server.address) -> list[str]:
                    async with AsyncCubeClient(shards=[[address]]) as aio:
                        return await aio.wait_ready(30)

                not_ready = asyncio.run(wait())
            assert not_ready == [], kind
            assert time.monotonic() - started < 30, kind
            with CubeClient(shards=[[server.address]]) as client:
                assert client.seek(keys).found.all(), kind
