"""agent/peers.py (issue 35 item 4): the rules of a recovery from peers (pure, fake clocks), the
manifest checks, and recoveries between in-process agents (fake servers, the real HTTP peer
API with its token, the md5 check)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import tarfile
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from helpers.agent_helpers import make_shard_tar

from cube.agent.api import make_app
from cube.agent.deploy import Agent, AgentConfig
from cube.agent.fetch import FetchPolicy, Prefix, SourcePolicy
from cube.agent.peers import (
    MAX_TAR_BYTES,
    Manifest,
    PeerConfig,
    PeerRecovery,
    RecoveryState,
    Step,
    choose,
    decide,
    failed,
    parse_manifest,
    token_text,
)
from cube.backoff import Backoff

MD5 = "0123456789abcdef0123456789abcdef"


def layer(version: str, mode: str = "base", **over: Any) -> dict[str, Any]:
    return {"version": version, "md5": MD5, "size": 10240, "mode": mode, "tar": "d_part0.tar",
            "shard_seq": 0, "dict_name": "d", **over}  # fmt: skip


def manifest(peer: str, *chain: str, serving: bool = True) -> Manifest:
    layers = [layer(v, "base" if i == 0 else "delta") for i, v in enumerate(chain)]
    parsed = parse_manifest(peer, {"current": chain[-1], "layers": layers, "serving": serving})
    assert isinstance(parsed, Manifest), parsed
    return parsed


# ---------------------------------------------------------------------------------------------
# the rules


def test_decide_prefers_the_transfer_then_recovers_with_backoff() -> None:
    rec = RecoveryState(started=100.0, peer_wait=30.0, backoff=Backoff(1.0, 8.0))
    # a version here: nothing to do, whatever else
    assert decide(rec, 100.0, True, None, False) is Step.DONE
    # the transfer answers: it gets peer_wait seconds from the start first
    assert decide(rec, 110.0, False, None, True) is Step.WAIT
    assert decide(rec, 130.0, False, None, True) is Step.RECOVER
    # it does not answer (gone with a drained node): at once
    assert decide(rec, 100.5, False, None, False) is Step.RECOVER
    # it sent a command lately: it is at work, wait for it (answering or not)
    assert decide(rec, 140.0, False, 125.0, False) is Step.WAIT
    assert decide(rec, 156.0, False, 125.0, False) is Step.RECOVER
    # a failed attempt: the next after the backoff, doubling to its cap
    delays = [failed(rec, 200.0 + i, f"try {i}") for i in range(5)]
    assert delays == [1.0, 2.0, 4.0, 8.0, 8.0]
    assert rec.attempts == 5 and rec.state == "failed" and rec.message == "try 4"
    assert decide(rec, 205.0, False, None, False) is Step.WAIT
    assert decide(rec, 212.0, False, None, False) is Step.RECOVER


def test_choose_the_version_most_peers_hold_from_one_that_serves_it() -> None:
    a = manifest("a:1", "100", serving=False)
    b = manifest("b:1", "100")
    c = manifest("c:1", "100", "100_200")
    assert choose([]) is None
    assert choose([a, b, c]) is b  # two hold 100; of them, b serves it
    assert choose([a, c]) is c  # one each: the longer chain (a switch in progress)
    assert choose([a]) is a


@pytest.mark.parametrize(
    ("data", "why"),
    [
        ([], "not a JSON object"),
        ({"current": "", "layers": []}, "no version"),
        ({"current": "../x", "layers": [layer("x")]}, "not a version name"),
        ({"current": "100", "layers": []}, "missing"),
        ({"current": "100", "layers": [layer("100", md5="x" * 32)]}, "malformed"),
        ({"current": "100", "layers": [layer("100", size=0)]}, "malformed"),
        ({"current": "100", "layers": [layer("100", size=MAX_TAR_BYTES + 1)]}, "malformed"),
        ({"current": "100", "layers": [layer("100", tar="../../etc/passwd")]}, "malformed"),
        ({"current": "100", "layers": [layer("100", mode="delta")]}, "malformed"),
        ({"current": "100_200", "layers": [layer("100"), layer("300_200", "delta")]}, "one base"),
        ({"current": "100_300", "layers": [layer("100"), layer("100_200", "delta")]}, "end with"),
        ({"current": "100_200", "layers": [layer("100"), layer("100_200", "delta", shard_seq=1)]},
         "different shards"),
    ],
)  # fmt: skip
def test_a_manifest_that_breaks_a_rule_is_refused(data: object, why: str) -> None:
    problem = parse_manifest("p:1", data)
    assert isinstance(problem, str) and why in problem, problem


def test_the_peers_are_the_others() -> None:
    config = PeerConfig(peers=("s-0-0.s-0.ml.svc:8001", "s-0-1.s-0.ml.svc:8001", "other:8001"))
    assert config.others("s-0-1") == ["s-0-0.s-0.ml.svc:8001", "other:8001"]
    assert token_text("t") == "t" and token_text(None) == ""

    class Reloading:
        value = "rotated"

    assert token_text(Reloading()) == "rotated"


# ---------------------------------------------------------------------------------------------
# one recovery between two agents in this process


class FakeServer:
    """What the agent asks of a cube-server's control port, in memory."""

    def __init__(self, cur: str = "") -> None:
        self.cur, self.bg = cur, ""

    async def status(self, timeout: float | None = None) -> Any:
        from cube.agent.control import ServerStatus

        return ServerStatus(cur_version=self.cur, bg_version=self.bg)

    async def cmd(self, name: str, **fields: Any) -> None:
        if name.startswith("bg_load"):
            self.bg = fields["version_path"].lstrip("/")
        elif name == "enable":
            self.cur, self.bg = fields["version"], self.cur

    async def wait_for(self, version: str, slot: str, timeout: float) -> Any:
        return await self.status()

    async def close(self) -> None:
        pass


def shard_tar(tmp: Path) -> bytes:
    tar = tmp / "made" / "d_part0.tar"
    make_shard_tar(tar, n_keys=100)
    return tar.read_bytes()


def test_an_empty_agent_recovers_its_peers_version(tmp_path: Path) -> None:
    """The peer states its chain with the md5 the transfer sent; the empty agent downloads the
    tar through the peer API with the token, checks the md5, unpacks, reloads and enables: its
    server serves the version. A peer whose tar does not match what it states is refused."""
    blob = shard_tar(tmp_path)
    md5 = hashlib.md5(blob).hexdigest()

    async def scenario() -> None:
        # the peer: a placed version with its verified tar, as a download leaves them
        peer_cfg = AgentConfig(deploy_path=tmp_path / "peer")
        peer = Agent(peer_cfg, control=FakeServer("100"))  # type: ignore[arg-type]
        peer.open()
        folder = peer.layout.download_dir(0, "100")
        folder.mkdir(parents=True)
        (folder / "d_part0.tar").write_bytes(blob)
        (folder / ".download_done").write_text(json.dumps({"md5": md5, "size": len(blob)}))
        with tarfile.open(folder / "d_part0.tar") as tar:
            tar.extractall(peer.layout.version_dir("100"))
        (peer.layout.data_dir / "VERSION").write_text("100\n")
        peer.versions["100"] = {"md5": md5, "size": len(blob), "mode": "base", "seq": 1,
                                "tar": "cube_data/0/100/d_part0.tar", "dict_name": "d"}  # fmt: skip
        server = TestServer(make_app(peer, "secret"), host="127.0.0.1")
        await server.start_server()
        address = f"127.0.0.1:{server.port}"
        try:
            config = PeerConfig(peers=(address,), token=lambda: "secret", peer_wait=0, poll=0.05)
            fetch = FetchPolicy(attempts=2, backoff=0.01, timeout=30, io_timeout=5)
            empty_cfg = AgentConfig(
                deploy_path=tmp_path / "empty",
                peer_fetch=FetchPolicy(
                    attempts=2, backoff=0.01, timeout=30, io_timeout=5,
                    sources=SourcePolicy((Prefix.parse(f"http://{address}/agent/peer/tar"),)),
                ),
                peer_token=lambda: "secret",
                fetch=fetch,
            )  # fmt: skip
            fake = FakeServer()
            empty = Agent(empty_cfg, control=fake)  # type: ignore[arg-type]
            empty.open()
            recovery = PeerRecovery(empty, config, hostname="me")
            await asyncio.wait_for(recovery.run(), 30)
            assert recovery.state.state == "recovered", recovery.state
            assert fake.cur == "100"
            assert (empty.layout.data_dir / "VERSION").read_text().strip() == "100"
            assert empty.versions["100"]["md5"] == md5
            # the transfer's own download of it later: the same tar, answered as done
            task = empty.tasks.find("download", "100")
            assert task is not None and await empty._still_done(task, {"md5": md5})
            # without the token, the peer API answers nothing
            url = f"http://{address}/agent/peer/manifest"
            async with aiohttp.ClientSession() as session, session.get(url) as reply:
                assert reply.status == 401
            # a peer whose tar is not what it states (damaged on its disk): refused by md5
            damaged = bytearray(blob)
            damaged[len(blob) // 2] ^= 0xFF
            (folder / "d_part0.tar").write_bytes(bytes(damaged))
            third = Agent(
                AgentConfig(deploy_path=tmp_path / "third", peer_fetch=empty_cfg.peer_fetch,
                            peer_token=lambda: "secret", fetch=fetch),
                control=FakeServer(),  # type: ignore[arg-type]
            )  # fmt: skip
            third.open()
            again = PeerRecovery(third, config, hostname="me")
            with pytest.raises(Exception, match="md5"):
                await again.recover_once()
            assert not (third.layout.data_dir / "VERSION").exists()
            await third.close()
            await empty.close()
        finally:
            await server.close()
            await peer.close()

    asyncio.run(scenario())
