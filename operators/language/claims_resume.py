"""Which claims a validate run checks again: resuming by lineage (operators.io.lineage), for the
validate job's ``verdicts/`` table.

Each verdict records what it was checked from: the claim (its text, question and question type, under
the input name ``captions`` for a LEVIR-CC caption, ``qa`` for a QA pair of ``VQA.json``, ``claim`` for
a JSONL line), the mask it was checked against (the digest of its binary pixels, or an ``unreadable``
marker with the file and the reason), the rules' settings (``rules``), and the mask's stamp. A claim is
checked again when one of them changed; a mask whose stamp did not move is not read again. A claim whose
mask cannot be read today is neither current nor stale: it is failed, named with the file and the
reason, and is not checked again on every run (issue 44). A mask that became unreadable since its
verdict is a changed mask once: the claim is checked again, its verdict says why it has none, and
records it.
"""
from __future__ import annotations

import posixpath
from typing import Any, Callable, Iterable, Mapping

from operators.io import lineage

KINDS = ("captions", "qa", "claim")   # a claim's input name: its change is reported as caption, QA, claim


def claim_kind(claim: Mapping[str, Any]) -> str:
    kind = claim.get("kind") or "claim"
    return kind if kind in KINDS else "claim"


def claim_digest(claim: Mapping[str, Any]) -> str:
    """Of what a verdict judges: the claim's text, question and question type."""
    return lineage.value_digest([str(claim.get("text") or "").strip(), claim.get("question"), claim.get("type")])


def row_lineage(claim: Mapping[str, Any], used: str, mask: str, stamp: str | None, rules: str) -> dict:
    """The lineage a verdict row records: the claim, the mask used (``used``: its URI; ``mask``: its
    digest or :func:`operators.io.lineage.unreadable`), the rules' digest and the mask's stamp."""
    return {claim_kind(claim): claim_digest(claim), "mask": mask, "rules": rules, "mask_uri": used,
            lineage.STAMPS: {"mask": stamp} if stamp else {}}


def dirs_of(uris: Iterable[str]) -> list[str]:
    """The folders to list (once each) for the stamps of ``uris``."""
    return sorted({posixpath.dirname(u) for u in uris if u})


def today(claim: Mapping[str, Any], recorded: Mapping[str, Any], stamps: Mapping[str, str],
          digest_of: Callable[[str], str], rules: str) -> dict:
    """A claim's lineage today. The mask is the one its verdict used when that file is still listed with
    the recorded stamp (the recorded digest, the file not read); else the first of the claim's candidate
    masks that is listed, read now (``digest_of(uri)``); none listed: unreadable (no such file)."""
    used = recorded.get("mask_uri")
    stamp = (recorded.get(lineage.STAMPS) or {}).get("mask")
    if used and stamp and stamps.get(used) == stamp and recorded.get("mask"):
        mask = recorded["mask"]
    else:
        found = next((u for u in claim["masks"] if u in stamps), None)
        mask = digest_of(found) if found else lineage.unreadable(claim["masks"][0] if claim["masks"] else "",
                                                                 "no such file")
    return {claim_kind(claim): claim_digest(claim), "mask": mask, "rules": rules}


def plan(claims: list[dict], recorded: Mapping[str, dict | None], stamps: Mapping[str, str],
         digest_of: Callable[[str], str], rules: str) -> lineage.ResumePlan:
    """Claims split into current, stale (by cause: caption, QA, claim, mask, options), missing and
    unreadable (:func:`operators.io.lineage.plan_resume`, keyed by claim id). A verdict recorded without
    lineage (an output made before it was kept) is checked again: the rules are cheap."""
    def now(claim: dict, rec: Mapping) -> dict:   # which file was used is no input: its digest is
        return {**today(claim, rec, stamps, digest_of, rules), "mask_uri": rec.get("mask_uri")}

    result = lineage.plan_resume(claims, recorded, now, key="id")
    by_id = {c["id"]: c for c in claims}
    # A mask that became unreadable since its verdict: checked once more, so that the verdict says so
    # (ok null, the file and the reason) and records it; from then on the claim is unreadable, not redone.
    for k in [k for k in result.unreadable if not str((recorded[k] or {}).get("mask", "")).startswith(
            lineage.UNREADABLE)]:
        del result.unreadable[k]
        result.stale[k] = ["mask"]
        result.todo.append(by_id[k])
    result.todo += [by_id[k] for k in result.unrecorded]
    return result
