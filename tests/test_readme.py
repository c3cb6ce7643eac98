"""The README's quick tour, run as a user would (in a fresh directory, with the virtualenv's
commands on PATH): build, unpack, serve, look up. The servers' fixed ports are swapped for
`--port 0 --port_file` so that the tour runs beside anything else on the machine."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

from cube.processes import health_status, poll_until, spawn, stop_child

pytestmark = pytest.mark.slow  # real processes end to end: `make quick` skips them

REPO = Path(__file__).resolve().parent.parent
SERVING = health_pb2.HealthCheckResponse.SERVING


def tour_blocks() -> list[tuple[str, str]]:
    """(language, code) of each fenced block of the README's "Quick tour" section."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Quick tour", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(\w+)\n(.*?)```", section, re.DOTALL)


def test_the_quick_tour_runs(tmp_path: Path) -> None:
    setup, build, serve, lookup, paddle, transfer_conf = tour_blocks()
    assert setup[1].strip() == "make install && . .venv/bin/activate"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    built = subprocess.run(
        ["bash", "-euc", build[1]], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    servers, addresses = [], {}
    try:
        for line in serve[1].splitlines():
            shape = re.fullmatch(r"cube-server --port (\d+) --data_dir (\S+) &", line)
            assert shape, line
            port, data_dir = shape.groups()
            port_file = tmp_path / f"{port}.json"
            server = str(Path(sys.executable).parent / "cube-server")
            argv = [server, "--port", "0", "--port_file", str(port_file), "--data_dir", data_dir]
            servers.append(spawn(argv, tmp_path / f"{port}.log", cwd=tmp_path))
            log = tmp_path / f"{port}.log"
            assert poll_until(port_file.exists, 60, 0.05), log.read_text()
            bound = f"127.0.0.1:{json.loads(port_file.read_text())['ports'][0]}"
            serving = lambda address=bound: health_status(address) == SERVING  # noqa: E731
            assert poll_until(serving, 60, 0.05), log.read_text()
            addresses[f"127.0.0.1:{port}"] = bound
        code = lookup[1]
        for wanted, bound in addresses.items():
            code = code.replace(wanted, bound)
        exec(compile(code, "README.md quick tour", "exec"), {})  # its asserts check the answers
    finally:
        for process in servers:
            stop_child(process, 15)
    # From PaddleRec: run from the repository's root (its test saves are under tests/)
    (tmp_path / "tests").symlink_to(REPO / "tests")
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
