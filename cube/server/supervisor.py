"""cube-server's supervisor (`--workers N`): runs N worker processes, restarts one that dies on
the version its peers serve, forwards SIGTERM/SIGINT and waits for them. What it decides about a
death is `Restarts`, pure (the time is passed in); `supervise` is the loop around it. How the
workers share a shard: docs/ARCHITECTURE.md (Serving path).
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cube.server.flags import ServerFlags


log = logging.getLogger("cube.server")

# A worker that cannot listen on one of its ports exits with this: its supervisor stops the
# server at once rather than restarting it on a port someone else holds (the server itself
# exits 1).
EXIT_CANNOT_LISTEN = 3
RESTART_WINDOW_S = 60.0  # --worker_restarts counts the deaths of one worker in this window
POLL_S = 0.2  # how often the supervisor looks at its workers
STOP_MARGIN_S = 10.0  # past --grace, the wait for a worker to stop before it is killed


@dataclass
class Restarts:
    """What to do when a worker dies: restart it, unless it could not listen (its port is
    someone else's: restarting cannot help) or it died more than `limit` times within
    `window_s` (a crash loop). Pure: `died` is told the time."""

    limit: int
    window_s: float = RESTART_WINDOW_S
    deaths: dict[int, list[float]] = field(default_factory=dict)

    def died(self, worker: int, code: int | None, now: float) -> str | None:
        """None: restart `worker`; else why the server must stop instead."""
        recent = [t for t in self.deaths.get(worker, []) if now - t < self.window_s]
        self.deaths[worker] = [*recent, now]
        if code == EXIT_CANNOT_LISTEN:
            return f"worker {worker} cannot listen on its ports"
        if len(self.deaths[worker]) > self.limit:
            return (
                f"worker {worker} died {len(self.deaths[worker])} times within"
                f" {self.window_s:g} s (more than --worker_restarts {self.limit})"
            )
        return None


def supervise(flags: ServerFlags, argv: list[str], ports: list[int]) -> int:
    """Run the workers; forward SIGTERM/SIGINT. A worker that dies is started again, told to
    load the version a live peer serves (not VERSION, which may lag a switch), so the other
    workers keep serving meanwhile; `Restarts` decides when to stop them all and fail."""
    stopping = False

    def on_signal(signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    def start(i: int, peer: int = -1) -> subprocess.Popen[bytes]:
        extra = [f"--worker_index={i}"] + ([f"--worker_peer={peer}"] if peer >= 0 else [])
        return subprocess.Popen([sys.executable, "-m", "cube.server.main", *argv, *extra])

    children = [start(i) for i in range(flags.workers)]
    log.info(
        "started %d workers on ports %s (pids %s)",
        len(children),
        ",".join(map(str, ports)),
        ",".join(str(c.pid) for c in children),
    )
    restarts = Restarts(flags.worker_restarts)
    failed = False
    while not stopping and not failed:
        time.sleep(POLL_S)
        for i, child in enumerate(children):
            if child.poll() is None or stopping:
                continue
            log.error("worker %d (pid %d) exited with %s", i, child.pid, child.returncode)
            why = restarts.died(i, child.returncode, time.monotonic())
            if why is not None:
                log.error("%s: stopping the server", why)
                failed = True
                break
            alive = [j for j, c in enumerate(children) if j != i and c.poll() is None]
            children[i] = start(i, alive[0] if alive else -1)
            log.warning(
                "worker %d restarted (pid %d), on the version worker %s serves",
                i,
                children[i].pid,
                alive[0] if alive else "(none: VERSION)",
            )
    return stop_workers(children, flags.grace + STOP_MARGIN_S) or int(failed)


def stop_workers(children: list[subprocess.Popen[bytes]], timeout_s: float) -> int:
    """SIGTERM every worker still running and wait for them all, `timeout_s` in all; one that
    does not stop in time is killed. 1 when one did not exit 0, else 0."""
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    failed = False
    for i, child in enumerate(children):
        try:
            child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.error("worker %d (pid %d) did not stop in time: killing it", i, child.pid)
            child.kill()
            child.wait(timeout=10)
            failed = True
        if child.returncode != 0:
            failed = True
    log.info("all workers stopped")
    return int(failed)
