"""operators.chain.people: fingerprints of the people's work and how far they are (pure, quick)."""
from __future__ import annotations

import json

from operators.chain import people
from operators.io.storage import Store


def project(*anns):
    return [{"id": 1, "updated_at": "2026-01-01T00:00:00Z", "annotations": list(anns)}, {"id": 2, "annotations": []}]


def test_a_server_fingerprint_changes_with_every_new_edited_skipped_or_deleted_annotation():
    calls = []

    def call(op, **kw):
        calls.append((op, kw))
        return state

    a = {"id": 5, "updated_at": "2026-01-02T10:00:00Z"}
    state = project(a)
    first = people.fingerprint("http://127.0.0.1:8080", 3, studio_call=call)
    assert calls == [("export_json", {"url": "http://127.0.0.1:8080", "project_id": 3})]
    assert first.startswith("labelstudio:2/1/2026-01-02T10:00:00Z/")
    assert people.fingerprint("http://127.0.0.1:8080", 3, studio_call=call) == first          # same work
    seen = {first}
    for state in (project(dict(a, updated_at="2026-01-03T00:00:00Z")),                         # edited
                  project(a, {"id": 6, "updated_at": "2026-01-01T00:00:00Z", "was_cancelled": True}),  # skipped
                  project({"id": 6, "updated_at": "2026-01-02T10:00:00Z"}),                     # one replaced
                  project()):                                                                   # deleted
        fp = people.fingerprint("http://127.0.0.1:8080", 3, studio_call=call)
        assert fp not in seen
        seen.add(fp)


def test_a_file_fingerprint_is_its_digest_and_a_missing_file_is_missing(tmp_path):
    f = tmp_path / "export.json"
    assert people.fingerprint(str(f), None) == "missing"
    f.write_text("[]")
    one = people.fingerprint(str(f), None)
    f.write_text("[]")
    assert people.fingerprint(str(f), None) == one
    f.write_text("[ ]")
    assert people.fingerprint(str(f), None) != one


def test_progress_and_the_waiting_line(tmp_path):
    store = Store(str(tmp_path))
    assert people.progress(store) is None
    (tmp_path / "annotation_summary.json").write_text(json.dumps({"tasks": 3, "merged": 1}))   # no pair counts
    assert people.progress(store) is None
    (tmp_path / "annotation_summary.json").write_text(json.dumps({"version": 1, "pairs": {
        "total": 43, "decided": 12, "by_status": {"merged": 10, "expert": 1, "unusable": 1, "awaiting_check": 0,
                                                  "disagreement": 2, "unannotated": 29}}}))
    p = people.progress(store)
    assert people.waiting_line(p) == "waiting for annotators: 12 of 43 pairs decided (disagreement 2, unannotated 29)"
    assert people.waiting_line({"total": 4, "decided": 4, "by_status": {}}) is None


def test_the_export_fingerprint_counts_tasks_and_annotations_and_takes_the_latest_stamp():
    from operators.chain.people import export_fingerprint
    import hashlib
    ids = hashlib.sha256(b"5,6").hexdigest()[:12]
    tasks = [{"id": 1, "created_at": "2026-01-05T00:00:00Z",
              "annotations": [{"id": 6, "created_at": "2026-01-04T00:00:00Z"},
                              {"id": 5, "updated_at": "2026-01-02T00:00:00Z", "created_at": "2026-01-09T00:00:00Z"}]},
             {"id": 2, "annotations": None}]
    # updated_at before created_at; the task's own stamp counts too; ids sorted, so the order is not work
    assert export_fingerprint(tasks) == f"labelstudio:2/2/2026-01-05T00:00:00Z/{ids}"
    tasks[0]["annotations"].reverse()
    assert export_fingerprint(tasks) == f"labelstudio:2/2/2026-01-05T00:00:00Z/{ids}"
    empty = hashlib.sha256(b"").hexdigest()[:12]
    assert export_fingerprint([]) == f"labelstudio:0/0/-/{empty}"
    assert export_fingerprint([{"id": 1}]) == f"labelstudio:1/0/-/{empty}"


def test_only_http_and_https_exports_are_servers(tmp_path):
    assert people.is_server("http://127.0.0.1:8080") and people.is_server("https://studio.example/x")
    assert not people.is_server("s3://bucket/export.json") and not people.is_server(str(tmp_path / "http:x"))
    calls = []
    fp = people.fingerprint("https://studio.example", None, studio_call=lambda op, **kw: calls.append(kw) or [])
    assert fp.startswith("labelstudio:0/0/-/") and calls == [{"url": "https://studio.example", "project_id": 0}]


def test_progress_needs_integer_totals_and_the_waiting_line_lists_only_open_statuses(tmp_path):
    store = Store(str(tmp_path))
    for pairs in ({"total": 4}, {"decided": 4}, {"total": "4", "decided": 1}, {"total": 4, "decided": 1.0}):
        (tmp_path / "annotation_summary.json").write_text(json.dumps({"pairs": pairs}))
        assert people.progress(store) is None, pairs
    (tmp_path / "annotation_summary.json").write_text(json.dumps({"pairs": {"total": 5, "decided": 0}}))
    assert people.progress(store) == {"total": 5, "decided": 0, "by_status": {}}
    assert people.waiting_line(people.progress(store), "experts") == "waiting for experts: 0 of 5 pairs decided"
    assert people.waiting_line({"total": 3, "decided": 4, "by_status": {}}) is None
    assert people.waiting_line({"total": 3, "decided": 2, "by_status": {
        "merged": 1, "expert": 0, "unusable": 1, "awaiting_check": 1, "not_exported": 0}}) == \
        "waiting for annotators: 2 of 3 pairs decided (awaiting check 1)"


def test_only_the_annotation_loop_s_steps_run_after_a_waiting_ingest():
    # an export (to either queue) sends work to people and an ingest takes it back; the rest waits
    assert people.runs_while_waiting("annotate export") and people.runs_while_waiting("annotate ingest")
    for step in ("caption", "qa", "validate", "report", "publish", "pairs", "review export", "review ingest",
                 "score change", "annotate status", "annotate", "annotate exports"):
        assert not people.runs_while_waiting(step), step


def test_a_missing_export_is_waited_for_unless_every_pair_is_decided():
    assert people.waits_for_export(None)                               # nothing says how far the people are
    assert people.waits_for_export({"total": 5, "decided": 4, "by_status": {}})
    assert not people.waits_for_export({"total": 5, "decided": 5, "by_status": {}})
    assert not people.waits_for_export({"total": 0, "decided": 0, "by_status": {}})
    # more decided than the pairs counted (a summary whose expert decided pairs a rerun has since
    # dropped) is every pair decided, as waiting_line reads it: no wait
    p = {"total": 5, "decided": 6, "by_status": {}}
    assert not people.waits_for_export(p) and people.waiting_line(p) is None
