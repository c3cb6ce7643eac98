"""cube.conf parsing: the original's three node types, our partitioner, clear errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cube.client import ConfError, CubeClient, load_conf, parse_conf
from cube.client.conf import parse_all


def entry(**changes: Any) -> dict[str, Any]:
    """One dict of a cube.conf (decoded JSON), with `changes`; a None value drops a field."""
    base: dict[str, Any] = {
        "dict_name": "test_dict",
        "shard": 2,
        "dup": 1,
        "timeout": 200,
        "retry": 3,
        "backup_request": 100,
        "type": "ipport",
        "nodes": [{"ip": "127.0.0.1", "port": 8000}, {"ip": "127.0.0.1", "port": 8001}],
    }
    base.update(changes)
    return {k: v for k, v in base.items() if v is not None}


def test_ipport() -> None:
    conf = parse_conf([entry()])
    assert conf.shards == (("127.0.0.1:8000",), ("127.0.0.1:8001",))
    assert (conf.timeout_ms, conf.retry, conf.backup_request_ms) == (200, 3, 100)
    assert (conf.load_balancer, conf.partitioner, conf.dict_name) == ("rr", "mod", "test_dict")


def test_ipport_list_as_the_original_sample() -> None:
    sample = """[{
        "dict_name": "test_dict", "shard": 1, "dup": 1, "timeout": 200, "retry": 3,
        "backup_request": 100, "type": "ipport_list", "load_balancer": "rr",
        "nodes": [{"ipport_list": "list://127.0.0.1:8000,127.0.0.1:8001"}]
    }]"""
    conf = parse_conf(json.loads(sample))
    assert conf.shards == (("127.0.0.1:8000", "127.0.0.1:8001"),)


def test_ipport_parallel_uses_node_zero_for_every_shard() -> None:
    conf = parse_conf([entry(type="ipport_parallel", shard=3, nodes=[{"ip": "h", "port": 1}])])
    assert conf.shards == (("h:1",),) * 3


def test_partitioner_and_load_balancer_fields() -> None:
    conf = parse_conf([entry(partitioner="murmur3", load_balancer="la")])
    assert (conf.partitioner, conf.load_balancer) == ("murmur3", "la")


def test_several_dicts_need_a_name(tmp_path: Path) -> None:
    path = tmp_path / "cube.conf"
    path.write_text(json.dumps([entry(), entry(dict_name="other")]))
    with pytest.raises(ConfError, match=r"defines 2 dicts \(test_dict, other\); pass dict_name"):
        load_conf(path)
    assert load_conf(path, "other").dict_name == "other"
    with pytest.raises(ConfError, match="no dict 'nope'"):
        load_conf(path, "nope")
    assert len(parse_all(json.loads(path.read_text()))) == 2
    client = CubeClient.from_conf(path, dict_name="other", retry=0)
    assert client.shard_num == 2 and client.policy.retry == 0 and client.dict_name == "other"
    client.close()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"shard": None}, "dict 'test_dict': missing field 'shard'"),
        ({"shard": "2"}, "field 'shard' must be an integer >= 1, got '2'"),
        ({"retry": -1}, "field 'retry' must be an integer >= 0"),
        ({"type": "list"}, "field 'type' must be one of ipport, ipport_list, ipport_parallel"),
        ({"load_balancer": "lalb"}, "field 'load_balancer' must be one of brpc's balancers rr,"),
        ({"partitioner": "crc"}, "field 'partitioner' must be one of mod, murmur3"),
        ({"nodes": []}, "field 'nodes' must be a non-empty array"),
        ({"shard": 3}, "field 'nodes' has 2 entries but 'shard' is 3"),
        ({"nodes": [{"ip": "h"}, {"ip": "h", "port": 1}]}, r"nodes\[0\]: field 'port'"),
        ({"type": "ipport_list"}, r"nodes\[0\]: field 'ipport_list' must be a string"),
        (
            {"type": "ipport_list", "nodes": [{"ipport_list": "list://h:1"}, {"ipport_list": "x"}]},
            r"nodes\[1\]: field 'ipport_list': 'x' is not host:port",
        ),
        ({"dict_name": ""}, "entry 0: field 'dict_name' must be a non-empty string"),
    ],
)
def test_bad_conf_errors_name_dict_and_field(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfError, match=message):
        parse_conf([entry(**changes)], source="my.conf")


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ConfError, match="cannot read"):
        load_conf(tmp_path / "missing.conf")
    bad = tmp_path / "bad.conf"
    bad.write_text("[{")
    with pytest.raises(ConfError, match=r"bad\.conf: not JSON: line 1"):
        load_conf(bad)
    bad.write_text("[]")
    with pytest.raises(ConfError, match="non-empty JSON array"):
        load_conf(bad)
    bad.write_text(json.dumps([entry(), entry()]))
    with pytest.raises(ConfError, match="defined twice"):
        load_conf(bad)


def test_client_argument_errors() -> None:
    with pytest.raises(ConfError, match="shards must be"):
        CubeClient(shards="127.0.0.1:1")
    with pytest.raises(ConfError, match="replica 'nohost' is not 'host:port'"):
        CubeClient(shards=[["nohost"]])
    with pytest.raises(ConfError, match="partitioner 'x'"):
        CubeClient(shards=[["h:1"]], partitioner="x")  # type: ignore[arg-type]  # on purpose
    with pytest.raises(ConfError, match="load_balancer 'x'"):
        CubeClient(shards=[["h:1"]], load_balancer="x")  # type: ignore[arg-type]  # on purpose
    with CubeClient(shards=["h:1", ["h:2", "h:3"]]) as client:
        assert client.shards == (("h:1",), ("h:2", "h:3"))


def test_from_conf_timeout_override_keeps_the_files_backup_request(tmp_path: Path) -> None:
    import json

    from cube.client import CubeClient, Timeouts

    entry = {
        "dict_name": "d", "shard": 1, "dup": 1, "timeout": 800, "retry": 1,
        "backup_request": 20, "type": "ipport", "nodes": [{"ip": "127.0.0.1", "port": 1}],
    }  # fmt: skip
    path = tmp_path / "cube.conf"
    path.write_text(json.dumps([entry]))
    # cube.conf's timeout bounds the whole call (as the original's brpc timeout_ms did)
    with CubeClient.from_conf(path) as client:
        assert client.timeouts == Timeouts(0.8, 0.02, total=0.8) and client.retry.attempts == 1
    with CubeClient.from_conf(path, timeout=0.1) as client:
        assert client.timeouts == Timeouts(0.1, 0.02, total=0.1)
    with CubeClient.from_conf(path, timeout=Timeouts(0.3)) as client:
        assert client.timeouts == Timeouts(0.3)


def test_tls_fields(tmp_path: Path, pki: dict[str, str]) -> None:
    """cube.conf's `tls_ca` (and `tls_server_name`) turn TLS on for from_conf clients: the
    file alone says how to reach servers started with --tls_cert (the Helm chart's cube.conf
    with TLS on). Absent: plaintext, as before."""
    assert parse_conf([entry()]).tls_ca is None
    conf = parse_conf([entry(tls_ca="/etc/cube-tls/ca.crt", tls_server_name="cube.example")])
    assert (conf.tls_ca, conf.tls_server_name) == ("/etc/cube-tls/ca.crt", "cube.example")
    assert parse_conf([entry(tls_ca="")]).tls_ca == ""  # the system's CAs
    path = tmp_path / "cube.conf"
    path.write_text(json.dumps([entry(tls_ca=pki["ca"], tls_server_name="localhost")]))
    with CubeClient.from_conf(path) as client:
        assert client._tls is not None and client._tls.server_name == "localhost"
    with CubeClient.from_conf(path, tls_ca=None, tls_server_name="") as client:
        assert client._tls is None  # keyword arguments still win
    path.write_text(json.dumps([entry(tls_ca=str(tmp_path / "nope.pem"))]))
    with pytest.raises(ConfError, match=r"nope\.pem"):
        CubeClient.from_conf(path)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"tls_ca": 1}, "field 'tls_ca' must be a string"),
        ({"tls_ca": "ca.pem", "tls_server_name": 7}, "field 'tls_server_name' must be a string"),
        ({"tls_server_name": "cube.example"}, "field 'tls_server_name' needs 'tls_ca'"),
    ],
)
def test_bad_tls_fields(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfError, match=message):
        parse_conf([entry(**changes)], source="my.conf")


def test_dim_field_is_get_embeddings_default(tmp_path: Path) -> None:
    """cube.conf's optional `dim`: get_embeddings' width when a call gives none (sync, async
    and CubeClients); a call's own dim still wins; without either, a clear error."""
    import asyncio

    import numpy as np

    from cube.client import AsyncCubeClient, CubeClients, MockTransport

    row = np.arange(4, dtype=np.float32).tobytes()
    mock = MockTransport(lambda address, keys: [row if k % 2 else None for k in keys.tolist()])
    path = tmp_path / "cube.conf"
    path.write_text(json.dumps([entry(dim=4), entry(dict_name="nodim")]))
    assert load_conf(path, "test_dict").dim == 4 and load_conf(path, "nodim").dim is None
    with CubeClient.from_conf(path, "test_dict", transport=mock) as client:
        assert client.dim == 4
        emb = client.get_embeddings([1, 2, 3])
        assert emb.shape == (3, 4) and emb[0].tolist() == [0, 1, 2, 3] and not emb[1].any()
        assert client.get_embeddings([1], 2, dtype=np.float64).shape == (1, 2)
    with CubeClients.from_conf(path, transport=mock) as both:
        assert both.get_embeddings("test_dict", [5]).shape == (1, 4)
        with pytest.raises(ConfError, match=r"get_embeddings needs dim.*dict 'nodim'"):
            both.get_embeddings("nodim", [5])

    async def run() -> tuple[int, ...]:
        async with AsyncCubeClient.from_conf(path, "test_dict", transport=mock) as client:
            return (await client.get_embeddings([7])).shape

    assert asyncio.run(run()) == (1, 4)
    with pytest.raises(ConfError, match="field 'dim' must be an integer >= 1"):
        parse_conf([entry(dim=0)])
    with pytest.raises(ConfError, match="field 'dim' must be an integer >= 1"):
        parse_conf([entry(dim="8")])
    with pytest.raises(ConfError, match="dim must be an integer >= 1"):
        CubeClient([["h:1"]], dim=-2)
