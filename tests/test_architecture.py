"""The layering docs/ARCHITECTURE.md describes, checked: the pure core imports no shell (the
servers, clients, tools) and nothing that does network or process I/O, so it stays usable
from anywhere (the SDK, the Spark build, tests) and never imports upward."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CORE = [
    "backoff", "donefile", "format", "hashing", "idle", "index", "layout", "original_format",
    "paddle_ps", "_paddle_ps_jit", "protocol", "routing", "values", "wire",
]  # fmt: skip
SHELLS = ("cube.server", "cube.client", "cube.agent", "cube.transfer", "cube.builder", "cube.bench")
IO = ("grpc", "aiohttp", "asyncio", "socket", "subprocess", "urllib", "ftplib", "mmap")


def imports_of(path: Path) -> set[str]:
    """Modules imported at run time (imports under `if TYPE_CHECKING:` are for types only)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            node.body = []
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


@pytest.mark.parametrize("module", CORE)
def test_the_pure_core_imports_no_shell_and_no_network(module):
    found = imports_of(REPO / "cube" / f"{module}.py")
    upward = sorted(n for n in found if n.startswith(SHELLS))
    io = sorted(n for n in found if n.split(".")[0] in IO)
    assert not upward, f"cube/{module}.py imports the shells {upward}"
    assert not io, f"cube/{module}.py imports I/O modules {io}"


def test_no_module_of_the_cube_package_itself_imports_a_tool():
    """cube/*.py (not the subpackages) never imports the tools built on the shells."""
    for path in (REPO / "cube").glob("*.py"):
        tools = sorted(n for n in imports_of(path) if n.startswith(("cube.transfer", "cube.bench")))
        assert not tools, f"{path.name} imports {tools}"
