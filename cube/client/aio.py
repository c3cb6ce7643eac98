"""AsyncCubeClient: the asyncio client, same API as CubeClient with `await`. Drives the pure
rounds (cube.client._policy) with grpc.aio: completions land in an asyncio.Queue[Any] and the
coroutine waits on it until the next timer. Use one client per event loop (grpc.aio channels
belong to the loop that first used them)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Generator, Sequence
from typing import Any

import grpc
import numpy as np

from cube.client._base import ClientBase
from cube.client._core import Piece, PieceOutcome, PieceRequest, SeekResult, embeddings
from cube.client._policy import Action, Cancel
from cube.client._transport import AioChannels, status_of
from cube.client.errors import ConfError, CubeError


class AsyncCubeClient(ClientBase):
    """asyncio client; see ClientBase for the arguments and `from_conf` for cube.conf."""

    def _open(self) -> None:
        if self._busy_poll_s:
            raise ConfError(
                "busy_poll_us is for CubeClient (a thread waiting on a socket); AsyncCubeClient"
                " waits in its event loop: leave it 0"
            )
        self._channels = AioChannels(
            self._wire.method,
            lanes=self._use_lanes,
            check_routing=self._check_routing,
            tls=self._tls,
        )
        self._closed = False

    async def seek(self, keys: object, version: str | None = None) -> SeekResult:
        """As CubeClient.seek."""
        if self._closed:
            raise CubeError("the client is closed")
        started = time.perf_counter()
        request_id = self._request_id()
        try:
            pieces, flow = self._flow(keys, version)
            requests = next(flow)
            while True:
                requests = flow.send(await self._run(pieces, requests, request_id))
        except StopIteration as done:
            self._observe_call(started)
            result: SeekResult = done.value
            return result
        except CubeError as exc:
            self._observe_call(started, exc)
            self._tag(exc, request_id)
            raise

    async def get_embeddings(self, keys: object, dim: int, dtype: Any = "float32") -> np.ndarray:
        """As CubeClient.get_embeddings."""
        return embeddings(await self.seek(keys), dim, dtype)

    async def wait_ready(self, timeout_s: float = 5.0) -> list[str]:
        if self._injected is not None:
            return []
        return await self._channels.wait_ready(self.endpoints, timeout_s)

    async def close(self) -> None:
        self._closed = True
        await self._channels.close()
        if self._injected is not None:
            self._injected.close()

    async def __aenter__(self) -> AsyncCubeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _run(
        self, pieces: Sequence[Piece], requests: Sequence[PieceRequest], request_id: int = 0
    ) -> list[PieceOutcome]:
        now = time.monotonic()
        round_ = self._round(pieces, requests, now, request_id)
        events: asyncio.Queue[Any] = asyncio.Queue()
        handles: dict[tuple[int, int], Any] = {}
        try:
            self._execute(round_.start(now), events, handles)
            while not round_.done:
                timeout = round_.next_wakeup() - time.monotonic()
                try:
                    if events.empty():
                        async with asyncio.timeout(max(timeout, 0.0)):
                            key, call = await events.get()
                    else:
                        key, call = events.get_nowait()
                except TimeoutError:
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
                self._execute(actions + round_.on_timer(time.monotonic()), events, handles)
        finally:
            for call in handles.values():
                call.cancel()
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
            try:
                if self._injected is not None:
                    call = asyncio.ensure_future(
                        self._injected.acall(action.address, action.request, action.timeout_s)
                    )
                else:
                    call = self._channels.start(action.address, action.request, action.timeout_s)
            except Exception as exc:
                call = _Failed(exc)
                events.put_nowait((action.key, call))
            else:
                call.add_done_callback(lambda c, key=action.key: events.put_nowait((key, c)))
            handles[action.key] = call


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
