"""Command-line options generated from the typed config dataclasses, and Ray start-up for jobs.

Each dataclass field becomes ``--field-name`` with its default and the ``help`` in its metadata, so a
default documented in a config is the default a user sees in ``--help``.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from typing import Any


def _field_type(tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _field_type(args[0]) if args else str
    return tp


def _parse_int_list(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in str(text).split(",") if v.strip())


def add_config_args(parser: argparse.ArgumentParser, cls: type, title: str | None = None,
                    skip: tuple[str, ...] = ()) -> None:
    group = parser.add_argument_group(title or cls.__name__)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.init:
            continue
        tp = _field_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        help_text = f.metadata.get("help", "")
        flag = "--" + f.name.replace("_", "-")
        if f.metadata.get("required"):
            group.add_argument(flag, dest=f.name, required=True, help=help_text)
            continue
        shown_default = "" if "default:" in help_text or default in ("", None) else f" (default: {default})"
        choices = f.metadata.get("choices")
        if tp is bool:
            group.add_argument(flag, dest=f.name, default=default,
                               action=argparse.BooleanOptionalAction,
                               help=f"{help_text}{shown_default}")
        elif typing.get_origin(tp) in (tuple, list):
            shown = ",".join(str(v) for v in default) if default else "auto"
            shown = "" if "default:" in help_text else f" (default: {shown})"
            group.add_argument(flag, dest=f.name, default=default, type=_parse_int_list,
                               help=f"{help_text}, comma-separated{shown}")
        else:
            conv = tp if tp in (int, float, str) else str
            group.add_argument(flag, dest=f.name, default=default, type=conv, choices=choices,
                               help=f"{help_text}{shown_default}")


def config_from_args(cls: type, args: argparse.Namespace, **overrides):
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
              if f.init and hasattr(args, f.name)}
    values.update(overrides)
    return cls(**values)


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
        ray.init(num_cpus=num_cpus, include_dashboard=False, configure_logging=False, _system_config=RAY_SYSTEM_CONFIG)
