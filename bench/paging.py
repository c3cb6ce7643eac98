"""Lookups on a table larger than the memory its process may use (issue 37 item 3).

    python -m cube.bench.paging --keys 20000000 --width 64 --share 0.25 --seconds 10

Writes one shard of `--keys` derived keys (bench.keyspace: values checkable from the keys)
into a temporary directory (removed at the end), then for each way of mapping it and each key
distribution runs a child process that looks up 1000-key batches for `--seconds` through the
server's gather (`cube.server.service.FastGather`, the path a request takes), one batch at a
time, every answer checked:

- `in-memory`: no limit, the shard populated (the baseline; what `--in_mem` serves);
- `before`: in a cgroup v1 memory group of `--share` of the shard's bytes, mapped as a server
  did before issue 37 when it did not pin (`--in_mem false`: readahead, 2 MiB pages);
- `random`: the same group, mapped as a server now maps a version that does not fit
  (`Shard.open(random_access=True)`: MADV_RANDOM, 4 KiB faults);
- `random+index`: that, with the index pinned (what a server does when the index fits the
  group beside the process's headroom, `cube.server.memory`; skipped when it would not);
- `paged`: what a server does now (`cube.server.service.PagedGather`): `random`, the index
  pinned when it fits, a hot cache of the automatic size in front (`--hot_cache_mb -1`,
  filled from the warm-up's answers) and misses read on several threads;
- `server`: a real cube-server (defaults: `--in_mem`, one worker) started in the group on the
  shard as its version, looked up through AsyncCubeClient with `--inflight` requests in flight
  (the issue's setting: 8) from outside the group; every 8th answer checked.

The shard's pages are dropped from the page cache before each child (POSIX_FADV_DONTNEED), so
every run starts cold. Prints a table and one JSON object (`--out`). Needs root and cgroup v1's
memory controller for the limited runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from cube.bench.keyspace import DerivedData, draw_pool, parse_distributions, values_of
from cube.bench.procs import ProcessRegistry, port_open
from cube.index import build_table
from cube.processes import free_port
from cube.server.memory import in_mem_refusal
from cube.server.versions import write_version_file
from cube.shard import Shard, ShardStack, write_shard
from cube.values import ValueColumn

CGROUP_V1 = Path("/sys/fs/cgroup/memory")
MODES = ("in-memory", "before", "random", "random+index", "paged", "server")
BATCH = 1000


def write_table(directory: Path, data: DerivedData) -> int:
    """The shard of `data` in `directory`; its bytes."""
    keys = data.keys(np.arange(data.count, dtype=np.uint64))
    values = values_of(keys, data.width).reshape(-1)
    column = ValueColumn.fixed(values, data.width)
    write_shard(directory, build_table(keys), column, {"dict_name": "paging", "version": "1"})
    return sum(p.stat().st_size for p in directory.iterdir())


def drop_cache(directory: Path) -> None:
    for path in directory.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def require_memory_controller() -> None:
    """Exit with a message unless this process may make cgroup v1 memory groups."""
    if os.geteuid() != 0 or not (CGROUP_V1 / "memory.limit_in_bytes").exists():
        raise SystemExit("needs root and cgroup v1's memory controller")


@contextlib.contextmanager
def memory_group(label: str, limit: int) -> Iterator[Path]:
    """A fresh cgroup v1 memory group of `limit` bytes, removed at the end (the caller has
    stopped every process it put there by then)."""
    group = CGROUP_V1 / f"cube-{label}-{os.getpid()}-{time.time_ns()}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(limit))
        yield group
    finally:
        group.rmdir()


def peak_mib(group: Path) -> int:
    return round(int((group / "memory.max_usage_in_bytes").read_text()) / (1 << 20))


def start_server_in(
    group: Path, registry: ProcessRegistry, version_dir: Path, logs: Path, *flags: str
) -> int:
    """cube-server on the data dir holding `version_dir`, put into `group` before it execs
    (so its load is charged there), ready once it serves that version; its lookup port."""
    port = free_port()
    server = Path(sys.executable).parent / "cube-server"
    command = (
        f"echo $$ > {group / 'cgroup.procs'} && exec {server} --port {port} --data_dir"
        f" {version_dir.parent} {' '.join(flags)}"
    )
    log = logs / f"cube-server-{len(registry.servers)}.log"  # (ProcessRegistry's name)

    def serving() -> bool:  # its port is bound before the version is loaded
        return port_open(port) and log.exists() and f"SERVING {version_dir.name}" in log.read_text()

    registry.start("cube-server", ["sh", "-c", command], [port], logs, ready=serving, timeout=3600)
    return port


def probe(
    directory: Path, mode: str, data: DerivedData, dist: str, seconds: float, warmup: float
) -> dict[str, Any]:
    """The child's work: map the shard as `mode` says, look keys up for `warmup` seconds
    (other keys of the same distribution: the page cache's steady state, and the kernel's
    collapse of file pages into huge ones, which slows the first seconds after a load), then
    time batches (see the module)."""
    from cube.server import memory
    from cube.server.service import FastGather, PagedGather
    from cube.server.versions import lock_in_memory

    limit, source = memory.memory_limit()
    index_bytes = (directory / "index.cube").stat().st_size
    pin_index = mode == "random+index" or (
        mode == "paged" and not in_mem_refusal(index_bytes, 0, limit, source)
    )
    shard = Shard.open(
        directory,
        populate=mode == "in-memory",
        huge_pages=mode == "before",
        random_access=mode.startswith("random") or mode == "paged",
        populate_index=pin_index,
    )
    if pin_index:
        lock_in_memory(shard, index_only=True)
    gather = FastGather(ShardStack([shard]))
    if mode == "paged":
        budget = memory.hot_cache_budget(limit, 1, index_bytes if pin_index else 0)
        gather = PagedGather(ShardStack([shard]), budget)
    # drawn by the parent (a draw's temporaries would count against the child's limit)
    pool = np.load(directory.parent.parent / f"pool-{mode}-{dist}.npy", mmap_mode="r")
    warm = np.load(directory.parent.parent / f"warm-{dist}.npy", mmap_mode="r")
    warm_until = time.perf_counter() + warmup
    done = 0
    while done == 0 or time.perf_counter() < warm_until:
        gather.fixed_values(warm[done % warm.shape[0]])
        done += 1
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
    cache = gather.cache if isinstance(gather, PagedGather) else None
    warm_stats = cache.describe() if cache else {}
    latencies = []
    started = time.perf_counter()
    done = 0
    while time.perf_counter() - started < seconds and done < pool.shape[0]:
        keys = pool[done]
        begun = time.perf_counter()
        found, values = gather.fixed_values(keys)
        latencies.append(time.perf_counter() - begun)
        if not found.all() or not np.array_equal(values, values_of(keys, data.width)):
            raise SystemExit(f"wrong answer in batch {done}")
        done += 1
    elapsed = time.perf_counter() - started
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_majflt - faults
    ms = np.array(latencies) * 1e3
    stats: dict[str, float] = dict(cache.describe()) if cache else {}
    if cache:  # the measured window's share, not the warm-up's (its keys repeat)
        asked = stats["asked"] - warm_stats["asked"]
        stats["hit_share"] = round((stats["hits"] - warm_stats["hits"]) / max(1, asked), 3)
    return {
        "mode": mode,
        "distribution": dist,
        "index_pinned": pin_index,
        "hot_cache": stats,
        "keys_per_s": round(done * BATCH / elapsed),
        "p50_ms": round(float(np.median(ms)), 3),
        "p99_ms": round(float(np.percentile(ms, 99)), 3),
        "major_faults_per_key": round(faults / (done * BATCH), 3),
        "batches": done,
    }


async def drive_server(
    port: int, pool: np.ndarray, warm: np.ndarray, width: int, seconds: float, warmup: float,
    inflight: int,
) -> dict[str, Any]:  # fmt: skip
    """The `server` mode's lookups: `inflight` tasks sharing one AsyncCubeClient, `warmup` s
    of `warm`'s requests, then `seconds` of `pool`'s, every 8th answer checked."""
    from cube.client import AsyncCubeClient

    async with AsyncCubeClient(shards=[[f"127.0.0.1:{port}"]], timeout=30) as client:
        await client.wait_ready(600)
        counter = iter(range(1 << 62))
        latencies: list[float] = []
        problems: list[str] = []
        failed = wrong = 0
        deadline = time.perf_counter() + warmup

        async def worker(measure: bool, until: float) -> None:
            nonlocal failed, wrong
            source = pool if measure else warm
            while time.perf_counter() < until:
                number = next(counter)
                keys = source[number % source.shape[0]]
                begun = time.perf_counter()
                try:
                    result = await client.seek(keys)
                except Exception as exc:
                    failed += 1
                    problems.append(f"{type(exc).__name__}: {exc}"[:300])
                    continue
                if measure:
                    latencies.append(time.perf_counter() - begun)
                if number % 8 == 0 and not (
                    result.found.all()
                    and np.array_equal(result.column.as_rows(), values_of(keys, width))
                ):
                    wrong += 1

        await asyncio.gather(*(worker(False, deadline) for _ in range(inflight)))
        started = time.perf_counter()
        until = started + seconds
        await asyncio.gather(*(worker(True, until) for _ in range(inflight)))
        elapsed = time.perf_counter() - started
        ms = np.array(latencies) * 1e3
        return {
            "keys_per_s": round(len(latencies) * BATCH / elapsed),
            "p50_ms": round(float(np.median(ms)), 3) if ms.size else 0.0,
            "p99_ms": round(float(np.percentile(ms, 99)), 3) if ms.size else 0.0,
            "failed": failed,
            "first_failure": problems[0] if problems else "",
            "wrong": wrong,
            "batches": len(latencies),
        }


def serve(
    directory: Path, data: DerivedData, dist: str, seconds: float, limit: int, warmup: float,
    inflight: int,
) -> dict[str, Any]:  # fmt: skip
    """The `server` mode: cube-server in a fresh group of `limit` bytes on `directory` (a
    version directory of a data dir), driven from this process."""
    (distribution,) = parse_distributions(dist)
    pool = draw_pool(data, distribution, 4096, BATCH, seed=5)
    warm = draw_pool(data, distribution, 10_000, BATCH, seed=6)
    drop_cache(directory)
    registry = ProcessRegistry()
    try:
        with memory_group("paging-server", limit) as group:
            try:
                logs = directory.parent.parent / "logs"
                port = start_server_in(group, registry, directory, logs, "--metrics_port", "0")
                lookups = drive_server(port, pool, warm, data.width, seconds, warmup, inflight)
                result = {"mode": "server", "distribution": dist, "inflight": inflight}
                result.update(asyncio.run(lookups))
                result["peak_mib"] = peak_mib(group)
                return result
            finally:
                registry.stop_all()
    except Exception as exc:  # a server that died (OOM?) or never served
        return {"mode": "server", "distribution": dist, "error": str(exc)[:500]}


def run_child(
    directory: Path,
    mode: str,
    data: DerivedData,
    dist: str,
    seconds: float,
    limit: int,
    warmup: float = 3.0,
) -> dict[str, Any]:
    """One probe in a child process, in a fresh memory group of `limit` bytes (0: none)."""
    (distribution,) = parse_distributions(dist)
    rate = {"in-memory": 12_000_000, "paged": 250_000}.get(mode, 50_000)  # > it will do
    batches = max(1, int(seconds * rate / BATCH))
    pool = draw_pool(data, distribution, batches, BATCH, seed=5)
    np.save(directory.parent.parent / f"pool-{mode}-{dist}.npy", pool)
    del pool
    warm = directory.parent.parent / f"warm-{dist}.npy"
    if not warm.exists():  # 10M draws: a warm-up that repeats them would teach the hot cache
        np.save(warm, draw_pool(data, distribution, 10_000, BATCH, seed=6))  # only those
    drop_cache(directory)
    argv = [sys.executable, "-m", "cube.bench.paging", "--child", str(directory), "--mode", mode,
            "--keys", str(data.count), "--width", str(data.width), "--distributions", dist,
            "--seconds", str(seconds), "--warmup", str(warmup)]  # fmt: skip
    with memory_group("paging", limit) if limit else contextlib.nullcontext() as group:
        preexec = None
        if group is not None:
            procs = group / "cgroup.procs"

            def join() -> None:
                procs.write_text(str(os.getpid()))

            preexec = join
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=seconds * 4 + 300, preexec_fn=preexec
        )
        if done.returncode != 0:
            killed = " (killed: out of memory?)" if done.returncode < 0 else ""
            return {"mode": mode, "distribution": dist, "error": f"exit {done.returncode}{killed}"}
        result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        if group is not None:
            result["peak_mib"] = peak_mib(group)
        return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=20_000_000)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--share", type=float, default=0.25, help="memory limit / table bytes")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds looked up untimed")
    parser.add_argument("--distributions", default="uniform,zipf:0.99")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the shard goes")
    parser.add_argument("--out", default="")
    parser.add_argument("--inflight", type=int, default=8, help="requests in flight (server)")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    data = DerivedData(args.keys, args.width)
    if args.child:
        print(
            json.dumps(
                probe(
                    Path(args.child), args.mode, data, args.distributions, args.seconds, args.warmup
                )
            )
        )
        return 0
    require_memory_controller()
    need = args.keys * (args.width + 16) * 1.2
    if shutil.disk_usage(args.dir).free < need:
        raise SystemExit(f"{args.dir}: needs {need / 1e9:.1f} GB free for the shard")
    root = Path(tempfile.mkdtemp(prefix="cube-paging-", dir=args.dir))
    try:
        started = time.perf_counter()
        shard = root / "data" / "1"  # a version directory: the server mode serves it
        size = write_table(shard, data)
        write_version_file(root / "data", "1")
        print(f"shard: {args.keys:,} keys x {args.width} B, {size / 1e9:.2f} GB written in"
              f" {time.perf_counter() - started:.0f} s", flush=True)  # fmt: skip
        limit = int(size * args.share)
        index_bytes = (shard / "index.cube").stat().st_size
        pin_refusal = in_mem_refusal(index_bytes, 0, limit, "the group's limit")
        results = []
        for dist in args.distributions.split(","):
            for mode in args.modes.split(","):
                if mode == "random+index" and pin_refusal:  # a server would not pin it either
                    results.append({"mode": mode, "distribution": dist, "error": "index unpinned"})
                    print(f"{mode}: skipped, a server would not pin this index: {pin_refusal}")
                    continue
                cap = 0 if mode == "in-memory" else limit
                if mode == "server":
                    results.append(
                        serve(shard, data, dist, args.seconds, cap, args.warmup, args.inflight)
                    )
                else:
                    results.append(
                        run_child(shard, mode, data, dist, args.seconds, cap, args.warmup)
                    )
                print(json.dumps(results[-1]), flush=True)
        report = {
            "keys": args.keys, "width": args.width, "table_bytes": size,
            "limit_bytes": limit, "results": results, "machine": os.uname().nodename,
            "cpus": os.cpu_count(),
        }  # fmt: skip
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"{'distribution':14} {'mode':14} {'keys/s':>10} {'p50 ms':>8} {'p99 ms':>8}"
              f" {'faults/key':>10}")  # fmt: skip
        for r in results:
            print(f"{r['distribution']:14} {r['mode']:14} {r.get('keys_per_s', 0):>10,}"
                  f" {r.get('p50_ms', 0):>8} {r.get('p99_ms', 0):>8}"
                  f" {r.get('major_faults_per_key', r.get('error', '')):>10}")  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
