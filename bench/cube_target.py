"""The Cube target of cube-bench: the data set goes through the real pipeline — a SequenceFile
(Cube dialect), `cube-builder`, then one `cube-server` per shard with `--workers` processes,
each worker on its own port — and is read back with the SDK (`CubeClient.seek`, or
`get_embeddings`' conversion with --dim). Every worker port is a replica of its shard, so the
SDK's round robin spreads requests over the workers evenly.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from cube.bench.targets import DataSource, Target, TargetUnavailable
from cube.layout import part_name, served_name
from cube.processes import SERVING, free_port, free_ports, health_status
from cube.values import ValueColumn

DICT_NAME = "bench_dict"
_BUILD_TIMEOUT = 1800.0
_CLIENT_TIMEOUT_MS = 30_000  # as the other targets' 30 s socket timeouts: no retries under load


def _console_script(name: str, module: str) -> list[str]:
    """The installed console script beside this interpreter, else `python -m module`."""
    script = Path(sys.executable).parent / name
    return [str(script)] if script.exists() else [sys.executable, "-m", module]


class CubeTarget(Target):
    """cube-builder + cube-server (`--shards` servers, `--workers` workers each) + the SDK."""

    name = "cube"

    def check_available(self, client_mode: str) -> None:
        try:
            import cube.builder.cli
            import cube.client
            import cube.seqfile
            import cube.server.main  # noqa: F401
        except ImportError as exc:
            raise TargetUnavailable(f"cube: {exc} (is the package installed?)") from exc

    def setup(self, data: DataSource) -> None:
        self.width, self.dim = data.value_size, data.dim
        shard_num = int(self.options["shards"])
        workers = int(self.options["workers"])
        started = time.perf_counter()
        parts = self._build(data, shard_num)
        self.info["build_seconds"] = round(time.perf_counter() - started, 2)

        self.shard_ports: list[list[int]] = []
        for shard, part in enumerate(parts):
            # the layout an agent leaves: <data_dir>/<version>/ and VERSION naming it; a base
            # built into <depend>_<cur>/ is served as version <depend>
            version = served_name(part.parent.name)
            data_dir = self.workdir / f"server{shard}" / "data"
            data_dir.mkdir(parents=True)
            part.rename(data_dir / version)  # same file system: the builder's files, moved
            (data_dir / "VERSION").write_text(version + "\n")
            ports = [free_port() for _ in range(workers)]
            # worker i controls on control_port + i: consecutive ports free now, not the
            # default --port + 1000 + i, which another process may hold
            controls = free_ports(workers, avoid=ports)
            argv = [
                *_console_script("cube-server", "cube.server.main"),
                "--port", str(ports[0]),
                "--control_port", str(controls[0]),
                "--data_dir", str(data_dir),
                "--dict_name", DICT_NAME,
                "--shard", str(shard),
                "--workers", str(workers),
                "--log_level", "WARNING",
            ]  # fmt: skip
            if workers > 1:
                argv += ["--worker_ports", ",".join(map(str, ports))]
            busy_poll_us = int(self.options.get("cube_busy_poll_us", 0))
            if busy_poll_us:
                argv += ["--busy_poll_us", str(busy_poll_us)]

            def ready(ports: list[int] = ports) -> bool:  # its kernel loaded, version served
                return all(health_status(f"127.0.0.1:{port}") == SERVING for port in ports)

            self.servers.append(
                self.registry.start(
                    f"cube-server{shard}",
                    argv,
                    ports,
                    self.workdir / "logs",
                    timeout=float(self.options.get("start_timeout", 60.0)),
                    ready=ready,
                )
            )
            self.shard_ports.append(ports)
        self.info["command"] = " ; ".join(
            " ".join(["cube-server", *s.argv[s.argv.index("--port") :]]) for s in self.servers
        )
        self.info["load_seconds"] = round(time.perf_counter() - started, 2)
        self.info["load_note"] = "SequenceFile, cube-builder, servers up"
        self.info["notes"] = (
            f"SDK: CubeClient(transport={self.options.get('cube_transport', 'auto')!r}, "
            f"busy_poll_us={int(self.options.get('cube_busy_poll_us', 0))}), "
            f"{workers} worker port(s) per shard as replicas, round robin."
        )

    def _build(self, data: DataSource, shard_num: int) -> list[Path]:
        """SequenceFile -> cube-builder -> one directory per shard (index.cube + data.cube)."""
        from cube.seqfile import SequenceFileWriter

        input_dir = self.workdir / "input"
        input_dir.mkdir(parents=True)
        with SequenceFileWriter(input_dir / "part-00000", dialect="cube") as writer:
            for keys, values in data.chunks(1 << 20):  # (a derived data set: never all at once)
                writer.write_batch(keys, ValueColumn.fixed(values.reshape(-1), self.width))
        output_dir = self.workdir / "output"
        flags = [
            "-input_path", str(input_dir),
            "-output_path", str(output_dir),
            "-shard_num", str(shard_num),
            "-dict_name", DICT_NAME,
            "-job_mode", "base",
            "-only_build", "true",
            "-quiet",
        ]  # fmt: skip
        self.info["build_command"] = " ".join(["cube-builder", *flags])
        argv = [*_console_script("cube-builder", "cube.builder.cli"), *flags]
        log = self.workdir / "builder.log"
        with open(log, "wb") as out:
            proc = subprocess.run(
                argv, stdout=out, stderr=subprocess.STDOUT, timeout=_BUILD_TIMEOUT, check=False
            )
        if proc.returncode != 0:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
            raise RuntimeError(f"cube-builder failed (exit {proc.returncode}):\n{tail}")
        return self._parts(output_dir, shard_num)

    def _parts(self, output_dir: Path, shard_num: int) -> list[Path]:
        parts = []
        for shard in range(shard_num):
            found = sorted(output_dir.glob(f"*/{part_name(DICT_NAME, shard)}"))
            found = [p for p in found if p.is_dir()]
            if len(found) != 1:
                raise RuntimeError(
                    f"cube-builder output: expected one {DICT_NAME}_part{shard} directory under "
                    f"{output_dir}, found {[str(p) for p in found]}"
                )
            parts.append(found[0])
        return parts

    def _client_args(self) -> dict[str, Any]:
        return {
            "shards": [[f"127.0.0.1:{port}" for port in ports] for ports in self.shard_ports],
            "dict_name": DICT_NAME,
            "timeout": _CLIENT_TIMEOUT_MS / 1000.0,
            "transport": self.options.get("cube_transport", "auto"),
            "busy_poll_us": int(self.options.get("cube_busy_poll_us", 0)),
        }

    def thread_client(self) -> Any:
        from cube.client import CubeClient

        client = CubeClient(**self._client_args())
        client.wait_ready(10)  # as an application does before it serves (connects, loads)
        return _CubeClient(client, self.dim)

    def async_client(self, concurrency: int) -> Any:
        from cube.client import AsyncCubeClient

        args = self._client_args()
        args.pop("busy_poll_us")  # the blocking client's: the asyncio one waits in its loop
        return _AsyncCubeClient(AsyncCubeClient(**args), self.dim)


def _matrix(result: Any, dim: int) -> tuple[np.ndarray, int]:
    """What the application gets: the (n, width) rows or, with --dim, get_embeddings' array."""
    from cube.client._core import embeddings

    misses = int(result.found.shape[0] - np.count_nonzero(result.found))
    if dim:
        return embeddings(result, dim, "float32"), misses
    if not result.width:
        raise ValueError("cube answered variable-width values; the bench writes fixed width")
    return result.column.as_rows(), misses


class _CubeClient:
    def __init__(self, client: Any, dim: int) -> None:
        self.client, self.dim = client, dim

    def fetch(self, keys: np.ndarray) -> tuple[np.ndarray, int]:
        return _matrix(self.client.seek(keys), self.dim)

    def close(self) -> None:
        self.client.close()


class _AsyncCubeClient:
    def __init__(self, client: Any, dim: int) -> None:
        self.client, self.dim = client, dim

    async def ready(self) -> None:
        """What an application does before it serves (connects, loads the codec)."""
        await self.client.wait_ready(10)

    async def fetch(self, keys: np.ndarray) -> tuple[np.ndarray, int]:
        return _matrix(await self.client.seek(keys), self.dim)

    async def close(self) -> None:
        await self.client.close()
