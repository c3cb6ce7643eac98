"""What the SDK's two transports share (bytes in, bytes out; what the bytes say is
cube.client._core's): the protocols a `transport=` object follows (`SyncTransport` for
CubeClient, `AsyncTransport` for AsyncCubeClient), gRPC channel options, TLS, what first
contact tells (`Contact`: lane port, routing, --max_batch) and where a lane answer is read so
that its values align. The blocking transport: cube.client._sync_transport; the asyncio one:
cube.client._aio_transport. How first contact, lanes and routing checks go: docs/ARCHITECTURE.md
(SDK transports).
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol, runtime_checkable

import grpc
import grpc.aio
import numpy as np

from cube.client.errors import TransportError
from cube.routing import ShardRouting
from cube.security import TrustedCA
from cube.wire import (
    ANSWER_HEADER,
    MAX_BATCH_METADATA,
    REQUEST_HEADER,
    answer_values_at,
    answer_width,
)

# No message size limit (100k-key batches of large values), our own retries only, and a short
# reconnect backoff so a restarted replica is used again within seconds (grpc's default grows
# to 120 s).
CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
    ("grpc.enable_retries", 0),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.use_local_subchannel_pool", 1),
)


# The lane's wire constants (cube.server.lane; tests run the SDK against the real server).
LANE_PORT_METADATA = "cube-tcp-port"


ROUTING_METADATA = "cube-routing"


CONFIG_MISMATCH = "CONFIG_MISMATCH"  # a status of our own: the endpoint holds other keys


TRANSPORTS = ("auto", "grpc")


@dataclass(frozen=True)
class Contact:
    """What an endpoint said on first contact (the metadata of its answer to an empty Seek):
    the routing of the version it serves, and the most keys a request may carry (its
    --max_batch). None: not said (an older server, or nothing loaded)."""

    routing: ShardRouting | None = None
    max_batch: int | None = None


# Called with each first contact's Contact: what is wrong with the endpoint (None: nothing).
ContactCheck = Callable[[str, Contact], str | None]


_STATUS_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


_ALIGN = 16  # answers are read so that their values start at this alignment (malloc's)


_U8 = np.dtype(np.uint8)


LANE_RECHECK_S = 5.0  # an endpoint found without a (reachable) lane is asked again after this


@runtime_checkable
class SyncTransport(Protocol):
    """How CubeClient moves a request's bytes to a server and the answer's bytes back, when
    given one as `transport=` (instead of the built-in gRPC/TCP-lane one; MockTransport for
    tests): `call` returns the cube.v1 SeekResponse bytes or raises TransportError; `close`
    is called when the client closes."""

    def call(self, address: str, request: bytes, timeout_s: float) -> bytes: ...

    def close(self) -> None: ...


@runtime_checkable
class AsyncTransport(Protocol):
    """As SyncTransport, for AsyncCubeClient: `acall` is awaited; `close` is called when the
    client closes (`aclose()`)."""

    async def acall(self, address: str, request: bytes, timeout_s: float) -> bytes: ...

    def close(self) -> None: ...


@runtime_checkable
class Transport(SyncTransport, AsyncTransport, Protocol):
    """A transport for either client (both protocols), as MockTransport is."""


def _status_name(number: int) -> str:
    return _STATUS_NAMES.get(number, "UNKNOWN")


def _lane_address(address: str, metadata: Any) -> tuple[str, int] | None:
    """The lane's (host, port) announced in `metadata`, on the host of `address`; None when
    there is none or it is not a port (then the endpoint is used over gRPC)."""
    for key, value in metadata or ():
        if key == LANE_PORT_METADATA:
            host = address.rpartition(":")[0].strip("[]")
            text = str(value)
            if not text.isdigit() or not 0 < int(text) < 65536:
                return None
            return host, int(text)
    return None


def contact_of(metadata: Any) -> Contact:
    """The Contact that first contact's `metadata` states; a --max_batch that is not a
    positive integer counts as not said."""
    routing = max_batch = None
    for key, value in metadata or ():
        if key == ROUTING_METADATA:
            routing = ShardRouting.from_text(str(value))
        elif key == MAX_BATCH_METADATA:
            text = str(value)
            max_batch = int(text) if text.isdigit() and int(text) > 0 else None
    return Contact(routing, max_batch)


def _no_check(address: str, contact: Contact) -> str | None:
    return None


# A gRPC channel made with a CA bundle since replaced is closed this long after it stopped
# taking calls (calls in flight on it finish first).
RETIRED_CHANNEL_S = 60.0


@dataclass(frozen=True)
class ClientTLS:
    """TLS to the servers (their --tls_cert): trust `ca` (a PEM bundle; "" for the system's
    CAs) and expect certificates for `server_name` (default: each address's host). The bundle
    is read again when the file changes (`TrustedCA`, a stat at most once a second): new lane
    connections use it at once; gRPC channels keep the credentials they were made with, so the
    transports open new ones when `generation` moves on."""

    ca: str = ""
    server_name: str = ""

    @cached_property
    def trust(self) -> TrustedCA:
        return TrustedCA(self.ca)

    @property
    def context(self) -> ssl.SSLContext:
        return self.trust.context()

    @property
    def generation(self) -> int:
        """Counts the bundle's changes (0: as first read)."""
        return self.trust.generation

    def credentials(self) -> grpc.ChannelCredentials:
        return self.trust.credentials()

    def options(self) -> tuple[tuple[str, str], ...]:
        return (("grpc.ssl_target_name_override", self.server_name),) if self.server_name else ()

    def wrap(self, sock: socket.socket, host: str) -> ssl.SSLSocket:
        """`sock` in TLS, its handshake not done yet (`do_handshake()`: the caller first lets
        a cancel reach the new socket object)."""
        return self.context.wrap_socket(
            sock, server_hostname=self.server_name or host, do_handshake_on_connect=False
        )


def status_of(error: BaseException) -> tuple[str, str]:
    """(status code name, message) of a failed call."""
    if isinstance(error, TransportError):
        return error.code, error.message
    if isinstance(error, grpc.RpcError) and hasattr(error, "code"):
        code = error.code()
        name = code.name if isinstance(code, grpc.StatusCode) else str(code)
        return name, error.details() or ""
    return "UNKNOWN", f"{type(error).__name__}: {error}"


_REQUEST_HEADER = REQUEST_HEADER.pack


class _Placement:
    """Where in a buffer of its own to start receiving an answer (a frame) so that its values
    come out aligned, and get_embeddings can return a view of them: from the request's key
    count and the value width of the answers so far (as servers lay answers out)."""

    __slots__ = ("_pads", "length", "width")

    def __init__(self) -> None:
        self.width = 0  # of the answers' values; 0: not known (no padding)
        self.length = -1  # of the last answer: its width is read again when it changes
        # pad by request size: the same size is the same key count (but for a rare pinned
        # version of just the right length, which then costs get_embeddings a copy)
        self._pads: dict[int, int] = {}

    def pad(self, request: bytes) -> int:
        """Where the frame of the answer to `request` starts, modulo _ALIGN."""
        pad = self._pads.get(len(request))
        if pad is None:
            pad = 0
            if self.width:
                pad = -(ANSWER_HEADER.size + answer_values_at(request, self.width)) % _ALIGN
            if len(self._pads) >= 256:
                self._pads.clear()
            self._pads[len(request)] = pad
        return pad

    def learn(self, body: memoryview) -> None:
        if len(body) != self.length:
            self.length = len(body)
            width = answer_width(body)
            if width != self.width:
                self.width = width
                self._pads.clear()


_UNKNOWN = object()
