"""cube.conf, the original client configuration (a JSON array, one object per dictionary).

Fields (original-cube.md §7.1): `dict_name`, `shard`, `dup`, `timeout` (ms), `retry`,
`backup_request` (ms), `type`, optional `load_balancer` (default rr) and `nodes`:
- `ipport`: `nodes[i] = {"ip", "port"}` is shard i (one replica);
- `ipport_list`: `nodes[i] = {"ipport_list": "list://ip:port,ip:port"}`, shard i's replicas;
- `ipport_parallel`: every shard uses `nodes[0]` (`{"ip","port"}`, or an `ipport_list`).
Ours, optional: `partitioner` (`mod`, the default, or `murmur3`; must match the builder's).
`dup` is read and checked but, as in the original, does not limit anything.

Parsing is pure (`parse_conf` takes the decoded JSON); errors name the source, dict and field.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cube.client._policy import LOAD_BALANCERS
from cube.client.errors import ConfError, DictNotChosenError
from cube.routing import PARTITIONERS

TYPES = ("ipport", "ipport_list", "ipport_parallel")
_REQUIRED_INTS = ("shard", "dup", "timeout", "retry", "backup_request")


@dataclass(frozen=True)
class DictConf:
    """One dictionary's client settings, in the SDK's terms."""

    dict_name: str
    shards: tuple[tuple[str, ...], ...]  # replicas ("host:port") of each shard, shard order
    timeout_ms: int
    retry: int
    backup_request_ms: int
    load_balancer: str = "rr"
    partitioner: str = "mod"
    type: str = "ipport"
    dup: int = 1


def load_conf(path: str | os.PathLike[str], dict_name: str | None = None) -> DictConf:
    """Read `path` and return the dict named `dict_name` (optional if the file has one)."""
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
    return parse_conf(data, dict_name, source=str(path))


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
    balancer = entry.get("load_balancer", "rr")
    if balancer not in LOAD_BALANCERS:
        raise ConfError(
            f"{where}: field 'load_balancer' must be one of {', '.join(LOAD_BALANCERS)}, "
            f"got {balancer!r}"
        )
    partitioner = entry.get("partitioner", "mod")
    if partitioner not in PARTITIONERS:
        raise ConfError(
            f"{where}: field 'partitioner' must be one of {', '.join(PARTITIONERS)}, "
            f"got {partitioner!r}"
        )
    nodes = entry.get("nodes")
    if not isinstance(nodes, list) or not nodes:
        raise ConfError(f"{where}: field 'nodes' must be a non-empty array")
    shard_num = ints["shard"]
    if kind == "ipport_parallel":
        shards = (_node(nodes[0], f"{where}: nodes[0]"),) * shard_num
    else:
        if len(nodes) != shard_num:
            raise ConfError(
                f"{where}: field 'nodes' has {len(nodes)} entries but 'shard' is {shard_num}"
                " (one node per shard, in shard order)"
            )
        shards = tuple(
            _node(node, f"{where}: nodes[{i}]", list_only=kind == "ipport_list")
            for i, node in enumerate(nodes)
        )
    return DictConf(
        dict_name=name,
        shards=shards,
        timeout_ms=ints["timeout"],
        retry=ints["retry"],
        backup_request_ms=ints["backup_request"],
        load_balancer=balancer,
        partitioner=partitioner,
        type=kind,
        dup=ints["dup"],
    )


def _node(node: Any, where: str, list_only: bool | None = None) -> tuple[str, ...]:
    """Replicas of one node entry: `{"ip","port"}` or `{"ipport_list": "list://a:p,b:q"}`."""
    if not isinstance(node, dict):
        raise ConfError(f"{where}: expected an object, got {node!r}")
    if "ipport_list" in node or list_only:
        text = node.get("ipport_list")
        if not isinstance(text, str):
            raise ConfError(
                f"{where}: field 'ipport_list' must be a string like list://ip:port,ip:port"
            )
        body = text.removeprefix("list://")
        replicas = tuple(part.strip().split()[0] for part in body.split(",") if part.strip())
        if not replicas:
            raise ConfError(f"{where}: field 'ipport_list' lists no replicas: {text!r}")
        for replica in replicas:
            _check_address(replica, f"{where}: field 'ipport_list'")
        return replicas
    ip, port = node.get("ip"), node.get("port")
    if not isinstance(ip, str) or not ip:
        raise ConfError(f"{where}: field 'ip' must be a non-empty string, got {ip!r}")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ConfError(f"{where}: field 'port' must be an integer in 1..65535, got {port!r}")
    return (f"{ip}:{port}",)


def _check_address(address: str, where: str) -> None:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfError(f"{where}: {address!r} is not host:port")
