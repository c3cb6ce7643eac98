"""Test helpers: write version directories the way the builder/agent lay them out, and run real
cube-server processes on free loopback ports (started, waited for health SERVING, stopped by
PID). Shared by the server and SDK tests.

    with running_server(data_dir, "--dict_split", "1") as server:
        channel = grpc.insecure_channel(server.address)
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import psutil
from grpc_health.v1 import health_pb2

from cube.index import build_table
from cube.pb import cube_pb2
from cube.processes import free_ports, health_status, poll_until, spawn, stop_child
from cube.shard import write_shard
from cube.values import ValueColumn

from .stubs import raw_unary

REPO = Path(__file__).resolve().parents[2]
_SERVER_IDS = itertools.count()


# ---------------------------------------------------------------------------------------------
# data


def write_version(
    data_dir: str | os.PathLike[str],
    name: str,
    keys: Sequence[int] | np.ndarray,
    values: ValueColumn | Sequence[bytes],
    *,
    deleted: Sequence[int] | np.ndarray | None = None,
    split: int | None = None,
    chain: Sequence[str] | None = None,
    current: bool = False,
    dict_name: str = "test_dict",
    routing: dict[str, Any] | None = None,
    table: str = "",
) -> Path:
    """Write `<data_dir>[/<split>]/<name>/{index.cube,data.cube}` (a base, or a delta when the
    name is `<base>_<cur>`), optionally its CHAIN file, and VERSION when `current`. `routing`
    (shard, shard_num, partitioner) goes into the headers as the builder writes it. With
    `table`, the files go to `<name>/<table>/` and the table is added to `<name>/TABLES`."""
    root = Path(data_dir) if split is None else Path(data_dir) / str(split)
    keys = np.asarray(keys, dtype=np.uint64)
    if not isinstance(values, ValueColumn):
        values = ValueColumn.from_list(list(values)) if len(values) else ValueColumn.empty()
    dropped = None if deleted is None else np.asarray(deleted, dtype=np.uint64)
    directory = root / name
    meta = {"dict_name": dict_name, "version": name, **(routing or {})}
    if table:
        listed = directory / "TABLES"
        names = listed.read_text().split() if listed.exists() else []
        directory.mkdir(parents=True, exist_ok=True)
        listed.write_text("".join(f"{t}\n" for t in (names if table in names else [*names, table])))
        meta["table"] = table
    write_shard(directory / table, build_table(keys, dropped), values, meta)
    if chain is not None:
        (directory / "CHAIN").write_text("".join(f"{link}\n" for link in chain))
    if current:
        (root / "VERSION").write_text(f"{name}\n")
    return directory


def fixed_values(keys: np.ndarray, width: int, tag: int = 0) -> ValueColumn:
    """Deterministic values: key bytes (LE) + tag byte, repeated to `width` bytes."""
    keys = np.asarray(keys, dtype=np.uint64)
    unit = np.concatenate(
        [keys.astype("<u8").view(np.uint8).reshape(-1, 8), np.full((len(keys), 1), tag, np.uint8)],
        axis=1,
    )
    reps = -(-width // 9)
    rows = np.tile(unit, (1, reps))[:, :width]
    return ValueColumn.fixed(np.ascontiguousarray(rows).reshape(-1), width)


def expected_fixed(keys: np.ndarray, width: int, tag: int = 0) -> np.ndarray:
    return fixed_values(keys, width, tag).as_rows()


# ---------------------------------------------------------------------------------------------
# ports and processes


def processes_under(path: str | os.PathLike[str]) -> list[psutil.Process]:
    """Live processes whose command line mentions `path`: what a run in that directory started,
    found even when it did not report their PIDs."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(str(path) in part for part in proc.info["cmdline"] or []):
                found.append(proc)
    return found


def kill_processes_under(path: str | os.PathLike[str]) -> None:
    """Cleanup after a failed test: SIGKILL whatever still runs from `path`."""
    for proc in processes_under(path):
        with contextlib.suppress(psutil.Error):
            proc.kill()


@dataclass
class ServerProc:
    """A cube-server process. Started on port 0, its ports are unknown until it writes its
    port file (`resolve_ports`, done by `wait_up` and on first use of an address)."""

    process: subprocess.Popen[bytes]
    lookup_ports: list[int]
    data_dir: Path
    log_path: Path
    args: list[str] = field(default_factory=list)
    given_control_ports: list[int] = field(default_factory=list)
    port_file: Path | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def ports(self) -> list[int]:
        self.resolve_ports()
        return self.lookup_ports

    @property
    def control_ports(self) -> list[int]:
        self.resolve_ports()
        return self.given_control_ports

    @property
    def port(self) -> int:
        return self.ports[0]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.ports[0]}"

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.ports]

    @property
    def control_address(self) -> str:
        """Worker 0's control port (loads, switches, status): not the lookup port."""
        return f"127.0.0.1:{self.control_ports[0]}"

    @property
    def control_addresses(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.control_ports]

    def resolve_ports(self, timeout: float = 30.0) -> None:
        """Wait for the server's --port_file (it is written once every port is bound and
        the start-up load is done) and take the bound ports from it."""
        if self.port_file is None or all(self.lookup_ports + self.given_control_ports):
            return
        path = self.port_file

        def written() -> bool:
            return path.exists()

        if not poll_until(written, timeout, 0.05, check=self.check_running):
            raise TimeoutError(
                f"cube-server wrote no port file after {timeout} s:\n{self.log()[-4000:]}"
            )
        report = json.loads(path.read_text())
        self.lookup_ports[:] = report["ports"]
        self.given_control_ports[:] = report["control_ports"]

    def check_running(self) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(
                f"cube-server exited with {self.process.returncode}:\n{self.log()[-4000:]}"
            )

    def written_ports(self) -> dict[str, Any]:
        """What the server wrote in its --port_file (ports, control_ports, metrics_port, ...)."""
        assert self.port_file is not None, "started without a port file"
        report: dict[str, Any] = json.loads(self.port_file.read_text())
        return report

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def wait_up(self, timeout: float = 30.0, serving: bool = False) -> None:
        """Wait until every worker answers its health check on its control port (plaintext,
        even when lookups use TLS; it loads its start-up version before it answers) and has
        settled: SERVING, or NOT_SERVING for a reason other than getting ready (the lookup
        kernel loading); with `serving`, until every one says SERVING."""
        self.resolve_ports(timeout)
        pending = list(self.control_addresses)

        def ready(status: int | None) -> bool:
            if serving or status == health_pb2.HealthCheckResponse.SERVING:
                return status == health_pb2.HealthCheckResponse.SERVING
            return status is not None and not self.getting_ready(pending[0])

        def all_ready() -> bool:
            while pending and ready(health_status(pending[0], timeout=0.5)):
                pending.pop(0)
            return not pending

        if not poll_until(all_ready, timeout, 0.05, check=self.check_running):
            what = "SERVING" if serving else "answering"
            raise TimeoutError(
                f"cube-server not {what} on {pending} after {timeout} s:\n{self.log()[-4000:]}"
            )

    def getting_ready(self, control_address: str) -> bool:
        """Whether the worker on `control_address` says it is getting ready (`not_ready`)."""
        args = [part for arg in self.args for part in arg.split("=", 1)]
        token = args[args.index("--control_token") + 1] if "--control_token" in args else ""
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        request = cube_pb2.ControlRequest(cmd="status").SerializeToString()
        with grpc.insecure_channel(control_address) as channel:
            call = raw_unary(channel, "/rec.mcube.ControlService/cmd")
            try:
                reply = cube_pb2.ControlResponse.FromString(
                    call(request, timeout=2.0, metadata=metadata)
                )
            except grpc.RpcError as exc:  # not up, or slow: ask again; a token we lack: settled
                return bool(exc.code() != grpc.StatusCode.UNAUTHENTICATED)
        detail = json.loads(reply.detail_json)
        workers = detail.get("worker_states", [detail])
        return any(worker.get("not_ready") or "error" in worker for worker in workers)

    def wait_serving(self, timeout: float = 30.0) -> None:
        self.wait_up(timeout, serving=True)

    def signal(self, signum: int = signal.SIGTERM) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signum)

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM by PID, wait; SIGKILL if it does not exit in time. Returns the exit code."""
        return stop_child(self.process, timeout)


def start_server(
    data_dir: str | os.PathLike[str],
    *args: str,
    workers: int = 1,
    ports: list[int] | None = None,
    control_ports: list[int] | None = None,
    log_path: str | os.PathLike[str] | None = None,
    timeout: float = 30.0,
    wait: bool = True,
    env: dict[str, str] | None = None,
    preexec_fn: Callable[[], None] | None = None,
) -> ServerProc:
    """Start `cube-server --data_dir DATA --port P [--workers N] ARGS...` and wait until every
    worker answers its health check (SERVING or, with nothing to serve, NOT_SERVING). The
    caller must `stop()` it (or use `running_server`).

    One worker binds port 0 (lookups and control) and reports the bound ports in its
    --port_file: no port is picked by a bind-then-release that another process could win.
    With several workers (and --reuseport) the ports must be known in advance, so free ones
    are picked; explicit `ports` restart a server where a stopped one was. `preexec_fn` runs
    in the child before it starts (to set a limit, say)."""
    data_dir = Path(data_dir)
    name = f"cube-server-{os.getpid()}-{next(_SERVER_IDS)}"
    log_path = Path(log_path) if log_path else data_dir.parent / f"{name}.log"
    port_file = None
    if workers == 1 and "--reuseport" not in args:
        ports = ports or [0]
        controls = control_ports or [0]
        port_file = data_dir.parent / f"{name}.ports.json"
        port_file.unlink(missing_ok=True)
    else:
        ports = ports or free_ports(workers)
        controls = control_ports or free_ports(workers, avoid=ports)
    command = [
        sys.executable,
        "-m",
        "cube.server.main",
        "--data_dir",
        str(data_dir),
        "--port",
        str(ports[0]),
        "--workers",
        str(workers),
        "--control_port",
        str(controls[0]),
        "--in_mem",
        "false",
        *(["--port_file", str(port_file)] if port_file else []),
        *args,
    ]
    server = ServerProc(
        spawn(
            command,
            log_path,
            cwd=REPO,
            env={**os.environ, **env} if env else None,
            preexec_fn=preexec_fn,
        ),
        list(ports),
        data_dir,
        log_path,
        list(args),
        list(controls),
        port_file,
    )
    if wait:
        try:
            server.wait_up(timeout)
        except BaseException:
            server.stop()
            raise
    return server


@contextlib.contextmanager
def running_server(
    data_dir: str | os.PathLike[str], *args: str, **kwargs: Any
) -> Iterator[ServerProc]:
    server = start_server(data_dir, *args, **kwargs)
    try:
        yield server
    finally:
        server.stop()


# ---------------------------------------------------------------------------------------------
# metrics


def samples_of(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus exposition: (name, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The samples a metrics endpoint serves now."""
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as reply:
        return samples_of(reply.read().decode())
