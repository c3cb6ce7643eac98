"""Server processes for cube-bench: start on loopback, wait until ready, stop by PID; CPU meters.

Every process cube-bench starts is registered in a `ProcessRegistry` and stopped by its PID
(and the PIDs of its descendants, which are processes we started too) in a `finally` block,
on SIGTERM/SIGHUP (turned into an exception) and on Ctrl-C. Children also get
PR_SET_PDEATHSIG so they die if cube-bench itself is killed with SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import psutil

from cube.processes import (
    cpu_by_pid,
    cpu_seconds,
    die_with_parent,
    loadavg,
    log_tail,
    machine_seconds,
    poll_until,
    spawn,
    terminate,
)


class ServerStartError(RuntimeError):
    """A server did not come up; the message names it and quotes the end of its log."""


def port_open(port: int, host: str = "127.0.0.1", timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


@dataclass
class ServerProcess:
    name: str
    argv: list[str]
    popen: subprocess.Popen[bytes]
    log_path: Path
    ports: list[int] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log_tail(self, lines: int = 15) -> str:
        return log_tail(self.log_path, lines)

    def pids(self) -> list[int]:
        """This process and its live descendants (worker processes of a multi-process server)."""
        try:
            proc = psutil.Process(self.pid)
            return [self.pid, *(child.pid for child in proc.children(recursive=True))]
        except psutil.Error:
            return []


class ProcessRegistry:
    """The processes cube-bench started; `stop_all` ends each by PID, bounded in time."""

    def __init__(self, log: Callable[[str], None] | None = None) -> None:
        self.servers: list[ServerProcess] = []
        self.log = log

    def start(
        self,
        name: str,
        argv: Sequence[str],
        ports: Sequence[int],
        log_dir: Path,
        ready: Callable[[], bool] | None = None,
        timeout: float = 30.0,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> ServerProcess:
        """Start `argv`, then wait until every port accepts connections and `ready()` is true."""
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"{name}-{len(self.servers)}.log"
        popen = spawn(argv, log_path, cwd=cwd, env=env, preexec_fn=die_with_parent)
        server = ServerProcess(name, list(argv), popen, log_path, list(ports))
        self.servers.append(server)
        if self.log:
            self.log(f"started {name} pid {popen.pid} ports {','.join(map(str, ports))}")
        pending = list(ports)

        def running() -> None:
            code = popen.poll()
            if code is not None:
                raise ServerStartError(
                    f"{name} exited with code {code} during startup: {' '.join(argv)}\n"
                    f"--- {log_path} ---\n{server.log_tail()}"
                )

        def answering() -> bool:
            pending[:] = [p for p in pending if not port_open(p)]
            return not pending and (ready is None or ready())

        if not poll_until(answering, timeout, 0.05, check=running):
            raise ServerStartError(
                f"{name} not ready within {timeout:.0f}s (ports not answering: {pending}): "
                f"{' '.join(argv)}\n--- {log_path} ---\n{server.log_tail()}"
            )
        return server

    def all_pids(self) -> list[int]:
        return [pid for server in self.servers for pid in server.pids()]

    def stop(self, server: ServerProcess, timeout: float = 10.0) -> None:
        """SIGTERM the server and its descendants by PID; SIGKILL what is left after timeout."""
        procs = []
        for pid in reversed(server.pids()):  # children first, then the parent
            with contextlib.suppress(psutil.Error):
                procs.append(psutil.Process(pid))
        terminate(procs, timeout, kill_timeout=timeout)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.popen.wait(timeout=timeout)  # reap the direct child
        if server in self.servers:
            self.servers.remove(server)
        if self.log:
            self.log(f"stopped {server.name} pid {server.pid}")

    def stop_all(self) -> None:
        for server in reversed(list(self.servers)):
            self.stop(server)


class Interrupted(BaseException):
    """SIGTERM/SIGHUP arrived; raised in the main thread so that `finally` blocks run."""


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """While active, SIGTERM and SIGHUP raise `Interrupted` (SIGINT already raises
    KeyboardInterrupt), so a `finally` can stop the servers."""

    def handler(signum: int, _frame: FrameType | None) -> None:
        raise Interrupted(f"signal {signal.Signals(signum).name}")

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def signals_ignored() -> Iterator[None]:
    """While active, Ctrl-C, SIGTERM and SIGHUP are ignored: cleanup runs to its end."""
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in sigs}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


# --- CPU meters (cube.processes) --------------------------------------------------------------


def system_cpu_seconds() -> dict[str, float]:
    """Machine-wide CPU seconds since boot as a dict (cube.processes.machine_seconds)."""
    tasks, irq, steal = machine_seconds()
    return {"tasks": tasks, "irq": irq, "steal": steal}


@dataclass(frozen=True)
class CpuSnapshot:
    at_ns: int  # time.perf_counter_ns()
    client: float  # seconds of CPU used by this process (all threads)
    servers: dict[int, float]  # seconds of CPU used by each server process still running
    system: dict[str, float]  # system_cpu_seconds()
    loadavg: float

    @classmethod
    def take(cls, server_pids: Sequence[int]) -> CpuSnapshot:
        return cls(
            at_ns=time.perf_counter_ns(),
            client=cpu_seconds([os.getpid()]),
            servers={pid: u + s for pid, (u, s) in cpu_by_pid(server_pids).items()},
            system=system_cpu_seconds(),
            loadavg=loadavg(),
        )


def cpu_between(start: CpuSnapshot, end: CpuSnapshot) -> dict[str, float]:
    """CPU seconds used between two snapshots: by us (client), the servers, other processes
    (machine task time minus ours), interrupts and steal; plus the wall time."""
    client = end.client - start.client
    # processes present at both ends only: one that exits (or restarts) in between would
    # otherwise subtract all the CPU it ever used
    servers = sum(
        end.servers[pid] - start.servers[pid] for pid in end.servers.keys() & start.servers
    )
    tasks = end.system["tasks"] - start.system["tasks"]
    return {
        "wall": (end.at_ns - start.at_ns) / 1e9,
        "client": client,
        "servers": servers,
        "other": max(0.0, tasks - client - servers),
        "irq": end.system["irq"] - start.system["irq"],
        "steal": end.system["steal"] - start.system["steal"],
        "loadavg": end.loadavg,
    }
