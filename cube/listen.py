"""Listening sockets, opened one way by every command: exclusively.

No listening socket here sets SO_REUSEPORT. With it, a second process of the same user that
binds the same port (a second cube-server given the same --control_port, say) is let in beside
the first, and the kernel splits new connections between the two; gRPC servers set it unless
told not to, hence `GRPC_OPTIONS` on every gRPC server. SO_REUSEADDR stays on: it lets a
restart bind over connections in TIME_WAIT and, on Linux, never lets two listeners share a
port. So a port in use fails at once, with a `ListenError` that names the address, the flag or
setting that chose it, and why.

The one deliberate exception is cube-server `--reuseport` (its workers share --port through
SO_REUSEPORT): `check_free` lets the server make sure, before its workers bind, that nothing
else holds that port (cube/server/main.py).
"""

from __future__ import annotations

import errno
import resource
import socket
from typing import Any

# gRPC servers: no SO_REUSEPORT (gRPC's default is on)
GRPC_OPTIONS = (("grpc.so_reuseport", 0),)
BACKLOG = 1024


class ListenError(OSError):
    """A port that cannot be listened on; str() is the whole message."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(code, message)

    def __str__(self) -> str:
        return str(self.strerror)


def address(host: str, port: int) -> str:
    """host:port, an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def _reason(exc: OSError) -> str:
    return "port in use" if exc.errno == errno.EADDRINUSE else str(exc.strerror or exc)


def listen_socket(host: str, port: int, what: str, backlog: int = BACKLOG) -> socket.socket:
    """A socket listening on host:port (0: any free port) that no other socket may share;
    `what` names the flag or setting that chose the port, for the error. A host name binds
    the first address it resolves to ("" is 0.0.0.0; "::" is IPv6 only)."""
    try:
        found = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        family, where = found[0][0], found[0][4]
        return socket.create_server(where, family=family, backlog=backlog)
    except OSError as exc:  # (socket.gaierror is one)
        code = exc.errno or errno.EINVAL
        message = f"cannot listen on {address(host, port)} ({what}): {_reason(exc)}"
        raise ListenError(code, message) from exc


def check_free(host: str, port: int, what: str) -> None:
    """ListenError unless host:port could be listened on now (nothing else holds it)."""
    listen_socket(host, port, what, backlog=1).close()


def grpc_listen(
    server: Any, host: str, port: int, what: str, credentials: Any = None, shared: bool = False
) -> int:
    """Bind a grpc(.aio) server made with `GRPC_OPTIONS` on host:port (over TLS with
    `credentials`); the bound port, or ListenError saying why not (gRPC does not say: a
    probe of the port does). A fixed port is probed first: gRPC's C core logs an add_port
    error line of its own to stderr before failing, which would come before (and muddle) ours.
    `shared`: the port is shared through SO_REUSEPORT (cube-server --reuseport), held by the
    other workers already, so not probed."""
    bind = address(host, port)
    if port and not shared:
        check_free(host, port, what)  # raises with the reason, before gRPC tries
    try:
        bound = (
            server.add_insecure_port(bind)
            if credentials is None
            else server.add_secure_port(bind, credentials)
        )
    except RuntimeError:  # grpc >= 1.55: "Failed to bind to address ..."
        bound = 0
    if bound:
        return int(bound)
    check_free(host, port, what)  # raises with the reason
    raise ListenError(errno.EADDRINUSE, f"cannot listen on {bind} ({what}): gRPC cannot bind it")


def raise_open_files(wanted: int) -> int:
    """Raise this process's soft limit of open files toward `wanted`, as far as the hard limit
    allows (a server that is to hold N connections needs N descriptors, and many systems start
    processes with a soft limit of 1024); returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return wanted
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError):
        return soft
    return target
