"""Measuring what code under test allocates (for the bounded-memory tests)."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable


def peak_bytes(action: Callable[[], object]) -> int:
    """Peak traced allocation while `action` runs (numpy and bytes buffers are traced)."""
    tracemalloc.start()
    try:
        action()
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return peak
