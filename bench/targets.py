"""What cube-bench compares: the data set, and one `Target` per server (Redis, memcached, Cube).

A target starts its server(s) on loopback through a `ProcessRegistry` (so they are always
stopped by PID), loads the data set, and hands out clients whose `fetch(keys)` does what an
application does with a batch: ask for the keys, get back a (batch, value_size) uint8 matrix
(or (batch, dim) float32 with --dim), zero rows for misses, and the miss count.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, cast

import numpy as np

from cube.bench.keyspace import DerivedData, Distribution, values_of
from cube.bench.procs import ProcessRegistry, ServerProcess
from cube.processes import free_port


class TargetUnavailable(RuntimeError):
    """A target cannot run here (binary or client library missing): an error unless the user
    passed --skip_missing."""


class ModeUnsupported(TargetUnavailable):
    """The target has no client for the chosen --client mode: skipped, with a note."""


UNIFORM = Distribution("uniform")


class DataSource(ABC):
    """What every target loads and every client asks for: `count` keys of `value_size`-byte
    values, drawn from `distribution` (bench.keyspace) per request. Two kinds: `Dataset`, held
    in memory (random keys and values), and `DerivedDataset`, never in memory (values derived
    from keys, bench.keyspace): targets load either through `chunks`."""

    dim: int  # > 0: values are float32 embeddings of this dimension
    distribution: Distribution

    @property
    @abstractmethod
    def count(self) -> int: ...

    @property
    @abstractmethod
    def value_size(self) -> int: ...

    @abstractmethod
    def keys_at(self, rows: np.ndarray) -> np.ndarray:
        """The keys of data set rows `rows`."""

    @abstractmethod
    def values_at(self, rows: np.ndarray) -> np.ndarray:
        """The (n, value_size) uint8 values of data set rows `rows`."""

    @abstractmethod
    def chunks(self, size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(keys, (n, value_size) values) of every row, `size` rows at a time."""

    @abstractmethod
    def absent_keys(self, count: int, seed: int = 99) -> np.ndarray:
        """Keys that are not in the data set (for checking misses)."""

    def draw(self, rng: np.random.Generator, batch: int) -> np.ndarray:
        """A request's keys, drawn from `distribution`."""
        return self.keys_at(self.distribution.draw(rng, self.count, batch))

    def expected(self, rows: np.ndarray) -> np.ndarray:
        """What `fetch` must return for dataset rows `rows` (in the fetch output dtype)."""
        picked = self.values_at(rows)
        return picked.view(np.float32) if self.dim else picked


@dataclass(frozen=True)
class Dataset(DataSource):
    """`keys[i]` maps to `values[i]`: distinct random uint64 keys, random value bytes."""

    keys: np.ndarray  # uint64 (n,)
    values: np.ndarray  # uint8 (n, value_size)
    dim: int  # > 0: values are float32 embeddings of this dimension
    distribution: Distribution = UNIFORM

    @property
    def count(self) -> int:
        return int(self.keys.shape[0])

    @property
    def value_size(self) -> int:
        return int(self.values.shape[1])

    def keys_at(self, rows: np.ndarray) -> np.ndarray:
        picked: np.ndarray = self.keys[rows]
        return picked

    def values_at(self, rows: np.ndarray) -> np.ndarray:
        picked: np.ndarray = self.values[rows]
        return picked

    def chunks(self, size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for start in range(0, self.count, size):
            yield self.keys[start : start + size], self.values[start : start + size]

    def absent_keys(self, count: int, seed: int = 99) -> np.ndarray:
        rng = np.random.default_rng(seed)
        candidates = rng.integers(0, 2**64 - 1, count * 2 + 16, dtype=np.uint64)
        candidates = candidates[~np.isin(candidates, self.keys)]
        return candidates[:count]


@dataclass(frozen=True)
class DerivedDataset(DataSource):
    """bench.keyspace's derived data set: row i's key is keys_of(i), its value the key's bytes
    repeated; nothing is held, so any size loads and every answer can be checked."""

    data: DerivedData
    dim: int = 0
    distribution: Distribution = UNIFORM

    @property
    def count(self) -> int:
        return self.data.count

    @property
    def value_size(self) -> int:
        return self.data.width

    def keys_at(self, rows: np.ndarray) -> np.ndarray:
        return self.data.keys(rows)

    def values_at(self, rows: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(values_of(self.keys_at(rows), self.data.width))

    def chunks(self, size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for keys, values in self.data.chunks(size):
            yield keys, np.ascontiguousarray(values)

    def absent_keys(self, count: int, seed: int = 99) -> np.ndarray:
        return self.data.absent_keys(count, seed)


def make_dataset(
    count: int, value_size: int, dim: int = 0, seed: int = 1, distribution: Distribution = UNIFORM
) -> Dataset:
    """Distinct random 64-bit keys and random values (float32 embeddings when `dim` > 0)."""
    if count <= 0:
        raise ValueError(f"--keys must be > 0, got {count}")
    rng = np.random.default_rng(seed)
    keys = np.unique(rng.integers(0, 2**64 - 1, count + count // 50 + 16, dtype=np.uint64))
    rng.shuffle(keys)
    keys = keys[:count]
    if keys.shape[0] < count:  # ~impossible with 64-bit keys; the check keeps it honest
        raise RuntimeError(f"could only draw {keys.shape[0]} distinct keys of {count}")
    if dim:
        values = rng.standard_normal((count, dim), dtype=np.float32).view(np.uint8)
    else:
        values = rng.integers(0, 256, (count, value_size), dtype=np.uint8)
    return Dataset(keys, np.ascontiguousarray(values), dim, distribution)


def make_derived(
    count: int, value_size: int, dim: int = 0, distribution: Distribution = UNIFORM
) -> DerivedDataset:
    """The derived data set of `count` keys (values of dim * 4 bytes with `dim`)."""
    if count <= 0:
        raise ValueError(f"--keys must be > 0, got {count}")
    return DerivedDataset(DerivedData(count, dim * 4 or value_size), dim, distribution)


def rows_from_list(values: list[bytes | None], width: int, dim: int) -> tuple[np.ndarray, int]:
    """A list of value bytes (None = miss) as the fetch matrix plus the miss count."""
    misses = values.count(None)
    if misses:
        zero = bytes(width)
        filled = [zero if v is None else v for v in values]
    else:
        filled = cast(list[bytes], values)  # no miss: no None in it
    blob = b"".join(filled)
    if len(blob) != width * len(values):
        raise ValueError(
            f"answer has {len(blob)} value bytes for {len(values)} keys of {width} bytes"
        )
    matrix = np.frombuffer(blob, dtype=np.uint8).reshape(len(values), width)
    return (matrix.view(np.float32) if dim else matrix), misses


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _binary_version(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
        return (out.stdout or out.stderr).strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired, IndexError):
        return "unknown"


def require_binary(name: str, package: str) -> str:
    """Path of `name` on PATH, or TargetUnavailable saying how to install it."""
    path = shutil.which(name)
    if path is None:
        raise TargetUnavailable(
            f"{name} not found on PATH; install it with `sudo apt-get install -y {package}` "
            f"(or `make debs`), or pass --skip_missing to run without this target"
        )
    return path


class Target(ABC):
    """One system under test. `setup` starts and loads it; clients are made per thread."""

    name: str

    def __init__(self, registry: ProcessRegistry, workdir: Path, options: dict[str, Any]):
        self.registry = registry
        self.workdir = workdir
        self.options = options
        self.info: dict[str, Any] = {}  # command lines, load time, versions: for the report
        self.servers: list[ServerProcess] = []

    @abstractmethod
    def check_available(self, client_mode: str) -> None:
        """Raise TargetUnavailable before any work if this target cannot run."""

    @abstractmethod
    def setup(self, data: DataSource) -> None:
        """Start the server(s) and load the data set."""

    @abstractmethod
    def thread_client(self) -> Any:
        """A client for threads: `.fetch(keys) -> (matrix, misses)`, `.close()`. Safe to share
        between threads unless check_available refuses the "shared" mode."""

    def async_client(self, concurrency: int) -> Any:
        """A client shared by `concurrency` tasks: `await .fetch(keys)`, `await .close()`."""
        raise TargetUnavailable(f"{self.name} has no asyncio client")

    def server_pids(self) -> list[int]:
        """PIDs of this target's server processes and their workers (for CPU accounting)."""
        return [pid for server in self.servers for pid in server.pids()]

    def versions(self) -> dict[str, str]:
        return {}

    def stop(self) -> None:
        """Stop this target's servers (by PID, through the registry)."""
        for server in list(self.servers):
            self.registry.stop(server)
        self.servers.clear()


# --- Redis ----------------------------------------------------------------------------------


class RedisTarget(Target):
    """redis-server with persistence off; keys are decimal strings, loaded by pipelined MSET."""

    name = "redis"
    load_chunk = 10_000  # key/value pairs per MSET

    def check_available(self, client_mode: str) -> None:
        self.binary = require_binary("redis-server", "redis-server")
        try:
            import redis  # noqa: F401
        except ImportError as exc:
            raise TargetUnavailable("redis-py is not installed: pip install redis hiredis") from exc

    def setup(self, data: DataSource) -> None:
        self.start_server(data.value_size, data.dim)
        started = time.perf_counter()
        self.load_chunks(data.chunks(self.load_chunk * 10), data.count)
        self.info["load_seconds"] = round(time.perf_counter() - started, 2)

    def start_server(self, width: int, dim: int = 0) -> None:
        """redis-server on a free port of 127.0.0.1, persistence off, empty."""
        self.port = free_port()
        self.width, self.dim = width, dim
        argv = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--dir", str(self.workdir),
            "--logfile", "",
        ]  # fmt: skip
        self.servers.append(
            self.registry.start(self.name, argv, [self.port], self.workdir / "logs")
        )
        self.info["command"] = " ".join(a if a else '""' for a in argv)

    def load_chunks(self, chunks: Iterable[tuple[np.ndarray, np.ndarray]], count: int) -> None:
        """Load (keys, (n, width) values) chunks by pipelined MSET (`load_chunk` pairs each, 10
        in flight): only a chunk at a time is in this process, so a data set derived from its
        keys (bench.keyspace) of any size loads; RuntimeError unless Redis then holds `count`
        keys."""
        import redis

        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=60)
        try:
            pipe = client.pipeline(transaction=False)
            for keys, values in chunks:
                rows = np.ascontiguousarray(values).view(f"V{self.width}").ravel().tolist()
                listed = keys.tolist()
                for start in range(0, len(listed), self.load_chunk):
                    part = listed[start : start + self.load_chunk]
                    flat: list[Any] = [None] * (2 * len(part))
                    flat[0::2] = part
                    flat[1::2] = rows[start : start + self.load_chunk]
                    pipe.execute_command("MSET", *flat)  # type: ignore[no-untyped-call]  # redis-py's
                    if len(pipe) >= 10:
                        pipe.execute()
            pipe.execute()
            stored = client.dbsize()
        finally:
            client.close()
        if stored != count:
            raise RuntimeError(f"redis holds {stored} keys after loading {count}")
        self.info["load_note"] = f"pipelined MSET of {self.load_chunk:,} pairs"

    def thread_client(self) -> Any:
        return _RedisClient(self.port, self.width, self.dim)

    def async_client(self, concurrency: int) -> Any:
        return _AsyncRedisClient(self.port, self.width, self.dim, concurrency)

    def versions(self) -> dict[str, str]:
        return {
            "redis-server": _binary_version([self.binary, "--version"]).split(" sha=")[0],
            "redis-py": _version("redis"),
            "hiredis": _version("hiredis"),
        }


class _RedisClient:
    def __init__(self, port: int, width: int, dim: int) -> None:
        import redis

        self.redis = redis.Redis(host="127.0.0.1", port=port, socket_timeout=30)
        self.width, self.dim = width, dim

    def fetch(self, keys: np.ndarray) -> tuple[np.ndarray, int]:
        found = cast(list[bytes | None], self.redis.mget(keys.tolist()))  # not decoded: bytes
        return rows_from_list(found, self.width, self.dim)

    def close(self) -> None:
        self.redis.close()


class _AsyncRedisClient:
    def __init__(self, port: int, width: int, dim: int, concurrency: int) -> None:
        import redis.asyncio

        self.redis = redis.asyncio.Redis(
            host="127.0.0.1", port=port, socket_timeout=30, max_connections=concurrency + 1
        )
        self.width, self.dim = width, dim

    async def fetch(self, keys: np.ndarray) -> tuple[np.ndarray, int]:
        found = cast(list[bytes | None], await self.redis.mget(keys.tolist()))  # not decoded
        return rows_from_list(found, self.width, self.dim)

    async def close(self) -> None:
        await self.redis.aclose()


# --- memcached ------------------------------------------------------------------------------


class MemcachedTarget(Target):
    """memcached with enough memory for the data set; pymemcache get_many / set_many."""

    name = "memcached"
    load_chunk = 10_000

    def check_available(self, client_mode: str) -> None:
        self.binary = require_binary("memcached", "memcached")
        try:
            import pymemcache  # noqa: F401
        except ImportError as exc:
            raise TargetUnavailable("pymemcache is not installed: pip install pymemcache") from exc
        if client_mode in ("asyncio", "shared"):
            raise ModeUnsupported(
                f"memcached: pymemcache has no {client_mode} client (use --client thread)"
            )

    def setup(self, data: DataSource) -> None:
        from pymemcache.client.base import Client

        self.port = free_port()
        self.width, self.dim = data.value_size, data.dim
        # item overhead is ~50 bytes + key + value, in slab classes up to 1.25x apart
        memory_mb = max(64, int(data.count * (self.width + 20 + 64) * 1.5 / 2**20) + 16)
        argv = [
            self.binary,
            "-l", "127.0.0.1",
            "-p", str(self.port),
            "-U", "0",
            "-m", str(memory_mb),
            "-c", "4096",
        ]  # fmt: skip
        if os.geteuid() == 0:
            argv += ["-u", "root"]  # memcached refuses to run as root without it
        self.servers.append(
            self.registry.start(self.name, argv, [self.port], self.workdir / "logs")
        )
        self.info["command"] = " ".join(argv)
        started = time.perf_counter()
        client = Client(("127.0.0.1", self.port), timeout=60, connect_timeout=10)
        try:
            for chunk_keys, chunk_values in data.chunks(self.load_chunk):
                names = [str(k) for k in chunk_keys.tolist()]
                rows = np.ascontiguousarray(chunk_values).view(f"V{self.width}").ravel().tolist()
                client.set_many(dict(zip(names, rows, strict=True)), noreply=True)  # counted below
            items = int(client.stats().get(b"curr_items", 0))
        finally:
            client.close()
        if items != data.count:
            raise RuntimeError(
                f"memcached holds {items} items after loading {data.count} (out of memory? see -m)"
            )
        self.info["load_note"] = f"set_many of {self.load_chunk:,} keys"
        self.info["load_seconds"] = round(time.perf_counter() - started, 2)

    def thread_client(self) -> Any:
        return _MemcachedClient(self.port, self.width, self.dim)

    def versions(self) -> dict[str, str]:
        return {
            "memcached": _binary_version([self.binary, "--version"]),
            "pymemcache": _version("pymemcache"),
        }


class _MemcachedClient:
    def __init__(self, port: int, width: int, dim: int) -> None:
        from pymemcache.client.base import Client

        self.client = Client(("127.0.0.1", port), timeout=30, connect_timeout=10)
        self.width, self.dim = width, dim

    def fetch(self, keys: np.ndarray) -> tuple[np.ndarray, int]:
        names = list(map(str, keys.tolist()))
        found = self.client.get_many(names)
        return rows_from_list(list(map(found.get, names)), self.width, self.dim)

    def close(self) -> None:
        self.client.close()
