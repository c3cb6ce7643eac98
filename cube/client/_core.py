"""The SDK's pure core: keys in, per-shard sub-requests out, answers scattered back, one version.

No I/O. The transports (sync gRPC, grpc.aio) only move bytes; everything that decides what to
send and how to read it lives here, so both clients share it and tests drive it with fakes:

- `normalize_keys`: list of ints or integer array -> uint64 array, with a clear error.
- `make_plan`: route with `cube.routing.shard_of` (the builder's function), group with
  `group_by_owner`, split groups larger than `max_batch` into several pieces.
- Wire: `FastProtocol` writes and reads cube.v1 bytes with `cube.wire` (shared with the
  server; values stay in the received buffer). `OriginalProtocol` speaks the original
  `rec.mcube.DictService/seek` (one protobuf per key).
- `assemble`: scatter piece answers back into request order with fancy indexing (fixed-width
  answers go straight into one preallocated (n, width) buffer).
- `seek_flow`: the version rule (a generator that yields rounds of sub-requests):

  Version rule. Every answer carries the version that served it. If all pieces agree, done.
  Otherwise try candidate versions newest first: ask every piece that has no answer at the
  candidate for exactly that version (`SeekRequest.version`; a server answers from its current
  or its previous version, else FAILED_PRECONDITION, and the SDK then tries the shard's other
  replicas). The first candidate every piece answered from wins, so a batch never mixes
  versions: during a switch the newest version wins once all shards have it, and before that
  the shards already switched answer from their previous version. After `max_version_rounds`
  candidates without success, `VersionMismatchError`. Servers that cannot pin a version (the
  original protocol) are simply re-asked, and the first version complete across pieces wins.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Generator, KeysView, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol, TypeVar

import numpy as np
import numpy.typing as npt
from numpy.typing import DTypeLike, NDArray

import cube.client._compiled as _compiled
from cube import wire
from cube.client.errors import (
    Attempt,
    ConfigMismatchError,
    DeadlineExceededError,
    KeyRangeError,
    KeyShapeError,
    RequestRejectedError,
    ShardUnavailableError,
    ValueSizeError,
    VersionMismatchError,
)
from cube.routing import MISROUTED_HINT, group_by_owner, shard_of
from cube.values import ValueColumn, gather_ranges
from cube.wire import Answer, BadMessage

DEFAULT_MAX_BATCH = 100_000
_EMPTY_U8 = np.empty(0, dtype=np.uint8)
_U64 = np.dtype(np.uint64)


# ---------------------------------------------------------------------------------------------
# Keys


def normalize_keys(keys: npt.ArrayLike) -> NDArray[np.uint64]:
    """Keys as a contiguous 1-D uint64 array, in the order given. KeyRangeError names the
    first bad key and its position: negative, 2**64 or more, or not an integer (a float is
    refused even when it looks whole: float64 cannot hold every uint64, and 1000003.7 must not
    become 1000003; a bool too: True and False are not keys 1 and 0). KeyShapeError refuses a
    shape without one request order: an array of 2 or more dimensions, a set. Checked once per
    call on the array's dtype and shape (no loop over the keys but for Python ints beyond
    int64, or objects, which numpy cannot type)."""
    if type(keys) is np.ndarray and keys.dtype == _U64 and keys.ndim == 1:
        return keys if keys.flags.c_contiguous else np.ascontiguousarray(keys)  # the usual case
    if isinstance(keys, bool | np.bool_):
        raise KeyRangeError(f"key {keys!r} is a bool, not an integer (keys are uint64)")
    if isinstance(keys, AbstractSet) and not isinstance(keys, KeysView):
        raise KeyShapeError(
            f"keys in a {type(keys).__name__} have no order, and the answer is in request order:"
            " pass a list or an array (e.g. sorted(keys))"
        )
    given: object = [keys] if isinstance(keys, int | np.integer) else keys
    if isinstance(given, str | bytes | float | np.floating):
        raise KeyRangeError(f"keys must be integers, got {type(given).__name__} {given!r}")
    if isinstance(given, np.ndarray):
        array = given
    else:
        try:
            array = np.asarray(given)
        except (TypeError, ValueError, OverflowError):
            array = np.empty(0, dtype=object)
        if array.dtype.kind not in "iub" and array.ndim < 2:  # floats, strings, huge ints:
            array = np.fromiter(given, dtype=object)  # type: ignore[call-overload]  # one by one
    if array.ndim > 1:
        raise KeyShapeError(
            f"keys must be 1-D (one request order); got a {array.ndim}-D array of shape"
            f" {array.shape}: pass keys.ravel() (or a list) if its row-major order is meant"
        )
    if array.dtype == np.bool_:
        raise KeyRangeError(
            "keys are bools (an array of dtype bool), not integers: True and False are not keys"
            " 1 and 0 (a mask? select keys with it: keys[mask])"
        )
    if array.dtype == np.uint64:
        return np.ascontiguousarray(array.reshape(-1))
    if array.dtype.kind == "i":
        flat = array.reshape(-1)
        negative = np.flatnonzero(flat < 0)
        if negative.size:
            at = int(negative[0])
            raise KeyRangeError(
                f"key {int(flat[at])} at position {at} is negative; keys are uint64"
            )
        return flat.astype(np.uint64)
    if array.dtype.kind == "u":
        return array.reshape(-1).astype(np.uint64)
    if array.dtype != object:
        flat = array.reshape(-1)
        if flat.shape[0] == 0:
            return np.empty(0, dtype=np.uint64)
        raise KeyRangeError(
            f"key {flat[0]!r} at position 0 is not an integer (keys are uint64; got an array of"
            f" dtype {array.dtype.name})"
        )
    # Python ints beyond int64, or mixed objects: check each to name the culprit.
    flat = array.reshape(-1)
    for position, key in enumerate(flat.tolist()):
        if not isinstance(key, int | np.integer) or isinstance(key, bool):
            raise KeyRangeError(f"key {key!r} at position {position} is not an integer")
        if not 0 <= int(key) < 2**64:
            raise KeyRangeError(
                f"key {int(key)} at position {position} is outside [0, 2**64); keys are uint64"
            )
    return np.array(flat.tolist(), dtype=np.uint64)


# ---------------------------------------------------------------------------------------------
# Plan: which keys go where


@dataclass(eq=False, slots=True)  # (not frozen: cheaper to build, one per call; never changed)
class Piece:
    """One sub-request: up to `max_batch` keys of one shard, and where they sit in the request
    (`where` is a slice when the piece is a contiguous run of the request, else positions)."""

    shard: int
    where: slice | np.ndarray
    keys: np.ndarray
    table: str = ""  # the table its keys are looked up in ("": the version's one table)

    @property
    def size(self) -> int:
        return int(self.keys.shape[0])


def make_plan(
    keys: np.ndarray,
    shard_num: int,
    partitioner: str,
    max_batch: int | Sequence[int] = DEFAULT_MAX_BATCH,
) -> list[Piece]:
    """Pieces for the shards that own at least one key (shards without keys get no request),
    each of at most `max_batch` keys: one bound for every shard, or one per shard (what each
    shard's servers take). A shard's keys keep their request order across its pieces."""
    n = int(keys.shape[0])
    if n == 0:
        return []
    limits = [max_batch] * shard_num if isinstance(max_batch, int) else list(max_batch)
    if shard_num == 1:
        limit = limits[0]
        if n <= limit:
            return [Piece(0, slice(0, n), keys)]
        return [
            Piece(0, slice(start, min(start + limit, n)), keys[start : start + limit])
            for start in range(0, n, limit)
        ]
    grouped = _compiled.group(keys, shard_num, partitioner)
    if grouped is not None:
        order, grouped_keys, bounds = grouped
    else:
        grouping = group_by_owner(shard_of(keys, shard_num, partitioner), shard_num)
        order, grouped_keys = grouping.order, keys[grouping.order]
        bounds = grouping.bounds.tolist()
    pieces = []
    for shard in range(shard_num):  # shards without keys have an empty range: no piece
        limit = limits[shard]
        for start in range(bounds[shard], bounds[shard + 1], limit):
            stop = min(start + limit, bounds[shard + 1])
            pieces.append(Piece(shard, order[start:stop], grouped_keys[start:stop]))
    return pieces


def make_table_plan(
    tables: Sequence[tuple[str, np.ndarray]],
    shard_num: int,
    partitioner: str,
    max_batch: int | Sequence[int] = DEFAULT_MAX_BATCH,
) -> tuple[np.ndarray, list[Piece], list[tuple[int, int]]]:
    """The plan of a lookup in several tables: (every table's keys back to back, the pieces,
    each table's range of pieces). A piece holds keys of one table (servers answer a request
    from one table) and its `where` is a position in the keys back to back (`assemble` of
    them is the call's partial result); `assemble_tables` makes each table's result."""
    pieces: list[Piece] = []
    ranges: list[tuple[int, int]] = []
    offset = 0
    for table, keys in tables:
        first = len(pieces)
        for piece in make_plan(keys, shard_num, partitioner, max_batch):
            piece.table = table
            piece.where = _shifted(piece.where, offset)
            pieces.append(piece)
        ranges.append((first, len(pieces)))
        offset += int(keys.shape[0])
    every = np.concatenate([keys for _, keys in tables]) if tables else np.empty(0, np.uint64)
    return every, pieces, ranges


def _shifted(where: slice | np.ndarray, by: int) -> slice | np.ndarray:
    if isinstance(where, slice):
        return slice(where.start + by, where.stop + by)
    return where + by


def assemble_tables(
    tables: Sequence[tuple[str, np.ndarray]], ranges: Sequence[tuple[int, int]]
) -> Finish[list[SeekResult]]:
    """The `finish` of a lookup in several tables (`make_table_plan`): one SeekResult per
    table, in the order asked, each in its own keys' order."""

    def finish(
        _every: np.ndarray, pieces: Sequence[Piece], answers: Sequence[Answer | None]
    ) -> list[SeekResult]:
        results = []
        offset = 0
        for (_, keys), (first, last) in zip(tables, ranges, strict=True):
            own = [
                Piece(p.shard, _shifted(p.where, -offset), p.keys, p.table)
                for p in pieces[first:last]
            ]
            results.append(assemble(keys, own, answers[first:last]))
            offset += int(keys.shape[0])
        return results

    return finish


# ---------------------------------------------------------------------------------------------
# Wire: how sub-requests are written and answers read


class Wire(Protocol):
    """How sub-requests travel: the gRPC method and the bytes both ways."""

    method: str
    pins_versions: bool

    def encode(
        self,
        keys: np.ndarray,
        dict_name: str,
        version: str | None,
        request_id: int = 0,
        table: str = "",
    ) -> bytes: ...

    def decode(self, data: bytes, n: int) -> Answer: ...


class FastProtocol:
    """cube.v1.CubeService/Seek: packed keys, packed values (the default)."""

    method = "/cube.v1.CubeService/Seek"
    pins_versions = True
    # cube.wire's functions themselves (no wrapper call per request)
    encode = staticmethod(wire.encode_seek_request)
    decode = staticmethod(_compiled.decode)  # wire.decode_seek_response, its scan compiled


class OriginalProtocol:
    """rec.mcube.DictService/seek, for servers that speak only the original API. It costs one
    protobuf object per key and cannot pin a version (versions are re-asked, see seek_flow)."""

    method = "/rec.mcube.DictService/seek"
    pins_versions = False
    MISS = 0xFFFFFFFF

    def encode(
        self,
        keys: np.ndarray,
        dict_name: str,
        version: str | None,
        request_id: int = 0,
        table: str = "",
    ) -> bytes:
        from cube.pb import cube_pb2  # the original's request has no request id

        if table:  # (the clients refuse a table with this protocol before any request)
            raise ValueError("the original protocol (rec.mcube) cannot name a table")

        return cube_pb2.DictRequest(keys=keys.tolist(), version_required=True).SerializeToString()

    def decode(self, data: bytes, n: int) -> Answer:
        from google.protobuf.message import DecodeError

        from cube.pb import cube_pb2

        try:
            response = cube_pb2.DictResponse.FromString(data)
        except DecodeError as exc:
            raise BadMessage(f"bad DictResponse: {exc}") from None
        if len(response.values) != n:
            raise BadMessage(f"{len(response.values)} values for {n} keys")
        status = np.fromiter((v.status for v in response.values), dtype=np.uint32, count=n)
        found = status == 0
        hits = found.tolist()
        values = [v.value if ok else b"" for v, ok in zip(response.values, hits, strict=True)]
        column = ValueColumn.from_list(values) if n else ValueColumn.empty()
        if column.width and not found.all():
            column = column.as_variable()
        return Answer(found, column, response.version)


PROTOCOLS: dict[str, type] = {"fast": FastProtocol, "original": OriginalProtocol}


# ---------------------------------------------------------------------------------------------
# Results


@dataclass(eq=False)
class SeekResult:
    """Answers in request order.

    - `found[i]`: key i exists. `values[i]`: its bytes, or None for a miss (built on first use;
      prefer `column`, the raw buffer: `column.as_rows()` for fixed width `width > 0`, else
      `column.blob` + `column.offsets`; misses are zero rows / empty ranges).
    - `embeddings(dim)`: the values as an (n, dim) array (zero rows for misses).
    - `version`: the version that answered the whole batch (None if pieces disagree, which
      only happens in the partial result of an error).
    - `answered[i]`: False for keys of a shard that failed (only in `ShardUnavailableError
      .result`); distinct from a miss.
    """

    keys: np.ndarray
    found: np.ndarray
    column: ValueColumn
    version: str | None
    answered_mask: np.ndarray | None = field(default=None, repr=False)  # None: all answered

    def __len__(self) -> int:
        return int(self.keys.shape[0])

    @property
    def answered(self) -> np.ndarray:
        """bool per key: False for keys of a shard that failed (partial results only)."""
        if self.answered_mask is None:
            return np.ones(len(self), dtype=bool)
        return self.answered_mask

    @property
    def width(self) -> int:
        """Value width when every value has the same size (fixed layout), else 0."""
        return self.column.width

    @cached_property
    def values(self) -> list[bytes | None]:
        found = self.found.tolist()
        if self.column.width:
            width = self.column.width
            blob = self.column.blob[: len(found) * width].tobytes()
            return [
                blob[i * width : (i + 1) * width] if hit else None for i, hit in enumerate(found)
            ]
        blob = self.column.blob.tobytes()
        offsets = self.column.offsets.tolist()
        return [blob[offsets[i] : offsets[i + 1]] if hit else None for i, hit in enumerate(found)]

    def value(self, i: int) -> bytes | None:
        return self.column.get(i) if self.found[i] else None

    def embeddings(self, dim: int, dtype: DTypeLike = "float32") -> NDArray[Any]:
        """(n, dim) array of the values read as `dtype`, zero rows for misses: what
        get_embeddings returns, for a caller that also needs `version` or `found` of the same
        answer (a model whose dense part must match the version of its embeddings)."""
        return embeddings(self, dim, dtype)


def _empty_result(keys: np.ndarray) -> SeekResult:
    n = keys.shape[0]
    column = ValueColumn.variable(_EMPTY_U8, np.zeros(n + 1, np.int64))
    return SeekResult(keys, np.zeros(n, bool), column, None, np.zeros(n, bool))


def assemble(
    keys: np.ndarray, pieces: Sequence[Piece], answers: Sequence[Answer | None]
) -> SeekResult:
    """Scatter piece answers into request order. Pieces without an answer leave their keys
    `answered=False`, not found, empty."""
    n = int(keys.shape[0])
    if len(pieces) == 1 and len(answers) == 1 and (answer := answers[0]) is not None:
        where = pieces[0].where
        if type(where) is slice and where.start == 0 and where.stop == n:  # one shard: zero copy
            return SeekResult(keys, answer.found, answer.column, answer.version)
    present = [(p, a) for p, a in zip(pieces, answers, strict=True) if a is not None]
    versions = {a.version for _, a in present}
    version = versions.pop() if len(versions) == 1 else None
    if not present:
        return _empty_result(keys)
    answered = None  # all
    if len(present) < len(pieces):
        answered = np.zeros(n, dtype=bool)
        for piece, _ in present:
            answered[piece.where] = True
    if len(pieces) == 1 and len(present) == 1:
        ((piece, answer),) = present
        if isinstance(piece.where, slice) and piece.where == slice(0, n):
            return SeekResult(keys, answer.found, answer.column, version, answered)  # zero copy
    found = np.zeros(n, dtype=bool)
    widths = {a.column.width for _, a in present}
    if len(widths) > 1:
        # Pieces without hits fit any width (an empty shard answers width 0): hits decide.
        hit_widths = {a.column.width for _, a in present if a.found.any()}
        widths = hit_widths or widths - {0}
    if len(widths) == 1 and (width := widths.pop()):
        # One void item per row: fancy indexing moves whole rows (3x faster than 2-D uint8).
        row = np.dtype((np.void, width))
        blob = np.zeros(n * width, dtype=np.uint8)
        same = [(p.where, a) for p, a in present if a.column.width == width]
        # (the pieces of another width found nothing: their keys stay not found, zero rows)
        if not _compiled.scatter_fixed(found.view(np.uint8), blob, width, same):
            _scatter_found(found, present)
            rows = blob.view(row)
            for where, answer in same:
                column = answer.column
                rows[where] = column.blob[: column.count * width].view(row)
        return SeekResult(keys, found, ValueColumn.fixed(blob, width), version, answered)
    _scatter_found(found, present)
    # Variable (or mixed) widths: one gather of every value's byte range, in request order.
    starts = np.zeros(n, dtype=np.int64)
    lengths = np.zeros(n, dtype=np.int64)
    blobs, base = [], 0
    for piece, answer in present:
        column = answer.column
        if column.width:
            local_starts = np.arange(column.count, dtype=np.int64) * column.width
            local_lengths = np.where(answer.found, column.width, 0)
            blob = column.blob[: column.count * column.width]
        else:
            local_starts = column.offsets[:-1]
            local_lengths = np.where(answer.found, np.diff(column.offsets), 0)
            blob = column.blob
        starts[piece.where] = local_starts + base
        lengths[piece.where] = local_lengths
        blobs.append(blob)
        base += int(blob.shape[0])
    blob, offsets = gather_ranges(np.concatenate(blobs), starts, lengths)
    return SeekResult(keys, found, ValueColumn.variable(blob, offsets), version, answered)


def _scatter_found(found: np.ndarray, present: Sequence[tuple[Piece, Answer]]) -> None:
    for piece, answer in present:
        found[piece.where] = answer.found


def embeddings(
    result: SeekResult, dim: int, dtype: DTypeLike = "float32", own: bool = False
) -> NDArray[Any]:
    """(n, dim) array of the values read as `dtype`; zero rows for misses. A found value whose
    size is not dim * itemsize raises ValueSizeError naming the key.

    `own`: the caller hands `result` over (get_embeddings): when its values are fixed-width
    rows of dim * itemsize bytes in a writable, aligned buffer (a lane's received buffer, or
    the rows scattered from several shards), the array is a view of them, not a copy."""
    dt = _dtype(dtype)
    if dim <= 0:
        raise ValueError(f"dim must be > 0, got {dim}")
    row_bytes = dim * dt.itemsize
    n = len(result)
    column, found = result.column, result.found
    if own and column.width == row_bytes:
        rows = column.blob[: n * row_bytes].view(dt)
        if rows.flags.aligned and rows.flags.writeable:
            if not _all_found(found):
                rows.reshape(n, dim)[np.logical_not(found)] = 0  # whatever a miss's row held
            return rows.reshape(n, dim)
    out = np.zeros((n, dim), dtype=dt)
    out_bytes = out.view(np.uint8).reshape(n, row_bytes)
    if column.width != row_bytes:
        sizes = column.lengths()
        bad = np.flatnonzero(found & (sizes != row_bytes))
        if bad.size:
            at = int(bad[0])
            raise ValueSizeError(
                f"value of key {int(result.keys[at])} (position {at}) has {int(sizes[at])} bytes;"
                f" expected dim {dim} x {dt.name} = {row_bytes} bytes"
                f" ({bad.size} of {n} values have the wrong size)"
            )
    if column.width == row_bytes:
        if _all_found(found):
            out_bytes[:] = column.as_rows()
        else:
            row = np.dtype((np.void, row_bytes))
            rows = column.blob[: n * row_bytes].view(row)
            out_bytes.reshape(-1).view(row)[found] = rows[found]
    elif found.any():
        starts = column.offsets[:-1][found]
        out_bytes[found] = column.blob[starts[:, None] + np.arange(row_bytes)]
    return out


def _dtype(dtype: DTypeLike) -> np.dtype[Any]:
    """np.dtype(dtype), remembered for the few a program asks for (parsing "float32" costs
    more than the rest of a view)."""
    try:
        return _DTYPES[dtype]
    except (KeyError, TypeError):  # TypeError: not hashable (a structured dtype's spec)
        dt = np.dtype(dtype)
        if len(_DTYPES) < 64:
            with contextlib.suppress(TypeError):
                _DTYPES[dtype] = dt
        return dt


_DTYPES: dict[Any, np.dtype[Any]] = {}


def _all_found(found: np.ndarray) -> bool:
    """`found.all()` for a bool array viewed on received bytes (any nonzero byte is True):
    no zero byte in its bytes, a memchr (several times cheaper than the reduction)."""
    return 0 not in found.tobytes()


# ---------------------------------------------------------------------------------------------
# Versions and the per-call flow


_PART = re.compile(r"[_.]")


def version_order(version: str) -> tuple[Any, ...]:
    """Sort key for version names: '' (nothing loaded) first; `_`/`.`-separated parts compare
    as numbers when numeric (`1565323045_1565326078` after `1565323045`), else as text."""
    if not version:
        return (0, ())
    return (1, tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in _PART.split(version)))


@dataclass(frozen=True)
class PieceRequest:
    """Ask piece `piece` (an index into the plan), optionally for exactly `version`."""

    piece: int
    version: str | None


@dataclass(frozen=True)
class PieceOutcome:
    """What one sub-request came to after its retries: an answer, or the failed attempts."""

    answer: Answer | None
    attempts: tuple[Attempt, ...] = ()
    rejected: Attempt | None = None  # a non-retryable status: raise at once
    version_unavailable: bool = False  # pinned request, no replica holds that version
    retries: int = 0  # attempts after a failure
    hedges: int = 0  # backup requests sent
    hedge_won: bool = False  # the answer came from a backup request
    failover: bool = False  # the answer came from another replica than the first one tried
    deadline_exceeded: bool = False  # no answer because the call's whole-call timeout passed


R = TypeVar("R")
Flow = Generator[list[PieceRequest], list[PieceOutcome], R]
Finish = Callable[[np.ndarray, Sequence[Piece], Sequence[Answer | None]], R]


def _raise_rejected(
    pieces: Sequence[Piece], requests: Sequence[PieceRequest], outcomes: Sequence[PieceOutcome]
) -> None:
    for request, outcome in zip(requests, outcomes, strict=True):
        if outcome.rejected is not None:
            a = outcome.rejected
            shard = pieces[request.piece].shard
            if a.code == "CONFIG_MISMATCH" or (
                a.code == "INVALID_ARGUMENT" and MISROUTED_HINT in a.message
            ):
                raise ConfigMismatchError(shard, a.endpoint, a.message)
            raise RequestRejectedError(shard, a.endpoint, a.code, a.message)


def _failures(
    pieces: Sequence[Piece],
    requests: Sequence[PieceRequest],
    outcomes: Sequence[PieceOutcome],
    keep_version_unavailable: bool,
) -> dict[int, Sequence[Attempt]]:
    failed: dict[int, list[Attempt]] = {}
    for request, outcome in zip(requests, outcomes, strict=True):
        if outcome.answer is None and (keep_version_unavailable or not outcome.version_unavailable):
            failed.setdefault(pieces[request.piece].shard, []).extend(outcome.attempts)
    return dict(failed)


def _unavailable(
    failed: dict[int, Sequence[Attempt]],
    partial: SeekResult,
    outcomes: Sequence[PieceOutcome],
    call_timeout_s: float | None,
    dict_name: str,
) -> ShardUnavailableError:
    """The error for shards that failed: DeadlineExceededError when the call's timeout is
    what ended one of them."""
    if call_timeout_s is not None and any(
        o.deadline_exceeded for o in outcomes if o.answer is None
    ):
        return DeadlineExceededError(failed, partial, call_timeout_s, dict_name)
    return ShardUnavailableError(failed, partial)


def seek_flow(
    keys: np.ndarray,
    pieces: Sequence[Piece],
    finish: Finish[R],
    pins_versions: bool = True,
    max_version_rounds: int = 3,
    version: str | None = None,
    call_timeout_s: float | None = None,
    dict_name: str = "",
) -> Flow[R]:
    """Drive one seek: yields rounds of PieceRequests, receives their PieceOutcomes (same
    order), returns what `finish` makes of the answers of one version (`assemble`: the
    SeekResult; `assemble_tables`: one per table of a lookup in several). Implements the
    version rule of the module docstring; an error carries `assemble`'s partial result of
    every key. `call_timeout_s` and `dict_name` only name the call's timeout and dict in the
    error raised when that timeout ended it."""
    count = len(pieces)
    if count == 0:
        return finish(keys, pieces, [])
    requests = [PieceRequest(i, version) for i in range(count)]
    outcomes = yield requests
    _raise_rejected(pieces, requests, outcomes)
    first = [o.answer for o in outcomes]
    failed = _failures(pieces, requests, outcomes, keep_version_unavailable=True)
    if failed:
        partial = assemble(keys, pieces, first)
        raise _unavailable(failed, partial, outcomes, call_timeout_s, dict_name)
    answered = [a for a in first if a is not None]  # every piece answered (else raised above)
    by_version: list[dict[str, Answer]] = [{a.version: a} for a in answered]
    seen = {a.version for a in answered}
    if len(seen) == 1:
        return finish(keys, pieces, first)
    tried: list[str] = []
    for _ in range(max_version_rounds):
        candidates = sorted(seen.difference(tried), key=version_order, reverse=True)
        if not candidates:
            break
        target = candidates[0]
        tried.append(target)
        missing = [i for i in range(count) if target not in by_version[i]]
        requests = [PieceRequest(i, target if pins_versions else None) for i in missing]
        outcomes = yield requests
        _raise_rejected(pieces, requests, outcomes)
        failed = _failures(pieces, requests, outcomes, keep_version_unavailable=False)
        if failed:
            partial = assemble(keys, pieces, first)
            raise _unavailable(failed, partial, outcomes, call_timeout_s, dict_name)
        if call_timeout_s is not None and any(
            o.deadline_exceeded and o.answer is None for o in outcomes
        ):
            # a pinned re-ask cut short by the call's timeout: no version can be completed
            failed = {
                pieces[r.piece].shard: o.attempts
                for r, o in zip(requests, outcomes, strict=True)
                if o.deadline_exceeded and o.answer is None
            }
            partial = assemble(keys, pieces, first)
            raise DeadlineExceededError(failed, partial, call_timeout_s, dict_name)
        for request, outcome in zip(requests, outcomes, strict=True):
            if outcome.answer is not None:
                by_version[request.piece][outcome.answer.version] = outcome.answer
                seen.add(outcome.answer.version)
        complete = [v for v in seen if all(v in answers for answers in by_version)]
        if complete:
            best = max(complete, key=version_order)
            return finish(keys, pieces, [answers[best] for answers in by_version])
    per_shard: dict[int, list[str]] = {}
    for piece, answers in zip(pieces, by_version, strict=True):
        per_shard.setdefault(piece.shard, [])
        per_shard[piece.shard] += [v for v in answers if v not in per_shard[piece.shard]]
    raise VersionMismatchError(per_shard, tried)
