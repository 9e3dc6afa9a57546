"""Every third-party import is declared: the runtime code's in the core requirements (or, imported
lazily, in the extra named for it in operators/optional.py), the tests' and benchmarks' in the test
extra. Checked against the installed distribution's own metadata, so an undeclared import fails here
even when the environment happens to have the package."""
from __future__ import annotations

import ast
import functools
import re
import sys
from importlib.metadata import packages_distributions, requires
from pathlib import Path

import pytest

from operators.optional import EXTRAS

REPO = Path(__file__).resolve().parents[2]
OWN = {"jobs", "operators", "prompts", "tests", "benchmarks"}
# Imported only inside the Label Studio SDK's own environment (it pins numpy/OpenCV below ours), never
# from ours: operators/labelstudio/client.py runs it there when it is not importable here.
OWN_ENVIRONMENT = {"label_studio_sdk",
                   # benchmarks/registration_arosics.py runs in AROSICS's environment (GDAL's bindings)
                   "arosics", "osgeo"}


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> dict[str, set[str]]:
    """{extra or "": {distribution, ...}} from the installed changeforge's metadata."""
    out: dict[str, set[str]] = {}
    for req in requires("changeforge") or []:
        name = _normalise(re.match(r"[A-Za-z0-9_.-]+", req).group(0))
        extra = re.search(r"""extra\s*==\s*["']([^"']+)""", req)
        out.setdefault(extra.group(1) if extra else "", set()).add(name)
    # an extra that names changeforge[other extras] includes theirs
    for extra, names in list(out.items()):
        for req in requires("changeforge") or []:
            m = re.match(r"changeforge\[([^\]]+)\].*extra\s*==\s*[\"']" + re.escape(extra), req)
            if m:
                for other in m.group(1).split(","):
                    names |= out.get(other.strip(), set())
    return out


def _guards_import_error(node: ast.AST) -> bool:
    return isinstance(node, ast.Try) and any(
        isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError") for h in node.handlers)


def _statements(body: list, guarded: bool = False):
    """(statement, inside a ``try`` that catches ImportError) for every statement, nested ones included.
    An import is a statement, so only statement lists are walked, never expressions (the same imports
    as ``ast.walk`` finds, in a fraction of its time)."""
    for node in body:
        yield node, guarded
        inner = guarded or _guards_import_error(node)
        for field in ("body", "orelse", "finalbody"):
            children = getattr(node, field, None)
            if isinstance(children, list):
                yield from _statements(children, inner)
        for part in getattr(node, "handlers", None) or getattr(node, "cases", None) or []:
            yield from _statements(part.body, inner)


@functools.cache   # three tests read the same folders: parsed once
def imports(folder: str) -> tuple[tuple[str, str, bool, bool], ...]:
    """(top-level module, file:line, at module level, guarded by ``except ImportError``)."""
    found = []
    for path in sorted((REPO / folder).rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        top_level = {id(n) for n in tree.body}
        for node, guarded in _statements(tree.body):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in OWN or top == "__future__":
                    continue
                found.append((top, f"{path.relative_to(REPO)}:{node.lineno}", id(node) in top_level, guarded))
    return tuple(found)


@functools.cache
def distributions_of(module: str) -> set[str]:
    return {_normalise(d) for d in _module_distributions().get(module, [])}


@functools.cache
def _module_distributions() -> dict[str, list[str]]:
    return packages_distributions()


def test_runtime_imports_are_core_requirements():
    deps = declared()
    wrong = []
    for module, where, _, guarded in imports("jobs") + imports("operators"):
        if module in OWN_ENVIRONMENT or guarded or module in EXTRAS:
            continue
        if not distributions_of(module) & deps[""]:
            wrong.append(f"{where}: {module} (distribution {sorted(distributions_of(module)) or '?'})")
    assert not wrong, "imported by the jobs but not in [project] dependencies:\n" + "\n".join(wrong)


def test_optional_parts_are_extras_imported_lazily():
    deps = declared()
    for module, (extra, _) in EXTRAS.items():
        assert distributions_of(module) & deps.get(extra, set()), f"{module} is not in the {extra!r} extra"
    eager = [f"{where}: {module}" for module, where, top, _ in imports("jobs") + imports("operators")
             if module in EXTRAS and top]
    assert not eager, "optional packages imported at module level (a job would fail without the extra):\n" + \
        "\n".join(eager)
    direct = [f"{where}: {module}" for module, where, _, _ in imports("jobs") + imports("operators")
              if module in EXTRAS and "operators/optional.py" not in where]
    assert not direct, "optional packages must be imported through operators.optional.require:\n" + "\n".join(direct)


def test_tests_and_benchmarks_imports_are_in_the_test_extra():
    deps = declared()
    allowed = deps[""] | deps.get("test", set())
    wrong = [f"{where}: {module}" for module, where, _, guarded in imports("tests") + imports("benchmarks")
             if not guarded and module not in OWN_ENVIRONMENT and not distributions_of(module) & allowed]
    assert not wrong, "imported by tests/benchmarks but not declared:\n" + "\n".join(wrong)


def test_a_missing_extra_names_what_to_install(monkeypatch):
    from operators import optional

    monkeypatch.setitem(sys.modules, "wordcloud", None)   # importing it now raises ImportError
    with pytest.raises(optional.MissingExtra, match=r"pip install 'changeforge\[report\]'"):
        optional.require("wordcloud")
