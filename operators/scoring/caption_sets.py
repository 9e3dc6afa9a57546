"""Reading and matching caption predictions and references (pure; no scoring here).

References: the LEVIR-CC file format this project writes (``LevirCCcaptions.json``): ``{"images": [
{"filename", "split", "sentences": [{"raw": ...}], "changeflag"?}]}``. Predictions: a list
``[{"filename": ..., "caption": ...}]`` or a mapping ``{filename: caption}``. Names match by file name;
a name without extension matches the same stem (``test_000001`` = ``test_000001.png``).
"""
from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass, field

from operators.io.storage import read_uri


def name_key(filename: str) -> str:
    """Match key of a file name: its stem (the extension and any folder are ignored)."""
    return posixpath.splitext(posixpath.basename(str(filename).replace("\\", "/")))[0]


def load_json(uri: str):
    try:
        return json.loads(read_uri(uri))
    except FileNotFoundError:
        raise SystemExit(f"jobs.score: no such file: {uri}") from None
    except json.JSONDecodeError as exc:
        raise SystemExit(f"jobs.score: {uri} is not JSON: {exc}") from None


SPLIT_PREFERENCE = ("test", "val", "train")


def pick_split(docs: list, split: str) -> str:
    """``split`` itself, unless it is ``auto``: then the first of test, val, train that the references
    hold (a small dataset can lack a test split), else ``all``."""
    if split != "auto":
        return split
    present = {str(e.get("split", "")) for d in docs if isinstance(d, dict)
               for e in (d.get("images") or []) if isinstance(e, dict)}
    return next((s for s in SPLIT_PREFERENCE if s in present), "all")


@dataclass
class RefImage:
    key: str
    filename: str
    split: str
    refs: list[str]
    changeflag: int | None = None


@dataclass
class Matched:
    """What the scorer needs, and every input that cannot be scored with its reason."""
    images: list[RefImage] = field(default_factory=list)
    predictions: dict[str, str] = field(default_factory=dict)  # key -> caption
    problems: list[dict] = field(default_factory=list)         # {"item", "error_type", "message"}


def read_references(doc: dict, split: str) -> tuple[list[RefImage], list[dict]]:
    """Images of ``split`` (``all``: every split) with their raw reference sentences."""
    if not isinstance(doc, dict) or not isinstance(doc.get("images"), list):
        raise SystemExit('jobs.score: references must be a LEVIR-CC-style JSON object {"images": [...]}')
    images, problems, seen, splits = [], [], set(), set()
    for entry in doc["images"]:
        filename = str(entry.get("filename", ""))
        splits.add(str(entry.get("split", "")))
        if split != "all" and entry.get("split") != split:
            continue
        key = name_key(filename)
        refs = [str(s.get("raw", "")).strip() for s in entry.get("sentences", []) if str(s.get("raw", "")).strip()]
        if not filename:
            problems.append({"item": "?", "error_type": "bad_reference", "message": "image entry without filename"})
        elif key in seen:
            problems.append({"item": filename, "error_type": "duplicate_reference", "message": f"{filename} occurs twice in the references"})
        elif not refs:
            problems.append({"item": filename, "error_type": "no_reference_sentence", "message": f"{filename} has no reference sentence"})
        else:
            seen.add(key)
            flag = entry.get("changeflag")
            images.append(RefImage(key, filename, str(entry.get("split", "")), refs,
                                   None if flag is None else int(bool(flag))))
    if not images and not problems:
        raise SystemExit(f"jobs.score: no reference image in split {split!r} (the references hold: "
                         f"{', '.join(sorted(splits)) or 'nothing'}; --split all scores every split)")
    return images, problems


def read_caption_predictions(obj) -> tuple[list[tuple[str, str]], list[dict]]:
    """``[(filename, caption)]`` from either accepted shape, plus problems for malformed entries."""
    if isinstance(obj, dict):
        return [(str(k), "" if v is None else str(v)) for k, v in obj.items()], []
    if not isinstance(obj, list):
        raise SystemExit('jobs.score: predictions must be [{"filename": ..., "caption": ...}] or {filename: caption}')
    out, problems = [], []
    for i, entry in enumerate(obj):
        if isinstance(entry, dict) and "filename" in entry and isinstance(entry.get("caption"), str):
            out.append((str(entry["filename"]), entry["caption"]))
        else:
            problems.append({"item": f"prediction #{i}", "error_type": "bad_prediction",
                             "message": 'expected {"filename": ..., "caption": "..."}'})
    return out, problems


def match_captions(images: list[RefImage], preds: list[tuple[str, str]], split: str) -> Matched:
    """Pair each reference image with its one prediction; the rest become problems."""
    m = Matched()
    wanted = {img.key: img for img in images}
    for filename, caption in preds:
        key = name_key(filename)
        if key not in wanted:
            m.problems.append({"item": filename, "error_type": "extra_prediction",
                               "message": f"no reference image {filename} in split {split}"})
        elif key in m.predictions:
            m.problems.append({"item": filename, "error_type": "duplicate_prediction",
                               "message": f"second prediction for {filename} ignored"})
        else:
            m.predictions[key] = caption
    for img in images:
        if img.key in m.predictions:
            m.images.append(img)
        else:
            m.problems.append({"item": img.filename, "error_type": "missing_prediction",
                               "message": f"no prediction for {img.filename}"})
    return m
