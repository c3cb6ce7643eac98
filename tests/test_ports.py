"""Ports are exclusive (issue 24): every listening socket of every command refuses to share
its port. A second process given a port another one holds exits at once, with an error naming
the port and the flag that chose it, and the first keeps answering there. gRPC servers set
SO_REUSEPORT unless told not to, which let a second cube-server on the same --control_port
listen beside the first (the kernel split the control calls between them)."""

from __future__ import annotations

import http.client
import re
import socket
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers.agent_helpers import AgentProc
from helpers.brpc_client import BrpcClient
from helpers.procs import start_server

from cube.processes import free_ports, health_status, poll_until, spawn, stop_child
from cube.transfer.local import command
from cube.wire import LANE_MAGIC, encode_seek_request

pytestmark = pytest.mark.slow  # real processes end to end: `make quick` skips them

WAIT = 60.0
SERVER = [sys.executable, "-m", "cube.server.main", "--in_mem", "false"]
AGENT = [sys.executable, "-m", "cube.agent.main"]
TRANSFER = [sys.executable, "-m", "cube.transfer.main"]


# ---------------------------------------------------------------------------------------------
# "still answering", per protocol


def grpc_answers(port: int) -> bool:
    return health_status(f"127.0.0.1:{port}", timeout=10) is not None


def lane_answers(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        request = encode_seek_request(np.array([1], dtype=np.uint64), request_id=1)
        sock.sendall(LANE_MAGIC + struct.pack("<I", len(request)) + request)
        return len(sock.recv(5)) > 0  # an answer frame (an error frame when nothing is loaded)


def http_answers(method: str, path: str) -> Callable[[int], bool]:
    def answers(port: int) -> bool:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            connection.request(method, path, body=b"{}" if method == "POST" else None)
            return connection.getresponse().status > 0  # any status: it answers
        finally:
            connection.close()

    return answers


def baidu_std_answers(port: int) -> bool:
    with BrpcClient(port) as client:
        reply = client.call("rec.mcube.DictService", "seek", b"")
    return reply.correlation_id > 0


# ---------------------------------------------------------------------------------------------
# the first of each command, holding its ports


def transfer_conf(root: Path, wget_port: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "donefile").mkdir(exist_ok=True)
    path = root / "transfer.conf"
    path.write_text(
        "\n".join(
            [
                "[default]",
                "dict_name: ports_dict",
                "mode: base_only",
                "download_mode: http",
                f"wget_port: {wget_port}",
                f"buildtool_local: {command('cube-builder')}",
                f"donefile_address: {root / 'donefile'}",
                f"output_address: {root / 'output'}",
                f"tmp_address: {root / 'tmp'}",
                "shard_num: 1",
                "copy_num: 1",
                "transfer_address: 127.0.0.1",
                "[cube_agent]",
                "agent0_0: 127.0.0.1:1",
                f"cube0_0: 127.0.0.1:2:{root / 'deploy'}",
            ]
        )
        + "\n"
    )
    return path


@pytest.fixture(scope="module")
def held(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, int]]:
    """A cube-server, a cube-agent and a cube-transfer, every port of each on port 0: what
    they bound, by case name."""
    root = tmp_path_factory.mktemp("holders")
    server = start_server(
        root / "data", "--metrics_port", "0", "--http_port", "0", "--baidu_std_port", "0"
    )
    agent = AgentProc(root / "agent", "127.0.0.1:1", "--metrics_port", "0")
    transfer = None
    try:
        report = server.written_ports()
        agent.start()
        log = root / "transfer.log"
        argv = [*TRANSFER, "-p", "0", "--metrics_port", "0", "--config"]
        transfer = spawn([*argv, str(transfer_conf(root / "transfer", 0))], log)
        pattern = r"API on http://127\.0\.0\.1:(\d+), files \(http\) on 127\.0\.0\.1:(\d+)"
        found: dict[str, re.Match[str] | None] = {}

        def logged() -> bool:
            text = log.read_text()
            found["api"] = re.search(pattern, text)
            found["metrics"] = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", text)
            return all(found.values())

        def alive() -> None:
            assert transfer is not None and transfer.poll() is None, log.read_text()[-3000:]

        assert poll_until(logged, WAIT, 0.05, check=alive), log.read_text()[-3000:]
        api, metrics = found["api"], found["metrics"]
        assert api is not None and metrics is not None
        yield {
            "server --port": report["ports"][0],
            "server --control_port": report["control_ports"][0],
            "server --tcp_ports": report["tcp_ports"][0],
            "server --metrics_port": report["metrics_port"],
            "server --http_port": report["http_ports"][0],
            "server --baidu_std_port": report["baidu_std_ports"][0],
            "agent -P": int(agent.url.rsplit(":", 1)[1]),
            "agent --metrics_port": int(agent.metrics_url.rsplit(":", 1)[1].split("/")[0]),
            "transfer -p": int(api.group(1)),
            "transfer wget_port": int(api.group(2)),
            "transfer --metrics_port": int(metrics.group(1)),
        }
    finally:
        if transfer is not None:
            stop_child(transfer, 15)
        agent.stop()
        server.stop()


def server_argv(root: Path, *flags: str) -> list[str]:
    return [*SERVER, "--data_dir", str(root / "data"), *flags]


def agent_argv(root: Path, *flags: str) -> list[str]:
    return [*AGENT, "--deploy_path", str(root / "deploy"), "--server", "127.0.0.1:1", *flags]


def transfer_argv(root: Path, *flags: str, wget_port: int = 0) -> list[str]:
    return [*TRANSFER, "--config", str(transfer_conf(root, wget_port)), *flags]


# case: (the second command on `port`, in `root`; the flag its error names; the first answers)
CASES: dict[str, tuple[Callable[[Path, int], list[str]], str, Callable[[int], bool]]] = {
    "server --port": (
        lambda root, port: server_argv(root, "--port", str(port)),
        "--port",
        grpc_answers,
    ),
    "server --control_port": (
        lambda root, port: server_argv(root, "--port", "0", "--control_port", str(port)),
        "--control_port",
        grpc_answers,
    ),
    "server --tcp_ports": (
        lambda root, port: server_argv(root, "--port", "0", "--tcp_ports", str(port)),
        "--tcp_ports",
        lane_answers,
    ),
    "server --metrics_port": (
        lambda root, port: server_argv(root, "--port", "0", "--metrics_port", str(port)),
        "--metrics_port",
        http_answers("GET", "/metrics"),
    ),
    "server --http_port": (
        lambda root, port: server_argv(root, "--port", "0", "--http_port", str(port)),
        "--http_port",
        http_answers("POST", "/DictService/seek"),
    ),
    "server --baidu_std_port": (
        lambda root, port: server_argv(root, "--port", "0", "--baidu_std_port", str(port)),
        "--baidu_std_port",
        baidu_std_answers,
    ),
    "agent -P": (
        lambda root, port: agent_argv(root, "-P", str(port)),
        "-P",
        http_answers("GET", "/agent/status"),
    ),
    "agent --metrics_port": (
        lambda root, port: agent_argv(root, "-P", "0", "--metrics_port", str(port)),
        "--metrics_port",
        http_answers("GET", "/metrics"),
    ),
    "transfer -p": (
        lambda root, port: transfer_argv(root, "-p", str(port)),
        "-p, the API",
        http_answers("GET", "/dict/info"),
    ),
    "transfer wget_port": (
        lambda root, port: transfer_argv(root, "-p", "0", wget_port=port),
        "wget_port, the http file server",
        http_answers("GET", "/"),
    ),
    "transfer --metrics_port": (
        lambda root, port: transfer_argv(root, "-p", "0", "--metrics_port", str(port)),
        "--metrics_port",
        http_answers("GET", "/metrics"),
    ),
}


def refused(argv: list[str], log: Path, port: int, flag: str) -> None:
    """`argv` exits non-zero at once, its error naming the port and `flag`."""
    second = spawn(argv, log)
    try:
        second.wait(timeout=WAIT)
    except subprocess.TimeoutExpired:
        raise AssertionError(
            f"still running after {WAIT:.0f} s beside the first on port {port}:\n"
            + log.read_text()[-3000:]
        ) from None
    finally:
        stop_child(second, 10)
    text = log.read_text()
    assert second.returncode not in (0, None), text[-3000:]
    assert f"127.0.0.1:{port} ({flag}" in text and "port in use" in text, text[-3000:]


@pytest.mark.parametrize("case", [*CASES, "server --reuseport"])
def test_a_second_command_on_a_port_in_use_is_refused(
    case: str, held: dict[str, int], tmp_path: Path
) -> None:
    if case == "server --reuseport":
        return check_reuseport_is_for_one_server(tmp_path)
    second, flag, answers = CASES[case]
    port = held[case]
    refused(second(tmp_path, port), tmp_path / "second.log", port, flag)
    assert answers(port), f"the first no longer answers on port {port}"


def check_reuseport_is_for_one_server(tmp_path: Path) -> None:
    """--reuseport shares --port among the workers of one server, not with a second server
    started with --reuseport on the same port (both set SO_REUSEPORT there, which the kernel
    allows between processes of one user: the server checks the port is free first)."""
    shared, own = free_ports(2)  # one worker: its own port is --port + 1
    control, second_own, second_control = free_ports(3, avoid=[shared, own])
    first = start_server(tmp_path / "first", "--reuseport", ports=[shared], control_ports=[control])
    try:
        assert grpc_answers(shared) and grpc_answers(own)
        argv = server_argv(
            tmp_path, "--reuseport", "--port", str(shared), "--worker_ports", str(second_own),
            "--control_port", str(second_control),
        )  # fmt: skip
        refused(argv, tmp_path / "second.log", shared, "--port, shared by --reuseport")
        assert grpc_answers(shared)
    finally:
        first.stop()


@pytest.mark.parametrize("flag", ["--port", "--control_port"])
def test_cube_server_on_a_port_in_use_says_so_in_one_line_of_its_own(
    flag: str, tmp_path: Path
) -> None:
    """gRPC's C core logs its own failure to stderr when it cannot bind ("E... add_port.cc:83]
    Failed to add port to server: ... Address already in use"), which came before the server's
    message: the port is probed first, so the server's line is the only one."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ports = ["--port", str(port)]
        if flag == "--control_port":
            ports = ["--port", "0", "--control_port", str(port)]
        done = subprocess.run(
            [command("cube-server"), "--data_dir", str(tmp_path / "data"), *ports],
            capture_output=True,
            text=True,
            timeout=WAIT,
        )
    assert done.returncode == 1 and done.stdout == "", done.stderr
    message = f"cannot listen on 127.0.0.1:{port} ({flag}): port in use"
    lines = done.stderr.splitlines()
    pattern = r"\S+ \S+ ERROR cube\.server \[server pid \d+\]: " + re.escape(message)
    assert len(lines) == 1 and re.fullmatch(pattern, lines[0]), done.stderr
