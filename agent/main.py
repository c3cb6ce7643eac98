"""cube-agent command line: `cube-agent -P 8001 --deploy_path DIR --server 127.0.0.1:8000`.

One agent may serve several instances, as the original's did: `--instances
DIR=HOST:PORT,...` adds instances (their deploy path and their server's control address) to
the one of --deploy_path and --server; requests name theirs by `deploy_path`.

Binds 127.0.0.1 unless --host says otherwise; with a token (--token, --token_file or env
CUBE_TOKEN) every request must authenticate, and beyond loopback a token is required (or
--insecure). The API is served over TLS with --tls_cert/--tls_key. Token files and TLS files
are read again when they change (cube.security: new requests and connections use them).
Prints one line `cube-agent listening on http(s)://HOST:PORT` once bound (`-P 0` picks a free
port), then serves until SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from cube import remote
from cube.agent import __version__
from cube.agent.api import make_app
from cube.agent.deploy import Agent, AgentConfig
from cube.agent.fetch import FetchPolicy, Prefix, SourcePolicy
from cube.agent.layout import DeployPathTaken, overlap
from cube.agent.metrics import AgentCounters
from cube.agent.peers import TAR_PATH, PeerConfig, PeerRecovery, token_text
from cube.flags import FlagError, FlagSet, flag, run_cli
from cube.listen import address, listen_socket
from cube.logs import LOG_FORMATS, announce, setup_logging
from cube.security import (
    TLSFiles,
    TokenLike,
    is_loopback,
    require_token,
    server_context,
    token_of,
)

log = logging.getLogger("cube.agent")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


# The original agent's -l numbers (its logger's levels) in ours.
_ORIGINAL_LEVELS = {"16": "DEBUG", "8": "DEBUG", "4": "INFO", "2": "WARNING", "1": "ERROR",
                    "0": "CRITICAL"}  # fmt: skip


# Kubernetes' quantity suffixes (an emptyDir's sizeLimit, a claim's size) in bytes
_QUANTITY = re.compile(r"([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?")
_SUFFIXES = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
             "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50,
             "Ei": 1 << 60}  # fmt: skip


def byte_quantity(text: str) -> int:
    """Bytes, as a number or a Kubernetes quantity (20Gi, 500M, 1.5Gi; rounded up)."""
    found = _QUANTITY.fullmatch(text.strip())
    if found is None:
        raise ValueError("not a number of bytes nor a quantity such as 20Gi or 500M")
    number, suffix = found.groups()
    whole, _, fraction = number.partition(".")
    scale = _SUFFIXES[suffix or ""]
    places: int = 10 ** len(fraction)
    exact = int(whole) * scale * places + int(fraction or 0) * scale
    return -(-exact // places)


def log_level(text: str) -> str:
    """A level name, or one of the original agent's -l numbers."""
    name = _ORIGINAL_LEVELS.get(text.strip(), text.strip().upper())
    if name not in (*LOG_LEVELS, "CRITICAL"):
        raise ValueError(f"not one of {', '.join(LOG_LEVELS)} or 16, 8, 4, 2, 1, 0")
    return name


@dataclass(frozen=True)
class AgentFlags:
    """cube-agent's flags."""

    port: int = flag(0, "HTTP port of the agent (0 = any free port)", aliases=("P",), required=True)
    host: str = flag("127.0.0.1", "address to bind", metavar="HOST")
    metrics_port: int = flag(-1, "Prometheus metrics at :PORT/metrics; -1: off, 0: any")
    metrics_host: str = flag("127.0.0.1", "address to bind the metrics (no token)")
    deploy_path: str = flag(
        "", "instance directory: data/, cube_data/, agent_state/", required=True, metavar="DIR"
    )
    server: str = flag(
        "127.0.0.1:9000",
        "the cube-server's control address: its --control_host:--control_port (a server's"
        " control port is its --port + 1000 unless set)",
        metavar="HOST:PORT",
    )
    instances: str = flag(
        "",
        "more instances this agent serves, comma-separated DEPLOY_PATH=HOST:PORT (each server's"
        " control address); requests name theirs by deploy_path",
        metavar="DIR=HOST:PORT,...",
    )
    server_token: str = flag(
        "",
        "token of the server's control port (its --control_token) (default: env"
        " CUBE_CONTROL_TOKEN)",
    )
    server_token_file: str = flag(
        "",
        "file holding --server_token (the first line; read again when it changes), instead of"
        " the flag",
    )
    token: str = flag("", "require 'Authorization: Bearer <token>' (default: env CUBE_TOKEN)")
    token_file: str = flag(
        "",
        "file holding --token, one token a line (each is accepted; read again when it"
        " changes), instead of the flag",
    )
    insecure: bool = flag(
        False, "allow --host beyond loopback without a token (anyone reaching it can deploy)"
    )
    tls_cert: str = flag("", "PEM certificate: serve the HTTP API over TLS (https)")
    tls_key: str = flag("", "PEM private key of --tls_cert")
    tls_ca: str = flag("", "PEM CA bundle trusted for https:// downloads (default: system's)")
    keep: int = flag(2, "versions kept on disk besides the serving chain")
    disk_limit: int = flag(
        0,
        "bytes the deploy path may hold, e.g. its emptyDir's sizeLimit (20Gi, 500M, or bytes):"
        " downloads that would not fit are refused and the metrics' free space counts against"
        " it; 0: the filesystem's",
        parse=byte_quantity,
        metavar="BYTES",
    )
    log_level: str = flag(
        "INFO",
        "DEBUG, INFO, WARNING or ERROR; -l takes the original agent's numbers too"
        " (16 debug, 8 trace, 4 notice, 2 warning, 1 fatal, 0 none)",
        parse=log_level,
        aliases=("l",),
        metavar="LEVEL",
    )
    log_dir: str = flag("", "also log to <log_dir>/<log_name>.log (default: stderr only)")
    log_name: str = flag("cube-agent", "the log file's name in --log_dir, without .log")
    log_format: str = flag("text", "text lines, or one JSON object a line", choices=LOG_FORMATS)
    download_timeout: float = flag(3600.0, "seconds for one download, all attempts")
    download_attempts: int = flag(5, "attempts per download (each resumes the .part)")
    download_backoff: float = flag(1.0, "seconds before the 2nd attempt, doubled each time")
    io_timeout: float = flag(60.0, "seconds for one connect or one stalled read")
    limit_rate: int = flag(0, "download rate limit in bytes/s (0 = unlimited)")
    reload_timeout: float = flag(1800.0, "seconds for the server to load a version")
    control_timeout: float = flag(10.0, "seconds for other server control commands")
    allowed_sources: str = flag(
        "",
        "comma-separated URL prefixes downloads may use, scheme://host[:port]/path "
        "(file:///path for local files, s3://bucket/prefix for S3 objects, which need one)"
        " (default: any http, https or ftp URL)",
        metavar="PREFIX,...",
    )
    sync_reply_timeout: float = flag(
        110.0,
        "a command from the original cube-transfer (which takes the reply as the outcome) is"
        " answered when its task ends, or after this many seconds with 'still running' (the"
        " original transfer gives up after 120)",
    )
    allow_file_sources: bool = flag(False, "allow file:// and local path sources anywhere")
    md5_from_source: bool = flag(False, "a download without md5 fetches <source>.md5")
    peers: str = flag(
        "",
        "the agents of the other replicas of this shard, comma-separated HOST:PORT (this one's"
        " own name may be listed: skipped): an agent that starts with no version gets the"
        " version they serve from them, md5-checked, when the transfer does not (agent/peers.py)",
        metavar="HOST:PORT,...",
    )
    peer_wait: float = flag(
        30.0,
        "seconds a recovery from --peers leaves to the transfer first, while --transfer_address"
        " answers or after a command of the transfer",
    )
    transfer_address: str = flag(
        "",
        "HOST:PORT of the transfer (e.g. its file server): while it accepts connections, a"
        " recovery from --peers waits --peer_wait s for the transfer first",
        metavar="HOST:PORT",
    )


def flag_set() -> FlagSet[AgentFlags]:
    return FlagSet(
        "cube-agent",
        "Deploys shard versions onto one cube-server (docs/reference/agent-api.md).",
        spec=AgentFlags,
    ).ignore(
        ["n", "q"],
        True,
        "the original agent's worker and queue sizes; this agent runs each instance's tasks"
        " in order and bounds them itself",
    )


def instance_configs(first: AgentConfig, text: str) -> list[AgentConfig]:
    """`first` and the instances of --instances (DEPLOY_PATH=HOST:PORT, comma-separated), each
    with its own deploy path and server, the rest shared. FlagError for a malformed entry or a
    deploy path or server given twice."""
    configs = [first]
    for entry in (part.strip() for part in text.split(",")):
        if not entry:
            continue
        path, sep, server = entry.rpartition("=")
        host, colon, port = server.rpartition(":")
        if not sep or not path or not colon or not host or not port.isdigit():
            raise FlagError(f"--instances: {entry!r} is not DEPLOY_PATH=HOST:PORT")
        configs.append(dataclasses.replace(first, deploy_path=Path(path).absolute(), server=server))
    for what in ("deploy_path", "server"):
        seen: set[object] = set()
        for config in configs:
            value = getattr(config, what)
            if value in seen:
                raise FlagError(f"--instances: {what} {str(value)!r} is given twice")
            seen.add(value)
    for i, config in enumerate(configs):  # by real path: a symlink, or one inside another
        for other in configs[i + 1 :]:
            problem = overlap(config.deploy_path, other.deploy_path)
            if problem:
                raise FlagError(f"--instances: {problem}: one agent instance per directory")
    return configs


def config_from_flags(flags: AgentFlags) -> AgentConfig:
    if not 0 <= flags.port <= 65535:
        raise FlagError(f"--port: {flags.port} is not a TCP port")
    if not flags.deploy_path:
        raise FlagError("--deploy_path is required")
    if flags.keep < 1:
        raise FlagError("--keep: at least 1 (the newest download must survive until enabled)")
    for name, count in (
        ("download_attempts", flags.download_attempts), ("limit_rate", flags.limit_rate),
    ):  # fmt: skip
        if count < 0:
            raise FlagError(f"--{name}: must not be negative")
    for name, seconds in (
        ("download_timeout", flags.download_timeout), ("io_timeout", flags.io_timeout),
        ("reload_timeout", flags.reload_timeout), ("control_timeout", flags.control_timeout),
        ("sync_reply_timeout", flags.sync_reply_timeout),
    ):  # fmt: skip
        if seconds <= 0:
            raise FlagError(f"--{name}: must be positive")
    try:
        sources = SourcePolicy.from_flags(flags.allowed_sources, flags.allow_file_sources)
        for prefix in sources.prefixes:
            if prefix.scheme == "s3":  # s3fs installed: said now, not at the first download
                try:
                    remote.require(f"s3://{prefix.host}/")
                except remote.RemoteError as exc:
                    raise ValueError(f"--allowed_sources: {exc}") from None
        require_token(
            "cube-agent",
            flags.host,
            token_of(flags.token, flags.token_file, "CUBE_TOKEN"),
            flags.insecure,
            "--token or --token_file (or env CUBE_TOKEN)",
        )
        server_token = token_of(flags.server_token, flags.server_token_file, "CUBE_CONTROL_TOKEN")
        TLSFiles(flags.tls_cert, flags.tls_key, flags.tls_ca).check()
    except ValueError as exc:
        raise FlagError(str(exc)) from None
    policy = FetchPolicy(
        attempts=max(1, flags.download_attempts),
        backoff=flags.download_backoff,
        timeout=flags.download_timeout,
        io_timeout=flags.io_timeout,
        limit_rate=flags.limit_rate,
        sources=sources,
        tls_ca=flags.tls_ca,
    )
    return AgentConfig(
        deploy_path=Path(flags.deploy_path).absolute(),
        server=flags.server,
        server_token=server_token,
        keep=flags.keep,
        fetch=policy,
        reload_timeout=flags.reload_timeout,
        control_timeout=flags.control_timeout,
        md5_from_source=flags.md5_from_source,
        sync_reply_timeout=flags.sync_reply_timeout,
        disk_limit=flags.disk_limit,
    )


def peer_config(flags: AgentFlags, token: object) -> PeerConfig | None:
    """--peers and what goes with it (None without --peers); FlagError for a bad entry."""
    peers = tuple(p.strip() for p in flags.peers.split(",") if p.strip())
    if not peers:
        return None
    if flags.instances:
        raise FlagError("--peers: one instance only (not with --instances)")
    for entry in (*peers, *([flags.transfer_address] if flags.transfer_address else [])):
        host, colon, port = entry.rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise FlagError(f"--peers/--transfer_address: {entry!r} is not HOST:PORT")
    if flags.peer_wait < 0:
        raise FlagError("--peer_wait: must not be negative")
    return PeerConfig(
        peers=peers,
        token=lambda: token_text(token),
        scheme="https" if flags.tls_cert else "http",
        tls_ca=flags.tls_ca,
        peer_wait=flags.peer_wait,
        transfer_address=flags.transfer_address,
    )


def peer_policy(peers: PeerConfig, fetch: FetchPolicy) -> FetchPolicy:
    """The download policy of tars from peers: only their tar route, bounded as the rest."""
    prefixes = tuple(Prefix.parse(f"{peers.scheme}://{p}{TAR_PATH}") for p in peers.peers)
    return dataclasses.replace(fetch, sources=SourcePolicy(prefixes))


def combined_snapshot(agents: Sequence[Agent]) -> Callable[[], Coroutine[Any, Any, dict[str, Any]]]:
    """The metrics of every instance of the process: the shared counters, the other figures
    summed."""

    async def snapshot() -> dict[str, Any]:
        parts = [await agent.metrics_snapshot() for agent in agents]
        running: dict[str, int] = {}
        disk: dict[str, int] = {}
        for part in parts:
            for command, count in part["running"].items():
                running[command] = running.get(command, 0) + count
            for area, size in part["disk"].items():
                disk[area] = disk.get(area, 0) + size
        return {
            "counters": parts[0]["counters"],
            "running": running,
            "versions": sum(part["versions"] for part in parts),
            "disk": disk,
            "space": [space for part in parts for space in part["space"]],
        }

    return snapshot


async def serve(
    configs: Sequence[AgentConfig],
    host: str,
    port: int,
    token: TokenLike,
    tls: TLSFiles | None = None,
    metrics: tuple[str, int] | None = None,
    peers: PeerConfig | None = None,
) -> int:
    counters = AgentCounters()
    agents = [Agent(config, counters=counters) for config in configs]
    api = listen_socket(host, port, "-P")  # both ports before the instances open
    metrics_server, metrics_line = None, ""
    if metrics is not None:
        from cube.agent.metrics import AgentCollector
        from cube.metrics import serve_collector

        try:
            metrics_server = await serve_collector(
                *metrics, AgentCollector, combined_snapshot(agents)
            )
        except BaseException:
            api.close()
            raise
        where = address(metrics[0], metrics_server.port)
        metrics_line = f"cube-agent metrics on http://{where}/metrics"
    try:
        for agent in agents:
            agent.open()
    except BaseException:  # another agent holds a directory: nothing of ours stays open
        for agent in agents:
            agent.lock.release()
        api.close()
        if metrics_server is not None:
            await metrics_server.close()
        raise
    runner = web.AppRunner(make_app(agents, token), access_log=None)
    recovering: asyncio.Task[None] | None = None
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        ssl_context = server_context(tls) if tls is not None and tls.serves else None
        site = web.SockSite(runner, api, ssl_context=ssl_context)
        await site.start()
        bound = api.getsockname()
        scheme = "https" if ssl_context else "http"
        announce(log, f"cube-agent listening on {scheme}://{address(bound[0], bound[1])}")
        if metrics_server is not None:  # a second line, after the one tools wait for
            announce(log, metrics_line)
        log.info(
            "cube-agent %s: %s, auth %s",
            __version__,
            "; ".join(f"deploy_path {c.deploy_path}, server {c.server}" for c in configs),
            "on" if token else "OFF",
        )
        if peers is not None and peers.peers:
            recovery = PeerRecovery(agents[0], peers)
            agents[0].recovery_status = recovery.state.to_json
            recovering = asyncio.create_task(recovery.run(), name="recovery from peers")
        await stop.wait()
    finally:
        if recovering is not None:
            recovering.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await recovering
        await runner.cleanup()
        for agent in agents:
            await agent.close()
        if metrics_server is not None:
            await metrics_server.close()
    return 0


def _main(argv: Sequence[str]) -> int:
    flags = flag_set().parse(argv)
    configs = instance_configs(config_from_flags(flags), flags.instances)
    level = getattr(logging, flags.log_level)
    log_file = Path(flags.log_dir) / f"{flags.log_name}.log" if flags.log_dir else None
    setup_logging("cube-agent", max(level, logging.INFO), flags.log_format, log_file)
    for name in ("fsspec", "s3fs", "botocore", "aiobotocore"):  # their INFO/DEBUG: not ours
        logging.getLogger(name).setLevel(logging.WARNING)
    log.setLevel(level)  # DEBUG is for the agent, not for grpc's and asyncio's internals
    token = token_of(flags.token, flags.token_file, "CUBE_TOKEN")  # (checked: config_from_flags)
    if not token and not is_loopback(flags.host):
        log.warning("listening on %s without a token (--insecure): anyone reaching it can"
                    " deploy", flags.host)  # fmt: skip
    tls = TLSFiles(flags.tls_cert, flags.tls_key)
    try:
        metrics = (flags.metrics_host, flags.metrics_port) if flags.metrics_port >= 0 else None
        peers = peer_config(flags, token)
        if peers is not None:
            configs[0] = dataclasses.replace(
                configs[0], peer_fetch=peer_policy(peers, configs[0].fetch), peer_token=peers.token
            )
        return asyncio.run(serve(configs, flags.host, flags.port, token, tls, metrics, peers))
    except DeployPathTaken as exc:
        log.error("cube-agent: %s", exc)
        return 1
    except OSError as exc:
        log.error("cube-agent: %s", exc.strerror or exc)
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
