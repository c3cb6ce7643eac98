"""cube-bench: Cube against Redis (and memcached) on the same workload, with one command.

It starts every server itself on 127.0.0.1 (Cube through cube-builder and cube-server; Redis
and memcached from PATH, persistence off), loads the same keys and values into each, checks a
sample of answers, then runs each concurrency level for a fixed time after a warm-up with fresh
random keys in every request. It prints the seed's table per target (threads, batch, average
latency, QPS) plus percentiles, keys/s, server CPU per request and the Cube/Redis ratio, and
writes results.json, results.md and results.png to --out. Every server it started is stopped
by PID at the end, on error, on Ctrl-C and on SIGTERM.

    cube-bench --targets cube,redis,memcached --threads 1,4,8,16,24,32 --batch 1000 \\
        --keys 1000000 --value_size 40 --workers 2 --out bench/results/run1
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from cube.bench.cube_target import CubeTarget
from cube.bench.keyspace import parse_distribution
from cube.bench.procs import (
    Interrupted,
    ProcessRegistry,
    ServerStartError,
    signals_ignored,
    signals_raise,
)
from cube.bench.report import markdown_table, ratios, summarize, write_outputs
from cube.bench.runner import BenchError, LevelConfig, _new_event_loop, run_level
from cube.bench.targets import (
    DataSource,
    MemcachedTarget,
    ModeUnsupported,
    RedisTarget,
    Target,
    TargetUnavailable,
    make_dataset,
    make_derived,
)
from cube.flags import FlagError, FlagSet, flag, run_cli

TARGETS: dict[str, type[Target]] = {
    "cube": CubeTarget,
    "redis": RedisTarget,
    "memcached": MemcachedTarget,
}


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from exc
    if not values or min(values) <= 0:
        raise ValueError(f"expected positive integers, got {text!r}")
    return values


@dataclass(frozen=True)
class BenchFlags:
    """cube-bench's flags."""

    targets: str = flag("cube,redis", "comma-separated: cube, redis, memcached", metavar="LIST")
    threads: tuple[int, ...] = flag(
        (1, 4, 8, 16, 24, 32),
        "concurrency levels (threads or tasks)",
        parse=_int_list,
        metavar="N,...",
    )
    batch: int = flag(1000, "keys per request")
    requests: int = flag(0, "measure this many requests per level (0: use --duration)")
    duration: float = flag(10.0, "seconds measured per level")
    warmup: float = flag(2.0, "seconds of warm-up before each level is measured")
    keys: int = flag(1_000_000, "keys loaded into every target")
    value_size: int = flag(40, "bytes per value (random bytes); ignored with --dim")
    dim: int = flag(0, "values are embeddings of this many float32 (value_size = dim*4)")
    dtype: str = flag("float32", "embedding element type", choices=["float32"])
    shards: int = flag(1, "cube: shards (one cube-server each)")
    workers: int = flag(2, "cube: worker processes per cube-server")
    cube_transport: str = flag(
        "auto", "cube SDK transport: auto (the servers' TCP lane) or grpc", choices=["auto", "grpc"]
    )
    cube_busy_poll_us: int = flag(
        0, "cube: cube-server --busy_poll_us and the SDK's busy_poll_us (0: off)"
    )
    client: str = flag(
        "thread",
        "thread (a client per thread), shared (threads share one client) or asyncio",
        choices=["thread", "shared", "asyncio"],
    )
    out: str = flag("cube-bench-out", "directory for results.json/.md/.png", metavar="DIR")
    skip_missing: bool = flag(False, "skip a target whose server binary is missing")
    max_other_load: float = flag(0.25, "cores other processes may use before a rerun")
    max_repeats: int = flag(2, "reruns at most of a disturbed level")
    quiet_wait: float = flag(60.0, "seconds to wait at most for a quiet machine per try")
    check_sample: int = flag(2000, "keys checked against the data set per target")
    timeout: float = flag(300.0, "bound on one level's measured phase with --requests")
    start_timeout: float = flag(60.0, "bound on each server's startup")
    dataset: str = flag(
        "random",
        "random: random keys and values, held in memory to check answers; derived: values"
        " derived from the keys (bench.keyspace), never held, so 100M+ keys run",
        choices=["random", "derived"],
    )
    distribution: str = flag(
        "uniform",
        "keys a request asks for: uniform or zipf:THETA (YCSB's scrambled zipfian, e.g. zipf:0.99)",
        metavar="DIST",
    )
    seed: int = flag(1, "seed of the data set and of the key draws")
    workdir: str = flag(
        "", "where servers keep files (default: a temp dir, removed)", metavar="DIR"
    )


def flag_set() -> FlagSet[BenchFlags]:
    return FlagSet("cube-bench", (__doc__ or "").split("\n\n")[0], spec=BenchFlags)


def validate(flags: BenchFlags) -> list[str]:
    """FlagError for flags that do not go together; the targets to run, in order."""
    for name, count in (
        ("batch", flags.batch), ("keys", flags.keys), ("shards", flags.shards),
        ("workers", flags.workers), ("check_sample", flags.check_sample),
    ):  # fmt: skip
        if count <= 0:
            raise FlagError(f"--{name} must be > 0, got {count}")
    if flags.keys < flags.batch:
        raise FlagError(
            f"--keys {flags.keys} is below --batch {flags.batch}: every request would ask"
            " for some keys twice, which no real workload does (raise --keys or lower --batch)"
        )
    if flags.dim < 0 or (not flags.dim and flags.value_size <= 0):
        raise FlagError("--value_size (or --dim) must be > 0")
    if flags.duration <= 0 or flags.warmup < 0 or flags.requests < 0:
        raise FlagError("--duration must be > 0, --warmup and --requests >= 0")
    if flags.max_repeats < 0 or flags.quiet_wait < 0:
        raise FlagError("--max_repeats and --quiet_wait must be >= 0")
    try:
        parse_distribution(flags.distribution)
    except ValueError as exc:
        raise FlagError(f"--distribution: {exc}") from None
    names = [t.strip() for t in flags.targets.split(",") if t.strip()]
    if not names:
        raise FlagError("--targets is empty")
    unknown = [t for t in names if t not in ("cube", "redis", "memcached")]
    if unknown:
        raise FlagError(f"--targets: unknown {', '.join(unknown)} (cube, redis, memcached)")
    return list(dict.fromkeys(names))


def machine() -> dict[str, str]:
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": model,
        "cores": str(os.cpu_count()),
        "memory": f"{psutil.virtual_memory().total / 2**30:.1f} GiB",
        "kernel": platform.release(),
    }


def base_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for package in ("cube-py", "numpy", "grpcio", "protobuf", "uvloop"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[package] = metadata.version(package)
    try:
        commit = subprocess.run(
            ["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        versions["git"] = commit
    except (OSError, subprocess.SubprocessError):
        pass
    return versions


def check_answers(target: Target, data: DataSource, sample: int, mode: str, seed: int) -> int:
    """Fetch a sample of present and absent keys and compare with the data set; returns how
    many keys were checked. Raises BenchError naming the first wrong key."""
    rng = np.random.default_rng([seed, 7])
    rows = rng.choice(data.count, min(sample, data.count), replace=False)
    absent = data.absent_keys(max(1, sample // 10), seed)
    keys = np.concatenate([data.keys_at(rows), absent])

    def verify(answer: tuple[np.ndarray, int], how: str) -> None:
        matrix, misses = answer
        expected = data.expected(rows)
        got = np.asarray(matrix)
        if got.shape[0] != keys.shape[0]:
            raise BenchError(f"{target.name} ({how}): {got.shape[0]} values for {keys.shape[0]}")
        wrong = np.flatnonzero(
            (got[: rows.shape[0]].view(np.uint8) != expected.view(np.uint8)).any(axis=1)
        )
        if wrong.shape[0]:
            i = int(wrong[0])
            raise BenchError(
                f"{target.name} ({how}): wrong value for key {int(keys[i])} "
                f"({wrong.shape[0]} of {rows.shape[0]} keys wrong)"
            )
        if misses != absent.shape[0] or got[rows.shape[0] :].view(np.uint8).any():
            raise BenchError(
                f"{target.name} ({how}): {misses} misses reported for {absent.shape[0]} absent "
                f"keys, or non-zero values for them"
            )

    client = target.thread_client()
    try:
        verify(client.fetch(keys), "thread client")
    finally:
        client.close()
    if mode == "asyncio":

        async def fetch_async() -> tuple[np.ndarray, int]:
            aclient = target.async_client(1)
            try:
                fetched: tuple[np.ndarray, int] = await aclient.fetch(keys)
                return fetched
            finally:
                await aclient.close()

        loop = _new_event_loop()
        try:
            verify(loop.run_until_complete(asyncio.wait_for(fetch_async(), 60)), "asyncio")
        finally:
            loop.close()
    return int(keys.shape[0])


def _print_flush(text: str) -> None:
    print(text, flush=True)


# Peak memory of a run per byte of its data set (keys and values): the set, the targets'
# input written from it, the answers checked against it. 100M x 64 B peaked at 24 GB (3.4x).
_MEMORY_PER_DATA_BYTE = 3.5
_SERVER_BYTES_PER_KEY = 100  # redis-server over the value size, at most (cube-server: ~16)


def _memory_shortfall(
    keys: int, value_size: int, available: int | None = None, dataset: str = "random"
) -> str:
    """Why the run will not fit in this machine's memory ("" when it will). A random data set
    is held to check every target's answers, so a table too large is refused before any
    work, not killed by the kernel's OOM killer minutes in; a derived one is never held, and
    only the server holding the table counts (Redis or memcached: ~100 bytes a key over the
    value; cube-server: the value and ~16 bytes of index)."""
    if dataset == "derived":
        need = int(keys * (value_size + _SERVER_BYTES_PER_KEY))
        held = "the server holds the table"
    else:
        need = int(keys * (8 + value_size) * _MEMORY_PER_DATA_BYTE)
        held = "the data set is kept to check answers"
    if available is None:
        available = int(psutil.virtual_memory().available)
    if need <= available:
        return ""
    how = (
        "Use fewer keys"
        if dataset == "derived"
        else "Use --dataset derived (values derived from keys, never held), fewer keys, or"
        " `python -m bench.scale` for the server's path at this size"
    )
    return (
        f"--keys {keys:,} of {value_size} B need about {need / 2**30:.1f} GiB of memory ({held});"
        f" {available / 2**30:.1f} GiB is available. {how}"
    )


def run(flags: BenchFlags, target_names: list[str], argv: Sequence[str]) -> int:
    """Check the targets, then set up, check and measure each in turn; the servers always
    stop at the end, and a workdir of our own is removed however the run ends."""
    short = _memory_shortfall(flags.keys, flags.dim * 4 or flags.value_size, dataset=flags.dataset)
    if short:
        print(f"cube-bench: {short}", file=sys.stderr)
        return 2
    if flags.workdir:
        return _run(flags, target_names, argv, Path(flags.workdir), own_workdir=False)
    workdir = Path(tempfile.mkdtemp(prefix="cube-bench-"))
    try:
        return _run(flags, target_names, argv, workdir, own_workdir=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run(
    flags: BenchFlags,
    target_names: list[str],
    argv: Sequence[str],
    workdir: Path,
    own_workdir: bool,
) -> int:
    """`run` in `workdir` (its logs are named on an error when it is the caller's)."""
    options = dataclasses.asdict(flags)
    skipped: dict[str, str] = {}
    registry = ProcessRegistry(log=_print_flush)
    targets = _available_targets(flags, target_names, registry, workdir, options, skipped)
    if targets is None:
        return 2
    started = time.strftime("%Y-%m-%d %H:%M:%S %z")
    t0 = time.perf_counter()
    distribution = parse_distribution(flags.distribution)
    data: DataSource
    if flags.dataset == "derived":
        data = make_derived(flags.keys, flags.value_size, flags.dim, distribution)
    else:
        data = make_dataset(flags.keys, flags.value_size, flags.dim, flags.seed, distribution)
    _print_flush(
        f"data set: {flags.keys:,} keys x {data.value_size} bytes, {flags.dataset},"
        f" {flags.distribution} draws ({time.perf_counter() - t0:.1f}s)"
    )
    results: dict[str, Any] = {}
    versions = base_versions()
    try:
        with signals_raise():
            for target in targets:
                results[target.name] = _bench_target(target, data, flags, versions)
                target.stop()
    except (KeyboardInterrupt, Interrupted) as exc:
        print(f"\ninterrupted ({exc or 'Ctrl-C'}); stopping servers", file=sys.stderr)
        return 130
    except (BenchError, RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        if not own_workdir:
            print(f"server logs are in {workdir}", file=sys.stderr)
        return 1
    finally:
        with signals_ignored():
            registry.stop_all()
    result: dict[str, Any] = {
        "command": shlex.join(["cube-bench", *argv]),
        "started": started,
        "settings": _settings(flags, options),
        "machine": machine(),
        "versions": versions,
        "targets": results,
        "skipped": skipped,
        "ratios": ratios({name: t["levels"] for name, t in results.items()}),
    }
    _report(result, Path(flags.out))
    return 0


def _settings(flags: BenchFlags, options: dict[str, Any]) -> dict[str, Any]:
    """The flags that shape the measurement, as the result records them."""
    settings = {
        k: options[k]
        for k in (
            "threads", "batch", "requests", "duration", "warmup", "keys", "value_size", "dim",
            "dtype", "shards", "workers", "cube_transport", "cube_busy_poll_us", "client",
            "max_other_load", "max_repeats", "quiet_wait", "seed", "dataset", "distribution",
        )
    }  # fmt: skip
    if flags.dim:
        settings["value_size"] = flags.dim * 4
    settings["client"] = flags.client
    return settings


def _available_targets(
    flags: BenchFlags,
    target_names: list[str],
    registry: ProcessRegistry,
    workdir: Path,
    options: dict[str, Any],
    skipped: dict[str, str],
) -> list[Target] | None:
    """The targets that can run here; the others go to `skipped` with the reason (when
    --skip_missing allows, or the client mode is one a target does not support). None, after
    saying why on stderr, when the run cannot go on."""
    targets: list[Target] = []
    for name in target_names:
        target = TARGETS[name](registry, workdir / name, options)
        try:
            target.check_available(flags.client)
            targets.append(target)
            continue
        except TargetUnavailable as exc:
            reason = str(exc)
            unsupported = isinstance(exc, ModeUnsupported)
        if not flags.skip_missing and not unsupported:
            print(f"error: {reason}", file=sys.stderr)
            return None
        print(f"skipping {name}: {reason}", file=sys.stderr)
        skipped[name] = reason
    if not targets:
        print("error: no target left to run", file=sys.stderr)
        return None
    return targets


def _bench_target(
    target: Target, data: DataSource, flags: BenchFlags, versions: dict[str, str]
) -> dict[str, Any]:
    """Start and load one target, check its answers, then measure each concurrency level;
    returns its result (the target's info and one row per level)."""
    target.workdir.mkdir(parents=True, exist_ok=True)
    _print_flush(f"== {target.name}: starting and loading")
    try:
        target.setup(data)
    except ServerStartError as exc:
        raise BenchError(f"{target.name}: {exc}") from exc
    target.info["pids"] = target.server_pids()
    versions.update(target.versions())
    checked = check_answers(target, data, flags.check_sample, flags.client, flags.seed)
    _print_flush(
        f"{target.name}: loaded in {target.info.get('load_seconds', '?')}s, "
        f"{checked} answers checked"
    )
    rows = []
    for concurrency in flags.threads:
        cfg = LevelConfig(
            concurrency=concurrency,
            batch=flags.batch,
            warmup=flags.warmup,
            duration=flags.duration,
            requests=flags.requests,
            timeout=flags.timeout,
            mode=flags.client,
            seed=flags.seed * 1000 + concurrency,
        )
        level = run_level(
            target, data, cfg, flags.max_other_load, flags.max_repeats,
            log=_print_flush, quiet_wait=flags.quiet_wait,
        )  # fmt: skip
        row = summarize(level)
        rows.append(row)
        _print_flush(
            f"{target.name:>9} C={concurrency:<3} avg {row['avg_us']:>9,.0f} µs  "
            f"p99 {row['p99_us']:>9,.0f} µs  {row['qps']:>8,.0f} req/s  "
            f"server {row['server_cpu_us_per_req']:>6,.0f} µs/req  "
            f"other load {row['other_load']:.2f}"
            + (f"  MISSES {row['misses']}" if row["misses"] else "")
        )
    return {**target.info, "levels": rows}


def _report(result: dict[str, Any], out: Path) -> None:
    """Write the result files and print each target's table and the ratios."""
    paths = write_outputs(result, out)
    for name, target_result in result["targets"].items():
        print(f"\n{name}\n{markdown_table(target_result['levels'])}")
    for entry in result["ratios"]:
        print("  ".join(f"{k} {v}" for k, v in entry.items()))
    print("\nwrote " + ", ".join(str(p) for p in paths.values()))


def main(argv: Sequence[str] | None = None) -> int:
    def body(args: Sequence[str]) -> int:
        flags = flag_set().parse(args)
        return run(flags, validate(flags), args)

    return run_cli(body, argv)


if __name__ == "__main__":
    sys.exit(main())
