"""``changeforge <job> [options]``: one command for every job (``python -m jobs.<module>`` works too).

    changeforge pairs --preset demo --input data/naip --output out/demo
    changeforge caption --input out/demo --output out/captions --model gpt-4.1-mini
"""
from __future__ import annotations

import difflib
import importlib
import sys

from operators.io import cli
from operators.optional import MissingExtra

# subcommand -> (module, what it makes); the order is the chain's.
JOBS: dict[str, tuple[str, str]] = {
    "pairs": ("jobs.build_pairs", "registered, screened bitemporal pairs from an archive (S2Looking recipe)"),
    "annotate": ("jobs.annotate", "change masks drawn in Label Studio, with pre-labels and an agreement check (S2Looking step 6)"),
    "caption": ("jobs.caption", "LLM-written, LLM-judged change captions (JL1-CC recipe)"),
    "qa": ("jobs.qa", "LLM-written, LLM-judged change question-answer pairs (JL1-QA recipe)"),
    "validate": ("jobs.validate", "audit captions or QA pairs against their change masks"),
    "review": ("jobs.review", "human verification of a sample in Label Studio"),
    "report": ("jobs.report", "statistics tables, figures and an HTML page of a dataset"),
    "score": ("jobs.score", "change-mask, caption and QA metrics"),
    "publish": ("jobs.publish", "a versioned release others load in one line (folders, Parquet, Croissant, STAC)"),
    "chain": ("jobs.chain", "the jobs in order on one output root from a chain file, resuming where it stopped"),
}

# Commands that are a job with options fixed: name -> (job, its fixed options, what it shows). Not jobs, so
# never a chain step.
SHORTHANDS: dict[str, tuple[str, list[str], str]] = {
    "status": ("chain", ["--explain"], "what each step of a chain file would do and why, running nothing: "
                                       "per step, pairs current, stale by cause, or missing (chain --explain)"),
}


def usage() -> str:
    width = max(map(len, [*JOBS, *SHORTHANDS]))
    lines = ["usage: changeforge <job> [options]   (changeforge <job> --help for its options)", "", "jobs:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in JOBS.items()]
    lines += [f"  {name:<{width}}  {text}" for name, (_, _, text) in SHORTHANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name in SHORTHANDS:
        job, fixed, _ = SHORTHANDS[name]
        rest = fixed + rest
    elif name not in JOBS:
        close = difflib.get_close_matches(name, [*JOBS, *SHORTHANDS], n=1)
        print(f"changeforge: unknown job {name!r}" + (f" (did you mean {close[0]}?)" if close else "")
              + f"; the jobs: {', '.join(JOBS)}, and {', '.join(SHORTHANDS)} (changeforge --help describes them)",
              file=sys.stderr)
        return 2
    else:
        job = name
    module = importlib.import_module(JOBS[job][0])
    cli.PROG = f"changeforge {name}"
    try:
        result = module.main(rest)
    except MissingExtra as exc:   # a one-line hint, not a traceback
        print(f"changeforge {name}: {exc}", file=sys.stderr)
        return 2
    return result if isinstance(result, int) else 0


def run() -> None:
    """The process entry (the ``changeforge`` command, ``python -m jobs.cli``): :func:`main`, then
    the process ended by :mod:`operators.process_exit` (no interpreter teardown, where Arrow can abort)."""
    from operators.process_exit import run as run_process
    run_process(main)


if __name__ == "__main__":
    run()
