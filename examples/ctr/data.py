"""A synthetic click-log stream with a planted ground truth, in ElasticCTR's streaming layout.

    <root>/data/<YYYYMMDD>/<HHMM>/part-00000     training samples of one split
    <root>/data/<YYYYMMDD>/<HHMM>/to.hadoop.done  written last: the split is complete
    <root>/heldout/<YYYYMMDD>/<HHMM>/part-00000  held-out samples of the same time

Every slot has a vocabulary of features that grows (`growth` new features per split) and churns
(the `churn` oldest retire per split and are never seen again, so the trainer's shrink drops
them). Within the live window newer features are more frequent. Each feature has a true weight
drawn from its id; a sample's click probability is `sigmoid(bias + sum of its weights)`, so a
model that learns the weights reaches a known AUC (`bayes_auc`).

    python -m examples.ctr.data --out DIR --days 2 --splits_per_day 3
"""

from __future__ import annotations

import datetime as dt
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cube.flags import FlagError, Flags, FlagSet, run_cli
from cube.fsutil import atomic_write_text
from examples.ctr.model import auc
from examples.ctr.samples import Samples, format_lines

SPLIT_DONE = "to.hadoop.done"  # the marker a split's writer leaves last
PART = "part-00000"
EPOCH = dt.datetime(2026, 11, 23, tzinfo=dt.UTC)


@dataclass(frozen=True)
class StreamSpec:
    """What the stream looks like; every split is a pure function of (spec, split index)."""

    slots: int = 8  # slot ids 1..slots
    multi_hot_slots: int = 2  # the last ones carry 1-3 features per sample, the others 1
    samples: int = 20_000  # training samples per split
    heldout: int = 5_000  # held-out samples per split
    vocab: int = 3_000  # live features per slot at split 0
    growth: int = 150  # new features per slot per split
    churn: int = 100  # retired features per slot per split
    skew: float = 2.0  # > 1: newer features are drawn more often
    weight_scale: float = 0.9
    bias: float = -1.2
    splits_per_day: int = 3
    split_minutes: int = 60
    seed: int = 20_191_021

    def check(self) -> None:
        if self.slots < 1 or not 0 <= self.multi_hot_slots <= self.slots:
            raise FlagError("--slots must be >= 1 and --multi_hot_slots within it")
        if self.samples < 1 or self.heldout < 0 or self.vocab < 1:
            raise FlagError("--samples and --vocab must be >= 1, --heldout >= 0")
        if self.growth < 0 or self.churn < 0 or self.skew <= 0:
            raise FlagError("--growth and --churn must be >= 0, --skew > 0")
        if self.splits_per_day < 1 or not 1 <= self.split_minutes * self.splits_per_day <= 1440:
            raise FlagError("the splits of a day must fit in the day")


def split_time(spec: StreamSpec, index: int) -> dt.datetime:
    """When split `index` starts: `splits_per_day` splits a day, `split_minutes` apart."""
    day, within = divmod(index, spec.splits_per_day)
    return EPOCH + dt.timedelta(days=day, minutes=within * spec.split_minutes)


def split_path(root: Path, when: dt.datetime, kind: str = "data") -> Path:
    return root / kind / when.strftime("%Y%m%d") / when.strftime("%H%M")


@dataclass(frozen=True)
class Split:
    """A complete split found on disk."""

    when: dt.datetime
    path: Path

    @property
    def day(self) -> str:
        return self.when.strftime("%Y%m%d")

    @property
    def name(self) -> str:
        return self.when.strftime("%Y%m%d/%H%M")

    @property
    def timestamp(self) -> int:
        return int(self.when.timestamp())

    def parts(self) -> list[Path]:
        return sorted(p for p in self.path.iterdir() if p.name.startswith("part-"))


def list_splits(data_dir: Path) -> list[Split]:
    """The complete splits under `data_dir` (those with their donefile), oldest first. Other
    names are ignored: a writer's temporary directory, a README."""
    found: list[Split] = []
    if not data_dir.is_dir():
        return found
    for day in data_dir.iterdir():
        if not (len(day.name) == 8 and day.name.isdigit() and day.is_dir()):
            continue
        for hhmm in day.iterdir():
            if len(hhmm.name) == 4 and hhmm.name.isdigit() and (hhmm / SPLIT_DONE).is_file():
                try:
                    when = dt.datetime.strptime(day.name + hhmm.name, "%Y%m%d%H%M")
                except ValueError:
                    continue
                found.append(Split(when.replace(tzinfo=dt.UTC), hhmm))
    return sorted(found, key=lambda s: s.when)


# ---------------------------------------------------------------------------------------------
# the planted truth


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: spreads structured ids over 64 bits (and over Cube's shards)."""
    with np.errstate(over="ignore"):
        x = x.astype(np.uint64)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        mixed: np.ndarray = x ^ (x >> np.uint64(31))
        return mixed


def feasign(slot: np.ndarray, index: np.ndarray) -> np.ndarray:
    """The feature id of feature `index` of `slot` (distinct for all slots and indices used)."""
    return _mix64((slot.astype(np.uint64) << np.uint64(40)) | index.astype(np.uint64))


def true_weight(spec: StreamSpec, feasigns: np.ndarray) -> np.ndarray:
    """Each feature's planted weight: normal, a function of its id alone."""
    bits = _mix64(feasigns ^ np.uint64(spec.seed))
    u1 = ((bits >> np.uint64(40)).astype(np.float64) + 0.5) / 2.0**24
    u2 = ((bits & np.uint64(0xFFFFFF)).astype(np.float64) + 0.5) / 2.0**24
    return spec.weight_scale * np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


def click_probability(spec: StreamSpec, samples: Samples) -> np.ndarray:
    weights = true_weight(spec, samples.feasigns)
    logit = spec.bias + np.bincount(samples.sample_of, weights=weights, minlength=len(samples))
    probability: np.ndarray = 1.0 / (1.0 + np.exp(-logit))
    return probability


def live_window(spec: StreamSpec, index: int) -> tuple[int, int]:
    """Feature indices [lo, hi) of every slot that split `index` draws from."""
    return index * spec.churn, spec.vocab + index * spec.growth


def generate(spec: StreamSpec, index: int, count: int, stream: int) -> Samples:
    """`count` samples of split `index`; `stream` 0 is training, 1 held-out."""
    rng = np.random.default_rng([spec.seed, index, stream])
    per_slot = np.ones((count, spec.slots), dtype=np.int64)
    if spec.multi_hot_slots:
        per_slot[:, spec.slots - spec.multi_hot_slots :] = rng.integers(
            1, 4, size=(count, spec.multi_hot_slots)
        )
    counts = per_slot.sum(axis=1)
    offsets = np.zeros(count + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    slots = np.repeat(np.tile(np.arange(1, spec.slots + 1), count), per_slot.reshape(-1))
    lo, hi = live_window(spec, index)
    age = np.floor((hi - lo) * rng.random(slots.shape[0]) ** spec.skew).astype(np.int64)
    feasigns = feasign(slots, hi - 1 - age)
    shows = np.ones(count, dtype=np.int64)
    draft = Samples(shows, np.zeros(count, np.int64), offsets, feasigns, slots)
    clicks = (rng.random(count) < click_probability(spec, draft)).astype(np.int64)
    return Samples(shows, clicks, offsets, feasigns, slots)


def bayes_auc(spec: StreamSpec, index: int) -> float:
    """The AUC of the true probabilities on split `index`'s held-out samples: a ceiling."""
    samples = generate(spec, index, max(spec.heldout, 1000), 1)
    return auc(samples.labels, click_probability(spec, samples))


def _write_text(path: Path, lines: Sequence[str]) -> None:
    """Write a part file whole (a temporary name, synced, renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, "\n".join(lines) + "\n" if lines else "")


def write_split(spec: StreamSpec, root: Path, index: int) -> Path:
    """Write split `index` (training part, held-out part, then the split's donefile) and
    return its training directory. Idempotent: a complete split is left alone."""
    when = split_time(spec, index)
    train_dir = split_path(root, when)
    if (train_dir / SPLIT_DONE).is_file():
        return train_dir
    if spec.heldout:
        heldout = split_path(root, when, "heldout")
        _write_text(heldout / PART, format_lines(generate(spec, index, spec.heldout, 1)))
        _write_text(heldout / SPLIT_DONE, [])
    _write_text(train_dir / PART, format_lines(generate(spec, index, spec.samples, 0)))
    _write_text(train_dir / SPLIT_DONE, [])
    return train_dir


def with_stream_flags(flags: FlagSet[Flags]) -> FlagSet[Flags]:
    """The flags every command that makes a stream takes (data, demo)."""
    d = StreamSpec()
    return (
        flags.add("days", int, 2, "days of data")
        .add("splits_per_day", int, d.splits_per_day, "splits (trainer passes) per day")
        .add("samples", int, d.samples, "training samples per split (the rate)")
        .add("heldout", int, d.heldout, "held-out samples per split")
    )


def flag_set() -> FlagSet[Flags]:
    d = StreamSpec()
    flags = FlagSet("python -m examples.ctr.data", "Write a synthetic ElasticCTR click-log stream.")
    return (
        with_stream_flags(flags)
        .add("out", str, "", "root directory (data/ and heldout/ go under it)", required=True)
        .add("split_minutes", int, d.split_minutes, "minutes between splits")
        .add("slots", int, d.slots, "slots (fields) per sample")
        .add("multi_hot_slots", int, d.multi_hot_slots, "slots with 1-3 features per sample")
        .add("vocab", int, d.vocab, "live features per slot at the start")
        .add("growth", int, d.growth, "new features per slot per split")
        .add("churn", int, d.churn, "features per slot retired per split")
        .add("seed", int, d.seed, "random seed")
    )


def spec_from(flags: object) -> StreamSpec:
    """A StreamSpec of the flags that name its fields (the rest keep their defaults)."""
    names = StreamSpec.__dataclass_fields__.keys()
    spec = StreamSpec(**{n: getattr(flags, n) for n in names if hasattr(flags, n)})
    spec.check()
    if getattr(flags, "days", 1) < 1:
        raise FlagError("--days must be >= 1")
    return spec


def run(argv: Sequence[str]) -> int:
    flags = flag_set().parse(argv)
    spec = spec_from(flags)
    root = Path(flags.out)
    for index in range(flags.days * spec.splits_per_day):
        path = write_split(spec, root, index)
        print(f"{path}  (bayes AUC {bayes_auc(spec, index):.3f})", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    sys.exit(main())
