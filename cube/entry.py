"""The console scripts. Each checks that the packages of its extra are installed before it
imports its command, so `pip install cube-py` (the SDK alone) followed by `cube-server` says
which extra to install instead of dying with a ModuleNotFoundError traceback."""

from __future__ import annotations

import importlib
import importlib.util
import sys

# extra -> the import names it brings (pyproject.toml [project.optional-dependencies])
EXTRAS: dict[str, tuple[str, ...]] = {
    "server": ("uvloop", "aiohttp", "grpc_health", "grpc_reflection"),
    "builder": ("lz4", "cramjam", "tqdm"),
    "agent": ("aiohttp",),
    "transfer": ("aiohttp", "fsspec", "psutil", "pyftpdlib", "lz4", "cramjam", "tqdm"),
    "bench": ("redis", "pymemcache", "matplotlib", "psutil", "uvloop", "lz4"),
}


def missing(extra: str) -> list[str]:
    """The packages of `extra` that cannot be imported here."""
    return [name for name in EXTRAS[extra] if importlib.util.find_spec(name) is None]


def launch(command: str, extras: tuple[str, ...], module: str) -> int:
    """Run `module.main()` for `command` once its extras are present; else exit 2 saying
    what to install."""
    absent = {extra: missing(extra) for extra in extras}
    absent = {extra: names for extra, names in absent.items() if names}
    if absent:
        wanted = ",".join(absent)
        names = ", ".join(sorted({n for names in absent.values() for n in names}))
        print(
            f"error: {command} needs the cube-py[{wanted}] extra ({names} not installed):"
            f" pip install 'cube-py[{wanted}]'",
            file=sys.stderr,
        )
        return 2
    return int(importlib.import_module(module).main() or 0)


def cube_server() -> int:
    return launch("cube-server", ("server",), "cube.server.main")


def cube_cli() -> int:
    return launch("cube-cli", (), "cube.client.cli")


def cube_builder() -> int:
    return launch("cube-builder", ("builder",), "cube.builder.cli")


def cube_import() -> int:
    return launch("cube-import", (), "cube.builder.import_original")


def kvtool() -> int:
    return launch("kvtool", ("builder",), "cube.builder.kvtool")


def kv_to_seqfile() -> int:
    return launch("kv_to_seqfile", ("builder",), "cube.builder.kv_to_seqfile")


def cube_agent() -> int:
    return launch("cube-agent", ("agent",), "cube.agent.main")


def cube_transfer() -> int:
    return launch("cube-transfer", ("transfer",), "cube.transfer.main")


def cube_local() -> int:
    return launch("cube-local", ("transfer", "server", "agent"), "cube.transfer.local")


def cube_bench() -> int:
    return launch("cube-bench", ("bench", "server", "builder"), "cube.bench.cube_bench")


def cube_demo() -> int:
    return launch("cube-demo", ("transfer", "server", "agent"), "cube.transfer.demo")
