"""Optional parts a chain step will need (extras, the Label Studio SDK, Java), checked before anything
runs, so a missing one is one line with its install hint instead of a traceback halfway through the chain."""
from __future__ import annotations

import importlib.util
import os

from operators.optional import EXTRAS

# step -> import names it always needs (their extras and hints are in operators.optional.EXTRAS)
ALWAYS = {"report": ("matplotlib",), "score captions": ("pycocoevalcap",)}
# (step, option) -> {option value: import names}
BY_OPTION = {("annotate export", "prelabel"): {"pca-kmeans": ("sklearn",)}}
# step -> programs it runs (the caption metrics' PTB tokenizer and METEOR run Java), tried before anything runs
PROGRAMS = {"score captions": ("java",)}
# step -> its options that talk to a Label Studio server when they hold a URL
STUDIO_OPTIONS = {"annotate export": ("label-studio-url",), "annotate ingest": ("export",),
                  "review export": ("label-studio-url",), "review ingest": ("export",)}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _extra_hint(module: str, step: str) -> str:
    extra, what = EXTRAS[module]
    return (f"step {step!r} needs {module} ({what}): pip install 'changeforge[{extra}]' "
            f"(from a checkout: pip install -e '.[{extra}]')")


def _studio_hint(step: str) -> str | None:
    from operators.labelstudio import client as sc
    if _installed("label_studio_sdk") or os.path.exists(sc.sdk_python()):
        return None
    venv = os.path.dirname(os.path.dirname(sc.sdk_python()))
    return (f"step {step!r} talks to Label Studio but label-studio-sdk is neither importable here nor at "
            f"{sc.sdk_python()}: python -m venv {venv} && {venv}/bin/pip install {sc.SDK_VERSION} "
            f"(or set {sc.PYTHON_ENV})")


def _java_problem() -> str | None:
    """Why ``java`` cannot run here (not on PATH, or ``java -version`` fails), None when it runs."""
    from operators.scoring.caption_metrics import JavaMissing, require_java
    try:
        require_java()
    except JavaMissing as exc:
        return str(exc)
    return None


PROGRAM_CHECKS = {"java": _java_problem}


def missing(step: str, options: dict) -> list[str]:
    """One line per optional part ``step`` needs with ``options`` (names with ``-``) that is not installed,
    or program it runs that does not run here."""
    out = [_extra_hint(m, step) for m in ALWAYS.get(step, ()) if not _installed(m)]
    for program in PROGRAMS.get(step, ()):
        why = PROGRAM_CHECKS[program]()
        if why:
            out.append(f"step {step!r} needs a working {program}: {why}")
    for (s, opt), by_value in BY_OPTION.items():
        if s == step:
            out += [_extra_hint(m, step) for m in by_value.get(str(options.get(opt, "")), ()) if not _installed(m)]
    if any(str(options.get(o, "")).startswith(("http://", "https://")) for o in STUDIO_OPTIONS.get(step, ())):
        hint = _studio_hint(step)
        if hint:
            out.append(hint)
    return out
