"""Audit captions or answers of any dataset against their change masks with the grounded validators.

    python -m jobs.validate --input <claims.jsonl | LEVIR-CC JSON> [--masks <label folder>] --output <folder>

A JSONL line is ``{"id": "...", "mask": "<path or s3:// URI of a mask PNG>", "text": "<caption or
answer>", "question": "<optional>", "type": "<optional question type>"}`` (a relative mask path is
relative to --masks, else to the JSONL file's folder). A LEVIR-CC JSON (``images[]`` with
``filename``, ``filepath`` and ``sentences[].raw``) or the QA job's ``VQA.json`` (``images[].qa[]``
with ``type``, ``question``, ``answer``) finds its masks under ``--masks``, by default the dataset
named by the ``source.json`` beside it (the captions and QA jobs write one): each image's mask is
looked up as ``<masks>/<filename>``, ``<masks>/label/<filename>``, ``<masks>/<filepath>/<filename>``
or ``<masks>/<filepath>/label/<filename>``; every sentence is one claim with id
``<filename>#<sentid>``, every answer one with id ``<filename>#qa<index>`` (its question and type
given to the rules).

Outputs: ``verdicts.jsonl`` (``{"id", "ok", "violations": [{"rule", "detail"}]}`` per claim; a claim
whose mask cannot be read gets ``"ok": null`` and an ``"error"``) and ``verdicts/`` Parquet with the
claim's text, question, type and mask besides, and its ``lineage`` (the claim's digest, the mask's, the
rules': operators.language.claims_resume). A rerun checks again only the claims whose text, mask or rules
changed (their new rows supersede the old ones; a claim whose mask still cannot be read is not checked
again). The run prints how many claims each rule caught. No LLM and no Ray: the rules are cheap, a mask
is read once however many claims point to it.
"""
from __future__ import annotations

import os
import sys

if not __package__:  # run as `python jobs/validate.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import json
import logging
import posixpath
import time
from dataclasses import asdict

import cv2
import numpy as np
import pyarrow as pa

from operators.io import console, lineage, validation
from operators.io.cli import parse_job_args
from operators.io.sources import dataset_of, write_source
from operators.io.storage import Store, read_uri
from operators.io.tables import keyed, read_table, run_id_after, write_table_shard
from operators.language import claims_resume
from operators.language.mask_analysis import analyze_mask, binarize_mask
from operators.language.validators import RULES, ValidatorConfig, mask_facts, rule_counts, validate_text

log = logging.getLogger("changeforge.validate")

VERDICTS_SCHEMA = keyed(pa.schema([
    ("id", pa.string()), ("ok", pa.bool_()), ("violations", pa.string()), ("rules", pa.list_(pa.string())),
    ("text", pa.string()), ("question", pa.string()), ("type", pa.string()), ("mask", pa.string()),
    ("error", pa.string()), ("run_id", pa.string()), ("lineage", pa.string()),
]), "id")


def _join(base: str, rel: str) -> str:
    if "://" in rel or rel.startswith("/") or not base:
        return rel
    return base.rstrip("/") + "/" + rel


def load_claims(input_uri: str, masks: str | None) -> list[dict]:
    """Claims from a JSONL file or a LEVIR-CC JSON, each with a list of candidate mask URIs."""
    text = read_uri(input_uri).decode("utf-8")
    base = posixpath.dirname(input_uri)
    stripped = text.lstrip()
    if stripped.startswith("{") and '"images"' in stripped[:2000] and "\n{" not in stripped.strip():
        masks = masks or dataset_of(base)
        if not masks:
            raise SystemExit("jobs.validate: a LEVIR-CC JSON or VQA.json needs --masks <label folder> (found no "
                             "source.json beside it naming its dataset)")
        claims = []
        for img in json.loads(text).get("images", []):
            name, split = img["filename"], img.get("filepath") or img.get("split") or ""
            candidates = [_join(masks, name), _join(masks, f"label/{name}")] + (
                [_join(masks, f"{split}/{name}"), _join(masks, f"{split}/label/{name}")] if split else [])
            for i, s in enumerate(img.get("sentences", [])):
                claims.append({"id": f"{name}#{s.get('sentid', i)}", "masks": candidates, "kind": "captions",
                               "text": s.get("raw", "").strip(), "question": None, "type": None})
            for i, qa in enumerate(img.get("qa") or []):   # the QA job's VQA.json
                claims.append({"id": f"{name}#qa{i}", "masks": candidates, "kind": "qa",
                               "text": str(qa.get("answer", "")).strip(),
                               "question": qa.get("question"), "type": qa.get("type")})
        return claims
    claims = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        claims.append({"id": str(row.get("id", n)), "masks": [_join(masks or base, str(row.get("mask", "")))],
                       "text": row.get("text", ""), "question": row.get("question"), "type": row.get("type")})
    return claims


def _read_mask(uri: str) -> np.ndarray:
    image = cv2.imdecode(np.frombuffer(read_uri(uri), np.uint8), cv2.IMREAD_UNCHANGED)
    if image is None:
        raise ValueError(f"{uri} is not a readable image")
    return binarize_mask(image)


def validate_claims(claims: list[dict], cfg: ValidatorConfig = ValidatorConfig(), progress_every_s: float = 10.0):
    """Yields one verdict dict per claim, in order."""
    facts_by_uri: dict[str, dict | Exception] = {}
    digests: dict[str, str] = {}
    last = time.time()
    for n, claim in enumerate(claims, 1):
        facts, used, error = None, claim["masks"][0], None
        for uri in claim["masks"]:
            if uri not in facts_by_uri:
                try:
                    mask = _read_mask(uri)
                    facts_by_uri[uri] = mask_facts(mask, analyze_mask(mask).components)
                    digests[uri] = lineage.mask_digest(mask)
                except Exception as exc:  # noqa: BLE001 - a missing mask is that claim's error, not the run's
                    facts_by_uri[uri] = exc
            if not isinstance(facts_by_uri[uri], Exception):
                facts, used = facts_by_uri[uri], uri
                break
            error = f"cannot read mask {uri}: {type(facts_by_uri[uri]).__name__}: {facts_by_uri[uri]}"
        verdict = {"id": claim["id"], "text": claim["text"], "question": claim["question"], "type": claim["type"],
                   "mask": used, "mask_digest": digests.get(used) or lineage.unreadable(used, _reason(
                       facts_by_uri.get(used)))}
        if facts is None:
            verdict.update(ok=None, violations=[], error=error or "no mask given")
        else:
            ok, violations = validate_text(claim["text"], facts, claim["question"], claim["type"], cfg)
            verdict.update(ok=ok, violations=[asdict(v) for v in violations], error=None)
        if time.time() - last > progress_every_s:
            log.info("%d of %d claims checked", n, len(claims))
            last = time.time()
        yield verdict


def _reason(exc) -> str:
    return f"{type(exc).__name__}: {exc}" if isinstance(exc, Exception) else "no mask given"


def _mask_digest(uri: str) -> str:
    try:
        return lineage.mask_digest(_read_mask(uri))
    except Exception as exc:  # noqa: BLE001 - the claim's condition, said with its file and reason
        return lineage.unreadable(uri, _reason(exc))


def _stamps(uris) -> dict[str, str]:
    """uri -> its stamp (size and mtime, or ETag), from one listing of each folder the masks are in."""
    out = {}
    for folder in claims_resume.dirs_of(uris):
        try:
            listed = Store(folder).stamps(recursive=False)
        except Exception:  # noqa: BLE001 - a folder that is not there: its masks are not listed
            continue
        out.update({folder.rstrip("/") + "/" + rel: stamp for rel, stamp in listed.items()})
    return out


def plan_run(input_uri: str, output: str, masks: str | None = None):
    """(claims, their current verdict rows by id, the resume plan, the masks' stamps, the rules' digest):
    which claims a run checks again, reading only."""
    claims = load_claims(input_uri, masks)
    table = read_table(Store(output), "verdicts", key=("id",))
    rows = {} if table is None else {r["id"]: r for r in table.to_pylist()}
    rules = lineage.value_digest(asdict(ValidatorConfig()))
    stamps = _stamps([u for c in claims for u in c["masks"]]
                     + [(lineage.loads(r.get("lineage")) or {}).get("mask_uri") for r in rows.values()])
    recorded = {k: lineage.loads(r.get("lineage")) for k, r in rows.items()}
    return claims, rows, claims_resume.plan(claims, recorded, stamps, _mask_digest, rules), stamps, rules


def status(args) -> dict:
    """What a run would do (operators.io.lineage.status), reading only: for ``changeforge chain --explain``
    and the chain's decision to run this step again."""
    _, _, plan, _, _ = plan_run(args.input, args.output, args.masks or None)
    return lineage.status(plan)


def _old_verdict(row: dict) -> dict:
    return {"id": row["id"], "ok": row["ok"], "violations": json.loads(row["violations"] or "[]"),
            "error": row.get("error"), "text": row.get("text")}


def run(input_uri: str, output: str, masks: str | None = None) -> dict:
    claims, rows, plan, stamps, rules = plan_run(input_uri, output, masks)
    todo = {c["id"] for c in plan.todo}
    new = {v["id"]: v for v in validate_claims([c for c in claims if c["id"] in todo])}
    out = Store(output)
    write_source(out, "validate", input=input_uri, masks=masks or dataset_of(posixpath.dirname(input_uri)))
    verdicts = [new[c["id"]] if c["id"] in new else _old_verdict(rows[c["id"]]) for c in claims]
    lines = [json.dumps({"id": v["id"], "ok": v["ok"], "violations": v["violations"],
                         **({"error": v["error"]} if v["error"] else {})}) for v in verdicts]
    out.write_bytes("verdicts.jsonl", ("\n".join(lines) + "\n").encode() if lines else b"")
    run_id = run_id_after(max((str(r.get("run_id") or "") for r in rows.values()), default=""))
    by_id = {c["id"]: c for c in claims}
    # New rows supersede the claims' old ones (the table keeps the history: read_table(current=False)).
    write_table_shard(out, "verdicts", [
        dict({k: v for k, v in verdict.items() if k != "mask_digest"}, violations=json.dumps(verdict["violations"]),
             rules=sorted({x["rule"] for x in verdict["violations"]}), run_id=run_id,
             lineage=lineage.dumps(claims_resume.row_lineage(by_id[verdict["id"]], verdict["mask"],
                                                             verdict["mask_digest"], stamps.get(verdict["mask"]),
                                                             rules)))
        for verdict in new.values()], VERDICTS_SCHEMA, run_id)
    return {"claims": len(verdicts), "ok": sum(1 for v in verdicts if v["ok"] is True),
            "violating": sum(1 for v in verdicts if v["ok"] is False),
            "errors": sum(1 for v in verdicts if v["ok"] is None),
            "checked": len(new), "redone": lineage.redo_line(plan).replace("redone", "checked again"),
            "unreadable": lineage.unreadable_line(plan, "claim(s) not checked again"),
            "caught": rule_counts(v["violations"] for v in verdicts)}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jobs.validate", description=__doc__.split("\n\n")[0])
    validation.attach(ap.add_argument("--input", required=True, help="claims JSONL or LEVIR-CC JSON (local path or s3:// URI)"),
                      {"path": "file"})
    validation.attach(ap.add_argument("--masks", default="", help="label folder (or s3:// prefix) the masks are found in (default for a LEVIR-CC JSON or "
                         "VQA.json: the dataset named by the source.json beside it)"), {"path": "dir"})
    ap.add_argument("--output", required=True, help="output folder or s3:// prefix")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parse_job_args(build_parser(), argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_job_args(build_parser(), argv)
    s = run(args.input, args.output, args.masks or None)
    print(f"{s['claims']} claims: {s['ok']} pass, {s['violating']} break a rule, {s['errors']} without a readable mask"
          f" ({s['checked']} checked in this run, the others current)")
    for line in (s["redone"], s["unreadable"]):
        if line:
            print(line)
    print("caught per rule: " + ", ".join(f"{r}={s['caught'].get(r, 0)}" for r in RULES))
    print(f"outputs: {args.output}/verdicts.jsonl and {args.output}/verdicts/")
    console.stop_if_nothing("validate:", s["claims"] > s["errors"], f"none of the {s['claims']} claim(s) could be "
                            "checked" + (" (no mask could be read)" if s["claims"] else " (the input holds none)"))
    return 0


if __name__ == "__main__":
    from operators.process_exit import run as run_process    # this module may have its own run
    run_process(main)
