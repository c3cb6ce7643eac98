"""cube-transfer's rollout logic against in-process fake agents and a fake builder: phases,
commit and quorum, abort and rollback, restart from the journal, reconciliation, bad input, and
the HTTP API. Real processes: test_transfer_e2e.py."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import re
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest
from helpers.transfer_helpers import (
    FakeAgent,
    append_line,
    make_input,
    transfer_conf,
    write_fake_builder,
    write_table,
)

from cube.processes import _port_free, free_port, poll_until, spawn, stop_child
from cube.transfer.config import ConfigError, TransferConfig, parse_config
from cube.transfer.http_api import bind_listeners, start_listeners
from cube.transfer.service import TransferService
from cube.transfer.state import Deployment, VersionRecord

T = TypeVar("T")

pytestmark = pytest.mark.slow  # seconds of rollouts and timeouts: `make quick` skips them

B1, B2 = "1700000000", "1700000500"
D1, D2 = f"{B1}_1700000100", f"{B1}_1700000200"


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(coro, 60))


@dataclasses.dataclass
class Harness:
    """A transfer service (restartable: `new_service`) over fake agents, in `tmp`."""

    tmp: Path
    cfg: TransferConfig
    agents: list[list[FakeAgent]]
    flat: list[FakeAgent]
    events: list[tuple[str, str, str]]
    donefile: Path
    api: str  # the HTTP API's base URL ("" without listeners)
    new_service: Callable[[], Awaitable[TransferService]]
    service: TransferService


@contextlib.asynccontextmanager
async def harness(
    tmp: Path,
    shards: int = 2,
    replicas: int = 2,
    extra: str = "",
    listeners: bool = False,
    token: str = "",
    mode: str = "base_delta",
    donefile_address: str = "",
    builder: str = "",
    wget_port: int = 0,
) -> AsyncIterator[Harness]:
    events: list[tuple[str, str, str]] = []  # (agent, command, version), in arrival order
    agents = [
        [FakeAgent(f"{i}_{j}", token=token, events=events) for j in range(replicas)]
        for i in range(shards)
    ]
    for row in agents:
        for agent in row:
            await agent.start()
    builder = builder or str(write_fake_builder(tmp))
    text = transfer_conf(
        tmp,
        agents,
        wget_port=wget_port,  # 0: any free port, resolved by bind_listeners
        builder=builder,
        extra=extra,
        mode=mode,
        donefile_address=donefile_address,
    )
    (tmp / "transfer.conf").write_text(text)
    cfg = parse_config(text, "transfer.conf", tmp)
    sockets = bind_listeners(cfg, 0) if listeners else None
    if sockets is not None and sockets.files is not None:
        cfg = dataclasses.replace(cfg, wget_port=sockets.files_port)
    services: list[TransferService] = []
    stops: list[Callable[[], Awaitable[None]]] = []

    async def new_service() -> TransferService:
        service = TransferService(cfg, poll_interval=0.05, dead_timeout=1.0)
        await service.open()
        services.append(service)
        if sockets is not None:
            stops.append(await start_listeners(service, sockets))
        return service

    h = Harness(
        tmp=tmp,
        cfg=cfg,
        agents=agents,
        flat=[a for row in agents for a in row],
        events=events,
        donefile=tmp / "donefile",
        api=f"http://127.0.0.1:{sockets.api_port}" if sockets else "",
        new_service=new_service,
        service=await new_service(),
    )
    try:
        yield h
    finally:
        for stop in stops:
            await stop()
        for service in services:
            await service.close()
        for agent in h.flat:
            await agent.stop()


def base_line(h: Harness, version: str, *markers: str) -> None:
    make_input(h.tmp, version, *markers)
    append_line(
        h.donefile, "base.txt", {"id": version, "key": version, "input": f"input/{version}"}
    )
    # inputs are relative to the donefile directory
    (h.donefile / "input").mkdir(exist_ok=True)
    target = h.donefile / "input" / version
    if not target.exists():
        target.symlink_to(h.tmp / "input" / version)


def patch_line(h: Harness, delta: str, *markers: str) -> None:
    base, cur = delta.split("_")
    make_input(h.tmp, delta, *markers)
    append_line(
        h.donefile, "patch.txt", {"id": cur, "key": base, "input": str(h.tmp / "input" / delta)}
    )


async def roll_out(h: Harness, version: str, *markers: str) -> None:
    """Publish `version` in the donefile (a delta when named `<base>_<cur>`) and run one
    transfer cycle: the step most of these tests repeat."""
    (patch_line if "_" in version else base_line)(h, version, *markers)
    await h.service.cycle()


def recorded(service: TransferService, version: str) -> VersionRecord:
    """The version's record, which the test expects in the history."""
    rec = service.state.record(version)
    assert rec is not None, version
    return rec


def versions(h: Harness) -> list[str]:
    return [a.cur for a in h.flat]


def history(h: Harness) -> dict[str, str]:
    return {(r.version or r.line): r.status for r in h.service.state.history}


# ---------------------------------------------------------------------------------------------


def test_base_then_deltas_roll_out_in_phases(tmp_path: Path) -> None:
    async def body() -> None:
        async with harness(tmp_path) as h:
            await roll_out(h, B1)
            assert versions(h) == [B1] * 4
            assert h.service.state.live_version == B1 and h.service.state.live_chain == [B1]
            # every download before any reload, every reload before any enable
            order = [cmd for _, cmd, _ in h.events]
            assert order == ["download"] * 4 + ["reload"] * 4 + ["enable"] * 4
            first = h.flat[0].received[0]
            assert first["mode"] == "base" and first["version"] == B1 and first["depend"] == B1
            assert first["source"].endswith(f"/{B1}_{B1}/test_dict_part0.tar")
            assert len(first["md5"]) == 32 and first["size"] > 0
            assert first["shard_seq"] == 0 and first["deploy_path"] == "/deploy"
            rec = recorded(h.service, B1)
            assert rec.status == "finished" and set(rec.meta_infos) == {"0", "1"}
            argv = _builder_argv(tmp_path, 0)
            assert argv[argv.index("-job_mode") + 1] == "base"
            assert argv[argv.index("-cur_version") + 1] == B1

            h.events.clear()
            patch_line(h, D1)
            await roll_out(h, D2)
            assert versions(h) == [D2] * 4
            assert h.service.state.live_chain == [B1, D1, D2]
            sent = [b for b in h.flat[3].received if b["version"] == D2]
            assert sent[0]["chain"] == [B1, D1, D2] and sent[0]["mode"] == "delta"
            assert sent[0]["source"].endswith(f"/{D2}/test_dict_part1.tar")
            argv = _builder_argv(tmp_path)
            assert argv[argv.index("-job_mode") + 1] == "delta"
            assert argv[argv.index("-depend_version") + 1] == B1

    run(body())


def test_no_shard_switches_when_a_shard_misses_quorum(tmp_path: Path) -> None:
    async def body() -> None:
        async with harness(tmp_path, extra="retries: 1") as h:
            await roll_out(h, B1)
            h.events.clear()
            h.agents[1][0].behavior = lambda cmd, v: "disk full" if cmd == "reload" else None
            await roll_out(h, B2)
            assert versions(h) == [B1] * 4  # nobody switched
            assert not [e for e in h.events if e[1] == "enable"]
            rec = recorded(h.service, B2)
            assert rec.status == "failed"
            assert "reload did not reach quorum 2 (shard 1: 1 of 2" in rec.message
            assert "disk full" in rec.message and "nothing was switched" in rec.message
            assert h.service.state.live_version == B1 and h.service.state.deployment is None
            tries = [e for e in h.events if e[0] == "1_0" and e[1] == "reload"]
            assert len(tries) == 2  # first try + one retry

    run(body())


def test_a_dead_replica_does_not_block_under_quorum_one_and_catches_up(tmp_path: Path) -> None:
    async def body() -> None:
        async with harness(tmp_path, extra="quorum: 1") as h:
            await roll_out(h, B1)
            dead = h.agents[0][1]
            await dead.stop()
            await roll_out(h, B2)
            assert h.service.state.live_version == B2
            assert [a.cur for a in h.flat if a is not dead] == [B2] * 3 and dead.cur == B1
            assert h.service.state.instances["0_1"].status == "Dead"
            await dead.start(dead.port)
            await h.service.cycle()  # reconciler
            assert dead.cur == B2
            assert h.service.state.instances["0_1"].version == B2

    run(body())


def test_a_failed_enable_returns_the_switched_replicas_to_the_previous_version(
    tmp_path: Path,
) -> None:
    async def body() -> None:
        async with harness(tmp_path, extra="retries: 0") as h:
            await roll_out(h, B1)
            for agent in h.agents[1]:
                agent.behavior = lambda cmd, v: "server crashed" if cmd == "enable" else None
            await roll_out(h, B2)
            assert versions(h) == [B1] * 4
            assert h.agents[0][0].switches == [B1, B2, B1]
            rec = recorded(h.service, B2)
            assert rec.status == "failed" and "enable did not reach quorum" in rec.message
            assert "back on 1700000000" in rec.message
            assert h.service.state.live_version == B1

    run(body())


def test_a_lagging_replica_skips_a_delta_and_is_caught_up_by_the_reconciler(tmp_path: Path) -> None:
    async def body() -> None:
        async with harness(tmp_path, extra="quorum: 1") as h:
            await roll_out(h, B1)
            lagging = h.agents[1][1]
            lagging.cur = "1600000000"  # serves something else (restored by hand, say)
            await roll_out(h, D1)
            assert h.service.state.live_version == D1
            # it downloaded the delta but was never asked to load it on the wrong base
            assert (lagging.name, "reload", D1) not in h.events
            deploy = recorded(h.service, D1)
            assert deploy.status == "finished"
            # the reconciler (same cycle) brought it to D1 with a rollback to the on-disk version
            assert (lagging.name, "rollback", D1) in h.events
            assert versions(h) == [D1] * 4

    run(body())


def test_restart_resumes_a_deployment_without_redoing_finished_phases(tmp_path: Path) -> None:
    async def body() -> None:
        async with harness(tmp_path) as h:
            await roll_out(h, B1)
            for agent in h.flat:
                agent.delay = 0.5
            base_line(h, B2)
            work = asyncio.create_task(h.service.cycle())
            for _ in range(200):
                if any(cmd == "reload" and v == B2 for _, cmd, v in h.events):
                    break
                await asyncio.sleep(0.02)
            work.cancel()  # as a kill -9 would, mid-reload (the journal says phase reload)
            with contextlib.suppress(asyncio.CancelledError):
                await work
            for agent in h.flat:
                agent.delay = 0.01
            again = await h.new_service()
            assert again.state.deployment is not None
            assert again.state.deployment.phase == "reload"
            h.service = again
            await again.cycle()
            assert versions(h) == [B2] * 4 and again.state.live_version == B2
            downloads = [e for e in h.events if e[1] == "download" and e[2] == B2]
            assert len(downloads) == 4  # not downloaded again
            assert recorded(again, B2).status == "finished"
            # and a third start finds nothing to do
            third = await h.new_service()
            h.events.clear()
            await third.cycle()
            assert not [e for e in h.events if e[1] != "task"]

    run(body())


def test_bad_donefile_lines_and_bad_builds_fail_alone(tmp_path: Path) -> None:
    async def body() -> list[VersionRecord]:
        async with harness(tmp_path, extra="retries: 0") as h:
            append_line(h.donefile, "base.txt", '{"id": "17", "key": "17", "input": ')
            await h.service.cycle()
            for version, marker in (("19", "FAIL"), ("20", "BADMD5")):
                await roll_out(h, version, marker)
                assert versions(h) == [""] * 4 and h.flat[0].received == []
            await roll_out(h, "21")
            assert versions(h) == ["21"] * 4
            return h.service.state.history

    recs = run(body())
    assert recs[0].status == "failed" and "malformed donefile line" in recs[0].message
    assert "base.txt:1: not JSON" in recs[0].message
    by_version = {r.version: r for r in recs if r.version}
    assert by_version["19"].status == "failed"
    assert "exited with status 3" in by_version["19"].message
    assert "bad record at offset 42" in by_version["19"].message
    assert "does not match its .md5" in by_version["20"].message
    assert by_version["21"].status == "finished"


def test_missing_input_fails_the_version_with_its_path(tmp_path: Path) -> None:
    async def body() -> None:
        async with harness(tmp_path, shards=1, replicas=1) as h:
            append_line(h.donefile, "base.txt", {"id": "18", "key": "18", "input": "/no/such/dir"})
            await h.service.cycle()
            rec = recorded(h.service, "18")
            assert rec.status == "failed" and "input /no/such/dir does not exist" in rec.message
            assert h.flat[0].received == []
            assert rec.retry_at > 0  # the input may appear: tried again later
            await roll_out(h, "18_19")  # its patch waits for the base's retry, not refused
            assert recorded(h.service, "18_19").status == "pending"
            recorded(h.service, "18").retry_at = 0.0  # as if its retries were spent
            recorded(h.service, "18").abandoned = "gave up after 9 attempts"
            await h.service.cycle()
            assert "no base is live" in recorded(h.service, "18_19").message

    run(body())


def test_http_api_shapes_rollback_and_meta(tmp_path: Path) -> None:
    async def body() -> None:
        async with harness(tmp_path, listeners=True) as h, aiohttp.ClientSession() as http:
            await roll_out(h, B1)
            await roll_out(h, D1)
            # the file server serves the built tars read-only, with ranges
            source = h.flat[0].received[0]["source"]
            async with http.get(source) as resp:
                data = await resp.read()
                assert resp.status == 200
            assert hashlib.md5(data).hexdigest() == h.flat[0].received[0]["md5"]
            async with http.get(source, headers={"Range": "bytes=10-"}) as resp:
                assert resp.status == 206 and await resp.read() == data[10:]
            async with http.get(f"http://127.0.0.1:{h.cfg.wget_port}/../transfer.conf") as resp:
                assert resp.status in (403, 404)
            async with http.put(source, data=b"x") as resp:
                assert resp.status == 405

            async with http.get(h.api + "/dict/info") as resp:
                info = await resp.json()
            assert info["success"] == "0" and info["message"] == "query ok"
            data = info["data"]
            assert data["dict_name"] == "test_dict" and data["shard_num"] == 2
            assert data["inst_num"] == 4 and data["enable_insts"] == 4
            assert [v["version"] for v in data["current_version_info"]] == [B1, D1]
            async with http.get(h.api + "/instance/status") as resp:
                insts = (await resp.json())["data"]
            assert len(insts) == 4 and insts[0]["status"] == "Enable_Succ"
            assert insts[0]["status_id"] == 100 and insts[0]["agent_port"] == h.flat[0].port
            assert insts[0]["enabled_time"] > 0 and insts[0]["version"] == 1700000100
            assert isinstance(data["wget_port"], str)  # the original's JSON types
            async with http.get(h.api + "/dict/scaler?shard=1") as resp:
                scaled = json.loads((await resp.json())["data"])  # a JSON string, as the original's
            assert [(v["version"], v["shard"], v["mode"]) for v in scaled] == [
                (B1, 1, "base"),
                (D1, 1, "delta"),
            ]
            shard1 = [w for a in h.flat for w in a.received if w["shard_seq"] == 1]
            assert scaled[1]["data_source"] == shard1[-1]["source"]  # what agents were sent
            async with http.get(scaled[0]["data_source"]) as resp:
                assert resp.status == 200  # where the agents download it
            async with http.get(h.api + "/dict/scaler") as resp:  # shard 0 by default
                assert json.loads((await resp.json())["data"])[0]["shard"] == 0
            async with http.get(h.api + "/dict/scaler?shard=2") as resp:
                assert resp.status == 400 and "outside [0, 1]" in (await resp.json())["message"]
            async with http.get(h.api + "/dict/deploy/history") as resp:
                hist = (await resp.json())["data"]
            assert [(v["version"], v["status"]) for v in hist] == [(B1, 90), (D1, 90)]
            assert hist[1]["mode"] == "delta" and hist[1]["meta_infos"]["0"]

            query = f"name=test_dict&version=1700000100&depend={B1}&shard=1"
            async with http.get(h.api + "/dict/meta_info?" + query) as resp:
                meta = (await resp.json())["data"]
            assert (meta["version"], meta["shard"], meta["split"]) == (1700000100, 1, 0)
            assert json.loads(meta["meta"])["index_total_count"] == "1"
            form = {"name": "test_dict", "version": "1700000100", "depend": B1, "shard": "1",
                    "split": "0", "meta": '{"index_total_count": "7"}'}  # fmt: skip
            async with http.post(h.api + "/dict/meta_info/register", data=form) as resp:
                assert (await resp.json())["data"] == "ok"
            async with http.get(h.api + "/dict/meta_info?" + query) as resp:
                assert "7" in (await resp.json())["data"]["meta"]
            async with http.post(h.api + "/dict/meta_info/register", data={"name": "x"}) as resp:
                reply = await resp.json()
                assert resp.status == 400 and "missing form field" in reply["message"]

            # a background worker would hold the lock; here the API drives the rollback itself
            async with http.post(h.api + "/dict/rollback", json={"version": B1}) as resp:
                reply = await resp.json()
            assert reply["success"] == "0", reply
            assert versions(h) == [B1] * 4 and h.service.state.live_chain == [B1]
            async with http.post(h.api + "/dict/rollback", json={"version": "42"}) as resp:
                reply = await resp.json()
                assert resp.status == 400 and "never live here" in reply["message"]
            async with http.post(h.api + "/dict/rollback", data=b"nope") as resp:
                assert resp.status == 400
            h.service.state.deployment = Deployment(kind="deploy", version="x", phase="reload")
            async with http.post(h.api + "/dict/rollback", json={"version": D1}) as resp:
                reply = await resp.json()
                assert resp.status == 409 and "busy: deploy of x (phase reload)" in reply["message"]
            h.service.state.deployment = None
            async with http.get(h.api + "/no/such") as resp:
                reply = await resp.json()
                assert reply["success"] == "2" and "GET /dict/info" in reply["data"]["api_list"]

            # the next patch continues on the rolled-back chain
            await roll_out(h, D2)
            assert h.service.state.live_chain == [B1, D2]
            assert versions(h) == [D2] * 4

    run(body())


def test_a_first_base_failed_on_unreachable_replicas_is_retried_across_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every replica unreachable: the first base fails and is tried again on its own after the
    backoff (a fake clock), also by a restarted transfer (the journal keeps the retry), and
    goes live once the replicas answer; the status API and the metrics show the retry."""
    from cube.transfer import service as service_module
    from cube.transfer.views import dict_info, history

    clock = [1000.0]
    monkeypatch.setattr(service_module, "now", lambda: clock[0])

    async def body() -> None:
        async with harness(tmp_path, 1, 2, extra="version_retry_backoff: 20") as h:
            for agent in h.flat:
                await agent.stop()
            await roll_out(h, B1)
            rec = recorded(h.service, B1)
            assert rec.status == "failed" and "download did not reach quorum" in rec.message
            assert (rec.attempts, rec.retry_at) == (1, 1020.0)
            info = dict_info(h.cfg, h.service.state)
            [waiting] = info["awaiting_retry"]
            assert (waiting["version"], waiting["attempts"], waiting["max_attempts"]) == (B1, 1, 9)
            assert waiting["retry_at"] == 1020.0 and "quorum" in waiting["last_error"]
            snapshot = h.service.metrics_snapshot()
            assert snapshot["retry"] == {"awaiting": 1, "next_at": 1020.0}
            for agent in h.flat:
                await agent.start(agent.port)
            clock[0] = 1019.0
            await h.service.cycle()  # not due yet
            assert _downloads(h, B1) == [] and versions(h) == ["", ""]
            h.service = await h.new_service()  # a restart: the retry comes from the journal
            assert recorded(h.service, B1).retry_at == 1020.0
            clock[0] = 1020.0
            await h.service.cycle()
            assert versions(h) == [B1, B1]
            rec = recorded(h.service, B1)
            assert rec.status == "finished" and rec.attempts == 2 and rec.retry_at == 0.0
            assert len([r for r in history(h.cfg, h.service.state) if r["version"] == B1]) == 1
            assert h.service.metrics_snapshot()["counters"]["retries"] == 1
            assert [e["attempt"] for e in _events(h) if e["event"] == "retry"] == [2]

    run(body())


def test_the_transfer_refuses_a_missing_donefile_directory_unless_told_to_create_it(
    tmp_path: Path,
) -> None:
    """A donefile_address with a typo used to be watched, empty, forever: cube-transfer exits 2
    naming it; --create_donefile_dir creates it; the log says which donefiles are watched."""
    import subprocess

    typo = tmp_path / "typo"
    conf = tmp_path / "transfer.conf"
    conf.write_text(transfer_conf(tmp_path, [[(1, 2, "/deploy")]], wget_port=0, builder="x",
                                  donefile_address=str(typo)))  # fmt: skip
    argv = [sys.executable, "-m", "cube.transfer.main", "-p", "0", "--config", str(conf)]
    refused = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert refused.returncode == 2, refused.stderr
    assert (f"donefile_address: donefile directory {typo}: no such directory; create it, or "
            "start with --create_donefile_dir") in refused.stderr  # fmt: skip
    assert not typo.exists()
    log = tmp_path / "transfer.log"
    transfer = spawn([*argv, "--create_donefile_dir"], log)
    try:
        watching = f"watching donefiles {typo}/base.txt, {typo}/patch.txt"

        def exited() -> None:
            assert transfer.poll() is None, log.read_text()

        assert poll_until(lambda: watching in log.read_text(), 60, 0.1, exited), log.read_text()
        assert typo.is_dir() and f"created the donefile directory {typo}" in log.read_text()
    finally:
        assert stop_child(transfer, timeout=10) == 0


def test_an_external_file_server_on_wget_port_serves_the_builds(tmp_path: Path) -> None:
    """With download_address, agents are sent URLs of a file server the transfer does not run:
    here one already listening on wget_port (the original's clash), serving a directory above
    output_address, as a server serving `/` gives the original's absolute URLs."""
    port = free_port()
    server = spawn(
        [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port),
         "--directory", str(tmp_path)],
        tmp_path / "http.log",
    )  # fmt: skip
    try:
        assert poll_until(lambda: not _port_free(port), 15, 0.05), "http.server did not start"
        extra = f"download_address: http://127.0.0.1:{port}/output/"

        async def body() -> None:
            async with (
                harness(tmp_path, 1, 1, extra=extra, listeners=True, wget_port=port) as h,
                aiohttp.ClientSession() as http,
            ):
                await roll_out(h, B1)
                work = h.flat[0].received[0]
                assert work["source"] == (
                    f"http://127.0.0.1:{port}/output/{B1}_{B1}/test_dict_part0.tar"
                )
                async with http.get(work["source"]) as resp:  # the external server's copy
                    assert resp.status == 200
                    assert hashlib.md5(await resp.read()).hexdigest() == work["md5"]
                async with http.get(h.api + "/dict/info") as resp:
                    info = (await resp.json())["data"]
                assert info["download_addr"] == f"http://127.0.0.1:{port}/output"

        asyncio.run(body())
    finally:
        stop_child(server, timeout=10)


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ("download_address: ftp://h/out", "expected a http or https:// URL"),
        ("download_address: http://h/out?x=1", "no query or fragment"),
        ("download_address: /data/output", "expected a http or https:// URL"),
        ("download_mode: s3\nupload_address: s3://b/p\ndownload_address: http://h/o",
         "download_address is for download_mode http or ftp"),
    ],
)  # fmt: skip
def test_bad_download_addresses_are_refused(tmp_path: Path, line: str, error: str) -> None:
    text = transfer_conf(tmp_path, [[(1, 2, "/d")]], wget_port=0, builder="b", extra=line)
    text = text.replace("download_mode: http\n", "", 1) if "download_mode" in line else text
    with pytest.raises(ConfigError, match=re.escape(error)):
        parse_config(text, "transfer.conf", tmp_path)


def test_agent_token_is_sent(tmp_path: Path) -> None:
    async def body() -> None:
        async with harness(tmp_path, shards=1, replicas=1, extra="agent_token: s3cret",
                           token="s3cret") as h:  # fmt: skip
            await roll_out(h, B1)
            assert versions(h) == [B1]

    run(body())


def test_patch_for_a_non_current_base_is_refused_with_a_reason(tmp_path: Path) -> None:
    async def body() -> None:
        async with harness(tmp_path, shards=1, replicas=2) as h:
            await roll_out(h, B1)
            await roll_out(h, "1600000000_1700000100")
            rec = recorded(h.service, "1600000000_1700000100")
            assert rec.status == "refused"
            assert f"is for base 1600000000, but the live base is {B1}" in rec.message
            assert versions(h) == [B1, B1]
            events = (tmp_path / "tmp" / "transfer_events.jsonl").read_text()
            assert "1600000000_1700000100" in events

    run(body())


def test_base_only_mode_ignores_patches(tmp_path: Path) -> None:
    async def body() -> None:
        async with harness(tmp_path, shards=1, replicas=1, mode="base_only") as h:
            base_line(h, B1)
            await roll_out(h, D1)
            assert versions(h) == [B1]
            assert h.service.state.record(D1) is None

    run(body())


def _remote_tree(root: Path, version: str) -> None:
    """What a trainer publishes on a file server: donefile/base.txt and the input directory."""
    make_input(root, version)
    (root / "input" / version / "part-00001").write_bytes(b"SEQ2")
    (root / "input" / version / ".hidden").write_bytes(b"skip me")
    append_line(root / "donefile", "base.txt", {"id": version, "key": version,
                                                "input": f"/input/{version}"})  # fmt: skip


def _builder_argv(tmp: Path, index: int = -1) -> list[str]:
    """A command line the fake builder logged (the last by default)."""
    argv: list[str] = json.loads((tmp / "output" / "argv.log").read_text().splitlines()[index])
    return argv


def test_donefile_and_input_over_http_are_mirrored(tmp_path: Path) -> None:
    from aiohttp import web

    remote = tmp_path / "remote"
    _remote_tree(remote, B1)

    async def body() -> None:
        app = web.Application()
        app.router.add_static("/", remote, show_index=True)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        try:
            address = f"http://127.0.0.1:{port}/donefile"
            async with harness(tmp_path, 1, 1, donefile_address=address) as h:
                await h.service.cycle()
                assert versions(h) == [B1]
                argv = _builder_argv(tmp_path)
                mirror = argv[argv.index("-input_path") + 1]
                assert mirror.startswith(str(tmp_path / "tmp" / "input"))
                assert not Path(mirror).exists()  # removed after the build
                # an unreachable donefile server is logged and retried, not fatal
                await runner.cleanup()
                await h.service.cycle()
                assert h.service._donefile_errors
        finally:
            await runner.cleanup()

    run(body())


def test_donefile_and_input_over_ftp_are_mirrored(tmp_path: Path) -> None:
    from cube.transfer.http_api import FtpFileServer

    remote = tmp_path / "remote"
    _remote_tree(remote, B1)
    ftp = FtpFileServer(str(remote), socket.create_server(("127.0.0.1", 0)))
    port = ftp.port
    ftp.start()
    try:

        async def body() -> None:
            address = f"ftp://127.0.0.1:{port}/donefile"
            async with harness(tmp_path, 1, 2, donefile_address=address) as h:
                await h.service.cycle()
                assert versions(h) == [B1, B1]
                rec = recorded(h.service, B1)
                assert rec.input == f"/input/{B1}"

        run(body())
    finally:
        ftp.stop()


def test_ftp_file_server_is_read_only(tmp_path: Path) -> None:
    import ftplib
    import io

    (tmp_path / "v").mkdir()
    (tmp_path / "v" / "d_part0.tar").write_bytes(b"tar bytes")
    from cube.transfer.http_api import FtpFileServer

    server = FtpFileServer(str(tmp_path), socket.create_server(("127.0.0.1", 0)))
    port = server.port
    server.start()
    try:
        client = ftplib.FTP()
        client.connect("127.0.0.1", port, timeout=10)
        client.login()
        data = io.BytesIO()
        client.retrbinary("RETR /v/d_part0.tar", data.write)
        assert data.getvalue() == b"tar bytes"
        data = io.BytesIO()
        client.retrbinary("RETR /v/d_part0.tar", data.write, rest=4)  # resumed download
        assert data.getvalue() == b"bytes"
        try:
            client.storbinary("STOR /v/new", io.BytesIO(b"x"))
            raise AssertionError("an upload was accepted")
        except ftplib.error_perm:
            pass
        client.quit()
    finally:
        server.stop()
    assert not (tmp_path / "v" / "new").exists()


def test_a_restarted_transfer_stops_the_builder_its_predecessor_left(tmp_path: Path) -> None:
    import subprocess

    import psutil

    async def body() -> None:
        async with harness(tmp_path, 1, 1) as h:
            await h.service.close()
            orphan = subprocess.Popen(["sleep", "60"], start_new_session=True)
            created = psutil.Process(orphan.pid).create_time()
            (tmp_path / "tmp" / "builder.pid").write_text(f"{orphan.pid} {created}\n")
            await h.new_service()
            orphan.wait(timeout=10)  # sleep 60 ends this soon only when killed
            assert not (tmp_path / "tmp" / "builder.pid").exists()
            # a pid file naming some other process (pid reused) kills nothing
            bystander = subprocess.Popen(["sleep", "60"], start_new_session=True)
            (tmp_path / "tmp" / "builder.pid").write_text(f"{bystander.pid} 12345.0\n")
            await h.new_service()
            assert bystander.poll() is None
            bystander.kill()
            bystander.wait()

    run(body())


def test_a_busy_agent_is_waited_for_without_spending_retries(tmp_path: Path) -> None:
    async def body() -> None:
        async with harness(tmp_path, 1, 2, extra="retries: 0") as h:
            h.flat[1].busy_until = asyncio.get_running_loop().time() + 1.5
            await roll_out(h, B1)
            assert versions(h) == [B1, B1]

    run(body())


# ---------------------------------------------------------------------------------------------
# guarding the live table (issue 9)


def _events(h: Harness) -> list[dict[str, Any]]:
    text = (h.tmp / "tmp" / "transfer_events.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]


def _downloads(h: Harness, version: str) -> list[tuple[str, str, str]]:
    return [e for e in h.events if e[1] == "download" and e[2] == version]


def test_an_empty_base_from_the_real_builder_is_refused_and_the_live_version_stays(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from cube.transfer.local import command

    def publish(h: Harness, file: str, line: dict[str, str], records: int) -> None:
        name = f"{line['key']}_{line['id']}" if file == "patch.txt" else line["id"]
        write_table(h.tmp / "input" / name, records)
        append_line(h.donefile, file, {**line, "input": str(h.tmp / "input" / name)})

    async def body() -> None:
        async with harness(tmp_path, 2, 1, builder=command("cube-builder")) as h:
            publish(h, "base.txt", {"id": B1, "key": B1}, 300)
            await h.service.cycle()
            assert versions(h) == [B1, B1]
            # a delta may be empty: it goes live
            publish(h, "patch.txt", {"id": D1.split("_")[1], "key": B1}, 0)
            await h.service.cycle()
            assert versions(h) == [D1, D1]
            # an empty base is refused: nothing downloaded, nothing switched
            publish(h, "base.txt", {"id": B2, "key": B2}, 0)
            await h.service.cycle()
            rec = recorded(h.service, B2)
            assert rec.status == "refused", (rec.status, rec.message)
            assert "has no records" in rec.message and "allow_shrink" in rec.message
            assert _downloads(h, B2) == [] and versions(h) == [D1, D1]
            assert h.service.state.live_version == D1 and h.service.state.deployment is None
            refused = [e for e in _events(h) if e["event"] == "deploy_refused"]
            assert [e["version"] for e in refused] == [B2]
            assert "has no records" in refused[0]["message"]
            assert any("has no records" in r.getMessage() for r in caplog.records)
            # the same base, published again with allow_shrink, goes live
            append_line(h.donefile, "base.txt", {"id": B2, "key": B2, "allow_shrink": True,
                                                 "input": str(h.tmp / "input" / B2)})  # fmt: skip
            await h.service.cycle()
            assert versions(h) == [B2, B2] and recorded(h.service, B2).status == "finished"
            assert recorded(h.service, B1).count("records") == 300  # from the tars' headers

    run(body())


def test_a_version_published_again_after_a_failed_rollout_ships_the_same_tars(
    tmp_path: Path,
) -> None:
    """Agents that downloaded a version keep it: when its line is published again after the
    rollout failed, the transfer deploys the build it kept, not a new build under the same
    name (which those agents would refuse: a version name is deployed once)."""
    from cube.transfer.local import command

    async def body() -> None:
        async with harness(tmp_path, 1, 2, builder=command("cube-builder")) as h:
            write_table(h.tmp / "input" / B1, 200)
            line = {"id": B1, "key": B1, "input": str(h.tmp / "input" / B1)}
            h.agents[0][1].behavior = lambda cmd, v: "disk full" if cmd == "reload" else None
            append_line(h.donefile, "base.txt", line)
            await h.service.cycle()
            assert recorded(h.service, B1).status == "failed"
            kept = Path(recorded(h.service, B1).output)
            assert kept.is_dir()  # downloaded by agents: not pruned
            h.agents[0][1].behavior = None
            append_line(h.donefile, "base.txt", line)
            await h.service.cycle()
            assert versions(h) == [B1, B1] and recorded(h.service, B1).status == "finished"
            md5s = {
                r["md5"] for a in h.flat for r in a.received
                if r.get("command") == "download" and r.get("version") == B1
            }  # fmt: skip
            assert len(md5s) == 1, md5s  # the first build's tar, both times

    run(body())


def test_a_base_that_shrinks_the_table_too_much_is_refused(tmp_path: Path) -> None:
    b3, b4, b5 = "1700000600", "1700000700", "1700000800"

    async def body() -> None:
        async with harness(tmp_path, 2, 1, extra="max_shrink: 0.5") as h:
            await roll_out(h, B1, "RECORDS_1000")  # 2000 records over 2 shards
            await roll_out(h, D1, "RECORDS_10", "DELETED_300")  # at least 1400 still served
            assert versions(h) == [D1, D1]
            await roll_out(h, B2, "RECORDS_690")  # 1380 < 0.5 x 1400? no: 1380 >= 700
            assert versions(h) == [B2, B2]
            for shard in recorded(h.service, B2).shards.values():  # as an older journal
                del shard["records"], shard["deleted"]
            await roll_out(h, b3, "RECORDS_340")  # 680 < 0.5 x 1380 (counted from B2's tars)
            rec = recorded(h.service, b3)
            assert rec.status == "refused" and _downloads(h, b3) == []
            assert "has 680 records, 51% fewer than the live version's 1380" in rec.message
            assert versions(h) == [B2, B2]
            await roll_out(h, b4, "RECORDS_0")
            assert recorded(h.service, b4).status == "refused"
            assert "has no records" in recorded(h.service, b4).message
            assert versions(h) == [B2, B2]
        # configuration: max_shrink 1 and allow_empty_base let both through
        async with harness(tmp_path / "open", 1, 1,
                           extra="max_shrink: 1\nallow_empty_base: true") as h:  # fmt: skip
            await roll_out(h, B1, "RECORDS_0")  # a first base may be empty, when allowed
            await roll_out(h, B2, "RECORDS_1000")
            await roll_out(h, b5, "RECORDS_1")
            assert versions(h) == [b5] and recorded(h.service, B1).status == "finished"

    (tmp_path / "open").mkdir()
    run(body())


def test_a_delta_of_another_value_width_is_refused_unless_variable_width(tmp_path: Path) -> None:
    """A delta of 8-byte values over a chain of 16-byte ones would go live and make every
    get_embeddings fail: refused before download, naming both widths and versions."""
    d3, d4 = f"{B1}_1700000300", f"{B1}_1700000400"

    def argv(h: Harness) -> list[str]:
        return _builder_argv(h.tmp)

    async def body() -> None:
        async with harness(tmp_path, 2, 1) as h:
            await roll_out(h, B1)  # 16-byte values
            assert "-allow_empty" in argv(h) and "-variable_width" not in argv(h)
            await roll_out(h, D1, "WIDTH_8")
            rec = recorded(h.service, D1)
            assert rec.status == "refused" and _downloads(h, D1) == []
            assert (f"delta {D1} has 8-byte values, the live version {B1} (base {B1}) "
                    "16-byte values") in rec.message  # fmt: skip
            assert "variable_width: true" in rec.message
            assert versions(h) == [B1, B1]
            await roll_out(h, D2, "RECORDS_0", "DELETED_5", "WIDTH_8")  # no values: no width
            assert versions(h) == [D2, D2]
            for shard in recorded(h.service, B1).shards.values():  # as an older journal
                del shard["value_width"]
            await roll_out(h, d3, "WIDTH_4")  # B1's width read back from its tars
            assert recorded(h.service, d3).status == "refused"
            assert "has 4-byte values" in recorded(h.service, d3).message
            await roll_out(h, d4)  # the same width goes live
            assert versions(h) == [d4, d4]
        async with harness(tmp_path / "variable", 1, 1, extra="variable_width: true") as h:
            await roll_out(h, B1)
            await roll_out(h, D1, "WIDTH_8")
            assert versions(h) == [D1] and "-variable_width" in argv(h)

    (tmp_path / "variable").mkdir()
    run(body())


# ---------------------------------------------------------------------------------------------
# the query API under hostile or careless requests (issue 9)


async def _ask(
    http: aiohttp.ClientSession, method: str, url: str, timeout: float = 5.0, **kwargs: Any
) -> tuple[int, dict[str, Any]]:
    """One request that must be answered within `timeout` with the JSON envelope."""
    async with asyncio.timeout(timeout):
        async with http.request(method, url, **kwargs) as resp:
            reply = await resp.json(content_type=None)
    assert isinstance(reply, dict) and set(reply) == {"success", "message", "data"}, reply
    return resp.status, reply


def test_meta_info_with_a_huge_shard_is_refused_at_once(tmp_path: Path) -> None:
    async def body() -> None:
        async with harness(tmp_path, 2, 1, listeners=True) as h, aiohttp.ClientSession() as http:
            await roll_out(h, B1)
            query = f"name=test_dict&version={B1}&depend={B1}&shard=3000000"
            status, reply = await _ask(http, "GET", h.api + "/dict/meta_info?" + query)
            assert status == 400 and reply["success"] == "255"
            assert "shard: 3000000 is outside [0, 1]" in reply["message"]

    run(body())


BAD_QUERIES = [
    ("shard=-1", "shard: -1 is outside [0, 1]"),
    ("shard=2", "shard: 2 is outside [0, 1]"),
    ("shard=1e3", "shard: expected an integer"),
    ("shard=--1", "shard: expected an integer"),
    ("shard=%C2%B2", "shard: expected an integer"),
    ("shard=0&split=1", "split: only split 0 exists"),
    ("shard=0&split=x", "split: only split 0"),
    ("shard=0&version=../../etc/passwd", "version: expected a version id"),
    ("shard=0&depend=1700000000/..", "depend: expected a version id"),
    ("shard=0&name=other", "name 'other' is not this transfer's dict"),
    ("shard=0&shard=1", "shard: given more than once"),
    ("shard=0&verbose=1", "unknown query parameter(s): verbose"),
]


def test_every_query_parameter_is_validated(tmp_path: Path) -> None:
    async def body() -> None:
        async with harness(tmp_path, 2, 1, listeners=True) as h, aiohttp.ClientSession() as http:
            await roll_out(h, B1)
            good = {"name": "test_dict", "version": B1, "depend": B1}
            for bad, message in BAD_QUERIES:
                params = [(k, v) for k, v in good.items() if f"{k}=" not in bad]
                query = "&".join(f"{k}={v}" for k, v in params) + "&" + bad
                status, reply = await _ask(http, "GET", h.api + "/dict/meta_info?" + query)
                assert status == 400 and message in reply["message"], (bad, reply)
            for path in ("/dict/info", "/instance/status", "/dict/deploy/history"):
                status, reply = await _ask(http, "GET", h.api + path + "?x=1")
                assert status == 400 and "unknown query parameter(s): x" in reply["message"]
            # the same rules for a registration, plus a bounded meta
            form = {"name": "test_dict", "version": B1, "depend": B1, "shard": "7", "split": "0",
                    "meta": '{"a": 1}'}  # fmt: skip
            url = h.api + "/dict/meta_info/register"
            status, reply = await _ask(http, "POST", url, data=form)
            assert status == 400 and "shard: 7 is outside [0, 1]" in reply["message"]
            status, reply = await _ask(http, "POST", url, data={**form, "shard": "../0"})
            assert status == 400 and "shard: expected an integer" in reply["message"]
            big = json.dumps({"k": "x" * (70 << 10)})
            status, reply = await _ask(http, "POST", url, data={**form, "shard": "0", "meta": big})
            assert status == 400 and "meta: over 65536 bytes" in reply["message"]
            assert "x" * 100 not in reply["message"]  # never echoed back
            form_type = {"Content-Type": "application/x-www-form-urlencoded"}
            status, reply = await _ask(http, "POST", url, data=b"x" * (2 << 20), headers=form_type)
            assert status == 413 and reply["success"] == "255"
            # a rollback names a version, never a path
            url = h.api + "/dict/rollback"
            for version in ("../../etc/passwd", "1700000000/x", "", "1" * 30, True, ["1"]):
                status, reply = await _ask(http, "POST", url, json={"version": version})
                assert status == 400 and "version: expected a version name" in reply["message"]
            status, reply = await _ask(http, "POST", url, data=b"[" * (2 << 20))
            assert status == 413
            status, reply = await _ask(http, "GET", h.api + "/" + "a" * 5000)
            assert status == 404 and len(reply["message"]) < 300

    run(body())


def test_a_meta_json_cannot_read_is_a_400(tmp_path: Path) -> None:
    # json.loads raises a plain ValueError (not JSONDecodeError, no .msg) for an integer over
    # sys.get_int_max_str_digits(), and RecursionError for deep nesting: both were 500s
    async def body() -> None:
        async with harness(tmp_path, 2, 1, listeners=True) as h, aiohttp.ClientSession() as http:
            await roll_out(h, B1)
            form = {"name": "test_dict", "version": B1, "depend": B1, "shard": "0", "split": "0",
                    "meta": '{"a": ' + "7" * 5000 + "}"}  # fmt: skip
            url = h.api + "/dict/meta_info/register"
            status, reply = await _ask(http, "POST", url, data=form)
            assert status == 400 and "meta: not JSON" in reply["message"], reply
            assert "7" * 50 not in reply["message"]  # never echoed back
            status, reply = await _ask(http, "POST", url, data={**form, "meta": "[" * 60000})
            assert status == 400 and "meta: not JSON" in reply["message"], reply
            status, reply = await _ask(http, "POST", url, data={**form, "meta": '{"a": 1'})
            assert status == 400 and "meta: not JSON (Expecting" in reply["message"], reply
            for route in ("/dict/rollback", "/dict/retry"):  # the version bodies alike
                for hostile in (b"[" * 60000, b'{"version": ' + b"7" * 5000 + b"}"):
                    status, reply = await _ask(http, "POST", h.api + route, data=hostile)
                    assert status == 400 and "the body must be JSON" in reply["message"], reply

    run(body())


def test_a_handler_error_is_a_500_with_the_envelope(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cube.transfer import views

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("secret detail")

    async def body() -> None:
        async with harness(tmp_path, 1, 1, listeners=True) as h, aiohttp.ClientSession() as http:
            monkeypatch.setattr(views, "history", broken)
            status, reply = await _ask(http, "GET", h.api + "/dict/deploy/history")
            assert status == 500 and reply["success"] == "255"
            assert "internal error" in reply["message"] and "secret" not in reply["message"]

    run(body())


def test_with_an_api_token_every_request_needs_it(tmp_path: Path) -> None:
    async def body() -> None:
        async with (
            harness(tmp_path, 1, 1, listeners=True, extra="api_token: t0ken") as h,
            aiohttp.ClientSession() as http,
        ):
            await roll_out(h, B1)
            for method, path in (("GET", "/dict/info"), ("GET", "/instance/status"),
                                 ("GET", "/dict/deploy/history"), ("POST", "/dict/rollback"),
                                 ("GET", "/no/such")):  # fmt: skip
                status, reply = await _ask(http, method, h.api + path)
                assert status == 401 and reply["message"].startswith("unauthorized"), path
            auth = {"Authorization": "Bearer t0ken"}
            status, reply = await _ask(http, "GET", h.api + "/dict/info", headers=auth)
            assert status == 200 and reply["data"]["live_version"] == B1
            status, reply = await _ask(http, "GET", h.api + "/dict/info",
                                       headers={"Authorization": "Bearer wrong"})  # fmt: skip
            assert status == 401
            form = {"name": "test_dict", "version": B1, "depend": B1, "shard": "0",
                    "meta": '{"a": 1}', "token": "t0ken"}  # fmt: skip
            status, reply = await _ask(http, "POST", h.api + "/dict/meta_info/register", data=form)
            assert status == 200, reply

    run(body())


# ---------------------------------------------------------------------------------------------
# a replica that cannot load: visible, and repaired by a new download (issue 9)


def test_a_replica_that_cannot_load_is_shown_failed_and_repaired_by_a_new_download(
    tmp_path: Path,
) -> None:
    async def body() -> None:
        async with (
            harness(tmp_path, 1, 2, extra="quorum: 1", listeners=True) as h,
            aiohttp.ClientSession() as http,
        ):
            await roll_out(h, B1)
            assert h.service.reconciler is not None
            h.service.reconciler.catch_up_backoff = 0.3
            broken = h.agents[0][1]
            broken.cur = "1600000000"  # restored from elsewhere; its copy of B1 is damaged
            broken.corrupt = {B1}
            h.events.clear()
            await h.service.reconcile()
            # one load, refused as corrupt: not re-sent (the copy is gone; retrying is useless)
            assert [e[1:] for e in h.events] == [("rollback", B1)]
            assert B1 not in broken.on_disk and broken.cur == "1600000000"
            known = h.service.state.instances["0_1"]
            assert known.catch_up_failures == 1 and known.next_catch_up > 0
            status, reply = await _ask(http, "GET", h.api + "/instance/status")
            shown = {i["name"]: i for i in reply["data"]}["0_1"]
            assert shown["status"] == "Rollback_Failed", shown
            assert shown["failures"] == 1 and shown["last_failure_reason"] == "corrupt_version"
            assert "DATA_LOSS" in shown["last_failure_message"]
            assert shown["next_retry_time"] >= int(known.next_catch_up) > 0
            failed = [e for e in _events(h) if e["event"] == "catch_up_failed"]
            assert failed[-1]["reason"] == "corrupt_version" and failed[-1]["instance"] == "0_1"
            assert failed[-1]["command"] == "rollback" and failed[-1]["failures"] == 1
            # within the backoff nothing is sent; after it, the version is downloaded again
            await h.service.reconcile()
            assert len(h.events) == 1
            await asyncio.sleep(0.35)
            await h.service.reconcile()
            assert [e[1:] for e in h.events[1:]] == [
                ("download", B1),
                ("reload", B1),
                ("enable", B1),
            ]
            assert versions(h) == [B1, B1]
            status, reply = await _ask(http, "GET", h.api + "/instance/status")
            shown = {i["name"]: i for i in reply["data"]}["0_1"]
            assert status == 200 and shown["failures"] == 0 and shown["next_retry_time"] == 0
            assert shown["last_failure_reason"] == "" and shown["status"] == "Enable_Succ"
            assert _events(h)[-1]["event"] == "caught_up"

    run(body())


def test_a_replica_that_cannot_load_during_a_rollout_downloads_again(tmp_path: Path) -> None:
    async def body() -> None:
        async with harness(tmp_path, 2, 2) as h:  # quorum: every replica
            await roll_out(h, B1)
            h.agents[1][0].corrupt = {B2}
            await roll_out(h, B2)
            assert versions(h) == [B2] * 4, recorded(h.service, B2).message
            sent = [e[1] for e in h.events if e[0] == "1_0" and e[2] == B2]
            assert sent == ["download", "reload", "download", "reload", "enable"]

    run(body())


def test_a_catch_up_without_a_record_fails_instead_of_claiming_success(tmp_path: Path) -> None:
    async def body() -> None:
        async with harness(tmp_path, 1, 2, extra="quorum: 1") as h:
            await roll_out(h, B1)
            h.agents[0][1].cur = ""  # a fresh replica
            h.service.state.history = [r for r in h.service.state.history if r.version != B1]
            await h.service.reconcile()
            known = h.service.state.instances["0_1"]
            assert known.version == "" and known.catch_up_failures == 1
            assert known.failure_message == f"catch-up: no record of {B1}"
            assert known.status == "Download_Failed" and versions(h) == [B1, ""]

    run(body())


def test_a_catch_up_reload_refused_as_corrupt_is_repaired_by_a_new_download(tmp_path: Path) -> None:
    async def body() -> None:
        async with harness(tmp_path, 1, 2, extra="quorum: 1\nretries: 0") as h:
            assert h.service.reconciler is not None
            h.service.reconciler.catch_up_backoff = 0.2
            await roll_out(h, B1)
            broken = h.agents[0][1]
            broken.behavior = lambda command, _: "disk full" if command == "download" else None
            await roll_out(h, D1)  # live without it; the same cycle's catch-up fails too
            assert versions(h) == [D1, B1]
            assert h.service.state.instances["0_1"].failure_message.endswith("disk full")
            broken.behavior = None
            broken.corrupt = {D1}  # the next copy is damaged on its disk
            h.events.clear()
            for _ in range(2):  # the reload is refused as corrupt, then the repair
                await asyncio.sleep(0.45)
                await h.service.reconcile()
            assert [e[1:] for e in h.events] == [
                ("download", D1),
                ("reload", D1),
                ("download", D1),
                ("reload", D1),
                ("enable", D1),
            ]
            assert versions(h) == [D1, D1]
            failed = [e for e in _events(h) if e["event"] == "catch_up_failed"]
            assert [e["reason"] for e in failed] == ["", "corrupt_version"]
            assert [e["failures"] for e in failed] == [1, 2]
            assert h.service.state.instances["0_1"].catch_up_failures == 0

    run(body())


def test_a_rollback_waiting_for_the_lock_sees_a_deployment_that_began_meanwhile(
    tmp_path: Path,
) -> None:
    from cube.transfer.service import Busy

    async def body() -> None:
        async with harness(tmp_path, 1, 1) as h:
            await roll_out(h, B1)
            await roll_out(h, B2)
            await h.service.lock.acquire()  # a cycle holds it
            waiting = asyncio.create_task(h.service.rollback(B1, lock_timeout=10))
            await asyncio.sleep(0.05)
            assert not waiting.done()
            started = Deployment(kind="deploy", version="1700000900", phase="build")
            h.service.state.deployment = started
            h.service.lock.release()
            with pytest.raises(Busy, match="deploy of 1700000900"):
                await waiting
            assert h.service.state.deployment.version == "1700000900"  # not overwritten
            h.service.state.deployment = None

    run(body())


def test_metrics_follow_the_rollouts(tmp_path: Path) -> None:
    """The transfer's metrics after real rollouts (fake agents): outcomes counted, phase
    durations of committed rollouts, the live version, each replica's status and lag."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.registry import CollectorRegistry

    from cube.transfer.metrics import TransferCollector

    def scrape(h: Harness) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(TransferCollector(h.service.metrics_snapshot))
        text = generate_latest(registry).decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def get(
        samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
    ) -> float | None:
        return samples.get((name, tuple(sorted({"dict": "test_dict", **labels}.items()))))

    async def body() -> None:
        async with harness(tmp_path, 1, 2, extra="retries: 0") as h:
            await roll_out(h, B1)
            await roll_out(h, D1)
            await roll_out(h, "1700000300", "FAIL")  # the build fails: aborted
            samples = scrape(h)
            assert get(samples, "cube_transfer_live_version_info", version=D1) == 1
            assert get(samples, "cube_transfer_rollouts_total", outcome="committed") == 2
            assert get(samples, "cube_transfer_rollouts_total", outcome="aborted") == 1
            for phase in ("build", "download", "reload", "enable"):
                count = get(samples, "cube_transfer_phase_duration_seconds_count", phase=phase)
                assert count == 2, phase
            for replica in ("0", "1"):  # instances 0_0 and 0_1
                assert get(samples, "cube_transfer_instance_behind", shard="0",
                           replica=replica) == 0  # fmt: skip
                assert get(samples, "cube_transfer_instance_reachable", shard="0",
                           replica=replica) == 1  # fmt: skip
            assert (get(samples, "cube_transfer_last_success_timestamp_seconds") or 0) > 0
            assert get(samples, "cube_transfer_rollout_started_timestamp_seconds") == 0
            h.service.state.deployment = Deployment(
                kind="deploy", version="1700000400", phase="download", started_at=1234.5
            )  # a rollout in progress: since when, and its phase
            samples = scrape(h)
            assert get(samples, "cube_transfer_rollout_started_timestamp_seconds") == 1234.5
            assert get(samples, "cube_transfer_rollout_phase", phase="download") == 1
            h.service.state.deployment = None
            await h.service.rollback(B1)
            samples = scrape(h)
            assert get(samples, "cube_transfer_rollouts_total", outcome="rolled_back") == 1
            assert get(samples, "cube_transfer_live_version_info", version=B1) == 1
            assert get(samples, "cube_transfer_live_version_info", version=D1) is None

    run(body())


def test_an_abandoned_version_is_retried_from_the_api_and_cube_cli(tmp_path: Path) -> None:
    """A build the builder refused is abandoned (`not retried`); once the input is fixed,
    POST /dict/retry (and `cube-cli retry`) queues it again: only abandoned versions, twice
    is harmless, the request is in the journal (a restarted transfer still has it), and the
    next cycle rolls it out with a fresh round of attempts."""
    from cube.client import transfer_cmd

    async def body() -> None:
        async with (
            harness(
                tmp_path, shards=1, replicas=2, listeners=True, extra="api_token: r3try"
            ) as h,  # fmt: skip
            aiohttp.ClientSession(headers={"Authorization": "Bearer r3try"}) as http,
        ):
            await roll_out(h, B1)
            await roll_out(h, B2, "FAIL")
            rec = recorded(h.service, B2)
            assert rec.status == "failed" and rec.abandoned.startswith("not retried"), rec
            async with http.post(h.api + "/dict/retry", json={"version": B2}) as resp:
                reply = await resp.json()
            assert resp.status == 200 and reply["message"] == f"retry of {B2} queued", reply
            assert reply["data"]["abandoned"] == "" and reply["data"]["retry_at"] > 0
            async with http.post(h.api + "/dict/retry", json={"version": B2}) as resp:
                reply = await resp.json()  # idempotent: already queued
            assert resp.status == 200 and "already queued (a retry scheduled)" in reply["message"]
            for version, message in ((B1, "is finished, not abandoned"), ("42", "not in the")):
                async with http.post(h.api + "/dict/retry", json={"version": version}) as resp:
                    reply = await resp.json()
                assert resp.status == 400 and message in reply["message"], reply
            async with (
                aiohttp.ClientSession() as anonymous,
                anonymous.post(h.api + "/dict/retry", json={"version": B2}) as resp,
            ):
                assert resp.status == 401
            # in the journal: a transfer started now has the request
            again = TransferService(h.cfg)
            await again.open()
            kept = recorded(again, B2)
            assert kept.abandoned == "" and kept.retry_at > 0 and kept.attempts == 0, kept
            assert "retry_requested" in kept.times
            await again.close()
            events = (h.cfg.tmp_address / "transfer_events.jsonl").read_text()
            assert '"retry_requested"' in events

            (h.tmp / "input" / B2 / "FAIL").unlink()  # the input is fixed
            await h.service.cycle()
            rec = recorded(h.service, B2)
            assert rec.status == "finished" and rec.attempts == 1, rec
            assert versions(h) == [B2, B2]

            # cube-cli retry: a live version is refused (exit 1), an abandoned one queued
            argv = [B2, "--transfer", h.api.removeprefix("http://")]
            env = {"CUBE_API_TOKEN": "r3try"}
            with pytest.MonkeyPatch.context() as patch:
                for key, value in env.items():
                    patch.setenv(key, value)
                assert await asyncio.to_thread(transfer_cmd.run, argv) == 1
                D3 = f"{B2}_1700000600"
                await roll_out(h, D3, "FAIL")
                assert recorded(h.service, D3).abandoned
                (h.tmp / "input" / D3 / "FAIL").unlink()
                assert await asyncio.to_thread(transfer_cmd.run, [D3, *argv[1:]]) == 0
                await h.service.cycle()
                assert recorded(h.service, D3).status == "finished"
                patch.delenv("CUBE_API_TOKEN")
                assert await asyncio.to_thread(transfer_cmd.run, [D3, *argv[1:]]) == 1

    run(body())
