"""What users of the original client rely on (issue 16, item 5), against real cube-server
processes on loopback:

- cube.conf's `timeout` bounds the whole call (brpc's timeout_ms is a deadline over retries and
  backup requests): a call past it raises DeadlineExceededError naming the dict and shard,
  within the timeout plus slack, even with retries and backup requests left; `attempt_timeout`
  bounds each attempt inside it; a number given to the constructor still bounds each attempt.
  Replicas are made slow by stopping them (SIGSTOP: connected, never answering) or through a
  relay that delays every byte by an amount the test changes (helpers/delay_relay.py's `Link`).
- every load balancer name brpc registers is accepted (served by the nearest policy, with a
  warning) or refused with the reason and what is accepted;
- several dicts from one object (CubeClients / AsyncCubeClients: seek(dict_name, keys),
  table(name), get_table_names()), the one-dict API unchanged.

Time bounds are generous (slack for a loaded machine): they check that a call ends by its
deadline, not how fast it is."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import signal
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeAlias

import numpy as np
import pytest
from helpers.delay_relay import Link
from helpers.procs import ServerProc, expected_fixed, fixed_values, start_server, write_version

from cube.client import (
    AsyncCubeClient,
    AsyncCubeClients,
    ClientStats,
    ConfError,
    CubeClient,
    CubeClients,
    DeadlineExceededError,
    RequestRejectedError,
    SeekResult,
    ShardUnavailableError,
    Timeouts,
    load_conf,
    parse_conf,
)
from cube.client._core import PieceRequest, assemble, make_plan, seek_flow
from cube.client._policy import Cluster, Policy, Round, Send, ShardCall
from cube.client.conf import BRPC_LOAD_BALANCERS
from cube.routing import shard_of
from cube.values import ValueColumn
from cube.wire import Answer

pytestmark = pytest.mark.slow  # real processes: `make quick` skips them

WIDTH = 16
KEYS = np.arange(1, 20_000, 3, dtype=np.uint64)
SLACK = 0.8  # seconds a bounded call may run past its deadline on a loaded test machine

# a seek's result or the error it raised, and the seconds it took
Timed: TypeAlias = tuple[SeekResult | ShardUnavailableError, float]


@contextlib.contextmanager
def servers(*specs: tuple[Path, tuple[str, ...]]) -> Iterator[list[ServerProc]]:
    """(data_dir, args) each; stopped by PID at the end (resumed first if a test stopped one)."""
    started: list[ServerProc] = []
    try:
        for data_dir, args in specs:
            started.append(start_server(data_dir, *args, wait=False))
        for server in started:
            server.wait_up()
        yield started
    finally:
        for server in started:
            with contextlib.suppress(ProcessLookupError):
                server.signal(signal.SIGCONT)
            server.stop()


def shard_dirs(root: Path, dict_name: str, shard_num: int, tag: int) -> list[Path]:
    owner = shard_of(KEYS, shard_num, "mod")
    dirs = []
    for shard in range(shard_num):
        mine = KEYS[owner == shard]
        data = root / dict_name / f"shard{shard}" / "data"
        values = fixed_values(mine, WIDTH, tag)
        write_version(data, "100", mine, values, current=True, dict_name=dict_name)
        dirs.append(data)
    return dirs


def entry(dict_name: str, nodes: Sequence[Mapping[str, object]], **changes: Any) -> dict[str, Any]:
    """One dict of a cube.conf (decoded JSON)."""
    conf: dict[str, Any] = {
        "dict_name": dict_name,
        "shard": len(nodes),
        "dup": 1,
        "timeout": 2000,
        "retry": 2,
        "backup_request": 0,
        "type": "ipport_list",
        "nodes": nodes,
    }
    conf.update(changes)
    return conf


def replicas(*addresses: str) -> dict[str, str]:
    return {"ipport_list": "list://" + ",".join(addresses)}


def write_conf(path: Path, *entries: dict[str, Any]) -> Path:
    path.write_text(json.dumps(list(entries)))
    return path


def check(result: SeekResult, keys: np.ndarray, tag: int) -> None:
    expect = np.isin(keys, KEYS)
    assert result.found.tolist() == expect.tolist()
    rows = result.column.as_rows()
    assert (rows[expect] == expected_fixed(keys[expect], WIDTH, tag)).all()


def query(seed: int, n: int = 200) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 20_000, n, dtype=np.uint64)


@contextlib.contextmanager
def stopped(*procs: ServerProc) -> Iterator[None]:
    """The servers stopped (SIGSTOP): their sockets stay connected, nothing is answered."""
    for proc in procs:
        os.kill(proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for proc in procs:
            os.kill(proc.pid, signal.SIGCONT)


@contextlib.contextmanager
def relayed(server: ServerProc) -> Iterator[tuple[Link, str]]:
    """A delaying Link (tests/helpers/delay_relay.py) in front of `server` on 127.0.0.2; yields (the
    link, the relayed lookup address)."""
    report = server.written_ports()
    relay = Link([*report["ports"], *report["tcp_ports"]])
    try:
        yield relay, f"127.0.0.2:{report['ports'][0]}"
    finally:
        relay.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServerProc]]:
    """Dict `emb`: shard 0 on two replica processes, shard 1 on one; dict `ctr`: one shard.
    Values carry tag 1 (emb) and 2 (ctr)."""
    root = tmp_path_factory.mktemp("migration")
    emb = shard_dirs(root, "emb", 2, tag=1)
    (ctr,) = shard_dirs(root, "ctr", 1, tag=2)
    emb_args = ("--dict_name", "emb")
    specs: list[tuple[Path, tuple[str, ...]]] = [
        (emb[0], (*emb_args, "--shard", "0")),
        (emb[0], (*emb_args, "--shard", "0")),
        (emb[1], (*emb_args, "--shard", "1")),
        (ctr, ("--dict_name", "ctr")),
    ]
    with servers(*specs) as procs:
        yield procs


# ---------------------------------------------------------------------------------------------
# 1. The whole-call timeout


def seek_timed(
    client: CubeClient | AsyncCubeClient, keys: np.ndarray, stop: tuple[ServerProc, ...] = ()
) -> Timed:
    """(result or error, seconds) of one seek on a CubeClient or an AsyncCubeClient (then
    closed), made while the servers in `stop` are stopped, after a first seek that connects
    to them."""
    if isinstance(client, AsyncCubeClient):
        return asyncio.run(_seek_timed(client, keys, stop))
    with client:
        if stop:
            client.seek(keys)
        with stopped(*stop):
            started = time.monotonic()
            outcome: SeekResult | ShardUnavailableError
            try:
                outcome = client.seek(keys)
            except ShardUnavailableError as exc:
                outcome = exc
            return outcome, time.monotonic() - started


async def _seek_timed(
    client: AsyncCubeClient, keys: np.ndarray, stop: tuple[ServerProc, ...]
) -> Timed:
    async with client:  # grpc.aio channels belong to this run's event loop
        if stop:
            await client.seek(keys)
        with stopped(*stop):
            started = time.monotonic()
            outcome: SeekResult | ShardUnavailableError
            try:
                outcome = await client.seek(keys)
            except ShardUnavailableError as exc:
                outcome = exc
            return outcome, time.monotonic() - started


@pytest.mark.parametrize("make", [CubeClient, AsyncCubeClient], ids=["sync", "async"])
def test_conf_timeout_bounds_the_whole_call_past_retries_and_backups(
    cluster: list[ServerProc],
    tmp_path: Path,
    make: type[CubeClient] | type[AsyncCubeClient],
) -> None:
    """Both replicas of shard 0 stopped. Attempts of 150 ms, 5 retries and backup requests
    could take over a second; the 400 ms timeout of the call ends it, naming dict and shard."""
    a, b, c, _ = cluster
    conf = write_conf(
        tmp_path / "cube.conf",
        entry("emb", [replicas(a.address, b.address), replicas(c.address)], timeout=400,
              attempt_timeout=150, retry=5, backup_request=50),
    )  # fmt: skip
    keys = query(1)
    client = make.from_conf(conf)
    assert client.timeouts == Timeouts(0.15, 0.05, total=0.4)
    error, elapsed = seek_timed(client, keys, stop=(a, b))
    assert isinstance(error, DeadlineExceededError), error
    assert isinstance(error, TimeoutError) and isinstance(error, ShardUnavailableError)
    assert 0.35 < elapsed < 0.4 + SLACK, elapsed
    assert error.shards == [0] and error.dict_name == "emb" and error.timeout_s == 0.4
    message = str(error)
    assert message.startswith("dict 'emb': no answer within the call's timeout of 400 ms")
    assert "shard 0 failed" in message and "DEADLINE_EXCEEDED" in message
    partial = error.result  # shard 1 answered
    assert partial is not None
    on_shard1 = shard_of(keys, 2) == 1
    assert partial.answered.tolist() == on_shard1.tolist()
    assert partial.found[on_shard1].tolist() == np.isin(keys[on_shard1], KEYS).tolist()


@pytest.mark.parametrize("make", [CubeClient, AsyncCubeClient], ids=["sync", "async"])
def test_a_slow_shard_ends_at_the_deadline_with_the_others_answers(
    cluster: list[ServerProc],
    tmp_path: Path,
    make: type[CubeClient] | type[AsyncCubeClient],
) -> None:
    """Shard 1 behind a relay. Connected, then 1.5 s per round trip: the call fails by its
    300 ms timeout, with shard 0's answers in the error's partial result. At 100 ms per round
    trip it answers, late but in time."""
    a, _, c, _ = cluster
    keys = query(2)
    on_shard1 = shard_of(keys, 2) == 1
    with relayed(c) as (relay, slow):
        conf = write_conf(
            tmp_path / "cube.conf",
            entry("emb", [replicas(a.address), replicas(slow)], timeout=300, retry=3),
        )
        client = make.from_conf(conf)
        if isinstance(client, CubeClient):
            outcomes = [slow_seeks(client, keys, relay)]
        else:
            outcomes = [asyncio.run(slow_seeks_async(client, keys, relay))]
    ((first, (error, elapsed), (late, late_elapsed)),) = outcomes
    check(first, keys, 1)
    assert isinstance(error, DeadlineExceededError), error
    assert 0.25 < elapsed < 0.3 + SLACK, elapsed
    assert error.shards == [1] and str(error).startswith("dict 'emb': no answer within")
    assert error.result is not None
    assert error.result.answered.tolist() == (~on_shard1).tolist()
    answered = np.isin(keys[~on_shard1], KEYS).tolist()
    assert error.result.found[~on_shard1].tolist() == answered
    assert isinstance(late, SeekResult), late
    check(late, keys, 1)
    assert 0.1 <= late_elapsed < 0.3 + SLACK


def slow_seeks(
    client: CubeClient, keys: np.ndarray, relay: Link
) -> tuple[SeekResult, Timed, Timed]:
    """A seek through the relay, one at 1.5 s per round trip, one at 100 ms."""
    with client:
        first = client.seek(keys)
        relay.delay = 1.5
        slow = timed(client.seek, keys)
        relay.delay = 0.1
        time.sleep(1.5)  # the abandoned answer comes back and is dropped
        return first, slow, timed(client.seek, keys)


async def slow_seeks_async(
    client: AsyncCubeClient, keys: np.ndarray, relay: Link
) -> tuple[SeekResult, Timed, Timed]:
    async with client:
        first = await client.seek(keys)
        relay.delay = 1.5
        slow = await timed_async(client.seek, keys)
        relay.delay = 0.1
        await asyncio.sleep(1.5)
        return first, slow, await timed_async(client.seek, keys)


def timed(seek: Callable[[np.ndarray], SeekResult], keys: np.ndarray) -> Timed:
    started = time.monotonic()
    outcome: SeekResult | ShardUnavailableError
    try:
        outcome = seek(keys)
    except ShardUnavailableError as exc:
        outcome = exc
    return outcome, time.monotonic() - started


async def timed_async(
    seek: Callable[[np.ndarray], Awaitable[SeekResult]], keys: np.ndarray
) -> Timed:
    started = time.monotonic()
    outcome: SeekResult | ShardUnavailableError
    try:
        outcome = await seek(keys)
    except ShardUnavailableError as exc:
        outcome = exc
    return outcome, time.monotonic() - started


def test_attempt_timeout_fails_over_within_the_calls_timeout(
    cluster: list[ServerProc], tmp_path: Path
) -> None:
    """attempt_timeout 100 ms inside a 3 s call: a stopped replica costs one attempt, then the
    other replica answers (rr sends half of the first attempts to the stopped one)."""
    a, b, c, _ = cluster
    conf = write_conf(
        tmp_path / "cube.conf",
        entry("emb", [replicas(a.address, b.address), replicas(c.address)], timeout=3000,
              attempt_timeout=100, retry=1),
    )  # fmt: skip
    keys = query(3)
    with CubeClient.from_conf(conf) as client:
        check(client.seek(keys), keys, 1)
        check(client.seek(keys), keys, 1)
        with stopped(a):
            for _ in range(4):
                started = time.monotonic()
                check(client.seek(keys), keys, 1)
                assert time.monotonic() - started < 3.0


def test_without_attempt_timeout_a_backup_request_gets_past_a_stuck_replica(
    cluster: list[ServerProc], tmp_path: Path
) -> None:
    """As in the original: an attempt may use the whole timeout, so the backup request is what
    answers past a replica that never does (retry 0: no retry would come in time anyway)."""
    a, b, c, _ = cluster
    conf = write_conf(
        tmp_path / "cube.conf",
        entry("emb", [replicas(a.address, b.address), replicas(c.address)], timeout=5000,
              retry=0, backup_request=30),
    )  # fmt: skip
    keys = query(4)
    with CubeClient.from_conf(conf) as client:
        assert client.timeouts == Timeouts(5.0, 0.03, total=5.0)
        check(client.seek(keys), keys, 1)
        check(client.seek(keys), keys, 1)
        with stopped(a):
            started = time.monotonic()
            for _ in range(4):
                check(client.seek(keys), keys, 1)
            assert time.monotonic() - started < 5.0  # none waited for the stuck replica


def test_a_number_given_to_the_constructor_still_bounds_each_attempt(
    cluster: list[ServerProc],
) -> None:
    """Backward compatible: timeout=0.2 is per attempt, no whole-call bound: with both
    replicas stopped, 3 attempts time out (ShardUnavailableError, not the deadline's)."""
    a, b, c, _ = cluster
    keys = np.array([0, 2, 4], dtype=np.uint64)  # shard 0 only: one sub-request
    client = CubeClient([[a.address, b.address], [c.address]], timeout=0.2, retry=2)
    assert client.timeouts == Timeouts(0.2) and client.timeouts.total is None
    error, elapsed = seek_timed(client, keys, stop=(a, b))
    assert type(error) is ShardUnavailableError, error
    assert len(error.failures[0]) == 3 and elapsed >= 0.35  # two attempts timed out at least
    # the same with a whole-call bound of 0.3 s
    timeouts = Timeouts(0.2, total=0.3)
    client = CubeClient([[a.address, b.address], [c.address]], timeout=timeouts, retry=2)
    error, elapsed = seek_timed(client, keys, stop=(a, b))
    assert isinstance(error, DeadlineExceededError) and 0.25 < elapsed < 0.3 + SLACK
    assert str(error).startswith("no answer within the call's timeout of 300 ms: shard 0")


def test_from_conf_number_override_replaces_the_calls_timeout(tmp_path: Path) -> None:
    conf = write_conf(
        tmp_path / "cube.conf",
        entry(
            "emb", [replicas("127.0.0.1:1")], timeout=800, attempt_timeout=100, backup_request=20
        ),
    )
    with CubeClient.from_conf(conf) as client:
        assert client.timeouts == Timeouts(0.1, 0.02, total=0.8)
    with CubeClient.from_conf(conf, timeout=2.0) as client:
        assert client.timeouts == Timeouts(0.1, 0.02, total=2.0)
    with CubeClient.from_conf(conf, timeout=0.05) as client:
        assert client.timeouts == Timeouts(0.05, 0.02, total=0.05)
    for bad in (0, 801, "50", True):
        with pytest.raises(
            ConfError, match=r"field 'attempt_timeout' must be an integer in 1\.\.800"
        ):
            parse_conf([entry("emb", [replicas("h:1")], timeout=800, attempt_timeout=bad)])


# The state machine under a call deadline, with a fake clock.


def decode(data: bytes) -> Answer:
    return Answer(np.ones(1, bool), ValueColumn.from_list([b"v"]), data.decode())


def deadline_round(
    policy: Policy, deadline: float | None, replicas: Sequence[str] = ("a:1", "b:2")
) -> Round:
    rng = random.Random(3)
    cluster = Cluster([list(replicas)], "rr", rng)
    call = ShardCall(0, cluster.shards[0], b"req", decode, policy, rng)
    return Round([call], policy, 0.0, deadline)


def test_attempts_are_cut_to_the_deadline_and_nothing_starts_past_it() -> None:
    policy = Policy(timeout_ms=300, total_ms=500, retry=5, backup_request_ms=480)
    round_ = deadline_round(policy, 0.5)
    (first,) = round_.start(0.0)
    assert isinstance(first, Send)
    assert first.timeout_s == 0.3  # the attempt's own bound: within the deadline
    assert round_.calls[0].hedge_at == pytest.approx(0.48)
    assert round_.on_error(first.key, "UNAVAILABLE", "refused", 0.25) == []
    at = round_.next_wakeup()
    (retry,) = [a for a in round_.on_timer(at) if isinstance(a, Send)]
    assert retry.timeout_s == pytest.approx(0.5 - at)  # cut to what remains of the call
    assert round_.calls[0].hedge_at is None  # a backup 480 ms later would start past it
    assert round_.on_error(retry.key, "DEADLINE_EXCEEDED", "no answer", 0.5) == []
    assert round_.done
    (outcome,) = round_.outcomes()
    assert outcome.deadline_exceeded and outcome.answer is None and outcome.retries == 1


def test_the_round_aborts_at_the_calls_deadline() -> None:
    policy = Policy(timeout_ms=1000, total_ms=200, retry=2)
    round_ = deadline_round(policy, 0.2)
    (first,) = round_.start(0.0)
    assert isinstance(first, Send)
    assert first.timeout_s == pytest.approx(0.2)
    assert round_.next_wakeup() == pytest.approx(0.2)
    cancels = round_.on_timer(0.2)
    assert [c.key for c in cancels] == [first.key] and round_.done
    (outcome,) = round_.outcomes()
    assert outcome.deadline_exceeded
    assert "the call's timeout of 200 ms passed" in repr(outcome.attempts)
    # a retry that would begin after the deadline is not waited for
    round_ = deadline_round(Policy(timeout_ms=1000, total_ms=200, retry=2), 0.2)
    (first,) = round_.start(0.0)
    assert isinstance(first, Send)
    assert round_.on_error(first.key, "UNAVAILABLE", "refused", 0.1999) == []
    assert round_.done and round_.outcomes()[0].deadline_exceeded
    # without a deadline nothing changes
    round_ = deadline_round(Policy(timeout_ms=1000, retry=2), None)
    (first,) = round_.start(0.0)
    assert isinstance(first, Send)
    assert first.timeout_s == 1.0
    round_.on_error(first.key, "UNAVAILABLE", "refused", 0.1)
    assert not round_.done


def test_the_flow_raises_the_deadline_error_naming_the_dict() -> None:
    keys = np.array([1, 2], dtype=np.uint64)
    pieces = make_plan(keys, 2, "mod")
    flow = seek_flow(keys, pieces, assemble, call_timeout_s=0.25, dict_name="emb")
    requests = next(flow)
    assert requests == [PieceRequest(0, None), PieceRequest(1, None)]
    policy = Policy(timeout_ms=100, total_ms=250)
    rounds = [deadline_round(policy, 0.25) for _ in requests]
    outcomes = []
    for number, round_ in enumerate(rounds):
        (send,) = round_.start(0.0)
        assert isinstance(send, Send)
        if number == 0:
            round_.on_response(send.key, b"7", 0.01)
        else:
            round_.on_timer(0.25)
        outcomes += round_.outcomes()
    with pytest.raises(DeadlineExceededError) as info:
        flow.send(outcomes)
    assert str(info.value).startswith("dict 'emb': no answer within the call's timeout of 250 ms")
    partial = info.value.result
    assert info.value.shards == [1]
    assert partial is not None and partial.answered.tolist() == [False, True]


# ---------------------------------------------------------------------------------------------
# 2. brpc's load balancer names

# src/brpc/global.cpp of apache/brpc registers these (p2c since 2026; wr since 2020)
BRPC_NAMES = ("rr", "wrr", "random", "wr", "la", "p2c", "c_murmurhash", "c_md5", "c_ketama",
              "_dynpart")  # fmt: skip


def lb_conf(
    name: object, nodes: Sequence[Mapping[str, object]] | None = None, kind: str = "ipport_list"
) -> list[dict[str, Any]]:
    nodes = nodes or [replicas("h:1", "h:2")]
    return [entry("d", nodes, load_balancer=name, type=kind)]


def test_every_brpc_name_is_known() -> None:
    assert set(BRPC_NAMES) == set(BRPC_LOAD_BALANCERS)


@pytest.mark.parametrize(
    ("name", "policy", "warning"),
    [
        ("rr", "rr", None),
        ("random", "random", None),
        ("la", "la", None),
        ("wrr", "rr", "with one weight per shard it is rr"),
        ("wr", "random", "with one weight per shard it is random"),
        ("p2c", "la", "la scores replicas by in-flight requests x latency"),
        ("p2c:choices=4", "la", "its parameters 'choices=4' are ignored"),
        ("random:min_working_instances=6 hold_seconds=10", "random", "are ignored"),
    ],
)
def test_brpc_names_map_to_the_nearest_policy_with_a_warning(
    caplog: pytest.LogCaptureFixture, name: str, policy: str, warning: str | None
) -> None:
    with caplog.at_level(logging.WARNING, logger="cube.client"):
        conf = parse_conf(lb_conf(name))
    assert conf.load_balancer == policy
    lines = [r.getMessage() for r in caplog.records if r.name == "cube.client"]
    if warning is None:
        assert lines == []
    else:
        (line,) = lines
        assert f"load_balancer {name!r} is served by this SDK's {policy!r} policy" in line
        assert warning in line and "dict 'd'" in line


def test_weights_are_honoured_only_when_a_shard_has_one() -> None:
    equal = [replicas("h:1 10", "h:2 10"), replicas("h:3", "h:4")]
    assert parse_conf(lb_conf("wrr", equal)).load_balancer == "rr"
    uneven = [replicas("h:1 10", "h:2\t30")]
    with pytest.raises(ConfError, match=r"'wr' cannot be honoured: shard 0's replicas have"
                       r" different weights \(h:1 10, h:2 30\)") as info:  # fmt: skip
        parse_conf(lb_conf("wr", uneven))
    assert "accepted: rr, random, la" in str(info.value)
    assert parse_conf(lb_conf("rr", uneven)).shards == (("h:1", "h:2"),)  # tags ignored


@pytest.mark.parametrize("name", ["c_murmurhash", "c_md5", "c_ketama", "_dynpart"])
def test_hashing_and_internal_balancers_are_refused_where_there_is_a_choice(
    caplog: pytest.LogCaptureFixture, name: str
) -> None:
    with pytest.raises(ConfError, match=rf"'{name}' cannot be honoured for a shard with several"
                       " replicas") as info:  # fmt: skip
        parse_conf(lb_conf(name))
    assert "accepted: rr, random, la; wrr and wr" in str(info.value)
    single = [{"ip": "h", "port": 1}]
    with caplog.at_level(logging.WARNING, logger="cube.client"):
        conf = parse_conf(lb_conf(name, single, kind="ipport"))
    assert conf.load_balancer == "rr" and "nothing to choose" in caplog.text


def test_unknown_names_are_refused_listing_brpcs() -> None:
    for bad in ("lalb", "RR", "", 3):
        with pytest.raises(ConfError, match="field 'load_balancer' must be"):
            parse_conf(lb_conf(bad))
    with pytest.raises(ConfError) as info:
        parse_conf(lb_conf("consistent"))
    assert "rr, random, la, wrr, wr, p2c, c_murmurhash, c_md5, c_ketama, _dynpart" in str(
        info.value
    )


@pytest.mark.parametrize("name", ["wrr", "wr", "p2c", "la:whatever"])
def test_mapped_balancers_spread_calls_over_real_replicas(
    cluster: list[ServerProc], tmp_path: Path, name: str
) -> None:
    a, b, c, _ = cluster
    nodes = [replicas(f"{a.address} 5", f"{b.address} 5"), replicas(c.address)]
    conf = write_conf(tmp_path / "cube.conf", entry("emb", nodes, load_balancer=name))
    keys = query(5)
    with CubeClient.from_conf(conf) as client:
        for _ in range(30):
            check(client.seek(keys), keys, 1)
        states = {e.address: e for e in client._cluster.endpoints}
        # both replicas of shard 0 answered some calls (a latency measured)
        assert states[a.address].ewma_s > 0 and states[b.address].ewma_s > 0


# ---------------------------------------------------------------------------------------------
# 3. Several dicts from one object


@pytest.fixture
def two_dicts(cluster: list[ServerProc], tmp_path: Path) -> Path:
    a, b, c, d = cluster
    return write_conf(
        tmp_path / "cube.conf",
        entry("emb", [replicas(a.address, b.address), replicas(c.address)]),
        entry("ctr", [{"ip": "127.0.0.1", "port": d.port}], type="ipport", timeout=1000),
    )


def test_one_object_for_every_dict_of_cube_conf(two_dicts: Path) -> None:
    keys = query(6)
    with CubeClients.from_conf(two_dicts) as cube:
        assert cube.get_table_names() == ["emb", "ctr"]  # file order
        assert "ctr" in cube and "x" not in cube and len(cube) == 2 and list(cube) == ["emb", "ctr"]
        check(cube.seek("emb", keys), keys, 1)
        check(cube.seek("ctr", keys), keys, 2)
        emb = cube.get_embeddings("ctr", keys, dim=4)
        assert emb.shape == (len(keys), 4)
        table = cube.table("emb")
        assert isinstance(table, CubeClient) and table.dict_name == "emb" and table.shard_num == 2
        assert cube.table("ctr").timeouts.total == 1.0
        assert cube.wait_ready(5.0) == []
        with pytest.raises(ConfError, match=r"no dict 'x' \(has emb, ctr\)"):
            cube.seek("x", keys)
    with CubeClients.from_conf(two_dicts, dict_names=["ctr"], retry=0) as cube:
        assert cube.get_table_names() == ["ctr"] and cube.table("ctr").retry.attempts == 0
    with pytest.raises(ConfError, match="no dict 'nope'"):
        CubeClients.from_conf(two_dicts, dict_names=["ctr", "nope"])


def test_the_one_dict_api_is_unchanged(two_dicts: Path) -> None:
    keys = query(7)
    with pytest.raises(ConfError, match=r"defines 2 dicts \(emb, ctr\); pass dict_name .*"
                       "CubeClients.from_conf"):  # fmt: skip
        CubeClient.from_conf(two_dicts)
    with CubeClient.from_conf(two_dicts, "ctr") as client:
        check(client.seek(keys), keys, 2)
    assert load_conf(two_dicts, "emb").dict_name == "emb"


def test_clients_built_by_hand_and_their_checks(cluster: list[ServerProc], two_dicts: Path) -> None:
    _, _, c, d = cluster
    keys = query(8)
    stats = ClientStats()
    emb = CubeClient.from_conf(two_dicts, "emb", stats=stats)
    ctr = CubeClient([[d.address]], dict_name="ctr")
    with CubeClients([emb, ctr]) as cube:
        check(cube.seek("emb", keys), keys, 1)
        check(cube.seek("ctr", keys), keys, 2)
        assert stats.snapshot()["calls"] == {"ok": 1}
    with pytest.raises(ConfError, match="dict 'ctr' is given twice"):
        CubeClients([ctr, ctr])
    with pytest.raises(ConfError, match="needs its dict_name"):
        CubeClients([CubeClient([[d.address]])])
    with pytest.raises(ConfError, match="no dict given"):
        CubeClients([])
    with pytest.raises(ConfError, match="stats would mix the dicts"):
        CubeClients.from_conf(two_dicts, stats=stats)
    # a dict's name is checked by its servers: ctr's client on emb's servers is refused
    with (
        CubeClients([CubeClient([[c.address]], dict_name="ctr")]) as wrong,
        pytest.raises(RequestRejectedError, match="'ctr'"),
    ):
        wrong.seek("ctr", keys)


def test_async_clients_of_several_dicts(two_dicts: Path) -> None:
    keys = query(9)

    async def main() -> tuple[SeekResult, SeekResult, np.ndarray]:
        async with AsyncCubeClients.from_conf(two_dicts) as cube:
            assert cube.get_table_names() == ["emb", "ctr"]
            assert await cube.wait_ready(5.0) == []
            first = await cube.seek("emb", keys)
            second = await cube.seek("ctr", keys)
            vectors = await cube.get_embeddings("emb", keys, dim=2, dtype="float64")
            assert isinstance(cube.table("ctr"), AsyncCubeClient)
            return first, second, vectors

    first, second, vectors = asyncio.run(main())
    check(first, keys, 1)
    check(second, keys, 2)
    assert vectors.shape == (len(keys), 2) and vectors.dtype == np.float64
