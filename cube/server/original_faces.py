"""The original cube-server's faces of one worker, from cube-server's flags: HTTP+JSON on
`--http_port` (cube.server.http_json) and baidu_std on `--baidu_std_port`
(cube.server.baidu_std). Each flag: -1 off (the default), 0 any free port (one worker; the
bound port is in --port_file as http_ports / baidu_std_ports), else worker i listens on
port + i. Both bind --host, serve TLS with --tls_cert, share the worker's byte, connection and
stall bounds with the TCP lane (`Bounds`, from --lane_*) and take the gRPC message bound
(from --max_batch)."""

from __future__ import annotations

import logging
import ssl
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cube.flags import FlagError
from cube.listen import ListenError
from cube.security import TokenLike
from cube.server.bounds import Bounds
from cube.server.control import ControlRunner
from cube.server.service import SeekService

if TYPE_CHECKING:
    from cube.server.flags import ServerFlags

log = logging.getLogger("cube.server")

FLAGS = ("http_port", "baidu_std_port")


def first_port(flags: ServerFlags, name: str) -> int:
    """The flag `name` of FLAGS: worker 0's port of that face."""
    return {"http_port": flags.http_port, "baidu_std_port": flags.baidu_std_port}[name]


def face_ports(flags: ServerFlags, name: str) -> list[int]:
    """Each worker's port of the face `name` (a flag of FLAGS); [] when off. FlagError when
    the flag cannot work with the other ports."""
    first = first_port(flags, name)
    if first < 0:
        return []
    if first == 0:
        if flags.workers > 1:
            raise FlagError(
                f"--{name} 0 (any free port) needs --workers 1: give a port (worker i on port + i)"
            )
        return [0]
    ports = [first + i for i in range(flags.workers)]
    if ports[-1] > 65535:
        raise FlagError(f"--{name} {first}: ports {ports} are not all ports")
    return ports


def check_face_flags(flags: ServerFlags, taken: dict[int, str]) -> None:
    """The faces' ports are ports, distinct from each other's and from the server's other
    fixed ports (`taken`: port -> the flag that takes it; FlagError). Port 0 (any free
    port) never collides."""
    taken = {port: flag for port, flag in taken.items() if port}
    for name in FLAGS:
        if first_port(flags, name) < -1:
            raise FlagError(f"--{name} {first_port(flags, name)} is not a port (or -1: off)")
        for port in face_ports(flags, name):
            if port and port in taken:
                raise FlagError(f"--{name} and {taken[port]} both take port {port}")
            taken[port] = f"--{name}"


@dataclass
class Faces:
    """The faces a worker runs (stopped together)."""

    ports: dict[str, int] = field(default_factory=dict)  # flag -> bound port
    stoppers: list[Any] = field(default_factory=list)

    def report(self, one_worker: bool) -> dict[str, list[int]]:
        """For --port_file: each face's bound port (one worker), as the lists it keeps."""
        return {
            f"{name.removesuffix('_port')}_ports": (
                [self.ports[name]] if one_worker and name in self.ports else []
            )
            for name in FLAGS
        }

    def binds(self, address: Any) -> list[str]:
        """What the start-up log line says they listen on."""
        names = {"http_port": "HTTP+JSON", "baidu_std_port": "baidu_std"}
        return [f"{address(port)} ({names[name]})" for name, port in self.ports.items()]

    async def stop(self, grace: float) -> None:
        for stopper in self.stoppers:
            await stopper(grace)


async def start_faces(
    flags: ServerFlags,
    index: int,
    service: SeekService,
    control: ControlRunner,
    token: TokenLike,
    max_message: int,
    bounds: Bounds,
    ssl_context: ssl.SSLContext | None,
) -> Faces | None:
    """Listen on this worker's face ports (before the start-up load, like every port); None
    (logged) when a port cannot be bound or aiohttp is missing. `max_message` bounds a
    DictRequest (as gRPC's message bound); `bounds` are the worker's, shared with the lane."""
    faces = Faces()
    host, insecure = flags.host, flags.insecure
    for name in FLAGS:
        ports = face_ports(flags, name)
        if not ports:
            continue
        port = ports[index]
        try:
            if name == "http_port":
                try:
                    from cube.server.http_json import HttpFace, max_body_bytes
                except ImportError as exc:
                    log.error("--http_port needs aiohttp (pip install aiohttp): %s", exc)
                    await faces.stop(0.0)
                    return None
                body = max_body_bytes(max_message, flags.max_batch)
                http = HttpFace(
                    service,
                    control,
                    host=host,
                    token=token,
                    insecure=insecure,
                    max_body=body,
                    bounds=bounds,
                )
                faces.ports[name] = await http.start(port, ssl_context)
                faces.stoppers.append(http.stop)
            else:
                from cube.server.baidu_std import MAX_META, BaiduStdServer

                frame = max_message + MAX_META  # a DictRequest and its RpcMeta
                baidu = BaiduStdServer(
                    service,
                    control,
                    host=host,
                    token=token,
                    insecure=insecure,
                    max_frame=frame,
                    bounds=bounds,
                )
                faces.ports[name] = await baidu.start(port, ssl_context)
                faces.stoppers.append(baidu.stop)
        except ListenError as exc:
            log.error("%s", exc)
            await faces.stop(0.0)
            return None
    return faces
