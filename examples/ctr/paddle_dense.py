"""The dense part of a version the Paddle trainer saved, served with `paddle.inference`.

The trainer (examples/ctr/paddle_trainer.py, paddlepaddle 2.6.2) writes each version's fc
layers with `paddle.static.save_inference_model` into `<model>/dnn_plugin/` (`model.pdmodel`,
`model.pdiparams`: the program from the pooled embeddings to the click probability) and
`layout.json` (the slots and the served embedding width it expects). The predictor runs it with
paddlepaddle 3.3.1's `paddle.inference`, which installs beside the project's numpy 2 and
protobuf 7 (the `ctr-paddle` extra) and reads 2.6.2's models: the same process looks up the
embeddings in Cube with the SDK and runs the dense part, as `model.Dense` does for the numpy
trainer's versions. Paddle is imported on the first such version only.

A model of several sparse tables (the trainer's DeepFM: first-order weights and embeddings)
takes one pooled input per table; `layout.json` lists them in the model's order, each with the
Cube table it pools (a table name of the version: Fleet's folder, `000`, `001`, ...) and its
served width:

    {"slot_ids": [1, ..., 8], "model": "deepfm",
     "inputs": [{"name": "concat_0.tmp_0", "table": "001", "dim": 1},
                {"name": "concat_1.tmp_0", "table": "000", "dim": 8}], ...}

A layout without `inputs` is a one-table model: its input `input` pools the version's one
table (the table "") at width `dim`.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np

PLUGIN = "dnn_plugin"
LAYOUT = "layout.json"


class PaddleDense:
    """`model.Dense`'s interface (slot_ids, dim, tables, predict, predict_inputs) over a Paddle
    inference model. `tables`: the (table, width) each input pools, in the model's order."""

    def __init__(
        self,
        slot_ids: np.ndarray,
        tables: list[tuple[str, int]],
        predictor: Any,
        names: list[str] | None = None,
    ) -> None:
        self.slot_ids = slot_ids
        self.tables = tables
        self.dim = tables[-1][1]
        self._predictor = predictor
        names = names or predictor.get_input_names()[: len(tables)]
        self._inputs = [predictor.get_input_handle(name) for name in names]
        self._output = predictor.get_output_handle(predictor.get_output_names()[0])
        self._lock = threading.Lock()  # a predictor runs one batch at a time

    @classmethod
    def load(cls, directory: Path) -> PaddleDense:
        """The dense part in `directory` (a model's dnn_plugin/); ValueError naming the file
        when it is not one the trainer wrote, ImportError when paddle is not installed."""
        try:
            layout = json.loads((directory / LAYOUT).read_text())
            slot_ids = np.array(layout["slot_ids"], dtype=np.int64)
            if "inputs" in layout:
                inputs = [
                    (str(i["name"]), str(i["table"]), int(i["dim"])) for i in layout["inputs"]
                ]
            else:
                inputs = [(str(layout.get("input", "")), "", int(layout["dim"]))]
            if not inputs or any(dim < 1 for _, _, dim in inputs):
                raise ValueError("no inputs")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(
                f"{directory / LAYOUT}: not a dense layout ({type(exc).__name__})"
            ) from None
        try:
            from paddle import inference
        except ImportError as exc:
            raise ImportError(
                "a Paddle trainer's version needs paddle.inference: pip install "
                "'cube-py[ctr-paddle]' (make paddle-env)"
            ) from exc
        model, params = directory / "model.pdmodel", directory / "model.pdiparams"
        for path in (model, params):
            if not path.is_file():
                raise ValueError(f"{path}: missing")
        config = inference.Config(str(model), str(params))
        config.disable_gpu()
        config.set_cpu_math_library_num_threads(1)
        config.disable_glog_info()
        try:
            predictor = inference.create_predictor(config)
        except (RuntimeError, ValueError) as exc:  # Paddle's own errors are RuntimeErrors
            raise ValueError(
                f"{model}: not a Paddle inference model ({type(exc).__name__})"
            ) from None
        names = predictor.get_input_names()
        wanted = [name for name, _, _ in inputs]
        if len(inputs) > 1 and sorted(wanted) != sorted(names):
            raise ValueError(f"{model}: its inputs are not the layout's")
        tables = [(table, dim) for _, table, dim in inputs]
        return cls(slot_ids, tables, predictor, wanted if len(inputs) > 1 else None)

    def predict(self, pooled: np.ndarray) -> np.ndarray:
        """CTRs (n,) float64 of a one-table model's pooled embeddings (n, slots * dim)."""
        return self.predict_inputs([pooled])

    def predict_inputs(self, pooled: list[np.ndarray]) -> np.ndarray:
        """CTRs (n,) float64 of the pooled rows of each table in `tables` (n, slots * its
        width), in that order."""
        if len(pooled) != len(self.tables):
            raise ValueError(f"{len(pooled)} inputs; the model takes {len(self.tables)}")
        slots = self.slot_ids.shape[0]
        batches = []
        for x, (table, dim) in zip(pooled, self.tables, strict=True):
            if x.shape[1] != slots * dim:
                raise ValueError(f"{x.shape[1]} inputs of table {table!r}; the model takes "
                                 f"{slots} slots x {dim}")  # fmt: skip
            batches.append(np.ascontiguousarray(x, dtype=np.float32))
        with self._lock:
            for handle, batch in zip(self._inputs, batches, strict=True):
                handle.reshape(list(batch.shape))
                handle.copy_from_cpu(batch)
            self._predictor.run()
            out = self._output.copy_to_cpu()
        return np.asarray(out, dtype=np.float64).reshape(-1)
