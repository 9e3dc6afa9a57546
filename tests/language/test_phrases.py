"""How the validators read location phrases and the polarity of each part of a sentence (pure text)."""
import pytest

from operators.language.phrases import find_places, segments


@pytest.mark.parametrize("phrase, regions", [
    ("in the north of the image", [("third:upper", None)]),
    ("toward the southeast", [("cell:lower-right", "quad:lower-right")]),
    ("the north-eastern corner", [("cell:upper-right", None)]),
    ("the bottom-left quadrant", [("quad:lower-left", None)]),
    ("along the bottom edge", [("edge:lower", None)]),
    ("the top and bottom edges", [("edge:upper", None), ("edge:lower", None)]),
    ("the western and southern edges", [("edge:left", None), ("edge:lower", None)]),
    ("the left third", [("third:left", None)]),
    ("the right two-thirds", [("thirds2:right", None)]),
    ("the upper and lower halves", [("half:upper", None), ("half:lower", None)]),
    ("the upper middle", [("cell:upper", None)]),
    ("centre-right", [("cell:right", None)]),
    ("near the edges", [("ring", None)]),
    # not locations in the image
    ("houses left untouched", []),
    ("right next to the road", []),
    ("north of the road", []),
    ("on top of the hill", []),
])
def test_find_places(phrase, regions):
    assert [(p.region, p.alt) for p in find_places(phrase)] == regions


@pytest.mark.parametrize("text, expected", [
    # a bare list of places takes the polarity of its verb, before or after it
    ("The top third, as well as the western edge, remains as it was.", [("neg", ["upper third"]), ("neg", ["left edge"]),
                                                                       ("neg", [])]),
    ("New houses line the north, the center, and the south.", [("pos", ["upper"]), ("pos", ["center"]),
                                                               ("pos", ["lower"])]),
    # "and" between two predications splits; inside a list of places it does not
    ("New houses were built in the north and the south remained empty.", [("pos", ["upper"]), ("neg", ["lower"])]),
    ("The upper-left and lower-right corners show no change.", [("neg", ["upper-left corner", "lower-right corner"])]),
    # exceptions after a negated main clause assert change; contrast words start a new group
    ("Except for a small area in the southwest, the image shows no change.", [("pos", ["lower-left"]), ("neg", [])]),
    ("While the north stays the same, the south has new houses.", [("neg", ["upper"]), ("pos", ["lower"])]),
    # words that look negative but describe the before state
    ("New houses were built on previously empty land in the east.", [("pos", ["right"])]),
    ("New houses were built on empty plots along the same street.", [("pos", [])]),
])
def test_segment_polarity(text, expected):
    assert [(s.polarity, [p.name for p in s.places]) for s in segments(text)] == expected


@pytest.mark.parametrize("phrase, regions", [
    # a side refined by "the middle" is the side's middle cell ...
    ("is there any change on the right side of the image, around the middle?", [("cell:right", None)]),
    ("at the bottom, in the middle", [("cell:lower", None)]),
    ("in the middle, along the left edge", [("edge:left&cell:left", None)]),
    # ... but a list of places is not
    ("on the right side and in the middle", [("third:right", None), ("cell:center", None)]),
    ("at the top, in the middle and at the bottom", [("third:upper", None), ("cell:center", None),
                                                     ("third:lower", None)]),
])
def test_side_refined_by_the_middle(phrase, regions):
    assert [(p.region, p.alt) for p in find_places(phrase)] == regions


@pytest.mark.parametrize("text, polarities", [
    ("a new house stands where the field was empty before", ["pos"]),
    ("the roads are exactly as they were", ["neg"]),
    ("the amount of change is nil", ["neg"]),
    ("the buildings are the same as in the first image, and the change is zero", ["neg", "neg"]),
    ("the field was empty before and is empty now", ["neg"]),
])
def test_before_state_and_no_change_words(text, polarities):
    assert [s.polarity for s in segments(text)] == polarities
