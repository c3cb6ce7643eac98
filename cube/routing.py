"""Which shard (or split) owns a key. Pure and vectorized; shared by builder, server and SDK.

`mod` is the original's rule (`key % n`); `murmur3` hashes first, for ids whose low digits are
skewed (structured ids, or `dict_split` sharing a factor with `shard_num`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from cube.hashing import as_keys, murmur3_32

PARTITIONERS = ("mod", "murmur3")
# Ends the server's refusal of a key routed to the wrong shard; the SDK recognises it.
MISROUTED_HINT = "the client's shard order, shard count or partitioner does not match the build"


def check_partitioner(name: str) -> str:
    if name not in PARTITIONERS:
        raise ValueError(f"unknown partitioner {name!r}; expected one of {', '.join(PARTITIONERS)}")
    return name


def shard_of(keys: np.ndarray, shard_num: int, partitioner: str = "mod") -> np.ndarray:
    """Shard index (int64 array) of every key."""
    if shard_num < 1:
        raise ValueError(f"shard_num must be >= 1, got {shard_num}")
    keys = as_keys(keys)
    if shard_num == 1:
        return np.zeros(keys.shape, dtype=np.int64)
    if check_partitioner(partitioner) == "mod":
        return (keys % np.uint64(shard_num)).astype(np.int64)
    return (murmur3_32(keys) % np.uint32(shard_num)).astype(np.int64)


@dataclass(frozen=True)
class Grouping:
    """Keys grouped by owner: `order` lists key positions owner by owner; owner `s` has
    positions `order[bounds[s]:bounds[s + 1]]`. Scatter answers back with `out[order] = ...`."""

    order: np.ndarray
    bounds: np.ndarray

    def positions(self, owner: int) -> np.ndarray:
        return self.order[self.bounds[owner] : self.bounds[owner + 1]]

    def owners(self) -> list[int]:
        """Owners that received at least one key."""
        return np.flatnonzero(np.diff(self.bounds)).tolist()


def group_by_owner(owner: np.ndarray, owner_count: int) -> Grouping:
    """Group key positions by owner in one stable pass (request order kept inside a group)."""
    # A stable argsort of a uint8/uint16 array is a radix sort: O(n), ~2x faster at 1000 keys.
    small = np.uint8 if owner_count <= 1 << 8 else np.uint16 if owner_count <= 1 << 16 else None
    order = np.argsort(owner.astype(small, copy=False) if small else owner, kind="stable")
    counts = np.bincount(owner, minlength=owner_count)
    bounds = np.zeros(owner_count + 1, dtype=np.int64)
    np.cumsum(counts, out=bounds[1:])
    return Grouping(order=order, bounds=bounds)


@dataclass(frozen=True)
class ShardRouting:
    """Which keys one shard holds: what a built shard's header records (dict, shard, count,
    partitioner). A server refuses keys that do not route to it and the SDK compares it with
    its own configuration, so a wrong shard order, count or partitioner is an error, not a
    stream of misses."""

    dict_name: str
    shard: int
    shard_num: int
    partitioner: str

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> ShardRouting | None:
        """From shard header fields; None when they do not say (hand-made or older shards)."""
        try:
            shard, shard_num = int(meta["shard"]), int(meta["shard_num"])
            partitioner = check_partitioner(str(meta.get("partitioner") or "mod"))
        except (KeyError, TypeError, ValueError):
            return None
        if not 0 <= shard < shard_num:
            return None
        return cls(str(meta.get("dict_name") or ""), shard, shard_num, partitioner)

    def describe(self) -> str:
        dict_part = f" of dict {self.dict_name!r}" if self.dict_name else ""
        return f"shard {self.shard} of {self.shard_num} ({self.partitioner}){dict_part}"

    def first_foreign(self, keys: np.ndarray) -> int:
        """Position of the first key that routes to another shard, -1 when all are ours."""
        if self.shard_num == 1 or not keys.shape[0]:
            return -1
        n = self.shard_num
        if self.partitioner == "mod":
            owner = keys & np.uint64(n - 1) if n & (n - 1) == 0 else keys % np.uint64(n)
            foreign = owner != np.uint64(self.shard)
        else:
            foreign = murmur3_32(keys) % np.uint32(n) != np.uint32(self.shard)
        return int(foreign.argmax()) if foreign.any() else -1

    def to_text(self) -> str:
        """The `cube-routing` metadata a server announces (compact JSON, ASCII)."""
        fields = {
            "dict_name": self.dict_name,
            "shard": self.shard,
            "shard_num": self.shard_num,
            "partitioner": self.partitioner,
        }
        return json.dumps(fields, separators=(",", ":"))

    @classmethod
    def from_text(cls, text: str) -> ShardRouting | None:
        try:
            fields = json.loads(text)
        except ValueError:
            return None
        return cls.from_meta(fields) if isinstance(fields, dict) else None
