"""Human verification in Label Studio (JL1-CC&QA stage 3, sections II-B2 and II-C3): a seeded, stratified
sample of captions or QA pairs out as Label Studio tasks, the reviewers' verdicts back in as a table and
a summary.

    python -m jobs.review export --input <captions or QA job output> --output <folder> --sample 200 \\
        [--stratify perspective,car_class,split] [--sample-seed 0] [--include-rejected] [--images <dataset>] \\
        [--label-studio-url http://localhost:8080]        # key from LABEL_STUDIO_API_KEY
    python -m jobs.review ingest --export <export.json | Label Studio URL> [--project-id N] --output <folder>

export writes ``tasks.json`` (import it in Label Studio, or let --label-studio-url do it),
``label_config.xml`` (the labeling interface), ``sample.parquet`` (what was drawn, with strata) and
``export_summary.json``. ingest writes ``review/`` (Parquet, one row per annotation, plus unreviewed
tasks), ``review_summary.json`` and ``review_summary.md``.
"""
from __future__ import annotations

import os
import sys

if not __package__:  # run as `python jobs/review.py`: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import io
import json
import logging
import posixpath
from dataclasses import dataclass, field

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from operators.io.cli import add_config_args, config_from_args, parse_job_args
from operators.io.sources import dataset_of, write_source
from operators.io.storage import Store, read_uri
from operators.io.tables import ERRORS_SCHEMA, error_record, new_run_id, prune_shards, write_table_shard
from operators.review.image_urls import ImageUrls
from operators.review.items import review_items, review_status, stratum_columns
from operators.review.label_studio import labeling_config, review_rows, task
from operators.review.outputs import ImageIndex, output_kinds, read_current
from operators.review.sampling import stratified_sample
from operators.review.summary import summarize_reviews

log = logging.getLogger("changeforge.review")

REVIEW_SCHEMA = pa.schema([
    ("task_id", pa.int64()), ("annotation_id", pa.int64()), ("status", pa.string()),
    ("item_id", pa.string()), ("kind", pa.string()), ("pair_id", pa.string()), ("filename", pa.string()),
    ("split", pa.string()), ("index", pa.int64()), ("facet", pa.string()), ("text", pa.string()),
    ("car", pa.float64()), ("car_class", pa.string()), ("overall", pa.float64()), ("judge_accept", pa.bool_()),
    ("selected", pa.bool_()), ("stratum", pa.string()), ("stratum_size", pa.int64()),
    ("stratum_sampled", pa.int64()), ("verdict", pa.string()), ("error_categories", pa.list_(pa.string())),
    ("corrected_text", pa.string()), ("human_judge_score", pa.int64()), ("annotator", pa.string()),
    ("annotated_at", pa.string()), ("run_id", pa.string()), ("source", pa.string()), ("ingest_run_id", pa.string()),
    ("lineage", pa.string()),   # what the reviewed item was made from, and its text (operators.io.lineage)
])


@dataclass
class ExportConfig:
    input: str = field(default="", metadata={"path": "dir", "required": True, "help": "captions or QA job output (folder or s3:// prefix)"})
    output: str = field(default="", metadata={"required": True, "help": "folder or s3:// prefix for tasks.json, label_config.xml, sample.parquet"})
    sample: int = field(default=200, metadata={"min": 1, "help": "items to draw"})
    stratify: str = field(default="perspective,car_class,split", metadata={
        "help": "strata, comma-separated: perspective (captions) or question_type (QA), car_class, split"})
    seed: int = field(default=0, metadata={"flag": "sample-seed", "old_flags": ("--seed",), "help": "random seed of the sample (same seed, same sample)"})
    include_rejected: bool = field(default=False, metadata={
        "help": "also sample rejected items (to measure human-judge agreement on both sides)"})
    kind: str = field(default="auto", metadata={"help": "captions or qa (auto: the table the input holds)",
                                                "choices": ("auto", "captions", "qa")})
    images: str = field(default="", metadata={"path": "dir", 
        "help": "the LEVIR-CD dataset the job read (A/ B/ label/); default: --input when it holds A/, else the "
                "dataset named by its source.json"})
    local_files_root: str = field(default="", metadata={
        "help": "Label Studio's LABEL_STUDIO_LOCAL_FILES_DOCUMENT_ROOT for local images (default: the images folder's parent)"})
    url_expiry_s: int = field(default=7 * 24 * 3600, metadata={"range": (1, 7 * 24 * 3600), "help": "lifetime of presigned S3 image URLs (max 7 days)"})
    pass_score: float = field(default=7.0, metadata={"range": (0, 10), "help": "judge score at which the judge accepts (paper: 7)"})
    label_studio_url: str = field(default="", metadata={"url": True, 
        "help": "create the project and import the tasks there (key from LABEL_STUDIO_API_KEY)"})
    project_title: str = field(default="", metadata={"help": "project title (default: from kind, input and seed)"})


@dataclass
class IngestConfig:
    export: str = field(default="", metadata={"json": "nonempty", "path": "must_exist", "required": True, "help": "Label Studio JSON export file, or the server URL (with --project-id)"})
    output: str = field(default="", metadata={"required": True, "help": "folder or s3:// prefix for review/ and review_summary.*"})
    project_id: int = field(default=0, metadata={"min": 0, "help": "project to export when --export is a server URL"})
    accept_partly: bool = field(default=False, metadata={"help": "count 'partly correct' as accepted (both rates are reported)"})


# -- export ------------------------------------------------------------------------------------------
def _kind(store: Store, wanted: str) -> str:
    kinds = output_kinds(store)
    if wanted != "auto":
        if wanted not in kinds:
            raise SystemExit(f"jobs.review: {store.uri()} has no {wanted}/ table")
        return wanted
    found = [k for k in ("captions", "qa") if k in kinds]
    if len(found) != 1:
        raise SystemExit(f"jobs.review: {store.uri()} holds {found or 'no captions/ or qa/ table'}; pass --kind")
    return found[0]


def run_export(cfg: ExportConfig) -> dict:
    src, out = Store(cfg.input), Store(cfg.output)
    kind = _kind(src, cfg.kind)
    table = read_current(src, kind)
    items = review_items(kind, table, read_current(src, "pairs"), pass_score=cfg.pass_score)
    if not cfg.include_rejected:
        items = items[items["selected"]].reset_index(drop=True)

    found = cfg.images or dataset_of(src.uri())
    if not found:
        raise SystemExit("jobs.review: --input holds no images and no source.json naming its dataset; pass "
                         "--images <the LEVIR-CD dataset the job read>")
    images = Store(found)
    index = ImageIndex(images)
    rels = [index.paths(p) for p in items["pair_id"]]
    shown = pd.Series([all(k in r for k in ImageIndex.FOLDERS) for r in rels], index=items.index)
    run_id = new_run_id()
    errors = [error_record(r.item_id, "review_export", f"images missing for pair {r.pair_id}: "
                           f"{', '.join(k for k in ImageIndex.FOLDERS if k not in rels[i]) } not under {images.uri()}",
                           error_type="MissingImage", job="review", run_id=run_id)
              for i, r in enumerate(items.itertuples()) if not shown[i]]
    pool = items[shown].reset_index(drop=True)
    pool_rels = [r for r, ok in zip(rels, shown) if ok]

    cols = stratum_columns(cfg.stratify)
    keys = [tuple("" if v is None or v != v else str(v) for v in row) for row in pool[cols].itertuples(index=False)] \
        if cols else [()] * len(pool)
    chosen, alloc = stratified_sample(keys, cfg.sample, cfg.seed)
    urls = ImageUrls(images, cfg.local_files_root, cfg.url_expiry_s)
    judge_model = str(pool["judge_model"].dropna().iloc[0]) if pool["judge_model"].notna().any() else ""
    tasks, sample_rows = [], []
    for i in chosen:
        item = pool.iloc[int(i)].to_dict()
        a = alloc[keys[i]]
        item.update(stratum="|".join(keys[i]), stratum_size=a.size, stratum_sampled=a.sampled, source=src.uri())
        r = pool_rels[int(i)]
        tasks.append(task(item, {"pre": urls.url(r["A"]), "post": urls.url(r["B"]), "mask": urls.url(r["label"])},
                          kind, judge_model))
        sample_rows.append({k: v for k, v in item.items() if k != "judge_reason"})

    out.write_bytes("tasks.json", json.dumps(tasks, indent=1).encode())
    out.write_bytes("label_config.xml", labeling_config(kind).encode())
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pandas(pd.DataFrame(sample_rows), preserve_index=False), buf)
    out.write_bytes("sample.parquet", buf.getvalue())
    write_table_shard(out, "errors", errors, ERRORS_SCHEMA, run_id)
    prune_shards(out, "errors", run_id)
    summary = {"kind": kind, "input": src.uri(), "images": images.uri(), "image_urls": urls.mode,
               "local_files_root": urls.local_files_root or None, "population": int(len(items)),
               "missing_images": len(errors), "sampled": len(tasks), "seed": cfg.seed,
               "stratify": cols, "include_rejected": cfg.include_rejected,
               "strata": [{"stratum": "|".join(k), "size": a.size, "sampled": a.sampled}
                          for k, a in sorted(alloc.items())]}
    if cfg.label_studio_url:
        from operators.labelstudio.client import call
        title = cfg.project_title or f"changeforge {kind} review: {posixpath.basename(src.uri())} seed {cfg.seed}"
        summary["label_studio"] = call("create_project_with_tasks", url=cfg.label_studio_url, title=title,
                                       label_config=labeling_config(kind), tasks=tasks,
                                       storage_path=urls.storage_path())
    out.write_bytes("export_summary.json", json.dumps(summary, indent=1).encode())
    write_source(out, "review_export", input=src.uri(), dataset=images.uri())
    return summary


# -- ingest ------------------------------------------------------------------------------------------
def load_export(cfg: IngestConfig) -> list[dict]:
    if cfg.export.startswith(("http://", "https://")):
        if not cfg.project_id:
            raise SystemExit("jobs.review ingest: --export is a server URL; pass --project-id")
        from operators.labelstudio.client import call
        return call("export_json", url=cfg.export, project_id=cfg.project_id)
    return json.loads(read_uri(cfg.export))


def run_ingest(cfg: IngestConfig) -> dict:
    out = Store(cfg.output)
    run_id = new_run_id()
    rows = review_rows(load_export(cfg))
    for r in rows:
        r["ingest_run_id"] = run_id
    # One table per ingest: the export is the whole truth at that time (later rounds re-export all).
    write_table_shard(out, "review", rows, REVIEW_SCHEMA, run_id)
    prune_shards(out, "review", run_id)
    reviews = read_current(out, "review")
    summary = summarize_reviews(reviews, accept_partly=cfg.accept_partly) if reviews is not None else {}
    out.write_bytes("review_summary.json", json.dumps(summary, indent=1).encode())
    out.write_bytes("review_summary.md", review_markdown(summary).encode())
    return summary


def review_markdown(s: dict) -> str:
    from operators.report.markdown import review_tables
    return review_tables(s)


# -- status (changeforge chain --explain) -------------------------------------------------------------
STATUS_TO_EXPLAIN = True   # reviews are people's work: their status explains, it never runs the step again


def _sampled(out: Store, command: str) -> tuple[pd.DataFrame | None, str]:
    """(the sampled items with what they were made from, the captions or QA output they came from):
    export's ``sample.parquet``; ingest's review rows (their verdicts)."""
    summary = json.loads(out.read_bytes("export_summary.json")) if out.exists("export_summary.json") else {}
    if command == "export":
        rows = pd.read_parquet(io.BytesIO(out.read_bytes("sample.parquet"))) if out.exists("sample.parquet") else None
    else:
        rows = read_current(out, "review")
    source = summary.get("input") or ""
    if not source and rows is not None and "source" in rows.columns and rows["source"].notna().any():
        source = str(rows["source"].dropna().iloc[0])
    return rows, source


def status(cfg: ExportConfig | IngestConfig) -> dict:
    """The review's sampled items against today's captions or QA (operators.review.items.review_status),
    reading only: an item whose text was redone since it was sampled or reviewed is stale (cause caption
    or QA). No sample yet: nothing to count."""
    command = "export" if isinstance(cfg, ExportConfig) else "ingest"
    rows, source = _sampled(Store(cfg.output), command)
    source = getattr(cfg, "input", "") or source
    current = {}
    if rows is not None and source:
        src = Store(source)
        for kind in sorted(set(rows["kind"].dropna()) if "kind" in rows.columns else ()):
            table = read_current(src, kind)
            if table is not None:
                current[kind] = review_items(kind, table, None)
    return review_status(rows, current)


def parse_args(argv: list[str]) -> ExportConfig | IngestConfig:
    """``export ...`` or ``ingest ...`` as the command's config, for :func:`status` (which reads only the
    output): the export a later ingest takes need not have arrived, so paths are not checked here."""
    args = build_parser().parse_args(argv)
    return config_from_args(ExportConfig if args.command == "export" else IngestConfig, args)


# -- command line ------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jobs.review", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    add_config_args(sub.add_parser("export", help="sample items and write Label Studio tasks"), ExportConfig, "export")
    add_config_args(sub.add_parser("ingest", help="turn a Label Studio export into review/ and a summary"),
                    IngestConfig, "ingest")
    return ap


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_job_args(build_parser(), argv)
    if args.command == "export":
        s = run_export(config_from_args(ExportConfig, args))
        print(f"{s['sampled']} of {s['population']} {s['kind']} items sampled ({s['missing_images']} without images); "
              f"images via {s['image_urls']}" + (f" (LABEL_STUDIO_LOCAL_FILES_DOCUMENT_ROOT={s['local_files_root']})"
                                                 if s["local_files_root"] else ""))
        if "label_studio" in s:
            print(f"Label Studio project: {s['label_studio']['project_url']}")
        else:
            print("import tasks.json in Label Studio with label_config.xml as the labeling interface")
    else:
        cfg = config_from_args(IngestConfig, args)
        s = run_ingest(cfg)
        print(review_markdown(s))
        print(f"outputs: {cfg.output}/review/ and {cfg.output}/review_summary.{{json,md}}")
    return 0


if __name__ == "__main__":
    from operators.process_exit import run as run_process    # this module may have its own run
    run_process(main)
