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
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from cube.flags import FlagError, Flags, FlagSet, run_cli
from cube.fsutil import atomic_write_json
from cube.listen import (
    GRPC_OPTIONS,
    ListenError,
    address,
    check_free,
    grpc_listen,
    raise_open_files,
)
from cube.logs import LOG_FORMATS, setup_logging
from cube.routing import PARTITIONERS
from cube.security import SecurityError, TLSFiles, require_token, token_from
from cube.server.service import DEFAULT_MAX_ANSWER_BYTES, warm_version

log = logging.getLogger("cube.server")
# A worker that cannot listen on one of its ports exits with this: its supervisor stops the
# server at once rather than restarting it on a port someone else holds (the server itself
# exits 1).
EXIT_CANNOT_LISTEN = 3
# Open files a worker needs besides its socket ports' connections (gRPC connections, shard
# files, the metrics endpoint's connections, ...).
FILES_BESIDES_CONNECTIONS = 512

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


def worker_ports(flags: Flags) -> list[int]:
    """Each worker's own port: --worker_ports, else --port + i (worker 0 on --port). With
    --reuseport every worker also listens on the shared --port, so the own ports start at
    --port + 1 (worker-to-worker calls need a port that reaches exactly one worker)."""
    first = flags.port + 1 if flags.reuseport else flags.port
    if not flags.worker_ports:
        return [first + i for i in range(flags.workers)]
    try:
        ports = [int(p) for p in flags.worker_ports.split(",") if p.strip()]
    except ValueError as exc:
        bad = flags.worker_ports
        raise FlagError(f"--worker_ports: {bad!r} is not a list of ports") from exc
    if len(ports) != flags.workers:
        raise FlagError(f"--worker_ports lists {len(ports)} ports for --workers {flags.workers}")
    if len(set(ports)) != len(ports):
        raise FlagError(f"--worker_ports {flags.worker_ports}: a port is listed twice")
    if flags.reuseport and flags.port in ports:
        raise FlagError(
            f"--worker_ports must not list the shared --port {flags.port} with --reuseport"
        )
    return ports


def control_ports(flags: Flags) -> list[int]:
    """Each worker's control port: --control_port (or --port + 1000) + i; 0 (any free port,
    one worker only) when --port is 0 and --control_port is not given."""
    if flags.control_port >= 0:
        first = flags.control_port
    else:
        first = flags.port + 1000 if flags.port else 0
    ports = [first + i for i in range(flags.workers)]
    if first == 0 and flags.workers == 1:
        return ports
    if not all(0 < p < 65536 for p in ports):
        raise FlagError(f"--control_port {first}: control ports {ports} are not all ports")
    taken = set(worker_ports(flags)) | {flags.port}
    if taken.intersection(ports):
        raise FlagError(
            f"control ports {ports} overlap the lookup ports {sorted(taken)}: set --control_port"
        )
    return ports


def lane_ports(flags: Flags) -> list[int]:
    """Each worker's TCP lane port (0: any free port, announced to clients over gRPC)."""
    if not flags.tcp_ports:
        return [0] * flags.workers
    try:
        ports = [int(p) for p in flags.tcp_ports.split(",") if p.strip()]
    except ValueError as exc:
        raise FlagError(f"--tcp_ports: {flags.tcp_ports!r} is not a list of ports") from exc
    if len(ports) != flags.workers:
        raise FlagError(f"--tcp_ports lists {len(ports)} ports for --workers {flags.workers}")
    if not all(0 < p < 65536 for p in ports) or len(set(ports)) != len(ports):
        raise FlagError(f"--tcp_ports {flags.tcp_ports}: ports must be distinct and in 1..65535")
    return ports


def fixed_ports(flags: Flags, ports: list[int]) -> dict[int, str]:
    """The server's ports other than the original's faces, port -> the flag that sets it,
    (checked: FlagError); 0 where any free port is taken."""
    taken: dict[int, str] = {}
    for port in lane_ports(flags):
        taken[port] = "--tcp_ports"
    if flags.metrics_port > 0:
        taken[flags.metrics_port] = "--metrics_port"
    for port in control_ports(flags):
        taken[port] = "--control_port"
    for port in ports:
        taken[port] = "--worker_ports" if flags.worker_ports else "--port"
    taken[flags.port] = "--port"
    return taken


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


def control_token(flags: Flags) -> str:
    return token_from(flags.control_token, "CUBE_CONTROL_TOKEN")


def tls_files(flags: Flags) -> TLSFiles:
    return TLSFiles(cert=flags.tls_cert, key=flags.tls_key)


def configure_logging(flags: Flags) -> None:
    who = f"worker {flags.worker_index}" if flags.worker_index >= 0 else "server"
    if flags.workers > 1 and flags.worker_index < 0:
        who = "supervisor"
    setup_logging(
        "cube-server",
        flags.log_level.upper(),
        flags.log_format,
        Path(flags.log_dir) / "cube-server.log" if flags.log_dir else None,
        text_format=f"%(asctime)s %(levelname)s cube-server[{who} pid %(process)d] %(message)s",
        tag=who,
    )


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(_main, argv)


def _main(argv: Sequence[str]) -> int:
    flags = FLAGS.parse(argv)
    check_flags(flags)
    configure_logging(flags)
    ports = worker_ports(flags)
    from cube.server.original_faces import check_face_flags

    check_face_flags(flags, fixed_ports(flags, ports))  # checks them all before any worker
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
        return supervise(flags, list(argv), ports)
    import uvloop

    index = max(flags.worker_index, 0)
    code = uvloop.run(serve(flags, index, ports))
    if code == EXIT_CANNOT_LISTEN and flags.worker_index < 0:
        return 1  # (EXIT_CANNOT_LISTEN is a worker's word to its supervisor)
    return code


def _loopback(host: str) -> str:
    return "127.0.0.1" if host in ("", "0.0.0.0", "::", "[::]") else host


async def serve(flags: Flags, index: int, ports: list[int]) -> int:
    """Run one worker until SIGTERM/SIGINT; 0 on a clean drain."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    from cube import kernel
    from cube.security import grpc_server_credentials, server_context
    from cube.server.bounds import Bounds, LaneLimits
    from cube.server.control import (
        CONTROL_SERVICE,
        ControlRunner,
        Coordinator,
        LocalWorker,
        RemoteWorker,
        TokenCheck,
        control_handler,
        worker_handler,
    )
    from cube.server.guard import FileWatch
    from cube.server.lane import Lane
    from cube.server.original_faces import start_faces
    from cube.server.service import DICT_SERVICE, FAST_SERVICE, SeekService
    from cube.server.versions import (
        LoadOptions,
        VersionError,
        VersionSlots,
        diagnose_data_dir,
        flat_layout,
        load_base,
        load_flat,
        split_dirs,
        startup_version,
    )

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()  # set by SIGTERM/SIGINT, even during the start-up load
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    data_dir = Path(flags.data_dir)
    dirs = split_dirs(data_dir, flags.dict_split)
    watch = FileWatch(use_leases=flags.file_leases)
    options = LoadOptions(
        verify=flags.verify,
        populate=flags.in_mem,
        lock_memory=flags.in_mem,
        delay=flags.load_delay,
        watch=watch,
        dict_name=flags.dict_name,
        shard=flags.shard,
    )
    executor = ThreadPoolExecutor(1, thread_name_prefix="cube-loader")
    slots = VersionSlots(allow_empty=flags.allow_empty)
    service = SeekService(
        slots,
        max_batch=flags.max_batch,
        max_answer_bytes=flags.max_answer_bytes,
        dict_name=flags.dict_name,
        shard=flags.shard,
        partitioner=flags.partitioner,
    )
    local = LocalWorker(index, ports[index], slots, data_dir, dirs, options, executor, service)

    def files_changed() -> None:
        """A lease broke (SIGIO) or the periodic check runs: stop using changed files."""
        changed = watch.check()
        if not changed:
            return
        reasons = {f.fd: f"{f.path} {f.changed}" for f in changed}

        def reason_of(version: Any) -> str:
            return next(reasons[fd] for fd in version.fds if fd in reasons)

        for line in slots.drop_changed(set(reasons), reason_of):
            log.error("stopped serving %s; reload a good copy", line)
            local.last_error = line

    # SIGIO's default action ends the process: the handler must be in place before a lease.
    loop.add_signal_handler(signal.SIGIO, files_changed)

    startup_error = ""

    internal = _loopback(flags.control_host)
    token = control_token(flags)
    controls = control_ports(flags)
    remotes = []
    if index == 0:
        remotes = [
            RemoteWorker(i, port, address(internal, port), flags.control_timeout, token)
            for i, port in enumerate(controls)
            if i != 0
        ]

    def describe() -> dict[str, Any]:
        return {
            "dict_name": flags.dict_name,
            "shard": flags.shard,
            "dict_split": flags.dict_split,
            "partitioner": flags.partitioner,
            "data_dir": str(data_dir.resolve()),
            "in_mem": flags.in_mem,
            "max_batch": flags.max_batch,
            "workers": flags.workers,
            "ports": ports,
            "control_ports": controls,
            "host": flags.host,
            "reuseport": flags.reuseport,
            "tcp_port": service.lane_port,
            "tls": bool(flags.tls_cert),
            "startup_error": startup_error,
            "kernel": kernel.describe(),
            "pid": os.getpid(),
        }

    coordinator = (
        Coordinator(local, remotes, describe=describe, write_version=flags.write_version)
        if index == 0
        else None
    )
    forward = None if index == 0 else address(internal, controls[0])

    # Lookups on the data port; loads and switches on the control port (loopback by default,
    # token-checked when one is set): whoever reaches the data port cannot change versions.
    # A DictRequest's key takes up to 11 bytes (proto2 repeated uint64 is not packed: a tag
    # and a varint of up to 10 bytes), a cube.v1 one 8 or 9.
    max_message = max(4 << 20, flags.max_batch * 11 + (1 << 16))
    health_servicer = health.aio.HealthServicer()
    service_names = [FAST_SERVICE, DICT_SERVICE]

    def grpc_server(names: list[str], options: list[tuple[str, Any]], checks: list[Any]) -> Any:
        """A gRPC server with health and reflection (the handlers are added by the caller)."""
        made = grpc.aio.server(interceptors=checks, options=options)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, made)
        reflection.enable_server_reflection(
            [*names, health.SERVICE_NAME, reflection.SERVICE_NAME], made
        )
        return made

    lookup_options = [
        ("grpc.max_receive_message_length", max_message),
        ("grpc.max_send_message_length", -1),
    ]
    server = grpc_server(service_names, [*GRPC_OPTIONS, *lookup_options], [])
    server.add_generic_rpc_handlers(service.handlers())
    checks = [TokenCheck(token, flags.control_host, flags.insecure)] if token else []
    control_server = grpc_server([CONTROL_SERVICE], [*GRPC_OPTIONS], checks)
    # One ControlRunner serves every transport of control: the control port, HTTP+JSON and
    # baidu_std.
    runner = ControlRunner(coordinator, forward, flags.control_timeout, token)
    control_server.add_generic_rpc_handlers([control_handler(runner), worker_handler(local)])
    # --reuseport: the shared --port is the one socket bound with SO_REUSEPORT, on a server of
    # its own (the worker's own ports stay exclusive); `_main` made sure no other process held
    # it before the workers started (cube.listen).
    shared_server = None
    if flags.reuseport:
        shared_options = [("grpc.so_reuseport", 1), *lookup_options]
        shared_server = grpc_server(service_names, shared_options, [])
        shared_server.add_generic_rpc_handlers(service.handlers())
    grpc_servers = [s for s in (server, shared_server, control_server) if s is not None]
    tls = tls_files(flags)
    credentials = grpc_server_credentials(tls) if tls.serves else None
    # Every port is bound before the start-up load: a port in use fails at once, not after a
    # long load. Port 0 binds any free port; the bound one is what describe() and the port
    # file report.
    port_flag = "--worker_ports" if flags.worker_ports else "--port"
    try:
        ports[index] = grpc_listen(server, flags.host, ports[index], port_flag, credentials)
        listening = [address(flags.host, ports[index])]
        if shared_server is not None:
            grpc_listen(shared_server, flags.host, flags.port, "--port, --reuseport", credentials)
            listening.append(address(flags.host, flags.port))
        controls[index] = grpc_listen(
            control_server, flags.control_host, controls[index], "--control_port"
        )
    except ListenError as exc:
        log.error("%s", exc)
        executor.shutdown(wait=False)
        return EXIT_CANNOT_LISTEN
    listening.append(address(flags.control_host, controls[index]))
    # The byte, connection and stall bounds of the worker's socket ports (TCP lane, HTTP+JSON,
    # baidu_std): one budget and one connection count for them all. The process must be able
    # to hold that many connections, twice (a burst of newcomers is accepted while as many
    # connections they made room for are still closing), besides its other files: else the
    # limit is never reached, the idle never make room, and accept fails instead.
    max_connections = flags.lane_max_connections
    files = raise_open_files(2 * max_connections + FILES_BESIDES_CONNECTIONS)
    if files < 2 * max_connections + FILES_BESIDES_CONNECTIONS:
        max_connections = max((files - FILES_BESIDES_CONNECTIONS) // 2, 64)
        log.warning(
            "--lane_max_connections %d lowered to %d: this process may open %d files"
            " (raise the hard RLIMIT_NOFILE, ulimit -Hn)",
            flags.lane_max_connections,
            max_connections,
            files,
        )
    limits = LaneLimits(
        max_frame=max_message,
        connection_bytes=flags.lane_connection_bytes,
        budget_bytes=flags.lane_budget_bytes,
        stall_timeout=flags.lane_stall_timeout,
        max_connections=max_connections,
        idle_timeout=flags.lane_idle_timeout,
        request_timeout=flags.lane_request_timeout,
    )
    bounds = Bounds(limits)
    service.lane_stats = bounds.stats
    lane = None
    if flags.tcp_lane:
        lane = Lane(service, limits, busy_poll_s=flags.busy_poll_us / 1e6, bounds=bounds)
        wanted = lane_ports(flags)[index]
        try:
            ssl_context = server_context(tls) if tls.serves else None
            service.lane_port = await lane.start(flags.host, wanted, ssl_context)
        except ListenError as exc:
            log.error("%s", exc)
            executor.shutdown(wait=False)
            return EXIT_CANNOT_LISTEN
        lane_bind = f"{address(flags.host, service.lane_port)} (TCP lane)"
    faces = await start_faces(  # the original's HTTP+JSON and baidu_std (--http_port, ...)
        flags,
        index,
        service,
        runner,
        token,
        max_message,
        bounds,
        server_context(tls) if tls.serves else None,
    )
    if faces is None:
        executor.shutdown(wait=False)
        return EXIT_CANNOT_LISTEN
    metrics_server, metrics_port, metrics_note = None, 0, ""
    if index == 0 and flags.metrics_port >= 0 and coordinator is not None:
        from cube.metrics import serve_collector
        from cube.server.metrics import ServerCollector

        try:
            metrics_server = await serve_collector(
                flags.metrics_host,
                flags.metrics_port,
                ServerCollector,
                coordinator.worker_states,
            )
        except ListenError as exc:
            log.error("%s", exc)
            executor.shutdown(wait=False)
            return EXIT_CANNOT_LISTEN
        metrics_port = metrics_server.port
        metrics_note = f", metrics on http://{address(flags.metrics_host, metrics_port)}/metrics"
    # The compiled lookup kernel loads from its cache (or compiles, where none matches) in
    # the background, then is sealed: nothing compiles in a request. Until then the replica
    # is not ready (UNAVAILABLE at once, health NOT_SERVING), so clients use the others.
    warming = kernel.warm_in_background(sealed=True)
    if not warming.done():
        slots.set_not_ready("the compiled lookup kernel is loading")

    def kernel_ready(done: Any) -> None:
        if done.exception() is not None:
            log.error("lookup kernel: not compiled, lookups stay on numpy: %s", done.exception())
        else:
            log.info("lookup kernel: %s, ready in %.2f s", kernel.describe(), done.result())
        loop.call_soon_threadsafe(slots.set_not_ready, "")

    warming.add_done_callback(kernel_ready)
    try:
        name = startup_version(dirs)
        if flags.worker_peer >= 0:  # restarted: serve what the other workers serve
            name = await peer_version(flags, controls, token) or name
        if name is None and flat_layout(dirs):
            version = await loop.run_in_executor(executor, load_flat, dirs, options)
            await loop.run_in_executor(executor, warm_version, version, flags.partitioner)
            slots.install(version)
            log.info(
                "serving the shard files in %s directly as version %s (the original's local"
                " mode: no VERSION file)", data_dir, version.name,
            )  # fmt: skip
        elif name is None:
            slots.idle_reason = diagnose_data_dir(data_dir, dirs)
            level = logging.INFO if flags.allow_empty else logging.WARNING
            log.log(level, "no start-up version: %s", slots.idle_reason)
        else:
            version = await loop.run_in_executor(executor, load_base, dirs, name, options)
            await loop.run_in_executor(executor, warm_version, version, flags.partitioner)
            slots.install(version)
            log.info("serving %s (%s)", name, " > ".join(version.chain))
    except VersionError as exc:
        startup_error = exc.message
        local.last_error = f"startup: {exc.message}"
        slots.fail_startup(f"its start-up version could not be loaded: {exc.message}")
        log.error("start-up version not loaded; NOT_SERVING until one is: %s", exc.message)
    serving_state: list[bool | None] = [None]

    async def publish_health() -> None:
        """Health follows the serving state: NOT_SERVING while the replica cannot serve."""
        while serving_state[0] != slots.serving:
            serving_state[0] = slots.serving
            status = (
                health_pb2.HealthCheckResponse.SERVING
                if slots.serving
                else health_pb2.HealthCheckResponse.NOT_SERVING
            )
            for name in ("", *service_names):
                await health_servicer.set(name, status)
            if not slots.serving:  # still getting ready is no fault
                level = logging.INFO if slots.not_ready else logging.WARNING
                log.log(level, "NOT_SERVING: %s", slots.why_not_serving())
            else:
                log.info("SERVING %s", slots.current.name if slots.current else "(empty)")

    health_updates: set[asyncio.Future] = set()

    def on_slots_changed() -> None:
        if serving_state[0] != slots.serving:
            update = asyncio.ensure_future(publish_health())
            health_updates.add(update)
            update.add_done_callback(health_updates.discard)

    slots.listeners.append(on_slots_changed)
    await publish_health()  # before the ports answer: the health servicer starts at SERVING
    for each in grpc_servers:
        await each.start()
    # Start-up objects never become garbage: keep the cyclic GC from rescanning them.
    gc.collect()
    gc.freeze()

    async def check_files() -> None:  # leases signal at once; this covers polling and misses
        while True:
            await asyncio.sleep(1.0)
            files_changed()

    file_checker = asyncio.ensure_future(check_files())
    lookups = listening[:-1] + ([lane_bind] if lane else [])
    lookups += faces.binds(lambda port: address(flags.host, port))
    log.info(
        "listening on %s%s, control on %s%s (worker %d of %d, dict_split %d, version %r)",
        ", ".join(lookups),
        " over TLS" if tls.serves else "",
        listening[-1],
        metrics_note,
        index,
        flags.workers,
        flags.dict_split,
        slots.current.name if slots.current else "",
    )
    # --port_file says the server has settled: ports answering, start-up version loaded and
    # kernel ready, so a tool that waits for the file finds it serving what it loaded.
    warmed = asyncio.wrap_future(warming)
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({warmed, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if warmed.done() and not warmed.cancelled():
        warmed.exception()  # a failed warm-up was logged by kernel_ready
    if flags.port_file and index == 0 and not stop.is_set():
        report = {
            "pid": os.getpid(),
            "ports": ports,
            "control_ports": controls,
            "tcp_ports": [service.lane_port] if lane is not None and flags.workers == 1 else [],
            "metrics_port": metrics_port,
            **faces.report(flags.workers == 1),
        }
        try:
            atomic_write_json(flags.port_file, report, indent=None)
        except OSError as exc:
            log.error("cannot write --port_file %s: %s", flags.port_file, exc)

    await stop.wait()
    service.draining = True  # for the metrics, while in-flight calls finish
    file_checker.cancel()
    log.info("stopping: draining in-flight calls for up to %.1f s", flags.grace)
    await health_servicer.enter_graceful_shutdown()
    if lane is not None:
        await lane.stop(flags.grace)
    await faces.stop(flags.grace)
    await server.stop(flags.grace)
    if shared_server is not None:
        await shared_server.stop(flags.grace)
    await control_server.stop(1.0)
    if metrics_server is not None:
        await metrics_server.close()
    for remote in remotes:
        await remote.close()
    await runner.close()
    slots.close()
    executor.shutdown(wait=False, cancel_futures=True)
    if flags.port_file and index == 0:  # the ports are no longer ours
        Path(flags.port_file).unlink(missing_ok=True)
    log.info("stopped")
    return 0


async def peer_version(flags: Flags, controls: list[int], token: str) -> str | None:
    """The current version of worker --worker_peer (None when it does not say in time)."""
    from cube.server.control import ControlError, RemoteWorker

    peer = flags.worker_peer
    where = address(_loopback(flags.control_host), controls[peer])
    remote = RemoteWorker(peer, controls[peer], where, 10.0, token)
    try:
        state = await remote.apply("state")
    except ControlError as exc:
        log.warning("worker %d did not say what it serves (%s): using VERSION", peer, exc)
        return None
    finally:
        await remote.close()
    return str(state.get("cur_version") or "") or None


def supervise(flags: Flags, argv: list[str], ports: list[int]) -> int:
    """Run the workers; forward SIGTERM/SIGINT. A worker that dies is started again, told to
    load the version a live peer serves (not VERSION, which may lag a switch), so the other
    workers keep serving meanwhile; more than --worker_restarts deaths of one worker within a
    minute (a crash loop) stop them all and fail."""
    stopping = False

    def on_signal(signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    def start(i: int, peer: int = -1) -> subprocess.Popen:
        extra = [f"--worker_index={i}"] + ([f"--worker_peer={peer}"] if peer >= 0 else [])
        return subprocess.Popen([sys.executable, "-m", "cube.server.main", *argv, *extra])

    children = [start(i) for i in range(flags.workers)]
    log.info(
        "started %d workers on ports %s (pids %s)",
        len(children),
        ",".join(map(str, ports)),
        ",".join(str(c.pid) for c in children),
    )
    deaths: list[list[float]] = [[] for _ in children]
    failed = False
    while not stopping and not failed:
        time.sleep(0.2)
        for i, child in enumerate(children):
            if child.poll() is None or stopping:
                continue
            now = time.monotonic()
            deaths[i] = [t for t in deaths[i] if now - t < 60.0] + [now]
            log.error("worker %d (pid %d) exited with %s", i, child.pid, child.returncode)
            if child.returncode == EXIT_CANNOT_LISTEN:
                log.error("worker %d cannot listen on its ports: stopping the server", i)
                failed = True
                break
            if len(deaths[i]) > flags.worker_restarts:
                log.error(
                    "worker %d died %d times within a minute (more than --worker_restarts %d):"
                    " stopping the server",
                    i,
                    len(deaths[i]),
                    flags.worker_restarts,
                )
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
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + flags.grace + 10.0
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
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
