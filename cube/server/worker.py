"""One cube-server worker process, from `Worker.start()` to `Worker.stop()`: its gRPC servers
(lookups, control, health, reflection), the TCP lane, the original's faces, the metrics endpoint
(worker 0), the version slots and the start-up load. `serve` runs one until SIGTERM/SIGINT.
How a worker serves and gets ready: docs/ARCHITECTURE.md (Serving path); its flags:
docs/reference/cube-server.md.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AsyncExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cube import kernel
from cube.fsutil import atomic_write_json
from cube.listen import GRPC_OPTIONS, ListenError, address, grpc_listen
from cube.metrics import MetricsEndpoint
from cube.security import ServerTLS
from cube.server.bounds import Bounds
from cube.server.config import control_token, lane_limits, max_message, tls_files
from cube.server.control import (
    CONTROL_SERVICE,
    ControlError,
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
from cube.server.original_faces import Faces, start_faces
from cube.server.ports import PortPlan, loopback
from cube.server.service import DICT_SERVICE, FAST_SERVICE, SeekService, warm_version
from cube.server.supervisor import EXIT_CANNOT_LISTEN
from cube.server.versions import (
    WAITING,
    LoadedVersion,
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

if TYPE_CHECKING:
    from cube.server.flags import ServerFlags

LIVENESS_SERVICE = "cube.Liveness"  # the health name the kubelet's liveness probe asks
log = logging.getLogger("cube.server")
FILE_CHECK_S = 1.0  # how often mapped files are checked besides the leases' signals
CONTROL_GRACE_S = 1.0  # what in-flight control calls get when the worker stops


class CannotListen(Exception):
    """A port of the worker cannot be listened on (already logged): the worker exits with
    EXIT_CANNOT_LISTEN, which stops its supervisor."""


class Worker:
    """One worker's servers. `start()` opens everything in order, each thing's closing pushed
    on an AsyncExitStack (as grpclib's Server.start / close / wait_closed), so a failure part
    way closes what was opened; `settle()` waits until the worker is ready and writes
    --port_file; `stop()` drains in-flight calls for --grace seconds and closes the rest.

    The order `start()` keeps: every port is bound before the start-up load (a port in use
    fails at once, not after a long load); the lookup kernel warms in the background while
    the replica says it is not ready; health is published before the ports answer (the health
    servicer starts at SERVING)."""

    def __init__(self, flags: ServerFlags, index: int, plan: PortPlan) -> None:
        self.flags, self.index, self.plan = flags, index, plan
        # The bound ports (port 0 becomes the one bound), for status and --port_file.
        self.ports, self.controls = list(plan.lookups), list(plan.controls)
        self.data_dir = Path(flags.data_dir)
        self.dirs = split_dirs(self.data_dir, flags.dict_split)
        self.watch = FileWatch(use_leases=flags.file_leases)
        self.options = LoadOptions(
            verify=flags.verify,
            populate=flags.in_mem,
            lock_memory=flags.in_mem,
            huge_pages=flags.huge_pages,
            delay=flags.load_delay,
            watch=self.watch,
            dict_name=flags.dict_name,
            shard=flags.shard,
            hot_cache_bytes=flags.hot_cache_mb << 20 if flags.hot_cache_mb >= 0 else -1,
            workers=flags.workers,
        )
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="cube-loader")  # (no thread yet)
        self.slots = VersionSlots(allow_empty=flags.allow_empty)
        self.service = SeekService(
            self.slots,
            max_batch=flags.max_batch,
            max_answer_bytes=flags.max_answer_bytes,
            dict_name=flags.dict_name,
            shard=flags.shard,
            partitioner=flags.partitioner,
        )
        self.local = LocalWorker(
            index, self.ports[index], self.slots, self.data_dir, self.dirs, self.options,
            self.executor, self.service,
        )  # fmt: skip
        self.token = control_token(flags)
        self.tls = tls_files(flags)
        self.server_tls: ServerTLS | None = None  # the certificate followed as it is renewed
        self.health = health.aio.HealthServicer()
        self.coordinator: Coordinator | None = None
        self.grpc_servers: list[Any] = []
        self.lane: Lane | None = None
        self.faces = Faces()
        self.metrics: MetricsEndpoint | None = None
        self.startup_error = ""
        self.warming: Future[float] | None = None
        self._published: bool | None = None  # the serving state health last said
        self._health_updates: set[asyncio.Future[None]] = set()
        self._listening: list[str] = []  # lookup addresses, for the start-up log line
        self._stack = AsyncExitStack()

    # start ----------------------------------------------------------------------------------

    async def start(self) -> None:
        """Open, bind, load and start serving; CannotListen (logged) when a port is taken.
        Returns once the ports answer (the kernel may still be warming: `settle`)."""
        stack = self._stack
        try:
            stack.callback(self.executor.shutdown, wait=False, cancel_futures=True)
            stack.callback(self.slots.close)
            # SIGIO's default action ends the process: the handler must be in place before a
            # lease is taken (the start-up load takes them).
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(signal.SIGIO, self._files_changed)
            runner = self._control()
            stack.push_async_callback(self._close_metrics)  # (closed after the serving ports)
            await self._listen(runner)
            self._warm_kernel()
            await self._load_startup_version()
            self.slots.listeners.append(self._on_slots_changed)
            await self._publish_health()  # before the ports answer
            # alive: SERVING whatever the version, answered by the event loop (the liveness
            # probe's: a loop that is stuck answers nothing)
            await self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
            for server in self.grpc_servers:
                await server.start()
            gc.collect()  # start-up objects never become garbage: keep the cyclic GC from
            gc.freeze()  # rescanning them
            checker = asyncio.ensure_future(self._check_files())
            stack.callback(checker.cancel)
        except BaseException:
            await stack.aclose()
            raise
        self._log_listening()

    def _control(self) -> ControlRunner:
        """Worker 0 coordinates the others over their control ports (remote workers); the
        others forward control commands to it. One ControlRunner serves every transport of
        control: the control port, HTTP+JSON and baidu_std."""
        flags, index = self.flags, self.index
        internal = loopback(flags.control_host)
        forward = None
        if index == 0:
            remotes = [
                RemoteWorker(i, port, address(internal, port), flags.control_timeout, self.token)
                for i, port in enumerate(self.controls)
                if i != 0
            ]
            self.coordinator = Coordinator(
                self.local, remotes, describe=self.describe, write_version=flags.write_version
            )
        else:
            remotes = []
            forward = address(internal, self.controls[0])
        runner = ControlRunner(self.coordinator, forward, flags.control_timeout, self.token)
        self._stack.push_async_callback(runner.close)
        for remote in remotes:
            self._stack.push_async_callback(remote.close)
        return runner

    def _grpc_server(
        self, names: list[str], options: list[tuple[str, Any]], checks: list[Any]
    ) -> Any:
        """A gRPC server with health and reflection (the caller adds the handlers)."""
        made = grpc.aio.server(interceptors=checks, options=options)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, made)
        reflection.enable_server_reflection(
            [*names, health.SERVICE_NAME, reflection.SERVICE_NAME], made
        )
        self.grpc_servers.append(made)
        return made

    async def _listen(self, runner: ControlRunner) -> None:
        """Bind every port: gRPC lookups (and --reuseport's shared port), control, the TCP lane,
        the original's faces, metrics (worker 0). Port 0 binds any free port; the bound one is
        what describe() and --port_file report."""
        flags, index = self.flags, self.index
        await self._listen_grpc(runner)
        limits = lane_limits(flags)
        bounds = Bounds(limits)  # one budget for the lane's and the faces' connections
        self.service.lane_stats = bounds.stats
        ssl_context = self.server_tls.context() if self.server_tls is not None else None
        if flags.tcp_lane:
            lane = Lane(self.service, limits, busy_poll_s=flags.busy_poll_us / 1e6, bounds=bounds)
            self.service.lane_port = await self._bound(
                lane.start(flags.host, self.plan.lanes[index], ssl_context)
            )
            self._stack.push_async_callback(lane.stop, flags.grace)
            self.lane = lane
        faces = await start_faces(  # the original's HTTP+JSON and baidu_std (--http_port, ...)
            flags, index, self.service, runner, self.token, max_message(flags), bounds, ssl_context
        )
        if faces is None:  # (logged)
            raise CannotListen
        self._stack.push_async_callback(faces.stop, flags.grace)
        self.faces = faces
        if index == 0 and flags.metrics_port >= 0 and self.coordinator is not None:
            from cube.metrics import serve_collector
            from cube.server.metrics import ServerCollector

            self.metrics = await self._bound(
                serve_collector(
                    flags.metrics_host,
                    flags.metrics_port,
                    ServerCollector,
                    self.coordinator.worker_states,
                )
            )

    async def _listen_grpc(self, runner: ControlRunner) -> None:
        """The gRPC servers, bound (started later, once health is published). Lookups on the
        data port; loads and switches on the control port (loopback by default, token-checked
        when one is set): whoever reaches the data port cannot change versions."""
        flags, index = self.flags, self.index
        lookup_options = [
            ("grpc.max_receive_message_length", max_message(flags)),
            ("grpc.max_send_message_length", -1),
        ]
        service_names = [FAST_SERVICE, DICT_SERVICE]
        server = self._grpc_server(service_names, [*GRPC_OPTIONS, *lookup_options], [])
        server.add_generic_rpc_handlers(self.service.handlers())
        # --reuseport: the shared --port is the one socket bound with SO_REUSEPORT, on a server
        # of its own (the worker's own ports stay exclusive); main made sure no other process
        # held it before the workers started (cube.listen).
        shared = None
        if flags.reuseport:
            shared_options = [("grpc.so_reuseport", 1), *lookup_options]
            shared = self._grpc_server(service_names, shared_options, [])
            shared.add_generic_rpc_handlers(self.service.handlers())
        checks = [TokenCheck(self.token, flags.control_host, flags.insecure)] if self.token else []
        control = self._grpc_server([CONTROL_SERVICE], [*GRPC_OPTIONS], checks)
        control.add_generic_rpc_handlers([control_handler(runner), worker_handler(self.local)])

        async def stop_grpc() -> None:
            await server.stop(flags.grace)
            if shared is not None:
                await shared.stop(flags.grace)
            await control.stop(CONTROL_GRACE_S)

        self._stack.push_async_callback(stop_grpc)
        # TLS: one certificate for every port (new handshakes get it renewed); gRPC credentials
        # of their own per port
        tls = self.server_tls = ServerTLS(self.tls) if self.tls.serves else None
        try:
            what = self.plan.lookup_flag
            credentials = tls.grpc_credentials() if tls is not None else None
            self.ports[index] = grpc_listen(
                server, flags.host, self.ports[index], what, credentials
            )
            self._listening.append(address(flags.host, self.ports[index]))
            if shared is not None:
                credentials = tls.grpc_credentials() if tls is not None else None
                grpc_listen(
                    shared, flags.host, flags.port, "--port, --reuseport", credentials, shared=True
                )
                self._listening.append(address(flags.host, flags.port))
            self.controls[index] = grpc_listen(
                control, flags.control_host, self.controls[index], "--control_port"
            )
        except ListenError as exc:
            log.error("%s", exc)
            raise CannotListen from None

    @staticmethod
    async def _bound(listening: Any) -> Any:
        """Await a listener's start; CannotListen (logged) for its ListenError."""
        try:
            return await listening
        except ListenError as exc:
            log.error("%s", exc)
            raise CannotListen from None

    async def _close_metrics(self) -> None:
        if self.metrics is not None:
            await self.metrics.close()

    def _warm_kernel(self) -> None:
        """The compiled lookup kernel loads from its cache (or compiles, where none matches)
        in the background, then is sealed: nothing compiles in a request. Until then the
        replica is not ready (UNAVAILABLE at once, health NOT_SERVING), so clients use the
        others."""
        loop = asyncio.get_running_loop()
        warming = kernel.warm_in_background(sealed=True)
        if not warming.done():
            self.slots.set_not_ready("the compiled lookup kernel is loading")

        def kernel_ready(done: Future[float]) -> None:
            if done.exception() is not None:
                log.error(
                    "lookup kernel: not compiled, lookups stay on numpy: %s", done.exception()
                )
            else:
                log.info("lookup kernel: %s, ready in %.2f s", kernel.describe(), done.result())
            loop.call_soon_threadsafe(self.slots.set_not_ready, "")

        warming.add_done_callback(kernel_ready)
        self.warming = warming

    async def _load_startup_version(self) -> None:
        """Load what VERSION names (or, restarted, what a peer serves; or the shard files of
        the original's local mode) and warm it. A version that cannot be loaded leaves the
        replica NOT_SERVING with the reason, until a control command loads one."""
        flags = self.flags
        loop = asyncio.get_running_loop()
        try:
            name = startup_version(self.dirs)
            if flags.worker_peer >= 0:  # restarted: serve what the other workers serve
                name = await self._peer_version() or name
            if name is None and flat_layout(self.dirs):
                version = await loop.run_in_executor(
                    self.executor, load_flat, self.dirs, self.options
                )
                await self._warm_and_install(version)
                log.info(
                    "serving the shard files in %s directly as version %s (the original's"
                    " local mode: no VERSION file)", self.data_dir, version.name,
                )  # fmt: skip
            elif name is None:
                self.slots.idle_reason = diagnose_data_dir(self.data_dir, self.dirs)
                waiting = self.slots.idle_reason.endswith(WAITING)  # for its agent: normal
                level = logging.INFO if flags.allow_empty or waiting else logging.WARNING
                log.log(level, "no start-up version: %s", self.slots.idle_reason)
            else:
                version = await loop.run_in_executor(
                    self.executor, load_base, self.dirs, name, self.options
                )
                await self._warm_and_install(version)
                log.info("serving %s (%s)", name, " > ".join(version.chain))
        except VersionError as exc:
            self.startup_error = exc.message
            self.local.last_error = f"startup: {exc.message}"
            self.slots.fail_startup(f"its start-up version could not be loaded: {exc.message}")
            log.error("start-up version not loaded; NOT_SERVING until one is: %s", exc.message)

    async def _warm_and_install(self, version: LoadedVersion) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self.executor, warm_version, version, self.flags.partitioner)
        self.slots.install(version)

    async def _peer_version(self) -> str | None:
        """The current version of worker --worker_peer (None when it does not say in time)."""
        peer = self.flags.worker_peer
        where = address(loopback(self.flags.control_host), self.controls[peer])
        remote = RemoteWorker(peer, self.controls[peer], where, 10.0, self.token)
        try:
            state = await remote.apply("state")
        except ControlError as exc:
            log.warning("worker %d did not say what it serves (%s): using VERSION", peer, exc)
            return None
        finally:
            await remote.close()
        return str(state.get("cur_version") or "") or None

    # serving state --------------------------------------------------------------------------

    async def _publish_health(self) -> None:
        """Health follows the serving state: NOT_SERVING while the replica cannot serve."""
        slots = self.slots
        while self._published != slots.serving:
            self._published = slots.serving
            status = (
                health_pb2.HealthCheckResponse.SERVING
                if slots.serving
                else health_pb2.HealthCheckResponse.NOT_SERVING
            )
            for name in ("", FAST_SERVICE, DICT_SERVICE):
                await self.health.set(name, status)
            if not slots.serving:  # still getting ready is no fault
                level = logging.INFO if slots.not_ready else logging.WARNING
                log.log(level, "NOT_SERVING: %s", slots.why_not_serving())
            else:
                log.info("SERVING %s", slots.current.name if slots.current else "(empty)")

    def _on_slots_changed(self) -> None:
        if self._published != self.slots.serving:
            update = asyncio.ensure_future(self._publish_health())
            self._health_updates.add(update)
            update.add_done_callback(self._health_updates.discard)

    def _files_changed(self) -> None:
        """A lease broke (SIGIO) or the periodic check runs: stop using changed files."""
        changed = self.watch.check()
        if not changed:
            return
        reasons = {f.fd: f"{f.path} {f.changed}" for f in changed}

        def reason_of(version: Any) -> str:
            return next(reasons[fd] for fd in version.fds if fd in reasons)

        for line in self.slots.drop_changed(set(reasons), reason_of):
            log.error("stopped serving %s; reload a good copy", line)
            self.local.last_error = line

    async def _check_files(self) -> None:  # leases signal at once; this covers polling
        while True:
            await asyncio.sleep(FILE_CHECK_S)
            self._files_changed()

    def describe(self) -> dict[str, Any]:
        """This server as status' detail_json shows it."""
        flags = self.flags
        return {
            "dict_name": flags.dict_name,
            "shard": flags.shard,
            "dict_split": flags.dict_split,
            "partitioner": flags.partitioner,
            "data_dir": str(self.data_dir.resolve()),
            "in_mem": flags.in_mem,
            "huge_pages": flags.huge_pages,
            "max_batch": flags.max_batch,
            "workers": flags.workers,
            "ports": self.ports,
            "control_ports": self.controls,
            "host": flags.host,
            "reuseport": flags.reuseport,
            "tcp_port": self.service.lane_port,
            "tls": bool(flags.tls_cert),
            "startup_error": self.startup_error,
            "kernel": kernel.describe(),
            "pid": os.getpid(),
        }

    def _log_listening(self) -> None:
        flags = self.flags
        lookups = list(self._listening)
        if self.lane is not None:
            lookups.append(f"{address(flags.host, self.service.lane_port)} (TCP lane)")
        lookups += self.faces.binds(lambda port: address(flags.host, port))
        metrics = ""
        if self.metrics is not None:
            where = address(flags.metrics_host, self.metrics.port)
            metrics = f", metrics on http://{where}/metrics"
        log.info(
            "listening on %s%s, control on %s%s (worker %d of %d, dict_split %d, version %r)",
            ", ".join(lookups),
            " over TLS" if self.tls.serves else "",
            address(flags.control_host, self.controls[self.index]),
            metrics,
            self.index,
            flags.workers,
            flags.dict_split,
            self.slots.current.name if self.slots.current else "",
        )

    # settle, stop ---------------------------------------------------------------------------

    async def settle(self, stop: asyncio.Event) -> None:
        """Wait until the worker has settled (ports answering, start-up version loaded, kernel
        ready), then write --port_file (worker 0), so that a tool that waits for the file finds
        it serving what it loaded. Returns early, writing nothing, when `stop` is set first."""
        if self.warming is not None:
            warmed: asyncio.Future[Any] = asyncio.wrap_future(self.warming)
            stopping: asyncio.Future[Any] = asyncio.ensure_future(stop.wait())
            await asyncio.wait({warmed, stopping}, return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            if warmed.done() and not warmed.cancelled():
                warmed.exception()  # a failed warm-up was logged by kernel_ready
        if self.flags.port_file and self.index == 0 and not stop.is_set():
            self._write_port_file()

    def _write_port_file(self) -> None:
        flags = self.flags
        one = flags.workers == 1
        report = {
            "pid": os.getpid(),
            "ports": self.ports,
            "control_ports": self.controls,
            "tcp_ports": [self.service.lane_port] if self.lane is not None and one else [],
            "metrics_port": self.metrics.port if self.metrics is not None else None,  # off
            **self.faces.report(one),
        }
        try:
            atomic_write_json(flags.port_file, report, indent=None)
        except OSError as exc:
            log.error("cannot write --port_file %s: %s", flags.port_file, exc)

    async def stop(self) -> None:
        """Stop taking new calls, let in-flight ones finish for up to --grace seconds, close
        everything start() opened (in reverse), and remove --port_file."""
        flags = self.flags
        self.service.draining = True  # for the metrics, while in-flight calls finish
        log.info("stopping: draining in-flight calls for up to %.1f s", flags.grace)
        await self.health.enter_graceful_shutdown()
        await self._stack.aclose()
        if flags.port_file and self.index == 0:  # the ports are no longer ours
            Path(flags.port_file).unlink(missing_ok=True)
        log.info("stopped")


async def serve(flags: ServerFlags, index: int, plan: PortPlan) -> int:
    """Run worker `index` until SIGTERM/SIGINT: 0 after a clean drain, EXIT_CANNOT_LISTEN when
    one of its ports cannot be listened on."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()  # set by SIGTERM/SIGINT, even during the start-up load
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    worker = Worker(flags, index, plan)
    try:
        await worker.start()
    except CannotListen:
        return EXIT_CANNOT_LISTEN
    try:
        await worker.settle(stop)
        await stop.wait()
    finally:
        await worker.stop()
    return 0
