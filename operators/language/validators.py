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
``location``   a place (read by :func:`operators.language.phrases.find_places`: corners, sides, compass
               words, edges, thirds, halves, quadrants, "the X part of the Y") in a segment that asserts
               change, where no reading of it has change worth naming: at least ``presence_fraction``
               of its pixels changed, and either ``clear_fraction`` of them or a density (its changed
               fraction over the CAR) of at least ``presence_density``, the same test for a cell, a
               third or a half; the quadrant reading of "the lower-left part" needs density
               ``alt_density``; a hedged presence ("just reaches into the west") needs only
               ``presence_fraction``. A place said to be unchanged that changed by ``clear_fraction`` of its
               pixels (``hedged_clear_fraction`` when hedged: "mostly unchanged", "very few"). "Only /
               all of the / confined to" places holding less than ``only_share`` of the change,
               "mostly / mainly / concentrated in" less than ``mostly_share`` (unless it is the 3x3 cell
               or quadrant holding the most change); "the entire X" with a
               3x3 piece of X under ``presence_fraction``; "entire / whole image" for a change in
               fewer than ``entire_min_quadrants`` quadrants. An answer that names no place speaks
               about its question's place (not for YES/NO or either-or questions).
``magnitude``  CAR bins of JL1-CD: small < ``small_car`` (0.05) <= medium < ``large_car`` (0.2) <= large.
               "large-scale / extensive / widespread / a considerable portion" on a small-bin mask,
               "most of the image" below ``most_car``, "small / localized / minor / modest / tiny" on a
               large-bin mask (medium accepts both: one bin of tolerance; "small" only as an amount,
               said of the change or an area, not of objects: "small houses"), and words that deny almost
               all change ("negligible", "barely anything", "hardly affects", "a tiny patch", "very
               little") from the medium bin up, when they speak of the whole image (an answer to "how
               much changed?" does; one to "how much changed in the west?" does not).
``counts``     a stated number of objects ("three new buildings", "a single road", "half a dozen", "18 to
               20 houses", "several", "many", "dozens") in a segment that asserts change, against the
               number of changed components: a number n passes when ``|n - c| <= max(count_abs_tol,
               count_rel_tol * c)`` (adjacent buildings merge into one component, fragments split one),
               a range when c lies between its ends with that tolerance, "a few / a handful" needs
               2 <= c <= 7, "several" c >= 2, "many / numerous" c >= ``many_min``, "dozens" at least 24
               and "hundreds" 200 with the numeric tolerance. Group sizes ("groups of two to four
               houses") are not totals. When the segment names places, c may also be the components
               touching those places (together or any one): "three houses in the upper-right".
``existence``  a YES/NO answer to a question about change (in a named region or in the image) that the
               mask contradicts: "yes" where the region has no change worth naming (as above) or the
               mask is empty; "no" where the region is clearly changed, or, for the whole image, where
               the CAR is at least ``no_change_max_car``. Questions about absence ("Is the lower-left
               unchanged?") invert the answer. "No" is only checked for generic change or construction
               questions (a mask does not say *what* changed: "were any trees removed?" passes).
Texts are read in segments with a polarity each (asserts change, asserts none, or a bare list of places
that takes its verb's polarity; exceptions after a negation assert change): see
:mod:`operators.language.phrases`.
"""
from __future__ import annotations

import collections
import functools
import json
import math
import re
from dataclasses import asdict, dataclass

import cv2
import numpy as np

from operators.language.phrases import (CHANGE_CUE, HEDGED_PRESENCE, OBJECT_NOUNS, Place, find_places, own_polarity,
                                        segments)

RULES = ("numbers", "change", "location", "magnitude", "counts", "existence")


@dataclass(frozen=True)
class ValidatorConfig:
    empty_car: float = 0.0             # a mask with CAR at or below this has no change
    # The no-change floor, in pixels of the mask, tied to the smallest object class the change classes name:
    # a building. The smallest whole house in the bundled LEVIR-CD masks (0.5 m/px) covers about 220 px
    # (7 m x 8 m), so a changed component of 200 px is one object: "no change" is wrong from one such
    # component on (a house at 0.29 % of a 1024 px crop is change), and "a new house" needs one. Smaller
    # components (slivers of a roof at a crop's edge, speckle) are not change. For imagery coarser or finer
    # than ~0.5 m/px, scale it by the square of the ratio of ground sample distances.
    min_object_px: int = 200
    no_change_max_car: float = 0.01    # only for facts without component sizes (stored by older versions)
    object_share: float = 0.5          # an object lies in a place when this share of its pixels does
    presence_fraction: float = 0.005   # a region "has change" when this share of its pixels changed ...
    presence_density: float = 0.45     # ... and it changed at least this times as densely as the whole image
                                       #     (for a 3x3 cell: holds 5% of the change), or is clearly changed
    clear_fraction: float = 0.05       # a region "clearly changed" when this share of its pixels changed
    hedged_clear_fraction: float = 0.2  # "mostly / almost unchanged" is contradicted from this share (large bin)
    entire_min_quadrants: int = 3      # "entire image" needs change in at least this many of the 4 quadrants
    small_car: float = 0.05            # JL1-CD CAR bins: small < 0.05 <= medium < 0.2 <= large
    large_car: float = 0.2
    most_car: float = 0.35             # "most of / the majority of the image" needs at least this CAR
    alt_density: float = 1.0           # "the lower-left part" read as the quadrant: changed as densely as the image
    only_share: float = 2 / 3          # "only / all of the new houses / confined to" X: X holds this share of the change
    mostly_share: float = 0.5          # "mostly / mainly / most of the houses / concentrated in" X: this share
    count_abs_tol: int = 1
    count_rel_tol: float = 0.5
    many_min: int = 4
    car_decimals_match: float = 0.005  # "0.21" matches a CAR of 0.207
    # "roughly 15 percent": a hedged round figure (a multiple of 5) is an estimate, not a copied number;
    # it must agree with the CAR within this many percentage points (or this share of the CAR)
    estimate_abs_tol: float = 5.0
    estimate_rel_tol: float = 0.35
    # The QA job's rule (JL1-QA, II-C3): an answer holds no percentage or measured figure at all, hedged or not
    # ("approximately 2 percent", "about 15%", "roughly 3 hundred square metres"); verbal shares ("about a
    # fifth") and object counts are still checked against the mask. Off for captions and audits.
    strict_numbers: bool = False


def qa_validator_config(cfg: "ValidatorConfig | None" = None) -> "ValidatorConfig":
    """The configuration the QA job checks answers with: ``cfg`` (default: the defaults) with the strict
    numbers rule."""
    from dataclasses import replace
    return replace(cfg or ValidatorConfig(), strict_numbers=True)


@dataclass(frozen=True)
class Violation:
    rule: str
    detail: str


# -- mask facts ------------------------------------------------------------------------------------
def _bands(n: int, parts: int) -> list[int]:
    return [int(round(v)) for v in np.linspace(0, n, parts + 1)]


GRID = 12           # facts keep changed pixels on a 12x12 grid: thirds, halves, quadrants, sixths fall on it
EDGE_BAND = 2       # an edge ("the bottom edge") is the outer 2/12 = 1/6 of the image on that side
_CELL_NAMES = (("upper-left", "upper", "upper-right"), ("left", "center", "right"),
               ("lower-left", "lower", "lower-right"))


def grid_regions() -> dict[str, tuple[int, int, int, int]]:
    """Named regions in grid units (y0, y1, x0, x1) of the :data:`GRID` x :data:`GRID` grid: the 3x3 cells,
    thirds, two thirds, halves, quadrants, edge bands, the center square and the whole image."""
    g, t, h, e = GRID, GRID // 3, GRID // 2, EDGE_BAND
    out = {f"cell:{_CELL_NAMES[i][j]}": (i * t, (i + 1) * t, j * t, (j + 1) * t) for i in range(3) for j in range(3)}
    out.update({
        "third:upper": (0, t, 0, g), "third:lower": (g - t, g, 0, g), "third:left": (0, g, 0, t), "third:right": (0, g, g - t, g),
        "thirds2:upper": (0, 2 * t, 0, g), "thirds2:lower": (t, g, 0, g),
        "thirds2:left": (0, g, 0, 2 * t), "thirds2:right": (0, g, t, g),
        "half:upper": (0, h, 0, g), "half:lower": (h, g, 0, g), "half:left": (0, g, 0, h), "half:right": (0, g, h, g),
        "quad:upper-left": (0, h, 0, h), "quad:upper-right": (0, h, h, g),
        "quad:lower-left": (h, g, 0, h), "quad:lower-right": (h, g, h, g),
        "edge:upper": (0, e, 0, g), "edge:lower": (g - e, g, 0, g), "edge:left": (0, g, 0, e), "edge:right": (0, g, g - e, g),
        "square:center": (g // 4, g - g // 4, g // 4, g - g // 4),
        "all": (0, g, 0, g),
    })
    return out


def region_boxes(height: int, width: int) -> dict[str, tuple[int, int, int, int]]:
    """Named boxes in pixels (y0, y1, x0, x1), see :func:`grid_regions`."""
    rows, cols = _bands(height, GRID), _bands(width, GRID)
    return {name: (rows[y0], rows[y1], cols[x0], cols[x1]) for name, (y0, y1, x0, x1) in grid_regions().items()}


def _grid_cover(region: str) -> np.ndarray:
    """Which grid cells a named region covers (the ring is everything but the center cell)."""
    cover = np.zeros((GRID, GRID), bool)
    if region.startswith("middle:"):  # the middle third, each way, of a named region
        y0, y1, x0, x1 = grid_regions()[region[len("middle:"):]]
        dy, dx = (y1 - y0) / 3, (x1 - x0) / 3
        cover[int(round(y0 + dy)):int(round(y1 - dy)), int(round(x0 + dx)):int(round(x1 - dx))] = True
        return cover
    if region == "ring":
        cover[:] = True
        region, value = "cell:center", False
    else:
        value = True
    y0, y1, x0, x1 = grid_regions()[region]
    cover[y0:y1, x0:x1] = value
    return cover


def mask_facts(mask: np.ndarray, components: int | None = None, min_component_px: int = 10) -> dict:
    """What the validators need from a boolean mask: size, changed pixels, components and, for every
    named region, ``[changed pixels, region pixels]``, and the changed pixels on the 12x12 grid (for the share
    of the change held by several regions together). JSON-serialisable (it travels in rows)."""
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
    rows, cols = _bands(h, GRID), _bands(w, GRID)
    grid = [[int(m[rows[i]:rows[i + 1], cols[j]:cols[j + 1]].sum()) for j in range(GRID)] for i in range(GRID)]
    by_region, objects = _components_by_region(m, min_component_px)
    return {"height": h, "width": w, "changed_pixels": changed, "car": changed / float(h * w) if h * w else 0.0,
            "components": int(components), "regions": regions, "grid": grid,
            "region_components": by_region, "objects": objects}


def _components_by_region(m: np.ndarray, min_px: int) -> tuple[dict[str, list[int]], list[list]]:
    """Ids of the changed components (>= ``min_px``, 8-connected, as in the mask analysis) touching each
    named region, so that "three houses in the lower-right" is counted where it is said to be; and every
    such component as ``[id, pixels, [[grid cell, pixels], ...]]`` (its pixels on the 12x12 grid), so that
    whether one object lies in a place, or outside the places a text excepts, can be measured."""
    if not m.any():
        return {name: [] for name in list(region_boxes(*m.shape)) + ["ring"]}, []
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
    h, w = m.shape
    rows = np.searchsorted(_bands(h, GRID)[1:], np.arange(h), side="right")
    cols = np.searchsorted(_bands(w, GRID)[1:], np.arange(w), side="right")
    cell = (rows[:, None] * GRID + cols[None, :])[m]
    per_cell = np.bincount(labels[m].astype(np.int64) * GRID * GRID + cell, minlength=n * GRID * GRID)
    per_cell = per_cell.reshape(n, GRID * GRID)
    objects = [[int(i), int(stats[i, cv2.CC_STAT_AREA]), [[int(c), int(per_cell[i, c])] for c in np.flatnonzero(per_cell[i])]]
               for i in range(1, n) if keep[i]]
    return out, objects


def _cover(region: str) -> np.ndarray:
    cover = np.ones((GRID, GRID), bool)
    for name in region.split("&"):
        cover &= _grid_cover(name)
    return cover


def objects(facts: dict, cfg: "ValidatorConfig") -> list[list] | None:
    """The changed components of at least ``min_object_px`` (one object of the smallest class each);
    None for facts stored without component sizes."""
    if "objects" not in facts:
        return None
    return [o for o in facts["objects"] if o[1] >= cfg.min_object_px]


def object_share(obj: list, cover: np.ndarray) -> float:
    """Share of an object's pixels inside a grid cover."""
    flat = cover.ravel()
    return sum(px for c, px in obj[2] if flat[c]) / obj[1] if obj[1] else 0.0


def objects_in(facts: dict, regions: list[str], cfg: "ValidatorConfig") -> list[list]:
    """Objects lying in the regions together (``object_share`` of their pixels inside)."""
    found = objects(facts, cfg) or []
    if not regions or not facts.get("grid"):
        return []
    cover = np.zeros((GRID, GRID), bool)
    for r in regions:
        cover |= _cover(r)
    return [o for o in found if object_share(o, cover) >= cfg.object_share]


def has_object_change(facts: dict, cfg: "ValidatorConfig") -> bool:
    """Change worth naming in the image: one object of the smallest class (``min_object_px``), or for
    older facts a CAR of ``no_change_max_car``."""
    found = objects(facts, cfg)
    return bool(found) if found is not None else facts["car"] >= cfg.no_change_max_car


def _known(facts: dict, region: str) -> bool:
    """Facts stored by an older version lack the newer regions (edge bands, two thirds) and the grid that
    intersections ("the eastern part of the northern half") are read from: those are not checked."""
    if "&" in region or region.startswith("middle:"):
        names = [r.removeprefix("middle:") for r in region.split("&")]
        return bool(facts.get("grid")) and all(r in grid_regions() or r == "ring" for r in names)
    return region in facts["regions"]


def _stats(facts: dict, region: str) -> tuple[int, int]:
    """Changed pixels and pixels of a named region or an intersection of them."""
    if "&" not in region and not region.startswith("middle:"):
        return tuple(facts["regions"][region])
    cover = np.ones((GRID, GRID), bool)
    for r in region.split("&"):
        cover &= _grid_cover(r)
    rows, cols = np.diff(_bands(facts["height"], GRID)), np.diff(_bands(facts["width"], GRID))
    return int(np.asarray(facts["grid"])[cover].sum()), int(np.outer(rows, cols)[cover].sum())


def _fraction(facts: dict, region: str) -> float:
    changed, area = _stats(facts, region)
    return changed / area if area else 0.0


def _density(facts: dict, region: str) -> float:
    """How densely the region changed relative to the whole image (1 = as dense as the image overall)."""
    return _fraction(facts, region) / facts["car"] if facts["car"] else 0.0


def has_change(facts: dict, region: str, cfg: "ValidatorConfig", single: bool = False) -> bool:
    """Change worth naming: at least ``presence_fraction`` of the region's pixels, and either clearly changed
    or at least ``presence_density`` times as densely changed as the image overall. The density test is
    the same for a corner cell, a third or a half: a sliver of a building crossing into a corner, or a
    few houses' worth spread over a half that holds little of the change, is not "change there"."""
    if single and _known(facts, region) and objects_in(facts, [region], cfg):
        return True   # "a single new house in the west": one object is change, however little of the place it covers
    fraction = _fraction(facts, region)
    return fraction >= cfg.presence_fraction and (fraction >= cfg.clear_fraction
                                                  or _density(facts, region) >= cfg.presence_density)


def clearly_changed(facts: dict, region: str, cfg: "ValidatorConfig") -> bool:
    return _fraction(facts, region) >= cfg.clear_fraction


def union_share(facts: dict, regions: list[str]) -> float | None:
    """Share of all the change that lies in the named regions together (None without the grid)."""
    if not facts.get("grid") or not facts["changed_pixels"]:
        return None
    cover = np.zeros((GRID, GRID), bool)
    for r in regions:
        part = np.ones((GRID, GRID), bool)
        for name in r.split("&"):
            part &= _grid_cover(name)
        cover |= part
    return float(np.asarray(facts["grid"])[cover].sum()) / facts["changed_pixels"]


# -- text patterns ---------------------------------------------------------------------------------
GLOBAL_NO_CHANGE = re.compile(
    r"\b(no (significant |notable |visible |obvious |apparent |major |noticeable |discernible |substantial |"
    r"meaningful |real |clear |new )*(changes?|differences?|construction|development)\b"
    r"|nothing (\w+ ){0,3}?(changed|(been )?(built|added|changed|constructed|demolished|removed))"
    r"|no new (buildings?|structures?|houses?|construction)( or (other )?changes?)?( (were|was|have|has|are|is|appear)"
    r"( been)? ?(built|constructed|added|visible|appeared|appear)?)?\b"
    r"|(image|scene|area|landscape|everything|view|neighbou?rhood|region|site|tile|frame|picture|photo)s? "
    r"(appears? |looks? |seems? )?(to )?(remains?|stays?|is|are|looks?|appears?|be)? ?"
    r"(largely |essentially |virtually |basically |entirely |completely |exactly )?(unchanged|the same|identical|"
    r"as (it|they) (was|were)|as before)"
    r"|\b(amount|extent|degree|scale) of change (\w+ ){0,4}?(is|was) (nil|zero|none|non-?existent)"
    r"|\b(changes?|differences?) (between (the )?(two )?(dates|images|photos|scenes|years) )?(is|are|was|were) "
    r"(nil|zero|none|non-?existent)"
    r"|(^|\b)(remains?|stays?) (the same|unchanged)\b"
    r"|no change (occurred|is visible|happened|took place)? ?anywhere"
    r"|(do not|don't|cannot|can't|could not|couldn't|did not|didn't) (see|spot|find|detect|identify|notice|observe) "
    r"any (new |obvious |visible |clear |notable |significant )*(changes?|differences?|construction|buildings?|"
    r"structures?|development)"
    r"|no (buildings?|structures?|houses?|homes?) (have|has|had|were|was) (been )?(added|built|constructed|erected)"
    r"|(did not|didn't|has not|hasn't|have not|haven't|does not|doesn't) (really |visibly )?change)")
_ENTIRE = re.compile(r"\b((entire|whole) (image|scene|area|frame|view|tile)|(throughout|all over) the "
                     r"(entire |whole )?(image|scene|frame|area|view)|across the (entire|whole) (image|scene|frame|area)|"
                     r"everywhere)\b")


def clauses(text: str) -> list[str]:
    """The segments of a text (see :mod:`operators.language.phrases`)."""
    return [s.text for s in segments(text)]


def _negated(clause: str) -> bool:
    return own_polarity(clause) == "neg"


def _asserts_change(clause: str) -> bool:
    return own_polarity(clause) == "pos"


# -- rules -------------------------------------------------------------------------------------------
_PERCENT = re.compile(r"\b\d+(?:[.,]\d+)?\s*(%|percent\b|per cent\b|pct\b)|%")
_PIXELS = re.compile(r"\b\d[\d,.]*\s*(changed |changing )?(pixels?|px)\b")
_DECIMAL = re.compile(r"(?<![\d.])0?\.\d{2,}\b")


# "Roughly 15 percent", "just under 20%", "well over 40 percent": a hedged whole figure is an estimate.
_ESTIMATE = re.compile(r"\b(about|around|roughly|approximately|approx\.?|some|nearly|almost|close to|just under|"
                       r"call it|say|\d{1,2} or|\d{1,2} to|\d{1,2}\s*[-\u2013]|"
                       r"a bit (?:under|over|more than|less than)|"
                       r"just over|a little (?:under|over|more than|less than)|(?:well |slightly )?(?:under|over|below|"
                       r"above)|less than|more than|at least|at most|perhaps|maybe|an estimated|something like|"
                       r"in the region of|on the order of)\s+(\d{1,2}|100)\s*(%|percent\b|per cent\b)")


# "25 percent or thereabouts", "18 percent or so": hedged after the figure.
_ESTIMATE_AFTER = re.compile(r"()\b(\d{1,2}|100)\s*(%|percent\b|per cent\b)(?=,? (or so|or thereabouts|give or take|"
                             r"more or less|at a guess|or close to it)\b)")


def _estimate_ok(qualifier: str, figure: float, car_pct: float, cfg: ValidatorConfig) -> bool:
    """Does "<qualifier> <figure> percent" hold for a CAR of ``car_pct`` percent?"""
    tol = max(cfg.estimate_abs_tol, cfg.estimate_rel_tol * car_pct)
    near = bool(re.match(r"(just|a little|slightly) ", qualifier))      # "just under 20": close below 20
    bound = re.sub(r"^(just|a little|slightly|well) ", "", qualifier)
    if re.match(r"\d", bound):   # "11 or 12 percent", "10-15 percent": a range, read at its upper end
        low = float(re.match(r"\d+", bound).group(0))
        return low - max(cfg.estimate_abs_tol, cfg.estimate_rel_tol * car_pct) <= car_pct <= figure + tol
    if bound in ("under", "below", "less than", "at most"):
        return figure - (tol if near else math.inf) <= car_pct <= figure + 0.5
    if bound in ("over", "above", "more than", "at least"):
        return figure - 0.5 <= car_pct <= figure + (tol if near else math.inf)
    return abs(car_pct - figure) <= tol


_FRACTIONS = {"a tenth": 0.1, "one tenth": 0.1, "one-tenth": 0.1, "an eighth": 0.125, "one eighth": 0.125,
              "one-eighth": 0.125, "a sixth": 1 / 6, "one sixth": 1 / 6, "one-sixth": 1 / 6, "a fifth": 0.2,
              "one fifth": 0.2, "one-fifth": 0.2, "a quarter": 0.25, "one quarter": 0.25, "one-quarter": 0.25,
              "a third": 1 / 3, "one third": 1 / 3, "one-third": 1 / 3, "half": 0.5, "a half": 0.5, "one half": 0.5,
              "two thirds": 2 / 3, "two-thirds": 2 / 3, "three quarters": 0.75, "three-quarters": 0.75}
_ORDINALS = {"seventh": 7, "ninth": 9, "twelfth": 12, "fifteenth": 15, "twentieth": 20, "thirtieth": 30,
             "fiftieth": 50, "hundredth": 100}
_FRACTIONS |= {f"{a}{sep}{o}": 1 / n for o, n in _ORDINALS.items() for a, sep in (("a", " "), ("one", " "), ("one", "-"))}
# "Roughly a third of the scene", "about two thirds of it", "under a tenth of this crop": a proportion of the
# whole view (not of a place: "half of the lower half" is the location rules' business, nor of objects:
# "half of the houses").
_VERBAL_SHARE = re.compile(
    r"\b(about|around|roughly|approximately|some|nearly|almost|close to|just under|just over|a (?:little|bit) "
    r"(?:under|over|more than|less than)|(?:well |slightly )?(?:under|over|below|above)|less than|more than|at least|"
    r"at most|perhaps|maybe|somewhere around)?\s*("
    + "|".join(sorted(map(re.escape, _FRACTIONS), key=len, reverse=True))
    + r")( of (it|(the|this|that|its) (whole |entire )?(image|scene|area|frame|view|crop|section|quadrant|tile|picture|"
      r"photo|neighbou?rhood)|this (part|corner|patch|region|piece))\b|(?=[.;,]?\s*$))")


_PLACE_BEFORE_SHARE = re.compile(r"\b(the|its|this|that|these|their|upper|lower|top|bottom|left|right|northern|"
                                 r"southern|eastern|western|north|south|east|west|central|middle|outer|inner|other|"
                                 r"first|second|last|same|whole|entire|[\w-]+most|[\w-]+ern)\s*$")


def _fraction_ok(qualifier: str, share: float, car: float, cfg: ValidatorConfig) -> bool:
    return _estimate_ok(qualifier, 100 * share, 100 * car, cfg)


_FIGURE_UNITS = (r"(%|percent\b|per cent\b|pct\b|square (metres|meters|feet|foot|kilometres|kilometers|miles|yards)\b|"
                 r"sq\.? ?(m|km|ft|mi)\b|m2\b|m²|km2\b|km²|hectares?\b|ha\b|acres?\b|metres?\b|meters?\b|m\b|"
                 r"kilometres?\b|kilometers?\b|km\b|feet\b|foot\b|ft\b|miles?\b|yards?\b|pixels?\b|px\b)")


@functools.lru_cache(maxsize=1)
def _strict_figure() -> re.Pattern:
    words = "|".join(sorted(map(re.escape, [w for w in _NUMBER_WORDS if not w.startswith(("a ", "single", "only"))]),
                            key=len, reverse=True))
    return re.compile(r"(?<![\w.])(\d[\d,]*(?:\.\d+)?|\.\d+|" + words + r"|a few|several|a hundred|a thousand|"
                      r"hundreds of|thousands of)"
                      r"(?:\s+(?:hundred|thousand|million))?(?:\s*-\s*\d+(?:\.\d+)?)?\s*-?\s*" + _FIGURE_UNITS
                      + r"|(?<![\d.])0?\.\d+\b")


def check_numbers(text: str, facts: dict, cfg: ValidatorConfig, question: str | None = None) -> list[Violation]:
    t = text.lower()
    out = []
    if cfg.strict_numbers:
        # The QA job's rule: no figure at all, however hedged ("about 15%", "roughly 3 hundred square metres",
        # "around 0.12 of the image"): precision an answer cannot read off the images.
        if m := _strict_figure().search(t):
            out.append(Violation("numbers", f"figure {m.group(0).strip()!r} in an answer: no percentages or "
                                            f"measured figures, hedged or not"))
    estimates = list(_ESTIMATE.finditer(t)) + list(_ESTIMATE_AFTER.finditer(t))
    for m in estimates:
        if not _estimate_ok(m.group(1), float(m.group(2)), 100 * facts["car"], cfg):
            out.append(Violation("numbers", f"{m.group(0).strip()!r} but {100 * facts['car']:.1f}% of the image "
                                            f"changed"))
    # A verbal share of the view; a bare one ("About two thirds of it.", "Roughly half.") only when it
    # answers a question about how much changed.
    amount_question = bool(question) and bool(_AMOUNT_QUESTION.search(question.lower()) or
                                              re.search(r"\b(proportion|share|fraction|percentage)\b", question.lower()))
    for m in _VERBAL_SHARE.finditer(t):
        if m.group(3) is None and not (amount_question and m.start() < 30):
            continue
        if not m.group(1) and _PLACE_BEFORE_SHARE.search(t[:m.start()]):
            continue   # "the lower half of the image", "its upper two thirds": a place, not a share
        if not _fraction_ok((m.group(1) or "").strip(), _FRACTIONS[m.group(2)], facts["car"], cfg):
            out.append(Violation("numbers", f"{m.group(0).strip()!r} but {100 * facts['car']:.1f}% of the image "
                                            f"changed"))
            break
    m = next((m for m in _PERCENT.finditer(t) if not any(e.start() <= m.start() < e.end() for e in estimates)), None)
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


_OBJECT_WORD = re.compile(r"\b(" + OBJECT_NOUNS + r"|roads?|construction)\b")


def check_change(text: str, facts: dict, cfg: ValidatorConfig, question: str | None = None) -> list[Violation]:
    segs = segments(text)
    if facts["car"] <= cfg.empty_car:
        for s in segs:
            if s.own == "pos":
                return [Violation("change", f"asserts change ({s.text!r}) but the mask is empty")]
        return []
    if not has_object_change(facts, cfg):
        # A sliver (smaller than one object of the smallest class) is no new building: "new houses were built in
        # this part" is wrong; "just a sliver of a new roof reaches into the corner" is right.
        for s in segs:
            if s.own == "pos" and _OBJECT_WORD.search(s.text) and not (
                    HEDGED_PRESENCE.search(s.text) or _SMALL.search(s.text) or _NEAR_NONE.search(s.text)
                    or re.search(r"\d|percent|\b(tiny|small|little|sliver|edge|tip|part of a|piece|trace|"
                                 r"fragment|hint|only|just|barely|hardly)\b", s.text)):
                return [Violation("change", f"asserts new buildings ({s.text!r}) but no changed area of the "
                                            f"mask reaches {cfg.min_object_px} px (one building; "
                                            f"{100 * facts['car']:.2f}% changed)")]
    if question and find_places(question.lower()):
        return []  # "No, nothing changed there" answers about the question's place (the location rules' job)
    # "What changed? - Nothing; the road and the houses are as they were.": the answer's first word denies it all.
    if question and _WHAT_CHANGED_Q.search(question.lower()) and _NOTHING_ANSWER.match(text.lower()) \
            and has_object_change(facts, cfg):
        return [Violation("change", f"answers {question!r} with no change ({text!r}) but {100 * facts['car']:.1f}% "
                                    f"of the mask changed")]
    # Change asserted anywhere, or excepted from the no-change claim with a place or an object ("apart from
    # two buildings in the north-east, nothing changed"), makes the claim partial.
    if has_object_change(facts, cfg) and not any(
            s.own == "pos" or (s.exception and s.polarity == "pos" and (s.places or _OBJECT_WORD.search(s.text)))
            for s in segs):
        for i, s in enumerate(segs):
            # "The upper-right corner, where nothing changed": the place belongs to the claim.
            local = any(o.inherited_from == i and o.places for o in segs)
            if GLOBAL_NO_CHANGE.search(s.text) and not s.places and not local and not _PARTIAL.search(s.text):
                return [Violation("change", f"asserts no change ({s.text!r}) but {100 * facts['car']:.1f}% of the "
                                            f"mask changed")]
    return []


_WHAT_CHANGED_Q = re.compile(r"\bwhat\b.*\b(chang(e|ed|es)|differen(t|ce|ces)|new|built|appeared|added)\b")
_NOTHING_ANSWER = re.compile(r"\s*(nothing|none|no changes?|no differences?|nothing at all)\s*([.;:!,]|$)"
                             r"(?!.*\b(except|apart from|but|besides|other than|save)\b)")


# "Most of the image is unchanged" / "the rest of the scene": a part, not the whole ("this part of the
# neighbourhood" is the whole view).
_PARTIAL = re.compile(r"(?<!this )(?<!that )\b(most|much|rest|remainder|part|parts|portion|majority|some|areas?) of "
                      r"(the )?(image|scene|area|surroundings|neighbou?rhood)\b|\belsewhere\b")


def _is_yes_no(question: str | None, qtype: str | None) -> bool:
    if qtype and qtype.upper().replace(" ", "") in ("YES/NO", "YES_NO", "YESNO"):
        return True
    return bool(question) and bool(re.match(r"\s*(is|are|was|were|has|have|had|did|does|do|can|could|will)\b",
                                            question.lower()))


def _answer_polarity(answer: str) -> str | None:
    m = re.match(r"\s*(yes|yeah|yep|correct|indeed|absolutely|certainly|definitely|no|nope|not really|not at all|"
                 r"none|nothing|never)\b", answer.lower())
    if not m:
        return None
    return "yes" if m.group(1) in ("yes", "yeah", "yep", "correct", "indeed", "absolutely", "certainly",
                                   "definitely") else "no"


def place_has_change(facts: dict, p: Place, cfg: ValidatorConfig, hedged: bool = False, single: bool = False) -> bool:
    """Change worth naming under some reading of the place. The second, coarser reading (the quadrant of "the
    lower-left part") counts only when it changed at least ``alt_density`` times as densely as the image: a
    building's tail reaching into the quadrant from the middle is not "change in the lower-left"."""
    if has_change(facts, p.region, cfg, single) or (hedged and _fraction(facts, p.region) >= cfg.presence_fraction):
        return True  # hedged ("just reaches into the west"): some change is enough
    return bool(p.alt) and _fraction(facts, p.alt) >= cfg.presence_fraction and \
        _density(facts, p.alt) >= cfg.alt_density


# A clause about one object ("a single new house", "one small building", "a new home"): one object of the smallest
# class is enough to make it true of a place, where a claim about the change ("the new houses are in the west")
# needs the place to hold its share.
_SINGLE_OBJECT = re.compile(r"\b(a|an|one|a single|single|another|a lone|an isolated|only one)\s+([\w-]+\s+){0,3}?"
                            r"(house|building|home|structure|residence|dwelling|villa|shed|warehouse|block|roof)\b"
                            r"(?!\s+(and|or|,)\s)")


def place_clearly_changed(facts: dict, p: Place, cfg: ValidatorConfig) -> bool:
    """Clearly changed under every reading of the place."""
    return clearly_changed(facts, p.region, cfg) and (not p.alt or clearly_changed(facts, p.alt, cfg))


# Exclusive and majority claims about where the change is: "only in the north", "all of the new houses are
# in ...", "confined to ..." / "mostly", "mainly", "most of the new houses", "concentrated in".
_ONLY = re.compile(r"\b((only|solely|exclusively|entirely|just) (in|on|along|at|near|around|within|across|to|the|"
                   r"this|that)\b|the only\b|all (of )?(the |these |those |them )?(new |changes?\b|construction|"
                   r"buildings?|houses?|structures?|homes?)|all (of )?(them|these|those)\b|(are|were|is|was) all\b|"
                   r"confined to|limited to|restricted to|nowhere else)")
_MOSTLY = re.compile(r"\b(most of (the |them|these|those)(?!(image|scene|area|frame|view|picture|tile|rest)\b)|"
                     r"mostly|mainly|predominantly|primarily|chiefly|largely|concentrated|the (bulk|majority) of "
                     r"(the )?(new|changes?|construction|buildings?|houses?|structures?|homes?|development))")


# "The entire northern half", "all along the bottom edge", "the full width of the top": the whole place.
_WHOLE_OF = re.compile(r"\b(entire|entirety of|whole|full|fully|completely|all (along|over|across)|all of|"
                       r"across the (entire|whole|full))( (length|width|extent|expanse|stretch))?( of)?( the)?\s*$")


def _unchanged_parts(facts: dict, region: str, cfg: ValidatorConfig) -> list[str]:
    """The 3x3 cells a place spreads over (its pieces at least half the size of its largest) that have
    less than ``presence_fraction`` of their pixels changed inside the place."""
    if not _known(facts, region) or not facts.get("grid"):
        return []
    pieces = [(name.removeprefix("cell:"), _stats(facts, f"{region}&{name}"))
              for name in grid_regions() if name.startswith("cell:")]
    pieces = [(n, st) for n, st in pieces if st[1]]
    largest = max(st[1] for _, st in pieces)
    return [n for n, (changed, area) in pieces if area >= largest / 2 and changed / area < cfg.presence_fraction]


def _largest_of_its_kind(facts: dict, region: str) -> bool:
    """A 3x3 cell or quadrant holding more of the change than any other: "mostly in the bottom center" is
    true of the cell with the most change even when it holds less than ``mostly_share``."""
    kind = region.split(":")[0]
    if kind not in ("cell", "quad") or "&" in region:
        return False
    return facts["regions"][region][0] >= max(v[0] for k, v in facts["regions"].items() if k.startswith(kind + ":"))


def _places_with_continuation(segs, i: int) -> list[Place]:
    """The places of segment ``i`` and of the bare segments that took their polarity from it (a list of
    places continued after a comma: "mostly in the north, the east and the center")."""
    out = list(segs[i].places)
    for s in segs[i + 1:]:
        if s.inherited_from != i:
            break
        out += s.places
    return out


def _region_names(places: list[Place]) -> str:
    return ", ".join(p.name for p in places)


def check_location(text: str, facts: dict, cfg: ValidatorConfig, question: str | None = None,
                   qtype: str | None = None) -> list[Violation]:
    out = []
    q = question.lower() if question else ""
    question_about_change = bool(q) and bool(CHANGE_CUE.search(q))
    # An answer that names no place speaks about the question's place ("What happened in the north-east?
    # - New houses were built."), unless the question offers places to choose from.
    question_places = find_places(q) if q and not _is_yes_no(question, qtype) and " or " not in q and \
        (qtype or "").upper() != "COMPARE" else []
    segs = segments(text)
    for i, s in enumerate(segs):
        polarity = s.polarity or ("pos" if question_about_change else None)
        places = [p for p in (s.places or question_places) if _known(facts, p.region)]
        for p in places:
            if polarity == "pos" and not place_has_change(facts, p, cfg, bool(HEDGED_PRESENCE.search(s.text)),
                                                          bool(_SINGLE_OBJECT.search(s.text))):
                out.append(Violation("location", f"change placed in the {p.name} ({s.text!r}), where the mask has "
                                                 f"{100 * _fraction(facts, p.region):.1f}% changed"))
            elif polarity == "neg" and place_clearly_changed(facts, p, cfg) and not (
                    s.hedged and _fraction(facts, p.region) < cfg.hedged_clear_fraction):
                out.append(Violation("location", f"the {p.name} is said to be unchanged ({s.text!r}), but "
                                                 f"{100 * _fraction(facts, p.region):.1f}% of it changed"))
            elif polarity == "neg" and not s.hedged and s.own == "neg" and not s.exception \
                    and not CHANGE_CUE.search(s.text) and (  # "a new house in the otherwise unchanged north": mixed
                    inside := [o for o in objects_in(facts, [p.region], cfg)
                               if not p.alt or o in objects_in(facts, [p.alt], cfg)]):
                # One house is change: "the southern half is unchanged" is wrong with a new house in it.
                out.append(Violation("location", f"the {p.name} is said to be unchanged ({s.text!r}), but a "
                                                 f"changed area of {inside[0][1]} px (one object or more) lies in it"))
        if polarity == "pos" and s.places and facts["changed_pixels"]:
            for pattern, need, word in ((_ONLY, cfg.only_share, "only"), (_MOSTLY, cfg.mostly_share, "mostly")):
                if pattern.search(s.text):
                    named = [p for p in _places_with_continuation(segs, i) if _known(facts, p.region)]
                    share = union_share(facts, [p.region for p in named]) if named else None
                    # A reading with the alternative regions may hold more: take the kinder one.
                    alt = union_share(facts, [p.alt or p.region for p in named]) if named else None
                    if share is not None and max(share, alt or 0.0) < need and not (
                            word == "mostly" and len(named) == 1 and _largest_of_its_kind(facts, named[0].region)):
                        out.append(Violation("location", f"{word!r} in the {_region_names(named)} ({s.text!r}), but "
                                                         f"they hold {100 * max(share, alt or 0.0):.0f}% of the change "
                                                         f"(needs {100 * need:.0f}%)"))
                    break
        if polarity == "pos":
            for p in places:
                if _WHOLE_OF.search(s.text[max(0, p.start - 40):p.start]) and p in s.places:
                    gaps = _unchanged_parts(facts, p.region, cfg)
                    if gaps:
                        out.append(Violation("location", f"change over the whole {p.name} ({s.text!r}), but its "
                                                         f"{', '.join(gaps)} part has no change"))
        if _ENTIRE.search(s.text) and polarity == "pos":
            quads = sum(1 for k in facts["regions"] if k.startswith("quad:") and has_change(facts, k, cfg))
            if facts["changed_pixels"] and quads < cfg.entire_min_quadrants:
                out.append(Violation("location", f"change over the entire image ({s.text!r}), but only {quads} of 4 "
                                                 f"quadrants changed"))
    return out + check_scope(segs, facts, cfg)


# "The rest of the image is unchanged", "elsewhere nothing changed", "nothing else has changed": a claim about
# everything outside the places the text names as changed.
_REST = re.compile(r"\b(rest|remainder|remaining (part|parts|area|areas)|elsewhere|else|otherwise|surrounding|"
                   r"surroundings|outside|beyond)\b")
# A span or a spread ("scattered from the upper left to the lower right", "across the scene") names no scope.
_SPAN = re.compile(r"\b(from\b.*\bto\b|scattered|spread|across|throughout|all over|between)\b")
_RELATIVE_START = re.compile(r"\s*(where|which|that|whose|in which|on which)\b")


def check_scope(segs, facts: dict, cfg: ValidatorConfig) -> list[Violation]:
    """The scope of an exception: "apart from R, the scene is unchanged", "except for R, nothing changed" and
    "... in R; the rest of the image is unchanged" are wrong when an object (``min_object_px``) lies outside
    the places the text names as changed (R, under its kinder reading)."""
    found = objects(facts, cfg)
    if not found or not facts.get("grid"):
        return []
    claims = [s for s in segs if s.polarity == "neg" and s.own == "neg" and not s.hedged and not s.places
              and not s.alternative and (GLOBAL_NO_CHANGE.search(s.text) or _REST.search(s.text))
              and not re.search(r"\b(most|much|majority|some|part|parts|portion)\b", s.text)]
    if not claims:
        return []
    scope: list[Place] = []
    for i, s in enumerate(segs):
        if s in claims or s.polarity == "neg" or (s.inherited_from is not None and not s.exception):
            continue
        places = _places_with_continuation(segs, i)
        if not places and _RELATIVE_START.match(s.text) and i and segs[i - 1].places:
            continue   # "apart from the north-east, where new houses stand": the place before it
        talks_change = bool(CHANGE_CUE.search(s.text) or _OBJECT_WORD.search(s.text)) or bool(places)
        if not talks_change:
            continue   # "apart from that": the clause before it
        if not places or _SPAN.search(s.text) or not all(_known(facts, p.region) for p in places):
            return []  # change said to be somewhere the text does not place: no scope to check
        scope += places
    if not scope:
        return []
    cover = np.zeros((GRID, GRID), bool)
    for p in scope:
        cover |= _cover(p.region) | (_cover(p.alt) if p.alt and _known(facts, p.alt) else False)
    outside = [o for o in found if object_share(o, cover) < cfg.object_share]
    if not outside:
        return []
    return [Violation("location", f"everything outside the {_region_names(scope)} is said to be unchanged "
                                  f"({claims[0].text!r}), but {len(outside)} changed area(s) of at least "
                                  f"{cfg.min_object_px} px lie outside it")]


# What "most of / much of / dominated" may be said of: the view itself ("this crop", "the scene").
_VIEW = r"(image|scene|area|frame|view|crop|section|quadrant|tile|picture|photo|part|patch|region)"
_LARGE = re.compile(r"\b(large[- ]scale|extensive(ly)?|widespread|massive(ly)?|vast|sweeping|wholesale|"
                    r"(large|considerable|substantial|sizable|sizeable|significant) (portion|part|area|share|swath|"
                    r"tract|fraction|amount|proportion)s?|"
                    rf"much of (the|this|that) {_VIEW}|dominat(es|ing|ed) (the|this|that) {_VIEW}|"
                    rf"{_VIEW} (is|was|has been) dominated by)\b")
_MOST = re.compile(rf"\b(most of (the|this|that) {_VIEW}|(the )?(majority|bulk) of (the|this) {_VIEW}|"
                   rf"(nearly|almost|virtually|practically) (all|the entire|the whole) (of )?(the|this|that) ({_VIEW})\b|"
                   r"(nearly|almost|virtually|practically) all of it(?=\s*([.;,!]|$|(is|was|has|have|changed|got)\b))|"
                   rf"(nearly|almost|virtually|practically) (the )?(entire|whole) {_VIEW}|"
                   r"(the )?(majority|bulk) of it\b|most of it(?= (is|was|has|changed|got)\b)|"
                   r"(almost|nearly|virtually|practically) (completely|entirely|fully|totally) (filled|covered|built[- ]up|"
                   r"built over|taken up|occupied))\b")
# "Larger than what stayed the same": more than half changed. Its "stayed the same" is no negation of the claim.
_MORE_THAN_UNCHANGED = re.compile(r"\b(larger|bigger|greater|more) than (what|the (part|area|portion|rest) that) "
                                  r"(stayed|remained|is|was|has stayed|has remained) (the same|unchanged|untouched)|"
                                  r"\b(larger|bigger|greater) than the (unchanged|untouched) (area|part|portion|rest)\b")
# "Houses are scattered across most of the scene" says how far they spread, not how much area changed.
_SPREAD = re.compile(r"\b(scattered|spread|dotted|distributed|sprinkled|strewn|dispersed)( out)? (across|over|through(out)?"
                     r"|around) $")
# Graded small-magnitude words: "small / minor / modest" are wrong on a large-bin mask; "negligible / barely
# anything / a tiny patch" deny almost all change and are wrong from the medium bin up.
# "Small" is an amount when it sizes an area or the change ("a small spot", "small changes") or is said of the
# change itself ("the amount of change here is small", "the new construction is fairly small"); said of objects
# ("small houses were built", "the new houses are small") it is their size.
_SMALL = re.compile(r"\b(small[- ]scale|locali[sz]ed|minor|limited|slight(ly)?|tiny|negligible|marginal|modest|"
                    r"small (portion|part|area|patch|patches|spot|spots|fraction|share|change|changes|amount|proportion|"
                    r"modifications?|alterations?|differences?|section|piece|zone|strip|extent|degree|sliver|slice))\b")
_SMALL_PREDICATE = re.compile(r"^(?P<subject>.*?)\b(is|are|was|were|seems?|appears?|looks?|remains?)( (very|rather|quite|"
                              r"fairly|relatively|pretty|only|comparatively|overall))? (?P<word>small|minor|limited|"
                              r"slight|tiny|modest|minimal)\b")
# What may follow the subject's head noun before its verb: "the amount [of change] [in this area] is small".
_SUBJECT_TAIL = re.compile(r"(\s+(here|there|overall|now|in (this|that|the|each) [\w-]+( of (the )?[\w-]+)?|between "
                           r"(the )?(two )?[\w-]+|across (the )?[\w-]+|of (the )?(new )?(change|changes|construction|"
                           r"development|modifications?|alterations?)))+\s*$")
_AMOUNT_HEAD = re.compile(r"\b(amount|extent|scale|degree|share|proportion|changes?|modifications?|alterations?|"
                          r"differences?|construction|development|transformation|footprint|(changed|affected|modified|"
                          r"built[- ]up) (area|region|part|portion|surface)|(area|region|part|portion|surface) (affected|"
                          r"changed|modified))\s*$")
# A question about the amount makes its answer's "very little" / "minor" speak of the change.
_AMOUNT_QUESTION = re.compile(r"\b(how (much|extensive|large|big|significant|widespread|substantial)|to what (extent|"
                              r"degree)|(large|small)[- ]scale|extent|amount|magnitude|scale)\b")
# Words that make a segment speak of the change (beyond the change words themselves).
_ABOUT_CHANGE = re.compile(r"\b(it|this|differences?|modifications?|modif(y|ies|ied)|alterations?|alters?|affects?|"
                           r"amount|extent)\b")


_LARGE_PREDICATE = re.compile(_SMALL_PREDICATE.pattern.replace(
    "(?P<word>small|minor|limited|slight|tiny|modest|minimal)",
    "(?P<word>huge|large|big|vast|enormous|massive|extensive|considerable|substantial|sizable|sizeable|immense)"))


def _small_amount(c: str, predicate=_SMALL_PREDICATE):
    """"Small" (or minor, limited, ...) predicated of the change or its amount, not of objects."""
    m = predicate.search(c)
    if not m:
        return None
    subject = _SUBJECT_TAIL.sub("", m.group("subject").rstrip())
    return m if _AMOUNT_HEAD.search(subject) else None


_NEAR_NONE = re.compile(r"\b(negligible|minimal|insignificant|minuscule|trivial|(barely|hardly|scarcely) (any|anything|"
                        r"noticeable|visible|perceptible|affect(s|ed)?|alter(s|ed)?|change(s|d)?|touch(es|ed)?|"
                        r"modif(y|ies|ied))|(almost|virtually|practically) nothing|next to nothing|very "
                        r"(little|small|minor|slight)|(tiny|very small|minute) (patch|patches|spot|spots|change|changes|area|"
                        r"fraction|portion|part|amount|bit|share|proportion|piece|slice|sliver))\b")


def check_magnitude(text: str, facts: dict, cfg: ValidatorConfig, question: str | None = None) -> list[Violation]:
    car, out = facts["car"], []
    # An answer to "how much changed in the west?" speaks of the west: not checked against the whole image.
    question_places = find_places(question.lower()) if question else []
    amount_question = bool(question) and bool(_AMOUNT_QUESTION.search(question.lower())) and not question_places
    segs = segments(text)
    for s in segs:
        c = s.text
        if question_places and not s.places:
            continue
        about_change = amount_question or bool(CHANGE_CUE.search(c)) or bool(_ABOUT_CHANGE.search(c))
        # Near-"no change" words deny the change themselves ("barely anything changed"): read before the
        # negation test below. About the whole image only: "hardly any change in the north" is the location
        # rule's business.
        if (m := _NEAR_NONE.search(c)) and not s.places and car >= cfg.small_car and about_change \
                and not re.search(r"\b(not|n't|rather than|instead of)\b", c):
            out.append(Violation("magnitude", f"{m.group(0)!r} but the change area ratio is {100 * car:.1f}% "
                                              f"(small bin: < {100 * cfg.small_car:g}%)"))
            continue
        if (m := _MORE_THAN_UNCHANGED.search(c)) and not s.places and car < cfg.most_car \
                and not re.search(r"\b(not|n't|hardly)\b", c[:m.start()]):
            out.append(Violation("magnitude", f"{m.group(0)!r} but the change area ratio is {100 * car:.1f}% "
                                              f"(needs {100 * cfg.most_car:g}%)"))
            continue
        if re.search(r"\b(not|no|hardly|rather than|instead of)\b", c) or s.polarity == "neg":
            continue  # "not extensive", "no large-scale change": negated magnitude words say nothing here
        # "most of the frame is parking and grass" is no claim about the change.
        if (m := _MOST.search(c)) and not _SPREAD.search(c[:m.start()]) and not re.search(r"\bstill\b", c) \
                and (about_change or any(o.sentence == s.sentence and (CHANGE_CUE.search(o.text) or
                                                                       _ABOUT_CHANGE.search(o.text)) for o in segs)):
            if car < cfg.most_car:
                out.append(Violation("magnitude", f"{m.group(0)!r} but the change area ratio is "
                                                  f"{100 * car:.1f}% (needs {100 * cfg.most_car:g}%)"))
                continue
        if (m := _LARGE.search(c) or _small_amount(c, _LARGE_PREDICATE)) and car < cfg.small_car \
                and not (s.places and not _LARGE.search(c)):   # "the change in the north is large": of a place
            out.append(Violation("magnitude", f"{m.group(0)!r} but the change area ratio is {100 * car:.1f}% "
                                              f"(small bin: < {100 * cfg.small_car:g}%)"))
        elif (m := _small_amount(c)) and car >= cfg.large_car and not s.places:  # of a place: not the whole's
            out.append(Violation("magnitude", f"{m.group('word')!r} said of the change, but the change area ratio is "
                                              f"{100 * car:.1f}% (large bin: >= {100 * cfg.large_car:g}%)"))
        elif (m := _SMALL.search(c)) and car >= cfg.large_car and about_change:
            out.append(Violation("magnitude", f"{m.group(0)!r} but the change area ratio is {100 * car:.1f}% "
                                              f"(large bin: >= {100 * cfg.large_car:g}%)"))
    return out


_NUMBER_WORDS = {"one": 1, "a single": 1, "single": 1, "only one": 1, "two": 2, "a pair of": 2, "a couple of": 2,
                 "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10,
                 "eleven": 11, "twelve": 12, "a dozen": 12, "thirteen": 13, "fourteen": 14, "fifteen": 15,
                 "sixteen": 16, "seventeen": 17, "eighteen": 18, "nineteen": 19, "twenty": 20, "thirty": 30,
                 "half a dozen": 6, "a half dozen": 6, "two dozen": 24, "a score of": 20}
_TENS = {"twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70, "eighty": 80, "ninety": 90}
_UNITS = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
_NUMBER_WORDS |= _TENS | {f"{t}{sep}{u}": n + k + 1 for t, n in _TENS.items() for k, u in enumerate(_UNITS)
                          for sep in ("-", " ")} | {"a hundred": 100, "one hundred": 100}
_VAGUE = {"a few": "few", "a handful of": "few", "several": "several", "many": "many", "numerous": "many",
          "a large number of": "many", "a good number of": "many", "lots of": "many", "a lot of": "many",
          "a small number of": "few", "multiple": "several", "a number of": "several", "a series of": "several", "a group of": "several",
          "a cluster of": "several", "a row of": "several", "dozens of": "dozens", "a few dozen": "dozens", "several dozen": "dozens",
          "hundreds of": "hundreds"}
# "Dozens" / "hundreds" are read as at least 24 / 200, with the numeric tolerance.
_VAGUE_AT_LEAST = {"dozens": 24, "hundreds": 200}
_OBJECTS = (r"(new |small |large |big |single[- ]family |residential |detached |separate |additional |individual |"
            r"very |huge |massive |industrial |commercial |distinct |rectangular |tall |low[- ]rise |"
            r"light[- ]roofed |grey |gray |white |red |blue )*"
            r"(buildings?|houses?|homes?|structures?|roofs?|residences?|dwellings?|villas?|warehouses?|"
            r"factories|factory|sheds?|blocks?|roads?|ponds?|patches|patch|plots?|fields?|facilities|facility|"
            r"constructions?|objects?|units?|buildings?)")
_COUNT = re.compile(r"\b(about |around |approximately |roughly |nearly |almost |some |well over |over |more than |"
                    r"at least |fewer than |less than |under |at most |no more than |up to |exactly |only |just |something like |"
                    r"close to )?"
                    r"(" + "|".join(sorted(map(re.escape, list(_NUMBER_WORDS) + list(_VAGUE)), key=len, reverse=True))
                    + r"|\d{1,3})(?: or (\w+))? " + _OBJECTS + r"\b")


_NUM = r"(\d{1,3}|" + "|".join(sorted(map(re.escape, _NUMBER_WORDS), key=len, reverse=True)) + ")"
_RANGE_START = re.compile(r"\b" + _NUM + r"\s*(?:to|-|\u2013|and)\s*$")
_GROUP_SIZE = re.compile(r"\b(groups|clusters|rows|sets|blocks|lines|batches|pairs|each|per)\s+(of\s+)?"
                         r"(" + _NUM + r"\s*(?:to|-|\u2013|or)\s*)?$")


_LANDMARK = re.compile(r"\b(along|beside|besides|near|by|next to|around|between|behind|facing|opposite|across|"
                       r"in front of|alongside|among|adjacent to|close to)\s+(the\s+)?$")
_HOW_MANY = re.compile(r"\bhow many\b")
_BARE_COUNT = re.compile(_COUNT.pattern.split(r"(?: or (\w+))? ")[0] + r"(?: or (\w+))?\b(?!\s*(%|percent|of\b))")


_MORE_OF_ANOTHER_KIND = re.compile(r"\s*(,? and|,? plus|as well as|along with|together with)\s+([\w-]+\s+){0,5}?"
                                   r"(townhouses?|houses?|homes?|buildings?|structures?|units?|sheds?|warehouses?|"
                                   r"villas?|dwellings?|residences?|garages?|barns?|apartments?|blocks?)\b")


def _count_ok(stated: str, qualifier: str, alt: str | None, c: int, cfg: ValidatorConfig) -> bool:
    if stated in _VAGUE:
        kind = _VAGUE[stated]
        if kind == "few":
            return 2 <= c <= 7
        if kind == "several":
            return c >= 2
        if kind in _VAGUE_AT_LEAST:
            return c + max(cfg.count_abs_tol, cfg.count_rel_tol * c) >= _VAGUE_AT_LEAST[kind]
        return c >= cfg.many_min
    n = int(stated) if stated.isdigit() else _NUMBER_WORDS[stated]
    tol = max(cfg.count_abs_tol, cfg.count_rel_tol * c)
    if alt:  # "six or seven houses", "18 to 20 houses": anything from one end to the other
        m = _NUMBER_WORDS.get(alt, int(alt) if alt.isdigit() else None)
        if m is not None and min(n, m) - tol <= c <= max(n, m) + tol:
            return True
    q = qualifier.strip()
    if q in ("more than", "over", "at least", "well over"):
        return c + tol >= n
    if q in ("fewer than", "less than", "under", "at most", "no more than", "up to"):
        return c - tol <= n
    return abs(n - c) <= tol


def check_counts(text: str, facts: dict, cfg: ValidatorConfig, question: str | None = None) -> list[Violation]:
    question_about_change = bool(question) and bool(CHANGE_CUE.search(question.lower()))
    question_places = find_places(question.lower()) if question else []
    out = []
    segs = segments(text)
    for s in segs:
        if s.polarity == "neg" or not (s.polarity == "pos" or question_about_change):
            continue
        # A count may be about the whole image or about the place the clause names ("a few houses in the
        # lower-right": components touching that region); either reading may match.
        candidates = [int(facts["components"])]
        places = s.places or question_places
        by_region = facts.get("region_components") or {}
        if places and by_region:  # all the named places together, or any one of them
            # An intersection ("the top of the west") counts the components touching all its parts (at most).
            sets = [set.intersection(*(set(by_region[x]) for x in r.split("&")))
                    for p in places for r in (p.region, p.alt) if r and all(x in by_region for x in r.split("&"))]
            if sets:
                candidates += [len(set().union(*sets))] + [len(x) for x in sets]
        matches = list(_COUNT.finditer(s.text))
        # "How many new houses are there? - Just two.": a bare number counts the question's objects.
        if not matches and s is segs[0] and question and _HOW_MANY.search(question.lower()):
            matches = [m for m in [_BARE_COUNT.match(s.text)] if m]
        # "one large building and several houses": a count by kind; the parts together are the count.
        in_breakdown = {k for k in range(len(matches) - 1)
                        if re.fullmatch(r"\s*(,|,? and|,? plus|as well as|along with|together with)\s*",
                                        s.text[matches[k].end():matches[k + 1].start()])}
        in_breakdown |= {k + 1 for k in in_breakdown}
        if in_breakdown:
            parts = [matches[k] for k in sorted(in_breakdown)]
            if all(m.group(2) not in _VAGUE for m in parts):
                total = sum(int(m.group(2)) if m.group(2).isdigit() else _NUMBER_WORDS[m.group(2)] for m in parts)
                if not any(_count_ok(str(total), "", None, c, cfg) for c in candidates):
                    out.append(Violation("counts", f"{' and '.join(m.group(0).strip() for m in parts)!r} ({total}) "
                                                   f"but the mask has {candidates[0]} changed components"))
            matches = [m for k, m in enumerate(matches) if k not in in_breakdown]
        # "one large building plus a row of smaller townhouses": a part of a count by kind whose other
        # parts are not counted in words: the part alone is not the count.
        matches = [m for m in matches if not _MORE_OF_ANOTHER_KIND.match(s.text[m.end():])]
        for m in matches:
            before = s.text[:m.start()]
            if re.match(r"of (the|these|those|them|which)\b", s.text[m.end():].strip()) or _GROUP_SIZE.search(before) \
                    or re.match(r"\s*each\b", s.text[m.end():]) or _LANDMARK.search(before):
                # "one of the buildings", "groups of three houses", "two houses each", "along two roads":
                # no count of changed objects
                continue
            qualifier, stated, alt = m.group(1) or "", m.group(2), m.group(3)
            if (r := _RANGE_START.search(before)) and not alt:  # "18 to 20 houses": either end may match
                alt = r.group(1)
            if not any(_count_ok(stated, qualifier, alt, c, cfg) for c in candidates):
                where = f" ({candidates[1]} where the text places them)" if len(candidates) > 1 else ""
                out.append(Violation("counts", f"{m.group(0).strip()!r} but the mask has {candidates[0]} changed "
                                               f"component{'s' if candidates[0] != 1 else ''}{where}"))
    return out


_GENERIC_CHANGE_Q = re.compile(r"\b(chang(e|es|ed)|differ(s|ent|ence|ences)?|construct(ed|ion)|built|development|developed|new (buildings?|"
                               r"structures?|houses?|construction)|anything|any (building|structure|house)s?|"
                               r"new|appear(ed)?|added)\b")


def check_existence(answer: str, facts: dict, cfg: ValidatorConfig, question: str | None,
                    qtype: str | None) -> list[Violation]:
    if not question or not _is_yes_no(question, qtype):
        return []
    q = question.lower()
    if _PROPERTY_Q.match(q):
        return []  # "Is the change concentrated in one area?" asks about the change, not whether there is one
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
        places = [p for p in places if _known(facts, p.region)]
        if places and not any(place_has_change(facts, p, cfg) for p in places):
            where = ", ".join(f"the {p.name} {100 * _fraction(facts, p.region):.1f}% changed" for p in places)
            return [Violation("existence", f"answers that {question!r} has change, but the mask has {where}")]
        if not places and facts["car"] <= cfg.empty_car:
            return [Violation("existence", f"answers that {question!r} has change, but the mask is empty")]
        return []
    if not (asks_absence or _GENERIC_CHANGE_Q.search(q)) or _DIRECTED_CHANGE_Q.search(q):
        # "were any trees removed?", "were buildings demolished?": a mask says neither what changed nor
        # which way, so it cannot contradict a "no"
        return []
    places = [p for p in places if _known(facts, p.region)]
    for p in places:
        if place_clearly_changed(facts, p, cfg):
            return [Violation("existence", f"answers that {question!r} has no change, but "
                                           f"{100 * _fraction(facts, p.region):.1f}% of the {p.name} changed")]
    if not places and has_object_change(facts, cfg):
        return [Violation("existence", f"answers that {question!r} has no change, but {100 * facts['car']:.1f}% "
                                       f"of the image changed")]
    return []


_DIRECTED_CHANGE_Q = re.compile(r"\b(demolish(ed)?|remov(e|ed)|clear(ed)?|disappear(ed)?|torn down|destroy(ed)?|"
                                r"lost|knocked down|razed)\b")
_PROPERTY_Q = re.compile(r"\s*(is|are|was|were|does|do|did) the (change|changes|new|construction|development|"
                         r"buildings?|houses?|structures?)\b(?! (visible|present|there)\b)")
_ABSENCE_Q = re.compile(r"\b(unchanged|unaffected|intact|untouched|(remain|remains|remained|stay|stays|stayed) "
                        r"(the same|unchanged|as before)|the same as before|free of change|no change)\b")


def validate_text(text: str, facts: dict, question: str | None = None, qtype: str | None = None,
                  cfg: ValidatorConfig = ValidatorConfig(), rules: tuple[str, ...] = RULES) -> tuple[bool, list[Violation]]:
    """Check one caption or answer (with its question, for QA) against the mask facts."""
    text = text or ""
    found: list[Violation] = []
    if "numbers" in rules:
        found += check_numbers(text, facts, cfg, question)
    if "change" in rules:
        found += check_change(text, facts, cfg, question)
    if "location" in rules:
        found += check_location(text, facts, cfg, question, qtype)
    if "magnitude" in rules:
        found += check_magnitude(text, facts, cfg, question)
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


def validator_tally(rows, validators: str) -> dict:
    """Per-rule counts of the validators' findings over rows carrying ``validator_ok`` and
    ``validator_violations`` (a JSON list of violations, or empty), and how many were not sent to the
    judge (policy ``reject``): the summary line of the captions and QA jobs."""
    caught: collections.Counter = collections.Counter()
    rejected = 0
    for r in rows:
        if r["validator_violations"]:
            caught.update(rule_counts([json.loads(r["validator_violations"])]))
        rejected += r["validator_ok"] is False and validators == "reject"
    return {"validators": validators, "validator_caught": {k: caught[k] for k in RULES} | dict(caught),
            "validator_rejected": rejected}
