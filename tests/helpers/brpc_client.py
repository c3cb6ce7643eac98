"""A tiny baidu_std client for the tests, written from brpc's published description of the
protocol (docs/cn/baidu_std.md and src/brpc/policy/baidu_rpc_meta.proto in apache/brpc), not
from cube-server's code: the RpcMeta bytes are encoded and decoded here by hand, so the server
is checked against the description rather than against itself. No brpc peer is available on
this machine (nothing in the package registries), which is why the tests use this.

A frame: "PRPC", body size and meta size (big-endian uint32), then the RpcMeta, the message
and the attachment. RpcMeta fields: 1 request {1 service_name, 2 method_name, 3 log_id},
2 response {1 error_code, 2 error_text}, 3 compress_type, 4 correlation_id, 5 attachment_size,
7 authentication_data.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass
from typing import TypedDict, Unpack

HEADER = struct.Struct(">4sII")


def varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int32/int64 travel as ten bytes (two's complement)
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def field_varint(number: int, value: int) -> bytes:
    return varint(number << 3) + varint(value)


def field_bytes(number: int, value: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(value)) + value


def decode(data: bytes) -> dict[int, list[int | bytes]]:
    """Fields of a protobuf message: number -> values (varints as ints, others as bytes)."""
    fields: dict[int, list[int | bytes]] = {}
    at = 0
    while at < len(data):
        key, at = _read_varint(data, at)
        number, kind = key >> 3, key & 7
        value: int | bytes
        if kind == 0:
            value, at = _read_varint(data, at)
        elif kind == 2:
            size, at = _read_varint(data, at)
            value, at = data[at : at + size], at + size
        else:
            raise ValueError(f"wire type {kind} not expected in RpcMeta")
        fields.setdefault(number, []).append(value)
    return fields


def _read_varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, at


def signed(value: int, bits: int) -> int:
    """A varint's value as a signed integer of `bits` bits (int32, int64)."""
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >> (bits - 1) else value


class RequestMeta(TypedDict, total=False):
    """The optional RpcMeta fields `request_meta` takes, as keywords."""

    log_id: int
    compress_type: int
    attachment_size: int
    authentication_data: bytes


def request_meta(
    service: str,
    method: str,
    correlation_id: int,
    *,
    log_id: int | None = None,
    compress_type: int | None = None,
    attachment_size: int | None = None,
    authentication_data: bytes | None = None,
) -> bytes:
    request = field_bytes(1, service.encode()) + field_bytes(2, method.encode())
    if log_id is not None:
        request += field_varint(3, log_id)
    meta = field_bytes(1, request)
    if compress_type is not None:
        meta += field_varint(3, compress_type)
    meta += field_varint(4, correlation_id)
    if attachment_size is not None:
        meta += field_varint(5, attachment_size)
    if authentication_data is not None:
        meta += field_bytes(7, authentication_data)
    return meta


def frame(meta: bytes, message: bytes = b"", attachment: bytes = b"") -> bytes:
    body = meta + message + attachment
    return HEADER.pack(b"PRPC", len(body), len(meta)) + body


@dataclass
class Reply:
    correlation_id: int
    error_code: int
    error_text: str
    compress_type: int | None
    message: bytes
    attachment: bytes
    has_error_code: bool


def read_reply(sock: socket.socket) -> Reply:
    """Read one response frame (ConnectionError if the server closed the connection)."""
    header = _read_exactly(sock, HEADER.size)
    magic, body_size, meta_size = HEADER.unpack(header)
    assert magic == b"PRPC", magic
    body = _read_exactly(sock, body_size)
    meta = decode(body[:meta_size])
    response = decode(meta[2][0]) if 2 in meta else {}  # type: ignore[arg-type]
    attachment = int(meta.get(5, [0])[0])
    payload = body[meta_size:]
    split = len(payload) - attachment
    return Reply(
        correlation_id=signed(int(meta[4][0]), 64),
        error_code=signed(int(response.get(1, [0])[0]), 32),
        error_text=bytes(response.get(2, [b""])[0]).decode(),
        compress_type=int(meta[3][0]) if 3 in meta else None,
        message=payload[:split],
        attachment=payload[split:],
        has_error_code=1 in response,
    )


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    chunks = []
    while size:
        chunk = sock.recv(min(size, 1 << 20))
        if not chunk:
            raise ConnectionError("the server closed the connection")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def closed_without_answer(sock: socket.socket, timeout: float = 10.0) -> bool:
    """Whether the server closes the connection without sending a byte."""
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


class BrpcClient:
    """One connection; `call` sends a request and reads its response."""

    def __init__(self, port: int, host: str = "127.0.0.1", timeout: float = 30.0) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.next_id = 1

    def call(
        self,
        service: str,
        method: str,
        message: bytes = b"",
        attachment: bytes = b"",
        *,
        correlation_id: int | None = None,
        **meta: Unpack[RequestMeta],
    ) -> Reply:
        if correlation_id is None:
            correlation_id, self.next_id = self.next_id, self.next_id + 1
        if attachment and "attachment_size" not in meta:
            meta["attachment_size"] = len(attachment)
        head = request_meta(service, method, correlation_id, **meta)
        self.sock.sendall(frame(head, message, attachment))
        return read_reply(self.sock)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> BrpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
