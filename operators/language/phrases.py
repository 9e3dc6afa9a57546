"""Reading captions and answers for the grounded validators (pure text, no mask): where a phrase places
the change, and whether each part of a sentence asserts change, asserts none, or only lists places.

Location phrases (:func:`find_places`) are read as a direction plus the noun that governs it, so that
the same rule covers "the upper-left", "the north-western corner", "the top and bottom edges", "the
left third", "toward the south" and "the upper middle":

- directions: corners (upper-left ... lower-right, north-west ... south-east), sides (upper/top/north/
  northern, lower/bottom/south/southern, left/west/western, right/east/eastern), the centre (center,
  centre, central, middle), and side+centre compounds ("upper middle", "center-left", "right-central");
- the governing noun is the first noun after the direction, skipping other directions of a list
  ("the top and bottom *edges*" gives both directions the edge noun);
- edge / border / margin: the outer band of ``edge_band`` (1/6) of the image on that side; half: the
  half; third (two thirds): the third (two thirds); quadrant / quarter: the quadrant; corner: the 3x3
  corner cell; any other noun (part, side, area, ...) or none: a side is its third, a corner direction
  its 3x3 cell *or* its quadrant ("the lower-left part" may mean either), a compound its edge-centre cell;
- "edges", "borders", "periphery" alone: the outer ring of the 3x3 grid;
- a side refined by the middle next to it ("on the right side of the image, around the middle", "at the
  bottom, in the middle"): the side's middle cell (an edge: the edge's middle), unless the two are items of
  a list ("at the top and in the middle").

Sentences are cut into segments (:func:`segments`) at sentence punctuation, commas, contrast words
(while, whereas, but, although, though), exception words (except, apart from, aside from, other than,
save for, besides, with the exception of), alternatives (rather than, instead of, as opposed to), and
at "and" when both sides have a predicate of their own. Each segment gets a polarity:

- ``neg`` when it holds a negation or persistence word (no, not, nothing, unchanged, remains, intact,
  hardly, already, very few, exactly as they were, as before, nil, ...; "previously empty", "built on
  empty plots", a state of the earlier date ("where the ground was empty before", "the lot that was
  vacant") and "not only" do not count; "vacant / bare / undeveloped" only when predicated: "leaving the corner vacant"); it is
  *hedged* with "mostly", "largely", "almost", ...;
- ``pos`` when it holds a change word (new, built, appeared, demolished, ...) or places an object
  ("the houses lie in the north");
- an alternative without a predicate of its own is ``neg`` ("in the north rather than the south");
- a verbless list of change nouns after a negated segment continues it ("no new construction,
  demolition or land-use change");
- a segment with neither (a bare list of places, "the center, and the right") takes the polarity of
  the predicated segment it belongs to: the first one after it when none came before in its
  contrast group (a list of subjects before their verb), else the last one before it;
- an exception without a predicate of its own is the opposite of a negated main clause ("except for
  the north, nothing changed": the north changed); after a positive main clause it is left open
  ("apart from the houses in the north, a road was built" adds, it does not except).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

CHANGE_CUE = re.compile(
    r"\b(new(ly)?|built|build|building of|constructed|construction|erected|developed|development|"
    r"appear(s|ed|ing|ance)?|emerg(e|es|ed|ing)|added|demolish(ed|ing)?|demolition|removed|removal|clear(ed|ing)|"
    r"replac(e|ed|ing)|convert(ed|ing)?|transform(ed|ing|ation)?|expan(d|ded|sion)|chang(e|es|ed|ing)|"
    r"alter(ed|ation)|paved|excavat(ed|ion)|disappear(ed|s)?|vanish(ed)?|gone|lost|occup(y|ies|ied)|"
    r"covers?|covered|covering|fill(s|ed|ing)?|spans?|lines? (?=(the|both|each|a|an|its|their|this|that|either)\b)|runs?|"
    r"stands?|form(s|ed)?|visible|affected|gain(s|ed)?|spr(a|u)ng up|"
    r"springs? up|install(ed|ation)|laid out|extend(s|ed)?|extension|infill(ed)?)\b")
NEGATION = re.compile(
    r"\b(no|not|none|nothing|never|without|neither|nor|unchanged|unaffected|intact|untouched|empty|"
    r"remain(s|ed)?|stays?|stayed|identical|n't|absent|free of|hardly|barely|scarcely|already|nil|zero|non-?existent|"
    # "exactly as they were", "as before": the earlier state, kept ("as they were built" is not)
    r"as (it|they) (was|were|used to be|had been)(?! (\w+ed|built|being|made|torn|seen|shown)\b)|"
    r"(?<!, )(?<!, and )as (before|previously|earlier)|"
    # a state word says "unchanged" only when predicated ("leaving the corner vacant"), not as the before
    # state ("bare ground, where houses now stand")
    r"((is|are|was|were|remains?|stays?|left|still) (\w+ )?|(leaving|keeping) ([\w-]+ ){0,4})(vacant|bare|undeveloped|"
    r"unbuilt|open)|"
    r"(?<!a )(?<!a very )few|(?<!a )(?<!a very )little|"
    # "the school and the houses are present in both images": there before and after
    r"(present|visible|there|standing|seen) in both (images|photos|pictures|dates|scenes|epochs)|"
    # "the bottom strip changed much less", "less change in the south": little, not none
    r"(chang(ed|es?)|built up|developed|affected) ((much|far|a lot|considerably|significantly|noticeably|a good deal) )?"
    r"less|(less|fewer) (change|changes|development|construction|new)|"
    # "the same" as persistence, not "along the same street"
    r"same(?! (street|road|area|row|way|style|size|shape|orientation|direction|colou?r|type|pattern|time|block|"
    r"plot|neighbou?rhood|place|location|spot|side|part|cluster|group|line)\b))\b")
# Words that look negative but describe the "before" state or stress a positive ("not only ... but"). A state
# word is the earlier date's when said so ("empty before", "vacant in the first image") or in a relative
# clause in the past ("where the ground was empty", "the lot that was vacant"): "a new building stands where
# the ground was empty before" asserts change.
_STATE = r"(empty|vacant|bare|open|undeveloped|unused|unbuilt)"
_NOT_NEGATION = re.compile(r"\b((previously|formerly|once|originally|what was|used to be)( an?)? (empty|vacant|bare|"
                           r"open|undeveloped|unused)|"
                           rf"{_STATE} (before|earlier|previously|at first|in the (first|earlier|older|previous|"
                           r"before) (image|photo|picture|scene|date))(?! (and|&) (after|now|later|since)\b)|"
                           rf"(where|which|that) ([\w-]+ ){{0,3}}(was|were|had been|used to be|lay|stood) ((?!(still|left|kept|again) )\w+ )?{_STATE}"
                           r"(?! (and|but) (still|is|are|remains?|stays?)\b)|(on|onto|over|into|in|at|within|across|of|from|replacing|replaced|"
                           r"fill(s|ed|ing)?|occupy(ing)?|occupie[sd]|cover(s|ed|ing)?|taking (up|over)|took (up|over)) (the |an? |some |"
                           r"previously |formerly )*(empty|vacant|bare|open|undeveloped) (land|lots?|plots?|fields?|ground|"
                           r"parcels?|areas?|spaces?|terrain|soil)|not only|no longer)\b")

# -- location phrases ------------------------------------------------------------------------------
_CORNERS = {"upper-left": r"(?:upper|top)[ -]?left|north[ -]?west(?:ern)?",
            "upper-right": r"(?:upper|top)[ -]?right|north[ -]?east(?:ern)?",
            "lower-left": r"(?:lower|bottom)[ -]?left|south[ -]?west(?:ern)?",
            "lower-right": r"(?:lower|bottom)[ -]?right|south[ -]?east(?:ern)?"}
# "left"/"right" are also verbs and adverbs ("left untouched", "right next to"); the compass words also
# give positions relative to objects ("north of the road"): those readings are excluded.
_NOT_A_SIDE = (r"(?! (?:behind|unchanged|intact|untouched|undisturbed|alone|empty|vacant|bare|open|standing|as|over|"
               r"in place|next|after|before|away|now|beside|by|there|here)\b)")
_RELATIVE = r"(?! of (?!(?:the |this |a |an )?(?:image|scene|frame|picture|view|tile|photo|area)\b))(?![- ]?(?:facing|ward|bound))"
_SIDES = {"upper": r"upper(?:most)?|(?<!on )top(?:most)?(?! of (?:a|an|the) (?:building|house|roof))|northern|north" + _RELATIVE,
          "lower": r"lower(?:most)?(?! than)|bottom(?:most)?|southern|south" + _RELATIVE,
          "left": r"(?:left(?:most)?|western|west" + _RELATIVE + r")" + _NOT_A_SIDE,
          "right": r"(?:right(?:most)?|eastern|east" + _RELATIVE + r")" + _NOT_A_SIDE}
_CENTER = r"cent(?:er|re|ral)|middle"
_ANY_DIRECTION = "|".join(f"(?:{p})" for p in list(_CORNERS.values()) + list(_SIDES.values()) + [_CENTER])
# A list of further directions between a direction and its noun: "top and bottom", "upper, central and lower".
_LIST_TAIL = re.compile(rf"(?:\s*(?:,|\band\b|\bor\b|&|/)\s*(?:the\s+)?(?:(?:far|very|extreme)\s+)?(?:{_ANY_DIRECTION}))*")
_NOUN = re.compile(r"[\s-]*(?:hand\s+)?(?:(two|2)[\s-]+)?(edges?|borders?|margins?|rims?|boundary|boundaries|fringes?|"
                   r"periphery|outskirts|perimeter|"
                   r"halves|half|thirds?|quadrants?|quarters?|corners?|parts?|portions?|areas?|sections?|sides?|"
                   r"regions?|bands?|strips?|zones?|rows?|columns?|sectors?|ends?)\b")
_EDGE_NOUNS = ("edge", "border", "margin", "rim", "boundary", "boundaries", "fringe", "periphery", "outskirts", "perimeter")
_RING = re.compile(r"\b(edges|borders|periphery|peripheral|margins|outskirts|perimeter|the (edge|border)s?|"
                   r"(image|scene|frame|picture) (edge|border)s?)\b")


@dataclass(frozen=True)
class Place:
    name: str               # what the text said, normalised ("upper-left", "upper half", "left edge", ...)
    region: str             # the named box (validators.region_boxes) it stands for
    alt: str | None = None  # a second reading the text allows ("the lower-left part": cell or quadrant)
    start: int = field(default=0, compare=False)  # where the phrase starts in its clause
    refined_end: int = field(default=0, compare=False)  # a side refined by "the middle": where that phrase ends


def _noun_after(clause: str, pos: int) -> tuple[str | None, bool, int]:
    """The noun governing a direction that ends at ``pos`` (skipping a list of further directions), whether
    it says "two thirds", and where the noun ends (or ``pos`` when there is none)."""
    tail = _LIST_TAIL.match(clause, pos)
    m = _NOUN.match(clause, tail.end())
    if not m:
        return None, False, pos
    return m.group(2), bool(m.group(1)), m.end()


def _side_place(side: str, noun: str | None, two: bool) -> Place:
    if noun and noun.startswith(_EDGE_NOUNS):
        return Place(f"{side} edge", f"edge:{side}")
    if noun in ("half", "halves"):
        return Place(f"{side} half", f"half:{side}")
    if noun and noun.startswith("third"):
        return Place(f"{side} two thirds", f"thirds2:{side}") if two else Place(f"{side} third", f"third:{side}")
    return Place(side, f"third:{side}")


def _corner_place(corner: str, noun: str | None) -> Place:
    if noun and noun.startswith(("quadrant", "quarter")):
        return Place(f"{corner} quadrant", f"quad:{corner}")
    if noun and noun.startswith(("corner",) + _EDGE_NOUNS):
        return Place(f"{corner} corner", f"cell:{corner}")
    return Place(corner, f"cell:{corner}", alt=f"quad:{corner}")


_OF_THE = re.compile(r"\s+of\s+(?:the\s+)?(?:image's\s+|scene's\s+)?")
# Between a side and "the middle" that refines it ("on the right side of the image, around the middle", "at
# the bottom, in the middle"): a comma or a preposition, not "and" / "or" (a list of two places).
_REFINES = re.compile(r"(?:\s+of\s+(?:the\s+)?(?:image|scene|frame|picture|view|tile))?\s*,?\s*"
                      r"(?:(?:in|at|around|near|toward|towards|about|along|on)\s+)?(?:the\s+)?(?:very\s+)?")
_LIST_JOIN = re.compile(r"\s*(?:,|\band\b|\bor\b|&)\s*(?:,?\s*(?:and|or)\s+)?(?:(?:in|at|on|around|near|toward|towards|along|by|the|very|far)\s+){0,3}")


def _side_and_middle(clause: str, found: list) -> list:
    """A side and "the middle" next to each other, in either order, are the side's middle cell ("at the bottom,
    in the middle": the bottom-centre cell; along an edge, the edge's middle), unless they are two items of a
    longer list ("at the top, in the middle and at the bottom")."""
    out = list(found)
    i = 0
    while i + 1 < len(out):
        (a0, a1, pa), (b0, b1, pb) = out[i], out[i + 1]
        side = next((p for p in (pa, pb) if p.region.startswith(("third:", "edge:"))), None)
        middle = next((p for p in (pa, pb) if p.region == "cell:center" and p.name == "center"), None)
        listed = (i > 0 and _LIST_JOIN.fullmatch(clause, out[i - 1][1], a0) is not None) or \
            (i + 2 < len(out) and _LIST_JOIN.fullmatch(clause, b1, out[i + 2][0]) is not None)
        if side and middle and not listed and _REFINES.fullmatch(clause, a1, b0):
            name = side.region.split(":")[1]
            region = f"cell:{name}" if side.region.startswith("third:") else f"{side.region}&cell:{name}"
            out[i:i + 2] = [(a0, b1, Place(f"{name} middle", region, refined_end=b1))]
        i += 1
    return out


def find_places(clause: str) -> list[Place]:
    """Location phrases of one lower-cased clause, in reading order, without overlaps. "The X part of the Y"
    is the part of Y that X names (their intersection, "region1&region2"; "the middle of Y" is the middle
    third of Y each way, "middle:region"), not X and Y."""
    found: list[tuple[int, int, Place]] = []     # start, end of the phrase (its noun included), place
    taken: list[tuple[int, int]] = []            # directions and nouns already read

    def free(a: int, b: int) -> bool:
        return not any(x < b and a < y for x, y in taken)

    def add(pattern: str, make) -> None:
        for m in re.finditer(pattern, clause):
            if free(m.start(), m.end()):
                noun, two, noun_end = _noun_after(clause, m.end())
                found.append((m.start(), max(m.end(), noun_end), make(m, noun, two)))
                taken.append((m.start(), m.end()))
                if noun_end > m.end():
                    taken.append((noun_end - len(noun), noun_end))

    # Side + centre compounds first ("upper middle", "center-left", "right-central"): the edge-centre cell.
    for side, pat in _SIDES.items():
        add(rf"\b(?:(?:{pat})[ -](?:{_CENTER})|(?:{_CENTER})[ -](?:{pat}))\b",
            lambda m, noun, two, side=side: Place(f"{side} middle", f"cell:{side}"))
    for corner, pat in _CORNERS.items():
        add(rf"\b(?:{pat})\b", lambda m, noun, two, corner=corner: _corner_place(corner, noun))
    for side, pat in _SIDES.items():
        add(rf"\b(?:{pat})\b", lambda m, noun, two, side=side: _side_place(side, noun, two))
    add(rf"\b(?:{_CENTER})\b", lambda m, noun, two: Place("center", "cell:center"))
    for m in _RING.finditer(clause):
        if free(m.start(), m.end()):
            found.append((m.start(), m.end(), Place("edges", "ring")))
            taken.append((m.start(), m.end()))
    found.sort(key=lambda f: f[0])
    found = _side_and_middle(clause, found)
    out: list[Place] = []
    dropped: set[int] = set()
    for i, (a, end, place) in enumerate(found):
        if i in dropped:
            continue
        # The list this phrase ends ("the left and central parts") may be "of the" a container place.
        container = None
        for j in range(i + 1, len(found)):
            of = _OF_THE.match(clause, found[j - 1][1])
            if of and of.end() == found[j][0]:
                container = j
                break
            if found[j][0] > end:
                break
        if container is None:
            out.append(replace(place, start=a))
            continue
        outer = found[container][2]
        if outer.region == "cell:center":  # "left of center": beside the centre, not the image's left
            dropped.update(k for k in range(i, container))
            continue
        if "&" in outer.region:
            out.append(replace(place, start=a))
            continue
        members = [k for k in range(i, container) if k not in dropped]
        for k in members:
            p = found[k][2]
            if p.region == "cell:center":  # "the middle of the lower-left quadrant": its own middle
                out.append(Place(f"center of the {outer.name}", f"middle:{outer.region}", start=found[k][0]))
                dropped.add(k)
                continue
            out.append(Place(f"{p.name} of the {outer.name}", f"{p.region}&{outer.region}",
                             f"{p.alt}&{outer.region}" if p.alt else None, start=found[k][0]))
            dropped.add(k)
        dropped.add(container)
    return out


# -- segments and their polarity ------------------------------------------------------------------
_SENTENCE = re.compile(r"(?<!\d)\.|\.(?!\d)|[;:!?]|\s[-\u2013\u2014]+\s|\u2014")
_CONTRAST = r"while|whereas|but|although|though"  # not "however" / "yet": mostly parenthetical or "not yet"
_EXCEPTION = r"except(?: for)?|apart from|aside from|other than|save for|besides|with the exception of|excluding"
_ALTERNATIVE = r"rather than|instead of|as opposed to"  # a negated alternative: "in the north rather than the south"
_BOUNDARY = re.compile(rf",|\b({_CONTRAST})\b|\b({_EXCEPTION})\b|\b({_ALTERNATIVE})\b")
_LEADING = re.compile(r"^(and|or|with|as well as|plus|then|also)\b\s*")


@dataclass
class Segment:
    text: str
    polarity: str | None          # "pos", "neg" or None (no predicate, nothing inherited)
    own: str | None               # the polarity of its own words only
    exception: bool = False       # introduced by except / apart from / ...
    group: int = 0                # contrast group inside its sentence
    sentence: int = 0
    inherited_from: int | None = None   # index of the segment whose polarity a bare one took
    places: list[Place] = field(default_factory=list)
    hedged: bool = False          # a negation softened by "mostly", "largely", "almost", ... (see HEDGE)
    alternative: bool = False     # introduced by "rather than" / "instead of": denied unless it says otherwise


# "Mostly unchanged", "almost no change": a claim that little changed, not that nothing did.
HEDGE = re.compile(r"\b(mostly|largely|mainly|essentially|almost|nearly|virtually|practically|relatively|fairly|"
                   r"broadly|generally|predominantly|hardly|barely|scarcely|little|few|minimal|less|fewer)\b")
# Change words that are nouns: after "no signs of new construction," a verbless "demolition or land-use
# change" continues the negated list instead of asserting change.
_NOMINAL_CUE = re.compile(r"\b(construction|development|demolition|changes?|removal|expansion|transformation|"
                          r"alteration|extension|installation|excavation|conversion|clearing|replacement|"
                          r"disappearance|appearance|paving|infill)\b")
_VERB = re.compile(r"\b(is|are|was|were|be|been|being|has|have|had|do|does|did|can|could|may|might|will|would|"
                   r"shows?|showed|shown|appears?|seems?|looks?|remains?|stays?|lines?|runs?|stands?|covers?|"
                   r"occup(y|ies)|spans?|extends?|forms?|\w+ed)\b")


# In a caption of change, "the houses lie in the north" places the changed objects: an object word with a
# verb of position asserts change where it puts them.
OBJECT_NOUNS = (r"buildings?|houses?|homes?|structures?|roofs?|residences?|dwellings?|warehouses?|factor(y|ies)|"
                r"sheds?|villas?|complex(es)?|blocks?")
_PLACED_OBJECT = re.compile(r"\b(" + OBJECT_NOUNS + r")\b.*\b(lies|lie|lying|sits?|sitting|"
                            r"located|situated|found|placed|positioned|concentrated|clustered|grouped|arranged|"
                            r"distributed|spread|scattered|is|are)\b")


# "Just reaches into", "a small part of", "slightly": a claim of some change, not of change worth naming.
HEDGED_PRESENCE = re.compile(r"\b(just|slightly|a little|partly|partially|marginally|barely|a (small |tiny )?(part|"
                             r"piece|portion|corner|sliver|bit|tip|fragment|edge|end|trace|hint|touch|speck) of|touch(es|ing)?|reach(es|ing)? "
                             r"into|extend(s|ing)? (slightly )?into|spills? (over )?into)\b")


def own_polarity(text: str) -> str | None:
    t = _NOT_NEGATION.sub(" ", re.sub(r"(?<=\w)n't\b", " not", text))   # "don't" -> "do not"
    if NEGATION.search(t):
        return "neg"
    if CHANGE_CUE.search(t) or _PLACED_OBJECT.search(t):
        return "pos"
    return None


def _split_and(piece: str) -> list[str]:
    """Split at "and" when both sides have a predicate of their own ("houses were built in the north and the
    south is unchanged"), not inside a list of places ("the upper-left and lower-right corners show no change")."""
    parts = re.split(r"\band\b", piece)
    if len(parts) < 2:
        return [piece]
    out, current = [], parts[0]
    for nxt in parts[1:]:
        rest = nxt
        if own_polarity(current) and own_polarity(rest):
            out.append(current)
            current = rest
        else:
            current = current + "and" + nxt
    out.append(current)
    return out


def segments(text: str) -> list[Segment]:
    out: list[Segment] = []
    for s_idx, sentence in enumerate(_SENTENCE.split(text.lower())):
        if not sentence or not sentence.strip():
            continue
        group, exception, pieces = 0, False, []
        pos = 0
        # "on the right side, around the middle" is one place: not cut at its comma
        refined = [(p.start, p.refined_end) for p in find_places(sentence) if p.refined_end]
        for m in [m for m in _BOUNDARY.finditer(sentence) if not any(a < m.start() < b for a, b in refined)] + [None]:
            end = m.start() if m else len(sentence)
            chunk = sentence[pos:end]
            if chunk.strip():
                for part in _split_and(chunk):
                    pieces.append((part, group, exception))
            if m is None:
                break
            if m.group(1):
                group, exception = group + 1, False
            elif m.group(2):
                exception = True
            elif m.group(3):
                exception = "alternative"
            else:  # a comma ends an exception phrase ("except for X, nothing changed")
                exception = False
            pos = m.end()
        start = len(out)
        for part, g, exc in pieces:
            t = _LEADING.sub("", part.strip())
            if not t:
                continue
            own = own_polarity(t)
            prev = out[-1] if len(out) > start else None
            if own == "pos" and prev and prev.own == "neg" and prev.group == g and not _VERB.search(t) \
                    and not CHANGE_CUE.search(_NOMINAL_CUE.sub(" ", t)):
                own = None  # "no new construction, demolition or land-use change": the list goes on
            out.append(Segment(t, own, own, exc is True, g, s_idx, places=find_places(t),
                               alternative=exc == "alternative"))
        _inherit(out[start:], start)
        for seg in out[start:]:
            seg.hedged = seg.polarity == "neg" and bool(HEDGE.search(seg.text if seg.own else
                                                                      out[seg.inherited_from].text
                                                                      if seg.inherited_from is not None else ""))
    return out


_RESULT_CLAUSE = re.compile(r"(leaving|keeping|with|while|whereas)\b")
# "No, it is all on the right.": the answer word denies the question, not the clause after it.
ANSWER_WORD = re.compile(r"(yes|yeah|yep|no|nope|correct|indeed|not really|not at all)$")
# "the west, especially the corner by the school, is untouched": a predicate without a subject of its own
# completes the bare segments before it.
_PREDICATE_START = re.compile(r"(is|are|was|were|remains?|remained|stays?|stayed|looks?|looked|appears?|appeared|"
                              r"seems?|seemed|has|have|had|did|does|do)\b")


def _inherit(segs: list[Segment], offset: int) -> None:
    for i, s in enumerate(segs):
        if s.alternative and not s.own:
            s.polarity = "neg"
        if s.own or s.exception or s.alternative:
            continue
        same = [j for j, o in enumerate(segs) if o.group == s.group and o.own and not o.exception
                and not ANSWER_WORD.match(o.text)]
        # "... fills the left, leaving the right edge untouched": a result clause says nothing of what
        # came before it (a list of subjects takes its verb from the clause after it, a result clause not)
        before = [j for j in same if j < i]
        after = [j for j in same if j > i and not _RESULT_CLAUSE.match(segs[j].text)]
        src = before[-1] if before else (after[0] if after else None)
        nxt = next((j for j in range(i + 1, len(segs)) if segs[j].own), None)
        if nxt is not None and segs[nxt].group == s.group and _PREDICATE_START.match(segs[nxt].text):
            src = nxt   # its subject is this segment (and the bare ones between)
        if src is not None:
            s.polarity, s.inherited_from = segs[src].own, offset + src
    for i, s in enumerate(segs):
        if s.exception and not s.own:
            main = [o for o in segs if not o.exception and o.own]
            if main and main[0].own == "neg":
                s.polarity = "pos"
                # "The west is unchanged, apart from a few houses near the top": the top of the west.
                if len(main[0].places) == 1 and s.places:
                    outer = main[0].places[0]
                    s.places = [p if p.region == outer.region else
                                Place(f"{p.name} of the {outer.name}", f"{p.region}&{outer.region}",
                                      f"{p.alt}&{outer.region}" if p.alt else None) for p in s.places]
