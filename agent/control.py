"""Client of the cube-server's control service (gRPC `rec.mcube.ControlService.cmd`).

The only way the agent talks to its server: no shell, no HTTP. gRPC failures become two kinds of
errors with messages that say what to do: the server is unreachable (the transfer retries later),
or it refused the command (the message carries the gRPC code and the server's detail).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio

from cube.pb import cube_pb2, cube_pb2_grpc
from cube.protocol import SERVER_UNREACHABLE
from cube.security import TokenLike, bearer_metadata

STATUS_RUNNING = 0
STATUS_LOADING = 1
_UNREACHABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


class ServerError(Exception):
    """The cube-server refused or failed a command. `code` is the gRPC status (None when the
    agent itself judged the answer wrong), `details` the server's own words; callers decide on
    the code (e.g. DATA_LOSS: the version's files are corrupt), never on the message text."""

    def __init__(
        self, message: str, code: grpc.StatusCode | None = None, details: str = ""
    ) -> None:
        super().__init__(message)
        self.code = code
        self.details = details


class ServerUnreachable(ServerError):
    """No answer from the cube-server's control service."""

    reason = SERVER_UNREACHABLE  # a task failed by it says so (the transfer waits, see drive)


@dataclass
class ServerStatus:
    cur_version: str = ""
    bg_version: str = ""
    status: int = STATUS_RUNNING
    message: str = ""
    detail: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_pb(cls, resp: cube_pb2.ControlResponse) -> ServerStatus:
        try:
            detail = json.loads(resp.detail_json) if resp.detail_json else {}
        except ValueError:
            detail = {"detail_json": resp.detail_json}
        return cls(resp.cur_version, resp.bg_version, resp.status, resp.message, detail)

    def holds(self, version: str) -> bool:
        return version in (self.cur_version, self.bg_version)

    def to_json(self) -> dict[str, Any]:
        return {
            "cur_version": self.cur_version,
            "bg_version": self.bg_version,
            "status": self.status,
            "message": self.message,
            "detail": self.detail,
        }


class ServerControl:
    """One channel to the server's control port, opened lazily and reused."""

    def __init__(self, address: str, timeout: float = 10.0, token: TokenLike = "") -> None:
        self.address = address
        self.timeout = timeout
        self.token = token  # a Token file's is read again when it changes: per call
        self._channel: grpc.aio.Channel | None = None
        self._stub: cube_pb2_grpc.ControlServiceStub | None = None

    def _get_stub(self) -> cube_pb2_grpc.ControlServiceStub:
        if self._stub is None:
            self._channel = grpc.aio.insecure_channel(self.address)
            # protoc writes the gRPC stubs untyped (cube/pb has .pyi files for the messages only)
            self._stub = cube_pb2_grpc.ControlServiceStub(self._channel)  # type: ignore[no-untyped-call]
        return self._stub

    async def cmd(
        self, cmd: str, *, version_path: str = "", version: str = "", timeout: float | None = None
    ) -> ServerStatus:
        request = cube_pb2.ControlRequest(cmd=cmd)
        if version_path:
            request.version_path = version_path
        if version:
            request.version = version
        what = f"{cmd} {version or version_path}".strip()
        try:
            resp = await self._get_stub().cmd(
                request, timeout=timeout or self.timeout, metadata=bearer_metadata(self.token)
            )
        except grpc.aio.AioRpcError as exc:
            code, details = exc.code(), exc.details() or ""
            if code in _UNREACHABLE:
                raise ServerUnreachable(
                    f"cube-server at {self.address} unreachable ({code.name}) during {what}: "
                    f"{details}",
                    code,
                    details,
                ) from exc
            raise ServerError(f"cube-server {what}: {code.name}: {details}", code, details) from exc
        return ServerStatus.from_pb(resp)

    async def status(self, timeout: float | None = None) -> ServerStatus:
        return await self.cmd("status", timeout=timeout)

    async def wait_for(
        self, version: str, *, slot: str, timeout: float, poll: float = 0.2
    ) -> ServerStatus:
        """Poll `status` until `version` is in `slot` ('bg' or 'cur'; 'cur' also accepts...)
        — bounded by `timeout`; a finished load that left another version there is an error."""
        deadline = time.monotonic() + timeout
        while True:
            st = await self.status()
            if st.cur_version == version or (slot == "bg" and st.bg_version == version):
                return st
            if st.status != STATUS_LOADING and slot == "bg" and st.bg_version:
                raise ServerError(
                    f"cube-server finished loading but holds bg_version {st.bg_version!r}, "
                    f"not {version!r} (cur_version {st.cur_version!r}) {st.message}".rstrip()
                )
            if time.monotonic() >= deadline:
                raise ServerError(
                    f"cube-server did not show {version!r} as {slot} version within "
                    f"{timeout:g} s (cur {st.cur_version!r}, bg {st.bg_version!r}, "
                    f"status {st.status})"
                )
            await asyncio.sleep(poll)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None
