"""The expert's loop inside ``changeforge chain``, with people in a real Label Studio (the session's one):
export -> ingest of round 1 -> export of the review queue -> ingest of the review -> report, on a small
LEVIR-CD-layout dataset under Label Studio's document root.

Round 1: two annotators agree on s0 and s2, disagree on s1, and one draws s3 alone; the batch's mean
agreement over its checked pairs (s0, s1, s2) is below 0.8, so its merged pairs (s0, s2 and the unchecked
s3) are held with s1 for the expert. The chain ingests round 1, exports the four to the review project
while it waits, and waits for the
review's export. The expert (a third person) answers s1 only: s1 leaves the batch's mean, the batch
recovers, every pair is decided, and the chain goes on to the report. One run for the module."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import cv2
import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.annotation.drawing import brush
from tests.annotation.test_annotate_job import make_dataset, rect
from tests.jobs.chain_runs import run_chain, save_export as save_export_of
from tests.conftest import REPO
from tests.review.test_review_label_studio import api

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
IDS = ["s0", "s1", "s2", "s3"]


@pytest.fixture(scope="module")
def loop(tmp_path_factory, label_studio):

    server = label_studio
    base = tmp_path_factory.mktemp("chain-expert")
    docroot = server.document_root / base.name
    ds = make_dataset(docroot / "ds", IDS)
    shutil.rmtree(ds / "metadata")                      # a LEVIR-CD-layout dataset
    root, round1, review = base / "root", base / "round1.json", base / "review.json"
    config = base / "chain.yaml"
    config.write_text(f"""output: {root}
steps:
  - annotate export: {{input: {ds}, annotations-per-task: 2, label-studio-url: "{server.url}",
                       project-title: "chain expert {base.name} round 1", local-files-root: {server.document_root}}}
  - annotate ingest: {{input: {ds}, export: {round1}}}
  - annotate export: {{input: {ds}, queue: review, label-studio-url: "{server.url}",
                       project-title: "chain expert {base.name} review", local-files-root: {server.document_root}}}
  - annotate ingest: {{input: {ds}, export: {review}}}
  - report: {{input: [{ds}]}}
""")
    env = {**os.environ, "PYTHONPATH": str(REPO), "LABEL_STUDIO_API_KEY": server.token}

    def chain(*extra):
        return run_chain(config, base, env, *extra)

    def save_export(project_id: int, path: Path) -> None:
        save_export_of(server, project_id, path)

    def tasks_of(project_id: int) -> dict:
        return {t["data"]["item_id"]: t for t in api(server, f"/api/tasks?project={project_id}&page_size=100")["tasks"]}

    def annotate(task, who, mask):
        api(server, f"/api/tasks/{task['id']}/annotations/",
            {"result": [brush("new", "post", mask)], "completed_by": who, "lead_time": 20.0})

    out = {"ds": ds, "root": root, "review": review}
    out["run1"] = chain()                              # the export; round 1's export has not arrived
    pid = json.loads((root / "annotate" / "export_summary.json").read_text())["label_studio"]["project_id"]
    tasks = tasks_of(pid)
    first = api(server, "/api/current-user/whoami")["id"]
    second = api(server, "/api/users/", {"email": f"second-{base.name}@changeforge.test", "username": f"s{base.name}",
                                         "first_name": "S", "last_name": "S"})["id"]
    annotate(tasks["s0"], first, rect(5, 25, 5, 25))
    annotate(tasks["s0"], second, rect(5, 25, 5, 26))     # a pixel off: agrees
    annotate(tasks["s1"], first, rect(0, 20, 0, 20))
    annotate(tasks["s1"], second, rect(20, 40, 30, 50))   # disagrees
    annotate(tasks["s2"], first, rect(10, 30, 20, 40))
    annotate(tasks["s2"], second, rect(10, 30, 20, 40))   # agrees
    annotate(tasks["s3"], first, rect(0, 20, 30, 50))     # one annotation
    save_export(pid, round1)
    out["run2"] = chain()                              # round 1 in; the review exported; its export awaited
    out["pending2"] = {r["pair_id"]: r for r in pq.read_table(ds / "annotation_pending").to_pylist()}
    rid = json.loads((root / "annotate-review" / "export_summary.json").read_text())["label_studio"]["project_id"]
    out["review_tasks"] = tasks_of(rid)
    expert = api(server, "/api/users/", {"email": f"expert-{base.name}@changeforge.test", "username": f"e{base.name}",
                                         "first_name": "E", "last_name": "E"})["id"]
    out["expert_mask"] = rect(0, 20, 10, 30)
    annotate(out["review_tasks"]["s1"], expert, out["expert_mask"])
    save_export(rid, review)
    out["run3"] = chain()                              # the review in: every pair decided, the report runs
    out["summary"] = json.loads((ds / "annotation_summary.json").read_text())
    out["run4"] = chain()                              # nothing new: nothing runs
    return out


def explain(run: dict) -> str:
    return run["out"][-3000:] + run["err"][-3000:]


def test_the_chain_waits_for_round_one_s_export(loop):
    r = loop["run1"]
    assert r["code"] == 3 and "waiting for annotators: no export at" in r["out"], explain(r)
    assert "step 3/5" not in r["out"]


def test_round_one_s_review_is_exported_while_the_chain_waits_for_its_answers(loop):
    r = loop["run2"]
    assert r["code"] == 3, explain(r)
    assert "step 2/5 annotate ingest" in r["out"] and "step 3/5 annotate export" in r["out"], explain(r)
    assert f"waiting for annotators: no export at {loop['review']} yet" in r["out"]
    assert "step 5/5 report" not in r["out"]
    pending = loop["pending2"]
    assert {p: pending[p]["status"] for p in IDS} == dict.fromkeys(IDS, "disagreement")
    assert [p for p in IDS if pending[p]["reason"].startswith("batch (")] == ["s0", "s2", "s3"]
    assert sorted(loop["review_tasks"]) == IDS                     # the held pairs go to the expert too


def test_the_expert_s_answer_lets_the_batch_recover_and_the_chain_run_to_the_end(loop):
    r = loop["run3"]
    assert r["code"] == 0, explain(r)
    assert "step 4/5 annotate ingest (not finished before)" in r["out"] and "step 5/5 report" in r["out"], explain(r)
    p = loop["summary"]["pairs"]
    assert (p["total"], p["decided"]) == (4, 4)
    assert (p["by_status"]["merged"], p["by_status"]["expert"]) == (3, 1)
    drawn = cv2.imread(str(loop["ds"] / "label" / "s1.png"), cv2.IMREAD_UNCHANGED) > 0
    assert np.array_equal(drawn, loop["expert_mask"])
    assert (loop["root"] / "report" / "index.html").exists()


def test_a_run_with_nothing_new_runs_nothing(loop):
    r = loop["run4"]
    assert r["code"] == 0 and "ran 0 step(s); done" in r["out"], explain(r)
