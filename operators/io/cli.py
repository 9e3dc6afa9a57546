"""Command-line options generated from the typed config dataclasses, run files, presets, and Ray
start-up for jobs.

Each dataclass field becomes ``--field-name`` with its default and the ``help`` in its metadata, so a
default documented in a config is the default a user sees in ``--help``. Every job parses through
:func:`parse_job_args`, which adds ``--config run.yaml`` (any option; the command line wins),
``--preset`` where a job has presets, and ``--help-all`` (``--help`` hides the tuning options).
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import sys
import types
import typing
import warnings
from pathlib import Path
from typing import Any

from operators.io import validation


def _field_type(tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _field_type(args[0]) if args else str
    return tp


def _parse_int_list(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in str(text).split(",") if v.strip())


def add_config_args(parser: argparse.ArgumentParser, cls: type, title: str | None = None,
                    skip: tuple[str, ...] = (), tuning: bool = False) -> None:
    """One option per field of ``cls``, named after the field (or ``metadata["flag"]``). ``tuning=True``
    (or a field's ``metadata["tuning"]``) marks the options that ``--help`` hides and ``--help-all``
    shows; ``metadata["old_flags"]`` are earlier spellings that keep working with a deprecation warning."""
    group = parser.add_argument_group(title or cls.__name__)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.init:
            continue
        if dataclasses.is_dataclass(hints[f.name]):   # a nested settings group: its fields, flat
            add_config_args(parser, hints[f.name], f.metadata.get("title", f.name), skip, tuning)
            continue
        action = validation.attach(_add_field(group, f, _field_type(hints[f.name])), f.metadata)
        action.tuning = bool(tuning or f.metadata.get("tuning"))
        for old in f.metadata.get("old_flags", ()):
            add_deprecated_alias(parser, old, action.option_strings[0])


def _add_field(group, f: dataclasses.Field, tp) -> argparse.Action:
    default = f.default if f.default is not dataclasses.MISSING else (
        f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
    help_text = f.metadata.get("help", "")
    flag = "--" + f.metadata.get("flag", f.name.replace("_", "-"))
    if f.metadata.get("required"):
        return group.add_argument(flag, dest=f.name, required=True, help=help_text)
    shown_default = "" if "default:" in help_text or default in ("", None) else f" (default: {default})"
    if tp is bool:
        return group.add_argument(flag, dest=f.name, default=default, action=argparse.BooleanOptionalAction,
                                  help=f"{help_text}{shown_default}")
    if typing.get_origin(tp) in (tuple, list):
        shown = ",".join(str(v) for v in default) if default else "auto"
        shown = "" if "default:" in help_text else f" (default: {shown})"
        return group.add_argument(flag, dest=f.name, default=default, type=_parse_int_list,
                                  help=f"{help_text}, comma-separated{shown}")
    conv = tp if tp in (int, float, str) else str
    return group.add_argument(flag, dest=f.name, default=default, type=conv, choices=f.metadata.get("choices"),
                              help=f"{help_text}{shown_default}")


def mark_tuning(actions) -> None:
    """Mark argparse actions as tuning options (hidden by ``--help``, shown by ``--help-all``)."""
    for action in actions:
        action.tuning = True


def add_deprecated_alias(parser: argparse.ArgumentParser, old: str, new: str) -> None:
    """Keep ``old`` working as ``new`` for one release: :func:`parse_job_args` replaces the token (and
    warns), so type checks, choices and required options behave exactly as with ``new``. ``new`` may
    be a whole flag, e.g. ``--no-cache`` for an old ``--skip-cache``."""
    if not hasattr(parser, "deprecated_flags"):
        parser.deprecated_flags = {}
    parser.deprecated_flags[old] = new


def _replace_deprecated(parser: argparse.ArgumentParser, tokens: list[str]) -> list[str]:
    table = getattr(parser, "deprecated_flags", {})
    out = []
    for token in tokens:
        name, eq, value = token.partition("=")
        if name in table:
            message = f"{name} is deprecated and will be removed in the next release: use {table[name]}"
            warnings.warn(message, DeprecationWarning, stacklevel=3)
            print(f"warning: {message}", file=sys.stderr)
            token = table[name] + eq + value
        out.append(token)
    return out


def _option_tokens(parser: argparse.ArgumentParser, values: dict, origin: str) -> list[str]:
    """Command-line tokens for ``{option: value}`` (a run file's or a preset's), so that they pass the
    same type and choice checks as typed options. Keys are option names with ``-`` or ``_``."""
    tokens: list[str] = []
    for key, value in values.items():
        name = str(key).lstrip("-")
        if "--" + name.replace("_", "-") in getattr(parser, "deprecated_flags", {}):
            _replace_deprecated(parser, ["--" + name.replace("_", "-")])   # the same warning
        try:
            action, _ = validation.file_option(parser, key, value)
        except validation.OptionProblem as exc:
            parser.error(f"{origin}: {exc}")
        flag = next((s for s in action.option_strings if s.startswith("--")), action.option_strings[0])
        if isinstance(action, argparse.BooleanOptionalAction):
            # the value means what the key says: "no-x: true" is --no-x, "no-x: false" is --x
            negative = "--" + name.replace("_", "-") == "--no-" + flag[2:]
            tokens.append(flag if value != negative else "--no-" + flag[2:])
        elif action.nargs == 0:   # store_true / store_const
            if value:
                tokens.append(flag)
        elif value is None:
            continue
        elif isinstance(value, (list, tuple)):
            tokens += [flag, ",".join(str(v) for v in value)]
        else:
            tokens += [flag, str(value)]
    return tokens


def _read_run_file(path: str) -> dict:
    import yaml

    try:
        values = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        validation.fail(PROG or "changeforge", f"--config {path}: cannot read it ({' '.join(str(exc).split())})")
    if not isinstance(values, dict):
        validation.fail(PROG or "changeforge", f"--config {path}: expected a mapping of option names to values")
    return values


def _subparser_for(parser: argparse.ArgumentParser, argv: list[str]):
    """(subparser, index of its command in argv) for a parser with subcommands, else (parser, -1)."""
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    if sub is None:
        return parser, -1
    for i, token in enumerate(argv):
        if token in sub.choices:
            return sub.choices[token], i
    return parser, -1


def _add_run_options(parser: argparse.ArgumentParser, presets: dict | None) -> None:
    if any("--config" in a.option_strings for a in parser._actions):
        return
    group = parser.add_argument_group("run configuration")
    group.add_argument("--config", metavar="RUN.yaml",
                       help="YAML file of options (option: value, names as on the command line, with - or _); "
                            "options given on the command line win")
    if presets:
        group.add_argument("--preset", choices=sorted(presets),
                           help="; ".join(f"{name}: {text}" for name, (text, _) in sorted(presets.items()))
                           + " (a run file and the command line win over it)")
    group.add_argument("--help-all", action="store_true", help="show every option, the tuning ones too")


# Set by the ``changeforge`` command so that usage lines name it instead of ``python -m jobs.<module>``.
PROG: str | None = None


def parse_job_args(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """Parse a job's command line: a preset's values, then a run file's, then the command line (the
    last one wins). A parser's presets are its ``presets`` attribute, ``{name: (description,
    {option: value})}``. ``--help`` hides the options marked as tuning; ``--help-all`` shows them."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if PROG:
        parser.prog = PROG
        for sub in (a for a in parser._actions if isinstance(a, argparse._SubParsersAction)):
            for name, subparser in sub.choices.items():
                subparser.prog = f"{PROG} {name}"
    validation.make_strict(parser)   # no abbreviations, one-line errors (exit 2)
    target, at = _subparser_for(parser, argv)
    presets = getattr(target, "presets", None) or getattr(parser, "presets", None)
    for p in {id(parser): parser, id(target): target}.values():
        _add_run_options(p, presets)
    if "--help-all" in argv:
        argv = [("--help" if t == "--help-all" else t) for t in argv]
    else:
        hidden = [a for a in target._actions if getattr(a, "tuning", False)]
        for action in hidden:
            action.help = argparse.SUPPRESS
        if hidden:
            target.epilog = ((target.epilog + "\n\n") if target.epilog else "") + \
                f"{len(hidden)} tuning options are not shown: --help-all lists every option."
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    pre.add_argument("--preset")
    known, _ = pre.parse_known_args(argv[at + 1:])
    run_file = _read_run_file(known.config) if known.config else {}
    # A run file may name the preset too (the command line's --preset wins); its values come first.
    preset = known.preset or run_file.pop("preset", None)
    tokens: list[str] = []
    if preset:
        if not presets or preset not in presets:
            target.error(f"preset {preset!r}: " + (f"choose from {', '.join(sorted(presets))}" if presets
                                                     else "this job has no presets"))
        tokens += _option_tokens(target, presets[preset][1], f"preset {preset}")
    if run_file:
        tokens += _option_tokens(target, run_file, known.config)
    args = parser.parse_args(argv[:at + 1] + _replace_deprecated(target, tokens + argv[at + 1:]))
    # Checked before the job reads, writes or starts anything: values, paths, options that go together.
    problem = validation.check_args(target, args, origins=_file_origins(target, run_file, known.config,
                                                                        argv[at + 1:]))
    if problem:
        validation.fail(target.prog, problem)
    return args


def _file_origins(parser: argparse.ArgumentParser, run_file: dict, path: str | None, argv: list[str]) -> dict:
    """dest -> "<run file>: <key>" for the run file's values the command line does not override."""
    by_flag = {s: a for a in parser._actions for s in a.option_strings}
    by_flag |= {old: by_flag[new] for old, new in getattr(parser, "deprecated_flags", {}).items() if new in by_flag}
    given = {by_flag[t.split("=")[0]].dest for t in argv if t.split("=")[0] in by_flag}
    out = {}
    for key in run_file:
        name = str(key).lstrip("-")
        action = by_flag.get("--" + name.replace("_", "-"))
        dest = action.dest if action else name.replace("-", "_")
        if dest not in given:
            out[dest] = f"{path}: {key}"
    return out


def config_from_args(cls: type, args: argparse.Namespace, **overrides):
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if dataclasses.is_dataclass(hints[f.name]):   # a nested settings group, from its flat options
            values[f.name] = config_from_args(hints[f.name], args)
        elif hasattr(args, f.name):
            values[f.name] = getattr(args, f.name)
    values.update(overrides)
    try:
        return cls(**values)
    except ValueError as exc:
        # A combination of settings the group's own checks refuse: one line, before any work (exit
        # 2, as argparse's own errors), not a traceback.
        print(f"{os.path.basename(sys.argv[0]) or 'changeforge'}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


# Ray deletes freed objects in batches, once a second by default. At the language jobs' rate a second
# of freed blocks (each one LLM batch of encoded images) was half their object-store use and most of
# its peaks (benchmarks/memory_scale.py). Every Ray these jobs start uses 100 ms, and so do
# cluster.yaml and deploy/kuberay/ (as RAY_free_objects_period_milliseconds on every node).
RAY_SYSTEM_CONFIG = {"free_objects_period_milliseconds": 100}


def init_ray(num_cpus: int | None) -> None:
    """Connect to ``RAY_ADDRESS`` (a cluster, or the job's own under ``ray job submit``), else start
    a local Ray with ``num_cpus``.

    No runtime_env is passed here: under ``ray job submit`` it would replace the job's own (its
    working_dir); a local Ray's workers inherit this process's environment (storage endpoint and
    credentials) anyway. On a cluster, pass endpoint variables with ``--runtime-env-json``.
    """
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"])
    else:
        # address="local": never attach to a cluster some other process left running on this machine.
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, configure_logging=False,
                 _system_config=RAY_SYSTEM_CONFIG)
