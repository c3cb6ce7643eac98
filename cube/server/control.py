"""Control plane: rec.mcube.ControlService.cmd with the original's commands, applied to every
worker process consistently.

The control port is its own (--control_port, bound to --control_host, loopback by default,
token-checked by `TokenCheck` when --control_token is set): whoever reaches the lookup port
cannot load, switch or unload versions. Worker 0 coordinates: it runs each command on itself
and on the other workers (over an internal raw-bytes gRPC service on their control ports,
`cube.internal.Worker/Apply`, JSON in and out) and answers only after all succeeded. Loads are
two-phase: every worker loads into a staged slot, then all commit (staged -> background); if
any worker fails, the others drop what they staged, so no worker changes. A switch that fails
on one worker is switched back on the others. Other workers forward `cmd` to worker 0.

Commands (version_path "/<dir>" or "<dir>", a directory directly under the data dir):
- status: cur_version, bg_version, status (0 RUNNING, 1 LOADING), detail_json.
- bg_load_base: load a version from disk into the background slot (a delta: its whole chain).
- bg_load_patch: layer a delta over the current version's shards into the background slot.
- enable (version): ok if current; switch if background; else FAILED_PRECONDITION.
- bg_switch: swap current and background (again = undo).
- bg_unload: drop the background version (e.g. the previous one after a switch).
- reload_base / reload_patch: load + switch + unload in one command.
A command while another runs is refused with ABORTED (status is always answered).
Enabling never rewrites VERSION (the agent owns it) unless --write_version is set.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

import grpc

from cube.pb import cube_pb2
from cube.security import (
    AUTH_METADATA,
    TokenLike,
    bearer_metadata,
    bearer_token,
    control_refusal,
)
from cube.server import memory
from cube.server.service import SeekService, warm_version
from cube.server.versions import (
    LoadedVersion,
    LoadOptions,
    VersionError,
    VersionSlots,
    load_base,
    load_patch,
    settle_memory,
    version_name_from_path,
    write_version_file,
)

log = logging.getLogger("cube.server")
SETTLE_WAIT = 10.0  # seconds a dropped version may take to be released (`_settle`)

CONTROL_SERVICE = "rec.mcube.ControlService"
WORKER_SERVICE = "cube.internal.Worker"
WORKER_APPLY = f"/{WORKER_SERVICE}/Apply"
CONTROL_CMD = f"/{CONTROL_SERVICE}/cmd"
RUNNING, LOADING = 0, 1
COMMANDS = (
    "status",
    "bg_load_base",
    "bg_load_patch",
    "enable",
    "bg_switch",
    "bg_unload",
    "reload_base",
    "reload_patch",
)


class ControlError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    @classmethod
    def from_version_error(cls, exc: VersionError, where: str = "") -> ControlError:
        return cls(grpc.StatusCode[exc.code], f"{where}{exc.message}")


def _name(version: LoadedVersion | None) -> str:
    return version.name if version is not None else ""


class LocalWorker:
    """The version operations of this process (one participant of every command)."""

    def __init__(
        self,
        index: int,
        port: int,
        slots: VersionSlots,
        data_dir: Path,
        dirs: list[Path],
        options: LoadOptions,
        executor: Executor,
        service: SeekService,
    ) -> None:
        self.index = index
        self.port = port
        self.slots = slots
        self.data_dir = data_dir
        self.dirs = dirs
        self.options = options
        self.executor = executor
        self.service = service
        self.loading: str | None = None
        self.last_error = ""
        self._tasks: set[asyncio.Task[None]] = set()  # `_settle`s in flight (referenced)

    async def apply(self, op: str, mode: str = "", name: str = "") -> dict[str, Any]:
        """One step of a command; raises VersionError."""
        if op == "prepare":
            await self.prepare(mode, name)
        elif op == "commit":
            old = self.slots.background
            self.slots.commit()
            self._settle(old)
        elif op == "abort":
            self.slots.abort()
        elif op == "switch":
            self.slots.switch()
            self._settle(None)
        elif op == "unload":
            old = self.slots.background
            self.slots.unload_background()
            self._settle(old)
        elif op != "state":
            raise VersionError("INVALID_ARGUMENT", f"unknown worker op {op!r}")
        return self.state()

    def _settle(self, old: LoadedVersion | None) -> None:
        """After the slots change: once `old` (dropped, if any) is unmapped, let the current
        version take the memory --in_mem wants for it (`versions.settle_memory`); in the
        background, on the loader thread."""
        current = self.slots.current
        if current is None or not current.memory_note:
            return

        async def when_gone() -> None:
            deadline = time.monotonic() + SETTLE_WAIT
            while old is not None and not old.closed and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # requests that still hold it release it soon
            if self.slots.current is current:
                background = self.slots.background
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(self.executor, settle_memory, current, background)

        task = asyncio.get_running_loop().create_task(when_gone())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def prepare(self, mode: str, name: str) -> None:
        loop = asyncio.get_running_loop()
        self.loading = name
        try:
            if mode == "patch":
                current = self.slots.current
                if current is not None:
                    current.acquire()  # its shards are reused; keep them mapped meanwhile
                try:
                    version = await loop.run_in_executor(
                        self.executor, load_patch, self.dirs, name, current, self.options
                    )
                finally:
                    if current is not None:
                        current.release()
            else:
                version = await loop.run_in_executor(
                    self.executor, load_base, self.dirs, name, self.options
                )
            try:
                await loop.run_in_executor(
                    self.executor, warm_version, version, self.service.partitioner
                )
            except Exception as exc:  # a lookup that fails here would fail every request
                reason = f"its warm-up lookup failed: {exc}"
                version.fail(reason)
                raise VersionError("DATA_LOSS", f"{name}: {reason}") from exc
        except VersionError as exc:
            self.last_error = exc.message
            raise
        finally:
            self.loading = None
        watch = self.options.watch
        changed = watch.changed(version.fds) if watch is not None else ""
        if changed:  # its files changed after they were checked, before it could serve
            version.fail(changed)
            self.last_error = f"refused {name}: {changed}"
            raise VersionError("DATA_LOSS", self.last_error)
        self.slots.stage(version)
        log.info(
            "worker %d loaded %s (%s, %.3f s): %s",
            self.index,
            name,
            mode,
            version.load_seconds,
            " > ".join(version.chain),
        )

    def state(self) -> dict[str, Any]:
        slots = self.slots
        return {
            "worker": self.index,
            "port": self.port,
            "cur_version": _name(slots.current),
            "bg_version": _name(slots.background),
            "staged_version": _name(slots.staged),
            "loading": self.loading,
            "serving": slots.serving,
            "not_serving_reason": "" if slots.serving else slots.why_not_serving(),
            "not_ready": slots.not_ready,  # getting ready (not a fault): serving soon
            "requests": self.service.counters.as_dict(),
            "lane": self.service.lane_stats(),
            "metrics": self.service.counters.snapshot(),
            "draining": self.service.draining,
            "major_faults": memory.major_faults(),
            "versions": {
                slot: version.describe()
                for slot, version in (("current", slots.current), ("background", slots.background))
                if version is not None
            },
        }


class RemoteWorker:
    """Another worker process, reached on its control port over loopback gRPC."""

    def __init__(
        self, index: int, port: int, address: str, timeout: float, token: TokenLike = ""
    ) -> None:
        self.index = index
        self.port = port
        self.address = address
        self.timeout = timeout
        self.token = token  # a token file's is read again when it changes: per call
        self._channel: grpc.aio.Channel | None = None

    # A peer on loopback that is not up yet (starting, or restarted by the supervisor) is up
    # within a second: retry connecting that soon, not after gRPC's default backoff (1 s
    # growing to 120 s, during which every call failed with the first refusal).
    CHANNEL_OPTIONS = (
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    )

    def _call(self) -> grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]:
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(self.address, options=self.CHANNEL_OPTIONS)
        return self._channel.unary_unary(WORKER_APPLY)

    async def apply(
        self, op: str, mode: str = "", name: str = "", timeout: float | None = None
    ) -> dict[str, Any]:
        request = json.dumps({"op": op, "mode": mode, "name": name}).encode()
        try:
            raw = await self._call()(  # waits for a peer still starting, within the timeout
                request,
                timeout=timeout or self.timeout,
                metadata=bearer_metadata(self.token),
                wait_for_ready=True,
            )
        except grpc.aio.AioRpcError as exc:
            raise ControlError(
                exc.code(), f"worker {self.index} ({self.address}): {exc.details()}"
            ) from exc
        reply: dict[str, Any] = json.loads(raw)
        return reply

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()


class Coordinator:
    """Runs control commands over every worker (self first)."""

    def __init__(
        self,
        local: LocalWorker,
        remotes: list[RemoteWorker],
        *,
        describe: Callable[[], dict[str, Any]],
        write_version: bool = False,
    ) -> None:
        self.local = local
        self.remotes = remotes
        self.describe = describe
        self.write_version = write_version
        self.busy: str | None = None
        self.busy_since = 0.0
        self.last_error = ""

    # participants -----------------------------------------------------------------------

    async def _local(self, op: str, mode: str = "", name: str = "") -> dict[str, Any]:
        try:
            return await self.local.apply(op, mode, name)
        except VersionError as exc:
            where = "worker 0: " if self.remotes else ""
            raise ControlError.from_version_error(exc, where) from exc

    async def _everywhere(self, op: str, mode: str = "", name: str = "") -> list[Any]:
        calls = [self._local(op, mode, name), *(r.apply(op, mode, name) for r in self.remotes)]
        results: list[Any] = await asyncio.gather(*calls, return_exceptions=True)
        return results

    @staticmethod
    def _first_error(results: list[Any]) -> BaseException | None:
        return next((r for r in results if isinstance(r, BaseException)), None)

    async def _undo(self, op: str, results: list[Any]) -> None:
        """Apply `op` to the participants whose step succeeded (best effort, logged)."""
        participants = [self._local, *(r.apply for r in self.remotes)]
        undo = [p(op) for p, r in zip(participants, results, strict=True) if isinstance(r, dict)]
        for result in await asyncio.gather(*undo, return_exceptions=True):
            if isinstance(result, BaseException):
                log.error("rollback step %s failed: %s", op, result)

    # steps ------------------------------------------------------------------------------

    async def load(self, mode: str, name: str) -> None:
        results = await self._everywhere("prepare", mode, name)
        error = self._first_error(results)
        if error is not None:
            await self._undo("abort", results)
            raise error
        error = self._first_error(await self._everywhere("commit"))
        if error is not None:
            raise error

    async def switch(self) -> None:
        if self.local.slots.background is None:
            raise ControlError(
                grpc.StatusCode.FAILED_PRECONDITION, "no background version to switch to"
            )
        results = await self._everywhere("switch")
        error = self._first_error(results)
        if error is not None:
            await self._undo("switch", results)
            raise error
        if self.write_version:
            name = _name(self.local.slots.current)
            for split_dir in self.local.dirs:
                write_version_file(split_dir, name)

    async def unload(self) -> None:
        error = self._first_error(await self._everywhere("unload"))
        if error is not None:
            raise error

    # commands ---------------------------------------------------------------------------

    async def command(self, request: cube_pb2.ControlRequest) -> cube_pb2.ControlResponse:
        cmd = request.cmd
        if cmd not in COMMANDS:
            raise ControlError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"unknown control cmd {cmd!r}; expected one of {', '.join(COMMANDS)}",
            )
        if cmd == "status":
            return await self.status()
        if self.busy is not None:
            raise ControlError(
                grpc.StatusCode.ABORTED,
                f"control command {cmd!r} refused: {self.busy!r} is in progress"
                f" (for {time.monotonic() - self.busy_since:.1f} s); retry when it ends",
            )
        self.busy, self.busy_since = cmd, time.monotonic()
        started = time.monotonic()
        try:
            message = await self._run(cmd, request)
        except ControlError as exc:
            self.last_error = f"{cmd}: {exc.message}"
            log.error("control %s failed: %s", cmd, exc.message)
            raise
        finally:
            self.busy = None
        log.info("control %s: %s (%.3f s)", cmd, message, time.monotonic() - started)
        response = await self.status()
        response.message = message
        return response

    def _version_name(self, request: cube_pb2.ControlRequest, path: str | None = None) -> str:
        try:
            path = request.version_path if path is None else path
            return version_name_from_path(path, self.local.data_dir)
        except VersionError as exc:
            raise ControlError.from_version_error(exc, f"{request.cmd}: ") from exc

    async def _run(self, cmd: str, request: cube_pb2.ControlRequest) -> str:
        slots = self.local.slots
        if cmd in ("bg_load_base", "bg_load_patch", "reload_base", "reload_patch"):
            name = self._version_name(request)
            mode = "patch" if cmd.endswith("patch") else "base"
            await self.load(mode, name)
            if cmd.startswith("reload"):
                await self.switch()
                await self.unload()
                return f"serving {name}"
            return f"{name} loaded in the background"
        if cmd == "enable":
            if not (request.version or request.version_path):
                raise ControlError(grpc.StatusCode.INVALID_ARGUMENT, "enable needs a version")
            name = self._version_name(request, request.version or request.version_path)
            if name == _name(slots.current):
                return f"{name} is already current"
            if name == _name(slots.background):
                await self.switch()
                return f"switched to {name}"
            raise ControlError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"enable {name!r}: it is neither current ({_name(slots.current)!r}) nor loaded"
                f" in the background ({_name(slots.background)!r}); load it first",
            )
        if cmd == "bg_switch":
            await self.switch()
            return f"switched to {_name(slots.current)}"
        if cmd == "bg_unload":
            name = _name(slots.background)
            await self.unload()
            return f"unloaded {name}" if name else "no background version"
        raise ControlError(grpc.StatusCode.INVALID_ARGUMENT, f"unhandled cmd {cmd!r}")

    async def worker_states(self) -> list[dict[str, Any]]:
        """Every worker's state (LocalWorker.state), this one's first; a worker that does not
        answer is {"worker", "port", "error"}. For status and the metrics endpoint."""
        workers = [self.local.state()]
        for remote in self.remotes:
            try:
                workers.append(await remote.apply("state", timeout=2.0))
            except ControlError as exc:
                workers.append({"worker": remote.index, "port": remote.port, "error": exc.message})
        return workers

    @property
    def loading(self) -> bool:
        return self.busy is not None and ("load" in self.busy or self.local.loading is not None)

    async def status(self) -> cube_pb2.ControlResponse:
        slots = self.local.slots
        loading = self.loading
        workers = await self.worker_states()
        totals: dict[str, int] = {}
        for worker in workers:
            for key, value in worker.get("requests", {}).items():
                totals[key] = totals.get(key, 0) + value
        current = slots.current.describe() if slots.current is not None else None
        background = slots.background.describe() if slots.background is not None else None
        detail = {
            **self.describe(),
            "status": "LOADING" if loading else "RUNNING",
            "busy": self.busy,
            "cur_version": _name(slots.current),
            "bg_version": _name(slots.background),
            "previous_version": _name(slots.background) if slots.background_was_current else "",
            "record_count": current["record_count"] if current else 0,
            "data_size": current["data_bytes"] if current else 0,
            "current": current,
            "background": background,
            "splits": _split_versions(slots),
            "worker_states": workers,
            "requests": totals,
            "serving": slots.serving,
            "not_serving_reason": "" if slots.serving else slots.why_not_serving(),
            "last_error": self.last_error or self.local.last_error,
        }
        return cube_pb2.ControlResponse(
            cur_version=_name(slots.current),
            bg_version=_name(slots.background),
            status=LOADING if loading else RUNNING,
            detail_json=json.dumps(detail, sort_keys=True),
        )


def _split_versions(slots: VersionSlots) -> list[dict[str, Any]]:
    splits = []
    count = (
        max(len(v.splits) for v in (slots.current, slots.background) if v)
        if (slots.current or slots.background)
        else 0
    )
    for i in range(count):
        entry: dict[str, Any] = {"split": i}
        for label, version in (("cur", slots.current), ("bg", slots.background)):
            if version is not None:
                entry[f"{label}_version"] = version.name
                entry[f"{label}_chain"] = version.splits[i].chain
        splits.append(entry)
    return splits


# ---------------------------------------------------------------------------------------------
# gRPC handlers


class TokenCheck(grpc.aio.ServerInterceptor):
    """The control port's guard: every call but health and reflection must carry
    `authorization: Bearer <token>` (compared in constant time), else UNAUTHENTICATED
    (`cube.security.control_refusal`, the rule of every transport that carries control)."""

    OPEN = ("/grpc.health.v1.Health/", "/grpc.reflection.")

    def __init__(self, token: TokenLike, host: str = "127.0.0.1", insecure: bool = False) -> None:
        self.token = token
        self.host = host
        self.insecure = insecure

        async def deny(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "the control port needs 'authorization: Bearer <token>' (cube-server"
                " --control_token; cube-agent --server_token)",
            )
            raise AssertionError("abort raises")  # pragma: no cover

        self._deny: grpc.RpcMethodHandler[bytes, bytes] = grpc.unary_unary_rpc_method_handler(deny)

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        if details.method.startswith(self.OPEN):
            return await continuation(details)
        header = dict(details.invocation_metadata or ()).get(AUTH_METADATA)
        given = bearer_token(header if isinstance(header, str) else None)  # bytes: -bin keys only
        if control_refusal(self.host, self.token, self.insecure, given) is None:
            return await continuation(details)
        return self._deny


class ControlRunner:
    """Runs ControlService.cmd for any transport (gRPC, HTTP+JSON, baidu_std): worker 0 runs
    it, other workers forward it to worker 0's control port. Raises ControlError."""

    def __init__(
        self,
        coordinator: Coordinator | None,
        forward_address: str | None,
        timeout: float,
        token: TokenLike = "",
    ) -> None:
        self.coordinator = coordinator
        self.forward_address = forward_address
        self.timeout = timeout
        self.token = token  # a token file's is read again when it changes: per call
        self._channel: grpc.aio.Channel | None = None
        self._running: set[asyncio.Future[cube_pb2.ControlResponse]] = set()

    async def forward(self, raw: bytes) -> bytes:
        """ControlRequest bytes -> ControlResponse bytes, from worker 0."""
        if self._channel is None:
            assert self.forward_address is not None
            self._channel = grpc.aio.insecure_channel(self.forward_address)
        call: Any = self._channel.unary_unary(CONTROL_CMD)
        try:
            metadata = bearer_metadata(self.token)
            return bytes(await call(raw, timeout=self.timeout, metadata=metadata))
        except grpc.aio.AioRpcError as exc:
            raise ControlError(exc.code(), exc.details() or "") from exc

    async def run(self, request: cube_pb2.ControlRequest) -> cube_pb2.ControlResponse:
        if self.coordinator is None:
            raw = await self.forward(request.SerializeToString())
            return cube_pb2.ControlResponse.FromString(raw)
        # A command runs to its end even if the caller goes away (deadline, disconnect): a
        # load half done on some workers would leave them inconsistent. Callers poll status.
        task = asyncio.ensure_future(self.coordinator.command(request))
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        return await asyncio.shield(task)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()


def control_handler(runner: ControlRunner) -> grpc.GenericRpcHandler:
    """ControlService.cmd through `runner` (the worker's, shared with the original's faces):
    run it (worker 0) or forward it to worker 0 (other workers)."""

    async def cmd(raw: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        try:
            if runner.coordinator is None:
                return await runner.forward(raw)
            try:
                request = cube_pb2.ControlRequest.FromString(raw)
            except Exception as exc:
                raise ControlError(
                    grpc.StatusCode.INVALID_ARGUMENT, f"ControlRequest does not parse: {exc}"
                ) from exc
            response = await runner.run(request)
        except ControlError as exc:
            await context.abort(exc.code, exc.message)
        return response.SerializeToString()

    return grpc.method_handlers_generic_handler(
        CONTROL_SERVICE, {"cmd": grpc.unary_unary_rpc_method_handler(cmd)}
    )


def worker_handler(local: LocalWorker) -> grpc.GenericRpcHandler:
    """cube.internal.Worker/Apply: one step of a command, sent by worker 0."""

    async def apply(raw: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        try:
            request = json.loads(raw)
            state = await local.apply(
                str(request["op"]), str(request.get("mode", "")), str(request.get("name", ""))
            )
        except VersionError as exc:
            await context.abort(grpc.StatusCode[exc.code], exc.message)
        except (ValueError, KeyError, TypeError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad worker request: {exc}")
        return json.dumps(state).encode()

    return grpc.method_handlers_generic_handler(
        WORKER_SERVICE, {"Apply": grpc.unary_unary_rpc_method_handler(apply)}
    )
