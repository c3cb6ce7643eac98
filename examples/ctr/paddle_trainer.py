"""The CTR trainer on PaddlePaddle's parameter server: the ElasticCTR loop's real trainer.

    .paddle-venv/bin/python -m examples.ctr.paddle_trainer --data_dir ROOT/data \\
        --heldout_dir ROOT/heldout --out_dir OUT [--passes N]

A Fleet job of 1 pserver + 1 trainer (`python -m paddle.distributed.launch --server_num=1
--worker_num=1`, this file in both roles), paddlepaddle 2.6.2 (the last CPU wheel with a
parameter-server runtime) in a venv of its own: its numpy<2 and protobuf<5 pins clash with the
project's (`make paddle-env` makes it). Static graph, a_sync.

The models (`--model`), per slot and sparse table: `sparse_embedding` (CtrCommonAccessor: a
lookup returns [show, click, embed_w, embedx_w x (D-3)]) -> `continuous_value_model(use_cvm=
False)` (drops show and click; its gradient carries them back, so the table counts shows and
clicks) -> sum pool per sample (a matmul with a 0/1 pooling matrix) -> concat:

- `deepfm` (the default): two tables, `first_order` (a weight per feature: D = `--wide_dim`, 3)
  and `embedding` (D = `--dim`); logit = the first-order weights summed + the FM interaction of
  the slots' pooled embeddings + fc layers (relu) on them; sigmoid.
- `dnn` (a CTR-DNN, PaddleRec's slot_dnn): the table `embedding` -> fc layers -> sigmoid.

The tables' thresholds are PaddleRec's (config_online.yaml): `ACCESSOR`.

One pass per split of the stream (`data/<day>/<HHMM>` with its `to.hadoop.done`), as Fleet's
streaming trainer does:

1. train one epoch in mini-batches (`exe.run`; the dense parameters pulled from the pserver after
   each step, as Fleet's dense pull thread does for `train_from_dataset`); the predictions made
   before each step give the streaming AUC;
2. save with the real modes: the first pass of a day `fleet.shrink()` then
   `fleet.save_persistables(mode=2)` (**base**: rows with score >= base_threshold), every
   other pass `mode=1` (**delta**: rows whose delta score reached delta_threshold since the
   last save); the dense part with `paddle.static.save_inference_model` (the program from the
   pooled input to the probability) into `dnn_plugin/`;
3. evaluate the version as saved, with the trainer's own numbers: the saved keys pulled from
   the pserver (exact float32; each checked against its saved text to its 6 digits), applied
   to what the previous saves made (a base replaces, a delta updates: what Cube serves), pooled
   and run through the trainer's own program: its probability on every held-out sample, the
   offline AUC, and each probability's bound for the served one (`probability_bounds`);
4. move the model directory into place, then append Fleet's donefile line
   (`cube.donefile.format_fleet_line`, `xbox_base_done.txt` / `xbox_patch_done.txt` in
   `OUT/models`, as `FleetUtil.write_xbox_donefile` writes them).

    OUT/models/fleet_desc.prototxt          the job's PSParameter (cube-builder -paddle_config)
    OUT/models/<day>/base/000/part-*        the embeddings (mode 2); deepfm: 001/ the first-order
                                            weights, 002/ the dense table (dnn: 001/)
    OUT/models/<day>/delta-<n>/...          the n-th pass of the day (mode 1)
    <model>/dnn_plugin/model.pdmodel, .pdiparams, layout.json    the dense part
    <model>/heldout.npz, meta.json          the trainer's probabilities and bounds; store.ModelMeta
    OUT/models/xbox_base_done.txt, xbox_patch_done.txt            the donefile lines (input:
                                            the save; dnn: its table's folder)

A version's id is the Unix time of its split (Fleet uses the wall time; the demo needs ids it
can predict). The job does not resume (Fleet's trainer resumes from its donefile.txt
checkpoints; the example starts afresh): `--out_dir` is wiped.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cube.donefile import format_fleet_line
from cube.flags import FlagError, Flags, FlagSet, run_cli
from cube.fsutil import atomic_write_json, fsync_dir
from examples.ctr import samples as sample_io
from examples.ctr.data import Split, list_splits
from examples.ctr.model import auc, pool
from examples.ctr.store import MODELS, ModelMeta

REPO = Path(__file__).resolve().parents[2]
TABLE = "embedding"  # the sparse table's name (its parameter): the embeddings of every model
FIRST_ORDER = "first_order"  # DeepFM's second table: a weight per feature (its lookup: 3 wide)
MODELS_KNOWN = ("deepfm", "dnn")
VOCAB = 1 << 30  # declared; a PS lookup uses the raw uint64 id whatever the size
DONE = "PADDLE TRAINER DONE"  # the job's last line on success (the launcher exits 0 anyway)
FLEET_BASE, FLEET_PATCH = "xbox_base_done.txt", "xbox_patch_done.txt"
DESC = "fleet_desc.prototxt"
LAYOUT = "layout.json"  # beside the inference model: the slots and the served dim it expects
# The served numbers are the text's 6 significant digits (|text - x| <= 5e-6 |x|) read as
# float32 (2^-24 more), pooled in float32 by two programs (up to 3 ids a slot: 2 x 3 x 2^-24):
# a pooled input is off by at most RHO x the sum of the magnitudes it adds up.
RHO = 5e-6 + 2**-24 * (1 + 6)
# Two runtimes (this Paddle's executor, the predictor's paddle.inference) evaluate the MLP in
# float32 with their own kernels: what the same input may differ by, in probability.
EVAL_NOISE = 1e-6

# CtrCommonAccessor with PaddleRec's thresholds (models/rank/slot_dnn/config_online.yaml)
ACCESSOR = {
    "accessor.accessor_class": "CtrCommonAccessor",
    "accessor.embedx_threshold": 10,
    "accessor.ctr_accessor_param.nonclk_coeff": 0.1,
    "accessor.ctr_accessor_param.click_coeff": 1.0,
    "accessor.ctr_accessor_param.base_threshold": 1.5,
    "accessor.ctr_accessor_param.delta_threshold": 0.25,
    "accessor.ctr_accessor_param.delta_keep_days": 16.0,
    "accessor.ctr_accessor_param.show_click_decay_rate": 0.98,
    "accessor.ctr_accessor_param.delete_threshold": 0.8,
    "accessor.ctr_accessor_param.delete_after_unseen_days": 30.0,
    **{
        f"accessor.{part}_sgd_param.{key}": value
        for part in ("embed", "embedx")
        for key, value in {
            "name": "SparseAdaGradSGDRule",
            "adagrad.learning_rate": 0.05,
            "adagrad.initial_g2sum": 3.0,
            "adagrad.initial_range": 0.0001,
        }.items()
    },
}


def say(text: str) -> None:
    print(text, flush=True)


# ---------------------------------------------------------------------------------------------
# numpy helpers (no Paddle: the tests use them in the project's environment)


def slot_feeds(samples: sample_io.Samples, slot_ids: np.ndarray) -> dict[str, np.ndarray]:
    """A mini-batch's feeds: per slot its ids (uint64 as int64, [n, 1]), their [show, click]
    (1, the sample's label) for the cvm op, and the 0/1 matrix that sums them per sample."""
    n = len(samples)
    feeds = {"label": samples.labels.reshape(-1, 1).astype(np.float32)}
    sample_of = samples.sample_of
    for index, slot in enumerate(slot_ids.tolist()):
        mask = samples.slots == slot
        keys = samples.feasigns[mask]
        owners = sample_of[mask]
        feeds[f"slot{index}_ids"] = keys.astype(np.uint64).view(np.int64).reshape(-1, 1)
        show_click = np.ones((keys.shape[0], 2), np.float32)
        show_click[:, 1] = samples.labels[owners]
        feeds[f"slot{index}_show_click"] = show_click
        pooling = np.zeros((n, keys.shape[0]), np.float32)
        pooling[owners, np.arange(keys.shape[0])] = 1.0
        feeds[f"slot{index}_pool"] = pooling
    return feeds


class ServedTable:
    """What Cube serves of the versions saved so far, in the trainer's exact float32: a base
    replaces it, a delta updates it (Cube's semantics for parameter-server saves)."""

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.keys = np.zeros(0, np.uint64)
        self.rows = np.zeros((0, dim), np.float32)

    def apply(self, keys: np.ndarray, rows: np.ndarray, base: bool) -> None:
        if base:
            order = np.argsort(keys)
            self.keys, self.rows = keys[order], rows[order]
            return
        kept = ~np.isin(self.keys, keys)
        merged_keys = np.concatenate([self.keys[kept], keys])
        merged_rows = np.concatenate([self.rows[kept], rows])
        order = np.argsort(merged_keys)
        self.keys, self.rows = merged_keys[order], merged_rows[order]

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """Rows of `keys`; zeros for a key not served (as the predictor pools a miss)."""
        if not self.keys.shape[0]:
            return np.zeros((keys.shape[0], self.dim), np.float32)
        at = np.minimum(np.searchsorted(self.keys, keys), self.keys.shape[0] - 1)
        found = self.keys[at] == keys
        return np.where(found[:, None], self.rows[at], np.float32(0.0))


def mlp_gradients(pooled: np.ndarray, layers: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """d logit / d pooled input for each sample of a relu MLP (`layers`: (w, b), the last
    linear), in float64: (n, inputs)."""
    h = pooled.astype(np.float64)
    masks = []
    for w, b in layers[:-1]:
        pre = h @ w.astype(np.float64) + b.astype(np.float64)
        masks.append(pre > 0)
        h = np.maximum(pre, 0.0)
    grad = np.broadcast_to(layers[-1][0].astype(np.float64)[:, 0], (pooled.shape[0], h.shape[1]))
    for (w, _), mask in zip(reversed(layers[:-1]), reversed(masks), strict=True):
        grad = (grad * mask) @ w.astype(np.float64).T
    return np.asarray(grad)


def fm_gradients(pooled: np.ndarray, slots: int) -> np.ndarray:
    """d fm / d pooled embeddings of the FM interaction 0.5 x sum_k ((sum_s e_sk)^2 -
    sum_s e_sk^2), per sample: e_sk's is sum_s' e_s'k - e_sk (float64, (n, slots x dim))."""
    fields = pooled.astype(np.float64).reshape(pooled.shape[0], slots, -1)
    grad = fields.sum(axis=1, keepdims=True) - fields
    return np.asarray(grad.reshape(pooled.shape[0], -1))


def probability_bounds(
    prob: np.ndarray, gradients: np.ndarray, magnitudes: np.ndarray
) -> np.ndarray:
    """How far a served probability may be from the trainer's, per sample: the pooled inputs
    are each off by at most RHO x `magnitudes` (the sum of |embedding| they add up), the logit
    then by sum_j |d logit / d x_j| x that (first order; the MLP is piecewise linear), the
    probability by p (1 - p) x that; plus EVAL_NOISE for two float32 runtimes."""
    p = prob.astype(np.float64)
    logit_error = RHO * (np.abs(gradients) * magnitudes).sum(axis=1)
    return np.asarray(p * (1.0 - p) * logit_error + EVAL_NOISE)


def saved_rows(folder: Path, embedx_dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A CtrCommonAccessor + adagrad table folder (plain parts: modes 1 and 2): its keys, the
    served columns of each row as the text has them ([embed_w, embedx_w...], float64), and
    whether each row has its embedx part. A row whose show/click score is below
    embedx_threshold when saved (the shrink's decay counts) is written without it, even when
    the trainer holds embedx weights for it: the version serves zeros there."""
    keys: list[int] = []
    rows: list[list[float]] = []
    full: list[bool] = []
    for part in sorted(folder.glob("part-*")):
        for line in part.read_text().splitlines():
            fields = line.split()
            if not fields:
                continue
            # key slot unseen delta_score show click embed_w embed_g2sum [embedx_w... g2sum]
            embedx = [float(v) for v in fields[8 : 8 + embedx_dim]]
            keys.append(int(fields[0]))
            rows.append([float(fields[6]), *(embedx or [0.0] * embedx_dim)])
            full.append(bool(embedx))
    text = np.array(rows, dtype=np.float64).reshape(-1, 1 + embedx_dim)
    return np.array(keys, dtype=np.uint64), text, np.array(full, dtype=bool)


def as_saved(where: str, text: np.ndarray, full: np.ndarray, pulled: np.ndarray) -> np.ndarray:
    """The version's rows in the trainer's exact float32: its lookup right after the save
    (`pulled`), without the embedx part where the save left it out. RuntimeError when a value
    differs from the saved text by more than its 6 significant digits allow (a push that
    landed after the save: the version's numbers would not be the trainer's)."""
    rows = pulled.astype(np.float32).copy()
    rows[~full, 1:] = 0.0
    off = np.abs(rows.astype(np.float64) - text) > 5e-6 * np.abs(text) + 1e-30
    if off.any():
        row = int(np.flatnonzero(off.any(axis=1))[0])
        raise RuntimeError(
            f"{where}: {int(off.any(axis=1).sum())} saved rows differ from the pserver's values "
            f"(first: row {row}, text {text[row].tolist()}, pulled {pulled[row].tolist()})"
        )
    return rows


# ---------------------------------------------------------------------------------------------
# the Fleet job (both roles)


@dataclass(frozen=True)
class Sparse:
    """One sparse table of the model: its parameter's name and its lookup's width (show,
    click, embed_w, embedx_w x (dim - 3)); what Cube serves of a row is its last dim - 2."""

    name: str
    dim: int

    @property
    def served_dim(self) -> int:
        return self.dim - 2


def model_tables(model: str, dim: int, wide_dim: int = 3) -> list[Sparse]:
    """The sparse tables of `model`: the CTR-DNN's one embedding table; DeepFM's first-order
    weights (a lookup of `wide_dim`, 3: show, click, embed_w; served: one float, the feature's
    weight; wider, its served floats add up to the weight) and its embeddings (`dim` wide;
    served: dim - 2 floats, the FM's and the DNN's input)."""
    if model == "dnn":
        return [Sparse(TABLE, dim)]
    if model == "deepfm":
        return [Sparse(FIRST_ORDER, wide_dim), Sparse(TABLE, dim)]
    raise ValueError(f"model {model!r}: one of {', '.join(MODELS_KNOWN)}")


class PaddleJob:
    """The trainer role: the network, the pserver's tables, one pass per split."""

    def __init__(self, flags: Any) -> None:
        import paddle
        import paddle.distributed.fleet as fleet

        self.paddle, self.fleet = paddle, fleet
        self.flags = flags
        self.out = Path(flags.out_dir)
        self.models = self.out / MODELS
        self.slot_ids = np.arange(1, flags.slots + 1, dtype=np.int64)
        self.model = flags.model
        self.tables = model_tables(flags.model, flags.dim, flags.wide_dim)
        self.served_dim = flags.dim - 2  # the embedding table's served width
        hidden = [int(h) for h in flags.hidden.split(",")]
        paddle.enable_static()
        fleet.init(fleet.PaddleCloudRoleMaker(is_collective=False))
        self._build(hidden)
        strategy = fleet.DistributedStrategy()
        strategy.a_sync = True
        strategy.sparse_table_configs = {
            table.name: {
                f"table_parameters.{table.name}.{key}": value
                for key, value in {"shard_num": flags.table_shards, **ACCESSOR}.items()
            }
            for table in self.tables
        }
        optimizer = paddle.optimizer.Adam(flags.dense_lr)
        fleet.distributed_optimizer(optimizer, strategy).minimize(self.loss)

    def _build(self, hidden: list[int]) -> None:
        """The network. Per slot and table: `sparse_embedding` -> cvm (show and click dropped)
        -> sum pool per sample; `self.inputs` are the pooled inputs of the dense part, one per
        table ([n, slots x served dim], in the tables' order). The CTR-DNN: fc layers on the
        pooled embeddings. DeepFM: logit = sum of the first-order weights + the FM interaction
        of the slots' pooled embeddings (0.5 x sum_k ((sum_s e_sk)^2 - sum_s e_sk^2)) + the
        fc layers on them (whose last bias is the model's bias)."""
        paddle = self.paddle
        pooled: dict[str, list[Any]] = {table.name: [] for table in self.tables}
        self.lookups: dict[str, list[Any]] = {table.name: [] for table in self.tables}
        for index in range(self.slot_ids.shape[0]):
            ids = paddle.static.data(f"slot{index}_ids", [-1, 1], "int64")
            show_click = paddle.static.data(f"slot{index}_show_click", [-1, 2], "float32")
            pooling = paddle.static.data(f"slot{index}_pool", [-1, -1], "float32")
            for table in self.tables:
                emb = paddle.static.nn.sparse_embedding(
                    ids, size=[VOCAB, table.dim], param_attr=paddle.ParamAttr(name=table.name)
                )
                self.lookups[table.name].append(emb)
                values = paddle.static.nn.continuous_value_model(emb, show_click, use_cvm=False)
                pooled[table.name].append(paddle.matmul(pooling, values))
        self.inputs = [paddle.concat(pooled[table.name], axis=1) for table in self.tables]
        self.x = self.inputs[-1]  # the pooled embeddings
        h = self.x
        self.dense_names: list[tuple[str, str]] = []
        for i, width in enumerate([*hidden, 1]):
            names = (f"dense_{i}.w", f"dense_{i}.b")
            self.dense_names.append(names)
            h = paddle.static.nn.fc(
                h,
                width,
                activation="relu" if i < len(hidden) else None,
                weight_attr=paddle.ParamAttr(name=names[0]),
                bias_attr=paddle.ParamAttr(name=names[1]),
            )
        if self.model == "deepfm":  # the first-order weights of the sample's features, summed
            first = paddle.sum(self.inputs[0], axis=1, keepdim=True)
            fields = paddle.reshape(self.x, [-1, self.slot_ids.shape[0], self.served_dim])
            summed = paddle.sum(fields, axis=1)
            fm = 0.5 * paddle.sum(
                paddle.square(summed) - paddle.sum(paddle.square(fields), axis=1),
                axis=1,
                keepdim=True,
            )
            h = h + first + fm
        self.logit = h
        self.prob = paddle.nn.functional.sigmoid(self.logit)
        label = paddle.static.data("label", [-1, 1], "float32")
        # a sum, not a mean: the sparse rule's step follows the gradient's size (adagrad)
        self.loss = paddle.sum(
            paddle.nn.functional.binary_cross_entropy_with_logits(
                self.logit, label, reduction="none"
            )
        )

    # -- the pserver's side -------------------------------------------------------------------
    def serve(self) -> None:
        self.fleet.init_server()
        self.fleet.run_server()

    # -- the trainer's side -------------------------------------------------------------------
    def start(self) -> None:
        paddle, fleet = self.paddle, self.fleet
        from google.protobuf import text_format
        from paddle.distributed.ps.utils.public import get_the_one_recv_context

        self.exe = paddle.static.Executor(paddle.CPUPlace())
        self.exe.run(paddle.static.default_startup_program())
        fleet.init_worker()
        self.main = paddle.static.default_main_program()
        self.scope = paddle.static.global_scope()
        self.runtime = fleet.fleet._runtime_handle
        self.dense_map = get_the_one_recv_context(
            self.runtime.context, split_dense_table=self.runtime.is_heter_ps_mode
        )
        desc = self.runtime.ps_desc_builder.ps_desc
        self.models.mkdir(parents=True, exist_ok=True)
        atomic = self.models / f".{DESC}.tmp"
        atomic.write_text(text_format.MessageToString(desc))
        os.replace(atomic, self.models / DESC)
        # each sparse table's folder in a save: its table id, as the PSParameter numbers it
        ids = {
            t.common.table_name: f"{t.table_id:03d}"
            for t in desc.worker_param.downpour_worker_param.downpour_table_param
        }
        self.folders = {table.name: ids[table.name] for table in self.tables}
        self.table_folder = self.folders[TABLE]
        self.infer = self.main.clone(for_test=True)._prune_with_input(
            [x.name for x in self.inputs], [self.prob]
        )
        feeds = [f"slot{i}_ids" for i in range(self.slot_ids.shape[0])]
        self.pulls = {
            table.name: self.main.clone(for_test=True)._prune_with_input(
                feeds, self.lookups[table.name][:1]
            )
            for table in self.tables
        }
        self.served = {table.name: ServedTable(table.served_dim) for table in self.tables}
        self.pass_no = 0
        self.day = ""
        self.day_pass = 0
        self.base_id = 0

    def pull_dense(self) -> None:
        """The dense parameters from the pserver into the trainer's scope (a_sync pushes the
        gradients; Fleet's dataset trainer pulls in a thread, exe.run does not)."""
        self.runtime._pull_all_dense(self.runtime.scopes, self.runtime._send_ctx, self.dense_map)

    def run_pass(self, split: Split, heldout_dir: Path | None) -> ModelMeta:
        self.pass_no += 1
        if split.day != self.day:
            self.day, self.day_pass = split.day, 0
        self.day_pass += 1
        base = self.day_pass == 1
        samples = sample_io.concat([sample_io.read_file(str(p)) for p in split.parts()])
        streaming = []
        batch = self.flags.batch
        for start in range(0, len(samples), batch):
            chunk = samples.take(start, min(start + batch, len(samples)))
            [prob] = self.exe.run(
                self.main, feed=slot_feeds(chunk, self.slot_ids), fetch_list=[self.prob]
            )
            streaming.append(np.asarray(prob)[:, 0])
            self.pull_dense()
        streaming_auc = auc(samples.labels, np.concatenate(streaming))
        self.runtime._worker.client_flush()  # every push sent and applied before the save
        self.pull_dense()
        version_id = split.timestamp
        if base:
            self.base_id = version_id
        name = "base" if base else f"delta-{self.day_pass}"
        final = self.models / split.day / name
        tmp = final.with_name(f".tmp-{name}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.parent.mkdir(parents=True, exist_ok=True)
        if base:
            self.fleet.shrink()  # the day's shrink, then its base
        self.fleet.save_persistables(self.exe, str(tmp), mode=2 if base else 1)
        counts: dict[str, int] = {}
        dropped = 0
        for table in self.tables:
            folder = tmp / self.folders[table.name]
            keys, text, full = saved_rows(folder, table.served_dim - 1)
            where = f"{split.day}/{name}/{self.folders[table.name]}"
            rows = as_saved(where, text, full, self._pull(table, keys))
            served = self.served[table.name]
            if table.name == TABLE:
                dropped = int((~np.isin(served.keys, keys)).sum()) if base else 0
            served.apply(keys, rows, base)
            counts[table.name] = int(keys.shape[0])
        self._save_dense(tmp / "dnn_plugin")
        offline_auc, heldout_n = self._evaluate(split, heldout_dir, tmp)
        meta = ModelMeta(
            id=version_id,
            kind="base" if base else "delta",
            base=self.base_id,
            pass_no=self.pass_no,
            day_pass=self.day_pass,
            split=split.name,
            features=counts[TABLE],
            deleted=dropped,
            table_size=int(self.served[TABLE].keys.shape[0]),
            streaming_auc=streaming_auc,
            offline_auc=offline_auc,
            heldout_samples=heldout_n,
            dim=self.served_dim,
            written_at=time.time(),
        )
        atomic_write_json(tmp / "meta.json", asdict(meta))
        fsync_dir(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        fsync_dir(final.parent)
        self._announce(meta, final)
        tables = ", ".join(
            f"{self.folders[t.name]} ({t.name}): {counts[t.name]:,} rows saved, "
            f"{self.served[t.name].keys.shape[0]:,} served"
            for t in self.tables
        )
        say(
            f"pass {meta.pass_no} {meta.split} {meta.kind} {meta.version}: streaming AUC "
            f"{streaming_auc:.4f}, offline {offline_auc:.4f}; {tables}; {dropped:,} dropped "
            "by the base"
        )
        return meta

    def _pull(self, table: Sparse, keys: np.ndarray) -> np.ndarray:
        """The served columns of `keys` in `table` as the trainer's lookup returns them
        (float32)."""
        if not keys.shape[0]:
            return np.zeros((0, table.served_dim), np.float32)
        ids = keys.view(np.int64).reshape(-1, 1)
        feed = {f"slot{i}_ids": ids if i == 0 else ids[:1] for i in range(self.slot_ids.shape[0])}
        lookup = self.lookups[table.name][0]
        [rows] = self.exe.run(self.pulls[table.name], feed=feed, fetch_list=[lookup])
        return np.asarray(rows, dtype=np.float32)[:, 2:]  # without show, click

    def _layers(self) -> list[tuple[np.ndarray, np.ndarray]]:
        def value(name: str) -> np.ndarray:
            return np.array(self.scope.find_var(name).get_tensor())

        return [(value(w), value(b)) for w, b in self.dense_names]

    def _save_dense(self, directory: Path) -> None:
        directory.mkdir(parents=True)
        self.paddle.static.save_inference_model(
            str(directory / "model"), self.inputs, [self.prob], self.exe, program=self.infer
        )
        layout: dict[str, Any] = {
            "slot_ids": self.slot_ids.tolist(),
            "dim": self.served_dim,
            "input": self.x.name,
        }
        if self.model != "dnn":  # the inputs in order: the table each pools and its width
            layout["model"] = self.model
            layout["inputs"] = [
                {"name": x.name, "table": self.folders[t.name], "dim": t.served_dim}
                for x, t in zip(self.inputs, self.tables, strict=True)
            ]
        atomic_write_json(directory / LAYOUT, layout)

    def _evaluate(self, split: Split, heldout_dir: Path | None, model: Path) -> tuple[float, int]:
        """The trainer's probabilities on the split's held-out samples with the version as
        saved, their bounds, and the offline AUC; written to heldout.npz."""
        path = heldout_dir / split.day / split.path.name if heldout_dir else None
        if path is None or not path.is_dir():
            return float("nan"), 0
        parts = sorted(path.glob("part-*"))
        samples = sample_io.concat([sample_io.read_file(str(p)) for p in parts])
        feasigns = samples.feasigns.astype(np.uint64)
        pooled, magnitudes = [], []
        for table in self.tables:
            rows = self.served[table.name].lookup(feasigns)
            pooled.append(pool(rows, samples, self.slot_ids))
            magnitudes.append(pool(np.abs(rows), samples, self.slot_ids))
        feed = {x.name: p for x, p in zip(self.inputs, pooled, strict=True)}
        [prob] = self.exe.run(self.infer, feed=feed, fetch_list=[self.prob])
        prob = np.asarray(prob, dtype=np.float32)[:, 0]
        gradients = mlp_gradients(pooled[-1], self._layers())
        if self.model == "deepfm":
            gradients = np.concatenate(
                [np.ones_like(pooled[0], np.float64), gradients + fm_gradients(pooled[-1],
                 self.slot_ids.shape[0])], axis=1
            )  # fmt: skip
        bounds = probability_bounds(prob, gradients, np.concatenate(magnitudes, axis=1))
        with open(model / "heldout.npz", "wb") as file:
            np.savez(file, probability=prob, bound=bounds, labels=samples.labels)
        return auc(samples.labels, prob), len(samples)

    def _announce(self, meta: ModelMeta, final: Path) -> None:
        """Fleet's donefile line. Its input is the save (FleetUtil's `<day>/base` or
        `<day>/delta-<n>`: cube-builder builds each sparse table of it into one version) for
        a model of several tables, the table's folder for the CTR-DNN's one."""
        from cube.donefile import append_line

        source = f"{final}/{self.table_folder}" if len(self.tables) == 1 else str(final)
        line = format_fleet_line(str(meta.id), str(meta.base), source, str(self.models), meta.day)
        append_line(self.models / (FLEET_BASE if meta.kind == "base" else FLEET_PATCH), line)


def job(flags: Any) -> None:
    """One role of the Fleet job (the launcher sets TRAINING_ROLE)."""
    trainer = PaddleJob(flags)
    if trainer.fleet.is_server():
        trainer.serve()
        return
    trainer.start()
    data_dir = Path(flags.data_dir)
    heldout_dir = Path(flags.heldout_dir) if flags.heldout_dir else None
    done: set[str] = set()
    idle_since = time.monotonic()
    while flags.passes == 0 or trainer.pass_no < flags.passes:
        pending = [s for s in list_splits(data_dir) if s.name not in done]
        if not pending:
            if time.monotonic() - idle_since > flags.wait_timeout:
                say(f"no new split in {data_dir} for {flags.wait_timeout:g}s; stopping")
                break
            time.sleep(flags.poll)
            continue
        trainer.run_pass(pending[0], heldout_dir)
        done.add(pending[0].name)
        idle_since = time.monotonic()
    say(DONE)
    trainer.fleet.stop_worker()


# ---------------------------------------------------------------------------------------------
# the command: starts the job and waits for it


def flag_set() -> FlagSet[Flags]:
    return (
        FlagSet(
            "python -m examples.ctr.paddle_trainer",
            "Streaming CTR trainer on PaddlePaddle's parameter server (paddlepaddle 2.6.2).",
        )
        .add("data_dir", str, "", "the stream: <data_dir>/<YYYYMMDD>/<HHMM>/", required=True)
        .add("out_dir", str, "", "models and donefiles go here (wiped first)", required=True)
        .add("heldout_dir", str, "", "held-out splits, same layout (offline AUC, probabilities)")
        .add("slots", int, 8, "slot ids 1..slots")
        .add(
            "model",
            str,
            "deepfm",
            "deepfm (two tables: first-order weights, embeddings) or dnn (one embedding table)",
        )
        .add(
            "wide_dim",
            int,
            3,
            "deepfm: the first-order table's lookup width (3: show, click, "
            "embed_w, one weight served; wider: the served floats add up to the weight)",
        )
        .add("dim", int, 10, "the embeddings' lookup width D: show, click, embed_w, D - 3 embedx_w")
        .add("hidden", str, "32,16", "widths of the hidden fc layers")
        .add("dense_lr", float, 0.002, "Adam learning rate of the fc layers")
        .add("batch", int, 256, "mini-batch size")
        .add("table_shards", int, 4, "shards of the sparse table (files per save)")
        .add("passes", int, 0, "stop after this many passes (0: when the stream stops)")
        .add("wait_timeout", float, 60.0, "stop when no new split appears for this long (s)")
        .add("poll", float, 0.2, "seconds between looks for a new split")
        .add("timeout", float, 3600.0, "seconds the whole job may take")
    )


def launch(flags: Any, argv: Sequence[str]) -> int:
    """Run the Fleet job (1 pserver + 1 trainer) and wait for it; 0 when the trainer said
    it was done (the launcher exits 0 even when a role failed: the worker's log says)."""
    out = Path(flags.out_dir)
    for old in (out / MODELS, out / "logs" / "paddle"):  # no resuming: a fresh start
        shutil.rmtree(old, ignore_errors=True)
    logs = out / "logs" / "paddle"
    logs.mkdir(parents=True)
    (out / MODELS).mkdir()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    command = [
        sys.executable, "-m", "paddle.distributed.launch", "--server_num=1", "--worker_num=1",
        "--log_dir", str(logs), str(Path(__file__).resolve()), *argv,
    ]  # fmt: skip
    say(f"starting the Fleet job (1 pserver + 1 trainer); logs in {logs}")
    worker_log = logs / "workerlog.0"
    shown = 0
    proc = subprocess.Popen(
        command, cwd=out, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + flags.timeout
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            shown = _relay(worker_log, shown)
            time.sleep(0.2)
        if proc.poll() is None:
            say(f"error: the Fleet job did not end within {flags.timeout:g}s")
            return 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    _relay(worker_log, shown)
    text = worker_log.read_text(errors="replace") if worker_log.exists() else ""
    if DONE not in text:
        tail = "\n".join(text.splitlines()[-30:])
        say(f"error: the trainer failed (launcher exit {proc.returncode}); {worker_log}:\n{tail}")
        return 1
    return 0


def _relay(log: Path, shown: int) -> int:
    """Print the worker's new progress lines (`pass ...`); the count of lines seen."""
    if not log.exists():
        return shown
    lines = log.read_text(errors="replace").splitlines()
    for line in lines[shown:]:
        if line.startswith(("pass ", "no new split", "error")):
            say(line)
    return len(lines)


def run(argv: Sequence[str]) -> int:
    flags = flag_set().parse(argv)
    if flags.slots < 1 or flags.dim < 4 or flags.batch < 1 or flags.table_shards < 1:
        raise FlagError("--slots >= 1, --dim >= 4, --batch >= 1 and --table_shards >= 1")
    if flags.wide_dim < 3:
        raise FlagError("--wide_dim >= 3 (show, click, embed_w)")
    if flags.model not in MODELS_KNOWN:
        raise FlagError(f"--model {flags.model!r}: one of {', '.join(MODELS_KNOWN)}")
    if "TRAINING_ROLE" in os.environ:  # a role of the job, started by the launcher
        job(flags)
        return 0
    return launch(flags, argv)


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    sys.exit(main())
