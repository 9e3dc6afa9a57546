"""The dataset card (``README.md`` at the release root): YAML front matter that the Hugging Face Hub and
``datasets.load_dataset`` read (licence, the ``configs:`` block with per-split ``data_files``), then the
card written from the run: how to load it, the layout and mask encodings, the statistics of
``jobs.report`` (computed by :mod:`operators.report.stats`), the recipes and their deviations, known
limitations, the licence and the citation.
"""
from __future__ import annotations

import json

import pandas as pd

from operators.report.markdown import markdown_table
from operators.report.stats import (Table, car_stats, car_table, caption_stats, caption_table, pairs_job_stats,
                                    pairs_job_table, qa_stats, qa_table, reject_reason_table)
from operators.pairs.selection.splits import SPLITS
from operators.publish.sources import stem

# Hub licence ids are lower-case SPDX ids; others are given as "other" with a name.
HUB_LICENCES = {"apache-2.0", "mit", "bsd-2-clause", "bsd-3-clause", "cc0-1.0", "cc-by-4.0", "cc-by-sa-4.0",
                "cc-by-nc-4.0", "cc-by-nc-sa-4.0", "cc-by-nd-4.0", "cc-by-nc-nd-4.0", "cc-by-3.0", "odbl",
                "pddl", "odc-by", "cdla-permissive-2.0", "gpl-3.0", "unlicense"}

CITATIONS = {
    "s2looking": "@article{shen2021s2looking,\n  title={S2Looking: A Satellite Side-Looking Dataset for Building "
                 "Change Detection},\n  author={Shen, Li and Lu, Yao and Chen, Hao and Wei, Hao and Xie, Donghai and "
                 "Yue, Jiabao and Chen, Rui and Lv, Shouye and Jiang, Bitao},\n  journal={Remote Sensing},\n  "
                 "volume={13},\n  number={24},\n  pages={5094},\n  year={2021}\n}",
    "jl1ccqa": "@misc{jl1ccqa,\n  title={JL1-CC\\&QA: Extending the JL1-CD Benchmark with Change Captioning "
               "and Question Answering},\n  note={https://github.com/circleLZY/JL1-CD}\n}",
}


def hub_licence(spdx: str) -> dict:
    low = spdx.lower()
    return {"license": low} if low in HUB_LICENCES else {"license": "other", "license_name": spdx}


def _yaml_str(v: str) -> str:
    return json.dumps(v, ensure_ascii=False)  # a JSON string is a valid YAML scalar


def front_matter(name: str, licence: str, splits: dict[str, int], has_captions: bool, has_qa: bool) -> str:
    """The YAML block: licence, tags, size, and ``configs`` with one ``data_files`` glob per split."""
    n = sum(splits.values())
    size = "n<1K" if n < 1000 else "1K<n<10K" if n < 10_000 else "10K<n<100K" if n < 100_000 else "100K<n<1M"
    tasks = ["image-segmentation"] + (["image-to-text"] if has_captions else []) + \
        (["visual-question-answering"] if has_qa else [])
    lines = ["---"]
    lines += [f"{k}: {_yaml_str(v)}" for k, v in hub_licence(licence).items()]
    lines += [f"pretty_name: {_yaml_str(name)}", "task_categories:"] + [f"- {t}" for t in tasks]
    lines += ["tags:", "- change-detection", "- remote-sensing", "- satellite-imagery", "- bitemporal"]
    lines += [f"size_categories:\n- {size}", "configs:", "- config_name: default", "  data_files:"]
    for split in [s for s in SPLITS if splits.get(s)]:
        lines += [f"  - split: {split}", f"    path: data/{split}-*.parquet"]
    lines.append("---")
    return "\n".join(lines) + "\n"


def statistics(rows: pd.DataFrame, captions: pd.DataFrame | None, qa: pd.DataFrame | None,
               pairs_job: dict | None) -> tuple[dict, list[Table]]:
    """``jobs.report``'s statistics of the published pairs: ``rows`` has id, split, car; captions / QA
    candidates are restricted to the published pairs and take their release split."""
    stats: dict = {"pairs": {s: int((rows["split"] == s).sum()) for s in SPLITS}}
    stats["pairs"]["total"] = int(len(rows))
    tables = [Table("splits", "Pairs per split", ["Split", "Pairs"],
                    [[s, f"{v:,}"] for s, v in stats["pairs"].items()])]
    if rows["car"].notna().any():
        stats["car"] = car_stats(rows["car"])
        tables.append(car_table(stats["car"]))
    split_of = dict(zip(rows["id"], rows["split"]))
    pair_rows = rows.rename(columns={"id": "pair_id"})[["pair_id", "split"]]
    if captions is not None:
        c = captions.assign(pair_id=captions["filename"].map(stem))
        c = c[c["pair_id"].isin(split_of)].assign(split=lambda d: d["pair_id"].map(split_of))
        if len(c):
            stats["captions"] = caption_stats(c, pair_rows[pair_rows["pair_id"].isin(set(c["pair_id"]))])
            tables.append(caption_table(stats["captions"]))
    if qa is not None:
        q = qa.assign(pair_id=qa["filename"].map(stem))
        q = q[q["pair_id"].isin(split_of)].assign(split=lambda d: d["pair_id"].map(split_of))
        if len(q):
            stats["qa"] = qa_stats(q)
            tables.append(qa_table(stats["qa"]))
    if pairs_job and pairs_job.get("metadata") is not None:
        stats["pairs_job"] = pairs_job_stats(pairs_job["metadata"], pairs_job.get("pairs"), pairs_job.get("labels"))
        stats["pairs_job"].pop("car", None)   # the release's CAR above is the published pairs'
        tables.append(pairs_job_table(stats["pairs_job"]))
        if stats["pairs_job"]["rejected"]:
            tables.append(reject_reason_table(stats["pairs_job"]))
    return stats, tables


def render(info: dict, tables: list[Table]) -> str:
    """The whole card. ``info``: name, version, date, licence, licence_note, splits, has_two_maps, has_captions,
    has_qa, recipes (list of lines), limitations (list), excluded (int), language (RAI dict), inputs."""
    name, version = info["name"], info["version"]
    body = [front_matter(name, info["licence"], info["splits"], info["has_captions"], info["has_qa"]),
            f"# {name} {version}", "",
            f"A bitemporal change-detection release of {sum(info['splits'].values())} image pairs "
            "(pre image, post image, change mask"
            + ((", one map per class: " + ", ".join(c.name for c in info["classes"].classes)) if info["has_two_maps"]
               and info.get("classes") is not None and info["classes"].declared
               else ", new/demolished building maps" if info["has_two_maps"] else "")
            + (", change captions" if info["has_captions"] else "") + (", question-answer pairs" if info["has_qa"] else "")
            + f"), published {info['date']} with changeforge.", "",
            "## Loading", "", "```python", "from datasets import load_dataset",
            f'ds = load_dataset("path/to/{name}")          # or the Hub repository; splits: '
            + ", ".join(s for s in SPLITS if info["splits"].get(s)),
            'ds["' + next(s for s in SPLITS if info["splits"].get(s)) + '"][0]["pre"]   # a PIL image', "```", "",
            "Parquet with image columns: `data/<split>-<nnnnn>.parquet` (images as PNG bytes). The same pairs in "
            "the folder layout open-cd, torchgeo and LEVIR-CD code read:", "",
            "```", "<split>/A/<id>.png      pre-change image (RGB)", "<split>/B/<id>.png      post-change image (RGB)",
            "<split>/label/<id>.png  change mask, single channel: 0 = no change, 255 = change"]
    classes = info.get("classes")
    if info["has_two_maps"] and classes is not None and classes.declared:
        body += [f"<split>/{c.folder}/<id>.png {classes.describe(c)}, 0/255" for c in classes.classes]
        body += ["<split>/label_index/<id>.png  " + ", ".join(f"{v} = {n}" for v, n in classes.index_values().items())
                 + " (a pixel in several maps takes the first; label_classes.json lists the classes in order)"]
    elif info["has_two_maps"]:
        body += ["<split>/label1/<id>.png new buildings, 0/255", "<split>/label2/<id>.png demolished buildings, 0/255",
                 "<split>/label_index/<id>.png  0 = no change, 1 = new, 2 = demolished (a pixel in both maps is 1)"]
    body += [(f"<split>/captions.json   LEVIR-CC format" if info["has_captions"] else ""),
             (f"<split>/qa.json         questions and answers per pair" if info["has_qa"] else ""), "```", "",
             "Masks are 0/255: with open-cd / mmseg set `reduce_zero_label=False` and map 255 to 1 (a loader that "
             "treats 255 as `ignore_index` would ignore every changed pixel). `croissant.json` describes the "
             "release for `mlcroissant`; `stac/catalog.json` is a STAC catalogue (label extension, `ml-aoi:split`, "
             "source scenes); `SHA256SUMS` verifies every file (`sha256sum -c SHA256SUMS`); `release.json` "
             "records the inputs, run ids, options and code version; `CHANGELOG.md` the changes between versions.",
             "", "## Statistics", ""]
    body += [markdown_table(t) for t in tables]
    body += ["## How it was made", ""] + [f"- {r}" for r in info["recipes"]] + [""]
    masks = info.get("masks") or {}
    if masks:
        body += ["### Change masks", ""] + [f"- {k}: {v}" for k, v in masks.items()] + [""]
    people = info.get("excluded_by_people") or []
    if people:
        body += [f"Excluded by the annotators ({len(people)} pair(s), also in `excluded.json`):", ""]
        body += [f"- {e['item']}: {e['message']}" for e in people[:50]]
        body += ([f"- ... and {len(people) - 50} more (excluded.json)"] if len(people) > 50 else []) + [""]
    lang = info.get("language") or {}
    if lang:
        body += ["### Annotations", ""] + [f"- {k}: {v}" for k, v in lang.items()] + [""]
    body += ["## Known limitations", ""] + [f"- {x}" for x in info["limitations"]] + [""]
    body += ["## Licence", "", f"{info['licence']} ({info['licence_note']}).", "",
             "## Citation", "", "Cite this release:", "", "```bibtex",
             f"@misc{{{_key(name)}_{version.replace('.', '_')},\n  title={{{name}}},\n  version={{{version}}},\n"
             f"  year={{{info['date'][:4]}}},\n  note={{Built with changeforge}}\n}}", "```", "",
             "and the recipes it follows:", "", "```bibtex", CITATIONS["s2looking"], "", CITATIONS["jl1ccqa"], "```", ""]
    return "\n".join(b for b in body if b is not None)


def _key(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name.lower()).strip("_") or "dataset"
