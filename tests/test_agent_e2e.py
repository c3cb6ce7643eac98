"""cube-agent as a real process: HTTP API, downloads from real HTTP/FTP servers and files,
hostile and corrupt tars, md5 checks, resume, kill -9, token, rollback, retention.

The cube-server is a real `cube-server` process (helpers/procs.py) on the agent's data dir; the
agent only ever talks to it over its gRPC control service.
"""

from __future__ import annotations

import hashlib
import os
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from helpers.agent_helpers import (
    WAIT,
    AgentProc,
    FtpFileServer,
    make_evil_tar,
    make_shard_tar,
    seek,
    server_commands,
    server_state,
    shard_content,
    write_md5,
)

if TYPE_CHECKING:
    from conftest import Deployment
    from helpers.procs import ServerProc

pytestmark = pytest.mark.slow  # real processes end to end: `make quick` skips them

BASE, DELTA1, DELTA2 = "1700000000", "1700000000_1700000100", "1700000000_1700000200"


class Env:
    """The shared deployment (tests/conftest.py) with its HTTP file server (`http`) and its
    cube-server (`server`) started: the deployment's fields, these two not Optional."""

    def __init__(self, deployment: Deployment) -> None:
        deployment.http = self.http = deployment.serve_files()
        self.server: ServerProc = deployment.start_server()
        self.tmp, self.files, self.deploy, self.data = (
            deployment.tmp, deployment.files, deployment.deploy, deployment.data,
        )  # fmt: skip
        self.closers: list[Callable[[], object]] = deployment.closers
        self.agent = deployment.agent


@pytest.fixture
def env(deployment: Deployment) -> Env:
    return Env(deployment)


def tar_for(env: Env, name: str, seed: int = 0, n_keys: int = 1000) -> dict[str, str]:
    """Builder-style `<name>.tar` + `.md5` in the file root; the download fields for it (its
    HTTP URL as `source`, and its `md5`)."""
    md5 = make_shard_tar(env.files / f"{name}.tar", n_keys=n_keys, seed=seed)
    return {"source": f"{env.http.url}/{name}.tar", "md5": md5}


def deploy(agent: AgentProc, version: str, src: dict[str, str], **body: Any) -> None:
    steps: tuple[tuple[str, dict[str, Any]], ...] = (
        ("download", {**src, **body}),
        ("reload", {}),
        ("enable", {}),
    )
    for command, extra in steps:
        task = agent.run(command, version, **extra)
        assert task["state"] == "succeeded", task


def visible_entries(data: Path) -> set[str]:
    return {p.name for p in data.iterdir()} if data.exists() else set()


# ------------------------------------------------------------------ the main path


def test_base_then_delta_with_chain_and_idempotent_repeats(env: Env) -> None:
    agent = env.agent()
    deploy(agent, BASE, tar_for(env, "base", seed=1), dict_name="t", shard_seq=0, mode="base")
    assert (env.data / "VERSION").read_text() == f"{BASE}\n"
    assert sorted(p.name for p in (env.data / BASE).iterdir()) == ["data.cube", "index.cube"]
    assert (env.deploy / "cube_data" / "0" / BASE / "base.tar").is_file()
    assert server_commands(env.server) == ["bg_load_base", "enable"]
    keys, rows = shard_content(1000, 16, seed=1)
    assert seek(env.server.address, keys[:100]) == [r.tobytes() for r in rows[:100]]

    chain = [BASE, DELTA1]
    delta = tar_for(env, "delta1", seed=2)
    task = agent.run("download", DELTA1, **delta, mode="delta", chain=chain)
    assert task["state"] == "succeeded", task
    assert (env.data / "VERSION").read_text() == f"{BASE}\n"  # download never touches VERSION
    assert (env.data / DELTA1 / "CHAIN").read_text() == f"{BASE}\n{DELTA1}\n"
    for command in ("reload", "enable"):
        assert agent.run(command, DELTA1)["state"] == "succeeded"
    assert server_commands(env.server)[2:] == ["bg_load_patch", "enable"]
    assert (env.data / "VERSION").read_text() == f"{DELTA1}\n"
    assert server_state(env.server.control_address) == (DELTA1, BASE)
    delta_keys, delta_rows = shard_content(1000, 16, seed=2)
    got = seek(env.server.address, [*delta_keys[:50], *keys[:50]])
    assert got == [r.tobytes() for r in delta_rows[:50]] + [r.tobytes() for r in rows[:50]]

    # repeats return the finished task, nothing is redone
    requests_before, log_before = len(env.http.requests), server_commands(env.server)
    for command, extra in (("download", {**delta, "chain": chain}), ("reload", {})):
        again = agent.cmd(command=command, version=DELTA1, **extra)
        assert again["state"] == "succeeded" and again["runs"] == 1, again
    assert agent.run("enable", DELTA1)["runs"] == 1
    assert len(env.http.requests) == requests_before
    assert server_commands(env.server) == log_before

    status = agent.status()
    assert status["current"] == DELTA1 and status["versions"] == [BASE, DELTA1]
    assert status["server"]["reachable"] and status["server"]["cur_version"] == DELTA1
    assert {(t["command"], t["version"]) for t in status["tasks"]} >= {("enable", DELTA1)}


def test_another_tar_under_a_placed_version_name_fails_loudly(env: Env) -> None:
    """A repeat of a succeeded download is answered from the task only when it asks for the
    same tar: another build under the same version name fails, and the placed one stays."""
    agent = env.agent()
    first = tar_for(env, "b1", seed=1)
    assert agent.run("download", BASE, **first)["state"] == "succeeded"
    assert agent.run("download", BASE, **first)["runs"] == 1  # the same tar: already done
    placed = (env.data / BASE / "data.cube").read_bytes()
    other = tar_for(env, "b2", seed=2)
    task = agent.run("download", BASE, **other)
    assert task["state"] == "failed" and "deployed only once" in task["message"], task
    assert (env.data / BASE / "data.cube").read_bytes() == placed


def test_original_style_version_pair_and_builder_dir_names(env: Env) -> None:
    agent = env.agent()
    src = tar_for(env, "b", seed=3)
    task = agent.run("download", f"{BASE}_{BASE}", **src)  # the builder's base dir name
    assert task["state"] == "succeeded" and task["version"] == BASE
    delta = agent.cmd(
        command="download", version="1700000100", depend=BASE, mode="delta",
        **tar_for(env, "d", seed=4), chain=[BASE],
    )  # fmt: skip
    assert delta["version"] == DELTA1
    assert agent.wait_task("download", DELTA1)["state"] == "succeeded"


# ------------------------------------------------------------------ sources


def test_ftp_source_with_resume(env: Env) -> None:
    ftp = FtpFileServer(env.files)
    try:
        agent = env.agent("--md5_from_source")  # the original transfer sends no md5
        make_shard_tar(env.files / "f.tar", n_keys=3000, seed=5)
        whole = (env.files / "f.tar").read_bytes()
        folder = env.deploy / "cube_data" / "0" / BASE
        folder.mkdir(parents=True)
        (folder / "f.tar.part").write_bytes(whole[:7000])
        deploy(agent, BASE, {"source": f"{ftp.url}/f.tar"})  # md5 from f.tar.md5 over FTP too
        assert "7000" in ftp.rest_offsets
        assert (folder / "f.tar").read_bytes() == whole
    finally:
        ftp.close()


def test_file_url_and_plain_path(env: Env) -> None:
    agent = env.agent("--allow_file_sources")
    md5_a = make_shard_tar(env.files / "a.tar", seed=6)
    md5_b = make_shard_tar(env.files / "b.tar", seed=7)
    deploy(agent, "100", {"source": f"file://{env.files / 'a.tar'}", "md5": md5_a})
    deploy(agent, "200", {"source": str(env.files / "b.tar"), "md5": md5_b})
    assert server_state(env.server.control_address) == ("200", "100")
    missing = agent.run("download", "300", source=str(env.files / "nope.tar"), md5="0" * 32)
    assert missing["state"] == "failed" and "no such file" in missing["message"]


# ------------------------------------------------------------------ integrity


def test_resume_after_truncated_part_and_recovery_from_a_bad_part(env: Env) -> None:
    agent = env.agent()
    src = tar_for(env, "r", seed=8, n_keys=20000)
    whole = (env.files / "r.tar").read_bytes()
    folder = env.deploy / "cube_data" / "0" / BASE
    folder.mkdir(parents=True)
    half = len(whole) // 2
    (folder / "r.tar.part").write_bytes(whole[:half])
    task = agent.run("download", BASE, **src, size=len(whole))
    assert task["state"] == "succeeded", task
    assert env.http.ranges_for("r.tar") == [f"bytes={half}-"]

    # a .part whose bytes are wrong: the md5 check throws it away, the next try starts over
    src2 = tar_for(env, "r2", seed=9, n_keys=20000)
    folder2 = env.deploy / "cube_data" / "0" / "200"
    folder2.mkdir(parents=True)
    (folder2 / "r2.tar.part").write_bytes(b"\0" * 1000)
    bad = agent.run("download", "200", **src2)
    assert bad["state"] == "failed" and "md5 mismatch" in bad["message"], bad
    assert not (folder2 / "r2.tar.part").exists() and not (env.data / "200").exists()
    good = agent.run("download", "200", **src2)
    assert good["state"] == "succeeded" and good["runs"] == 2, good


def test_md5_mismatch_places_nothing(env: Env) -> None:
    agent = env.agent("--md5_from_source")
    url = tar_for(env, "m", seed=10)["source"]
    task = agent.run("download", BASE, source=url, md5="0" * 32)
    assert task["state"] == "failed"
    assert f"md5 mismatch for {url}: expected {'0' * 32}" in task["message"]
    assert visible_entries(env.data) == set()
    assert not list((env.deploy / "cube_data").rglob("*.part"))
    # a wrong .md5 file published next to the tar is caught the same way
    (env.files / "m.tar.md5").write_text(f"{'1' * 32}  m.tar\n")
    task = agent.run("download", "200", source=url)
    assert task["state"] == "failed" and "md5 mismatch" in task["message"]


def test_corrupt_tars_refused(env: Env) -> None:
    agent = env.agent()
    for damage in ("truncated", "garbage"):
        name = f"c-{damage}"
        make_shard_tar(env.files / f"{name}.tar", seed=11, n_keys=5000)
        whole = (env.files / f"{name}.tar").read_bytes()
        body = whole[: len(whole) // 2] if damage == "truncated" else os.urandom(len(whole))
        (env.files / f"{name}.tar").write_bytes(body)
        md5 = write_md5(env.files / f"{name}.tar")  # it matches: the builder shipped a broken tar
        task = agent.run("download", name, source=f"{env.http.url}/{name}.tar", md5=md5)
        assert task["state"] == "failed", task
        assert f"tar {name}.tar: corrupt or truncated tar" in task["message"], task
    assert visible_entries(env.data) == set()


def _member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    return info


HOSTILE_MEMBERS = [
    (_member("../evil"), "'..'"),
    (_member("./sub/../../evil"), "'..'"),
    (_member("/tmp/cube-agent-test-evil-abs"), "absolute path"),
    (_member("./evil", tarfile.SYMTYPE, "../../evil"), "symlink"),
    (_member("./evil", tarfile.LNKTYPE, "/etc/passwd"), "hard link"),
    (_member("./evil", tarfile.FIFOTYPE), "fifo"),
    (_member("./evil", tarfile.CHRTYPE), "device"),
    (_member("./evil", tarfile.BLKTYPE), "device"),
]


def test_hostile_tars_refused_and_nothing_written_outside(env: Env) -> None:
    agent = env.agent()
    make_shard_tar(env.files / "good.tar", seed=12)
    for i, (member, why) in enumerate(HOSTILE_MEMBERS):
        data = b"pwned" if member.isreg() else b""
        member.size = len(data)
        md5 = make_evil_tar(env.files / f"evil{i}.tar", env.files / "good.tar", member, data)
        task = agent.run("download", f"v{i}", source=f"{env.http.url}/evil{i}.tar", md5=md5)
        assert task["state"] == "failed", task
        assert f"refused member {member.name!r}: " in task["message"], task
        assert why in task["message"], task
    assert visible_entries(env.data) == set()
    assert not (env.deploy / "evil").exists() and not (env.tmp / "evil").exists()
    assert not Path("/tmp/cube-agent-test-evil-abs").exists()
    assert not list(env.deploy.rglob("evil"))
    assert not list(env.deploy.rglob("*.tar"))  # refused tars are not kept


# ------------------------------------------------------------------ API behaviour


def test_token_required(env: Env) -> None:
    agent = env.agent(token="s3cret")
    status, reply = agent.call("GET", "/agent/status", token=None)
    assert status == 401 and reply["success"] == "255" and "unauthorized" in reply["message"]
    status, reply = agent.call("GET", "/agent/status", token="wrong")
    assert status == 401
    status, reply = agent.call("POST", "/agent/cmd", {"command": "task", "version": "1"}, None)
    assert status == 401
    status, reply = agent.call(
        "POST", "/agent/cmd", {"command": "task", "version": "1", "token": "s3cret"}, None
    )
    assert status == 404 and reply["success"] == "255"  # authorized by the body token
    assert agent.status()["status"] == "RUNNING"  # with the bearer header


def test_envelopes_for_unknown_api_bad_requests_and_unknown_tasks(env: Env) -> None:
    agent = env.agent()
    status, reply = agent.call("GET", "/agent/nothing")
    assert status == 404 and reply["success"] == "2"
    assert reply["data"]["api_list"] == ["GET /agent/status", "POST /agent/cmd"]
    status, reply = agent.call("POST", "/agent/cmd", {"command": "download", "version": "../x"})
    assert status == 400 and reply["success"] == "255" and "version" in reply["message"]
    status, reply = agent.call("POST", "/agent/cmd", {"command": "task", "version": "42"})
    assert status == 404 and reply["message"] == "no task for version 42"
    status, reply = agent.call(
        "POST", "/agent/cmd", {"command": "task", "version": "42", "task_command": "reload"}
    )
    assert status == 404 and reply["message"] == "no reload task for version 42"
    status, reply = agent.call("POST", "/agent/cmd", None)
    assert status == 400 and "command" in reply["message"]


def test_server_unreachable_fails_the_task_with_a_clear_message(env: Env) -> None:
    agent = env.agent(server="127.0.0.1:1")
    assert agent.run("download", BASE, **tar_for(env, "u"))["state"] == "succeeded"
    task = agent.run("reload", BASE)
    assert task["state"] == "failed" and "127.0.0.1:1 unreachable" in task["message"], task
    server = agent.status()["server"]
    assert server["reachable"] is False and "unreachable" in server["message"]
    enable = agent.run("enable", BASE)
    assert enable["state"] == "failed" and "unreachable" in enable["message"]
    assert not (env.data / "VERSION").exists()


def test_enable_requires_a_loaded_version(env: Env) -> None:
    agent = env.agent()
    assert agent.run("download", BASE, **tar_for(env, "e"))["state"] == "succeeded"
    task = agent.run("enable", BASE)
    assert task["state"] == "failed" and "send reload first" in task["message"]
    missing = agent.run("reload", "999")
    assert missing["state"] == "failed" and "not on disk" in missing["message"]


# ------------------------------------------------------------------ rollback and retention


def test_rollback_to_previous_and_to_an_unloaded_version(env: Env) -> None:
    agent = env.agent("--keep", "3")
    for i, version in enumerate(("100", "200", "300")):
        deploy(agent, version, tar_for(env, f"v{version}", seed=20 + i))
    assert server_state(env.server.control_address) == ("300", "200")
    task = agent.run("rollback", "200")  # the server's bg: a switch, no load
    assert task["state"] == "succeeded", task
    assert server_state(env.server.control_address) == ("200", "300")
    assert server_commands(env.server)[-1] == "enable"
    assert (env.data / "VERSION").read_text() == "200\n"
    task = agent.run("rollback", "100")  # only on disk: load, then switch
    assert task["state"] == "succeeded", task
    assert server_commands(env.server)[-2:] == ["bg_load_base", "enable"]
    assert server_state(env.server.control_address) == ("100", "200")
    assert (env.data / "VERSION").read_text() == "100\n"
    gone = agent.run("rollback", "50")
    assert gone["state"] == "failed" and "not on disk" in gone["message"]


def test_rollback_to_a_delta_on_disk_loads_its_chain(env: Env) -> None:
    agent = env.agent("--keep", "5")
    deploy(agent, BASE, tar_for(env, "b", seed=70))
    deploy(agent, DELTA1, tar_for(env, "d1", seed=71), chain=[BASE, DELTA1])
    for version, seed in (("1800000000", 72), ("1900000000", 73)):
        deploy(agent, version, tar_for(env, f"n{seed}", seed=seed))
    assert server_state(env.server.control_address) == ("1900000000", "1800000000")
    task = agent.run("rollback", DELTA1)
    assert task["state"] == "succeeded", task
    assert server_commands(env.server)[-2:] == ["bg_load_base", "enable"]  # whole chain
    assert server_state(env.server.control_address) == (DELTA1, "1900000000")
    base_keys, base_rows = shard_content(1000, 16, seed=70)
    delta_keys, delta_rows = shard_content(1000, 16, seed=71)
    got = seek(env.server.address, [*base_keys[:20], *delta_keys[:20]])
    assert got == [r.tobytes() for r in base_rows[:20]] + [r.tobytes() for r in delta_rows[:20]]
    assert (env.data / "VERSION").read_text() == f"{DELTA1}\n"


def test_retention_keeps_serving_versions_and_the_current_chain(env: Env) -> None:
    agent = env.agent("--keep", "2")
    deploy(agent, "100", tar_for(env, "a", seed=30))
    for i, version in enumerate(("200", "300", "400")):  # downloaded, never enabled
        assert (
            agent.run("download", version, **tar_for(env, f"x{version}", seed=31 + i))["state"]
            == "succeeded"
        )
    assert visible_entries(env.data) >= {"100", "200", "300", "400"}  # download deletes nothing
    for command in ("reload", "enable"):
        assert agent.run(command, "400")["state"] == "succeeded"
    # newest two (400, 300) + the server's rollback target 100 (still loaded); 200 goes
    assert visible_entries(env.data) == {"100", "300", "400", "VERSION"}
    assert not (env.deploy / "cube_data" / "0" / "200").exists()

    # a delta chain over base B: all of it stays while it serves or is the rollback target
    b, d1, d2 = BASE, DELTA1, DELTA2
    deploy(agent, b, tar_for(env, "b", seed=40))
    deploy(agent, d1, tar_for(env, "d1", seed=41), chain=[b, d1])
    deploy(agent, d2, tar_for(env, "d2", seed=42), chain=[b, d1, d2])
    assert (env.data / d2 / "CHAIN").read_text() == f"{b}\n{d1}\n{d2}\n"
    assert visible_entries(env.data) == {b, d1, d2, "VERSION"}
    deploy(agent, "1800000000", tar_for(env, "n", seed=43))  # new base; the chain is bg
    assert visible_entries(env.data) == {b, d1, d2, "1800000000", "VERSION"}
    deploy(agent, "1900000000", tar_for(env, "m", seed=44))
    assert visible_entries(env.data) == {"1800000000", "1900000000", "VERSION"}


# ------------------------------------------------------------------ crashes


def test_kill9_during_download_then_restart_resumes(env: Env) -> None:
    # several of the agent's 1 MiB blocks (one block arrives whole before the pace holds it
    # back: a tar under 1 MiB, as 40,000 keys make with index format 3, came in one piece)
    src = tar_for(env, "k", seed=50, n_keys=160_000)
    size = (env.files / "k.tar").stat().st_size
    assert size > 3 << 20, size
    slow = env.agent("--limit_rate", str(size // 8))  # about 8 s for the whole tar
    task = slow.cmd(command="download", version=BASE, **src)
    assert task["state"] == "running"
    # the same command again joins the running task; another command on the version is refused
    assert slow.cmd(command="download", version=BASE, **src)["started_at"] == task["started_at"]
    status, reply = slow.call("POST", "/agent/cmd", {"command": "reload", "version": BASE})
    assert status == 409 and reply["success"] == "255"
    assert f"download of version {BASE} is running" in reply["message"]

    part = env.deploy / "cube_data" / "0" / BASE / "k.tar.part"
    deadline = time.monotonic() + WAIT
    while not (part.exists() and part.stat().st_size >= size // 4):
        assert time.monotonic() < deadline, "download made no progress"
        time.sleep(0.05)
    slow.kill9()
    kept = part.stat().st_size
    assert 0 < kept < size and visible_entries(env.data) == set()

    agent = env.agent()
    before = agent.cmd(command="task", version=BASE, task_command="download")
    assert before["state"] == "failed" and before["message"].startswith("interrupted")
    task = agent.run("download", BASE, **src)
    assert task["state"] == "succeeded" and task["runs"] == 2, task
    resumed = [r for r in env.http.ranges_for("k.tar") if r]
    assert resumed and int(resumed[-1].split("=")[1].rstrip("-")) >= kept
    tar_md5 = hashlib.md5((env.deploy / "cube_data" / "0" / BASE / "k.tar").read_bytes())
    assert tar_md5.hexdigest() == (env.files / "k.tar.md5").read_text().split()[0]
    assert sorted(p.name for p in (env.data / BASE).iterdir()) == ["data.cube", "index.cube"]


def test_restart_remembers_placed_versions_and_drops_half_extracted_dirs(env: Env) -> None:
    agent = env.agent()
    src = tar_for(env, "p", seed=60)
    deploy(agent, BASE, src)
    agent.kill9()
    half = env.data / f".tmp-{DELTA1}-99999"
    half.mkdir()
    (half / "index.cube").write_bytes(b"partial")
    agent = env.agent()
    assert not half.exists()
    requests = len(env.http.requests)
    again = agent.run("download", BASE, **src)
    assert again["state"] == "succeeded" and len(env.http.requests) == requests
    assert agent.status()["versions"] == [BASE]


# ------------------------------------------------------------------ the transfer's own client


def test_transfer_agent_client_drives_a_real_agent(env: Env) -> None:
    """cube-transfer's AgentClient/drive (transfer/agents.py) against this agent: the contract
    as the other side reads it, with the transfer's full Work fields and a token."""
    import asyncio
    from urllib.parse import urlsplit

    import aiohttp

    from cube.transfer.agents import AgentClient, Outcome, drive
    from cube.transfer.config import Instance

    agent = env.agent(token="t0k")
    url = tar_for(env, "tr", seed=80)["source"]
    md5 = (env.files / "tr.tar.md5").read_text().split()[0]
    agent_port = urlsplit(agent.url).port
    assert agent_port is not None, agent.url
    server_port = int(env.server.address.rsplit(":", 1)[1])
    inst = Instance(0, 0, "127.0.0.1", agent_port, "127.0.0.1", server_port, str(env.deploy))

    def fields(command: str, version: str, **extra: object) -> dict[str, object]:
        return {
            "dict_name": "t", "shard_seq": 0, "deploy_path": str(env.deploy),
            "command": command, "version": version, "depend": BASE, "mode": "base",
            "source": url, "port": server_port, "id": BASE, "key": "k", **extra,
        }  # fmt: skip

    async def scenario() -> tuple[list[Outcome], Outcome, dict[str, Any]]:
        async with aiohttp.ClientSession() as session:
            client = AgentClient(session, token="t0k")
            outcomes: list[Outcome] = []
            for command in ("download", "reload", "enable"):
                extra = {"md5": md5, "size": (env.files / "tr.tar").stat().st_size}
                outcome = await drive(client, inst, fields(command, BASE, **extra), 60, 1)
                outcomes.append(outcome)
            bad = await drive(client, inst, fields("enable", "1999"), 30, 0)
            return outcomes, bad, await client.status(inst)

    outcomes, bad, status = asyncio.run(scenario())
    assert all(o.ok for o in outcomes), outcomes
    assert not bad.ok and "send reload first" in bad.message
    assert status["current"] == BASE and status["server"]["cur_version"] == BASE
    assert server_state(env.server.control_address) == (BASE, "")


def test_one_agent_serves_two_instances_told_apart_by_deploy_path(env: Env) -> None:
    """As the original's transfer.conf has it: two instances (deploy path + cube-server) under
    one agent (--instances). The transfer's AgentClient drives each by its deploy_path; a
    command that names none is refused, naming both; each server serves its own table."""
    import asyncio
    from urllib.parse import urlsplit

    import aiohttp
    from helpers.procs import start_server

    from cube.transfer.agents import AgentClient, drive
    from cube.transfer.config import Instance

    second = env.tmp / "deploy2"
    (second / "data").mkdir(parents=True)
    server2 = start_server(second / "data")
    env.closers.append(server2.stop)
    agent = env.agent("--instances", f"{second}={server2.control_address}")
    port = urlsplit(agent.url).port
    assert port is not None, agent.url
    places = [(env.deploy, env.server, 1), (second, server2, 2)]
    insts = [
        Instance(0, j, "127.0.0.1", port, "127.0.0.1", int(server.address.rsplit(":", 1)[1]),
                 str(deploy))
        for j, (deploy, server, _seed) in enumerate(places)
    ]  # fmt: skip
    sources = [tar_for(env, f"i{seed}", seed=seed) for _d, _s, seed in places]

    async def scenario() -> list[dict[str, Any]]:
        async with aiohttp.ClientSession() as session:
            client = AgentClient(session)
            for inst, src in zip(insts, sources, strict=True):
                for command in ("download", "reload", "enable"):
                    fields = {"command": command, "version": BASE, "depend": BASE,
                              "mode": "base", "dict_name": "t", "shard_seq": 0,
                              "deploy_path": inst.deploy_path, **src}  # fmt: skip
                    outcome = await drive(client, inst, fields, 60, 0)
                    assert outcome.ok, outcome
            return [await client.status(inst) for inst in insts]

    statuses = asyncio.run(scenario())
    assert [s["deploy_path"] for s in statuses] == [str(env.deploy), str(second)]
    for (deploy, server, seed), instance_status in zip(places, statuses, strict=True):
        assert instance_status["server"]["address"] == server.control_address
        assert server_state(server.control_address) == (BASE, "")
        keys, rows = shard_content(1000, 16, seed=seed)
        assert seek(server.address, keys[:50]) == [r.tobytes() for r in rows[:50]]
        assert (deploy / "data" / "VERSION").read_text() == f"{BASE}\n"
    both = agent.status()  # no deploy_path: every instance
    assert [i["deploy_path"] for i in both["instances"]] == [str(env.deploy), str(second)]
    status, reply = agent.call("POST", "/agent/cmd", {"command": "enable", "version": BASE})
    assert status == 400 and "deploy_path: required" in reply["message"]
    assert str(env.deploy) in reply["message"] and str(second) in reply["message"]
    body = {"command": "enable", "version": BASE, "deploy_path": str(env.tmp / "other")}
    status, reply = agent.call("POST", "/agent/cmd", body)
    assert status == 400 and "is none of this agent's instances" in reply["message"]


def test_metrics_count_tasks_steps_and_bytes(env: Env) -> None:
    """The agent's metrics endpoint after real tasks: outcomes, step timings, bytes fetched
    and what is on disk."""
    from helpers.procs import scrape

    agent = env.agent("--metrics_port", "0")
    assert agent.metrics_url.startswith("http://127.0.0.1:")
    src = tar_for(env, "b", seed=5)
    deploy(agent, BASE, src)
    bad = agent.run("download", "1700000500", source=src["source"], md5="0" * 32)
    assert bad["state"] == "failed"
    samples = scrape(agent.metrics_url)

    def get(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    ok = {"outcome": "succeeded", "reason": ""}
    for command in ("download", "reload", "enable"):
        assert get("cube_agent_tasks_total", command=command, **ok) == 1
    assert get("cube_agent_tasks_total", command="download", outcome="failed", reason="") == 1
    # the reasons a program reacts to are there from the start: a first failure is an increase
    assert get("cube_agent_tasks_total", command="download", outcome="failed",
               reason="no_space") == 0  # fmt: skip
    size = (env.files / "b.tar").stat().st_size
    assert get("cube_agent_downloaded_bytes_total") == 2 * size  # the failed one was fetched too
    assert get("cube_agent_download_step_duration_seconds_count", step="fetch") == 2
    assert get("cube_agent_download_step_duration_seconds_count", step="verify") == 2
    assert get("cube_agent_download_step_duration_seconds_count", step="extract") == 1
    assert get("cube_agent_versions_placed") == 1
    assert get("cube_agent_disk_bytes", area="data") > 0
    assert get("cube_agent_tasks_running", command="download") == 0
    room = {"deploy_path": str(env.deploy)}
    assert 0 < get("cube_agent_disk_available_bytes", **room) <= get(
        "cube_agent_disk_capacity_bytes", **room)  # fmt: skip


def original_transfer_body(command: str, version: str, **fields: object) -> dict[str, object]:
    """A POST /agent/cmd body as the original cube-transfer marshals it (every field of its
    command struct, zero values included)."""
    body: dict[str, object] = {
        "dict_name": "t", "shard_seq": 0, "deploy_path": "", "command": command,
        "version": version, "depend": version, "source": "", "mode": "base",
        "dict_mode": "base_only", "port": "", "rollback_info": None, "status": "",
        "finish_status": "",
    }  # fmt: skip
    return {**body, **fields}


def test_the_original_transfer_gets_its_answer_when_the_work_is_done(env: Env) -> None:
    """The original transfer takes the reply to each command as its outcome: the agent waits
    for the task and answers "0" once done, "255" with the reason when it failed, and "255"
    saying so when it still runs after --sync_reply_timeout (this project's transfer, which
    polls, still gets the running task at once)."""
    agent = env.agent("--md5_from_source", "--allowed_sources", env.http.url)
    source = tar_for(env, "base", seed=1)["source"]
    write_md5(env.files / "base.tar")  # the original sends no md5: the agent fetches <tar>.md5
    body = original_transfer_body("download", BASE, source=source)
    status, reply = agent.call("POST", "/agent/cmd", body)
    assert (status, reply["success"]) == (200, "0"), reply
    assert reply["data"]["state"] == "succeeded"  # answered when done, not when started
    for command in ("reload", "enable"):
        status, reply = agent.call("POST", "/agent/cmd", original_transfer_body(command, BASE))
        assert reply["success"] == "0" and reply["data"]["state"] == "succeeded", reply
    assert server_state(env.server.control_address)[0] == BASE

    (env.files / "bad.tar").write_bytes(b"not a tar" * 100)
    write_md5(env.files / "bad.tar")
    status, reply = agent.call("POST", "/agent/cmd", original_transfer_body(
        "download", "1700000300", source=f"{env.http.url}/bad.tar"))  # fmt: skip
    assert reply["success"] == "255" and "failed" in reply["message"], reply

    agent.stop()
    slow = env.agent("--md5_from_source", "--allowed_sources", env.http.url,
                     "--sync_reply_timeout", "0.2", "--limit_rate", "20000")  # fmt: skip
    big = tar_for(env, "big", seed=3, n_keys=20000)["source"]
    write_md5(env.files / "big.tar")
    body = original_transfer_body("download", "1700000400", source=big)
    status, reply = slow.call("POST", "/agent/cmd", body)
    assert reply["success"] == "255" and "still running after 0.2s" in reply["message"], reply
    ours = slow.call("POST", "/agent/cmd", {"command": "download", "version": "1700000400",
                                            "source": big, "mode": "base"})[1]  # fmt: skip
    assert ours["success"] == "0" and ours["data"]["state"] == "running"


def test_a_delta_from_the_original_transfer_layers_over_the_enabled_version(env: Env) -> None:
    """The original transfer sends no chain: the delta goes over the version enabled here (its
    chain, then the delta), as the original server layered a patch over what it served; one
    on another base is refused by name."""
    agent = env.agent("--md5_from_source", "--allowed_sources", env.http.url)
    deploy(agent, BASE, tar_for(env, "base", seed=1), mode="base")
    for name, version in (("d1", DELTA1), ("d2", DELTA2)):
        source = tar_for(env, name, seed=2)["source"]
        write_md5(env.files / f"{name}.tar")
        cur = version.split("_")[1]
        body = original_transfer_body("download", cur, depend=BASE, mode="delta", source=source)
        reply = agent.call("POST", "/agent/cmd", body)[1]
        assert reply["success"] == "0", reply
        for command in ("reload", "enable"):
            body = original_transfer_body(command, cur, depend=BASE, mode="delta")
            assert agent.call("POST", "/agent/cmd", body)[1]["success"] == "0"
    assert (env.data / DELTA2 / "CHAIN").read_text() == f"{BASE}\n{DELTA1}\n{DELTA2}\n"
    assert server_state(env.server.control_address)[0] == DELTA2
    body = original_transfer_body("download", "1800000100", depend="1800000000", mode="delta",
                                  source=f"{env.http.url}/d1.tar")  # fmt: skip
    status, reply = agent.call("POST", "/agent/cmd", body)
    assert status == 400 and "is on base 1700000000, not 1800000000" in reply["message"]
