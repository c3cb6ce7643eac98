"""Typed constructors for the generated gRPC stubs in cube.pb: grpc_python_out writes no type
information, so the one `type: ignore` per stub class lives here rather than at every call."""

from __future__ import annotations

import grpc
import grpc.aio

from cube.pb import cube_fast_pb2_grpc, cube_pb2_grpc

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
