"""Errors raised by the SDK. Every one is a `CubeError`; messages name the shard, the replicas
tried and what each answered, so an operator can act on the message alone."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cube.client._core import SeekResult


class CubeError(Exception):
    """Base class of every SDK error. `request_id`: the id a failed seek() call sent its
    sub-requests with (the servers' logs name it), when the error comes from one."""

    request_id: int | None = None


class ConfError(CubeError, ValueError):
    """A bad cube.conf or client argument; the message names the file, dict and field."""


class DictNotChosenError(ConfError):
    """The cube.conf defines several dicts and none was named; `names` lists them."""

    def __init__(
        self,
        source: str,
        names: list[str],
        how: str = "pass dict_name (or open them all: CubeClients.from_conf, AsyncCubeClients)",
    ) -> None:
        self.source, self.names = source, names
        super().__init__(f"{source} defines {len(names)} dicts ({', '.join(names)}); {how}")


class ConfigMismatchError(ConfError):
    """A server holds other keys than the client's configuration routes to it (wrong shard
    order, shard count, partitioner or dict): found on first contact, or refused by the
    server. The message names the endpoint, what it holds and what the client expected."""

    def __init__(self, shard: int, endpoint: str, details: str) -> None:
        self.shard = shard
        self.endpoint = endpoint
        self.details = details
        super().__init__(f"shard {shard} ({endpoint}): {details}")


class KeyRangeError(CubeError, ValueError):
    """A key that is not a uint64 (negative, too large or not an integer, a bool included)."""


class KeyShapeError(CubeError, TypeError, ValueError):
    """Keys in a shape with no request order: a 2-D array (flattening would guess an order) or
    a set (it has none). The message says what was given and what to pass instead. A
    TypeError and a ValueError, as either may be caught for a bad argument."""


class ClientClosedError(CubeError, RuntimeError):
    """A call on a client after `close()` / `aclose()` (as httpx refuses a closed client)."""


class TransportError(CubeError):
    """A call that failed: `code` is a gRPC status name (UNAVAILABLE, DEADLINE_EXCEEDED, ...)
    or one of ours (CONFIG_MISMATCH); `message` says what happened. Every transport raises
    it (the lanes, gRPC, a MockTransport's handler), so the retry policy sees one shape
    whichever moved the bytes."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class ValueSizeError(CubeError, ValueError):
    """`get_embeddings`: a value's size is not dim * itemsize."""


class Attempt:
    """One failed try of a sub-request: the replica and the error it gave."""

    __slots__ = ("code", "endpoint", "message")

    def __init__(self, endpoint: str, code: str, message: str) -> None:
        self.endpoint = endpoint
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return f"{self.endpoint}: {self.code} {self.message}".rstrip()


class RequestRejectedError(CubeError):
    """The server rejected the request with a non-retryable status (INVALID_ARGUMENT,
    RESOURCE_EXHAUSTED, NOT_FOUND, ...): raised at once, carrying the server's message."""

    def __init__(self, shard: int, endpoint: str, code: str, details: str) -> None:
        self.shard = shard
        self.endpoint = endpoint
        self.code = code
        self.details = details
        super().__init__(f"shard {shard} ({endpoint}) rejected the request: {code}: {details}")


class ShardUnavailableError(CubeError):
    """One or more shards failed on every replica tried.

    `failures` maps each failed shard to its attempts (replica, status, message); `result` is
    the partial SeekResult: keys of failed shards have `answered == False` (and
    `found == False`, value None), which is distinct from a miss (`answered == True`)."""

    def __init__(
        self,
        failures: Mapping[int, Sequence[Attempt]],
        result: SeekResult | None,
        lead: str = "",
    ) -> None:
        self.failures = {shard: list(attempts) for shard, attempts in failures.items()}
        self.result = result
        self.shards = sorted(self.failures)
        self.shard = self.shards[0]
        parts = []
        for shard in self.shards:
            tried = describe_attempts(self.failures[shard]) or "no replica tried"
            parts.append(f"shard {shard} failed after trying [{tried}]")
        answered = ""
        if result is not None:
            answered = (
                f" ({int(result.answered.sum())} of {len(result)} keys answered by other shards;"
                " see .result)"
            )
        super().__init__(lead + "; ".join(parts) + answered)


def describe_attempts(attempts: Sequence[Attempt]) -> str:
    """Each distinct error once, with how many attempts and which replicas gave it, in the
    order first seen: "3 attempts at h:1: UNAVAILABLE down" (one replica tried three times),
    "2 replicas (h:1, h:2): UNAVAILABLE down", or a lone attempt as `repr(Attempt)`."""
    groups: dict[tuple[str, str], list[str]] = {}
    for attempt in attempts:
        groups.setdefault((attempt.code, attempt.message), []).append(attempt.endpoint)
    parts = []
    for (code, message), endpoints in groups.items():
        error = f"{code} {message}".rstrip()
        replicas = list(dict.fromkeys(endpoints))
        if len(endpoints) == 1:
            parts.append(f"{endpoints[0]}: {error}")
        elif len(replicas) == 1:
            parts.append(f"{len(endpoints)} attempts at {replicas[0]}: {error}")
        elif len(replicas) == len(endpoints):
            parts.append(f"{len(replicas)} replicas ({', '.join(replicas)}): {error}")
        else:
            parts.append(
                f"{len(endpoints)} attempts at {len(replicas)} replicas"
                f" ({', '.join(replicas)}): {error}"
            )
    return "; ".join(parts)


class DeadlineExceededError(ShardUnavailableError, TimeoutError):
    """The call's whole-call timeout (`Timeouts.total`; cube.conf's `timeout`) passed before
    every shard answered: what was in flight was cancelled and no retry or backup request
    was started past it. A `ShardUnavailableError` (`failures`, `shards` and the partial
    `result` as there) and a `TimeoutError`. `timeout_s`: the bound; `dict_name`: the dict
    ("" when the client was not given one)."""

    def __init__(
        self,
        failures: Mapping[int, Sequence[Attempt]],
        result: SeekResult | None,
        timeout_s: float,
        dict_name: str = "",
    ) -> None:
        self.timeout_s = timeout_s
        self.dict_name = dict_name
        where = f"dict {dict_name!r}: " if dict_name else ""
        lead = f"{where}no answer within the call's timeout of {timeout_s * 1000:g} ms: "
        super().__init__(failures, result, lead)


class VersionMismatchError(CubeError):
    """Shards answered from different versions and no single version could answer the whole
    batch within the bounded number of re-asks. `versions` maps shard -> versions seen."""

    def __init__(self, versions: Mapping[int, Sequence[str]], tried: Sequence[str]) -> None:
        self.versions = {shard: list(v) for shard, v in versions.items()}
        self.tried = list(tried)
        seen = ", ".join(
            f"shard {s}: {'/'.join(n or '(nothing loaded)' for n in v)}"
            for s, v in sorted(versions.items())
        )
        super().__init__(
            f"shards answered from different versions ({seen}); re-asked for "
            f"{', '.join(repr(v) for v in tried) or 'nothing'} without getting one version "
            "for the whole batch (a rollout is probably in progress; retry later)"
        )
