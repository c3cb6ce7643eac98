"""MockTransport: a CubeClient or AsyncCubeClient that needs no server, for the tests of code
that uses the SDK (as httpx.MockTransport does for httpx).

    def handler(address: str, keys: np.ndarray) -> list[bytes | None]:
        return [table.get(int(k)) for k in keys]          # None: a miss

    client = CubeClient([["shard0:1"], ["shard1:1"]], transport=MockTransport(handler))

The client routes, splits, retries and merges as it does against real servers: the handler
sees each sub-request (the shard's replica address and its keys) and answers with the value
of each key in order (or a dict key -> value), or raises TransportError(code, message) to make
that attempt fail (UNAVAILABLE is retried on another replica, INVALID_ARGUMENT is not). It
speaks the fast protocol (cube.v1 Seek), the client's default.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from cube import wire
from cube.client.errors import TransportError
from cube.pb import cube_fast_pb2

Values = Sequence[bytes | None] | Mapping[int, bytes]
Handler = Callable[[str, np.ndarray], Values]


class MockTransport:
    """Answers every sub-request with `handler(address, keys)`; every answer carries
    `version` (a real server's version name; it must not be empty, which would mean the
    replica serves nothing)."""

    def __init__(self, handler: Handler, version: str = "mock") -> None:
        if not version:
            raise ValueError("a MockTransport answers from a version: give it a name")
        self.handler = handler
        self.version = version
        self.calls: list[tuple[str, int]] = []  # (address, keys) of every call, for asserts

    def call(self, address: str, request: bytes, timeout_s: float) -> bytes:
        try:
            parsed = cube_fast_pb2.SeekRequest.FromString(request)
        except Exception as exc:
            raise TransportError("INVALID_ARGUMENT", f"not a cube.v1 SeekRequest: {exc}") from None
        keys = np.frombuffer(parsed.keys, dtype="<u8")
        self.calls.append((address, int(keys.shape[0])))
        answered = self.handler(address, keys)
        if isinstance(answered, Mapping):
            values: list[bytes | None] = [answered.get(int(k)) for k in keys.tolist()]
        else:
            values = list(answered)
        if len(values) != keys.shape[0]:
            raise TransportError(
                "INTERNAL", f"the handler answered {len(values)} values for {keys.shape[0]} keys"
            )
        return _response(values, self.version, parsed.request_id)

    async def acall(self, address: str, request: bytes, timeout_s: float) -> bytes:
        return self.call(address, request, timeout_s)

    def close(self) -> None:
        pass


def _response(values: list[bytes | None], version: str, request_id: int) -> bytes:
    """cube.v1.SeekResponse bytes for `values` (None: a miss), fixed width when every found
    value has one length, else variable."""
    n = len(values)
    found = np.array([v is not None for v in values], dtype=bool)
    lengths = {len(v) for v in values if v is not None}
    if len(lengths) == 1 and (width := lengths.pop()) > 0:
        rows = np.zeros((n, width), dtype=np.uint8)
        for i, value in enumerate(values):
            if value is not None:
                rows[i] = np.frombuffer(value, dtype=np.uint8)
        parts = wire.seek_response_parts(found, rows, width, None, version, request_id)
    else:
        blob = np.frombuffer(b"".join(v or b"" for v in values), dtype=np.uint8)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum([len(v or b"") for v in values], out=offsets[1:])
        parts = wire.seek_response_parts(found, blob, 0, offsets, version, request_id)
    return b"".join(parts)
