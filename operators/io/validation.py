"""Checks of a job's options before any work: ranges, paths, dates, URLs and options that go together,
declared once in the config dataclasses' field metadata and applied by :mod:`operators.io.cli` to the
command line, a run file (``--config``) and a chain file alike.

Keys a field's metadata may hold (all optional; an empty or unset value is not checked):

- ``"min"`` / ``"max"``: inclusive bounds; ``"gt"``: strictly above (``"gt": 0`` for rates);
  ``"range": (lo, hi)``: inclusive (``(0, 1)`` for fractions, ``(0, 100)`` for percentages);
  on a list-valued option every element is checked, and ``"length"`` fixes how many there are;
  ``"increasing": True`` wants them in increasing order.
- ``"path"``: ``"must_exist"`` (a file or a folder), ``"dir"`` or ``"file"``: a local path must be that
  (URIs with a scheme, ``s3://`` or ``https://``, are not looked up here).
- ``"fractions": n``: ``n`` comma-separated non-negative numbers summing to 1 within
  :data:`FRACTIONS_TOLERANCE` (split fractions; :func:`fractions_problem`).
- ``"holds": (suffixes, "what")``: a local folder holds at least one such file (at any depth);
  ``"holds_except": (suffixes, "what")``: at least one file that is not such a one (sidecars);
  ``"json": "nonempty"``: a local file is JSON holding at least one entry (a Label Studio export).
- ``"date": True``: ``YYYY-MM-DD``; ``"url": True``: ``http(s)://host[:port]`` with a port in 1-65535.
- ``"not_below": "<field>"``: at least the other option's value (a slice holds its crop);
  ``"conflicts": ("<field>", ...)``: not together with those; ``"requires": ("<field>", ...)``: only with them.

Every failure is one line naming the option and the value (and the file and key, for a run or chain
file), printed as ``<prog>: <message>``; the process exits with :data:`USAGE` before anything is read,
written or started.
"""
from __future__ import annotations

import argparse
import datetime as dt
import difflib
import math
import os
import re
import sys
from urllib.parse import urlsplit

USAGE = 2          # a bad option: nothing was done
NOTHING_DONE = 3   # the run ran, but every item failed or there was nothing it could do
# Fractions must sum to 1 within this: room for the rounding of typed decimals (0.7+0.1+0.2 is
# 0.9999999999999999), none for a typo such as 0.5,0.6,0.2 (rescaling it would hide the typo).
FRACTIONS_TOLERANCE = 1e-6

CHECK_KEYS = ("min", "max", "gt", "range", "length", "increasing", "fractions", "path", "holds", "holds_except",
              "json", "date", "url", "not_below", "conflicts", "requires")


def attach(action: argparse.Action, metadata) -> argparse.Action:
    """Record the checks among a field's ``metadata`` on its argparse action."""
    checks = {k: metadata[k] for k in CHECK_KEYS if k in metadata}
    if checks:
        action.checks = checks
    return action


def flag_of(action: argparse.Action) -> str:
    return next((s for s in action.option_strings if s.startswith("--")), action.dest)


def _shown(value) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(_shown(v) for v in value)
    return _num(value)


def _num(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def value_problem(checks: dict, value) -> str | None:
    """Why ``value`` breaks ``checks`` (the value checks, not paths or other options), or None."""
    if value is None or value == "" or value == ():
        return None
    if isinstance(value, (list, tuple)):
        if "length" in checks and len(value) != checks["length"]:
            return f"needs {checks['length']} values, got {len(value)}"
        for v in value:
            problem = value_problem({k: c for k, c in checks.items() if k not in ("length", "increasing")}, v)
            if problem:
                return f"{v}: {problem}"
        if checks.get("increasing") and any(a >= b for a, b in zip(value, value[1:])):
            return "must be in increasing order"
        return None
    if isinstance(value, float) and math.isnan(value):
        return "not a number"
    if "range" in checks:
        lo, hi = checks["range"]
        if not lo <= value <= hi:
            return f"must be between {_num(lo)} and {_num(hi)}"
    if "min" in checks and value < checks["min"]:
        return f"must be at least {_num(checks['min'])}"
    if "max" in checks and value > checks["max"]:
        return f"must be at most {_num(checks['max'])}"
    if "gt" in checks and not value > checks["gt"]:
        return f"must be greater than {_num(checks['gt'])}"
    if checks.get("fractions"):
        problem = fractions_problem(value, checks["fractions"])
        if problem:
            return problem
    if checks.get("date"):
        try:
            dt.date.fromisoformat(str(value))
        except ValueError:
            return "not a date (YYYY-MM-DD)"
        if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", str(value)):
            return "not a date (YYYY-MM-DD)"
    if checks.get("url"):
        return _url_problem(str(value))
    return None


def fractions_problem(value, n: int) -> str | None:
    """Why ``value`` (``"a,b,c"`` or numbers) is not ``n`` non-negative fractions summing to 1, or None.
    The one rule for the option check and for :func:`operators.pairs.selection.splits.parse_fractions`."""
    try:
        parts = [float(v) for v in (value.split(",") if isinstance(value, str) else value)]
    except (TypeError, ValueError):
        parts = []
    if len(parts) != n or any(not v >= 0 for v in parts):   # `not >=` refuses nan too
        return f"needs {n} comma-separated fractions, none negative"
    total = sum(parts)
    if not abs(total - 1) <= FRACTIONS_TOLERANCE:   # `not <=` refuses inf too
        # .10g, not :g, so that a sum of 1.000002 is not shown as "1"
        return f"must sum to 1, they sum to {total:.10g}"
    return None


def _url_problem(text: str) -> str | None:
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "not an http(s):// URL"
    try:
        port = parts.port
    except ValueError:
        return "the port must be a number between 1 and 65535"
    if port is not None and not 1 <= port <= 65535:
        return "the port must be a number between 1 and 65535"
    return None


def is_uri(text: str) -> bool:
    return bool(re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", text))


def path_problem(kind: str, value, checks: dict | None = None) -> str | None:
    """Why a local path does not fit ``kind`` (``must_exist``, ``dir``, ``file``) and the content
    checks among ``checks`` (``holds``, ``holds_except``, ``json``), or None."""
    checks = checks or {}
    for v in (value if isinstance(value, (list, tuple)) else [value]):
        if not v or not isinstance(v, str) or is_uri(v):
            continue
        if not os.path.exists(v):
            return f"{v}: no such file or folder"
        if kind == "dir" and not os.path.isdir(v):
            return f"{v}: not a folder"
        if kind == "file" and not os.path.isfile(v):
            return f"{v}: not a file (a folder)"
        problem = _content_problem(v, checks)
        if problem:
            return f"{v}: {problem}"
    return None


def _content_problem(path: str, checks: dict) -> str | None:
    if os.path.isdir(path) and ("holds" in checks or "holds_except" in checks):
        names = [n.lower() for _, _, files in os.walk(path) for n in files if not n.startswith(".")]
        if "holds" in checks:
            suffixes, what = checks["holds"]
            if not any(n.endswith(tuple(suffixes)) for n in names):
                return f"holds no {what} ({', '.join(suffixes)})" if names else f"is empty (no {what})"
        if "holds_except" in checks:
            suffixes, what = checks["holds_except"]
            if not any(not n.endswith(tuple(suffixes)) for n in names):
                return f"holds no {what} (only {len(names)} sidecar or text file(s))" if names else \
                    f"is empty (no {what})"
    if os.path.isfile(path) and checks.get("json") == "nonempty":
        import json
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            return f"not a JSON file ({' '.join(str(exc).split())[:80]})"
        if not doc:
            return "holds no entries (an empty export)"
    return None


def convert(action: argparse.Action, value):
    """A run or chain file's value as the option would parse it: (value, problem or None)."""
    if isinstance(value, bool) or action.type is None or value is None:
        converted = value
    elif isinstance(value, (list, tuple)) and action.type not in (int, float, str):
        try:
            converted = action.type(",".join(str(v) for v in value))
        except (TypeError, ValueError):
            return value, "not a list of whole numbers"
    else:
        try:
            converted = action.type(value) if not isinstance(value, (list, tuple)) else value
        except (TypeError, ValueError):
            return value, _type_name(action.type)
    if action.choices is not None and converted not in action.choices and not isinstance(converted, bool):
        return value, "choose from " + ", ".join(map(str, action.choices))
    return converted, None


class OptionProblem(ValueError):
    """A run or chain file's key or value that its job would refuse (the message names the key)."""


def file_option(parser: argparse.ArgumentParser, key, value, paths: bool = False,
                later: frozenset | set = frozenset()) -> tuple[argparse.Action, object]:
    """The option a run or chain file's ``key: value`` names, and the value as it would parse, checked
    as a typed option is (type, choices, the field's checks; the path with ``paths``, except for the
    dests in ``later``, paths that arrive later). A key may be
    ``--flag``, ``flag``, ``flag_name``, the option's dest or a deprecated alias. Raises
    :class:`OptionProblem` with one line naming the key; a run file and a chain file share it."""
    by_flag = {s: a for a in parser._actions for s in a.option_strings}
    by_flag |= {old: by_flag[new] for old, new in getattr(parser, "deprecated_flags", {}).items() if new in by_flag}
    by_dest = {a.dest: a for a in parser._actions if a.option_strings}
    name = str(key).lstrip("-")
    action = by_flag.get("--" + name.replace("_", "-")) or by_dest.get(name.replace("-", "_"))
    if action is None or action.dest == "help":
        close = difflib.get_close_matches(name.replace("_", "-"), [f[2:] for f in by_flag if f.startswith("--")], n=1)
        raise OptionProblem(f"unknown option {key!r}" + (f" (did you mean {close[0]}?)" if close else ""))
    if isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0:
        if not isinstance(value, bool):
            raise OptionProblem(f"{key}: takes true or false, not {value!r}")
        return action, value
    values = value if action.nargs in ("+", "*") and isinstance(value, (list, tuple)) else [value]
    out = []
    for v in values:
        converted, problem = convert(action, v)
        checks = getattr(action, "checks", {})
        problem = problem or value_problem(checks, converted)
        if not problem and paths and checks.get("path") and action.dest not in later:
            problem = path_problem(checks["path"], converted, checks)
            problem = problem and problem.split(": ", 1)[1]
        if problem:
            raise OptionProblem(f"{key}: {_shown(v)}: {problem}")
        out.append(converted)
    return action, (out if values is value else out[0])


def _type_name(tp) -> str:
    return {int: "not a whole number", float: "not a number"}.get(tp, "not a valid value")


def check_value(action: argparse.Action, value, origin: str = "") -> str | None:
    """The one-line problem of one option's value (``origin``: the run file and key), or None."""
    problem = value_problem(getattr(action, "checks", {}), value)
    if problem is None:
        return None
    return f"{origin}: {_shown(value)}: {problem}" if origin else f"{flag_of(action)} {_shown(value)}: {problem}"


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace, paths: bool = True,
               origins: dict[str, str] | None = None) -> str | None:
    """The first problem of parsed ``args`` (value checks, paths, options that go together), or None.
    ``origins``: dest -> "run.yaml: key" for values that came from a file."""
    origins = origins or {}
    actions = [a for a in parser._actions if getattr(a, "checks", None) and hasattr(args, a.dest)]
    by_dest = {a.dest: a for a in parser._actions if a.option_strings}
    for a in actions:
        problem = check_value(a, getattr(args, a.dest), origins.get(a.dest, ""))
        if problem:
            return problem
    for a in actions:   # paths after values: a wrong number is named even when a path is missing too
        value = getattr(args, a.dest)
        if paths and a.checks.get("path"):
            problem = path_problem(a.checks["path"], value, a.checks)
            if problem:
                return f"{origins[a.dest]}: {problem}" if a.dest in origins else f"{flag_of(a)} {problem}"
    for a in actions:
        value = getattr(args, a.dest)
        if not _given(value):
            continue
        other = a.checks.get("not_below")
        if other and other in by_dest and _given(getattr(args, other, None)) and value < getattr(args, other):
            return (f"{flag_of(by_dest[other])} {_shown(getattr(args, other))} is larger than {flag_of(a)} "
                    f"{_shown(value)}: it must fit in it")
        for name in a.checks.get("conflicts", ()):
            if name in by_dest and _given(getattr(args, name, None)) and getattr(args, name) != by_dest[name].default:
                return f"{flag_of(a)} and {flag_of(by_dest[name])} cannot be given together"
        for name in a.checks.get("requires", ()):
            if name in by_dest and not _given(getattr(args, name, None)):
                return f"{flag_of(a)} {_shown(value)} needs {flag_of(by_dest[name])}"
    return None


def _given(value) -> bool:
    return value not in (None, "", (), [], False)


# -- one-line argparse errors -------------------------------------------------------------------------
_REWRITES = [
    (re.compile(r"argument (\S+): invalid (int|float) value: '(.*)'"),
     lambda m, p: f"{_flag(m[1])} {m[3]}: {_type_name({'int': int, 'float': float}[m[2]])}"),
    (re.compile(r"argument (\S+): invalid _parse_int_list value: '(.*)'"),
     lambda m, p: f"{_flag(m[1])} {m[2]}: not a comma-separated list of whole numbers"),
    (re.compile(r"argument (\S+): invalid choice: '?(.*?)'? \(choose from (.*)\)"),
     lambda m, p: f"{_flag(m[1])} {m[2]}: choose from {m[3].replace(chr(39), '')}"),
    (re.compile(r"argument (\S+): expected one argument"), lambda m, p: f"{_flag(m[1])}: needs a value"),
    (re.compile(r"unrecognized arguments: (.*)"), lambda m, p: _unknown(m[1], p)),
    (re.compile(r"the following arguments are required: (.*)"), lambda m, p: f"missing {m[1]} (required)"),
]


def _flag(text: str) -> str:
    return text.split("/")[-1] if text.startswith("-") else text


def _unknown(tokens: str, parser: argparse.ArgumentParser) -> str:
    first = tokens.split()[0]
    parsers = [parser] + [p for a in parser._actions if isinstance(a, argparse._SubParsersAction)
                          for p in a.choices.values()]   # a subcommand's options are reported by its parent
    flags = sorted({s for p in parsers for a in p._actions for s in a.option_strings if s.startswith("--")})
    close = difflib.get_close_matches(first.split("=")[0], flags, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    what = "unknown option" if first.startswith("-") else "unexpected argument"
    return f"{what} {first}{hint}"


def one_line(parser: argparse.ArgumentParser, message: str) -> str:
    for pattern, fmt in _REWRITES:
        m = pattern.fullmatch(message)
        if m:
            return fmt(m, parser)
    return message


def fail(prog: str, message: str):
    """Print ``<prog>: <message>`` and exit with :data:`USAGE`."""
    print(f"{prog}: {message}", file=sys.stderr, flush=True)
    raise SystemExit(USAGE)


def make_strict(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """No abbreviations (``--strid`` is not ``--stride``) and one-line errors, for a parser and its
    subcommands."""
    parsers = [parser]
    for sub in (a for a in parser._actions if isinstance(a, argparse._SubParsersAction)):
        parsers += list(sub.choices.values())
    for p in parsers:
        p.allow_abbrev = False
        p.error = (lambda q: (lambda message: fail(q.prog, one_line(q, message))))(p)
    return parser


# -- reasons, for the consoles (operators.io.console) ------------------------------------------------
def reason_lines(reasons: dict[str, int], examples: dict[str, list[str]] | None = None, top: int = 5,
                 first: int = 3) -> list[str]:
    """``"<count> x <reason> (first: a, b, c)"`` for the ``top`` most frequent reasons."""
    examples = examples or {}
    lines = []
    for reason, n in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))[:top]:
        items = examples.get(reason, [])[:first]
        lines.append(f"{n} x {reason}" + (f" (first: {', '.join(items)})" if items else ""))
    if len(reasons) > top:
        lines.append(f"... and {len(reasons) - top} other reason(s)")
    return lines


# -- chain files --------------------------------------------------------------------------------------
# Paths a chain may name before they exist: a Label Studio export arrives from the annotators between
# two runs of the chain (the chain stops at its ingest step until then; the step checks it when it starts).
ARRIVES_LATER = {"export"}


def check_chain(path: str, steps: list[tuple[str, dict]], parser_for, wired: dict[str, dict] | None = None,
                jobs: list[str] = (), prog: str = "changeforge chain", required: bool = True) -> None:
    """Every step of a chain file checked as its job would check it, before any step runs: the job
    and command exist, every option is one of the job's, every value passes the option's checks
    (paths the user names must exist; the ones the chain wires are made by earlier steps), and the
    required options are given or wired. One line naming the file, the step and the key; exit 2.

    ``parser_for(step)`` gives ``(module, command, parser)`` or raises SystemExit; ``wired``: step ->
    the options the chain fills in; ``jobs``: job names, for a suggestion when a step is misspelt;
    ``required=False`` leaves the required options to the caller (the chain names all of them at once,
    and its dry run lists them)."""
    for i, (step, options) in enumerate(steps):
        where = f"{path}: step {i + 1} {step!r}"
        try:
            _, _, parser = parser_for(step)
        except SystemExit as exc:
            close = difflib.get_close_matches(step.split()[0], list(jobs), n=1) if step else []
            hint = f" (did you mean {close[0]!r}?)" if close and close[0] != step.split()[0] else ""
            fail(prog, f"{where}: {str(exc.code).removeprefix('chain: ')}{hint}")
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is not None:
            fail(prog, f"{where}: name the command of {step} ({', '.join(sub.choices)}), e.g. '{step} "
                       f"{next(iter(sub.choices))}'")
        by_flag = {s: a for a in parser._actions for s in a.option_strings}
        given = set()
        for key, value in options.items():
            try:
                action, _ = file_option(parser, key, value, paths=True, later=ARRIVES_LATER)
            except OptionProblem as exc:
                fail(prog, f"{where}: {exc}")
            given.add(action.dest)
        wired_here = {by_flag["--" + k.replace("_", "-")].dest for k in (wired or {}).get(step, {})
                      if "--" + k.replace("_", "-") in by_flag}
        for a in parser._actions if required else ():
            if a.required and a.option_strings and a.dest not in given | wired_here:
                fail(prog, f"{where}: needs {flag_of(a).lstrip('-')} (the step's job requires it)")
