"""The screening rules' digest (``screen_rules``) and the rerun rule built on it: edits of the real
screening modules, generated, tell code from words; every recorded state of a slice meets the
documented rule."""
from __future__ import annotations

import ast
import functools
import io
import itertools
import tokenize

import pytest
from hypothesis import given, settings, strategies as st

from operators.pairs.crops.slice_io import slice_finished
from operators.pairs.screening.rules import PACKAGE, RULE_MODULES, rules_digest, screen_rules

SOURCES = {name: (PACKAGE / name).read_text(encoding="utf-8") for name in RULE_MODULES}


def _offset(source: str, line: int, col: int, col_in_bytes: bool = True) -> int:
    """The character offset of (line, column): ast gives the column in UTF-8 bytes, tokenize in
    characters."""
    lines = source.splitlines(keepends=True)
    head = lines[line - 1].encode()[:col].decode() if col_in_bytes else lines[line - 1][:col]
    return sum(len(x) for x in lines[:line - 1]) + len(head)


def _replace(source: str, node: ast.AST, text: str) -> str:
    a = _offset(source, node.lineno, node.col_offset)
    b = _offset(source, node.end_lineno, node.end_col_offset)
    return source[:a] + text + source[b:]


def _docstrings(source: str) -> list[ast.Constant]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and \
                    isinstance(first.value.value, str):
                out.append(first.value)
    return out


@functools.cache
def _numbers(source: str) -> list[ast.Constant]:
    """Every number written in the code (not True/False)."""
    return [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Constant)
            and isinstance(n.value, (int, float)) and not isinstance(n.value, bool)]


@functools.cache
def _line_ends(source: str) -> list[tuple[int, int]]:
    """Where each logical line ends (a comment may go there)."""
    return [t.start for t in tokenize.generate_tokens(io.StringIO(source).readline)
            if t.type == tokenize.NEWLINE and t.string]


def _with_comment(source: str, at: tuple[int, int]) -> str:
    i = _offset(source, *at, col_in_bytes=False)
    return source[:i] + "  # an edited comment" + source[i:]


def test_the_modules_have_what_the_edits_need():
    for name, source in SOURCES.items():
        assert _docstrings(source) and _numbers(source) and _line_ends(source), name


@functools.cache
def _digest_of(name: str) -> str:
    return rules_digest({name: SOURCES[name]})


# Budget: a third of the profile's, at most 60 edits (each parses and writes back a module of up to 1,300 lines, about 0.2 s).
@settings(settings.default, max_examples=min(settings.default.max_examples // 3, 60))
@given(st.data())
def test_words_leave_the_digest_and_code_changes_it(data):
    """Generated edits of the real modules: comments added at line ends and docstrings rewritten
    keep the digest (an edit of words judges no slice again); one number of the code changed by
    one changes it (any changed rule judges them again). The digest is one module's at a time
    (it is a hash over each module in turn)."""
    name = data.draw(st.sampled_from(sorted(SOURCES)), label="module")
    before = _digest_of(name)
    words = SOURCES[name]
    ends = _line_ends(words)
    for at in sorted(data.draw(st.lists(st.sampled_from(ends), min_size=1, max_size=5, unique=True),
                               label="comments"), reverse=True):
        words = _with_comment(words, at)
    docs = _docstrings(words)
    doc = docs[data.draw(st.integers(0, len(docs) - 1), label="docstring")]
    words = _replace(words, doc, '"""Rewritten in other words."""')
    assert rules_digest({name: words}) == before

    numbers = _numbers(SOURCES[name])
    number = numbers[data.draw(st.integers(0, len(numbers) - 1), label="number")]
    code = _replace(SOURCES[name], number, repr(number.value + 1))
    assert rules_digest({name: code}) != before


def test_every_module_the_screen_imports_is_digested():
    """The screen's own imports within the package, read from its code: each is one of the digested
    modules (a rule moved into a module the digest left out would change no slice's record)."""
    seen = {"screening.py"}
    todo = ["screening.py"]
    while todo:
        tree = ast.parse((PACKAGE / todo.pop()).read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("operators.pairs.screening."):
                name = node.module.rsplit(".", 1)[1] + ".py"
                if name not in seen:
                    seen.add(name)
                    todo.append(name)
    assert {"repeats.py", "roofs.py"} <= seen
    assert seen <= set(RULE_MODULES)


def test_the_installation_s_digest_is_its_modules():
    assert screen_rules() == rules_digest(SOURCES)
    assert len(screen_rules()) == 10


# Each part of a recorded state: absent (None), as this run would record it, or another value.
STATES = [None] + [(key, rules) for key, rules in itertools.product((None, "k", "k-old"), (None, "r", "r-old"))]


def reference(recorded, key, rules):
    """docs/registration.md, "Reruns": a slice is skipped only when recorded under the settings and
    inputs this run would use (a row from before ``settings_key`` passes) and by the same screening
    rules (a row without ``screen_rules`` does not)."""
    if recorded is None:
        return False
    return recorded[0] in (None, key) and recorded[1] == rules


@pytest.mark.parametrize("recorded", STATES, ids=str)
def test_a_slice_is_finished_only_under_the_same_settings_and_screen(recorded):
    done, reason = slice_finished(recorded, "k", "r")
    assert done == reference(recorded, "k", "r")
    assert reason == ("finished" if done else "new" if recorded is None else
                      "settings" if recorded[0] not in (None, "k") else "screen_rules")
