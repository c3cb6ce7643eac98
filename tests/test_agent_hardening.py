"""Issue 9 "Hardening" for cube-agent, with real processes: placed versions that fail
verification are placed again, sources limited to what the deployment allows, fetched content
never echoed, the declared size enforced, and the HTTP API's envelope for every bad body.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import pytest
from aiohttp import web
from helpers.agent_helpers import (
    AGENT_BIN,
    WAIT,
    AgentProc,
    FtpFileServer,
    HttpFileServer,
    LineServer,
    add_bytes,
    flip_byte,
    make_shard_tar,
    seek,
    server_state,
    shard_content,
    write_md5,
)
from helpers.procs import ServerProc, start_server
from helpers.stubs import control_stub

from cube.agent.fetch import FetchError, FetchPolicy, SourcePolicy, fetch_file, fetch_md5
from cube.pb import cube_pb2
from cube.processes import free_port, stop_child

if TYPE_CHECKING:
    from conftest import Deployment

pytestmark = pytest.mark.slow  # real processes end to end: `make quick` skips them

BASE, DELTA1 = "1700000000", "1700000000_1700000100"
SECRET = b"TOPSECRET-c0ffee-do-not-echo"
LEAK = SECRET[:8].decode()  # even the 8 bytes a bad-magic message would show
FAST = FetchPolicy(attempts=3, backoff=0.01, timeout=20, io_timeout=5)
HEADER = 4096  # shard file header; the first section starts here


def tar_source(
    files: Path, url: str, name: str, seed: int = 0, n_keys: int = 1000
) -> dict[str, str]:
    """Builder-style `<name>.tar` + `.md5` under `files`; the download fields for it."""
    md5 = make_shard_tar(files / f"{name}.tar", n_keys=n_keys, seed=seed)
    return {"source": f"{url}/{name}.tar", "md5": md5}


def no_secret_anywhere(agent: AgentProc) -> None:
    text = json.dumps(agent.status())
    assert LEAK not in text, text


@pytest.fixture
def env(deployment: Deployment) -> Deployment:
    """The shared deployment (tests/conftest.py): files served over HTTP on demand, agents
    started on demand (no cube-server unless a test starts one: an agent's --server then
    points at a closed port)."""
    return deployment


# ------------------------------------------------------------------ 4. the HTTP API


def test_bad_json_bodies_get_a_400_envelope(env: Deployment) -> None:
    agent = env.agent()
    zeros = b"0" * 32
    bodies = {
        "nested arrays": b"[" * 100_000,
        "nested objects": b'{"a":' * 50_000,
        "NaN": b'{"command": "task", "version": NaN}',
        "Infinity size": b'{"command": "download", "version": "1", "source": "http://h/x.tar",'
        b' "md5": "' + zeros + b'", "size": Infinity}',
        "overflowing float": b'{"command": "download", "version": "1", "source": "http://h/x",'
        b' "md5": "' + zeros + b'", "size": 1e400}',
        "-Infinity": b'{"command": "task", "version": "1", "x": -Infinity}',
        "not UTF-8": b'{"command": "task", "version": "\xff\xfe"}',
    }
    for name, body in bodies.items():
        status, reply = agent.call_raw("/agent/cmd", body)
        assert status == 400, (name, status, reply)
        assert reply["success"] == "255" and reply["data"] is None, (name, reply)
        assert reply["message"].startswith("the body is not"), (name, reply)
    assert agent.status()["status"] == "RUNNING"


def test_bad_fields_get_a_400_not_a_500(env: Deployment) -> None:
    agent = env.agent()
    zeros = "0" * 32
    bodies = [
        {"command": "reload", "version": "1", "deploy_path": "/x\0y"},
        {"command": "download", "version": "1", "source": "http://[::1/x.tar", "md5": zeros},
        {"command": "download", "version": "1", "source": "http://h/" + "x" * 5000, "md5": zeros},
        {"command": "download", "version": "1", "source": "http://h:99999/x", "md5": zeros},
        {"command": "task", "version": "v" * 100_000},
    ]
    for body in bodies:
        status, reply = agent.call("POST", "/agent/cmd", body)
        assert status == 400 and reply["success"] == "255", (body, status, reply)
        assert len(reply["message"]) < 300, reply  # a request's megabytes are not echoed
    assert agent.status()["tasks"] == []


def test_oversized_body_gets_a_413_envelope(env: Deployment) -> None:
    agent = env.agent()
    status, reply = agent.call_raw("/agent/cmd", b" " * (2 << 20))
    assert status == 413, (status, reply)
    assert reply["success"] == "255" and reply["data"] is None
    assert "1048576" in reply["message"], reply  # the limit, not the body
    assert agent.status()["status"] == "RUNNING"


# ------------------------------------------------------------------ 2. sources and disclosure


def test_download_requires_md5_unless_md5_from_source(env: Deployment) -> None:
    http = env.serve_files()
    agent = env.agent()
    src = tar_source(env.files, http.url, "s")
    body = {"command": "download", "version": "1", "source": src["source"]}
    status, reply = agent.call("POST", "/agent/cmd", body)
    assert status == 400 and reply["success"] == "255", reply
    assert reply["message"].startswith("md5: required") and "--md5_from_source" in reply["message"]
    assert http.requests == []  # nothing fetched
    agent.stop()  # (one agent a directory)
    compatible = env.agent("--md5_from_source")  # the original transfer's behaviour, on request
    task = compatible.run("download", "1", source=src["source"])
    assert task["state"] == "succeeded", task


def test_file_sources_refused_unless_enabled(env: Deployment) -> None:
    src = tar_source(env.files, f"file://{env.files}", "s")
    path = src["source"].removeprefix("file://")
    secret_dir = env.tmp / "secret"
    secret_dir.mkdir()
    (secret_dir / "s.tar").write_bytes((env.files / "s.tar").read_bytes())
    (env.files / "link.tar").symlink_to(secret_dir / "s.tar")

    agent = env.agent()
    for source in (src["source"], path, f"file://localhost{path}"):
        status, reply = agent.call(
            "POST", "/agent/cmd", {"command": "download", "version": "1", "source": source,
                                   "md5": src["md5"]},
        )  # fmt: skip
        assert status == 400 and "--allow_file_sources" in reply["message"], (source, reply)
    assert not list((env.deploy / "cube_data").rglob("*"))  # nothing was read or written
    agent.stop()

    agent = env.agent("--allowed_sources", f"file://{env.files}/")
    assert agent.run("download", "1", **src)["state"] == "succeeded"
    for outside in (f"file://{secret_dir}/s.tar", f"file://{env.files}/link.tar",
                    f"file://{env.files}/../secret/s.tar", f"{src['source']}?x"):  # fmt: skip
        status, reply = agent.call(
            "POST", "/agent/cmd",
            {"command": "download", "version": "2", "source": outside, "md5": src["md5"]},
        )  # fmt: skip
        assert status == 400 and reply["success"] == "255", (outside, reply)
    agent.stop()

    anywhere = env.agent("--allow_file_sources")
    task = anywhere.run("download", "2", source=f"file://{env.files}/link.tar", md5=src["md5"])
    assert task["state"] == "succeeded", task


def test_allowed_sources_match_the_parsed_url_and_every_redirect(env: Deployment) -> None:
    other = env.serve_files()  # a server the deployment does not allow
    (env.files / "ok").mkdir()
    md5 = tar_source(env.files / "ok", "", "s")["md5"]
    own: dict[str, str] = {}

    async def moved(request: web.Request) -> web.Response:
        return _redirect(f"{own['url']}/ok/s.tar")

    async def away(request: web.Request) -> web.Response:
        return _redirect(f"{other.url}/ok/s.tar")

    async def relative(request: web.Request) -> web.Response:
        return _redirect("../s.tar")

    http = env.serve_files({"/ok/moved.tar": moved, "/ok/away.tar": away, "/ok/up.tar": relative})
    own["url"] = http.url
    agent = env.agent("--allowed_sources", f"http://127.0.0.1:{http.port}/ok/,ftp://h.example/x")
    refused = [
        f"{other.url}/ok/s.tar",  # another port
        f"http://127.0.0.1:{http.port}@127.0.0.1:{other.port}/ok/s.tar",  # userinfo trick
        f"http://x@127.0.0.1:{other.port}/ok/s.tar",
        f"{http.url}/ok/../s.tar",
        f"{http.url}/ok/%2e%2e/s.tar",
        f"{http.url}/ok/%2E%2E%2Fs.tar",
        f"{http.url}/okay/s.tar",  # a string prefix, not a path prefix
        f"{http.url}/s.tar",
        f"https://127.0.0.1:{http.port}/ok/s.tar",  # another scheme
        f"http://localhost:{http.port}/ok/s.tar",  # another host name
        f"{http.url}\\@127.0.0.1:{other.port}/ok/s.tar",
        f"{http.url}/ok/s\t.tar",
        f"file://{env.files}/ok/s.tar",
        "gopher://127.0.0.1/x",
    ]
    for source in refused:
        status, reply = agent.call(
            "POST", "/agent/cmd",
            {"command": "download", "version": "1", "source": source, "md5": md5},
        )  # fmt: skip
        assert status == 400 and reply["success"] == "255", (source, status, reply)
        assert "source" in reply["message"], reply
    assert other.requests == [] and http.requests == []

    for version, name in (("1", "s"), ("2", "moved")):
        task = agent.run("download", version, source=f"{http.url}/ok/{name}.tar", md5=md5)
        assert task["state"] == "succeeded", task
    for version, name in (("3", "away"), ("4", "up")):
        task = agent.run("download", version, source=f"{http.url}/ok/{name}.tar", md5=md5)
        assert task["state"] == "failed" and "redirect" in task["message"], task
        assert "--allowed_sources" in task["message"], task
        assert str(other.port) not in task["message"]  # the Location is fetched content
    assert other.requests == []
    assert not list((env.deploy / "cube_data").rglob("*.part"))


def _redirect(location: str) -> web.Response:
    return web.Response(status=302, headers={"Location": location})


def test_fetched_content_never_appears_in_messages(env: Deployment) -> None:
    """md5 files, HTTP reason phrases, non-HTTP banners, FTP replies, shard headers: a source the
    agent may fetch can hold a secret, and the task messages (shown by /agent/status) are no
    way to read it."""
    make_shard_tar(env.files / "x.tar")
    (env.files / "x.tar.md5").write_bytes(SECRET + b"\n")  # not an md5 line
    (env.files / "shadow").write_bytes(SECRET + b"\n")
    (env.files / "shadow.md5").write_bytes(SECRET + b"\n")

    async def reason(request: web.Request) -> web.Response:
        return web.Response(status=404, reason=SECRET.decode())

    http = env.serve_files({"/reason.tar": reason})
    banner = LineServer(b"", SECRET + b"\r\n\r\n")
    ftp_liar = LineServer(b"220 ready\r\n", b"530 " + SECRET + b"\r\n")
    env.closers += [banner.close, ftp_liar.close]
    evil = env.files / "evil.tar"
    with tarfile.open(evil, "w") as tar:
        add_bytes(tar, "./index.cube", SECRET + b"\0" * 5000)
        add_bytes(tar, "./data.cube", SECRET + b"\0" * 5000)
    evil_md5 = write_md5(evil)

    agent = env.agent("--md5_from_source", "--allow_file_sources", "--download_attempts", "2")
    zeros = "0" * 32
    failures = {
        "md5 file": {"source": f"{http.url}/x.tar"},
        "md5 file over file://": {"source": f"file://{env.files}/x.tar"},
        "reason phrase": {"source": f"{http.url}/reason.tar", "md5": zeros},
        "non-HTTP banner": {"source": f"http://127.0.0.1:{banner.port}/x.tar", "md5": zeros},
        "FTP reply": {"source": f"ftp://127.0.0.1:{ftp_liar.port}/x.tar", "md5": zeros},
        "shard header": {"source": f"{http.url}/evil.tar", "md5": evil_md5},
    }
    for i, (name, body) in enumerate(failures.items()):
        task = agent.run("download", f"v{i}", **body)
        assert task["state"] == "failed", (name, task)
        assert LEAK not in task["message"], (name, task)
    # a query string must not turn `<source>.md5` into another file
    for source in (f"file://{env.files}/shadow?", f"{http.url}/shadow?x="):
        status, reply = agent.call(
            "POST", "/agent/cmd", {"command": "download", "version": "q", "source": source}
        )
        assert status == 400 and LEAK not in reply["message"], (source, reply)
    assert banner.connections and ftp_liar.connections
    no_secret_anywhere(agent)


# ------------------------------------------------------------------ 3. the declared size


def _size_server(env: Deployment) -> tuple[HttpFileServer, list[int]]:
    """/endless.tar: a chunked body far bigger than any declared size (8 MiB at most, the bytes
    sent counted); /long.tar: 300000 bytes with their Content-Length."""
    sent = [0]

    async def endless(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        for _ in range(128):
            await resp.write(b"x" * 65536)
            sent[0] += 65536
        return resp

    async def long(request: web.Request) -> web.Response:
        return web.Response(body=b"y" * 300_000)

    routes = {"/endless.tar": endless, "/long.tar": long, "/big.tar.md5": endless}
    return env.serve_files(routes), sent


def test_fetch_stops_at_the_declared_size(env: Deployment) -> None:
    http, sent = _size_server(env)
    part = env.tmp / "p.part"
    seen: list[int] = []

    def progress(done: int, total: int | None) -> None:
        seen.append(done)

    size = 100_000
    with pytest.raises(FetchError, match="more than the declared size of 100000 bytes"):
        asyncio.run(fetch_file(f"{http.url}/endless.tar", part, size=size, policy=FAST,
                               progress=progress))  # fmt: skip
    assert max(seen, default=0) <= size and not part.exists()
    assert len(http.ranges_for("endless.tar")) == 1  # permanent: not retried
    assert sent[0] < 128 * 65536  # the transfer was cut, not read to its end

    seen.clear()
    with pytest.raises(FetchError, match="has 300000 bytes, the request says size 100000"):
        asyncio.run(fetch_file(f"{http.url}/long.tar", part, size=size, policy=FAST,
                               progress=progress))  # fmt: skip
    assert seen == [] and not part.exists()  # refused from Content-Length, before any byte

    make_shard_tar(env.files / "s.tar", n_keys=5000)
    real = (env.files / "s.tar").stat().st_size
    ftp = FtpFileServer(env.files)
    env.closers.append(ftp.close)
    files_ok = FetchPolicy(attempts=3, backoff=0.01, timeout=20, io_timeout=5,
                           sources=SourcePolicy(allow_files=True))  # fmt: skip
    for source in (f"{ftp.url}/s.tar", str(env.files / "s.tar")):
        with pytest.raises(FetchError, match=f"has {real} bytes, the request says size 1000"):
            asyncio.run(fetch_file(source, part, size=1000, policy=files_ok, progress=progress))
        assert seen == [] and not part.exists(), source


def test_fetches_of_unknown_size_are_bounded(env: Deployment) -> None:
    """No declared size: a cap still stops the transfer (the agent passes half the free disk;
    an md5 file may have 64 KiB)."""
    http, sent = _size_server(env)
    part = env.tmp / "p.part"
    with pytest.raises(FetchError, match=r"more than 200000 bytes \(room\); stopped"):
        asyncio.run(fetch_file(f"{http.url}/endless.tar", part, size=None, policy=FAST,
                               cap=200_000, cap_why="room"))  # fmt: skip
    assert not part.exists()
    with pytest.raises(FetchError, match=r"more than 65536 bytes \(md5 file\)"):
        asyncio.run(fetch_md5(f"{http.url}/big.tar", env.tmp / "big.tar.md5", FAST))
    assert sent[0] < 2 * 128 * 65536 and not list(env.tmp.glob("big.tar.md5*"))


def test_parts_that_cannot_be_resumed_are_not_kept(env: Deployment) -> None:
    http = env.serve_files()
    part = env.tmp / "gone.tar.part"
    part.write_bytes(b"z" * 5000)  # from an earlier attempt; the source has gone since
    with pytest.raises(FetchError, match="HTTP 404"):
        asyncio.run(fetch_file(f"{http.url}/gone.tar", part, size=None, policy=FAST))
    assert not part.exists()


def test_agent_download_with_a_wrong_size_fails_at_once_and_keeps_nothing(env: Deployment) -> None:
    http, _sent = _size_server(env)
    agent = env.agent()
    src = tar_source(env.files, http.url, "s", n_keys=5000)
    real = (env.files / "s.tar").stat().st_size
    task = agent.run("download", "1", source=f"{http.url}/endless.tar", md5=src["md5"], size=real)
    assert task["state"] == "failed" and f"more than the declared size of {real}" in task["message"]
    assert task["progress"]["bytes"] <= real
    assert not list((env.deploy / "cube_data").rglob("*.part"))
    task = agent.run("download", "1", **src, size=real)  # the right source afterwards
    assert task["state"] == "succeeded" and task["runs"] == 2, task


# ------------------------------------------------------------------ 1. corrupt placed versions


@dataclasses.dataclass
class Served:
    """`env` plus a real cube-server on the deploy's data dir and an agent driving it."""

    env: Deployment
    http: HttpFileServer
    agent: AgentProc
    server: ServerProc

    def restart(self) -> None:
        """The server stopped and started again on its ports."""
        ports, controls = self.server.ports, self.server.control_ports
        self.server.stop()
        self.server = start_server(self.env.data, ports=ports, control_ports=controls)


@pytest.fixture
def cluster(env: Deployment) -> Served:
    http = env.serve_files()
    server = env.start_server()
    env.closers.append(lambda: served.server.stop())  # the restarted one (`served`: below)
    served = Served(env, http, env.agent(), server)
    return served


def _deploy(agent: AgentProc, version: str, **download: Any) -> None:
    for command, body in (("download", download), ("reload", {}), ("enable", {})):
        task = agent.run(command, version, **body)
        assert task["state"] == "succeeded", task


def _values_offset() -> int:
    return HEADER + 100  # inside the values section, past the header


def test_corrupt_placed_version_is_quarantined_and_placed_again(cluster: Served) -> None:
    env, agent, http = cluster.env, cluster.agent, cluster.http
    src = tar_source(env.files, http.url, "b", seed=1)
    _deploy(agent, BASE, **src)
    flip_byte(env.data / BASE / "data.cube", _values_offset())
    cluster.restart()  # the server refuses to serve it at start
    assert server_state(cluster.server.control_address) == ("", "")
    fetched = len(http.requests)

    # the transfer's catch-up: download, reload, enable
    task = agent.run("download", BASE, **src)
    assert task["state"] == "succeeded", task  # the headers are fine: cheap check passes
    task = agent.run("reload", BASE)
    assert task["state"] == "failed" and task["reason"] == "corrupt_version", task
    assert f"data/{BASE}/data.cube" in task["message"], task
    assert "download" in task["message"], task
    assert BASE not in agent.status()["versions"]
    assert not [p for p in env.data.iterdir() if p.name.startswith(".")]

    task = agent.run("download", BASE, **src)
    assert task["state"] == "succeeded" and task["runs"] == 2, task
    assert len(http.requests) == fetched  # placed from the verified tar in cube_data/
    for command in ("reload", "enable"):
        assert agent.run(command, BASE)["state"] == "succeeded"
    keys, rows = shard_content(1000, 16, seed=1)
    assert seek(cluster.server.address, keys[:200]) == [r.tobytes() for r in rows[:200]]


def test_corrupt_base_under_a_delta_is_placed_again_with_its_chain(cluster: Served) -> None:
    env, agent, http = cluster.env, cluster.agent, cluster.http
    base = tar_source(env.files, http.url, "b", seed=2)
    delta = tar_source(env.files, http.url, "d", seed=3)
    _deploy(agent, BASE, **base)
    _deploy(agent, DELTA1, **delta, chain=[BASE, DELTA1])
    flip_byte(env.data / BASE / "data.cube", _values_offset())
    cached = env.deploy / "cube_data" / "0" / BASE / "b.tar"
    flip_byte(cached, cached.stat().st_size // 2)  # the cached tar went bad too
    cluster.restart()
    assert server_state(cluster.server.control_address) == ("", "")

    task = agent.run("reload", DELTA1)
    assert task["state"] == "failed" and task["reason"] == "corrupt_version", task
    assert f"data/{BASE}/data.cube" in task["message"], task
    versions = agent.status()["versions"]
    assert BASE not in versions and DELTA1 not in versions, versions

    before_b, before_d = len(http.ranges_for("b.tar")), len(http.ranges_for("d.tar"))
    assert agent.run("download", BASE, **base)["state"] == "succeeded"
    assert agent.run("download", DELTA1, **delta, chain=[BASE, DELTA1])["state"] == "succeeded"
    assert len(http.ranges_for("b.tar")) == before_b + 1  # md5 re-checked: fetched again
    assert len(http.ranges_for("d.tar")) == before_d  # still good: from the cache
    for command in ("reload", "enable"):
        task = agent.run(command, DELTA1)
        assert task["state"] == "succeeded", task
    base_keys, base_rows = shard_content(1000, 16, seed=2)
    delta_keys, delta_rows = shard_content(1000, 16, seed=3)
    got = seek(cluster.server.address, [*base_keys[:50], *delta_keys[:50]])
    assert got == [r.tobytes() for r in base_rows[:50]] + [r.tobytes() for r in delta_rows[:50]]


def test_rollback_to_a_corrupt_version_places_it_again(cluster: Served) -> None:
    env, http = cluster.env, cluster.http
    cluster.agent.stop()
    agent = env.agent("--keep", "3", server=cluster.server.control_address)
    old = tar_source(env.files, http.url, "o", seed=7)
    _deploy(agent, "100", **old)
    for version, seed in (("200", 8), ("300", 9)):
        _deploy(agent, version, **tar_source(env.files, http.url, f"v{version}", seed=seed))
    assert server_state(cluster.server.control_address) == ("300", "200")
    flip_byte(env.data / "100" / "data.cube", _values_offset())  # on disk only, not loaded
    task = agent.run("rollback", "100")
    assert task["state"] == "failed" and task["reason"] == "corrupt_version", task
    assert "data/100/data.cube" in task["message"] and "100" not in agent.status()["versions"]
    assert server_state(cluster.server.control_address) == ("300", "200")  # still serving
    fetched = len(http.requests)
    assert agent.run("download", "100", **old)["state"] == "succeeded"
    task = agent.run("rollback", "100")
    assert task["state"] == "succeeded", task
    assert len(http.requests) == fetched and (env.data / "VERSION").read_text() == "100\n"
    keys, rows = shard_content(1000, 16, seed=7)
    assert seek(cluster.server.address, keys[:100]) == [r.tobytes() for r in rows[:100]]


def test_download_checks_placed_files_and_never_touches_served_ones(cluster: Served) -> None:
    env, agent, http = cluster.env, cluster.agent, cluster.http
    served = tar_source(env.files, http.url, "b", seed=4)
    _deploy(agent, BASE, **served)
    later = tar_source(env.files, http.url, "n", seed=5)
    assert agent.run("download", "1800000000", **later)["state"] == "succeeded"
    fetched = len(http.requests)

    data = env.data / "1800000000" / "data.cube"
    whole = data.stat().st_size
    os.truncate(data, whole - 1)  # placed, not loaded: re-placed from the cache
    task = agent.run("download", "1800000000", **later)
    assert task["state"] == "succeeded" and task["runs"] == 2, task
    assert data.stat().st_size == whole and len(http.requests) == fetched

    delta = tar_source(env.files, http.url, "d", seed=6)  # fetched once
    assert agent.run("download", DELTA1, **delta, chain=[BASE, DELTA1])["state"] == "succeeded"
    for bad_chain in (None, f"../../outside\n{DELTA1}\n"):  # missing, or leading out of data/
        chain_file = env.data / DELTA1 / "CHAIN"
        chain_file.unlink() if bad_chain is None else chain_file.write_text(bad_chain)
        task = agent.run("download", DELTA1, **delta, chain=[BASE, DELTA1])
        assert task["state"] == "succeeded" and "placed data/" in task["message"], task
        assert chain_file.read_text() == f"{BASE}\n{DELTA1}\n"

    # a damaged base (not loaded) under a placed delta: the base is placed again, the delta,
    # removed with it (it cannot load over a missing base), comes back with its own download
    base2, delta2 = "1900000000", "1900000000_1900000100"
    srcs: dict[str, dict[str, Any]] = {
        base2: tar_source(env.files, http.url, "b2", seed=10),
        delta2: {**tar_source(env.files, http.url, "d2", seed=11), "chain": [base2, delta2]},
    }
    for version, src in srcs.items():
        assert agent.run("download", version, **src)["state"] == "succeeded"
    os.truncate(env.data / base2 / "index.cube", HEADER)
    task = agent.run("download", base2, **srcs[base2])
    assert task["state"] == "succeeded" and delta2 in task["message"], task
    assert agent.status()["versions"].count(delta2) == 0
    task = agent.run("download", delta2, **srcs[delta2])
    assert task["state"] == "succeeded" and task["runs"] == 2, task
    assert len(http.requests) == fetched + 3  # d.tar, b2.tar, d2.tar once each: the rest cached

    # The header of a version the server serves, damaged on disk: by a rename over it, since
    # writing into a file the server maps makes the server drop that version (cube-server's
    # file leases), after which it is no longer served and may be placed again.
    index = env.data / BASE / "index.cube"
    damaged = index.with_name("damaged")
    damaged.write_bytes(index.read_bytes())
    flip_byte(damaged, 40)
    os.replace(damaged, index)
    task = agent.run("download", BASE, **served)
    assert task["state"] == "failed" and "cube-server holds it" in task["message"], task
    assert (env.data / BASE).is_dir()
    assert server_state(cluster.server.control_address)[0] == BASE


# ------------------------------------------------------------------ issue 24: one agent a directory


def refused_agent(deploy: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """A cube-agent started on `deploy` that is expected to refuse to start (it is stopped
    after WAIT seconds if it does not: then its return code is None)."""
    argv = [str(AGENT_BIN), "-P", "0", "--deploy_path", str(deploy), "--server",
            f"127.0.0.1:{free_port()}", *extra]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=WAIT)
    except subprocess.TimeoutExpired:
        stop_child(proc, timeout=10)
        out, err = proc.communicate(timeout=WAIT)
        return subprocess.CompletedProcess(argv, None, out, err)  # type: ignore[arg-type]
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def test_a_second_agent_process_on_the_same_directory_is_refused(env: Deployment) -> None:
    """Through a symlink to the first agent's deploy path, or the same path: the second agent
    process exits 1 naming the directory and the first agent's pid, and the first agent's
    extraction in progress (its .tmp-* folder) is left alone (a second agent used to remove
    it at start, then both managed the directory)."""
    first = env.agent()
    staging = env.data / ".tmp-1700000000-99999"
    staging.mkdir()
    (staging / "index.cube").write_bytes(b"half-written")
    link = env.tmp / "link-to-deploy"
    link.symlink_to(env.deploy)
    for path in (link, env.deploy):
        done = refused_agent(path)
        assert done.returncode == 1, (done.returncode, done.stderr)
        assert f"deploy_path {path} ({env.deploy}) is managed by another cube-agent" in done.stderr
        assert first.proc is not None and f"(pid {first.proc.pid}, at {env.deploy})" in done.stderr
    assert (staging / "index.cube").read_bytes() == b"half-written"
    first.stop()
    second = AgentProc(link, f"127.0.0.1:{free_port()}").start()  # the first is gone: fine
    env.closers.append(second.stop)


def test_nested_deploy_paths_are_refused_both_ways(env: Deployment) -> None:
    """An agent whose deploy path lies inside another agent's (or holds one) would take the
    other's files for its own: refused at start, in either order, naming both; and within one
    process (--instances), a flag error naming both."""
    outer = env.agent()
    inner = env.deploy / "cube_data" / "nested"
    done = refused_agent(inner)
    assert done.returncode == 1, (done.returncode, done.stderr)
    assert f"deploy_path {inner} ({inner}) lies inside {env.deploy}, which another cube-agent" \
        in done.stderr  # fmt: skip
    outer.stop()
    inner_agent = AgentProc(inner, f"127.0.0.1:{free_port()}").start()
    env.closers.append(inner_agent.stop)
    done = refused_agent(env.deploy)
    assert done.returncode == 1, (done.returncode, done.stderr)
    assert f"deploy_path {env.deploy} ({env.deploy}) holds {inner}, which another" in done.stderr
    inner_agent.stop()

    link = env.tmp / "again"
    link.symlink_to(env.deploy)
    server = f"127.0.0.1:{free_port()}"
    for other, problem in (
        (link, f"deploy_path {env.deploy} and {link} are one directory ({env.deploy})"),
        (inner, f"deploy_path {inner} lies inside deploy_path {env.deploy}"),
    ):
        done = refused_agent(env.deploy, "--instances", f"{other}={server}")
        assert done.returncode == 2, (done.returncode, done.stderr)
        assert f"--instances: {problem}" in done.stderr


def test_the_agents_staging_folder_cannot_be_loaded_as_a_version(cluster: Served) -> None:
    """A control token holder naming the agent's hidden staging folder (`.tmp-*`, half
    written while the agent extracts) as a version is refused by the server (it loaded it)
    and by the agent; the served version keeps serving."""
    env, agent, http = cluster.env, cluster.agent, cluster.http
    _deploy(agent, BASE, **tar_source(env.files, http.url, "b", seed=1))
    staging = env.data / ".tmp-1700000200-4242"
    shutil.copytree(env.data / BASE, staging)  # an extraction in progress, as the agent names it
    server = cluster.server
    with grpc.insecure_channel(server.control_address) as channel:
        stub = control_stub(channel)
        for cmd, field in (("bg_load_base", "version_path"), ("enable", "version")):
            with pytest.raises(grpc.RpcError) as refused:
                stub.cmd(cube_pb2.ControlRequest(cmd=cmd, **{field: f"/{staging.name}"}),
                         timeout=WAIT)  # fmt: skip
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, cmd
            details = refused.value.details() or ""
            assert f"'{staging.name}' is not a version name" in details
            assert "an agent's staging folder" in details
    assert server_state(server.control_address) == (BASE, "")
    status, reply = agent.call("POST", "/agent/cmd", {"command": "reload", "version": staging.name})
    assert status == 400 and "is not a valid name" in reply["message"], reply


def _member(tar: tarfile.TarFile, name: str) -> bytes:
    """The bytes of a regular file in `tar`."""
    member = tar.extractfile(name)
    assert member is not None, name
    return member.read()


def _sparse_shard_tar(path: Path, good_tar: Path, claimed: int) -> str:
    """A plain tar with the good tar's index.cube and a GNU sparse data.cube that stores 512
    bytes and unpacks to `claimed` bytes (Python's tarfile reads such members but cannot write
    them: the header is made here); its md5."""
    with tarfile.open(good_tar) as good:
        index = _member(good, "./index.cube")
    plain = tarfile.TarInfo("./index.cube")
    plain.size = len(index)
    sparse = tarfile.TarInfo("./data.cube")
    sparse.size, sparse.type = 512, tarfile.GNUTYPE_SPARSE
    header = bytearray(sparse.tobuf(tarfile.GNU_FORMAT))
    header[386:410] = b"%011o\0%011o\0" % (0, 512)  # one region: 512 bytes at offset 0
    header[483:495] = b"%011o\0" % claimed  # the size it unpacks to
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)  # the header checksum, over the new fields
    path.write_bytes(
        plain.tobuf(tarfile.GNU_FORMAT) + index + bytes(-len(index) % 512)
        + bytes(header) + b"\1" * 512 + bytes(1024)
    )  # fmt: skip
    return write_md5(path)


def test_a_tar_that_unpacks_past_its_recorded_size_is_refused_before_extraction(
    env: Deployment,
) -> None:
    """A 300 MB of zeros gzipped into a few hundred KB (it was extracted in full), and a plain
    tar whose sparse member claims 300 MB: refused before a byte is written, naming the bound,
    with no partial directory left in data/."""
    http = env.serve_files()
    agent = env.agent()
    make_shard_tar(env.files / "good.tar", n_keys=100)
    bomb = env.files / "bomb.tar"
    with tarfile.open(bomb, "w:gz", compresslevel=9) as tar:
        with tarfile.open(env.files / "good.tar") as good:
            add_bytes(tar, "./index.cube", _member(good, "./index.cube"))
        info = tarfile.TarInfo("./data.cube")
        info.size = 300 << 20
        tar.addfile(info, io.BufferedReader(io.BytesIO(bytes(300 << 20))))
    assert bomb.stat().st_size < 400_000
    sparse = env.files / "sparse.tar"
    md5s = {"bomb": write_md5(bomb), "sparse": _sparse_shard_tar(sparse, env.files / "good.tar",
                                                                 300 << 20)}  # fmt: skip
    expected = {
        "bomb": "tar bomb.tar: a gzip-compressed tar; a shard tar is a plain tar",
        "sparse": f"tar sparse.tar: its files unpack to more than {sparse.stat().st_size} bytes,"
        " the size of the tar its build recorded",
    }
    for version, name in (("1", "bomb"), ("2", "sparse")):
        source = f"{http.url}/{name}.tar"
        size = (env.files / f"{name}.tar").stat().st_size
        task = agent.run("download", version, source=source, md5=md5s[name], size=size)
        assert task["state"] == "failed", task
        assert expected[name] in task["message"], task["message"]
        assert not [p.name for p in env.data.iterdir()], list(env.data.iterdir())
