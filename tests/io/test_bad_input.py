"""Every mistake a user can make, over every job: one table of bad command lines (and run and chain
files). Each must exit non-zero with one line naming the bad thing and no traceback; the ones that
fail before work must start no Ray (``ray.init`` raises here) and write nothing (the working folder
is exactly as it was). The few that need a job to run (a corrupt raster, a mask of the wrong size)
are marked ``ray`` and reuse the session's Ray."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from jobs import cli as changeforge
from operators.io.validation import NOTHING_DONE, USAGE

REPO = Path(__file__).resolve().parents[2]
NAIP = str(REPO / "data" / "naip")
LEVIR = str(REPO / "data" / "levir-cd")
CAPTIONS_JSON = str(REPO / "data" / "levir-cc" / "LevirCCcaptions.json")


def _files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")}


@pytest.fixture
def bench(tmp_path, monkeypatch):
    """A working folder with the bad inputs the table names, as the current directory."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes").mkdir()
    for i in range(3):
        (tmp_path / "notes" / f"note{i}.txt").write_text("not an image\n")
    (tmp_path / "empty-export.json").write_text("[]\n")
    (tmp_path / "broken.json").write_text("[{\"id\": 1,")
    (tmp_path / "run-unknown.yaml").write_text("stride: 512\ncolour: red\n")
    (tmp_path / "run-bad.yaml").write_text("stride: 0\n")
    (tmp_path / "run-type.yaml").write_text("max-cloud-cover: lots\n")
    (tmp_path / "run-list.yaml").write_text("- stride\n- 0\n")
    chain = "output: run\nsteps:\n  - pairs: {{input: {naip}, preset: demo}}\n  - {step}\n"
    (tmp_path / "chain-misspelt.yaml").write_text(chain.format(naip=NAIP, step="captoin: {model: m}"))
    (tmp_path / "chain-key.yaml").write_text(chain.format(naip=NAIP, step="caption: {modle: m}"))
    (tmp_path / "chain-value.yaml").write_text(chain.format(naip=NAIP, step="caption: {model: m, rpm: -1}"))
    (tmp_path / "chain-required.yaml").write_text(chain.format(naip=NAIP, step="caption: {}"))
    (tmp_path / "chain-path.yaml").write_text(chain.format(naip=NAIP + "x", step="report: {}"))
    (tmp_path / "chain-command.yaml").write_text(chain.format(naip=NAIP, step="score: {}"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


P = ["pairs", "--input", NAIP, "--output", "out"]
C = ["caption", "--input", LEVIR, "--output", "out", "--model", "m"]
Q = ["qa", "--input", LEVIR, "--output", "out", "--model", "m"]
PUB = ["publish", "--input", LEVIR, "--output", "out", "--name", "n", "--version", "1.0.0"]

# (id, argv, what the one line must say). All fail before any work.
CASES = [
    # pairs
    ("pairs-missing-input", ["pairs", "--input", "data/naipp", "--output", "out"], "--input data/naipp: no such file or folder"),
    ("pairs-stride-0", P + ["--stride", "0"], "--stride 0: must be at least 1"),
    ("pairs-stride-type", P + ["--stride", "abc"], "--stride abc: not a whole number"),
    ("pairs-abbreviation", P + ["--strid", "512"], "unknown option --strid (did you mean --stride?)"),
    ("pairs-slice-negative", P + ["--slice-size", "-1"], "--slice-size -1: must be at least 1"),
    # the rescue's field needs redundancy: the floor was a silent max(setting, 8) in the screen
    ("pairs-rescue-min-windows-7", P + ["--rescue-min-windows", "7"], "--rescue-min-windows 7: must be at least 8"),
    ("pairs-crop-above-slice", P + ["--crop-size", "4000"], "--crop-size 4000 is larger than --slice-size 3000"),
    ("pairs-cloud-cover-150", P + ["--max-cloud-cover", "150"], "--max-cloud-cover 150: must be between 0 and 100"),
    ("pairs-crop-cloud-fraction", P + ["--max-crop-cloud", "1.5"], "--max-crop-cloud 1.5: must be between 0 and 1"),
    ("pairs-iou", P + ["--min-iou", "2"], "--min-iou 2: must be between 0 and 1"),
    ("pairs-lookback-0", P + ["--lookback-years", "0"], "--lookback-years 0: must be greater than 0"),
    ("pairs-date", P + ["--reference-date", "2021-13-01"], "--reference-date 2021-13-01: not a date"),
    ("pairs-split-fractions", P + ["--split-fractions", "0.7,0.3"], "--split-fractions 0.7,0.3: needs 3"),
    ("pairs-split-fractions-sum", P + ["--split-fractions", "0.5,0.6,0.2"],
     "--split-fractions 0.5,0.6,0.2: must sum to 1, they sum to 1.3"),
    ("pairs-percentiles-order", P + ["--stretch-percentiles", "98,2"], "--stretch-percentiles 98,2: must be in increasing order"),
    ("pairs-percentile-range", P + ["--stretch-percentiles", "2,101"], "--stretch-percentiles 2,101: 101: must be between 0 and 100"),
    ("pairs-rgb-bands-type", P + ["--rgb-bands", "r,g,b"], "--rgb-bands r,g,b: not a comma-separated list"),
    ("pairs-registration-choice", P + ["--registration", "fast"], "--registration fast: choose from regional, per-slice"),
    ("pairs-cloud-kind-choice", P + ["--cloud-mask-kind", "fmask"], "--cloud-mask-kind fmask: choose from"),
    ("pairs-label-maps-missing", P + ["--label-maps", "labelz"], "--label-maps labelz: no such file or folder"),
    ("pairs-preset", P + ["--preset", "huge"], "preset 'huge': choose from demo, paper"),
    ("pairs-empty-folder", ["pairs", "--input", "empty", "--output", "out"], "--input empty: is empty (no scenes)"),
    ("pairs-folder-of-non-images", ["pairs", "--input", "notes", "--output", "out"], "--input notes: holds no scenes"),
    ("pairs-run-file-unknown-key", P + ["--config", "run-unknown.yaml"], "run-unknown.yaml: unknown option 'colour'"),
    ("pairs-run-file-bad-value", P + ["--config", "run-bad.yaml"], "run-bad.yaml: stride: 0: must be at least 1"),
    ("pairs-run-file-wrong-type", P + ["--config", "run-type.yaml"], "run-type.yaml: max-cloud-cover: lots: not a number"),
    ("pairs-run-file-not-a-mapping", P + ["--config", "run-list.yaml"], "--config run-list.yaml: expected a mapping"),
    ("pairs-run-file-missing", P + ["--config", "nope.yaml"], "--config nope.yaml: cannot read it"),
    ("pairs-num-cpus-0", P + ["--num-cpus", "0"], "--num-cpus 0: must be at least 1"),
    # caption and qa
    ("caption-required-model", ["caption", "--input", LEVIR, "--output", "out"], "missing --model (required)"),
    ("caption-missing-input", ["caption", "--input", "pairz", "--output", "out", "--model", "m"], "--input pairz: no such file or folder"),
    ("caption-detail-choice", C + ["--detail", "ultra"], "--detail ultra: choose from low, high, auto"),
    ("caption-rpm-negative", C + ["--rpm", "-1"], "--rpm -1: must be at least 0"),
    ("caption-port", C + ["--base-url", "http://127.0.0.1:99999/v1"], "the port must be a number between 1 and 65535"),
    ("caption-url-scheme", C + ["--base-url", "localhost:8000"], "--base-url localhost:8000: not an http(s):// URL"),
    ("caption-batch-size-0", C + ["--batch-size", "0"], "--batch-size 0: must be at least 1"),
    ("caption-timeout-0", C + ["--timeout-s", "0"], "--timeout-s 0: must be greater than 0"),
    ("caption-abbreviation", C + ["--judge", "m2"], "unknown option --judge"),
    ("qa-per-pair-9", Q + ["--qa-per-pair", "9"], "--qa-per-pair 9: must be between 1 and 8"),
    ("qa-captions-missing", Q + ["--captions", "caps.json"], "--captions caps.json: no such file or folder"),
    # annotate
    ("annotate-unknown-command", ["annotate", "exprot", "--input", LEVIR], "command exprot: choose from export, ingest"),
    ("annotate-annotations-per-task", ["annotate", "export", "--input", LEVIR, "--output", "out",
                                       "--annotations-per-task", "3"], "--annotations-per-task 3: choose from 1, 2"),
    ("annotate-label-studio-url", ["annotate", "export", "--input", LEVIR, "--output", "out",
                                   "--label-studio-url", "ftp://ls"], "--label-studio-url ftp://ls: not an http(s):// URL"),
    ("annotate-url-expiry", ["annotate", "export", "--input", LEVIR, "--output", "out", "--url-expiry-s", "0"],
     "--url-expiry-s 0: must be between 1 and 604800"),
    ("annotate-min-agreement", ["annotate", "ingest", "--input", LEVIR, "--export", "empty-export.json",
                                "--min-agreement", "1.5"], "--min-agreement 1.5: must be between 0 and 1"),
    ("annotate-empty-export", ["annotate", "ingest", "--input", LEVIR, "--export", "empty-export.json"],
     "--export empty-export.json: holds no entries (an empty export)"),
    ("annotate-broken-export", ["annotate", "ingest", "--input", LEVIR, "--export", "broken.json"],
     "--export broken.json: not a JSON file"),
    ("annotate-missing-export", ["annotate", "ingest", "--input", LEVIR, "--export", "export.json"],
     "--export export.json: no such file or folder"),
    # validate, review, report
    ("validate-missing-input", ["validate", "--input", "claims.jsonl", "--output", "out"], "--input claims.jsonl: no such file or folder"),
    ("validate-masks-not-a-folder", ["validate", "--input", CAPTIONS_JSON, "--output", "out", "--masks", CAPTIONS_JSON],
     "not a folder"),
    ("review-sample-0", ["review", "export", "--input", LEVIR, "--output", "out", "--sample", "0"], "--sample 0: must be at least 1"),
    ("review-pass-score", ["review", "export", "--input", LEVIR, "--output", "out", "--pass-score", "11"],
     "--pass-score 11: must be between 0 and 10"),
    ("review-kind-choice", ["review", "export", "--input", LEVIR, "--output", "out", "--kind", "masks"],
     "--kind masks: choose from auto, captions, qa"),
    ("review-empty-export", ["review", "ingest", "--export", "empty-export.json", "--output", "out"],
     "--export empty-export.json: holds no entries"),
    ("report-missing-input", ["report", "--input", LEVIR, "nope", "--output", "out"], "--input nope: no such file or folder"),
    ("report-gallery-side", ["report", "--input", LEVIR, "--output", "out", "--gallery-side", "0"], "--gallery-side 0: must be at least 16"),
    # score
    ("score-change-empty-pred", ["score", "change", "--pred", "empty", "--masks", f"{LEVIR}/label", "--output", "out"],
     "--pred empty: is empty (no PNG masks)"),
    ("score-change-non-images", ["score", "change", "--pred", "notes", "--masks", f"{LEVIR}/label", "--output", "out"],
     "--pred notes: holds no PNG masks"),
    ("score-change-abbreviation", ["score", "change", "--pred", f"{LEVIR}/label", "--masks", f"{LEVIR}/label",
                                   "--output", "out", "--masks-per", "8"], "unknown option --masks-per (did you mean --masks-per-task?)"),
    ("score-captions-split", ["score", "captions", "--pred", CAPTIONS_JSON, "--refs", CAPTIONS_JSON, "--output", "out",
                              "--split", "holdout"], "--split holdout: choose from auto, all, train, val, test"),
    ("score-qa-rpm", ["score", "qa", "--pred", CAPTIONS_JSON, "--refs", CAPTIONS_JSON, "--output", "out", "--rpm", "-5"],
     "--rpm -5: must be at least 0"),
    ("score-qa-base-url-without-judge", ["score", "qa", "--pred", CAPTIONS_JSON, "--refs", CAPTIONS_JSON, "--output",
                                         "out", "--base-url", "http://127.0.0.1:8000/v1"],
     "--base-url http://127.0.0.1:8000/v1 needs --judge-model"),
    # publish
    ("publish-override-without-licence", PUB + ["--licence-override", "granted by mail"],
     "--licence-override granted by mail needs --licence"),
    ("publish-date", PUB + ["--date", "2020-02-30"], "--date 2020-02-30: not a date"),
    ("publish-missing-input", ["publish", "--input", "levir", "--output", "out", "--name", "n", "--version", "1.0.0"],
     "--input levir: no such file or folder"),
    ("publish-shard-mb", PUB + ["--shard-mb", "0"], "--shard-mb 0: must be greater than 0"),
    ("publish-split-choice", PUB + ["--default-split", "holdout"], "--default-split holdout: choose from train, val, test"),
    # the chain and the command
    ("chain-misspelt-step", ["chain", "--config", "chain-misspelt.yaml"], "chain-misspelt.yaml: step 2 'captoin': unknown job 'captoin'"),
    ("chain-unknown-key", ["chain", "--config", "chain-key.yaml"], "chain-key.yaml: step 2 'caption': unknown option 'modle' (did you mean model?)"),
    ("chain-bad-value", ["chain", "--config", "chain-value.yaml"], "chain-value.yaml: step 2 'caption': rpm: -1: must be at least 0"),
    ("chain-required", ["chain", "--config", "chain-required.yaml"], "chain-required.yaml: nothing ran; step 2 'caption' needs --model"),
    ("chain-missing-path", ["chain", "--config", "chain-path.yaml"], "chain-path.yaml: step 1 'pairs': input:"),
    ("chain-no-command", ["chain", "--config", "chain-command.yaml"], "chain-command.yaml: step 2 'score': name the command"),
    ("chain-abbreviation", ["chain", "--config", "chain-key.yaml", "--dry"], "unknown option --dry (did you mean --dry-run?)"),
    ("unknown-job", ["captions", "--input", LEVIR], "unknown job 'captions' (did you mean caption?)"),
]


def _run(argv, capsys) -> tuple[int, str]:
    try:
        code = changeforge.main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
        if not isinstance(exc.code, int) and exc.code is not None:
            print(exc.code, file=__import__("sys").stderr)
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.mark.parametrize("argv,message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_fails_before_work_with_one_line(argv, message, bench, capsys, monkeypatch):
    import ray

    def no_ray(*a, **k):
        raise AssertionError("Ray was started for a bad input")

    monkeypatch.setattr(ray, "init", no_ray)
    before = _files(bench)
    code, text = _run(argv, capsys)
    assert code == USAGE, (code, text)
    assert "Traceback" not in text and "Error:" not in text.replace("error:", ""), text
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("warning:")]
    assert len(lines) == 1, text                      # one line ...
    assert message in lines[0], lines[0]              # ... naming the option and the value
    assert lines[0].startswith("changeforge"), lines[0]
    assert _files(bench) == before                    # nothing written: no out/, no runs/


def test_the_table_covers_every_job_with_at_least_40_cases():
    from jobs.cli import JOBS

    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)
    assert {c[1][0] for c in CASES} >= set(JOBS)


# -- cases that need the job to run: the item goes to errors/, and a run that produced nothing exits 3 ------
def test_a_corrupt_raster_is_an_error_row_named_on_the_console(tmp_path, ray_session, capsys):
    scenes = tmp_path / "scenes"
    scenes.mkdir()
    (scenes / "m_0000000_ne_01_1_20150101.tif").write_bytes(b"II*\x00" + os.urandom(600))   # a TIFF header, then noise
    (scenes / "m_0000000_ne_01_1_20190101.tif").write_bytes(b"not a raster at all")
    code, text = _run(["pairs", "--input", str(scenes), "--output", str(tmp_path / "out"), "--preset", "demo"], capsys)
    assert code == NOTHING_DONE, text
    assert "Traceback" not in text
    assert "m_0000000_ne_01_1_20150101.tif" in text and "m_0000000_ne_01_1_20190101.tif" in text, text
    from operators.io.tables import read_table
    from operators.io.storage import Store
    errors = read_table(Store(str(tmp_path / "out")), "errors").to_pylist()
    assert sorted(os.path.basename(e["item"]) for e in errors) == ["m_0000000_ne_01_1_20150101.tif",
                                                                    "m_0000000_ne_01_1_20190101.tif"]


def test_a_mask_of_the_wrong_size_is_an_error_row_and_the_others_are_scored(tmp_path, ray_session, capsys):
    import cv2

    pred, ref = tmp_path / "pred", tmp_path / "ref"
    pred.mkdir(), ref.mkdir()
    for name in ("a", "b"):
        cv2.imwrite(str(ref / f"{name}.png"), np.zeros((32, 32), np.uint8))
    cv2.imwrite(str(pred / "a.png"), np.zeros((32, 32), np.uint8))
    cv2.imwrite(str(pred / "b.png"), np.zeros((16, 16), np.uint8))     # the wrong size
    code, text = _run(["score", "change", "--pred", str(pred), "--masks", str(ref), "--output", str(tmp_path / "out"),
                       "--num-cpus", "1"], capsys)
    assert code == 0 and "Traceback" not in text, text
    from operators.io.tables import read_table
    from operators.io.storage import Store
    errors = read_table(Store(str(tmp_path / "out")), "errors").to_pylist()
    assert [os.path.basename(e["item"]).removesuffix(".png") for e in errors] == ["b"], errors
    assert "b" in text and "error" in text.lower(), text
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["n_images"] == 1 and metrics["n_errors"] == 1, metrics
