"""The shared command line: run files, presets, --help-all, deprecated spellings, the changeforge
command, and the generated CLI reference."""
from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from operators.io import cli
from operators.io.cli import add_config_args, add_deprecated_alias, parse_job_args

REPO = Path(__file__).resolve().parents[2]


@dataclasses.dataclass
class _Config:
    size: int = dataclasses.field(default=3000, metadata={"help": "side"})
    mode: str = dataclasses.field(default="a", metadata={"help": "mode", "choices": ("a", "b")})
    cache: bool = dataclasses.field(default=True, metadata={"help": "use the cache"})
    knob: float = dataclasses.field(default=0.5, metadata={"help": "a tuning knob", "tuning": True})
    bands: tuple[int, ...] = dataclasses.field(default=(1, 2, 3), metadata={"help": "bands"})


PRESETS = {"small": ("small sizes", {"size": 512, "mode": "b"})}


def _parser():
    parser = argparse.ArgumentParser(prog="t")
    add_config_args(parser, _Config, "opts")
    parser.add_argument("--output", required=True)
    return parser


def _parse(argv):
    parser = _parser()
    parser.presets = PRESETS
    return parse_job_args(parser, argv)


def test_defaults_preset_run_file_and_command_line_in_that_order(tmp_path):
    assert _parse(["--output", "o"]).size == 3000
    assert (_parse(["--output", "o", "--preset", "small"]).size, _parse(["--output", "o", "--preset", "small"]).mode) \
        == (512, "b")
    run = tmp_path / "run.yaml"
    run.write_text("size: 700\ncache: false\nbands: [4, 3, 2]\noutput: from-file\n")
    args = _parse(["--preset", "small", "--config", str(run)])
    assert (args.size, args.mode, args.cache, args.bands, args.output) == (700, "b", False, (4, 3, 2), "from-file")
    args = _parse(["--preset", "small", "--config", str(run), "--size", "9", "--cache", "--output", "cli"])
    assert (args.size, args.cache, args.output) == (9, True, "cli")


@pytest.mark.parametrize("line, cache", [("no-cache: true", False), ("no-cache: false", True),
                                          ("no_cache: true", False), ("cache: false", False)])
def test_a_run_file_s_booleans_mean_what_their_key_says(tmp_path, line, cache):
    run = tmp_path / "run.yaml"
    run.write_text(f"{line}\noutput: o\n")
    assert _parse(["--config", str(run)]).cache is cache


def test_a_run_file_may_name_the_preset_and_the_command_line_s_preset_wins(tmp_path, capsys):
    run = tmp_path / "run.yaml"
    run.write_text("preset: small\noutput: o\nsize: 600\n")
    args = _parse(["--config", str(run)])
    assert (args.size, args.mode) == (600, "b")           # the preset's mode, the file's size
    run.write_text("preset: large\noutput: o\n")
    with pytest.raises(SystemExit):
        _parse(["--config", str(run)])
    assert "preset 'large': choose from small" in capsys.readouterr().err


def test_run_file_values_are_checked_like_typed_options(tmp_path, capsys):
    for text, message in (("mode: c\n", "run.yaml: mode: c: choose from a, b"),
                          ("size: big\n", "run.yaml: size: big: not a whole number"),
                          ("colour: red\n", "unknown option 'colour'"), ("cache: maybe\n", "true or false")):
        run = tmp_path / "run.yaml"
        run.write_text(text + "output: o\n")
        with pytest.raises(SystemExit):
            _parse(["--config", str(run)])
        assert message in capsys.readouterr().err
    run.write_text("- not\n- a mapping\n")
    with pytest.raises(SystemExit):
        _parse(["--config", str(run)])
    assert "expected a mapping" in capsys.readouterr().err


@pytest.mark.parametrize("key, value, message", [
    ("split-seed", 7, None), ("seed", 7, None), ("split_seed", 7, None),    # flag, dest, underscores
    ("registration", "per-slice", None), ("method", "per-slice", None), ("no-rescue", True, None),
    ("split-seed", "x", "split-seed: x: not a whole number"),
    ("registraton", "sift", "unknown option 'registraton' (did you mean registration?)"),
    ("rescue", "maybe", "rescue: takes true or false, not 'maybe'"),
    ("registration", "sift", "registration: sift: choose from regional, per-slice"),
])
def test_a_run_file_and_a_chain_step_take_and_refuse_the_same_keys(key, value, message, capsys):
    """One checker (validation.file_option) for both files: a key the pairs job takes in a run file is
    taken in a chain step, and a refused one is refused with the same words."""
    from jobs import chain
    from operators.io import validation

    _, _, parser = chain._parser_for("pairs")
    if message is None:
        cli._option_tokens(parser, {key: value}, "run.yaml")
        validation.check_chain("c.yaml", [("pairs", {key: value})], chain._parser_for, required=False)
        return
    with pytest.raises(SystemExit):
        cli._option_tokens(parser, {key: value}, "run.yaml")
    assert f"run.yaml: {message}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        validation.check_chain("c.yaml", [("pairs", {key: value})], chain._parser_for, required=False)
    assert f"c.yaml: step 1 'pairs': {message}" in capsys.readouterr().err


def test_help_hides_tuning_options_and_help_all_shows_them(capsys):
    with pytest.raises(SystemExit):
        _parse(["--help"])
    short = capsys.readouterr().out
    with pytest.raises(SystemExit):
        _parse(["--help-all"])
    full = capsys.readouterr().out
    assert "--size" in short and "--knob" not in short and "1 tuning options are not shown" in short
    assert "--knob" in full and "--preset" in full and "--config" in full


def test_a_deprecated_spelling_still_works_and_warns(tmp_path):
    parser = _parser()
    add_deprecated_alias(parser, "--side", "--size")
    add_deprecated_alias(parser, "--no-use-cache", "--no-cache")
    with pytest.warns(DeprecationWarning, match="--side is deprecated.*use --size"):
        args = parse_job_args(parser, ["--output", "o", "--side=64", "--no-use-cache"])
    assert (args.size, args.cache) == (64, False)
    assert "--side" not in parser.format_help()
    run = tmp_path / "run.yaml"
    run.write_text("side: 65\n")
    with pytest.warns(DeprecationWarning):
        assert parse_job_args(_parser_with(("--side", "--size")), ["--output", "o", "--config", str(run)]).size == 65


def _parser_with(*aliases):
    parser = _parser()
    for old, new in aliases:
        add_deprecated_alias(parser, old, new)
    return parser


def test_subcommand_jobs_take_run_files(tmp_path):
    from jobs import score

    run = tmp_path / "run.yaml"
    masks = str(REPO / "data" / "levir-cd" / "label")   # --pred and --masks must be folders of PNG masks
    run.write_text(f"pred: {masks}\nmasks-per-task: 7\n")
    args = parse_job_args(score.build_parser(), ["change", "--config", str(run), "--output", "o", "--masks", masks])
    assert (args.command, args.pred, args.masks_per_task, args.output) == ("change", masks, 7, "o")


def test_the_jobs_old_spellings_still_work_with_a_warning():
    from jobs import build_pairs, qa, report, review, score

    n, d = str(REPO / "data" / "naip"), str(REPO / "data" / "levir-cd")   # paths the jobs check exist
    cases = [(build_pairs, ["--input", n, "--output", "o", "--labels", d, "--seed", "3"],
              {"labels": d, "seed": 3}),
             (score, ["change", "--pred", f"{d}/label", "--output", "o", "--label", f"{d}/label"], {"label": f"{d}/label"}),
             (review, ["export", "--input", d, "--output", "o", "--seed", "5"], {"seed": 5}),
             (report, ["--input", d, "--output", "o", "--seed", "2"], {"seed": 2}),
             (qa, ["--input", d, "--output", "o", "--model", "m", "--dataset", d, "--seed", "9"],
              {"dataset": d, "seed": 9})]
    for job, argv, expected in cases:
        with pytest.warns(DeprecationWarning):
            args = parse_job_args(job.build_parser(), argv)
        assert {k: getattr(args, k) for k in expected} == expected, job.__name__
    new = parse_job_args(qa.build_parser(), ["--input", d, "--output", "o", "--model", "m", "--images", d,
                                             "--type-seed", "9", "--no-cache", "--no-strict-schema"])
    assert (new.dataset, new.seed, new.cache, new.strict_schema) == (d, 9, False, False)


def test_pairs_presets_are_the_papers_and_the_demos_geometry():
    from jobs import build_pairs

    naip = str(REPO / "data" / "naip")
    paper = parse_job_args(build_pairs.build_parser(), ["--input", naip, "--output", "o", "--preset", "paper"])
    demo = parse_job_args(build_pairs.build_parser(), ["--input", naip, "--output", "o", "--preset", "demo"])
    # S2Looking section 2.2: 3000 x 3000 slices at stride 1024, central 1024 x 1024 kept, > 8 px screened out
    assert (paper.slice_size, paper.stride, paper.crop_size, paper.max_residual_px) == (3000, 1024, 1024, 8.0)
    assert (demo.slice_size, demo.stride, demo.crop_size, demo.tile_size, demo.search_margin_px,
            demo.reference_date) == (512, 128, 256, 512, 64, "2021-01-01")


@pytest.mark.parametrize("name", list(__import__("jobs.cli").cli.JOBS))
def test_changeforge_runs_every_job_s_help(name, capsys):
    """In process (a subprocess per job costs seconds of imports each; one smoke test below runs the
    command itself)."""
    from jobs import cli as changeforge

    with pytest.raises(SystemExit) as done:      # argparse exits after printing the help
        changeforge.main([name, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: changeforge {name}"), out[:200]


def test_an_unknown_job_is_refused(capsys):
    from jobs import cli as changeforge

    assert changeforge.main(["nonsense"]) == 2
    assert "unknown job 'nonsense'" in capsys.readouterr().err


@pytest.mark.slow   # a subprocess: seconds of imports, outside the quick loop
def test_the_changeforge_command_runs_a_job_s_help():
    """The one subprocess: the module entry point as the installed command runs it."""
    out = subprocess.run([sys.executable, "-m", "jobs.cli", "pairs", "--help"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("usage: changeforge pairs"), out.stdout[:200]


def test_a_missing_extra_is_one_line_not_a_traceback(monkeypatch, capsys):
    from jobs import cli as changeforge
    from jobs import validate
    from operators.optional import require

    monkeypatch.setitem(sys.modules, "wordcloud", None)
    monkeypatch.setattr(validate, "main", lambda argv: require("wordcloud"))
    assert changeforge.main(["validate"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("changeforge validate: the report's word cloud needs wordcloud: pip install "
                          "'changeforge[report]'") and "Traceback" not in err and err.count("\n") == 1


def _reference_options(markdown: str) -> dict[str, set[str]]:
    sections: dict[str, set[str]] = {}
    current = None
    for line in markdown.splitlines():
        if line.startswith("## `"):
            current = line.strip("#` ")
            sections[current] = set()
        elif current and line.startswith("| `"):
            sections[current] |= set(re.findall(r"--[a-z0-9-]+", line.split("|")[1]))
    return sections


def test_cli_reference_matches_the_parsers():
    from jobs.cli import JOBS
    from jobs.cli_reference import _parsers, reference_markdown

    committed = (REPO / "docs" / "cli-reference.md").read_text(encoding="utf-8")
    documented = _reference_options(committed)
    parsed = {}
    for name, (module, _) in JOBS.items():
        for command, parser, presets in _parsers(name, module):
            cli._add_run_options(parser, presets)
            parsed[command] = {s for a in parser._actions if a.help != argparse.SUPPRESS
                               for s in a.option_strings if s.startswith("--") and s != "--help"}
    assert documented == parsed, "docs/cli-reference.md differs from the parsers: regenerate it with " \
        "python -m jobs.cli_reference > docs/cli-reference.md"
    assert committed == reference_markdown(), "docs/cli-reference.md is stale: regenerate it"


def test_status_is_the_chain_s_explain_and_no_chain_step(monkeypatch):
    """``changeforge status`` runs ``chain --explain`` (nothing else) with the options given; a chain file
    cannot name it as a step (it is no job)."""
    from jobs import chain, cli as changeforge
    seen = []
    monkeypatch.setattr(chain, "main", lambda argv: seen.append(argv) or 0)
    monkeypatch.setattr(cli, "PROG", cli.PROG)
    assert changeforge.main(["status", "--config", "c.yaml"]) == 0
    assert seen == [["--explain", "--config", "c.yaml"]]
    assert "status" not in changeforge.JOBS
