"""The ElasticCTR sample line: `$show $click $feasign:$slot $feasign:$slot ...`.

`show` and `click` are non-negative integers (the label is `click > 0`); each feature is a
uint64 feature id (*feasign*) and the slot it belongs to (a small integer naming the field: user,
ad, query, ...). A line the predictor gets may leave out `show click`. Lines are parsed into
flat numpy arrays (`Samples`); the per-line work is one `split`, the numbers are converted in
one numpy call for the whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MAX_FEATURES_PER_SAMPLE = 10_000


class SampleError(ValueError):
    """A line that is not a sample; the message names where (file:line or sample index)."""


@dataclass(frozen=True)
class Samples:
    """A batch of samples as flat arrays: the features of sample i are
    `feasigns[offsets[i]:offsets[i+1]]`, in slots `slots[...]`."""

    shows: np.ndarray  # int64 (n,); 0 where the line had no show/click
    clicks: np.ndarray  # int64 (n,)
    offsets: np.ndarray  # int64 (n+1,)
    feasigns: np.ndarray  # uint64 (nnz,)
    slots: np.ndarray  # int64 (nnz,)

    def __len__(self) -> int:
        return int(self.offsets.shape[0] - 1)

    @property
    def labels(self) -> np.ndarray:
        return (self.clicks > 0).astype(np.float32)

    @property
    def sample_of(self) -> np.ndarray:
        """The sample index of every feature (nnz,)."""
        return np.repeat(np.arange(len(self), dtype=np.int64), np.diff(self.offsets))

    def take(self, start: int, stop: int) -> Samples:
        """Samples [start, stop) as their own batch (views, no copy of the features)."""
        lo, hi = int(self.offsets[start]), int(self.offsets[stop])
        return Samples(
            self.shows[start:stop],
            self.clicks[start:stop],
            self.offsets[start : stop + 1] - lo,
            self.feasigns[lo:hi],
            self.slots[lo:hi],
        )


def format_lines(samples: Samples) -> list[str]:
    """Lines of `samples` (with show and click), without newlines."""
    tokens = np.char.add(
        np.char.add(samples.feasigns.astype(str), ":"), samples.slots.astype(str)
    ).tolist()
    offsets = samples.offsets.tolist()
    return [
        f"{show} {click} " + " ".join(tokens[offsets[i] : offsets[i + 1]])
        for i, (show, click) in enumerate(
            zip(samples.shows.tolist(), samples.clicks.tolist(), strict=True)
        )
    ]


def parse_lines(lines: Sequence[str], where: str = "sample", first_line: int = 1) -> Samples:
    """Parse sample lines. A bad line raises SampleError naming `where` and its number (counted
    from `first_line`) and what is wrong, never the line's content."""
    shows: list[str] = []
    clicks: list[str] = []
    counts: list[int] = []
    features: list[str] = []
    for number, line in enumerate(lines, first_line):
        tokens = line.split()
        if tokens and ":" not in tokens[0]:
            if len(tokens) < 2 or ":" in tokens[1]:
                raise SampleError(f"{where} {number}: expected `show click feasign:slot ...`")
            shows.append(tokens[0])
            clicks.append(tokens[1])
            del tokens[:2]
        else:
            shows.append("0")
            clicks.append("0")
        if len(tokens) > MAX_FEATURES_PER_SAMPLE:
            raise SampleError(
                f"{where} {number}: {len(tokens)} features, more than {MAX_FEATURES_PER_SAMPLE}"
            )
        counts.append(len(tokens))
        features.extend(tokens)
    try:
        if features and not (np.char.count(np.array(features), ":") == 1).all():
            raise ValueError("a feature without exactly one colon")
        pairs = np.array(" ".join(features).replace(":", " ").split(), dtype=np.uint64)
        show_arr = np.array(shows, dtype=np.int64)
        click_arr = np.array(clicks, dtype=np.int64)
    except (ValueError, OverflowError):
        raise _locate(lines, where, first_line) from None
    if pairs.shape[0] != 2 * len(features) or (show_arr < 0).any() or (click_arr < 0).any():
        raise _locate(lines, where, first_line)
    offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    pairs = pairs.reshape(-1, 2)
    return Samples(show_arr, click_arr, offsets, pairs[:, 0].copy(), pairs[:, 1].astype(np.int64))


def _locate(lines: Sequence[str], where: str, first_line: int) -> SampleError:
    """The error of the first bad line (the slow path, taken only when the batch failed)."""
    for number, line in enumerate(lines, first_line):
        tokens = line.split()
        if tokens and ":" not in tokens[0]:
            for name, token in (("show", tokens[0]), ("click", tokens[1])):
                if not _is_uint(token) or int(token) >= 2**63:
                    return SampleError(f"{where} {number}: {name} is not a non-negative integer")
            tokens = tokens[2:]
        for position, token in enumerate(tokens, 1):
            feasign, colon, slot = token.partition(":")
            if not (colon and _is_uint(feasign) and _is_uint(slot)) or int(feasign) >= 2**64:
                return SampleError(
                    f"{where} {number}: feature {position} is not `feasign:slot` "
                    "(two non-negative integers, the feasign below 2^64)"
                )
    return SampleError(f"{where}: cannot parse")  # not reached: a failed batch has a bad line


def _is_uint(text: str) -> bool:
    return text.isascii() and text.isdigit() and len(text) <= 20


def read_file(path: str) -> Samples:
    """All samples of one text file (a split's part file)."""
    with open(path, encoding="ascii", errors="strict") as file:
        try:
            lines = file.read().splitlines()
        except UnicodeDecodeError as exc:
            raise SampleError(f"{path}: byte {exc.start} is not ASCII") from None
    return parse_lines(lines, where=path)


def concat(batches: Sequence[Samples]) -> Samples:
    if not batches:
        return parse_lines([])
    sizes = np.array([int(b.offsets[-1]) for b in batches], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    offsets = np.concatenate(
        [[0]] + [b.offsets[1:] + s for b, s in zip(batches, starts, strict=True)]
    ).astype(np.int64)
    return Samples(
        np.concatenate([b.shows for b in batches]),
        np.concatenate([b.clicks for b in batches]),
        offsets,
        np.concatenate([b.feasigns for b in batches]),
        np.concatenate([b.slots for b in batches]),
    )
