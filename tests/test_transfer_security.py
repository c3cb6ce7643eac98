"""cube-transfer secure by default, and the whole rollout plane over TLS, on real processes:
an API beyond loopback needs api_token (or `insecure: true`); with TLS files the query API and
the file server speak https, the transfer calls agents over https with their token, agents
download over https trusting the CA and command their server's control port with its token."""

from __future__ import annotations

import json
import re
import socket
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from helpers.agent_helpers import AgentProc
from helpers.procs import start_server

from cube.client import CubeClient
from cube.processes import poll_until, spawn, stop_child
from cube.seqfile import SequenceFileWriter
from cube.transfer.local import command
from cube.values import ValueColumn

# Every test here starts processes (servers, CLIs): make quick skips them.
pytestmark = pytest.mark.slow

WAIT = 60.0


def transfer_conf(root: Path, agent: str, server: str, deploy: Path, **extra: str) -> Path:
    lines = [
        "[default]",
        "dict_name: secure_dict",
        "mode: base_only",
        "download_mode: http",
        "wget_port: 0",  # any free port: the agents are told the bound one
        f"buildtool_local: {command('cube-builder')}",
        f"donefile_address: {root / 'donefile'}",
        f"output_address: {root / 'output'}",
        f"tmp_address: {root / 'tmp'}",
        "shard_num: 1",
        "copy_num: 1",
        "transfer_address: 127.0.0.1",
        *(f"{k}: {v}" for k, v in extra.items()),
        "",
        "[cube_agent]",
        f"agent0_0: {agent}",
        f"cube0_0: {server}:{deploy}",
    ]
    (root / "donefile").mkdir(parents=True, exist_ok=True)
    path = root / "transfer.conf"
    path.write_text("\n".join(lines) + "\n")
    return path


def listening_port(log: Path, process: subprocess.Popen[bytes]) -> int:
    """The API port a cube-transfer started with `-p 0` logged once listening."""
    found: list[str] = []

    def logged() -> bool:
        found[:] = re.findall(r"API on https?://[^ ]*:(\d+),", log.read_text())
        return bool(found)

    def running() -> None:
        assert process.poll() is None, log.read_text()[-2000:]

    assert poll_until(logged, WAIT, 0.05, check=running), log.read_text()[-2000:]
    return int(found[0])


def test_api_beyond_loopback_needs_a_token(tmp_path: Path) -> None:
    conf = transfer_conf(tmp_path, "127.0.0.1:1", "127.0.0.1:2", tmp_path / "d", listen="0.0.0.0")
    argv = [sys.executable, "-m", "cube.transfer.main", "-p", "0", "--config", str(conf)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=WAIT)
    assert done.returncode == 2
    assert "without a token" in done.stderr and "api_token" in done.stderr


def test_rollout_over_tls_with_tokens(tmp_path: Path, pki: dict[str, str]) -> None:
    deploy = tmp_path / "deploy"
    (deploy / "data").mkdir(parents=True)
    server = start_server(deploy / "data", "--control_token=ctl")
    agent = AgentProc(
        deploy,
        server.control_address,
        "--server_token", "ctl",
        "--tls_cert", pki["cert"], "--tls_key", pki["key"], "--tls_ca", pki["ca"],
        token="agent-t0k",
    )  # fmt: skip
    agent.ssl_context = ssl.create_default_context(cafile=pki["ca"])
    agent.start()
    conf = transfer_conf(
        tmp_path / "transfer",
        agent.url.removeprefix("https://"),
        server.address,
        deploy,
        tls_cert=pki["cert"],
        tls_key=pki["key"],
        agent_tls_ca=pki["ca"],
        agent_token="agent-t0k",
        api_token="api-t0k",
    )
    transfer = spawn(
        [command("cube-transfer"), "-p", "0", "--config", str(conf), "--poll_interval", "0.5",
         "--metrics_port", "0"],
        tmp_path / "transfer.log",
    )  # fmt: skip
    try:
        api_port = listening_port(tmp_path / "transfer.log", transfer)
        keys = np.arange(1, 501, dtype=np.uint64)
        values = np.random.default_rng(3).standard_normal((500, 4), dtype=np.float32)
        source = tmp_path / "input" / "100"
        source.mkdir(parents=True)
        column = ValueColumn.fixed(values.view(np.uint8).reshape(-1), 16)
        with SequenceFileWriter(source / "part-00000") as writer:
            writer.write_batch(keys, column)
        line = {"id": "100", "key": "100", "input": str(source)}
        (tmp_path / "transfer" / "donefile" / "base.txt").write_text(json.dumps(line) + "\n")

        def served() -> bool:
            return bool(agent.status()["server"].get("cur_version") == "100")

        assert poll_until(served, WAIT, 0.2), (tmp_path / "transfer.log").read_text()[-3000:]
        # the metrics endpoint (plain http, no token: counts and versions, never data)
        (metrics_port,) = re.findall(
            r"metrics on http://127.0.0.1:(\d+)/metrics", (tmp_path / "transfer.log").read_text()
        )

        def metrics() -> str:
            url = f"http://127.0.0.1:{metrics_port}/metrics"
            with urllib.request.urlopen(url, timeout=10) as reply:
                text: str = reply.read().decode()
                return text

        committed = 'cube_transfer_rollouts_total{dict="secure_dict",outcome="committed"} 1.0'
        assert poll_until(lambda: committed in metrics(), WAIT, 0.2), metrics()
        assert 'cube_transfer_live_version_info{dict="secure_dict",version="100"} 1.0' in metrics()
        with CubeClient(shards=[[server.address]]) as client:
            got = client.get_embeddings(keys, dim=4)
        assert (got == values).all()
        task = agent.cmd(command="task", version="100", task_command="download")
        assert task["state"] == "succeeded"

        api = f"https://127.0.0.1:{api_port}/dict/info"
        trusted = ssl.create_default_context(cafile=pki["ca"])
        request = urllib.request.Request(api, headers={"Authorization": "Bearer api-t0k"})
        with urllib.request.urlopen(request, context=trusted, timeout=10) as resp:
            assert json.loads(resp.read())["success"] == "0"
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(api, context=trusted, timeout=10)
        assert refused.value.code == 401
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            urllib.request.urlopen(request, context=ssl.create_default_context(), timeout=10)
    finally:
        stop_child(transfer, 15)
        agent.stop()
        server.stop()


def test_port_in_use_is_reported_at_once(tmp_path: Path) -> None:
    """The API and file ports are bound before the journal is opened or the donefile read."""
    conf = transfer_conf(tmp_path, "127.0.0.1:1", "127.0.0.1:2", tmp_path / "d")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = [sys.executable, "-m", "cube.transfer.main", "-p", str(port), "--config", str(conf)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=WAIT)
    assert done.returncode == 1
    assert f"127.0.0.1:{port} (-p, the API): port in use" in done.stderr, done.stderr
