"""cube-server's port plan: which port each worker listens on for lookups, control and the TCP
lane, from the flags, checked before any worker starts (FlagError naming the flags that
clash). Pure: no socket is opened here (cube/listen.py binds them). The original's faces'
ports: cube/server/original_faces.py. Layout of the ports: docs/reference/cube-server.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from cube.flags import FlagError

if TYPE_CHECKING:
    from cube.server.flags import ServerFlags


def worker_ports(flags: ServerFlags) -> list[int]:
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


def control_ports(flags: ServerFlags) -> list[int]:
    """Each worker's control port: --control_port (or --port + 1000) + i; 0 (any free port,
    one worker only) when --port is 0 and --control_port is not given."""
    if flags.control_port >= 0:
        first = int(flags.control_port)
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


def lane_ports(flags: ServerFlags) -> list[int]:
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


def fixed_ports(flags: ServerFlags, ports: list[int]) -> dict[int, str]:
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


def loopback(host: str) -> str:
    """The address a worker reaches a peer's port bound on `host` at (a wildcard: loopback)."""
    return "127.0.0.1" if host in ("", "0.0.0.0", "::", "[::]") else host


@dataclass(frozen=True)
class PortPlan:
    """Every worker's ports as the flags ask for them (0: any free port, one worker only)."""

    lookups: tuple[int, ...]  # each worker's own lookup port (gRPC)
    controls: tuple[int, ...]  # each worker's control port
    lanes: tuple[int, ...]  # each worker's TCP lane port
    lookup_flag: str  # the flag that sets the lookup ports, for messages

    @classmethod
    def from_flags(cls, flags: ServerFlags) -> PortPlan:
        """The plan (FlagError when the flags cannot make one)."""
        return cls(
            tuple(worker_ports(flags)),
            tuple(control_ports(flags)),
            tuple(lane_ports(flags)),
            "--worker_ports" if flags.worker_ports else "--port",
        )
