"""gRPC transports: one channel per endpoint, created on first use and kept; bytes in, bytes
out (request and response (de)serialization is the core's, see `cube.client.core`)."""

from __future__ import annotations

import threading
from typing import Any

import grpc
import grpc.aio

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


def status_of(error: BaseException) -> tuple[str, str]:
    """(status code name, message) of a failed call."""
    if isinstance(error, grpc.RpcError) and hasattr(error, "code"):
        code = error.code()
        name = code.name if isinstance(code, grpc.StatusCode) else str(code)
        return name, error.details() or ""
    return "UNKNOWN", f"{type(error).__name__}: {error}"


class SyncChannels:
    """Blocking-API channels. `call` blocks the calling thread: gRPC's sync `future()` starts
    a polling thread per call when none is running, which costs more than the call itself
    here, so the client runs blocking calls inline or on its own thread pool instead."""

    def __init__(self, method: str) -> None:
        self._method = method
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._callables: dict[str, grpc.UnaryUnaryMultiCallable] = {}
        self._closed = False

    def _callable(self, address: str) -> grpc.UnaryUnaryMultiCallable:
        call = self._callables.get(address)
        if call is None:
            with self._lock:
                if self._closed:
                    raise RuntimeError("client is closed")
                call = self._callables.get(address)
                if call is None:
                    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
                    self._channels[address] = channel
                    call = channel.unary_unary(self._method)
                    self._callables[address] = call
        return call

    def call(self, address: str, request: bytes, timeout_s: float) -> tuple[bool, Any]:
        """(True, response bytes) or (False, (status name, message)); never raises."""
        try:
            return True, self._callable(address)(request, timeout=timeout_s)
        except Exception as exc:
            return False, status_of(exc)

    def wait_ready(self, addresses: list[str], timeout_s: float) -> list[str]:
        """Connect to every address; return those not ready within `timeout_s`."""
        futures = {}
        for address in addresses:
            self._callable(address)
            futures[address] = grpc.channel_ready_future(self._channels[address])
        not_ready = []
        for address, future in futures.items():
            try:
                future.result(timeout=timeout_s)
            except grpc.FutureTimeoutError:
                future.cancel()
                not_ready.append(address)
        return not_ready

    def close(self) -> None:
        with self._lock:
            self._closed = True
            channels = list(self._channels.values())
            self._channels.clear()
            self._callables.clear()
        for channel in channels:
            channel.close()


class AioChannels:
    """grpc.aio channels, bound to the event loop they were first used in."""

    def __init__(self, method: str) -> None:
        self._method = method
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._callables: dict[str, grpc.aio.UnaryUnaryMultiCallable] = {}
        self._closed = False

    def _callable(self, address: str) -> grpc.aio.UnaryUnaryMultiCallable:
        call = self._callables.get(address)
        if call is None:
            if self._closed:
                raise RuntimeError("client is closed")
            channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            self._channels[address] = channel
            call = self._callables[address] = channel.unary_unary(self._method)
        return call

    def start(self, address: str, request: bytes, timeout_s: float) -> grpc.aio.UnaryUnaryCall:
        return self._callable(address)(request, timeout=timeout_s)

    async def wait_ready(self, addresses: list[str], timeout_s: float) -> list[str]:
        import asyncio

        for address in addresses:
            self._callable(address)

        async def ready(address: str) -> bool:
            try:
                await asyncio.wait_for(self._channels[address].channel_ready(), timeout_s)
                return True
            except TimeoutError:
                return False

        flags = await asyncio.gather(*(ready(a) for a in addresses))
        return [a for a, ok in zip(addresses, flags, strict=True) if not ok]

    async def close(self) -> None:
        self._closed = True
        channels = list(self._channels.values())
        self._channels.clear()
        self._callables.clear()
        for channel in channels:
            await channel.close()
