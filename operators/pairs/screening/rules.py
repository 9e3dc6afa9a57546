"""Which screening rules judged a slice: a digest of the screening package's code.

A slice's verdict and its ``residual_px`` come from its settings (``settings_key``) and from the
screen's code. A rerun that kept a slice judged by an older screen would publish a verdict no
current rule gave; the pairs job records this digest on every slice and judges again the slices
recorded under another one. It is taken from the code itself, not from a number someone must
remember to raise: comments, docstrings and layout are left out (``ast.unparse`` of the syntax
tree without docstrings), so a change to what the screen computes changes it and an edit of its
words does not.
"""
from __future__ import annotations

import ast
import functools
import hashlib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
# The modules whose code decides a crop's verdict and its residual: every module of the package but
# this one (which only records) and the package's marker, so a module added to the screen counts.
RULE_MODULES = tuple(sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "rules.py")))


def _without_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return tree


def code_text(source: str) -> str:
    """``source`` as the code it runs: parsed, docstrings dropped, written back (no comments, one
    layout)."""
    return ast.unparse(_without_docstrings(ast.parse(source)))


def rules_digest(sources: dict[str, str]) -> str:
    """Ten hex digits over each module's name and :func:`code_text`."""
    h = hashlib.sha1()
    for name in sorted(sources):
        h.update(name.encode() + b"\0" + code_text(sources[name]).encode() + b"\0")
    return h.hexdigest()[:10]


@functools.cache
def screen_rules() -> str:
    """The digest of this installation's screening rules (recorded as ``screen_rules``)."""
    return rules_digest({name: (PACKAGE / name).read_text(encoding="utf-8") for name in RULE_MODULES})
