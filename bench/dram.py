"""The DRAM floor under a lookup (issue 37 item 1): what one cache miss costs on this machine.

    python -m cube.bench.dram --gib 8 --seconds 2

A lookup at 100M keys misses the caches on its index line and on its value (and on the
per-bucket rows at that size), so the server's CPU per 1000-key request cannot fall below
what those misses cost. Two compiled loops over a buffer much larger than the caches:

- `chase`: a pointer chase (each load's address comes from the previous load): the latency of
  one miss, with nothing to overlap it;
- `gather`: independent loads at random addresses (the addresses known ahead, as a batch of
  keys is): the cost of a miss when the core overlaps as many as it can, the floor a
  vectorized or prefetching lookup can reach.

Prints ns per miss for both, and the floor of a 1000-key request at 3 misses a key. Pages of
the buffer are 4 KiB unless the kernel gives it transparent huge pages (`--huge`, madvise),
as the server's mappings get with `--huge_pages`.
"""

from __future__ import annotations

import argparse
import json
import mmap
import time

import numba
import numpy as np

MISSES_PER_KEY = 3  # the index's bucket line, its row of bucket_rows, the value


@numba.njit(cache=False, nogil=True)
def _chase(ring: np.ndarray, steps: int) -> int:
    at = 0
    for _ in range(steps):
        at = ring[at]
    return at


@numba.njit(cache=False, nogil=True)
def _gather(words: np.ndarray, at: np.ndarray) -> int:
    total = 0
    for i in range(at.shape[0]):
        total += words[at[i]]
    return total


def _buffer(words: int, huge: bool) -> np.ndarray:
    region = mmap.mmap(-1, words * 8, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge:
        region.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(region, dtype=np.int64)


def _timed(function: object, *args: object, seconds: float, count: int) -> float:
    """ns per item of the fastest of the runs done in `seconds` (at least 3)."""
    best = float("inf")
    deadline = time.perf_counter() + seconds
    runs = 0
    while runs < 3 or time.perf_counter() < deadline:
        started = time.perf_counter()
        function(*args)  # type: ignore[operator]
        best = min(best, time.perf_counter() - started)
        runs += 1
    return best / count * 1e9


def measure(gib: float, seconds: float, huge: bool, line_words: int = 8) -> dict[str, float]:
    """ns per dependent miss and per independent miss over `gib` GiB."""
    words = int(gib * (1 << 30)) // 8
    ring = _buffer(words, huge)
    lines = words // line_words
    rng = np.random.default_rng(1)
    order = rng.permutation(lines) * line_words  # one word a cache line, in a random cycle
    ring[order] = np.roll(order, -1)  # every line visited once before the cycle closes
    steps = min(lines, 4_000_000)
    _chase(ring, 10)
    chase_ns = _timed(_chase, ring, steps, seconds=seconds, count=steps)
    at = rng.integers(0, lines, 4_000_000) * line_words
    _gather(ring, at[:10])
    gather_ns = _timed(_gather, ring, at, seconds=seconds, count=at.shape[0])
    return {
        "gib": gib,
        "huge_pages": huge,
        "chase_ns": round(chase_ns, 1),
        "gather_ns": round(gather_ns, 2),
        "floor_us_per_1000_keys": round(gather_ns * MISSES_PER_KEY * 1000 / 1000, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=8.0, help="buffer size (>> the caches)")
    parser.add_argument("--seconds", type=float, default=2.0, help="per loop, fastest kept")
    parser.add_argument("--huge", action="store_true", help="ask for transparent huge pages")
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.gib, args.seconds, args.huge)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
