"""The CTR model, in numpy: per-slot sum-pooled embeddings (the sparse part, served by Cube) and a
small MLP (the dense part, kept by the predictor beside each version).

    pooled[i, s] = sum of the embeddings of sample i's features in slot s   (n, slots * dim)
    ctr[i]       = sigmoid(w2 . relu(w1 . pooled[i] + b1) + b2)

The trainer and the predictor share `pool` and `Dense.predict`, so a prediction served from
Cube's embeddings is the same computation, in the same order, as the trainer's own evaluation of
the version it saved: the served AUC equals the offline AUC whenever the served embeddings are
the trained ones. A feature without an embedding (never seen, or shrunk away) pools as zeros.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from examples.ctr.samples import SampleError, Samples


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve (ties count half); nan when one class is absent."""
    positive: np.ndarray = np.asarray(labels) > 0
    n_pos = int(positive.sum())
    n_neg = int(positive.shape[0]) - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    _, inverse, counts = np.unique(np.asarray(scores), return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    average_rank = (ends - counts + 1 + ends) / 2.0
    rank_sum = float(average_rank[inverse][positive].sum())
    return (rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)


def slot_index(slot_ids: np.ndarray, samples: Samples) -> np.ndarray:
    """The position of each feature's slot in the model's sorted `slot_ids`; SampleError naming
    the sample and feature whose slot the model does not have."""
    pos: np.ndarray = np.minimum(np.searchsorted(slot_ids, samples.slots), slot_ids.shape[0] - 1)
    bad = slot_ids[pos] != samples.slots
    if bad.any():
        at = int(np.flatnonzero(bad)[0])
        sample = int(np.searchsorted(samples.offsets, at, side="right")) - 1
        raise SampleError(
            f"sample {sample}: feature {at - int(samples.offsets[sample]) + 1} is in slot "
            f"{int(samples.slots[at])}, which the model does not have (slots "
            f"{int(slot_ids[0])}..{int(slot_ids[-1])})"
        )
    return pos


def pool(rows: np.ndarray, samples: Samples, slot_ids: np.ndarray) -> np.ndarray:
    """Sum `rows` (one embedding per feature of `samples`, in their order) per sample and slot:
    (n, slots * dim), float32 for float32 rows."""
    n, n_slots, dim = len(samples), slot_ids.shape[0], rows.shape[1]
    segment = samples.sample_of * n_slots + slot_index(slot_ids, samples)
    pooled = np.zeros((n * n_slots, dim), dtype=rows.dtype)
    np.add.at(pooled, segment, rows)
    return pooled.reshape(n, n_slots * dim)


@dataclass
class Dense:
    """The MLP on the pooled embeddings, and the layout it expects (slots, dim)."""

    slot_ids: np.ndarray  # int64, sorted
    dim: int
    w1: np.ndarray  # (slots * dim, hidden)
    b1: np.ndarray  # (hidden,)
    w2: np.ndarray  # (hidden, 1)
    b2: np.ndarray  # (1,)

    @classmethod
    def initial(
        cls, slot_ids: np.ndarray, dim: int, hidden: int, rng: np.random.Generator
    ) -> Dense:
        fan_in = slot_ids.shape[0] * dim
        return cls(
            np.asarray(slot_ids, dtype=np.int64),
            dim,
            (rng.standard_normal((fan_in, hidden)) * np.sqrt(2.0 / fan_in)).astype(np.float32),
            np.zeros(hidden, np.float32),
            (rng.standard_normal((hidden, 1)) * np.sqrt(1.0 / hidden)).astype(np.float32),
            np.zeros(1, np.float32),
        )

    @property
    def params(self) -> dict[str, np.ndarray]:
        return {"w1": self.w1, "b1": self.b1, "w2": self.w2, "b2": self.b2}

    def logits(self, pooled: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(logits (n,), hidden pre-activation, hidden activation)."""
        pre = pooled @ self.w1 + self.b1
        hidden = np.maximum(pre, 0.0)
        return (hidden @ self.w2 + self.b2)[:, 0], pre, hidden

    def predict(self, pooled: np.ndarray) -> np.ndarray:
        """CTRs (n,) float64."""
        return _sigmoid(self.logits(pooled)[0].astype(np.float64))

    def save(self, path: Path) -> None:
        """Write as .npz (no pickles) to `path`, synced (the caller renames its directory into
        place)."""
        with open(path, "wb") as file:
            # numpy's stub: a **dict of arrays could fill its allow_pickle flag
            np.savez(file, slot_ids=self.slot_ids, dim=np.int64(self.dim), **self.params)  # type: ignore[arg-type]
            file.flush()
            os.fsync(file.fileno())

    @classmethod
    def load(cls, path: Path) -> Dense:
        """Read a dense.npz; ValueError naming the file when it is not one this model wrote."""
        try:
            with np.load(path, allow_pickle=False) as npz:
                arrays = {name: npz[name] for name in ("slot_ids", "dim", "w1", "b1", "w2", "b2")}
        except (OSError, KeyError, ValueError, EOFError) as exc:
            raise ValueError(f"{path}: not a dense parameter file ({type(exc).__name__})") from None
        dense = cls(
            arrays["slot_ids"].astype(np.int64),
            int(arrays["dim"]),
            arrays["w1"].astype(np.float32),
            arrays["b1"].astype(np.float32),
            arrays["w2"].astype(np.float32),
            arrays["b2"].astype(np.float32),
        )
        hidden = dense.b1.shape[0]
        expected = {
            "w1": (dense.slot_ids.shape[0] * dense.dim, hidden),
            "w2": (hidden, 1),
            "b2": (1,),
        }
        for name, shape in expected.items():
            if dense.params[name].shape != shape:
                raise ValueError(
                    f"{path}: {name} has shape {dense.params[name].shape}, not {shape}"
                )
        return dense


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))  # no overflow warnings for large |z|


# ---------------------------------------------------------------------------------------------
# training state


@dataclass
class SparseTable:
    """The trainer's embedding table: rows addressed by feasign, Adagrad state, the pass each
    row was last seen in (for shrink) and whether it changed since the last save (for deltas).
    Keys are found with a sorted copy (`searchsorted`), so nothing loops per key in Python."""

    dim: int
    init_scale: float = 0.01
    keys: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    emb: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))
    g2: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))
    last_seen: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    dirty: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    sorted_keys: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    sorted_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    def __post_init__(self) -> None:
        if self.emb.shape[1:] != (self.dim,):
            self.emb = self.emb.reshape(0, self.dim).astype(np.float32)
            self.g2 = self.g2.reshape(0, self.dim).astype(np.float32)

    def __len__(self) -> int:
        return int(self.keys.shape[0])

    def find(self, keys: np.ndarray) -> np.ndarray:
        """Row of each key, -1 where the table does not have it."""
        if not len(self):
            return np.full(keys.shape[0], -1, np.int64)
        pos = np.minimum(np.searchsorted(self.sorted_keys, keys), len(self) - 1)
        return np.where(self.sorted_keys[pos] == keys, self.sorted_rows[pos], -1)

    def rows(self, unique_keys: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Rows of distinct `unique_keys`, adding the missing ones (small random vectors)."""
        rows = self.find(unique_keys)
        missing = rows < 0
        if missing.any():
            new_keys = np.sort(unique_keys[missing])
            first = len(self)
            count = new_keys.shape[0]
            init = (rng.standard_normal((count, self.dim)) * self.init_scale).astype(np.float32)
            self.keys = np.concatenate([self.keys, new_keys])
            self.emb = np.concatenate([self.emb, init])
            self.g2 = np.concatenate([self.g2, np.zeros((count, self.dim), np.float32)])
            self.last_seen = np.concatenate([self.last_seen, np.zeros(count, np.int64)])
            self.dirty = np.concatenate([self.dirty, np.ones(count, bool)])
            at = np.searchsorted(self.sorted_keys, new_keys)
            self.sorted_keys = np.insert(self.sorted_keys, at, new_keys)
            self.sorted_rows = np.insert(self.sorted_rows, at, np.arange(first, first + count))
            rows = self.find(unique_keys)
        return rows

    def embeddings(self, keys: np.ndarray) -> np.ndarray:
        """(n, dim) rows of `keys`; zeros for keys not in the table (as Cube answers misses)."""
        rows = self.find(keys)
        out = np.zeros((keys.shape[0], self.dim), np.float32)
        hit = rows >= 0
        out[hit] = self.emb[rows[hit]]
        return out

    def shrink(self, now: int, unseen_passes: int) -> np.ndarray:
        """Drop rows not seen in the last `unseen_passes` passes; the dropped keys, sorted."""
        keep = now - self.last_seen < unseen_passes
        dropped = np.sort(self.keys[~keep])
        if dropped.shape[0]:
            self.keys, self.emb, self.g2 = self.keys[keep], self.emb[keep], self.g2[keep]
            self.last_seen, self.dirty = self.last_seen[keep], self.dirty[keep]
            self.sorted_rows = np.argsort(self.keys, kind="stable")
            self.sorted_keys = self.keys[self.sorted_rows]
        return dropped

    def arrays(self) -> dict[str, np.ndarray]:
        return {
            "keys": self.keys,
            "emb": self.emb,
            "g2": self.g2,
            "last_seen": self.last_seen,
            "dirty": self.dirty,
        }

    @classmethod
    def of(cls, keys: np.ndarray, emb: np.ndarray) -> SparseTable:
        """A table of these rows and no training state (to look a saved version up)."""
        n, dim = emb.shape
        return cls.from_arrays(
            dim,
            0.0,
            {
                "keys": keys,
                "emb": emb,
                "g2": np.zeros_like(emb),
                "last_seen": np.zeros(n, np.int64),
                "dirty": np.zeros(n, bool),
            },
        )

    @classmethod
    def from_arrays(cls, dim: int, init_scale: float, arrays: dict[str, np.ndarray]) -> SparseTable:
        table = cls(
            dim, init_scale, **{k: arrays[k] for k in ("keys", "emb", "g2", "last_seen", "dirty")}
        )
        table.sorted_rows = np.argsort(table.keys, kind="stable")
        table.sorted_keys = table.keys[table.sorted_rows]
        return table


@dataclass
class Hyper:
    dim: int = 8
    hidden: int = 32
    sparse_lr: float = 0.05
    dense_lr: float = 0.003
    batch: int = 256
    init_scale: float = 0.01


@dataclass
class Model:
    """Sparse table + dense MLP + their optimizer state: what the trainer checkpoints."""

    hyper: Hyper
    table: SparseTable
    dense: Dense
    adam_m: dict[str, np.ndarray]
    adam_v: dict[str, np.ndarray]
    steps: int = 0

    @classmethod
    def initial(cls, slot_ids: np.ndarray, hyper: Hyper, rng: np.random.Generator) -> Model:
        dense = Dense.initial(np.sort(slot_ids), hyper.dim, hyper.hidden, rng)
        zeros = {k: np.zeros_like(v) for k, v in dense.params.items()}
        return cls(
            hyper,
            SparseTable(hyper.dim, hyper.init_scale),
            dense,
            zeros,
            {k: v.copy() for k, v in zeros.items()},
        )

    def predict(self, samples: Samples) -> np.ndarray:
        """CTRs from the current table; features it lacks pool as zeros."""
        rows = self.table.embeddings(samples.feasigns)
        return self.dense.predict(pool(rows, samples, self.dense.slot_ids))

    def train(self, samples: Samples, pass_no: int, rng: np.random.Generator) -> float:
        """One epoch over `samples` in mini-batches, in order; the mean log loss."""
        total, batch = 0.0, self.hyper.batch
        for start in range(0, len(samples), batch):
            total += self._step(samples.take(start, min(start + batch, len(samples))), pass_no, rng)
        return total / max(len(samples), 1)

    def _step(self, samples: Samples, pass_no: int, rng: np.random.Generator) -> float:
        unique, inverse = np.unique(samples.feasigns, return_inverse=True)
        rows = self.table.rows(unique, rng)
        loss, dense_grads, row_grads = self.gradients(samples, self.table.emb[rows][inverse])
        d_rows = np.zeros((unique.shape[0], self.dense.dim), np.float32)
        np.add.at(d_rows, inverse, row_grads)  # summed per distinct feature
        self._adagrad(rows, d_rows, pass_no)
        self._adam(dense_grads)
        return loss

    def gradients(
        self, samples: Samples, emb: np.ndarray
    ) -> tuple[float, dict[str, np.ndarray], np.ndarray]:
        """Summed log loss of `samples` given the embedding of each feature `emb` (nnz, dim),
        the gradients of its mean over the batch w.r.t. the dense parameters, and w.r.t. each
        feature's embedding (nnz, dim)."""
        d = self.dense
        pooled = pool(emb, samples, d.slot_ids)
        logits, pre, hidden = d.logits(pooled)
        p = _sigmoid(logits.astype(np.float64))
        y = samples.labels.astype(np.float64)
        eps = 1e-7
        loss = float(-(y * np.log(p + eps) + (1 - y) * np.log(1 - p + eps)).sum())
        d_logit = ((p - y) / len(samples)).astype(pooled.dtype)[:, None]
        grads = {"w2": hidden.T @ d_logit, "b2": d_logit.sum(axis=0)}
        d_pre = (d_logit @ d.w2.T) * (pre > 0)
        grads["w1"] = pooled.T @ d_pre
        grads["b1"] = d_pre.sum(axis=0)
        d_pooled = (d_pre @ d.w1.T).reshape(-1, d.dim)
        segment = samples.sample_of * d.slot_ids.shape[0] + slot_index(d.slot_ids, samples)
        return loss, grads, d_pooled[segment]

    def _adagrad(self, rows: np.ndarray, grad: np.ndarray, pass_no: int) -> None:
        t = self.table
        t.g2[rows] += grad * grad
        t.emb[rows] -= self.hyper.sparse_lr * grad / (np.sqrt(t.g2[rows]) + 1e-6)
        t.last_seen[rows] = pass_no
        t.dirty[rows] = True

    def _adam(self, grads: dict[str, np.ndarray], b1: float = 0.9, b2: float = 0.999) -> None:
        self.steps += 1
        lr = self.hyper.dense_lr * np.sqrt(1 - b2**self.steps) / (1 - b1**self.steps)
        for name, param in self.dense.params.items():
            g = grads[name].astype(np.float32)
            self.adam_m[name] = b1 * self.adam_m[name] + (1 - b1) * g
            self.adam_v[name] = b2 * self.adam_v[name] + (1 - b2) * g * g
            param -= (lr * self.adam_m[name] / (np.sqrt(self.adam_v[name]) + 1e-8)).astype(
                np.float32
            )

    def state(self) -> dict[str, Any]:
        """Arrays of a checkpoint (npz-able)."""
        out: dict[str, Any] = {f"table_{k}": v for k, v in self.table.arrays().items()}
        out.update({f"dense_{k}": v for k, v in self.dense.params.items()})
        out.update({f"m_{k}": v for k, v in self.adam_m.items()})
        out.update({f"v_{k}": v for k, v in self.adam_v.items()})
        out["slot_ids"] = self.dense.slot_ids
        out["steps"] = np.int64(self.steps)
        return out

    @classmethod
    def from_state(cls, hyper: Hyper, arrays: dict[str, np.ndarray]) -> Model:
        names = ("w1", "b1", "w2", "b2")
        table = SparseTable.from_arrays(
            hyper.dim,
            hyper.init_scale,
            {k[len("table_") :]: v for k, v in arrays.items() if k.startswith("table_")},
        )
        dense = Dense(arrays["slot_ids"], hyper.dim, *(arrays[f"dense_{n}"] for n in names))
        return cls(
            hyper,
            table,
            dense,
            {n: arrays[f"m_{n}"] for n in names},
            {n: arrays[f"v_{n}"] for n in names},
            int(arrays["steps"]),
        )
