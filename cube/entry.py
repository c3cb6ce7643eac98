"""The console scripts. Each checks that the packages of its extra are installed before it
imports its command, so `pip install cube-py` (the SDK alone) followed by `cube-server` says
which extra to install instead of dying with a ModuleNotFoundError traceback. What each extra
brings is read from the installed package's metadata (pyproject.toml)."""

from __future__ import annotations

import importlib
import re
import sys
from importlib import metadata

DISTRIBUTION = "cube-py"
_REQUIREMENT = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?")
_EXTRA_MARKER = re.compile(r"""\bextra\s*==\s*["']([^"']+)["']""")


def _requires() -> list[str]:
    """cube-py's requirement lines as installed (pyproject.toml's dependencies and extras);
    none when it is not installed (run from a source tree: nothing to check)."""
    try:
        return metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        return []


def canonical(name: str) -> str:
    """A distribution name as PyPI compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(extra: str) -> list[str]:
    """The distributions `extra` brings, read from the package's metadata (pyproject.toml is
    their one home), with those of the extras it includes (`cube-py[builder]`)."""
    found: list[str] = []
    pending, seen = [extra], set()
    while pending:
        wanted = pending.pop()
        seen.add(wanted)
        for line in _requires():
            spec, _, marker = line.partition(";")
            said = _EXTRA_MARKER.search(marker)
            shape = _REQUIREMENT.match(spec)
            if said is None or said.group(1) != wanted or shape is None:
                continue
            name, included = shape.groups()
            if canonical(name) == DISTRIBUTION:
                pending += [e.strip() for e in (included or "").split(",") if e.strip() not in seen]
            elif name not in found:
                found.append(name)
    return found


def missing(extra: str) -> list[str]:
    """The distributions of `extra` that are not installed here."""
    absent = []
    for name in requirements(extra):
        try:
            metadata.version(name)
        except metadata.PackageNotFoundError:
            absent.append(name)
    return absent


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
