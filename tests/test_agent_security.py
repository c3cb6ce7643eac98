"""cube-agent secure by default, on real processes: no token beyond loopback unless
--insecure, its API over TLS (--tls_cert), and the token of its server's control port."""

from __future__ import annotations

import json
import ssl
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from helpers.agent_helpers import AGENT_BIN, WAIT, AgentProc
from helpers.procs import running_server

# Every test here starts processes (servers, CLIs): make quick skips them.
pytestmark = pytest.mark.slow


def run_agent(
    tmp_path: Path, *extra: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    argv = [str(AGENT_BIN), "-P", "0", "--deploy_path", str(tmp_path / "deploy"), *extra]
    return subprocess.run(argv, capture_output=True, text=True, timeout=WAIT, env=env)


def test_beyond_loopback_without_a_token_refuses_to_start(tmp_path: Path) -> None:
    done = run_agent(tmp_path, "--host", "0.0.0.0")
    assert done.returncode == 2
    assert "without a token" in done.stderr and "--insecure" in done.stderr
    for extra, token in ((("--insecure",), None), ((), "s3cret")):
        agent = AgentProc(tmp_path / "deploy", "127.0.0.1:1", "--host", "0.0.0.0", *extra,
                          token=token).start()  # fmt: skip
        try:
            status, reply = agent.call("GET", "/agent/status")
            assert status == 200 and reply["success"] == "0"
        finally:
            agent.stop()


def test_api_over_tls(tmp_path: Path, pki: dict[str, str]) -> None:
    agent = AgentProc(
        tmp_path / "deploy", "127.0.0.1:1", "--tls_cert", pki["cert"], "--tls_key", pki["key"]
    ).start()
    try:
        assert agent.url.startswith("https://")
        trusted = ssl.create_default_context(cafile=pki["ca"])
        with urllib.request.urlopen(agent.url + "/agent/status", context=trusted) as resp:
            assert json.loads(resp.read())["success"] == "0"
        untrusted = ssl.create_default_context()  # the system's CAs do not know ours
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            urllib.request.urlopen(agent.url + "/agent/status", context=untrusted, timeout=10)
        plain = agent.url.replace("https://", "http://")
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(plain + "/agent/status", timeout=10).read()
    finally:
        agent.stop()


def test_server_control_token(tmp_path: Path) -> None:
    """The agent speaks to a server whose control port wants a token: with --server_token
    (or CUBE_CONTROL_TOKEN) it is let in, without it the server is reported refusing."""
    data = tmp_path / "deploy" / "data"
    data.mkdir(parents=True)
    with running_server(data, "--control_token=ctl") as server:
        for extra, expect in ((("--server_token", "ctl"), True), ((), False)):
            agent = AgentProc(tmp_path / "deploy", server.control_address, *extra).start()
            try:
                found = agent.status()["server"]
                assert found["reachable"] is expect, found
                if not expect:
                    assert "UNAUTHENTICATED" in found["message"]
            finally:
                agent.stop()
