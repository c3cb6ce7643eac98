"""The original's local mode, as its docs run it: cube-builder with versions 0, the shard's
files copied into ./data (no VERSION), cube-server started in a directory holding the
original's conf/gflags.conf with brpc flags on the command line, and the original agent's
-l / -n / -q / --log_dir / --log_name."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cube.client import CubeClient
from cube.flags import FlagError, FlagSet
from cube.processes import poll_until, spawn, stop_child
from cube.seqfile import SequenceFileWriter
from cube.values import ValueColumn

# Every test here starts processes (servers, CLIs): make quick skips them.
pytestmark = pytest.mark.slow

# The original cube-server's conf/gflags.conf, as shipped, plus a port file for the test.
ORIGINAL_GFLAGS = "--port=8000\n--dict_split=1\n--in_mem=true\n--log_dir=./log/\n"


def tool(
    name: str, *args: str, cwd: Path, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", name, *args], cwd=cwd, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def test_ignored_flags_warn_and_take_their_values(capsys: pytest.CaptureFixture[str]) -> None:
    flags = (
        FlagSet("t")
        .add("port", int, 0)
        .ignore(["bvar_dump"], False, "not used")
        .ignore(["idle_timeout_second"], True, "not used")
        .parse(["--bvar_dump", "--idle_timeout_second", "10", "--port", "5"])
    )
    assert flags.port == 5
    assert capsys.readouterr().err.count("ignored: not used") == 2
    with pytest.raises(FlagError, match="unknown flag '--bvar_dumpp'"):
        FlagSet("t").ignore(["bvar_dump"], False, "x").parse(["--bvar_dumpp"])


def test_the_default_flagfile_is_read_first_and_the_command_line_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    fs = FlagSet("t", default_flagfile="conf/gflags.conf").add("port", int, 0).add("x", int, 1)
    assert fs.parse([]).port == 0  # no file: defaults
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "gflags.conf").write_text("--port=8000\n--x=2\n")
    assert (fs.parse([]).port, fs.parse([]).x) == (8000, 2)
    assert fs.parse(["--port", "9"]).port == 9


def test_build_and_serve_as_the_original_docs_do(tmp_path: Path) -> None:
    """cube-builder -cur_version=0 -depend_version=0 makes version 0; its shard files copied
    into ./data are served as version 0 by a cube-server that reads conf/gflags.conf and
    ignores --bvar_dump."""
    keys = np.arange(1, 301, dtype=np.uint64)
    values = [b"v%d" % k for k in keys.tolist()]
    (tmp_path / "input").mkdir()
    with SequenceFileWriter(tmp_path / "input" / "part-00000") as writer:
        writer.write_batch(keys, ValueColumn.from_list(values))
    built = tool(
        "cube.builder.cli", "-dict_name=test_dict", "-job_mode=base", "-last_version=0",
        "-cur_version=0", "-depend_version=0", "-input_path=./input", "-output_path=./output",
        "-shard_num=1", "-only_build=false", cwd=tmp_path,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    version_dir = tmp_path / "output" / "0_0"
    assert json.loads((tmp_path / "output/meta_info/0_0_0_0.json").read_text())["version"] == "0"
    unset = tool("cube.builder.cli", "-dict_name=d", "-input_path=./input", "-output_path=./o",
                 "-shard_num=1", "-only_build=false", cwd=tmp_path)  # fmt: skip
    assert unset.returncode == 2 and "--cur_version is required" in unset.stderr

    cube = tmp_path / "cube"
    (cube / "conf").mkdir(parents=True)
    (cube / "conf" / "gflags.conf").write_text(
        ORIGINAL_GFLAGS.replace("8000", "0") + "--port_file=./ports.json\n--control_port=0\n"
    )
    shutil.copytree(version_dir / "test_dict_part0", cube / "data")
    argv = [sys.executable, "-m", "cube.server.main", "--bvar_dump", "--in_mem=false"]
    server = spawn(argv, tmp_path / "server.log", cwd=cube)
    try:
        ports = cube / "ports.json"
        assert poll_until(ports.exists, 60, 0.1, check=lambda: _alive(server, tmp_path))
        port = json.loads(ports.read_text())["ports"][0]
        with CubeClient(shards=[[f"127.0.0.1:{port}"]]) as client:
            result = client.seek([1, 300, 301])
        assert result.version == "0" and result.found.tolist() == [True, True, False]
        assert result.values[:2] == [b"v1", b"v300"]
    finally:
        stop_child(server, 10)
    log = (tmp_path / "server.log").read_text()
    assert "--bvar_dump ignored" in log and "directly as version 0" in log
    assert (cube / "log" / "cube-server.log").exists()  # --log_dir=./log/ from gflags.conf


def _alive(process: subprocess.Popen[bytes], tmp_path: Path) -> None:
    if process.poll() is not None:
        raise AssertionError((tmp_path / "server.log").read_text()[-2000:])


def test_a_delta_alone_in_data_is_not_served(tmp_path: Path) -> None:
    """The files of a delta copied into ./data would answer misses for every key of its base:
    the server says NOT_SERVING with the reason instead."""
    from grpc_health.v1 import health_pb2
    from helpers.procs import start_server
    from test_builder import build_args, run_builder, write_seqfile

    from cube.processes import health_status

    write_seqfile(tmp_path / "in" / "part-0", [1, 2], [b"a", b"b"])
    base = run_builder(*build_args(tmp_path / "in", tmp_path / "out", 1))
    delta_flags = {"job_mode": "delta", "cur_version": 1_700_000_100,
                   "depend_version": 1_700_000_000}  # fmt: skip
    delta = run_builder(*build_args(tmp_path / "in", tmp_path / "out", 1, **delta_flags))
    assert base.returncode == delta.returncode == 0, delta.stderr
    shutil.copytree(tmp_path / "out" / "1700000000_1700000100" / "dict_part0", tmp_path / "data")
    server = start_server(tmp_path / "data")
    try:
        assert health_status(server.address) == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        server.stop()
    assert "needs its base" in server.log_path.read_text()


def test_the_original_agents_flags_start_it(tmp_path: Path) -> None:
    args = ["-P", "0", "-l", "2", "-n", "10", "-q", "20", "--log_dir=./log",
            "--log_name=m_agent", "--deploy_path", str(tmp_path / "deploy")]  # fmt: skip
    agent = spawn([sys.executable, "-m", "cube.agent.main", *args], tmp_path / "agent.out",
                  cwd=tmp_path)  # fmt: skip
    try:
        assert poll_until(
            lambda: "listening on" in (tmp_path / "agent.out").read_text(), 30, 0.1,
            check=lambda: _alive(agent, tmp_path),
        )  # fmt: skip
    finally:
        stop_child(agent, 10)
    assert (tmp_path / "log" / "m_agent.log").exists()
    assert "-n ignored" in (tmp_path / "agent.out").read_text()
    bad = tool("cube.agent.main", "-P", "0", "-l", "7", "--deploy_path", "x", cwd=tmp_path)
    assert bad.returncode == 2 and "16, 8, 4, 2, 1, 0" in bad.stderr
