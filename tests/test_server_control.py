"""cube-server control plane end to end: loads, enable, undo, unload, concurrent commands,
corrupted versions, path traversal, restart on a delta, workers, SIGTERM drain, and a version
switch under load where every response comes from one version."""

from __future__ import annotations

import json
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import ParamSpec

import grpc
import numpy as np
import pytest
from helpers.procs import expected_fixed, fixed_values, running_server, start_server, write_version
from helpers.stubs import control_stub, fast_stub
from test_server import control, fixed_rows, seek

from cube.format import HEADER_SIZE
from cube.pb import cube_fast_pb2, cube_pb2
from cube.processes import free_ports, health_status, poll_until

pytestmark = pytest.mark.slow  # real processes end to end: `make quick` skips them

KEYS = np.arange(1, 3001, 2, dtype=np.uint64)  # 1500 keys
WIDTH = 24
P = ParamSpec("P")


def write_base(
    data: Path, name: str, tag: int, *, current: bool = False, split: int | None = None
) -> Path:
    return write_version(
        data, name, KEYS, fixed_values(KEYS, WIDTH, tag), current=current, split=split
    )


def tags_of(response: cube_fast_pb2.SeekResponse) -> set[int]:
    """The tag byte (byte 8) of every found row."""
    found = np.frombuffer(response.found, np.uint8).astype(bool)
    return set(fixed_rows(response)[found, 8].tolist())


def expect_error(
    code: grpc.StatusCode,
    words: str,
    fn: Callable[P, object],
    *args: P.args,
    **kwargs: P.kwargs,
) -> str:
    """fn(*args, **kwargs) fails with `code`, `words` in its details, which it returns."""
    with pytest.raises(grpc.RpcError) as info:
        fn(*args, **kwargs)
    details = info.value.details() or ""
    assert info.value.code() == code, details
    assert words in details, details
    return details


@pytest.fixture
def data(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    write_base(data, "100", 1, current=True)
    write_base(data, "200", 2)
    return data


def test_load_enable_undo_unload(data: Path) -> None:
    with running_server(data) as server, grpc.insecure_channel(server.address) as channel:
        status = control(server, "status")
        assert (status.cur_version, status.bg_version, status.status) == ("100", "", 0)
        loaded = control(server, "bg_load_base", version_path="/200")
        assert loaded.bg_version == "200" and loaded.cur_version == "100"
        assert tags_of(seek(channel, KEYS[:50])) == {1}
        assert tags_of(seek(channel, KEYS[:50], version="200")) == {2}  # ask for the bg one
        enabled = control(server, "enable", version="200")
        assert (enabled.cur_version, enabled.bg_version) == ("200", "100")
        detail = json.loads(enabled.detail_json)
        assert detail["previous_version"] == "100" and detail["record_count"] == len(KEYS)
        response = seek(channel, KEYS[:50])
        assert response.version == "200" and tags_of(response) == {2}
        assert control(server, "enable", version="200").cur_version == "200"  # already current
        undone = control(server, "bg_switch")  # undo
        assert (undone.cur_version, undone.bg_version) == ("100", "200")
        assert tags_of(seek(channel, KEYS[:50])) == {1}
        expect_error(
            grpc.StatusCode.FAILED_PRECONDITION, "'300'", control, server, "enable", version="300"
        )
        unloaded = control(server, "bg_unload")
        assert unloaded.bg_version == "" and unloaded.cur_version == "100"
        expect_error(
            grpc.StatusCode.FAILED_PRECONDITION, "'200'", seek, channel, [1], version="200"
        )
        expect_error(
            grpc.StatusCode.FAILED_PRECONDITION, "no background", control, server, "bg_switch"
        )
        reloaded = control(server, "reload_base", version_path="200")
        assert (reloaded.cur_version, reloaded.bg_version) == ("200", "")
        detail = json.loads(control(server, "status").detail_json)
        assert detail["requests"]["requests"] == 4 and detail["ports"] == [server.port]
        assert (data / "VERSION").read_text().strip() == "100"  # the agent owns VERSION


def test_patch_layers_over_current_and_records_chain(data: Path) -> None:
    changed = KEYS[:10]
    write_version(data, "100_150", changed, fixed_values(changed, WIDTH, 5), deleted=KEYS[10:20])
    write_version(data, "200_250", changed, fixed_values(changed, WIDTH, 6))
    with running_server(data) as server, grpc.insecure_channel(server.address) as channel:
        expect_error(
            grpc.StatusCode.FAILED_PRECONDITION,
            "base '200'",
            control,
            server,
            "bg_load_patch",
            version_path="/200_250",
        )
        control(server, "bg_load_patch", version_path="/100_150")
        assert (data / "100_150" / "CHAIN").read_text().split() == ["100", "100_150"]
        control(server, "enable", version="100_150")
        response = seek(channel, KEYS[:30])
        found = np.frombuffer(response.found, np.uint8)
        assert found.tolist() == [1] * 10 + [0] * 10 + [1] * 10
        rows = fixed_rows(response)
        assert (rows[:10] == expected_fixed(changed, WIDTH, 5)).all()
        assert (rows[20:] == expected_fixed(KEYS[20:30], WIDTH, 1)).all()
        status = json.loads(control(server, "status").detail_json)
        assert status["current"]["chain"] == ["100", "100_150"]
        expect_error(
            grpc.StatusCode.NOT_FOUND,
            "does not exist",
            control,
            server,
            "bg_load_base",
            version_path="/nope",
        )


def test_path_traversal_refused(data: Path) -> None:
    with running_server(data) as server:
        for path in ["/../data", "../x", "/etc/passwd", "a/b", "/", "..", "", str(data.parent)]:
            expect_error(
                grpc.StatusCode.INVALID_ARGUMENT,
                "version",
                control,
                server,
                "bg_load_base",
                version_path=path,
            )
        assert control(server, "status").bg_version == ""
        # an absolute path inside the data dir is that version
        assert control(server, "bg_load_base", version_path=str(data / "200")).bg_version == "200"


def test_corrupted_version_refused_old_keeps_serving(data: Path) -> None:
    bad = write_base(data, "300", 3)
    blob = bytearray((bad / "data.cube").read_bytes())
    blob[HEADER_SIZE + 100] ^= 0xFF
    (bad / "data.cube").write_bytes(bytes(blob))
    with running_server(data) as server, grpc.insecure_channel(server.address) as channel:
        details = expect_error(
            grpc.StatusCode.DATA_LOSS,
            "checksum",
            control,
            server,
            "bg_load_base",
            version_path="/300",
        )
        assert "300" in details
        status = control(server, "status")
        assert (status.cur_version, status.bg_version) == ("100", "")
        assert "checksum" in json.loads(status.detail_json)["last_error"]
        assert tags_of(seek(channel, KEYS)) == {1}


def test_concurrent_command_aborted(data: Path) -> None:
    with (
        running_server(data, "--load_delay", "1.5") as server,
        grpc.insecure_channel(server.address) as channel,
    ):
        errors: list[Exception] = []

        def load() -> None:
            try:
                control(server, "bg_load_base", version_path="/200")
            except Exception as exc:  # reported below
                errors.append(exc)

        loader = threading.Thread(target=load)
        loader.start()
        deadline = time.monotonic() + 10
        while control(server, "status").status != 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert control(server, "status").status == 1  # LOADING
        assert seek(channel, KEYS[:5]).version == "100"  # serving goes on
        expect_error(grpc.StatusCode.ABORTED, "in progress", control, server, "bg_switch")
        loader.join(timeout=30)
        assert not errors
        assert control(server, "status").bg_version == "200"
        # a caller that gives up does not cancel the command: it completes, status shows it
        with grpc.insecure_channel(server.control_address) as control_channel:
            stub = control_stub(control_channel)
            request = cube_pb2.ControlRequest(cmd="bg_load_base", version_path="/100")
            expect_error(grpc.StatusCode.DEADLINE_EXCEEDED, "", stub.cmd, request, timeout=0.3)
        deadline = time.monotonic() + 20
        while control(server, "status").bg_version != "100" and time.monotonic() < deadline:
            time.sleep(0.05)
        status = control(server, "status")
        assert (status.bg_version, status.status) == ("100", 0)


def test_restart_on_delta_rebuilds_chain(tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_base(data, "100", 1)
    first, second = KEYS[:5], KEYS[5:10]
    write_version(data, "100_200", first, fixed_values(first, WIDTH, 2))
    write_version(data, "100_300", second, fixed_values(second, WIDTH, 3), deleted=first[:2])
    write_version(data, "100_400", second, fixed_values(second, WIDTH, 4))  # after: not used
    (data / "VERSION").write_text("100_300\n")
    with running_server(data) as server, grpc.insecure_channel(server.address) as channel:
        response = seek(channel, KEYS[:12])
        assert response.version == "100_300"
        assert np.frombuffer(response.found, np.uint8).tolist() == [0, 0] + [1] * 10
        rows = fixed_rows(response)
        assert (rows[2:5] == expected_fixed(first[2:], WIDTH, 2)).all()
        assert (rows[5:10] == expected_fixed(second, WIDTH, 3)).all()
        assert (rows[10:] == expected_fixed(KEYS[10:12], WIDTH, 1)).all()
    # With a CHAIN that skips 100_200, the chain is the file's.
    (data / "100_300" / "CHAIN").write_text("100\n100_300\n")
    with running_server(data) as server, grpc.insecure_channel(server.address) as channel:
        response = seek(channel, KEYS[:5])
        assert np.frombuffer(response.found, np.uint8).tolist() == [0, 0, 1, 1, 1]
        assert (fixed_rows(response)[2:] == expected_fixed(first[2:], WIDTH, 1)).all()
        chain = json.loads(control(server, "status").detail_json)["current"]["chain"]
        assert chain == ["100", "100_300"]
    # A chain naming a missing link: a clear start-up error, the server starts empty.
    (data / "100_300" / "CHAIN").write_text("100\n100_250\n100_300\n")
    with running_server(data) as server, grpc.insecure_channel(server.address) as channel:
        status = control(server, "status")
        assert status.cur_version == ""
        assert "100_250" in json.loads(status.detail_json)["startup_error"]


def test_workers_share_versions(data: Path) -> None:
    with running_server(data, workers=2) as server:
        first, second = (grpc.insecure_channel(a) for a in server.addresses)
        try:
            for channel in (first, second):
                assert tags_of(seek(channel, KEYS[:20])) == {1}
            second_control = server.control_addresses[1]
            status = control(second_control, "bg_load_base", version_path="/200")  # to worker 0
            assert status.bg_version == "200"
            enabled = control(server.control_addresses[0], "enable", version="200")
            detail = json.loads(enabled.detail_json)
            assert detail["ports"] == server.ports and detail["workers"] == 2
            states = detail["worker_states"]
            assert [(w["worker"], w["cur_version"], w["bg_version"]) for w in states] == [
                (0, "200", "100"),
                (1, "200", "100"),
            ]
            for channel in (first, second):
                response = seek(channel, KEYS[:20])
                assert response.version == "200" and tags_of(response) == {2}
        finally:
            first.close()
            second.close()
        assert server.stop() == 0


def test_sigterm_drains_in_flight_stream(data: Path) -> None:
    server = start_server(data, "--grace", "20")
    try:
        with grpc.insecure_channel(server.address) as channel:
            outbox: queue.Queue[cube_fast_pb2.SeekRequest | None] = queue.Queue()

            def requests() -> Iterator[cube_fast_pb2.SeekRequest]:
                while True:
                    item = outbox.get(timeout=30)
                    if item is None:
                        return
                    yield item

            keys = np.asarray(KEYS[:10], "<u8").tobytes()
            stream = fast_stub(channel).SeekStream(requests(), timeout=60)
            outbox.put(cube_fast_pb2.SeekRequest(keys=keys, request_id=1))
            assert next(stream).request_id == 1
            server.signal()
            time.sleep(0.5)
            assert server.process.poll() is None  # still draining the open stream
            outbox.put(cube_fast_pb2.SeekRequest(keys=keys, request_id=2))
            reply = next(stream)
            assert reply.request_id == 2 and reply.found == b"\x01" * 10
            outbox.put(None)
            assert list(stream) == []
        assert server.process.wait(timeout=15) == 0
        assert "stopped" in server.log()
    finally:
        server.stop()


def test_switch_under_load_each_response_from_one_version(data: Path) -> None:
    with running_server(data) as server:
        control(server, "bg_load_base", version_path="/200")
        stop = threading.Event()
        seen: dict[str, int] = {}
        failures: list[str] = []

        def hammer() -> None:
            rng = np.random.default_rng(1)
            with grpc.insecure_channel(server.address) as own:
                for _ in range(5000):
                    if stop.is_set():
                        return
                    query = rng.choice(KEYS, 200)
                    try:
                        response = seek(own, query)
                    except grpc.RpcError as exc:
                        failures.append(f"{exc.code()}: {exc.details()}")
                        return
                    tags = tags_of(response)
                    expected = {"100": {1}, "200": {2}}[response.version]
                    if tags != expected:
                        failures.append(f"{response.version}: tags {tags}")
                    seen[response.version] = seen.get(response.version, 0) + 1

        threads = [threading.Thread(target=hammer) for _ in range(3)]
        for thread in threads:
            thread.start()
        try:
            for _ in range(10):
                control(server, "bg_switch")
                time.sleep(0.03)
            control(server, "bg_unload")
            control(server, "bg_load_base", version_path="/200")
            control(server, "enable", version="200")
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=30)
        assert not failures
        assert seen.get("100") and seen.get("200")


def test_reuseport_workers_stop_on_sigint(data: Path) -> None:
    shared, *own = free_ports(3)
    server = start_server(data, "--reuseport", workers=2, ports=[shared, *own])
    try:
        for address in server.addresses:
            with grpc.insecure_channel(address) as channel:
                assert tags_of(seek(channel, KEYS[:5])) == {1}
                detail = json.loads(control(server, "status").detail_json)
                assert detail["ports"] == own and detail["reuseport"] is True
        server.signal(signal.SIGINT)
        assert server.process.wait(timeout=30) == 0
    finally:
        server.stop()


def test_a_dead_worker_is_restarted_on_what_its_peers_serve(data: Path) -> None:
    """kill -9 of one worker of two: the other keeps serving, the dead one comes back on the
    version its peer serves (200, enabled after start; VERSION still says 100), and a crash
    loop beyond --worker_restarts stops the whole server with an error."""
    import psutil
    from grpc_health.v1 import health_pb2

    SERVING = health_pb2.HealthCheckResponse.SERVING
    with running_server(data, "--worker_restarts", "2", workers=2) as server:
        control(server, "reload_base", version_path="/200")
        supervisor = psutil.Process(server.pid)

        def worker(index: int) -> psutil.Process:
            flag = f"--worker_index={index}"
            return next(c for c in supervisor.children() if flag in c.cmdline())

        for round_ in range(2):
            victim = worker(1)
            victim.kill()
            victim.wait(10)
            with grpc.insecure_channel(server.addresses[0]) as channel:
                assert tags_of(seek(channel, KEYS[:20])) == {2}  # worker 0 serves on

            def back(dead: int = victim.pid) -> bool:
                """Worker 1 is back, and ready (its kernel loaded)."""
                ready = health_status(server.control_addresses[1]) == SERVING
                return ready and worker(1).pid != dead

            assert poll_until(back, 30, 0.1), (
                f"round {round_}: worker 1 not back\n{server.log()[-2000:]}"
            )
            with grpc.insecure_channel(server.addresses[1]) as channel:
                response = seek(channel, KEYS[:20])
            assert response.version == "200" and tags_of(response) == {2}
        worker(1).kill()  # a third death within a minute: more than --worker_restarts 2
        assert poll_until(lambda: server.process.poll() is not None, 30, 0.1)
        assert server.process.returncode == 1
        assert "more than --worker_restarts" in server.log()
