"""Files renewed under a running process (cube.security: Reloading, ServerTLS, TrustedCA,
Token), in process: the watcher on a fake clock and fake stats, then real files laid out as a
kubelet's Secret volume with TLS handshakes in memory. The processes under rotation:
tests/test_rotation.py."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from aiohttp import web
from helpers.secret_volume import Issued, SecretVolume, tls_files

from cube.client._aio_transport import AioChannels
from cube.client._sync_transport import SyncChannels
from cube.client._transport import ClientTLS
from cube.security import (
    Reloading,
    SecurityError,
    ServerTLS,
    TLSFiles,
    Token,
    TrustedCA,
    control_refusal,
    token_matches,
    token_of,
)
from cube.transfer.agents import AgentClient
from cube.transfer.config import Instance


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeFiles:
    """stat() over made-up files: path -> (inode, size, mtime); counts the calls."""

    def __init__(self, **files: tuple[int, int, int]) -> None:
        self.files = {f"/{name}": meta for name, meta in files.items()}
        self.stats = 0

    def stat(self, path: str) -> os.stat_result:
        self.stats += 1
        if path not in self.files:
            raise FileNotFoundError(path)
        inode, size, mtime = self.files[path]
        ns = {"st_mtime_ns": mtime * 10**9, "st_ctime_ns": mtime * 10**9}
        return os.stat_result((0o100644, inode, 1, 1, 0, 0, size, 0, mtime, mtime), ns)


class Loads:
    """A load function that returns the next value, or raises what it is told to."""

    def __init__(self) -> None:
        self.count = 0
        self.failure: Exception | None = None
        self.during: Callable[[], None] | None = None  # runs inside the load

    def __call__(self) -> int:
        self.count += 1
        if self.during is not None:
            self.during()
        if self.failure is not None:
            raise self.failure
        return self.count


def reloading(files: FakeFiles, clock: Clock, loads: Loads) -> Reloading[int]:
    return Reloading("test files", ("/a", "/b"), loads, interval=1.0, clock=clock, stat=files.stat)


def test_files_are_looked_at_once_a_second_at_most() -> None:
    files, clock, loads = FakeFiles(a=(1, 10, 5), b=(2, 10, 5)), Clock(), Loads()
    value = reloading(files, clock, loads)
    stats = files.stats  # the first load's
    for _ in range(1000):
        assert value.current() == 1
    clock.now += 0.999
    assert value.current() == 1 and files.stats == stats  # one clock read a call, no stat
    clock.now += 0.001
    assert value.current() == 1 and files.stats == stats + 2  # a stat per file
    assert value.current() == 1 and files.stats == stats + 2
    assert loads.count == 1 and value.generation == 0


def test_a_changed_file_is_loaded_again_at_the_next_look() -> None:
    files, clock, loads = FakeFiles(a=(1, 10, 5), b=(2, 10, 5)), Clock(), Loads()
    value = reloading(files, clock, loads)
    files.files["/b"] = (3, 10, 5)  # another inode: a swapped ..data symlink
    assert value.current() == 1  # not looked yet
    clock.now += 1
    assert value.current() == 2 and value.generation == 1
    files.files["/a"] = (1, 11, 6)  # rewritten in place
    clock.now += 1
    assert value.state() == (2, 3)


def test_a_load_that_fails_keeps_the_value_and_warns_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    files, clock, loads = FakeFiles(a=(1, 10, 5), b=(2, 10, 5)), Clock(), Loads()
    value = reloading(files, clock, loads)
    loads.failure = SecurityError("key values mismatch")
    files.files["/a"] = (7, 10, 5)  # half of a pair renewed
    with caplog.at_level(logging.WARNING, "cube.security"):
        for _ in range(5):
            clock.now += 1
            assert value.current() == 1
    assert loads.count == 2  # tried once for this state of the files
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "test files changed but cannot be used, the one before stays in use: key values mismatch"
    ]
    loads.failure = None
    files.files["/b"] = (8, 10, 5)  # the other half
    clock.now += 1
    assert value.current() == 3 and value.generation == 1


def test_files_changing_during_a_load_are_loaded_again() -> None:
    files, clock, loads = FakeFiles(a=(1, 10, 5), b=(2, 10, 5)), Clock(), Loads()
    value = reloading(files, clock, loads)
    files.files["/a"] = (4, 10, 5)

    def renewed_again() -> None:
        files.files["/b"] = (5, 10, 5)
        loads.during = None

    loads.during = renewed_again
    clock.now += 1
    assert value.current() == 1  # what the load read may be a mix: not used
    clock.now += 1
    assert value.current() == 3 and value.generation == 1


def test_a_missing_file_at_start_is_the_callers_error() -> None:
    files, clock = FakeFiles(), Clock()

    def load() -> int:
        raise SecurityError("TLS file /a: No such file or directory")

    with pytest.raises(SecurityError, match="/a"):
        Reloading("x", ("/a",), load, clock=clock, stat=files.stat)


# ---------------------------------------------------------------------------------------------
# real files, a Secret volume's layout; TLS handshakes in memory


def handshake(server: ssl.SSLContext, client: ssl.SSLContext) -> tuple[ssl.SSLObject, Any]:
    """A TLS handshake between the two contexts over memory BIOs: the client's SSLObject and
    a function moving bytes both ways (the connection stays usable)."""
    to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    from_server, from_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    server_end = server.wrap_bio(to_server, from_server, server_side=True)
    client_end = client.wrap_bio(to_client, from_client, server_hostname="localhost")

    def pump() -> None:
        to_server.write(from_client.read())
        to_client.write(from_server.read())

    for _ in range(10):
        done = 0
        for end in (client_end, server_end):
            try:
                end.do_handshake()
                done += 1
            except ssl.SSLWantReadError:
                pass
            pump()
        if done == 2:
            break

    def echo(data: bytes) -> bytes:
        client_end.write(data)
        pump()
        got = server_end.read(len(data))
        server_end.write(got)
        pump()
        return client_end.read(len(data))

    return client_end, echo


def trusting(*issued: Issued) -> ssl.SSLContext:
    context = ssl.create_default_context()
    for item in issued:
        item.ca.configure_trust(context)
    return context


@pytest.fixture(scope="module")
def certs() -> tuple[Issued, Issued]:
    return Issued(), Issued()


def test_servers_hand_new_connections_the_renewed_certificate(
    tmp_path: Path, certs: tuple[Issued, Issued]
) -> None:
    old, new = certs
    volume = SecretVolume(tmp_path / "tls", tls_files(old))
    clock = Clock()
    tls = ServerTLS(TLSFiles(volume.path("tls.crt"), volume.path("tls.key")), clock=clock)
    context = tls.context()
    assert tls.context() is context  # one context, for every socket server of the process
    before, echo = handshake(context, trusting(old))
    assert before.getpeercert(binary_form=True) == old.der
    volume.update(tls_files(new, old, new))
    clock.now += 1
    after, _ = handshake(context, trusting(new))
    assert after.getpeercert(binary_form=True) == new.der
    assert echo(b"still here") == b"still here"  # the connection made before goes on
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(context, trusting(old))  # (do_handshake raises on the client)


def test_a_pair_that_does_not_match_keeps_the_one_before(
    tmp_path: Path, certs: tuple[Issued, Issued], caplog: pytest.LogCaptureFixture
) -> None:
    old, new = certs
    volume = SecretVolume(tmp_path / "tls", tls_files(old))
    clock = Clock()
    tls = ServerTLS(TLSFiles(volume.path("tls.crt"), volume.path("tls.key")), clock=clock)
    volume.update({"tls.crt": new.cert, "tls.key": old.key})  # half renewed
    with caplog.at_level(logging.WARNING, "cube.security"):
        for _ in range(3):
            clock.now += 1
            client, _ = handshake(tls.context(), trusting(old))
            assert client.getpeercert(binary_form=True) == old.der
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "stays in use" in warnings[0], warnings
    assert tls.pair.generation == 0
    volume.update(tls_files(new))
    clock.now += 1
    client, _ = handshake(tls.context(), trusting(new))
    assert client.getpeercert(binary_form=True) == new.der


def test_grpc_credentials_are_one_per_port(tmp_path: Path, certs: tuple[Issued, Issued]) -> None:
    old, _ = certs
    volume = SecretVolume(tmp_path / "tls", tls_files(old))
    tls = ServerTLS(TLSFiles(volume.path("tls.crt"), volume.path("tls.key")))
    first, second = tls.grpc_credentials(), tls.grpc_credentials()
    assert isinstance(first, grpc.ServerCredentials) and first is not second


def test_clients_trust_the_renewed_bundle(tmp_path: Path, certs: tuple[Issued, Issued]) -> None:
    old, new = certs
    volume = SecretVolume(tmp_path / "tls", tls_files(old))
    clock = Clock()
    trust = TrustedCA(volume.path("ca.crt"), clock=clock)
    server = ServerTLS(TLSFiles(volume.path("tls.crt"), volume.path("tls.key")), clock=clock)
    handshake(server.context(), trust.context())
    first = trust.context()
    # a CA rotation: the bundle holds both, the certificate is renewed, the old CA dropped
    for files, generation in (
        (tls_files(old, old, new), 1),
        (tls_files(new, old, new), 2),
        (tls_files(new, new), 3),
    ):
        volume.update(files)
        clock.now += 1
        client, _ = handshake(server.context(), trust.context())
        assert client.getpeercert(binary_form=True) == ssl.PEM_cert_to_DER_cert(
            files["tls.crt"].decode()
        )
        assert trust.generation == generation
    assert trust.context() is not first
    assert trust.credentials() is not None
    assert len(trust.context().get_ca_certs()) == 1
    old_server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    old.ca.issue_cert("localhost").configure_cert(old_server)
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(old_server, trust.context())


def test_a_bundle_that_does_not_load_keeps_the_one_before(
    tmp_path: Path, certs: tuple[Issued, Issued]
) -> None:
    old, _ = certs
    volume = SecretVolume(tmp_path / "tls", tls_files(old))
    clock = Clock()
    trust = TrustedCA(volume.path("ca.crt"), clock=clock)
    volume.update({**tls_files(old), "ca.crt": b"-----BEGIN CERTIFICATE-----\ncut sho"})
    clock.now += 1
    assert trust.generation == 0
    handshake(ServerTLS(TLSFiles(volume.path("tls.crt"), volume.path("tls.key"))).context(),
              trust.context())  # fmt: skip


def test_tokens_from_a_renewed_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    volume = SecretVolume(tmp_path / "tokens", {"token": b"old\n"})
    clock = Clock()
    token = Token(path=volume.path("token"), clock=clock)
    assert token and token.value == "old" and token.accepts("old") and not token.accepts("new")
    assert not token.accepts(None) and "old" not in repr(token)
    # the rotation: accept both, send the new one, drop the old one
    steps = [(b"old\nnew\n", "old", True), (b"new\n\nold\n", "new", True), (b"new", "new", False)]
    for content, sent, old_accepted in steps:
        volume.update({"token": content})
        clock.now += 1
        assert token.value == sent and token.accepts("new")
        assert token.accepts("old") is old_accepted
        assert token_matches("new", token) and control_refusal("0.0.0.0", token, False, "x")
    volume.update({"token": b"\n \n"})  # emptied: keep the tokens before
    clock.now += 1
    with caplog.at_level(logging.WARNING, "cube.security"):
        assert token.value == "new"
    assert "no token in it" in caplog.text


def test_token_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "token"
    path.write_text("from-file\n")
    monkeypatch.setenv("CUBE_TEST_TOKEN", "from-env")
    assert token_of("given", "", "CUBE_TEST_TOKEN").value == "given"
    assert token_of("", str(path), "CUBE_TEST_TOKEN").value == "from-file"
    assert token_of("", "", "CUBE_TEST_TOKEN").value == "from-env"
    assert not token_of("", "", "CUBE_NO_SUCH_TOKEN") and Token().accepts(None)
    with pytest.raises(SecurityError, match="give one"):
        token_of("given", str(path), "CUBE_TEST_TOKEN")
    with pytest.raises(SecurityError, match="no token in it"):
        path.write_text("\n")
        Token(path=str(path))
    with pytest.raises(SecurityError, match="spaces"):
        path.write_text("two words\n")
        Token(path=str(path))
    with pytest.raises(SecurityError, match="No such file"):
        Token(path=str(tmp_path / "missing"))


def test_sdk_channels_are_renewed_with_the_bundle(
    tmp_path: Path, certs: tuple[Issued, Issued]
) -> None:
    """A gRPC channel keeps the credentials it was made with: when the CA bundle changes, the
    SDK's calls go to new channels; the old ones are closed later (calls in flight finish)."""
    old, new = certs
    volume = SecretVolume(tmp_path / "tls", tls_files(old))
    tls = ClientTLS(volume.path("ca.crt"))
    channels = SyncChannels("/cube.v1.CubeService/Seek", tls=tls)
    try:
        first = channels._callable("127.0.0.1:1")
        assert channels._callable("127.0.0.1:1") is first
        volume.update(tls_files(old, old, new))
        assert tls.trust.trust.check()  # (the next look, now)
        second = channels._callable("127.0.0.1:1")
        assert second is not first and len(channels._retired) == 1
    finally:
        channels.close()
    assert not channels._retired


def test_asyncio_sdk_channels_are_renewed_with_the_bundle(
    tmp_path: Path, certs: tuple[Issued, Issued]
) -> None:
    """As above for AsyncCubeClient's channels: the old ones close gracefully (their calls
    in flight finish first), at the latest when the client closes."""
    old, new = certs
    volume = SecretVolume(tmp_path / "tls", tls_files(old))
    tls = ClientTLS(volume.path("ca.crt"))

    async def run() -> None:
        channels = AioChannels("/cube.v1.CubeService/Seek", tls=tls)
        try:
            first = channels._callable("127.0.0.1:1")
            volume.update(tls_files(old, old, new))
            assert tls.trust.trust.check()
            assert channels._callable("127.0.0.1:1") is not first
            assert len(channels._retired) == 1
            await asyncio.sleep(0.1)  # no call in flight: closed at once
            assert not channels._retired
        finally:
            await channels.close()

    asyncio.run(run())


# ---------------------------------------------------------------------------------------------
# the transfer's calls to agents: https trusting a renewed bundle, a renewed token


def test_the_transfer_calls_agents_through_a_rotation(
    tmp_path: Path, certs: tuple[Issued, Issued]
) -> None:
    """AgentClient (in process, against an aiohttp server as the agent's): the agent's
    certificate renewed by a new CA and the agent token renewed, each call answered; new
    connections see the new certificate."""
    old, new = certs
    volume = SecretVolume(tmp_path / "tls", {**tls_files(old), "agent-token": b"t1\n"})
    served: list[str] = []

    async def status(request: web.Request) -> web.Response:
        served.append(request.headers.get("Authorization", ""))
        return web.json_response({"success": "0", "message": "", "data": {"status": "RUNNING"}})

    async def peer_certificate(port: int, context: ssl.SSLContext) -> bytes:
        _, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=context, server_hostname="localhost"
        )
        der: bytes = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        writer.close()
        return der

    async def run() -> list[bytes]:
        clock = Clock()
        app = web.Application()
        app.router.add_get("/agent/status", status)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        files = TLSFiles(volume.path("tls.crt"), volume.path("tls.key"))
        listening = socket.create_server(("127.0.0.1", 0))
        port = listening.getsockname()[1]
        site = web.SockSite(runner, listening, ssl_context=ServerTLS(files, clock=clock).context())
        await site.start()
        inst = Instance(0, 0, "127.0.0.1", port, "127.0.0.1", 1, "/deploy")
        peers: list[bytes] = []
        try:
            async with aiohttp.ClientSession() as session:
                trust = TrustedCA(volume.path("ca.crt"), clock=clock)
                token = Token(path=volume.path("agent-token"), clock=clock)
                client = AgentClient(session, token, scheme="https", trust=trust)
                for renewed in (
                    {**tls_files(old, old, new), "agent-token": b"t2\n"},
                    {**tls_files(new, old, new), "agent-token": b"t2\n"},
                    {**tls_files(new, new), "agent-token": b"t2\n"},
                ):
                    assert (await client.status(inst))["status"] == "RUNNING"
                    volume.update(renewed)
                    clock.now += 1
                    assert (await client.status(inst))["status"] == "RUNNING"
                    peers.append(await peer_certificate(port, trust.context()))
        finally:
            await runner.cleanup()
        return peers

    assert asyncio.run(run()) == [old.der, new.der, new.der]
    assert served == ["Bearer t1"] + ["Bearer t2"] * 5
