"""The TCP lane (cube.server.lane) and the SDK's use of it, on real cube-server processes.

Discovery over gRPC, pipelined frames answered in order, every error status as an error frame
(the connection stays usable), a wrong magic and an oversized frame, the SDK on the lane vs
gRPC-only (server counters tell which one answered), a server without a lane, and a server
restarted on the same gRPC port (new lane port) under both clients."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from helpers.procs import (
    ServerProc,
    expected_fixed,
    fixed_values,
    running_server,
    start_server,
    write_version,
)
from helpers.stubs import raw_unary
from test_server import control

from cube.client import AsyncCubeClient, ConfError, CubeClient, RequestRejectedError, SeekResult
from cube.client._sync_transport import BusyPoll
from cube.pb import cube_fast_pb2
from cube.processes import cpu_seconds, poll_until
from cube.values import ValueColumn
from cube.wire import LANE_MAGIC, decode_seek_response, encode_seek_request

WIDTH = 24
KEYS = np.arange(1, 9000, 3, dtype=np.uint64)


def lane_port(address: str) -> int | None:
    """The lane port a server announces to an empty Seek, or None."""
    with grpc.insecure_channel(address) as channel:
        _, call = raw_unary(channel, "/cube.v1.CubeService/Seek").with_call(b"", timeout=10)
    ports = [int(v) for k, v in call.initial_metadata() if k == "cube-tcp-port"]
    return ports[0] if ports else None


def status(address: str) -> dict[str, Any]:
    detail: dict[str, Any] = json.loads(control(address, "status").detail_json)
    return detail


def counters(address: str) -> dict[str, int]:
    requests: dict[str, int] = status(address)["requests"]
    return requests


def announced_lane_port(address: str) -> int:
    """The lane port a server announces; fails the test if it announces none."""
    port = lane_port(address)
    assert port is not None, f"{address} announces no lane"
    return port


class LaneSocket:
    """A raw client of the lane: frames out, (status, body) in."""

    def __init__(self, port: int, magic: bytes = LANE_MAGIC) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock.sendall(magic)

    def send(self, payload: bytes) -> None:
        self.sock.sendall(struct.pack("<I", len(payload)) + payload)

    def read(self) -> tuple[int, bytes]:
        length, status = struct.unpack("<IB", self._exact(5))
        return status, self._exact(length)

    def _exact(self, size: int) -> bytes:
        data = b""
        while len(data) < size:
            chunk = self.sock.recv(size - len(data))
            if not chunk:
                raise ConnectionError("closed")
            data += chunk
        return data

    def closed(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    data = tmp_path_factory.mktemp("lane") / "data"
    write_version(data, "100", KEYS, fixed_values(KEYS, WIDTH, tag=1), current=True)
    with running_server(data, "--dict_name", "test_dict", "--max_batch", "3000") as proc:
        yield proc


@pytest.mark.slow
def test_pipelined_frames_answered_in_order(server: ServerProc) -> None:
    port = lane_port(server.address)
    assert port and port != server.port
    lane = LaneSocket(port)
    try:
        extra = [np.array([2, 5 + 3 * i], dtype=np.uint64) for i in range(20)]
        batches = [np.concatenate([KEYS[i * 40 : i * 40 + 30], extra[i]]) for i in range(20)]
        # all requests in one write: several frames per read on the server
        lane.sock.sendall(
            b"".join(
                struct.pack("<I", len(r)) + r
                for r in (encode_seek_request(b, request_id=i + 1) for i, b in enumerate(batches))
            )
        )
        for batch in batches:
            status, body = lane.read()
            assert status == 0
            answer = decode_seek_response(body, len(batch))
            expect = np.isin(batch, KEYS)
            assert answer.found.tolist() == expect.tolist() and answer.version == "100"
            rows = answer.column.as_rows()
            assert (rows[expect] == expected_fixed(batch[expect], WIDTH, tag=1)).all()
            assert (rows[~expect] == 0).all()
        # a frame split across writes, byte by byte at its start
        request = encode_seek_request(KEYS[:5])
        frame = struct.pack("<I", len(request)) + request
        for i in range(6):
            lane.sock.sendall(frame[i : i + 1])
        lane.sock.sendall(frame[6:])
        status, body = lane.read()
        assert status == 0 and decode_seek_response(body, 5).found.all()
    finally:
        lane.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    "payload, code, words",
    [
        (b"\x0a\x03abc", grpc.StatusCode.INVALID_ARGUMENT, "not a multiple of 8"),
        (b"\x0a\x05x", grpc.StatusCode.INVALID_ARGUMENT, "does not parse"),
        (
            encode_seek_request(KEYS[:2], dict_name="other"),
            grpc.StatusCode.NOT_FOUND,
            "'other' is not served",
        ),
        (
            encode_seek_request(KEYS[:2], version="999"),
            grpc.StatusCode.FAILED_PRECONDITION,
            "version '999' is not loaded",
        ),
        (
            encode_seek_request(np.arange(3001, dtype=np.uint64), request_id=77),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "request_id=77: 3001 keys",
        ),
    ],
)
def test_error_frames_keep_the_connection(
    server: ServerProc, payload: bytes, code: grpc.StatusCode, words: str
) -> None:
    lane = LaneSocket(announced_lane_port(server.address))
    try:
        lane.send(payload)
        lane.send(encode_seek_request(KEYS[:3]))
        status, body = lane.read()
        assert status == code.value[0] and words in body.decode()
        status, body = lane.read()
        assert status == 0 and decode_seek_response(body, 3).found.all()
    finally:
        lane.close()


@pytest.mark.slow
def test_wrong_magic_and_oversized_frame_close_the_connection(server: ServerProc) -> None:
    port = announced_lane_port(server.address)
    stranger = LaneSocket(port, magic=b"GET / HTTP/1.1\r\n\r\n")
    try:
        assert stranger.closed()
    finally:
        stranger.close()
    lane = LaneSocket(port)
    try:
        lane.sock.sendall(struct.pack("<I", 1 << 30))
        status, body = lane.read()
        assert status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert "exceeds" in body.decode()
        assert lane.closed()
    finally:
        lane.close()


@pytest.mark.slow
def test_sdk_uses_the_lane_unless_told_grpc(server: ServerProc) -> None:
    keys = np.concatenate([KEYS[100:400], np.array([0, 2], dtype=np.uint64)])
    before = counters(server.control_address)
    with CubeClient(shards=[[server.address]], dict_name="test_dict") as client:
        for _ in range(5):
            result = client.seek(keys)
    middle = counters(server.control_address)
    assert middle["lane_messages"] - before["lane_messages"] == 5
    assert result.found.tolist() == np.isin(keys, KEYS).tolist()
    with CubeClient(shards=[[server.address]], transport="grpc") as client:
        assert client.seek(keys).values == result.values
    after = counters(server.control_address)
    assert after["lane_messages"] == middle["lane_messages"]
    assert after["requests"] - middle["requests"] == 2  # first contact (routing) + the seek

    async def seek_async() -> list[SeekResult]:
        async with AsyncCubeClient(shards=[[server.address]], dict_name="test_dict") as aio:
            return await asyncio.gather(*(aio.seek(keys) for _ in range(6)))

    for answer in asyncio.run(seek_async()):
        assert answer.values == result.values
    assert counters(server.control_address)["lane_messages"] - after["lane_messages"] == 6
    with (
        CubeClient(shards=[[server.address]], dict_name="other") as client,
        pytest.raises(RequestRejectedError, match="NOT_FOUND"),
    ):
        client.seek(keys)


@pytest.mark.slow
def test_server_without_a_lane_is_used_over_grpc(tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_version(data, "100", KEYS, fixed_values(KEYS, WIDTH, tag=1), current=True)
    with running_server(data, "--tcp_lane", "false") as server:
        assert lane_port(server.address) is None
        with CubeClient(shards=[[server.address]]) as client:
            assert client.seek(KEYS[:50]).found.all()

        async def seek_async() -> SeekResult:
            async with AsyncCubeClient(shards=[[server.address]]) as aio:
                return await aio.seek(KEYS[:50])

        assert asyncio.run(seek_async()).found.all()
        requests = counters(server.control_address)["requests"]
        assert requests == 3 + 2  # three probes (ours too), two seeks
        assert counters(server.control_address)["lane_messages"] == 0


@pytest.mark.slow
def test_fixed_lane_ports_and_bad_flags(tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_version(data, "100", KEYS, fixed_values(KEYS, WIDTH, tag=1), current=True)
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    with running_server(data, "--tcp_ports", str(port)) as server:
        assert lane_port(server.address) == port
    for flags, words in (
        (["--tcp_ports", "1,2"], "--tcp_ports lists 2 ports"),
        (["--tcp_ports", "x"], "is not a list of ports"),
        (["--workers", "2", "--tcp_ports", "7,7"], "distinct"),
        (["--busy_poll_us", "-5"], "--busy_poll_us must be in 0..1000000"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "cube.server.main", "--data_dir", str(data), *flags],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2 and words in done.stderr


@pytest.mark.slow
def test_restarted_server_gets_a_new_lane_and_clients_follow(tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_version(data, "100", KEYS, fixed_values(KEYS, WIDTH, tag=1), current=True)
    keys = KEYS[:200]
    first = start_server(data)
    ports = first.ports
    try:
        sync_client = CubeClient(shards=[[first.address]], retry=3, timeout=5.0)

        async def run_async(restart: Callable[[], None]) -> SeekResult:
            async with AsyncCubeClient(shards=[[first.address]], retry=3, timeout=5.0) as aio:
                assert (await aio.seek(keys)).found.all()
                await asyncio.to_thread(restart)
                return await aio.seek(keys)

        assert sync_client.seek(keys).found.all()
        old_lane = lane_port(first.address)
        servers = [first]

        def restart() -> None:
            servers[-1].stop()
            servers.append(start_server(data, ports=ports))

        restart()
        assert lane_port(first.address) != old_lane
        assert sync_client.seek(keys).found.all()  # stale lane: re-asked, then answered
        assert asyncio.run(run_async(restart)).found.all()
        sync_client.close()
    finally:
        for proc in servers:
            proc.stop()


# ---------------------------------------------------------------------------------------------
# In process: requests answered together equal requests answered one by one


def _requests(keys: np.ndarray, count: int, seed: int, version: str | None = "") -> list[bytes]:
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 60, count)
    sizes[1] = 0  # an empty request among them
    out = []
    for i, size in enumerate(sizes):
        batch = rng.choice(np.concatenate([keys, keys + 1]), size)  # half misses
        out.append(encode_seek_request(batch, version=version, request_id=i + 1))
    return out


@pytest.mark.parametrize("layout", ["fixed", "variable", "split", "empty"])
def test_merged_answers_equal_single_answers(tmp_path: Path, layout: str) -> None:
    from cube.server.service import SeekService
    from cube.server.versions import LoadOptions, VersionSlots, load_base, split_dirs

    keys = np.arange(10, 3000, 7, dtype=np.uint64)
    splits = 2 if layout == "split" else 1
    slots = VersionSlots(allow_empty=True)  # "empty": misses by design (--allow_empty)
    if layout != "empty":
        for version, tag in (("1", 1), ("2", 2)):
            for split in range(splits):
                mine = keys[keys % splits == split]
                values: ValueColumn | list[bytes]
                if layout == "variable":
                    values = [bytes([tag]) * int(1 + k % 5) for k in mine]
                else:
                    values = fixed_values(mine, 12, tag=tag)
                write_version(tmp_path, version, mine, values, split=split if splits > 1 else None)
        dirs = split_dirs(tmp_path, splits)
        slots.install(load_base(dirs, "1", LoadOptions()))
        slots.stage(load_base(dirs, "2", LoadOptions()))
        slots.commit()  # 1 current, 2 background: requests may pin either
    service = SeekService(slots, max_batch=100)
    raws = _requests(keys, 12, seed=5)
    if layout != "empty":
        raws += _requests(keys, 5, seed=6, version="2") + _requests(keys, 3, seed=7, version="1")
    raws = [raws[i] for i in np.random.default_rng(8).permutation(len(raws))]
    merged = service.answer_seeks([service.parse_seek(r) for r in raws])
    assert len(merged) == len(raws)
    for raw, parts in zip(raws, merged, strict=True):
        assert isinstance(parts, list)  # buffers: not an error, not a whole lane frame
        assert b"".join(parts) == service.seek(raw)


@pytest.mark.parametrize("announced", ["refused", "banana", "0", "70000"])
def test_unreachable_lane_falls_back_to_grpc(announced: str) -> None:
    """A server announcing a lane nobody can connect to (e.g. a firewall), or a port that is
    not one: calls go over gRPC and the lane is asked for again only after a while."""
    from concurrent.futures import ThreadPoolExecutor

    from cube.server.encoders import empty_answer, encode_seek_response

    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    dead_port = dead.getsockname()[1]  # bound, never listening: connections are refused
    calls = {"probe": 0, "seek": 0}

    def seek(raw: bytes, context: grpc.ServicerContext) -> bytes:
        if not raw:
            calls["probe"] += 1
            port = str(dead_port) if announced == "refused" else announced
            context.send_initial_metadata((("cube-tcp-port", port),))
            return b""
        calls["seek"] += 1
        request = cube_fast_pb2.SeekRequest.FromString(raw)
        n = len(request.keys) // 8
        return encode_seek_response(empty_answer(n), "7", request.request_id)

    server = grpc.server(ThreadPoolExecutor(4))
    handler = grpc.method_handlers_generic_handler(
        "cube.v1.CubeService", {"Seek": grpc.unary_unary_rpc_method_handler(seek)}
    )
    server.add_generic_rpc_handlers([handler])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        address = f"127.0.0.1:{port}"
        with CubeClient(shards=[[address]], retry=0) as client:
            for _ in range(3):
                result = client.seek(KEYS[:10])
                assert not result.found.any() and result.version == "7"
        assert calls == {"probe": 1, "seek": 3}

        async def seek_async() -> list[SeekResult]:
            async with AsyncCubeClient(shards=[[address]], retry=0) as aio:
                return [await aio.seek(KEYS[:10]) for _ in range(3)]

        assert all(r.version == "7" for r in asyncio.run(seek_async()))
        assert calls == {"probe": 2, "seek": 6}
    finally:
        server.stop(0)
        dead.close()


@pytest.mark.slow
def test_busy_polling_answers_and_stops_when_idle(tmp_path: Path) -> None:
    """--busy_poll_us on the server and busy_poll_us in the SDK: answers are right, several
    threads share the client, and once traffic stops the server stops polling (a window that
    never closed would burn a core forever)."""
    data = tmp_path / "data"
    write_version(data, "100", KEYS, fixed_values(KEYS, WIDTH, tag=1), current=True)
    with (
        running_server(data, "--busy_poll_us", "20000") as server,
        CubeClient(shards=[[server.address]], busy_poll_us=20000) as client,
    ):
        for _ in range(20):
            result = client.seek(KEYS[:500])
            assert result.found.all()
            assert (result.column.as_rows() == expected_fixed(KEYS[:500], WIDTH, 1)).all()
        with ThreadPoolExecutor(4) as pool:
            assert all(pool.map(lambda _: client.seek(KEYS).found.all(), range(40)))
        assert counters(server.control_address)["lane_messages"] >= 60
        # the lookup kernel loads in the background after start-up: not idle work to count
        assert poll_until(
            lambda: not status(server.control_address)["kernel"].startswith("numpy until"), 120, 0.1
        )
        time.sleep(0.2)  # past the 20 ms window
        before = cpu_seconds([server.pid])
        time.sleep(1.0)
        assert cpu_seconds([server.pid]) - before < 0.2
    with pytest.raises(ConfError, match="busy_poll_us"):
        CubeClient(shards=[["127.0.0.1:1"]], busy_poll_us=-1)


def test_busy_poll_receives_what_comes_within_or_after_its_window() -> None:
    ours, theirs = socket.socketpair()
    try:
        poll = BusyPoll(0.5)
        buffer = bytearray(16)
        timer = threading.Timer(0.01, theirs.send, args=(b"soon",))
        timer.start()
        assert poll.recv_into(ours, memoryview(buffer), time.monotonic() + 5) == 4
        timer.join()
        short = BusyPoll(0.001)  # the window passes: the blocking receive gets it
        threading.Timer(0.05, theirs.send, args=(b"later",)).start()
        assert short.recv_into(ours, memoryview(buffer), time.monotonic() + 5) == 5
        assert bytes(buffer[:5]) == b"later" and BusyPoll._waiting == 0
    finally:
        ours.close()
        theirs.close()


@pytest.mark.parametrize(
    ("n", "width", "version", "request_id", "word"),
    [
        (1000, 40, "1", 5, np.uint64),
        (3, 8, "", 0, np.uint64),
        (200, 64, "20261123_1", 2**40, np.uint64),
        (7, 6, "x", 1, np.uint16),
        (5, 3, "y", 300, np.uint8),
    ],
)
def test_fixed_answer_frame_is_header_and_response_bytes(
    n: int, width: int, version: str, request_id: int, word: type[np.unsignedinteger[Any]]
) -> None:
    """The one-buffer answer the kernel writes into is byte for byte the answer header + the
    SeekResponse parts, with the values aligned for the kernel's word copies."""
    from cube.server.encoders import Answer, seek_response_parts
    from cube.wire import answer_header, fixed_answer_frame

    frame, found, values = fixed_answer_frame(n, width, version, request_id, np.dtype(word))
    assert values.ctypes.data % np.dtype(word).itemsize == 0
    rng = np.random.default_rng(n)
    found[:] = rng.random(n) < 0.5
    as_bytes = values.view(np.uint8)
    as_bytes[:] = rng.integers(0, 256, (n, width), dtype=np.uint8)
    answer = Answer(found.copy(), as_bytes.copy(), width, None)
    body = b"".join(bytes(p) for p in seek_response_parts(answer, version, request_id))
    assert bytes(frame) == answer_header(len(body)) + body
