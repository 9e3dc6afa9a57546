"""The dataset report (JL1-CC&QA's Tables III and V, Figs. 2, 4, 5, 7, 8, and the S2Looking pairs job's
screening): statistics, Markdown tables, PNG figures and one self-contained HTML page.

    python -m jobs.report --input <pairs, captions, QA or review output> [<another> ...] --output <folder>

Every number comes from the jobs' Parquet tables (never recomputed from images); images are read only
for the gallery's thumbnails. Each section appears when its tables are there: a captions output alone
gives the caption sections. Outputs: ``stats.json``, ``tables.md``, ``figures/*.png``, ``index.html``.
"""
from __future__ import annotations

import os
import sys

if not __package__:  # run as `python jobs/report.py`: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import json
import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import cv2
import numpy as np

from operators.io import lineage, validation
from operators.io.cli import add_config_args, config_from_args, parse_job_args
from operators.io.sources import dataset_of
from operators.io.storage import Store
from operators.report import figures as fig
from operators.report.annotation import mask_table, read_classes, read_summary
from operators.report.html_page import Figure, GalleryItem, render_page
from operators.report.made_from import pair_lineage
from operators.report.markdown import markdown_table, review_result_tables
from operators.report.stats import (car_stats, car_table, caption_stats, caption_table, pairs_job_car, pairs_job_stats,
                                    pairs_job_table, qa_stats, qa_table, reject_reason_table, usage_stats, usage_table)
from operators.review.outputs import ImageIndex, output_kinds, read_current
from operators.review.summary import summarize_reviews

log = logging.getLogger("changeforge.report")


@dataclass
class ReportConfig:
    input: list = field(default_factory=list, metadata={"help": "job outputs (folders or s3:// prefixes): pairs, captions, QA, review"})
    output: str = field(default="", metadata={"required": True, "help": "local folder for stats.json, tables.md, figures/, index.html"})
    images: str = field(default="", metadata={"path": "dir", "help": "LEVIR-CD dataset for the gallery (default: an --input holding A/, "
                                                      "else the dataset an input's source.json names)"})
    gallery: int = field(default=6, metadata={"min": 0, "help": "sample pairs shown in the gallery"})
    gallery_side: int = field(default=192, metadata={"min": 16, "help": "gallery thumbnail size in pixels (longer side)"})
    seed: int = field(default=0, metadata={"flag": "gallery-seed", "old_flags": ("--seed",), "help": "seed of the gallery's pick and the word cloud's layout"})
    pass_score: float = field(default=7.0, metadata={"range": (0, 10), "help": "judge score threshold of the captions/QA jobs (paper: 7)"})
    max_residual_px: float = field(default=8.0, metadata={"min": 0, "help": "the pairs job's residual limit, drawn on the residual figure"})
    accept_partly: bool = field(default=False, metadata={"help": "review: count 'partly correct' as accepted"})
    title: str = field(default="changeforge dataset report", metadata={"help": "page title"})


def load_inputs(uris: list[str]) -> dict:
    """Tables by job kind from the given outputs (the first output of each kind is used)."""
    found: dict = {"uris": {}}
    for uri in uris:
        store = Store(uri)
        kinds = output_kinds(store)
        if not kinds:
            log.warning("%s holds none of metadata/, captions/, qa/, review/ or A/", uri)
        for kind in sorted(kinds):
            if kind in found["uris"]:
                log.warning("%s: a second %s output; using %s", uri, kind, found["uris"][kind])
                continue
            found["uris"][kind] = store.uri()
            if kind == "pairs_job":
                found["pairs_job"] = {t: read_current(store, t) for t in ("metadata", "pairs", "labels")}
            elif kind in ("captions", "qa"):
                found[kind] = {t: read_current(store, t) for t in (kind, "pairs", "usage")}
            elif kind == "review":
                found["review"] = read_current(store, "review")
    return found


def compute(cfg: ReportConfig, data: dict) -> tuple[dict, dict]:
    """``stats`` (JSON-ready) and ``tables`` (by section) from the loaded tables."""
    stats: dict = {"inputs": data["uris"]}
    tables: dict = {k: [] for k in ("pairs_job", "car", "masks", "captions", "qa", "usage", "review")}
    car = None
    if "captions" in data:
        c = data["captions"]
        stats["captions"] = caption_stats(c["captions"], c["pairs"], cfg.pass_score)
        tables["captions"].append(caption_table(stats["captions"]))
        if c["pairs"] is not None and "car" in c["pairs"]:
            car, car_source = c["pairs"]["car"], "captions job pairs/"
    if "qa" in data:
        q = data["qa"]
        stats["qa"] = qa_stats(q["qa"], cfg.pass_score)
        tables["qa"].append(qa_table(stats["qa"]))
        if car is None and q["pairs"] is not None and "car" in q["pairs"]:
            car, car_source = q["pairs"]["car"], "QA job pairs/"
    if "pairs_job" in data and data["pairs_job"]["metadata"] is not None:
        p = data["pairs_job"]
        stats["pairs_job"] = pairs_job_stats(p["metadata"], p["pairs"], p["labels"])
        tables["pairs_job"] += [pairs_job_table(stats["pairs_job"])]
        if stats["pairs_job"]["rejected"]:
            tables["pairs_job"].append(reject_reason_table(stats["pairs_job"]))
        if car is None and p["labels"] is not None and len(p["labels"]):
            car, car_source = pairs_job_car(p["metadata"], p["labels"]), "pairs job labels/ and metadata/"
    if car is not None and car.notna().any():
        stats["car"] = dict(car_stats(car), source=car_source)
        tables["car"].append(car_table(stats["car"]))
    usage = {job: usage_stats(data[job]["usage"]) for job in ("captions", "qa")
             if job in data and data[job]["usage"] is not None}
    if usage:
        stats["usage"] = usage
        tables["usage"].append(usage_table(usage))
    if data.get("review") is not None:
        stats["review"] = summarize_reviews(data["review"], accept_partly=cfg.accept_partly)
        tables["review"] = review_result_tables(stats["review"])
    dataset = _dataset(cfg, data)
    if dataset:   # how the masks were made: the dataset's class scheme and annotation summary
        classes, summary = read_classes(Store(dataset)), read_summary(Store(dataset))
        if classes or summary:
            stats["masks"] = {"dataset": dataset, "classes": classes, "annotation_summary": summary}
            tables["masks"].append(mask_table(classes, summary))
    stats["_car_values"] = car
    return stats, tables


def _dataset(cfg: ReportConfig, data: dict) -> str | None:
    """The dataset behind the inputs (``--images``, else an input holding images or the one a source.json names)."""
    return cfg.images or data["uris"].get("images") or next((d for d in map(dataset_of, data["uris"].values()) if d), None)


def draw_figures(cfg: ReportConfig, data: dict, stats: dict, folder: Path) -> dict[str, list[Figure]]:
    folder.mkdir(parents=True, exist_ok=True)
    out: dict[str, list[Figure]] = {k: [] for k in ("pairs_job", "car", "captions", "qa", "review")}

    def add(section, key, title, path, caption=""):
        out[section].append(Figure(key, title, Path(path).read_bytes(), caption))

    car = stats.get("_car_values")
    if "car" in stats:
        pct = 100 * car.dropna().to_numpy(dtype=float)
        add("car", "car", "Change area ratio", fig.car_histogram(pct, folder / "car_distribution.png",
            "Distribution of change area ratio (CAR)"), f"(paper Fig. 2; from the {stats['car']['source']})")
        classes = stats["car"]["classes"]
        add("car", "magnitude", "Change-magnitude classes",
            fig.bar_chart(list(classes), list(classes.values()), folder / "magnitude_classes.png",
                          "Change-magnitude classes by CAR", ylabel="image pairs"))
    if "captions" in stats:
        c = data["captions"]["captions"]
        add("captions", "caption_scores", "Caption judge scores",
            fig.score_histogram(c["overall"].dropna().to_numpy(float), folder / "caption_scores.png",
                                "Judge score distribution, captions", cfg.pass_score), "(paper Fig. 4)")
        sel = c[c["selected"].fillna(False).astype(bool)]["caption"].dropna().tolist()
        add("captions", "wordcloud", "Word cloud of selected captions",
            fig.word_cloud(sel, folder / "caption_wordcloud.png", cfg.seed), "(paper Fig. 5)")
    if "qa" in stats:
        q = data["qa"]["qa"]
        add("qa", "qa_scores", "QA judge scores", fig.score_histogram(
            q["overall"].dropna().to_numpy(float), folder / "qa_scores.png", "Judge score distribution, QA pairs",
            cfg.pass_score), "(paper Fig. 7)")
        types = stats["qa"]["total"]["selected_by_question_type"]
        types = dict(sorted(types.items(), key=lambda kv: -kv[1]))
        add("qa", "question_types", "Question types", fig.bar_chart(
            list(types), list(types.values()), folder / "question_types.png",
            "Question types of selected QA pairs", ylabel="QA pairs", horizontal=True), "(paper Fig. 8)")
    if "pairs_job" in stats:
        p = stats["pairs_job"]
        if p["reject_reasons"]:
            reasons = dict(sorted(p["reject_reasons"].items(), key=lambda kv: -kv[1]))
            add("pairs_job", "reject_reasons", "Reject reasons", fig.bar_chart(
                list(reasons), list(reasons.values()), folder / "reject_reasons.png",
                "Why slices were rejected", ylabel="slices", horizontal=True, colour="#d62728"))
        m = data["pairs_job"]["metadata"]
        has = m["residual_px"].notna()
        if has.any():
            add("pairs_job", "residuals", "Screening residuals", fig.residual_histogram(
                m.loc[has, "residual_px"].to_numpy(float), (m.loc[has, "status"] == "accepted").to_numpy(),
                folder / "residuals.png", cfg.max_residual_px))
    return out


def _read_image(store: Store, rel: str | None, mask: bool = False) -> np.ndarray | None:
    if not rel:
        return None
    try:
        raw = np.frombuffer(store.read_bytes(rel), np.uint8)
    except (FileNotFoundError, OSError):
        return None
    if mask:
        m = cv2.imdecode(raw, cv2.IMREAD_GRAYSCALE)
        return None if m is None else np.where(m > 0, 255, 0).astype(np.uint8)
    img = cv2.imdecode(raw, cv2.IMREAD_COLOR)
    return None if img is None else cv2.cvtColor(img, cv2.COLOR_BGR2RGB)


def gallery(cfg: ReportConfig, data: dict) -> list[GalleryItem]:
    images_uri = _dataset(cfg, data)
    captions = data.get("captions", {}).get("captions")
    qa = data.get("qa", {}).get("qa")
    by_caption = {} if captions is None else {
        k: g.sort_values("candidate_index")["caption"].tolist()
        for k, g in captions[captions["selected"].fillna(False).astype(bool)].groupby("pair_id")}
    by_qa = {} if qa is None else {
        k: list(zip(g.sort_values("qa_index")["question"], g.sort_values("qa_index")["answer"]))
        for k, g in qa[qa["selected"].fillna(False).astype(bool)].groupby("pair_id")}
    candidates = sorted(set(by_caption) | set(by_qa))
    if not candidates and "pairs_job" in data and data["pairs_job"]["metadata"] is not None:
        m = data["pairs_job"]["metadata"]
        candidates = sorted(m.loc[m["status"] == "accepted", "slice_id"])
    if not candidates or cfg.gallery <= 0:
        return []
    rng = np.random.default_rng(cfg.seed)
    pick = sorted(rng.choice(candidates, size=min(cfg.gallery, len(candidates)), replace=False).tolist())
    index = ImageIndex(Store(images_uri)) if images_uri else None
    car = {}
    for job in ("captions", "qa"):
        pairs = data.get(job, {}).get("pairs")
        if pairs is not None and "car" in pairs:
            car.update(pairs.set_index("pair_id")["car"].to_dict())
    items = []
    for pid in pick:
        paths = index.paths(pid) if index else {}
        store = index.store if index else None
        imgs = {"pre": _read_image(store, paths.get("A")) if store else None,
                "post": _read_image(store, paths.get("B")) if store else None,
                "mask": _read_image(store, paths.get("label"), mask=True) if store else None}
        meta = f"CAR {100 * car[pid]:.1f}%" if pid in car and car[pid] == car[pid] else ""
        items.append(GalleryItem(pid, meta, imgs, by_caption.get(pid, []), by_qa.get(pid, [])))
    return items


def run(cfg: ReportConfig) -> dict:
    out = Path(cfg.output)
    out.mkdir(parents=True, exist_ok=True)
    data = load_inputs(list(cfg.input))
    stats, tables = compute(cfg, data)
    figures = draw_figures(cfg, data, stats, out / "figures")
    stats.pop("_car_values", None)
    stats["tables"] = {t.key: t.as_dict() for ts in tables.values() for t in ts}
    stats["figures"] = sorted(p.name for p in (out / "figures").glob("*.png"))
    order = [("pairs_job", "Bitemporal pairs"), ("car", "Change magnitude"), ("masks", "Change masks"),
             ("captions", "Captions"),
             ("qa", "Question answering"), ("usage", "Tokens and cost"), ("review", "Human review")]
    md = "\n".join(markdown_table(t) for key, _ in order for t in tables[key])
    sections = [(key, heading, tables[key], figures.get(key, [])) for key, heading in order]
    page = render_page(cfg.title, "from " + ", ".join(f"{k}: {v}" for k, v in data["uris"].items()), sections,
                       gallery(cfg, data), cfg.gallery_side)
    stats["made_from"] = pair_lineage(data)   # per pair, what the report counted (operators.report.made_from)
    _write(out / "stats.json", json.dumps(stats, indent=1, default=_json_default))
    _write(out / "tables.md", md)
    _write(out / "index.html", page)
    return stats


def _json_default(value):
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    raise TypeError(type(value))


def _write(path: Path, text: str) -> None:
    """Whole file or nothing (a crash never leaves half a page)."""
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, encoding="utf-8", suffix=".tmp") as f:
        f.write(text)
    os.chmod(f.name, 0o644)
    os.replace(f.name, path)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jobs.report", description=__doc__.split("\n\n")[0])
    add_config_args(ap, ReportConfig, "report", skip=("input",))
    validation.attach(ap.add_argument("--input", nargs="+", required=True, dest="input", help=ReportConfig.__dataclass_fields__["input"].metadata["help"]), {"path": "must_exist"})
    return ap


def parse_args(argv: list[str] | None = None) -> ReportConfig:
    return config_from_args(ReportConfig, parse_job_args(build_parser(), argv))


def status(cfg: ReportConfig) -> dict:
    """The pairs the report counted against today's tables (operators.report.made_from), reading the
    tables only (no figure, no image): a pair whose captions, QA pairs or review verdicts changed since
    is stale (caption, QA, review), one not in the report yet missing. No report yet: every pair missing."""
    path = Path(cfg.output) / "stats.json"
    made = json.loads(path.read_text()).get("made_from") if path.exists() else None
    today = pair_lineage(load_inputs(list(cfg.input)))
    recorded = {pid: None for pid in today} if made is None and path.exists() else (made or {})
    return lineage.keyed_status(recorded, today)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = parse_args(argv)
    stats = run(cfg)
    print((Path(cfg.output) / "tables.md").read_text())
    print(f"report: {cfg.output}/index.html ({len(stats['figures'])} figures), stats.json, tables.md")
    return 0


if __name__ == "__main__":
    from operators.process_exit import run as run_process    # this module may have its own run
    run_process(main)
