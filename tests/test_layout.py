"""The package's shape: short modules, short functions, no import circle (docs/design.md)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "eagle3"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, Path]:
    out = {}
    for f in sorted(PACKAGE.rglob("*.py")):
        parts = list(f.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """eagle3 modules that ``name`` imports anywhere in its body (lazy imports included)."""
    tree = ast.parse(path.read_text())
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import module`
    return {m for m in found if m in known and m != name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (c := visit(m)):
                return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (c := visit(n)):
            return c
    return None


def test_no_module_over_the_line_limit():
    long = {n: len(p.read_text().splitlines()) for n, p in _modules().items()}
    assert {n: k for n, k in long.items() if k > MAX_MODULE_LINES} == {}


def test_no_function_over_the_line_limit():
    long = {}
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{name}.{node.name}"] = n
    assert long == {}


def test_no_import_circle():
    mods = _modules()
    # a package's __init__ is not an edge to its submodules unless it imports them
    graph = {n: _imports(n, p, set(mods)) for n, p in mods.items()}
    assert _cycle(graph) is None


def _package(module: str) -> str:
    """The unit of the package graph: ``eagle3.train.loop`` -> ``train``; a top-level module
    (``eagle3.io``) is its own unit; the package root ``eagle3`` is none."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for n, deps in graph.items():
        a = _package(n)
        out.setdefault(a, set())
        for m in deps:
            b = _package(m)
            if a and b and a != b:
                out[a].add(b)
                out.setdefault(b, set())
    out.pop("", None)
    return out


def test_no_package_circle():
    """docs/design.md's floor order holds between packages too: ``export`` never reaches back
    into ``train``, ``doctor`` and ``evaluate`` do not import each other, lazy imports counted."""
    mods = _modules()
    graph = {n: _imports(n, p, set(mods)) for n, p in mods.items()}
    assert _cycle(_package_graph(graph)) is None


def test_the_package_graph_folds_modules_into_packages():
    graph = {"eagle3.a.x": {"eagle3.b.y", "eagle3.a.z"}, "eagle3.a.z": set(),
             "eagle3.b.y": {"eagle3.io"}, "eagle3.io": set(), "eagle3": {"eagle3.a.x"}}
    assert _package_graph(graph) == {"a": {"b"}, "b": {"io"}, "io": set()}
    assert _cycle(_package_graph({**graph, "eagle3.b.w": {"eagle3.a.z"}})) == ["a", "b", "a"]


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
