"""Grounded validators: deterministic checks of a caption or a QA answer against its change mask.

Pure functions (no LLM, no Ray): :func:`mask_facts` summarises a boolean mask into how much of each
named region changed, and :func:`validate_text` checks a text against those facts, returning
``(ok, violations)`` the way a filter does. Every violation names its rule:

``numbers``    an exact figure copied from the metadata. The JL1-QA prompt forbids copying numbers
               (section II-C3: "such precision cannot be derived from visual inspection alone") and
               its judge rejected "hallucinated precise percentages" most often. Flagged: any
               percentage figure ("20.7%", "21 percent"), a pixel count, and a decimal fraction equal
               to the change area ratio (CAR) to two places. Number words ("about a fifth") pass.
``change``     a change asserted on an empty mask (changed fraction <= ``empty_car``), or a global
               "no change" on a mask with CAR >= ``no_change_max_car``. Only generic no-change
               statements count ("no change", "nothing changed", "the scene remains the same"); a
               negation about one object type ("no trees were removed") is not contradicted by a mask.
``location``   a location phrase (upper-left ... lower-right, upper/lower/left/right part, side, edge, half or
               third, center, edges) in a clause that asserts change, where that region has no change
               worth naming (less than ``presence_fraction`` of its pixels changed, or less than
               ``presence_share`` of all the change unless ``clear_fraction`` of its pixels changed: a
               sliver of a building crossing into a corner is not "change in the corner"); a location
               stated as unchanged with at least ``clear_fraction`` of its pixels changed; or
               "entire / whole image" for a change in fewer than ``entire_min_quadrants`` quadrants.
               A corner or the center is its 3x3 cell, "upper/lower/left/right" its third, a half its half.
``magnitude``  CAR bins of JL1-CD: small < ``small_car`` (0.05) <= medium < ``large_car`` (0.2) <= large.
               "large-scale / extensive / widespread" on a small-bin mask, "most of the image" below
               ``most_car``, and "small / localized / minor / tiny" on a large-bin mask. Medium masks
               accept both words (one bin of tolerance).
``counts``     a stated number of objects ("three new buildings", "a single road", "a dozen houses",
               "several", "many") in a clause that asserts change, against the number of changed
               components: a number n passes when ``|n - c| <= max(count_abs_tol, count_rel_tol * c)``
               (adjacent buildings merge into one component, fragments split one), "a few" needs
               2 <= c <= 7, "several" c >= 2, "many / numerous / dozens" c >= ``many_min``. When the
               clause names places, c may also be the components touching those places (together or
               any one): "three houses in the upper-right" is counted there.
``existence``  a YES/NO answer to a question about change (in a named region or in the image) that the
               mask contradicts: "yes" where the region has no change worth naming (as above) or the
               mask is empty; "no" where the region is clearly changed, or, for the whole image, where
               the CAR is at least ``no_change_max_car``. Questions about absence ("Is the lower-left
               unchanged?") invert the answer. "No" is only checked for generic change or construction
               questions (a mask does not say *what* changed: "were any trees removed?" passes).
Clauses are split at sentence punctuation, commas (not before "and/or/where/which/that/with") and
contrast words (while, but, whereas, except, apart from); a clause with a negation or persistence word
(no, not, unchanged, remains, intact, ...) asserts no change for its places.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass

import cv2
import numpy as np

RULES = ("numbers", "change", "location", "magnitude", "counts", "existence")


@dataclass(frozen=True)
class ValidatorConfig:
    empty_car: float = 0.0             # a mask with CAR at or below this has no change
    no_change_max_car: float = 0.01    # "no change" is tolerated up to this CAR (speckle, slivers)
    presence_fraction: float = 0.005   # a region "has change" when this share of its pixels changed ...
    presence_share: float = 0.05       # ... and it holds this share of all the change (or is clearly changed)
    clear_fraction: float = 0.05       # a region "clearly changed" when this share of its pixels changed
    entire_min_quadrants: int = 3      # "entire image" needs change in at least this many of the 4 quadrants
    small_car: float = 0.05            # JL1-CD CAR bins: small < 0.05 <= medium < 0.2 <= large
    large_car: float = 0.2
    most_car: float = 0.35             # "most of / the majority of the image" needs at least this CAR
    count_abs_tol: int = 1
    count_rel_tol: float = 0.5
    many_min: int = 4
    car_decimals_match: float = 0.005  # "0.21" matches a CAR of 0.207


@dataclass(frozen=True)
class Violation:
    rule: str
    detail: str


# -- mask facts ------------------------------------------------------------------------------------
def _bands(n: int, parts: int) -> list[int]:
    return [int(round(v)) for v in np.linspace(0, n, parts + 1)]


def region_boxes(height: int, width: int) -> dict[str, tuple[int, int, int, int]]:
    """Named boxes (y0, y1, x0, x1): the 3x3 cells, thirds, halves, quadrants, center square."""
    r3, c3 = _bands(height, 3), _bands(width, 3)
    h2, w2 = height // 2, width // 2
    names = (("upper-left", "upper", "upper-right"), ("left", "center", "right"),
             ("lower-left", "lower", "lower-right"))
    boxes = {f"cell:{names[i][j]}": (r3[i], r3[i + 1], c3[j], c3[j + 1]) for i in range(3) for j in range(3)}
    boxes.update({
        "third:upper": (0, r3[1], 0, width), "third:lower": (r3[2], height, 0, width),
        "third:left": (0, height, 0, c3[1]), "third:right": (0, height, c3[2], width),
        "half:upper": (0, h2, 0, width), "half:lower": (h2, height, 0, width),
        "half:left": (0, height, 0, w2), "half:right": (0, height, w2, width),
        "quad:upper-left": (0, h2, 0, w2), "quad:upper-right": (0, h2, w2, width),
        "quad:lower-left": (h2, height, 0, w2), "quad:lower-right": (h2, height, w2, width),
        "square:center": (height // 4, height - height // 4, width // 4, width - width // 4),
        "all": (0, height, 0, width),
    })
    return boxes


def mask_facts(mask: np.ndarray, components: int | None = None, min_component_px: int = 10) -> dict:
    """What the validators need from a boolean mask: size, changed pixels, components and, for every
    named region, ``[changed pixels, region pixels]``. JSON-serialisable (it travels in rows)."""
    m = np.asarray(mask).astype(bool)
    h, w = m.shape
    regions = {}
    for name, (y0, y1, x0, x1) in region_boxes(h, w).items():
        regions[name] = [int(m[y0:y1, x0:x1].sum()), int((y1 - y0) * (x1 - x0))]
    # The outer ring of the 3x3 grid ("edges", "borders").
    ring_changed = regions["all"][0] - regions["cell:center"][0]
    regions["ring"] = [ring_changed, regions["all"][1] - regions["cell:center"][1]]
    if components is None:
        from operators.language.mask_analysis import analyze_mask
        components = analyze_mask(m).components
    changed = regions["all"][0]
    return {"height": h, "width": w, "changed_pixels": changed, "car": changed / float(h * w) if h * w else 0.0,
            "components": int(components), "regions": regions,
            "region_components": _components_by_region(m, min_component_px)}


def _components_by_region(m: np.ndarray, min_px: int) -> dict[str, list[int]]:
    """Ids of the changed components (>= ``min_px``, 8-connected, as in the mask analysis) touching each
    named region, so that "three houses in the lower-right" is counted where it is said to be."""
    if not m.any():
        return {name: [] for name in list(region_boxes(*m.shape)) + ["ring"]}
    n, labels, stats, _ = cv2.connectedComponentsWithStats(m.astype(np.uint8), connectivity=8)
    keep = np.zeros(n, bool)
    keep[1:] = stats[1:, cv2.CC_STAT_AREA] >= min_px
    if not keep.any():
        keep[1:] = True  # only speckle: count it, as the mask analysis does
    out = {}
    for name, (y0, y1, x0, x1) in region_boxes(*m.shape).items():
        ids = np.unique(labels[y0:y1, x0:x1])
        out[name] = [int(i) for i in ids if keep[i]]
    center = set(out["cell:center"])
    out["ring"] = sorted(set(out["all"]) - center | {i for k, v in out.items() if k.startswith("cell:")
                                                      and k != "cell:center" for i in v})
    return out


def _fraction(facts: dict, region: str) -> float:
    changed, area = facts["regions"][region]
    return changed / area if area else 0.0


def has_change(facts: dict, region: str, cfg: "ValidatorConfig") -> bool:
    """Change worth naming: enough of the region's pixels, and either a fair share of all the change or
    clearly changed (a sliver of a building crossing into a corner does not make "change in the corner")."""
    fraction = _fraction(facts, region)
    share = facts["regions"][region][0] / facts["changed_pixels"] if facts["changed_pixels"] else 0.0
    return fraction >= cfg.presence_fraction and (share >= cfg.presence_share or fraction >= cfg.clear_fraction)


def clearly_changed(facts: dict, region: str, cfg: "ValidatorConfig") -> bool:
    return _fraction(facts, region) >= cfg.clear_fraction


# -- text patterns ---------------------------------------------------------------------------------
CHANGE_CUE = re.compile(
    r"\b(new(ly)?|built|build|building of|constructed|construction|erected|developed|development|"
    r"appear(s|ed|ing)?|emerg(e|es|ed|ing)|added|demolish(ed|ing)?|demolition|removed|removal|clear(ed|ing)|"
    r"replac(e|ed|ing)|convert(ed|ing)?|transform(ed|ing|ation)?|expan(d|ded|sion)|chang(e|es|ed|ing)|"
    r"alter(ed|ation)|paved|excavat(ed|ion)|disappear(ed|s)?|vanish(ed)?|gone|lost|occup(y|ies|ied)|"
    r"covers?|covered|spans?|line|lines|runs?|stands?|form(s|ed)?|visible)\b")
NEGATION = re.compile(
    r"\b(no|not|none|nothing|never|without|neither|nor|unchanged|unaffected|intact|untouched|empty|"
    r"remain(s|ed)?|stays?|stayed|same|identical|n't|absent|free of)\b")
GLOBAL_NO_CHANGE = re.compile(
    r"\b(no (significant |notable |visible |obvious |apparent |major |noticeable |discernible |substantial |"
    r"meaningful |real |clear |new )*(changes?|differences?|construction|development)\b"
    r"|nothing (has |have |was |were )?(changed|(been )?(built|added|changed|constructed|demolished|removed))"
    r"|no new (buildings?|structures?|houses?|construction)( or (other )?changes?)?( (were|was|have|has|are|is|appear)"
    r"( been)? ?(built|constructed|added|visible|appeared|appear)?)?\b"
    r"|(image|scene|area|landscape|everything|view)s? (appears? |looks? |seems? )?(remains?|stays?|is|are|looks?|appears?)? ?"
    r"(largely |essentially |virtually |basically |entirely )?(unchanged|the same|identical)"
    r"|(^|\b)(remains?|stays?) (the same|unchanged)\b"
    r"|no change (occurred|is visible|happened|took place)? ?anywhere)")

_CORNER = {"upper-left": r"(upper|top)[ -]left|north[ -]?west(ern)?",
           "upper-right": r"(upper|top)[ -]right|north[ -]?east(ern)?",
           "lower-left": r"(lower|bottom)[ -]left|south[ -]?west(ern)?",
           "lower-right": r"(lower|bottom)[ -]right|south[ -]?east(ern)?"}
_SIDE_NOUN = r"(part|parts|portion|portions|area|areas|section|side|sides|edge|edges|region|band|strip|corner|half|third|column|row|border|margin)"
_SIDE = {"upper": r"upper|top|northern|north(?= (part|side|edge|half|portion|section))",
         "lower": r"lower|bottom|southern|south(?= (part|side|edge|half|portion|section))",
         "left": r"(?<=the )(far )?left(?! (behind|unchanged|intact|untouched|as|over|in place))|left(?=[- ]hand)|western|left(?= " + _SIDE_NOUN + r")",
         "right": r"(?<=the )(far )?right(?! (next|after|before|away|now))|right(?=[- ]hand)|eastern|right(?= " + _SIDE_NOUN + r")"}
_ENTIRE = re.compile(r"\b((entire|whole) (image|scene|area|frame|view|tile)|(throughout|all over|across) the "
                     r"(entire |whole )?(image|scene|frame)|everywhere)\b")


@dataclass(frozen=True)
class Place:
    name: str          # what the text said, normalised ("upper-left", "upper half", "center", ...)
    region: str        # the named box of :func:`region_boxes` it stands for


def find_places(clause: str) -> list[Place]:
    """Location phrases of one lower-cased clause, longest first, without overlaps."""
    found: list[tuple[int, int, Place]] = []

    def add(pattern: str, place: Place) -> None:
        for m in re.finditer(pattern, clause):
            if not any(a < m.end() and m.start() < b for a, b, _ in found):
                found.append((m.start(), m.end(), place))

    for name, pat in _CORNER.items():
        add(rf"\b({pat})\b", Place(name, f"cell:{name}"))
    for side, pat in _SIDE.items():
        add(rf"\b({pat}) half\b", Place(f"{side} half", f"half:{side}"))
        add(rf"\b({pat}) third\b", Place(f"{side} third", f"third:{side}"))
    add(r"\b(cent(er|re|ral)|middle)\b", Place("center", "cell:center"))
    add(r"\b(edges|borders|periphery|peripheral|margins|outskirts)\b", Place("edges", "ring"))
    for side, pat in _SIDE.items():
        add(rf"\b({pat})\b", Place(side, f"third:{side}"))
    return [p for _, _, p in sorted(found, key=lambda f: f[0])]


_CLAUSE_SPLIT = re.compile(r"[.;:!?]|,(?! (and|or|where|which|that|with) )|\b(while|whereas|but|although|though|except|apart from|"
                           r"besides|with the exception of)\b")


def clauses(text: str) -> list[str]:
    return [c.strip() for c in _CLAUSE_SPLIT.split(text.lower()) if c and c.strip() and c.strip() not in (
        "while", "whereas", "but", "although", "though", "except", "apart from", "besides",
        "with the exception of", "and", "or")]


def _negated(clause: str) -> bool:
    return bool(NEGATION.search(clause))


def _asserts_change(clause: str) -> bool:
    return bool(CHANGE_CUE.search(clause)) and not _negated(clause)


# -- rules -------------------------------------------------------------------------------------------
_PERCENT = re.compile(r"\b\d+(?:[.,]\d+)?\s*(%|percent\b|per cent\b|pct\b)|%")
_PIXELS = re.compile(r"\b\d[\d,.]*\s*(changed |changing )?(pixels?|px)\b")
_DECIMAL = re.compile(r"(?<![\d.])0?\.\d{2,}\b")


def check_numbers(text: str, facts: dict, cfg: ValidatorConfig) -> list[Violation]:
    t = text.lower()
    out = []
    m = _PERCENT.search(t)
    if m:
        out.append(Violation("numbers", f"percentage figure {m.group(0).strip()!r}: metadata numbers must not be copied"))
    m = _PIXELS.search(t)
    if m:
        out.append(Violation("numbers", f"pixel count {m.group(0).strip()!r} copied from the mask statistics"))
    for m in _DECIMAL.finditer(t):
        if abs(float(m.group(0)) - facts["car"]) <= cfg.car_decimals_match:
            out.append(Violation("numbers", f"the change area ratio {m.group(0)} copied from the metadata"))
            break
    return out


def check_change(text: str, facts: dict, cfg: ValidatorConfig, question: str | None = None) -> list[Violation]:
    parts = clauses(text)
    if facts["car"] <= cfg.empty_car:
        for c in parts:
            if _asserts_change(c):
                return [Violation("change", f"asserts change ({c!r}) but the mask is empty")]
        return []
    if question and find_places(question.lower()):
        return []  # "No, nothing changed there" answers about the question's place (the location rules' job)
    if facts["car"] >= cfg.no_change_max_car and not any(_asserts_change(c) for c in parts):
        for c in parts:
            if GLOBAL_NO_CHANGE.search(c) and not find_places(c) and not _PARTIAL.search(c):
                return [Violation("change", f"asserts no change ({c!r}) but {100 * facts['car']:.1f}% of the "
                                            f"mask changed")]
    return []


_PARTIAL = re.compile(r"\b(most|much|rest|remainder|part|parts|portion|majority|some|areas?) of (the )?"
                      r"(image|scene|area|surroundings|neighbou?rhood)\b|\belsewhere\b")


def _is_yes_no(question: str | None, qtype: str | None) -> bool:
    if qtype and qtype.upper().replace(" ", "") in ("YES/NO", "YES_NO", "YESNO"):
        return True
    return bool(question) and bool(re.match(r"\s*(is|are|was|were|has|have|had|did|does|do|can|could|will)\b",
                                            question.lower()))


def _answer_polarity(answer: str) -> str | None:
    m = re.match(r"\s*(yes|yeah|yep|correct|indeed|no|nope|not really)\b", answer.lower())
    if not m:
        return None
    return "yes" if m.group(1) in ("yes", "yeah", "yep", "correct", "indeed") else "no"


def check_location(text: str, facts: dict, cfg: ValidatorConfig, question: str | None = None) -> list[Violation]:
    out = []
    question_about_change = bool(question) and bool(CHANGE_CUE.search(question.lower()))
    for c in clauses(text):
        places = find_places(c)
        negative = _negated(c)
        positive = not negative and (bool(CHANGE_CUE.search(c)) or question_about_change)
        for p in places:
            if positive and not has_change(facts, p.region, cfg):
                out.append(Violation("location", f"change placed in the {p.name} ({c!r}), where the mask has "
                                                 f"{100 * _fraction(facts, p.region):.1f}% changed"))
            elif negative and clearly_changed(facts, p.region, cfg):
                out.append(Violation("location", f"the {p.name} is said to be unchanged ({c!r}), but "
                                                 f"{100 * _fraction(facts, p.region):.1f}% of it changed"))
        if _ENTIRE.search(c) and not negative and (CHANGE_CUE.search(c) or question_about_change):
            quads = sum(1 for k in facts["regions"] if k.startswith("quad:") and has_change(facts, k, cfg))
            if facts["changed_pixels"] and quads < cfg.entire_min_quadrants:
                out.append(Violation("location", f"change over the entire image ({c!r}), but only {quads} of 4 "
                                                 f"quadrants changed"))
    return out


_LARGE = re.compile(r"\b(large[- ]scale|extensive(ly)?|widespread|massive(ly)?|vast|sweeping|wholesale|"
                    r"large (portion|part|area|share|swath|tract|fraction)s?|substantial (portion|part|share|fraction)|"
                    r"much of the (image|scene|area))\b")
_MOST = re.compile(r"\b(most of the (image|scene|area|frame)|(the )?majority of the (image|scene|area)|"
                   r"(nearly|almost|virtually) (all|the entire|the whole) (of the )?(image|scene|area))\b")
_SMALL = re.compile(r"\b(small[- ]scale|locali[sz]ed|minor|limited|slight(ly)?|tiny|negligible|marginal|"
                    r"small (portion|part|area|patch|fraction|share|change|changes|amount))\b")


def check_magnitude(text: str, facts: dict, cfg: ValidatorConfig) -> list[Violation]:
    car, out = facts["car"], []
    for c in clauses(text):
        if re.search(r"\b(not|no|hardly|rather than|instead of)\b", c) or _negated(c):
            continue  # "not extensive", "no large-scale change": negated magnitude words say nothing here
        if m := _MOST.search(c):
            if car < cfg.most_car:
                out.append(Violation("magnitude", f"{m.group(0)!r} but the change area ratio is "
                                                  f"{100 * car:.1f}% (needs {100 * cfg.most_car:g}%)"))
                continue
        if (m := _LARGE.search(c)) and car < cfg.small_car:
            out.append(Violation("magnitude", f"{m.group(0)!r} but the change area ratio is {100 * car:.1f}% "
                                              f"(small bin: < {100 * cfg.small_car:g}%)"))
        elif (m := _SMALL.search(c)) and car >= cfg.large_car and (CHANGE_CUE.search(c) or "change" in c
                                                                  or re.search(r"\b(it|this)\b", c)):
            out.append(Violation("magnitude", f"{m.group(0)!r} but the change area ratio is {100 * car:.1f}% "
                                              f"(large bin: >= {100 * cfg.large_car:g}%)"))
    return out


_NUMBER_WORDS = {"one": 1, "a single": 1, "single": 1, "only one": 1, "two": 2, "a pair of": 2, "a couple of": 2,
                 "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10,
                 "eleven": 11, "twelve": 12, "a dozen": 12, "thirteen": 13, "fourteen": 14, "fifteen": 15,
                 "sixteen": 16, "seventeen": 17, "eighteen": 18, "nineteen": 19, "twenty": 20, "thirty": 30}
_VAGUE = {"a few": "few", "a handful of": "few", "several": "several", "many": "many", "numerous": "many",
          "dozens of": "many", "a large number of": "many", "multiple": "several", "a number of": "several"}
_OBJECTS = (r"(new |small |large |big |single[- ]family |residential |detached |separate |additional |individual |"
            r"very |huge |massive |industrial |commercial |distinct |rectangular |tall |low[- ]rise |"
            r"light[- ]roofed |grey |gray |white |red |blue )*"
            r"(buildings?|houses?|homes?|structures?|roofs?|residences?|dwellings?|villas?|warehouses?|"
            r"factories|factory|sheds?|blocks?|roads?|ponds?|patches|patch|plots?|fields?|facilities|facility|"
            r"constructions?|objects?|units?|buildings?)")
_COUNT = re.compile(r"\b(about |around |approximately |roughly |nearly |almost |some |over |more than |at least |"
                    r"fewer than |less than |exactly |only |just )?"
                    r"(" + "|".join(sorted(map(re.escape, list(_NUMBER_WORDS) + list(_VAGUE)), key=len, reverse=True))
                    + r"|\d{1,3})(?: or (\w+))? " + _OBJECTS + r"\b")


def _count_ok(stated: str, qualifier: str, alt: str | None, c: int, cfg: ValidatorConfig) -> bool:
    if stated in _VAGUE:
        kind = _VAGUE[stated]
        if kind == "few":
            return 2 <= c <= 7
        if kind == "several":
            return c >= 2
        return c >= cfg.many_min
    n = int(stated) if stated.isdigit() else _NUMBER_WORDS[stated]
    tol = max(cfg.count_abs_tol, cfg.count_rel_tol * c)
    if alt:  # "six or seven houses": either end may match
        m = _NUMBER_WORDS.get(alt, int(alt) if alt.isdigit() else None)
        if m is not None and abs(m - c) <= tol:
            return True
    q = qualifier.strip()
    if q in ("more than", "over", "at least"):
        return c + tol >= n
    if q in ("fewer than", "less than"):
        return c - tol <= n
    return abs(n - c) <= tol


def check_counts(text: str, facts: dict, cfg: ValidatorConfig, question: str | None = None) -> list[Violation]:
    question_about_change = bool(question) and bool(CHANGE_CUE.search(question.lower()))
    out = []
    for clause in clauses(text):
        if _negated(clause) or not (CHANGE_CUE.search(clause) or question_about_change):
            continue
        # A count may be about the whole image or about the place the clause names ("a few houses in the
        # lower-right": components touching that region); either reading may match.
        candidates = [int(facts["components"])]
        places = find_places(clause) or find_places(question.lower() if question else "")
        by_region = facts.get("region_components") or {}
        if places and by_region:  # all the named places together, or any one of them
            sets = [set(by_region.get(p.region, [])) for p in places]
            candidates += [len(set().union(*sets))] + [len(x) for x in sets]
        for m in _COUNT.finditer(clause):
            if re.match(r"of\b", clause[m.end():].strip()):
                continue  # "one of the buildings" counts nothing
            qualifier, stated, alt = m.group(1) or "", m.group(2), m.group(3)
            if not any(_count_ok(stated, qualifier, alt, c, cfg) for c in candidates):
                where = f" ({candidates[1]} where the text places them)" if len(candidates) > 1 else ""
                out.append(Violation("counts", f"{m.group(0).strip()!r} but the mask has {candidates[0]} changed "
                                               f"component{'s' if candidates[0] != 1 else ''}{where}"))
    return out


_GENERIC_CHANGE_Q = re.compile(r"\b(chang(e|es|ed)|construct(ed|ion)|built|development|developed|new (buildings?|"
                               r"structures?|houses?|construction)|anything|any (building|structure|house)s?|"
                               r"new|appear(ed)?|added)\b")


def check_existence(answer: str, facts: dict, cfg: ValidatorConfig, question: str | None,
                    qtype: str | None) -> list[Violation]:
    if not question or not _is_yes_no(question, qtype):
        return []
    q = question.lower()
    # "Is the lower-left corner unchanged?" asks about absence: its "yes" says "no change there".
    asks_absence = bool(_ABSENCE_Q.search(q))
    if not (CHANGE_CUE.search(q) or _GENERIC_CHANGE_Q.search(q) or asks_absence):
        return []
    polarity = _answer_polarity(answer)
    if polarity is None:
        return []
    if asks_absence:
        polarity = "no" if polarity == "yes" else "yes"
    places = find_places(q)
    if polarity == "yes":
        if places and not any(has_change(facts, p.region, cfg) for p in places):
            where = ", ".join(f"the {p.name} {100 * _fraction(facts, p.region):.1f}% changed" for p in places)
            return [Violation("existence", f"answers that {question!r} has change, but the mask has {where}")]
        if not places and facts["car"] <= cfg.empty_car:
            return [Violation("existence", f"answers that {question!r} has change, but the mask is empty")]
        return []
    if not (asks_absence or _GENERIC_CHANGE_Q.search(q)):
        return []  # "were any trees removed?": a mask cannot say no to a specific object type
    for p in places:
        if clearly_changed(facts, p.region, cfg):
            return [Violation("existence", f"answers that {question!r} has no change, but "
                                           f"{100 * _fraction(facts, p.region):.1f}% of the {p.name} changed")]
    if not places and facts["car"] >= cfg.no_change_max_car:
        return [Violation("existence", f"answers that {question!r} has no change, but {100 * facts['car']:.1f}% "
                                       f"of the image changed")]
    return []


_ABSENCE_Q = re.compile(r"\b(unchanged|unaffected|intact|untouched|(remain|remains|remained|stay|stays|stayed) "
                        r"(the same|unchanged|as before)|the same as before|free of change|no change)\b")


def validate_text(text: str, facts: dict, question: str | None = None, qtype: str | None = None,
                  cfg: ValidatorConfig = ValidatorConfig(), rules: tuple[str, ...] = RULES) -> tuple[bool, list[Violation]]:
    """Check one caption or answer (with its question, for QA) against the mask facts."""
    text = text or ""
    found: list[Violation] = []
    if "numbers" in rules:
        found += check_numbers(text, facts, cfg)
    if "change" in rules:
        found += check_change(text, facts, cfg, question)
    if "location" in rules:
        found += check_location(text, facts, cfg, question)
    if "magnitude" in rules:
        found += check_magnitude(text, facts, cfg)
    if "counts" in rules:
        found += check_counts(text, facts, cfg, question)
    if "existence" in rules:
        found += check_existence(text, facts, cfg, question, qtype)
    found = list(dict.fromkeys(found))  # a place named twice in one clause is one violation
    return (not found), found


def violations_json(violations: list[Violation]) -> str:
    return json.dumps([asdict(v) for v in violations])


def rule_counts(violation_lists) -> dict[str, int]:
    """How many texts each rule caught (a text counts once per rule)."""
    counts = {r: 0 for r in RULES}
    for vs in violation_lists:
        for rule in {v["rule"] if isinstance(v, dict) else v.rule for v in vs}:
            counts[rule] = counts.get(rule, 0) + 1
    return counts
