"""Drive one concurrency level against a target: N threads (or N asyncio tasks), each sending
batches of fresh random keys back to back; warm up, then measure for a fixed time (or a fixed
number of requests) between two CPU snapshots, and repeat a level that other processes disturbed.

Every request draws new random keys: a fixed key set stays cache-hot and flatters servers whose
cost is memory latency (perf-notes: Redis about 5x).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cube.bench.procs import CpuSnapshot, cpu_between
from cube.bench.targets import DataSource, Target

_NEVER = 2**63 - 1
_JOIN_TIMEOUT = 60.0  # clients have 30 s socket timeouts; a worker gone longer is stuck


class BenchError(RuntimeError):
    """A level could not be measured (a worker failed or hung); names target and level."""


@dataclass(frozen=True)
class LevelConfig:
    concurrency: int
    batch: int
    warmup: float  # seconds before measuring
    duration: float  # seconds measured (when requests == 0)
    requests: int  # > 0: measure this many completed requests instead of a fixed time
    timeout: float  # upper bound on the measured phase in requests mode
    mode: str  # "thread" | "shared" (threads sharing one client) | "asyncio"
    seed: int = 0


@dataclass
class Attempt:
    """Raw measurements of one run of a level (report.summarize turns them into figures)."""

    latencies_ns: np.ndarray  # int64, one per request completed inside the window
    misses: int
    window: float  # seconds between the CPU snapshots
    cpu: dict[str, float]  # cpu_between(): client, servers, other, irq, steal, wall, loadavg
    warmup_requests: int

    @property
    def requests(self) -> int:
        return int(self.latencies_ns.shape[0])

    @property
    def other_load(self) -> float:
        """Cores used by other processes (and stolen by the hypervisor) during the window."""
        return (self.cpu["other"] + self.cpu["steal"]) / max(self.window, 1e-9)


@dataclass
class LevelResult:
    config: LevelConfig
    attempt: Attempt  # the least disturbed attempt
    attempts: list[dict[str, float]] = field(default_factory=list)  # other_load of each try
    disturbed: bool = False  # still above the threshold after all repeats


class _Shared:
    """State the workers and the coordinating thread share."""

    def __init__(self, workers: int, requests: int) -> None:
        self.stop = threading.Event()
        self.measure_from_ns = _NEVER
        self.requests = requests
        self.counter = itertools.count(1)  # next() is atomic under the GIL
        self.records: list[tuple[list[int], list[int], list[int]]] = [
            ([], [], []) for _ in range(workers)
        ]
        self.error: BaseException | None = None

    def record(self, worker: int, started: int, ended: int, misses: int) -> None:
        ends, lats, miss = self.records[worker]
        ends.append(ended)
        lats.append(ended - started)
        miss.append(misses)
        measured = self.requests and ended >= self.measure_from_ns
        if measured and next(self.counter) >= self.requests:
            self.stop.set()

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self.stop.set()


def _thread_worker(
    shared: _Shared, index: int, client: Any, data: DataSource, cfg: LevelConfig
) -> None:
    rng = np.random.default_rng([cfg.seed, index])
    clock = time.perf_counter_ns
    try:
        while not shared.stop.is_set():
            batch = data.draw(rng, cfg.batch)
            started = clock()
            _values, misses = client.fetch(batch)
            shared.record(index, started, clock(), misses)
    except Exception as exc:
        shared.fail(exc)


async def _async_worker(
    shared: _Shared, index: int, client: Any, data: DataSource, cfg: LevelConfig
) -> None:
    rng = np.random.default_rng([cfg.seed, index])
    clock = time.perf_counter_ns
    while not shared.stop.is_set():
        batch = data.draw(rng, cfg.batch)
        started = clock()
        _values, misses = await client.fetch(batch)
        shared.record(index, started, clock(), misses)


def _start_threads(
    target: Target, data: DataSource, cfg: LevelConfig, shared: _Shared
) -> Callable[[], None]:
    """Threads mode: one client per thread, or ("shared") one client all threads use, as an
    application server would (connections made before the clock starts)."""
    if cfg.mode == "shared":
        clients = [target.thread_client()] * cfg.concurrency
    else:
        clients = [target.thread_client() for _ in range(cfg.concurrency)]
    threads = [
        threading.Thread(
            target=_thread_worker,
            args=(shared, i, clients[i], data, cfg),
            name=f"bench-{target.name}-{i}",
            daemon=True,
        )
        for i in range(cfg.concurrency)
    ]
    for thread in threads:
        thread.start()

    def finish() -> None:
        shared.stop.set()
        for thread in threads:
            thread.join(_JOIN_TIMEOUT)
        for client in {id(c): c for c in clients}.values():
            with contextlib.suppress(Exception):
                client.close()
        if any(thread.is_alive() for thread in threads):
            shared.fail(BenchError("a client thread did not finish within 60 s"))

    return finish


def _new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


def _start_asyncio(
    target: Target, data: DataSource, cfg: LevelConfig, shared: _Shared
) -> Callable[[], None]:
    """Asyncio mode: one event loop (uvloop) in its own thread, `concurrency` tasks, one
    shared client (the async libraries pool connections themselves)."""
    ready = threading.Event()

    async def main() -> None:
        client = target.async_client(cfg.concurrency)
        try:
            ready_hook = getattr(client, "ready", None)  # (a client with a warm-up step)
            if ready_hook is not None:
                await ready_hook()
            tasks = [
                asyncio.create_task(_async_worker(shared, i, client, data, cfg))
                for i in range(cfg.concurrency)
            ]
            ready.set()
            done, _pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                error = task.exception()
                if error is not None:
                    shared.fail(error)
            shared.stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            await client.close()

    def run() -> None:
        loop = _new_event_loop()
        try:
            loop.run_until_complete(main())
        except BaseException as exc:
            shared.fail(exc)
        finally:
            ready.set()
            loop.close()

    thread = threading.Thread(target=run, name=f"bench-{target.name}-loop", daemon=True)
    thread.start()
    if not ready.wait(_JOIN_TIMEOUT):
        shared.fail(BenchError("the asyncio client did not start within 60 s"))

    def finish() -> None:
        shared.stop.set()
        thread.join(_JOIN_TIMEOUT)
        if thread.is_alive():
            shared.fail(BenchError("the asyncio client did not finish within 60 s"))

    return finish


_SIGNAL_SLICE = 0.1  # seconds the main thread waits at most before it runs Python again


def wait_event(event: threading.Event, seconds: float) -> None:
    """`event.wait(seconds)` in short slices. The kernel may deliver Ctrl-C to any thread;
    Python handles it only when the main thread runs again, so one long wait in the main
    thread held a Ctrl-C for the rest of the level (a 60 s level ran on to its end)."""
    deadline = time.monotonic() + seconds
    while not event.is_set():
        left = deadline - time.monotonic()
        if left <= 0:
            return
        event.wait(min(left, _SIGNAL_SLICE))


def run_attempt(
    target: Target, data: DataSource, cfg: LevelConfig, server_pids: list[int]
) -> Attempt:
    """One warm-up + measured run of a level."""
    shared = _Shared(cfg.concurrency, cfg.requests)
    start = _start_asyncio if cfg.mode == "asyncio" else _start_threads
    finish: Callable[[], None] = start(target, data, cfg, shared)
    try:
        wait_event(shared.stop, cfg.warmup)  # returns early only on a worker error
        before = CpuSnapshot.take(server_pids)
        shared.measure_from_ns = before.at_ns
        wait_event(shared.stop, cfg.timeout if cfg.requests else cfg.duration)
        after = CpuSnapshot.take(server_pids)
    finally:
        finish()
    label = f"{target.name}, {cfg.concurrency} {cfg.mode}s, batch {cfg.batch}"
    if shared.error is not None:
        raise BenchError(f"{label}: {shared.error!r}") from shared.error
    if cfg.requests and next(shared.counter) <= cfg.requests:
        raise BenchError(f"{label}: {cfg.requests} requests not done within {cfg.timeout:.0f}s")
    ends = np.concatenate([np.asarray(r[0], np.int64) for r in shared.records])
    lats = np.concatenate([np.asarray(r[1], np.int64) for r in shared.records])
    miss = np.concatenate([np.asarray(r[2], np.int64) for r in shared.records])
    inside = (ends >= before.at_ns) & (ends <= after.at_ns)
    return Attempt(
        latencies_ns=lats[inside],
        misses=int(miss[inside].sum()),
        window=(after.at_ns - before.at_ns) / 1e9,
        cpu=cpu_between(before, after),
        warmup_requests=int((ends < before.at_ns).sum()),
    )


def other_load_now(server_pids: list[int], seconds: float = 1.0) -> float:
    """Cores other processes use right now (sampled over `seconds`, our servers excluded)."""
    before = CpuSnapshot.take(server_pids)
    wait_event(threading.Event(), seconds)
    used = cpu_between(before, CpuSnapshot.take(server_pids))
    return (used["other"] + used["steal"]) / used["wall"]


def wait_for_quiet(
    server_pids: list[int], max_other_load: float, max_wait: float, log: Callable[[str], None]
) -> float:
    """Wait (at most `max_wait` seconds) until other processes use at most `max_other_load`
    cores; returns the seconds waited. Levels then start on a quiet machine when one comes."""
    if max_wait <= 0:
        return 0.0
    started = time.monotonic()
    load = other_load_now(server_pids, 0.5)
    if load <= max_other_load:
        return 0.0
    log(f"  waiting up to {max_wait:.0f}s for other load ({load:.2f} cores) to drop")
    while time.monotonic() - started < max_wait and load > max_other_load:
        load = other_load_now(server_pids, 1.0)
    return time.monotonic() - started


def run_level(
    target: Target,
    data: DataSource,
    cfg: LevelConfig,
    max_other_load: float,
    max_repeats: int,
    log: Callable[[str], None] = print,
    quiet_wait: float = 0.0,
) -> LevelResult:
    """Run a level; while other processes used more than `max_other_load` cores during it,
    run it again (at most `max_repeats` more times) and keep the least disturbed attempt.
    Before every try, wait up to `quiet_wait` seconds for the machine to be quiet."""
    attempts: list[Attempt] = []
    for repeat in range(max_repeats + 1):
        pids = target.server_pids()
        wait_for_quiet(pids, max_other_load, quiet_wait, log)
        attempt = run_attempt(target, data, cfg, pids)
        attempts.append(attempt)
        if attempt.other_load <= max_other_load:
            break
        more = "repeating" if repeat < max_repeats else "no repeats left; keeping the least"
        log(
            f"  {target.name} C={cfg.concurrency}: other processes used "
            f"{attempt.other_load:.2f} cores (> {max_other_load}); {more} disturbed"
        )
    best = min(attempts, key=lambda a: a.other_load)
    return LevelResult(
        config=cfg,
        attempt=best,
        attempts=[
            {"other_load": round(a.other_load, 3), "loadavg": a.cpu["loadavg"]} for a in attempts
        ],
        disturbed=best.other_load > max_other_load,
    )
