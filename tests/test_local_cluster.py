"""cube-local as users run it: up / status / wait / restart / down on real processes, configs that
the transfer and the SDK accept, and stopping exactly the recorded processes."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from helpers.procs import kill_processes_under, processes_under
from helpers.transfer_helpers import write_table

from cube.client import load_conf
from cube.processes import free_ports
from cube.transfer.config import load_config
from cube.transfer.local import Proc, command, http_json, stop

pytestmark = pytest.mark.slow  # real processes end to end: `make quick` skips them

CLI = [sys.executable, "-m", "cube.transfer.local"]
TOKEN_VARS = ("CUBE_TOKEN", "CUBE_API_TOKEN")


def publish_base(tmp_path: Path, donefile: Path, cluster_dir: Path) -> str:
    """A new base of 100 records in base.txt, waited for with `cube-local wait`."""
    version = str(int(time.time()))
    inputs = write_table(tmp_path / "input" / version, 100)
    with open(donefile / "base.txt", "a") as f:
        f.write(json.dumps({"id": version, "key": version, "input": str(inputs)}) + "\n")
    waited = cube_local("wait", "--version", version, "--timeout", "60", "--dir", str(cluster_dir))
    assert waited.returncode == 0, waited.stderr
    return version


def cube_local(
    *args: str, timeout: float = 90.0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """The CLI, with no token in its environment unless `env` adds one."""
    clean = {k: v for k, v in os.environ.items() if k not in TOKEN_VARS}
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=timeout, check=False,
        env={**clean, **(env or {})},
    )  # fmt: skip


@pytest.fixture
def cluster_dir(tmp_path: Path) -> Iterator[Path]:
    directory = tmp_path / "cluster"
    yield directory
    # whatever a failing test left behind: stop it by the PIDs it recorded
    with contextlib.suppress(FileNotFoundError, ValueError, KeyError):
        data = json.loads((directory / "cluster.json").read_text())
        stop([Proc(**p) for p in data["processes"]], timeout=5)
    kill_processes_under(directory)


def test_up_status_wait_restart_down(tmp_path: Path, cluster_dir: Path) -> None:
    donefile = tmp_path / "donefile"
    result = cube_local(
        "up", "--shards", "1", "--replicas", "2", "--donefile", str(donefile),
        "--dir", str(cluster_dir), "--dim", "4", "--poll_interval", "0.2", "--create_donefile_dir",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr + result.stdout
    assert donefile.is_dir()  # created: asked for
    assert "cluster up in" in result.stdout and "INSTANCE" in result.stdout
    data = json.loads((cluster_dir / "cluster.json").read_text())
    procs = {p["name"]: Proc(**p) for p in data["processes"]}
    assert set(procs) == {"server0_0", "server0_1", "agent0_0", "agent0_1", "transfer"}
    assert all(p.process() is not None for p in procs.values())

    cfg = load_config(cluster_dir / "transfer.conf")
    assert cfg.shard_num == 1 and cfg.copy_num == 2 and cfg.quorum == 2
    assert cfg.donefile_address == str(donefile.resolve())
    conf = load_conf(cluster_dir / "cube.conf")
    assert conf.type == "ipport_list" and len(conf.shards[0]) == 2
    for inst in cfg.instances:  # the server's data_dir is its agent's deploy_path/data
        server = procs[f"server{inst.name}"]
        assert server.argv[server.argv.index("--data_dir") + 1] == f"{inst.deploy_path}/data"
        assert f"127.0.0.1:{server.port}" in conf.shards[0]
        agent = procs[f"agent{inst.name}"]
        assert agent.argv[agent.argv.index("--deploy_path") + 1] == inst.deploy_path

    again = cube_local("up", "--donefile", str(donefile), "--dir", str(cluster_dir))
    assert again.returncode == 1 and "already running" in again.stderr

    version = publish_base(tmp_path, donefile, cluster_dir)
    status = cube_local("status", "--dir", str(cluster_dir))
    assert status.returncode == 0
    lines = status.stdout.splitlines()
    assert f"live version {version}" in lines[0]
    rows = [line for line in lines if line.startswith("0_")]
    assert len(rows) == 2 and all(version in row and "Enable_Succ" in row for row in rows)
    as_json = json.loads(cube_local("status", "--json", "--dir", str(cluster_dir)).stdout)
    assert [r["version"] for r in as_json["instances"]] == [version, version]
    missing = cube_local("wait", "--version", "1", "--timeout", "1", "--dir", str(cluster_dir))
    assert missing.returncode == 1 and "not served everywhere within 1s" in missing.stderr

    restarted = cube_local("restart", "--name", "agent0_1", "--dir", str(cluster_dir))
    assert restarted.returncode == 0, restarted.stderr
    new_agent = Proc(
        **next(
            p
            for p in json.loads((cluster_dir / "cluster.json").read_text())["processes"]
            if p["name"] == "agent0_1"
        )
    )
    assert new_agent.pid != procs["agent0_1"].pid and new_agent.process() is not None
    assert procs["agent0_1"].process() is None

    # a recorded PID whose start time does not match is not ours any more: down leaves it alone
    data = json.loads((cluster_dir / "cluster.json").read_text())
    for p in data["processes"]:
        if p["name"] == "server0_1":
            p["create_time"] -= 1000
    (cluster_dir / "cluster.json").write_text(json.dumps(data))
    down = cube_local("down", "--dir", str(cluster_dir))
    assert down.returncode == 0, down.stderr
    assert "server0_1: not running" in down.stdout
    assert "transfer: stopped" in down.stdout
    foreign = procs["server0_1"]
    foreign_process = foreign.process()
    assert foreign_process is not None  # untouched
    for name, proc in procs.items():
        if name not in ("server0_1", "agent0_1"):
            assert proc.process() is None, name
    assert new_agent.process() is None
    assert not (cluster_dir / "cluster.json").exists()
    foreign_process.terminate()
    gone = cube_local("status", "--dir", str(cluster_dir))
    assert gone.returncode == 1 and "no cluster" in gone.stderr


def test_up_with_metrics_gives_every_process_an_endpoint(tmp_path: Path, cluster_dir: Path) -> None:
    """`up --metrics`: each process's /metrics on a port of its own, recorded in cluster.json
    (kept by a restart) and listed by status, serving its command's families."""
    from helpers.procs import scrape

    result = cube_local(
        "up", "--shards", "1", "--replicas", "1", "--donefile", str(tmp_path / "donefile"),
        "--create_donefile_dir", "--dir", str(cluster_dir), "--metrics",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr + result.stdout
    procs = {
        p["name"]: Proc(**p)
        for p in json.loads((cluster_dir / "cluster.json").read_text())["processes"]
    }
    ports = {name: proc.metrics_port for name, proc in procs.items()}
    assert len(set(ports.values())) == 3 and 0 not in ports.values()
    assert f"agent0_0 {ports['agent0_0']}" in result.stdout  # the status table's metrics line
    for name, proc in procs.items():
        assert proc.argv[proc.argv.index("--metrics_port") + 1] == str(proc.metrics_port)
        samples = scrape(f"http://127.0.0.1:{proc.metrics_port}/metrics")
        prefix = {"server": "cube_server_", "agent": "cube_agent_", "transfer": "cube_transfer_"}
        assert any(n.startswith(prefix[proc.role]) for n, _ in samples), name
    restarted = cube_local("restart", "--name", "agent0_0", "--dir", str(cluster_dir))
    assert restarted.returncode == 0, restarted.stderr
    assert scrape(f"http://127.0.0.1:{ports['agent0_0']}/metrics")
    assert cube_local("down", "--dir", str(cluster_dir)).returncode == 0


def test_up_fails_cleanly_when_a_process_cannot_start(tmp_path: Path, cluster_dir: Path) -> None:
    base_port = free_ports(16)[0]  # the cluster's ports are free but for the first one
    (tmp_path / "d").mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", base_port))
        taken.listen()  # the transfer's API port is in use
        result = cube_local(
            "up", "--shards", "1", "--replicas", "1", "--donefile", str(tmp_path / "d"),
            "--dir", str(cluster_dir), "--base_port", str(base_port), "--timeout", "30",
        )  # fmt: skip
    assert result.returncode == 1
    assert "transfer exited at start" in result.stderr and "transfer.log" in result.stderr
    assert not (cluster_dir / "cluster.json").exists()
    deadline = time.monotonic() + 10
    while processes_under(cluster_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_under(cluster_dir) == []


def test_up_refuses_a_donefile_directory_that_does_not_exist(
    tmp_path: Path, cluster_dir: Path
) -> None:
    """`--donefile ./typo` used to create the directory and wait on it forever: refused, naming
    it, before anything starts; the transfer refuses it too unless told to create it."""
    typo = tmp_path / "typo"
    result = cube_local("up", "--shards", "1", "--replicas", "1", "--donefile", str(typo),
                        "--dir", str(cluster_dir))  # fmt: skip
    assert result.returncode == 1, result.stdout
    assert f"--donefile {typo}: donefile directory {typo}: no such directory" in result.stderr
    assert "--create_donefile_dir" in result.stderr
    assert not typo.exists() and not (cluster_dir / "cluster.json").exists()
    assert processes_under(cluster_dir) == []
    (tmp_path / "file").write_text("")
    result = cube_local("up", "--donefile", str(tmp_path / "file"), "--dir", str(cluster_dir))
    assert result.returncode == 1 and "not a directory" in result.stderr


def test_stop_escalates_to_sigkill_and_reports_it(tmp_path: Path) -> None:
    code = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print(1, flush=True); time.sleep(60)"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None
        child.stdout.readline()  # SIGTERM is ignored from here on
        record = Proc("stubborn", "server", [], str(tmp_path / "log"), 0, child.pid,
                      psutil.Process(child.pid).create_time())  # fmt: skip
        lines = stop([record], timeout=0.5)
        assert lines == [f"stubborn: killed (SIGKILL) (pid {child.pid})"]
        child.wait(timeout=5)  # gone (psutil reaped it, so its status reads 0 here)
        assert record.process() is None
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()


def test_cli_usage_errors() -> None:
    assert cube_local().returncode == 2
    assert "usage: cube-local" in cube_local("--help").stdout
    bad = cube_local("launch")
    assert bad.returncode == 2 and "unknown command 'launch'" in bad.stderr
    need = cube_local("up")
    assert need.returncode == 2 and "--donefile is required" in need.stderr
    assert command("cube-server").endswith("cube-server")


def test_up_passes_the_tokens_on_and_uses_them(tmp_path: Path, cluster_dir: Path) -> None:
    """Tokens given to cube-local (here via CUBE_TOKEN / CUBE_API_TOKEN) protect the agents
    and the transfer API it starts, and its own status/wait calls carry them (read from the
    cluster's transfer.conf: those commands run without the variables)."""
    donefile = tmp_path / "donefile"
    donefile.mkdir()
    tokens = {"CUBE_TOKEN": "agent-s3cret", "CUBE_API_TOKEN": "api-s3cret"}
    result = cube_local(
        "up", "--shards", "1", "--replicas", "1", "--donefile", str(donefile),
        "--dir", str(cluster_dir), "--poll_interval", "0.2", env=tokens,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr + result.stdout
    conf = cluster_dir / "transfer.conf"
    cfg = load_config(conf)
    assert (cfg.agent_token, cfg.api_token) == ("agent-s3cret", "api-s3cret")
    assert conf.stat().st_mode & 0o077 == 0  # tokens inside: readable by the owner only
    assert "s3cret" not in (cluster_dir / "cluster.json").read_text()  # nor on command lines

    data = json.loads((cluster_dir / "cluster.json").read_text())
    procs = {p["name"]: Proc(**p) for p in data["processes"]}
    agent_url = f"http://127.0.0.1:{procs['agent0_0'].port}/agent/status"
    api_url = f"http://127.0.0.1:{procs['transfer'].port}/dict/info"
    assert http_json(agent_url)["success"] == "255"  # 401 without the token
    assert http_json(agent_url, token="agent-s3cret")["success"] == "0"
    assert http_json(api_url)["success"] == "255"
    assert http_json(api_url, token="api-s3cret")["success"] == "0"

    version = publish_base(tmp_path, donefile, cluster_dir)
    status = cube_local("status", "--dir", str(cluster_dir))
    assert status.returncode == 0 and f"live version {version}" in status.stdout, status.stdout
    row = next(line for line in status.stdout.splitlines() if line.startswith("0_0"))
    assert version in row and "Enable_Succ" in row

    restarted = cube_local("restart", "--name", "agent0_0", "--dir", str(cluster_dir))
    assert restarted.returncode == 0, restarted.stderr
    assert http_json(agent_url)["success"] == "255"  # still protected after a restart
    assert http_json(agent_url, token="agent-s3cret")["success"] == "0"
    down = cube_local("down", "--dir", str(cluster_dir))
    assert down.returncode == 0, down.stderr
