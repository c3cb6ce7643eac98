"""The layering docs/ARCHITECTURE.md describes, checked: the pure core imports no shell (the
servers, clients, tools) and nothing that does network or process I/O, so it stays usable
from anywhere (the SDK, the Spark build, tests) and never imports upward."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CORE = [
    "backoff", "donefile", "format", "hashing", "idle", "index", "kernel_constants", "layout",
    "original_format", "paddle_ps", "_paddle_ps_jit", "protocol", "routing", "values", "wire",
]  # fmt: skip
SHELLS = ("cube.server", "cube.client", "cube.agent", "cube.transfer", "cube.builder", "cube.bench")
IO = ("grpc", "aiohttp", "asyncio", "socket", "subprocess", "urllib", "ftplib", "mmap")


# The repo's folders and the package names they install as (pyproject.toml package-dir).
PACKAGE_DIRS = {
    "cube": "cube", "builder": "cube.builder", "agent": "cube.agent",
    "transfer": "cube.transfer", "bench": "cube.bench",
}  # fmt: skip
# Import cycles known and not yet broken (each with the module that would break it).
KNOWN_CYCLES = [
    # cube/builder/paddle_ps.py imports BuildError from build, which imports it lazily (issue 25's
    # module: BuildError to a leaf of the builder breaks it)
    ["cube.builder.build", "cube.builder.paddle_ps", "cube.builder.sources"],
]


def modules() -> dict[str, Path]:
    """Every module of the installed package, by dotted name -> its file."""
    found = {}
    for folder, package in PACKAGE_DIRS.items():
        for path in (REPO / folder).rglob("*.py"):
            parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
            if "micro" in parts or path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue  # bench/micro is not a package; generated stubs
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def imports_of(path: Path, names: bool = False) -> set[str]:
    """Modules imported at run time (imports under `if TYPE_CHECKING:` are for types only);
    with `names`, also `module.name` of each `from module import name` (a submodule, maybe)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            node.body = []
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            if names:
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


@pytest.mark.parametrize("module", CORE)
def test_the_pure_core_imports_no_shell_and_no_network(module: str) -> None:
    found = imports_of(REPO / "cube" / f"{module}.py")
    upward = sorted(n for n in found if n.startswith(SHELLS))
    io = sorted(n for n in found if n.split(".")[0] in IO)
    assert not upward, f"cube/{module}.py imports the shells {upward}"
    assert not io, f"cube/{module}.py imports I/O modules {io}"


def test_no_module_of_the_cube_package_itself_imports_a_tool() -> None:
    """cube/*.py (not the subpackages) never imports the tools built on the shells."""
    for path in (REPO / "cube").glob("*.py"):
        tools = sorted(n for n in imports_of(path) if n.startswith(("cube.transfer", "cube.bench")))
        assert not tools, f"{path.name} imports {tools}"


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_no_import_cycle_between_the_modules() -> None:
    """Imports anywhere in a module count (a lazy import inside a function too): a cycle means
    a module cannot be understood, tested or imported alone, and tempts copying constants to
    dodge it (the kernels once did: `_jit -> kernel -> index -> build_kernels -> kernel`)."""
    found = modules()
    graph = {
        name: {m for m in imports_of(path, names=True) if m in found and m != name}
        for name, path in found.items()
    }
    cycles = [c for c in import_cycles(graph) if c not in KNOWN_CYCLES]
    assert not cycles, f"import cycles: {cycles}"


def test_the_kernels_constants_are_defined_once() -> None:
    """TOMBSTONE, MAX_ROWS, MISS, OFFSET_BITS and COMPILED are assigned in cube.kernel_constants
    only (the others import them), so no copy can drift from it."""
    names = {"TOMBSTONE", "MAX_ROWS", "MISS", "OFFSET_BITS", "COMPILED"}
    for module, path in modules().items():
        if module == "cube.kernel_constants":
            continue
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else []
            assigned = {t.id for t in targets if isinstance(t, ast.Name)} & names
            assert not assigned, f"{module} assigns {sorted(assigned)}: import them"


LONGEST = 80  # lines of one function, docstring included


def test_no_function_is_long_without_saying_why() -> None:
    """A function over LONGEST lines is hard to hold in one's head: split it, or say in its
    docstring why it is one piece ("Long: ..."; e.g. a hot loop that a call per step would
    slow down, or a flag table)."""
    long = []
    for path in modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            assert node.end_lineno is not None
            lines = node.end_lineno - node.lineno + 1
            where = f"{path.relative_to(REPO)}:{node.name}"
            if lines > LONGEST and "Long:" not in (ast.get_docstring(node) or ""):
                long.append(f"{where} ({lines} lines)")
    assert not long, long


def test_the_module_table_lists_every_module() -> None:
    """docs/ARCHITECTURE.md's module table has one row per module of the tree, and no row for a
    module that is not there (a module added, moved or removed needs its row)."""
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    section = text.split("\n## Modules\n", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `([^`]+\.py)` \|", section, flags=re.MULTILINE)
    tree = {str(path.relative_to(REPO)) for path in modules().values()}
    assert len(listed) == len(set(listed)), "a module is listed twice"
    assert not tree - set(listed), f"missing from the module table: {sorted(tree - set(listed))}"
    assert not set(listed) - tree, f"listed but not in the tree: {sorted(set(listed) - tree)}"


def test_the_typecheck_tree_is_the_installed_layout() -> None:
    """typecheck/cube (what mypy checks, pyproject.toml) links every module and package of
    cube/, and builder/, agent/, transfer/ and bench/ as cube.builder, ...: a module missing
    there would go unchecked."""
    tree = REPO / "typecheck" / "cube"
    wanted = {
        entry.name: entry
        for entry in (REPO / "cube").iterdir()
        if entry.name.endswith((".py", ".typed"))
        or (entry.is_dir() and (entry / "__init__.py").exists())
    }
    wanted |= {name: REPO / name for name in ("builder", "agent", "transfer", "bench")}
    linked = {entry.name: entry for entry in tree.iterdir()}
    assert sorted(linked) == sorted(wanted), "typecheck/cube differs from cube/: relink it"
    for name, entry in linked.items():
        assert entry.is_symlink() and entry.resolve() == wanted[name].resolve(), name


# The parts docs/ARCHITECTURE.md's diagram draws, by module name prefix (longest first wins);
# a cube.* module under none of them is "core" when CORE lists it, else "support".
PARTS = {
    "cube.server": "server", "cube.client": "SDK", "cube.builder": "builder",
    "cube.agent": "agent", "cube.transfer": "transfer", "cube.bench": "bench",
    "cube.seqfile": "support", "cube.pb": "support",
}  # fmt: skip
DIAGRAM_BEGIN = "<!-- parts diagram: generated by `python tests/test_architecture.py` -->"
DIAGRAM_END = "<!-- end of the parts diagram -->"


KERNELS = {  # the compiled loops and what loads them: the core's compiled twins
    "cube._jit", "cube._kernel_jit", "cube._lane_jit", "cube._paddle_ps_jit", "cube._sdk_jit",
    "cube.build_kernels", "cube.kernel", "cube.kernel_cache",
}  # fmt: skip


def part_of(module: str) -> str:
    if module in KERNELS:
        return "kernels"
    for prefix, part in sorted(PARTS.items(), key=lambda item: -len(item[0])):
        if module == prefix or module.startswith(prefix + "."):
            return part
    return "core" if module.removeprefix("cube.") in CORE else "support"


def parts_diagram() -> str:
    """A mermaid graph of which part imports which (any import of a module of the other part,
    lazy ones too), from the code as it is."""
    found = modules()
    edges: set[tuple[str, str]] = set()
    for name, path in found.items():
        for imported in imports_of(path, names=True):
            if imported == "cube":  # (`from cube import x`: x is the module imported)
                continue
            if imported in found and part_of(imported) != part_of(name):
                edges.add((part_of(name), part_of(imported)))
    lines = ["```mermaid", "graph TD"]
    lines += [f"    {a} --> {b}" for a, b in sorted(edges)]
    return "\n".join([*lines, "```"])


def test_the_parts_diagram_is_the_code_s() -> None:
    """docs/ARCHITECTURE.md's diagram is what the imports say today (regenerate it with
    `python tests/test_architecture.py`); no shell is imported by the core, the kernels or
    the support modules."""
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    drawn = text.split(DIAGRAM_BEGIN, 1)[1].split(DIAGRAM_END, 1)[0].strip()
    assert drawn == parts_diagram(), "the diagram is stale: python tests/test_architecture.py"
    shells = ("server", "SDK", "builder", "agent", "transfer", "bench")
    for floor in ("core", "kernels", "support"):
        upward = [line for line in drawn.splitlines() if line.strip().startswith(f"{floor} -->")]
        assert not [line for line in upward if line.split("--> ")[1] in shells], upward


def _write_diagram() -> None:
    path = REPO / "docs" / "ARCHITECTURE.md"
    text = path.read_text()
    before, rest = text.split(DIAGRAM_BEGIN, 1)
    after = rest.split(DIAGRAM_END, 1)[1]
    path.write_text(f"{before}{DIAGRAM_BEGIN}\n{parts_diagram()}\n{DIAGRAM_END}{after}")


if __name__ == "__main__":
    _write_diagram()
