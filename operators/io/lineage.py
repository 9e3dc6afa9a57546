"""Lineage: what a derived row was made from, as content digests, and whether it is still current.

Every row the language jobs write (``pairs/``, ``captions/``, ``qa/``) carries a ``lineage`` column: a
JSON object of input name -> digest, e.g. ::

    {"A": "<sha256 of the A file>", "B": "...", "mask": "<digest of the binary mask's pixels>",
     "captions": "<digest of the caption set a QA pair was grounded in>",
     "generate_template": "...", "judge_template": "...", "model": "gpt-4.1-mini", "judge_model": "...",
     "options": "<digest of the settings that change a result>", "stamps": {"A": "<size:mtime or ETag>", ...}}

A job resumes by it: an item is skipped only when its recorded digests equal today's; otherwise it is
redone and its new rows supersede the old ones (tables keep the history). Why a small table of our own
rather than DVC, Dagster or Bazel: the unit of staleness here is one *row* (one pair's captions), inside
one Parquet table on object storage written by Ray workers; DVC tracks whole files or folders per stage,
Dagster's data versions are per asset (partition), and Bazel's action keys need its sandbox. The idea is
theirs (content-addressed inputs, staleness as "an input's version changed"), the bookkeeping is a column.

Digests are computed where the files are read anyway (the job's prepare step). To tell today's digest
without reading every file again, the row also records each file's *stamp* (size and modification time,
or the object's ETag on S3), as git's index and DVC's state do: an unchanged stamp means an unchanged
file; a changed stamp means the file is read and digested again (a touched, unchanged file is current).

The mask digest is of the binary mask's pixels (any non-zero value is change), not its file: a mask
re-encoded (another PNG compression, 0/1 saved as 0/255) is the same mask, and a release, which may
re-encode masks, can be checked against it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import numpy as np

COLUMN = "lineage"
STAMPS = "stamps"
# input name -> the cause a change of it is reported as
CAUSES = {"A": "image", "B": "image", "mask": "mask", "captions": "caption",
          "generate_template": "template", "judge_template": "template",
          "model": "model", "judge_model": "model", "options": "options",
          "qa": "QA", "rules": "options",   # the validate job's claims (operators.language.claims_resume)
          "prediction": "prediction", "pred_mask": "prediction", "reference": "QA",   # the score job's rows
          "review": "review", "pairs": "pairs"}   # the report's pairs (operators.report.made_from)
REMOVED = "removed"   # the cause of an item recorded but no longer in today's inputs
FILE_INPUTS = ("A", "B", "mask")   # read from the dataset; the rest are the job's settings
# The prefix of a "digest" that is none: the file could not be read today (``unreadable(rel, reason)``).
# It tells nothing about what changed, so the item is neither current nor stale: it is reported, with
# the file and the reason, and counted as failed; redoing it would fail the same way on every run.
UNREADABLE = "unreadable: "


def bytes_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def mask_digest(mask: np.ndarray) -> str:
    """Digest of a change mask's pixels: change is any non-zero value in any channel."""
    m = np.asarray(mask)
    if m.ndim not in (2, 3):
        raise ValueError(f"a mask has 2 dimensions (or 3, with channels), not {m.ndim}")
    if m.ndim == 3:
        m = m.max(axis=2)
    m = m != 0
    head = f"mask:{m.shape[0]}x{m.shape[1]}:".encode()
    return hashlib.sha256(head + np.packbits(m, axis=None).tobytes()).hexdigest()


def value_digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def template_digest(template: Any) -> str:
    """Of a prompt template's content (a dataclass): its text, not only its file name."""
    return value_digest(dataclasses.asdict(template) if dataclasses.is_dataclass(template) else template)


def caption_set_digest(captions: Iterable[str]) -> str:
    """Of the captions a pair ships (order and surrounding spaces aside)."""
    return value_digest(sorted(str(c).strip() for c in captions))


def unreadable(rel: str, reason: str) -> str:
    """The digest text of a file that cannot be read today: ``unreadable: <rel>: <reason>``."""
    return f"{UNREADABLE}{rel}: {' '.join(str(reason).split())}"[:300]


def unreadable_inputs(today: Mapping[str, Any]) -> list[str]:
    """The ``<rel>: <reason>`` of each input of ``today`` that could not be read."""
    return [str(v)[len(UNREADABLE):] for k, v in sorted(today.items())
            if k != STAMPS and isinstance(v, str) and v.startswith(UNREADABLE)]


def dumps(lineage: Mapping[str, Any]) -> str:
    return json.dumps(dict(lineage), sort_keys=True)


def loads(text: str | None) -> dict | None:
    """A row's lineage; None for a row without one (made before lineage was kept: null or NaN)."""
    if not isinstance(text, str) or not text:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def changed_inputs(recorded: Mapping[str, Any], today: Mapping[str, Any]) -> list[str]:
    """Input names whose digest differs between ``recorded`` and ``today`` (stamps aside). An input
    today has that the row did not record is a change too (a row made without captions, now with)."""
    names = set(recorded) | set(today)
    names.discard(STAMPS)
    return sorted(n for n in names if recorded.get(n) != today.get(n))


def causes(recorded: Mapping[str, Any], today: Mapping[str, Any]) -> list[str]:
    """The causes (mask, image, caption, template, model, options) of the changed inputs."""
    return sorted({CAUSES.get(n, n) for n in changed_inputs(recorded, today)})


# -- resuming by lineage -----------------------------------------------------------------------------
@dataclass
class ResumePlan:
    """Which items a run does: the missing ones and the stale ones; the rest are current."""
    todo: list[dict] = field(default_factory=list)
    current: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    stale: dict[str, list[str]] = field(default_factory=dict)     # item -> causes
    unrecorded: list[str] = field(default_factory=list)           # finished before lineage was recorded
    unreadable: dict[str, str] = field(default_factory=dict)      # item -> "<file>: <reason>" (cannot tell)

    def stale_by_cause(self) -> Counter:
        return Counter(c for cs in self.stale.values() for c in cs)

    def counts(self) -> dict:
        return {"current": len(self.current), "stale": len(self.stale), "missing": len(self.missing),
                "unrecorded": len(self.unrecorded), "unreadable": len(self.unreadable), "stale_by_cause": dict(sorted(self.stale_by_cause().items()))}


def plan_resume(items: Iterable[dict], recorded: Mapping[str, dict | None], today: Callable[[dict, dict], dict],
                key: str = "pair_id") -> ResumePlan:
    """Split ``items`` by their finished rows' ``recorded`` lineage (item key -> lineage, None for a row
    written before lineage existed). ``today(item, recorded)`` gives an item's lineage now (it may reuse
    the recorded digests of files whose stamps did not change). A row without lineage is kept as
    current, counted apart: nothing says what it was made from, and redoing it would pay again. A finished
    item one of whose files cannot be read today (:func:`unreadable`) is neither: it is ``unreadable``,
    not redone (it would fail the same way each run, and a chain would run its step each time)."""
    plan = ResumePlan()
    for item in items:
        k = item[key]
        if k not in recorded:
            plan.missing.append(k)
            plan.todo.append(item)
            continue
        rec = recorded[k]
        if rec is None:
            plan.unrecorded.append(k)
            continue
        now = today(item, rec)
        cannot = unreadable_inputs(now)
        if cannot:
            plan.unreadable[k] = "; ".join(cannot)
            continue
        why = causes(rec, now)
        if why:
            plan.stale[k] = why
            plan.todo.append(item)
        else:
            plan.current.append(k)
    return plan


def status(plan: ResumePlan, failed: Iterable[str] = ()) -> dict:
    """What a step would do, without doing it: ``current``, ``stale`` (by cause), ``missing`` (never
    attempted), ``failed`` (missing, with a current error: a rerun tries them, but they do not make a
    chain step run again by themselves; items whose files cannot be read today count here too, named with
    the file and the reason in ``unreadable_first``), ``unrecorded``; ``needs_run`` when anything is stale
    or missing."""
    failed = set(failed)
    missing = [k for k in plan.missing if k not in failed]
    cannot = sorted(plan.unreadable)
    return {"current": len(plan.current), "stale": len(plan.stale),
            "stale_by_cause": dict(sorted(plan.stale_by_cause().items())),
            "stale_first": sorted(plan.stale)[:5], "missing": len(missing), "missing_first": sorted(missing)[:5],
            "failed": len(plan.missing) - len(missing) + len(cannot), "unrecorded": len(plan.unrecorded),
            "unreadable": len(cannot), "unreadable_first": [f"{k}: {plan.unreadable[k]}" for k in cannot[:3]],
            "needs_run": bool(plan.stale or missing)}


def keyed_status(recorded: Mapping[str, dict | None], today: Mapping[str, dict], failed: Iterable[str] = ()) -> dict:
    """:func:`status` of a step whose outputs are recomputed as a whole (scores, a report): ``recorded``
    (item -> the lineage its output row records; None: made before lineage was kept), ``today`` (item ->
    its lineage from today's inputs). An item recorded but no longer in today's inputs is stale (cause
    ``removed``): the output still counts it. Items whose input cannot be read today are unreadable."""
    plan = plan_resume([{"key": k} for k in sorted(today)], recorded, lambda item, rec: today[item["key"]], key="key")
    for k in sorted(set(recorded) - set(today)):
        plan.stale[k] = [REMOVED]
    return status(plan, failed)


def status_line(s: Mapping[str, Any]) -> str:
    """"9 current, 2 stale (mask 2: a, b), 0 missing, 1 failed"; items whose files cannot be read are named
    with the file and the reason: "1 failed (1 unreadable: p: label/p.png: not an image)"."""
    causes_ = ", ".join(f"{c} {n}" for c, n in s["stale_by_cause"].items())
    stale = f"{s['stale']} stale" + (f" ({causes_}: {', '.join(s['stale_first'])})" if s["stale"] else "")
    missing = f"{s['missing']} missing" + (f" ({', '.join(s['missing_first'])})" if s["missing"] else "")
    extra = f", {s['unrecorded']} without lineage" if s["unrecorded"] else ""
    cannot = (f" ({s['unreadable']} unreadable: {'; '.join(s.get('unreadable_first') or [])})"
              if s.get("unreadable") else "")
    return f"{s['current']} current, {stale}, {missing}, {s['failed']} failed{cannot}{extra}"


def redo_line(plan: ResumePlan) -> str:
    """"3 redone because their input changed: mask 2, template 1" (empty when none)."""
    by = plan.stale_by_cause()
    if not plan.stale:
        return ""
    return (f"{len(plan.stale)} redone because their input changed: "
            + ", ".join(f"{cause} {n}" for cause, n in sorted(by.items())))


def unreadable_line(plan: ResumePlan, what: str = "pair(s) not redone") -> str:
    """"1 pair(s) not redone, a file cannot be read: p: label/p.png: not a readable image" (empty when none):
    one line per run, however often the run is repeated it says the same and redoes nothing."""
    if not plan.unreadable:
        return ""
    first = "; ".join(f"{k}: {plan.unreadable[k]}" for k in sorted(plan.unreadable)[:3])
    return f"{len(plan.unreadable)} {what}, a file cannot be read: {first}"


FILE_KEYS = (("A", "a"), ("B", "b"), ("mask", "label"))   # role -> the item's key prefix (a_rel, a_stamp)


def moved_files(item: Mapping[str, Any], recorded: Mapping[str, Any] | None) -> list[tuple[str, str]]:
    """``(role, rel)`` of the item's files whose stamp is not the one recorded with a digest: the
    files to read again today (every file, for an item recorded without them)."""
    recorded = recorded or {}
    stamps = recorded.get(STAMPS) or {}
    return [(role, item[f"{k}_rel"]) for role, k in FILE_KEYS if item.get(f"{k}_rel")
            and not (item.get(f"{k}_stamp") and stamps.get(role) == item[f"{k}_stamp"] and recorded.get(role))]


def file_lineage(item: Mapping[str, Any], recorded: Mapping[str, Any] | None,
                 digest_of: Callable[[str, str], str]) -> dict:
    """Today's digests of an item's files (``A``, ``B``, ``mask``): the recorded digest where the file's
    stamp (``<role>_stamp`` in the item) equals the recorded one, else ``digest_of(role, rel)`` (the file
    read now). An item with no file for a role has no digest for it."""
    moved = dict(moved_files(item, recorded))
    return {role: digest_of(role, moved[role]) if role in moved else (recorded or {})[role]
            for role, k in FILE_KEYS if item.get(f"{k}_rel")}


def item_stamps(item: Mapping[str, Any]) -> dict:
    """The stamps an item's files had when the driver listed them (recorded with the row)."""
    return {role: item[f"{k}_stamp"] for role, k in FILE_KEYS if item.get(f"{k}_stamp")}
