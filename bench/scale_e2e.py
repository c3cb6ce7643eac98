"""The scale benchmark (issue 37): a table of N keys end to end, then lookups under load.

    make bench-scale KEYS=100000000 WIDTH=64            # or:
    python -m cube.bench.scale_e2e --keys 100000000 --width 64 --baseline_keys 1000000

One command, in this order, everything under one temp directory (removed at the end):
1. Checks first: the free disk under --tmp and the memory available must hold the largest run
   (the factors below, measured); it refuses with what it needs and what there is (exit 2).
2. Per size, the baseline (--baseline_keys, default 1M) and then --keys: a cube-local cluster
   (--shards servers, one replica each, an agent each, a cube-transfer) on loopback; the input
   written streaming (bench.keyspace: key i = fmix64(i ^ salt), its value the key's bytes
   repeated: never the whole set in memory, every answer checkable), a base line appended to the
   donefile, and each phase timed from that line with the transfer's own record of the version
   (seen, build start, built, downloaded, loaded, enabled) and cube-local's wait_version
   (served: every server SERVING it). Then, per distribution (--distributions, default
   `uniform,zipf:0.99`; bench.keyspace), --pool requests of --batch keys drawn before the clock
   and cycled, sent through AsyncCubeClient (uvloop) with --inflight in flight: --warmup s, then
   --duration s measured between two CPU snapshots of the servers (bench.procs CpuSnapshot,
   /proc/<pid>/stat), every --check_every-th answer checked against the derived values. The
   cluster is stopped (by PID) and its files removed before the next size.
3. --tables T (default 26; 0: skipped): DLRM-shaped requests, T tables x --keys_per_table keys
   through `seek_tables`, on one version of T tables of --table_keys keys each (default
   --keys / T), built table by table and laid out by bench.multitable (why: see there), served
   by --shards cube-servers started here.
4. --redis: redis-server beside it at --redis_keys (default --keys), loaded by pipelined MSET in
   chunks of derived values, looked up with the same draws through redis.asyncio MGET.

Reports server CPU per 1000-key request (µs), keys per server CPU-second, p50/p99, keys/s, the
answers checked/wrong and lookups failed, and for each distribution the ratio of the large run
to the baseline. Writes one JSON (--out) and prints a short table. Exit 0; 1 when a lookup
failed or an answer was wrong (the figures are still written) or a step failed; 2 on bad flags
or a size that does not fit; 130 on Ctrl-C. Every process it started is stopped by PID at the
end, on error, on Ctrl-C and on SIGTERM/SIGHUP.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import shlex
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from cube.bench.cube_bench import base_versions, machine
from cube.bench.keyspace import DerivedData, Distribution, draw_pool, parse_distributions, values_of
from cube.bench.keyspace import write_input as write_derived_input
from cube.bench.multitable import build_version
from cube.bench.procs import (
    CpuSnapshot,
    Interrupted,
    ProcessRegistry,
    cpu_between,
    signals_ignored,
    signals_raise,
)
from cube.bench.runner import wait_for_quiet
from cube.donefile import BASE_FILE, PATCH_FILE, append_line, format_line
from cube.flags import FlagError, FlagSet, flag, run_cli
from cube.processes import SERVING, free_port, health_status

# Disk a run takes per key at its peak, over the value width: the input (SequenceFile records of
# 8 + width bytes and framing), the build (shards + tars), the agents' download and unpacked copy.
# Measured here at 1M x 64 B: 5 copies of (width + 19) bytes a key; 6x leaves room.
DISK_COPIES = 6.0
DISK_PER_KEY = 20
# Memory: the servers hold each table's index and values (width + ~7 bytes a key, mlocked by
# default), plus the builder's buffers and this process (the draws: --pool x keys a request).
MEMORY_PER_KEY = 16
MEMORY_FIXED = 2 << 30
REDIS_PER_KEY = 100  # redis-server per key of 20-digit name and short value, over the width


@dataclass(frozen=True)
class ScaleFlags:
    """bench.scale_e2e's flags."""

    keys: int = flag(100_000_000, "keys of the table measured")
    width: int = flag(64, "value bytes per key")
    baseline_keys: int = flag(1_000_000, "keys of the baseline run, same invocation (0: none)")
    shards: int = flag(2, "shards (one cube-server each, one worker)")
    distributions: str = flag("uniform,zipf:0.99", "key distributions, comma separated")
    inflight: int = flag(32, "requests in flight (asyncio tasks sharing one client)")
    batch: int = flag(1000, "keys per request (single-table runs)")
    duration: float = flag(10.0, "seconds measured per distribution")
    warmup: float = flag(2.0, "seconds before measuring")
    check_every: int = flag(64, "check every Nth answer against the derived values")
    pool: int = flag(4096, "requests drawn before the clock per distribution, then cycled")
    patch_keys: int = flag(
        1_000_000, "keys of a patch rolled out onto each base while lookups run (0: none)"
    )
    tables: int = flag(26, "DLRM-shaped run: tables of one version (0: no such run)")
    keys_per_table: int = flag(40, "DLRM-shaped run: keys per table per request")
    table_keys: int = flag(0, "DLRM-shaped run: keys of each table (0: --keys / --tables)")
    redis: bool = flag(False, "also Redis at --redis_keys, with the same draws")
    redis_keys: int = flag(0, "keys loaded into Redis (0: --keys)")
    files: int = flag(0, "input files per run (0: about 1 GB each)")
    tmp: str = flag(tempfile.gettempdir(), "where the temp directory goes", metavar="DIR")
    keep: bool = flag(False, "keep the temp directory (for a look at the logs)")
    out: str = flag("bench-scale.json", "the JSON result", metavar="FILE")
    phase_timeout: float = flag(3600.0, "bound on each rollout phase and on served (s)")
    quiet_wait: float = flag(30.0, "seconds to wait at most for other load to drop, per run")
    max_other_load: float = flag(0.25, "cores other processes may use before waiting")
    server_args: str = flag("", "more cube-server flags (shell-split)", metavar="FLAGS")
    seed: int = flag(1, "seed of the draws")


FLAGS = FlagSet("bench-scale", (__doc__ or "").split("\n\n")[0], spec=ScaleFlags)


class ScaleError(RuntimeError):
    """A step failed; the message says which and where its logs were."""


# ---------------------------------------------------------------------------------------------
# checks before any work


def table_bytes(keys: int, width: int) -> int:
    return keys * (width + MEMORY_PER_KEY)


def needs(flags: ScaleFlags) -> tuple[int, int]:
    """(disk, memory) bytes the largest run needs at its peak: runs are one after another."""
    sizes = [flags.keys, flags.baseline_keys]
    dlrm = flags.tables * dlrm_table_keys(flags) if flags.tables else 0
    disk = int(max(*sizes, dlrm) * (flags.width + DISK_PER_KEY) * DISK_COPIES)
    pool = flags.pool * max(flags.batch, flags.tables * flags.keys_per_table) * 8 * 2
    memory = table_bytes(max(*sizes, dlrm), flags.width) + pool + MEMORY_FIXED
    if flags.redis:
        memory = max(memory, (flags.redis_keys or flags.keys) * (flags.width + REDIS_PER_KEY))
    return disk, memory


def shortfall(flags: ScaleFlags, free_disk: int, available: int) -> str:
    """Why this size cannot run here ("" when it can)."""
    disk, memory = needs(flags)
    problems = []
    if disk > free_disk:
        problems.append(
            f"{flags.tmp} has {free_disk / 2**30:.1f} GiB free, the run needs about"
            f" {disk / 2**30:.1f} GiB (input, build, the agents' copies; pass --tmp elsewhere)"
        )
    if memory > available:
        problems.append(
            f"{available / 2**30:.1f} GiB of memory is available, the run needs about"
            f" {memory / 2**30:.1f} GiB (the servers hold the table in memory)"
        )
    return "; ".join(problems)


def dlrm_table_keys(flags: ScaleFlags) -> int:
    return flags.table_keys or max(1, flags.keys // max(1, flags.tables))


def validate(flags: ScaleFlags) -> tuple[Distribution, ...]:
    for name in ("keys", "width", "shards", "inflight", "batch", "check_every", "pool"):
        if getattr(flags, name) <= 0:
            raise FlagError(f"--{name} must be > 0, got {getattr(flags, name)}")
    if flags.baseline_keys < 0 or flags.tables < 0 or flags.keys_per_table <= 0:
        raise FlagError("--baseline_keys and --tables must be >= 0, --keys_per_table > 0")
    if flags.duration <= 0 or flags.warmup < 0:
        raise FlagError("--duration must be > 0 and --warmup >= 0")
    try:
        return parse_distributions(flags.distributions)
    except ValueError as exc:
        raise FlagError(f"--distributions: {exc}") from None


# ---------------------------------------------------------------------------------------------
# load


@dataclass
class Tally:
    checked: int = 0
    wrong: int = 0
    failed: int = 0
    first_problem: str = ""


def _loop_run(main: Awaitable[dict[str, Any]]) -> dict[str, Any]:
    try:
        import uvloop

        return uvloop.run(main)  # type: ignore[arg-type]  # a coroutine
    except ImportError:
        return asyncio.run(main)  # type: ignore[arg-type]


async def drive(
    fetch: Callable[[Any], Awaitable[Any]],
    check: Callable[[Any, Any], str],
    requests: Sequence[Any] | np.ndarray,
    keys_per_request: int,
    flags: ScaleFlags,
    pids: list[int],
) -> dict[str, Any]:
    """--inflight tasks send `requests` (cycled) through `fetch` until the window ends; every
    --check_every-th answer goes through `check` (returns "" or what is wrong). Figures of the
    measured window (CPU of `pids` between two snapshots)."""
    tally = Tally()
    ends: list[int] = []
    latencies: list[int] = []
    counter = itertools.count()
    stopping = asyncio.Event()
    clock = time.perf_counter_ns

    async def worker() -> None:
        while not stopping.is_set():
            number = next(counter)
            request = requests[number % len(requests)]
            started = clock()
            try:
                answer = await fetch(request)
            except Exception as exc:  # counted and reported; the run goes on
                tally.failed += 1
                tally.first_problem = tally.first_problem or f"lookup failed: {exc!r}"[:500]
                if tally.failed > 10_000:
                    raise
                await asyncio.sleep(0.01)
                continue
            ended = clock()
            ends.append(ended)
            latencies.append(ended - started)
            if number % flags.check_every == 0:
                tally.checked += 1
                problem = check(request, answer)
                if problem:
                    tally.wrong += 1
                    tally.first_problem = tally.first_problem or problem

    tasks = [asyncio.create_task(worker()) for _ in range(flags.inflight)]
    try:
        await asyncio.sleep(flags.warmup)
        before = CpuSnapshot.take(pids)
        await asyncio.sleep(flags.duration)
        after = CpuSnapshot.take(pids)
    finally:
        stopping.set()
        done = await asyncio.gather(*tasks, return_exceptions=True)
    errors = [e for e in done if isinstance(e, BaseException)]
    if errors:
        raise ScaleError(f"a load task failed: {errors[0]!r}")
    cpu = cpu_between(before, after)
    end = np.asarray(ends, dtype=np.int64)
    inside = (end >= before.at_ns) & (end <= after.at_ns)
    lat = np.asarray(latencies, dtype=np.int64)[inside] / 1000.0
    count = int(lat.shape[0])
    if not count:
        raise ScaleError(f"no lookup completed in the window ({tally.first_problem})")
    window = cpu["wall"]
    keys = count * keys_per_request
    return {
        "requests": count,
        "keys_per_request": keys_per_request,
        "window_s": round(window, 3),
        "req_s": round(count / window, 1),
        "keys_s": round(keys / window),
        "p50_us": round(float(np.percentile(lat, 50)), 1),
        "p99_us": round(float(np.percentile(lat, 99)), 1),
        "server_cpu_us_per_req": round(cpu["servers"] / count * 1e6, 1),
        "server_cpu_us_per_1000_keys": round(cpu["servers"] / keys * 1e9, 1),
        "keys_per_server_cpu_s": round(keys / max(cpu["servers"], 1e-9)),
        "client_cpu_us_per_req": round(cpu["client"] / count * 1e6, 1),
        "other_cores": round((cpu["other"] + cpu["steal"]) / window, 2),
        "loadavg": cpu["loadavg"],
        **asdict(tally),
    }


def check_rows(keys: np.ndarray, found: np.ndarray, rows: np.ndarray, width: int) -> str:
    """ "" when every key was found with its derived value, else what is wrong."""
    if not found.all():
        missing = keys[~found]
        return f"{missing.shape[0]} of {keys.shape[0]} keys missing, e.g. {int(missing[0])}"
    expected = values_of(keys, width)
    if rows.shape != expected.shape:
        return f"answer of shape {rows.shape} for {expected.shape}"
    bad = np.flatnonzero((rows != expected).any(axis=1))
    if bad.shape[0]:
        return f"{bad.shape[0]} wrong values, e.g. key {int(keys[bad[0]])}"
    return ""


def cube_load(
    addresses: list[str], dict_name: str, requests: np.ndarray, width: int, flags: ScaleFlags,
    pids: list[int],
) -> dict[str, Any]:  # fmt: skip
    """Single-table lookups: AsyncCubeClient.seek of each request's keys."""
    from cube.client import AsyncCubeClient

    def check(keys: np.ndarray, result: Any) -> str:
        return check_rows(keys, result.found, result.column.as_rows(), width)

    async def main() -> dict[str, Any]:
        shards = [[address] for address in addresses]
        async with AsyncCubeClient(shards=shards, dict_name=dict_name, timeout=30.0) as client:
            await client.wait_ready(30)
            return await drive(client.seek, check, requests, requests.shape[1], flags, pids)

    return _loop_run(main())


def tables_load(
    addresses: list[str], dict_name: str, requests: list[list[tuple[str, np.ndarray]]],
    width: int, flags: ScaleFlags, pids: list[int],
) -> dict[str, Any]:  # fmt: skip
    """DLRM-shaped lookups: AsyncCubeClient.seek_tables of each request's (table, keys)."""
    from cube.client import AsyncCubeClient

    def check(request: list[tuple[str, np.ndarray]], results: Any) -> str:
        for (name, keys), result in zip(request, results, strict=True):
            problem = check_rows(keys, result.found, result.column.as_rows(), width)
            if problem:
                return f"table {name}: {problem}"
        return ""

    per_request = sum(keys.shape[0] for _, keys in requests[0])

    async def main() -> dict[str, Any]:
        shards = [[address] for address in addresses]
        async with AsyncCubeClient(shards=shards, dict_name=dict_name, timeout=30.0) as client:
            await client.wait_ready(30)
            return await drive(client.seek_tables, check, requests, per_request, flags, pids)

    return _loop_run(main())


def redis_load(
    port: int, requests: np.ndarray, width: int, flags: ScaleFlags, pids: list[int]
) -> dict[str, Any]:
    """Redis: redis.asyncio MGET of each request's keys (decimal names), pooled connections."""
    import redis.asyncio

    from cube.bench.targets import rows_from_list

    def check(keys: np.ndarray, answer: list[bytes | None]) -> str:
        rows, _misses = rows_from_list(answer, width, 0)
        found = np.array([value is not None for value in answer], dtype=bool)
        return check_rows(keys, found, rows, width)

    async def main() -> dict[str, Any]:
        client = redis.asyncio.Redis(
            host="127.0.0.1", port=port, socket_timeout=30, max_connections=flags.inflight + 1
        )

        async def fetch(keys: np.ndarray) -> Any:
            return await client.mget(keys.tolist())

        try:
            return await drive(fetch, check, requests, requests.shape[1], flags, pids)
        finally:
            await client.aclose()

    return _loop_run(main())


# ---------------------------------------------------------------------------------------------
# runs


def _say(text: str) -> None:
    """Progress on stdout; a closed stdout (`| head`, a killed pager) must not stop the
    cleanup that prints as it goes."""
    with contextlib.suppress(OSError):
        print(text, flush=True)


def _process_tree(pids: Sequence[int]) -> list[int]:
    found = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            found += [pid, *(child.pid for child in proc.children(recursive=True))]
    return found


def _rss(pids: Sequence[int]) -> int:
    total = 0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            total += psutil.Process(pid).memory_info().rss
    return total


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


class Runner:
    """The runs of one invocation, and what must be stopped and removed however it ends."""

    def __init__(self, flags: ScaleFlags, distributions: tuple[Distribution, ...], work: Path):
        self.flags = flags
        self.distributions = distributions
        self.work = work
        self.registry = ProcessRegistry(log=_say)
        self.clusters: list[Any] = []  # cube-local clusters up (cube.transfer.local.Cluster)

    def stop_all(self) -> None:
        """Every process started: the clusters' (by their recorded PIDs), then ours."""
        for cluster in self.clusters:
            for line in cluster.down(timeout=10.0):
                _say(f"  {line}")
        self.clusters.clear()
        self.registry.stop_all()

    def _draws(self, data: DerivedData, distribution: Distribution, batch: int) -> np.ndarray:
        return draw_pool(data, distribution, self.flags.pool, batch, self.flags.seed)

    def _quiet(self, pids: list[int]) -> None:
        wait_for_quiet(pids, self.flags.max_other_load, self.flags.quiet_wait, _say)

    def _report_level(self, label: str, level: dict[str, Any]) -> None:
        _say(
            f"  {label}: {level['keys_s'] / 1e6:.2f}M keys/s, p50 {level['p50_us']:.0f} µs,"
            f" p99 {level['p99_us']:.0f} µs, server {level['server_cpu_us_per_1000_keys']:.0f}"
            f" µs per 1000 keys; checked {level['checked']}, wrong {level['wrong']},"
            f" failed {level['failed']}"
        )

    # -- one table through the whole pipeline ----------------------------------------------
    def table_run(self, keys: int) -> dict[str, Any]:
        from cube.transfer.local import ClusterSpec, up

        flags = self.flags
        root = self.work / f"table-{keys}"
        _say(f"== {keys:,} keys x {flags.width} B: cube-local up ({flags.shards} shards)")
        spec = ClusterSpec(
            dir=root / "cluster",
            shards=flags.shards,
            replicas=1,
            donefile=root / "donefile",
            create_donefile_dir=True,
            poll_interval=0.2,
            phase_timeout=flags.phase_timeout,
            server_args=shlex.split(flags.server_args),
        )
        cluster = up(spec)
        self.clusters.append(cluster)
        data = DerivedData(keys, flags.width)
        files = flags.files or max(1, keys * (flags.width + 16) // (1 << 30))
        started = time.perf_counter()
        input_bytes = write_derived_input(root / "input", data, files)
        input_s = time.perf_counter() - started
        os.sync()  # the input on disk before the build: its writeback would compete
        sync_s = time.perf_counter() - started - input_s
        _say(f"  input: {input_bytes / 1e9:.2f} GB in {files} file(s), {input_s:.1f}s")
        version = str(int(time.time()))
        line_at = time.time()
        append_line(
            root / "donefile" / BASE_FILE, format_line(version, version, str(root / "input"))
        )
        cluster.wait_version(version, flags.phase_timeout * 4, poll=0.1)
        served = time.time() - line_at
        phases = self._phases(cluster, version, line_at, served)
        _say("  " + ", ".join(f"{name} {at:.1f}s" for name, at in phases["after_line_s"].items()))
        servers = [p for p in cluster.processes if p.role == "server"]
        pids = _process_tree([p.pid for p in servers])
        disk = _du(root)
        data_files = list((root / "cluster" / "instances").glob(f"*/data/{version}/*.cube"))
        index_bytes = sum(p.stat().st_size for p in data_files if p.name == "index.cube")
        shutil.rmtree(root / "input", ignore_errors=True)
        result: dict[str, Any] = {
            "keys": keys,
            "width": flags.width,
            "shards": flags.shards,
            "input_s": round(input_s, 2),
            "input_sync_s": round(sync_s, 2),
            "input_bytes": input_bytes,
            "input_files": files,
            "version": version,
            **phases,
            "disk_bytes_at_served": disk,
            "index_bytes_per_key": round(index_bytes / keys, 2),
            "server_rss_bytes": _rss(pids),
            "server_pids": pids,
            "lookups": {},
        }
        addresses = [f"127.0.0.1:{p.port}" for p in sorted(servers, key=lambda p: p.shard)]
        for distribution in self.distributions:
            requests = self._draws(data, distribution, flags.batch)
            self._quiet(pids)
            _say(f"  {distribution}: {requests.size:,} keys drawn")
            level = cube_load(addresses, cluster.dict_name, requests, flags.width, flags, pids)
            del requests
            result["lookups"][str(distribution)] = level
            self._report_level(f"{keys:,} {distribution}", level)
        if flags.patch_keys:
            result["patch"] = self.patch_run(cluster, root, data, version, addresses, pids)
        result["server_rss_bytes_after"] = _rss(pids)
        for line in cluster.down(timeout=10.0):
            _say(f"  {line}")
        self.clusters.remove(cluster)
        shutil.rmtree(root, ignore_errors=True)
        return result

    def patch_run(
        self,
        cluster: Any,
        root: Path,
        data: DerivedData,
        base: str,
        addresses: list[str],
        pids: list[int],
    ) -> dict[str, Any]:
        """Freshness (issue 37 item 2): a patch of the base's first --patch_keys keys (their
        values unchanged, so every answer stays checkable) appended to patch.txt while
        lookups of the first distribution run; when every server serves it, in phases, and
        the lookups' figures over the rollout (none may fail)."""
        flags = self.flags
        patch = DerivedData(min(flags.patch_keys, data.count), data.width)
        started = time.perf_counter()
        write_derived_input(root / "patch-input", patch, 1)
        input_s = time.perf_counter() - started
        os.sync()
        requests = self._draws(data, self.distributions[0], flags.batch)
        during: dict[str, Any] = {}
        failure: list[BaseException] = []

        def lookups() -> None:
            try:
                during.update(
                    cube_load(addresses, cluster.dict_name, requests, data.width, flags, pids)
                )
            except BaseException as exc:  # raised below, in the run's thread
                failure.append(exc)

        load = threading.Thread(target=lookups)
        load.start()
        time.sleep(flags.warmup + 1.0)  # the lookups measured before, during and after it
        patch_id = str(int(time.time()))
        version = f"{base}_{patch_id}"
        line_at = time.time()
        line = format_line(patch_id, base, str(root / "patch-input"))
        append_line(root / "donefile" / PATCH_FILE, line)
        cluster.wait_version(version, flags.phase_timeout, poll=0.05)
        served = time.time() - line_at
        load.join(flags.duration + flags.warmup + 120)
        if failure:
            raise RuntimeError(f"the lookups during the patch failed: {failure[0]}") from failure[0]
        if load.is_alive() or not during:
            raise RuntimeError("the lookups during the patch did not end in time")
        phases = self._phases(cluster, version, line_at, served)
        marks = ", ".join(f"{n} {a:.2f}s" for n, a in phases["after_line_s"].items())
        _say(f"  patch of {patch.count:,} keys: served {served:.2f}s after its line ({marks})")
        self._report_level(f"  lookups during the patch ({self.distributions[0]})", during)
        return {
            "keys": patch.count,
            "input_s": round(input_s, 2),
            "version": version,
            **phases,
            "lookups_during": during,
        }

    @staticmethod
    def _phases(cluster: Any, version: str, line_at: float, served: float) -> dict[str, Any]:
        """When each phase ended, in seconds after the donefile line, from the transfer's record
        of the version; how long each took; and served (wait_version: every server SERVING)."""
        record: dict[str, Any] = next(
            (r for r in cluster.history() if r.get("version") == version), {}
        )
        times: dict[str, float] = record.get("times") or {}
        marks = ("line_seen", "build_start", "built", "downloaded", "reloaded", "enabled")
        after = {m: round(times[m] - line_at, 2) for m in marks if m in times}
        after["served"] = round(served, 2)
        spans = (("build", "build_start", "built"), ("download", "built", "downloaded"),
                 ("load", "downloaded", "reloaded"), ("enable", "reloaded", "enabled"))  # fmt: skip
        took = {n: round(times[b] - times[a], 2) for n, a, b in spans if a in times and b in times}
        return {"after_line_s": after, "phase_s": took}

    # -- DLRM-shaped requests ----------------------------------------------------------------
    def tables_run(self) -> dict[str, Any]:
        from cube.transfer.local import command

        flags = self.flags
        per_table = dlrm_table_keys(flags)
        root = self.work / "tables"
        names = [f"t{t:02d}" for t in range(flags.tables)]
        tables = [(name, DerivedData(per_table, flags.width, t)) for t, name in enumerate(names)]
        _say(f"== {flags.tables} tables x {per_table:,} keys: building each, one version")
        data_dirs = [root / f"server{s}" / "data" for s in range(flags.shards)]
        version = str(int(time.time()))
        dict_name = "dlrm"
        built = build_version(tables, dict_name, root / "build", data_dirs, version)
        table_bytes_all = flags.tables * per_table * (flags.width + MEMORY_PER_KEY)
        start_timeout = 60.0 + table_bytes_all / 50e6  # a server maps and populates its shard
        started = time.perf_counter()
        servers = []
        for shard, data_dir in enumerate(data_dirs):
            port = free_port()
            argv = [
                command("cube-server"),
                "--port", str(port),
                "--control_port", str(free_port()),  # (not --port + 1000: maybe held)
                "--data_dir", str(data_dir),
                "--dict_name", dict_name,
                "--shard", str(shard),
                "--log_level", "WARNING",
                *shlex.split(flags.server_args),
            ]  # fmt: skip

            def ready(port: int = port) -> bool:
                return health_status(f"127.0.0.1:{port}") == SERVING

            servers.append(
                self.registry.start(
                    f"cube-server-tables{shard}",
                    argv,
                    [port],
                    root / "logs",
                    ready=ready,
                    timeout=start_timeout,
                )
            )
        load_s = time.perf_counter() - started
        pids = _process_tree([s.pid for s in servers])
        result: dict[str, Any] = {
            "tables": flags.tables,
            "table_keys": per_table,
            "keys_per_table": flags.keys_per_table,
            "width": flags.width,
            "build_s": round(built["build_s"], 2),
            "served_s": round(load_s, 2),
            "server_rss_bytes": _rss(pids),
            "server_pids": pids,
            "lookups": {},
        }
        _say(f"  built in {built['build_s']:.1f}s, served {load_s:.1f}s after start")
        addresses = [f"127.0.0.1:{s.ports[0]}" for s in servers]
        for distribution in self.distributions:
            pools = [self._draws(data, distribution, flags.keys_per_table) for _, data in tables]
            requests = [
                [(name, pools[t][i]) for t, name in enumerate(names)] for i in range(flags.pool)
            ]
            self._quiet(pids)
            level = tables_load(addresses, dict_name, requests, flags.width, flags, pids)
            result["lookups"][str(distribution)] = level
            self._report_level(f"{flags.tables} tables {distribution}", level)
        for server in servers:
            self.registry.stop(server)
        shutil.rmtree(root, ignore_errors=True)
        return result

    # -- Redis beside it -------------------------------------------------------------------
    def redis_run(self) -> dict[str, Any]:
        from cube.bench.targets import RedisTarget, TargetUnavailable

        flags = self.flags
        keys = flags.redis_keys or flags.keys
        root = self.work / "redis"
        root.mkdir(parents=True)
        target = RedisTarget(self.registry, root, {})
        try:
            target.check_available("asyncio")
        except TargetUnavailable as exc:
            raise ScaleError(str(exc)) from None
        _say(f"== redis: {keys:,} keys x {flags.width} B")
        data = DerivedData(keys, flags.width)
        target.start_server(flags.width)
        started = time.perf_counter()
        target.load_chunks(data.chunks(1 << 18), keys)
        load_s = time.perf_counter() - started
        pids = target.server_pids()
        result: dict[str, Any] = {
            "keys": keys,
            "width": flags.width,
            "load_s": round(load_s, 2),
            "server_rss_bytes": _rss(pids),
            "server_pids": pids,
            "versions": target.versions(),
            "lookups": {},
        }
        _say(f"  loaded in {load_s:.1f}s")
        for distribution in self.distributions:
            requests = self._draws(data, distribution, flags.batch)
            self._quiet(pids)
            level = redis_load(target.port, requests, flags.width, flags, pids)
            result["lookups"][str(distribution)] = level
            self._report_level(f"redis {keys:,} {distribution}", level)
        target.stop()
        shutil.rmtree(root, ignore_errors=True)
        return result


def ratios(baseline: dict[str, Any] | None, large: dict[str, Any]) -> dict[str, Any]:
    """Per distribution: server CPU per 1000 keys and p99 of the large run over the baseline's
    uniform and same-distribution figures (the issue's targets are stated so)."""
    if baseline is None:
        return {}
    out: dict[str, Any] = {}
    base_uniform = baseline["lookups"].get("uniform")
    for name, level in large["lookups"].items():
        same = baseline["lookups"].get(name)
        entry: dict[str, float] = {}
        if same:
            entry["server_cpu_vs_baseline_same"] = round(
                level["server_cpu_us_per_1000_keys"] / same["server_cpu_us_per_1000_keys"], 3
            )
            entry["keys_s_vs_baseline_same"] = round(level["keys_s"] / same["keys_s"], 3)
        if base_uniform:
            entry["server_cpu_vs_baseline_uniform"] = round(
                level["server_cpu_us_per_1000_keys"] / base_uniform["server_cpu_us_per_1000_keys"],
                3,
            )
        out[name] = entry
    return out


def table_text(result: dict[str, Any]) -> str:
    """The short human table: one row per run and distribution."""
    head = (
        "| run | keys | distribution | keys/s | p50 µs | p99 µs | server µs/1000 keys |"
        " keys/server CPU-s | checked | wrong | failed |"
    )
    lines = [head, "|" + "---|" * 11]
    for run in result["runs"]:
        label = run["label"]
        size = f"{run['keys']:,}" if "keys" in run else f"{run['tables']}x{run['table_keys']:,}"
        for name, v in run["lookups"].items():
            lines.append(
                f"| {label} | {size} | {name} | {v['keys_s'] / 1e6:.2f}M | {v['p50_us']:.0f} |"
                f" {v['p99_us']:.0f} | {v['server_cpu_us_per_1000_keys']:.0f} |"
                f" {v['keys_per_server_cpu_s'] / 1e6:.2f}M | {v['checked']} | {v['wrong']} |"
                f" {v['failed']} |"
            )
    for run in result["runs"]:
        if "after_line_s" in run:
            marks = ", ".join(f"{k} {v:.1f}" for k, v in run["after_line_s"].items())
            lines.append(
                f"\n{run['label']} {run['keys']:,} keys, s after the donefile line: {marks}"
            )
        if "patch" in run:
            patch = run["patch"]
            marks = ", ".join(f"{k} {v:.2f}" for k, v in patch["after_line_s"].items())
            during = patch["lookups_during"]
            lines.append(
                f"{run['label']} patch of {patch['keys']:,} keys, s after its line: {marks};"
                f" lookups meanwhile p99 {during['p99_us']:.0f} µs, failed {during['failed']}"
            )
    for name, entry in result.get("ratios", {}).items():
        lines.append(f"ratio {name}: " + ", ".join(f"{k} {v}" for k, v in entry.items()))
    return "\n".join(lines)


def run(flags: ScaleFlags, argv: Sequence[str]) -> int:
    distributions = validate(flags)
    tmp = Path(flags.tmp)
    if not tmp.is_dir():
        raise FlagError(f"--tmp {tmp}: not a directory")
    problem = shortfall(flags, shutil.disk_usage(tmp).free, psutil.virtual_memory().available)
    if problem:
        print(f"bench-scale: refused: {problem}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="cube-scale-e2e-", dir=tmp))
    runner = Runner(flags, distributions, work)
    result: dict[str, Any] = {
        "command": shlex.join(["python -m cube.bench.scale_e2e", *argv]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "settings": asdict(flags),
        "machine": machine(),
        "versions": base_versions(),
        "runs": [],
    }
    status = 0
    try:
        with signals_raise():
            baseline = None
            if flags.baseline_keys and flags.baseline_keys != flags.keys:
                baseline = {"label": "baseline", **runner.table_run(flags.baseline_keys)}
                result["runs"].append(baseline)
            large = {"label": "scale", **runner.table_run(flags.keys)}
            result["runs"].append(large)
            result["ratios"] = ratios(baseline, large)
            if flags.tables:
                result["runs"].append({"label": "dlrm", **runner.tables_run()})
            if flags.redis:
                result["runs"].append({"label": "redis", **runner.redis_run()})
    except (KeyboardInterrupt, Interrupted) as exc:
        print(f"\ninterrupted ({exc or 'Ctrl-C'}); stopping", file=sys.stderr)
        status = 130
    except Exception as exc:
        print(f"error: {exc}", file=sys.stderr)
        if flags.keep:
            print(f"logs are in {work}", file=sys.stderr)
        status = 1
    finally:
        with signals_ignored():
            runner.stop_all()
            if not flags.keep:
                shutil.rmtree(work, ignore_errors=True)
    if status:
        return status
    levels = [
        (run["label"], name, level)
        for run in result["runs"]
        for name, level in run["lookups"].items()
    ]
    levels += [
        (run["label"], "during the patch", run["patch"]["lookups_during"])
        for run in result["runs"]
        if "patch" in run
    ]
    problems = [entry for entry in levels if entry[2]["wrong"] or entry[2]["failed"]]
    result["ok"] = not problems
    Path(flags.out).parent.mkdir(parents=True, exist_ok=True)
    Path(flags.out).write_text(json.dumps(result, indent=1) + "\n")
    _say("\n" + table_text(result) + f"\n\nwrote {flags.out}")
    for label, name, level in problems:
        print(f"error: {label} {name}: {level['first_problem']}", file=sys.stderr)
    return 1 if problems else 0


def main(argv: Sequence[str] | None = None) -> int:
    def body(args: Sequence[str]) -> int:
        return run(FLAGS.parse(args), args)

    return run_cli(body, argv)


if __name__ == "__main__":
    sys.exit(main())
