"""TLS on the lookup port and the TCP lane (cube-server --tls_cert/--tls_key) with the SDK's
tls_ca, on real processes: clients that trust the CA are answered over the lane, clients
without it (plaintext, or another CA) are refused."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from procs import fixed_values, running_server, write_version
from test_server import control

from cube.client import AsyncCubeClient, CubeClient, ShardUnavailableError

KEYS = np.arange(1, 2001, 2, dtype=np.uint64)


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory, pki):
    data = tmp_path_factory.mktemp("tls") / "data"
    write_version(data, "1", KEYS, fixed_values(KEYS, 16, 1), current=True)
    args = ("--tls_cert", pki["cert"], "--tls_key", pki["key"])
    with running_server(data, *args) as server:
        yield server


def lane_messages(server) -> int:
    return json.loads(control(server, "status").detail_json)["requests"]["lane_messages"]


@pytest.mark.parametrize("transport", ["auto", "grpc"])
def test_clients_trusting_the_ca_are_answered(tls_server, pki, transport):
    before = lane_messages(tls_server)
    with CubeClient(shards=[[tls_server.address]], tls_ca=pki["ca"], transport=transport) as client:
        assert client.seek(KEYS[:300]).found.all()
    used_lane = lane_messages(tls_server) - before
    assert used_lane == (1 if transport == "auto" else 0)

    async def seek_async():
        async with AsyncCubeClient(
            shards=[[tls_server.address]], tls_ca=pki["ca"], transport=transport
        ) as client:
            return await client.seek(KEYS[:300])

    assert asyncio.run(seek_async()).found.all()


@pytest.mark.parametrize("ca", [None, "other"])
def test_clients_without_the_ca_are_refused(tls_server, pki, ca):
    tls_ca = None if ca is None else pki[ca]
    with (
        CubeClient(shards=[[tls_server.address]], tls_ca=tls_ca, retry=0) as client,
        pytest.raises(ShardUnavailableError),
    ):
        client.seek(KEYS[:10])

    async def seek_async():
        async with AsyncCubeClient(shards=[[tls_server.address]], tls_ca=tls_ca, retry=0) as client:
            await client.seek(KEYS[:10])

    with pytest.raises(ShardUnavailableError):
        asyncio.run(seek_async())


def test_plaintext_lane_connection_gets_nothing(tls_server):
    """A raw plaintext client on the lane port: the TLS handshake fails, no answer comes."""
    import socket
    import struct

    import grpc

    from cube.wire import LANE_MAGIC, encode_seek_request

    with grpc.secure_channel(
        tls_server.address,
        grpc.ssl_channel_credentials(open(tls_server_ca_path(tls_server), "rb").read()),
    ) as channel:
        _, call = channel.unary_unary("/cube.v1.CubeService/Seek").with_call(b"", timeout=10)
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


def tls_server_ca_path(server) -> str:
    args = server.args
    return args[args.index("--tls_cert") + 1].replace("cert.pem", "ca.pem")


def test_bad_tls_files_are_named(tmp_path, pki):
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
