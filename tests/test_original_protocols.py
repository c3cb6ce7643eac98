"""The original cube-server's faces: HTTP+JSON (`--http_port`) and baidu_std
(`--baidu_std_port`), as the original's demos, curl, the original cube-agent and the C++
cube-api reach them.

The JSON encoder and parser are checked against a plain reference (json + base64); the rest
runs a real cube-server: the answers equal rec.mcube.DictService's over gRPC, refusals are
HTTP statuses and brpc error codes (never silent misses, never the request's content echoed),
bad baidu_std frames close the connection with nothing sent, and control follows the control
port's token rule. baidu_std frames come from tests/helpers/brpc_client.py, written from brpc's
published description (no brpc peer exists on this machine).
"""

from __future__ import annotations

import base64
import http.client
import json
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest
from helpers.brpc_client import (
    BrpcClient,
    RequestMeta,
    closed_without_answer,
    frame,
    read_reply,
    request_meta,
)
from helpers.procs import ServerProc, expected_fixed, fixed_values, running_server, write_version
from helpers.stubs import control_stub, dict_stub

from cube.pb import cube_pb2
from cube.processes import _port_free, free_port, poll_until
from cube.server.encoders import Answer
from cube.server.original import control_request, keys_array, seek_json, seek_request
from cube.server.service import RequestError

MISS = 0xFFFFFFFF
DICT = "rec.mcube.DictService"
SECRET = "s3cr3t-marker"  # put in bad requests: no answer may repeat it

# ---------------------------------------------------------------------------------------------
# the JSON codec (no process)


def reference_json(
    found: Sequence[bool] | np.ndarray, values: Sequence[bytes], version: str | None
) -> dict[str, object]:
    """What brpc's json2pb makes of a DictResponse (bytes as base64, empty arrays left out)."""
    answer: dict[str, object] = {}
    if len(found):
        answer["values"] = [
            {"status": 0 if hit else MISS, "value": base64.b64encode(value).decode()}
            for hit, value in zip(found, values, strict=True)
        ]
    if version is not None:
        answer["version"] = version
    return answer


@pytest.mark.parametrize("seed", range(4))
def test_seek_json_matches_the_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(150):
        n = int(rng.integers(0, 60))
        found = rng.random(n) < rng.random()
        if rng.random() < 0.5:  # fixed width, zero rows for misses
            width = int(rng.integers(1, 30))
            rows = rng.integers(0, 256, (n, width), dtype=np.uint8)
            rows[~found] = 0
            answer = Answer(found, rows, width, None)
            values = [bytes(row) if hit else b"" for row, hit in zip(rows, found, strict=True)]
        else:  # variable width, offsets that need not start at 0
            lengths = rng.integers(0, 14, n) * found
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            offsets += int(rng.integers(0, 5))
            blob = rng.integers(0, 256, int(offsets[-1]), dtype=np.uint8)
            answer = Answer(found, blob, 0, offsets)
            values = [bytes(blob[offsets[i] : offsets[i + 1]]) for i in range(n)]
        version = [None, "", "100_200"][int(rng.integers(0, 3))]
        text = seek_json(answer, version)
        assert json.loads(text) == reference_json(found, values, version)
        assert b" " not in text  # compact, as brpc writes it


def test_json_keys_numbers_and_decimal_strings() -> None:
    keys = keys_array([0, 1, "2", 2**64 - 1, str(2**64 - 1)])
    assert keys.dtype == np.uint64
    assert keys.tolist() == [0, 1, 2, 2**64 - 1, 2**64 - 1]
    assert keys_array([]).shape == (0,)


@pytest.mark.parametrize(
    "bad", [-1, 2**64, 1.0, 1e3, True, None, "-1", "0x10", " 7", "1" * 21, [1], {"k": 1}]
)
def test_json_bad_key_is_named_by_position(bad: object) -> None:
    with pytest.raises(RequestError) as info:
        keys_array([5, bad])
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "keys[1]" in info.value.message


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (f'{{"keys": [1, "{SECRET}"'.encode(), "not JSON"),
        (f'["{SECRET}"]'.encode(), "not a JSON object"),
        (f'{{"keys": "{SECRET}"}}'.encode(), "keys is not an array"),
        (f'{{"keys": [], "version_required": "{SECRET}"}}'.encode(), "version_required"),
        (b'{"keys": [NaN]}', "not JSON"),
        (b'{"keys": [1], "table": 5}', "table is not a string"),
        (b"\xff" + SECRET.encode(), "not UTF-8"),
        (b"[" * 100000, "not JSON"),
    ],
)
def test_json_bad_bodies_name_the_problem_not_the_content(body: bytes, words: str) -> None:
    with pytest.raises(RequestError) as info:
        seek_request(body)
    assert words in info.value.message and SECRET not in info.value.message


def test_json_seek_request_defaults_and_ignores_other_members() -> None:
    assert seek_request(b"{}") == ([], False, "")
    assert seek_request(b'{"keys": null, "version_required": null}') == ([], False, "")
    assert seek_request(b'{"keys": [3], "version_required": true, "x": 1}') == ([3], True, "")
    assert seek_request(b'{"keys": [3], "table": "001"}') == ([3], False, "001")


def test_control_json_fields() -> None:
    request = control_request(b'{"cmd": "bg_load_base", "version_path": "/7", "other": 1}')
    assert (request.cmd, request.version_path, request.HasField("version")) == (
        "bg_load_base",
        "/7",
        False,
    )
    for body, words in (
        (b'{"version": "7"}', "cmd"),
        (b'{"cmd": "enable", "version": 7}', "version"),
    ):
        with pytest.raises(RequestError) as info:
            control_request(body)
        assert words in info.value.message


# ---------------------------------------------------------------------------------------------
# a real server


def post(
    port: int, path: str, body: bytes, headers: dict[str, str] | None = None
) -> tuple[int, str, bytes]:
    """(status, content type, body) of one HTTP POST."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request("POST", path, body, headers or {})
        reply = connection.getresponse()
        return reply.status, reply.getheader("Content-Type", ""), reply.read()
    finally:
        connection.close()


def post_json(
    port: int, path: str, payload: object, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    """(status, the JSON answer when 200, else the text)."""
    status, _type, body = post(port, path, json.dumps(payload).encode(), headers)
    return status, (json.loads(body) if status == 200 else body.decode())


def grpc_seek(
    server: ServerProc, keys: Sequence[int], version_required: bool = True
) -> cube_pb2.DictResponse:
    with grpc.insecure_channel(server.address) as channel:
        request = cube_pb2.DictRequest(keys=keys, version_required=version_required)
        response: cube_pb2.DictResponse = dict_stub(channel).seek(request, timeout=10)
        return response


def as_json(response: cube_pb2.DictResponse) -> dict[str, object]:
    """A DictResponse as brpc's json2pb writes it."""
    found = [v.status == 0 for v in response.values]
    values = [v.value for v in response.values]
    return reference_json(found, values, response.version if response.HasField("version") else None)


KEYS = np.arange(1, 9000, 3, dtype=np.uint64)  # version 100: width 12, tag 1


@dataclass
class Faces:
    """A running cube-server and the ports of its two original faces."""

    proc: ServerProc
    http: int
    brpc: int


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Faces]:
    data = tmp_path_factory.mktemp("original") / "data"
    write_version(data, "100", KEYS, fixed_values(KEYS, 12, tag=1), current=True)
    args = ("--http_port", "0", "--baidu_std_port", "0", "--max_batch", "1000")
    with running_server(data, *args) as proc:
        proc.wait_serving()
        ports = proc.written_ports()
        yield Faces(proc=proc, http=ports["http_ports"][0], brpc=ports["baidu_std_ports"][0])


QUERY = [int(KEYS[7]), 2, int(KEYS[0]), 2**64 - 1, int(KEYS[7]), int(KEYS[-1])]


@pytest.mark.slow
def test_http_seek_hits_misses_order_and_version(server: Faces) -> None:
    status, answer = post_json(server.http, "/DictService/seek", {"keys": QUERY})
    assert status == 200
    assert [v["status"] for v in answer["values"]] == [0, MISS, 0, MISS, 0, 0]
    assert "version" not in answer
    first = base64.b64decode(answer["values"][0]["value"])
    assert first == expected_fixed(KEYS[7:8], 12, 1).tobytes()
    assert answer["values"][1]["value"] == "" and answer["values"][4] == answer["values"][0]
    # the same answer as rec.mcube.DictService over gRPC, version included when asked
    status, answer = post_json(
        server.http, "/DictService/seek", {"keys": QUERY, "version_required": True}
    )
    assert answer == as_json(grpc_seek(server.proc, QUERY)) and answer["version"] == "100"


@pytest.mark.slow
def test_http_seek_as_the_original_clients_send_it(server: Faces) -> None:
    """The Go demo (application/json), curl -d (form-urlencoded), the full service name,
    decimal-string keys, no keys at all, and the protobuf body brpc takes as well."""
    body = json.dumps({"keys": QUERY}).encode()
    expected = as_json(grpc_seek(server.proc, QUERY, version_required=False))
    for path, ctype in (
        ("/DictService/seek", "application/json"),
        ("/DictService/seek", "application/x-www-form-urlencoded"),
        ("/rec.mcube.DictService/seek", "text/plain"),
    ):
        status, rtype, reply = post(server.http, path, body, {"Content-Type": ctype})
        assert status == 200 and rtype == "application/json"
        assert json.loads(reply) == expected
    strings = {"keys": [str(k) for k in QUERY]}
    assert post_json(server.http, "/DictService/seek", strings)[1] == expected
    assert post_json(server.http, "/DictService/seek", {"keys": []}) == (200, {})
    assert post_json(server.http, "/DictService/seek", {"version_required": True}) == (
        200,
        {"version": "100"},
    )
    request = cube_pb2.DictRequest(keys=QUERY, version_required=True).SerializeToString()
    for ctype in ("application/proto", "application/x-protobuf"):
        status, rtype, reply = post(
            server.http, "/DictService/seek", request, {"Content-Type": ctype}
        )
        assert status == 200 and rtype == ctype
        assert cube_pb2.DictResponse.FromString(reply) == grpc_seek(server.proc, QUERY)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("body", "words"),
    [
        (f'{{"keys": [1, 2, "{SECRET}"]}}', "keys[2]"),
        (f'{{"keys": [1, 2, -3], "note": "{SECRET}"}}', "keys[2]"),
        (f'{{"keys": {{"{SECRET}": 1}}}}', "keys is not an array"),
        (f'{{"keys": [1], "version_required": "{SECRET}"}}', "version_required"),
        (f"{{{SECRET}", "not JSON"),
    ],
)
def test_http_bad_json_is_400_naming_the_field(server: Faces, body: str, words: str) -> None:
    status, rtype, reply = post(server.http, "/DictService/seek", body.encode())
    assert status == 400 and rtype.startswith("text/plain")
    assert words in reply.decode() and SECRET not in reply.decode()


@pytest.mark.slow
def test_http_too_many_keys_and_oversized_body(server: Faces) -> None:
    status, _type, reply = post(
        server.http, "/DictService/seek", b'{"keys": [%s]}' % b",".join([b"1"] * 1001)
    )
    assert status == 400 and b"1001 keys" in reply and b"--max_batch" in reply
    body = b'{"keys": [' + b" " * (5 << 20) + b"]}"  # over the 4 MiB bound
    status, _type, reply = post(server.http, "/DictService/seek", body)
    assert status == 413 and b"exceeds" in reply
    status, _type, _reply = post(server.http, "/DictService/nothing", b"{}")
    assert status == 404


@pytest.mark.slow
def test_http_control_on_loopback_without_a_token(server: Faces) -> None:
    status, answer = post_json(server.http, "/ControlService/cmd", {"cmd": "status"})
    assert status == 200 and answer == {"cur_version": "100", "bg_version": "", "status": 0}
    status, text = post_json(server.http, "/ControlService/cmd", {"cmd": "fly"})
    assert status == 400 and "unknown control cmd" in text
    status, text = post_json(server.http, "/ControlService/cmd", {"version_path": "/1"})
    assert status == 400 and "cmd" in text


@pytest.mark.slow
def test_baidu_std_seek_hits_misses_order_and_version(server: Faces) -> None:
    request = cube_pb2.DictRequest(keys=QUERY, version_required=True).SerializeToString()
    with BrpcClient(server.brpc) as client:
        reply = client.call(DICT, "seek", request, correlation_id=2**62 + 5, log_id=77)
        assert reply.correlation_id == 2**62 + 5
        assert reply.error_code == 0 and reply.has_error_code and reply.error_text == ""
        assert reply.compress_type == 0 and reply.attachment == b""
        assert cube_pb2.DictResponse.FromString(reply.message) == grpc_seek(server.proc, QUERY)
        # the short service name (as brpc takes it), no version, a negative correlation id
        plain = cube_pb2.DictRequest(keys=QUERY).SerializeToString()
        reply = client.call("DictService", "seek", plain, correlation_id=-3)
        response = cube_pb2.DictResponse.FromString(reply.message)
        assert reply.correlation_id == -3 and not response.HasField("version")
        assert [v.status for v in response.values] == [0, MISS, 0, MISS, 0, 0]
        # an attachment on a seek is ignored, as the original ignored it
        reply = client.call(DICT, "seek", plain, attachment=b"ignored")
        assert cube_pb2.DictResponse.FromString(reply.message) == response
        assert client.call(DICT, "seek").message == b""  # no keys: an empty DictResponse


@pytest.mark.slow
def test_baidu_std_pipelined_requests_answer_in_order(server: Faces) -> None:
    with BrpcClient(server.brpc) as client:
        frames = b""
        for i in range(20):
            keys = cube_pb2.DictRequest(keys=[int(KEYS[i]), 2]).SerializeToString()
            frames += frame(request_meta(DICT, "seek", 100 + i), keys)
        client.sock.sendall(frames)
        for i in range(20):
            reply = read_reply(client.sock)
            values = cube_pb2.DictResponse.FromString(reply.message).values
            assert reply.correlation_id == 100 + i
            assert values[0].value == expected_fixed(KEYS[i : i + 1], 12, 1).tobytes()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("service", "method", "meta", "code", "words"),
    [
        ("rec.mcube.Nothing", "seek", {}, 1001, "no service"),
        (DICT, "parallel_seek", {}, 1002, "no method"),
        (DICT, "seek", {"compress_type": 1}, 1003, "compress_type 1"),
        (DICT, "seek", {"compress_type": 2}, 1003, "uncompressed"),
        (DICT, "seek", {"attachment_size": 999}, 1003, "attachment_size"),
    ],
)
def test_baidu_std_refusals_are_error_responses(
    server: Faces, service: str, method: str, meta: RequestMeta, code: int, words: str
) -> None:
    with BrpcClient(server.brpc) as client:
        request = cube_pb2.DictRequest(keys=[1]).SerializeToString()
        reply = client.call(service, method, request, correlation_id=41, **meta)
        assert (reply.correlation_id, reply.error_code) == (41, code)
        assert words in reply.error_text and reply.message == b""
        reply = client.call(DICT, "seek", request, correlation_id=42)  # the connection goes on
        assert reply.error_code == 0


@pytest.mark.slow
def test_baidu_std_bad_request_and_too_many_keys(server: Faces) -> None:
    with BrpcClient(server.brpc) as client:
        reply = client.call(DICT, "seek", b"\xff\xff" + SECRET.encode())
        assert reply.error_code == 1003 and "does not parse" in reply.error_text
        too_many = cube_pb2.DictRequest(keys=range(1001)).SerializeToString()
        reply = client.call(DICT, "seek", too_many)
        assert reply.error_code == 1003 and "1001 keys" in reply.error_text


def _raw(port: int, data: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(data)
    return sock


@pytest.mark.slow
@pytest.mark.parametrize(
    "data",
    [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # not baidu_std
        b"PRPX" + struct.pack(">II", 4, 0) + b"abcd",  # a wrong magic
        b"PRPC" + struct.pack(">II", 64 << 20, 0),  # a body over the bound, never sent
        b"PRPC" + struct.pack(">II", 4, 8) + b"abcd",  # meta larger than the body
        b"PRPC" + struct.pack(">II", 6, 6) + b"\xff" * 6,  # a meta that does not parse
        b"PRPC" + struct.pack(">II", 2, 2) + b"\x20\x05",  # a meta without a request
    ],
)
def test_baidu_std_bad_frames_close_without_an_answer(server: Faces, data: bytes) -> None:
    with _raw(server.brpc, data) as sock:
        assert closed_without_answer(sock)
    with BrpcClient(server.brpc) as client:  # the server goes on
        assert client.call(DICT, "seek").error_code == 0


@pytest.mark.slow
def test_baidu_std_control_on_loopback_without_a_token(server: Faces) -> None:
    with BrpcClient(server.brpc) as client:
        reply = client.call("rec.mcube.ControlService", "cmd", attachment=b'{"cmd": "status"}')
        assert reply.error_code == 0 and reply.message == b""
        assert json.loads(reply.attachment) == {"cur_version": "100", "bg_version": "", "status": 0}
        reply = client.call("ControlService", "cmd", attachment=b"{" + SECRET.encode())
        assert reply.error_code == 1003 and SECRET not in reply.error_text


@pytest.mark.slow
def test_the_faces_are_counted_apart(server: Faces) -> None:
    post_json(server.http, "/DictService/seek", {"keys": [1, 2, 3]})
    assert post_json(server.http, "/DictService/seek", {"keys": [-1]})[0] == 400
    with BrpcClient(server.brpc) as client:
        client.call(DICT, "seek", cube_pb2.DictRequest(keys=[1, 2]).SerializeToString())
    post_json(server.http, "/ControlService/cmd", {"cmd": "status"})
    with grpc.insecure_channel(server.proc.control_address) as channel:
        stub = control_stub(channel)
        detail = json.loads(stub.cmd(cube_pb2.ControlRequest(cmd="status")).detail_json)
    metrics = detail["worker_states"][0]["metrics"]["api"]
    assert metrics["http"]["requests"] >= 1 and metrics["baidu_std"]["requests"] >= 1
    assert metrics["http"]["errors"].get("INVALID_ARGUMENT", 0) >= 1
    assert detail["requests"]["http_requests"] == metrics["http"]["requests"]


def _connections(proc: ServerProc) -> dict[str, Any]:
    with grpc.insecure_channel(proc.control_address) as channel:
        stub = control_stub(channel)
        detail = json.loads(stub.cmd(cube_pb2.ControlRequest(cmd="status")).detail_json)
    lane: dict[str, Any] = detail["worker_states"][0]["lane"]
    return lane


@pytest.mark.slow
def test_the_faces_share_the_lane_limits(tmp_path: Path) -> None:
    """--lane_max_connections counts every socket port of a worker: at the limit, a new
    connection on any face closes the idle one (here an HTTP keep-alive connection between
    requests) to make room. A peer that stalls halfway through a request is closed after
    --lane_stall_timeout on either face."""
    write_version(tmp_path / "data", "1", [1, 2], [b"ab", b"cd"], current=True)
    args = ("--http_port", "0", "--baidu_std_port", "0")
    limits = ("--lane_max_connections=3", "--lane_stall_timeout=1")
    with running_server(tmp_path / "data", *args, *limits) as proc:
        ports = proc.written_ports()
        http_port, brpc = ports["http_ports"][0], ports["baidu_std_ports"][0]
        idle = http.client.HTTPConnection("127.0.0.1", http_port, timeout=30)
        idle.request("POST", "/DictService/seek", b'{"keys": [1]}')
        assert idle.getresponse().read()  # answered; the connection stays open
        half_http = socket.create_connection(("127.0.0.1", http_port), timeout=30)
        half_http.sendall(
            b"POST /DictService/seek HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"
        )
        half_brpc = socket.create_connection(("127.0.0.1", brpc), timeout=30)
        half_brpc.sendall(frame(request_meta(DICT, "seek", 1), b"\x08\x01")[:14])  # a partial frame

        def held() -> tuple[int, int]:
            counts = _connections(proc)
            return counts["http_connections"], counts["baidu_std_connections"]

        assert poll_until(lambda: held() == (2, 1), 10, 0.05), held()

        def fourth_answered() -> bool:  # (refused until the watchdog has seen `idle` idle)
            try:
                status, _type, reply = post(http_port, "/DictService/seek", b'{"keys": [2]}')
            except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
                return False  # refused by closing before the request was read
            assert status in (200, 503), (status, reply)
            return status == 200

        assert poll_until(fourth_answered, 10, 0.1)
        assert closed_without_answer(idle.sock, 10)  # it made room
        assert _connections(proc)["evicted"] == 1
        started = time.monotonic()
        assert closed_without_answer(half_brpc, 15)  # stalled: closed by the watchdog
        answer = b""
        while chunk := half_http.recv(4096):  # a stalled body: 408, then closed
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 408") and b"--lane_stall_timeout" in answer
        assert time.monotonic() - started < 10
        assert poll_until(lambda: held() == (0, 0), 10, 0.1), held()
        status, _type, reply = post(http_port, "/DictService/seek", b'{"keys": [2]}')
        assert status == 200 and json.loads(reply)["values"][0]["value"] == "Y2Q="
        for sock in (half_http, half_brpc):
            sock.close()
        idle.close()


# ---------------------------------------------------------------------------------------------
# a replica that cannot serve, the token rule, variable values over every transport


@pytest.mark.slow
def test_not_serving_replica_refuses_on_both_faces(tmp_path: Path) -> None:
    args = ("--http_port", "0", "--baidu_std_port", "0")
    with running_server(tmp_path / "nothing", *args) as proc:
        ports = proc.written_ports()
        status, rtype, reply = post(ports["http_ports"][0], "/DictService/seek", b'{"keys":[1]}')
        assert status == 503 and rtype.startswith("text/plain") and b"serves no version" in reply
        with BrpcClient(ports["baidu_std_ports"][0]) as client:
            refused = client.call(DICT, "seek", cube_pb2.DictRequest(keys=[1]).SerializeToString())
        assert refused.error_code == 2003 and "serves no version" in refused.error_text
        assert refused.message == b""


@pytest.mark.slow
def test_control_token_rule_and_a_rollout_over_http(tmp_path: Path) -> None:
    """With --control_token, control over HTTP needs the bearer token and over baidu_std the
    token as authentication_data; with it, the original agent's commands load and enable."""
    data = tmp_path / "data"
    write_version(data, "100", KEYS[:10], fixed_values(KEYS[:10], 12, tag=1), current=True)
    write_version(data, "200", KEYS[:10], fixed_values(KEYS[:10], 12, tag=2))
    args = ("--http_port", "0", "--baidu_std_port", "0", "--control_token", "tok")
    with running_server(data, *args) as proc:
        ports = proc.written_ports()
        http, brpc = ports["http_ports"][0], ports["baidu_std_ports"][0]
        path = "/ControlService/cmd"
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "tok"}):
            status, text = post_json(http, path, {"cmd": "status"}, headers)
            assert status == 401 and "--control_token" in text
        good = {"Authorization": "Bearer tok"}
        status, answer = post_json(
            http, path, {"cmd": "bg_load_base", "version_path": "/200"}, good
        )
        assert status == 200 and answer["bg_version"] == "200" and "loaded" in answer["message"]
        with BrpcClient(brpc) as client:
            status_cmd = b'{"cmd": "status"}'
            for auth in (None, b"nope"):
                meta: RequestMeta = {} if auth is None else {"authentication_data": auth}
                reply = client.call("ControlService", "cmd", attachment=status_cmd, **meta)
                assert reply.error_code == 1004 and reply.attachment == b""
            for auth in (b"tok", b"Bearer tok"):
                reply = client.call(
                    "ControlService", "cmd", attachment=status_cmd, authentication_data=auth
                )
                assert reply.error_code == 0
                assert json.loads(reply.attachment)["bg_version"] == "200"
        status, answer = post_json(http, path, {"cmd": "enable", "version": "200"}, good)
        assert status == 200 and answer["cur_version"] == "200"
        _status, answer = post_json(
            http, "/DictService/seek", {"keys": [1], "version_required": True}
        )
        assert answer["version"] == "200"
        assert (
            base64.b64decode(answer["values"][0]["value"])
            == expected_fixed(KEYS[:1], 12, 2).tobytes()
        )
        status, text = post_json(http, path, {"cmd": "enable", "version": "300"}, good)
        assert status == 400 and "300" in text  # a failed command is not a 200


def test_control_beyond_loopback_needs_a_token_or_insecure() -> None:
    """The rule, without binding a public address: a face bound beyond loopback refuses
    control with no token unless --insecure; with a token, only the right one passes."""
    from cube.pb.baidu_std_pb2 import RpcMeta
    from cube.security import control_refusal
    from cube.server.baidu_std import BaiduStdServer
    from cube.server.bounds import Bounds
    from cube.server.http_json import HttpFace

    request = SimpleNamespace(headers={})
    meta = RpcMeta()
    for host, insecure, refused in (
        ("0.0.0.0", False, True),
        ("192.0.2.1", False, True),
        ("192.0.2.1", True, False),
        ("127.0.0.1", False, False),
        ("localhost", False, False),
    ):
        rule = {"host": host, "token": "", "insecure": insecure}
        http = HttpFace(None, None, max_body=1, bounds=Bounds(), **rule)  # type: ignore[arg-type]
        refusal = http.control_refused(request)  # type: ignore[arg-type]
        assert (refusal is not None and refusal.status == 403) == refused
        brpc = BaiduStdServer(None, None, bounds=Bounds(), max_frame=1, **rule)  # type: ignore[arg-type]
        assert bool(brpc.control_refused(meta)) == refused
    assert control_refusal("0.0.0.0", "s3cret", False, "s3cret") is None
    assert control_refusal("127.0.0.1", "s3cret", True, "wrong") == grpc.StatusCode.UNAUTHENTICATED
    assert control_refusal("127.0.0.1", "s3cret", False, None) == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.slow
def test_variable_values_and_splits_agree_over_every_transport(tmp_path: Path) -> None:
    data = tmp_path / "data"
    keys = np.arange(0, 400, dtype=np.uint64)
    values = [bytes([k % 251]) * (k % 9) for k in range(400)]  # empty values too
    for split in range(2):
        mine = keys[keys % 2 == split]
        write_version(data, "7", mine, [values[k] for k in mine], split=split, current=True)
    args = ("--dict_split", "2", "--http_port", "0", "--baidu_std_port", "0")
    with running_server(data, *args) as proc:
        ports = proc.written_ports()
        query = [5, 1000, 8, 0, 399, 5, 2**63]
        expected = grpc_seek(proc, query)
        assert [v.status for v in expected.values] == [0, MISS, 0, 0, 0, 0, MISS]
        payload = {"keys": query, "version_required": True}
        assert post_json(ports["http_ports"][0], "/DictService/seek", payload)[1] == as_json(
            expected
        )
        with BrpcClient(ports["baidu_std_ports"][0]) as client:
            request = cube_pb2.DictRequest(keys=query, version_required=True)
            reply = client.call(DICT, "seek", request.SerializeToString())
        assert cube_pb2.DictResponse.FromString(reply.message) == expected


@pytest.mark.slow
def test_both_faces_over_tls(tmp_path: Path, pki: dict[str, str]) -> None:
    """With --tls_cert the faces serve TLS, like the other lookup ports: HTTPS and baidu_std
    in TLS, verified with the test CA; a plaintext peer gets nothing."""
    import ssl

    write_version(tmp_path / "data", "1", [1], [b"tls!"], current=True)
    args = ("--http_port", "0", "--baidu_std_port", "0", "--tls_cert", pki["cert"])
    with running_server(tmp_path / "data", *args, "--tls_key", pki["key"]) as proc:
        ports = proc.written_ports()
        context = ssl.create_default_context(cafile=pki["ca"])
        https = http.client.HTTPSConnection("127.0.0.1", ports["http_ports"][0], context=context)
        https.request("POST", "/DictService/seek", b'{"keys": [1, 2]}')
        answer = json.loads(https.getresponse().read())
        https.close()
        assert [base64.b64decode(v["value"]) for v in answer["values"]] == [b"tls!", b""]
        raw = socket.create_connection(("127.0.0.1", ports["baidu_std_ports"][0]), timeout=10)
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as sock:
            sock.sendall(frame(request_meta(DICT, "seek", 9), b"\x08\x01"))  # keys: [1]
            reply = read_reply(sock)
        assert reply.correlation_id == 9
        assert cube_pb2.DictResponse.FromString(reply.message).values[0].value == b"tls!"
        with pytest.raises((ConnectionError, OSError)):
            post(ports["http_ports"][0], "/DictService/seek", b'{"keys": [1]}')


def _consecutive_free_ports(count: int) -> int:
    """The first of `count` consecutive free loopback ports (worker i listens on port + i)."""
    for _ in range(50):
        first = free_port()
        if first + count <= 65535 and all(_port_free(first + i) for i in range(1, count)):
            return first
    raise RuntimeError("no run of free ports")


@pytest.mark.slow
def test_every_worker_serves_both_faces_and_forwards_control(tmp_path: Path) -> None:
    """--workers 2: worker i on port + i for both faces; control sent to worker 1 is run by
    worker 0 (forwarded over the internal channel), as on the control port."""
    write_version(tmp_path / "data", "100", KEYS[:50], fixed_values(KEYS[:50], 12, 1), current=True)
    http, brpc = _consecutive_free_ports(2), _consecutive_free_ports(2)
    args = ("--http_port", str(http), "--baidu_std_port", str(brpc))
    with running_server(tmp_path / "data", *args, workers=2) as proc:
        proc.wait_serving()
        for worker in range(2):
            payload = {"keys": [int(KEYS[3]), 2], "version_required": True}
            status, answer = post_json(http + worker, "/DictService/seek", payload)
            assert status == 200 and answer["version"] == "100"
            assert [v["status"] for v in answer["values"]] == [0, MISS]
            with BrpcClient(brpc + worker) as client:
                reply = client.call(
                    DICT, "seek", cube_pb2.DictRequest(keys=[1]).SerializeToString()
                )
                assert reply.error_code == 0
                reply = client.call("ControlService", "cmd", attachment=b'{"cmd": "status"}')
                assert json.loads(reply.attachment)["cur_version"] == "100"
        status, answer = post_json(http + 1, "/ControlService/cmd", {"cmd": "bg_unload"})
        assert status == 200 and answer["message"] == "no background version"


@pytest.mark.slow
def test_idle_baidu_std_connection_does_not_hold_up_a_stop(tmp_path: Path) -> None:
    write_version(tmp_path / "data", "1", [1], [b"x"], current=True)
    with running_server(tmp_path / "data", "--baidu_std_port", "0", "--grace", "20") as proc:
        client = BrpcClient(proc.written_ports()["baidu_std_ports"][0])
        assert client.call(DICT, "seek").error_code == 0
        started = time.monotonic()
        assert proc.stop() == 0
        assert time.monotonic() - started < 10
        assert closed_without_answer(client.sock)
        client.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--http_port", "0", "--workers", "2", "--port", "18000"], "--http_port 0"),
        (["--http_port", "18100", "--baidu_std_port", "18100"], "both take port 18100"),
        (["--baidu_std_port", "-5"], "not a port"),
        (["--baidu_std_port", "65535", "--workers", "2", "--port", "18000"], "not all ports"),
    ],
)
def test_face_flags_are_checked(tmp_path: Path, args: list[str], words: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "cube.server.main", "--data_dir", str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and words in result.stderr


@pytest.mark.slow
def test_help_lists_the_flags() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "cube.server.main", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "--http_port" in result.stdout and "--baidu_std_port" in result.stdout
