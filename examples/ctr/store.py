"""Where the trainer's models live, and how a version name leads to its dense parameters.

    <out>/models/<YYYYMMDD>/base/           the day's base; `delta_<n>/` for its n-th pass
    <model>/sparse/part-00000   Cube SequenceFile: uint64 feasign -> float32[dim]
                                (a base: every feature; a delta: changed and new ones)
    <model>/delete.txt          a delta's deleted feasigns, one per line (shrunk away)
    <model>/dense.npz           the MLP of this version (model.Dense)
    <model>/meta.json           what the trainer knows of it (id, pass, split, AUCs, counts)
    <out>/donefile/base.txt, patch.txt    the lines cube-transfer reads, appended last

The Paddle trainer (paddle_trainer.py) writes Fleet's layout under the same `<out>/models`:
`<day>/base/`, `<day>/delta-<n>/` (a parameter-server save: a folder per table, `000/` the
embeddings, for its DeepFM `001/` the first-order weights; its inference model in `dnn_plugin/`
and the same meta.json) and Fleet's donefiles `xbox_base_done.txt`, `xbox_patch_done.txt`.

A version's id is the Unix time of the split it was trained on, so its day directory follows
from the id. cube-transfer names a base version `<id>` and a delta `<base id>_<id>`; either way
the dense parameters of a served version are those of the model whose id is the last one. A model
directory is written under a temporary name and renamed into place, and its donefile line is
appended only after that: a version is either whole and announced, or not visible at all.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cube.donefile import (
    BASE_FILE,
    PATCH_FILE,
    SEQFILE,
    VERSION_NAME,
    DonefileEntry,
    DonefileFormat,
    append_line,
    format_line,
    parse_lines,
)
from cube.fsutil import atomic_write_json, atomic_write_text, fsync_dir
from examples.ctr.model import Dense, SparseTable
from examples.ctr.paddle_dense import PLUGIN, PaddleDense

MODELS = "models"
DONEFILE = "donefile"
SAVE_PAUSE_ENV = "CTR_TRAINER_SAVE_PAUSE"  # fault injection for tests: seconds to stall mid-save


@dataclass(frozen=True)
class ModelMeta:
    id: int
    kind: str  # base | delta
    base: int  # the base id (== id for a base)
    pass_no: int
    day_pass: int  # 1 for the day's base, then 2, 3, ... (the n of delta_<n>)
    split: str  # YYYYMMDD/HHMM
    features: int  # rows in sparse/
    deleted: int  # keys in delete.txt
    table_size: int  # features the model has after this version
    streaming_auc: float  # on this split's training data, predicted before training on it
    offline_auc: float  # on this split's held-out data, with this version as saved (nan: none)
    heldout_samples: int
    dim: int
    written_at: float

    @property
    def day(self) -> str:
        return self.split[:8]

    @property
    def name(self) -> str:
        return "base" if self.kind == "base" else f"delta_{self.day_pass}"

    @property
    def version(self) -> str:
        """The name cube-transfer gives this version."""
        return str(self.id) if self.kind == "base" else f"{self.base}_{self.id}"


def model_dir(out: Path, meta: ModelMeta) -> Path:
    return out / MODELS / meta.day / meta.name


def all_models(models_root: Path) -> list[tuple[ModelMeta, Path]]:
    """Every whole model under `models_root` (temporaries skipped), by id."""
    found = [
        (read_meta(path.parent), path.parent) for path in models_root.glob("[0-9]*/[!.]*/meta.json")
    ]
    return sorted(found, key=lambda pair: pair[0].id)


def find_model(models_root: Path, version_id: int | str) -> Path:
    """The directory of the model `version_id` (looked for in the day the id falls on)."""
    when = dt.datetime.fromtimestamp(int(version_id), dt.UTC)
    day = models_root / when.strftime("%Y%m%d")
    for path in sorted(day.glob("[!.]*/meta.json")):
        if read_meta(path.parent).id == int(version_id):
            return path.parent
    raise FileNotFoundError(f"no model with id {version_id} in {day}")


def last_id(version: str) -> str:
    """The id whose model holds the dense part of a served version (`B` or `B_D` -> D)."""
    if not VERSION_NAME.fullmatch(version):
        raise ValueError("not a version name (<base id> or <base id>_<delta id>)")
    return version.rpartition("_")[2]


def read_meta(directory: Path) -> ModelMeta:
    return ModelMeta(**json.loads((directory / "meta.json").read_text()))


def write_model(
    out: Path,
    meta: ModelMeta,
    keys: np.ndarray,
    embeddings: np.ndarray,
    deleted: np.ndarray,
    dense: Dense,
) -> Path:
    """Write a whole model directory, then rename it into place (replacing an unannounced one a
    crashed run left). Returns its path."""
    from cube.seqfile import SequenceFileWriter
    from cube.values import ValueColumn

    final = model_dir(out, meta)
    tmp = final.with_name(f".tmp-{meta.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "sparse").mkdir(parents=True)  # and the day's directory
    rows = np.ascontiguousarray(embeddings, dtype=np.float32)
    column = ValueColumn.fixed(rows.view(np.uint8).reshape(-1), meta.dim * 4)
    with SequenceFileWriter(tmp / "sparse" / "part-00000", dialect="cube") as writer:
        writer.write_batch(np.ascontiguousarray(keys, dtype=np.uint64), column)
    _stall_for_tests()
    if meta.kind == "delta":
        atomic_write_text(tmp / "delete.txt", "".join(f"{k}\n" for k in deleted.tolist()))
    dense.save(tmp / "dense.npz")
    atomic_write_json(tmp / "meta.json", asdict(meta))
    with open(tmp / "sparse" / "part-00000", "rb") as file:
        os.fsync(file.fileno())
    fsync_dir(tmp / "sparse")
    fsync_dir(tmp)
    if final.exists():  # left by a run killed before its donefile line: never announced
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    return final


def _stall_for_tests() -> None:
    pause = float(os.environ.get(SAVE_PAUSE_ENV, "0") or 0)
    if pause > 0:
        time.sleep(min(pause, 60.0))


def remove_stale_temporaries(out: Path) -> list[Path]:
    """Temporary model directories of killed runs (never announced), removed."""
    stale = sorted((out / MODELS).glob("[0-9]*/.tmp-*"))
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def donefile_line(out: Path, meta: ModelMeta) -> tuple[Path, str]:
    """The donefile and line that announce `meta`'s model to cube-transfer."""
    directory = model_dir(out, meta).resolve()
    if meta.kind == "base":
        return out / DONEFILE / BASE_FILE, format_line(
            str(meta.id), str(meta.id), str(directory / "sparse")
        )
    return out / DONEFILE / PATCH_FILE, format_line(
        str(meta.id), str(meta.base), str(directory / "sparse"), str(directory / "delete.txt")
    )


def announced_ids(out: Path, donefile_format: DonefileFormat = SEQFILE) -> set[str]:
    """Ids that have a donefile line: in `out`/donefile (base.txt and patch.txt), or for a
    Paddle trainer's (`paddle_fleet`) in `out`/models, where Fleet writes its own."""
    ids: set[str] = set()
    directory = out / (MODELS if donefile_format.paddle_saves else DONEFILE)
    for name in (donefile_format.base_file, donefile_format.patch_file):
        path = directory / name
        if path.is_file():
            entries = parse_lines(name, path.read_text(), 0, donefile_format)
            ids.update(e.id for e in entries if isinstance(e, DonefileEntry))
    return ids


def announce(out: Path, meta: ModelMeta) -> bool:
    """Append `meta`'s donefile line unless it is there already; whether it was appended."""
    if str(meta.id) in announced_ids(out):
        return False
    path, line = donefile_line(out, meta)
    append_line(path, line)
    return True


def load_dense(models_root: Path, version: str) -> tuple[Dense | PaddleDense, dict[str, Any]]:
    """The dense part and meta of a served `version`: those of the model of its last id (the
    numpy trainer's dense.npz, or the Paddle trainer's inference model in dnn_plugin/)."""
    directory = find_model(models_root, last_id(version))
    plugin = directory / PLUGIN
    dense = PaddleDense.load(plugin) if plugin.is_dir() else Dense.load(directory / "dense.npz")
    meta = json.loads((directory / "meta.json").read_text())
    return dense, meta


def read_sparse(directory: Path, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Keys and (n, dim) float32 rows of every SequenceFile in a model's `sparse/`."""
    from cube.seqfile import SequenceFileReader

    keys, rows = [np.zeros(0, np.uint64)], [np.zeros((0, dim), np.float32)]
    for path in sorted(directory.iterdir()):
        with SequenceFileReader(path) as reader:
            for batch in reader.batches():
                keys.append(batch.keys)
                rows.append(batch.values.as_rows().view(np.float32).reshape(-1, dim).copy())
    return np.concatenate(keys), np.concatenate(rows)


def version_table(out: Path, version: str, dim: int) -> SparseTable:
    """What Cube should serve for `version`, rebuilt from the model files alone: the base, then
    each delta of that base up to the version's id in order (upserts, then its deletes). An
    oracle for tests and a tool to inspect a version (`.keys`, `.embeddings(feasigns)`)."""
    target = int(last_id(version))
    base = int(version.partition("_")[0])
    keys, rows = read_sparse(find_model(out / MODELS, base) / "sparse", dim)
    table = dict(zip(keys.tolist(), rows, strict=True))
    for meta, directory in all_models(out / MODELS):
        if meta.kind != "delta" or meta.base != base or meta.id > target:
            continue
        k, r = read_sparse(directory / "sparse", dim)
        table.update(zip(k.tolist(), r, strict=True))
        for key in (directory / "delete.txt").read_text().split():
            table.pop(int(key), None)
    ordered = sorted(table)
    stacked = np.stack([table[k] for k in ordered]) if ordered else np.zeros((0, dim), np.float32)
    return SparseTable.of(np.array(ordered, dtype=np.uint64), stacked)
