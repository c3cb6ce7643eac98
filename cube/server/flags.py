"""cube-server's flags, typed (`ServerFlags`), and their FlagSet; what they mean:
docs/reference/cube-server.md. cube/server/main.py checks them and runs the server.
"""

from __future__ import annotations

from dataclasses import dataclass

from cube.flags import FlagSet, flag
from cube.logs import LOG_FORMATS
from cube.routing import PARTITIONERS
from cube.server.service import DEFAULT_MAX_ANSWER_BYTES


@dataclass(frozen=True)
class ServerFlags:
    """cube-server's flags (also read from conf/gflags.conf)."""

    port: int = flag(
        8000,
        "gRPC port of the lookups (worker 0's port with --workers); 0: any free port"
        " (--workers 1 only), see --port_file",
    )
    port_file: str = flag(
        "",
        "once listening, write the bound ports here as JSON {pid, ports, control_ports,"
        " tcp_ports, metrics_port, http_ports, baidu_std_ports} (for tools that start the"
        " server on --port 0)",
    )
    host: str = flag("127.0.0.1", "address to bind the lookups (0.0.0.0: every interface)")
    metrics_port: int = flag(
        -1,
        "Prometheus metrics of every worker at http://<metrics_host>:<port>/metrics, served by"
        " worker 0; -1: off, 0: any free port (in --port_file)",
    )
    metrics_host: str = flag(
        "127.0.0.1",
        "address to bind the metrics (no token: they reveal counts, versions and timings, not"
        " data)",
    )
    control_port: int = flag(
        -1,
        "port of the control service (loads, switches; worker i on control_port + i);"
        " -1: --port + 1000 (any free port when --port is 0)",
    )
    control_host: str = flag(
        "127.0.0.1", "address to bind the control port (beyond loopback it needs --control_token)"
    )
    control_token: str = flag(
        "",
        "require 'authorization: Bearer <token>' on the control port (default: env"
        " CUBE_CONTROL_TOKEN)",
    )
    control_token_file: str = flag(
        "",
        "file holding --control_token, one token a line (each is accepted; read again when it"
        " changes), instead of the flag",
    )
    insecure: bool = flag(
        False,
        "allow a control port beyond loopback without a token (anyone reaching it can load,"
        " switch and unload versions)",
    )
    tls_cert: str = flag("", "PEM certificate: serve lookups (gRPC and TCP lane) over TLS")
    tls_key: str = flag("", "PEM private key of --tls_cert")
    dict_split: int = flag(1, "sub-dicts in this shard: <data_dir>/<split>/... when > 1")
    partitioner: str = flag("mod", "key -> split rule (the builder's)", choices=PARTITIONERS)
    in_mem: bool = flag(True, "fault shards into memory at load and mlock them (best effort)")
    hot_cache_mb: int = flag(
        -1,
        "MiB of hot cache a worker keeps in front of a version too large for its memory"
        " (the values asked for most, key by key); -1: a fifth of the memory limit, less"
        " beside a pinned index, shared out among the workers; 0: none",
    )
    huge_pages: bool = flag(
        True,
        "map shards with 2 MiB pages where the kernel and filesystem have them (transparent"
        " huge pages in the page cache); with --in_mem a loaded shard's unmapped pages are read"
        " again",
    )
    data_dir: str = flag("./data", "directory with VERSION and the version directories")
    workers: int = flag(1, "worker processes, each on its own port (see --worker_ports)")
    worker_ports: str = flag("", "comma list of worker ports (default: port, port+1, ...)")
    reuseport: bool = flag(
        False,
        "every worker also on --port (SO_REUSEPORT; refused when another process holds it);"
        " own ports +1",
    )
    tcp_lane: bool = flag(True, "also serve cube.v1 Seek over plain TCP (see cube.server.lane)")
    tcp_ports: str = flag("", "comma list of each worker's TCP lane port (default: any free)")
    busy_poll_us: int = flag(
        0,
        "after answering on the TCP lane, poll for the next request this long before sleeping"
        " (lower latency where waking an idle CPU is slow, e.g. VMs; burns CPU when idle)",
    )
    http_port: int = flag(
        -1,
        "also serve the original's HTTP+JSON (POST /DictService/seek, /ControlService/cmd) on"
        " this port, worker i on port + i; -1: off, 0: any free port (in --port_file)",
    )
    baidu_std_port: int = flag(
        -1,
        "also serve the original's brpc baidu_std protocol (DictService.seek and"
        " ControlService.cmd, as the C++ cube-api calls them) on this port, worker i on"
        " port + i; -1: off, 0: any free port (in --port_file)",
    )
    max_batch: int = flag(100000, "most keys in one request (more: RESOURCE_EXHAUSTED)")
    max_answer_bytes: int = flag(
        DEFAULT_MAX_ANSWER_BYTES, "most value bytes in one answer (more: RESOURCE_EXHAUSTED)"
    )
    allow_empty: bool = flag(
        False,
        "answer misses while no version is loaded (without it: NOT_SERVING and UNAVAILABLE"
        " until one is; a replica that failed to load its version never answers misses)",
    )
    file_leases: bool = flag(
        True, "watch mapped shard files with kernel leases (false: poll their size and mtime)"
    )
    lane_max_connections: int = flag(
        1024,
        "connections per worker at most, TCP lane, HTTP+JSON and baidu_std together (a new one"
        " closes the one idle longest to make room)",
    )
    lane_budget_bytes: int = flag(
        256 << 20,
        "TCP lane: input buffers + queued + unsent answers per worker, at most (then no"
        " connection's next frame is read until it drops)",
    )
    lane_connection_bytes: int = flag(
        16 << 20, "TCP lane: a connection's queued + unsent answers, at most (then it is not read)"
    )
    lane_stall_timeout: float = flag(
        30.0, "TCP lane: close a connection holding a partial frame or unread answers this long"
    )
    lane_idle_timeout: float = flag(
        60.0,
        "TCP lane, HTTP+JSON, baidu_std: close a connection that sends nothing this long after"
        " it connected or was last answered",
    )
    lane_request_timeout: float = flag(
        30.0,
        "TCP lane, HTTP+JSON, baidu_std: close a connection whose request is not whole this"
        " long after its first byte (a drip)",
    )
    dict_name: str = flag("", "dictionary served; requests naming another get NOT_FOUND")
    shard: int = flag(-1, "shard number of this server (also accepts <dict>_part<shard>)")
    verify: bool = flag(True, "check every section checksum when loading a version")
    write_version: bool = flag(False, "rewrite <data_dir>/VERSION on a switch (agent's job)")
    grace: float = flag(5.0, "seconds in-flight calls get to finish on SIGTERM")
    control_timeout: float = flag(900.0, "seconds worker 0 waits for a worker's step")
    load_delay: float = flag(0.0, "testing aid: hold every version load this many seconds")
    log_level: str = flag("INFO", "DEBUG, INFO, WARNING or ERROR")
    log_dir: str = flag("", "also log to <log_dir>/cube-server.log (default: stderr only)")
    log_format: str = flag("text", "text lines, or one JSON object a line", choices=LOG_FORMATS)
    worker_restarts: int = flag(
        3,
        "a worker that dies is restarted (on the version its peers serve) up to this many"
        " times a minute; beyond that the whole server stops with an error",
    )
    worker_index: int = flag(-1, "internal: which worker this process is (set by --workers)")
    worker_peer: int = flag(-1, "internal: a restarted worker takes its version from this one")


FLAGS = FlagSet(
    "cube-server",
    "Serve one shard of a Cube dictionary over gRPC. Reads conf/gflags.conf first when it"
    " exists (as the original does); flags on the command line win over it.",
    spec=ServerFlags,
    default_flagfile="conf/gflags.conf",
).ignore_original_runtime()
