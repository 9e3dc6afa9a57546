"""The report's "Change masks" section: the dataset's class scheme and annotation summary, as written
by annotate export and ingest; nothing of it when the dataset has neither."""
from __future__ import annotations

import json
import shutil

from jobs.report import ReportConfig, run
from operators.annotation.scheme import parse_classes, scheme_document
from tests.conftest import DATA
from tests.publish.test_publish_scheme import SUMMARY


def dataset(root):
    for role in ("A", "B", "label"):
        shutil.copytree(DATA / "levir-cd" / role, root / role)
    return root


def test_the_scheme_and_the_summary_are_reported(tmp_path):
    ds = dataset(tmp_path / "ds")
    (ds / "label_classes.json").write_text(json.dumps(scheme_document(parse_classes("demolished:pre,new:post"))))
    (ds / "annotation_summary.json").write_text(json.dumps(SUMMARY))
    stats = run(ReportConfig(input=[str(ds)], output=str(tmp_path / "report"), gallery=0))
    assert [c["name"] for c in stats["masks"]["classes"]] == ["demolished", "new"]
    md = (tmp_path / "report" / "tables.md").read_text()
    section = md.split("### Change masks")[1].split("###")[0]
    for text in ("demolished (on the pre-change image, label1/)", "5 of 6", "median 0.913", "60.0%", "20.0%",
                 "pca-kmeans", "2026-01-20T08:00:00Z to 2026-01-31T17:30:00Z",
                 f"{SUMMARY['excluded'][0]['pair_id']}: unusable (cloud)"):
        assert text in section, (text, section)
    assert "Change masks" in (tmp_path / "report" / "index.html").read_text()


def test_a_dataset_without_them_has_no_mask_section(tmp_path):
    stats = run(ReportConfig(input=[str(dataset(tmp_path / "ds"))], output=str(tmp_path / "report"), gallery=0))
    assert "masks" not in stats and "Change masks" not in (tmp_path / "report" / "tables.md").read_text()
