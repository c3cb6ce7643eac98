"""`make demo-ctr`: the ElasticCTR loop around Cube on this machine, in a few minutes.

1. a local Cube cluster (cube-local: transfer + 2 shards x 2 replicas), the streaming trainer
   (a process watching the data directory) and the predictor (a process on the cluster's
   cube.conf and the trainer's models);
2. a background client that keeps asking the predictor for CTRs the whole time, so every
   rollout happens under load;
3. for each split of the stream: the split appears (data + its donefile), the trainer trains a
   pass and saves a base (first pass of a day) or a delta with its donefile line, cube-transfer
   rolls it out, and the held-out samples of that split are replayed against the predictor;
4. per pass: the trainer's offline AUC, the AUC served through Cube, the version served, the
   rollout time and the keys served. The served AUC must equal the offline AUC of the same
   version within 0.002 (the embeddings served are the ones trained), else exit 1.

    python -m examples.ctr.demo [--dir .demo-ctr] [--days 2] [--splits_per_day 3]

`--trainer paddle` (`make demo-ctr-paddle`) runs the loop on real PaddlePaddle instead: the
trainer is a Fleet parameter-server job (paddle_trainer.py, in the paddlepaddle 2.6.2 venv
`--paddle_python`), Cube reads its saves through Fleet's donefiles (`source_format:
paddle_fleet`, cube-builder -input_format paddle_ps) and the predictor runs each version's
inference model with paddle.inference. The model is a DeepFM of two sparse tables
(`--paddle_model deepfm`, the default: first-order weights and embeddings, tables `001` and
`000` of one version, built together from each save and looked up together by the predictor)
or the CTR-DNN of one (`--paddle_model dnn`). Checked per pass, else exit 1 naming the pass
and by how much: the served AUC equals the offline AUC within 0.001, and every served
probability equals the trainer's own (its exact embeddings as saved, its own program) within
the bound the 6-digit text allows for that sample (`paddle_trainer.probability_bounds`,
about 1e-5).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cube.donefile import DONEFILE_FORMATS, SEQFILE, DonefileFormat
from cube.flags import FlagError, Flags, FlagSet, run_cli
from cube.processes import free_port, log_tail, poll_until, spawn, stop_child
from cube.transfer.demo import DemoError, fresh_dir, say, timeline
from examples.ctr import client as ctr_client
from examples.ctr.data import spec_from, split_path, split_time, with_stream_flags, write_split
from examples.ctr.store import MODELS, ModelMeta, announced_ids, find_model, read_meta

REPO = Path(__file__).resolve().parents[2]
TOLERANCE = 0.002
PADDLE_TOLERANCE = 0.001  # the served AUC of the Paddle trainer's versions
PADDLE_PYTHON = REPO / ".paddle-venv" / "bin" / "python"  # make paddle-env
FLEET = DONEFILE_FORMATS["paddle_fleet"]
PADDLE_MODELS = ("deepfm", "dnn")
# The DeepFM's tables in a version: Fleet's table folders of each save, which cube-builder
# names the version's tables after (the PSParameter numbers the embedding table 0, the
# first-order weights 1, the dense table 2: paddle_trainer.py's layout.json says which input
# pools which)
DEEPFM_TABLES = ("000", "001")
# The first-order table's lookup width: 3 (show, click, embed_w), a table without embedx part
# (embedx_dim 0) serving embed_w alone, the feature's weight; 4 would serve embed_w and one
# embedx_w, which the model adds up to the weight (examples/ctr/README.md, "Two tables, one
# version")
WIDE_DIM = 3


def python_env() -> dict[str, str]:
    """The environment of the example's processes: the repository importable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def start_trainer(
    work: Path, logs: Path, extra: Sequence[str] = (), env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """The streaming trainer on `work`/stream, saving into `work`/out (its log appended)."""
    stream = work / "stream"
    argv = [
        sys.executable, "-m", "examples.ctr.trainer",
        "--data_dir", str(stream / "data"), "--heldout_dir", str(stream / "heldout"),
        "--out_dir", str(work / "out"), "--wait_timeout", "600", "--poll", "0.2", *extra,
    ]  # fmt: skip
    return spawn(argv, logs / "trainer.log", append=True, env={**python_env(), **(env or {})})


def start_paddle_trainer(
    work: Path,
    logs: Path,
    python: Path,
    passes: int,
    model: str = "deepfm",
    wide_dim: int = 3,
) -> subprocess.Popen[bytes]:
    """The Paddle trainer (a Fleet job) on `work`/stream, saving into `work`/out/models."""
    if not python.is_file():
        raise DemoError(f"no paddlepaddle 2.6.2 environment at {python}: run make paddle-env")
    stream = work / "stream"
    argv = [
        str(python), "-m", "examples.ctr.paddle_trainer",
        "--data_dir", str(stream / "data"), "--heldout_dir", str(stream / "heldout"),
        "--out_dir", str(work / "out"), "--passes", str(passes), "--wait_timeout", "600",
        "--model", model, "--wide_dim", str(wide_dim),
    ]  # fmt: skip
    return spawn(argv, logs / "trainer.log", append=True, env=python_env())


def start_predictor(
    cube_conf: Path,
    models: Path,
    logs: Path,
    timeout: float = 30.0,
    tables: Sequence[str] = (),
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    argv = [
        sys.executable, "-m", "examples.ctr.predictor", "--cube_conf", str(cube_conf),
        "--model_dir", str(models), "--port", str(port),
    ]  # fmt: skip
    if tables:
        argv += ["--tables", ",".join(tables)]
    proc = spawn(argv, logs / "predictor.log", env=python_env())
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1.0) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def alive() -> None:
        if proc.poll() is not None:
            raise DemoError(f"the predictor exited:\n{log_tail(logs / 'predictor.log')}")

    if not poll_until(up, timeout, 0.2, check=alive):
        stop_child(proc, 5.0)
        raise DemoError(f"the predictor did not answer within {timeout:g}s")
    return proc, url


def wait_predictor_ready(url: str, timeout: float) -> None:
    """Until the predictor says it is ready (`/ready`: a serving replica of every shard, a
    version answered, its dense part loaded), so that no replayed request pays for that."""
    reason = ["no answer"]

    def ready() -> bool:
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=2.0) as response:
                return bool(response.status == 200)
        except urllib.error.HTTPError as exc:
            reason[0] = exc.read(500).decode("utf-8", "replace")
            return False
        except OSError as exc:
            reason[0] = str(exc)
            return False

    if not poll_until(ready, timeout, 0.1):
        raise DemoError(f"the predictor was not ready within {timeout:g}s: {reason[0]}")


def wait_model(
    work: Path,
    version_id: int,
    trainer: subprocess.Popen[bytes],
    timeout: float,
    donefile_format: DonefileFormat = SEQFILE,
) -> ModelMeta:
    """The meta of the model `version_id`, once the trainer has announced it."""

    def announced() -> bool:
        return str(version_id) in announced_ids(work / "out", donefile_format)

    def alive() -> None:
        if trainer.poll() is not None:
            log = log_tail(work / "logs" / "trainer.log")
            raise DemoError(f"the trainer exited ({trainer.returncode}):\n{log}")

    if not poll_until(announced, timeout, 0.2, check=alive):
        raise DemoError(f"the trainer did not announce version {version_id} within {timeout:g}s")
    return read_meta(find_model(work / "out" / MODELS, version_id))


class Background:
    """A client that replays samples against the predictor without pause, in a thread, until
    stopped; it counts answers per version and every error."""

    def __init__(self, url: str, lines: list[str], keep: int = 0) -> None:
        self.url, self.lines = url, lines
        self.requests = 0
        self.errors: list[str] = []
        self.versions: dict[str, int] = {}
        self.kept: list[ctr_client.Replay] = []  # the first `keep` replays, for checks
        self.keep = keep
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="background-load", daemon=True)

    def start(self) -> Background:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            result = asyncio.run(ctr_client.replay(self.url, self.lines, batch=50, concurrency=2))
            self.requests += len(result.latencies)
            self.errors.extend(result.errors)
            if len(self.kept) < self.keep:
                self.kept.append(result)
            for version in result.versions:
                if version:
                    self.versions[version] = self.versions.get(version, 0) + 1


def flag_set() -> FlagSet[Flags]:
    flags = FlagSet("python -m examples.ctr.demo", "The ElasticCTR loop around a local Cube.")
    return (
        with_stream_flags(flags)
        .add("dir", str, ".demo-ctr", "work directory (wiped first)")
        .add("shards", int, 2, "Cube shards")
        .add("replicas", int, 2, "replicas per shard")
        .add("shrink_after", int, 2, "the trainer drops features unseen for this many passes")
        .add("timeout", float, 120.0, "seconds each step may take")
        .add("trainer", str, "numpy", "numpy (the framework-free trainer) or paddle (Fleet)")
        .add("paddle_python", str, str(PADDLE_PYTHON), "python of the paddlepaddle 2.6.2 venv")
        .add(
            "paddle_model",
            str,
            "deepfm",
            "--trainer paddle: deepfm (two tables, rolled out together) or dnn (one)",
        )
        .add(
            "paddle_wide_dim",
            int,
            WIDE_DIM,
            "--paddle_model deepfm: the first-order table's lookup width (3: one weight served;"
            " 4: embed_w and one embedx_w served, their sum the weight)",
        )
    )


def run(argv: Sequence[str]) -> int:
    flags = flag_set().parse(argv)
    from cube.transfer.local import Cluster, ClusterSpec, LocalError, up

    spec = spec_from(flags)
    if flags.trainer not in ("numpy", "paddle"):
        raise FlagError(f"--trainer {flags.trainer!r}: numpy or paddle")
    paddle = flags.trainer == "paddle"
    if flags.paddle_model not in PADDLE_MODELS:
        raise FlagError(f"--paddle_model {flags.paddle_model!r}: {' or '.join(PADDLE_MODELS)}")
    tables = DEEPFM_TABLES if paddle and flags.paddle_model == "deepfm" else ()
    donefile_format = FLEET if paddle else SEQFILE
    started = time.monotonic()
    work = Path(flags.dir).resolve()
    fresh_dir(work)
    logs = work / "logs"
    logs.mkdir()
    donefiles = work / "out" / (MODELS if paddle else "donefile")
    donefiles.mkdir(parents=True)
    stream = work / "stream"
    cluster: Cluster | None = None
    children: list[subprocess.Popen[bytes]] = []
    background: Background | None = None
    rows: list[dict[str, Any]] = []

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        say(
            f"== 1. local cluster ({flags.shards} shards x {flags.replicas} replicas), "
            "trainer, predictor"
        )
        overrides: dict[str, Any] = {}
        if paddle:  # Fleet's donefiles and saves; the job writes its PSParameter first
            config = donefiles / "fleet_desc.prototxt"
            overrides = {
                "source_format": FLEET.name,
                "builder_flags": paddle_builder_flags(config, tables),
                "max_shrink": 0.9,
            }
        cluster = up(
            ClusterSpec(
                dir=work / "cluster",
                shards=flags.shards,
                replicas=flags.replicas,
                donefile=donefiles,
                dim=8,
                poll_interval=0.3,
                transfer_overrides=overrides,
            )
        )
        passes = flags.days * spec.splits_per_day
        if paddle:
            python = Path(flags.paddle_python)
            trainer = start_paddle_trainer(
                work, logs, python, passes, flags.paddle_model, flags.paddle_wide_dim
            )
        else:
            trainer = start_trainer(work, logs, ["--shrink_after", str(flags.shrink_after)])
        children.append(trainer)
        predictor, url = start_predictor(
            cluster.cube_conf, work / "out" / "models", logs, tables=tables
        )
        children.append(predictor)
        say(
            f"   cluster up (transfer {cluster.transfer_url}), trainer pid {trainer.pid}, "
            f"predictor {url}"
        )
        say(
            f"== 2. the stream: {flags.days} days x {spec.splits_per_day} splits of "
            f"{spec.samples:,} samples ({spec.heldout:,} held out each)"
        )
        for index in range(flags.days * spec.splits_per_day):
            when = split_time(spec, index)
            write_split(spec, stream, index)
            meta = wait_model(work, int(when.timestamp()), trainer, flags.timeout, donefile_format)
            rollout = cluster.wait_version(meta.version, flags.timeout)
            record: dict[str, Any] = next(
                (r for r in reversed(cluster.history()) if r.get("version") == meta.version), {}
            )
            heldout = ctr_client.read_samples(split_path(stream, when, "heldout"))
            wait_predictor_ready(url, flags.timeout)
            if background is None:
                background = Background(url, heldout).start()
            served = asyncio.run(ctr_client.replay(url, heldout, batch=100, concurrency=2))
            row = {
                "pass": meta.pass_no,
                "split": meta.split,
                "kind": meta.kind,
                "version": meta.version,
                "offline_auc": meta.offline_auc,
                "streaming_auc": meta.streaming_auc,
                "served_auc": served.auc(meta.version),
                "served_versions": sorted(set(served.versions)),
                "rollout_s": rollout,
                "timeline": timeline(record),
                "table_keys": meta.table_size,
                "saved": meta.features,
                "deleted": meta.deleted,
                "looked_up": served.features,
                "missing": served.missing_features,
                "p99_ms": served.summary()["p99_ms"],
                "errors": served.errors,
            }
            if paddle:
                row.update(probability_check(work, meta, served))
            rows.append(row)
            say(
                f"   pass {row['pass']} {row['split']} {row['kind']:<5} {row['version']:<21} "
                f"offline AUC {row['offline_auc']:.4f} served {row['served_auc']:.4f} "
                f"(streaming {row['streaming_auc']:.4f}); rollout {rollout:.1f}s "
                f"({row['timeline']}); {row['table_keys']:,} keys, {row['saved']:,} saved, "
                f"{row['deleted']:,} deleted"
                + (
                    f"; probabilities: max |served - trainer's| {row['max_prob_diff']:.2e} "
                    f"(bound {row['max_bound']:.2e})"
                    if paddle
                    else ""
                )
            )
        if background is not None:
            background.stop()
        say()
        say(report(rows, background))
        failures = check(rows, background)
        for failure in failures:
            say(f"FAILED: {failure}")
        (work / "report.json").write_text(json.dumps(rows, indent=1))
        say(
            f"\ndone in {time.monotonic() - started:.1f}s; per-pass figures in "
            f"{work / 'report.json'}"
        )
        return 1 if failures else 0
    except KeyboardInterrupt:
        say("\ninterrupted")
        return 130
    except (LocalError, DemoError) as exc:
        say(f"\nerror: {exc}\nlogs: {logs}")
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if background is not None:
            background.stop()
        for child in reversed(children):
            stop_child(child, 10.0)
        if cluster is not None:
            say("== shutting down")
            for line in cluster.down():
                say(f"   {line}")


def paddle_builder_flags(config: Path, tables: Sequence[str]) -> tuple[str, ...]:
    """cube-builder's flags for the Paddle trainer's saves (transfer.conf's builder_flags):
    the rows' layouts from the job's PSParameter; for a model of several tables, every sparse
    table of a save built into one version, each a table named by its folder."""
    flags: tuple[str, ...] = ("-paddle_config", str(config))
    if tables:
        flags += ("-paddle_table", "all")
    return flags


def probability_check(work: Path, meta: ModelMeta, served: ctr_client.Replay) -> dict[str, Any]:
    """The served probabilities against the trainer's own for the same held-out samples
    (`heldout.npz` beside the version's model: its probabilities and per-sample bounds)."""
    with np.load(find_model(work / "out" / MODELS, meta.id) / "heldout.npz") as saved:
        mine, bound = saved["probability"].astype(np.float64), saved["bound"]
    if mine.shape != served.ctr.shape:
        raise DemoError(f"pass {meta.pass_no}: {mine.shape[0]} probabilities saved by the "
                        f"trainer, {served.ctr.shape[0]} served")  # fmt: skip
    diff = np.abs(served.ctr - mine)
    diff[~np.isfinite(diff)] = np.inf  # an unanswered sample
    excess = diff - bound
    worst = int(np.argmax(excess))
    return {
        "max_prob_diff": float(diff.max()),
        "max_bound": float(bound.max()),
        "over_bound": int((excess > 0).sum()),
        "worst": {"sample": worst, "diff": float(diff[worst]), "bound": float(bound[worst])},
    }


def report(rows: list[dict[str, Any]], background: Background | None) -> str:
    probabilities = any("max_prob_diff" in r for r in rows)
    head = (
        f"{'pass':>4}  {'split':<13} {'kind':<5} {'version':<21} {'offline':>7} "
        f"{'served':>7} {'diff':>7} {'rollout':>8} {'keys':>7} {'looked up':>9} "
        f"{'missing':>7} {'p99 ms':>6}"
    ) + (f" {'max |dp|':>9} {'bound':>9}" if probabilities else "")
    lines = [head]
    for r in rows:
        diff = r["served_auc"] - r["offline_auc"]
        lines.append(
            f"{r['pass']:>4}  {r['split']:<13} {r['kind']:<5} {r['version']:<21} "
            f"{r['offline_auc']:>7.4f} {r['served_auc']:>7.4f} {diff:>+7.4f} "
            f"{r['rollout_s']:>7.1f}s {r['table_keys']:>7,} {r['looked_up']:>9,} "
            f"{r['missing']:>7,} {r['p99_ms']:>6.1f}"
            + (f" {r['max_prob_diff']:>9.2e} {r['max_bound']:>9.2e}" if probabilities else "")
        )
    if background is not None:
        seen = ", ".join(f"{v}: {n:,}" for v, n in sorted(background.versions.items()))
        lines.append(
            f"\nbackground load during the rollouts: {background.requests:,} requests, "
            f"{len(background.errors)} errors; samples answered by version: {seen}"
        )
    return "\n".join(lines)


def check(rows: list[dict[str, Any]], background: Background | None) -> list[str]:
    failures = []
    for r in rows:
        diff = abs(r["served_auc"] - r["offline_auc"])
        tolerance = PADDLE_TOLERANCE if "max_prob_diff" in r else TOLERANCE
        if not math.isfinite(diff) or diff > tolerance:
            failures.append(
                f"pass {r['pass']} ({r['version']}): served AUC {r['served_auc']:.4f}"
                f" vs offline {r['offline_auc']:.4f}: off by {diff:.4f} (> {tolerance})"
            )
        if r.get("over_bound"):
            w = r["worst"]
            failures.append(
                f"pass {r['pass']} ({r['version']}): {r['over_bound']} served probabilities "
                f"differ from the trainer's by more than the 6-digit text allows; worst: "
                f"held-out sample {w['sample']}, off by {w['diff']:.3e} (bound {w['bound']:.3e})"
            )
        if r["served_versions"] != [r["version"]]:
            failures.append(
                f"pass {r['pass']}: answers came from {r['served_versions']}, "
                f"not only {r['version']}"
            )
        if r["errors"]:
            failures.append(
                f"pass {r['pass']}: {len(r['errors'])} failed requests: {r['errors'][0]}"
            )
    if background is not None and background.errors:
        failures.append(
            f"background load: {len(background.errors)} failed requests: {background.errors[0]}"
        )
    return failures


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
