"""The SDK's compiled codec (cube/_sdk_jit.py via cube.client._compiled) against the numpy
paths it replaces, its reference: the same plans, answers and errors byte for byte (fixed and
variable width, misses, several shards, mod and murmur3, malformed answers), and a warmed
client that compiles nothing at its first calls."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from cube import wire
from cube.client import AsyncCubeClient, CubeClient, MockTransport, _compiled
from cube.client._core import Piece, assemble, embeddings, make_plan
from cube.client.options import Partitioner
from cube.kernel import read_only
from cube.kernel_constants import COMPILED
from cube.pb import cube_fast_pb2
from cube.wire import Answer, BadMessage

pytestmark = pytest.mark.skipif(not COMPILED, reason="numba not installed, or CUBE_KERNEL=numpy")


@pytest.fixture(autouse=True)
def warmed() -> Iterator[None]:
    assert _compiled.warm()
    yield


def numpy_path(call: Callable[[], Any]) -> Any:
    """`call()` on the numpy paths (the compiled codec switched off meanwhile)."""
    loops, _compiled._loops = _compiled._loops, None
    try:
        return call()
    finally:
        _compiled._loops = loops


def both(call: Callable[[], Any]) -> tuple[Any, Any]:
    assert _compiled.ready()
    return call(), numpy_path(call)


def outcome(call: Callable[[], Any]) -> Any:
    """What `call()` returned, or the error it raised (type and message)."""
    try:
        return call()
    except BadMessage as exc:
        return type(exc).__name__, str(exc)


def plan_bytes(pieces: list[Piece]) -> list[tuple[int, bytes, bytes]]:
    return [(p.shard, np.asarray(p.where).tobytes(), p.keys.tobytes()) for p in pieces]


def answer_bytes(answer: Answer) -> tuple[Any, ...]:
    column = answer.column
    return (
        answer.found.tobytes(),
        answer.found.dtype.str,
        column.blob.tobytes(),
        column.offsets.tobytes(),
        column.width,
        answer.version,
    )


RNG = np.random.default_rng(28)
KEYS = np.concatenate(
    [
        RNG.integers(0, 2**64, 997, dtype=np.uint64, endpoint=False),
        np.array([0, 2**64 - 1, 7], dtype=np.uint64),
    ]
)


@pytest.mark.parametrize("partitioner", ["mod", "murmur3"])
@pytest.mark.parametrize("shard_num", [2, 3, 7, 300])
@pytest.mark.parametrize("max_batch", [100_000, 64])
def test_plans_are_the_numpy_plans(partitioner: str, shard_num: int, max_batch: int) -> None:
    for keys in (KEYS, read_only(KEYS.copy()), KEYS[:1], KEYS[:0]):

        def plan(k: np.ndarray = keys) -> list[Piece]:
            return make_plan(k, shard_num, partitioner, max_batch)

        compiled, reference = both(plan)
        assert plan_bytes(compiled) == plan_bytes(reference)
    assert not _compiled.unwarmed


def response(
    found: list[bool], values: list[bytes], width: int, version: str = "v1", request_id: int = 9
) -> bytes:
    if width:
        return cube_fast_pb2.SeekResponse(
            found=bytes(found), values=b"".join(values), value_width=width, version=version,
            request_id=request_id,
        ).SerializeToString()  # fmt: skip
    offsets = np.zeros(len(values) + 1, np.uint64)
    np.cumsum([len(v) for v in values], out=offsets[1:])
    return cube_fast_pb2.SeekResponse(
        found=bytes(found), values=b"".join(values), offsets=offsets.astype("<u8").tobytes(),
        version=version, request_id=request_id,
    ).SerializeToString()  # fmt: skip


FIXED = response([True, False, True], [b"abcd", b"\0" * 4, b"wxyz"], 4)
VARIABLE = response([True, False, True], [b"a", b"", b"longer"], 0, "1565323045_1565326078")
OFFSETS = np.array([0, 1, 1, 7], "<u8").tobytes()  # VARIABLE's
MESSAGES = {
    "fixed": (FIXED, 3),
    "variable": (VARIABLE, 3),
    "fixed, no request id": (response([True], [b"12345678"], 8, request_id=0), 1),
    "empty": (b"", 0),
    "an unknown varint, fixed64 and fixed32 field": (
        FIXED + b"\x38\x96\x01" + b"\x41" + b"8 bytes." + b"\x4d" + b"4byt",
        3,
    ),
    "an unknown length-delimited field": (b"\x3a\x03abc" + FIXED, 3),
    "found repeated (the last wins)": (b"\x0a\x03\x00\x00\x00" + FIXED, 3),
    "a tag written in two bytes": (FIXED.replace(b"\x18\x04", b"\x98\x00\x04"), 3),
    "version repeated": (FIXED + b"\x2a\x02v2", 3),
    "version not UTF-8": (FIXED + b"\x2a\x02\xff\xfe", 3),
    "truncated": (FIXED[:-3], 3),
    "a field past the end": (FIXED + b"\x3a\x7f", 3),
    "wire type 3": (FIXED + b"\x3b", 3),
    "a 10-byte varint": (FIXED + b"\x38" + b"\xff" * 9 + b"\x7f", 3),
    "a varint that never ends": (FIXED + b"\x38" + b"\xff" * 12, 3),
    "a fixed64 past the end": (FIXED + b"\x41abc", 3),
    "too few found flags": (FIXED, 4),
    "a width past 2**62": (FIXED + b"\x18" + b"\xff" * 8 + b"\x7f", 3),
    "offsets out of order": (VARIABLE.replace(OFFSETS, np.array([0, 5, 1, 7], "<u8").tobytes()), 3),
}


@pytest.mark.parametrize("name", list(MESSAGES))
def test_answers_are_the_numpy_answers(name: str) -> None:
    data, n = MESSAGES[name]
    received = np.frombuffer(bytearray(data), np.uint8)  # as a lane receives: writable
    for buffer in (data, received.data, memoryview(data)):

        def decode(b: wire.Buffer = buffer) -> Any:
            return outcome(lambda: _compiled.decode(b, n))

        compiled, reference = both(decode)
        if isinstance(reference, Answer):
            assert isinstance(compiled, Answer)
            assert answer_bytes(compiled) == answer_bytes(reference)
            assert answer_bytes(reference) == answer_bytes(wire.decode_seek_response(data, n))
        else:
            assert compiled == reference
    assert not _compiled.unwarmed


def test_repeated_and_malformed_answers_are_left_to_the_reference() -> None:
    """The cases above that the scan hands back: a version it would not check, a message
    it cannot read (so the errors are the reference's own)."""
    fields = np.empty(9, np.int64)
    assert _compiled._loops is not None
    for name in ("version repeated", "truncated", "wire type 3", "a 10-byte varint"):
        data = np.frombuffer(MESSAGES[name][0], np.uint8)
        assert not _compiled._loops.scan_answer(data, fields), name
    assert _compiled._loops.scan_answer(np.frombuffer(FIXED, np.uint8), fields)


def shard_answers(
    pieces: list[Piece], widths: dict[int, int], misses: int = 3
) -> list[Answer | None]:
    """An answer per piece: a fixed width per shard (0: variable; -1: no answer), every
    `misses`th key not found."""
    answers: list[Answer | None] = []
    for piece in pieces:
        width = widths[piece.shard]
        if width < 0:
            answers.append(None)
            continue
        keys = piece.keys.tolist()
        found = [k % misses != 0 for k in keys]
        size = width or 5
        values = [bytes([k % 251]) * size if f else b"" for k, f in zip(keys, found, strict=True)]
        if width:
            values = [v or b"\0" * width for v in values]
        answers.append(wire.decode_seek_response(response(found, values, width), len(keys)))
    return answers


def result_bytes(result: Any) -> tuple[Any, ...]:
    column = result.column
    answered = None if result.answered_mask is None else result.answered_mask.tobytes()
    return (
        result.found.tobytes(),
        column.blob.tobytes(),
        column.offsets.tobytes(),
        column.width,
        result.version,
        answered,
    )


@pytest.mark.parametrize(
    "widths",
    [
        {0: 8, 1: 8, 2: 8},  # fixed
        {0: 0, 1: 0, 2: 0},  # variable
        {0: 8, 1: 0, 2: 8},  # mixed
        {0: 8, 1: -1, 2: 8},  # a shard without an answer
        {0: 8, 1: 8, 2: 4},  # two widths: the hits decide (all of one shard miss)
    ],
)
@pytest.mark.parametrize("partitioner", ["mod", "murmur3"])
def test_scattered_results_are_the_numpy_results(widths: dict[int, int], partitioner: str) -> None:
    misses = 1 if widths[2] == 4 else 3  # every key of shard 2 a miss: its width yields
    pieces = make_plan(KEYS, 3, partitioner, 256)
    answers = shard_answers(pieces, widths, misses)
    if widths[2] == 4:  # the other shards hit
        answers = [a if p.shard == 2 else shard_answers([p], widths, 3)[0]
                   for p, a in zip(pieces, answers, strict=True)]  # fmt: skip
    compiled, reference = both(lambda: assemble(KEYS, pieces, answers))
    assert result_bytes(compiled) == result_bytes(reference)
    assert not _compiled.unwarmed


TABLE = {int(k): int(k % 65521).to_bytes(4, "little") * 16 for k in KEYS[::2]}  # float32[16]
VARIABLE_TABLE = {int(k): b"x" * int(k % 7 + 1) for k in KEYS[::2]}


def clients(
    partitioner: Partitioner, table: dict[int, bytes]
) -> tuple[CubeClient, AsyncCubeClient]:
    def handler(address: str, keys: np.ndarray) -> dict[int, bytes]:
        return table

    shards = [[f"shard{i}:1"] for i in range(4)]
    transport = MockTransport(handler, version="7")
    return (
        CubeClient(shards, partitioner=partitioner, transport=transport, max_batch=300),
        AsyncCubeClient(shards, partitioner=partitioner, transport=transport, max_batch=300),
    )


@pytest.mark.parametrize("partitioner", ["mod", "murmur3"])
@pytest.mark.parametrize("table", [TABLE, VARIABLE_TABLE], ids=["fixed", "variable"])
def test_clients_answer_the_same_either_way(
    partitioner: Partitioner, table: dict[int, bytes]
) -> None:
    sync, aio = clients(partitioner, table)

    def calls() -> list[Any]:
        results: list[Any] = [result_bytes(sync.seek(KEYS)), result_bytes(sync.seek(KEYS[:1]))]

        async def both_apis() -> list[Any]:
            got: list[Any] = [result_bytes(await aio.seek(KEYS))]
            if table is TABLE:
                got.append((await aio.get_embeddings(KEYS, 16)).tobytes())
            return got

        results += asyncio.run(both_apis())
        if table is TABLE:
            results.append(sync.get_embeddings(KEYS, 16).tobytes())
        return results

    compiled, reference = both(calls)
    assert compiled == reference
    assert not _compiled.unwarmed


def test_a_warmed_client_compiles_nothing_at_its_first_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """warm() (a client's background load, `python -m cube.kernel_cache` at install) covers
    every signature a client's calls need: its first calls run the compiled loops, and none
    of them compiles (a compile would hold a request for a second)."""
    ran: list[str] = []
    sealed = _compiled._sealed

    def spy(function: Any, *args: Any) -> Any:
        ran.append(function.__name__)
        return sealed(function, *args)

    monkeypatch.setattr(_compiled, "_sealed", spy)
    signatures = [len(d.signatures) for d in _compiled.dispatchers()]
    sync, aio = clients("murmur3", TABLE)
    sync.seek(KEYS)
    sync.get_embeddings(read_only(KEYS.copy()), 16)
    asyncio.run(aio.seek(KEYS))
    assert {"group_keys", "scan_answer", "scatter_fixed"} <= set(ran)
    assert [len(d.signatures) for d in _compiled.dispatchers()] == signatures
    assert not _compiled.unwarmed


def test_the_codec_loads_in_wait_ready_and_never_during_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Loading numba holds the GIL for tens of milliseconds at a time: it must not happen in
    the background of a client that is serving (it did after the 256th call), only in the
    step a program takes before it serves."""
    loaded: list[str] = []

    def recorder(what: str) -> Callable[[], bool]:
        def record() -> bool:
            loaded.append(what)
            return True

        return record

    monkeypatch.setattr(_compiled, "_started", False)  # (not loaded yet in this process)
    monkeypatch.setattr(_compiled, "load", recorder("load"))
    monkeypatch.setattr(_compiled, "warm", recorder("warm"))
    sync, aio = clients("mod", TABLE)
    for _ in range(300):
        sync.seek(KEYS[:3])

    async def calls() -> None:
        for _ in range(300):
            await aio.seek(KEYS[:3])

    asyncio.run(calls())
    assert not loaded
    sync.wait_ready(1)
    assert loaded == ["load"]
    asyncio.run(aio.wait_ready(1))
    assert loaded == ["load", "load"]  # (once per process: _compiled.load's own guard)


def test_load_runs_the_warm_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    warmed: list[int] = []

    def warm() -> bool:
        warmed.append(1)
        return True

    monkeypatch.setattr(_compiled, "_started", False)
    monkeypatch.setattr(_compiled, "warm", warm)
    _compiled.load()
    _compiled.load()
    assert warmed == [1]


def test_embeddings_of_scattered_rows_match() -> None:
    pieces = make_plan(KEYS, 3, "mod")
    answers = shard_answers(pieces, {0: 64, 1: 64, 2: 64})
    compiled, reference = both(
        lambda: embeddings(assemble(KEYS, pieces, answers), 16, own=True).tobytes()
    )
    assert compiled == reference
