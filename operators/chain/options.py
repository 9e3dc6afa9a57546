"""A chain step's options as its job's command line: booleans as written, and the options the job
requires that neither the step nor the wiring gives (reported before anything runs)."""
from __future__ import annotations

import argparse


def _flag(key) -> str:
    return "--" + str(key).lstrip("-").replace("_", "-")


def normalise_booleans(parser: argparse.ArgumentParser, options: dict, origin: str) -> dict:
    """``{no-x: true}`` -> ``{x: false}`` (and ``no-x: false`` -> ``x: true``) for a ``--x/--no-x`` option,
    so the value means what the key says; a step giving both ``x`` and ``no-x`` is refused."""
    by_flag = {s: a for a in parser._actions for s in a.option_strings}
    out: dict = {}
    for key, value in options.items():
        flag = _flag(key)
        action = by_flag.get(flag)
        negative = (isinstance(action, argparse.BooleanOptionalAction) and flag.startswith("--no-")
                    and flag not in action.option_strings[:1])
        if negative:
            if not isinstance(value, bool):
                parser.error(f"{origin}: {key} takes true or false, not {value!r}")
            key, value = flag[len("--no-"):], not value
        name = _flag(key)
        if any(_flag(k) == name for k in out):
            parser.error(f"{origin}: {name[2:]} is given twice (as {name[2:]} and no-{name[2:]})")
        out[key] = value
    return out


def missing_required(parser: argparse.ArgumentParser, tokens: list[str]) -> list[str]:
    """The required options of ``parser`` that ``tokens`` does not give (``--refs``, ``--name`` ...)."""
    given = {t.split("=", 1)[0] for t in tokens if t.startswith("--")}
    return [a.option_strings[0] for a in parser._actions
            if a.required and a.option_strings and not given & set(a.option_strings)]
