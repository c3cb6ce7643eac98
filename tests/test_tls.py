"""TLS on the lookup port and the TCP lane (cube-server --tls_cert/--tls_key) with the SDK's
tls_ca, on real processes: clients that trust the CA are answered over the lane, clients
without it (plaintext, or another CA) are refused."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers.procs import ServerProc, fixed_values, running_server, write_version
from helpers.stubs import raw_unary
from test_server import control

from cube.client import (
    AsyncCubeClient,
    CubeClient,
    SeekResult,
    ShardUnavailableError,
    TransportName,
)

# Every test here starts processes (servers, CLIs): make quick skips them.
pytestmark = pytest.mark.slow

KEYS = np.arange(1, 2001, 2, dtype=np.uint64)


@pytest.fixture(scope="module")
def tls_server(
    tmp_path_factory: pytest.TempPathFactory, pki: dict[str, str]
) -> Iterator[ServerProc]:
    data = tmp_path_factory.mktemp("tls") / "data"
    write_version(data, "1", KEYS, fixed_values(KEYS, 16, 1), current=True)
    args = ("--tls_cert", pki["cert"], "--tls_key", pki["key"])
    with running_server(data, *args) as server:
        yield server


def lane_messages(server: ServerProc) -> int:
    messages: int = json.loads(control(server, "status").detail_json)["requests"]["lane_messages"]
    return messages


@pytest.mark.parametrize("transport", ["auto", "grpc"])
def test_clients_trusting_the_ca_are_answered(
    tls_server: ServerProc, pki: dict[str, str], transport: TransportName
) -> None:
    before = lane_messages(tls_server)
    with CubeClient(shards=[[tls_server.address]], tls_ca=pki["ca"], transport=transport) as client:
        assert client.seek(KEYS[:300]).found.all()
    used_lane = lane_messages(tls_server) - before
    assert used_lane == (1 if transport == "auto" else 0)

    async def seek_async() -> SeekResult:
        async with AsyncCubeClient(
            shards=[[tls_server.address]], tls_ca=pki["ca"], transport=transport
        ) as client:
            return await client.seek(KEYS[:300])

    assert asyncio.run(seek_async()).found.all()


@pytest.mark.parametrize("ca", [None, "other"])
def test_clients_without_the_ca_are_refused(
    tls_server: ServerProc, pki: dict[str, str], ca: str | None
) -> None:
    tls_ca = None if ca is None else pki[ca]
    with (
        CubeClient(shards=[[tls_server.address]], tls_ca=tls_ca, retry=0) as client,
        pytest.raises(ShardUnavailableError),
    ):
        client.seek(KEYS[:10])

    async def seek_async() -> None:
        async with AsyncCubeClient(shards=[[tls_server.address]], tls_ca=tls_ca, retry=0) as client:
            await client.seek(KEYS[:10])

    with pytest.raises(ShardUnavailableError):
        asyncio.run(seek_async())


def test_plaintext_lane_connection_gets_nothing(tls_server: ServerProc) -> None:
    """A raw plaintext client on the lane port: the TLS handshake fails, no answer comes."""
    import socket
    import struct

    import grpc

    from cube.wire import LANE_MAGIC, encode_seek_request

    with grpc.secure_channel(
        tls_server.address,
        grpc.ssl_channel_credentials(open(tls_server_ca_path(tls_server), "rb").read()),
    ) as channel:
        _, call = raw_unary(channel, "/cube.v1.CubeService/Seek").with_call(b"", timeout=10)
    port = next(int(v) for k, v in call.initial_metadata() if k == "cube-tcp-port")
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    request = encode_seek_request(KEYS[:5])
    sock.sendall(LANE_MAGIC + struct.pack("<I", len(request)) + request)
    try:
        reply = sock.recv(1 << 16)
    except (ConnectionResetError, TimeoutError):
        reply = b""
    assert b"\x01\x02\x03" not in reply and not reply.startswith(struct.pack("<I", 0))
    sock.close()


def tls_server_ca_path(server: ServerProc) -> str:
    args = server.args
    return args[args.index("--tls_cert") + 1].replace("cert.pem", "ca.pem")


@pytest.mark.slow
def test_bad_tls_files_are_named(tmp_path: Path, pki: dict[str, str]) -> None:
    import subprocess
    import sys

    missing = tmp_path / "nope.pem"
    done = subprocess.run(
        [sys.executable, "-m", "cube.server.main", "--tls_cert", str(missing), "--tls_key",
         pki["key"]],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and str(missing) in done.stderr
    with pytest.raises(Exception, match=r"nope\.pem"):
        CubeClient(shards=[["127.0.0.1:1"]], tls_ca=str(missing))


def test_cube_conf_tls_fields_reach_the_sdk_and_cube_cli(
    tls_server: ServerProc, pki: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """cube.conf's tls_ca (the Helm chart writes it with TLS on) is all a client needs:
    CubeClient.from_conf and cube-cli (the chart's `helm test` pod) are answered over TLS;
    the same file without it is refused, unless cube-cli's --tls_ca gives the CA."""
    from cube.client import cli

    host, port = tls_server.address.rsplit(":", 1)
    entry = {
        "dict_name": "test_dict", "shard": 1, "dup": 1, "timeout": 5000, "retry": 0,
        "backup_request": 0, "type": "ipport", "nodes": [{"ip": host, "port": int(port)}],
    }  # fmt: skip
    keys = tmp_path / "keys.txt"
    keys.write_text("\n".join(map(str, KEYS[:50].tolist())))
    plain, secure = tmp_path / "plain.conf", tmp_path / "tls.conf"
    plain.write_text(json.dumps([entry]))
    secure.write_text(json.dumps([dict(entry, tls_ca=pki["ca"])]))
    with CubeClient.from_conf(secure, dict_name="test_dict") as client:
        assert client.seek(KEYS[:300]).found.all()

    def cube_cli(conf: Path, *extra: str) -> int:
        args = ["--config_file", str(conf), "--keys", str(keys), "--batch", "50"]
        return cli.main([*args, "--requests", "1", "--dict", "test_dict", *extra])

    assert cube_cli(secure) == 0
    assert cube_cli(plain) == 1  # plaintext against a TLS port: the request fails
    assert cube_cli(plain, "--tls_ca", pki["ca"]) == 0
    assert cube_cli(secure, "--tls_ca", pki["other"]) == 1  # the flag wins: another CA
    capsys.readouterr()
