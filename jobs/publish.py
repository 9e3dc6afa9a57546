"""The publish job: a dataset root (a pairs job output or any LEVIR-CD layout) and the captions / QA job
outputs in, a self-contained, versioned release out.

    python -m jobs.publish --input <dataset root> [--captions <captions output>] [--qa <QA output>] \\
                           --output <folder | s3://prefix> --name <name> --version <semver> [--licence <SPDX id>]

The release is written to ``<output>/<version>/``: the folder layout ``{train,val,test}/{A,B,label}/<id>.png``
(+ one map per class and ``label_index/`` when classes were annotated apart, ``captions.json`` / ``qa.json``
per split), Parquet shards with image columns ``data/<split>-<n>.parquet``, the dataset card
``README.md`` (its YAML ``configs:`` is what ``datasets.load_dataset`` reads), ``croissant.json``,
a STAC catalogue ``stac/``, ``release.json`` (inputs, run ids, options, code version, pair digests),
``CHANGELOG.md`` / ``changes.json`` against the previous version in ``<output>``, ``excluded.json``
(pairs that could not be published, with the reason) and ``SHA256SUMS``. ``<output>/versions.json``
lists the versions.
"""
from __future__ import annotations

import os
import sys

if not __package__:  # run as `python jobs/publish.py`: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import dataclasses
import json
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from operators.io.cli import add_config_args, config_from_args, parse_job_args
from operators.io.storage import Store
from operators.publish import card, croissant, made_from, provenance, recipes
from operators.publish.classes import ReleaseClasses, add_class_files, release_classes
from operators.publish.layout import (STAC_ROLES, captions_document, prepare_pair, qa_document, release_path,
                                      stac_class_assets)
from operators.publish.shards import IMAGE_TYPE, ShardWriter, image_cell
from operators.publish.sources import (declared_licence, portable, read_captions, read_dataset, read_qa,
                                       resolve_licence)
from operators.publish.stac import CATALOG, catalog, item_path, pair_item
from operators.publish.versions import (changelog, changelog_entry, code_version, diff_pairs, pair_digest,
                                        parse_version, previous_version, sha256, sha256sums)
from operators.pairs.selection.splits import SPLITS

VERSIONS_FILE = "versions.json"
STATUS_TO_EXPLAIN = True   # status() reads every released pair's sources: for --explain, not each chain run
VERIFY_HELP = ("changeforge publish --verify <release folder> [--sources <dataset> | --no-sources]: re-check a "
               "finished release (every file against SHA256SUMS, no file beyond them; each pair's captions and QA made from the mask, "
               "images and captions it ships; its sources unchanged, unless --no-sources) and exit 1 on any mismatch")


@dataclass
class PublishConfig:
    input: str = field(default="", metadata={"path": "must_exist", "required": True, "help": "dataset root: a pairs job output, or a LEVIR-CD layout (A/ B/ label/, flat or under train/ val/ test/); folder or s3:// prefix"})
    output: str = field(default="", metadata={"required": True, "help": "folder or s3:// prefix holding the releases; this one goes to <output>/<version>/"})
    name: str = field(default="", metadata={"required": True, "help": "dataset name (letters, digits, '-', '_', '.')"})
    version: str = field(default="", metadata={"required": True, "help": "semantic version of this release, e.g. 1.0.0"})
    captions: str = field(default="", metadata={"path": "must_exist", "help": "captions job output (or a LEVIR-CC json) whose selected captions go with the pairs"})
    qa: str = field(default="", metadata={"path": "must_exist", "help": "QA job output (or a VQA.json) whose selected QA pairs go with the pairs"})
    review: str = field(default="", metadata={"path": "dir", "help": "review job output: its sample size, acceptance and agreement go into the card and Croissant"})
    licence: str = field(default="", metadata={"help": "SPDX licence id of the release; required when an input declares none (no licence.txt) or inputs disagree"})
    licence_override: str = field(default="", metadata={"requires": ("licence",), "help": "why --licence may differ from a licence an input declares (its licence.txt, or the bundled data's terms); recorded in release.json and the card"})
    default_split: str = field(default="train", metadata={"help": "split of LEVIR-CD pairs with no split folder, list/<split>.txt or train_/val_/test_ name prefix", "choices": SPLITS})
    require_label: bool = field(default=True, metadata={"help": "publish only pairs with a change mask (the others go to excluded.json)"})
    shard_mb: float = field(default=256.0, metadata={"gt": 0, "help": "Parquet shard size in MB of encoded images"})
    rows_per_group: int = field(default=100, metadata={"min": 1, "help": "rows per Parquet row group"})
    threads: int = field(default=8, metadata={"min": 1, "help": "pairs read and written at once"})
    date: str = field(default="", metadata={"date": True, "help": "release date YYYY-MM-DD (default: today, UTC)"})
    description: str = field(default="", metadata={"help": "one-paragraph description for the card, Croissant and STAC (default: generated)"})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m jobs.publish", description=__doc__.split("\n\n")[0],
                                     epilog=VERIFY_HELP + ".")
    add_config_args(parser, PublishConfig, "release")
    return parser


class Recorder:
    """Writes release files through the Store and keeps each file's SHA-256."""

    def __init__(self, store: Store, inputs: list[str] = ()):
        self.store, self.hashes, self.inputs = store, {}, list(inputs)

    def put(self, rel: str, data: bytes) -> None:
        self.store.write_bytes(rel, data)
        self.hashes[rel] = sha256(data)

    def put_json(self, rel: str, doc) -> None:
        doc = portable(doc, self.inputs)   # no absolute path of this machine, no NaN, in a release
        self.put(rel, (json.dumps(doc, indent=1, ensure_ascii=False) + "\n").encode())


def _check(cfg: PublishConfig) -> None:
    try:
        parse_version(cfg.version)
    except ValueError as exc:
        raise SystemExit(f"--version: {exc}") from None
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", cfg.name or ""):
        raise SystemExit(f"--name {cfg.name!r}: use letters, digits, '-', '_' and '.'")
    if cfg.date and not re.fullmatch(r"\d{4}-\d{2}-\d{2}", cfg.date):
        raise SystemExit(f"--date {cfg.date!r} is not YYYY-MM-DD")


def run(cfg: PublishConfig) -> dict:
    """Build the release; returns a summary (also printed by :func:`main`)."""
    _check(cfg)
    t0 = time.time()
    date = cfg.date or time.strftime("%Y-%m-%d", time.gmtime())
    dataset = read_dataset(cfg.input, cfg.default_split)
    src = Store(dataset.uri)
    classes = release_classes(src)                 # label_classes.json, else S2Looking's label1/label2
    add_class_files(src, dataset.pairs, classes)
    summary = provenance.read_summary(src)         # annotation_summary.json: how the masks were made
    caps = read_captions(cfg.captions) if cfg.captions else None
    qa = read_qa(cfg.qa) if cfg.qa else None
    declared = {"--input": declared_licence(cfg.input)}
    for flag, uri in (("--captions", cfg.captions), ("--qa", cfg.qa)):
        if uri and declared_licence(uri):  # derived annotations inherit the imagery's licence unless they say one
            declared[flag] = declared_licence(uri)
    licence, licence_note = resolve_licence(declared, cfg.licence, cfg.licence_override)

    root = Store(cfg.output)
    out = Recorder(root.child(cfg.version), [cfg.input, cfg.captions, cfg.qa, cfg.review, cfg.output])
    versions = json.loads(root.read_bytes(VERSIONS_FILE)) if root.exists(VERSIONS_FILE) else []
    print(f"[publish] {cfg.name} {cfg.version}: {len(dataset.pairs)} pair(s) from {dataset.uri} ({dataset.kind}); "
          f"licence {licence}; writing {out.store.uri()}", flush=True)

    earlier = out.store.exists("SHA256SUMS")      # this version was published before (a rerun of it)
    rows, index, items, excluded, writers, made = _write_pairs(cfg, dataset, caps, qa, out, date, classes, summary)
    unrecorded = made.pop(made_from.UNRECORDED, [])
    if made:   # a caption or QA pair shipped with what it was not made from: no release at all
        if not earlier:
            for rel in out.hashes:
                out.store.delete(rel)
        raise SystemExit(f"publish: refused, {len(set().union(*made.values()))} pair(s) would ship language made from "
                         "other inputs (rerun the caption/QA jobs: they redo exactly these pairs):\n  "
                         + "\n  ".join(made_from.problem_lines(made))
                         + (f"\n  {out.store.uri()} held this version before: its files are now mixed, publish it "
                            "again once the language is current" if earlier else ""))
    if unrecorded:
        print(f"[publish] {made_from.problem_lines({made_from.UNRECORDED: unrecorded})[0]}: not checked", flush=True)
    if not rows:
        raise SystemExit(f"nothing to publish: every pair of {cfg.input} was excluded "
                         f"({len(excluded)}; first: {excluded[0]['message'] if excluded else 'no pairs'})")
    counts = {s: sum(1 for r in rows if r["split"] == s) for s in SPLITS}
    present = [s for s in SPLITS if counts[s]]
    for s in present:
        if caps:
            out.put_json(f"{s}/captions.json", captions_document([r for r in rows if r["split"] == s]))
        if qa:
            out.put_json(f"{s}/qa.json", qa_document([r for r in rows if r["split"] == s]))
    for item in items:
        out.put_json(item_path(item["id"]), item)
    description = cfg.description or recipes.description(cfg.name, counts, bool(caps), bool(qa), dataset.kind)
    out.put_json(CATALOG, catalog(cfg.name, cfg.version, description, [i["id"] for i in items]))

    # Statistics, recipes and the card.
    import pandas as pd
    frame = pd.DataFrame(rows)
    stats, tables = card.statistics(frame, caps.table if caps else None, qa.table if qa else None,
                                    dataset.tables if dataset.kind == "pairs_job" else None)
    review = recipes.review_summary(cfg.review, caps, qa) if cfg.review else None
    language = recipes.annotation_facts(caps, qa, review)
    has_two = classes.per_class and any(r.get(classes.pixels_column(classes.classes[0])) is not None for r in rows)
    if classes.declared:
        out.put_json("label_classes.json", classes.document())
    prev = previous_version([v["version"] for v in versions if v["version"] != cfg.version], cfg.version)
    prev_store = root.child(prev) if prev else None
    if prev_store and not prev_store.exists("release.json"):
        raise SystemExit(f"{root.uri(VERSIONS_FILE)} lists version {prev} but {prev_store.uri('release.json')} is "
                         "missing: restore it, or remove the version from the list")
    prev_index = json.loads(prev_store.read_bytes("release.json"))["pairs"] if prev_store else {}
    changes = diff_pairs(prev_index, index)
    info = {"name": cfg.name, "version": cfg.version, "date": date, "licence": licence, "licence_note": licence_note,
            "splits": counts, "has_two_maps": has_two, "classes": classes, "has_captions": bool(caps),
            "has_qa": bool(qa), "recipes": recipes.recipe_lines(dataset, caps, qa),
            "limitations": recipes.limitations(dataset, counts, excluded, bool(caps), bool(qa), review, has_two,
                                               classes),
            "masks": provenance.facts(summary), "language": language,
            "excluded_by_people": [e for e in excluded if e.get("stage") == "annotation"]}
    out.put("README.md", portable(card.render(info, tables), out.inputs).encode())
    shards = {s: [rel for rel, _ in writers[s].written] for s in present}
    out.put_json("croissant.json", croissant.document(
        name=cfg.name, version=cfg.version, date=date, licence=licence, description=description,
        shards={rel: out.hashes[rel] for s in present for rel in shards[s]}, has_captions=bool(caps),
        has_qa=bool(qa), has_two_maps=has_two, classes=classes,
        rai=recipes.rai_fields(language, info["limitations"], dataset, provenance.rai(summary))))
    out.put_json("stats.json", stats)
    out.put_json("excluded.json", excluded)
    out.put_json("changes.json", {"version": cfg.version, "previous": prev, **changes})
    prev_log = prev_store.read_bytes("CHANGELOG.md").decode() if prev_store and prev_store.exists("CHANGELOG.md") else None
    out.put("CHANGELOG.md", changelog(changelog_entry(cfg.version, date, prev, changes, counts), prev_log).encode())
    out.put_json("release.json", {
        "name": cfg.name, "version": cfg.version, "date": date, "licence": licence, "licence_source": licence_note,
        "previous_version": prev, "code_version": code_version(), "options": dataclasses.asdict(cfg),
        "inputs": {"dataset": {"uri": dataset.uri, "kind": dataset.kind, "runs": dataset.runs,
                               "classes": classes.document()["classes"] if classes.declared else None,
                               "annotation_summary": ({"file": provenance.SUMMARY_FILE,
                                                       "generated_at": summary.get("generated_at")}
                                                      if summary else None)},
                   **({"captions": {"uri": caps.uri, "runs": caps.runs}} if caps else {}),
                   **({"qa": {"uri": qa.uri, "runs": qa.runs}} if qa else {})},
        "counts": counts, "excluded": len(excluded), "shards": {s: writers[s].written for s in present},
        "pairs": index})
    out.put("SHA256SUMS", sha256sums(out.hashes).encode())
    # A rerun of this version over an earlier attempt: files no longer part of it go, so the folder is
    # exactly what SHA256SUMS lists.
    stale = [rel for rel in out.store.list() if rel not in out.hashes]
    for rel in stale:
        out.store.delete(rel)
    versions = [v for v in versions if v["version"] != cfg.version] + [
        {"version": cfg.version, "date": date, "pairs": len(rows), "path": cfg.version}]
    root.write_bytes(VERSIONS_FILE, (json.dumps(sorted(versions, key=lambda v: parse_version(v["version"])),
                                                indent=1) + "\n").encode())
    return {"output": out.store.uri(), "version": cfg.version, "previous": prev, "pairs": counts,
            "excluded": len(excluded), "files": len(out.hashes), "stale_removed": len(stale), "licence": licence,
            "added": len(changes["added"]), "removed": len(changes["removed"]), "changed": len(changes["changed"]),
            "seconds": round(time.time() - t0, 1)}


def _write_pairs(cfg: PublishConfig, dataset, caps, qa, out: "Recorder", date: str, classes: ReleaseClasses,
                 summary: dict | None):
    """Every pair in split order: read, checked and written by a thread pool, its Parquet row added to its
    split's shards. Returns (rows without images, {id: split, digest, sources and what its language was made
    from}, STAC items, excluded, writers, {lineage cause: pairs}: operators.publish.made_from).
    Pairs the annotators excluded (``unusable``) are listed with their reason and never read."""
    excluded = [dict(e) for e in dataset.errors]
    excluded += [{"item": p.pair_id, "stage": "inputs", "message": f"unknown split {p.split!r}"}
                 for p in dataset.pairs if p.split not in SPLITS]
    by_people, people_rows = provenance.excluded(summary, dataset.pairs)
    excluded += people_rows
    schema = classes.schema()
    writers = {s: ShardWriter(s, out.put, cfg.shard_mb, cfg.rows_per_group, schema) for s in SPLITS}
    rows, index, items = [], {}, []
    src = Store(dataset.uri)
    todo = sorted((p for p in dataset.pairs if p.split in SPLITS and p.pair_id not in by_people),
                  key=lambda p: (SPLITS.index(p.split), p.pair_id))
    source_files = {p.pair_id: p.files for p in todo}
    lineage_problems: dict[str, list[str]] = {}   # cause -> pairs (operators.publish.made_from)

    def prepare(p):
        """In a worker thread: read, check and encode one pair, and write its layout files."""
        try:
            prepared = prepare_pair(src, p, cfg.require_label, classes)
        except (ValueError, FileNotFoundError) as exc:
            return None, {"item": p.pair_id, "stage": "prepare", "message": str(exc)}
        for role, data in prepared.files.items():
            out.put(release_path(prepared.split, role, prepared.pair_id), data)
        return prepared, None

    chunk = max(1, cfg.threads) * 4
    with ThreadPoolExecutor(max_workers=max(1, cfg.threads)) as pool:
        for start in range(0, len(todo), chunk):
            for prepared, err in pool.map(prepare, todo[start:start + chunk]):
                if err:
                    excluded.append(err)
                    continue
                row, digest_files = _pair_row(out, prepared, caps, qa, classes, schema)
                writers[prepared.split].add(row)
                made = made_from.made_from(caps.by_pair.get(prepared.pair_id) if caps else None,
                                           qa.by_pair.get(prepared.pair_id) if qa else None)
                for cause in made_from.mismatches(prepared.lineage, row["captions"] if caps else None, made):
                    lineage_problems.setdefault(cause, []).append(prepared.pair_id)
                if (row["captions"] and "captions" not in made) or (row["qa"] and "qa" not in made):
                    lineage_problems.setdefault(made_from.UNRECORDED, []).append(prepared.pair_id)
                files = source_files[prepared.pair_id]
                index[prepared.pair_id] = {"split": prepared.split, "digest": pair_digest(
                    digest_files, prepared.split, row["captions"] or [], row["qa"] or []),
                    "sources": prepared.lineage, "made_from": made,
                    "source_files": {("mask" if r == "label" else r): files[r] for r in ("A", "B", "label")
                                     if r in files}}
                meta_row = {k: v for k, v in row.items() if k not in classes.image_columns()}
                rows.append(meta_row)
                paths = {r: release_path(prepared.split, r, prepared.pair_id) for r in prepared.files}
                item = pair_item(meta_row, {r: v for r, v in paths.items() if r in STAC_ROLES},
                                 *_label_classes(prepared.files, classes), date)
                items.append(stac_class_assets(item, paths, classes))
    for w in writers.values():
        w.flush()
    return rows, index, items, excluded, writers, lineage_problems


def _label_classes(files: dict, classes: ReleaseClasses) -> tuple[list[str], list[dict]]:
    out = [{"name": "change", "classes": [0, 255]}]
    if "label_index" in files:
        out.append({"name": "label_index", "classes": sorted(classes.index_values())})
    return ["manual"], out


def _pair_row(out: Recorder, p, caps, qa, classes: ReleaseClasses, schema) -> tuple[dict, dict]:
    """One written pair's Parquet row and its files' hashes by role."""
    digests = {role: out.hashes[release_path(p.split, role, p.pair_id)] for role in p.files}
    by_role = {role: col for col, role in classes.image_columns().items()}
    pixels = p.stats.get("class_pixels") or {}
    row = {"id": p.pair_id, "split": p.split, "width": p.size[0], "height": p.size[1],
           **{by_role[r]: image_cell(d, release_path(p.split, r, p.pair_id)) for r, d in p.files.items()},
           "car": p.stats.get("car"), "changed_pixels": p.stats.get("changed_pixels"),
           **({classes.pixels_column(c): pixels.get(c.name) for c in classes.classes} if classes.per_class else {})}
    for f in schema:
        if f.type == IMAGE_TYPE:
            row.setdefault(f.name, None)
    # With a language source, a pair it kept nothing for gets an empty list, not null: Croissant readers
    # turn a null list into one record of null fields.
    c = caps.by_pair.get(p.pair_id) if caps else None
    row["captions"] = (c["captions"] if c else []) if caps else None
    row["caption_perspectives"] = (c["perspectives"] or None) if c else None
    q = qa.by_pair.get(p.pair_id) if qa else None
    row["qa"] = (q["qa"] if q else []) if qa else None
    for k in ("location", "pre_date", "post_date", "sensor", "crs", "bounds", "pre_source", "post_source",
              "source_run_id"):
        row[k] = p.meta.get(k)
    return row, digests


def verify_main(argv: list[str]) -> int:
    """``--verify <release>``: one line per cause (count and first items), exit 1 on any mismatch."""
    ap = argparse.ArgumentParser(prog="changeforge publish --verify", description=VERIFY_HELP)
    ap.add_argument("--verify", required=True, metavar="RELEASE", help="a release folder: <output>/<version>")
    ap.add_argument("--sources", default="", metavar="DATASET",
                    help="the release's dataset, to check its sources did not change since (default: the one "
                         "release.json names, when it can be read from here: a release records it portably)")
    ap.add_argument("--no-sources", action="store_true", help="check the release alone")
    args = ap.parse_args(argv)
    problems, counts = made_from.verify(Store(args.verify), check_sources=not args.no_sources,
                                        dataset=args.sources or None)
    for line in problems:
        print(f"[publish --verify] {line}", flush=True)
    if problems:
        print(f"[publish --verify] {args.verify}: {len(problems)} kind(s) of mismatch", flush=True)
        return 1
    print(f"[publish --verify] {args.verify}: {counts['files']} files match SHA256SUMS; {counts['pairs']} pairs' "
          f"captions and QA were made from what they ship; "
          + (f"sources checked for {counts['sources_checked']} pairs" if counts["sources_checked"] else
             f"sources not checked ({counts['sources_note']})"), flush=True)
    return 0


def parse_args(argv: list[str]) -> PublishConfig:
    return config_from_args(PublishConfig, parse_job_args(build_parser(), argv))


def status(cfg: PublishConfig) -> dict:
    """The latest release in ``--output`` against today's dataset (operators.publish.made_from.release_status),
    reading only: for ``changeforge chain --explain``. No release yet: every pair missing."""
    root = Store(cfg.output)
    versions = json.loads(root.read_bytes(VERSIONS_FILE)) if root.exists(VERSIONS_FILE) else []
    today = {p.pair_id for p in read_dataset(cfg.input, cfg.default_split).pairs}
    if not versions:
        missing = sorted(today)
        return {"current": 0, "stale": 0, "stale_by_cause": {}, "stale_first": [], "missing": len(missing),
                "missing_first": missing[:5], "failed": 0, "unrecorded": 0, "needs_run": False}
    latest = max(versions, key=lambda v: parse_version(v["version"]))
    return made_from.release_status(root.child(latest.get("path") or latest["version"]), cfg.input, today)


def main(argv: list[str] | None = None) -> dict | int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a == "--verify" or a.startswith("--verify=") for a in argv):
        return verify_main(argv)
    cfg = parse_args(argv)
    s = run(cfg)
    print(f"[publish] done in {s['seconds']}s: {s['output']} ({sum(s['pairs'].values())} pairs: "
          + ", ".join(f"{k} {v}" for k, v in s["pairs"].items()) + f"; {s['excluded']} excluded; {s['files']} files; "
          f"licence {s['licence']}); against {s['previous'] or 'no earlier version'}: {s['added']} added, "
          f"{s['removed']} removed, {s['changed']} changed", flush=True)
    return s


if __name__ == "__main__":
    from operators.process_exit import run as run_process    # this module may have its own run
    run_process(main)
