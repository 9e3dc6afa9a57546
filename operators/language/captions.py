"""Caption logic without Ray or HTTP: prompt templates, reply schemas, scoring and selection, and the
LEVIR-CC caption file.

Selection (JL1-CC, section II-B2): every candidate gets five criterion scores (1-10) from the judge;
its *overall* score is, by ``--overall``,

- ``criteria`` (the default): the mean of the five criterion scores, except that a caption the
  accuracy criterion marks as hallucinated (accuracy <= 4, the band the judge prompt reserves for a
  hallucinated change or object) scores its accuracy instead, so it is always rejected;
- ``judge``: the judge's own ``overall`` field (unconstrained: a judge can give 8 to a caption it
  scored 2 for accuracy);
- ``mean``: the mean of the five criterion scores;
- ``min``: the lowest criterion score (a caption is only as good as its worst aspect).

Candidates with overall < 7 are rejected; of the rest the three best are kept, and every candidate
tied with the third is kept too (so a pair can keep 4 or 5).
"""
from __future__ import annotations

import importlib.resources
import re
import string
from dataclasses import dataclass
from pathlib import Path

PERSPECTIVES = ("change_type", "spatial_location", "visual_appearance", "scale", "implication")
CRITERIA = ("accuracy", "specificity", "spatial_correctness", "naturalness", "informativeness")
OVERALL_MODES = ("criteria", "judge", "mean", "min")
HALLUCINATION_CRITERIA = ("accuracy",)   # criteria whose low band means "hallucinated"
HALLUCINATION_MAX = 4                    # the judge prompt: a hallucinated change or object scores 1-4
# The templates ship as package data of the top-level ``prompts`` package, so an installed wheel finds them
# without a checkout.
PROMPTS_DIR = Path(str(importlib.resources.files("prompts")))


@dataclass(frozen=True)
class PromptTemplate:
    version: str       # file stem, e.g. "caption_generate.v1"; stored with results and in cache keys
    system: str
    user: str

    def render(self, **values) -> tuple[str, str]:
        return (string.Template(self.system).substitute(values),
                string.Template(self.user).substitute(values))


def load_template(name: str, prompts_dir: str | Path | None = None) -> PromptTemplate:
    """Read ``<prompts_dir>/<name>.txt`` (default: the packaged templates) with ``## system`` and
    ``## user`` sections."""
    path = Path(prompts_dir or PROMPTS_DIR) / f"{name}.txt"
    text = path.read_text(encoding="utf-8")
    sections: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"^## (system|user)\s*$", line)
        if m:
            current = m.group(1)
            sections[current] = []
        elif current:
            sections[current].append(line)
    if "user" not in sections:
        raise ValueError(f"{path}: no '## user' section")
    return PromptTemplate(version=path.stem, system="\n".join(sections.get("system", [])).strip(),
                          user="\n".join(sections["user"]).strip())


def generation_schema() -> dict:
    caption = {"type": "string", "minLength": 10}
    return {"type": "object", "properties": {p: caption for p in PERSPECTIVES},
            "required": list(PERSPECTIVES), "additionalProperties": False}


def judge_schema(keys: tuple[str, ...] = PERSPECTIVES) -> dict:
    score = {"type": "integer", "minimum": 1, "maximum": 10}
    entry = {"type": "object",
             "properties": {**{c: score for c in CRITERIA}, "overall": score, "reason": {"type": "string"}},
             "required": [*CRITERIA, "overall", "reason"], "additionalProperties": False}
    return {"type": "object", "properties": {k: entry for k in keys}, "required": list(keys),
            "additionalProperties": False}


def overall_score(scores: dict, mode: str = "criteria", criteria: tuple[str, ...] = CRITERIA,
                  hallucination: tuple[str, ...] = HALLUCINATION_CRITERIA) -> float:
    """``criteria``: the scored criteria (the QA job's four differ from the captions' five);
    ``hallucination``: those whose low band (<= HALLUCINATION_MAX) means a hallucination."""
    if mode == "judge":
        return float(scores["overall"])
    values = [float(scores[c]) for c in criteria]
    if mode == "criteria":
        flagged = [float(scores[c]) for c in hallucination if float(scores[c]) <= HALLUCINATION_MAX]
        return min(flagged) if flagged else sum(values) / len(values)
    if mode == "mean":
        return sum(values) / len(values)
    if mode == "min":
        return min(values)
    raise ValueError(f"unknown overall mode {mode!r}; one of {OVERALL_MODES}")


@dataclass(frozen=True)
class Selection:
    selected: bool
    reason: str


def select_captions(overall: list[float], threshold: float = 7.0, keep: int = 3) -> list[Selection]:
    """Per candidate (same order): kept or not, and why."""
    passing = sorted((s for s in overall if s >= threshold), reverse=True)
    cut = passing[keep - 1] if len(passing) >= keep else (passing[-1] if passing else None)
    out = []
    for s in overall:
        if s < threshold:
            out.append(Selection(False, f"rejected: overall {s:g} below {threshold:g}"))
        elif s >= cut:
            rank = 1 + sum(1 for p in passing if p > s)
            tie = s == cut and sum(1 for p in passing if p >= cut) > keep
            out.append(Selection(True, f"selected: rank {rank} of {len(passing)} passing"
                                       + (" (tied at the top-3 cut)" if tie else "")))
        else:
            out.append(Selection(False, f"not in top {keep}: overall {s:g} below the cut {cut:g}"))
    return out


_PUNCT = re.compile(r"[^\w\s]")


def tokenize(sentence: str) -> list[str]:
    """LEVIR-CC style tokens: lower case, punctuation removed, split on white space."""
    return _PUNCT.sub(" ", sentence.lower().replace("'", "")).split()


def _levir_cc_image(p: dict, imgid: int, first_sentid: int) -> dict:
    sentences = [{"raw": " " + raw.strip(), "tokens": tokenize(raw), "imgid": imgid, "sentid": first_sentid + k}
                 for k, raw in enumerate(p["selected_captions"])]
    return {"filepath": p["split"], "filename": p["filename"], "imgid": imgid, "split": p["split"],
            "sentences": sentences, "sentids": [s["sentid"] for s in sentences],
            "changeflag": int((p.get("car") or 0) > 0)}


def levir_cc_document(pairs: list[dict]) -> dict:
    """``{"images": [...]}`` as in LEVIR-CC's LevirCCcaptions.json: per image ``filepath`` (split folder),
    ``filename``, ``imgid``, ``split``, ``sentences`` (``raw``, ``tokens``, ``imgid``, ``sentid``),
    ``sentids`` and ``changeflag``. Pairs without any selected caption are left out (training code
    expects at least one sentence per image); they stay in the ``pairs`` table."""
    images, sentid = [], 0
    for p in sorted((p for p in pairs if p.get("selected_captions")), key=lambda p: (p["split"], p["filename"])):
        images.append(_levir_cc_image(p, len(images), sentid))
        sentid += len(p["selected_captions"])
    return {"images": images}


def write_levir_cc(sorted_batches, f) -> int:
    """:func:`levir_cc_document` written to the binary file ``f`` as it goes, byte for byte what
    ``json.dumps(document, indent=1)`` gives, holding one image at a time: the file of a whole archive
    need not fit in the driver. ``sorted_batches``: lists of pair rows, already in (split, filename)
    order. Returns the number of images written."""
    def images():
        imgid = sentid = 0
        for rows in sorted_batches:
            for p in rows:
                if p.get("selected_captions"):
                    yield _levir_cc_image(p, imgid, sentid)
                    imgid += 1
                    sentid += len(p["selected_captions"])
    return write_images_document(images(), f)


def write_images_document(images, f) -> int:
    """``{"images": [...]}`` from an iterable of image dicts, written to the binary file ``f`` one image at
    a time, byte for byte ``json.dumps(document, indent=1)``. Returns the number of images."""
    import json
    f.write(b'{\n "images": [')
    n = 0
    for img in images:
        text = json.dumps(img, indent=1)
        f.write(("\n" if n == 0 else ",\n").encode() + "\n".join("  " + line for line in text.split("\n")).encode())
        n += 1
    f.write(b"\n ]\n}" if n else b"]\n}")
    return n
