"""Test helpers for cube-agent: shard tars, a cube-agent process, HTTP and FTP file servers, a
fake cube-server control service. Every server binds 127.0.0.1 on a free port and is stopped by
its owner; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import tarfile
import threading
import urllib.error
import urllib.request
from collections.abc import Coroutine, Iterable
from pathlib import Path
from typing import Any, SupportsInt, TypeVar

import grpc
import grpc.aio
import numpy as np
from aiohttp import web
from aiohttp.typedefs import Handler

from cube.index import build_table
from cube.pb import cube_pb2, cube_pb2_grpc
from cube.processes import log_tail, poll_until, spawn, stop_child
from cube.shard import DATA_FILE, INDEX_FILE, write_shard
from cube.values import ValueColumn

from .stubs import control_stub, dict_stub

REPO = Path(__file__).resolve().parents[2]
AGENT_BIN = REPO / ".venv" / "bin" / "cube-agent"
WAIT = 30.0
T = TypeVar("T")


# ------------------------------------------------------------------ shards and tars


def write_test_shard(directory: Path, keys: np.ndarray, width: int = 16, seed: int = 0) -> None:
    keys = np.asarray(keys, dtype=np.uint64)
    blob = np.random.default_rng(seed).integers(0, 256, len(keys) * width, dtype=np.uint8)
    write_shard(directory, build_table(keys), ValueColumn.fixed(blob, width), {"dict_name": "t"})


def shard_content(n_keys: int, width: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The keys and value rows (n_keys x width) of `make_shard_tar(..., seed)`."""
    keys = np.random.default_rng(seed).integers(1, 2**63, n_keys, dtype=np.uint64)
    blob = np.random.default_rng(seed).integers(0, 256, n_keys * width, dtype=np.uint8)
    return keys, blob.reshape(n_keys, width)


def make_shard_tar(tar_path: Path, n_keys: int = 1000, width: int = 16, seed: int = 0) -> str:
    """A builder-style tar (./index.cube, ./data.cube) plus `<tar>.md5`; returns the md5."""
    keys, _ = shard_content(n_keys, width, seed)
    shard_dir = tar_path.parent / f".shard-{tar_path.name}"
    write_test_shard(shard_dir, keys, width, seed)
    tar_path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tar_path, "w") as tar:
        for name in (INDEX_FILE, DATA_FILE):
            tar.add(shard_dir / name, arcname=f"./{name}")
    for name in (INDEX_FILE, DATA_FILE):
        (shard_dir / name).unlink()
    shard_dir.rmdir()
    return write_md5(tar_path)


def write_md5(path: Path) -> str:
    digest = hashlib.md5(path.read_bytes()).hexdigest()
    Path(f"{path}.md5").write_text(f"{digest}  {path.name}\n")
    return digest


def flip_byte(path: Path, offset: int) -> None:
    """Corrupt one byte of `path` in place (the bitwise complement), as a bad disk would."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        assert byte, f"{path} has no byte at offset {offset}"
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def make_evil_tar(tar_path: Path, good_tar: Path, evil: tarfile.TarInfo, data: bytes = b"") -> str:
    """A copy of a good shard tar with one extra hostile member; returns the md5."""
    with tarfile.open(good_tar) as src, tarfile.open(tar_path, "w") as dst:
        for member in src.getmembers():
            dst.addfile(member, src.extractfile(member))
        dst.addfile(evil, io.BytesIO(data) if data else None)
    return write_md5(tar_path)


# ------------------------------------------------------------------ a thread running a loop


class LoopThread:
    """An asyncio loop in a daemon thread, for servers the test process hosts."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = WAIT) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=WAIT)
        self.loop.close()


class HttpFileServer:
    """aiohttp static files (with Range support) from `root`; records each request's Range.
    `routes` adds handlers (path -> async handler) in front of the static files."""

    def __init__(self, root: Path, routes: dict[str, Handler] | None = None) -> None:
        self.root = root
        self.routes = dict(routes or {})
        self.requests: list[tuple[str, str]] = []  # (path, Range header)
        self.fail_next: dict[str, int] = {}  # path -> how many requests to answer 503
        self._loop = LoopThread()
        self.port = self._loop.run(self._start())
        self.url = f"http://127.0.0.1:{self.port}"

    async def _start(self) -> int:
        @web.middleware
        async def record(request: web.Request, handler: Handler) -> web.StreamResponse:
            self.requests.append((request.path, request.headers.get("Range", "")))
            if self.fail_next.get(request.path, 0) > 0:
                self.fail_next[request.path] -= 1
                return web.Response(status=503, text="try later")
            return await handler(request)

        app = web.Application(middlewares=[record])
        for path, handler in self.routes.items():
            app.router.add_get(path, handler)
        app.router.add_static("/", self.root)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port: int = self._runner.addresses[0][1]
        return port

    def ranges_for(self, name: str) -> list[str]:
        return [rng for path, rng in self.requests if path == f"/{name}"]

    def close(self) -> None:
        self._loop.run(self._runner.cleanup())
        self._loop.close()


class FtpFileServer:
    """A real FTP server (pyftpdlib), anonymous read-only on `root`; records REST offsets."""

    def __init__(self, root: Path) -> None:
        from pyftpdlib.authorizers import DummyAuthorizer
        from pyftpdlib.handlers import FTPHandler
        from pyftpdlib.servers import FTPServer

        self.rest_offsets: list[str] = []
        offsets = self.rest_offsets

        class Handler(FTPHandler):  # type: ignore[misc]  # pyftpdlib has no type information
            def ftp_REST(self, line: str) -> None:
                offsets.append(line)
                super().ftp_REST(line)

        authorizer = DummyAuthorizer()
        authorizer.add_anonymous(str(root))
        Handler.authorizer = authorizer
        Handler.log_prefix = "ftp"
        self.server = FTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.address[1]
        self.url = f"ftp://127.0.0.1:{self.port}"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"timeout": 0.2}, daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.server.close_all()
        self.thread.join(timeout=WAIT)


class LineServer:
    """A hostile TCP server on loopback: sends `greeting` on connect, then `reply` for every line
    it receives (e.g. an HTTP or FTP client pointed at some other service). Records connections."""

    def __init__(self, greeting: bytes, reply: bytes) -> None:
        self.greeting, self.reply = greeting, reply
        self.connections = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._talk, args=(conn,), daemon=True).start()

    def _talk(self, conn: socket.socket) -> None:
        conn.settimeout(WAIT)
        with conn, contextlib.suppress(OSError):
            if self.greeting:
                conn.sendall(self.greeting)
            for _line in conn.makefile("rb"):
                conn.sendall(self.reply)

    def close(self) -> None:
        self._stop.set()
        self.thread.join(timeout=WAIT)
        self.sock.close()


# ------------------------------------------------------------------ fake cube-server control


class FakeControl(cube_pb2_grpc.ControlServiceServicer):
    """The original's control semantics (cur + bg slots) over gRPC, without loading anything:
    a load checks the version dir has the shard files (and a CHAIN for a patch)."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.cur = ""
        self.bg = ""
        self.log: list[tuple[str, str]] = []

    async def cmd(
        self, request: cube_pb2.ControlRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> cube_pb2.ControlResponse:
        name = request.cmd
        target = request.version_path.lstrip("/") or request.version
        if name != "status":
            self.log.append((name, target))
        if name in ("bg_load_base", "bg_load_patch"):
            folder = self.data_dir / target
            if not (folder / INDEX_FILE).is_file():
                await context.abort(grpc.StatusCode.NOT_FOUND, f"no shard in {folder}")
            if name == "bg_load_patch" and not (folder / "CHAIN").is_file():
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "patch without CHAIN")
            self.bg = target
        elif name == "enable":
            if target == self.bg:
                self.cur, self.bg = self.bg, self.cur
            elif target != self.cur:
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION, f"{target} is neither cur nor bg"
                )
        elif name == "bg_unload":
            self.bg = ""
        elif name != "status":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown cmd {name!r}")
        return cube_pb2.ControlResponse(
            cur_version=self.cur, bg_version=self.bg, status=0, detail_json="{}"
        )


class FakeServer:
    """A grpc.aio server hosting FakeControl on a free loopback port (in its own loop)."""

    def __init__(self, data_dir: Path) -> None:
        self.control = FakeControl(data_dir)
        self._loop = LoopThread()
        self.port = self._loop.run(self._start())
        self.address = f"127.0.0.1:{self.port}"

    async def _start(self) -> int:
        self.server = grpc.aio.server()
        cube_pb2_grpc.add_ControlServiceServicer_to_server(self.control, self.server)  # type: ignore[no-untyped-call]  # generated, untyped
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return port

    def close(self) -> None:
        self._loop.run(self.server.stop(grace=None))
        self._loop.close()


# ------------------------------------------------------------------ a real cube-server


def server_commands(server: Any) -> list[str]:
    """Control commands a real cube-server (tests/procs.ServerProc) ran, from its log."""
    return re.findall(r"control (\w+): ", server.log())


def server_state(address: str) -> tuple[str, str]:
    """(cur_version, bg_version) of a cube-server, over its control service."""
    with grpc.insecure_channel(address) as channel:
        reply = control_stub(channel).cmd(cube_pb2.ControlRequest(cmd="status"), timeout=WAIT)
    return reply.cur_version, reply.bg_version


def seek(address: str, keys: Iterable[SupportsInt]) -> list[bytes | None]:
    """Values a cube-server returns for `keys` (None for a miss), via the original seek."""
    with grpc.insecure_channel(address) as channel:
        reply = dict_stub(channel).seek(
            cube_pb2.DictRequest(keys=[int(k) for k in keys]), timeout=WAIT
        )
    return [v.value if v.status == 0 else None for v in reply.values]


# ------------------------------------------------------------------ the agent process


class AgentProc:
    """A `cube-agent` subprocess on a free port; stopped by PID only."""

    def __init__(self, deploy: Path, server: str, *extra: str, token: str | None = None) -> None:
        self.deploy = deploy
        self.args = [
            str(AGENT_BIN), "-P", "0", "--deploy_path", str(deploy), "--server", server,
            "--download_backoff", "0.1", "--io_timeout", "5", "--control_timeout", "5",
            "--reload_timeout", "20", "--log_level", "DEBUG", *extra,
        ]  # fmt: skip
        self.env = {k: v for k, v in os.environ.items() if k != "CUBE_TOKEN"}
        if token is not None:
            self.env["CUBE_TOKEN"] = token
        self.token = token
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.metrics_url = ""  # with --metrics_port: its http://.../metrics
        self.ssl_context: ssl.SSLContext | None = None  # trusts the agent's --tls_cert

    def start(self) -> AgentProc:
        """Start the agent (cube.processes.spawn: its stdout and stderr in
        `agent-<deploy>.log`, appended) and wait for the line it announces its URL with (and
        its metrics URL, with --metrics_port)."""
        self.deploy.mkdir(parents=True, exist_ok=True)
        log = self.deploy.parent / f"agent-{self.deploy.name}.log"
        offset = log.stat().st_size if log.exists() else 0  # an earlier run's lines before it
        self.proc = proc = spawn(self.args, log, append=True, env=self.env, cwd=self.deploy.parent)
        wanted = (
            ["listening on", "metrics on"] if "--metrics_port" in self.args else ["listening on"]
        )
        found: dict[str, str] = {}

        def announced() -> bool:
            with open(log, "rb") as f:
                f.seek(offset)
                text = f.read().decode(errors="replace")
            for what in wanted:
                match = re.search(rf"cube-agent {what} (\S+)$", text, re.MULTILINE)
                if match:
                    found[what] = match.group(1)
            return len(found) == len(wanted)

        def running() -> None:
            if proc.poll() is not None:
                raise RuntimeError(f"cube-agent exited ({proc.returncode}):\n{log_tail(log)}")

        if not poll_until(announced, WAIT, 0.02, check=running):
            self.stop()
            raise RuntimeError(f"cube-agent did not start within {WAIT:g} s:\n{log_tail(log)}")
        self.url, self.metrics_url = found["listening on"], found.get("metrics on", "")
        return self

    def kill9(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=WAIT)

    def stop(self) -> None:
        if self.proc is not None:
            stop_child(self.proc, timeout=15, kill_timeout=WAIT)

    # ---- HTTP

    def call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        token: str | None = "default",
    ) -> tuple[int, dict[str, Any]]:
        token = self.token if token == "default" else token
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data=data, method=method)
        request.add_header("Content-Type", "application/json")
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(request, timeout=WAIT, context=self.ssl_context) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def call_raw(self, path: str, data: bytes) -> tuple[int, dict[str, Any]]:
        """POST raw bytes (not necessarily JSON); returns (HTTP status, parsed envelope)."""
        request = urllib.request.Request(self.url + path, data=data, method="POST")
        request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=WAIT) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def cmd(self, **body: Any) -> dict[str, Any]:
        """POST /agent/cmd expecting success "0"; returns the task."""
        status, reply = self.call("POST", "/agent/cmd", body)
        assert status == 200 and reply["success"] == "0", reply
        task: dict[str, Any] = reply["data"]
        return task

    def status(self) -> dict[str, Any]:
        status, reply = self.call("GET", "/agent/status")
        assert status == 200 and reply["success"] == "0", reply
        state: dict[str, Any] = reply["data"]
        return state

    def wait_task(self, command: str, version: str, timeout: float = WAIT) -> dict[str, Any]:
        """Poll `task` until it is no longer running."""
        task: dict[str, Any] = {}

        def ended() -> bool:
            task.update(self.cmd(command="task", version=version, task_command=command))
            return bool(task["state"] != "running")

        if not poll_until(ended, timeout, 0.05):
            raise AssertionError(f"{command} {version} still running: {task}")
        return task

    def run(self, command: str, version: str, **body: Any) -> dict[str, Any]:
        """Submit a command and wait for its end."""
        self.cmd(command=command, version=version, **body)
        return self.wait_task(command, version)
