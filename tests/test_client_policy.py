"""Retry, backup request and load-balancing state machine, driven with a fake clock."""

from __future__ import annotations

import random
from typing import Final

import numpy as np
import pytest

from cube.backoff import Backoff
from cube.client._core import PieceOutcome
from cube.client._policy import (
    Action,
    Balancer,
    Cancel,
    Cluster,
    EndpointState,
    Policy,
    Round,
    Send,
    ShardCall,
)
from cube.client.errors import ConfError
from cube.values import ValueColumn
from cube.wire import Answer, BadMessage


def fake_decode(data: bytes) -> Answer:
    """Test responses are the version name; b"garbage" is a malformed response."""
    if data == b"garbage":
        raise BadMessage("garbage")
    return Answer(np.ones(1, bool), ValueColumn.from_list([b"v"]), data.decode())


def make_round(
    replicas: list[str],
    policy: Policy,
    calls: int = 1,
    pinned: str | None = None,
    balancer: str = "rr",
    now: float = 0.0,
) -> tuple[Round, Cluster]:
    rng = random.Random(7)
    cluster = Cluster([replicas] * calls, balancer, rng)
    shard_calls = [
        ShardCall(i, cluster.shards[i], b"req", fake_decode, policy, rng, pinned)
        for i in range(calls)
    ]
    return Round(shard_calls, policy, now), cluster


def sends(actions: list[Action]) -> list[Send]:
    return [a for a in actions if isinstance(a, Send)]


def only_sends(actions: list[Action]) -> list[Send]:
    """`actions`, every one of them a Send (what `start` returns)."""
    assert all(isinstance(a, Send) for a in actions), actions
    return sends(actions)


def answer_of(outcome: PieceOutcome) -> Answer:
    """The outcome's answer; fails the test if it has none."""
    assert outcome.answer is not None, outcome.attempts
    return outcome.answer


def picked(choice: int | None) -> int:
    """A balancer's pick; fails the test if it picked none."""
    assert choice is not None, "no replica picked"
    return choice


def test_first_answer_wins() -> None:
    round_, _ = make_round(["a:1", "b:2"], Policy())
    (send,) = only_sends(round_.start(0.0))
    assert send.request == b"req" and send.timeout_s == 1.0
    assert round_.on_response(send.key, b"v9", 0.001) == []
    assert round_.done
    (outcome,) = round_.outcomes()
    assert answer_of(outcome).version == "v9" and outcome.attempts == ()


def test_retries_go_to_other_replicas_with_bounded_backoff_then_fail() -> None:
    policy = Policy(retry=2, backoff=Backoff(0.004, 0.006, 0.5))
    round_, cluster = make_round(["a:1", "b:2", "c:3"], policy)
    (first,) = only_sends(round_.start(0.0))
    assert round_.on_error(first.key, "UNAVAILABLE", "refused", 0.0) == []
    wake = round_.next_wakeup()
    assert 0.002 <= wake <= 0.004  # half to full of base
    assert round_.on_timer(wake - 1e-6) == []
    (second,) = sends(round_.on_timer(wake))
    assert second.address != first.address
    round_.on_error(second.key, "DEADLINE_EXCEEDED", "slow", wake)
    wake2 = round_.next_wakeup()
    assert 0.003 <= wake2 - wake <= 0.006  # 2 * base capped at 6 ms, jittered
    (third,) = sends(round_.on_timer(wake2))
    assert {first.address, second.address, third.address} == {"a:1", "b:2", "c:3"}
    round_.on_error(third.key, "INTERNAL", "boom", wake2)
    assert round_.done
    (outcome,) = round_.outcomes()
    assert outcome.answer is None
    assert [(a.endpoint, a.code) for a in outcome.attempts] == [
        (first.address, "UNAVAILABLE"),
        (second.address, "DEADLINE_EXCEEDED"),
        (third.address, "INTERNAL"),
    ]
    assert all(e.is_down(wake2) for e in cluster.endpoints)


def test_single_replica_retries_on_itself() -> None:
    round_, _ = make_round(["a:1"], Policy(retry=1))
    (first,) = only_sends(round_.start(0.0))
    round_.on_error(first.key, "UNAVAILABLE", "x", 0.0)
    (second,) = sends(round_.on_timer(round_.next_wakeup()))
    assert second.address == "a:1"
    round_.on_response(second.key, b"v1", 0.01)
    assert answer_of(round_.outcomes()[0]).version == "v1"


def test_backoff_is_capped_and_jittered() -> None:
    policy = Policy(backoff=Backoff(0.002, 0.1, 0.5))
    rng = random.Random(1)
    delays = [policy.backoff_s(k, rng) for k in range(30)]
    assert max(delays) <= 0.1 and min(delays[10:]) >= 0.05
    assert len(set(delays)) == 30


def test_non_retryable_status_rejects_the_round_and_cancels_the_rest() -> None:
    round_, _ = make_round(["a:1", "b:2"], Policy(retry=3), calls=3)
    started = round_.start(0.0)
    assert len(started) == 3
    actions = round_.on_error(started[1].key, "INVALID_ARGUMENT", "bad keys", 0.0)
    assert sorted(a.key for a in actions if isinstance(a, Cancel)) == [
        started[0].key,
        started[2].key,
    ]
    assert round_.done and round_.rejected
    outcomes = round_.outcomes()
    assert outcomes[1].rejected is not None and outcomes[1].rejected.message == "bad keys"
    assert outcomes[0].attempts[0].code == "CANCELLED"


def test_backup_request_after_delay_and_loser_cancelled() -> None:
    round_, cluster = make_round(["a:1", "b:2"], Policy(backup_request_ms=10))
    (first,) = only_sends(round_.start(0.0))
    assert round_.next_wakeup() == pytest.approx(0.010)
    assert round_.on_timer(0.005) == []
    (backup,) = sends(round_.on_timer(0.010))
    assert backup.address != first.address and backup.request == first.request
    assert {e.address: e.inflight for e in cluster.endpoints} == {"a:1": 1, "b:2": 1}
    actions = round_.on_response(backup.key, b"v1", 0.012)
    assert actions == [Cancel(first.key)]
    assert round_.done and answer_of(round_.outcomes()[0]).version == "v1"
    assert all(e.inflight == 0 for e in cluster.endpoints)
    # A late answer of the cancelled attempt changes nothing.
    assert round_.on_response(first.key, b"v2", 0.02) == []


def test_la_learns_a_replica_whose_attempts_always_lose_to_backups() -> None:
    """A slow replica never answers first, so it never reports a latency of its own; the
    time its outrun attempts waited counts instead, and `la` stops picking it first."""
    policy = Policy(backup_request_ms=10)
    rng = random.Random(3)
    cluster = Cluster([["slow:1", "fast:2"]], "la", rng)
    firsts = []
    for call in range(40):
        now = call * 1.0
        call_ = ShardCall(0, cluster.shards[0], b"req", fake_decode, policy, rng)
        round_ = Round([call_], policy, now)
        (first,) = only_sends(round_.start(now))
        firsts.append(first.address)
        if first.address == "fast:2":
            round_.on_response(first.key, b"v", now + 0.001)
            continue
        (backup,) = sends(round_.on_timer(now + 0.010))
        assert round_.on_response(backup.key, b"v", now + 0.011) == [Cancel(first.key)]
    slow, fast = cluster.endpoints
    assert slow.ewma_s > 0.010 > fast.ewma_s  # at least the time it was outrun after
    assert firsts[-20:].count("slow:1") <= 1, firsts


def test_no_backup_request_with_one_replica_and_failed_original_waits_for_backup() -> None:
    round_, _ = make_round(["a:1"], Policy(backup_request_ms=10))
    round_.start(0.0)
    assert round_.next_wakeup() > 1.0  # only the round deadline
    round_, _ = make_round(["a:1", "b:2"], Policy(backup_request_ms=10, retry=0))
    (first,) = only_sends(round_.start(0.0))
    (backup,) = sends(round_.on_timer(0.01))
    assert round_.on_error(first.key, "DEADLINE_EXCEEDED", "slow", 0.02) == []
    assert not round_.done
    round_.on_response(backup.key, b"v3", 0.03)
    assert answer_of(round_.outcomes()[0]).version == "v3"


def test_pinned_version_tries_other_replicas_without_marking_them_down() -> None:
    round_, cluster = make_round(["a:1", "b:2"], Policy(retry=1), pinned="6")
    (first,) = only_sends(round_.start(0.0))
    round_.on_error(first.key, "FAILED_PRECONDITION", "version 6 not held", 0.0)
    (second,) = sends(round_.on_timer(round_.next_wakeup()))
    assert second.address != first.address
    # A server that ignores the pin and answers another version counts as not holding it.
    round_.on_response(second.key, b"5", 0.01)
    outcome = round_.outcomes()[0]
    assert outcome.answer is None and outcome.version_unavailable
    assert not any(e.is_down(0.01) for e in cluster.endpoints)


def test_bad_response_is_retried() -> None:
    round_, _ = make_round(["a:1", "b:2"], Policy(retry=1))
    (first,) = only_sends(round_.start(0.0))
    round_.on_response(first.key, b"garbage", 0.0)
    (second,) = sends(round_.on_timer(round_.next_wakeup()))
    round_.on_response(second.key, b"v1", 0.01)
    outcome = round_.outcomes()[0]
    assert answer_of(outcome).version == "v1" and outcome.attempts[0].code == "BAD_RESPONSE"


def test_round_deadline_aborts_everything() -> None:
    policy = Policy(timeout_ms=100, retry=1, backoff=Backoff(0.002, 0.01, 0.5))
    round_, _ = make_round(["a:1"], policy, calls=2)
    started = round_.start(0.0)
    deadline = round_.next_wakeup()
    assert deadline == pytest.approx(2 * 0.110 + 1.0)
    actions = round_.on_timer(deadline)
    assert sorted(a.key for a in actions) == sorted(s.key for s in started)
    assert round_.done
    assert {o.attempts[0].code for o in round_.outcomes()} == {"DEADLINE_EXCEEDED"}


def test_balancers() -> None:
    replicas = [EndpointState(a) for a in ("a", "b", "c")]
    rr = Balancer("rr", random.Random(0))
    picks = [picked(rr.pick(replicas, set(), 0.0, reuse=True)) for _ in range(6)]
    assert sorted(picks[:3]) == [0, 1, 2] and picks[:3] == picks[3:]
    assert rr.pick(replicas, {0, 1}, 0.0, reuse=True) == 2
    assert rr.pick(replicas, {0, 1, 2}, 0.0, reuse=False) is None

    la = Balancer("la", random.Random(0))
    replicas[0].inflight, replicas[1].inflight, replicas[2].inflight = 2, 0, 1
    assert la.pick(replicas, set(), 0.0, reuse=True) == 1
    replicas[1].inflight = 2
    replicas[0].ewma_s, replicas[1].ewma_s, replicas[2].ewma_s = 0.001, 0.001, 0.01
    assert la.pick(replicas, set(), 0.0, reuse=True) == 0  # 3 * 1 ms beats 2 * 10 ms

    rnd = Balancer("random", random.Random(0))
    assert {rnd.pick(replicas, set(), 0.0, reuse=True) for _ in range(50)} == {0, 1, 2}

    replicas[0].failed(0.0, Policy())
    assert replicas[0].is_down(0.05) and not replicas[0].is_down(0.2)
    assert all(rr.pick(replicas, set(), 0.05, reuse=True) != 0 for _ in range(6))
    replicas[1].failed(0.0, Policy())
    replicas[2].failed(0.0, Policy())
    assert rr.pick(replicas, set(), 0.05, reuse=True) is not None  # all down: still try one
    with pytest.raises(ConfError, match="load_balancer 'wrr'"):
        Balancer("wrr", random.Random(0))


def test_the_policy_takes_retry_and_cooldown_from_the_options() -> None:
    """Retry.backoff and Retry.cooldown are the state machine's rules as they are (one home for
    the backoff rule and its defaults)."""
    from cube.client.options import Retry, Timeouts

    retry = Retry(backoff=Backoff(0.01, 0.5, 0.25), cooldown=Backoff(0.3, 0.9))
    policy = Policy.from_options(Timeouts(), retry)
    assert policy.backoff is retry.backoff and policy.cooldown is retry.cooldown
    assert Policy().backoff == Retry().backoff and Policy().cooldown == Retry().cooldown
    endpoint = EndpointState("a")
    for expected in (0.3, 0.6, 0.9):
        endpoint.failed(0.0, policy)
        assert endpoint.down_until == pytest.approx(expected)


def test_cooldown_grows_and_is_capped() -> None:
    endpoint, policy = EndpointState("a"), Policy(cooldown=Backoff(0.1, 0.4))
    for expected in (0.1, 0.2, 0.4, 0.4):
        endpoint.failed(0.0, policy)
        assert endpoint.down_until == pytest.approx(expected)
    endpoint.succeeded(0.002)
    assert not endpoint.is_down(0.0) and endpoint.failures == 0
    endpoint = EndpointState("b")  # a replica down for a long time under load
    for _ in range(5000):  # (the doubling overflowed at 1025 failures in a row)
        endpoint.failed(1.0, Policy())
    assert endpoint.down_until == pytest.approx(1.0 + Policy().cooldown.cap)


def test_policy_rejects_bad_settings() -> None:
    with pytest.raises(ConfError, match="retry"):
        Policy(retry=-1)
    with pytest.raises(ConfError, match="timeout"):
        Policy(timeout_ms=0)


def test_version_unavailable_is_not_retried_on_the_same_replicas() -> None:
    round_, _ = make_round(["a:1"], Policy(retry=5), pinned="6")
    (first,) = only_sends(round_.start(0.0))
    round_.on_error(first.key, "FAILED_PRECONDITION", "version 6 not held", 0.0)
    assert round_.done and round_.outcomes()[0].version_unavailable


# ---------------------------------------------------------------------------------------------
# Partial failure (issue 24, item 10): a replica whose link is down (connects hang, no reset),
# another too slow for the call's timeout, a third healthy; hedging on, `rr`.

NEVER: Final = None  # a replica that never answers: its attempts end by their timeout


def drive(
    cluster: Cluster,
    policy: Policy,
    latency: dict[str, float | None],
    calls: int,
    gap_s: float = 0.01,
    late_s: float = 1e-4,
) -> tuple[list[PieceOutcome], list[Send]]:
    """Sequential calls through the state machine on a fake clock, as the drivers run them:
    an attempt's answer arrives `latency[address]` after it was sent; an attempt that gets
    none reports DEADLINE_EXCEEDED `late_s` after its timeout, i.e. just after the driver's
    own timer at the call's deadline (the race the drivers see). Returns the outcomes and
    every Send."""
    rng = random.Random(11)
    now = 0.0
    outcomes: list[PieceOutcome] = []
    sent: list[Send] = []
    for _ in range(calls):
        call = ShardCall(0, cluster.shards[0], b"req", fake_decode, policy, rng)
        round_ = Round([call], policy, now, now + policy.total_s if policy.total_s else None)
        due: dict[tuple[int, int], tuple[float, bool]] = {}  # key -> (when, answered)

        def carry_out(
            actions: list[Action],
            at: float,
            due: dict[tuple[int, int], tuple[float, bool]] = due,
        ) -> None:
            for action in actions:
                if isinstance(action, Send):
                    sent.append(action)
                    took = latency[action.address]
                    if took is NEVER or took > action.timeout_s:
                        due[action.key] = (at + action.timeout_s + late_s, False)
                    else:
                        due[action.key] = (at + took, True)
                else:
                    due.pop(action.key, None)

        carry_out(round_.start(now), now)
        for _ in range(1000):  # bounded: a round is a handful of events
            if round_.done:
                break
            key = min(due, key=lambda k: due[k][0], default=None)
            if key is None or round_.next_wakeup() <= due[key][0]:
                now = max(now, round_.next_wakeup())
                carry_out(round_.on_timer(now), now)
                continue
            now, answered = due.pop(key)
            if answered:
                actions = round_.on_response(key, b"v1", now)
            else:
                actions = round_.on_error(key, "DEADLINE_EXCEEDED", "no answer", now)
            carry_out(actions + round_.on_timer(now, expire=False), now)
        assert round_.done
        outcomes += round_.outcomes()
        now += gap_s
    return outcomes, sent


# the chart's client defaults: 200 ms for the whole call (and so for each attempt), a backup
# request after 20 ms, 2 retries
CHART = Policy(timeout_ms=200, total_ms=200, retry=2, backup_request_ms=20)
DEAD_SLOW_OK = {"dead:1": NEVER, "slow:2": 0.300, "ok:3": 0.001}


def test_no_call_fails_while_a_replica_answers() -> None:
    """Before: a call whose first attempt went to the dead replica and its one backup request
    to the slow one waited for them until its deadline (about one call in three), although
    the third replica would have answered at once."""
    cluster = Cluster([list(DEAD_SLOW_OK)], "rr", random.Random(5))
    outcomes, _ = drive(cluster, CHART, DEAD_SLOW_OK, calls=300)
    failed = [o for o in outcomes if o.answer is None]
    assert not failed, f"{len(failed)} of 300 calls failed, e.g. {failed[0].attempts}"


def test_a_replica_that_never_answers_is_avoided_though_backups_save_every_call() -> None:
    """Before: its attempts always lost to a backup request (cancelled, never failed) or were
    ended by the driver's deadline timer (aborted, never failed), so it never cooled down and
    `rr` sent it a third of all first attempts, each call paying the backup delay."""
    latency = {"dead:1": NEVER, "ok:2": 0.001, "ok:3": 0.001}
    cluster = Cluster([list(latency)], "rr", random.Random(5))
    outcomes, sent = drive(cluster, CHART, latency, calls=300)  # 3 s of calls
    assert all(o.answer is not None for o in outcomes)
    to_dead = [s for s in sent if s.address == "dead:1"]
    # cooldowns of 0.1, 0.2, 0.4, 0.8, 1.6 s (then 2 s): about 6 tries in 3 s, not 100
    assert len(to_dead) <= 10, len(to_dead)


def test_the_deadline_fails_the_replicas_it_ends_whichever_reports_first() -> None:
    for transport_first in (True, False):
        round_, cluster = make_round(["a:1", "b:2"], CHART)
        round_ = Round(round_.calls, CHART, 0.0, call_deadline=0.2)
        (first,) = only_sends(round_.start(0.0))
        assert len(sends(round_.on_timer(0.02))) == 1  # the backup request
        if transport_first:  # the attempt's own timeout (cut to the deadline) reports it
            round_.on_error(first.key, "DEADLINE_EXCEEDED", "no answer", 0.2)
        round_.on_timer(0.2)  # the driver's timer at the call's deadline
        assert round_.done and round_.outcomes()[0].deadline_exceeded
        assert all(e.is_down(0.25) for e in cluster.endpoints), transport_first


def test_backup_requests_go_on_to_replicas_not_tried_yet() -> None:
    round_, cluster = make_round(["a:1", "b:2", "c:3"], Policy(backup_request_ms=10, retry=1))
    (first,) = only_sends(round_.start(0.0))
    (backup,) = sends(round_.on_timer(0.010))
    (third,) = sends(round_.on_timer(0.020))
    assert {first.address, backup.address, third.address} == {"a:1", "b:2", "c:3"}
    assert round_.next_wakeup() > 1.0  # every replica has the request: no more backups
    assert set(round_.on_response(third.key, b"v1", 0.021)) == {
        Cancel(first.key),
        Cancel(backup.key),
    }
    outcome = round_.outcomes()[0]
    assert outcome.hedges == 2 and outcome.hedge_won
    # the two that had waited 21 and 11 ms for what the third answered in 1 ms cool down
    assert [e.is_down(0.05) for e in cluster.endpoints].count(True) == 2
    # the budget: 1 + retry backup requests
    round_, _ = make_round(["a:1", "b:2", "c:3", "d:4"], Policy(backup_request_ms=10, retry=0))
    round_.start(0.0)
    assert len(sends(round_.on_timer(0.010))) == 1
    assert round_.next_wakeup() > 1.0
    # a loser about as fast as the winner (waited 25 ms; the winner took 15) does not cool down
    round_, cluster = make_round(["a:1", "b:2"], Policy(backup_request_ms=10))
    (first,) = only_sends(round_.start(0.0))
    (backup,) = sends(round_.on_timer(0.010))
    round_.on_response(backup.key, b"v1", 0.025)
    assert not any(e.is_down(0.026) for e in cluster.endpoints)
