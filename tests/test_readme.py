"""The README's quick tour, run as a user would (in a scratch directory, with the virtualenv's
commands on PATH): build, unpack, serve, look up, stop the servers as it says. The servers'
fixed ports are swapped for `--port 0 --port_file` so that the tour runs beside anything else
on the machine."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from grpc_health.v1 import health_pb2

from cube.processes import health_status, poll_until

pytestmark = pytest.mark.slow  # real processes end to end: `make quick` skips them

REPO = Path(__file__).resolve().parent.parent
SERVING = health_pb2.HealthCheckResponse.SERVING


def tour_blocks() -> list[tuple[str, str]]:
    """(language, code) of each fenced block of the README's "Quick tour" section."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Quick tour", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(\w+)\n(.*?)```", section, re.DOTALL)


def test_the_quick_tour_runs(tmp_path: Path) -> None:
    setup, build, serve, lookup, stop, paddle, transfer_conf = tour_blocks()
    install, scratch = setup[1].strip().splitlines()
    assert install == "make install && . .venv/bin/activate"
    assert scratch.startswith("export CUBE_REPO=$PWD && cd ")  # the tour runs in a scratch dir
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env["CUBE_REPO"] = str(REPO)
    built = subprocess.run(
        ["bash", "-euc", build[1]], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    # the servers as the tour starts them, in the background with their PIDs in servers.pid;
    # port 0 and a port file each instead of the fixed ports
    addresses = {}
    script = serve[1]
    for port in re.findall(r"cube-server --port (\d+) ", script):
        script = script.replace(f"--port {port} ", f"--port 0 --port_file {port}.json ")
        addresses[f"127.0.0.1:{port}"] = tmp_path / f"{port}.json"
    assert len(addresses) == 2 and script.count("echo $! >> servers.pid") == 2, script
    pids: list[int] = []
    bound_to: dict[str, str] = {}  # the tour's address -> the one its server bound
    try:
        with open(tmp_path / "servers.log", "wb") as log:  # not a pipe: the servers keep it
            started = subprocess.run(
                ["bash", "-euc", script], cwd=tmp_path, env=env, stdout=log, stderr=log,
                timeout=60, start_new_session=True,
            )  # fmt: skip
        pids = [int(line) for line in (tmp_path / "servers.pid").read_text().split()]
        assert started.returncode == 0 and len(pids) == 2, (tmp_path / "servers.log").read_text()
        for wanted, port_file in addresses.items():
            assert poll_until(port_file.exists, 60, 0.05), (tmp_path / "servers.log").read_text()
            bound = f"127.0.0.1:{json.loads(port_file.read_text())['ports'][0]}"
            serving = lambda address=bound: health_status(address) == SERVING  # noqa: E731
            assert poll_until(serving, 60, 0.05), bound
            bound_to[wanted] = bound
        code = lookup[1]
        for wanted, bound in bound_to.items():
            code = code.replace(wanted, bound)
        exec(compile(code, "README.md quick tour", "exec"), {})  # its asserts check the answers
        # the tour's way to stop them: every server exits, servers.pid is gone
        stopped = subprocess.run(
            ["bash", "-euc", stop[1]], cwd=tmp_path, env=env, capture_output=True, text=True,
            timeout=30,
        )  # fmt: skip
        assert stopped.returncode == 0, stopped.stderr
        assert poll_until(lambda: not any(psutil.pid_exists(p) for p in pids), 30, 0.1)
        assert not (tmp_path / "servers.pid").exists()
    finally:
        pid_file = tmp_path / "servers.pid"
        if not pids and pid_file.exists():  # the start failed after one server was up
            pids = [int(n) for n in pid_file.read_text().split()]
        for pid in pids:  # only if the tour's way failed: ours, by PID
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()
    # From PaddleRec: the checkout's test saves, through $CUBE_REPO
    built = subprocess.run(
        ["bash", "-euc", paddle[1]], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    for shard in (0, 1):
        assert (tmp_path / "ps-output" / "1700000100_1700000100" / f"ctr_part{shard}.tar").is_file()
    # its transfer.conf lines are keys cube-transfer takes
    from cube.transfer.config import parse_config

    conf = "[default]\ndict_name: ctr\nwget_port: 0\noutput_address: o\ntmp_address: t\n"
    conf += "shard_num: 1\n" + transfer_conf[1]
    conf += "[cube_agent]\nagent0_0: 127.0.0.1:1\ncube0_0: 127.0.0.1:2:/d\n"
    cfg = parse_config(conf, "README.md", tmp_path)
    assert cfg.donefile_format.base_file == "base_donefile.txt" and cfg.paddle_saves
