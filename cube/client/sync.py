"""CubeClient: the blocking client. Drives the pure rounds (cube.client._policy) with gRPC's
blocking API.

How attempts run (chosen by measurement, bench/micro/test_bench_sdk.py): gRPC's sync `future()`
starts a polling thread per call, and a private asyncio loop thread adds two thread hops, so
a round with a single sub-request and no backup requests runs its attempt inline in the
calling thread (no thread hop at all). Otherwise attempts run on the client's thread pool,
the last one of a batch inline when backup requests are off; completions land in a per-call
queue that the calling thread waits on until the next timer (backup request, retry backoff,
deadline).
An attempt on a pool thread is cancelled when it loses (a backup request answered first) or is
abandoned: on a TCP lane its socket is shut down (also while it connects) and the thread is
free at once; a blocking gRPC call cannot be cancelled, so it is left to finish (at most
`timeout_ms`) and its answer is dropped. Safe to share between threads (each call has its own
queue and round).
`close()` is bounded: it cancels every attempt the pool runs and closes the channels (which
ends their gRPC calls), and the pool's threads are daemons, so a process exits at once even
with an attempt hung on a dead link (a ThreadPoolExecutor's threads are joined at exit).
With a whole-call timeout (Timeouts.total) every attempt's timeout is cut to the call's
deadline and the waits end at it, so seek() returns (or raises DeadlineExceededError) by then.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar, overload

import numpy as np
import numpy.typing as npt
from numpy.typing import DTypeLike, NDArray

import cube.client._compiled as _compiled
from cube.client._base import MAX_REPLANS, ClientBase, TablesArg
from cube.client._core import (
    Flow,
    Piece,
    PieceOutcome,
    PieceRequest,
    R,
    SeekResult,
    embeddings,
    normalize_keys,
)
from cube.client._policy import Action, Round, Send
from cube.client._sync_transport import CallHandle, SyncChannels
from cube.client._transport import SyncTransport, status_of
from cube.client.errors import ConfError, CubeError, RequestRejectedError

_Key = tuple[int, int]
_Outcome = tuple[bool, Any]  # (True, answer bytes) or (False, (status name, message))
_CLOSED: _Outcome = (False, ("CANCELLED", "the client is closed"))
_Job = tuple[Callable[[CallHandle], _Outcome], CallHandle, Callable[[_Outcome], None]]
_S = TypeVar("_S", bound=np.generic)


class AttemptPool:
    """Threads that run attempts off the calling thread (backup requests, several shards):
    daemon threads, started when no idle one is left (up to `limit`) and kept, taking jobs
    from one queue. `close()` cancels the attempts running and ends the threads; a job
    submitted after it is answered CANCELLED at once. Daemons, unlike a ThreadPoolExecutor's,
    so that an interpreter exits without waiting for attempts hung on a dead link."""

    _names = itertools.count()

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._running: set[CallHandle] = set()
        self._threads = 0
        self._idle = 0
        self._queued = 0
        self._closed = False

    def submit(
        self,
        attempt: Callable[[CallHandle], _Outcome],
        handle: CallHandle,
        report: Callable[[_Outcome], None],
    ) -> None:
        """Run `attempt(handle)` on a pool thread, then `report` its outcome."""
        with self._lock:
            closed = self._closed
            if not closed:
                self._queued += 1
                start = self._queued > self._idle and self._threads < self._limit
                self._threads += start
                self._jobs.put((attempt, handle, report))  # (under the lock: before close())
        if closed:
            report(_CLOSED)
            return
        if start:
            name = f"cube-client-{next(self._names)}"
            threading.Thread(target=self._work, name=name, daemon=True).start()

    def _work(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            job = self._jobs.get()  # (an idle daemon thread waits here until close())
            with self._lock:
                self._idle -= 1
                if job is None:
                    self._threads -= 1
                    return
                self._queued -= 1
                attempt, handle, report = job
                self._running.add(handle)
                if self._closed:
                    handle.cancel()
            try:
                outcome = attempt(handle)
            finally:
                with self._lock:
                    self._running.discard(handle)
            report(outcome)

    @property
    def busy(self) -> int:
        """Attempts running or waiting for a thread."""
        with self._lock:
            return len(self._running) + self._queued

    def close(self) -> None:
        """Cancel what runs, answer what waits CANCELLED, end the threads; returns at once."""
        with self._lock:
            self._closed = True
            running = list(self._running)
            threads = self._threads
        for handle in running:
            handle.cancel()
        while True:  # jobs not started yet: answered, never run
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                with self._lock:
                    self._queued -= 1
                job[2](_CLOSED)
        for _ in range(threads):
            self._jobs.put(None)


def _report(events: queue.SimpleQueue[Any], key: _Key, outcome: _Outcome) -> None:
    events.put((key, *outcome))


class CubeClient(ClientBase[SyncTransport]):
    """Blocking client; see ClientBase for the arguments and `from_conf` for cube.conf."""

    def _open(self) -> None:
        if self._injected is not None and not isinstance(self._injected, SyncTransport):
            raise ConfError(
                f"transport {type(self._injected).__name__} has no call() and close(): CubeClient"
                " needs a SyncTransport"
            )
        self._channels = SyncChannels(
            self._wire.method,
            lanes=self._use_lanes,
            busy_poll_s=self._busy_poll_s,
            on_contact=self._on_contact,
            tls=self._tls,
        )
        # Threads start only when needed; many allowed because an abandoned gRPC attempt (a
        # backup request's loser) holds its thread until its timeout.
        self._pool = AttemptPool(max(32, 8 * len(self._cluster.endpoints)))

    def seek(
        self, keys: npt.ArrayLike, version: str | None = None, *, table: str = ""
    ) -> SeekResult:
        """Look up `keys` (a 1-D sequence or array of integers, in request order); one version
        for the whole batch.

        `version` asks for exactly that version (servers hold the current and the previous
        one). `table` names the table of a version that holds several (a model's sparse
        tables; "" for a version of one). Raises ShardUnavailableError (with the partial
        result), RequestRejectedError (NOT_FOUND for a table the version lacks,
        INVALID_ARGUMENT for none named where several are served), VersionMismatchError,
        KeyRangeError (a key that is not a uint64, bools included), KeyShapeError (a 2-D
        array, a set) or ClientClosedError."""
        self._check_open()
        started = time.perf_counter()
        request_id = self._request_id()
        deadline = self._deadline()
        try:
            if table:
                self._check_tables_protocol()
            keys = normalize_keys(keys)
            pieces, limits = self._plan(keys, table)
            for replans in range(MAX_REPLANS + 1):
                try:
                    if len(pieces) == 1 and self._lone_fast:
                        result = self._seek_lone(keys, pieces, version, request_id, deadline)
                    else:
                        result = self._seek_rounds(keys, pieces, version, request_id, deadline)
                    break
                except RequestRejectedError as exc:  # too large for servers met just now?
                    replan = replans < MAX_REPLANS
                    plan = self._replan(exc, keys, limits, table) if replan else None
                    if plan is None:
                        raise
                    pieces, limits = plan
        except CubeError as exc:
            self._observe_call(started, exc)
            self._tag(exc, request_id)
            raise
        if self.stats is not None:
            self._observe_call(started)
        return result

    def seek_tables(self, tables: TablesArg, version: str | None = None) -> list[SeekResult]:
        """Look up keys in several tables of one version in one call: `tables` is (table,
        keys) pairs, or a mapping of table to keys; returns one SeekResult per pair, in order
        (each as `seek(keys, table=table)` would), every one from the same version, across
        every shard. Raises as `seek`; the partial result of a ShardUnavailableError holds
        every pair's keys back to back."""
        with self._observed() as (request_id, deadline):
            plan = self._table_plan(tables)
            replans = 0
            while True:
                try:
                    flow = self._flow_to(plan.every, plan.pieces, version, plan.finish)
                    return self._rounds(flow, plan.pieces, request_id, deadline)
                except RequestRejectedError as exc:  # too large for servers met just now?
                    if replans == MAX_REPLANS or not self._smaller_limit(exc, plan.limits):
                        raise
                    replans += 1
                    plan = self._table_plan(plan.tables)

    def _seek_rounds(
        self,
        keys: np.ndarray,
        pieces: list[Piece],
        version: str | None,
        request_id: int,
        deadline: float | None = None,
        first_round: Callable[[list[PieceRequest]], list[PieceOutcome]] | None = None,
    ) -> SeekResult:
        """The state machine's way: rounds of sub-requests until the flow has its result
        (`first_round` runs the first one when the fast path already started it)."""
        flow = self._flow(keys, pieces, version)
        return self._rounds(flow, pieces, request_id, deadline, first_round)

    def _rounds(
        self,
        flow: Flow[R],
        pieces: list[Piece],
        request_id: int,
        deadline: float | None = None,
        first_round: Callable[[list[PieceRequest]], list[PieceOutcome]] | None = None,
    ) -> R:
        """Run `flow`'s rounds of sub-requests until it returns its result."""
        try:
            requests = next(flow)
            if first_round is not None:
                outcomes = first_round(requests)
            else:
                outcomes = self._run(pieces, requests, request_id, deadline)
            while True:
                requests = flow.send(outcomes)
                outcomes = self._run(pieces, requests, request_id, deadline)
        except StopIteration as done:
            result: R = done.value
            return result

    def _seek_lone(
        self,
        keys: np.ndarray,
        pieces: list[Piece],
        version: str | None,
        request_id: int,
        deadline: float | None,
    ) -> SeekResult:
        """One sub-request without backup requests (ClientBase's fast path): its first
        attempt runs inline; the state machine takes over unless it simply answers."""
        piece = pieces[0]
        replica, choice, request, started = self._first_attempt(piece, version, request_id)
        timeout_s = self._first_timeout(started, deadline)
        ok, payload = self._attempt(replica.address, request, timeout_s)
        if ok and (answer := self._accept(payload, piece, version)) is not None:
            return self._lone_result(keys, pieces, answer, replica, time.monotonic() - started)

        def take_over(requests: list[PieceRequest]) -> list[PieceOutcome]:
            round_ = self._adopted_round(pieces, requests, request_id, choice, started, deadline)
            pending: dict[_Key, CallHandle | None] = {}
            actions = self._feed(round_, pending, (0, 0), ok, payload)
            return self._drive(pieces, requests, round_, pending, actions)

        return self._seek_rounds(keys, pieces, version, request_id, deadline, take_over)

    @overload
    def get_embeddings(
        self, keys: npt.ArrayLike, dim: int | None = None, *, table: str = ""
    ) -> NDArray[np.float32]: ...

    @overload
    def get_embeddings(
        self,
        keys: npt.ArrayLike,
        dim: int | None,
        dtype: type[_S] | np.dtype[_S],
        *,
        table: str = "",
    ) -> NDArray[_S]: ...

    @overload
    def get_embeddings(
        self,
        keys: npt.ArrayLike,
        dim: int | None = None,
        *,
        dtype: type[_S] | np.dtype[_S],
        table: str = "",
    ) -> NDArray[_S]: ...

    @overload
    def get_embeddings(
        self,
        keys: npt.ArrayLike,
        dim: int | None = None,
        dtype: DTypeLike = "float32",
        *,
        table: str = "",
    ) -> NDArray[Any]: ...

    def get_embeddings(
        self,
        keys: npt.ArrayLike,
        dim: int | None = None,
        dtype: DTypeLike = "float32",
        *,
        table: str = "",
    ) -> NDArray[Any]:
        """(n, dim) array of `dtype`, zero rows for misses; ValueSizeError names a key whose
        value is not dim * itemsize bytes. `dim` defaults to the client's (cube.conf's);
        `table` as for `seek`."""
        dim = self._embedding_dim(dim)
        return embeddings(self.seek(keys, table=table), dim, dtype, own=True)

    def wait_ready(self, timeout_s: float = 5.0) -> list[str]:
        """Make first contact with every endpoint (connection, routing check, TCP lane);
        return the ones not ready within `timeout_s`: unreachable, refusing (a replica that
        cannot serve at its normal latency yet says so), or of another routing. Where numba
        is installed it also loads the compiled codec (cube.client._compiled), once per
        process: here, before the program serves, never in the middle of its calls."""
        self._check_open()
        _compiled.load()
        if self._injected is not None:
            return []
        return self._channels.wait_ready(self.endpoints, timeout_s)

    def close(self) -> None:
        """Close the connections and cancel the attempts in flight; returns at once (module
        docstring). Calls still running in other threads end with an error; calls after it
        raise ClientClosedError. Closing again does nothing."""
        if self._closed:
            return
        self._closed = True
        self._pool.close()
        self._channels.close()
        if self._injected is not None:
            self._injected.close()

    def __enter__(self) -> CubeClient:
        self._check_open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(
        self,
        pieces: Sequence[Piece],
        requests: Sequence[PieceRequest],
        request_id: int = 0,
        deadline: float | None = None,
    ) -> list[PieceOutcome]:
        round_ = self._round(pieces, requests, time.monotonic(), request_id, deadline)
        return self._drive(pieces, requests, round_, {}, round_.start(time.monotonic()))

    def _drive(
        self,
        pieces: Sequence[Piece],
        requests: Sequence[PieceRequest],
        round_: Round,
        pending: dict[_Key, CallHandle | None],  # attempts running (None: inline)
        actions: list[Action],
    ) -> list[PieceOutcome]:
        """Carry out the round's actions and feed it answers and timers until it is done."""
        events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        while True:
            inline = self._execute(actions, events, pending)
            actions = self._feed(round_, pending, *inline) if inline else []
            if actions:
                continue
            if round_.done:
                for handle in pending.values():  # attempts nobody waits for any more
                    if handle is not None:
                        handle.cancel()
                return self._observe_round(pieces, requests, round_.outcomes())
            timeout = round_.next_wakeup() - time.monotonic()
            try:
                event = events.get(timeout=timeout) if timeout > 0 else events.get_nowait()
            except queue.Empty:
                actions = round_.on_timer(time.monotonic())
                continue
            if event[0] in pending:
                actions = self._feed(round_, pending, *event)

    def _feed(
        self,
        round_: Round,
        pending: dict[_Key, CallHandle | None],
        key: _Key,
        ok: bool,
        payload: Any,
    ) -> list[Action]:
        pending.pop(key, None)
        now = time.monotonic()
        if ok:
            actions = round_.on_response(key, payload, now)
        else:
            actions = round_.on_error(key, payload[0], payload[1], now)
        return actions + round_.on_timer(now, expire=False)  # answers queued are read first

    def _execute(
        self,
        actions: list[Action],
        events: queue.SimpleQueue[Any],
        pending: dict[_Key, CallHandle | None],
    ) -> tuple[_Key, bool, Any] | None:
        """Start the Sends (the last one inline unless backup requests are on), cancel the
        Cancels. Returns the inline attempt's (key, ok, payload), if any."""
        sends = [a for a in actions if isinstance(a, Send)]
        for action in actions:
            if not isinstance(action, Send):
                handle = pending.pop(action.key, None)  # a late answer will be dropped
                if handle is not None:
                    handle.cancel()
        if not sends:
            return None
        inline = sends.pop() if self.policy.backup_request_ms <= 0 else None
        for send in sends:
            handle = pending[send.key] = CallHandle()
            attempt = partial(self._attempt, send.address, send.request, send.timeout_s)
            self._pool.submit(attempt, handle, partial(_report, events, send.key))
        if inline is None:
            return None
        pending[inline.key] = None
        return (inline.key, *self._attempt(inline.address, inline.request, inline.timeout_s))

    def _attempt(
        self, address: str, request: bytes, timeout_s: float, handle: CallHandle | None = None
    ) -> _Outcome:
        """One attempt through the transport (the built-in one, or the injected one)."""
        if self._closed:
            return _CLOSED
        try:
            if self._injected is not None:
                return True, self._injected.call(address, request, timeout_s)
            return True, self._channels.call(address, request, timeout_s, handle)
        except Exception as exc:  # TransportError, or an injected transport's bug
            return False, status_of(exc)
