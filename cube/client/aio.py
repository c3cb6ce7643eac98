"""AsyncCubeClient: the asyncio client, same API as CubeClient with `await`. Drives the pure
rounds (cube.client._policy) with grpc.aio: completions land in an asyncio.Queue[Any] and the
coroutine waits on it until the next timer. A batch of one sub-request on a TCP lane awaits
its first attempt's future directly instead (ClientBase's fast path; the lane times it out)
and hands it to the rounds unless it simply answers. Use one client per event loop (grpc.aio
channels belong to the loop that first used them)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Generator, Sequence
from typing import Any, TypeVar, overload

import grpc
import numpy as np
import numpy.typing as npt
from numpy.typing import DTypeLike, NDArray

import cube.client._compiled as _compiled
from cube.client._aio_transport import AioChannels
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
from cube.client._policy import Action, Cancel
from cube.client._transport import AsyncTransport, status_of
from cube.client.errors import ConfError, CubeError, RequestRejectedError

# The fast path's first attempt handed over: (replica index, monotonic start, its call in
# flight or done, or None when it is still to start).
_Adopted = tuple[int, float, Any]
_S = TypeVar("_S", bound=np.generic)


class AsyncCubeClient(ClientBase[AsyncTransport]):
    """asyncio client; see ClientBase for the arguments and `from_conf` for cube.conf."""

    def _open(self) -> None:
        if self._injected is not None and not isinstance(self._injected, AsyncTransport):
            raise ConfError(
                f"transport {type(self._injected).__name__} has no acall() and close():"
                " AsyncCubeClient needs an AsyncTransport"
            )
        if self._busy_poll_s:
            raise ConfError(
                "busy_poll_us is for CubeClient (a thread waiting on a socket); AsyncCubeClient"
                " waits in its event loop: leave it 0"
            )
        self._channels = AioChannels(
            self._wire.method,
            lanes=self._use_lanes,
            on_contact=self._on_contact,
            tls=self._tls,
        )

    async def seek(
        self, keys: npt.ArrayLike, version: str | None = None, *, table: str = ""
    ) -> SeekResult:
        """As CubeClient.seek."""
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
                        result = await self._seek_lone(keys, pieces, version, request_id, deadline)
                    else:
                        result = await self._seek_rounds(
                            keys, pieces, version, request_id, deadline
                        )
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

    async def seek_tables(self, tables: TablesArg, version: str | None = None) -> list[SeekResult]:
        """As CubeClient.seek_tables."""
        with self._observed() as (request_id, deadline):
            plan = self._table_plan(tables)
            replans = 0
            while True:
                try:
                    flow = self._flow_to(plan.every, plan.pieces, version, plan.finish)
                    return await self._rounds(flow, plan.pieces, request_id, deadline)
                except RequestRejectedError as exc:  # too large for servers met just now?
                    if replans == MAX_REPLANS or not self._smaller_limit(exc, plan.limits):
                        raise
                    replans += 1
                    plan = self._table_plan(plan.tables)

    async def _seek_rounds(
        self,
        keys: np.ndarray,
        pieces: list[Piece],
        version: str | None,
        request_id: int,
        deadline: float | None = None,
        adopted: _Adopted | None = None,
    ) -> SeekResult:
        """The state machine's way: rounds of sub-requests until the flow has its result
        (`adopted`: the fast path's first attempt, which the first round takes over)."""
        flow = self._flow(keys, pieces, version)
        return await self._rounds(flow, pieces, request_id, deadline, adopted)

    async def _rounds(
        self,
        flow: Flow[R],
        pieces: list[Piece],
        request_id: int,
        deadline: float | None = None,
        adopted: _Adopted | None = None,
    ) -> R:
        """Run `flow`'s rounds of sub-requests until it returns its result."""
        try:
            requests = next(flow)
            outcomes = await self._run(pieces, requests, request_id, deadline, adopted)
            while True:
                requests = flow.send(outcomes)
                outcomes = await self._run(pieces, requests, request_id, deadline)
        except StopIteration as done:
            result: R = done.value
            return result

    async def _seek_lone(
        self,
        keys: np.ndarray,
        pieces: list[Piece],
        version: str | None,
        request_id: int,
        deadline: float | None,
    ) -> SeekResult:
        """One sub-request without backup requests (ClientBase's fast path): on a lane, its
        first attempt is awaited here (the lane times it out); the state machine takes over
        unless it simply answers, and runs attempts that are not on a lane."""
        piece = pieces[0]
        replica, choice, request, started = self._first_attempt(piece, version, request_id)
        lane = self._channels.lane(replica.address) if self._injected is None else None
        if lane is None:  # first contact, gRPC or an injected transport: not this way
            return await self._seek_rounds(
                keys, pieces, version, request_id, deadline, (choice, started, None)
            )
        future = lane.send(request, self._first_timeout(started, deadline))
        try:
            data = await future
        except asyncio.CancelledError:
            replica.end()  # as the state machine does for a call cancelled (its in-flight count)
            raise
        except Exception:  # TransportError: the state machine reads it from the future
            pass
        else:
            if (answer := self._accept(data, piece, version)) is not None:
                latency_s = time.monotonic() - started
                return self._lone_result(keys, pieces, answer, replica, latency_s)
        adopted = (choice, started, future)
        return await self._seek_rounds(keys, pieces, version, request_id, deadline, adopted)

    @overload
    async def get_embeddings(
        self, keys: npt.ArrayLike, dim: int | None = None, *, table: str = ""
    ) -> NDArray[np.float32]: ...

    @overload
    async def get_embeddings(
        self,
        keys: npt.ArrayLike,
        dim: int | None,
        dtype: type[_S] | np.dtype[_S],
        *,
        table: str = "",
    ) -> NDArray[_S]: ...

    @overload
    async def get_embeddings(
        self,
        keys: npt.ArrayLike,
        dim: int | None = None,
        *,
        dtype: type[_S] | np.dtype[_S],
        table: str = "",
    ) -> NDArray[_S]: ...

    @overload
    async def get_embeddings(
        self,
        keys: npt.ArrayLike,
        dim: int | None = None,
        dtype: DTypeLike = "float32",
        *,
        table: str = "",
    ) -> NDArray[Any]: ...

    async def get_embeddings(
        self,
        keys: npt.ArrayLike,
        dim: int | None = None,
        dtype: DTypeLike = "float32",
        *,
        table: str = "",
    ) -> NDArray[Any]:
        """As CubeClient.get_embeddings."""
        dim = self._embedding_dim(dim)
        return embeddings(await self.seek(keys, table=table), dim, dtype, own=True)

    async def wait_ready(self, timeout_s: float = 5.0) -> list[str]:
        """As CubeClient.wait_ready (the compiled codec loads in a thread; the GIL it holds
        stalls this event loop too, which is why it happens here, before serving)."""
        self._check_open()
        if _compiled.pending():
            await asyncio.to_thread(_compiled.load)
        if self._injected is not None:
            return []
        return await self._channels.wait_ready(self.endpoints, timeout_s)

    async def aclose(self) -> None:
        """Close the connections (calls in flight end with an error; calls after it raise
        ClientClosedError). Closing again does nothing."""
        if self._closed:
            return
        self._closed = True
        await self._channels.close()
        if self._injected is not None:
            self._injected.close()

    async def close(self) -> None:
        """The same as `aclose()` (the name it had first)."""
        await self.aclose()

    async def __aenter__(self) -> AsyncCubeClient:
        self._check_open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _run(
        self,
        pieces: Sequence[Piece],
        requests: Sequence[PieceRequest],
        request_id: int = 0,
        deadline: float | None = None,
        adopted: _Adopted | None = None,
    ) -> list[PieceOutcome]:
        events: asyncio.Queue[Any] = asyncio.Queue()
        handles: dict[tuple[int, int], Any] = {}
        if adopted is None:
            now = time.monotonic()
            round_ = self._round(pieces, requests, now, request_id, deadline)
            actions = round_.start(now)
        else:  # the fast path's first attempt: in flight (a lane's future), or to start
            choice, now, call = adopted
            round_ = self._adopted_round(pieces, requests, request_id, choice, now, deadline)
            actions = []
            first = round_.calls[0]
            if call is None:
                address = first.group.replicas[choice].address
                timeout_s = self._first_timeout(now, deadline)
                self._start((0, 0), address, first.request, timeout_s, events, handles)
            else:
                self._track((0, 0), call, events, handles)
        try:
            self._execute(actions, events, handles)
            while not round_.done:
                timeout = round_.next_wakeup() - time.monotonic()
                try:
                    if events.empty():
                        async with asyncio.timeout(max(timeout, 0.0)):
                            key, call = await events.get()
                    else:
                        key, call = events.get_nowait()
                except TimeoutError:
                    if not events.empty():  # an answer came with the timer: read it first
                        continue
                    self._execute(round_.on_timer(time.monotonic()), events, handles)
                    continue
                if handles.pop(key, None) is None or call.cancelled():
                    continue
                try:
                    data = await call
                except grpc.aio.AioRpcError as error:
                    actions = round_.on_error(key, *status_of(error), time.monotonic())
                except Exception as error:  # a call that could not start
                    actions = round_.on_error(key, *status_of(error), time.monotonic())
                else:
                    actions = round_.on_response(key, data, time.monotonic())
                timers = round_.on_timer(time.monotonic(), expire=False)  # answers queued first
                self._execute(actions + timers, events, handles)
        finally:
            for call in handles.values():
                call.cancel()
            if not round_.done:  # cancelled: release the replicas' in-flight counts
                for shard_call in round_.calls:
                    shard_call.abort("CANCELLED", "the call was cancelled")
        return self._observe_round(pieces, requests, round_.outcomes())

    def _execute(
        self, actions: list[Action], events: asyncio.Queue[Any], handles: dict[tuple[int, int], Any]
    ) -> None:
        for action in actions:
            if isinstance(action, Cancel):
                call = handles.pop(action.key, None)
                if call is not None:
                    call.cancel()
                continue
            key, address, request = action.key, action.address, action.request
            self._start(key, address, request, action.timeout_s, events, handles)

    def _start(
        self,
        key: tuple[int, int],
        address: str,
        request: bytes,
        timeout_s: float,
        events: asyncio.Queue[Any],
        handles: dict[tuple[int, int], Any],
    ) -> None:
        """Start an attempt; its completion lands in `events`."""
        try:
            if self._injected is not None:
                call = asyncio.ensure_future(self._injected.acall(address, request, timeout_s))
            else:
                call = self._channels.start(address, request, timeout_s)
        except Exception as exc:
            handles[key] = _Failed(exc)
            events.put_nowait((key, handles[key]))
        else:
            self._track(key, call, events, handles)

    @staticmethod
    def _track(
        key: tuple[int, int],
        call: Any,
        events: asyncio.Queue[Any],
        handles: dict[tuple[int, int], Any],
    ) -> None:
        call.add_done_callback(lambda c: events.put_nowait((key, c)))
        handles[key] = call


class _Failed:
    """A call that could not even start, awaitable like a failed grpc.aio call."""

    def __init__(self, error: BaseException) -> None:
        self._error = error

    def cancelled(self) -> bool:
        return False

    def cancel(self) -> bool:
        return False

    def __await__(self) -> Generator[Any, None, Any]:
        raise self._error
        yield  # pragma: no cover - makes this a generator
