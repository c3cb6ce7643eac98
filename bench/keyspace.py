"""Data sets that are never held in memory, and the key distributions benchmarks draw from.

A derived data set of N keys (per table) is a function, not an array: key number i of table t
is `fmix64(i ^ salt_t)` (a bijection on uint64: the keys are distinct and look random) and its
value is the key's 8 little-endian bytes repeated to the value width. Any answer can be checked
from the key alone (`values_of`), inputs are written in chunks (`chunks`), and a 300M-key table
costs the benchmark nothing but the keys it draws. Table 0's keys are the ones bench.scale
writes (it uses these functions).

Distributions (`parse_distribution`) say which key numbers a request asks for:
- `uniform`: every key equally likely.
- `zipf:THETA` (0 < THETA < 1; YCSB-C uses 0.99): YCSB's scrambled zipfian. A rank is drawn
  from Zipf(THETA) over the N keys (Gray et al.'s closed-form generator, YCSB's
  ZipfianGenerator: O(1) a draw, vectorized here), then scattered by hashing (fmix64 of the rank
  modulo N, as YCSB's ScrambledZipfianGenerator uses FNV), so the hot keys are spread over the
  key numbers, hence over shards, index slots and value pages, instead of being the first N.

Draws are made before the clock: `draw_pool` returns whole batches of keys up front.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from cube.hashing import fmix64

SALT = np.uint64(0x5CA1AB1E5CA1AB1E)
_TABLE_STEP = np.uint64(0x9E3779B97F4A7C15)  # table t's salt: SALT + t * golden ratio (mod 2^64)
_ZIPF_SALT = np.uint64(0x2F0F1E2D3C4B5A69)  # scatters zipf ranks (independent of the keys' salt)
_EXACT_ZETA = 1 << 22  # zeta(n) summed term by term up to here, Euler-Maclaurin beyond


def table_salt(table: int) -> np.uint64:
    with np.errstate(over="ignore"):
        return np.uint64(SALT + np.uint64(table) * _TABLE_STEP)


def keys_of(ids: np.ndarray, table: int = 0) -> np.ndarray:
    """Key numbers -> keys of `table` (a bijection for each table: distinct keys)."""
    return fmix64(np.asarray(ids).astype(np.uint64) ^ table_salt(table))


def values_of(keys: np.ndarray, width: int) -> np.ndarray:
    """Each key's value: its 8 little-endian bytes repeated to `width` bytes, (n, width)."""
    raw = np.ascontiguousarray(keys, dtype="<u8").view(np.uint8).reshape(-1, 8)
    return np.tile(raw, (1, -(-width // 8)))[:, :width]


@dataclass(frozen=True)
class DerivedData:
    """`count` keys of `width`-byte values for table `table`, derived (see the module)."""

    count: int
    width: int
    table: int = 0

    def keys(self, ids: np.ndarray) -> np.ndarray:
        return keys_of(ids, self.table)

    def chunks(
        self, size: int = 1 << 20, start: int = 0, stop: int | None = None
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(keys, values (n, width)) of key numbers start..stop, `size` at a time, in order."""
        stop = self.count if stop is None else stop
        for first in range(start, stop, size):
            keys = self.keys(np.arange(first, min(first + size, stop), dtype=np.uint64))
            yield keys, values_of(keys, self.width)

    def absent_keys(self, count: int, seed: int = 99) -> np.ndarray:
        """Keys not in the data set: keys of key numbers past its end (fmix64 is a bijection)."""
        rng = np.random.default_rng(seed)
        return self.keys(self.count + rng.integers(0, 1 << 40, count, dtype=np.uint64))


# ---------------------------------------------------------------------------------------------
# distributions


@dataclass(frozen=True)
class Distribution:
    """Which key numbers of [0, n) requests ask for: `uniform` or scrambled `zipf` (theta)."""

    name: str  # "uniform" | "zipf"
    theta: float = 0.0

    def __str__(self) -> str:
        return self.name if self.name == "uniform" else f"zipf:{self.theta:g}"

    def draw(self, rng: np.random.Generator, n: int, size: int | tuple[int, ...]) -> np.ndarray:
        """Key numbers (uint64) drawn from this distribution over [0, n)."""
        if self.name == "uniform":
            return rng.integers(0, n, size, dtype=np.uint64)
        ranks = zipf_ranks(rng, n, self.theta, size)
        with np.errstate(over="ignore"):
            return fmix64(ranks ^ _ZIPF_SALT) % np.uint64(n)


def parse_distribution(text: str) -> Distribution:
    """`uniform` or `zipf:THETA` (0 < THETA < 1); ValueError otherwise."""
    text = text.strip()
    if text == "uniform":
        return Distribution("uniform")
    name, sep, value = text.partition(":")
    if name == "zipf" and sep:
        try:
            theta = float(value)
        except ValueError:
            theta = math.nan
        if 0.0 < theta < 1.0:
            return Distribution("zipf", theta)
        raise ValueError(f"zipf:THETA needs 0 < THETA < 1, got {value!r}")
    raise ValueError(f"unknown distribution {text!r} (uniform or zipf:THETA, e.g. zipf:0.99)")


def parse_distributions(text: str) -> tuple[Distribution, ...]:
    found = tuple(parse_distribution(part) for part in text.split(",") if part.strip())
    if not found:
        raise ValueError("expected one distribution at least (uniform, zipf:0.99)")
    return found


@lru_cache(maxsize=16)
def zeta(n: int, theta: float) -> float:
    """sum_{i=1..n} i^-theta: term by term up to 2^22, then Euler-Maclaurin (error < 1e-12
    relative), so n = 300M costs milliseconds."""
    exact = min(n, _EXACT_ZETA)
    total = 0.0
    for first in range(1, exact + 1, 1 << 20):
        i = np.arange(first, min(first + (1 << 20), exact + 1), dtype=np.float64)
        total += float(np.sum(i**-theta))
    if n <= exact:
        return total
    m, s = float(exact), 1.0 - theta  # the sum over (m, n]: integral + end corrections
    tail = (n**s - m**s) / s + (n**-theta - m**-theta) / 2
    tail += -theta / 12 * (n ** (-theta - 1) - m ** (-theta - 1))
    return float(total + tail)


def zipf_ranks(
    rng: np.random.Generator, n: int, theta: float, size: int | tuple[int, ...]
) -> np.ndarray:
    """Ranks in [0, n) (0 the most popular) from Zipf(theta): YCSB's ZipfianGenerator (Gray et
    al., "Quickly generating billion-record synthetic databases"), vectorized."""
    if n < 2:
        return np.zeros(size, dtype=np.uint64)
    zetan = zeta(n, theta)
    zeta2 = 1.0 + 0.5**theta
    alpha = 1.0 / (1.0 - theta)
    eta = (1.0 - (2.0 / n) ** (1.0 - theta)) / (1.0 - zeta2 / zetan)
    u = rng.random(size)
    uz = u * zetan
    ranks = np.floor(n * np.power(eta * u - eta + 1.0, alpha))
    ranks = np.where(uz < zeta2, 1.0, ranks)
    ranks = np.where(uz < 1.0, 0.0, ranks)
    return np.minimum(ranks, n - 1).astype(np.uint64)


def draw_pool(
    data: DerivedData, distribution: Distribution, batches: int, batch: int, seed: int
) -> np.ndarray:
    """(batches, batch) keys of `data` drawn before the clock (a request per row)."""
    rng = np.random.default_rng([seed, data.table])
    ids = distribution.draw(rng, data.count, (batches, batch))
    return data.keys(ids)


def write_input(directory: Path, data: DerivedData, files: int = 1, chunk: int = 1 << 20) -> int:
    """`data` as `files` Cube-dialect SequenceFiles in `directory` (created), written `chunk`
    records at a time (never the whole set in memory); returns the bytes written."""
    from cube.seqfile import SequenceFileWriter
    from cube.values import ValueColumn

    directory.mkdir(parents=True)
    bounds = np.linspace(0, data.count, max(1, files) + 1).astype(np.int64)
    written = 0
    for number in range(max(1, files)):
        path = directory / f"part-{number:05d}"
        with SequenceFileWriter(path, dialect="cube") as writer:
            for keys, rows in data.chunks(chunk, int(bounds[number]), int(bounds[number + 1])):
                writer.write_batch(keys, ValueColumn.fixed(rows.reshape(-1), data.width))
        written += path.stat().st_size
    return written
