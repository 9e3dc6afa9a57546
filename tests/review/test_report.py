"""The dataset report over a real captions output, a QA table in the QA job's shape, a pairs-job table
set and a review ingested from a recorded Label Studio export: its numbers against a direct pandas
computation over the same Parquet tables, and the page as headless Chromium shows it."""
import json
import re
import shutil

import cv2
import pyarrow.parquet as pq
import pytest

from jobs.report import ReportConfig, run
from jobs.review import ExportConfig, IngestConfig, run_export, run_ingest
from tests.review.browser import chromium, probe_page, screenshot
from tests.review.conftest import LEVIR, make_pairs_job_output, make_qa_output, reviewer_result

pytestmark = pytest.mark.slow


def latest(df, keys):
    return df.sort_values("run_id", kind="stable").drop_duplicates(keys, keep="last")


def recorded_review(captions_output, folder):
    """A review ingested from a Label Studio export recorded in the test (the reviewer's answers
    appended to the exported tasks the way Label Studio exports them)."""
    run_export(ExportConfig(input=str(captions_output), output=str(folder / "export"), sample=10, seed=1,
                            images=str(LEVIR), local_files_root=str(LEVIR.parent)))
    tasks = json.loads((folder / "export" / "tasks.json").read_text())
    for i, t in enumerate(tasks):
        t["id"] = 100 + i
        verdict = ("correct", "correct", "partly correct", "wrong")[i % 4]
        t["annotations"] = [{"id": 500 + i, "was_cancelled": False, "completed_by": 1, "updated_at": "2026-01-01",
                             "result": reviewer_result(verdict)}]
    (folder / "export.json").write_text(json.dumps(tasks))
    summary = run_ingest(IngestConfig(export=str(folder / "export.json"), output=str(folder / "review-out")))
    return folder / "review-out", summary, tasks


def test_report_numbers_match_pandas_and_page_renders(captions_output, chromium_path, tmp_path):
    pairs_c = pq.read_table(captions_output / "pairs").to_pandas()
    qa_out = make_qa_output(tmp_path / "qa", pairs_c.to_dict("records"))
    pairs_job = make_pairs_job_output(tmp_path / "pairs-job")
    review_out, review_summary, review_tasks = recorded_review(captions_output, tmp_path)
    out = tmp_path / "report"
    stats = run(ReportConfig(input=[str(pairs_job), str(captions_output), str(qa_out), str(review_out)],
                             output=str(out), images=str(LEVIR), gallery=4))
    on_disk = json.loads((out / "stats.json").read_text())
    assert on_disk["captions"] == stats["captions"]

    # Table III, straight from the Parquet folder with pandas.
    cap = pq.read_table(captions_output / "captions").to_pandas()
    for split in ("train", "val", "test", "total"):
        c = cap if split == "total" else cap[cap["split"] == split]
        p = pairs_c if split == "total" else pairs_c[pairs_c["split"] == split]
        sel = c[c["selected"]]
        got = stats["captions"][split]
        assert got["image_pairs"] == len(p) and got["generated"] == len(c) and got["selected"] == len(sel)
        assert got["pass_rate"] == pytest.approx(len(sel) / len(c))
        assert got["selected_per_pair"] == pytest.approx(len(sel) / len(p))
        assert got["caption_words_mean"] == pytest.approx(sel["caption"].str.split().str.len().mean())
        vocab = set(re.sub(r"[^\w\s]", " ", " ".join(sel["caption"]).lower().replace("'", "")).split())
        assert got["vocabulary"] == len(vocab)
        assert got["judge_score_mean"] == pytest.approx(c["overall"].mean())
        assert got["judge_score_median"] == pytest.approx(c["overall"].median())
    assert stats["captions"]["total"]["generated"] == 55

    # Table V: the stale row of an older run must not count.
    qa = latest(pq.read_table(qa_out / "qa").to_pandas(), ["pair_id", "qa_index"])
    sel = qa[qa["selected"]]
    got = stats["qa"]["total"]
    assert got["generated"] == len(qa) == 55 and got["selected"] == len(sel)
    assert got["question_words_mean"] == pytest.approx(sel["question"].str.split().str.len().mean())
    assert got["answer_words_mean"] == pytest.approx(sel["answer"].str.split().str.len().mean())
    assert got["judge_score_median"] == pytest.approx(qa["overall"].median())
    assert got["judged"] == int(qa["overall"].notna().sum()) == len(qa) - 1
    assert got["selected_by_question_type"] == sel["question_type"].value_counts().to_dict()
    assert got["score_bands"]["9-10"] == pytest.approx((qa["overall"].dropna() >= 9).mean())   # of judged pairs

    # CAR (Fig. 2) from the captions job's pairs table; magnitude classes add up.
    assert stats["car"]["mean"] == pytest.approx(pairs_c["car"].mean())
    assert stats["car"]["median"] == pytest.approx(pairs_c["car"].median())
    assert sum(stats["car"]["classes"].values()) == len(pairs_c)
    assert stats["car"]["classes"]["no change"] == int((pairs_c["car"] == 0).sum())

    # Pairs job: splits, reasons without their numbers, residuals.
    meta = pq.read_table(pairs_job / "metadata").to_pandas()
    assert stats["pairs_job"]["accepted"] == int((meta["status"] == "accepted").sum())
    assert stats["pairs_job"]["by_split"]["val"]["rejected"] == int(((meta["split"] == "val") & (meta["status"] == "rejected")).sum())
    assert stats["pairs_job"]["reject_reasons"] == {"too few inliers": 2, "residual": 2, "nodata": 1}
    assert stats["pairs_job"]["residual_px"]["median"] == pytest.approx(meta["residual_px"].median())

    # Tokens and cost over every run.
    usage_c = pq.read_table(captions_output / "usage").to_pandas()
    assert stats["usage"]["captions"]["prompt_tokens"] == int(usage_c["prompt_tokens"].sum())
    assert stats["usage"]["captions"]["cost_usd"] == pytest.approx(usage_c["cost_usd"].sum())
    assert stats["usage"]["qa"]["completion_tokens"] == 200 * len(pairs_c)

    # Review: the recorded verdicts.
    sel_tasks = [t for t in review_tasks if t["data"]["selected"]]
    correct = sum(t["annotations"][0]["result"][0]["value"]["choices"][0] == "correct" for t in sel_tasks)
    assert stats["review"]["acceptance"]["accepted"] == correct and stats["review"]["acceptance"]["n"] == len(sel_tasks)
    assert stats["review"] == review_summary

    # Every section's table and figure is there.
    figures = sorted(p.name for p in (out / "figures").glob("*.png"))
    assert figures == ["caption_scores.png", "caption_wordcloud.png", "car_distribution.png", "magnitude_classes.png",
                       "qa_scores.png", "question_types.png", "reject_reasons.png", "residuals.png"]
    md = (out / "tables.md").read_text()
    for title in ("Table III", "Table V", "Reject reasons", "Tokens and cost", "Human review", "Change-magnitude"):
        assert title in md

    # The page in headless Chromium: every figure and gallery image decodes, and the page has content.
    seen = probe_page(out / "index.html", tmp_path)
    assert len(seen["images"]) == len(figures) + 3 * 4
    assert all(im["ok"] for im in seen["images"]), [im for im in seen["images"] if not im["ok"]]
    assert seen["tables"] >= 7 and seen["text_chars"] > 2000
    png = screenshot(out / "index.html", tmp_path / "report.png")
    shutil.copy(png, out / "screenshot.png")
    shot = cv2.imread(str(png))
    non_white = (shot.min(axis=2) < 240).mean()
    assert shot.shape[:2] == (3000, 1200) and non_white > 0.1 and shot.std() > 30


def test_report_of_a_captions_output_alone_has_only_caption_sections(captions_output, tmp_path):
    stats = run(ReportConfig(input=[str(captions_output)], output=str(tmp_path / "r"), gallery=2))
    assert set(stats) >= {"captions", "car", "usage"} and not {"qa", "pairs_job", "review"} & set(stats)
    assert sorted(p.name for p in (tmp_path / "r" / "figures").glob("*.png")) == [
        "caption_scores.png", "caption_wordcloud.png", "car_distribution.png", "magnitude_classes.png"]
    page = (tmp_path / "r" / "index.html").read_text()
    assert "Question answering" not in page and "Sample pairs" in page
    # No --images: the gallery finds the pairs' images through the source.json the captions job wrote.
    assert "not available" not in page and page.count('class="gallery"') == 2 * 3
