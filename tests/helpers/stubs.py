"""Typed constructors for the generated gRPC stubs in cube.pb: grpc_python_out writes no type
information, so the one `type: ignore` per stub class lives here rather than at every call."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import grpc
import grpc.aio

from cube.pb import cube_fast_pb2_grpc, cube_pb2_grpc

if TYPE_CHECKING:  # grpcio-reflection is the server extra's: imported where it is used
    from grpc_reflection.v1alpha.reflection_pb2 import (
        ServerReflectionRequest,
        ServerReflectionResponse,
    )

Channel = grpc.Channel | grpc.aio.Channel


def control_stub(channel: Channel) -> cube_pb2_grpc.ControlServiceStub:
    """The original's control service (cmd)."""
    return cube_pb2_grpc.ControlServiceStub(channel)  # type: ignore[no-untyped-call]  # generated


def dict_stub(channel: Channel) -> cube_pb2_grpc.DictServiceStub:
    """The original's seek service."""
    return cube_pb2_grpc.DictServiceStub(channel)  # type: ignore[no-untyped-call]  # generated


def fast_stub(channel: Channel) -> cube_fast_pb2_grpc.CubeServiceStub:
    """The fast lookup service (Seek, SeekStream)."""
    return cube_fast_pb2_grpc.CubeServiceStub(channel)  # type: ignore[no-untyped-call]  # generated


def raw_unary(channel: grpc.Channel, method: str) -> grpc.UnaryUnaryMultiCallable[bytes, bytes]:
    """A unary call by its full name, bytes in and out (no generated stub: an internal
    method, or the bytes of a request the stubs would not build)."""
    call: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(method)
    return call


def reflection_info(
    channel: grpc.Channel, requests: Iterable[ServerReflectionRequest], timeout: float
) -> Iterator[ServerReflectionResponse]:
    """The reflection service's one call (a stream). types-grpcio-reflection declares the
    stub's method `Incomplete` imported from binascii, which has none: not callable to mypy."""
    from grpc_reflection.v1alpha import reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies: Iterator[ServerReflectionResponse] = stub.ServerReflectionInfo(  # type: ignore[operator]  # the stub bug above
        iter(requests), timeout=timeout
    )
    return replies
