"""cube-server: serve one shard (of one dictionary) from mmap'd shard files over gRPC.

    cube-server --port 8000 --dict_split 1 --data_dir ./data [--workers N] [--flagfile FILE]

Services on every port: cube.v1.CubeService (Seek, SeekStream: the fast API; also over the
TCP lane, cube.server.lane, on a port of its own per worker: --tcp_lane, --tcp_ports),
rec.mcube.DictService.seek (the original's), rec.mcube.ControlService.cmd (versions, see
cube.server.control), grpc.health.v1.Health and server reflection.

Workers: `--workers N` starts a supervisor that runs N worker processes; worker i listens on
its own port, `--worker_ports` (comma list) or port + i by default, so worker 0 is on --port.
Each maps the same shard files (one copy in the page cache). Clients spread load by treating
every worker port as an endpoint (round robin; SO_REUSEPORT alone balances connections
badly); `--reuseport` also binds every worker on the shared --port for clients that know one
address, and then the workers' own ports default to --port + 1 + i.
status detail_json lists the ports. Control commands go to worker 0, which applies them to
all workers (a command sent to another worker is forwarded there). A worker that dies is
restarted on the version its peers serve while the others keep serving (--worker_restarts
bounds a crash loop; then the whole server stops with an error).

SIGTERM / SIGINT: stop taking new calls, let in-flight ones finish for up to --grace seconds,
exit 0. The supervisor forwards the signal to its workers and waits for them.

This module checks the flags (declared in cube/server/flags.py); a worker is
cube/server/worker.py, the supervisor cube/server/supervisor.py, the port plan
cube/server/ports.py (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from cube.flags import FlagError, run_cli
from cube.listen import ListenError, check_free
from cube.logs import setup_logging
from cube.security import SecurityError, require_token

# The port plan, the supervisor and the derived settings have modules of their own; their
# names stay importable from here (tools and tests read the flags through this module).
from cube.server.config import control_token as control_token
from cube.server.config import tls_files as tls_files
from cube.server.flags import FLAGS as FLAGS
from cube.server.flags import ServerFlags
from cube.server.ports import PortPlan
from cube.server.ports import control_ports as control_ports
from cube.server.ports import fixed_ports as fixed_ports
from cube.server.ports import lane_ports as lane_ports
from cube.server.ports import worker_ports as worker_ports
from cube.server.supervisor import EXIT_CANNOT_LISTEN as EXIT_CANNOT_LISTEN

log = logging.getLogger("cube.server")


def check_flags(flags: ServerFlags) -> None:
    if flags.dict_split < 1:
        raise FlagError(f"--dict_split must be >= 1, got {flags.dict_split}")
    if flags.workers < 1:
        raise FlagError(f"--workers must be >= 1, got {flags.workers}")
    if flags.hot_cache_mb < -1:
        raise FlagError(f"--hot_cache_mb must be >= -1 (-1: automatic), got {flags.hot_cache_mb}")
    if flags.max_batch < 1:
        raise FlagError(f"--max_batch must be >= 1, got {flags.max_batch}")
    for name, count in (
        ("max_answer_bytes", flags.max_answer_bytes),
        ("lane_max_connections", flags.lane_max_connections),
        ("lane_budget_bytes", flags.lane_budget_bytes),
        ("lane_connection_bytes", flags.lane_connection_bytes),
    ):
        if count < 1:
            raise FlagError(f"--{name} must be >= 1, got {count}")
    for name, seconds in (
        ("lane_stall_timeout", flags.lane_stall_timeout),
        ("lane_idle_timeout", flags.lane_idle_timeout),
        ("lane_request_timeout", flags.lane_request_timeout),
    ):
        if seconds <= 0:
            raise FlagError(f"--{name} must be > 0, got {seconds}")
    if not 0 <= flags.busy_poll_us <= 1_000_000:
        raise FlagError(f"--busy_poll_us must be in 0..1000000, got {flags.busy_poll_us}")
    if not 0 <= flags.port < 65536:
        raise FlagError(f"--port {flags.port} is not a port")
    if not -1 <= flags.metrics_port < 65536:
        raise FlagError(f"--metrics_port {flags.metrics_port} is not a port (or -1: off)")
    if flags.port == 0 and (flags.workers > 1 or flags.reuseport) and not flags.worker_ports:
        raise FlagError(
            "--port 0 (any free port) needs --workers 1 without --reuseport: clients and"
            " worker 0 must know every worker's port in advance (give --port or --worker_ports)"
        )
    if flags.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise FlagError(f"--log_level {flags.log_level!r}: expected DEBUG, INFO, WARNING, ERROR")
    if flags.worker_index >= flags.workers:
        raise FlagError(f"--worker_index {flags.worker_index} >= --workers {flags.workers}")
    if flags.worker_restarts < 0:
        raise FlagError(f"--worker_restarts must be >= 0, got {flags.worker_restarts}")
    try:
        require_token(
            "the control port",
            flags.control_host,
            control_token(flags),
            flags.insecure,
            "--control_token or --control_token_file (or env CUBE_CONTROL_TOKEN)",
        )
        tls_files(flags).check()
    except SecurityError as exc:
        raise FlagError(str(exc)) from None


def configure_logging(flags: ServerFlags) -> None:
    who = f"worker {flags.worker_index}" if flags.worker_index >= 0 else "server"
    if flags.workers > 1 and flags.worker_index < 0:
        who = "supervisor"
    setup_logging(
        "cube-server",
        flags.log_level.upper(),
        flags.log_format,
        Path(flags.log_dir) / "cube-server.log" if flags.log_dir else None,
        tag=who,
    )


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(_main, argv)


def _main(argv: Sequence[str]) -> int:
    """Check every flag, then run the supervisor (--workers N) or the one worker."""
    flags = FLAGS.parse(argv)
    check_flags(flags)
    configure_logging(flags)
    plan = PortPlan.from_flags(flags)
    from cube.server.original_faces import check_face_flags

    check_face_flags(flags, fixed_ports(flags, list(plan.lookups)))  # before any worker
    if flags.reuseport and flags.worker_index < 0:
        # The workers bind --port with SO_REUSEPORT, which any process of this user that
        # sets it too may join: first make sure no other holds it (a second server started
        # with --reuseport on the same port is refused here).
        try:
            check_free(flags.host, flags.port, "--port, shared by --reuseport")
        except ListenError as exc:
            log.error("%s", exc)
            return 1
    if flags.workers > 1 and flags.worker_index < 0:
        from cube.server.supervisor import supervise

        return supervise(flags, list(argv), list(plan.lookups))
    import uvloop

    from cube.server.worker import serve

    code = uvloop.run(serve(flags, max(flags.worker_index, 0), plan))
    if code == EXIT_CANNOT_LISTEN and flags.worker_index < 0:
        return 1  # (EXIT_CANNOT_LISTEN is a worker's word to its supervisor)
    return code


if __name__ == "__main__":
    sys.exit(main())
