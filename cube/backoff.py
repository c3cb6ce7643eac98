"""Capped exponential backoff: the one rule for waiting between tries (the SDK's retries, the
agent's download attempts, the transfer's catch-ups), and `retrying` / `retrying_async`, the
one loop that tries a call again (as redis-py's `Retry.call_with_retry`). Pure: the clock and
the sleep are passed in (asyncio's sleep by the async caller)."""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    """Delays `base`, 2 x base, 4 x base, ... up to `cap` (seconds). With `jitter` j, each is
    drawn from [(1 - j) x delay, delay], so that many clients do not retry in lockstep."""

    base: float
    cap: float
    jitter: float = 0.0

    def __post_init__(self) -> None:
        if self.base < 0 or self.cap < 0:
            raise ValueError(f"backoff delays must be >= 0, got base {self.base}, cap {self.cap}")
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError(f"backoff jitter must be in [0, 1], got {self.jitter}")

    def delay(self, retry: int, rng: random.Random | None = None) -> float:
        """Seconds before retry number `retry` (0 = the first retry). The exponent is bounded,
        so days of failures in a row never overflow."""
        ceiling = min(self.cap, self.base * 2.0 ** min(max(retry, 0), 60))
        if self.jitter and rng is not None:
            return ceiling * rng.uniform(1.0 - self.jitter, 1.0)
        return ceiling


def _pause(
    error: Exception,
    number: int,
    backoff: Backoff,
    attempts: int,
    retryable: Callable[[Exception], bool],
    deadline: float | None,
    clock: Callable[[], float],
) -> float | None:
    """Seconds to wait before the attempt after failed attempt `number` (1-based), or None
    when `error` ends the tries: not retryable, the last attempt, or the deadline passed."""
    if not retryable(error) or number >= attempts:
        return None
    pause = backoff.delay(number - 1)
    if deadline is None:
        return pause
    left = deadline - clock()
    return None if left <= 0 else min(pause, left)


def retrying(
    attempt: Callable[[int], T],
    backoff: Backoff,
    attempts: int,
    retryable: Callable[[Exception], bool],
    *,
    deadline: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], object] = time.sleep,
) -> T:
    """`attempt(1)`, `attempt(2)`, ... (at least one, at most `attempts`) until one returns,
    waiting `backoff` between them: the value returned. An error that is not `retryable`, the
    last attempt's, or one after `deadline` (on `clock`) is raised as it is."""
    number = 1
    while True:
        try:
            return attempt(number)
        except Exception as error:
            pause = _pause(error, number, backoff, attempts, retryable, deadline, clock)
            if pause is None:
                raise
        sleep(pause)
        number += 1


async def retrying_async(
    attempt: Callable[[int], Awaitable[T]],
    backoff: Backoff,
    attempts: int,
    retryable: Callable[[Exception], bool],
    *,
    sleep: Callable[[float], Awaitable[object]],
    deadline: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """`retrying` for coroutines: `sleep` is the event loop's (asyncio.sleep)."""
    number = 1
    while True:
        try:
            return await attempt(number)
        except Exception as error:
            pause = _pause(error, number, backoff, attempts, retryable, deadline, clock)
            if pause is None:
                raise
        await sleep(pause)
        number += 1
