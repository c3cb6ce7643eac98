"""Replicas, load balancing, retries and backup requests, as a pure state machine.

No I/O and no clock: every method takes `now` (seconds, monotonic) and returns actions
(`Send`, `Cancel`) for a driver to carry out; the driver reports back responses, errors and
timer ticks. The sync client (grpc futures) and the asyncio client (grpc.aio) are two such
drivers, and the tests drive it with a fake clock.

Per sub-request (`ShardCall`):
- pick a replica with the shard's balancer (`rr`, `random`, `la` = fewest in flight, then
  lowest latency EWMA), skipping replicas that failed recently (a short, capped cooldown);
- on a retryable error (UNAVAILABLE, DEADLINE_EXCEEDED, INTERNAL, ...) retry on another
  replica after a capped exponential backoff with jitter, at most `retry` times;
- `backup_request_ms` without an answer: send the same request to another replica, take the
  first answer and cancel the others; still none after another `backup_request_ms`: to a
  third replica not tried yet, and so on (at most `1 + retry` backup requests), so that a
  dead replica and a slow one picked first cannot hold a call while a third could answer;
- a non-retryable status (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, NOT_FOUND, ...) ends the
  whole round at once;
- FAILED_PRECONDITION to a version-pinned request means "this replica does not hold that
  version": try the other replicas, without counting it against the replica's health.
- an answer without a version comes from a replica that serves nothing: it is a failure of
  that replica (retried elsewhere), never a batch of misses.
- A replica fails (and cools down) when an attempt on it errs, when the deadline ends an
  attempt still waiting on it (whether the driver's timer or the transport's own timeout
  reports it first), and when it is outrun: another replica answered the same request while
  this one had waited at least twice as long as the answer took. A replica that never
  answers (a link down: connects hang, no reset) is thus avoided even when every call it
  is part of is saved by a backup request; without that, `rr` kept picking it first.
Every round also has a hard deadline (all attempts and backoffs, plus slack), so a driver
never waits unboundedly. With a whole-call timeout (`Policy.total_ms`, cube.conf's `timeout`)
the driver gives each round the call's deadline: attempts are cut to what remains of it, no
retry or backup request is started when it would begin past it, and at the deadline the
round aborts what is in flight (DEADLINE_EXCEEDED); the outcomes then say the deadline ended
them (`deadline_exceeded`), which the flow raises as DeadlineExceededError.
"""

from __future__ import annotations

import itertools
import random
import threading
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from cube.backoff import Backoff
from cube.client._core import PieceOutcome
from cube.client.errors import Attempt, ConfError
from cube.client.options import Retry, Timeouts
from cube.wire import Answer, BadMessage

LOAD_BALANCERS = ("rr", "random", "la")
NON_RETRYABLE = frozenset(
    {
        "INVALID_ARGUMENT",
        "RESOURCE_EXHAUSTED",
        "NOT_FOUND",
        "OUT_OF_RANGE",
        "PERMISSION_DENIED",
        "UNAUTHENTICATED",
        "CONFIG_MISMATCH",  # the endpoint holds other keys than this client routes to it
    }
)
# Errors that say nothing about the replica's health (no cooldown).
NEUTRAL = frozenset({"FAILED_PRECONDITION", "CANCELLED"})
VERSION_UNAVAILABLE = "FAILED_PRECONDITION"
CALL_DEADLINE = "DEADLINE_EXCEEDED"
# An attempt is not started with less than this left before the call's deadline.
MIN_ATTEMPT_S = 0.001
NO_VERSION = (
    "answered without a version: the replica serves nothing (e.g. a cube-server started with"
    " --allow_empty before its first version); its misses are not taken as answers"
)


@dataclass(frozen=True)
class Policy:
    """Timeouts and retry budget of every sub-request (milliseconds)."""

    timeout_ms: float = 1000.0  # per attempt
    total_ms: float = 0.0  # the whole call (every round, retry and backup); 0 = no bound
    retry: int = 2  # extra attempts after the first, on other replicas when there are any
    backup_request_ms: float = 0.0  # 0 = no backup requests
    backoff: Backoff = Retry().backoff  # before each retry (seconds, jittered)
    cooldown: Backoff = Retry().cooldown  # how long a failed replica is avoided, doubling

    @classmethod
    def from_options(cls, timeouts: Timeouts, retry: Retry) -> Policy:
        """The state machine's settings (milliseconds) from the public option objects."""
        return cls(
            timeout_ms=timeouts.attempt * 1000.0,
            total_ms=(timeouts.total or 0.0) * 1000.0,
            retry=retry.attempts,
            backup_request_ms=(timeouts.backup_after or 0.0) * 1000.0,
            backoff=retry.backoff,
            cooldown=retry.cooldown,
        )

    def __post_init__(self) -> None:
        if self.timeout_ms <= 0:
            raise ConfError(f"timeout must be > 0 ms, got {self.timeout_ms}")
        if self.retry < 0:
            raise ConfError(f"retry must be >= 0, got {self.retry}")
        if self.backup_request_ms < 0:
            raise ConfError(f"backup_request must be >= 0 ms, got {self.backup_request_ms}")
        if self.total_ms < 0:
            raise ConfError(f"the call's timeout must be >= 0 ms, got {self.total_ms}")

    def backoff_s(self, retry_index: int, rng: random.Random) -> float:
        """Delay before retry number `retry_index` (0-based): capped exponential, jittered
        (by default into [half, full]) so that clients do not retry in lockstep."""
        return self.backoff.delay(retry_index, rng)

    def cooldown_s(self, failures: int) -> float:
        """How long a replica is avoided after `failures` failures in a row (doubling, capped;
        any number of them: a replica down for hours used to overflow the doubling)."""
        return self.cooldown.delay(failures - 1)

    @property
    def timeout_s(self) -> float:
        """Seconds per attempt."""
        return self.timeout_ms / 1000.0

    @property
    def total_s(self) -> float | None:
        """Seconds the whole call may take (None: no bound)."""
        return self.total_ms / 1000.0 if self.total_ms > 0 else None

    def deadline_reason(self) -> str:
        return f"the call's timeout of {self.total_ms:g} ms passed"

    def max_attempts(self) -> int:
        return (1 + self.retry) * (2 if self.backup_request_ms > 0 else 1)

    @property
    def max_hedges(self) -> int:
        """Backup requests one sub-request may send (0 without backup requests)."""
        return 1 + self.retry if self.backup_request_ms > 0 else 0

    def round_budget_s(self) -> float:
        """Hard bound on one round: every attempt timing out back to back, plus slack."""
        per_try = self.timeout_ms + self.backoff.cap * 1000.0
        return (1 + self.retry) * per_try / 1000.0 + 1.0


class EndpointState:
    """Health and load of one replica endpoint (host:port), shared by all calls of a client.

    The in-flight count is changed under a lock (calls from many threads would otherwise
    lose updates and leave it drifting); latency and failure fields may lose an update under
    concurrency, which only nudges load balancing."""

    __slots__ = ("_lock", "address", "down_until", "ewma_s", "failures", "inflight")

    def __init__(self, address: str) -> None:
        self._lock = threading.Lock()
        self.address = address
        self.inflight = 0
        self.ewma_s = 0.0  # latency EWMA; 0 = not measured yet
        self.failures = 0  # consecutive failures
        self.down_until = 0.0

    def begin(self) -> None:
        with self._lock:
            self.inflight += 1

    def end(self) -> None:
        with self._lock:
            self.inflight -= 1

    def is_down(self, now: float) -> bool:
        return now < self.down_until

    def succeeded(self, latency_s: float) -> None:
        self.ewma_s = latency_s if not self.ewma_s else 0.8 * self.ewma_s + 0.2 * latency_s
        self.failures = 0
        self.down_until = 0.0

    def outrun(self, waited_s: float) -> None:
        """An attempt here lost to a backup request after `waited_s` without an answer: its
        latency is at least that. Counted when it raises the EWMA, so that `la` learns a
        replica is slow even though its attempts never finish (each loses to a hedge)."""
        if waited_s > self.ewma_s:
            self.ewma_s = waited_s if not self.ewma_s else 0.8 * self.ewma_s + 0.2 * waited_s

    def failed(self, now: float, policy: Policy) -> None:
        self.failures += 1
        self.down_until = now + policy.cooldown_s(self.failures)

    def __repr__(self) -> str:
        return f"EndpointState({self.address}, inflight={self.inflight}, failures={self.failures})"


class Balancer:
    """Chooses a replica of one shard: `rr`, `random` or `la` (least in flight, then lowest
    latency EWMA). Replicas already tried by this call come last, replicas in cooldown
    after those."""

    def __init__(self, kind: str, rng: random.Random) -> None:
        if kind not in LOAD_BALANCERS:
            raise ConfError(
                f"load_balancer {kind!r} is not supported; expected one of "
                f"{', '.join(LOAD_BALANCERS)}"
            )
        self.kind = kind
        self._rng = rng
        self._turn = itertools.count(rng.randrange(1 << 16))  # next() is atomic in CPython

    def pick(
        self, replicas: Sequence[EndpointState], tried: AbstractSet[int], now: float, reuse: bool
    ) -> int | None:
        """Index of the replica to use, or None when `reuse` is False and all were tried."""
        count = len(replicas)
        if count == 1:  # nothing to choose (the common single-replica shard: no lists)
            return None if tried and not reuse else 0
        if not tried and self.kind == "rr":  # a call's first pick (what the code below picks)
            healthy = [i for i, r in enumerate(replicas) if now >= r.down_until]
            pool = healthy or range(count)
            return pool[0] if len(pool) == 1 else pool[next(self._turn) % len(pool)]
        fresh = [i for i in range(count) if i not in tried]
        if not fresh and not reuse:
            return None
        pool = fresh or list(range(count))
        healthy = [i for i in pool if not replicas[i].is_down(now)]
        pool = healthy or pool
        if len(pool) == 1:
            return pool[0]
        if self.kind == "random":
            return self._rng.choice(pool)
        turn = next(self._turn)
        if self.kind == "rr":
            return pool[turn % len(pool)]
        # la: fewest in flight, then fastest; rotate the start so ties spread evenly.
        start = turn % len(pool)
        rotated = pool[start:] + pool[:start]
        known = [replicas[i].ewma_s for i in pool if replicas[i].ewma_s]
        default = min(known) if known else 0.0
        return min(
            rotated,
            key=lambda i: (replicas[i].inflight + 1) * (replicas[i].ewma_s or default or 1.0),
        )


class ShardReplicas:
    """The replicas of one shard and its balancer."""

    def __init__(self, shard: int, replicas: Sequence[EndpointState], balancer: Balancer) -> None:
        self.shard = shard
        self.replicas = list(replicas)
        self.balancer = balancer


class Cluster:
    """Every shard's replicas. Endpoint states are shared by shards listing the same address
    (ipport_parallel), so health and load are tracked per endpoint."""

    def __init__(
        self, shards: Sequence[Sequence[str]], load_balancer: str, rng: random.Random
    ) -> None:
        states: dict[str, EndpointState] = {}
        self.shards = [
            ShardReplicas(
                number,
                [states.setdefault(a, EndpointState(a)) for a in addresses],
                Balancer(load_balancer, rng),
            )
            for number, addresses in enumerate(shards)
        ]
        self.endpoints = list(states.values())

    @property
    def shard_num(self) -> int:
        return len(self.shards)


# ---------------------------------------------------------------------------------------------
# Actions for the driver


@dataclass(frozen=True)
class Send:
    key: tuple[int, int]  # (call index in the round, attempt number): the driver's handle key
    address: str
    request: bytes
    timeout_s: float


@dataclass(frozen=True)
class Cancel:
    key: tuple[int, int]


Action = Send | Cancel


class _InFlight:
    __slots__ = ("capped", "hedge", "replica", "started")

    def __init__(self, replica: int, started: float, hedge: bool, capped: bool) -> None:
        self.replica = replica
        self.started = started
        self.hedge = hedge
        self.capped = capped  # its timeout was cut to the call's deadline


class ShardCall:
    """One sub-request across its attempts (see the module docstring)."""

    def __init__(
        self,
        index: int,
        group: ShardReplicas,
        request: bytes,
        decode: Callable[[bytes], Answer],
        policy: Policy,
        rng: random.Random,
        pinned_version: str | None = None,
    ) -> None:
        self.index = index
        self.group = group
        self.request = request
        self.decode = decode
        self.policy = policy
        self.rng = rng
        self.pinned_version = pinned_version
        self.inflight: dict[int, _InFlight] = {}
        self.tried: set[int] = set()
        self.attempts: list[Attempt] = []
        self.answer: Answer | None = None
        self.rejected: Attempt | None = None
        self.finished = False
        self._next_attempt = 0
        self._retries = 0
        self._hedges = 0
        self._first: int | None = None  # the replica tried first
        self._won: _InFlight | None = None  # the attempt that answered
        self.retry_at: float | None = None
        self.hedge_at: float | None = None
        self.deadline: float | None = None  # the call's (set by the Round); None: no bound
        self.deadline_hit = False  # the call's deadline is what ended this sub-request

    # -- driver inputs -------------------------------------------------------------------

    def start(self, now: float) -> list[Action]:
        return self._send(now, hedge=False)

    def on_response(self, attempt: int, data: bytes, now: float) -> list[Action]:
        flight = self.inflight.get(attempt)
        if flight is None or self.finished:
            return []
        try:
            answer = self.decode(data)
        except BadMessage as exc:
            return self.on_error(attempt, "BAD_RESPONSE", str(exc), now)
        if not answer.version:
            return self.on_error(attempt, "UNAVAILABLE", NO_VERSION, now)
        if self.pinned_version is not None and answer.version != self.pinned_version:
            message = f"answered version {answer.version!r}, asked for {self.pinned_version!r}"
            return self.on_error(attempt, VERSION_UNAVAILABLE, message, now)
        del self.inflight[attempt]
        self._won = flight
        replica = self.group.replicas[flight.replica]
        replica.end()
        replica.succeeded(now - flight.started)
        self.answer = answer
        return self._finish(now)

    def on_error(self, attempt: int, code: str, message: str, now: float) -> list[Action]:
        flight = self.inflight.pop(attempt, None)
        if flight is None or self.finished:
            return []
        replica = self.group.replicas[flight.replica]
        replica.end()
        failure = Attempt(replica.address, code, message)
        self.attempts.append(failure)
        if code in NON_RETRYABLE:
            self.rejected = failure
            return self._finish()
        if code not in NEUTRAL:
            replica.failed(now, self.policy)
        if code == CALL_DEADLINE and flight.capped:
            self.deadline_hit = True  # it had what remained of the call: the call is over
        if self.inflight:  # a backup (or the original) is still out: wait for it
            return []
        if code == VERSION_UNAVAILABLE and len(self.tried) >= len(self.group.replicas):
            return self._finish()  # every replica said it does not hold the version
        if self._retries < self.policy.retry:
            retry_at = now + self.policy.backoff_s(self._retries, self.rng)
            if self.deadline is not None and retry_at + MIN_ATTEMPT_S > self.deadline:
                self.deadline_hit = True  # a retry would start too late: give up now
                return self._finish()
            self.retry_at = retry_at
            self._retries += 1
            self.hedge_at = None
            return []
        return self._finish()

    def on_timer(self, now: float) -> list[Action]:
        if self.finished:
            return []
        if self.retry_at is not None and now >= self.retry_at:
            self.retry_at = None
            return self._send(now, hedge=False)
        if self.hedge_at is not None and now >= self.hedge_at:
            self.hedge_at = None
            if self.inflight:
                return self._send(now, hedge=True)
        return []

    def abort(
        self, code: str, reason: str, deadline: bool = False, now: float | None = None
    ) -> list[Action]:
        """Give up (hard deadline, or another call was rejected): cancel what is in flight.
        `deadline`: the call's deadline is the reason. With `now` and a code that speaks of the
        replicas (DEADLINE_EXCEEDED, not CANCELLED), each replica still waited on failed, as
        when its attempt's own timeout reports it: the same health whichever comes first."""
        if self.finished:
            return []
        self.deadline_hit = self.deadline_hit or deadline
        for flight in self.inflight.values():
            replica = self.group.replicas[flight.replica]
            self.attempts.append(Attempt(replica.address, code, reason))
            if now is not None and code not in NEUTRAL:
                replica.failed(now, self.policy)
        if not self.inflight:
            self.attempts.append(Attempt("-", code, reason))
        return self._finish()

    def wakeup(self) -> float | None:
        if self.finished:
            return None
        times = [t for t in (self.retry_at, self.hedge_at) if t is not None]
        return min(times) if times else None

    def outcome(self) -> PieceOutcome:
        unavailable = (
            self.answer is None
            and self.pinned_version is not None
            and any(a.code == VERSION_UNAVAILABLE for a in self.attempts)
        )
        won = self._won
        return PieceOutcome(
            self.answer,
            tuple(self.attempts),
            self.rejected,
            unavailable,
            retries=self._retries,
            hedges=self._hedges,
            hedge_won=won is not None and won.hedge,
            failover=won is not None and not won.hedge and won.replica != self._first,
            deadline_exceeded=self.deadline_hit and self.answer is None,
        )

    # -- internals -----------------------------------------------------------------------

    def adopt(self, choice: int, now: float) -> None:
        """Take over a first attempt that a driver already sent to replica `choice` at `now`
        (its `begin()` done) without this object: the state `start(now)` would have left,
        had the balancer picked `choice`. The drivers' fast path for a lone sub-request
        builds the state machine only when that attempt does not simply succeed."""
        self._launch(choice, now, hedge=False, begin=False)

    def _send(self, now: float, hedge: bool) -> list[Action]:
        if self.deadline is not None and self.deadline - now < MIN_ATTEMPT_S:
            if hedge:
                return []
            reason = self.policy.deadline_reason()
            return self.abort(CALL_DEADLINE, reason, deadline=True, now=now)
        group = self.group
        busy = self.tried | {f.replica for f in self.inflight.values()}
        choice = group.balancer.pick(group.replicas, busy, now, reuse=not hedge)
        if choice is None:
            return []
        return [self._launch(choice, now, hedge)]

    def _launch(self, choice: int, now: float, hedge: bool, begin: bool = True) -> Send:
        group = self.group
        if hedge:
            self._hedges += 1
        attempt = self._next_attempt
        self._next_attempt += 1
        if self._first is None:
            self._first = choice
        self.tried.add(choice)
        timeout_s = self.policy.timeout_s
        capped = False
        if self.deadline is not None and self.deadline - now < timeout_s:
            timeout_s = max(self.deadline - now, MIN_ATTEMPT_S)
            capped = True
        self.inflight[attempt] = _InFlight(choice, now, hedge, capped)
        replica = group.replicas[choice]
        if begin:
            replica.begin()
        self._schedule_hedge(now)
        return Send((self.index, attempt), replica.address, self.request, timeout_s)

    def _schedule_hedge(self, now: float) -> None:
        """The next backup request, `backup_request_ms` after the attempt just sent, while
        the budget lasts and a replica is left that is neither tried nor waited on."""
        if self._hedges >= self.policy.max_hedges:
            return
        if len(self.tried) >= len(self.group.replicas):
            return
        hedge_at = now + self.policy.backup_request_ms / 1000.0
        if self.deadline is None or hedge_at + MIN_ATTEMPT_S <= self.deadline:
            self.hedge_at = hedge_at

    def _finish(self, answered_at: float | None = None) -> list[Action]:
        """End the call; cancel the attempts still out (outrun by the answer at
        `answered_at`, when there is one)."""
        self.finished = True
        self.retry_at = self.hedge_at = None
        cancels: list[Action] = []
        won = self._won
        for attempt, flight in self.inflight.items():
            replica = self.group.replicas[flight.replica]
            replica.end()
            if answered_at is not None and won is not None:
                waited = answered_at - flight.started
                replica.outrun(waited)
                if waited >= 2 * (answered_at - won.started):  # clearly slower: see above
                    replica.failed(answered_at, self.policy)
            cancels.append(Cancel((self.index, attempt)))
        self.inflight.clear()
        return cancels


class Round:
    """All sub-requests of one round, run in parallel until each has an outcome, one is
    rejected (then everything else is cancelled), or the hard deadline passes: the round's
    own budget, or `call_deadline` (monotonic seconds: the whole call's, None: none) when
    that comes first."""

    def __init__(
        self,
        calls: Sequence[ShardCall],
        policy: Policy,
        now: float,
        call_deadline: float | None = None,
    ) -> None:
        self.calls = list(calls)
        self.policy = policy
        self.call_deadline = call_deadline
        budget = now + policy.round_budget_s()
        self.deadline = budget if call_deadline is None else min(budget, call_deadline)
        for call in self.calls:
            call.deadline = call_deadline
        self._closed: set[int] = set()
        self.rejected = False

    @property
    def done(self) -> bool:
        return self.rejected or len(self._closed) == len(self.calls)

    def start(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for call in self.calls:  # (past the call's deadline, each call aborts at once)
            actions += self._after(call, call.start(now))
        return actions

    def on_response(self, key: tuple[int, int], data: bytes, now: float) -> list[Action]:
        call = self.calls[key[0]]
        return self._after(call, call.on_response(key[1], data, now))

    def on_error(self, key: tuple[int, int], code: str, message: str, now: float) -> list[Action]:
        call = self.calls[key[0]]
        return self._after(call, call.on_error(key[1], code, message, now))

    def on_timer(self, now: float, expire: bool = True) -> list[Action]:
        """Start the retries and backup requests that are due; at the deadline, end the round
        (unless `expire` is False: a driver that has answers still to read, e.g. right after
        feeding one, must read them before the deadline may abort calls they answer)."""
        actions: list[Action] = []
        if now >= self.deadline and expire:
            if self.call_deadline is not None and now >= self.call_deadline:
                reason = self.policy.deadline_reason()
                for call in self.calls:
                    aborted = call.abort(CALL_DEADLINE, reason, deadline=True, now=now)
                    actions += self._after(call, aborted)
                return actions
            for call in self.calls:
                aborted = call.abort("DEADLINE_EXCEEDED", "round deadline", now=now)
                actions += self._after(call, aborted)
            return actions
        for call in self.calls:
            wake = call.wakeup()
            if wake is not None and now >= wake:
                actions += self._after(call, call.on_timer(now))
        return actions

    def next_wakeup(self) -> float:
        times = [t for call in self.calls if (t := call.wakeup()) is not None]
        return min([self.deadline, *times])

    def outcomes(self) -> list[PieceOutcome]:
        return [call.outcome() for call in self.calls]

    def _after(self, call: ShardCall, actions: list[Action]) -> list[Action]:
        if not call.finished or call.index in self._closed:
            return actions
        self._closed.add(call.index)
        if call.rejected is not None and not self.rejected:
            self.rejected = True
            for other in self.calls:
                actions += other.abort("CANCELLED", "another shard rejected the request")
                self._closed.add(other.index)
        return actions
