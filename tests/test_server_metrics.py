"""cube-server's Prometheus endpoint on real processes: the counts match the requests sent on
every API (TCP lane, gRPC Seek, the original DictService), misses and errors are counted
apart, the versions match what is served, and one endpoint covers every worker."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import grpc
import numpy as np
import pytest
from helpers.procs import ServerProc, fixed_values, running_server, scrape, write_version
from helpers.stubs import raw_unary

from cube.client import CubeClient
from cube.pb import cube_pb2
from cube.processes import free_port, poll_until

pytestmark = pytest.mark.slow  # real processes end to end: `make quick` skips them

KEYS = np.arange(1, 2001, dtype=np.uint64)
WIDTH = 16
VERSION = "1700000000"
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]  # helpers.procs.scrape's


def scrape_port(port: int) -> Samples:
    return scrape(f"http://127.0.0.1:{port}/metrics")


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def metrics_port(server: ServerProc) -> int:
    return int(server.written_ports()["metrics_port"])


@pytest.fixture
def data(tmp_path: Path) -> Path:
    write_version(tmp_path / "data", VERSION, KEYS, fixed_values(KEYS, WIDTH), current=True)
    return tmp_path / "data"


def test_counts_match_the_requests_sent_on_each_api(data: Path) -> None:
    with running_server(data, "--metrics_port", "0") as server:
        port = metrics_port(server)
        before = scrape_port(port)
        assert value(before, "cube_server_worker_up", worker="0") == 1
        assert value(before, "cube_server_version_info", worker="0", slot="current",
                     version=VERSION) == 1  # fmt: skip
        assert value(before, "cube_server_serving", worker="0") == 1
        mapped = value(before, "cube_server_version_mapped_bytes", worker="0", slot="current")
        assert mapped >= len(KEYS) * (WIDTH + 8)  # the values and at least the index keys
        locked = value(before, "cube_server_version_locked_bytes", worker="0", slot="current")
        assert 0 <= locked <= mapped  # --in_mem locks it, as far as RLIMIT_MEMLOCK allows
        asked = np.concatenate([KEYS[:150], np.arange(10**6, 10**6 + 50, dtype=np.uint64)])
        with CubeClient(shards=[[server.address]]) as lane:  # the TCP lane by default
            for _ in range(7):
                lane.seek(asked)
        with CubeClient(shards=[[server.address]], transport="grpc") as unary:
            for _ in range(3):
                unary.seek(asked)
        with grpc.insecure_channel(server.address) as channel:
            original = raw_unary(channel, "/rec.mcube.DictService/seek")
            request = cube_pb2.DictRequest(keys=[int(k) for k in asked[:100]])
            for _ in range(2):
                original(request.SerializeToString(), timeout=10)
            with pytest.raises(grpc.RpcError) as refused:  # keys of 7 bytes: INVALID_ARGUMENT
                raw_unary(channel, "/cube.v1.CubeService/Seek")(_bad_seek(), timeout=10)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        after = scrape_port(port)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    # the SDK's first contact (discovery) is an empty Seek: answered, with no keys
    assert delta("cube_server_requests_total", worker="0", api="lane") == 7
    assert delta("cube_server_keys_total", worker="0", api="lane", outcome="hit") == 7 * 150
    assert delta("cube_server_keys_total", worker="0", api="lane", outcome="miss") == 7 * 50
    grpc_requests = delta("cube_server_requests_total", worker="0", api="seek")
    assert grpc_requests >= 3  # plus the discovery calls of both clients
    assert delta("cube_server_keys_total", worker="0", api="seek", outcome="hit") == 3 * 150
    assert delta("cube_server_keys_total", worker="0", api="seek", outcome="miss") == 3 * 50
    assert delta("cube_server_requests_total", worker="0", api="original") == 2
    assert delta("cube_server_keys_total", worker="0", api="original", outcome="hit") == 200
    errors = delta(
        "cube_server_request_errors_total", worker="0", api="seek", code="INVALID_ARGUMENT"
    )
    assert errors == 1
    for api, count in (("lane", 7), ("seek", grpc_requests), ("original", 2)):
        assert delta("cube_server_request_duration_seconds_count", worker="0", api=api) == count
        assert delta("cube_server_request_keys_count", worker="0", api=api) == count
    # 200 keys a request: in the (100, 500] bucket of the batch histogram
    in_bucket = delta("cube_server_request_keys_bucket", worker="0", api="lane", le="500.0")
    below = delta("cube_server_request_keys_bucket", worker="0", api="lane", le="100.0")
    assert in_bucket - below == 7


def _bad_seek() -> bytes:
    from cube.pb import cube_fast_pb2

    return cube_fast_pb2.SeekRequest(keys=b"1234567", request_id=9).SerializeToString()


def test_the_port_file_has_no_metrics_port_while_metrics_are_off(data: Path) -> None:
    """metrics_port is null with metrics off (a 0 would read as "any free port")."""
    with running_server(data) as server:
        report = server.written_ports()
        assert report["metrics_port"] is None and report["ports"][0] > 0


def test_one_endpoint_covers_every_worker(data: Path) -> None:
    port = free_port()
    with running_server(data, "--metrics_port", str(port), workers=2) as server:
        with CubeClient(shards=[[f"127.0.0.1:{server.ports[1]}"]]) as client:  # worker 1 only
            for _ in range(4):
                client.seek(KEYS[:10])
        samples = scrape_port(port)
    assert value(samples, "cube_server_worker_up", worker="0") == 1
    assert value(samples, "cube_server_worker_up", worker="1") == 1
    assert value(samples, "cube_server_requests_total", worker="1", api="lane") == 4
    assert value(samples, "cube_server_requests_total", worker="0", api="lane") == 0
    for worker in ("0", "1"):
        assert value(samples, "cube_server_version_info", worker=worker, slot="current",
                     version=VERSION) == 1  # fmt: skip


def test_metrics_port_in_use_is_refused_at_once(data: Path, tmp_path: Path) -> None:
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "cube.server.main", "--data_dir", str(data), "--port", "0",
             "--metrics_port", str(port)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert done.returncode == 1
    assert f"127.0.0.1:{port} (--metrics_port): port in use" in done.stderr, done.stderr


def test_idle_connections_to_the_metrics_port_hold_no_threads(data: Path) -> None:
    """Issue 24: prometheus_client's server started a thread a connection (500 idle
    connections made 515 threads). The endpoint now serves from the event loop with one
    thread of its own, keeps at most a few connections (the one idle longest makes room),
    and a scrape still gets through 500 idle connections."""
    import socket

    import psutil

    with running_server(data, "--metrics_port", "0") as server:
        port = metrics_port(server)
        assert value(scrape_port(port), "cube_server_worker_up", worker="0") == 1
        threads = psutil.Process(server.pid).num_threads()
        idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(500)]
        try:
            half = idle[-1]
            half.sendall(b"GET /metrics HTTP/1.1\r\n")  # and then nothing
            samples = scrape_port(port)
            assert value(samples, "cube_server_worker_up", worker="0") == 1
            grown = psutil.Process(server.pid).num_threads() - threads
            assert grown <= 2, f"{grown} more threads with 500 idle connections"
            assert idle[0].recv(1) == b""  # the idle ones made room
        finally:
            for sock in idle:
                sock.close()


@pytest.mark.parametrize("transport", ["auto", "grpc"])
def test_a_refusal_names_the_request_id_in_the_error_and_the_server_log(
    data: Path, transport: Literal["auto", "grpc"]
) -> None:
    """The SDK sends each call's request id with its sub-requests and puts it on the error it
    raises; the server logs the refusal with the same id (rate-limited)."""
    from cube.client import RequestRejectedError

    with running_server(data, "--max_answer_bytes", str(WIDTH * 10)) as server:
        with (
            CubeClient(shards=[[server.address]], transport=transport) as client,
            pytest.raises(RequestRejectedError) as refused,
        ):
            client.seek(KEYS[:50])  # more value bytes than the server's --max_answer_bytes
        request_id = refused.value.request_id
        assert request_id and f"request id {request_id}" in "".join(refused.value.__notes__)
        assert poll_until(
            lambda: f"request_id={request_id}" in server.log_path.read_text(), 10, 0.05
        ), server.log_path.read_text()[-2000:]
        assert "refused (" in server.log_path.read_text()
