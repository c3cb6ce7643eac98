"""Write the parameter-server saves under tests/data/paddle_ps/ with the REAL trainer.

The converter's tests (tests/test_paddle_ps.py) read these files: saves that PaddlePaddle's
own Fleet parameter server wrote, in every save mode, for both accessors the converter knows,
together with what the trainer itself returns for each saved key (its embedding lookup, run
after the save), so that the tests compare our parser with the framework, not with itself.

Re-run (about a minute; needs paddlepaddle 2.6.2, whose CPU wheel has the parameter-server
runtime, in a venv of its own because of its numpy and protobuf pins):

    python3.11 -m venv /tmp/paddle-venv      # any place outside the checkout
    /tmp/paddle-venv/bin/pip install paddlepaddle==2.6.2 "numpy<2" "protobuf>=4.21,<5"
    /tmp/paddle-venv/bin/python tests/data/paddle_ps/generate.py [scenario ...]

Each scenario is one job of 1 pserver + 1 trainer (`python -m paddle.distributed.launch
--server_num=1 --worker_num=1`, this same file in the job role), static graph, a_sync,
`paddle.static.nn.sparse_embedding` with 4 table shards (4 part files per save). The job
trains on synthetic CTR samples and saves with `fleet.save_persistables(exe, dir, mode)`:

    checkpoint   mode 0  every row (gzip parts), after 20 steps
    base         mode 2  after fleet.shrink() (rare keys deleted; delta scores reset)
    delta        mode 1  after 3 more steps: the rows whose delta score passed
                         delta_threshold (0.25) since the base
    delta_empty  mode 1  again at once: no row qualifies, every part file is empty
    batch_model  mode 3  every row (gzip parts)

Scenarios:
    ctr_common_adagrad   CtrCommonAccessor + SparseAdaGradSGDRule, D=8 (embedx_dim 5), a cvm
                         op after the lookup; embedx_threshold 3, so rare keys are saved
                         without their embedx part (short rows)
    sparse_adam          SparseAccessor (Paddle's default) + SparseAdamSGDRule, D=8
    sparse_naive_2tables two sparse tables (D=4 and D=6), SparseNaiveSGDRule (plain SGD):
                         one save of each mode 0 and 2
    ctr_common_first_order  a DeepFM's two tables, CtrCommonAccessor + SparseAdaGradSGDRule,
                         embedx_threshold 3: `emb` (D=8) and `first_order` (D=3: show, click,
                         embed_w; embedx_dim 0 in the PSParameter). Its rows are 7 numbers
                         after the key, or 8 for the keys above embedx_threshold: the embedx
                         g2sum, which adagrad divides by embedx_dim (0 / 0), written `-nan`.
                         Saves checkpoint (mode 0), base (2) and delta (1)

Files per scenario: <scenario>/<save>/<NNN>/part-*, <scenario>/fleet_desc.prototxt (the job's
PSParameter, as Paddle built it) and <scenario>/expected.json: for each save and table, the
folder, the keys saved, and the trainer's lookup of each key right after the save (float32
little-endian, in hex: [show, click, embed_w, embedx_w...] for CtrCommonAccessor, [embed_w,
embedx_w...] for SparseAccessor; no embedx_w for a table of embedx_dim 0). The generator
checks its own output: every saved key is pulled, and each pulled value equals the saved text
to its 6 significant digits.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where it runs: in the paddle venv
    import numpy as np

HERE = Path(__file__).resolve().parent
K = 4  # ids per slot per sample
BATCH = 32
KEYS_PER_SLOT = 200
HIGH = 1 << 63  # slot 2's keys live above 2^63: uint64 keys an int64 feed carries negated

# Paddle 2.6.2 picks SparseAdamSGDRule for an SGD optimizer too (the_one_ps.py's
# `if sgd: naive` is overridden by the `if adam ... else adam` after it): name the rule.
NAIVE = {
    "accessor.embed_sgd_param.name": "SparseNaiveSGDRule",
    "accessor.embedx_sgd_param.name": "SparseNaiveSGDRule",
}
SCENARIOS: dict[str, dict[str, Any]] = {
    "ctr_common_adagrad": {
        "optimizer": "adam",  # the dense part's; the sparse rule is the table's config
        "tables": {
            "emb": {
                "dim": 8,
                "slots": [0, 1, 2],
                "config": {
                    "accessor.accessor_class": "CtrCommonAccessor",
                    "accessor.embedx_threshold": 3,
                    "accessor.embed_sgd_param.name": "SparseAdaGradSGDRule",
                    "accessor.embedx_sgd_param.name": "SparseAdaGradSGDRule",
                },
            }
        },
        "saves": ["checkpoint", "base", "delta", "delta_empty", "batch_model"],
    },
    "sparse_adam": {
        "optimizer": "adam",
        "tables": {"emb": {"dim": 8, "slots": [0, 2], "config": {}}},
        "saves": ["checkpoint", "base", "delta", "delta_empty", "batch_model"],
    },
    # issue 36: CtrDoubleAccessor (show/click as doubles, its own column order, adagrad state
    # built in) and SparseAdaGradV2SGDRule; both at D=8 have 13 numbers after the key, as
    # ctr_common_adagrad does: column counts cannot tell these layouts apart
    "ctr_double_adagrad": {
        "optimizer": "adam",
        "tables": {
            "emb": {
                "dim": 8,
                "slots": [0, 1, 2],
                "config": {
                    "accessor.accessor_class": "CtrDoubleAccessor",
                    "accessor.embedx_threshold": 3,
                    "accessor.embed_sgd_param.name": "SparseAdaGradSGDRule",
                    "accessor.embedx_sgd_param.name": "SparseAdaGradSGDRule",
                },
            }
        },
        "saves": ["checkpoint", "base", "delta", "batch_model"],
    },
    "sparse_adagrad_v2": {
        "optimizer": "adam",
        "tables": {
            "emb": {
                "dim": 8,
                "slots": [0, 2],
                "config": {
                    "accessor.embed_sgd_param.name": "SparseAdaGradV2SGDRule",
                    "accessor.embedx_sgd_param.name": "SparseAdaGradV2SGDRule",
                },
            }
        },
        "saves": ["checkpoint", "base", "delta", "batch_model"],
    },
    # a DeepFM's two tables: its first-order weights (one per feature: a lookup of 3, show,
    # click, embed_w; embedx_dim 0, so adagrad's embedx g2sum is 0 / 0, saved as -nan in the
    # rows above embedx_threshold) and its embeddings, both CtrCommonAccessor + adagrad
    "ctr_common_first_order": {
        "optimizer": "adam",
        "tables": {
            "emb": {
                "dim": 8,
                "slots": [0, 1, 2],
                "config": {
                    "accessor.accessor_class": "CtrCommonAccessor",
                    "accessor.embedx_threshold": 3,
                    "accessor.embed_sgd_param.name": "SparseAdaGradSGDRule",
                    "accessor.embedx_sgd_param.name": "SparseAdaGradSGDRule",
                },
            },
            "first_order": {
                "dim": 3,
                "slots": [0, 1, 2],
                "config": {
                    "accessor.accessor_class": "CtrCommonAccessor",
                    "accessor.embedx_threshold": 3,
                    "accessor.embed_sgd_param.name": "SparseAdaGradSGDRule",
                    "accessor.embedx_sgd_param.name": "SparseAdaGradSGDRule",
                },
            },
        },
        "saves": ["checkpoint", "base", "delta"],
        "steps": {"delta": 20},  # (3 steps left this two-table job's delta empty)
    },
    "sparse_naive_2tables": {
        "optimizer": "sgd",
        "tables": {
            "emb_a": {"dim": 4, "slots": [0, 1], "config": NAIVE},
            "emb_b": {"dim": 6, "slots": [2], "config": NAIVE},
        },
        "saves": ["checkpoint", "base"],
    },
}
SAVE_MODES = {"checkpoint": 0, "delta": 1, "delta_empty": 1, "base": 2, "batch_model": 3}
COMMON_TABLE_CONFIG = {
    "shard_num": 4,
    "accessor.ctr_accessor_param.delta_threshold": 0.25,
    "accessor.ctr_accessor_param.delete_threshold": 0.8,
}


# ---------------------------------------------------------------------------------------------
# The driver: one launch per scenario, then the files into place


def main() -> int:
    only = sys.argv[1:]
    for name in SCENARIOS:
        if only and name not in only:
            continue
        with tempfile.TemporaryDirectory(prefix=f"paddle-ps-{name}-") as tmp:
            work = Path(tmp)
            command = [
                sys.executable, "-m", "paddle.distributed.launch", "--server_num=1",
                "--worker_num=1", "--log_dir", str(work / "logs"), str(Path(__file__).resolve()),
                name, str(work / "out"),
            ]  # fmt: skip
            started = time.monotonic()
            done = subprocess.run(command, cwd=work, timeout=600, capture_output=True, text=True)
            log = (work / "logs" / "workerlog.0").read_text(errors="replace")
            # the launcher exits 0 even when the trainer failed: its log says
            if done.returncode or "GENERATED" not in log:
                print(done.stdout[-2000:], done.stderr[-2000:], log[-4000:], sep="\n")
                print(f"error: scenario {name} failed", file=sys.stderr)
                return 1
            target = HERE / name
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(work / "out", target)
            size = sum(p.stat().st_size for p in target.rglob("*") if p.is_file())
            print(f"{name}: {size} bytes in {time.monotonic() - started:.1f} s")
    return 0


# ---------------------------------------------------------------------------------------------
# The job (run by paddle.distributed.launch as pserver and as trainer)


def job(name: str, out: Path) -> None:
    import numpy as np
    import paddle
    import paddle.distributed.fleet as fleet
    from google.protobuf import text_format

    scenario = SCENARIOS[name]
    paddle.enable_static()
    fleet.init(fleet.PaddleCloudRoleMaker(is_collective=False))
    slots = sorted({s for t in scenario["tables"].values() for s in t["slots"]})
    ids = {i: paddle.static.data(f"slot{i}", [-1, 1], "int64") for i in slots}
    label = paddle.static.data("label", [-1, 1], "float32")
    accessors = {
        table: spec["config"].get("accessor.accessor_class", "SparseAccessor")
        for table, spec in scenario["tables"].items()
    }
    ctr = {table: accessor != "SparseAccessor" for table, accessor in accessors.items()}
    show_clicks = {}
    lookups: dict[str, list[Any]] = {}  # table -> its lookup outputs, one per slot
    pooled = []
    for table, spec in scenario["tables"].items():
        dim = spec["dim"]
        for slot in spec["slots"]:
            emb = paddle.static.nn.sparse_embedding(
                ids[slot], size=[1_000_000, dim], param_attr=paddle.ParamAttr(name=table)
            )
            lookups.setdefault(table, []).append(emb)
            width = dim
            if ctr[table]:  # [show, click, embed_w, embedx_w...]: a cvm op drops show, click
                show_click = paddle.static.data(f"show_click{slot}", [-1, 2], "float32")
                show_clicks[slot] = show_click
                emb = paddle.static.nn.continuous_value_model(emb, show_click, use_cvm=False)
                width = dim - 2
            pooled.append(paddle.sum(paddle.reshape(emb, [-1, K, width]), axis=1))
    hidden = paddle.static.nn.fc(paddle.concat(pooled, axis=1), 16, activation="relu")
    logit = paddle.static.nn.fc(hidden, 1)
    loss = paddle.mean(paddle.nn.functional.binary_cross_entropy_with_logits(logit, label))

    strategy = fleet.DistributedStrategy()
    strategy.a_sync = True
    strategy.sparse_table_configs = {
        table: {
            f"table_parameters.{table}.{key}": value
            for key, value in {**COMMON_TABLE_CONFIG, **spec["config"]}.items()
        }
        for table, spec in scenario["tables"].items()
    }
    optimizer = (
        paddle.optimizer.Adam(0.01)
        if scenario["optimizer"] == "adam"
        else paddle.optimizer.SGD(0.05)
    )
    fleet.distributed_optimizer(optimizer, strategy).minimize(loss)
    if fleet.is_server():
        fleet.init_server()
        fleet.run_server()
        return

    exe = paddle.static.Executor(paddle.CPUPlace())
    exe.run(paddle.static.default_startup_program())
    fleet.init_worker()
    main_program = paddle.static.default_main_program()
    desc = fleet.fleet._runtime_handle.ps_desc_builder.ps_desc
    out.mkdir(parents=True, exist_ok=True)
    (out / "fleet_desc.prototxt").write_text(text_format.MessageToString(desc))
    folders = table_folders(text_format.MessageToString(desc), scenario["tables"])

    # One pull program per table: only its lookup (pruned from the training program, so
    # running it pushes nothing back to the table).
    pulls = {}
    for table in scenario["tables"]:
        feeds = [f"slot{s}" for s in scenario["tables"][table]["slots"]]
        program = main_program.clone(for_test=True)._prune_with_input(feeds, lookups[table])
        kept = [op.type for op in program.global_block().ops]
        assert kept == ["distributed_lookup_table"], kept
        pulls[table] = (program, feeds)

    rng = np.random.default_rng(20261128)

    def train(steps: int) -> None:
        for _ in range(steps):
            feed: dict[str, np.ndarray] = {
                "label": rng.integers(0, 2, (BATCH, 1)).astype(np.float32)
            }
            for slot in slots:
                offset = np.uint64(slot * 1000 + (HIGH + 7 if slot == 2 else 0))
                drawn = ((rng.zipf(1.6, BATCH * K) - 1) % KEYS_PER_SLOT).astype(np.uint64)
                feed[f"slot{slot}"] = (drawn + offset).view(np.int64).reshape(-1, 1)
                if slot in show_clicks:
                    show_click = np.ones((BATCH * K, 2), np.float32)
                    show_click[:, 1] = np.repeat(feed["label"][:, 0], K)
                    feed[f"show_click{slot}"] = show_click
            exe.run(main_program, feed=feed, fetch_list=[loss])
        time.sleep(1.0)  # the async communicator's last pushes reach the server

    expected: dict[str, Any] = {"scenario": name, "tables": {}, "saves": {}}
    for table, spec in scenario["tables"].items():
        expected["tables"][table] = {
            "folder": folders[table],
            "dim": spec["dim"],
            "accessor": accessors[table],
            # (a table without embedx_w, D = 3 or 1: its lookup ends at embed_w)
            "lookup": ("show,click,embed_w" if ctr[table] else "embed_w")
            + (",embedx_w" if spec["dim"] > (3 if ctr[table] else 1) else ""),
        }
    steps = {"checkpoint": 20, "base": 0, "delta": 3, "delta_empty": 0, "batch_model": 0}
    steps.update(scenario.get("steps", {}))
    for save in scenario["saves"]:
        train(steps[save])
        if save == "base":
            fleet.shrink()
        mode = SAVE_MODES[save]
        fleet.save_persistables(exe, str(out / save), mode=mode)
        record: dict[str, Any] = {"mode": mode, "tables": {}}
        for table, (program, feeds) in pulls.items():
            keys, texts = saved_rows(out / save / folders[table])
            pulled: list[np.ndarray] | np.ndarray = []
            if keys:
                id_feed = np.array(keys, dtype=np.uint64).view(np.int64).reshape(-1, 1)
                result = exe.run(
                    program, feed={f: id_feed for f in feeds}, fetch_list=lookups[table][:1]
                )
                pulled = np.asarray(result[0]).astype(np.float32).reshape(len(keys), -1)
                check_pulled(save, table, texts, pulled, accessors[table])
            record["tables"][table] = {
                "keys": keys,
                "lookup_f32le_hex": [row.astype("<f4").tobytes().hex() for row in pulled],
            }
        expected["saves"][save] = record
    (out / "expected.json").write_text(json.dumps(expected, separators=(",", ":")) + "\n")
    print("GENERATED", flush=True)
    fleet.stop_worker()


def table_folders(desc_text: str, tables: dict[str, Any]) -> dict[str, str]:
    """Each table's save folder: its table_id in Paddle's PSParameter, as 3 digits."""
    import re

    found = {}
    for block in desc_text.split("downpour_table_param {")[1:]:
        table_id = re.search(r"table_id: (\d+)", block)
        name = re.search(r'table_name: "([^"]+)"', block)
        if table_id and name and name.group(1) in tables:
            found[name.group(1)] = f"{int(table_id.group(1)):03d}"
    assert set(found) == set(tables), found
    return found


def saved_rows(folder: Path) -> tuple[list[int], list[list[str]]]:
    """The keys and text fields of every row of a table's save folder (an oracle of its own:
    split on whitespace, nothing more)."""
    import gzip

    keys, texts = [], []
    for part in sorted(folder.iterdir()):
        data = part.read_bytes()
        if data[:2] == b"\x1f\x8b":
            data = gzip.decompress(data)
        for line in data.decode().splitlines():
            fields = line.split()
            keys.append(int(fields[0]))
            texts.append(fields[1:])
    return keys, texts


def check_pulled(
    save: str, table: str, texts: list[list[str]], pulled: np.ndarray, accessor: str
) -> None:
    """The trainer's lookup after the save equals the saved text, to 6 significant digits
    (a push landing after the save would break this: then the generator must not write).
    CtrDoubleAccessor's columns: unseen_days delta_score show click embed_w embed_g2sum slot
    embedx_g2sum embedx_w..."""
    ctr = accessor != "SparseAccessor"
    double = accessor == "CtrDoubleAccessor"
    for fields, row in zip(texts, pulled, strict=True):
        if double:
            saved = [float(fields[2]), float(fields[3]), float(fields[4])]
            embedx = row[len(saved) :]
            start = 8
        else:
            saved = [float(fields[3]), float(fields[4])] if ctr else []
            saved.append(float(fields[5]))
            embedx = row[len(saved) :]
            start = 6 + embed_state_dim(len(fields), len(embedx), ctr)
        if len(fields) > start:
            saved += [float(v) for v in fields[start : start + len(embedx)]]
        for got, want in zip(row, saved, strict=False):
            assert abs(got - want) <= 5e-6 * abs(want) + 1e-30, (save, table, fields, row)


def embed_state_dim(field_count: int, embedx_dim_pulled: int, ctr: bool) -> int:
    """Columns of the embed optimizer state in a row of `field_count` floats (without the
    key), from the three rules these scenarios use: adagrad (1), adam (4), naive (0)."""
    if ctr:
        return 1  # SparseAdaGradSGDRule
    rules = ((4, 2 * embedx_dim_pulled + 2), (0, 0), (1, 1))  # adam, naive, adagrad(_v2)
    for embed_state, embedx_state in rules:
        if field_count in (6 + embed_state, 6 + embed_state + embedx_dim_pulled + embedx_state):
            return embed_state
    raise AssertionError(f"unexpected row of {field_count} floats")


if __name__ == "__main__":
    if "TRAINING_ROLE" in os.environ:  # started by paddle.distributed.launch
        job(sys.argv[1], Path(sys.argv[2]))
    else:
        sys.exit(main())
