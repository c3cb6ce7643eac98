"""SDK pure core: keys, plans, wire bytes, scatter, embeddings, the version rule."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cube.client._core import (
    OriginalProtocol,
    Piece,
    PieceOutcome,
    PieceRequest,
    SeekResult,
    assemble,
    embeddings,
    make_plan,
    normalize_keys,
    seek_flow,
    version_order,
)
from cube.client.errors import (
    Attempt,
    KeyRangeError,
    KeyShapeError,
    RequestRejectedError,
    ShardUnavailableError,
    ValueSizeError,
    VersionMismatchError,
)
from cube.pb import cube_fast_pb2, cube_pb2
from cube.routing import shard_of
from cube.values import ValueColumn
from cube.wire import Answer, BadMessage, decode_seek_response, encode_seek_request

# ---------------------------------------------------------------------------------------------
# keys


def test_normalize_keys_accepts_ints_and_arrays() -> None:
    assert normalize_keys([1, 2**64 - 1]).tolist() == [1, 2**64 - 1]
    assert normalize_keys(np.array([3, 4], dtype=np.int64)).dtype == np.uint64
    assert normalize_keys(np.array([5], dtype=np.uint32)).tolist() == [5]
    array = np.arange(4, dtype=np.uint64)
    assert normalize_keys(array) is array or normalize_keys(array).base is array
    assert normalize_keys([]).shape == (0,)
    assert normalize_keys(7).tolist() == [7]


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ([1, -5, 3], "key -5 at position 1"),
        ([0, 2**64], "key 18446744073709551616 at position 1 is outside"),
        (np.array([4, -1]), "key -1 at position 1 is negative"),
        (np.array([1.5]), "dtype float64"),
        ([1, "x"], "'x' at position 1 is not an integer"),
        ([1000003.7], "key 1000003.7 at position 0 is not an integer"),
        ([5, 2.0], "key 2.0 at position 1 is not an integer"),  # whole, but a float
        ([np.float32(3)], "at position 0 is not an integer"),
        ([2**64 - 1, -1], "key -1 at position 1 is outside"),
        (1000003.7, "keys must be integers"),
        ("123", "keys must be integers"),
    ],
)
def test_normalize_keys_names_the_bad_key(keys: Any, message: str) -> None:  # Any: bad on purpose
    with pytest.raises(KeyRangeError, match=message):
        normalize_keys(keys)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (True, "key True is a bool"),
        (False, "key False is a bool"),
        (np.True_, "is a bool"),
        (np.array([True, False]), "dtype bool"),
        ([True, False, True], "dtype bool"),
    ],
)
def test_normalize_keys_refuses_bools(keys: Any, message: str) -> None:
    """True and False are not keys 1 and 0 (a mask passed by mistake must not be looked up)."""
    with pytest.raises(KeyRangeError, match=message) as info:
        normalize_keys(keys)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (np.arange(6, dtype=np.uint64).reshape(2, 3), r"2-D array of shape \(2, 3\)"),
        (np.arange(6, dtype=np.int64).reshape(3, 2), r"2-D array of shape \(3, 2\)"),
        ([[1, 2], [3, 4]], "keys must be 1-D"),
        (np.zeros((2, 2, 2), dtype=np.uint32), "3-D array"),
        ({3, 1, 2}, "keys in a set have no order"),
        (frozenset([5, 6]), "keys in a frozenset have no order"),
    ],
)
def test_normalize_keys_refuses_shapes_without_one_request_order(keys: Any, message: str) -> None:
    with pytest.raises(KeyShapeError, match=message) as info:
        normalize_keys(keys)
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)


def test_normalize_keys_keeps_ordered_collections() -> None:
    """Collections with an order stay accepted: a dict's keys, a tuple, a generator."""
    # accepted at run time, though npt.ArrayLike (the SDK's annotation of keys) says no
    assert normalize_keys({9: "a", 4: "b"}.keys()).tolist() == [9, 4]  # type: ignore[arg-type]
    assert normalize_keys((3, 1, 2)).tolist() == [3, 1, 2]
    assert normalize_keys(k for k in (8, 7)).tolist() == [8, 7]  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# plan


@pytest.mark.parametrize("partitioner", ["mod", "murmur3"])
def test_plan_routes_like_the_builder_and_covers_every_key_once(partitioner: str) -> None:
    keys = np.random.default_rng(1).integers(0, 2**63, 1000, dtype=np.uint64)
    pieces = make_plan(keys, 3, partitioner, max_batch=100)
    owner = shard_of(keys, 3, partitioner)
    seen = np.zeros(1000, dtype=int)
    for piece in pieces:
        assert piece.size <= 100
        assert (owner[piece.where] == piece.shard).all()
        assert (keys[piece.where] == piece.keys).all()
        seen[piece.where] += 1
    assert (seen == 1).all()


def test_plan_takes_a_limit_per_shard() -> None:
    keys = np.arange(40, dtype=np.uint64)
    pieces = make_plan(keys, 2, "mod", [3, 100])
    assert [p.size for p in pieces if p.shard == 0] == [3] * 6 + [2]
    assert [p.size for p in pieces if p.shard == 1] == [20]
    assert np.concatenate([p.keys for p in pieces if p.shard == 0]).tolist() == keys[::2].tolist()
    assert [p.size for p in make_plan(keys, 1, "mod", [16])] == [16, 16, 8]


def test_first_contact_metadata_states_routing_and_max_batch() -> None:
    from cube.client._transport import contact_of

    assert contact_of([("cube-max-batch", "7"), ("cube-tcp-port", "9")]).max_batch == 7
    for bad in ("0", "-1", "x", ""):
        assert contact_of([("cube-max-batch", bad)]).max_batch is None
    assert contact_of([]).max_batch is None and contact_of(None).routing is None


def test_plan_skips_shards_without_keys_and_uses_slices_for_one_shard() -> None:
    keys = np.array([0, 2, 4], dtype=np.uint64)
    assert [p.shard for p in make_plan(keys, 2, "mod")] == [0]
    pieces = make_plan(np.arange(250, dtype=np.uint64), 1, "mod", max_batch=100)
    assert [p.where for p in pieces] == [slice(0, 100), slice(100, 200), slice(200, 250)]
    assert make_plan(np.empty(0, np.uint64), 4, "mod") == []


# ---------------------------------------------------------------------------------------------
# wire


@settings(max_examples=50, deadline=None)
@given(
    keys=st.lists(st.integers(0, 2**64 - 1), max_size=50),
    dict_name=st.text(max_size=10),
    version=st.text(max_size=20),
    request_id=st.integers(0, 2**64 - 1),
)
def test_encode_seek_request_is_what_protobuf_reads(
    keys: list[int], dict_name: str, version: str, request_id: int
) -> None:
    data = encode_seek_request(np.array(keys, dtype=np.uint64), dict_name, version, request_id)
    parsed = cube_fast_pb2.SeekRequest.FromString(data)
    assert np.frombuffer(parsed.keys, "<u8").tolist() == keys
    assert (parsed.dict_name, parsed.version, parsed.request_id) == (dict_name, version, request_id)


def _response(
    found: list[int],
    values: bytes,
    width: int = 0,
    offsets: list[int] | None = None,
    version: str = "v1",
    request_id: int = 9,
) -> bytes:
    message = cube_fast_pb2.SeekResponse(
        found=bytes(found), values=values, value_width=width, version=version, request_id=request_id
    )
    if offsets is not None:
        message.offsets = np.asarray(offsets, "<u8").tobytes()
    return message.SerializeToString()


def test_decode_fixed_width_response_without_copy() -> None:
    data = _response([1, 0, 1], b"aa" + b"\0\0" + b"cc", width=2, version="123_456")
    answer = decode_seek_response(data, 3)
    assert answer.found.tolist() == [True, False, True]
    assert answer.column.width == 2 and answer.column.as_rows().tobytes() == b"aa\0\0cc"
    assert answer.version == "123_456"
    assert answer.column.blob.base is not None  # a view on the response bytes


def test_decode_variable_response() -> None:
    data = _response([1, 0, 1, 1], b"xyzab", offsets=[0, 3, 3, 3, 5])
    answer = decode_seek_response(data, 4)
    assert answer.column.width == 0
    assert answer.column.to_list() == [b"xyz", b"", b"", b"ab"]
    empty = decode_seek_response(_response([], b"", offsets=[0]), 0)
    assert empty.found.shape == (0,)


@pytest.mark.parametrize(
    ("data", "n", "message"),
    [
        (_response([1, 1], b"abcd", width=2), 3, "2 found flags for 3 keys"),
        (_response([1, 1], b"abc", width=2), 2, "3 value bytes"),
        (_response([1, 1], b"ab", offsets=[0, 1]), 2, "2 offsets for 2 keys"),
        (_response([1, 1], b"ab", offsets=[0, 2, 1]), 2, "out of order"),
        (_response([1, 1], b"ab", offsets=[0, 1, 9]), 2, "beyond 2"),
        (b"\x0a\x05ab", 2, "past the end"),
        (b"\x0f", 0, "wire type 7"),
    ],
)
def test_decode_rejects_responses_that_do_not_match(data: bytes, n: int, message: str) -> None:
    with pytest.raises(BadMessage, match=message):
        decode_seek_response(data, n)


def test_original_protocol_roundtrip() -> None:
    wire = OriginalProtocol()
    request = cube_pb2.DictRequest.FromString(wire.encode(np.array([5, 6], np.uint64), "", None))
    assert list(request.keys) == [5, 6] and request.version_required
    reply = cube_pb2.DictResponse(
        values=[
            cube_pb2.DictValue(status=0, value=b"abc"),
            cube_pb2.DictValue(status=0xFFFFFFFF, value=b""),
        ],
        version="7",
    ).SerializeToString()
    answer = wire.decode(reply, 2)
    assert answer.found.tolist() == [True, False]
    assert answer.column.to_list() == [b"abc", b""] and answer.version == "7"
    with pytest.raises(BadMessage, match="1 values for 2 keys"):
        wire.decode(
            cube_pb2.DictResponse(
                values=[cube_pb2.DictValue(status=0, value=b"")]
            ).SerializeToString(),
            2,
        )


# ---------------------------------------------------------------------------------------------
# assemble (scatter) and embeddings


def _answer_for(
    keys: np.ndarray, table: dict[int, bytes], width: int, version: str = "v1"
) -> Answer:
    """What a server holding `table` (key -> bytes) answers for `keys`."""
    found = np.array([int(k) in table for k in keys], dtype=bool)
    if width:
        rows = b"".join(table.get(int(k), b"\0" * width) for k in keys)
        column = ValueColumn.fixed(np.frombuffer(rows, np.uint8).copy(), width)
    else:
        column = ValueColumn.from_list([table.get(int(k), b"") for k in keys]).as_variable()
    return Answer(found, column, version)


@pytest.mark.parametrize("width", [0, 4])
@pytest.mark.parametrize("shards", [1, 3])
def test_assemble_scatters_into_request_order(width: int, shards: int) -> None:
    rng = np.random.default_rng(width + shards)
    keys = rng.integers(0, 60, 200, dtype=np.uint64)
    table = {k: (bytes([k % 256]) * (width or 1 + k % 5)) for k in range(0, 60, 2)}
    pieces = make_plan(keys, shards, "mod", max_batch=32)
    answers = [_answer_for(p.keys, table, width) for p in pieces]
    result = assemble(keys, pieces, answers)
    assert result.version == "v1" and result.answered.all()
    assert result.values == [table.get(int(k)) for k in keys]
    assert result.found.tolist() == [int(k) in table for k in keys]
    assert result.width == width


def test_assemble_mixed_widths_falls_back_to_variable_and_marks_unanswered() -> None:
    keys = np.arange(6, dtype=np.uint64)
    pieces = make_plan(keys, 3, "mod")
    table = {0: b"aaaa", 3: b"bbbb", 1: b"c", 4: b"dd"}
    answers = [
        _answer_for(pieces[0].keys, table, 4),
        _answer_for(pieces[1].keys, table, 0),
        None,
    ]
    result = assemble(keys, pieces, answers)
    assert result.values == [b"aaaa", b"c", None, b"bbbb", b"dd", None]
    assert result.answered.tolist() == [True, True, False, True, True, False]
    assert not result.found[[2, 5]].any()


def test_embeddings_zero_rows_for_misses_and_size_errors_name_the_key() -> None:
    keys = np.array([10, 11, 12], dtype=np.uint64)
    vectors = {10: np.array([1.5, 2.5], np.float32), 12: np.array([-1, 4], np.float32)}
    table = {k: v.tobytes() for k, v in vectors.items()}
    for width in (8, 0):
        pieces = make_plan(keys, 2, "mod")
        result = assemble(keys, pieces, [_answer_for(p.keys, table, width) for p in pieces])
        out = embeddings(result, 2)
        assert out.dtype == np.float32 and out.shape == (3, 2)
        assert out.tolist() == [[1.5, 2.5], [0, 0], [-1, 4]]
        out[0, 0] = 9  # writable
    pieces = make_plan(keys, 1, "mod")
    bad = assemble(keys, pieces, [_answer_for(keys, {10: b"12345678", 12: b"123"}, 0)])
    with pytest.raises(ValueSizeError, match=r"key 12 \(position 2\) has 3 bytes; expected dim 2"):
        embeddings(bad, 2)
    with pytest.raises(ValueSizeError, match="key 10"):
        embeddings(assemble(keys, pieces, [_answer_for(keys, table, 8)]), 4)


# ---------------------------------------------------------------------------------------------
# versions


def test_version_order() -> None:
    names = ["1565323045_1565326078", "", "1565323045", "1565400000", "2", "10"]
    assert sorted(names, key=version_order) == [
        "",
        "2",
        "10",
        "1565323045",
        "1565323045_1565326078",
        "1565400000",
    ]


class FakeShards:
    """Answers flow rounds as shards would: `held[shard]` = versions (current first)."""

    def __init__(
        self,
        held: dict[int, list[str] | PieceOutcome],
        table: dict[int, bytes],
        width: int = 4,
        pins: bool = True,
    ) -> None:
        self.held = held
        self.table = table
        self.width = width
        self.pins = pins
        self.rounds: list[list[PieceRequest]] = []

    def run(
        self,
        keys: np.ndarray,
        pieces: list[Piece],
        version: str | None = None,
        max_rounds: int = 3,
    ) -> SeekResult:
        flow = seek_flow(keys, pieces, assemble, self.pins, max_rounds, version)
        try:
            requests = next(flow)
            while True:
                self.rounds.append(requests)
                requests = flow.send([self.answer(pieces[r.piece], r.version) for r in requests])
        except StopIteration as stop:
            result: SeekResult = stop.value  # the flow's return value
            return result

    def answer(self, piece: Piece, version: str | None) -> PieceOutcome:
        held = self.held[piece.shard]
        if isinstance(held, PieceOutcome):
            return held
        if version is None:
            version = held[0]
        elif version not in held:
            attempt = Attempt(f"shard{piece.shard}", "FAILED_PRECONDITION", "not held")
            return PieceOutcome(None, (attempt,), version_unavailable=True)
        return PieceOutcome(_answer_for(piece.keys, self.table, self.width, version))


def _pieces(shards: int = 3) -> tuple[np.ndarray, list[Piece]]:
    keys = np.arange(12, dtype=np.uint64)
    return keys, make_plan(keys, shards, "mod")


def test_flow_single_version_takes_one_round() -> None:
    keys, pieces = _pieces()
    fake = FakeShards({0: ["5"], 1: ["5"], 2: ["5"]}, {1: b"abcd"})
    result = fake.run(keys, pieces)
    assert result.version == "5" and len(fake.rounds) == 1
    assert all(r.version is None for r in fake.rounds[0])


def test_flow_reasks_older_shards_for_the_newest_version() -> None:
    keys, pieces = _pieces()
    # Shard 1 answers the first round from 5, then switches to 6 (and keeps 5 as previous).
    fake = FakeShards({0: ["6", "5"], 1: ["5", "6"], 2: ["6", "5"]}, {1: b"abcd"})
    result = fake.run(keys, pieces)
    assert result.version == "6"
    assert [(r.piece, r.version) for r in fake.rounds[1]] == [(1, "6")]


def test_flow_falls_back_to_the_older_version_while_the_newest_is_not_everywhere() -> None:
    keys, pieces = _pieces()
    fake = FakeShards({0: ["6", "5"], 1: ["5"], 2: ["5"]}, {1: b"abcd"})
    result = fake.run(keys, pieces)
    assert result.version == "5" and result.values[1] == b"abcd"
    assert [(r.piece, r.version) for r in fake.rounds[1]] == [(1, "6"), (2, "6")]
    assert [(r.piece, r.version) for r in fake.rounds[2]] == [(0, "5")]


def test_flow_raises_when_no_version_is_everywhere() -> None:
    keys, pieces = _pieces()
    fake = FakeShards({0: ["7"], 1: ["6"], 2: ["5"]}, {})
    with pytest.raises(VersionMismatchError, match=r"shard 0: 7.*shard 2: 5") as info:
        fake.run(keys, pieces)
    assert info.value.tried == ["7", "6", "5"]
    with pytest.raises(VersionMismatchError):
        FakeShards({0: ["7"], 1: ["6"], 2: ["5"]}, {}).run(keys, pieces, max_rounds=1)


def test_flow_without_pinning_reasks_until_one_version_is_complete() -> None:
    keys, pieces = _pieces(2)
    answers = iter(["5", "6"])  # shard 1 switches to 6 between rounds

    class Switching(FakeShards):
        def answer(self, piece: Piece, version: str | None) -> PieceOutcome:
            assert version is None
            current = "6" if piece.shard == 0 else next(answers)
            return PieceOutcome(_answer_for(piece.keys, {}, 4, current))

    fake = Switching({0: ["6"], 1: ["5"]}, {}, pins=False)
    assert fake.run(keys, pieces).version == "6"


def test_flow_failed_shard_raises_with_partial_result() -> None:
    keys, pieces = _pieces()
    attempts = (Attempt("h:1", "UNAVAILABLE", "down"), Attempt("h:2", "DEADLINE_EXCEEDED", "slow"))
    fake = FakeShards({0: ["5"], 1: PieceOutcome(None, attempts), 2: ["5"]}, {0: b"abcd"})
    with pytest.raises(ShardUnavailableError) as info:
        fake.run(keys, pieces)
    error = info.value
    assert error.shard == 1 and "h:1: UNAVAILABLE down" in str(error) and "h:2" in str(error)
    partial = error.result
    assert partial is not None
    assert partial.answered.tolist() == [k % 3 != 1 for k in range(12)]
    assert partial.values[0] == b"abcd" and partial.values[1] is None


def test_shard_unavailable_says_each_distinct_error_once_with_a_count() -> None:
    """One replica tried three times with the same error: said once, with the count."""
    down = "failed to connect to all addresses; last error: UNAVAILABLE: Connection refused"
    once = [Attempt("h:1", "UNAVAILABLE", down)] * 3
    message = str(ShardUnavailableError({0: once}, None))
    assert message.count(down) == 1
    assert f"3 attempts at h:1: UNAVAILABLE {down}" in message
    spread = [Attempt(f"h:{i}", "UNAVAILABLE", down) for i in range(3)]
    spread.append(Attempt("h:0", "DEADLINE_EXCEEDED", "slow"))
    message = str(ShardUnavailableError({2: spread}, None))
    assert message.count(down) == 1 and f"3 replicas (h:0, h:1, h:2): UNAVAILABLE {down}" in message
    assert message.endswith("h:0: DEADLINE_EXCEEDED slow]")
    mixed = [Attempt("h:1", "UNAVAILABLE", "x"), Attempt("h:2", "UNAVAILABLE", "x")] * 2
    assert "4 attempts at 2 replicas (h:1, h:2): UNAVAILABLE x" in str(
        ShardUnavailableError({1: mixed}, None)
    )


def test_flow_rejected_raises_the_server_message() -> None:
    keys, pieces = _pieces()
    rejected = Attempt("h:1", "INVALID_ARGUMENT", "too many keys")
    fake = FakeShards({0: ["5"], 1: ["5"], 2: PieceOutcome(None, (rejected,), rejected)}, {})
    with pytest.raises(RequestRejectedError, match=r"shard 2 .h:1. rejected.*too many keys"):
        fake.run(keys, pieces)


def test_flow_empty_batch_sends_nothing() -> None:
    fake = FakeShards({}, {})
    result = fake.run(np.empty(0, np.uint64), [])
    assert len(result) == 0 and fake.rounds == [] and result.values == []
