"""What a release is built from: the pairs of a dataset root (a pairs job output or any LEVIR-CD layout,
flat or with train/ val/ test/ folders), the captions and QA of the language jobs, and the licences
the inputs declare.

A pair is its id (the file-name stem), its split, the relative paths of its files by role (``A``, ``B``,
``label``, ``label1``, ``label2``) and, for a pairs job output, its lineage (location, dates, scenes,
sensor, bounds). Files that cannot form a pair become error rows, never silently dropped.
"""
from __future__ import annotations

import json
import math
import os
import posixpath
import re
from dataclasses import dataclass, field

import pandas as pd

from operators.io.storage import Store
from operators.io import lineage
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
    inputs = [str(run["input"]) for run in ([] if runs is None else runs.to_dict("records")) if known(run.get("input"))]
    for r in accepted.sort_values("slice_id").to_dict("records"):
        r = {k: (v if not _missing(v) else None) for k, v in r.items()}   # NaN from pandas is "unknown", not "nan"
        sid = r["slice_id"]
        sensors = sorted({str(platform[r[k]]) for k in ("pre_scene", "post_scene") if known(platform.get(r[k]))})
        lineage = {
            "location": r.get("location"), "pre_date": r.get("pre_date"), "post_date": r.get("post_date"),
            "pre_scene": r.get("pre_scene"), "post_scene": r.get("post_scene"),
            "pre_source": [portable_source(u, inputs) for u in _sources(r, "pre", scene_uri)],
            "post_source": [portable_source(u, inputs) for u in _sources(r, "post", scene_uri)],
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


def _missing(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v)) or v is pd.NaT


def known(v) -> bool:
    """A value that says something: not None, NaN, an empty string or the text "nan"."""
    return not _missing(v) and str(v).strip().lower() not in ("", "nan", "none", "null")


# -- sources that travel -----------------------------------------------------------------------------
def _local(uri: str) -> str | None:
    """The local path of ``uri`` (a path or ``file://``), or None for a URI a reader elsewhere can follow."""
    if uri.startswith("file://"):
        return uri[len("file://"):]
    return None if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", uri) else uri


def portable_source(uri: str, inputs: list[str]) -> str:
    """A scene's source as a release gives it: URIs (``s3://``, ``https://``, STAC hrefs) as they are;
    a local file relative to the input of the run that read it (``naip/<file>.tif`` for a run on
    ``.../data/naip``), else by its file name; never an absolute path of the machine that built it."""
    path = _local(str(uri))
    if path is None:
        return str(uri)
    path = os.path.normpath(path).replace(os.sep, "/")
    for given in sorted(inputs, key=len, reverse=True):
        root = _local(given)
        if root is None:
            continue
        root = os.path.normpath(root).replace(os.sep, "/")
        if root.lower().endswith((".csv", ".parquet")):   # a manifest: its rows name files beside it
            root = posixpath.dirname(root) or "."
        label = portable_uri(root)
        if os.path.isabs(root) and os.path.isabs(path):
            if path.startswith(root.rstrip("/") + "/"):
                return posixpath.join(label, path[len(root.rstrip("/")) + 1:])
        elif "/" + root.strip("/") + "/" in "/" + path:   # the run's input as typed, inside the path as read
            return posixpath.join(label, ("/" + path).split("/" + root.strip("/") + "/", 1)[1])
    return path if not os.path.isabs(path) else posixpath.basename(path)


def portable_uri(uri: str) -> str:
    """An input as a release names it: a URI as given; a local folder or file by its name (the
    release does not know where its reader keeps it)."""
    path = _local(str(uri))
    if path is None:
        return str(uri)
    path = os.path.normpath(path)
    if not os.path.isabs(path):
        return path.replace(os.sep, "/")
    return posixpath.basename(path.rstrip("/")) or "."


# An absolute path in running text: a "/" that no word, ":" or "/" precedes (not "0/255", not a URL).
_ABSOLUTE = re.compile(r"(?<![\w:/.~-])/(?:[\w.@+=,-]+/)*[\w.@+=,-]+/?")


def _on_this_machine(path: str) -> bool:
    """``path`` starts with a top-level folder that exists here (``/tmp``, ``/home``, ``/work`` ...)."""
    top = path.strip("/").split("/")[0]
    return bool(top) and path.count("/") >= 2 and os.path.isdir("/" + top)


def portable(doc, roots: list[str]):
    """``doc`` (JSON-like) with every absolute local path under one of ``roots`` (and the working
    folder) written as :func:`portable_uri` gives its root, in any string, keys untouched."""
    local = sorted({os.path.normpath(os.path.abspath(p)) for p in roots if p and _local(p) is not None}
                   | {os.getcwd()}, key=len, reverse=True)

    def fix(text: str) -> str:
        for root in local:
            if root in text and root != "/":
                label = portable_uri(root) if root != os.getcwd() else "."
                text = re.sub(re.escape(root) + r"(?=/|\b|$)", label, text)
        # Any other absolute path of this machine (a pairs run's archive, its label maps): by its name.
        return _ABSOLUTE.sub(lambda m: posixpath.basename(m[0].rstrip("/")) if _on_this_machine(m[0]) else m[0],
                             text)

    def walk(v):
        if isinstance(v, str):
            return fix(v)
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [walk(x) for x in v]
        if isinstance(v, float) and math.isnan(v):
            return None
        return v
    return walk(doc)


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
        _refuse_unfinished_job(store, "--captions", "captions")
        doc = _json_doc(uri, "LevirCCcaptions.json")
        return LanguageSource(uri, {stem(i["filename"]): {"captions": [s["raw"].strip() for s in i["sentences"]],
                                                          "perspectives": []} for i in doc["images"]})
    table = read_current(store, "captions")
    by_pair = {}
    for p in pairs.to_dict("records"):
        by_pair[stem(p["filename"])] = {
            "captions": [str(c) for c in (p["selected_captions"] if p["selected_captions"] is not None else [])],
            "perspectives": [str(c) for c in (p["selected_perspectives"] if p["selected_perspectives"] is not None else [])],
            "lineage": lineage.loads(p.get("lineage")),   # what the captions were made from (None: not recorded)
        }
    return LanguageSource(uri, by_pair, table, _language_runs(pairs, table, ("generate_prompt_version", "judge_prompt_version")))


def read_qa(uri: str) -> LanguageSource:
    """Selected QA pairs per image pair from a QA job output (``qa/`` and ``pairs/``), or a ``VQA.json``."""
    store = Store(uri)
    qa = read_current(store, "qa")
    if qa is None:
        _refuse_unfinished_job(store, "--qa", "QA")
        doc = _json_doc(uri, "VQA.json")
        return LanguageSource(uri, {stem(i["filename"]): {"qa": [{"type": q["type"], "question": q["question"],
                                                                  "answer": q["answer"]} for q in i["qa"]]}
                                    for i in doc["images"]})
    pairs = read_current(store, "pairs")
    names = {} if pairs is None else dict(zip(pairs["pair_id"], pairs["filename"]))
    made_from = {} if pairs is None or "lineage" not in pairs else dict(zip(pairs["pair_id"], pairs["lineage"]))
    by_pair: dict[str, dict] = {}
    for r in qa[qa["selected"].fillna(False).astype(bool)].sort_values(["pair_id", "qa_index"]).to_dict("records"):
        key = stem(names.get(r["pair_id"], r["filename"]))
        by_pair.setdefault(key, {"qa": [], "lineage": lineage.loads(made_from.get(r["pair_id"]))})["qa"].append(
            {"type": r["question_type"], "question": r["question"], "answer": r["answer"]})
    return LanguageSource(uri, by_pair, qa, _language_runs(qa, qa, ("generate_prompt_version", "judge_prompt_version")))


def _refuse_unfinished_job(store: Store, flag: str, what: str) -> None:
    """A job output whose tables hold no finished pair is not a JSON file to publish as it is: the
    card would say its models and prompts were not recorded, and the release would carry nothing."""
    if not uri_is_file(store.uri()) and (store.exists("source.json") or store.list("errors", suffixes=(".parquet",))):
        raise SystemExit(f"{flag} {portable_uri(store.uri())}: a {what} job output with no finished pair "
                         f"(see its errors/); rerun the {what} job until pairs finish, then publish")


def uri_is_file(uri: str) -> bool:
    return uri.endswith(".json")


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
# The known terms of the data bundled in the repository's data/ (docs/data.md), by folder name.
BUNDLED_TERMS = {"levir-cd": ("LicenseRef-LEVIR-CD-academic", "the bundled LEVIR-CD samples are for academic use "
                              "(Chen & Shi, 2020; docs/data.md)"),
                 "levir-cc": ("LicenseRef-LEVIR-CD-academic", "the bundled LEVIR-CC captions go with the LEVIR-CD "
                              "samples, for academic use (docs/data.md)")}
BUNDLED_DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "data")


def bundled_terms(uri: str) -> tuple[str, str] | None:
    """(licence id, why) of an input inside the repository's bundled data/, else None."""
    path = _local(str(uri))
    if path is None:
        return None
    rel = os.path.relpath(os.path.realpath(path), os.path.realpath(BUNDLED_DATA)).replace(os.sep, "/")
    return None if rel.startswith("..") else BUNDLED_TERMS.get(rel.split("/")[0])


def declared_licence(uri: str) -> str | None:
    """The SPDX id an input declares: the first non-empty line of ``licence.txt`` (or ``license.txt``) at its
    root, or the ``licence`` field of a release's ``release.json``, or the known terms of the repository's
    bundled data (:data:`BUNDLED_TERMS`); None when it declares none."""
    if bundled_terms(uri):
        return bundled_terms(uri)[0]
    store = Store(uri) if not uri.endswith(".json") else Store(posixpath.dirname(uri) or ".")
    for name in LICENCE_FILES:
        if store.exists(name):
            lines = [ln.strip() for ln in store.read_bytes(name).decode().splitlines() if ln.strip()]
            return lines[0] if lines else None
    if store.exists("release.json"):
        return json.loads(store.read_bytes("release.json")).get("licence")
    return None


def resolve_licence(declared: dict[str, str | None], given: str = "", override: str = "") -> tuple[str, str]:
    """(licence, how it was decided) from the inputs' declarations, ``--licence`` and ``--licence-override``.

    Refuses (SystemExit) when no input declares one and none is given, or the inputs disagree and
    none is given, or ``--licence`` would relabel an input's declared licence without an override
    (the reason why the release may carry another licence), which the returned note records."""
    known = {k: v for k, v in declared.items() if v}
    if given:
        other = {k: v for k, v in known.items() if v != given}
        named = ", ".join(f"{k}: {v}" for k, v in sorted(other.items()))
        if other and not override.strip():
            raise SystemExit(f"refusing to relabel: the inputs declare {named}, and --licence {given} would "
                             f"publish them under another licence; publish under theirs, or say why with "
                             f'--licence-override "<why>" (recorded in the release)')
        note = "--licence" + (f" (inputs declare {named}; overridden: {' '.join(override.split())})" if other else "")
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
