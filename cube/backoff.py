"""Capped exponential backoff: the one rule for waiting between tries (the SDK's retries, the
agent's download attempts, the transfer's catch-ups). Pure."""

from __future__ import annotations

import random
from dataclasses import dataclass


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
