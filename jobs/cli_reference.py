"""The CLI reference page (docs/cli-reference.md), generated from the jobs' own parsers so that it
cannot drift from them:

    python -m jobs.cli_reference > docs/cli-reference.md
"""
from __future__ import annotations

import argparse
import importlib
import re

from operators.io import cli


def _parsers(name: str, module_name: str):
    """(command line, parser, presets) for a job and each of its subcommands."""
    parser = importlib.import_module(module_name).build_parser()
    presets = getattr(parser, "presets", None)
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    if sub is None:
        yield f"changeforge {name}", parser, presets
        return
    for command, subparser in sub.choices.items():
        yield f"changeforge {name} {command}", subparser, presets


def _cell(text) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def options(parser: argparse.ArgumentParser, presets=None) -> list[dict]:
    """The parser's options as rows (the run options every job gets included)."""
    cli._add_run_options(parser, presets)
    formatter = parser._get_formatter()
    rows = []
    for group in parser._action_groups:
        for action in group._group_actions:
            if not action.option_strings or action.help == argparse.SUPPRESS or action.dest == "help":
                continue
            default = action.default
            shown = "" if default in (None, "", argparse.SUPPRESS) or action.required else default
            if isinstance(shown, (tuple, list)):
                shown = ",".join(map(str, shown))
            rows.append({"flags": ", ".join(action.option_strings), "group": group.title or "",
                         "required": action.required, "default": shown,
                         "choices": ", ".join(map(str, action.choices)) if action.choices else "",
                         "tuning": bool(getattr(action, "tuning", False)),
                         "help": re.sub(r"\s*\(default: [^()]*\)$", "", formatter._expand_help(action))})
    return rows


def reference_markdown() -> str:
    from jobs.cli import JOBS, SHORTHANDS

    out = ["# CLI reference", "",
           "Generated from the jobs' parsers (`python -m jobs.cli_reference`); a test fails when it "
           "differs from them. Every job also runs as `python -m <module>`. Options marked *tuning* are "
           "hidden by `--help` and shown by `--help-all`.", ""]
    for name, (module_name, text) in JOBS.items():
        for command, parser, presets in _parsers(name, module_name):
            out += [f"## `{command}`", "", _cell(text if command.count(" ") == 1 else parser.description or text),
                    "", f"Module: `python -m {module_name}`", "",
                    "| option | default | choices | description |", "|---|---|---|---|"]
            for row in options(parser, presets):
                flags = f"`{row['flags']}`" + (" (required)" if row["required"] else "") + \
                    (" *tuning*" if row["tuning"] else "")
                out.append(f"| {flags} | {_cell(row['default'])} | {_cell(row['choices'])} | {_cell(row['help'])} |")
            out.append("")
    out += ["## Shorthands", "", "Commands that are a job with options fixed; they take that job's options.", ""]
    out += [f"- `changeforge {name}` = `changeforge {job} {' '.join(fixed)}`: {_cell(text)}."
            for name, (job, fixed, text) in SHORTHANDS.items()]
    out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(reference_markdown(), end="")
