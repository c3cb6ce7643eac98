"""The lookup services: the fast API (cube.v1.CubeService Seek/SeekStream: packed keys in,
packed values out) and the original's rec.mcube.DictService.seek, and the lookups behind them
(keys to found flags and values, from one version).

Both are registered as generic handlers on raw bytes: requests are parsed once by protobuf
(upb) and answers written straight to wire bytes from numpy buffers by cube/server/encoders.py.
Every request takes the version it is answered from once (`VersionSlots.get`) and holds it
until its answer bytes are built, so it is answered entirely from that version and a retired
version is unmapped only after its last request.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import numpy as np

from cube import kernel, wire
from cube.index import TOMBSTONE, keys_at
from cube.layout import clip, part_name
from cube.metrics import Histogram
from cube.pb import cube_fast_pb2, cube_pb2
from cube.routing import MISROUTED_HINT, group_by_owner, shard_of
from cube.server import hot
from cube.server.encoders import (
    Answer,
    empty_answer,
    encode_dict_response,
    seek_response_parts,
    split_answer,
)
from cube.server.hot import HotCache
from cube.server.versions import LoadedVersion, VersionSlots
from cube.shard import LookupResult, ShardStack
from cube.values import ValueColumn
from cube.wire import MAX_BATCH_METADATA, Buffer

log = logging.getLogger("cube.server")

FAST_SERVICE = "cube.v1.CubeService"
PORT_METADATA = "cube-tcp-port"  # discovery: the worker's TCP lane (cube.server.lane)
ROUTING_METADATA = "cube-routing"  # discovery: the served version's ShardRouting as JSON
DICT_SERVICE = "rec.mcube.DictService"
_KEY_DTYPE = np.dtype("<u8")
_TOMBSTONE = np.uint32(TOMBSTONE)
_NO_LAYERS = np.empty(0, dtype=np.int16)  # a single layer's LookupResult needs none
T = TypeVar("T")


class RequestError(Exception):
    """A request the server refuses; `code` is the gRPC status it answers with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# ---------------------------------------------------------------------------------------------
# the kernel: keys -> found flags + values, from one version (pure; no I/O but the mmaps)


class FastGather:
    """Per-stack lookup + gather prepared once per version. A single layer of fixed-width
    values is looked up and gathered in one compiled pass (cube.kernel.seek_fixed); other
    stacks are probed layer by layer (a single layer without a per-key layer array) and
    gathered by the stack."""

    __slots__ = ("single", "stack", "tombstones", "width", "words")

    def __init__(self, stack: ShardStack) -> None:
        self.stack = stack
        self.width = stack.value_width
        self.single = stack.layers[0] if len(stack.layers) == 1 else None
        self.tombstones = bool(self.single is not None and self.single.meta.get("tombstone_count"))
        self.words = None
        if self.width and self.single is not None and self.single.values.count:
            self.words = kernel.value_words(self.single.values.as_rows())

    def fixed_values_into(self, keys: np.ndarray, found: np.ndarray, values: np.ndarray) -> int:
        """Found flags and values (rows of `words.dtype`) of a single layer written into the
        given arrays; returns the count not found. Needs `words` (a single layer of
        fixed-width values)."""
        assert self.single is not None and self.words is not None
        return kernel.seek_fixed_into(self.single.kernel_table, self.words, keys, found, values)

    def fixed_values(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(found, (n, width) uint8 values with zero rows for misses) of fixed-width keys."""
        if self.words is not None:
            assert self.single is not None
            found, values, _misses = kernel.seek_fixed(
                self.single.kernel_table, self.words, keys, self.width
            )
            return found, values
        result = self.lookup(keys)
        return result.found, self.stack.gather_fixed(result)

    def lookup(self, keys: np.ndarray) -> LookupResult:
        if self.single is None:
            return self.stack.lookup(keys)
        rows, found = self.single.lookup(keys)
        if self.tombstones:
            found &= rows != _TOMBSTONE
        return LookupResult(found, _NO_LAYERS, rows)

    def variable(self, result: LookupResult) -> ValueColumn:
        return self.stack.gather(self._layered(result))

    def value_bytes(self, result: LookupResult) -> int:
        """Bytes `fixed_values`/`variable` would gather for `result` (found values only)."""
        if self.width:
            return int(np.count_nonzero(result.found)) * self.width
        return self.stack.value_bytes(self._layered(result))

    def _layered(self, result: LookupResult) -> LookupResult:
        """A single layer's result with the per-key layer array the stack methods read."""
        if self.single is None:
            return result
        return LookupResult(result.found, np.where(result.found, 0, -1), result.rows)


class PagedGather(FastGather):
    """A split of a version served paged, larger than the memory it may use
    (cube.server.hot): fixed-width values from the hot layer first, the rest read from the
    mapped files on several threads at once; each answer's found values are sampled to keep
    the hot layer current. Variable-width values are looked up as FastGather does."""

    __slots__ = ("cache",)

    def __init__(
        self, stack: ShardStack, hot_cache_bytes: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__(stack)
        self.cache = HotCache(self.width, hot_cache_bytes, clock) if self.width else None

    def fixed_values(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        n = keys.shape[0]
        found = np.zeros(n, dtype=bool)
        values = np.zeros((n, self.width), dtype=np.uint8)
        self.fixed_values_into(keys, found, values)
        return found, values

    def fixed_values_into(self, keys: np.ndarray, found: np.ndarray, values: np.ndarray) -> int:
        rows = values.view(np.uint8).reshape(keys.shape[0], self.width)
        rest = np.arange(keys.shape[0])
        layer = self.cache.layer if self.cache is not None else None
        if layer is not None and layer.keys.shape[0] and rows.flags.c_contiguous:
            words = rows.view(layer.words.dtype)  # the layer's words (its rows are contiguous)
            kernel.seek_fixed_into(layer.shard.kernel_table, layer.words, keys, found, words)
            rest = np.flatnonzero(~found)
        else:
            found[:] = False

        def read(part: np.ndarray) -> None:
            part_found, part_rows = FastGather.fixed_values(self, keys[part])
            found[part] = part_found
            rows[part] = part_rows

        if rest.shape[0]:
            parts = hot.chunks(rest)
            if len(parts) == 1:
                read(parts[0])
            else:
                for task in [hot.readers().submit(read, part) for part in parts]:
                    task.result()  # (the first failure raised, once every part was asked)
        if self.cache is not None:
            asked = keys.shape[0]
            self.cache.record(keys[found], rows[found], asked, asked - rest.shape[0])
            if self.cache.capacity and self.cache.due():
                hot.readers().submit(self.cache.refresh)
        return int(keys.shape[0]) - int(np.count_nonzero(found))


def gatherers(version: LoadedVersion) -> list[FastGather]:
    cached = version.kernel_cache.get("gatherers")
    if cached is None:
        cached = version.kernel_cache["gatherers"] = [
            PagedGather(s, version.hot_cache_bytes // len(version.stacks))
            if version.memory_note
            else FastGather(s)
            for s in version.stacks
        ]
    return cached


def lane_target(version: LoadedVersion) -> kernel.LaneTarget | None:
    """The version as the TCP lane's compiled pass answers from it (cached with it); None
    when that pass does not (several splits: the Python path answers)."""
    if "lane" not in version.kernel_cache:
        version.kernel_cache["lane"] = _lane_target(version)
    target: kernel.LaneTarget | None = version.kernel_cache["lane"]
    return target


def _lane_target(version: LoadedVersion) -> kernel.LaneTarget | None:
    if len(version.stacks) != 1 or version.tables:  # (the pass knows no table field)
        return None
    if version.memory_note:  # served paged: its misses read in parallel (PagedGather)
        return None
    layers = [(shard.kernel_table, shard.values) for shard in version.stacks[0].layers]
    routing = version.routing
    where = (1, 0, "mod")
    if routing is not None:
        where = (routing.shard_num, routing.shard, routing.partitioner)
    return kernel.lane_target(
        layers, version.value_width, version.name, version.max_value_bytes, where
    )


WARM_KEYS = 256  # keys of a version looked up before it serves (version_warmed)


def warm_version(version: LoadedVersion, partitioner: str = "mod") -> None:
    """What a version's first request would otherwise pay, paid before it serves (called in
    the loader's thread): its gatherers (the value word views) and one lookup of a few keys
    of each split, through the path requests take (index and data pages, kernel calls);
    for a version of several tables, of each table."""
    if version.tables:
        for child in version.tables.values():
            warm_version(child, partitioner)
        return
    samples = []
    for stack in version.stacks:  # the base's first rows (their keys: cube.index.keys_at)
        table = stack.layers[0].table
        samples.append(keys_at(table, np.arange(min(WARM_KEYS, table.row_count))))
    answer_keys(version, np.concatenate(samples), partitioner)


class AnswerTooLarge(Exception):
    """An answer that would exceed the byte bound it was built under."""

    def __init__(self, size: int) -> None:
        super().__init__(f"{size} bytes")
        self.size = size


def answer_keys(
    version: LoadedVersion | None,
    keys: np.ndarray,
    partitioner: str = "mod",
    max_bytes: int | None = None,
) -> Answer:
    """Look every key up in `version` (None: an empty server, every key a miss). With
    `max_bytes`, variable-width values are counted before they are gathered (AnswerTooLarge)."""
    n = keys.shape[0]
    if version is None:
        return empty_answer(n)
    gathers = gatherers(version)
    width = version.value_width
    if len(gathers) == 1:
        gather = gathers[0]
        if width:
            found, values = gather.fixed_values(keys)
            return Answer(found, values, width, None)
        result = gather.lookup(keys)
        if max_bytes is not None and (size := gather.value_bytes(result)) > max_bytes:
            raise AnswerTooLarge(size)
        column = gather.variable(result)
        return Answer(result.found, column.blob, 0, column.offsets)
    grouping = group_by_owner(shard_of(keys, len(gathers), partitioner), len(gathers))
    found = np.zeros(n, dtype=bool)
    if width:
        values = np.zeros((n, width), dtype=np.uint8)
        for split in grouping.owners():
            positions = grouping.positions(split)
            found[positions], values[positions] = gathers[split].fixed_values(keys[positions])
        return Answer(found, values, width, None)
    results = []
    for split in grouping.owners():
        positions = grouping.positions(split)
        results.append((split, positions, gathers[split].lookup(keys[positions])))
    if max_bytes is not None:
        size = sum(gathers[split].value_bytes(result) for split, _, result in results)
        if size > max_bytes:
            raise AnswerTooLarge(size)
    lengths = np.zeros(n, dtype=np.int64)
    pieces: list[tuple[np.ndarray, ValueColumn]] = []
    for split, positions, result in results:
        found[positions] = result.found
        column = gathers[split].variable(result).as_variable()
        lengths[positions] = column.lengths()
        pieces.append((positions, column))
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    blob = np.empty(int(offsets[-1]), dtype=np.uint8)
    for positions, column in pieces:
        if column.nbytes:
            start = column.offsets[0]
            dest = np.repeat(offsets[positions] - (column.offsets[:-1] - start), column.lengths())
            dest += np.arange(column.nbytes, dtype=np.int64)
            blob[dest] = column.blob[start : start + column.nbytes]
    return Answer(found, blob, 0, offsets)


# ---------------------------------------------------------------------------------------------
# the services


@dataclass(slots=True)
class ParsedSeek:
    """A checked cube.v1 SeekRequest: its keys and the version to answer from, held (acquired)
    from parse to answer so that it cannot be unmapped in between (None: a server that holds
    nothing by design, every key a miss). `answer_bound` is the most bytes its values can take
    (keys x the version's longest value); above the server's bound the size is counted exactly
    before the values are gathered."""

    request_id: int
    keys: np.ndarray
    version: LoadedVersion | None
    answer_bound: int = 0
    count_bytes: bool = False


# server-side request time (seconds) and keys per request
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)
BATCH_BUCKETS = (1, 10, 100, 500, 1000, 2000, 5000, 10000, 50000)
# cube.v1 unary, stream and TCP lane; rec.mcube.DictService over gRPC, HTTP+JSON and baidu_std
APIS = ("seek", "seek_stream", "lane", "original", "http", "baidu_std")


class ApiCounters:
    """What one lookup API of one worker answered: updated once per request (and misses once
    per kernel pass), never per key."""

    __slots__ = ("batch", "errors", "keys", "latency", "misses", "requests")

    def __init__(self) -> None:
        self.requests = 0  # answered
        self.keys = 0
        self.misses = 0
        self.errors: dict[str, int] = {}  # gRPC status name -> requests refused with it
        self.latency = Histogram(LATENCY_BUCKETS)
        self.batch = Histogram(BATCH_BUCKETS)

    def error(self, code: grpc.StatusCode) -> None:
        self.errors[code.name] = self.errors.get(code.name, 0) + 1

    def snapshot(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "keys": self.keys,
            "misses": self.misses,
            "errors": dict(self.errors),
            "latency": self.latency.snapshot(),
            "batch": self.batch.snapshot(),
        }


class Counters:
    """Request counters of one worker, per API (reported by status and the metrics)."""

    __slots__ = ("api", "inflight", "lane_batches")

    def __init__(self) -> None:
        self.api = {name: ApiCounters() for name in APIS}
        self.lane_batches = 0  # kernel passes of the lane
        self.inflight = 0  # gRPC lookups being answered

    def as_dict(self) -> dict[str, int]:
        """The totals status has always shown."""
        api = self.api
        fast = api["seek"].requests + api["seek_stream"].requests + api["lane"].requests
        return {
            "requests": fast,
            "stream_messages": api["seek_stream"].requests,
            "lane_messages": api["lane"].requests,
            "lane_batches": self.lane_batches,
            "original_requests": api["original"].requests,
            "http_requests": api["http"].requests,
            "baidu_std_requests": api["baidu_std"].requests,
            "keys": sum(c.keys for c in api.values()),
            "unfound": sum(c.misses for c in api.values()),
            "errors": sum(sum(c.errors.values()) for c in api.values()),
        }

    def snapshot(self) -> dict[str, Any]:
        """Everything, for the metrics endpoint (worker 0 gathers every worker's)."""
        return {
            "api": {name: c.snapshot() for name, c in self.api.items()},
            "lane_batches": self.lane_batches,
            "inflight": self.inflight,
        }


DEFAULT_MAX_ANSWER_BYTES = 64 << 20
REFUSALS_LOGGED = 10  # a second per worker: a flood of bad requests must not flood the log


class SeekService:
    """Answers lookups from the slots of one server process.

    A request is refused (never answered with misses it does not deserve) when the replica
    cannot serve (UNAVAILABLE, with the reason: nothing loaded, start-up load failed, files
    changed under it), when a key does not route to the shard this replica holds
    (INVALID_ARGUMENT naming the key and both routings; checked on the misses only, since a
    key of another shard is never found here), or when its answer would exceed
    `max_answer_bytes` (RESOURCE_EXHAUSTED)."""

    def __init__(
        self,
        slots: VersionSlots,
        *,
        max_batch: int,
        max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES,
        dict_name: str = "",
        shard: int = -1,
        partitioner: str = "mod",
    ) -> None:
        self.slots = slots
        self.max_batch = max_batch
        self.max_answer_bytes = max_answer_bytes
        self.dict_name = dict_name
        self.accepted_names = {"", dict_name}
        if dict_name and shard >= 0:
            self.accepted_names.add(part_name(dict_name, shard))
        self.partitioner = partitioner
        self.counters = Counters()
        self.draining = False  # SIGTERM received: in-flight calls finish, no new ones
        self._refusal_window = 0.0
        self._refusals_logged = self._refusals_unlogged = 0
        self.lane_port = 0  # the TCP lane's port, announced to empty Seek requests (discovery)
        self.lane_stats: Callable[[], dict[str, int]] = dict  # the lane's, once it runs

    def refused(self, api: str, error: RequestError) -> None:
        """Count a refused request and log it (its message names the request id the SDK sent,
        which the SDK's error carries too), at most REFUSALS_LOGGED a second per worker."""
        self.counters.api[api].error(error.code)
        now = time.monotonic()
        if now - self._refusal_window >= 1.0:
            if self._refusals_unlogged:
                log.info("%d more refused requests in the last second", self._refusals_unlogged)
            self._refusal_window, self._refusals_logged, self._refusals_unlogged = now, 0, 0
        if self._refusals_logged < REFUSALS_LOGGED:
            self._refusals_logged += 1
            log.info("refused (%s) %s: %s", api, error.code.name, error.message)
        else:
            self._refusals_unlogged += 1

    def _keys(self, raw: bytes, what: str) -> np.ndarray:
        if len(raw) % 8:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{what}: keys are {len(raw)} bytes, not a multiple of 8"
                " (packed little-endian uint64)",
            )
        return self._check_batch(np.frombuffer(raw, dtype=_KEY_DTYPE), what)

    def _check_batch(self, keys: np.ndarray, what: str) -> np.ndarray:
        self.check_key_count(keys.shape[0], what)
        return keys

    def check_key_count(self, count: int, what: str) -> None:
        """RESOURCE_EXHAUSTED beyond --max_batch keys (checked before the keys are converted)."""
        if count > self.max_batch:
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{what}: {count} keys in one request; this server takes at most"
                f" {self.max_batch} (--max_batch): split the batch",
            )

    def _hold(
        self, name: str, keys: np.ndarray, what: str, table: str = ""
    ) -> tuple[LoadedVersion | None, int]:
        """The version to answer `keys` from (the table's, for a version of several tables),
        acquired (None: answer misses, by design), and the bound of the answer's value bytes;
        RequestError when the request must be refused."""
        slots = self.slots
        version = slots.get(name)
        n = keys.shape[0]
        if version is None:
            if name:
                raise RequestError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{what}: version {name!r} is not loaded here (current"
                    f" {self._name(slots.current)!r}, background"
                    f" {self._name(slots.background)!r})",
                )
            if not slots.serving:  # an empty request too: the SDK's first contact
                raise RequestError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"{what}: this replica serves no version: {slots.why_not_serving()}",
                )
            return None, 0
        if slots.not_ready:  # an empty request too: the first contact must not pass
            raise RequestError(
                grpc.StatusCode.UNAVAILABLE,
                f"{what}: this replica is not ready: {slots.not_ready}",
            )
        if version.broken:
            raise RequestError(
                grpc.StatusCode.UNAVAILABLE,
                f"{what}: version {version.name} is no longer served: {version.broken}",
            )
        version = self._table_of(version, table, n, what)
        bound = n * version.max_value_bytes
        if bound > self.max_answer_bytes and version.value_width:
            raise self._too_large(what, bound)
        return version.acquire(), bound

    @staticmethod
    def _table_of(version: LoadedVersion, table: str, count: int, what: str) -> LoadedVersion:
        """The version of `table` a request reads (an empty request without one, the SDK's
        first contact, reads the first table: no key, the version's name). A request that
        names no table, or one the version lacks, is refused: a wrong table would answer
        misses or another table's values."""
        found = version.table(table)
        if found is not None:
            return found
        tables = ", ".join(version.tables)
        if not table:
            if not count:
                return next(iter(version.tables.values()))
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{what}: version {version.name} holds several tables ({tables}): name one"
                ' (the SDK\'s table=, cube-cli -table, HTTP+JSON "table", cube.v1'
                " SeekRequest.table; the original rec.mcube and baidu_std APIs cannot)",
            )
        held = f"tables {tables}" if tables else "one unnamed table (send no table)"
        raise RequestError(
            grpc.StatusCode.NOT_FOUND,
            f"{what}: no table {clip(table)} in version {version.name} (it holds {held})",
        )

    @staticmethod
    def _misrouted(
        version: LoadedVersion, keys: np.ndarray, found: np.ndarray, what: str
    ) -> RequestError | None:
        """The refusal of a request with a key that routes to another shard. Only misses are
        checked: a found key is in this shard's build, so it routes here; a key routed
        elsewhere is always a miss (this costs nothing when every key is found)."""
        routing = version.routing
        if routing is None or routing.shard_num == 1:
            return None
        missed = np.flatnonzero(~found)
        if not missed.shape[0]:
            return None
        at = routing.first_foreign(keys[missed])
        if at < 0:
            return None
        position = int(missed[at])
        key = keys[position : position + 1]
        owner = int(shard_of(key, routing.shard_num, routing.partitioner)[0])
        return RequestError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{what}: key {int(key[0])} (position {position}) routes to shard {owner} of"
            f" {routing.shard_num} ({routing.partitioner}), but this server holds"
            f" {routing.describe()}: {MISROUTED_HINT}",
        )

    def _too_large(self, what: str, size: int) -> RequestError:
        return RequestError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{what}: the answer would take {size} bytes of values, more than this server's"
            f" {self.max_answer_bytes} (--max_answer_bytes): split the batch",
        )

    def seek(self, raw: bytes, api: str = "seek") -> bytes:
        """cube.v1 SeekRequest bytes -> SeekResponse bytes."""
        (answer,) = self.answer_seeks([self.parse_seek(raw)], api)
        if isinstance(answer, RequestError):
            raise answer
        assert not isinstance(answer, memoryview)  # a whole lane frame only with `frames`
        return b"".join(answer)

    def parse_seek(self, raw: Buffer) -> ParsedSeek:
        """Parse and check a cube.v1 SeekRequest; RequestError names what is wrong. The
        returned request holds its version until `answer_seeks` answers it."""
        try:
            request = cube_fast_pb2.SeekRequest.FromString(raw)  # type: ignore[arg-type]
        except Exception as exc:  # DecodeError
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT, f"SeekRequest does not parse: {exc}"
            ) from exc
        what = f"Seek request_id={request.request_id}"
        if request.dict_name not in self.accepted_names and self.dict_name:
            raise RequestError(
                grpc.StatusCode.NOT_FOUND,
                f"{what}: dict {request.dict_name!r} is not served here (this server holds"
                f" {self.dict_name!r})",
            )
        keys = self._keys(request.keys, what)
        version, bound = self._hold(request.version, keys, what, request.table)
        return ParsedSeek(request.request_id, keys, version, bound, bound > self.max_answer_bytes)

    def answer_seeks(
        self, seeks: Sequence[ParsedSeek], api: str = "lane", frames: bool = False
    ) -> list[list[Buffer] | memoryview | RequestError]:
        """SeekResponse bytes (as buffers) for parsed requests, in order, or the error of a
        request that could not be answered; each request's version is released here.
        Requests on the same version are looked up together: one pass over all their keys
        costs less than one per request (the numpy path's per-call costs dominate 1000-key
        batches). A request that fails fails alone.

        With `frames` (the TCP lane), a request on a single layer of fixed-width values is
        answered alone, with its whole lane frame (`cube.wire.fixed_answer_frame`) that the
        compiled kernel writes into: one buffer to write and no copies, where merging would
        copy every answer out of the merged one."""
        answers: list[Answer | RequestError | None] = [None] * len(seeks)
        try:
            groups: dict[int, list[int]] = {}
            for index, parsed in enumerate(seeks):
                version = parsed.version
                if version is None:
                    answers[index] = empty_answer(parsed.keys.shape[0])
                elif parsed.count_bytes:
                    answers[index] = self._answer_one(parsed, api)
                elif frames and (gather := self._framed(parsed)) is not None:
                    answers[index] = self._answer_in_frame(parsed, gather, api)
                else:
                    groups.setdefault(id(version), []).append(index)
            for members in groups.values():
                self._answer_group(seeks, members, answers, api)
        finally:
            for parsed in seeks:
                if parsed.version is not None:
                    parsed.version.release()
        counters = self.counters.api[api]
        responses: list[list[Buffer] | memoryview | RequestError] = []
        for parsed, answer in zip(seeks, answers, strict=True):
            assert answer is not None
            if isinstance(answer, RequestError):  # counted by the caller, like parse errors
                responses.append(answer)
                continue
            count = parsed.keys.shape[0]
            counters.requests += 1
            counters.keys += count
            counters.batch.observe(count)
            if parsed.version is None:
                counters.misses += count
            if answer.frame is not None:
                responses.append(answer.frame)
                continue
            name = parsed.version.name if parsed.version is not None else ""
            responses.append(seek_response_parts(answer, name, parsed.request_id))
        return responses

    @staticmethod
    def _framed(parsed: ParsedSeek) -> FastGather | None:
        """The gatherer that can answer `parsed` straight into a lane frame, if any."""
        version = parsed.version
        if version is None or version.broken or not parsed.keys.shape[0]:
            return None
        gathers = gatherers(version)
        if len(gathers) != 1 or gathers[0].words is None:
            return None
        return gathers[0]

    def _answer_in_frame(
        self, parsed: ParsedSeek, gather: FastGather, api: str
    ) -> Answer | RequestError:
        version = parsed.version
        assert version is not None
        keys = parsed.keys
        assert gather.words is not None
        frame, found, values = wire.fixed_answer_frame(
            keys.shape[0], gather.width, version.name, parsed.request_id, gather.words.dtype
        )
        try:
            misses = gather.fixed_values_into(keys, found, values)
        except Exception:
            log.exception("answering a request of %d keys failed", keys.shape[0])
            return RequestError(grpc.StatusCode.INTERNAL, "the lookup failed (see the server log)")
        self.counters.api[api].misses += misses
        if misses:
            what = f"Seek request_id={parsed.request_id}"
            refusal = self._misrouted(version, keys, found, what)
            if refusal is not None:
                return refusal
        return Answer(found, values.view(np.uint8), gather.width, None, frame)

    def _answer_group(
        self,
        seeks: Sequence[ParsedSeek],
        members: list[int],
        answers: list[Answer | RequestError | None],
        api: str,
    ) -> None:
        """One kernel pass over the keys of requests on one version (answers set in place)."""
        version = seeks[members[0]].version
        assert version is not None
        if version.broken:
            for index in members:
                answers[index] = self._dropped(version, seeks[index])
            return
        keys = [seeks[i].keys for i in members]
        try:
            if len(keys) == 1:
                merged = answers[members[0]] = answer_keys(version, keys[0], self.partitioner)
            else:
                bounds = [0, *itertools.accumulate(k.shape[0] for k in keys)]
                merged = answer_keys(version, np.concatenate(keys), self.partitioner)
                for index, piece in zip(members, split_answer(merged, bounds), strict=True):
                    answers[index] = piece
        except Exception:
            if len(members) == 1:
                log.exception("answering a request of %d keys failed", keys[0].shape[0])
                answers[members[0]] = RequestError(
                    grpc.StatusCode.INTERNAL, "the lookup failed (see the server log)"
                )
                return
            for index in members:  # one at a time: only the request at fault fails
                self._answer_group(seeks, [index], answers, api)
            return
        found = merged.found
        unfound = found.shape[0] - int(np.count_nonzero(found))
        self.counters.api[api].misses += unfound  # once a pass
        if unfound and version.routing is not None:
            for index in members:
                answer = answers[index]
                assert isinstance(answer, Answer)
                parsed = seeks[index]
                what = f"Seek request_id={parsed.request_id}"
                refusal = self._misrouted(version, parsed.keys, answer.found, what)
                if refusal is not None:
                    answers[index] = refusal

    def _answer_one(self, parsed: ParsedSeek, api: str) -> Answer | RequestError:
        """A request whose values may exceed the byte bound: counted before gathering."""
        version = parsed.version
        assert version is not None
        what = f"Seek request_id={parsed.request_id}"
        if version.broken:
            return self._dropped(version, parsed)
        try:
            answer = answer_keys(version, parsed.keys, self.partitioner, self.max_answer_bytes)
        except AnswerTooLarge as exc:
            return self._too_large(what, exc.size)
        except Exception:
            log.exception("answering %s failed", what)
            return RequestError(grpc.StatusCode.INTERNAL, "the lookup failed (see the server log)")
        misses = answer.found.shape[0] - int(np.count_nonzero(answer.found))
        self.counters.api[api].misses += misses
        return self._misrouted(version, parsed.keys, answer.found, what) or answer

    @staticmethod
    def _dropped(version: LoadedVersion, parsed: ParsedSeek) -> RequestError:
        return RequestError(
            grpc.StatusCode.UNAVAILABLE,
            f"Seek request_id={parsed.request_id}: version {version.name} is no longer served:"
            f" {version.broken}",
        )

    def seek_original(self, raw: Buffer, api: str = "original") -> bytes:
        """rec.mcube DictRequest bytes -> DictResponse bytes (gRPC, and baidu_std's body)."""
        try:
            request = cube_pb2.DictRequest.FromString(raw)  # type: ignore[arg-type]
        except Exception as exc:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT, f"DictRequest does not parse: {exc}"
            ) from exc
        self.check_key_count(len(request.keys), "seek")
        keys = np.array(request.keys, dtype=np.uint64)  # 2x faster than np.fromiter here
        answer, name = self.answer_original(keys, api)
        return encode_dict_response(answer, name if request.version_required else None)

    def answer_original(self, keys: np.ndarray, api: str, table: str = "") -> tuple[Answer, str]:
        """The original API's lookup, whatever carried it (gRPC, HTTP+JSON, baidu_std): every
        key's answer from the current version and that version's name ("" for none), counted
        under `api` (`table`: the table of a version of several; only HTTP+JSON names one).
        RequestError when the request is refused (the replica cannot serve, a
        key of another shard, an answer over --max_answer_bytes); the caller checked the key
        count (`check_key_count`)."""
        count = keys.shape[0]
        version, bound = self._hold("", keys, "seek", table)
        if version is None:
            answer = empty_answer(count)
            name = ""
        else:
            try:
                limit = self.max_answer_bytes if bound > self.max_answer_bytes else None
                answer = answer_keys(version, keys, self.partitioner, limit)
                name = version.name
            except AnswerTooLarge as exc:
                raise self._too_large("seek", exc.size) from None
            finally:
                version.release()
            refusal = self._misrouted(version, keys, answer.found, "seek")
            if refusal is not None:
                raise refusal
        counters = self.counters.api[api]
        counters.requests += 1
        counters.keys += count
        counters.batch.observe(count)
        counters.misses += count - int(np.count_nonzero(answer.found))
        return answer, name

    def timed(self, api: str, call: Callable[[], T]) -> T:
        """Run one lookup of `api` (any transport): a refusal (RequestError, re-raised) is
        counted and logged, an answer's time observed."""
        counters = self.counters
        started = time.perf_counter()
        counters.inflight += 1
        try:
            result = call()
        except RequestError as exc:
            self.refused(api, exc)
            raise
        finally:
            counters.inflight -= 1
        counters.api[api].latency.observe(time.perf_counter() - started)
        return result

    @staticmethod
    def _name(version: LoadedVersion | None) -> str:
        return version.name if version is not None else ""

    # grpc.aio handlers -------------------------------------------------------------------

    def discovery_metadata(self) -> tuple[tuple[str, str], ...]:
        """What an empty Seek (a client's first contact) is told: the TCP lane's port, the
        routing of the version served, which the SDK checks against its configuration, and
        --max_batch, which the SDK splits its batches by."""
        metadata = [(MAX_BATCH_METADATA, str(self.max_batch))]
        if self.lane_port:
            metadata.append((PORT_METADATA, str(self.lane_port)))
        current = self.slots.current
        if current is not None and current.routing is not None:
            metadata.append((ROUTING_METADATA, current.routing.to_text()))
        return tuple(metadata)

    async def _seek_rpc(self, raw: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        if not raw:  # an empty request: a client's first contact (discovery)
            await context.send_initial_metadata(self.discovery_metadata())
        counters = self.counters
        started = time.perf_counter()
        counters.inflight += 1
        try:
            answer = self.seek(raw)
        except RequestError as exc:
            self.refused("seek", exc)
            await context.abort(exc.code, exc.message)
            raise  # not reached: abort raises
        finally:
            counters.inflight -= 1
        counters.api["seek"].latency.observe(time.perf_counter() - started)
        return answer

    async def _seek_stream_rpc(
        self, _requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> None:
        # read()/write() on the context: a little cheaper per message than an async generator
        while True:
            raw = await context.read()
            # the stubs type read() as the request type; it returns grpc.aio.EOF at the end
            if raw is grpc.aio.EOF:  # type: ignore[comparison-overlap]
                return
            started = time.perf_counter()
            try:
                answer = self.seek(raw, "seek_stream")
            except RequestError as exc:
                self.refused("seek_stream", exc)
                await context.abort(exc.code, exc.message)
                return
            self.counters.api["seek_stream"].latency.observe(time.perf_counter() - started)
            await context.write(answer)

    async def _dict_seek_rpc(
        self, raw: bytes, context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> bytes:
        try:
            return self.timed("original", lambda: self.seek_original(raw))
        except RequestError as exc:
            await context.abort(exc.code, exc.message)
            raise

    def handlers(self) -> list[grpc.GenericRpcHandler]:
        """Raw-bytes handlers for both lookup services."""
        fast = grpc.method_handlers_generic_handler(
            FAST_SERVICE,
            {
                "Seek": grpc.unary_unary_rpc_method_handler(self._seek_rpc),
                "SeekStream": grpc.stream_stream_rpc_method_handler(self._seek_stream_rpc),
            },
        )
        original = grpc.method_handlers_generic_handler(
            DICT_SERVICE, {"seek": grpc.unary_unary_rpc_method_handler(self._dict_seek_rpc)}
        )
        return [fast, original]
