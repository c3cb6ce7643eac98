"""Streaming trainer: one pass per split as the splits appear, a base per day, a delta per pass.

    python -m examples.ctr.trainer --data_dir ROOT/data --out_dir OUT [--heldout_dir ROOT/heldout]

Every pass, for the oldest complete split not trained yet (`data/<YYYYMMDD>/<HHMM>` with its
`to.hadoop.done`):

1. predict the split before training on it and log that AUC (the streaming AUC);
2. train one epoch on it (Adagrad for the embeddings, Adam for the MLP);
3. shrink: drop the features not seen in the last `--shrink_after` passes;
4. save a **base** (every feature) on the first pass of a day, else a **delta** (the features
   changed or added since the last save, and the shrunk ones as deletes), with the dense part,
   evaluated on the split's held-out data as saved (the offline AUC); see store.py;
5. checkpoint the whole training state, then append the version's donefile line.

A restart resumes from the last checkpoint: a version whose model was written but whose line
was not is announced then; a pass killed before its checkpoint is trained again (training is
deterministic, so it writes the same model). No new split for `--wait_timeout` seconds ends the
run (exit 0), as does `--max_passes`.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cube.flags import FlagError, Flags, FlagSet, run_cli
from cube.fsutil import atomic_write_text, fsync_dir
from examples.ctr import samples as sample_io
from examples.ctr.data import Split, list_splits
from examples.ctr.model import Hyper, Model, auc
from examples.ctr.store import (
    MODELS,
    ModelMeta,
    announce,
    find_model,
    read_meta,
    remove_stale_temporaries,
    write_model,
)

CHECKPOINTS = "checkpoint"
LATEST = "LATEST"


@dataclass
class Progress:
    """What a checkpoint records besides the model's arrays."""

    pass_no: int = 0
    last_split: str = ""  # YYYYMMDD/HHMM of the last pass
    last_id: int = 0  # the version id of the last pass
    day_pass: int = 0  # passes of the current day so far
    base_id: int = 0
    base_day: str = ""
    rng: dict[str, Any] | None = None


def say(text: str) -> None:
    print(text, flush=True)


class StreamingTrainer:
    def __init__(self, out: Path, slot_ids: np.ndarray, hyper: Hyper, seed: int) -> None:
        self.out = out
        self.hyper = hyper
        self.progress = Progress()
        self.rng = np.random.default_rng(seed)
        self.model = Model.initial(slot_ids, hyper, self.rng)

    # -- checkpoints --

    def resume(self) -> bool:
        """Load the latest checkpoint, if any, and announce its version if a crash came between
        writing the model and appending the line. Whether there was one."""
        for path in remove_stale_temporaries(self.out):
            say(f"removed {path}: a save that never finished")
        pointer = self.out / CHECKPOINTS / LATEST
        if not pointer.is_file():
            return False
        directory = self.out / CHECKPOINTS / pointer.read_text().strip()
        info = json.loads((directory / "progress.json").read_text())
        self.progress = Progress(**info["progress"])
        self.hyper = Hyper(**info["hyper"])
        with np.load(directory / "state.npz", allow_pickle=False) as npz:
            self.model = Model.from_state(self.hyper, {k: npz[k] for k in npz.files})
        if self.progress.rng is not None:
            self.rng.bit_generator.state = self.progress.rng
        meta = read_meta(find_model(self.out / MODELS, self.progress.last_id))
        if announce(self.out, meta):
            say(f"announced version {meta.version}: its model was saved before the last stop")
        return True

    def checkpoint(self) -> None:
        """Write the state to a new directory, then point LATEST at it (atomic rename)."""
        self.progress.rng = dict(self.rng.bit_generator.state)
        root = self.out / CHECKPOINTS
        name = f"pass-{self.progress.pass_no:06d}"
        tmp = root / f".tmp-{name}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        with open(tmp / "state.npz", "wb") as file:
            np.savez(file, **self.model.state())
            file.flush()
            os.fsync(file.fileno())
        info = {"progress": asdict(self.progress), "hyper": asdict(self.hyper)}
        atomic_write_text(tmp / "progress.json", json.dumps(info))
        fsync_dir(tmp)
        shutil.rmtree(root / name, ignore_errors=True)
        os.replace(tmp, root / name)
        atomic_write_text(root / LATEST, name + "\n")
        for old in root.iterdir():
            if old.name.startswith("pass-") and old.name != name:
                shutil.rmtree(old, ignore_errors=True)

    # -- one pass --

    def next_split(self, data_dir: Path) -> Split | None:
        for split in list_splits(data_dir):
            if split.name > self.progress.last_split:
                return split
        return None

    def run_pass(self, split: Split, shrink_after: int, heldout_dir: Path | None) -> ModelMeta:
        started = time.monotonic()
        data = sample_io.concat([sample_io.read_file(str(p)) for p in split.parts()])
        pass_no = self.progress.pass_no + 1
        model, table = self.model, self.model.table
        streaming_auc = auc(data.labels, model.predict(data)) if len(table) else 0.5
        loss = model.train(data, pass_no, self.rng)
        dropped = table.shrink(pass_no, shrink_after)
        is_base = split.day != self.progress.base_day
        version_id = split.timestamp
        if version_id <= self.progress.last_id:
            raise RuntimeError(f"split {split.name} is not newer than the last version")
        if is_base:
            rows = np.arange(len(table))
            base_id = version_id
        else:
            rows = np.flatnonzero(table.dirty)
            base_id = self.progress.base_id
        offline_auc, heldout_n = float("nan"), 0
        heldout = self._heldout(split, heldout_dir)
        if heldout is not None:
            offline_auc, heldout_n = auc(heldout.labels, model.predict(heldout)), len(heldout)
        meta = ModelMeta(
            id=version_id,
            kind="base" if is_base else "delta",
            base=base_id,
            pass_no=pass_no,
            day_pass=1 if is_base else self.progress.day_pass + 1,
            split=split.name,
            features=int(rows.shape[0]),
            deleted=0 if is_base else int(dropped.shape[0]),
            table_size=len(table),
            streaming_auc=streaming_auc,
            offline_auc=offline_auc,
            heldout_samples=heldout_n,
            dim=self.hyper.dim,
            written_at=time.time(),
        )
        order = np.argsort(table.keys[rows])
        rows = rows[order]
        write_model(self.out, meta, table.keys[rows], table.emb[rows], dropped, model.dense)
        table.dirty[:] = False
        self.progress.pass_no, self.progress.last_split = pass_no, split.name
        self.progress.last_id, self.progress.base_id = version_id, base_id
        self.progress.base_day, self.progress.day_pass = split.day, meta.day_pass
        self.checkpoint()
        announce(self.out, meta)
        say(
            f"pass {pass_no} {split.name}: {meta.kind} {meta.version}, {len(data):,} samples, "
            f"loss {loss:.4f}, streaming AUC {streaming_auc:.4f}, offline AUC {offline_auc:.4f}, "
            f"{meta.features:,} features saved, {meta.deleted:,} deleted, table {len(table):,}, "
            f"{time.monotonic() - started:.1f}s"
        )
        return meta

    def _heldout(self, split: Split, heldout_dir: Path | None) -> sample_io.Samples | None:
        if heldout_dir is None:
            return None
        directory = heldout_dir / split.path.parent.name / split.path.name
        parts = sorted(directory.glob("part-*")) if directory.is_dir() else []
        if not parts:
            return None
        return sample_io.concat([sample_io.read_file(str(p)) for p in parts])


def flag_set() -> FlagSet[Flags]:
    h = Hyper()
    return (
        FlagSet("python -m examples.ctr.trainer", "Streaming CTR trainer that feeds Cube.")
        .add("data_dir", str, "", "the stream: <data_dir>/<YYYYMMDD>/<HHMM>/", required=True)
        .add("out_dir", str, "", "models, donefiles and checkpoints go here", required=True)
        .add("heldout_dir", str, "", "held-out splits, same layout (for the offline AUC)")
        .add("slots", int, 8, "slot ids 1..slots")
        .add("dim", int, h.dim, "embedding size")
        .add("hidden", int, h.hidden, "MLP hidden units")
        .add("sparse_lr", float, h.sparse_lr, "Adagrad learning rate of the embeddings")
        .add("dense_lr", float, h.dense_lr, "Adam learning rate of the MLP")
        .add("batch", int, h.batch, "mini-batch size")
        .add("shrink_after", int, 3, "drop features not seen for this many passes")
        .add("max_passes", int, 0, "stop after this many passes in this run (0: no limit)")
        .add("wait_timeout", float, 60.0, "stop when no new split appears for this long (s)")
        .add("poll", float, 0.5, "seconds between looks for a new split")
        .add("seed", int, 7, "random seed (initial weights, new embeddings)")
    )


def run(argv: Sequence[str]) -> int:
    flags = flag_set().parse(argv)
    if flags.slots < 1 or flags.dim < 1 or flags.hidden < 1 or flags.batch < 1:
        raise FlagError("--slots, --dim, --hidden and --batch must be >= 1")
    if flags.shrink_after < 1 or flags.wait_timeout < 0 or flags.poll <= 0:
        raise FlagError("--shrink_after >= 1, --wait_timeout >= 0 and --poll > 0, please")
    out = Path(flags.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hyper = Hyper(flags.dim, flags.hidden, flags.sparse_lr, flags.dense_lr, flags.batch)
    slot_ids = np.arange(1, flags.slots + 1, dtype=np.int64)
    trainer = StreamingTrainer(out, slot_ids, hyper, flags.seed)
    if trainer.resume():
        say(f"resumed after pass {trainer.progress.pass_no} ({trainer.progress.last_split})")
    data_dir = Path(flags.data_dir)
    heldout_dir = Path(flags.heldout_dir) if flags.heldout_dir else None
    passes = 0
    idle_since = time.monotonic()
    while flags.max_passes == 0 or passes < flags.max_passes:
        split = trainer.next_split(data_dir)
        if split is None:
            if time.monotonic() - idle_since > flags.wait_timeout:
                say(f"no new split in {data_dir} for {flags.wait_timeout:g}s; stopping")
                break
            time.sleep(flags.poll)
            continue
        try:
            trainer.run_pass(split, flags.shrink_after, heldout_dir)
        except sample_io.SampleError as exc:
            say(f"error: {exc}")
            return 1
        passes += 1
        idle_since = time.monotonic()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    sys.exit(main())
