"""Issue 45's history through ``changeforge chain`` with two real Label Studio servers (instances lab-a and
lab-b, one document root), checked against the reference oracle (tests/annotation/oracle.py) after every
run: each pair's status, reason, people, expert and batch, the masks written, and the summary's counts.

The chain: export to lab-a -> ingest of lab-a's project -> export of the pairs still open to lab-b ->
ingest of lab-b's project -> export of the review queue to lab-b -> ingest of the review -> report. The
team lead saves each project's export (users named by email, as the Label Studio client gives them) at
the path its ingest step names.

- Round 1, on lab-a: ann1 and the admin agree on s0 and disagree on s1 and s2 (ann1's s2 is wrong); ann1
  draws s3 alone. The batch's mean agreement is below 0.8, so its merged pairs are held for the expert.
  The chain ingests it, sends the open pairs s4 and s5 to lab-b, and waits for lab-b's export.
- Round 2: on lab-a the lead deletes ann1's wrong s2 drawing and ann1 draws it again (now agreeing), and
  the admin corrects ann1's s3 in place (a check). On lab-b, ann2 and the admin (the same person on both
  servers, by email) agree on s4; ann2 draws s5 alone. The batch on lab-a is still rejected (s1); the
  review queue goes to lab-b and the chain waits for its answers.
- Round 3: ann2, an annotator elsewhere but not of s1, answers s1's review task: the expert. s1 leaves
  lab-a's batch mean, the batch recovers, every pair is decided and the chain runs the report.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import cv2
import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.annotation import oracle
from tests.annotation.drawing import brush
from tests.annotation.test_annotate_job import H, W, make_dataset, rect
from tests.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.labelstudio, pytest.mark.timeout(2400)]
IDS = ["s0", "s1", "s2", "s3", "s4", "s5"]
RULES = oracle.Rules(min_agreement=0.8, batch_min_agreement=0.8, tolerance_px=2, noise_px=200)


def api(server, path, payload=None, method=None):
    req = urllib.request.Request(server.url + path, data=None if payload is None else json.dumps(payload).encode(),
                                 headers={"Authorization": f"Token {server.token}", "Content-Type": "application/json"},
                                 method=method or ("GET" if payload is None else "POST"))
    with urllib.request.urlopen(req, timeout=60) as r:
        body = r.read()
    return json.loads(body) if body and r.headers.get("Content-Type", "").startswith("application/json") else body


def named(tasks: list[dict]) -> list[dict]:
    """The export as the oracle reads it: a user is their email (the client names them ``{id, email}``)."""
    out = json.loads(json.dumps(tasks))
    for t in out:
        for a in t.get("annotations") or []:
            for key in ("completed_by", "updated_by"):
                if isinstance(a.get(key), dict):
                    a[key] = a[key].get("email") or str(a[key].get("id"))
    return out


def masks_of(version: dict) -> dict:
    """The oracle's masks of a version: {class: (a name for the drawing, mask)}."""
    from operators.annotation.results import class_masks
    from operators.annotation.scheme import parse_classes
    masks = class_masks(version["result"], parse_classes("new:post,demolished:pre"), W, H)
    return {c: (hashlib.sha1(np.packbits(m).tobytes()).hexdigest(), m) for c, m in masks.items()}


@pytest.fixture(scope="module")
def history(tmp_path_factory):
    from operators.labelstudio.client import call
    from tests.review.label_studio_env import LabelStudioServer, venv_dir

    base = tmp_path_factory.mktemp("two-instances")
    docroot = base / "docroot"
    ds = make_dataset(docroot / "ds", IDS)
    import shutil
    shutil.rmtree(ds / "metadata")                       # a LEVIR-CD-layout dataset
    a, b = LabelStudioServer(base / "lab-a", docroot, startup_s=900), LabelStudioServer(base / "lab-b", docroot,
                                                                                          startup_s=900)
    try:   # started together: the two start in about the time of one
        a.launch()
        b.launch()
        a.ready()
        b.ready()
    except BaseException:
        a.stop()
        b.stop()
        raise
    env = {**os.environ, "PYTHONPATH": str(REPO), "LABEL_STUDIO_API_KEY": a.token,
           "LABEL_STUDIO_PYTHON": str(venv_dir() / "bin" / "python")}
    root = base / "root"
    files = {"a": base / "lab-a-annotate.json", "b": base / "lab-b-annotate.json", "review": base / "lab-b-review.json"}
    config = base / "chain.yaml"
    config.write_text(f"""output: {root}
steps:
  - annotate export: {{input: {ds}, annotations-per-task: 2, label-studio-url: "{a.url}", project-title: round 1,
                       local-files-root: {docroot}}}
  - annotate ingest: {{input: {ds}, export: {files['a']}, instance: lab-a}}
  - annotate export: {{input: {ds}, annotations-per-task: 2, label-studio-url: "{b.url}", project-title: round 2,
                       local-files-root: {docroot}, resend: true}}
  - annotate ingest: {{input: {ds}, export: {files['b']}, instance: lab-b}}
  - annotate export: {{input: {ds}, queue: review, label-studio-url: "{b.url}", project-title: review,
                       local-files-root: {docroot}}}
  - annotate ingest: {{input: {ds}, export: {files['review']}, instance: lab-b}}
  - report: {{input: [{ds}]}}
""")
    known = oracle.Known()
    out = {"ds": ds, "root": root, "files": files, "runs": [], "checks": [], "states": []}
    instance_of = {str(files["a"]): "lab-a", str(files["b"]): "lab-b", str(files["review"]): "lab-b"}

    def chain():
        proc = subprocess.run([sys.executable, "-m", "jobs.cli", "chain", "--config", str(config)], cwd=base,
                              env=env, capture_output=True, text=True, timeout=1200)
        run = {"code": proc.returncode, "out": proc.stdout, "err": proc.stderr}
        out["runs"].append(run)
        # the oracle reads the exports the run ingested, in the chain's order
        for line in proc.stdout.splitlines():
            if "annotate ingest (" in line and line.startswith("[chain] step "):
                export = line.split(" --export ")[1].split()[0]
                known.ingest(instance_of[export], named(json.loads(Path(export).read_text())))
        out["checks"].append(compare(ds, known))
        out["states"].append({r["pair_id"]: (r["status"], r["reason"].split(":")[0])
                              for r in pq.read_table(ds / "annotation_state").to_pylist()}
                             if (ds / "annotation_state").exists() else {})
        return run

    def save(server, project_title, path):       # the team lead: the project's JSON export
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("LABEL_STUDIO_API_KEY", server.token)
            mp.setenv("LABEL_STUDIO_PYTHON", env["LABEL_STUDIO_PYTHON"])
            pid = next(p["id"] for p in api(server, "/api/projects?page_size=100")["results"] if p["title"] == project_title)
            path.write_text(json.dumps(call("export_json_with_predictions", url=server.url, project_id=pid)))
        return pid

    def tasks_of(server, project_title) -> dict:
        pid = next(p["id"] for p in api(server, "/api/projects?page_size=100")["results"] if p["title"] == project_title)
        return {t["data"]["item_id"]: t for t in api(server, f"/api/tasks?project={pid}&page_size=100")["tasks"]}

    def draw(server, task, who, mask):
        return api(server, f"/api/tasks/{task['id']}/annotations/",
                   {"result": [brush("new", "post", mask)], "completed_by": who, "lead_time": 20.0})

    def user(server, email):
        return api(server, "/api/users/", {"email": email, "username": email.split("@")[0], "first_name": "A",
                                           "last_name": "B"})["id"]

    try:
        out["run1"] = chain()                                       # the export to lab-a; nothing to ingest yet
        admin_a, admin_b = (api(s, "/api/current-user/whoami")["id"] for s in (a, b))
        ann1, ann2 = user(a, "ann1@changeforge.test"), user(b, "ann2@changeforge.test")
        t = tasks_of(a, "round 1")
        draw(a, t["s0"], ann1, rect(5, 25, 5, 25))
        draw(a, t["s0"], admin_a, rect(5, 25, 5, 26))               # agrees
        draw(a, t["s1"], ann1, rect(0, 20, 0, 20))
        draw(a, t["s1"], admin_a, rect(20, 40, 30, 50))             # disagrees
        wrong = draw(a, t["s2"], ann1, rect(0, 20, 30, 50))         # wrong
        draw(a, t["s2"], admin_a, rect(10, 30, 20, 40))
        own = draw(a, t["s3"], ann1, rect(15, 35, 10, 40))          # alone
        save(a, "round 1", files["a"])
        out["run2"] = chain()       # round 1 in; s4, s5 to lab-b; waits for lab-b's export

        api(a, f"/api/annotations/{wrong['id']}/", None, method="DELETE")      # the lead deletes the wrong one
        draw(a, t["s2"], ann1, rect(10, 30, 20, 41))                # ann1 again: agrees now
        api(a, f"/api/annotations/{own['id']}/", {"result": [brush("new", "post", rect(15, 35, 10, 41))]},
            method="PATCH")                                         # the admin corrects s3 in place: a check
        tb = tasks_of(b, "round 2")
        out["b_tasks"] = sorted(tb)
        draw(b, tb["s4"], ann2, rect(0, 20, 0, 30))
        draw(b, tb["s4"], admin_b, rect(0, 20, 0, 30))              # the same person as lab-a's admin
        draw(b, tb["s5"], ann2, rect(20, 40, 20, 40))
        save(a, "round 1", files["a"])
        save(b, "round 2", files["b"])
        out["run3"] = chain()       # both in; s1 still open: the review to lab-b; waits for its answers

        tr = tasks_of(b, "review")
        out["review_tasks"] = sorted(tr)
        out["expert_mask"] = rect(0, 20, 10, 30)
        draw(b, tr["s1"], ann2, out["expert_mask"])                  # ann2: an annotator elsewhere, not of s1
        save(b, "review", files["review"])
        out["run4"] = chain()       # the review in: every pair decided, the report runs
        out["summary"] = json.loads((ds / "annotation_summary.json").read_text())
        out["known"] = known
        return out
    finally:
        for server in (a, b):      # both told to stop first, then each waited for
            if server.proc and server.proc.poll() is None:
                server.proc.terminate()
        a.stop()
        b.stop()


def compare(ds: Path, known: oracle.Known) -> dict:
    """The pipeline's states and masks beside the oracle's, {pair: (got, expected)} for those that differ."""
    if not (ds / "annotation_state").exists():
        return {}
    expected = oracle.decide_everything(known, masks_of, RULES, {})
    got = {r["pair_id"]: r for r in pq.read_table(ds / "annotation_state").to_pylist()}
    diff = {}
    for pid, want in expected.items():
        g = got.get(pid) or {}
        mine = dict(status=g.get("status"), reason=g.get("reason"), annotator=g.get("annotator"),
                    checker=g.get("checker"), expert=g.get("expert"),
                    batch=None if g.get("batch") is None else (g.get("instance") or "", g["batch"]))
        theirs = {k: want[k] for k in mine}
        if mine != theirs:
            diff[pid] = (mine, theirs)
        if want["merged"] is not None and mine["status"] in ("merged", "expert"):
            drawn = cv2.imread(str(ds / "label1" / f"{pid}.png"), cv2.IMREAD_UNCHANGED)
            if drawn is None or not np.array_equal(drawn > 0, masks_of(want["merged"])["new"][1]):
                diff[f"{pid} mask"] = "label1 differs from the oracle's merged drawing"
    return diff


def explain(run: dict) -> str:
    return run["out"][-3000:] + run["err"][-3000:]


def test_every_run_ends_as_the_story_says(history):
    codes = [r["code"] for r in history["runs"]]
    assert codes == [3, 3, 3, 0], [explain(r) for r in history["runs"]]
    assert f"no export at {history['files']['b']} yet" in history["run2"]["out"]
    assert "step 3/7 annotate export" in history["run2"]["out"] and "step 7/7" not in history["run2"]["out"]
    assert f"no export at {history['files']['review']} yet" in history["run3"]["out"]
    assert "step 7/7 report" in history["run4"]["out"]
    assert history["b_tasks"] == ["s4", "s5"] and "s1" in history["review_tasks"]


def test_after_every_run_the_pipeline_agrees_with_the_oracle(history):
    assert history["checks"] == [{}, {}, {}, {}]
    # what they agree on, run by run: round 1 leaves lab-a's batch rejected (its merged pairs held); round 2
    # decides s2 (the wrong drawing deleted) and s3 (checked in place), but s1 keeps the batch rejected;
    # the expert's answer on s1 lets it recover
    after1, after2, after3 = history["states"][1:]
    held = ("disagreement", "batch (project 1 on lab-a) rejected")
    assert after1["s0"] == after1["s3"] == held
    assert after1["s1"][0] == after1["s2"][0] == "disagreement"
    assert after1["s1"][1].startswith("annotator and checker agree at 0.000 < 0.8")
    assert after1["s2"][1].startswith("annotator and checker agree at 0.")
    assert after2["s2"] == after2["s0"] == after2["s3"] == held
    assert (after2["s4"][0], after2["s5"]) == ("merged", ("merged", "one annotation, merged unchecked"))
    assert after3["s1"] == ("expert", "decided by the expert")
    assert {after3[p][0] for p in ("s0", "s2", "s3", "s4", "s5")} == {"merged"}


def test_the_end_is_every_pair_decided_with_the_expert_s_drawing_on_s1(history):
    ds, p = history["ds"], history["summary"]["pairs"]
    assert (p["total"], p["decided"]) == (6, 6), p
    expected = oracle.decide_everything(history["known"], masks_of, RULES, {})
    counts = {}
    for d in expected.values():
        counts[d["status"]] = counts.get(d["status"], 0) + 1
    assert {k: v for k, v in p["by_status"].items() if v} == counts == {"merged": 5, "expert": 1}
    state = {r["pair_id"]: r for r in pq.read_table(ds / "annotation_state").to_pylist()}
    assert state["s1"]["expert"] == "ann2@changeforge.test"
    assert state["s2"]["withdrawn"] == 1 and state["s2"]["status"] == "merged"          # the deletion seen
    assert state["s3"]["checker"] == "reviewer@changeforge.test"                        # the in-place check
    assert state["s4"]["checker"] == "reviewer@changeforge.test" and state["s4"]["instance"] == "lab-b"
    assert np.array_equal(cv2.imread(str(ds / "label1" / "s1.png"), cv2.IMREAD_UNCHANGED) > 0,
                          history["expert_mask"])
