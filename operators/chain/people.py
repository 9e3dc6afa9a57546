"""The human steps of the chain: what their input is (an export file, or a Label Studio project) and a
fingerprint of it, so a step re-runs when the people's work changed; and how far the people are, read
from the dataset's ``annotation_summary.json`` after an ingest.

A fingerprint is ``sha256:<hex>`` of a file's bytes, or for a Label Studio server
``labelstudio:<tasks>/<annotations>/<latest updated_at>`` of the project (its tasks and annotations as
exported through the Label Studio client, cancelled ones counted too: a skip is work done).
"""
from __future__ import annotations

import hashlib

from operators.io.storage import Store, read_uri
from operators.report.annotation import read_summary

# step -> the option naming its human input (an export file or a server URL)
HUMAN_STEPS = {"annotate ingest": "export", "review ingest": "export"}
MISSING = "missing"
# The annotation loop's own steps: they send work to people (an export, to either queue) or take it back
# (an ingest). After an ingest that leaves pairs undecided, these still run (the expert's review queue is
# exported and its answers ingested); the chain waits at the first other step.
ANNOTATION_LOOP = ("annotate export", "annotate ingest")


def file_fingerprint(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def export_fingerprint(tasks: list[dict]) -> str:
    """Counts and the latest ``updated_at`` of an exported project: any new, edited, skipped or deleted
    annotation changes one of them."""
    anns = [a for t in tasks for a in (t.get("annotations") or [])]
    stamps = [str(x.get("updated_at") or x.get("created_at") or "") for x in [*tasks, *anns]]
    latest = max(stamps, default="")
    ids = hashlib.sha256(",".join(sorted(str(a.get("id")) for a in anns)).encode()).hexdigest()[:12]
    return f"labelstudio:{len(tasks)}/{len(anns)}/{latest or '-'}/{ids}"


def is_server(export: str) -> bool:
    return str(export).startswith(("http://", "https://"))


def fingerprint(export: str, project_id: int | None, studio_call=None) -> str:
    """The fingerprint of a human step's input (see the module docstring). A missing file is
    :data:`MISSING`: the chain then waits for the people (the export has not arrived).
    ``studio_call``: the Label Studio client's ``call`` (injected; imported when None)."""
    if is_server(export):
        if studio_call is None:
            from operators.labelstudio.client import call as studio_call
        return export_fingerprint(studio_call("export_json", url=export, project_id=int(project_id or 0)))
    try:
        return file_fingerprint(read_uri(export))
    except FileNotFoundError:
        return MISSING


def progress(dataset: Store) -> dict | None:
    """``{"total", "decided", "by_status"}`` of the pairs from the dataset's ``annotation_summary.json``
    (None when it has none or one without pair counts)."""
    pairs = (read_summary(dataset) or {}).get("pairs") or {}
    if not isinstance(pairs.get("total"), int) or not isinstance(pairs.get("decided"), int):
        return None
    return {"total": pairs["total"], "decided": pairs["decided"], "by_status": dict(pairs.get("by_status") or {})}


def runs_while_waiting(step: str) -> bool:
    """Whether ``step`` runs after an annotate ingest that left pairs undecided (see :data:`ANNOTATION_LOOP`)."""
    return step in ANNOTATION_LOOP


def waits_for_export(p: dict | None) -> bool:
    """Whether an annotate ingest whose export has not arrived waits for it, given the dataset's progress
    ``p`` (:func:`progress`): unless every pair is decided already (an expert's review export with no
    disagreement in it never comes), or when nothing says how far the people are."""
    return p is None or p["decided"] < p["total"]


def waiting_line(p: dict, who: str = "annotators") -> str | None:
    """"waiting for annotators: 12 of 43 pairs decided (…)", or None when every pair is decided."""
    if p["decided"] >= p["total"]:
        return None
    open_ = {k: v for k, v in p["by_status"].items() if v and k not in ("merged", "expert", "unusable")}
    parts = [f"{k.replace('_', ' ')} {v}" for k, v in open_.items()]
    detail = f" ({', '.join(parts)})" if parts else ""
    return f"waiting for {who}: {p['decided']} of {p['total']} pairs decided{detail}"
