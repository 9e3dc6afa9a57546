"""MkDocs hook: table schemas read from the code at build time, so the docs cannot drift from it.

In a page, ``<!-- schemas MODULE:NAME -->`` is replaced by one section per table of the dict
``NAME`` (or of the dict ``NAME()`` returns, when it is a function), and
``<!-- schema MODULE:NAME TABLE -->`` by one section for the single schema ``NAME`` written as
``TABLE/``. Each section lists the columns with their Arrow types and the table's key."""
from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"<!-- (schemas?) ([\w.]+):(\w+)(?: (\w+))? -->")


def _resolve(module: str, name: str):
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    value = getattr(importlib.import_module(module), name)
    return value() if callable(value) else value


def _section(table: str, schema) -> str:
    from operators.io.tables import table_key

    key = table_key(schema)
    lines = [f"### `{table}/`", ""]
    lines.append(f"Key: {', '.join(f'`{k}`' for k in key)} (the current state is the latest row per key)."
                 if key else "No key: every row is kept.")
    lines += ["", "| column | type |", "|---|---|"]
    lines += [f"| `{f.name}` | `{f.type}` |" for f in schema]
    return "\n".join(lines) + "\n"


def _render(match: re.Match) -> str:
    kind, module, name, table = match.groups()
    value = _resolve(module, name)
    if kind == "schema":
        return _section(table or name.lower(), value)
    return "\n".join(_section(t, s) for t, s in value.items())


def on_page_markdown(markdown: str, **kwargs) -> str:
    return MARKER.sub(_render, markdown)
