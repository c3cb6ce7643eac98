"""What the blocking and the asyncio clients share: arguments, routing, and building rounds.
No I/O here; the subclasses drive rounds over their transport."""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import time
from collections.abc import Iterator, Mapping, Sequence
from functools import partial
from typing import Any, Generic, NamedTuple, Self, TypedDict, TypeVar, Unpack

import numpy as np
import numpy.typing as npt

from cube.client._core import (
    DEFAULT_MAX_BATCH,
    PROTOCOLS,
    Finish,
    Flow,
    Piece,
    PieceOutcome,
    PieceRequest,
    R,
    SeekResult,
    assemble,
    assemble_tables,
    make_plan,
    make_table_plan,
    normalize_keys,
    seek_flow,
)
from cube.client._policy import MIN_ATTEMPT_S, Cluster, EndpointState, Policy, Round, ShardCall
from cube.client._transport import TRANSPORTS, ClientTLS, Contact
from cube.client.conf import DictConf, load_conf
from cube.client.errors import ClientClosedError, ConfError, CubeError, RequestRejectedError
from cube.client.options import (
    LoadBalancer,
    Partitioner,
    Retry,
    Timeouts,
    TransportName,
    WireProtocol,
)
from cube.client.stats import ClientStats
from cube.layout import clip
from cube.routing import PARTITIONERS, ShardRouting
from cube.security import SecurityError
from cube.wire import Answer, BadMessage, Buffer

_NONE_TRIED: frozenset[int] = frozenset()
# seek_tables' argument: (table, keys) pairs, or a mapping of table to keys
TablesArg = Mapping[str, npt.ArrayLike] | Sequence[tuple[str, npt.ArrayLike]]


class TablePlan(NamedTuple):
    """A lookup in several tables, planned (`cube.client._core.make_table_plan`)."""

    tables: list[tuple[str, np.ndarray]]  # each table's keys, in the order asked
    every: np.ndarray  # every key, back to back
    pieces: list[Piece]
    finish: Finish[list[SeekResult]]
    limits: tuple[int, ...]  # the shards' limits the plan was made for


_ID_MASK = (1 << 48) - 1
MAX_REPLANS = 2  # a call re-planned when servers it met take fewer keys than it planned for

T = TypeVar("T")  # the transport protocol of a client: SyncTransport or AsyncTransport


class ClientOptions(TypedDict, Generic[T], total=False):
    """The keyword arguments of CubeClient / AsyncCubeClient (ClientBase documents them), as
    `from_conf` takes them to override cube.conf's settings."""

    partitioner: Partitioner
    timeout: Timeouts | float
    retry: Retry | int
    load_balancer: LoadBalancer
    max_batch: int
    protocol: WireProtocol
    max_version_rounds: int
    transport: TransportName | T
    busy_poll_us: float
    tls_ca: str | None
    tls_server_name: str
    dim: int | None
    stats: ClientStats | None
    seed: int | None


def normalize_shards(shards: Any) -> tuple[tuple[str, ...], ...]:
    """`[["host:port", ...replicas], ...]` (a bare "host:port" is one replica) -> tuples."""
    if isinstance(shards, str) or not isinstance(shards, Sequence) or not shards:
        raise ConfError('shards must be a non-empty list like [["host:port", ...], ...]')
    result = []
    for number, replicas in enumerate(shards):
        if isinstance(replicas, str):
            replicas = [replicas]
        if not isinstance(replicas, Sequence) or not replicas:
            raise ConfError(f"shard {number}: expected a non-empty list of 'host:port' replicas")
        for address in replicas:
            host, _, port = str(address).rpartition(":")
            if not isinstance(address, str) or not host or not port.isdigit():
                raise ConfError(f"shard {number}: replica {address!r} is not 'host:port'")
        result.append(tuple(replicas))
    return tuple(result)


class ClientBase(Generic[T]):
    """What CubeClient and AsyncCubeClient share: the arguments, routing, building rounds.

    shards: replicas of each shard in shard order, e.g. `[["127.0.0.1:8000", "127.0.0.1:8001"],
        ["127.0.0.1:8010"]]`; every worker port of a multi-worker server is one replica.
    partitioner: "mod" (`key % shard_num`, the original's) or "murmur3"; the builder's.
    timeout: seconds per attempt, or `Timeouts(attempt=..., backup_after=..., total=...)` to
        also send backup requests (the first answer wins) and bound the whole call (retries,
        backup requests and version re-asks included: DeadlineExceededError past it). A
        number bounds each attempt only, as before; `from_conf` bounds the whole call by
        cube.conf's `timeout`, as the original did.
    retry: extra attempts (on other replicas first), or `Retry(attempts, backoff, cooldown)`.
    load_balancer: "rr", "random" or "la" (least in flight, then lowest latency); cube.conf
        also takes brpc's names (see cube.client.conf).
    dict_name: sent with every request so a server of another dict rejects it ("" = any).
    max_batch: keys per sub-request at most. Servers that state their --max_batch on first
        contact lower it for their shard (a batch is split into more sub-requests, not
        refused); with older ones, set it to theirs.
    protocol: "fast" (cube.v1, default) or "original" (rec.mcube.DictService, slower).
    max_version_rounds: version candidates tried before VersionMismatchError.
    transport: "auto" (default: the fast protocol uses a server's TCP lane when it offers one,
        ~10x cheaper per call than gRPC), "grpc" (gRPC only), or a transport object: a
        `SyncTransport` for CubeClient, an `AsyncTransport` for AsyncCubeClient (e.g.
        `MockTransport`, both, in tests: no server needed).
    busy_poll_us: CubeClient on the TCP lane only: wait for an answer by polling for up to
        this long before sleeping, while it is the process's only call waiting (pairs with
        the server's --busy_poll_us). Lower latency where waking an idle CPU is slow (VMs), for
        up to one core of CPU while waiting. 0 (default) = off. AsyncCubeClient refuses it.
    tls_ca: None (default) = plaintext; else TLS to servers started with --tls_cert,
        trusting this PEM CA bundle ("" = the system's CAs), over gRPC and the TCP lane.
    tls_server_name: the name the servers' certificates carry, when it is not the host of
        their addresses (e.g. addresses by IP, certificates by DNS name).
    dim: the width of get_embeddings' rows when a call gives none (from_conf: cube.conf's
        `dim`); None (default): every get_embeddings call passes its `dim`.
    stats: a `ClientStats` to count calls, latency, retries, backup requests won, failovers
        and failed attempts per shard into (None, the default: nothing counted); export them
        with `cube.client.prometheus.ClientCollector`.
    seed: of the load balancer's and the retries' randomness (tests).
    """

    def __init__(
        self,
        shards: Sequence[Sequence[str] | str],
        *,
        partitioner: Partitioner = "mod",
        timeout: Timeouts | float = 1.0,
        retry: Retry | int = 2,
        load_balancer: LoadBalancer = "rr",
        dict_name: str = "",
        max_batch: int = DEFAULT_MAX_BATCH,
        protocol: WireProtocol = "fast",
        max_version_rounds: int = 3,
        transport: TransportName | T = "auto",
        busy_poll_us: float = 0,
        tls_ca: str | None = None,
        tls_server_name: str = "",
        dim: int | None = None,
        stats: ClientStats | None = None,
        seed: int | None = None,
    ) -> None:
        self.shards = normalize_shards(shards)
        self.stats = stats
        if partitioner not in PARTITIONERS:
            raise ConfError(f"partitioner {partitioner!r} is not one of {', '.join(PARTITIONERS)}")
        if protocol not in PROTOCOLS:
            raise ConfError(f"protocol {protocol!r} is not one of {', '.join(PROTOCOLS)}")
        if max_batch < 1:
            raise ConfError(f"max_batch must be >= 1, got {max_batch}")
        if isinstance(transport, str) and transport not in TRANSPORTS:
            raise ConfError(f"transport {transport!r} is not one of {', '.join(TRANSPORTS)}")
        if busy_poll_us < 0:
            raise ConfError(f"busy_poll_us must be >= 0, got {busy_poll_us}")
        if max_version_rounds < 1:
            raise ConfError(f"max_version_rounds must be >= 1, got {max_version_rounds}")
        if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int) or dim < 1):
            raise ConfError(f"dim must be an integer >= 1 or None, got {dim!r}")
        self.dim = dim
        self.timeouts = timeout if isinstance(timeout, Timeouts) else Timeouts(float(timeout))
        self.retry = retry if isinstance(retry, Retry) else Retry(attempts=int(retry))
        self.partitioner = partitioner
        self.dict_name = dict_name
        # each endpoint's --max_batch as its first contact stated it, and what that makes the
        # most keys per sub-request of each shard (read by every call: replaced, not changed)
        self._server_max_batch: dict[str, int] = {}
        self.max_batch = max_batch  # (sets _limits)
        self.max_version_rounds = max_version_rounds
        self.policy = Policy.from_options(self.timeouts, self.retry)
        self._total_s = self.timeouts.total  # the whole call's bound (None: none)
        # A batch of one sub-request runs its first attempt on the fast path (see
        # _first_attempt) unless backup requests need the state machine's timers.
        self._lone_fast = self.policy.backup_request_ms <= 0
        self._rng = random.Random(seed)
        # request ids count up from a random start (never seeded, unlike the balancer):
        # fresh for every call, and cheap to write (see cube.wire._varint)
        self._ids = itertools.count(random.Random().getrandbits(48))
        self._cluster = Cluster(self.shards, load_balancer, self._rng)
        self._wire = PROTOCOLS[protocol]()
        # Only the fast protocol's Seek has a TCP lane.
        self._use_lanes = transport == "auto" and protocol == "fast"
        self._busy_poll_s = busy_poll_us / 1e6
        if tls_ca is None and tls_server_name:
            raise ConfError('tls_server_name needs tls_ca ("" for the system\'s CAs)')
        self._tls = None if tls_ca is None else ClientTLS(tls_ca, tls_server_name)
        if self._tls is not None:
            try:
                self._tls.trust  # noqa: B018 - read the CA file now: errors name it
            except SecurityError as exc:
                raise ConfError(str(exc)) from None
        self._injected: T | None = None if isinstance(transport, str) else transport
        self._closed = False
        self._open()

    def _open(self) -> None:
        """Set up the transport (the blocking or the asyncio one)."""
        raise NotImplementedError

    def _check_open(self) -> None:
        """ClientClosedError when the client was closed (a call on it, or `with` again)."""
        if self._closed:
            where = f" of dict {self.dict_name!r}" if self.dict_name else ""
            raise ClientClosedError(
                f"this {type(self).__name__}{where} is closed: open a new client (a closed one"
                " cannot be used or reopened)"
            )

    def _embedding_dim(self, dim: int | None) -> int:
        """`dim` as given, else the client's (cube.conf's `dim`); ConfError when neither."""
        if dim is not None:
            return dim
        if self.dim is None:
            where = f" dict {self.dict_name!r} of" if self.dict_name else ""
            raise ConfError(
                "get_embeddings needs dim (the values' width in elements): pass dim=, or set"
                f" `dim` for{where} the client (cube.conf's field `dim`, or dim= when building it)"
            )
        return self.dim

    @classmethod
    def from_conf(
        cls,
        path: str | os.PathLike[str],
        dict_name: str | None = None,
        **overrides: Unpack[ClientOptions[T]],
    ) -> Self:
        """A client for `dict_name` of the original cube.conf at `path` (see cube.client.conf;
        for several dicts in one object: CubeClients / AsyncCubeClients). The file's `timeout`
        bounds the whole call, as in the original (`Timeouts.total`), and each attempt
        unless `attempt_timeout` is smaller; its `tls_ca` and `tls_server_name` turn TLS on;
        its `dim` is get_embeddings' default width.
        Keyword arguments override the file's settings:
        a number as `timeout` (seconds) replaces the file's `timeout` (the whole call) and
        keeps its backup request; a `Timeouts` object replaces them all."""
        return cls._from_dict_conf(load_conf(path, dict_name), **overrides)

    @classmethod
    def _from_dict_conf(cls, conf: DictConf, **overrides: Unpack[ClientOptions[T]]) -> Self:
        """A client for one parsed cube.conf entry (`load_conf`, `parse_conf`), with
        `from_conf`'s overrides."""
        backup = conf.backup_request_ms / 1000.0 if conf.backup_request_ms > 0 else None
        settings: dict[str, Any] = {
            "partitioner": conf.partitioner,
            "timeout": conf_timeouts(conf),
            "retry": conf.retry,
            "load_balancer": conf.load_balancer,
            "dict_name": conf.dict_name,
            "dim": conf.dim,
        }
        if conf.tls_ca is not None:
            settings.update(tls_ca=conf.tls_ca, tls_server_name=conf.tls_server_name)
        settings.update(overrides)
        timeout = overrides.get("timeout")
        if timeout is not None and not isinstance(timeout, Timeouts):
            total = float(timeout)
            attempt = total
            if conf.attempt_timeout_ms is not None:
                attempt = min(total, conf.attempt_timeout_ms / 1000.0)
            settings["timeout"] = Timeouts(attempt, backup, total)
        return cls(conf.shards, **settings)

    def _observe_round(
        self,
        pieces: Sequence[Piece],
        requests: Sequence[PieceRequest],
        outcomes: list[PieceOutcome],
    ) -> list[PieceOutcome]:
        if self.stats is not None:
            self.stats.round([pieces[r.piece].shard for r in requests], outcomes)
        return outcomes

    def _request_id(self) -> int:
        """A fresh id for one seek() call: sent with its sub-requests (cube.v1 request_id),
        named in the servers' log lines about them and on the error the call raises."""
        return next(self._ids) & _ID_MASK or 1  # next() is atomic: safe across threads

    @staticmethod
    def _tag(error: CubeError, request_id: int) -> None:
        error.request_id = request_id
        error.add_note(f"request id {request_id} (the servers log it with their refusals)")

    def _observe_call(self, started: float, error: BaseException | None = None) -> None:
        if self.stats is not None:
            outcome = "ok" if error is None else type(error).__name__
            self.stats.call(outcome, time.perf_counter() - started)

    @property
    def shard_num(self) -> int:
        return self._cluster.shard_num

    @property
    def max_batch(self) -> int:
        """The most keys of a sub-request this client sends (its own bound; a shard whose
        servers stated a smaller --max_batch gets theirs: `batch_limits`)."""
        return self._max_batch

    @max_batch.setter
    def max_batch(self, value: int) -> None:
        self._max_batch = value
        self._update_limits()

    @property
    def batch_limits(self) -> tuple[int, ...]:
        """The most keys of a sub-request to each shard: `max_batch`, or less where the
        shard's servers stated a smaller --max_batch on first contact."""
        return self._limits

    def _update_limits(self) -> None:
        learned, own = self._server_max_batch, self._max_batch
        self._limits = tuple(
            min([own, *(learned.get(a) or own for a in replicas)]) for replicas in self.shards
        )

    def _on_contact(self, address: str, contact: Contact) -> str | None:
        """First contact with `address` (or a later check), from the transport: learn its
        --max_batch, and say what is wrong with its routing (None: nothing)."""
        learned = self._server_max_batch
        if learned.get(address) != contact.max_batch:
            if contact.max_batch is None:
                learned.pop(address, None)
            else:
                learned[address] = contact.max_batch
            self._update_limits()
        return self._check_routing(address, contact.routing)

    def _check_routing(self, address: str, routing: ShardRouting | None) -> str | None:
        """What is wrong when the server at `address` holds other keys than this client routes
        to it (None: nothing, or the server does not say)."""
        if routing is None:
            return None
        listed = [i for i, replicas in enumerate(self.shards) if address in replicas]
        holds = f"cube-server {address} holds {routing.describe()}"
        if self.dict_name and routing.dict_name and routing.dict_name != self.dict_name:
            return f"{holds}, but this client asks for dict {self.dict_name!r}"
        if routing.shard_num == 1:
            return None  # it holds every key of the dict
        expected = f"{self.shard_num} shards ({self.partitioner})"
        if routing.shard_num != self.shard_num or routing.partitioner != self.partitioner:
            return (
                f"{holds}, but this client routes keys over {expected}: set the client's"
                " shard count and partitioner to the build's"
            )
        if routing.shard not in listed:
            where = ", ".join(map(str, listed))
            return (
                f"{holds}, but this client lists it for shard {where} of {expected}: list the"
                " servers in shard order (cube.conf nodes, transfer.conf cube<i>_<j>)"
            )
        return None

    @property
    def endpoints(self) -> list[str]:
        return [e.address for e in self._cluster.endpoints]

    def _plan(self, keys: np.ndarray, table: str = "") -> tuple[list[Piece], tuple[int, ...]]:
        """The pieces of a call, within each shard's limit, and the limits they were made for
        (`table`: the table the keys are looked up in)."""
        limits = self._limits
        pieces = make_plan(keys, len(self.shards), self.partitioner, limits)
        if table:
            for piece in pieces:
                piece.table = table
        return pieces, limits

    def _replan(
        self,
        error: RequestRejectedError,
        keys: np.ndarray,
        limits: tuple[int, ...],
        table: str = "",
    ) -> tuple[list[Piece], tuple[int, ...]] | None:
        """A new plan when `error` refused a sub-request for its size and the shard's servers,
        met during the call, stated a smaller --max_batch than it was planned with (first
        contact happens in the call's first attempt); None: the error stands."""
        if not self._smaller_limit(error, limits):
            return None
        return self._plan(keys, table)

    def _smaller_limit(self, error: RequestRejectedError, limits: tuple[int, ...]) -> bool:
        """Whether `error` refused a sub-request for its size and the shard's servers, met
        during the call, take fewer keys than `limits` (the call's plan) allowed."""
        return (
            error.code == "RESOURCE_EXHAUSTED" and self._limits[error.shard] < limits[error.shard]
        )

    def _flow(self, keys: np.ndarray, pieces: list[Piece], version: str | None) -> Flow[SeekResult]:
        return self._flow_to(keys, pieces, version, assemble)

    def _flow_to(
        self, keys: np.ndarray, pieces: list[Piece], version: str | None, finish: Finish[R]
    ) -> Flow[R]:
        return seek_flow(
            keys,
            pieces,
            finish,
            self._wire.pins_versions,
            self.max_version_rounds,
            version,
            self._total_s,
            self.dict_name,
        )

    @contextlib.contextmanager
    def _observed(self) -> Iterator[tuple[int, float | None]]:
        """A call's request id and deadline, and its statistics and error tag when it ends
        (what `seek` does inline, on its hot path)."""
        self._check_open()
        started = time.perf_counter()
        request_id = self._request_id()
        try:
            yield request_id, self._deadline()
        except CubeError as exc:
            self._observe_call(started, exc)
            self._tag(exc, request_id)
            raise
        if self.stats is not None:
            self._observe_call(started)

    def _check_tables_protocol(self) -> None:
        """ConfError unless this client's protocol can name a table (cube.v1 can)."""
        if not self._wire.pins_versions:
            raise ConfError(
                "the original protocol (rec.mcube) cannot name a table: use the cube.v1 protocol"
            )

    def _table_plan(self, tables: TablesArg) -> TablePlan:
        """A lookup in several tables, checked and planned within the shards' limits."""
        self._check_tables_protocol()
        pairs = list(tables.items()) if isinstance(tables, Mapping) else list(tables)
        normal = []
        for pair in pairs:
            if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)):
                raise TypeError(f"seek_tables takes (table, keys) pairs, got {clip(pair)}")
            normal.append((pair[0], normalize_keys(pair[1])))
        limits = self._limits
        every, pieces, ranges = make_table_plan(normal, len(self.shards), self.partitioner, limits)
        return TablePlan(normal, every, pieces, assemble_tables(normal, ranges), limits)

    def _deadline(self) -> float | None:
        """The monotonic time a call starting now must end by (None: no whole-call bound)."""
        total = self._total_s
        return None if total is None else time.monotonic() + total

    def _first_timeout(self, started: float, deadline: float | None) -> float:
        """The fast path's first attempt's timeout: the attempt's, cut to the call's deadline."""
        timeout_s = self.policy.timeout_s
        if deadline is not None and deadline - started < timeout_s:
            return max(deadline - started, MIN_ATTEMPT_S)
        return timeout_s

    # The fast path. Most calls are one sub-request (one shard, or a batch routed to one)
    # whose first attempt answers. Such a call runs that attempt without the state machine:
    # no flow generator, round, shard call, actions or outcome objects. What the state
    # machine would do is done here in the same order (pick the replica as ShardCall.start
    # does, begin, send, accept the answer as ShardCall.on_response does, end, count); any
    # other end of the attempt (an error, a bad answer, another version) hands it over to
    # the state machine (`_adopted_round`), which carries on as if it had sent it itself:
    # the same retries, errors and statistics.

    def _first_attempt(
        self, piece: Piece, version: str | None, request_id: int
    ) -> tuple[EndpointState, int, bytes, float]:
        """(replica, its index, request bytes, monotonic start) of a lone sub-request's first
        attempt, the replica picked as ShardCall.start picks it and its begin() done."""
        group = self._cluster.shards[piece.shard]
        now = time.monotonic()
        choice = group.balancer.pick(group.replicas, _NONE_TRIED, now, reuse=True)
        assert choice is not None  # reuse=True always picks one
        replica = group.replicas[choice]
        replica.begin()
        request = self._wire.encode(piece.keys, self.dict_name, version, request_id, piece.table)
        return replica, choice, request, now

    def _accept(self, data: Buffer, piece: Piece, version: str | None) -> Answer | None:
        """The answer in `data` when ShardCall.on_response would take it, else None (the
        state machine then reads it again and says what is wrong)."""
        try:
            answer: Answer = self._wire.decode(data, piece.size)
        except BadMessage:
            return None
        if not answer.version or (version is not None and answer.version != version):
            return None
        return answer

    def _lone_result(
        self,
        keys: np.ndarray,
        pieces: list[Piece],
        answer: Answer,
        replica: EndpointState,
        latency_s: float,
    ) -> SeekResult:
        """The result of a first attempt accepted on the fast path; the replica's health and
        the statistics updated as the state machine would."""
        replica.end()
        replica.succeeded(latency_s)
        if self.stats is not None:
            self.stats.round([pieces[0].shard], [PieceOutcome(answer)])
        if type(pieces[0].where) is slice:  # a lone piece in request order holds every key
            return SeekResult(keys, answer.found, answer.column, answer.version)
        return assemble(keys, pieces, [answer])  # a batch routed to one of several shards

    def _adopted_round(
        self,
        pieces: Sequence[Piece],
        requests: Sequence[PieceRequest],
        request_id: int,
        choice: int,
        started: float,
        deadline: float | None = None,
    ) -> Round:
        """The round of the fast path's sub-request, its first attempt (to replica `choice`,
        sent at `started`) taken over by the state machine."""
        round_ = self._round(pieces, requests, started, request_id, deadline)
        round_.calls[0].adopt(choice, started)
        return round_

    def _round(
        self,
        pieces: Sequence[Piece],
        requests: Sequence[PieceRequest],
        now: float,
        request_id: int = 0,
        deadline: float | None = None,
    ) -> Round:
        calls = []
        for index, request in enumerate(requests):
            piece = pieces[request.piece]
            payload = self._wire.encode(
                piece.keys, self.dict_name, request.version, request_id, piece.table
            )
            decode = partial(self._wire.decode, n=piece.size)
            group = self._cluster.shards[piece.shard]
            calls.append(
                ShardCall(index, group, payload, decode, self.policy, self._rng, request.version)
            )
        return Round(calls, self.policy, now, deadline)


def conf_timeouts(conf: DictConf) -> Timeouts:
    """cube.conf's timeouts as the original means them: `timeout` bounds the whole call (brpc's
    channel timeout_ms is a deadline over the retries and backup requests), `attempt_timeout`
    (ours, optional) each attempt, `backup_request` (0 = off) the wait before a backup."""
    total = conf.timeout_ms / 1000.0
    attempt = total if conf.attempt_timeout_ms is None else conf.attempt_timeout_ms / 1000.0
    backup = conf.backup_request_ms / 1000.0 if conf.backup_request_ms > 0 else None
    return Timeouts(attempt, backup, total)
