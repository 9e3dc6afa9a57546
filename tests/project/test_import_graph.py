"""The import graph of ``operators/``: no cycles between modules, none between the step
subpackages of ``operators/pairs/``, and nothing under ``operators/`` imports ``jobs``.

The graph is read from the source with :mod:`ast` (every ``import`` / ``from ... import``,
module level or inside a function), so a cycle hidden in a lazy import counts too.
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imported_names(path: Path, module: str) -> set[str]:
    """Every module name an import statement in ``path`` refers to (relative imports resolved;
    ``from a.b import c`` yields both ``a.b`` and ``a.b.c``, whichever of them is a module)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in statements(tree.body):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            out.add(prefix)
            out.update(f"{prefix}.{alias.name}" for alias in node.names)
    return out


def statements(body: list):
    """Every statement of ``body``, nested ones included. An import is a statement, so walking the
    statement lists alone finds every import ``ast.walk`` finds, without visiting the expressions."""
    for node in body:
        yield node
        for field in ("body", "orelse", "finalbody"):
            children = getattr(node, field, None)
            if isinstance(children, list):
                yield from statements(children)
        for part in getattr(node, "handlers", None) or getattr(node, "cases", None) or []:
            yield from statements(part.body)


def import_graph(root: Path, top: str = "operators") -> tuple[dict[str, set[str]], set[str]]:
    """(module -> modules of ``top`` it imports, names from outside ``top`` imported by any)."""
    files = {module_name(p, root): p for p in sorted((root / top).rglob("*.py"))}
    graph, outside = {}, set()
    for mod, path in files.items():
        names = imported_names(path, mod)
        graph[mod] = {n for n in names if n in files and n != mod}
        outside.update(names)
    return graph, outside


@functools.cache
def repo_graph() -> tuple[dict[str, set[str]], set[str]]:
    """This repository's graph, parsed once for the tests below (none of them changes it)."""
    return import_graph(ROOT)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as [a, b, ..., a], or None (iterative depth-first search)."""
    state: dict[str, int] = {}            # 1: on the stack, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        state[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                path.pop()
                state[node] = 2
            elif state.get(child) == 1:
                return path[path.index(child):] + [child]
            elif not state.get(child):
                state[child] = 1
                path.append(child)
                stack.append((child, iter(sorted(graph.get(child, ())))))
    return None


def package_graph(graph: dict[str, set[str]], parent: str) -> dict[str, set[str]]:
    """The graph between the direct subpackages of ``parent`` (a module outside them is ignored)."""
    def step(mod: str) -> str | None:
        rest = mod[len(parent) + 1:] if mod.startswith(parent + ".") else ""
        return f"{parent}.{rest.split('.')[0]}" if "." in rest else None

    out: dict[str, set[str]] = {}
    for mod, deps in graph.items():
        a = step(mod)
        if a is None:
            continue
        out.setdefault(a, set()).update(b for b in map(step, deps) if b is not None and b != a)
    return out


def test_find_cycle_sees_a_cycle_and_a_dag():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"a"}}) == ["a", "a"]


def test_imported_names_resolve_relative_and_lazy_imports(tmp_path):
    pkg = tmp_path / "operators" / "x"
    pkg.mkdir(parents=True)
    (tmp_path / "operators" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from . import b\n    from .b import g\n")
    (pkg / "b.py").write_text("import operators.x.a\n")
    graph, _ = import_graph(tmp_path)
    assert graph["operators.x.a"] == {"operators.x", "operators.x.b"}
    assert find_cycle(graph) == ["operators.x.a", "operators.x.b", "operators.x.a"]


def test_operators_modules_import_no_cycle():
    graph, _ = repo_graph()
    assert len(graph) > 50          # the whole tree was read
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_pairs_steps_import_no_cycle():
    """The steps of operators/pairs/ depend on each other in one direction only."""
    graph, _ = repo_graph()
    steps = package_graph(graph, "operators.pairs")
    assert len(steps) >= 6
    cycle = find_cycle(steps)
    assert cycle is None, "cycle between steps of operators/pairs: " + " -> ".join(cycle)


@pytest.mark.parametrize("forbidden", ["jobs", "benchmarks", "tests"])
def test_operators_import_nothing_from_jobs(forbidden):
    _, names = repo_graph()
    bad = sorted(n for n in names if n == forbidden or n.startswith(forbidden + "."))
    assert not bad, f"operators/ imports {forbidden}: {bad}"
