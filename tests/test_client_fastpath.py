"""The SDK's fast path (a batch of one sub-request runs its first attempt without the state
machine) against the state machine itself: the same results, errors, attempts, replica
health and statistics, whatever the first attempt comes to. Also the wire decoder's fast
field scan against the generic one, and get_embeddings' view of the received buffer."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any, TypeAlias

import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import example, given, settings
from hypothesis import strategies as st

from cube.client import (
    AsyncCubeClient,
    ClientStats,
    CubeClient,
    CubeError,
    MockTransport,
    Retry,
    Timeouts,
    TransportError,
)
from cube.client._core import SeekResult, embeddings
from cube.client.mock import _response
from cube.pb import cube_fast_pb2
from cube.wire import BadMessage, _scan_response, _varint, decode_seek_response, varint

KEYS = np.arange(10, 20, dtype=np.uint64)

Step: TypeAlias = Callable[[str, bytes], bytes]  # one answer of a Scripted transport
Outcome: TypeAlias = tuple[object, ...]  # what a seek came to (_outcome)
# a client's three seeks: their outcomes, the replicas called, the stats and replica health
Run: TypeAlias = tuple[list[Outcome], list[str], tuple[Any, ...]]


class Scripted:
    """A transport answering each call with the next of `script` (a callable of (address,
    request) -> bytes, which may raise TransportError); the last one repeats."""

    def __init__(self, script: list[Callable[[str, bytes], bytes]]) -> None:
        self.script = script
        self.calls: list[str] = []

    def call(self, address: str, request: bytes, timeout_s: float) -> bytes:
        step = self.script[min(len(self.calls), len(self.script) - 1)]
        self.calls.append(address)
        return step(address, request)

    async def acall(self, address: str, request: bytes, timeout_s: float) -> bytes:
        return self.call(address, request, timeout_s)

    def close(self) -> None:
        pass


def good(version: str = "7") -> Callable[[str, bytes], bytes]:
    mock = MockTransport(lambda address, keys: [bytes(8) + k.tobytes() for k in keys], version)
    return lambda address, request: mock.call(address, request, 1.0)


def fail(code: str) -> Callable[[str, bytes], bytes]:
    def step(address: str, request: bytes) -> bytes:
        raise TransportError(code, f"{code.lower()} at {address}")

    return step


def garbage(address: str, request: bytes) -> bytes:
    return b"\x0f\x00"


def unversioned(address: str, request: bytes) -> bytes:
    return _response([b"x" * 16] * KEYS.shape[0], "", 0)


SCRIPTS = {
    "answers": [good()],
    "down then the other replica": [fail("UNAVAILABLE"), good()],
    "timeout then the other replica": [fail("DEADLINE_EXCEEDED"), good()],
    "every replica down": [fail("UNAVAILABLE")],
    "rejected": [fail("INVALID_ARGUMENT")],
    "bad answer then good": [garbage, good()],
    "serves nothing then good": [unversioned, good()],
    "another version": [good("6")],
}


def _outcome(run: Callable[[], SeekResult]) -> Outcome:
    try:
        result = run()
    except CubeError as exc:
        return _described(exc)
    return _described(result)


def _described(answer: SeekResult | CubeError) -> Outcome:
    """A seek's result or error as comparable values."""
    if isinstance(answer, CubeError):
        partial = getattr(answer, "result", None)
        found = None if partial is None else partial.found.tolist()
        return type(answer).__name__, str(answer).split(" (request id")[0], found
    assert isinstance(answer, SeekResult)
    return "ok", answer.version, answer.found.tolist(), answer.column.as_rows().tobytes()


def _state(client: CubeClient | AsyncCubeClient, stats: ClientStats) -> tuple[Any, ...]:
    snapshot = stats.snapshot()
    del snapshot["latency"]
    endpoints = [
        (e.address, e.inflight, e.failures, e.down_until > 0) for e in client._cluster.endpoints
    ]
    return snapshot, endpoints


def _run_sync(script: list[Step], fast: bool, version: str | None) -> Run:
    transport, stats = Scripted(script), ClientStats()
    client = CubeClient([["a:1", "b:1"]], transport=transport, retry=Retry(attempts=2),
                        stats=stats, seed=5)  # fmt: skip
    client._lone_fast = fast
    with client:
        outcomes = [_outcome(lambda: client.seek(KEYS, version)) for _ in range(3)]
        return outcomes, transport.calls, _state(client, stats)


def _run_async(script: list[Step], fast: bool, version: str | None) -> Run:
    async def run() -> Run:
        transport, stats = Scripted(script), ClientStats()
        client = AsyncCubeClient([["a:1", "b:1"]], transport=transport,
                                 retry=Retry(attempts=2), stats=stats, seed=5)  # fmt: skip
        client._lone_fast = fast
        async with client:
            outcomes = []
            for _ in range(3):
                try:
                    outcomes.append(_described(await client.seek(KEYS, version)))
                except CubeError as exc:
                    outcomes.append(_described(exc))
            return outcomes, transport.calls, _state(client, stats)

    return asyncio.run(run())


@pytest.mark.parametrize("version", [None, "7"])
@pytest.mark.parametrize("case", list(SCRIPTS))
@pytest.mark.parametrize("runner", [_run_sync, _run_async], ids=["sync", "async"])
def test_fast_path_does_what_the_state_machine_does(
    runner: Callable[[list[Step], bool, str | None], Run], case: str, version: str | None
) -> None:
    fast = runner(SCRIPTS[case], True, version)
    slow = runner(SCRIPTS[case], False, version)
    assert fast == slow


def test_the_fast_path_is_taken_and_counted() -> None:
    stats = ClientStats()
    transport = Scripted([good()])
    with CubeClient([["a:1"]], transport=transport, stats=stats) as client:
        assert client._lone_fast
        for _ in range(5):
            assert client.seek(KEYS).found.all()
        assert client._cluster.endpoints[0].inflight == 0
    snapshot = stats.snapshot()
    assert snapshot["calls"] == {"ok": 5}
    assert snapshot["shards"][0]["sub_requests"] == 5 and transport.calls == ["a:1"] * 5


def test_backup_requests_keep_the_state_machine() -> None:
    client = CubeClient([["a:1", "b:1"]], transport=Scripted([good()]),
                        timeout=Timeouts(1.0, 0.01))  # fmt: skip
    with client:
        assert not client._lone_fast and client.seek(KEYS).found.all()


# ---------------------------------------------------------------------------------------------
# wire


def _message(fields: list[tuple[int, int, Any]]) -> bytes:
    out = bytearray()
    for number, wire_type, value in fields:
        out += varint(number << 3 | wire_type)
        if wire_type == 0:
            out += varint(value)
        elif wire_type == 2:
            out += varint(len(value)) + value
        elif wire_type == 1:
            out += bytes(8)
        else:
            out += bytes(4)
    return bytes(out)


NUMBER = st.one_of(st.integers(1, 6), st.integers(7, 40))  # half of them SeekResponse's own
FIELD = st.one_of(
    st.tuples(NUMBER, st.just(2), st.binary(max_size=300)),
    st.tuples(NUMBER, st.just(0), st.integers(0, 2**64 - 1)),
    st.tuples(NUMBER, st.sampled_from([1, 5]), st.none()),
)


@settings(max_examples=600, deadline=None)
@given(fields=st.lists(FIELD, max_size=8), cut=st.integers(0, 400), junk=st.binary(max_size=2))
@example(  # every field of SeekResponse twice: the last one wins
    fields=[
        (n, 0, len(v)) if n in (3, 6) else (n, 2, v) for v in (b"ab", b"cde") for n in range(1, 7)
    ],
    cut=400,
    junk=b"",
).via("repeated fields")
@example(fields=[(5, 2, b"\x80"), (5, 2, b"")], cut=400, junk=b"").via(
    "a version that is not UTF-8, then a good one: protobuf refuses the message"
)
def test_response_scan_reads_what_protobuf_reads(
    fields: list[tuple[int, int, Any]], cut: int, junk: bytes
) -> None:
    """The SDK's one-pass scan against the generated class on any mix of known, unknown,
    repeated and damaged fields: same fields, same errors (the width is a uint32 to protobuf,
    which keeps the low 32 bits of a larger varint)."""
    data = _message(fields)
    data = data[: min(cut, len(data))] + junk if cut < len(data) else data
    try:
        message = cube_fast_pb2.SeekResponse.FromString(data)
    except DecodeError:
        with pytest.raises(BadMessage):
            _scan_response(memoryview(data))
        return
    found_at, found_length, values_at, values_length, width, offsets_at, offsets_length, version = (
        _scan_response(memoryview(data))
    )
    assert data[found_at : found_at + found_length] == message.found
    assert data[values_at : values_at + values_length] == message.values
    assert data[offsets_at : offsets_at + offsets_length] == message.offsets
    assert width & 0xFFFFFFFF == message.value_width
    assert version == message.version


@given(st.integers(0, 2**64 - 1))
def test_request_id_varint(value: int) -> None:
    assert _varint(value) == varint(value)


def test_request_id_varint_edges_and_runs() -> None:
    for value in (0, 127, 128, 2**42 - 1, 2**42, 2**48 - 1, 2**49 - 1, 2**49, 2**64 - 1):
        assert _varint(value) == varint(value)
    for value in range(2**47 - 300, 2**47 + 300):  # a client's ids count up
        assert _varint(value) == varint(value)


def test_request_ids_are_fresh_for_every_call() -> None:
    client = CubeClient([["a:1"]], transport=Scripted([good()]))
    ids = [client._request_id() for _ in range(1000)]
    assert len(set(ids)) == 1000 and all(0 < i < 2**48 for i in ids)


# ---------------------------------------------------------------------------------------------
# get_embeddings: a view of the answer's buffer when it can be


def _received(found: list[bool], rows: np.ndarray, shift: int = 0) -> memoryview:
    """A response in a writable buffer (as a lane receives it), `shift` bytes in."""
    data = _response([r.tobytes() if f else None for f, r in zip(found, rows, strict=True)], "1", 0)
    buffer = np.zeros(len(data) + shift, np.uint8)
    buffer[shift:] = np.frombuffer(data, np.uint8)
    return buffer.data[shift:]


def _result(data: memoryview | bytes, n: int) -> SeekResult:
    answer = decode_seek_response(data, n)
    return SeekResult(np.arange(n, dtype=np.uint64), answer.found, answer.column, answer.version)


def test_embeddings_view_the_received_rows_when_aligned_and_writable() -> None:
    rows = np.arange(40, dtype=np.float32).reshape(10, 4)
    for shift in range(16):
        result = _result(_received([True] * 10, rows, shift), 10)
        aligned = result.column.blob.ctypes.data % 4 == 0
        out = embeddings(result, 4, own=True)
        assert out.dtype == np.float32 and out.flags.aligned and out.flags.writeable
        assert (out == rows).all()
        assert np.shares_memory(out, result.column.blob) == aligned


def test_embeddings_zero_the_rows_of_misses_whatever_the_answer_held() -> None:
    rows = np.ones((4, 2), dtype=np.float32)
    result = _result(_received([True, False, True, False], rows), 4)
    result.column.blob[3 * 8 :] = 0xFF  # garbage in the last miss's row
    for own in (True, False):
        out = embeddings(result, 2, own=own)
        assert out.tolist() == [[1, 1], [0, 0], [1, 1], [0, 0]]


def test_embeddings_copy_what_they_must_not_share() -> None:
    rows = np.arange(8, dtype=np.float32).reshape(4, 2)
    data = bytes(_received([True] * 4, rows))  # read-only bytes (gRPC, a mock)
    result = _result(data, 4)
    out = embeddings(result, 2, own=True)
    assert out.flags.writeable and (out == rows).all()
    kept = _result(_received([True] * 4, rows), 4)
    out = embeddings(kept, 2)  # the caller keeps the result: never a view of it
    out[:] = 0
    assert kept.column.as_rows().view(np.float32).tolist() == rows.tolist()


# ---------------------------------------------------------------------------------------------
# Against a real server over the TCP lanes (blocking and asyncio)


@pytest.fixture(scope="module")
def one_shard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from helpers.procs import fixed_values, start_server, write_version

    keys = np.arange(0, 20_000, 2, dtype=np.uint64)  # odd keys are misses
    data = tmp_path_factory.mktemp("fastpath") / "data"
    write_version(data, "5", keys, fixed_values(keys, 64), current=True)
    server = start_server(data)
    try:
        yield server.address
    finally:
        server.stop()


def _expected(keys: np.ndarray) -> np.ndarray:
    from helpers.procs import expected_fixed

    rows = expected_fixed(keys, 64).view(np.float32).copy()
    rows[keys % 2 == 1] = 0
    return rows


SIZES = [1, 7, 1000, 999, 1000, 3, 1000]


@pytest.mark.slow
def test_lane_answers_become_aligned_views(one_shard: str) -> None:
    rng = np.random.default_rng(0)
    with CubeClient([[one_shard]]) as client:
        for size in SIZES:
            keys = rng.integers(0, 20_000, size, dtype=np.uint64)
            out = client.get_embeddings(keys, 16)
            assert out.flags.aligned and out.flags.writeable and out.shape == (size, 16)
            assert (out == _expected(keys)).all()
            if size > 1:  # the width known (from the answers so far): views, whatever the size
                assert not out.flags.owndata
        assert client.seek(keys).version == "5"


@pytest.mark.slow
def test_asyncio_lane_pipelined_answers(one_shard: str) -> None:
    rng = np.random.default_rng(1)
    batches = [rng.integers(0, 20_000, SIZES[i % len(SIZES)], dtype=np.uint64) for i in range(60)]

    async def run() -> list[np.ndarray]:
        async with AsyncCubeClient([[one_shard]]) as client:
            await client.seek([0])  # first contact: the lane
            return await asyncio.gather(*(client.get_embeddings(b, 16) for b in batches))

    for keys, out in zip(batches, asyncio.run(run()), strict=True):
        assert out.flags.aligned and out.flags.writeable  # answers read together: copies
        assert (out == _expected(keys)).all()


@pytest.mark.slow
def test_asyncio_lane_answers_one_at_a_time_become_views(one_shard: str) -> None:
    rng = np.random.default_rng(2)

    async def run() -> None:
        async with AsyncCubeClient([[one_shard]]) as client:
            for size in SIZES:
                keys = rng.integers(0, 20_000, size, dtype=np.uint64)
                out = await client.get_embeddings(keys, 16)
                assert out.flags.aligned and out.flags.writeable and out.shape == (size, 16)
                assert (out == _expected(keys)).all()
                if size > 1:
                    assert not out.flags.owndata

    asyncio.run(run())
