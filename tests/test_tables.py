"""Several tables in one version (a model's sparse tables, cube/layout.py TABLES): real
cube-server processes serving two tables of different widths on two shards, the SDK's
`seek_tables` (one version for every table and shard), `seek(table=)`, refusals (no table
named, a table the version lacks, the original API), patches over every table together, and
a patch whose tables differ refused while the version served keeps serving."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from helpers.procs import ServerProc, expected_fixed, fixed_values, running_server, write_version
from helpers.stubs import control_stub, dict_stub

from cube.client import AsyncCubeClient, CubeClient, cli
from cube.client.errors import ConfError, RequestRejectedError
from cube.donefile import append_line, format_fleet_line
from cube.pb import cube_pb2
from cube.routing import shard_of
from cube.transfer.local import ClusterSpec, up

pytestmark = pytest.mark.slow

SHARDS = 2
WIDTHS = {"wide": 4, "deep": 32}  # a first-order weight and an embedding, say
TAGS = {"wide": 1, "deep": 2}
BASE = np.arange(1, 4001, dtype=np.uint64) * 7919
WIDE_ONLY = np.arange(1, 301, dtype=np.uint64) * 104729 + 3  # keys only "wide" holds


def _write(root: Path, name: str, table: str, keys: np.ndarray, tag: int, **extra: Any) -> None:
    """The table's keys of each shard into `<root>/<shard>/<name>/<table>/`."""
    owners = shard_of(keys, SHARDS, "mod")
    for shard in range(SHARDS):
        mine = keys[owners == shard]
        routing = {"shard": shard, "shard_num": SHARDS, "partitioner": "mod"}
        values = fixed_values(mine, WIDTHS[table], tag)
        write_version(root / str(shard), name, mine, values, table=table, routing=routing, **extra)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServerProc]]:
    root = tmp_path_factory.mktemp("tables")
    _write(root, "100", "wide", np.concatenate([BASE, WIDE_ONLY]), TAGS["wide"], current=True)
    _write(root, "100", "deep", BASE, TAGS["deep"], current=True)
    with (
        running_server(root / "0", "--shard", "0", "--http_port", "0") as first,
        running_server(root / "1", "--shard", "1") as second,
    ):
        yield [first, second]


def _client(servers: list[ServerProc], **options: Any) -> CubeClient:
    return CubeClient(shards=[[s.address] for s in servers], **options)


def _control(server: ServerProc, cmd: str, **fields: Any) -> cube_pb2.ControlResponse:
    with grpc.insecure_channel(server.control_address) as channel:
        reply: cube_pb2.ControlResponse = control_stub(channel).cmd(
            cube_pb2.ControlRequest(cmd=cmd, **fields), timeout=60
        )
        return reply


def test_seek_tables_answers_every_table_from_one_version(servers: list[ServerProc]) -> None:
    keys = np.concatenate([BASE[::3], WIDE_ONLY[:50]])
    with _client(servers) as client:
        wide, deep, again = client.seek_tables(
            [("wide", keys), ("deep", keys), ("wide", BASE[:10])]
        )
    assert wide.version == deep.version == again.version == "100"
    assert wide.found.all() and wide.width == WIDTHS["wide"]
    assert np.array_equal(wide.column.as_rows(), expected_fixed(keys, 4, TAGS["wide"]))
    hits = np.isin(keys, BASE)
    assert np.array_equal(deep.found, hits) and deep.width == WIDTHS["deep"]
    expected = expected_fixed(keys, 32, TAGS["deep"])
    assert np.array_equal(deep.column.as_rows()[hits], expected[hits])
    assert not deep.column.as_rows()[~hits].any()  # a miss is a zero row
    assert np.array_equal(again.column.as_rows(), expected_fixed(BASE[:10], 4, TAGS["wide"]))


def test_seek_and_embeddings_name_a_table(servers: list[ServerProc]) -> None:
    with _client(servers) as client:
        result = client.seek(BASE[:100], table="deep")
        assert result.found.all() and result.width == 32
        rows = client.get_embeddings(BASE[:100], 8, table="deep")
    assert rows.shape == (100, 8)
    assert np.array_equal(rows.view(np.uint8), expected_fixed(BASE[:100], 32, TAGS["deep"]))
    with _client(servers) as client:
        by_name = client.seek_tables({"deep": BASE[:5], "wide": BASE[:5]})
    assert [r.width for r in by_name] == [32, 4]


def test_async_client_seek_tables(servers: list[ServerProc]) -> None:
    async def run() -> list[Any]:
        async with AsyncCubeClient(shards=[[s.address] for s in servers]) as client:
            results = await client.seek_tables([("wide", BASE[:500]), ("deep", BASE[500:900])])
            single = await client.seek(BASE[:3], table="wide")
            return [*results, single]

    wide, deep, single = asyncio.run(run())
    assert np.array_equal(wide.column.as_rows(), expected_fixed(BASE[:500], 4, TAGS["wide"]))
    assert np.array_equal(deep.column.as_rows(), expected_fixed(BASE[500:900], 32, TAGS["deep"]))
    assert single.found.all()


def test_a_request_must_name_a_table_the_version_has(servers: list[ServerProc]) -> None:
    with _client(servers, retry=0) as client:
        with pytest.raises(RequestRejectedError) as unnamed:
            client.seek(BASE[:10])
        assert unnamed.value.code == "INVALID_ARGUMENT"
        assert "several tables (wide, deep)" in str(unnamed.value)
        with pytest.raises(RequestRejectedError) as unknown:
            client.seek(BASE[:10], table="embedding_9")
        assert unknown.value.code == "NOT_FOUND"
        assert "no table 'embedding_9'" in str(unknown.value)
        assert client.seek([], table="wide").found.shape == (0,)
    with (
        _client(servers, protocol="original") as client,
        pytest.raises(ConfError, match="cannot name a table"),
    ):
        client.seek(BASE[:10], table="wide")
    # the original API names no table: refused, never answered from one of them
    with grpc.insecure_channel(servers[0].address) as channel:
        request = cube_pb2.DictRequest(keys=[int(BASE[0])])
        with pytest.raises(grpc.RpcError) as refused:
            dict_stub(channel).seek(request, timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_http_json_names_a_table(servers: list[ServerProc]) -> None:
    """The original's HTTP JSON seek, with our "table" member; without one, refused (400)."""
    port = servers[0].written_ports()["http_ports"][0]
    mine = BASE[shard_of(BASE, SHARDS, "mod") == 0][:3]
    body = {"keys": [int(k) for k in mine], "table": "wide", "version_required": True}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/DictService/seek", json.dumps(body).encode(), method="POST"
    )
    with urllib.request.urlopen(request, timeout=10) as reply:
        answer = json.loads(reply.read())
    assert answer["version"] == "100"
    values = [base64.b64decode(v["value"]) for v in answer["values"]]
    assert values == [bytes(row) for row in expected_fixed(mine, 4, TAGS["wide"])]
    del body["table"]
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/DictService/seek", json.dumps(body).encode(), method="POST"
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 400
    assert "several tables" in refused.value.read().decode()


def test_cube_cli_queries_a_table(
    servers: list[ServerProc], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    nodes = [{"ipport_list": f"list://{s.address}"} for s in servers]
    entry = {"dict_name": "test_dict", "shard": SHARDS, "dup": 1, "timeout": 2000}
    entry |= {"retry": 0, "backup_request": 0}
    conf = tmp_path / "cube.conf"
    conf.write_text(json.dumps([{**entry, "type": "ipport_list", "nodes": nodes}]))
    keys = tmp_path / "keys.txt"
    keys.write_text("".join(f"{k}\n" for k in BASE[:20]))
    args = ["--config_file", str(conf), "--keys", str(keys), "--batch", "20", "--requests", "1"]
    assert cli.main([*args, "--table", "deep", "--print_output"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("key:")]
    expected = expected_fixed(BASE[:1], 32, TAGS["deep"]).tobytes().hex().upper()
    assert lines[0] == f"key:{BASE[0]} value:{expected}"
    assert cli.main(args) == 1  # no table named: every request refused, said so
    assert "several tables" in capsys.readouterr().err


def test_status_lists_the_tables(servers: list[ServerProc]) -> None:
    detail = json.loads(_control(servers[0], "status").detail_json)
    tables = detail["current"]["tables"]
    assert sorted(tables) == ["deep", "wide"]  # (the status is JSON with sorted keys)
    assert (tables["wide"]["value_width"], tables["deep"]["value_width"]) == (4, 32)
    owned = shard_of(BASE, SHARDS, "mod") == 0
    assert tables["deep"]["record_count"] == int(owned.sum())


def test_patch_layers_every_table_and_a_mismatch_is_refused(
    tmp_path: Path,
) -> None:
    root = tmp_path / "data"
    _write(root, "100", "wide", BASE, TAGS["wide"], current=True)
    _write(root, "100", "deep", BASE, TAGS["deep"], current=True)
    changed = BASE[:200]
    _write(root, "100_101", "wide", changed, 11, chain=["100", "100_101"])
    _write(root, "100_101", "deep", changed, 12, chain=["100", "100_101"])
    _write(root, "100_102", "deep", changed, 13, chain=["100", "100_101", "100_102"])
    shards = []
    with (
        running_server(root / "0", "--shard", "0") as first,
        running_server(root / "1", "--shard", "1") as second,
    ):
        shards = [first, second]
        for server in shards:
            reply = _control(server, "reload_patch", version_path="/100_101")
            assert reply.cur_version == "100_101", reply.message
        with _client(shards) as client:
            wide, deep = client.seek_tables([("wide", BASE[:400]), ("deep", BASE[:400])])
        assert wide.version == deep.version == "100_101"
        rows = wide.column.as_rows()
        assert np.array_equal(rows[:200], expected_fixed(changed, 4, 11))
        assert np.array_equal(rows[200:], expected_fixed(BASE[200:400], 4, TAGS["wide"]))
        assert np.array_equal(deep.column.as_rows()[:200], expected_fixed(changed, 32, 12))
        # 100_102 holds only "deep": refused, and 100_101 keeps serving both tables
        with pytest.raises(grpc.RpcError) as refused:
            _control(shards[0], "reload_patch", version_path="/100_102")
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "holds tables ['deep']" in str(refused.value.details())
        assert _control(shards[0], "status").cur_version == "100_101"
        with _client(shards) as client:
            (wide,) = client.seek_tables([("wide", changed)])
        assert wide.version == "100_101" and wide.found.all()


def test_a_paddle_save_of_two_tables_rolls_out_through_transfer_and_agents(
    tmp_path: Path,
) -> None:
    """The whole path with real processes: a Fleet trainer's donefile line naming a save of
    two sparse tables (the real trainer's, tests/data/paddle_ps/sparse_naive_2tables), built
    by cube-transfer into one version of tables 000 and 001, placed by the agents, served by
    every shard; one seek_tables call answers both tables, each value the trainer's own
    lookup (expected.json), from one version."""
    saves = Path(__file__).parent / "data" / "paddle_ps" / "sparse_naive_2tables"
    models = tmp_path / "models"
    models.mkdir()
    spec = ClusterSpec(
        dir=tmp_path / "cluster", shards=2, replicas=1, donefile=models, poll_interval=0.2,
        phase_timeout=40.0,
        transfer_overrides={
            "source_format": "paddle_fleet",
            "builder_flags": ("-paddle_config", str(saves / "fleet_desc.prototxt")),
            "version_retries": 0,
        },
    )  # fmt: skip
    cluster = up(spec)
    try:
        day = "20261127"
        target = models / day / "base"
        shutil.copytree(saves / "base", target)
        version = "1795737600"
        line = format_fleet_line(version, version, f"{target}/000", str(models), day)
        append_line(models / "xbox_base_done.txt", line)
        cluster.wait_version(version, 60.0)
        truth = json.loads((saves / "expected.json").read_text())["saves"]["base"]["tables"]
        pairs, rows = [], []
        for name, folder in (("emb_a", "000"), ("emb_b", "001")):
            keys = np.array(truth[name]["keys"], dtype=np.uint64)
            pairs.append((folder, keys))
            hexes = truth[name]["lookup_f32le_hex"]
            rows.append(np.frombuffer(bytes.fromhex("".join(hexes)), "<f4"))
        with CubeClient.from_conf(cluster.cube_conf) as client:
            first, second = client.seek_tables(pairs)
        assert first.version == second.version == version
        for result, expected, dim in ((first, rows[0], 4), (second, rows[1], 6)):
            assert result.found.all()
            # the save holds the trainer's numbers to 6 significant digits
            np.testing.assert_allclose(result.embeddings(dim).reshape(-1), expected, rtol=5e-6)
    finally:
        cluster.down(timeout=5.0)


def test_a_table_named_to_a_version_of_one_is_not_found(tmp_path: Path) -> None:
    """A version without TABLES is one unnamed table: a request naming a table is refused
    (NOT_FOUND, saying to send none), never answered from the unnamed one."""
    data = tmp_path / "data"
    write_version(data, "5", BASE[:100], fixed_values(BASE[:100], 8, 1), current=True)
    with running_server(data) as server, CubeClient(shards=[[server.address]], retry=0) as client:
        assert client.seek(BASE[:10]).found.all()
        with pytest.raises(RequestRejectedError) as refused:
            client.seek(BASE[:10], table="000")
    assert refused.value.code == "NOT_FOUND"
    assert "one unnamed table (send no table)" in str(refused.value)
