"""Test helpers for s3:// and webhdfs:// sources: moto's S3 server as a process on a free
loopback port (started, waited for, stopped by PID), the AWS environment that points botocore
at it (and at nothing of the machine's own configuration), and a fake WebHDFS namenode (the
REST calls fsspec's client makes, served from a local directory) in a thread of the test.

    with MotoServer(tmp / "moto.log") as moto, aws_environment(moto.url, tmp):
        ...  # s3fs, cube-transfer, cube-agent and cube-builder all talk to moto
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from cube.processes import log_tail, poll_until, spawn, stop_child

from .agent_helpers import LoopThread

ACCESS_KEY = "AKIATESTCUBE0000"
SECRET_KEY = "cube-test-secret-Zq81xVw"  # a test's messages must never contain it
_RUNNING = re.compile(r"Running on http://127\.0\.0\.1:(\d+)")


class MotoServer:
    """`python -m moto.server` on 127.0.0.1, port 0 (the bound port read from its log). With
    `auth`, every request is authenticated (INITIAL_NO_AUTH_ACTION_COUNT=0): keys moto does
    not know are refused, as AWS refuses bad credentials."""

    def __init__(self, log_path: Path, auth: bool = False, timeout: float = 30.0) -> None:
        self.log_path = log_path
        env = dict(os.environ)
        if auth:
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"
        argv = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "0"]
        self.process = spawn(argv, log_path, env=env)
        self.port = 0
        try:
            if not poll_until(self._bound, timeout, 0.05, check=self._running):
                raise TimeoutError(f"moto did not start in {timeout} s:\n{log_tail(log_path)}")
        except BaseException:
            self.stop()
            raise
        self.url = f"http://127.0.0.1:{self.port}"

    def _bound(self) -> bool:
        match = _RUNNING.search(self.log_path.read_text(errors="replace"))
        if match:
            self.port = int(match.group(1))
        return bool(match)

    def _running(self) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(f"moto exited with {self.process.returncode}:\n"
                               f"{log_tail(self.log_path)}")  # fmt: skip

    def stop(self) -> None:
        stop_child(self.process, timeout=10)

    def __enter__(self) -> MotoServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def aws_settings(endpoint: str, tmp: Path) -> dict[str, str]:
    """The environment botocore reads, pointed at `endpoint` with test credentials, and away
    from the machine's own AWS configuration and instance metadata."""
    return {
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_CONFIG_FILE": str(tmp / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp / "no-aws-credentials"),
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_MAX_ATTEMPTS": "2",
    }


@contextlib.contextmanager
def aws_environment(endpoint: str, tmp: Path, **changes: str) -> Iterator[dict[str, str]]:
    """os.environ with `aws_settings` (and `changes`) for the block; restored after. Child
    processes started inside inherit it."""
    settings = {**aws_settings(endpoint, tmp), **changes}
    saved = {key: os.environ.get(key) for key in [*settings, "AWS_PROFILE", "AWS_SESSION_TOKEN"]}
    os.environ.pop("AWS_PROFILE", None)
    os.environ.pop("AWS_SESSION_TOKEN", None)
    os.environ.update(settings)
    try:
        yield settings
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class ObjectStore(Protocol):
    """The calls tests make on an s3fs filesystem (s3fs has no annotations): paths are
    "bucket/key", without s3://."""

    def exists(self, path: str) -> bool: ...
    def mkdir(self, path: str) -> None: ...
    def pipe_file(self, path: str, value: bytes) -> None: ...
    def put_file(self, lpath: str, rpath: str) -> None: ...
    def put(self, lpath: str, rpath: str, recursive: bool = False) -> None: ...
    def find(self, path: str) -> list[str]: ...


def s3_filesystem() -> ObjectStore:
    """An s3fs filesystem of the current environment (a test's own, to put and read objects)."""
    import s3fs

    store: ObjectStore = s3fs.S3FileSystem(skip_instance_cache=True)
    return store


@dataclass(frozen=True)
class S3Bucket:
    """A module's view of the session's moto server: a scratch directory (`root`), the
    filesystem to put objects with and the endpoint's URL."""

    root: Path
    fs: ObjectStore
    url: str


class SilentEndpoint:
    """A TCP port on 127.0.0.1 that accepts connections and never answers (a stalled S3
    endpoint or namenode). With `drip`, it answers each connection's first read with those
    bytes, one every `every` seconds (a server slow enough that no read ever times out)."""

    def __init__(self, drip: bytes = b"", every: float = 0.2) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.drip = drip
        self.every = every
        self.held: list[socket.socket] = []
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                sock = self.listener.accept()[0]
                self.held.append(sock)
                if self.drip:
                    threading.Thread(target=self._drip, args=(sock,), daemon=True).start()

    def _drip(self, sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            sock.recv(65536)
            for byte in self.drip:  # bounded: the bytes given, then silence
                if self._closed.wait(self.every):
                    return
                sock.sendall(bytes([byte]))

    def close(self) -> None:
        self._closed.set()
        self.listener.close()
        for sock in list(self.held):
            sock.close()

    def __enter__(self) -> SilentEndpoint:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# a fake WebHDFS namenode


class FakeNamenode:
    """The WebHDFS REST calls fsspec's client makes (GETFILESTATUS, LISTSTATUS, OPEN with
    offset and length), answered from the local directory `root`, on a free loopback port.
    A path under `root/denied` answers AccessControlException with `secret` in its message
    (a client must not repeat it). Records the `user.name` of each request."""

    def __init__(self, root: Path, secret: str = "namenode-internal-detail") -> None:
        self.root = root
        self.secret = secret
        self.users: list[str] = []
        self._loop = LoopThread()
        self.port = self._loop.run(self._start())
        self.url = f"webhdfs://127.0.0.1:{self.port}"

    def _error(self, status: int, exception: str, message: str) -> web.Response:
        body = {"RemoteException": {"exception": exception, "message": message}}
        return web.json_response(body, status=status)

    @staticmethod
    def _status(path: Path, suffix: str) -> dict[str, Any]:
        kind = "DIRECTORY" if path.is_dir() else "FILE"
        size = 0 if path.is_dir() else path.stat().st_size
        return {"pathSuffix": suffix, "type": kind, "length": size, "modificationTime": 0}

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.users.append(request.query.get("user.name", ""))
        relative = request.match_info["path"].strip("/")
        local = self.root / relative
        if relative.split("/")[0] == "denied":
            return self._error(403, "AccessControlException", f"denied: {self.secret}")
        if not local.exists():
            return self._error(404, "FileNotFoundException", f"no {relative}: {self.secret}")
        op = request.query.get("op", "")
        if op == "GETFILESTATUS":
            return web.json_response({"FileStatus": self._status(local, "")})
        if op == "LISTSTATUS":
            entries = sorted(local.iterdir()) if local.is_dir() else [local]
            statuses = [self._status(e, e.name if local.is_dir() else "") for e in entries]
            return web.json_response({"FileStatuses": {"FileStatus": statuses}})
        if op == "OPEN":
            data = local.read_bytes()
            offset = int(request.query.get("offset", 0))
            length = int(request.query.get("length", len(data) - offset))
            return web.Response(body=data[offset : offset + length])
        return self._error(400, "UnsupportedOperationException", f"{op}: {self.secret}")

    async def _start(self) -> int:
        app = web.Application()
        app.router.add_route("*", "/webhdfs/v1/{path:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        return int(self._runner.addresses[0][1])

    def close(self) -> None:
        self._loop.run(self._runner.cleanup())
        self._loop.close()
