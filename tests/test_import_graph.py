"""The package's import graph, read statically from components/logitless (nothing is imported).

Every ``import`` / ``from ... import`` of a ``logitless`` module is an edge, listed apart as
module-level (run when the module is imported) or function-level (run when the function is called).
An edge points at the module named, or at ``package.name`` when that is a module of its own (``from
logitless.ops import chunked``). Parent packages that Python imports on the way are not edges: a
package's ``__init__`` is a node with its own imports.

No cycle is allowed at either level: a cycle through a function-level import still means two modules
that each need the other, which a lazy import only hides.
"""

import ast
import pathlib
from typing import Dict, List, Set, Tuple

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "components"
PACKAGE = ROOT / "logitless"


def _modules() -> Dict[str, pathlib.Path]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    return modules


MODULES = _modules()


def _resolve(name: str) -> str:
    """The longest prefix of the dotted ``name`` that is a module of the package."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _targets(node: ast.AST, module: str, is_package: bool) -> List[str]:
    """The package's modules an import statement names (relative imports resolved)."""
    if isinstance(node, ast.Import):
        return [_resolve(a.name) for a in node.names if a.name.split(".")[0] == "logitless"]
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - node.level + 1]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    if source.split(".")[0] != "logitless":
        return []
    return [f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else _resolve(source) for a in node.names]


def _imports() -> Tuple[Dict[str, Set[str]], Dict[str, Set[str]], Dict[str, Set[str]]]:
    """``(module-level, function-level, all)`` edges of every module; also every import's top name."""
    top: Dict[str, Set[str]] = {m: set() for m in MODULES}
    inner: Dict[str, Set[str]] = {m: set() for m in MODULES}
    roots: Dict[str, Set[str]] = {m: set() for m in MODULES}
    for module, path in MODULES.items():
        is_package = path.name == "__init__.py"

        def visit(node: ast.AST, in_function: bool) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    names = [a.name for a in child.names] if isinstance(child, ast.Import) else [child.module or ""]
                    roots[module].update(n.split(".")[0] for n in names if not getattr(child, "level", 0))
                    (inner if in_function else top)[module].update(
                        t for t in _targets(child, module, is_package) if t and t != module)
                visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

        visit(ast.parse(path.read_text(), str(path)), False)
    return top, inner, roots


TOP, INNER, ROOTS = _imports()


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_the_walk_sees_the_package():
    """The walk reads the package's modules and their imports (a test that found no module would pass)."""
    assert "logitless.ops.dispatch" in MODULES and "logitless.generation.compiled" in MODULES
    assert "logitless.ops.chunked" in TOP["logitless.ops.dispatch"]
    assert "logitless.ops.triton" in INNER["logitless.ops.dispatch"]  # the lazy Triton import


def test_the_walk_finds_a_cycle():
    """A made-up graph with a cycle through a function-level edge is reported as one component."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_at_module_level():
    assert _cycles(TOP) == []


def test_no_import_cycle_through_function_level_imports():
    both = {m: TOP[m] | INNER[m] for m in MODULES}
    assert _cycles(both) == []


@pytest.mark.parametrize("outside", ["benchmarks", "experiments", "tests"])
def test_the_package_imports_nothing_outside_it(outside):
    """Research scripts and tests use the package; the package never reaches back into them."""
    assert [m for m in MODULES if outside in ROOTS[m]] == []


def test_ops_and_modules_import_nothing_above_them():
    """The head's ops import only ops (and the shared settings, platform and first-start helpers); the
    model wrapper imports ops and itself: the layering docs/architecture.md draws."""
    shared = ("logitless.settings", "logitless._platform", "logitless.first_start")
    allowed = {"ops": ("logitless.ops", *shared), "modules": ("logitless.ops", "logitless.modules", *shared)}
    for room, prefixes in allowed.items():
        for m in (m for m in MODULES if m.startswith(f"logitless.{room}")):
            above = [t for t in TOP[m] | INNER[m] if not t.startswith(prefixes)]
            assert above == [], f"{m} imports {above}"
