"""cube-transfer: `cube-transfer -p 8099 --config conf/transfer.conf [-l LEVEL] [--poll_interval S]`

Watches the donefiles, builds each new version with cube-builder and rolls it out to every
cube-agent of `[cube_agent]`; serves the query API on `-p` and the built tars on `wget_port`.
SIGTERM/SIGINT stop it cleanly; its journal (in tmp_address) lets a restart resume.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cube import hadoop, remote
from cube.flags import FlagError, FlagSet, flag, run_cli
from cube.listen import ListenError, address
from cube.logs import LOG_FORMATS, setup_logging
from cube.security import SecurityError, TLSFiles, require_token
from cube.transfer.build import builder_settings_problem
from cube.transfer.config import ConfigError, load_config
from cube.transfer.donefile import SourceUnavailable, ensure_donefile_dir
from cube.transfer.http_api import ListenSockets, bind_listeners, start_listeners
from cube.transfer.journal import JournalError
from cube.transfer.service import TransferService

log = logging.getLogger("cube.transfer")
_NUMERIC_LEVELS = {0: "ERROR", 1: "ERROR", 2: "WARNING", 3: "INFO", 4: "INFO"}


@dataclass(frozen=True)
class TransferFlags:
    """cube-transfer's flags."""

    port: int = flag(8099, "query API port (0: any free port, logged)", aliases=("p",))
    config: str = flag("conf/transfer.conf", "transfer.conf (the original's INI format)")
    log_level: str = flag(
        "info", "debug|info|warning|error (or the original's 0-5)", aliases=("l",), metavar="LEVEL"
    )
    log_dir: str = flag("", "also log to <log_dir>/<log_name>.log (default: stderr only)")
    log_name: str = flag("transfer", "log file name (without .log)")
    log_format: str = flag("text", "text lines, or one JSON object a line", choices=LOG_FORMATS)
    poll_interval: float = flag(5.0, "seconds between donefile polls / reconciliations")
    dead_timeout: float = flag(
        60.0, "seconds a silent agent is waited for within a phase before it is given up on"
    )
    keep_outputs: int = flag(3, "build outputs of the last N live versions to keep")
    metrics_port: int = flag(-1, "Prometheus metrics at :PORT/metrics; -1: off, 0: any")
    metrics_host: str = flag("127.0.0.1", "address to bind the metrics (no token)")
    hadoop_home: str = hadoop.home_flag()
    hadoop_configs: str = hadoop.configs_flag()
    create_donefile_dir: bool = flag(
        False,
        "create donefile_address (a local directory) when it does not exist; "
        "without it a missing one stops the start (exit 2)",
    )


def flag_set() -> FlagSet[TransferFlags]:
    return FlagSet(
        "cube-transfer", "Build and roll out Cube versions from donefiles.", spec=TransferFlags
    )


def log_level(text: str) -> int:
    if text.isdigit():
        return logging.DEBUG if int(text) >= 5 else getattr(logging, _NUMERIC_LEVELS[int(text)])
    level = logging.getLevelName(text.upper())
    if not isinstance(level, int):
        raise FlagError(f"--log_level: {text!r} is not debug, info, warning or error")
    return level


def configure_logging(flags: TransferFlags) -> None:
    log_file = Path(flags.log_dir) / f"{flags.log_name}.log" if flags.log_dir else None
    setup_logging("cube-transfer", log_level(flags.log_level), flags.log_format, log_file)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    for name in ("fsspec", "s3fs", "botocore", "aiobotocore"):  # their INFO/DEBUG: not ours
        logging.getLogger(name).setLevel(logging.WARNING)


async def serve(
    service: TransferService, sockets: ListenSockets, metrics: tuple[str, int] | None = None
) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    metrics_server = None
    if metrics is not None:
        from cube.metrics import serve_collector
        from cube.transfer.metrics import TransferCollector

        async def snapshot() -> dict[str, Any]:
            return service.metrics_snapshot()

        try:
            metrics_server = await serve_collector(*metrics, TransferCollector, snapshot)
        except ListenError as exc:
            log.error("%s", exc)
            return 1
        log.info("metrics on http://%s/metrics", address(metrics[0], metrics_server.port))
    await service.open()
    try:
        stop_listeners = await start_listeners(service, sockets)
    except OSError as exc:
        await service.close()
        log.error("cannot listen: %s", exc)
        return 1
    worker = asyncio.create_task(service.run(stop))
    try:
        await stop.wait()
        log.info("stopping")
    finally:
        worker.cancel()
        try:
            await asyncio.wait_for(
                asyncio.shield(asyncio.gather(worker, return_exceptions=True)), 10
            )
        except TimeoutError:
            log.warning("worker did not stop within 10s")
        await stop_listeners()
        await service.close()
        if metrics_server is not None:
            await metrics_server.close()
    return 0


def run(argv: Sequence[str]) -> int:
    flags = flag_set().parse(argv)
    configure_logging(flags)
    if flags.poll_interval <= 0:
        raise FlagError("--poll_interval must be > 0")
    if not 0 <= flags.port < 65536:
        raise FlagError(f"-p {flags.port} is not a port")
    try:
        hadoop.configure(flags.hadoop_home, flags.hadoop_configs)
    except ValueError as exc:
        raise FlagError(f"--hadoop_configs: {exc}") from None
    try:
        cfg = load_config(flags.config)
        require_token(
            "cube-transfer's API",
            cfg.listen,
            cfg.api_token_source(),
            cfg.insecure,
            f"api_token or api_token_file in {flags.config} (or env CUBE_API_TOKEN)",
            f"set insecure: true in {flags.config}",
        )
        TLSFiles(cfg.tls_cert, cfg.tls_key, cfg.agent_tls_ca).check("tls_cert/tls_key")
        cfg.agent_token_source()  # a token file that cannot be read: said now
        problem = builder_settings_problem(  # with its -paddle_config read (a local one)
            cfg.buildtool_local, cfg.builder_flags, cfg.donefile_format.paddle_saves, True
        )
        if problem:
            raise ConfigError(f"{flags.config}: builder_flags: {problem}")
        for key in ("donefile_address", "upload_address"):
            try:  # s3fs or the Hadoop client there for the address: said now, not at a poll
                remote.require(getattr(cfg, key))
            except remote.RemoteError as exc:
                raise ConfigError(f"{flags.config}: {key}: {exc}") from None
    except (ConfigError, SecurityError) as exc:
        log.error("%s", exc)
        return 2
    try:
        if ensure_donefile_dir(cfg.donefile_address, flags.create_donefile_dir):
            log.info("created the donefile directory %s", cfg.donefile_address)
    except SourceUnavailable as exc:
        how = (
            "" if flags.create_donefile_dir else "; create it, or start with --create_donefile_dir"
        )
        log.error("%s: donefile_address: %s%s", flags.config, exc, how)
        return 2
    try:
        sockets = bind_listeners(cfg, flags.port)  # before anything else: "in use" at once
    except OSError as exc:
        log.error("%s", exc.strerror)
        return 1
    if cfg.wget_port == 0 and sockets.files is not None:
        cfg = dataclasses.replace(cfg, wget_port=sockets.files_port)
    service = TransferService(
        cfg,
        poll_interval=flags.poll_interval,
        dead_timeout=flags.dead_timeout,
        keep_outputs=max(flags.keep_outputs, 1),
    )
    try:
        metrics = (flags.metrics_host, flags.metrics_port) if flags.metrics_port >= 0 else None
        return asyncio.run(serve(service, sockets, metrics))
    except JournalError as exc:
        log.error("%s", exc)
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    sys.exit(main())
