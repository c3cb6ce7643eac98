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

This module parses and checks the flags; a worker is cube/server/worker.py, the supervisor
cube/server/supervisor.py, the port plan cube/server/ports.py (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from cube.flags import FlagError, Flags, FlagSet, run_cli
from cube.listen import ListenError, check_free
from cube.logs import LOG_FORMATS, setup_logging
from cube.routing import PARTITIONERS
from cube.security import SecurityError, require_token

# The port plan, the supervisor and the derived settings have modules of their own; their
# names stay importable from here (tools and tests read the flags through this module).
from cube.server.config import control_token as control_token
from cube.server.config import tls_files as tls_files
from cube.server.ports import PortPlan
from cube.server.ports import control_ports as control_ports
from cube.server.ports import fixed_ports as fixed_ports
from cube.server.ports import lane_ports as lane_ports
from cube.server.ports import worker_ports as worker_ports
from cube.server.service import DEFAULT_MAX_ANSWER_BYTES
from cube.server.supervisor import EXIT_CANNOT_LISTEN as EXIT_CANNOT_LISTEN

log = logging.getLogger("cube.server")

FLAGS = (
    FlagSet(
        "cube-server",
        "Serve one shard of a Cube dictionary over gRPC. Reads conf/gflags.conf first when it"
        " exists (as the original does); flags on the command line win over it.",
        default_flagfile="conf/gflags.conf",
    )
    .add(
        "port",
        int,
        8000,
        "gRPC port of the lookups (worker 0's port with --workers); 0: any free port"
        " (--workers 1 only), see --port_file",
    )
    .add(
        "port_file",
        str,
        "",
        "once listening, write the bound ports here as JSON {pid, ports, control_ports,"
        " tcp_ports, metrics_port, http_ports, baidu_std_ports} (for tools that start the"
        " server on --port 0)",
    )
    .add("host", str, "127.0.0.1", "address to bind the lookups (0.0.0.0: every interface)")
    .add(
        "metrics_port",
        int,
        -1,
        "Prometheus metrics of every worker at http://<metrics_host>:<port>/metrics, served by"
        " worker 0; -1: off, 0: any free port (in --port_file)",
    )
    .add(
        "metrics_host",
        str,
        "127.0.0.1",
        "address to bind the metrics (no token: they reveal counts, versions and timings, not"
        " data)",
    )
    .add(
        "control_port",
        int,
        -1,
        "port of the control service (loads, switches; worker i on control_port + i);"
        " -1: --port + 1000 (any free port when --port is 0)",
    )
    .add(
        "control_host",
        str,
        "127.0.0.1",
        "address to bind the control port (beyond loopback it needs --control_token)",
    )
    .add(
        "control_token",
        str,
        "",
        "require 'authorization: Bearer <token>' on the control port (default: env"
        " CUBE_CONTROL_TOKEN)",
    )
    .add(
        "insecure",
        bool,
        False,
        "allow a control port beyond loopback without a token (anyone reaching it can load,"
        " switch and unload versions)",
    )
    .add("tls_cert", str, "", "PEM certificate: serve lookups (gRPC and TCP lane) over TLS")
    .add("tls_key", str, "", "PEM private key of --tls_cert")
    .add("dict_split", int, 1, "sub-dicts in this shard: <data_dir>/<split>/... when > 1")
    .add("partitioner", str, "mod", "key -> split rule (the builder's)", choices=PARTITIONERS)
    .add("in_mem", bool, True, "fault shards into memory at load and mlock them (best effort)")
    .add("data_dir", str, "./data", "directory with VERSION and the version directories")
    .add("workers", int, 1, "worker processes, each on its own port (see --worker_ports)")
    .add("worker_ports", str, "", "comma list of worker ports (default: port, port+1, ...)")
    .add(
        "reuseport",
        bool,
        False,
        "every worker also on --port (SO_REUSEPORT; refused when another process holds it);"
        " own ports +1",
    )
    .add("tcp_lane", bool, True, "also serve cube.v1 Seek over plain TCP (see cube.server.lane)")
    .add("tcp_ports", str, "", "comma list of each worker's TCP lane port (default: any free)")
    .add(
        "busy_poll_us",
        int,
        0,
        "after answering on the TCP lane, poll for the next request this long before sleeping"
        " (lower latency where waking an idle CPU is slow, e.g. VMs; burns CPU when idle)",
    )
    .add(
        "http_port",
        int,
        -1,
        "also serve the original's HTTP+JSON (POST /DictService/seek, /ControlService/cmd) on"
        " this port, worker i on port + i; -1: off, 0: any free port (in --port_file)",
    )
    .add(
        "baidu_std_port",
        int,
        -1,
        "also serve the original's brpc baidu_std protocol (DictService.seek and"
        " ControlService.cmd, as the C++ cube-api calls them) on this port, worker i on"
        " port + i; -1: off, 0: any free port (in --port_file)",
    )
    .add("max_batch", int, 100000, "most keys in one request (more: RESOURCE_EXHAUSTED)")
    .add(
        "max_answer_bytes",
        int,
        DEFAULT_MAX_ANSWER_BYTES,
        "most value bytes in one answer (more: RESOURCE_EXHAUSTED)",
    )
    .add(
        "allow_empty",
        bool,
        False,
        "answer misses while no version is loaded (default: NOT_SERVING and UNAVAILABLE"
        " until one is; a replica that failed to load its version never answers misses)",
    )
    .add(
        "file_leases",
        bool,
        True,
        "watch mapped shard files with kernel leases (false: poll their size and mtime)",
    )
    .add(
        "lane_max_connections",
        int,
        1024,
        "connections per worker at most, TCP lane, HTTP+JSON and baidu_std together (a new one"
        " closes the one idle longest to make room)",
    )
    .add(
        "lane_budget_bytes",
        int,
        256 << 20,
        "TCP lane: input buffers + queued + unsent answers per worker, at most (then no"
        " connection's next frame is read until it drops)",
    )
    .add(
        "lane_connection_bytes",
        int,
        16 << 20,
        "TCP lane: a connection's queued + unsent answers, at most (then it is not read)",
    )
    .add(
        "lane_stall_timeout",
        float,
        30.0,
        "TCP lane: close a connection holding a partial frame or unread answers this long",
    )
    .add(
        "lane_idle_timeout",
        float,
        60.0,
        "TCP lane, HTTP+JSON, baidu_std: close a connection that sends nothing this long after"
        " it connected or was last answered",
    )
    .add(
        "lane_request_timeout",
        float,
        30.0,
        "TCP lane, HTTP+JSON, baidu_std: close a connection whose request is not whole this"
        " long after its first byte (a drip)",
    )
    .add("dict_name", str, "", "dictionary served; requests naming another get NOT_FOUND")
    .add("shard", int, -1, "shard number of this server (also accepts <dict>_part<shard>)")
    .add("verify", bool, True, "check every section checksum when loading a version")
    .add("write_version", bool, False, "rewrite <data_dir>/VERSION on a switch (agent's job)")
    .add("grace", float, 5.0, "seconds in-flight calls get to finish on SIGTERM")
    .add("control_timeout", float, 900.0, "seconds worker 0 waits for a worker's step")
    .add("load_delay", float, 0.0, "testing aid: hold every version load this many seconds")
    .add("log_level", str, "INFO", "DEBUG, INFO, WARNING or ERROR")
    .add("log_dir", str, "", "also log to <log_dir>/cube-server.log (default: stderr only)")
    .add("log_format", str, "text", "text lines, or one JSON object a line", choices=LOG_FORMATS)
    .add(
        "worker_restarts",
        int,
        3,
        "a worker that dies is restarted (on the version its peers serve) up to this many"
        " times a minute; beyond that the whole server stops with an error",
    )
    .add("worker_index", int, -1, "internal: which worker this process is (set by --workers)")
    .add("worker_peer", int, -1, "internal: a restarted worker takes its version from this one")
    .ignore_original_runtime()
)


def check_flags(flags: Flags) -> None:
    if flags.dict_split < 1:
        raise FlagError(f"--dict_split must be >= 1, got {flags.dict_split}")
    if flags.workers < 1:
        raise FlagError(f"--workers must be >= 1, got {flags.workers}")
    if flags.max_batch < 1:
        raise FlagError(f"--max_batch must be >= 1, got {flags.max_batch}")
    for name in (
        "max_answer_bytes",
        "lane_max_connections",
        "lane_budget_bytes",
        "lane_connection_bytes",
    ):
        if flags[name] < 1:
            raise FlagError(f"--{name} must be >= 1, got {flags[name]}")
    for name in ("lane_stall_timeout", "lane_idle_timeout", "lane_request_timeout"):
        if flags[name] <= 0:
            raise FlagError(f"--{name} must be > 0, got {flags[name]}")
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
            "--control_token (or env CUBE_CONTROL_TOKEN)",
        )
        tls_files(flags).check()
    except SecurityError as exc:
        raise FlagError(str(exc)) from None


def configure_logging(flags: Flags) -> None:
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
