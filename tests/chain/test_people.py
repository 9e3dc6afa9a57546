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
