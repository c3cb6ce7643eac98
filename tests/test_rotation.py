"""Certificates, CA bundles and token files renewed under running processes, as the kubelet
renews a mounted Secret (tests/helpers/secret_volume.py: an atomic swap of `..data`), with
clients calling all along: cube-server (gRPC and the TCP lane) under SDK lookups, cube-agent
and cube-transfer under HTTPS API calls. A CA rotation goes as cert-manager's does: the bundle
first holds the old and the new CA, then the certificate is renewed by the new CA, then the
bundle holds the new CA alone. No call fails, connections made before go on, and new
connections get the new certificate. The watcher itself: tests/test_reload.py."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
from helpers.agent_helpers import AgentProc
from helpers.procs import fixed_values, running_server, write_version
from helpers.secret_volume import Issued, SecretVolume, tls_files
from test_tls import lane_messages
from test_transfer_security import listening_port, transfer_conf

from cube.client import CubeClient, ShardUnavailableError, TransportName
from cube.processes import poll_until, spawn, stop_child
from cube.transfer.local import command

# Every test here starts processes (servers, CLIs): make quick skips them.
pytestmark = pytest.mark.slow

KEYS = np.arange(1, 2001, 2, dtype=np.uint64)
WAIT = 30.0
LOOK_S = 1.0  # cube.security.RELOAD_CHECK_S: how often the processes look at their files


def presented(port: int, alpn: bool = False) -> bytes:
    """The certificate a new TLS connection to `port` is handshaken with (DER; not verified:
    which one it is, is the question)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    if alpn:  # gRPC speaks HTTP/2
        context.set_alpn_protocols(["h2"])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as sock,
        context.wrap_socket(sock) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def presents(port: int, issued: Issued, alpn: bool = False) -> None:
    """Wait (bounded) until new connections to `port` get `issued`'s certificate."""
    assert poll_until(lambda: presented(port, alpn) == issued.der, WAIT, 0.1), port


class Loop(threading.Thread):
    """One caller calling in a loop until stopped, counting what it got: `call` returns
    whether the answer was right (an exception is a failure too, its text kept)."""

    def __init__(self, name: str, call: Callable[[], bool]) -> None:
        super().__init__(name=name, daemon=True)
        self.call = call
        self.ok = 0
        self.failures: list[str] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                if self.call():
                    self.ok += 1
                else:
                    self.failures.append("wrong answer")
            except Exception as exc:
                self.failures.append(f"{type(exc).__name__}: {exc}"[:300])

    def stop(self) -> None:
        self.stopping.set()
        self.join(WAIT)
        assert not self.is_alive(), f"{self.name} did not stop"


@contextlib.contextmanager
def looping(*loops: Loop) -> Iterator[None]:
    for loop in loops:
        loop.start()
    try:
        yield
    finally:
        for loop in loops:
            loop.stop()


def progress(loops: Sequence[Loop], more: int = 10, at_least_s: float = 0.0) -> None:
    """Wait (bounded) until every loop has had `more` more answers and `at_least_s` seconds
    have passed (time for every process to look at its files)."""
    start = time.monotonic()
    marks = [loop.ok for loop in loops]

    def moved() -> bool:
        enough = all(loop.ok >= mark + more for loop, mark in zip(loops, marks, strict=True))
        return enough and time.monotonic() - start >= at_least_s

    assert poll_until(moved, WAIT, 0.05), [(x.name, x.ok, x.failures[:3]) for x in loops]


def no_failures(*loops: Loop) -> None:
    for loop in loops:
        assert loop.ok > 0 and not loop.failures, (loop.name, loop.ok, loop.failures[:5])


def test_server_certificate_and_ca_rotation_under_lookups(tmp_path: Path) -> None:
    """cube-server's lookup port and TCP lane renew their certificate, SDK clients their CA
    bundle, while three callers loop: a client on the lane, one over gRPC (both kept from the
    start, retry=0: any failed attempt fails the lookup) and a new client for every lookup."""
    old, new = Issued(), Issued()
    volume = SecretVolume(tmp_path / "tls", tls_files(old))
    data = tmp_path / "data"
    write_version(data, "1", KEYS, fixed_values(KEYS, 16, 1), current=True)
    args = ("--tls_cert", volume.path("tls.crt"), "--tls_key", volume.path("tls.key"))
    ca = volume.path("ca.crt")  # what the chart's cube.conf names: the Secret's ca.crt
    with running_server(data, *args) as server:
        lane_port = server.written_ports()["tcp_ports"][0]

        def client(transport: TransportName = "auto", tls_ca: str = ca) -> CubeClient:
            # no retry: a failed attempt fails the lookup; a timeout that a loaded machine
            # does not reach (a refused certificate fails at once)
            return CubeClient(
                [[server.address]], tls_ca=tls_ca, transport=transport, retry=0, timeout=10
            )

        def kept(client: CubeClient) -> Callable[[], bool]:
            return lambda: bool(client.seek(KEYS[:100]).found.all())

        def fresh() -> bool:
            with client() as made:
                return bool(made.seek(KEYS[:100]).found.all())

        lanes_before = lane_messages(server)
        with client("auto") as on_lane, client("grpc") as on_grpc:
            loops = (Loop("lane", kept(on_lane)), Loop("grpc", kept(on_grpc)), Loop("new", fresh))
            with looping(*loops):
                progress(loops)
                assert presented(server.port, alpn=True) == presented(lane_port) == old.der
                volume.update(tls_files(old, old, new))  # 1: the bundle trusts both CAs
                progress(loops, at_least_s=2 * LOOK_S)
                volume.update(tls_files(new, old, new))  # 2: the certificate renewed
                presents(server.port, new, alpn=True)
                presents(lane_port, new)
                progress(loops, at_least_s=2 * LOOK_S)
                volume.update(tls_files(new, new))  # 3: the old CA dropped
                progress(loops, at_least_s=2 * LOOK_S)
            no_failures(*loops)
            assert lane_messages(server) - lanes_before >= loops[0].ok  # the lane client's
            reloads = server.log().count("changed: reloaded")
            assert reloads >= 3, server.log()[-3000:]
            # the clients kept from the start make new connections trusting the new CA alone:
            # the server restarted where it was (a new lane port), they find it again
            server.stop()
            ports = {"ports": server.ports, "control_ports": server.control_ports}
            with running_server(data, *args, **ports):
                for name, kept_client in (("lane", on_lane), ("grpc", on_grpc)):
                    assert poll_until(answers(kept_client), WAIT, 0.1), name
                # new clients: verified with the new CA alone, and refused to the old one's
                old_ca = tmp_path / "old-ca.pem"
                old_ca.write_bytes(old.ca_pem)
                for transport in ("auto", "grpc"):
                    with client(transport) as made:
                        assert made.seek(KEYS).found.all()
                    with (
                        client(transport, str(old_ca)) as made,
                        pytest.raises(ShardUnavailableError),
                    ):
                        made.seek(KEYS[:10])


def answers(client: CubeClient) -> Callable[[], bool]:
    def answered() -> bool:
        try:
            return bool(client.seek(KEYS[:10]).found.all())
        except ShardUnavailableError:
            return False

    return answered


def api_callers(
    url: str, volume: SecretVolume, path: str
) -> tuple[Loop, Loop, http.client.HTTPSConnection]:
    """Two callers of `url + path` that send the token of `volume`'s token file and trust its
    ca.crt, read before each call as a process following the Secret would: one on a new
    connection each call, one on a keep-alive connection opened at the start (which must
    last: the connection's socket stays the same)."""

    def token() -> str:
        return Path(volume.path("token")).read_text().split()[0]  # the first: the one sent

    def answered(status: int, body: bytes) -> bool:
        return status == 200 and json.loads(body).get("success") == "0"

    def new_connection() -> bool:
        context = ssl.create_default_context(cadata=Path(volume.path("ca.crt")).read_text())
        headers = {"Authorization": f"Bearer {token()}"}
        request = urllib.request.Request(url + path, headers=headers)
        try:
            with urllib.request.urlopen(request, context=context, timeout=10) as reply:
                return answered(reply.status, reply.read())
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"HTTP {exc.code}: {exc.read()[:200]!r}") from None

    host, port = url.removeprefix("https://").rsplit(":", 1)
    context = ssl.create_default_context(cadata=Path(volume.path("ca.crt")).read_text())
    connection = http.client.HTTPSConnection(host, int(port), context=context, timeout=10)

    def keep_alive() -> bool:
        connection.request("GET", path, headers={"Authorization": f"Bearer {token()}"})
        reply = connection.getresponse()
        return answered(reply.status, reply.read())

    return Loop("new connections", new_connection), Loop("keep-alive", keep_alive), connection


def rotate_under_calls(url: str, volume: SecretVolume, path: str, old: Issued, new: Issued) -> None:
    """The CA rotation (above) and a token rotation (`t1`; `t1`+`t2`, `t2`+`t1`, `t2`: the
    first is sent, each accepted) in the same three Secret updates, under both callers."""
    port = int(url.rsplit(":", 1)[1])
    *loops, connection = api_callers(url, volume, path)
    with looping(*loops):
        progress(loops)
        sock = connection.sock
        assert presented(port) == old.der
        volume.update({**tls_files(old, old, new), "token": b"t1\nt2\n"})
        progress(loops, at_least_s=2 * LOOK_S)
        volume.update({**tls_files(new, old, new), "token": b"t2\nt1\n"})
        presents(port, new)
        progress(loops, at_least_s=2 * LOOK_S)
        volume.update({**tls_files(new, new), "token": b"t2\n"})
        progress(loops, at_least_s=2 * LOOK_S)
    no_failures(*loops)
    assert connection.sock is sock  # never reconnected
    connection.close()
    refused = urllib.request.Request(url + path, headers={"Authorization": "Bearer t1"})
    context = ssl.create_default_context(cadata=new.ca_pem.decode())
    with pytest.raises(urllib.error.HTTPError) as old_token:
        urllib.request.urlopen(refused, context=context, timeout=10)
    assert old_token.value.code == 401


def test_agent_certificate_and_token_rotation_under_calls(tmp_path: Path) -> None:
    old, new = Issued(), Issued()
    volume = SecretVolume(tmp_path / "secret", {**tls_files(old), "token": b"t1\n"})
    agent = AgentProc(
        tmp_path / "deploy", "127.0.0.1:1",
        "--tls_cert", volume.path("tls.crt"), "--tls_key", volume.path("tls.key"),
        "--token_file", volume.path("token"),
    )  # fmt: skip
    agent.start()
    try:
        rotate_under_calls(agent.url, volume, "/agent/status", old, new)
    finally:
        agent.stop()
    log = (tmp_path / "agent-deploy.log").read_text()
    assert log.count("changed: reloaded") >= 4, log[-3000:]  # the pair 3 times, the token


def test_transfer_certificate_and_token_rotation_under_calls(tmp_path: Path) -> None:
    old, new = Issued(), Issued()
    volume = SecretVolume(tmp_path / "secret", {**tls_files(old), "token": b"t1\n"})
    conf = transfer_conf(
        tmp_path / "transfer", "127.0.0.1:1", "127.0.0.1:2", tmp_path / "deploy",
        tls_cert=volume.path("tls.crt"), tls_key=volume.path("tls.key"),
        api_token_file=volume.path("token"), agent_token_file=volume.path("token"),
        agent_tls_ca=volume.path("ca.crt"),
    )  # fmt: skip
    log = tmp_path / "transfer.log"
    transfer = spawn([command("cube-transfer"), "-p", "0", "--config", str(conf)], log)
    try:
        port = listening_port(log, transfer)
        rotate_under_calls(f"https://127.0.0.1:{port}", volume, "/dict/info", old, new)
    finally:
        stop_child(transfer, 15)
    assert log.read_text().count("changed: reloaded") >= 4, log.read_text()[-3000:]
