"""The dense part of a version the Paddle trainer saved, served with `paddle.inference`.

The trainer (examples/ctr/paddle_trainer.py, paddlepaddle 2.6.2) writes each version's fc
layers with `paddle.static.save_inference_model` into `<model>/dnn_plugin/` (`model.pdmodel`,
`model.pdiparams`: the program from the pooled embeddings to the click probability) and
`layout.json` (the slots and the served embedding width it expects). The predictor runs it with
paddlepaddle 3.3.1's `paddle.inference`, which installs beside the project's numpy 2 and
protobuf 7 (the `ctr-paddle` extra) and reads 2.6.2's models: the same process looks up the
embeddings in Cube with the SDK and runs the dense part, as `model.Dense` does for the numpy
trainer's versions. Paddle is imported on the first such version only.
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
    """`model.Dense`'s interface (slot_ids, dim, predict) over a Paddle inference model."""

    def __init__(self, slot_ids: np.ndarray, dim: int, predictor: Any) -> None:
        self.slot_ids = slot_ids
        self.dim = dim
        self._predictor = predictor
        self._input = predictor.get_input_handle(predictor.get_input_names()[0])
        self._output = predictor.get_output_handle(predictor.get_output_names()[0])
        self._lock = threading.Lock()  # a predictor runs one batch at a time

    @classmethod
    def load(cls, directory: Path) -> PaddleDense:
        """The dense part in `directory` (a model's dnn_plugin/); ValueError naming the file
        when it is not one the trainer wrote, ImportError when paddle is not installed."""
        try:
            layout = json.loads((directory / LAYOUT).read_text())
            slot_ids = np.array(layout["slot_ids"], dtype=np.int64)
            dim = int(layout["dim"])
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
        return cls(slot_ids, dim, predictor)

    def predict(self, pooled: np.ndarray) -> np.ndarray:
        """CTRs (n,) float64 of pooled embeddings (n, slots * dim)."""
        if pooled.shape[1] != self.slot_ids.shape[0] * self.dim:
            raise ValueError(f"{pooled.shape[1]} inputs; the model takes {self.slot_ids.shape[0]}"
                             f" slots x {self.dim}")  # fmt: skip
        batch = np.ascontiguousarray(pooled, dtype=np.float32)
        with self._lock:
            self._input.reshape(list(batch.shape))
            self._input.copy_from_cpu(batch)
            self._predictor.run()
            out = self._output.copy_to_cpu()
        return np.asarray(out, dtype=np.float64).reshape(-1)
