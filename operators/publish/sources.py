"""What a release is built from: the pairs of a dataset root (a pairs job output or any LEVIR-CD layout,
flat or with train/ val/ test/ folders), the captions and QA of the language jobs, and the licences
the inputs declare.

A pair is its id (the file-name stem), its split, the relative paths of its files by role (``A``, ``B``,
``label``, ``label1``, ``label2``) and, for a pairs job output, its lineage (location, dates, scenes,
sensor, bounds). Files that cannot form a pair become error rows, never silently dropped.
"""
from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass, field

import pandas as pd

from operators.io.storage import Store
from operators.language.caption_ops import IMAGE_SUFFIXES, discover_pairs, split_lists
from operators.review.outputs import read_current

ROLES = ("A", "B", "label", "label1", "label2")
LICENCE_FILES = ("licence.txt", "license.txt")


@dataclass
class PairSource:
    pair_id: str
    split: str
    files: dict[str, str]                       # role -> path relative to the dataset root
    meta: dict = field(default_factory=dict)    # lineage (pairs job outputs)


@dataclass
class DatasetSource:
    uri: str
    kind: str                                   # "pairs_job" | "levir"
    pairs: list[PairSource]
    errors: list[dict]
    runs: list[dict] = field(default_factory=list)
    tables: dict = field(default_factory=dict)  # pandas tables for the statistics (pairs job)


def stem(rel: str) -> str:
    return posixpath.splitext(posixpath.basename(rel))[0]


def error(item: str, stage: str, message: str) -> dict:
    return {"item": item, "stage": stage, "message": message}


def _files_by_stem(store: Store, prefix: str) -> dict[str, dict[str, str]]:
    files: dict[str, dict[str, str]] = {}
    for role in ROLES:
        for rel in store.list(f"{prefix}{role}", suffixes=IMAGE_SUFFIXES):
            if posixpath.dirname(rel) == f"{prefix}{role}":
                files.setdefault(stem(rel), {})[role] = rel
    return files


def read_dataset(uri: str, default_split: str = "train") -> DatasetSource:
    """The pairs of a dataset root (see the module docstring); raises SystemExit when it holds none."""
    store = Store(uri)
    if store.list("metadata", suffixes=(".parquet",)):
        return _pairs_job(store)
    return _levir(store, default_split)


def _pairs_job(store: Store) -> DatasetSource:
    meta = read_current(store, "metadata")
    scenes = read_current(store, "scenes")
    runs = read_current(store, "runs", keys=("run_id",))
    platform, scene_uri = {}, {}
    if scenes is not None:
        scene_uri = dict(zip(scenes["scene_id"], scenes["uri"]))
        if "platform" in scenes:
            platform = dict(zip(scenes["scene_id"], scenes["platform"]))
    files = _files_by_stem(store, "")
    accepted = meta[meta["status"] == "accepted"]
    pairs, errors = [], []
    for r in accepted.sort_values("slice_id").to_dict("records"):
        sid = r["slice_id"]
        sensors = sorted({str(platform.get(r[k])) for k in ("pre_scene", "post_scene") if platform.get(r[k])})
        lineage = {
            "location": r.get("location"), "pre_date": r.get("pre_date"), "post_date": r.get("post_date"),
            "pre_scene": r.get("pre_scene"), "post_scene": r.get("post_scene"),
            "pre_source": _sources(r, "pre", scene_uri), "post_source": _sources(r, "post", scene_uri),
            "sensor": "/".join(sensors) or None, "crs": r.get("crs"),
            "bounds": [float(v) for v in r["bounds"]] if r.get("bounds") is not None else None,
            "source_pair_id": r.get("pair_id"), "source_run_id": r.get("run_id"),
        }
        pairs.append(PairSource(sid, str(r["split"]), files.pop(sid, {}), lineage))
    for sid in sorted(files):
        errors.append(error(sid, "inputs", "image files with no accepted slice of this name in metadata/"))
    tables = {"metadata": meta, "pairs": read_current(store, "pairs"), "labels": read_current(store, "labels")}
    return DatasetSource(store.uri(), "pairs_job", pairs, errors,
                         [] if runs is None else runs.to_dict("records"),
                         tables)


def _sources(row: dict, side: str, scene_uri: dict[str, str]) -> list[str]:
    """Where a side came from: the files read (band assets of a STAC item), else the scene's URI."""
    hrefs = row.get(f"{side}_hrefs")
    out = [] if hrefs is None else [str(h) for h in hrefs]
    if not out and scene_uri.get(row.get(f"{side}_scene")):
        out = [str(scene_uri[row[f"{side}_scene"]])]
    return out


def _levir(store: Store, default_split: str) -> DatasetSource:
    found = discover_pairs(store.uri(), default_split=default_split)
    if not found:
        raise SystemExit(f"{store.uri()} holds no A/ B/ label/ images (flat or under train/ val/ test/) "
                         "and no pairs job metadata/")
    listed = split_lists(store)
    by_prefix: dict[str, dict] = {}
    pairs, errors, seen = [], [], {}
    for p in found:
        prefix = p["pair_id"][: -len(stem(p["filename"]))] if "/" in p["pair_id"] else ""
        if prefix not in by_prefix:
            by_prefix[prefix] = _files_by_stem(store, prefix)
        sid = stem(p["filename"])
        if sid in seen:
            errors.append(error(f"{prefix}{sid}", "inputs", f"the id {sid} is also in {seen[sid]}; ids must be "
                                                        "unique across splits"))
            continue
        seen[sid] = prefix or "the root"
        split = p["split"] if prefix else listed.get(sid, p["split"])
        pairs.append(PairSource(sid, split, by_prefix[prefix].get(sid, {}), {}))
    return DatasetSource(store.uri(), "levir", sorted(pairs, key=lambda p: p.pair_id), errors)


# -- captions and QA ---------------------------------------------------------------------------------
@dataclass
class LanguageSource:
    uri: str
    by_pair: dict[str, dict]                    # file-name stem -> {"captions": [...], ...} / {"qa": [...]}
    table: pd.DataFrame | None = None           # candidates (captions/ or qa/) for the statistics
    runs: list[dict] = field(default_factory=list)


def read_captions(uri: str) -> LanguageSource:
    """Selected captions per pair from a captions job output (``pairs/`` and ``captions/``), or from a
    LEVIR-CC file (``LevirCCcaptions.json``, or a folder holding one)."""
    store = Store(uri)
    pairs = read_current(store, "pairs")
    if pairs is None or "selected_captions" not in pairs:
        doc = _json_doc(uri, "LevirCCcaptions.json")
        return LanguageSource(uri, {stem(i["filename"]): {"captions": [s["raw"].strip() for s in i["sentences"]],
                                                          "perspectives": []} for i in doc["images"]})
    table = read_current(store, "captions")
    by_pair = {}
    for p in pairs.to_dict("records"):
        by_pair[stem(p["filename"])] = {
            "captions": [str(c) for c in (p["selected_captions"] if p["selected_captions"] is not None else [])],
            "perspectives": [str(c) for c in (p["selected_perspectives"] if p["selected_perspectives"] is not None else [])],
        }
    return LanguageSource(uri, by_pair, table, _language_runs(pairs, table, ("generate_prompt_version", "judge_prompt_version")))


def read_qa(uri: str) -> LanguageSource:
    """Selected QA pairs per image pair from a QA job output (``qa/`` and ``pairs/``), or a ``VQA.json``."""
    store = Store(uri)
    qa = read_current(store, "qa")
    if qa is None:
        doc = _json_doc(uri, "VQA.json")
        return LanguageSource(uri, {stem(i["filename"]): {"qa": [{"type": q["type"], "question": q["question"],
                                                                  "answer": q["answer"]} for q in i["qa"]]}
                                    for i in doc["images"]})
    pairs = read_current(store, "pairs")
    names = {} if pairs is None else dict(zip(pairs["pair_id"], pairs["filename"]))
    by_pair: dict[str, dict] = {}
    for r in qa[qa["selected"].fillna(False).astype(bool)].sort_values(["pair_id", "qa_index"]).to_dict("records"):
        key = stem(names.get(r["pair_id"], r["filename"]))
        by_pair.setdefault(key, {"qa": []})["qa"].append(
            {"type": r["question_type"], "question": r["question"], "answer": r["answer"]})
    return LanguageSource(uri, by_pair, qa, _language_runs(qa, qa, ("generate_prompt_version", "judge_prompt_version")))


def _json_doc(uri: str, name: str) -> dict:
    from operators.io.storage import read_uri
    if uri.endswith(".json"):
        return json.loads(read_uri(uri))
    store = Store(uri)
    if not store.exists(name):
        raise SystemExit(f"{uri} is neither a job output with tables nor holds {name}")
    return json.loads(store.read_bytes(name))


def _language_runs(pairs: pd.DataFrame, table: pd.DataFrame | None, prompt_cols: tuple[str, str]) -> list[dict]:
    """One record per run that wrote the selected rows: models, prompt versions, overall mode, validators."""
    src = table if table is not None else pairs
    cols = [c for c in ("run_id", "model", "judge_model", *prompt_cols, "overall_mode", "validators") if c in src]
    out = []
    for _, g in src[cols].drop_duplicates().groupby("run_id", sort=True):
        rec = {c: sorted({str(v) for v in g[c].dropna()}) for c in cols if c != "run_id"}
        out.append({"run_id": str(g["run_id"].iloc[0]), **{k: (v[0] if len(v) == 1 else v) for k, v in rec.items()}})
    return out


# -- licences ----------------------------------------------------------------------------------------
def declared_licence(uri: str) -> str | None:
    """The SPDX id an input declares: the first non-empty line of ``licence.txt`` (or ``license.txt``) at its
    root, or the ``licence`` field of a release's ``release.json``; None when it declares none."""
    store = Store(uri) if not uri.endswith(".json") else Store(posixpath.dirname(uri) or ".")
    for name in LICENCE_FILES:
        if store.exists(name):
            lines = [ln.strip() for ln in store.read_bytes(name).decode().splitlines() if ln.strip()]
            return lines[0] if lines else None
    if store.exists("release.json"):
        return json.loads(store.read_bytes("release.json")).get("licence")
    return None


def resolve_licence(declared: dict[str, str | None], given: str = "") -> tuple[str, str]:
    """(licence, how it was decided) from the inputs' declarations and ``--licence``.

    Refuses (SystemExit) when no input declares one and none is given, or the inputs disagree and
    none is given. A given licence wins; a declared one that differs is named in the returned note."""
    known = {k: v for k, v in declared.items() if v}
    if given:
        other = {k: v for k, v in known.items() if v != given}
        note = "--licence" + (f" (inputs declare {', '.join(f'{k}: {v}' for k, v in sorted(other.items()))})"
                              if other else "")
        return given, note
    unknown = sorted(k for k, v in declared.items() if not v)
    if unknown:
        raise SystemExit("refusing to publish: the licence of " + ", ".join(unknown) + " is unknown (no "
                         f"{LICENCE_FILES[0]} with an SPDX id at its root); say it with --licence <SPDX id>")
    values = sorted(set(known.values()))
    if len(values) > 1:
        raise SystemExit("refusing to publish: the inputs declare different licences ("
                         + ", ".join(f"{k}: {v}" for k, v in sorted(known.items()))
                         + "); say the release's licence with --licence <SPDX id>")
    return values[0], "declared by " + ", ".join(sorted(known))
