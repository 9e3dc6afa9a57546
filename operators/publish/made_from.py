"""Releases that cannot lie: a caption or QA pair ships only with the mask, images and captions it was
made from (operators.io.lineage), and a finished release can be checked again.

``release.json`` records per pair ``sources`` (the source images' bytes and the released mask's pixels,
as digests) and ``made_from`` (what the captions and the QA pairs were made from, copied from their rows'
lineage). :func:`mismatches` is the rule publish applies before a release is kept; :func:`verify` applies
it again to a finished release, with its checksums and, where they can still be read, its sources.
"""
from __future__ import annotations

import json
import posixpath
from typing import Any, Mapping

import cv2
import numpy as np

from operators.io import lineage
from operators.io.storage import Store

# cause -> what it means, one line each in a refusal
CAPTION_MASK = "captions made from another mask than the one released"
CAPTION_IMAGES = "captions made from other images than the ones released"
QA_MASK = "QA pairs made from another mask than the one released"
QA_IMAGES = "QA pairs made from other images than the ones released"
QA_CAPTIONS = "QA pairs grounded in other captions than the ones released"
SOURCE_KIND = {"A": "images", "B": "images", "mask": "mask"}
UNRECORDED = "captions or QA pairs that record nothing of what they were made from (made before lineage was kept)"


def made_from(captions: Mapping | None, qa: Mapping | None) -> dict:
    """What a pair's language was made from, for ``release.json`` (stamps left out: local facts)."""
    out = {}
    for name, entry in (("captions", captions), ("qa", qa)):
        rec = (entry or {}).get("lineage")
        if rec:
            out[name] = {k: v for k, v in rec.items() if k in (*lineage.FILE_INPUTS, "captions")}
    return out


def mismatches(sources: Mapping[str, str], captions: list[str] | None, made: Mapping[str, Mapping]) -> list[str]:
    """The causes for which a pair's language was not made from what the release ships with it:
    ``sources`` (A, B and mask digests of the released pair), ``captions`` (the captions shipped, None
    when the release has none), ``made`` (:func:`made_from`)."""
    out = []
    cap, qa = made.get("captions"), made.get("qa")
    if cap:
        if cap.get("mask") != sources.get("mask"):
            out.append(CAPTION_MASK)
        if any(cap.get(r) != sources.get(r) for r in ("A", "B")):
            out.append(CAPTION_IMAGES)
    if qa:
        if qa.get("mask") != sources.get("mask"):
            out.append(QA_MASK)
        if any(qa.get(r) != sources.get(r) for r in ("A", "B")):
            out.append(QA_IMAGES)
        if captions is not None and qa.get("captions") and qa["captions"] != lineage.caption_set_digest(captions):
            out.append(QA_CAPTIONS)
    return out


def problem_lines(problems: Mapping[str, list[str]], first: int = 3) -> list[str]:
    """One line per cause: the count and the first items."""
    return [f"{cause}: {len(items)} pair(s) (first: {', '.join(sorted(items)[:first])})"
            for cause, items in sorted(problems.items()) if items]


def _mask_digest(data: bytes) -> str | None:
    from operators.publish.masks import binary_mask
    img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)
    return None if img is None else lineage.mask_digest(binary_mask(img))


def verify(release: Store, check_sources: bool = True, dataset: str | None = None) -> tuple[list[str], dict[str, Any]]:
    """(problem lines, counts) of a finished release: every file of ``SHA256SUMS`` present and equal, no
    file beyond them; every pair's released mask the one ``release.json`` records, its captions and QA
    made from that mask, those images and the captions released with them; and, when
    ``check_sources`` and the dataset (``dataset``, else the one ``release.json`` names) can be read from
    here, the sources unchanged since the release."""
    from operators.publish.versions import parse_sha256sums, sha256
    problems: dict[str, list[str]] = {}

    def add(cause: str, item: str) -> None:
        problems.setdefault(cause, []).append(item)

    if not release.exists("SHA256SUMS") or not release.exists("release.json"):
        return [f"{release.uri()}: not a finished release (no SHA256SUMS or release.json)"], {}
    sums = parse_sha256sums(release.read_bytes("SHA256SUMS").decode())
    present = set(release.list())
    for rel, digest in sums.items():
        if rel not in present:
            add("files listed in SHA256SUMS but missing", rel)
        elif sha256(release.read_bytes(rel)) != digest:
            add("files whose SHA-256 differs from SHA256SUMS", rel)
    for rel in sorted(present - set(sums) - {"SHA256SUMS"}):
        add("files not listed in SHA256SUMS", rel)
    doc = json.loads(release.read_bytes("release.json"))
    shipped_captions: dict[str, list[str]] = {}
    for split in ("train", "val", "test"):
        if release.exists(f"{split}/captions.json"):
            for img in json.loads(release.read_bytes(f"{split}/captions.json")).get("images", []):
                shipped_captions[posixpath.splitext(str(img["filename"]))[0]] = [
                    s.get("raw", "") for s in img.get("sentences", [])]
    has_captions = bool(doc.get("inputs", {}).get("captions"))
    dataset = dataset or (doc.get("inputs", {}).get("dataset") or {}).get("uri")
    src = Store(dataset) if check_sources and dataset else None
    note = "--no-sources" if not check_sources else f"dataset {dataset!r} not found here: give --sources"
    if src is not None and not src.list("", recursive=False) and not src.exists(""):
        src = None
    for pid, entry in (doc.get("pairs") or {}).items():
        recorded = entry.get("sources") or {}
        label = f"{entry['split']}/label/{pid}.png"
        released = dict(recorded)
        if release.exists(label):
            released["mask"] = _mask_digest(release.read_bytes(label))
            if recorded.get("mask") and released["mask"] != recorded["mask"]:
                add("released masks that are not the mask release.json records", pid)
        captions = shipped_captions.get(pid, []) if has_captions else None
        for cause in mismatches(released, captions, entry.get("made_from") or {}):
            add(cause, pid)
    changed = changed_sources(doc, src) if src is not None else {}
    for pid, kinds in changed.items():
        for kind in sorted(kinds):
            add(f"sources changed since the release ({kind})", pid)
    sources_checked = sum(1 for e in (doc.get("pairs") or {}).values() if e.get("source_files")) if src else 0
    counts = {"files": len(sums), "pairs": len(doc.get("pairs") or {}), "sources_checked": sources_checked,
              "sources_note": note}
    return problem_lines(problems), counts


def changed_sources(doc: Mapping, src: Store) -> dict[str, set[str]]:
    """pair id -> what changed in its sources since the release (``images``, ``mask``), read from ``src``
    (a file gone is a change); pairs whose release recorded no source files are left out."""
    out: dict[str, set[str]] = {}
    for pid, entry in (doc.get("pairs") or {}).items():
        recorded = entry.get("sources") or {}
        for role, d in _source_digests(src, entry.get("source_files") or {}).items():
            if recorded.get(role) and d != recorded[role]:
                out.setdefault(pid, set()).add(SOURCE_KIND[role])
    return out


def release_status(release: Store, dataset: str, today: set[str]) -> dict:
    """A finished release against today's dataset, in the shape of :func:`operators.io.lineage.status`
    (``changeforge chain --explain``): its pairs current or stale (by what changed: mask, images), the
    dataset's pairs in no release ``missing`` (``today``: their ids) unless the release excluded them
    (``failed``: excluded.json), pairs released without their source files ``unrecorded``. Reads only; ``needs_run`` stays False (a new release is a new version, asked for)."""
    doc = json.loads(release.read_bytes("release.json"))
    pairs = doc.get("pairs") or {}
    changed = changed_sources(doc, Store(dataset))
    unrecorded = [p for p, e in pairs.items() if not e.get("source_files")]
    by_cause: dict[str, int] = {}
    for kinds in changed.values():
        for kind in kinds:
            by_cause[kind] = by_cause.get(kind, 0) + 1
    excluded = {str(e.get("item") or e.get("pair_id")) for e in (json.loads(release.read_bytes("excluded.json"))
                                                if release.exists("excluded.json") else [])}
    missing = sorted(today - set(pairs) - excluded)
    return {"current": len(pairs) - len(changed) - len(unrecorded), "stale": len(changed),
            "stale_by_cause": dict(sorted(by_cause.items())), "stale_first": sorted(changed)[:5],
            "missing": len(missing), "missing_first": missing[:5], "failed": len(today & excluded),
            "unrecorded": len(unrecorded), "needs_run": False}


def _source_digests(src: Store, files: Mapping[str, str]) -> dict[str, str]:
    """Today's digests of a pair's source files (a file gone is ``missing``: a change)."""
    out = {}
    for role, rel in files.items():
        try:
            data = src.read_bytes(rel)
        except OSError:
            out[role] = "missing"
            continue
        out[role] = _mask_digest(data) if role == "mask" else lineage.bytes_digest(data)
    return out
