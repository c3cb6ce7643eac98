"""Time from a cube-server's process start to SERVING, on a fresh install (issue 34):

    python -m cube.bench.startup --keys 1000000 --value_size 64 --runs 5
    python -m cube.bench.startup --server /path/to/venv/bin/cube-server
    python -m cube.bench.startup --image cube-py:0.1.0     (read-only root, uid 10001,
                                                            NUMBA_CACHE_DIR on a tmpfs)

Each run starts the server anew on a data dir holding one shard of `--keys` keys (built once,
bench/e2e.py's data) and polls its gRPC health every 10 ms until SERVING; the kernel's load
time is the server's own log line ("lookup kernel: ..., ready in X s"). A container run
starts from its image every time, so it also pays copying the shipped kernel to its tmpfs.
Prints one line per run and the medians.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from cube.processes import SERVING, free_ports, health_status, spawn, stop_child

KERNEL_LINE = re.compile(r"lookup kernel: (.*), ready in ([0-9.]+) s")


def engine() -> list[str]:
    """The container engine command, as `make image` chooses it (deploy/docker/images.py,
    which a checkout has and an installed package does not)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "deploy" / "docker" / "images.py"
    spec = importlib.util.spec_from_file_location("cube_images", path)
    if spec is None or spec.loader is None or not path.exists():
        return ["podman"]
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    command: list[str] = module.engine()
    return command


def server_command(args: argparse.Namespace, data_dir: Path, port: int, name: str) -> list[str]:
    flags = ["--port", str(port), "--control_port", str(port + 1), "--data_dir"]
    if args.image:
        return [*engine(), "run", "--rm", "--name", name, "--network", "host", "--read-only",
                "--tmpfs", "/tmp", "--ulimit", "nofile=8192:8192", "--ulimit",
                "nproc=4096:4096", "-v", f"{data_dir}:/data", args.image, "cube-server",
                *flags, "/data"]  # fmt: skip
    return [args.server, *flags, str(data_dir)]


def one_run(args: argparse.Namespace, data_dir: Path, log: Path, run: int) -> tuple[float, float]:
    """Seconds from start to SERVING, and the kernel's load seconds from the server's log."""
    (port,) = free_ports(1)
    name = f"cube-startup-{port}"
    started = time.perf_counter()
    server = spawn(server_command(args, data_dir, port, name), log)
    try:
        deadline = started + args.timeout
        while health_status(f"127.0.0.1:{port}", timeout=0.5) != SERVING:
            if server.poll() is not None or time.perf_counter() > deadline:
                raise SystemExit(f"run {run}: not SERVING; the server's log:\n{log.read_text()}")
            time.sleep(0.01)
        serving = time.perf_counter() - started
    finally:
        if args.image:
            subprocess.run([*engine(), "kill", name], capture_output=True, timeout=60)
        stop_child(server, 20)
    match = KERNEL_LINE.search(log.read_text())
    if match is None or "loaded from its cache" not in match.group(1):
        print(f"run {run}: the kernel did not load from the shipped cache: {match and match[1]}")
    return serving, float(match.group(2)) if match else float("nan")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--value_size", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--server", default=shutil.which("cube-server") or "cube-server")
    parser.add_argument("--image", help="run the server from this image instead")
    parser.add_argument("--timeout", type=float, default=120.0, help="per run, seconds")
    parser.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "cube-startup"))
    args = parser.parse_args(argv)

    from cube.bench.e2e import build_data

    data_dir, _keys = build_data(Path(args.workdir), args.keys, args.value_size, seed=1)
    if args.image:  # the image's user (uid 10001) writes beside the shard
        subprocess.run(["chmod", "-R", "a+rwX", str(data_dir)], check=True, timeout=120)
    where = args.image or args.server
    print(f"cube-server start to SERVING: {args.keys} keys x {args.value_size} B, {where}")
    times: list[tuple[float, float]] = []
    with tempfile.TemporaryDirectory(prefix="cube-startup-") as scratch:
        for run in range(1, args.runs + 1):
            serving, kernel = one_run(args, data_dir, Path(scratch) / f"run{run}.log", run)
            times.append((serving, kernel))
            print(f"run {run}: SERVING after {serving:.2f} s (kernel loaded in {kernel:.2f} s)")
    serving = statistics.median(t[0] for t in times)
    kernel = statistics.median(t[1] for t in times)
    print(f"median of {args.runs}: SERVING after {serving:.2f} s, kernel {kernel:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
