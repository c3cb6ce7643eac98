"""What each way into cube-server costs: the TCP lane and gRPC (the SDK), rec.mcube.DictService
over gRPC, and the original's faces, HTTP+JSON and baidu_std, against one local
`cube-server --workers 1`, one request in flight, fresh random 1000-key batches.

    python -m bench.faces --requests 2000 [--keys 1000000 --width 40]

Each way is measured in turn on the same server (requests are encoded before the clock, so
the client's figure is sending, waiting and decoding). Reports per way: median and p99
latency, keys/s (batch / median latency), the server's CPU per request (utime + stime of the
server process from /proc over the measured requests, the transport's included), this
client's, and the cores other processes used meanwhile (a disturbed run shows there).

Clients: `lane` and `grpc` are `CubeClient(transport=...)` (the SDK encodes its requests in
the clock: a few µs); `grpc-original` a raw gRPC call of rec.mcube.DictService/seek; `http`
an http.client keep-alive connection (json.loads of the answer); `baidu_std` a socket
writing PRPC frames (the DictResponse parsed). The shard is bench/e2e.py's (built once under
--workdir, then reused).
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import struct
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from cube.bench.e2e import Server, build_data, key_batches
from cube.flags import FlagSet, flag, run_cli
from cube.processes import cpu_split, free_ports, machine_seconds

if TYPE_CHECKING:
    from cube.client import TransportName

WAYS = ("lane", "grpc", "grpc-original", "http", "baidu_std")


@dataclass(frozen=True)
class FacesFlags:
    """bench-faces' flags."""

    keys: int = flag(1_000_000, "keys in the shard")
    width: int = flag(40, "value bytes per key")
    batch: int = flag(1000, "keys per request")
    requests: int = flag(2000, "measured requests per way")
    warmup: int = flag(200, "unmeasured requests per way first")
    ways: str = flag(",".join(WAYS), "comma list of " + ", ".join(WAYS), metavar="LIST")
    workdir: str = flag("/tmp/cube-e2e", "where the shard is built (and reused)", metavar="DIR")
    seed: int = flag(7, "seed of the shard's keys and values")
    json: str = flag("", "also write the results to this file", metavar="PATH")


FLAGS = FlagSet(
    "bench-faces",
    "Time one 1000-key request over each way into cube-server.",
    spec=FacesFlags,
)


# A way in, ready to time: (encode, call, close); each way has its own request type.
Face = tuple[Callable[[np.ndarray], Any], Callable[[Any], int], Callable[[], None]]


def _lane_or_grpc(transport: TransportName) -> Callable[[Server, dict[str, int]], Face]:
    def make(server: Server, ports: dict[str, int]) -> Face:
        from cube.client import CubeClient

        client = CubeClient(shards=[server.addresses], timeout=30.0, transport=transport)
        client.wait_ready(10)

        def encode(keys: np.ndarray) -> np.ndarray:
            return keys

        def call(keys: np.ndarray) -> int:
            return int(np.count_nonzero(client.seek(keys).found))

        return encode, call, client.close

    return make


def _grpc_original(server: Server, ports: dict[str, int]) -> Face:
    import grpc

    from cube.pb import cube_pb2

    channel = grpc.insecure_channel(server.addresses[0])
    seek: grpc.UnaryUnaryMultiCallable[bytes, bytes]
    seek = channel.unary_unary("/rec.mcube.DictService/seek")

    def encode(keys: np.ndarray) -> bytes:
        return cube_pb2.DictRequest(keys=keys.tolist()).SerializeToString()

    def call(request: bytes) -> int:
        values = cube_pb2.DictResponse.FromString(seek(request, timeout=30)).values
        return sum(1 for v in values if v.status == 0)

    return encode, call, channel.close


def _http(server: Server, ports: dict[str, int]) -> Face:
    connection = http.client.HTTPConnection("127.0.0.1", ports["http"], timeout=30)
    headers = {"Content-Type": "application/json"}

    def encode(keys: np.ndarray) -> bytes:
        return json.dumps({"keys": keys.tolist()}).encode()

    def call(body: bytes) -> int:
        connection.request("POST", "/DictService/seek", body, headers)
        reply = connection.getresponse()
        data = reply.read()
        if reply.status != 200:
            raise RuntimeError(f"HTTP {reply.status}: {data[:200]!r}")
        return sum(1 for v in json.loads(data)["values"] if v["status"] == 0)

    return encode, call, connection.close


def _baidu_std(server: Server, ports: dict[str, int]) -> Face:
    from cube.pb import cube_pb2
    from cube.pb.baidu_std_pb2 import RpcMeta

    sock = socket.create_connection(("127.0.0.1", ports["baidu_std"]), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    header = struct.Struct(">4sII")

    def encode(keys: np.ndarray) -> bytes:
        meta = RpcMeta(correlation_id=1)
        meta.request.service_name = "rec.mcube.DictService"
        meta.request.method_name = "seek"
        head = meta.SerializeToString()
        body = cube_pb2.DictRequest(keys=keys.tolist()).SerializeToString()
        return header.pack(b"PRPC", len(head) + len(body), len(head)) + head + body

    def read(size: int) -> bytes:
        chunks = []
        while size:
            chunk = sock.recv(min(size, 1 << 20))
            if not chunk:
                raise ConnectionError("cube-server closed the baidu_std connection")
            chunks.append(chunk)
            size -= len(chunk)
        return b"".join(chunks)

    def call(frame: bytes) -> int:
        sock.sendall(frame)
        _magic, body_size, meta_size = header.unpack(read(header.size))
        body = read(body_size)
        meta = RpcMeta.FromString(body[:meta_size])
        if meta.response.error_code:
            raise RuntimeError(f"baidu_std error {meta.response.error_code}")
        values = cube_pb2.DictResponse.FromString(body[meta_size:]).values
        return sum(1 for v in values if v.status == 0)

    return encode, call, sock.close


CLIENTS: dict[str, Callable[[Server, dict[str, int]], Face]] = {
    "lane": _lane_or_grpc("auto"),
    "grpc": _lane_or_grpc("grpc"),
    "grpc-original": _grpc_original,
    "http": _http,
    "baidu_std": _baidu_std,
}


def measure(
    way: str, server: Server, ports: dict[str, int], batches: list[np.ndarray], flags: FacesFlags
) -> dict[str, Any]:
    encode, call, close = CLIENTS[way](server, ports)
    try:
        requests = [encode(b) for b in batches[: flags.warmup + flags.requests]]
        for request in requests[: flags.warmup]:
            if call(request) != flags.batch:
                raise RuntimeError(f"{way}: a warm-up request missed keys")
        measured = requests[flags.warmup :]
        latencies = np.empty(len(measured))
        pids = server.pids()
        cpu0, me0, machine0 = cpu_split(pids), cpu_split([os.getpid()]), machine_seconds()[0]
        started = time.perf_counter()
        for i, request in enumerate(measured):
            t0 = time.perf_counter()
            found = call(request)
            latencies[i] = time.perf_counter() - t0
            if found != flags.batch:
                raise RuntimeError(f"{way}: {flags.batch - found} keys missed")
        elapsed = time.perf_counter() - started
        cpu1, me1, machine1 = cpu_split(pids), cpu_split([os.getpid()]), machine_seconds()[0]
    finally:
        close()
    median = float(np.median(latencies))
    server_cpu, client_cpu = sum(cpu1) - sum(cpu0), sum(me1) - sum(me0)
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    return {
        "way": way,
        "requests": len(measured),
        "p50_us": round(median * 1e6, 1),
        "p99_us": round(float(np.percentile(latencies, 99)) * 1e6, 1),
        "keys_s_at_p50": round(flags.batch / median),
        "keys_s_overall": round(len(measured) * flags.batch / elapsed),
        "server_cpu_us": round(server_cpu / len(measured) * 1e6, 1),
        "client_cpu_us": round(client_cpu / len(measured) * 1e6, 1),
        "other_cores": round(max(0.0, machine1 - machine0 - server_cpu - client_cpu) / elapsed, 2),
        "loadavg": load,
    }


def table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| way | p50 µs/request | p99 µs | keys/s (batch / p50) | server CPU µs/request"
        " | client CPU µs/request | other cores |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['way']} | {r['p50_us']:,.0f} | {r['p99_us']:,.0f}"
            f" | {r['keys_s_at_p50'] / 1e6:.2f}M | {r['server_cpu_us']:,.0f}"
            f" | {r['client_cpu_us']:,.0f} | {r['other_cores']:.2f} |"
        )
    return "\n".join(lines)


def _main(argv: Sequence[str]) -> int:
    flags = FLAGS.parse(argv)
    ways = [w.strip() for w in flags.ways.split(",") if w.strip()]
    unknown = sorted(set(ways) - set(WAYS))
    if unknown:
        raise SystemExit(f"--ways: unknown {unknown}; expected some of {', '.join(WAYS)}")
    workdir = Path(flags.workdir)
    print(f"building/reusing the shard under {workdir} ...", file=sys.stderr)
    data_dir, keys = build_data(workdir, flags.keys, flags.width, flags.seed)
    batches = key_batches(keys, flags.batch, flags.warmup + flags.requests, flags.seed + 3)
    http_port, baidu_port = free_ports(2)
    extra = ["--http_port", str(http_port), "--baidu_std_port", str(baidu_port)]
    server = Server(data_dir, 1, extra, workdir / "faces-server.log")
    rows = []
    try:
        server.wait_serving()
        ports = {"http": http_port, "baidu_std": baidu_port}
        for way in ways:
            row = measure(way, server, ports, batches, flags)
            print(json.dumps(row), file=sys.stderr)
            rows.append(row)
    finally:
        server.stop()
    print(table(rows))
    if flags.json:
        Path(flags.json).write_text(json.dumps(rows, indent=1))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
