"""A base switch in a memory group of --share x one version's bytes (issue 37 item 4).

    python -m cube.bench.switch --keys 100000000 --width 64 --share 1.3

Writes two versions of --keys derived keys (bench.keyspace; the same contents: what is
measured is memory and failures, not values) into a data dir under --dir (removed at the
end); starts cube-server (`--in_mem`, the default) in a fresh cgroup v1 memory group of
--share x one version's bytes, serving the first; then, with lookups running from outside the
group (every answer checked), loads the second in the background, switches to it and waits
until it is pinned (or --seconds pass). Reports the most memory the group could not give back
(anonymous + mlocked, sampled every 50 ms) as a multiple of one version, the lookups' failures
and p99 over the switch, and when each step ended. Needs root and cgroup v1's memory
controller.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from cube.bench.keyspace import DerivedData, values_of
from cube.bench.paging import (
    drop_cache,
    memory_group,
    require_memory_controller,
    start_server_in,
    write_table,
)
from cube.bench.procs import ProcessRegistry
from cube.client import CubeClient
from cube.pb import cube_pb2, cube_pb2_grpc
from cube.processes import free_port, poll_until
from cube.server.versions import write_version_file

BATCH = 1000


def held_bytes(group: Path) -> int:
    """What the group cannot give back: anonymous memory and mlocked pages."""
    stat = dict(line.split() for line in (group / "memory.stat").read_text().splitlines())
    return int(stat["total_rss"]) + int(stat["total_unevictable"])


def control(port: int, cmd: str, **fields: str) -> dict[str, Any]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = cube_pb2_grpc.ControlServiceStub(channel)  # type: ignore[no-untyped-call]
        reply = stub.cmd(cube_pb2.ControlRequest(cmd=cmd, **fields), timeout=3600)
    detail: dict[str, Any] = json.loads(reply.detail_json) if reply.detail_json else {}
    return detail


class Observer:
    """While a switch runs: lookups of BATCH random keys one at a time from outside the group
    (every answer checked) and the group's held memory sampled every 50 ms, each on a thread."""

    def __init__(self, group: Path, port: int, data: DerivedData) -> None:
        self.group, self.port, self.data = group, port, data
        self.halt = threading.Event()
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self.peak = held_bytes(group)
        self.rng = np.random.default_rng(1)
        self.threads = [
            threading.Thread(target=self._lookups),
            threading.Thread(target=self._watch),
        ]
        for thread in self.threads:
            thread.start()

    def _lookups(self) -> None:
        data = self.data
        with CubeClient(shards=[[f"127.0.0.1:{self.port}"]], timeout=5.0) as client:
            while not self.halt.is_set():
                keys = data.keys(self.rng.integers(0, data.count, BATCH).astype(np.uint64))
                begun = time.perf_counter()
                try:
                    result = client.seek(keys)
                    ok = result.found.all() and np.array_equal(
                        result.column.as_rows(), values_of(keys, data.width)
                    )
                    if not ok:
                        self.failures.append("a wrong answer")
                except Exception as exc:  # every failure counted and its first kept
                    self.failures.append(f"{type(exc).__name__}: {exc}"[:300])
                self.latencies.append(time.perf_counter() - begun)

    def _watch(self) -> None:
        while not self.halt.wait(0.05):
            self.peak = max(self.peak, held_bytes(self.group))

    def stop(self) -> None:
        self.halt.set()
        for thread in self.threads:
            thread.join(60)

    def results(self) -> dict[str, Any]:
        ms = np.array(self.latencies) * 1e3
        return {
            "held_peak_bytes": self.peak,
            "lookups": len(self.latencies),
            "failed": len(self.failures),
            "first_failure": self.failures[0] if self.failures else "",
            "p50_ms": round(float(np.median(ms)), 2) if ms.size else 0.0,
            "p99_ms": round(float(np.percentile(ms, 99)), 2) if ms.size else 0.0,
        }


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    data = DerivedData(args.keys, args.width)
    started = time.perf_counter()
    version_bytes = write_table(root / "data" / "1", data)
    shutil.copytree(root / "data" / "1", root / "data" / "2")
    write_version_file(root / "data", "1")
    written = time.perf_counter() - started
    for version in ("1", "2"):
        drop_cache(root / "data" / version)
    limit = int(version_bytes * args.share)
    control_port = free_port()
    registry = ProcessRegistry()
    marks: dict[str, float] = {}
    with memory_group("switch", limit) as group:
        try:
            flags = ("--control_port", str(control_port))
            port = start_server_in(group, registry, root / "data" / "1", root / "logs", *flags)
            observer = Observer(group, port, data)
            try:
                time.sleep(2)
                begun = time.perf_counter()
                control(control_port, "bg_load_base", version_path="/2")
                marks["loaded_s"] = time.perf_counter() - begun
                control(control_port, "enable", version="2")
                marks["enabled_s"] = time.perf_counter() - begun

                def pinned() -> bool:
                    current = control(control_port, "status").get("current") or {}
                    return bool(current.get("version") == "2" and not current.get("memory_note"))

                settled = poll_until(pinned, args.seconds, 0.5)
                marks["pinned_s" if settled else "not_pinned_after_s"] = time.perf_counter() - begun
                time.sleep(2)
            finally:
                observer.stop()
            return {
                "keys": args.keys,
                "width": args.width,
                "version_bytes": version_bytes,
                "limit_bytes": limit,
                "written_s": round(written, 1),
                **{k: round(v, 2) for k, v in marks.items()},
                "held_peak_x_version": round(observer.peak / version_bytes, 3),
                **observer.results(),
                "server_alive": registry.servers[0].popen.poll() is None,
            }
        finally:
            registry.stop_all()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=100_000_000)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--share", type=float, default=1.3, help="group limit / version bytes")
    parser.add_argument("--seconds", type=float, default=600.0, help="wait for the pin, at most")
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    require_memory_controller()
    root = Path(tempfile.mkdtemp(prefix="cube-switch-", dir=args.dir))
    try:
        result = run(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["failed"] == 0 and result["server_alive"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
