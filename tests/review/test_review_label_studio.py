"""The review round trip against a real Label Studio on 127.0.0.1: export a stratified sample of a real
captions output, create the project and import through the SDK, annotate through the REST API as a
reviewer's browser does, export, ingest, and check the summary against what the reviewer said."""
import json
import urllib.request

import pandas as pd
import pyarrow.parquet as pq
import pytest

from jobs.review import ExportConfig, IngestConfig, run_export, run_ingest
from operators.review.agreement import wilson_interval
from tests.review.conftest import reviewer_result

pytestmark = pytest.mark.slow


def api(server, path, payload=None):
    req = urllib.request.Request(server.url + path, data=None if payload is None else json.dumps(payload).encode(),
                                 headers={"Authorization": f"Token {server.token}", "Content-Type": "application/json"},
                                 method="GET" if payload is None else "POST")
    with urllib.request.urlopen(req, timeout=60) as r:
        body = r.read()
    return json.loads(body) if r.headers.get("Content-Type", "").startswith("application/json") else body


def test_review_round_trip_through_label_studio(captions_output, label_studio, tmp_path, monkeypatch):
    monkeypatch.setenv("LABEL_STUDIO_API_KEY", label_studio.token)
    images = label_studio.document_root / "levir-cd"
    cfg = ExportConfig(input=str(captions_output), output=str(tmp_path / "export"), sample=14, seed=3,
                       include_rejected=True, images=str(images), label_studio_url=label_studio.url)
    summary = run_export(cfg)

    # The sample: 14 distinct items of the captions table, texts and scores as the job stored them.
    captions = pq.read_table(captions_output / "captions").to_pandas()
    by_item = {f"{r.pair_id}#{r.candidate_index}": r for r in captions.itertuples()}
    tasks = json.loads((tmp_path / "export" / "tasks.json").read_text())
    assert summary["sampled"] == len(tasks) == 14 and summary["population"] == len(captions) == 55
    assert len({t["data"]["item_id"] for t in tasks}) == 14
    for t in tasks:
        row = by_item[t["data"]["item_id"]]
        assert t["data"]["text"] == row.caption and t["data"]["overall"] == row.overall
        assert t["data"]["selected"] == row.selected and t["data"]["facet"] == row.perspective
        assert t["predictions"][0]["result"][0]["value"]["rating"] == round(row.overall)
    assert "base64" not in (tmp_path / "export" / "tasks.json").read_text()
    # Every perspective is represented (strata of one perspective would otherwise be lost at n=14).
    assert {t["data"]["facet"] for t in tasks} == set(captions["perspective"])
    assert summary["label_studio"]["created"] and summary["label_studio"]["imported"] == 14
    pid = summary["label_studio"]["project_id"]

    # In Label Studio: the tasks with the judge's prediction, and the images served from the dataset.
    listed = api(label_studio, f"/api/tasks?project={pid}&page_size=100")["tasks"]
    assert sorted(t["data"]["item_id"] for t in listed) == sorted(t["data"]["item_id"] for t in tasks)
    assert all(t["total_predictions"] == 1 for t in listed)
    first = listed[0]["data"]
    for key, folder in (("pre", "A"), ("post", "B"), ("mask", "label")):
        served = api(label_studio, first[key])
        assert served == (images / folder / f"{first['pair_id']}.png").read_bytes()

    # Rerunning the export imports nothing twice.
    again = run_export(cfg)
    assert again["label_studio"]["project_id"] == pid and again["label_studio"]["imported"] == 0

    # A reviewer works through all but two tasks; one task is re-reviewed later (the last word counts).
    plan = {}
    for i, t in enumerate(sorted(listed, key=lambda t: t["data"]["item_id"])[:-2]):
        if t["data"]["judge_accept"]:
            verdict = ("correct", "partly correct", "correct", "wrong")[i % 4]
        else:
            verdict = ("wrong", "partly correct")[i % 2]
        cats = ("hallucinated object", "vague") if verdict == "wrong" else ("wrong location",) if verdict != "correct" else ()
        corrected = f"corrected text {i}" if verdict == "wrong" else None
        api(label_studio, f"/api/tasks/{t['id']}/annotations/", {"result": reviewer_result(verdict, cats, corrected)})
        plan[t["data"]["item_id"]] = (verdict, cats, corrected, t["data"])
    redo = next(k for k, v in plan.items() if v[0] != "correct")
    redo_task = next(t for t in listed if t["data"]["item_id"] == redo)
    api(label_studio, f"/api/tasks/{redo_task['id']}/annotations/", {"result": reviewer_result("correct")})
    plan[redo] = ("correct", (), None, plan[redo][3])

    # Ingest straight from the server (SDK export) and from a downloaded JSON export of all tasks: the
    # same summary. (The export dialog's default leaves unannotated tasks out: then they are not counted.)
    s = run_ingest(IngestConfig(export=label_studio.url, project_id=pid, output=str(tmp_path / "ingest")))
    export_file = tmp_path / "export.json"
    exported = api(label_studio, f"/api/projects/{pid}/export?exportType=JSON&download_all_tasks=true")
    export_file.write_bytes(exported if isinstance(exported, bytes) else json.dumps(exported).encode())
    s_file = run_ingest(IngestConfig(export=str(export_file), output=str(tmp_path / "ingest-file")))
    assert s_file == s

    # The summary, against what the reviewer said.
    assert (s["tasks"], s["reviewed"], s["unreviewed"]) == (14, 12, 2)
    sel = [v for v in plan.values() if v[3]["selected"]]
    k = sum(v[0] == "correct" for v in sel)
    assert s["acceptance"]["accepted"] == k and s["acceptance"]["n"] == len(sel)
    assert s["acceptance"]["wilson95"] == pytest.approx(list(wilson_interval(k, len(sel))))
    assert s["acceptance_lenient"]["accepted"] == sum(v[0] != "wrong" for v in sel)
    human = [v[0] == "correct" for v in plan.values()]
    judge = [bool(v[3]["judge_accept"]) for v in plan.values()]
    n = len(human)
    po = sum(h == j for h, j in zip(human, judge)) / n
    pe = (sum(human) / n) * (sum(judge) / n) + (1 - sum(human) / n) * (1 - sum(judge) / n)
    assert s["judge_agreement"]["cohens_kappa"] == pytest.approx((po - pe) / (1 - pe))
    wrong_by_facet = pd.Series([v[3]["facet"] for v in plan.values() if v[0] == "wrong"]).value_counts()
    for facet, count in wrong_by_facet.items():
        assert s["by_facet"][facet]["error_categories"]["hallucinated object"] == count
    assert sorted(c["corrected_text"] for c in s["corrections"]) == sorted(v[2] for v in plan.values() if v[2])

    # review/ is plain Parquet: one row per annotation plus the unreviewed tasks.
    review = pq.read_table(tmp_path / "ingest" / "review").to_pandas()
    assert len(review) == 12 + 1 + 2 and (review["status"] == "unreviewed").sum() == 2
    assert (tmp_path / "ingest" / "review_summary.md").read_text().count("Wilson 95%") == 2
    # The API key is in no output.
    for path in list((tmp_path / "export").rglob("*")) + list((tmp_path / "ingest").rglob("*")):
        if path.is_file():
            assert label_studio.token.encode() not in path.read_bytes(), path
