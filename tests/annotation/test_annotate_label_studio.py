"""The roles through a real Label Studio on 127.0.0.1, on 1024 px pairs (the paper's crops): export into
a project taking two annotations per task; an annotator and a checker draw through the REST API as their
browsers do (agreeing, disagreeing, one marks a pair unusable, one skips); ingest from the server; the
review queue into a second project carrying both drawings; the expert resolves the disagreement there;
ingest of that project; the first project ingested again changes nothing."""
from __future__ import annotations

import hashlib
import json

import cv2
import numpy as np
import pytest

from jobs.annotate import ExportConfig, IngestConfig, StatusConfig, main, run_export, run_ingest, run_status
from operators.annotation.brush_rle import decode_mask
from tests.annotation import drawing
from tests.annotation.drawing import brush
from tests.review.test_review_label_studio import api

pytestmark = [pytest.mark.slow, pytest.mark.labelstudio, pytest.mark.timeout(900)]
N = 1024
IDS = ("p0", "p1", "p2", "p3", "p4")


def rect(y0, y1, x0, x1):
    return drawing.rect((N, N), y0, y1, x0, x1)


def digest(root):
    return {str(p.relative_to(root)): hashlib.sha1(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture()
def server(label_studio, tmp_path, monkeypatch):
    """The session's Label Studio (tests/conftest.py; one start per test process, shared with the chain and
    review tests), with this test's pairs in a folder of its own under its document root: its projects
    (titles from that folder's name), users and tasks are its own."""
    root = label_studio.document_root / f"annotate-{tmp_path.name}"
    rng = np.random.default_rng(5)
    for sid in IDS:
        for folder in ("A", "B"):
            (root / "ds" / folder).mkdir(parents=True, exist_ok=True)
            cv2.imwrite(str(root / "ds" / folder / f"{sid}.png"), rng.integers(0, 255, (N, N, 3), dtype=np.uint8))
    monkeypatch.setenv("LABEL_STUDIO_API_KEY", label_studio.token)
    return label_studio, root / "ds"


def test_annotator_checker_expert_through_label_studio(server, tmp_path, capsys):
    srv, ds = server
    s = run_export(ExportConfig(input=str(ds), output=str(tmp_path / "r1"), annotations_per_task=2,
                                label_studio_url=srv.url, classes="new:post,demolished:pre"))
    pid = s["label_studio"]["project_id"]
    tasks = {t["data"]["item_id"]: t for t in api(srv, f"/api/tasks?project={pid}&page_size=100")["tasks"]}
    assert sorted(tasks) == list(IDS)
    annotator = api(srv, "/api/current-user/whoami")["id"]
    checker = api(srv, "/api/users/", {"email": "checker@changeforge.test", "username": "checker",
                                       "first_name": "C", "last_name": "C"})["id"]

    def annotate(item, who, result, **extra):
        api(srv, f"/api/tasks/{tasks[item]['id']}/annotations/", {"result": result, "completed_by": who,
                                                                   "lead_time": 42.0, **extra})
    building = rect(100, 400, 200, 520)
    annotate("p0", annotator, [brush("new", "post", building)])
    annotate("p0", checker, [brush("new", "post", rect(101, 401, 200, 521))])       # a pixel off: agrees
    annotate("p1", annotator, [brush("new", "post", rect(0, 300, 0, 300))])
    annotate("p1", checker, [brush("new", "post", rect(0, 300, 90, 390))])           # disagrees (F1 0.71)
    annotate("p2", annotator, [{"type": "choices", "from_name": "quality", "to_name": "post",
                                "value": {"choices": ["unusable", "cloud"]}}])
    annotate("p3", annotator, [], was_cancelled=True)                                  # skipped
    s1 = run_ingest(IngestConfig(input=str(ds), export=srv.url, project_id=pid))
    by = s1["pairs"]["by_status"]
    assert (by["merged"], by["disagreement"], by["unusable"], by["unannotated"]) == (1, 1, 1, 2)
    assert np.array_equal(cv2.imread(str(ds / "label1" / "p0.png"), 0) > 0, rect(101, 401, 200, 521))   # the checker's
    assert s1["annotations"]["skipped"] == 1 and s1["excluded"][0]["reason"] == "cloud, unusable"
    # people by email, as the server names them (its JSON export gives bare user ids)
    assert "checker@changeforge.test" in {r["annotator"] for r in s1["per_annotator"]}

    # The review queue: a project of its own, p1 with both drawings as predictions.
    r = run_export(ExportConfig(input=str(ds), output=str(tmp_path / "review"), queue="review",
                                label_studio_url=srv.url))
    rid = r["label_studio"]["project_id"]
    assert rid != pid and r["tasks"] == 1
    (task,) = api(srv, f"/api/tasks?project={rid}&page_size=100")["tasks"]
    assert task["data"]["item_id"] == "p1" and task["total_predictions"] == 2
    # The expert is a third person: one of the pair's annotators answering its review task decides nothing.
    expert = api(srv, "/api/users/", {"email": "expert@changeforge.test", "username": "expert",
                                      "first_name": "E", "last_name": "E"})["id"]
    api(srv, f"/api/tasks/{task['id']}/annotations/", {"result": [brush("new", "post", rect(0, 300, 100, 400))],
                                                        "completed_by": expert, "lead_time": 60.0})
    s2 = run_ingest(IngestConfig(input=str(ds), export=srv.url, project_id=rid, experts="expert@changeforge.test"))
    assert s2["pairs"]["by_status"]["expert"] == 1 and s2["annotations"]["experts"] == 1
    assert np.array_equal(cv2.imread(str(ds / "label1" / "p1.png"), 0) > 0, rect(0, 300, 100, 400))
    assert decode_mask(json.loads((tmp_path / "review" / "tasks.json").read_text())[0]["predictions"][1]["result"][0]
                       ["value"]["rle"], N, N).sum() == 300 * 300

    # The first project again: not a byte changes. The unusable pair is never exported again.
    before = digest(ds)
    run_ingest(IngestConfig(input=str(ds), export=srv.url, project_id=pid, experts="expert@changeforge.test"))
    assert digest(ds) == before
    again = run_export(ExportConfig(input=str(ds), output=str(tmp_path / "r2"), resend=True))   # p3, p4: still open
    assert sorted(t["data"]["item_id"] for t in json.loads((tmp_path / "r2" / "tasks.json").read_text())) == ["p3", "p4"]
    assert again["left_out"] == {"decided": 2, "unusable": 1}
    assert run_status(StatusConfig(input=str(ds)))["pairs"]["decided"] == 3
    assert main(["status", "--input", str(ds)]) == 0
    print(capsys.readouterr().out)  # noqa: T201 - the status a team lead reads (pytest -s)
