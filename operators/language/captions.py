"""Caption logic without Ray or HTTP: prompt templates, reply schemas, scoring and selection, and the
LEVIR-CC caption file.

Selection (JL1-CC, section II-B2): every candidate gets five integer criterion scores (1-10) from the
judge; its *overall* score is an integer, as the paper's are, by ``--overall``,

- ``criteria`` (the default): the mean of the five criterion scores rounded half up (7.4 -> 7, 7.5 -> 8),
  except that a caption the accuracy criterion marks as hallucinated (accuracy <= 4, the band the
  judge prompt reserves for a hallucinated change or object) scores its accuracy instead, so it is
  always rejected;
- ``judge``: the judge's own integer ``overall`` field (unconstrained: a judge can give 8 to a caption
  it scored 2 for accuracy);
- ``min``: the lowest criterion score (a caption is only as good as its worst aspect);
- ``mean``: the unrounded mean of the five criterion scores, a float (not the paper's: ties at the cut
  then almost never happen, so a pair keeps 3 captions where the paper keeps 3.40 on average).

Candidates with overall < 7 are rejected; of the rest the three best are kept, and every candidate
tied with the third is kept too (so a pair can keep 4 or 5).
"""
from __future__ import annotations

import importlib.resources
import math
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
IMAGE_NAMES = ("A", "B", "mask")       # what a template's '## images' section may list
PROMPTS_DIR = Path(str(importlib.resources.files("prompts")))


@dataclass(frozen=True)
class PromptTemplate:
    version: str       # file stem, e.g. "caption_generate.v2"; stored with results and in cache keys
    system: str
    user: str
    # What all of a pair's requests share after its images (its mask metadata). A template with a pair
    # section is laid out for prefix caching: system, images, pair text, then the stage's text (``user``);
    # one without (v1) keeps its text before the images.
    pair: str = ""
    # The images a v3 template sends, in order, right after the system text ("A B mask" or "A B"): the
    # judges see the pair only, as the paper's do, so that A and B end the prefix every stage of a pair
    # shares. Empty: the v1/v2 layouts.
    images: tuple[str, ...] = ()
    # How the reply is shaped, in words (v4): sent only where the request does not state the schema
    # itself. In JSON mode (the default) the schema at the end of the request says it, so the line would
    # be paid twice; in json_schema mode some servers never show the schema to the model (vLLM's guided
    # decoding only constrains the tokens), so the words are its one guide to the keys.
    reply: str = ""

    def render(self, **values) -> tuple[str, str]:
        return (string.Template(self.system).substitute(values),
                string.Template(self.user).substitute(values))

    def render_pair(self, **values) -> str:
        return string.Template(self.pair).substitute(values)

    def render_reply(self, **values) -> str:
        return string.Template(self.reply).substitute(values)


def load_template(name: str, prompts_dir: str | Path | None = None) -> PromptTemplate:
    """Read ``<prompts_dir>/<name>.txt`` (default: the packaged templates) with ``## system``, ``## pair``
    (optional), ``## images`` (optional: the images sent, in order), ``## user`` and ``## reply`` (optional: the
    reply's shape in words, see :attr:`PromptTemplate.reply`) sections. A section that is one line ``@<name>`` is the text of
    ``<prompts_dir>/<name>.txt``: the system text and the pair text every stage shares, versioned like the
    templates (an included file is never edited either, so a template's stem still names its text)."""
    folder = Path(prompts_dir or PROMPTS_DIR)
    path = folder / f"{name}.txt"
    text = path.read_text(encoding="utf-8")
    sections: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"^## (system|pair|images|user|reply)\s*$", line)
        if m:
            current = m.group(1)
            sections[current] = []
        elif current:
            sections[current].append(line)
    if "user" not in sections:
        raise ValueError(f"{path}: no '## user' section")

    def section(key: str) -> str:
        body = "\n".join(sections.get(key, [])).strip()
        if re.fullmatch(r"@[\w.-]+", body):
            return (folder / f"{body[1:]}.txt").read_text(encoding="utf-8").strip()
        return body
    images = tuple(section("images").split())
    unknown = sorted(set(images) - set(IMAGE_NAMES))
    if unknown:
        raise ValueError(f"{path}: unknown image(s) {unknown} in '## images' (one of {', '.join(IMAGE_NAMES)})")
    return PromptTemplate(version=path.stem, system=section("system"), user=section("user"), pair=section("pair"),
                          images=images, reply=section("reply"))


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


def round_half_up(x: float) -> int:
    """7.5 -> 8 (Python's round() would give 8 for 7.5 but 6 for 6.5)."""
    return int(math.floor(x + 0.5))


def overall_score(scores: dict, mode: str = "criteria", criteria: tuple[str, ...] = CRITERIA,
                  hallucination: tuple[str, ...] = HALLUCINATION_CRITERIA) -> int | float:
    """An integer, except under ``mean``. ``criteria``: the scored criteria (the QA job's four differ
    from the captions' five); ``hallucination``: those whose low band (<= HALLUCINATION_MAX) means a
    hallucination."""
    if mode == "judge":
        return int(scores["overall"])
    values = [int(scores[c]) for c in criteria]
    if mode == "criteria":
        flagged = [int(scores[c]) for c in hallucination if int(scores[c]) <= HALLUCINATION_MAX]
        return min(flagged) if flagged else round_half_up(sum(values) / len(values))
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
