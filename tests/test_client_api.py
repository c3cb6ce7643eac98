"""The SDK's public surface: what cube.client exports, typed constructors visible to
inspect.signature (keyword-only after `shards`), the option objects, one transport shape, and
MockTransport driving the real client code without a server."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable

import numpy as np
import pytest

import cube.client
from cube.client import (
    AsyncCubeClient,
    Backoff,
    ConfError,
    CubeClient,
    MockTransport,
    RequestRejectedError,
    Retry,
    ShardUnavailableError,
    Timeouts,
    TransportError,
)

PUBLIC = {
    "AsyncCubeClient", "AsyncCubeClients", "AsyncTransport", "Attempt", "Backoff",
    "ClientClosedError", "ClientOptions", "ClientStats", "ConfError",
    "ConfigMismatchError", "CubeClient", "CubeClients", "CubeError", "DeadlineExceededError",
    "DictConf", "DictNotChosenError", "KeyRangeError", "KeyShapeError", "LoadBalancer",
    "MockTransport", "Partitioner", "RequestRejectedError", "Retry", "SeekResult",
    "ShardUnavailableError", "SyncTransport", "Timeouts", "Transport", "TransportError",
    "TransportName", "ValueSizeError", "VersionMismatchError", "WireProtocol", "load_conf",
    "parse_conf", "version_order",
}  # fmt: skip


def test_the_public_surface_is_what_cube_client_exports() -> None:
    assert set(cube.client.__all__) == PUBLIC
    assert all(hasattr(cube.client, name) for name in PUBLIC)


@pytest.mark.parametrize("cls", [CubeClient, AsyncCubeClient])
def test_constructors_declare_their_parameters(cls: type[CubeClient | AsyncCubeClient]) -> None:
    parameters = inspect.signature(cls).parameters
    kinds = {p.kind for p in parameters.values()}
    assert inspect.Parameter.VAR_POSITIONAL not in kinds
    assert inspect.Parameter.VAR_KEYWORD not in kinds
    names = list(parameters)
    assert names[0] == "shards" and parameters["shards"].kind.name == "POSITIONAL_OR_KEYWORD"
    assert all(parameters[n].kind == inspect.Parameter.KEYWORD_ONLY for n in names[1:])
    for name in ("partitioner", "timeout", "retry", "load_balancer", "transport", "tls_ca"):
        assert name in parameters
    assert "Literal" in str(parameters["partitioner"].annotation) or "Partitioner" in str(
        parameters["partitioner"].annotation
    )
    assert "Self" in str(inspect.signature(cls.from_conf).return_annotation)


def test_positional_options_are_refused() -> None:
    with pytest.raises(TypeError):
        CubeClient([["h:1"]], "murmur3")  # type: ignore[call-arg]


def test_option_objects() -> None:
    assert Retry().attempts == 2 and Retry().backoff == Backoff(0.002, 0.1, jitter=0.5)
    assert Timeouts().attempt == 1.0 and Timeouts().backup_after is None
    assert Timeouts().total is None and Timeouts(0.2, 0.02, 0.5).total == 0.5
    for bad in (
        lambda: Timeouts(0),
        lambda: Timeouts(1, 0),
        lambda: Timeouts(1, total=0),
        lambda: Retry(-1),
    ):
        with pytest.raises(ConfError):
            bad()
    client = CubeClient([["h:1"]], timeout=0.25, retry=5, transport=MockTransport(lambda a, k: []))
    assert client.timeouts == Timeouts(0.25) and client.retry.attempts == 5
    client.close()
    with pytest.raises(ConfError, match="busy_poll_us is for CubeClient"):
        AsyncCubeClient([["h:1"]], busy_poll_us=100)


TABLE = {k: f"v{k}".encode() for k in range(0, 1000, 3)}


def handler_with_a_dead_replica(address: str, keys: np.ndarray) -> list[bytes | None]:
    if address == "dead:1":
        raise TransportError("UNAVAILABLE", "replica down")
    return [TABLE.get(int(k)) for k in keys]


def test_mock_transport_drives_the_real_client_sync_and_async() -> None:
    """Routing over 2 shards, a dead replica retried on the other one, misses, order kept."""
    shards = [["dead:1", "a:1"], ["b:1"]]
    keys = np.arange(0, 60, dtype=np.uint64)
    mock = MockTransport(handler_with_a_dead_replica, version="17")
    with CubeClient(shards, transport=mock, retry=Retry(attempts=2), seed=1) as client:
        result = client.seek(keys)
    assert result.version == "17"
    assert result.found.tolist() == [int(k) % 3 == 0 for k in keys]
    assert result.values[3] == b"v3" and result.values[4] is None
    assert {address for address, _ in mock.calls} >= {"a:1", "b:1"}

    async def run() -> bytes | None:
        async with AsyncCubeClient(shards, transport=mock, seed=2) as client:
            return (await client.seek([9, 10])).values[0]

    assert asyncio.run(run()) == b"v9"


def test_mock_transport_errors_reach_the_caller_as_the_real_ones_do() -> None:
    def refuse(address: str, keys: np.ndarray) -> list[bytes | None]:
        raise TransportError("INVALID_ARGUMENT", "no")

    with (
        CubeClient([["a:1"]], transport=MockTransport(refuse)) as client,
        pytest.raises(RequestRejectedError, match="INVALID_ARGUMENT"),
    ):
        client.seek([1])

    def down(address: str, keys: np.ndarray) -> list[bytes | None]:
        raise TransportError("UNAVAILABLE", "down")

    with (
        CubeClient([["a:1", "b:1"]], transport=MockTransport(down), retry=1) as client,
        pytest.raises(ShardUnavailableError, match="down"),
    ):
        client.seek([1])


def test_client_stats_count_calls_retries_failovers_and_errors() -> None:
    """ClientStats through the real client (a mock transport): a dead first replica makes
    a retry and a failover on shard 0; the Prometheus collector exports it all."""
    from prometheus_client import generate_latest
    from prometheus_client.registry import CollectorRegistry

    from cube.client import ClientStats
    from cube.client.prometheus import ClientCollector

    stats = ClientStats()
    shards = [["dead:1", "a:1"], ["b:1"]]
    mock = MockTransport(handler_with_a_dead_replica, version="17")
    with CubeClient(shards, transport=mock, retry=2, stats=stats, load_balancer="rr",
                    seed=1) as client:  # fmt: skip
        for _ in range(4):
            client.seek(np.arange(0, 60, dtype=np.uint64))
    snap = stats.snapshot()
    assert snap["calls"] == {"ok": 4} and sum(snap["latency"]["counts"]) == 4
    shard0, shard1 = snap["shards"][0], snap["shards"][1]
    assert shard0["sub_requests"] == 4 and shard1["sub_requests"] == 4
    dead_first = shard0["retries"]  # rounds whose first try was the dead replica
    assert dead_first >= 1 and shard0["failovers"] == dead_first and shard0["failed"] == 0
    assert shard1 == {"sub_requests": 4, "retries": 0, "hedges": 0, "hedges_won": 0,
                      "failovers": 0, "failed": 0}  # fmt: skip
    assert [[0, "UNAVAILABLE", dead_first]] == snap["attempt_errors"]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ClientCollector(stats, dict_name="emb"))
    text = generate_latest(registry).decode()
    assert 'cube_client_calls_total{dict="emb",outcome="ok"} 4.0' in text
    assert f'cube_client_shard_failovers_total{{dict="emb",shard="0"}} {float(dead_first)}' in text


def test_errors_module_exports_every_error() -> None:
    """TransportError and DictNotChosenError live in cube.client.errors with the others."""
    import cube.client.errors as errors

    assert errors.TransportError is TransportError and issubclass(
        TransportError, cube.client.CubeError
    )
    assert errors.DictNotChosenError is cube.client.DictNotChosenError
    assert issubclass(errors.DictNotChosenError, ConfError)


class _SyncOnly:
    def call(self, address: str, request: bytes, timeout_s: float) -> bytes:
        raise TransportError("UNAVAILABLE", "never")

    def close(self) -> None:
        pass


class _AsyncOnly:  # (its close() is not awaited: the one SyncTransport has)
    def __init__(self) -> None:
        self.closed = 0

    async def acall(self, address: str, request: bytes, timeout_s: float) -> bytes:
        raise TransportError("UNAVAILABLE", "never")

    def close(self) -> None:
        self.closed += 1


def test_sync_and_async_transports_are_two_protocols() -> None:
    from cube.client import AsyncTransport, SyncTransport

    mock = MockTransport(lambda a, k: [])
    assert isinstance(mock, SyncTransport) and isinstance(mock, AsyncTransport)
    assert isinstance(_SyncOnly(), SyncTransport) and not isinstance(_SyncOnly(), AsyncTransport)
    assert not isinstance(object(), SyncTransport) and not isinstance(object(), AsyncTransport)
    assert isinstance(_AsyncOnly(), AsyncTransport) and not isinstance(_AsyncOnly(), SyncTransport)
    CubeClient([["h:1"]], transport=_SyncOnly()).close()
    with pytest.raises(ConfError, match=r"_AsyncOnly has no call.*needs a SyncTransport"):
        CubeClient([["h:1"]], transport=_AsyncOnly())  # type: ignore[arg-type]
    with pytest.raises(ConfError, match=r"_SyncOnly has no acall.*needs an AsyncTransport"):
        AsyncCubeClient([["h:1"]], transport=_SyncOnly())  # type: ignore[arg-type]


def test_types_are_precise() -> None:
    """keys are array-likes, get_embeddings returns NDArray (float32 by default, the dtype
    asked for otherwise), from_conf's overrides are the constructor's typed options."""
    import typing

    import numpy.typing as npt

    from cube.client import ClientOptions

    for cls in (CubeClient, AsyncCubeClient):
        assert typing.get_type_hints(cls.seek)["keys"] == npt.ArrayLike
        returns = [
            typing.get_type_hints(f)["return"] for f in typing.get_overloads(cls.get_embeddings)
        ]
        assert npt.NDArray[np.float32] in returns
        overrides = inspect.signature(cls.from_conf).parameters["overrides"]
        assert overrides.kind == inspect.Parameter.VAR_KEYWORD
        assert "Unpack[" in str(overrides.annotation) and "ClientOptions" in str(
            overrides.annotation
        )
    options = typing.get_type_hints(ClientOptions)
    constructor = set(inspect.signature(CubeClient).parameters) - {"shards", "dict_name"}
    assert set(options) == constructor


def test_a_closed_client_says_so() -> None:
    """As httpx: a call on a closed client raises ClientClosedError (a CubeError and a
    RuntimeError) naming the client; closing twice is fine; a closed client is not reopened."""
    from cube.client import ClientClosedError

    mock = MockTransport(lambda a, k: [b"v"] * len(k))
    client = CubeClient([["h:1"]], transport=mock, dict_name="emb", dim=1)
    client.close()
    client.close()
    calls: list[Callable[[], object]] = [
        lambda: client.seek([1]),
        lambda: client.get_embeddings([1], 1, dtype=np.uint8),
        lambda: client.wait_ready(),
        lambda: client.__enter__(),
    ]
    for call in calls:
        with pytest.raises(ClientClosedError, match="this CubeClient of dict 'emb' is closed"):
            call()
    assert issubclass(ClientClosedError, RuntimeError) and mock.calls == []

    async def run() -> None:
        transport = _AsyncOnly()
        aclient = AsyncCubeClient([["h:1"]], transport=transport)
        await aclient.aclose()
        await aclient.aclose()
        assert transport.closed == 1
        for call in (aclient.seek([1]), aclient.get_embeddings([1], 1), aclient.wait_ready()):
            with pytest.raises(ClientClosedError, match="this AsyncCubeClient is closed"):
                await call
        with pytest.raises(ClientClosedError):
            async with aclient:
                pass
        async with AsyncCubeClient([["h:1"]], transport=MockTransport(lambda a, k: [])) as other:
            pass
        with pytest.raises(ClientClosedError):
            await other.seek([1])

    asyncio.run(run())
