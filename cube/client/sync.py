"""CubeClient: the blocking client. Drives the pure rounds (cube.client.policy) with gRPC's
sync API: every attempt is a grpc future whose completion lands in a queue, and the calling
thread waits on that queue until the next timer (backup request, retry backoff, deadline).
Safe to share between threads (each call has its own queue and round)."""

from __future__ import annotations

import queue
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from cube.client.base import ClientBase
from cube.client.core import Piece, PieceOutcome, PieceRequest, SeekResult, embeddings
from cube.client.policy import Action, Cancel
from cube.client.transport import SyncChannels, status_of


class CubeClient(ClientBase):
    """Blocking client; see ClientBase for the arguments and `from_conf` for cube.conf."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._channels = SyncChannels(self._wire.method)

    def seek(self, keys: object, version: str | None = None) -> SeekResult:
        """Look up `keys` (ints or an integer array); one version for the whole batch.

        `version` asks for exactly that version (servers hold the current and the previous
        one). Raises ShardUnavailableError (with the partial result), RequestRejectedError,
        VersionMismatchError or KeyRangeError."""
        pieces, flow = self._flow(keys, version)
        try:
            requests = next(flow)
            while True:
                requests = flow.send(self._run(pieces, requests))
        except StopIteration as done:
            return done.value

    def get_embeddings(self, keys: object, dim: int, dtype: Any = "float32") -> np.ndarray:
        """(n, dim) array of `dtype`, zero rows for misses; ValueSizeError names a key whose
        value is not dim * itemsize bytes."""
        return embeddings(self.seek(keys), dim, dtype)

    def wait_ready(self, timeout_s: float = 5.0) -> list[str]:
        """Connect to every endpoint; return the ones not ready within `timeout_s`."""
        return self._channels.wait_ready(self.endpoints, timeout_s)

    def close(self) -> None:
        self._channels.close()

    def __enter__(self) -> CubeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, pieces: Sequence[Piece], requests: Sequence[PieceRequest]) -> list[PieceOutcome]:
        now = time.monotonic()
        round_ = self._round(pieces, requests, now)
        events: queue.SimpleQueue = queue.SimpleQueue()
        handles: dict[tuple[int, int], Any] = {}
        try:
            self._execute(round_.start(now), events, handles)
            while not round_.done:
                timeout = round_.next_wakeup() - time.monotonic()
                try:
                    key, future = (
                        events.get(timeout=timeout) if timeout > 0 else events.get_nowait()
                    )
                except queue.Empty:
                    self._execute(round_.on_timer(time.monotonic()), events, handles)
                    continue
                if handles.pop(key, None) is None or future.cancelled():
                    continue
                now = time.monotonic()
                error = future.exception()
                if error is None:
                    actions = round_.on_response(key, future.result(), now)
                else:
                    actions = round_.on_error(key, *status_of(error), now)
                self._execute(actions + round_.on_timer(now), events, handles)
        finally:
            for future in handles.values():
                future.cancel()
        return round_.outcomes()

    def _execute(
        self, actions: list[Action], events: queue.SimpleQueue, handles: dict[tuple[int, int], Any]
    ) -> None:
        for action in actions:
            if isinstance(action, Cancel):
                future = handles.pop(action.key, None)
                if future is not None:
                    future.cancel()
                continue
            try:
                future = self._channels.start(action.address, action.request, action.timeout_s)
            except Exception as exc:  # a bad address or a closed client: report as an error
                handles[action.key] = failed = _Failed(exc)
                events.put((action.key, failed))
                continue
            handles[action.key] = future
            future.add_done_callback(lambda f, key=action.key: events.put((key, f)))


class _Failed:
    """A call that could not even start, shaped like a finished grpc future."""

    def __init__(self, error: BaseException) -> None:
        self._error = error

    def cancelled(self) -> bool:
        return False

    def exception(self) -> BaseException:
        return self._error

    def cancel(self) -> bool:
        return False
