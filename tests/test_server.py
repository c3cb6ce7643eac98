"""cube-server end to end: real processes on loopback ports, real shard files.

Lookups (fast and original API, fixed and variable width, deltas and tombstones), every
bad-request status, a server with nothing (or nothing good) to serve, dict_split layout,
health and reflection."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2
from helpers.procs import (
    ServerProc,
    expected_fixed,
    fixed_values,
    running_server,
    start_server,
    write_version,
)
from helpers.stubs import control_stub, dict_stub, fast_stub, reflection_info
from numpy.typing import NDArray

from cube.client import AsyncCubeClient, CubeClient
from cube.pb import cube_fast_pb2, cube_pb2
from cube.processes import free_ports, health_status, poll_until
from cube.routing import shard_of

# Every test here starts processes (servers, CLIs): make quick skips them.
pytestmark = pytest.mark.slow

MISS = 0xFFFFFFFF
Keys = NDArray[np.uint64]
# the server, a channel to it, its keys, the delta's changed and added keys
FixedServer = tuple[ServerProc, grpc.Channel, Keys, Keys, Keys]
BadServer = tuple[ServerProc, grpc.Channel]  # a variable-width server with --max_batch 1000


def seek(channel: grpc.Channel, keys: npt.ArrayLike, **fields: Any) -> cube_fast_pb2.SeekResponse:
    """A fast Seek of `keys`; `fields`: the request's others (request_id, dict_name, ...)."""
    request = cube_fast_pb2.SeekRequest(keys=np.asarray(keys, dtype="<u8").tobytes(), **fields)
    response: cube_fast_pb2.SeekResponse = fast_stub(channel).Seek(request, timeout=10)
    return response


def fixed_rows(response: cube_fast_pb2.SeekResponse) -> NDArray[np.uint8]:
    return np.frombuffer(response.values, np.uint8).reshape(-1, response.value_width)


def variable_values(response: cube_fast_pb2.SeekResponse) -> list[bytes]:
    offsets = np.frombuffer(response.offsets, "<u8")
    return [response.values[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]


def control(
    target: ServerProc | str, cmd: str, *, token: str = "", **fields: Any
) -> cube_pb2.ControlResponse:
    """A control command to `target`: a ServerProc (its control port) or an address."""
    address = target.control_address if isinstance(target, ServerProc) else target
    request = cube_pb2.ControlRequest(cmd=cmd, **fields)
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    with grpc.insecure_channel(address) as channel:
        reply: cube_pb2.ControlResponse = control_stub(channel).cmd(
            request, timeout=60, metadata=metadata
        )
        return reply


@pytest.fixture(scope="module")
def fixed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FixedServer]:
    """Base 100 (keys 1..2000 step 3, width 40) + delta 100_200 (updates, new keys, deletes)."""
    data = tmp_path_factory.mktemp("fixed") / "data"
    keys = np.arange(1, 6000, 3, dtype=np.uint64)
    write_version(data, "100", keys, fixed_values(keys, 40, tag=1))
    changed = keys[:50]
    added = np.arange(10**12, 10**12 + 20, dtype=np.uint64)
    delta_keys = np.concatenate([changed, added])
    write_version(
        data,
        "100_200",
        delta_keys,
        fixed_values(delta_keys, 40, tag=2),
        deleted=keys[100:110],
        chain=["100", "100_200"],
        current=True,
    )
    with running_server(data) as server, grpc.insecure_channel(server.address) as channel:
        yield server, channel, keys, changed, added


def test_fast_seek_fixed_width_with_delta_and_tombstones(fixed_server: FixedServer) -> None:
    _server, channel, keys, changed, added = fixed_server
    missing = np.array([5, 2**64 - 1], np.uint64)
    query = np.concatenate([keys[200:300], changed[:5], added, keys[100:110], missing])
    response = seek(channel, query, request_id=77)
    assert response.request_id == 77 and response.version == "100_200"
    assert response.value_width == 40 and response.offsets == b""
    found = np.frombuffer(response.found, np.uint8)
    assert len(found) == len(query)
    assert found[:125].all() and not found[125:].any()
    rows = fixed_rows(response)
    assert (rows[:100] == expected_fixed(keys[200:300], 40, tag=1)).all()
    assert (rows[100:105] == expected_fixed(changed[:5], 40, tag=2)).all()
    assert (rows[105:125] == expected_fixed(added, 40, tag=2)).all()
    assert (rows[125:] == 0).all()  # deleted and missing keys: zero rows


def test_original_seek_in_request_order(fixed_server: FixedServer) -> None:
    _server, channel, keys, changed, _added = fixed_server
    query = [int(keys[500]), 5, int(changed[0]), int(keys[500]), int(keys[105])]
    stub = dict_stub(channel)
    response = stub.seek(cube_pb2.DictRequest(keys=query), timeout=10)
    assert not response.HasField("version")
    assert [v.status for v in response.values] == [0, MISS, 0, 0, MISS]
    assert response.values[0].value == expected_fixed(keys[500:501], 40, 1).tobytes()
    assert response.values[2].value == expected_fixed(changed[:1], 40, 2).tobytes()
    assert response.values[1].value == b"" and response.values[3] == response.values[0]
    response = stub.seek(cube_pb2.DictRequest(keys=query, version_required=True), timeout=10)
    assert response.version == "100_200"
    assert len(stub.seek(cube_pb2.DictRequest(keys=[]), timeout=10).values) == 0


@pytest.mark.parametrize(
    ("fields", "code", "words"),
    [
        ({"keys": b"\x01" * 12}, grpc.StatusCode.INVALID_ARGUMENT, "12 bytes"),
        ({"keys": b"\x00" * 8 * 1001}, grpc.StatusCode.RESOURCE_EXHAUSTED, "1001 keys"),
        ({"keys": b"", "dict_name": "other"}, grpc.StatusCode.NOT_FOUND, "'other'"),
        ({"keys": b"", "dict_name": "test_dict_part3"}, grpc.StatusCode.NOT_FOUND, "part3"),
        ({"keys": b"", "version": "999"}, grpc.StatusCode.FAILED_PRECONDITION, "'999'"),
    ],
)
def test_bad_fast_requests(
    bad_request_server: BadServer, fields: dict[str, Any], code: grpc.StatusCode, words: str
) -> None:
    _server, channel = bad_request_server
    with pytest.raises(grpc.RpcError) as info:
        fast_stub(channel).Seek(cube_fast_pb2.SeekRequest(request_id=9, **fields), timeout=10)
    assert info.value.code() == code
    assert words in (info.value.details() or "")


@pytest.fixture(scope="module")
def bad_request_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[BadServer]:
    data = tmp_path_factory.mktemp("bad") / "data"
    write_version(data, "5", [1, 2], [b"one", b"two!"], current=True)
    args = ("--max_batch", "1000", "--dict_name", "test_dict", "--shard", "2")
    with running_server(data, *args) as server, grpc.insecure_channel(server.address) as channel:
        yield server, channel


def test_dict_name_forms_accepted_and_original_batch_limit(
    bad_request_server: BadServer,
) -> None:
    _server, channel = bad_request_server
    for name in ("", "test_dict", "test_dict_part2"):
        assert seek(channel, [1], dict_name=name).found == b"\x01"
    with pytest.raises(grpc.RpcError) as info:
        dict_stub(channel).seek(cube_pb2.DictRequest(keys=list(range(1001))), timeout=10)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_bad_stream_request_ends_stream_with_status(
    bad_request_server: BadServer,
) -> None:
    stub = fast_stub(bad_request_server[1])
    requests = [
        cube_fast_pb2.SeekRequest(keys=np.array([1], "<u8").tobytes(), request_id=1),
        cube_fast_pb2.SeekRequest(keys=b"\x00" * 9, request_id=2),
    ]
    answers = []
    with pytest.raises(grpc.RpcError) as info:
        for answer in stub.SeekStream(iter(requests), timeout=10):
            answers.append(answer.request_id)
    assert answers == [1]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request_id=2" in (info.value.details() or "")


def test_variable_width_values(bad_request_server: BadServer) -> None:
    response = seek(bad_request_server[1], [2, 3, 1])
    assert response.value_width == 0
    assert response.found == b"\x01\x00\x01"
    assert variable_values(response) == [b"two!", b"", b"one"]


def test_empty_server_is_not_serving_and_says_why(tmp_path: Path) -> None:
    """Nothing to serve: health NOT_SERVING and every lookup UNAVAILABLE with the reason, never
    a batch of misses; an empty request (the SDK's first contact) too, so that a client
    does not take the replica for one that serves."""
    with (
        running_server(tmp_path / "nothing") as server,
        grpc.insecure_channel(server.address) as channel,
    ):
        assert health_status(server.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as caught:
            seek(channel, [1, 2, 3])
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "does not exist" in (caught.value.details() or "")
        with pytest.raises(grpc.RpcError) as caught:
            dict_stub(channel).seek(
                cube_pb2.DictRequest(keys=[4], version_required=True), timeout=10
            )
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError) as caught:
            seek(channel, [])
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "does not exist" in (caught.value.details() or "")
        detail = json.loads(control(server, "status").detail_json)
        assert detail["serving"] is False and "does not exist" in detail["not_serving_reason"]
        # the SDK's readiness is its first contact: a replica that cannot serve is not ready
        with CubeClient(shards=[[server.address]]) as client:
            assert client.wait_ready(5.0) == [server.address]

        async def first_contact() -> list[str]:
            async with AsyncCubeClient(shards=[[server.address]]) as client:
                return await client.wait_ready(5.0)

        assert asyncio.run(first_contact()) == [server.address]


def test_allow_empty_server_answers_misses(tmp_path: Path) -> None:
    with (
        running_server(tmp_path / "nothing", "--allow_empty") as server,
        grpc.insecure_channel(server.address) as channel,
    ):
        assert health_status(server.address) == health_pb2.HealthCheckResponse.SERVING
        response = seek(channel, [1, 2, 3])
        assert response.found == b"\x00\x00\x00" and response.version == ""
        assert variable_values(response) == [b"", b"", b""]
        original = dict_stub(channel).seek(
            cube_pb2.DictRequest(keys=[4], version_required=True), timeout=10
        )
        assert [v.status for v in original.values] == [MISS]
        assert original.HasField("version") and original.version == ""
        status = control(server, "status")
        assert status.cur_version == "" and status.status == 0
        assert json.loads(status.detail_json)["record_count"] == 0


@pytest.mark.parametrize(
    ("layout", "words"),
    [
        ("builder", "looks like cube-builder output"),
        ("flat", "holds shard files directly"),
        ("unnamed", "no VERSION"),
        ("empty", "waiting for cube-agent"),
    ],
)
def test_data_dir_without_a_version_is_diagnosed(tmp_path: Path, layout: str, words: str) -> None:
    data = tmp_path / "data"
    data.mkdir()
    if layout == "builder":
        (data / "test_dict_part0").mkdir()
        (data / "test_dict_part0.tar").write_bytes(b"")
    elif layout == "flat":  # half of a shard straight in the data dir (a whole one is served)
        write_version(tmp_path, "data", [1], [b"x"])
        (data / "data.cube").unlink()
    elif layout == "unnamed":
        write_version(data, "17", [1], [b"x"])
    with running_server(data) as server, grpc.insecure_channel(server.address) as channel:
        assert health_status(server.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as caught:
            seek(channel, [1])
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert words in (caught.value.details() or "")
        assert words in server.log()


def test_corrupt_startup_version_is_not_serving_even_with_allow_empty(tmp_path: Path) -> None:
    """A replica meant to serve a version it cannot load says so: NOT_SERVING, UNAVAILABLE
    naming the file, and a load of a good version makes it serve."""
    data = tmp_path / "data"
    directory = write_version(data, "5", [1, 2], [b"one", b"two"], current=True)
    with (directory / "data.cube").open("r+b") as f:  # one byte of the values section
        f.seek(4096)
        byte = f.read(1)
        f.seek(4096)
        f.write(bytes([byte[0] ^ 0xFF]))
    write_version(data, "6", [1, 2], [b"uno", b"dos!"])
    with (
        running_server(data, "--allow_empty") as server,
        grpc.insecure_channel(server.address) as channel,
    ):
        assert health_status(server.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as caught:
            seek(channel, [1])
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        details = caught.value.details() or ""
        assert "data.cube" in details and "checksum" in details
        control(server, "reload_base", version_path="/6")
        serving = health_pb2.HealthCheckResponse.SERVING
        assert poll_until(lambda: health_status(server.address) == serving, 10, 0.05)
        assert variable_values(seek(channel, [1, 2])) == [b"uno", b"dos!"]


def test_dict_split_layout(tmp_path: Path) -> None:
    data = tmp_path / "data"
    keys = np.arange(10, 410, dtype=np.uint64)
    for partitioner in ("mod", "murmur3"):
        owner = shard_of(keys, 2, partitioner)
        for split in range(2):
            mine = keys[owner == split]
            write_version(
                data, partitioner, mine, fixed_values(mine, 16, split), split=split, current=True
            )
        args = ("--dict_split", "2", "--partitioner", partitioner)
        with (
            running_server(data, *args) as server,
            grpc.insecure_channel(server.address) as channel,
        ):
            query = np.concatenate([keys[::-7], np.array([1, 2, 3], np.uint64)])
            response = seek(channel, query)
            assert response.version == partitioner
            assert np.frombuffer(response.found, np.uint8).tolist() == [1] * 58 + [0] * 3
            rows = fixed_rows(response)
            split_of = shard_of(query[:58], 2, partitioner)
            for split in range(2):
                mine = query[:58][split_of == split]
                assert (rows[:58][split_of == split] == expected_fixed(mine, 16, split)).all()
            detail = json.loads(control(server, "status").detail_json)
            assert [s["cur_version"] for s in detail["splits"]] == [partitioner] * 2


def test_health_and_reflection(bad_request_server: BadServer) -> None:
    server, channel = bad_request_server
    address = server.address
    assert health_status(address) == health_pb2.HealthCheckResponse.SERVING
    assert health_status(address, service="cube.v1.CubeService") == (
        health_pb2.HealthCheckResponse.SERVING
    )
    request = reflection_pb2.ServerReflectionRequest(list_services="")

    def listed(channel: grpc.Channel) -> set[str]:
        replies = reflection_info(channel, [request], timeout=10)
        return {s.name for reply in replies for s in reply.list_services_response.service}

    names = listed(channel)
    assert {"cube.v1.CubeService", "rec.mcube.DictService", "grpc.health.v1.Health"} <= names
    assert "rec.mcube.ControlService" not in names  # on the control port only
    with grpc.insecure_channel(server.control_address) as control_channel:
        control_names = listed(control_channel)
    assert {"rec.mcube.ControlService", "grpc.health.v1.Health"} <= control_names
    assert "cube.v1.CubeService" not in control_names
    request = reflection_pb2.ServerReflectionRequest(file_containing_symbol="cube.v1.CubeService")
    reply = next(reflection_info(channel, [request], timeout=10))
    assert reply.file_descriptor_response.file_descriptor_proto


def test_flagfile_and_cli_errors(tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_version(data, "7", [5, 9], [b"five", b"nine!"], current=True)
    flagfile = tmp_path / "gflags.conf"
    flagfile.write_text("# like conf/gflags.conf\n-dict_split=1\n--in_mem=true\n--max_batch=2\n")
    with (
        running_server(data, "--flagfile", str(flagfile)) as server,
        grpc.insecure_channel(server.address) as channel,
    ):
        assert variable_values(seek(channel, [5, 6])) == [b"five", b""]
        with pytest.raises(grpc.RpcError) as info:
            seek(channel, [1, 2, 3])
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert json.loads(control(server, "status").detail_json)["in_mem"] is True
        # a second server on the same port fails to start
        clash = subprocess.run(
            [
                sys.executable,
                "-m",
                "cube.server.main",
                "--data_dir",
                str(data),
                "--port",
                str(server.port),
                "--in_mem",
                "false",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert clash.returncode == 1 and "cannot listen" in clash.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "cube.server.main", "--dict_split", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "--dict_split" in bad.stderr


def test_seek_stream_pipelined_in_order(fixed_server: FixedServer) -> None:
    _server, channel, keys, _changed, _added = fixed_server
    batches = [keys[200 + i * 7 : 250 + i * 7] for i in range(30)]  # past the delta's keys
    requests = (
        cube_fast_pb2.SeekRequest(keys=b.astype("<u8").tobytes(), request_id=i + 1)
        for i, b in enumerate(batches)
    )
    stub = fast_stub(channel)
    answers = list(stub.SeekStream(requests, timeout=30))
    assert [a.request_id for a in answers] == list(range(1, 31))
    for batch, answer in zip(batches, answers, strict=True):
        assert answer.found == b"\x01" * 50 and answer.version == "100_200"
        assert (fixed_rows(answer) == expected_fixed(batch, 40, tag=1)).all()


def test_a_replica_is_not_serving_until_its_kernel_is_compiled(tmp_path: Path) -> None:
    """A server whose kernel cache is cold compiles it at start (seconds). Meanwhile it is
    NOT_SERVING from its first health answer on, says why in its status, and only then says
    SERVING: a client never meets it serving at numpy speed or stalled on a compile."""
    data = tmp_path / "data"
    keys = np.arange(1, 100, dtype=np.uint64)
    write_version(data, "1", keys, fixed_values(keys, 16), current=True)
    cache = tmp_path / "numba-cache"  # empty: nothing to load, everything to compile
    lookup, control_port = free_ports(2)  # known now: the port file waits for the kernel
    server = start_server(
        data,
        wait=False,
        env={"CUBE_KERNEL_CACHE": str(cache)},
        ports=[lookup],
        control_ports=[control_port],
    )
    try:
        seen: list[int] = []

        def answered() -> bool:
            status = health_status(server.control_address)
            if status is not None and (not seen or seen[-1] != status):
                seen.append(status)
            return status == health_pb2.HealthCheckResponse.SERVING

        assert poll_until(answered, 120, 0.02), server.log()[-3000:]
        assert seen == [
            health_pb2.HealthCheckResponse.NOT_SERVING,
            health_pb2.HealthCheckResponse.SERVING,
        ], server.log()[-3000:]
        log = server.log()
        loading = log.index("NOT_SERVING: the compiled lookup kernel is loading")
        compiled = log.index("lookup kernel: compiled (numba")
        assert loading < compiled < log.index("SERVING 1")
        assert "signatures compiled now" in log[compiled : log.index("\n", compiled)]
        with grpc.insecure_channel(server.address) as channel:
            assert seek(channel, keys[:5]).found == b"\x01" * 5
        assert server.port_file is not None
        assert poll_until(server.port_file.exists, 30, 0.05)  # written once it had settled
        assert any(cache.rglob("*.nbi"))  # it compiled, and cached what it compiled
    finally:
        server.stop()
