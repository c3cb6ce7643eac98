"""cube-server pieces in process: wire encoders against the generated protobuf classes, version
names and chains, slots and reference counts, and the coordinator's rollback when a worker
fails."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from helpers.procs import fixed_values, write_version

from cube.layout import base_of
from cube.pb import cube_fast_pb2, cube_pb2
from cube.server.control import ControlError, Coordinator, LocalWorker
from cube.server.encoders import MISS_STATUS, Answer, encode_dict_response, encode_seek_response
from cube.server.service import RequestError, SeekService
from cube.server.versions import (
    LoadedVersion,
    LoadOptions,
    VersionError,
    VersionSlots,
    load_base,
    resolve_chain,
    split_dirs,
    version_name_from_path,
    write_chain,
    write_version_file,
)


def variable_answer(values: list[bytes | None]) -> Answer:
    found = np.array([v is not None for v in values])
    lengths = [len(v or b"") for v in values]
    offsets = np.zeros(len(values) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    blob = np.frombuffer(b"".join(v or b"" for v in values), np.uint8)
    return Answer(found, blob, 0, offsets)


@pytest.mark.parametrize("version", [None, "", "1700000000_1700000100"])
@pytest.mark.parametrize(
    "values",
    [
        [],
        [b"a"],
        [None],
        [b"", None, b"xy", b"z" * 127, b"q" * 128, None, b"w" * 20000, bytes(range(256))],
    ],
)
def test_dict_response_bytes_parse_back(values: list[bytes | None], version: str | None) -> None:
    raw = encode_dict_response(variable_answer(values), version)
    parsed = cube_pb2.DictResponse.FromString(raw)
    assert [(v.status, v.value) for v in parsed.values] == [
        (MISS_STATUS, b"") if v is None else (0, v) for v in values
    ]
    assert parsed.HasField("version") == (version is not None)
    assert parsed.version == (version or "")


@pytest.mark.parametrize("width", [1, 40, 200])
def test_dict_response_fixed_width(width: int) -> None:
    rows = np.random.default_rng(width).integers(0, 256, (6, width), dtype=np.uint8)
    found = np.ones(6, bool)
    for mask in (found, np.array([True, False, True, True, False, False])):
        values = rows.copy()
        values[~mask] = 0
        parsed = cube_pb2.DictResponse.FromString(
            encode_dict_response(Answer(mask, values, width, None), "v")
        )
        assert [v.status for v in parsed.values] == [0 if m else MISS_STATUS for m in mask]
        assert [v.value for v in parsed.values] == [
            rows[i].tobytes() if m else b"" for i, m in enumerate(mask)
        ]


def test_seek_response_bytes_parse_back() -> None:
    fixed = Answer(np.array([True, False]), np.arange(8, dtype=np.uint8).reshape(2, 4), 4, None)
    parsed = cube_fast_pb2.SeekResponse.FromString(encode_seek_response(fixed, "v1", 2**40))
    assert parsed.found == b"\x01\x00" and parsed.value_width == 4 and parsed.offsets == b""
    assert parsed.values == bytes(range(8)) and parsed.version == "v1"
    assert parsed.request_id == 2**40
    variable = variable_answer([b"abc", None, b"d" * 300])
    parsed = cube_fast_pb2.SeekResponse.FromString(encode_seek_response(variable, "", 0))
    assert parsed.value_width == 0 and parsed.version == "" and parsed.request_id == 0
    assert np.frombuffer(parsed.offsets, "<u8").tolist() == [0, 3, 3, 303]
    assert parsed.values == b"abc" + b"d" * 300


def test_version_paths() -> None:
    root = "/srv/data"
    assert version_name_from_path("/1700", root) == "1700"
    assert version_name_from_path("1700_1800/", root) == "1700_1800"
    for bad in ("", "/", "..", "/../x", "a/b", "/etc/passwd", "x\x00"):
        with pytest.raises(VersionError) as info:
            version_name_from_path(bad, root)
        assert info.value.code == "INVALID_ARGUMENT"
    assert base_of("17_18") == "17" and base_of("17") == "17" and base_of("17_17") == "17_17"


def test_chain_rebuilt_in_numeric_order(tmp_path: Path) -> None:
    for name in ("9", "9_10", "9_9x", "9_100", "9_11", "8_12"):
        (tmp_path / name).mkdir()
    assert resolve_chain(tmp_path, "9_100") == ["9", "9_10", "9_11", "9_100"]
    assert resolve_chain(tmp_path, "9_11") == ["9", "9_10", "9_11"]
    with pytest.raises(VersionError, match="'8'"):
        resolve_chain(tmp_path, "8_12")


def test_retired_version_unmapped_after_last_request(tmp_path: Path) -> None:
    keys = np.arange(10, dtype=np.uint64)
    write_version(tmp_path, "1", keys, fixed_values(keys, 8))
    write_version(tmp_path, "2", keys, fixed_values(keys, 8, tag=2))
    dirs = split_dirs(tmp_path, 1)
    slots = VersionSlots()
    slots.install(load_base(dirs, "1", LoadOptions()))
    slots.stage(load_base(dirs, "2", LoadOptions()))
    slots.commit()
    assert slots.current is not None
    old = slots.current.acquire()  # a request in flight on version 1
    SeekService(slots, max_batch=100).seek(b"")  # the kernel prepared its views on it

    def mapped(name: str) -> bool:
        return str(tmp_path / name / "data.cube") in open("/proc/self/maps").read()

    slots.switch()
    slots.unload_background()
    assert old.retired and not old.closed and mapped("1")
    old.release()
    assert old.closed and not mapped("1") and mapped("2")
    service = SeekService(slots, max_batch=100)
    request = cube_fast_pb2.SeekRequest(keys=keys.astype("<u8").tobytes())
    response = cube_fast_pb2.SeekResponse.FromString(service.seek(request.SerializeToString()))
    assert response.version == "2" and response.found == b"\x01" * 10


class FailingRemote:
    """A worker that fails one op (and records what it was asked)."""

    def __init__(self, fail: str) -> None:
        self.fail = fail
        self.ops: list[str] = []
        self.index, self.port = 1, 0

    async def apply(
        self, op: str, mode: str = "", name: str = "", timeout: float | None = None
    ) -> dict[str, Any]:
        if op != "state":
            self.ops.append(op)
        if op == self.fail:
            raise ControlError(grpc.StatusCode.UNAVAILABLE, "worker 1: gone")
        return {"worker": 1}


def name(slot: LoadedVersion | None) -> str | None:
    """The version in a slot (None: empty)."""
    return slot.name if slot is not None else None


def make_coordinator(
    tmp_path: Path, remote: FailingRemote | None
) -> tuple[Coordinator, VersionSlots]:
    """A coordinator of a local worker on versions 1 (current) and 2, and `remote` if any."""
    keys = np.arange(10, dtype=np.uint64)
    write_version(tmp_path, "1", keys, fixed_values(keys, 8))
    write_version(tmp_path, "2", keys, fixed_values(keys, 8, tag=2))
    dirs = split_dirs(tmp_path, 1)
    slots = VersionSlots()
    slots.install(load_base(dirs, "1", LoadOptions()))
    service = SeekService(slots, max_batch=100)
    executor = ThreadPoolExecutor(1)
    local = LocalWorker(0, 0, slots, tmp_path, dirs, LoadOptions(), executor, service)
    remotes = [remote] if remote is not None else []
    return Coordinator(local, remotes, describe=dict), slots  # type: ignore[arg-type]  # a fake RemoteWorker


def test_failed_load_on_one_worker_rolls_back_the_others(tmp_path: Path) -> None:
    remote = FailingRemote("prepare")
    coordinator, slots = make_coordinator(tmp_path, remote)
    request = cube_pb2.ControlRequest(cmd="bg_load_base", version_path="/2")
    with pytest.raises(ControlError, match="worker 1"):
        asyncio.run(coordinator.command(request))
    assert slots.staged is None and slots.background is None and name(slots.current) == "1"
    assert remote.ops == ["prepare"]  # the failing worker itself had nothing to abort
    assert coordinator.busy is None


def test_failed_switch_on_one_worker_switches_the_others_back(tmp_path: Path) -> None:
    remote = FailingRemote("switch")
    coordinator, slots = make_coordinator(tmp_path, remote)
    asyncio.run(coordinator.command(cube_pb2.ControlRequest(cmd="bg_load_base", version_path="2")))
    assert name(slots.background) == "2"
    with pytest.raises(ControlError, match="gone"):
        asyncio.run(coordinator.command(cube_pb2.ControlRequest(cmd="enable", version="2")))
    assert name(slots.current) == "1" and name(slots.background) == "2"
    assert remote.ops == ["prepare", "commit", "switch"]


def test_enable_accepts_path_forms_and_refuses_traversal(tmp_path: Path) -> None:
    remote = FailingRemote("nothing")
    coordinator, _slots = make_coordinator(tmp_path, remote)

    def run(**fields: str) -> cube_pb2.ControlResponse:
        return asyncio.run(coordinator.command(cube_pb2.ControlRequest(**fields)))

    run(cmd="bg_load_base", version_path="/2")
    assert run(cmd="enable", version="/2").cur_version == "2"
    assert run(cmd="enable", version_path="1").cur_version == "1"  # back to the previous
    with pytest.raises(ControlError) as info:
        run(cmd="enable", version="../1")
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert remote.ops == ["prepare", "commit", "switch", "switch"]


def test_write_version_flag_rewrites_version_on_switch(tmp_path: Path) -> None:
    coordinator, _slots = make_coordinator(tmp_path, FailingRemote("nothing"))
    coordinator.write_version = True
    (tmp_path / "VERSION").write_text("1\n")
    asyncio.run(coordinator.command(cube_pb2.ControlRequest(cmd="reload_base", version_path="2")))
    assert (tmp_path / "VERSION").read_text() == "2\n"


def test_a_replica_getting_ready_refuses_every_request_at_once(tmp_path: Path) -> None:
    """While the replica gets ready (its kernel loading) it holds a version but does not
    serve: every request, the SDK's empty handshake included, is refused UNAVAILABLE with the
    reason (clients fail over at once), health and status follow; then it serves."""
    keys = np.arange(10, dtype=np.uint64)
    write_version(tmp_path, "1", keys, fixed_values(keys, 8))
    slots = VersionSlots()
    slots.install(load_base(split_dirs(tmp_path, 1), "1", LoadOptions()))
    heard = []
    slots.listeners.append(lambda: heard.append(slots.serving))
    slots.set_not_ready("the compiled lookup kernel is loading")
    assert not slots.serving and heard == [False]
    assert slots.why_not_serving() == "the compiled lookup kernel is loading"
    service = SeekService(slots, max_batch=100)
    request = cube_fast_pb2.SeekRequest(keys=keys.astype("<u8").tobytes()).SerializeToString()
    for call in (
        lambda: service.seek(b""),
        lambda: service.seek(request),
        lambda: service.answer_original(keys, "original"),
        lambda: service.seek(cube_fast_pb2.SeekRequest(version="1").SerializeToString()),
    ):
        with pytest.raises(RequestError) as refused:
            call()
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE
        assert "not ready: the compiled lookup kernel is loading" in refused.value.message
    slots.set_not_ready("")
    assert slots.serving and heard == [False, True]
    response = cube_fast_pb2.SeekResponse.FromString(service.seek(request))
    assert response.found == b"\x01" * 10 and response.version == "1"
    slots.close()


def test_a_worker_reaches_a_peer_that_came_up_after_its_first_try(tmp_path: Path) -> None:
    """Worker 0 asks worker 1 while worker 1 is not listening yet (starting, or restarted by
    the supervisor); once it listens, the next command reaches it: the channel to a loopback
    peer neither fails for gRPC's default reconnect backoff (a second or more, during which
    every command failed with the first refusal) nor fails before its timeout."""
    from cube.processes import free_port
    from cube.server.control import RemoteWorker, worker_handler

    coordinator, slots = make_coordinator(tmp_path, None)
    port = free_port()

    async def scenario() -> dict[str, Any]:
        peer = RemoteWorker(1, port, f"127.0.0.1:{port}", 5.0)
        with pytest.raises(ControlError):
            await peer.apply("state", timeout=0.3)  # nobody listens yet
        server = grpc.aio.server()
        server.add_generic_rpc_handlers([worker_handler(coordinator.local)])
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        try:
            return await peer.apply("state", timeout=0.5)
        finally:
            await peer.close()
            await server.stop(None)

    assert asyncio.run(scenario())["cur_version"] == "1"
    slots.close()


def test_the_supervisor_restarts_a_worker_until_it_crash_loops() -> None:
    """--worker_restarts 2: a worker may die twice within the window and is restarted; a third
    death within it stops the server; deaths older than the window are forgotten."""
    from cube.server.supervisor import Restarts

    restarts = Restarts(limit=2, window_s=60.0)
    assert restarts.died(1, -9, now=0.0) is None
    assert restarts.died(1, -9, now=10.0) is None
    assert restarts.died(0, 1, now=11.0) is None  # another worker counts apart
    why = restarts.died(1, -9, now=59.0)
    assert why is not None and "worker 1 died 3 times within 60 s" in why
    later = Restarts(limit=2, window_s=60.0)
    for now in (0.0, 50.0, 100.0, 150.0):  # never more than 2 within any 60 s
        assert later.died(0, -9, now) is None


def test_the_supervisor_stops_at_once_when_a_worker_cannot_listen() -> None:
    from cube.server.supervisor import EXIT_CANNOT_LISTEN, Restarts

    why = Restarts(limit=3).died(2, EXIT_CANNOT_LISTEN, now=0.0)
    assert why == "worker 2 cannot listen on its ports"


def test_version_and_chain_files_are_written_durably(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """VERSION and CHAIN go through cube.fsutil's atomic write: the file is fsynced before its
    rename and the directory after it, and no temp file is left behind."""
    import os

    synced: list[int] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    (tmp_path / "5_6").mkdir()
    write_version_file(tmp_path, "5_6")
    assert (tmp_path / "VERSION").read_text() == "5_6\n" and len(synced) == 2
    write_chain(tmp_path, "5_6", ["5", "5_6"])
    assert (tmp_path / "5_6" / "CHAIN").read_text() == "5\n5_6\n" and len(synced) == 4
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["5_6", "CHAIN", "VERSION"]


def test_a_data_dir_its_agent_has_not_made_yet_is_the_normal_start(tmp_path: Path) -> None:
    """A pod's server starts before its agent made <deploy_path>/data (the volume is there):
    waiting, no warning; a data dir whose parent is missing too is likely a typo."""
    from cube.server.versions import WAITING, diagnose_data_dir

    waiting = diagnose_data_dir(tmp_path / "data", [tmp_path / "data"])
    assert waiting.endswith(WAITING), waiting
    typo = diagnose_data_dir(tmp_path / "dta" / "data", [tmp_path / "dta" / "data"])
    assert "a typo?" in typo and not typo.endswith(WAITING)


def test_a_small_layer_skips_the_huge_page_measure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The huge-page share is measured (reading /proc/self/smaps walks every mapping of the
    process: seconds under a 300M-key base) only for layers of PMD_MEASURED_BYTES or more."""
    from cube.server import versions
    from cube.shard import Shard

    calls: list[int] = []

    def walk(self: Shard) -> int:
        calls.append(1)
        return 123

    monkeypatch.setattr(Shard, "pmd_mapped_bytes", walk)
    keys = np.arange(1000, dtype=np.uint64)
    write_version(tmp_path, "1", keys, fixed_values(keys, 64))
    dirs = split_dirs(tmp_path, 1)
    small = load_base(dirs, "1", LoadOptions(huge_pages=True))
    assert calls == [] and small.describe()["pmd_mapped_bytes"] == 0
    small.retire()
    monkeypatch.setattr(versions, "PMD_MEASURED_BYTES", 0)
    measured = load_base(dirs, "1", LoadOptions(huge_pages=True))
    assert calls == [1] and measured.describe()["pmd_mapped_bytes"] == 123
    measured.retire()
