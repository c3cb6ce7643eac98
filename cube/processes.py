"""Processes started and stopped by PID: spawn with a log file, wait until ready, SIGTERM then
SIGKILL, and tell a recorded PID from a reused one.

One copy of these mechanics for cube-local (product code, hence here), cube-bench and the
tests' server helpers; each keeps its own names, messages and readiness checks.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int, avoid: Sequence[int] = ()) -> list[int]:
    """`count` consecutive ports free on 127.0.0.1 now, none in `avoid` (a cube-server with
    --workers N listens on port .. port + N - 1, and on control_port + i)."""
    rng = random.Random()
    for _ in range(200):
        start = rng.randrange(20000, 60000 - count)
        ports = list(range(start, start + count))
        if not set(ports) & set(avoid) and all(_port_free(p) for p in ports):
            return ports
    raise RuntimeError(f"no {count} consecutive free ports found")


def health_status(address: str, timeout: float = 1.0, service: str = "") -> int | None:
    """The gRPC health status of `address` (a `HealthCheckResponse.ServingStatus` value, SERVING
    = 1), or None when it does not answer within `timeout`. cube-server says SERVING only
    when it can answer at its normal latency (docs/reference/cube-server.md)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            stub = health_pb2_grpc.HealthStub(channel)
            # types-grpcio-health-checking declares HealthStub without its methods
            reply = stub.Check(  # type: ignore[attr-defined]
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError:
            return None
    return int(reply.status)


SERVING = 1  # grpc.health.v1 HealthCheckResponse.SERVING


def log_tail(path: str | os.PathLike[str], lines: int = 15) -> str:
    """The last `lines` lines of a log, for an error message that says why a process died."""
    try:
        text = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:]) or "(empty log)"


def spawn(
    argv: Sequence[str],
    log_path: str | os.PathLike[str],
    *,
    append: bool = False,
    cwd: str | os.PathLike[str] | None = None,
    env: dict[str, str] | None = None,
    preexec_fn: Callable[[], None] | None = None,
) -> subprocess.Popen[bytes]:
    """Start `argv` with stdout and stderr in `log_path` and no stdin, in its own session, so
    that a Ctrl-C in the terminal reaches only its starter, which stops it in order."""
    with open(log_path, "ab" if append else "wb") as log:
        return subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=preexec_fn,
            env=env,
            cwd=cwd,
        )


def create_time(pid: int) -> float:
    """When `pid` started (psutil's clock), 0.0 when it is gone: recorded with a PID so that
    `same_process` can tell it from a later process given the same PID."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return 0.0


def same_process(pid: int, started: float, tolerance: float = 0.05) -> psutil.Process | None:
    """The live process `pid` if it is the one that started at `started`; None when it is
    gone, a zombie, or the PID now belongs to another process."""
    if not pid:
        return None
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - started) > tolerance:
            return None
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc
    except psutil.Error:
        return None


def poll_until(
    ready: Callable[[], bool],
    timeout: float,
    interval: float,
    check: Callable[[], None] = lambda: None,
) -> bool:
    """Call `check()` then `ready()` every `interval` s until `ready()` is true (True) or
    `timeout` s have passed (False). `check` raises when waiting is pointless (the process
    exited), so that a crash is reported at once rather than after the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        check()
        if ready():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


def terminate(
    procs: Sequence[psutil.Process], timeout: float, kill_timeout: float
) -> list[psutil.Process]:
    """SIGTERM each process in the order given and wait up to `timeout` s for all of them;
    SIGKILL those still alive and wait up to `kill_timeout` s. Returns the ones killed."""
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _gone, alive = psutil.wait_procs(procs, timeout=timeout)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=kill_timeout)
    return alive


def stop_child(
    popen: subprocess.Popen[bytes] | subprocess.Popen[str],
    timeout: float,
    kill_timeout: float = 10.0,
) -> int | None:
    """SIGTERM a child we started and reap it; SIGKILL it if it has not exited after `timeout`
    s. Returns its exit code (through Popen, which psutil's waiting would lose)."""
    if popen.poll() is None:
        popen.terminate()  # by PID; a no-op if it has exited meanwhile
        try:
            popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait(timeout=kill_timeout)
    return popen.returncode


# ---------------------------------------------------------------------------------------------
# children that die with us, and CPU meters (benchmarks and tests measure what they started)

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_PR_SET_PDEATHSIG = 1


def _find_prctl() -> Callable[..., int] | None:
    try:
        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None
    return prctl


# Looked up here, in the parent: the child of a threaded process must not dlopen between fork
# and exec (another thread may have held the loader's lock when it forked).
_PRCTL = _find_prctl()


def die_with_parent() -> None:
    """For `preexec_fn`: in the child before exec, ask for SIGTERM when the parent dies, even
    by SIGKILL (a benchmark killed midway leaves no server behind; a test process killed by
    its timeout leaves no child). "The parent" is the thread that started the child: start
    such children from a thread that lives as long as they should. Kept across exec, but not
    across a change of user (setpriv --pdeathsig keep restores it)."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def cpu_by_pid(pids: Sequence[int]) -> dict[int, tuple[float, float]]:
    """(user, system) CPU seconds of each process still there (all its threads), from
    /proc/<pid>/stat; a process that is gone is left out."""
    found = {}
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        # utime, stime: fields 14 and 15 of stat
        found[pid] = (int(fields[11]) / CLOCK_TICKS, int(fields[12]) / CLOCK_TICKS)
    return found


def cpu_split(pids: Sequence[int]) -> tuple[float, float]:
    """(user, system) CPU seconds of the processes; a process that is gone counts nothing."""
    times = cpu_by_pid(pids).values()
    return sum(u for u, _ in times), sum(s for _, s in times)


def cpu_seconds(pids: Sequence[int]) -> float:
    return sum(cpu_split(pids))


def machine_seconds() -> tuple[float, float, float]:
    """(task time, interrupt time, steal) of the whole machine since boot, all cores: what
    processes ran, irq + softirq (mostly loopback networking), and what the hypervisor took."""
    with open("/proc/stat") as f:
        parts = [int(v) for v in f.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = parts
    return (user + nice + system) / CLOCK_TICKS, (irq + softirq) / CLOCK_TICKS, steal / CLOCK_TICKS


def loadavg() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])
