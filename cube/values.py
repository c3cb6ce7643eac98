"""A column of byte-string values held as one buffer, and vectorized gathers over it.

Pure numpy, no I/O. Used by the SequenceFile reader (values of a record batch), the builder
(values in row order), the shard reader (values on an mmap) and the SDK (values of an answer).
Two layouts: fixed width (every value `width` bytes, value i at `blob[i*w:(i+1)*w]`) — the
embedding fast path, where a gather is one `take` — and variable (`offsets`, n+1 int64).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

_NO_OFFSETS = np.empty(0, dtype=np.int64)  # a fixed-width column's (unused) offsets


@dataclass(frozen=True)
class ValueColumn:
    blob: np.ndarray  # uint8, 1-D
    offsets: np.ndarray  # int64 (count + 1,) for variable width; empty for fixed width
    width: int  # > 0 for fixed width, 0 for variable
    count: int

    @classmethod
    def fixed(cls, blob: np.ndarray, width: int) -> ValueColumn:
        if width <= 0:
            raise ValueError(f"fixed width must be > 0, got {width}")
        blob = blob.reshape(-1)
        if blob.shape[0] % width:
            raise ValueError(f"{blob.shape[0]} value bytes are not a multiple of width {width}")
        return cls(blob, _NO_OFFSETS, width, blob.shape[0] // width)

    @classmethod
    def variable(cls, blob: np.ndarray, offsets: np.ndarray) -> ValueColumn:
        return cls(blob.reshape(-1), offsets.astype(np.int64, copy=False), 0, offsets.shape[0] - 1)

    @classmethod
    def from_list(cls, values: Iterable[bytes]) -> ValueColumn:
        """From Python bytes (tests, small inputs); fixed width when all lengths agree."""
        values = list(values)
        lengths = np.fromiter((len(v) for v in values), dtype=np.int64, count=len(values))
        blob = np.frombuffer(b"".join(values), dtype=np.uint8)
        offsets = np.zeros(len(values) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return cls.variable(blob, offsets).compact()

    @classmethod
    def empty(cls) -> ValueColumn:
        return cls(np.empty(0, np.uint8), np.zeros(1, np.int64), 0, 0)

    def __len__(self) -> int:
        return self.count

    @property
    def nbytes(self) -> int:
        return self.count * self.width if self.width else int(self.offsets[-1] - self.offsets[0])

    def lengths(self) -> np.ndarray:
        if self.width:
            return np.full(self.count, self.width, dtype=np.int64)
        return np.diff(self.offsets)

    def compact(self) -> ValueColumn:
        """The fixed-width form when every value has the same non-zero length, else self."""
        if self.width or self.count == 0:
            return self
        lengths = np.diff(self.offsets)
        width = int(lengths[0])
        if width and (lengths == width).all():
            start = int(self.offsets[0])
            return ValueColumn.fixed(self.blob[start : start + width * self.count], width)
        return self

    def as_rows(self) -> np.ndarray:
        """Fixed width only: a (count, width) uint8 view."""
        if not self.width:
            raise ValueError("as_rows needs fixed-width values")
        return self.blob[: self.count * self.width].reshape(self.count, self.width)

    def get(self, i: int) -> bytes:
        if self.width:
            return self.blob[i * self.width : (i + 1) * self.width].tobytes()
        return self.blob[self.offsets[i] : self.offsets[i + 1]].tobytes()

    def to_list(self) -> list[bytes]:
        return [self.get(i) for i in range(self.count)]

    def take(self, rows: np.ndarray) -> ValueColumn:
        """Values at `rows`, in that order, as a new contiguous column."""
        rows = np.asarray(rows, dtype=np.int64)
        if self.width:
            return ValueColumn.fixed(self.as_rows().take(rows, axis=0).reshape(-1), self.width)
        starts = self.offsets.take(rows)
        lengths = self.offsets.take(rows + 1) - starts
        blob, offsets = gather_ranges(self.blob, starts, lengths)
        return ValueColumn.variable(blob, offsets)

    def concat(self, other: ValueColumn) -> ValueColumn:
        if self.width and self.width == other.width:
            return ValueColumn.fixed(
                np.concatenate([self.blob[: self.nbytes], other.blob[: other.nbytes]]),
                self.width,
            )
        if self.count == 0:
            return other
        if other.count == 0:
            return self
        a, b = self.as_variable(), other.as_variable()
        blob = np.concatenate(
            [a.blob[a.offsets[0] : a.offsets[-1]], b.blob[b.offsets[0] : b.offsets[-1]]]
        )
        offsets = np.concatenate(
            [a.offsets[:-1] - a.offsets[0], b.offsets - b.offsets[0] + a.nbytes]
        )
        return ValueColumn.variable(blob, offsets)

    def as_variable(self) -> ValueColumn:
        if not self.width:
            return self
        offsets = np.arange(self.count + 1, dtype=np.int64) * self.width
        return ValueColumn.variable(self.blob, offsets)


def gather_ranges(
    blob: np.ndarray, starts: np.ndarray, lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate `blob[starts[i] : starts[i] + lengths[i]]` for all i, without a Python loop.

    Returns (bytes, offsets with len(starts) + 1 entries)."""
    offsets = np.zeros(starts.shape[0] + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    if total == 0:
        return np.empty(0, dtype=np.uint8), offsets
    # Each output byte's source = its range start + its distance from the range's output start.
    shift = np.repeat(starts - offsets[:-1], lengths)
    shift += np.arange(total, dtype=np.int64)
    return blob.take(shift), offsets
