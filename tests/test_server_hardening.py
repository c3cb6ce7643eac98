"""cube-server under an unlucky operator and a hostile peer, on real processes: shard files
truncated or rewritten under the server (leases and polling), keys that do not route to the
shard, answers bounded in bytes, and a version retired between a request's parse and answer."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any, ParamSpec

import grpc
import numpy as np
import numpy.typing as npt
import pytest
from grpc_health.v1 import health_pb2
from helpers.procs import ServerProc, fixed_values, running_server, write_version
from helpers.stubs import dict_stub, raw_unary
from numpy.typing import NDArray
from test_server import control, fixed_rows, seek

from cube.processes import health_status, poll_until
from cube.routing import shard_of

pytestmark = pytest.mark.slow  # real processes end to end: `make quick` skips them

KEYS = np.arange(1, 3001, 2, dtype=np.uint64)
WIDTH = 24
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
P = ParamSpec("P")


def expect_status(
    code: grpc.StatusCode,
    words: list[str],
    fn: Callable[P, object],
    *args: P.args,
    **kwargs: P.kwargs,
) -> str:
    """fn(*args, **kwargs) fails with `code`, every one of `words` in its details."""
    with pytest.raises(grpc.RpcError) as info:
        fn(*args, **kwargs)
    details = info.value.details() or ""
    assert info.value.code() == code, details
    for word in words:
        assert word in details, details
    return details


def health_becomes(address: str, status: int, timeout: float = 10.0) -> bool:
    return poll_until(lambda: health_status(address) == status, timeout, 0.05)


@pytest.mark.parametrize("leases", ["true", "false"])
def test_truncated_shard_file_stops_serving_not_the_process(tmp_path: Path, leases: str) -> None:
    """Today's SIGBUS: a shard file truncated under a running server. With a lease the
    truncation waits until the server has let go of the mapping; by polling the server notices
    within a second (the test waits for that before asking). Either way: the version stops
    serving with a reason naming the file, the process lives, a good version serves again."""
    data = tmp_path / "data"
    version = write_version(data, "1", KEYS, fixed_values(KEYS, WIDTH, 1), current=True)
    write_version(data, "2", KEYS, fixed_values(KEYS, WIDTH, 2))
    with (
        running_server(data, f"--file_leases={leases}") as server,
        grpc.insecure_channel(server.address) as channel,
    ):
        assert np.frombuffer(seek(channel, KEYS[:10]).found, np.uint8).all()
        os.truncate(version / "data.cube", 4096)  # waits for the server when it holds a lease
        assert health_becomes(server.address, NOT_SERVING)
        details = expect_status(
            grpc.StatusCode.UNAVAILABLE, ["data.cube"], seek, channel, KEYS[:1000]
        )
        assert "truncated" in details or "changed size" in details
        assert server.process.poll() is None
        detail = json.loads(control(server, "status").detail_json)
        assert detail["serving"] is False and "data.cube" in detail["not_serving_reason"]
        control(server, "reload_base", version_path="/2")
        assert health_becomes(server.address, SERVING)
        assert set(fixed_rows(seek(channel, KEYS[:50]))[:, 8].tolist()) == {2}
    assert server.process.returncode == 0, server.log()[-3000:]


def test_rewritten_background_version_is_dropped_current_keeps_serving(tmp_path: Path) -> None:
    """A file of the loaded background version opened for writing: that version goes (its
    slot empties), the current one is untouched and keeps answering."""
    data = tmp_path / "data"
    write_version(data, "1", KEYS, fixed_values(KEYS, WIDTH, 1), current=True)
    other = write_version(data, "2", KEYS, fixed_values(KEYS, WIDTH, 2))
    with running_server(data) as server, grpc.insecure_channel(server.address) as channel:
        control(server, "bg_load_base", version_path="/2")
        with open(other / "index.cube", "r+b"):  # an open for writing breaks the lease
            pass
        assert poll_until(lambda: control(server, "status").bg_version == "", 10, 0.05)
        assert health_status(server.address) == SERVING
        assert set(fixed_rows(seek(channel, KEYS[:50]))[:, 8].tolist()) == {1}
        detail = json.loads(control(server, "status").detail_json)
        assert "index.cube" in detail["last_error"]


def write_shard_of(
    data: Path, name: str, shard: int, shard_num: int, partitioner: str, **kwargs: Any
) -> tuple[NDArray[np.uint64], Path]:
    """Version `name` of the KEYS routed to `shard` (kwargs: write_version's)."""
    owned = KEYS[shard_of(KEYS, shard_num, partitioner) == shard]
    routing = {"shard": shard, "shard_num": shard_num, "partitioner": partitioner}
    return owned, write_version(
        data, name, owned, fixed_values(owned, WIDTH, shard), routing=routing, **kwargs
    )


@pytest.mark.parametrize("partitioner", ["mod", "murmur3"])
def test_keys_of_another_shard_are_refused(tmp_path: Path, partitioner: str) -> None:
    """Configuration drift (wrong shard order, partitioner or shard count in a client): the
    server refuses keys that do not route to it, naming the key and both routings."""
    data = tmp_path / "data"
    owned, _ = write_shard_of(data, "1", 1, 3, partitioner, current=True)
    with running_server(data) as server, grpc.insecure_channel(server.address) as channel:
        assert np.frombuffer(seek(channel, owned).found, np.uint8).all()
        foreign = KEYS[shard_of(KEYS, 3, partitioner) != 1][:5]
        query = np.concatenate([owned[:3], foreign])
        expect_status(
            grpc.StatusCode.INVALID_ARGUMENT,
            [f"key {int(foreign[0])} (position 3)", "shard 1 of 3", partitioner],
            seek,
            channel,
            query,
        )
        from cube.pb import cube_pb2

        expect_status(
            grpc.StatusCode.INVALID_ARGUMENT,
            ["shard 1 of 3"],
            dict_stub(channel).seek,
            cube_pb2.DictRequest(keys=[int(k) for k in query]),
            timeout=10,
        )


def test_version_of_another_shard_or_dict_is_refused_at_load(tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_shard_of(data, "1", 0, 2, "mod", current=True)
    write_shard_of(data, "2", 1, 2, "mod")
    write_shard_of(data, "3", 0, 2, "mod", dict_name="other_dict")
    args = ("--shard", "0", "--dict_name", "test_dict")
    with running_server(data, *args) as server:
        expect_status(
            grpc.StatusCode.FAILED_PRECONDITION,
            ["shard 1 of 2", "--shard 0"],
            control,
            server,
            "bg_load_base",
            version_path="/2",
        )
        expect_status(
            grpc.StatusCode.FAILED_PRECONDITION,
            ["other_dict", "--dict_name"],
            control,
            server,
            "bg_load_base",
            version_path="/3",
        )
        assert control(server, "status").cur_version == "1"


def test_delta_built_for_another_shard_count_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_shard_of(data, "1", 0, 2, "mod", current=True)
    routing = {"shard": 0, "shard_num": 3, "partitioner": "mod"}
    write_version(data, "1_2", [3], [b"x" * WIDTH], routing=routing, chain=["1", "1_2"])
    with running_server(data) as server:
        expect_status(
            grpc.StatusCode.FAILED_PRECONDITION,
            ["different shards", "shard 0 of 3", "shard 0 of 2"],
            control,
            server,
            "bg_load_patch",
            version_path="/1_2",
        )


def test_answers_are_bounded_in_bytes(tmp_path: Path) -> None:
    """--max_answer_bytes: a fixed-width request refused before any work; a variable-width
    one counted before its values are gathered; smaller ones answered."""
    data = tmp_path / "data"
    write_version(data, "1", KEYS, fixed_values(KEYS, 1000, 1), current=True)
    light, heavy = KEYS[KEYS % 4 == 3], KEYS[KEYS % 4 == 1]
    variable = [bytes([7]) * (1000 if k % 4 == 1 else 10) for k in KEYS.tolist()]
    write_version(data, "2", KEYS, variable)
    limit = 200 * 1000
    with (
        running_server(data, f"--max_answer_bytes={limit}") as server,
        grpc.insecure_channel(server.address) as channel,
    ):
        assert len(seek(channel, KEYS[:200]).values) == 200 * 1000
        expect_status(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            ["201000 bytes", "--max_answer_bytes"],
            seek,
            channel,
            KEYS[:201],
        )
        control(server, "reload_base", version_path="/2")
        assert len(seek(channel, light[:700]).values) == 7000  # bound 700 x 1000 > limit
        assert len(seek(channel, heavy[:200]).values) == 200 * 1000
        expect_status(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            ["201050 bytes"],  # counted exactly: 201 x 1000 + 5 x 10
            seek,
            channel,
            np.concatenate([heavy[:201], light[:5]]),
        )


def test_lane_request_holds_its_version_until_answered(tmp_path: Path) -> None:
    """A request parsed on the lane is answered in a later loop turn; the background version it
    pinned may be unloaded in between. It must still be answered from that version (today:
    INTERNAL errors, for it and for the requests answered with it)."""
    from cube.server.service import SeekService
    from cube.server.versions import LoadOptions, VersionSlots, load_base, split_dirs
    from cube.wire import decode_seek_response, encode_seek_request

    data = tmp_path / "data"
    write_version(data, "1", KEYS, fixed_values(KEYS, WIDTH, 1))
    write_version(data, "2", KEYS, fixed_values(KEYS, WIDTH, 2))
    dirs = split_dirs(data, 1)
    slots = VersionSlots()
    slots.install(load_base(dirs, "1", LoadOptions()))
    slots.stage(load_base(dirs, "2", LoadOptions()))
    slots.commit()
    service = SeekService(slots, max_batch=10_000)
    pinned = service.parse_seek(encode_seek_request(KEYS[:100], version="2", request_id=1))
    other = service.parse_seek(encode_seek_request(KEYS[:100], request_id=2))
    slots.unload_background()  # version 2 leaves every slot; the parsed request still holds it
    answers = service.answer_seeks([pinned, other])
    assert isinstance(answers[0], list) and isinstance(answers[1], list), answers
    first = decode_seek_response(b"".join(answers[0]), 100)
    second = decode_seek_response(b"".join(answers[1]), 100)
    assert first.version == "2" and set(first.column.as_rows()[:, 8].tolist()) == {2}
    assert second.version == "1" and second.found.all()
    assert pinned.version is not None and pinned.version.closed  # released: now unmapped


def _lane_port(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        _, call = raw_unary(channel, "/cube.v1.CubeService/Seek").with_call(b"", timeout=10)
    return next(int(v) for k, v in call.initial_metadata() if k == "cube-tcp-port")


def _kernel_loaded(server: ServerProc) -> None:
    """Wait until the server's lookup kernel has loaded in the background (numba and its
    compiled code: ~100 MiB and some CPU after start-up, which is not what a test of the
    lane's bounds measures)."""

    def loaded() -> bool:
        detail = json.loads(control(server, "status").detail_json)
        return not detail["kernel"].startswith("numpy until")

    assert poll_until(loaded, 120, 0.1), "the lookup kernel did not load"


def _rss(pid: int) -> int:
    import psutil

    return psutil.Process(pid).memory_info().rss


def _send_until_blocked(
    sock: socket.socket, payload: bytes, count: int, seconds: float = 5.0
) -> int:
    """Send `payload` up to `count` times; stop when the server stops reading (timeout)."""
    import time

    sock.settimeout(0.5)
    sent = 0
    deadline = time.monotonic() + seconds
    view = memoryview(payload)
    for _ in range(count):
        pos = 0
        while pos < len(view) and time.monotonic() < deadline:
            try:
                pos += sock.send(view[pos:])
            except TimeoutError:
                return sent
        sent += 1
    return sent


def test_lane_memory_bounded_when_answers_are_not_read(tmp_path: Path) -> None:
    """A client pipelines requests whose answers it never reads (each answer 40 MB): the
    server stops reading it once its answers are queued, so memory stays bounded, and it
    closes the connection after --lane_stall_timeout. Other clients are served meanwhile."""
    import struct
    import time

    from cube.wire import LANE_MAGIC, encode_seek_request

    data = tmp_path / "data"
    keys = np.arange(20_000, dtype=np.uint64)
    write_version(data, "1", keys, fixed_values(keys, 1000, 1), current=True)
    with (
        running_server(data, "--lane_stall_timeout=3") as server,
        grpc.insecure_channel(server.address) as channel,
    ):
        port = _lane_port(server.address)
        _kernel_loaded(server)
        before = _rss(server.pid)
        request = encode_seek_request(np.resize(keys, 40_000), request_id=1)
        frame = struct.pack("<I", len(request)) + request
        attacker = socket.create_connection(("127.0.0.1", port))
        attacker.sendall(LANE_MAGIC)
        sent = _send_until_blocked(attacker, frame, 40)  # 40 x 40 MB of answers asked
        time.sleep(1.0)
        grown = _rss(server.pid) - before
        assert np.frombuffer(seek(channel, keys[:100]).found, np.uint8).all()
        assert grown < 200 << 20, f"server grew {grown >> 20} MiB after {sent} requests"
        assert lane_connections(server) == 1
        assert poll_until(lambda: lane_connections(server) == 0, 15, 0.2), "not closed"
        attacker.close()


def lane_connections(server: ServerProc) -> int:
    detail = json.loads(control(server, "status").detail_json)
    return sum(w["lane"]["connections"] for w in detail["worker_states"])


def test_lane_partial_frames_bounded_and_timed_out(tmp_path: Path) -> None:
    """Many connections each holding most of a 4 MiB frame and then stalling: input buffers
    stay within --lane_budget_bytes (connections beyond it are told UNAVAILABLE and closed),
    stalled ones are closed after --lane_stall_timeout, other clients are served."""
    import struct
    import time

    from cube.wire import LANE_MAGIC

    data = tmp_path / "data"
    write_version(data, "1", KEYS, fixed_values(KEYS, WIDTH, 1), current=True)
    args = ("--lane_budget_bytes=33554432", "--lane_stall_timeout=2")
    with (
        running_server(data, *args) as server,
        grpc.insecure_channel(server.address) as channel,
    ):
        port = _lane_port(server.address)
        _kernel_loaded(server)
        before = _rss(server.pid)
        partial = LANE_MAGIC + struct.pack("<I", (4 << 20) - 16) + b"\0" * (3 << 20)
        sockets = []
        for _ in range(60):  # 180 MiB of partial frames offered
            sock = socket.create_connection(("127.0.0.1", port))
            _send_until_blocked(sock, partial, 1, seconds=2.0)
            sockets.append(sock)
        time.sleep(0.5)
        grown = _rss(server.pid) - before
        assert grown < 100 << 20, f"server grew {grown >> 20} MiB"
        assert np.frombuffer(seek(channel, KEYS[:100]).found, np.uint8).all()
        assert poll_until(lambda: lane_connections(server) == 0, 15, 0.2), "not closed"
        for sock in sockets:
            sock.close()


def _lane_call(port: int, keys: npt.ArrayLike, timeout: float = 10.0) -> tuple[int, bytes]:
    """One seek on a new lane connection: (status, body) of its answer frame."""
    import struct

    from cube.wire import LANE_MAGIC, encode_seek_request

    request = encode_seek_request(np.asarray(keys, dtype=np.uint64), request_id=1)
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(LANE_MAGIC + struct.pack("<I", len(request)) + request)
        head = b""
        while len(head) < 5 and (chunk := sock.recv(5 - len(head))):
            head += chunk
        length, status = struct.unpack("<IB", head)
        body = b""
        while len(body) < length and (chunk := sock.recv(length - len(body))):
            body += chunk
    return status, body


def test_lane_connections_capped(tmp_path: Path) -> None:
    """--lane_max_connections: at the limit, a new connection closes the one idle longest to
    make room; only when every connection is busy (here: HTTP requests whose bodies are
    being read) is it told UNAVAILABLE and closed."""
    from cube.wire import LANE_MAGIC

    data = tmp_path / "data"
    write_version(data, "1", KEYS, fixed_values(KEYS, WIDTH, 1), current=True)
    with running_server(data, "--lane_max_connections=3", "--http_port", "0") as server:
        port = _lane_port(server.address)
        http_port = server.written_ports()["http_ports"][0]
        kept = []
        for _ in range(3):  # idle: the magic, then nothing
            kept.append(socket.create_connection(("127.0.0.1", port), timeout=10))
            kept[-1].sendall(LANE_MAGIC)
        unavailable = grpc.StatusCode.UNAVAILABLE.value[0]

        def fourth_answered() -> bool:  # (refused until the watchdog has seen them idle)
            status, body = _lane_call(port, KEYS[:3])
            assert status in (0, unavailable), body
            return status == 0

        assert poll_until(fourth_answered, 10, 0.1)
        assert kept[0].recv(10) == b""  # the one idle longest made room
        for sock in kept:
            sock.close()
        assert poll_until(lambda: lane_connections(server) == 0, 10, 0.05)
        busy = []
        for _ in range(3):
            busy.append(socket.create_connection(("127.0.0.1", http_port), timeout=10))
            busy[-1].sendall(
                b"POST /DictService/seek HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"
            )

        def bodies_read() -> bool:  # each handler charges its body before reading it
            return _lane_stats(server)["bytes"] >= 300

        assert poll_until(bodies_read, 10, 0.05)
        status, body = _lane_call(port, KEYS[:3])
        assert status == unavailable and b"limit" in body and b"busy" in body, body
        for sock in busy:
            sock.close()


def _open_files_at_least(count: int) -> None:
    """Raise this process's soft limit of open files toward `count` (up to the hard limit)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = count if hard == resource.RLIM_INFINITY else min(count, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft != resource.RLIM_INFINITY and soft < count:
        pytest.skip(f"needs {count} open files, the hard limit is {hard}")


def _soft_open_files(count: int) -> Callable[[], None]:
    """A preexec_fn: the child's soft limit of open files is `count` (its hard one stays)."""

    def limit() -> None:
        import resource

        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (count, hard))

    return limit


def test_idle_connections_cannot_starve_the_lane(tmp_path: Path) -> None:
    """Issue 24: 3000 connections that send nothing to each face (TCP lane, HTTP+JSON,
    baidu_std), far over the worker's 1024 (--lane_max_connections), then one connection a
    face dripping a request a byte a second (and an HTTP body). A new SDK lane connection is
    served within its one second (idle ones make room), and the drips are closed after
    --lane_request_timeout (told why, where the protocol can say it). The server starts with a
    soft limit of 1024 open files, as many systems start processes: it raises it to hold its
    1024 connections."""
    import contextlib

    from cube.client import CubeClient
    from cube.wire import LANE_MAGIC

    flood = 3000
    _open_files_at_least(3 * flood + 512)
    data = tmp_path / "data"
    write_version(data, "1", KEYS, fixed_values(KEYS, WIDTH, 1), current=True)
    args = ("--http_port", "0", "--baidu_std_port", "0", "--lane_request_timeout", "4")
    with running_server(
        data, *args, "--dict_name", "test_dict", preexec_fn=_soft_open_files(1024)
    ) as server:
        ports = server.written_ports()
        faces = {
            "lane": _lane_port(server.address),
            "http": ports["http_ports"][0],
            "baidu_std": ports["baidu_std_ports"][0],
        }
        requests = {  # what each drip sends, a byte a second
            "lane": LANE_MAGIC + b"\x10\x00\x00\x00" + b"\x00" * 16,
            "http": b"POST /DictService/seek HTTP/1.1\r\nHost: x\r\n\r\n",
            "baidu_std": b"PRPC\x00\x00\x00\x10\x00\x00\x00\x04" + b"\x00" * 16,
            "http body": b'{"keys": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]}',
        }
        body_head = b"POST /DictService/seek HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
        idle: list[socket.socket] = []
        drips: dict[str, socket.socket] = {}
        sent = [0]

        def drip() -> None:
            for face, sock in drips.items():
                with contextlib.suppress(OSError):  # (closed by the server)
                    sock.sendall(requests[face][sent[0] : sent[0] + 1])
            sent[0] += 1

        try:
            for port in faces.values():
                idle += [socket.create_connection(("127.0.0.1", port), timeout=30)
                         for _ in range(flood)]  # fmt: skip

            def flood_taken() -> bool:  # every connection accepted, the oldest closed
                stats = _lane_stats(server)
                return stats["evicted"] == 3 * flood - 1024 and _held(server) == 1024

            assert poll_until(flood_taken, 60, 0.2), (_lane_stats(server), _held(server))
            for face, port in [*faces.items(), ("http body", faces["http"])]:
                drips[face] = socket.create_connection(("127.0.0.1", port), timeout=10)
            drips["http body"].sendall(body_head % len(requests["http body"]))  # then its body
            drip()
            before = _lane_messages(server)
            with CubeClient(shards=[[server.address]], dict_name="test_dict", retry=0) as client:
                result = client.seek(KEYS[:100])  # one attempt, a new lane connection, 1 s
            assert result.found.all() and _lane_messages(server) == before + 1
            assert idle[0].recv(1) == b""  # the oldest idle made room
            answers: dict[str, bytes] = {}

            def drips_closed() -> bool:
                drip()
                for face, sock in drips.items():
                    if face not in answers and _closed(sock):
                        answers[face] = _read_to_eof(sock)
                return len(answers) == len(drips)

            assert poll_until(drips_closed, 30, 1.0), set(drips) - set(answers)
            assert sent[0] < 20, f"a drip lived {sent[0]} s"
            for face in ("http", "http body"):
                assert answers[face].startswith(b"HTTP/1.1 408"), answers[face]
            for face in ("http", "http body", "lane"):  # (baidu_std has no frame for it)
                assert b"--lane_request_timeout" in answers[face], answers[face]
            assert _lane_stats(server)["closed_slow"] >= 3
        finally:
            for sock in idle + list(drips.values()):
                sock.close()


def _closed(sock: socket.socket) -> bool:
    """Whether the server has answered or closed `sock` (it says nothing to a drip before)."""
    import select

    poller = select.poll()  # (select() takes no descriptor past 1023)
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


def _lane_stats(server: ServerProc) -> dict[str, int]:
    stats: dict[str, int] = json.loads(control(server, "status").detail_json)["worker_states"][0][
        "lane"
    ]
    return stats


def _held(server: ServerProc) -> int:
    stats = _lane_stats(server)
    return sum(stats[k] for k in ("connections", "http_connections", "baidu_std_connections"))


def _read_to_eof(sock: socket.socket) -> bytes:
    sock.settimeout(10)
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def _lane_messages(server: ServerProc) -> int:
    return int(json.loads(control(server, "status").detail_json)["requests"]["lane_messages"])


# ---------------------------------------------------------------------------------------------
# the control plane: its own port, loopback by default, a token beyond it


def test_data_port_refuses_control_and_internal_calls(tmp_path: Path) -> None:
    """Whoever reaches the lookup port cannot load, switch or unload versions, nor apply an
    internal worker step (both used to be served on every worker's data port)."""
    data = tmp_path / "data"
    write_version(data, "1", KEYS, fixed_values(KEYS, WIDTH, 1), current=True)
    write_version(data, "2", KEYS, fixed_values(KEYS, WIDTH, 2))
    with running_server(data) as server, grpc.insecure_channel(server.address) as channel:
        expect_status(
            grpc.StatusCode.UNIMPLEMENTED, [], control, server.address, "reload_base",
            version_path="/2",
        )  # fmt: skip
        apply = raw_unary(channel, "/cube.internal.Worker/Apply")
        expect_status(grpc.StatusCode.UNIMPLEMENTED, [], apply, b'{"op": "switch"}', timeout=10)
        assert control(server, "status").cur_version == "1"


def test_control_token_checked_in_constant_time(tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_version(data, "1", KEYS, fixed_values(KEYS, WIDTH, 1), current=True)
    with running_server(data, "--control_token=s3cret", workers=2) as server:
        words = ["Bearer", "--control_token"]
        expect_status(grpc.StatusCode.UNAUTHENTICATED, words, control, server, "status")
        expect_status(
            grpc.StatusCode.UNAUTHENTICATED, words, control, server, "status", token="s3cre"
        )
        assert control(server, "status", token="s3cret").cur_version == "1"
        # worker 1 forwards to worker 0 with the token; its internal service wants it too
        second = server.control_addresses[1]
        assert control(second, "bg_unload", token="s3cret").cur_version == "1"
        with grpc.insecure_channel(second) as channel:
            apply = raw_unary(channel, "/cube.internal.Worker/Apply")
            expect_status(grpc.StatusCode.UNAUTHENTICATED, [], apply, b"{}", timeout=10)
        assert health_status(server.control_address) == SERVING  # health needs no token


def test_control_port_beyond_loopback_needs_a_token(tmp_path: Path) -> None:
    import subprocess
    import sys

    data = tmp_path / "data"
    command = [sys.executable, "-m", "cube.server.main", "--data_dir", str(data)]
    refused = subprocess.run(
        [*command, "--control_host", "0.0.0.0"], capture_output=True, text=True, timeout=60
    )
    assert refused.returncode == 2
    assert "without a token" in refused.stderr and "--insecure" in refused.stderr
    for extra in (["--insecure"], ["--control_token", "t"]):
        with running_server(data, "--control_host", "0.0.0.0", *extra) as server:
            assert health_status(server.control_address) is not None


@pytest.mark.parametrize("taken_flag", ["--port", "--tcp_ports"])
def test_port_in_use_fails_before_the_start_up_load(tmp_path: Path, taken_flag: str) -> None:
    """Every port is bound before the shard is loaded: an operator hears "port in use" at
    once, not after a long load, and nothing is mapped."""
    import subprocess
    import sys

    data = tmp_path / "data"
    write_version(data, "1700000000", KEYS, fixed_values(KEYS, WIDTH), current=True)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        flags = ["--port", "0", "--tcp_ports", str(port)]
        if taken_flag == "--port":
            flags = ["--port", str(port)]
        failed = subprocess.run(
            [sys.executable, "-m", "cube.server.main", "--data_dir", str(data), *flags],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert failed.returncode != 0
    assert f"127.0.0.1:{port}" in failed.stderr and "in use" in failed.stderr, failed.stderr
    assert "serving 1700000000" not in failed.stderr  # the load never began
