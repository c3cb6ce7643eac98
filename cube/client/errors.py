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
    """A key that is not a uint64 (negative, too large or not an integer)."""


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
            tried = "; ".join(repr(a) for a in self.failures[shard]) or "no replica tried"
            parts.append(f"shard {shard} failed after trying [{tried}]")
        answered = ""
        if result is not None:
            answered = (
                f" ({int(result.answered.sum())} of {len(result)} keys answered by other shards;"
                " see .result)"
            )
        super().__init__(lead + "; ".join(parts) + answered)


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
