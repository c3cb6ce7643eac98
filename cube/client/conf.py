"""cube.conf, the original client configuration (a JSON array, one object per dictionary).

Fields (original-cube.md §7.1): `dict_name`, `shard`, `dup`, `timeout` (ms), `retry`,
`backup_request` (ms), `type`, optional `load_balancer` (default rr) and `nodes`:
- `ipport`: `nodes[i] = {"ip", "port"}` is shard i (one replica);
- `ipport_list`: `nodes[i] = {"ipport_list": "list://ip:port,ip:port"}`, shard i's replicas;
- `ipport_parallel`: every shard uses `nodes[0]` (`{"ip","port"}`, or an `ipport_list`).
Ours, optional: `partitioner` (`mod`, the default, or `murmur3`; must match the builder's),
`attempt_timeout` (ms, at most `timeout`), and `tls_ca` (a PEM CA bundle, "" for the system's:
TLS to servers started with --tls_cert) with `tls_server_name` (the name their certificates
carry, when not the host of their addresses), and `dim` (an integer >= 1: the values' width in
elements, get_embeddings' default `dim`). `dup` is read and checked but, as in the
original, does not limit anything.

`timeout` is the whole call's bound, as brpc's `timeout_ms` was for the original (a deadline
over the retries and backup requests); `attempt_timeout` bounds each attempt within it
(default: `timeout`, i.e. an attempt may use what remains of the call, as in brpc).

`load_balancer` takes every name brpc registers (BRPC_LOAD_BALANCERS): each is served by the
nearest policy of this SDK, with a warning when that is not the same name, or refused with
the reason where it cannot be honoured (see `_balancer` and docs/reference/cube-conf.md).

Parsing is pure (`parse_conf` takes the decoded JSON) but for those warnings (logger
`cube.client`); errors name the source, dict and field.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cube.client.errors import ConfError, DictNotChosenError
from cube.routing import PARTITIONERS

log = logging.getLogger("cube.client")

TYPES = ("ipport", "ipport_list", "ipport_parallel")
_REQUIRED_INTS = ("shard", "dup", "timeout", "retry", "backup_request")

# Every load balancer brpc registers (src/brpc/global.cpp), and the policy of this SDK that
# serves it (LOAD_BALANCERS), or None: honoured only where there is nothing to choose (every
# shard has one replica), refused elsewhere.
BRPC_LOAD_BALANCERS: dict[str, str | None] = {
    "rr": "rr",
    "random": "random",
    "la": "la",
    "wrr": "rr",  # weighted round robin: rr when a shard's replicas have the same weight
    "wr": "random",  # weighted random: random when a shard's replicas have the same weight
    "p2c": "la",  # power of two choices over latency x in flight: la scores replicas alike
    "c_murmurhash": None,  # consistent hashing on a request code the original never set
    "c_md5": None,
    "c_ketama": None,
    "_dynpart": None,  # brpc's internal balancer of a DynamicPartitionChannel's sub-channels
}
_WEIGHTED = ("wrr", "wr")
_ACCEPTED = (
    "accepted: rr, random, la; wrr and wr when the replicas of each shard have the same"
    " weight; p2c (served as la); c_murmurhash, c_md5, c_ketama and _dynpart only where every"
    " shard has one replica"
)
_WHY_NOT = {
    "c_murmurhash": "brpc's consistent hashing needs a request code per call, which the"
    " original client never set (brpc failed every call with it); this SDK has no such"
    " policy",
    "_dynpart": "it is brpc's internal balancer of DynamicPartitionChannel sub-channels, not"
    " meant for a list of servers",
}
_WHY_NOT["c_md5"] = _WHY_NOT["c_ketama"] = _WHY_NOT["c_murmurhash"]


@dataclass(frozen=True)
class DictConf:
    """One dictionary's client settings, in the SDK's terms."""

    dict_name: str
    shards: tuple[tuple[str, ...], ...]  # replicas ("host:port") of each shard, shard order
    timeout_ms: int
    retry: int
    backup_request_ms: int
    load_balancer: str = "rr"  # this SDK's policy (rr, random, la) serving the file's name
    partitioner: str = "mod"
    type: str = "ipport"
    dup: int = 1
    attempt_timeout_ms: int | None = None  # None: an attempt may use the whole `timeout`
    tls_ca: str | None = None  # None: plaintext; "": TLS trusting the system's CAs
    tls_server_name: str = ""
    dim: int | None = None  # get_embeddings' default width; None: each call passes its dim


def load_conf(path: str | os.PathLike[str], dict_name: str | None = None) -> DictConf:
    """Read `path` and return the dict named `dict_name` (optional if the file has one)."""
    return parse_conf(_read(path), dict_name, source=str(path))


def load_all(
    path: str | os.PathLike[str], dict_names: Sequence[str] | None = None
) -> list[DictConf]:
    """Read `path` and return every dict, in file order (or those named, in that order)."""
    confs = parse_all(_read(path), source=str(path))
    if dict_names is None:
        return confs
    by_name = {conf.dict_name: conf for conf in confs}
    missing = [name for name in dict_names if name not in by_name]
    if missing:
        raise ConfError(
            f"{path}: no dict {', '.join(map(repr, missing))} (has {', '.join(by_name)})"
        )
    return [by_name[name] for name in dict_names]


def _read(path: str | os.PathLike[str]) -> Any:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfError(
            f"{path}: not JSON: line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    return data


def parse_all(data: Any, source: str = "cube.conf") -> list[DictConf]:
    """Every dictionary of a decoded cube.conf (an array; a single object is accepted too)."""
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list) or not data:
        raise ConfError(f"{source}: expected a non-empty JSON array of dict objects")
    confs = []
    names: set[str] = set()
    for position, entry in enumerate(data):
        conf = _parse_dict(entry, source, position)
        if conf.dict_name in names:
            raise ConfError(f"{source}: dict {conf.dict_name!r} is defined twice")
        names.add(conf.dict_name)
        confs.append(conf)
    return confs


def parse_conf(data: Any, dict_name: str | None = None, source: str = "cube.conf") -> DictConf:
    confs = parse_all(data, source)
    if dict_name is None:
        if len(confs) > 1:
            raise DictNotChosenError(source, [c.dict_name for c in confs])
        return confs[0]
    for conf in confs:
        if conf.dict_name == dict_name:
            return conf
    raise ConfError(
        f"{source}: no dict {dict_name!r} (has {', '.join(c.dict_name for c in confs)})"
    )


def _parse_dict(entry: Any, source: str, position: int) -> DictConf:
    if not isinstance(entry, dict):
        raise ConfError(f"{source}: entry {position}: expected an object, got {entry!r}")
    name = entry.get("dict_name")
    if not isinstance(name, str) or not name:
        raise ConfError(
            f"{source}: entry {position}: field 'dict_name' must be a non-empty string, "
            f"got {name!r}"
        )
    where = f"{source}: dict {name!r}"

    def integer(field: str, minimum: int) -> int:
        if field not in entry:
            raise ConfError(f"{where}: missing field {field!r}")
        value = entry[field]
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfError(
                f"{where}: field {field!r} must be an integer >= {minimum}, got {value!r}"
            )
        return value

    minimum = {"shard": 1, "dup": 1, "timeout": 1, "retry": 0, "backup_request": 0}
    ints = {field: integer(field, minimum[field]) for field in _REQUIRED_INTS}
    kind = entry.get("type")
    if kind not in TYPES:
        raise ConfError(f"{where}: field 'type' must be one of {', '.join(TYPES)}, got {kind!r}")
    attempt_ms = entry.get("attempt_timeout")
    if attempt_ms is not None and (
        isinstance(attempt_ms, bool)
        or not isinstance(attempt_ms, int)
        or not 1 <= attempt_ms <= ints["timeout"]
    ):
        raise ConfError(
            f"{where}: field 'attempt_timeout' must be an integer in 1..{ints['timeout']}"
            f" (ms, at most 'timeout', which bounds the whole call), got {attempt_ms!r}"
        )
    balancer = entry.get("load_balancer", "rr")
    if not isinstance(balancer, str):
        raise ConfError(
            f"{where}: field 'load_balancer' must be a string (a brpc load balancer name),"
            f" got {balancer!r}"
        )
    partitioner = entry.get("partitioner", "mod")
    if partitioner not in PARTITIONERS:
        raise ConfError(
            f"{where}: field 'partitioner' must be one of {', '.join(PARTITIONERS)}, "
            f"got {partitioner!r}"
        )
    tls_ca, tls_server_name = _tls_fields(entry, where)
    nodes = entry.get("nodes")
    if not isinstance(nodes, list) or not nodes:
        raise ConfError(f"{where}: field 'nodes' must be a non-empty array")
    shard_num = ints["shard"]
    if kind == "ipport_parallel":
        tagged = (_node(nodes[0], f"{where}: nodes[0]"),) * shard_num
    else:
        if len(nodes) != shard_num:
            raise ConfError(
                f"{where}: field 'nodes' has {len(nodes)} entries but 'shard' is {shard_num}"
                " (one node per shard, in shard order)"
            )
        tagged = tuple(
            _node(node, f"{where}: nodes[{i}]", list_only=kind == "ipport_list")
            for i, node in enumerate(nodes)
        )
    return DictConf(
        dict_name=name,
        shards=tuple(tuple(address for address, _ in replicas) for replicas in tagged),
        timeout_ms=ints["timeout"],
        retry=ints["retry"],
        backup_request_ms=ints["backup_request"],
        load_balancer=_balancer(balancer, tagged, where),
        partitioner=partitioner,
        type=kind,
        dup=ints["dup"],
        attempt_timeout_ms=attempt_ms,
        tls_ca=tls_ca,
        tls_server_name=tls_server_name,
        dim=_dim_field(entry, where),
    )


def _dim_field(entry: dict[str, Any], where: str) -> int | None:
    """`dim` of one dict entry (None when absent)."""
    dim = entry.get("dim")
    if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int) or dim < 1):
        raise ConfError(
            f"{where}: field 'dim' must be an integer >= 1 (the values' width in elements,"
            f" get_embeddings' default), got {dim!r}"
        )
    return dim


def _tls_fields(entry: dict[str, Any], where: str) -> tuple[str | None, str]:
    """`tls_ca` (None when absent: plaintext) and `tls_server_name` of one dict entry."""
    tls_ca = entry.get("tls_ca")
    server_name = entry.get("tls_server_name", "")
    if tls_ca is not None and not isinstance(tls_ca, str):
        raise ConfError(
            f"{where}: field 'tls_ca' must be a string (a PEM CA bundle's path, \"\" for the"
            f" system's CAs), got {tls_ca!r}"
        )
    if not isinstance(server_name, str):
        raise ConfError(f"{where}: field 'tls_server_name' must be a string, got {server_name!r}")
    if server_name and tls_ca is None:
        raise ConfError(
            f"{where}: field 'tls_server_name' needs 'tls_ca' (\"\" for the system's CAs)"
        )
    return tls_ca, server_name


def _balancer(text: str, shards: Sequence[Sequence[tuple[str, str]]], where: str) -> str:
    """This SDK's policy for the brpc load balancer `text` (`name` or `name:parameters`) over
    `shards` (each replica's address and brpc tag), or ConfError where it cannot be honoured.
    A warning says which policy serves a name that is not one of ours."""
    name, _, parameters = text.partition(":")
    if name not in BRPC_LOAD_BALANCERS:
        raise ConfError(
            f"{where}: field 'load_balancer' must be one of brpc's balancers"
            f" {', '.join(BRPC_LOAD_BALANCERS)}, got {text!r} ({_ACCEPTED})"
        )
    policy = BRPC_LOAD_BALANCERS[name]
    notes = []
    if parameters:
        notes.append(f"its parameters {parameters!r} are ignored")
    if policy is None:
        if any(len(replicas) > 1 for replicas in shards):
            raise ConfError(
                f"{where}: field 'load_balancer' {text!r} cannot be honoured for a shard with"
                f" several replicas: {_WHY_NOT[name]} ({_ACCEPTED})"
            )
        policy = "rr"
        notes.append("every shard has one replica, so there is nothing to choose")
    elif name in _WEIGHTED:
        for number, replicas in enumerate(shards):
            weights = {tag for _, tag in replicas}
            if len(weights) > 1:
                listed = ", ".join(f"{a} {t or '(none)'}" for a, t in replicas)
                raise ConfError(
                    f"{where}: field 'load_balancer' {text!r} cannot be honoured: shard"
                    f" {number}'s replicas have different weights ({listed}) and this SDK"
                    f" balances a shard's replicas evenly; give them one weight, or use"
                    f" {policy} ({_ACCEPTED})"
                )
        notes.append(f"with one weight per shard it is {policy}")
    elif name != policy:
        notes.append(f"{policy} scores replicas by in-flight requests x latency, as it does")
    if name != policy or notes:
        log.warning(
            "%s: load_balancer %r is served by this SDK's %r policy (%s)",
            where,
            text,
            policy,
            "; ".join(notes),
        )
    return policy


def _node(node: Any, where: str, list_only: bool | None = None) -> tuple[tuple[str, str], ...]:
    """Replicas of one node entry, as (address, brpc tag): `{"ip","port"}` or
    `{"ipport_list": "list://a:p,b:q"}` (an entry may carry a tag after a space: its weight
    for brpc's wrr and wr)."""
    if not isinstance(node, dict):
        raise ConfError(f"{where}: expected an object, got {node!r}")
    if "ipport_list" in node or list_only:
        text = node.get("ipport_list")
        if not isinstance(text, str):
            raise ConfError(
                f"{where}: field 'ipport_list' must be a string like list://ip:port,ip:port"
            )
        body = text.removeprefix("list://")
        replicas = []
        for part in body.split(","):
            if part.strip():
                address, *tag = part.split(None, 1)  # brpc: a tag may follow a space
                _check_address(address, f"{where}: field 'ipport_list'")
                replicas.append((address, tag[0].strip() if tag else ""))
        if not replicas:
            raise ConfError(f"{where}: field 'ipport_list' lists no replicas: {text!r}")
        return tuple(replicas)
    ip, port = node.get("ip"), node.get("port")
    if not isinstance(ip, str) or not ip:
        raise ConfError(f"{where}: field 'ip' must be a non-empty string, got {ip!r}")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ConfError(f"{where}: field 'port' must be an integer in 1..65535, got {port!r}")
    return ((f"{ip}:{port}", ""),)


def _check_address(address: str, where: str) -> None:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfError(f"{where}: {address!r} is not host:port")
