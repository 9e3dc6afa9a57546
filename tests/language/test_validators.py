"""Grounded validators on the repository's real LEVIR-CD masks: hand-written true and false statements for
every rule, in both directions, including the all-zero mask; and the --validators policy of the
captions job's stages (reject: not sent to the judge; flag: sent, verdict stored)."""
import functools
import json
from pathlib import Path

import cv2
import pytest

from operators.language.mask_analysis import analyze_mask, binarize_mask
from operators.language.validators import mask_facts, rule_counts, validate_text

LABELS = Path(__file__).resolve().parents[2] / "data" / "levir-cd" / "label"

# What the masks show (looked at with a 3x3 grid on top):
#   test_77_0512_0256   one large L-shaped building in the lower center and right; upper third empty
#   train_386_0512_0768 all zero: no change
#   test_2_0000_0000    ~18 houses in three rows over the whole image, CAR 0.25
#   val_27_0000_0256    3 houses upper-right, a row of ~7 along the bottom; center and upper-left empty
#   test_55_0256_0000   ~10 houses center, lower-left, right; upper third (almost) empty
#   test_102_0512_0000  one large diagonal building from the center to the upper-right


def facts(name, crop=None):
    mask = binarize_mask(cv2.imread(str(LABELS / f"{name}.png"), cv2.IMREAD_UNCHANGED))
    if crop:
        mask = mask[crop[0]:crop[1], crop[2]:crop[3]]
    return mask_facts(mask, analyze_mask(mask).components)


@pytest.fixture(scope="module")
def f():
    names = ("test_77_0512_0256", "train_386_0512_0768", "test_2_0000_0000", "val_27_0000_0256",
             "test_55_0256_0000", "test_102_0512_0000", "test_121_0768_0256", "test_7_0256_0512",
             "train_36_0512_0512", "train_412_0512_0768", "test_2_0000_0512")
    out = {n: facts(n) for n in names}
    out["test_55_ul"] = facts("test_55_0256_0000", (0, 128, 0, 128))   # a sliver of one house: CAR 0.009
    out["test_55_ur"] = facts("test_55_0256_0000", (0, 128, 128, 256))  # two houses in the lower-left only
    out["test_7_ll"] = facts("test_7_0256_0512", (128, 256, 0, 128))    # two buildings in the upper-right
    out["test_102_ul"] = facts("test_102_0512_0000", (0, 128, 0, 128))  # a building's corner, lower-right
    out["test_2_0512_lr"] = facts("test_2_0000_0512", (128, 256, 128, 256))  # 3 houses, middle band only
    out["test_2_0512_ur"] = facts("test_2_0000_0512", (0, 128, 128, 256))    # CAR 0.12
    out["test_2_ul"] = facts("test_2_0000_0000", (0, 128, 0, 128))      # 6 houses, little in the upper-right
    out["test_55_lr"] = facts("test_55_0256_0000", (128, 256, 128, 256))  # 7 houses
    out["test_77_lr"] = facts("test_77_0512_0256", (128, 256, 128, 256))  # CAR 0.47
    out["test_77_ur"] = facts("test_77_0512_0256", (0, 128, 128, 256))    # CAR 0.036, a corner of the building
    out["test_121_ul"] = facts("test_121_0768_0256", (0, 128, 0, 128))  # CAR 0.30, its left third 9% changed
    return out


def rules(text, facts, question=None, qtype=None):
    ok, violations = validate_text(text, facts, question, qtype)
    assert ok == (not violations)
    return {v.rule for v in violations}


def test_mask_facts_on_real_masks(f):
    assert f["train_386_0512_0768"]["changed_pixels"] == 0 and f["train_386_0512_0768"]["components"] == 0
    assert f["test_77_0512_0256"]["components"] == 1
    assert f["test_77_0512_0256"]["regions"]["third:upper"][0] == 0          # nothing in the top third
    assert f["val_27_0000_0256"]["regions"]["cell:center"][0] == 0
    total = f["test_2_0000_0000"]["regions"]["all"]
    assert total[0] == f["test_2_0000_0000"]["changed_pixels"] and total[1] == 256 * 256
    json.dumps(f["test_2_0000_0000"])   # travels in rows


@pytest.mark.parametrize("text, mask, expected", [
    # numbers: copied metadata figures
    ("Exactly 17.5% of the image changed.", "test_77_0512_0256", {"numbers"}),
    ("The change covers 25 percent of the scene.", "test_2_0000_0000", {"numbers"}),
    ("A total of 11,500 changed pixels form one building.", "test_77_0512_0256", {"numbers"}),
    ("One large new building covers a sizable part of the lower half.", "test_77_0512_0256", set()),
    ("Roughly a quarter of the scene is now covered by new houses.", "test_2_0000_0000", set()),
    # change / no change, both directions, and the all-zero mask
    ("Several new houses were built in the center.", "train_386_0512_0768", {"change", "location", "counts"}),
    ("A new road was constructed across the scene.", "train_386_0512_0768", {"change"}),
    ("No change is visible between the two images.", "train_386_0512_0768", set()),
    ("The scene appears unchanged; no new buildings were constructed.", "train_386_0512_0768", set()),
    ("No change occurred between the two images.", "test_77_0512_0256", {"change"}),
    ("The scene remains the same.", "test_2_0000_0000", {"change"}),
    ("The upper part remains unchanged while a large building appears lower down.", "test_77_0512_0256", set()),
    ("Essentially no change is visible apart from a sliver at the corner.", "test_55_ul", set()),
    # location: change where there is none, "unchanged" where there is change, "entire image"
    ("The new building stands in the upper-left corner.", "test_77_0512_0256", {"location"}),
    ("New houses were built in the center of the image.", "val_27_0000_0256", {"location"}),
    ("New houses were built in the upper-right corner and along the bottom.", "val_27_0000_0256", set()),
    ("The center of the image remains unchanged.", "val_27_0000_0256", set()),
    ("The lower half shows no change.", "test_77_0512_0256", {"location"}),
    ("The upper part of the image remains unchanged.", "test_77_0512_0256", set()),
    ("Rows of new houses were built across the whole image.", "test_2_0000_0000", set()),
    # (and, since revision 8, a sliver of 0.9% is no new buildings at all)
    ("New buildings were built throughout the entire image.", "test_55_ul", {"change", "location"}),
    # magnitude: CAR bins 0.05 / 0.2
    ("The change is minor and limited to a small area.", "test_2_0000_0000", {"magnitude"}),
    ("The construction is extensive, with new homes in almost every part.", "test_2_0000_0000", set()),
    ("Large-scale development covers the image.", "test_55_ul", {"magnitude"}),
    ("The change is small and localized.", "test_55_ul", set()),
    ("Construction covers most of the image.", "test_55_0256_0000", {"magnitude"}),
    # counts: against the changed components, with tolerance
    ("Two new houses were built.", "test_2_0000_0000", {"counts"}),
    ("Dozens of small houses were built.", "test_77_0512_0256", {"counts"}),
    ("A single large structure appeared.", "test_77_0512_0256", set()),
    ("About fifteen new houses appeared in three rows.", "test_2_0000_0000", set()),
    ("A single new house was built.", "test_55_0256_0000", {"counts"}),
    ("Around ten new houses were built.", "test_55_0256_0000", set()),
])
def test_caption_statements(f, text, mask, expected):
    assert rules(text, f[mask]) == expected


@pytest.mark.parametrize("question, answer, mask, expected", [
    ("Is there any new construction in the upper-left corner?", "No.", "test_77_0512_0256", set()),
    ("Was anything built in the upper-left of the image?", "Yes, a new house.", "test_77_0512_0256", {"existence"}),
    ("Is there a new structure in the lower part of the image?", "No, the lower part is unchanged.",
     "test_77_0512_0256", {"existence", "location"}),
    ("Is there a new structure in the lower part of the image?", "Yes, a large building.", "test_77_0512_0256", set()),
    ("Has any new construction occurred?", "No, there is no new construction.", "train_386_0512_0768", set()),
    ("Did any buildings appear in the image?", "Yes, new buildings appeared.", "train_386_0512_0768",
     {"existence", "change"}),
    ("Has anything changed in the image?", "No.", "test_2_0000_0000", {"existence"}),
    ("Has anything changed in the image?", "Yes.", "test_2_0000_0000", set()),
    # A mask cannot say "no" to a specific object type: not checked.
    ("Were any trees removed in the lower part?", "No.", "test_77_0512_0256", set()),
])
def test_yes_no_answers(f, question, answer, mask, expected):
    assert rules(answer, f[mask], question, "YES/NO") == expected


def test_mask_facts_grid_and_edge_bands(f):
    from operators.language.validators import union_share
    g = f["test_7_0256_0512"]
    assert sum(map(sum, g["grid"])) == g["changed_pixels"]
    assert g["regions"]["edge:lower"][0] == 0 and g["regions"]["third:lower"][0] > 0   # nothing at the very bottom
    assert g["regions"]["edge:upper"][1] == round(256 / 6) * 256                        # the outer sixth
    whole = union_share(g, ["half:upper", "half:lower"])
    assert whole == pytest.approx(1.0)
    assert union_share(g, ["third:upper", "half:upper"]) == pytest.approx(union_share(g, ["half:upper"]))


# Revision 4 (README, "How well they work"): 40 of these 73 cases (with the grid test) fail on revision 3
# (checked); the others guard the opposite direction of the same behaviour.
@pytest.mark.parametrize("text, mask, expected", [
    # compass words and edge bands ("the bottom edge" is the outer sixth, not the lower third)
    ("New houses were added in the northeast corner.", "val_27_0000_0256", set()),
    ("The new buildings are concentrated in the northeastern corner of the scene.", "test_121_0768_0256", {"location"}),
    ("Most of the newly built houses are clustered toward the bottom edge of the image.", "test_7_0256_0512",
     {"location"}),
    ("A row of new houses runs along the southern edge of the image.", "val_27_0000_0256", set()),
    ("Three new houses stand in a row across the middle band; the top and bottom edges show no change.",
     "test_2_0512_lr", set()),
    ("A row of new houses has been built along the western edge of the image.", "train_36_0512_0512", {"location"}),
    # thirds and two thirds
    ("A curved line of new homes extends from the upper middle toward the eastern edge, and the western third "
     "shows no sign of change.", "train_412_0512_0768", set()),
    ("New houses have been built across the western third of the image.", "train_412_0512_0768", {"location"}),
    ("About twelve houses were built, most of them in the upper two thirds of the image.", "test_7_0256_0512", set()),
    # presence by density: a third or a half holding little of the change is not "change there"
    ("The new houses are on the left side of the image.", "train_36_0512_0512", {"location"}),
    ("The change is spread over the entire image.", "test_77_0512_0256", {"location"}),
    # a corner direction without "corner" may mean the quadrant, if the quadrant holds the change densely
    ("A single elongated structure has been erected in the southwest part of the image.", "test_102_0512_0000",
     {"location"}),
    # negation scope: each part of the sentence has its own polarity
    ("The changes are found mostly along the western side and across the southern part of the image, with the "
     "north-eastern corner left untouched.", "test_121_0768_0256", set()),
    ("The new buildings are located in the southwest corner of this image, and nothing changed in the north or "
     "the east.", "test_55_ur", set()),
    ("The new buildings are located in the northeast corner of this image, and nothing changed in the south.",
     "test_55_ur", {"location"}),
    # exceptions: "except X" after a negated main clause asserts change in X
    ("Except for a small area in the southwest, the image shows no change.", "test_7_ll", {"location"}),
    ("Apart from two buildings in the northeast, this part of the scene shows no change.", "test_7_ll", set()),
    # exclusive and majority claims
    ("All of the new houses are located in the eastern third of the image.", "test_2_0000_0512", {"location"}),
    ("The new houses are all bunched together in the top-right corner of this view.", "test_2_ul", {"location"}),
    ("The change is limited to the lower-right corner.", "test_102_ul", set()),
    # graded magnitude words: "negligible" is wrong from the medium bin up, "modest" on the large bin
    ("The change is negligible, limited to one or two tiny spots.", "val_27_0000_0256", {"magnitude"}),
    ("Barely anything has changed here; the difference between the images is negligible.", "test_2_ul",
     {"magnitude"}),
    ("The change here is minimal: only a small corner of a building appears at the bottom right.", "test_55_ul",
     set()),
    ("Only a modest patch of the image has changed.", "test_77_lr", {"magnitude"}),
    # no-change vocabulary
    ("Nothing appears to have changed between the two acquisitions.", "train_412_0512_0768", {"change"}),
    ("Nothing appears to have changed between the two acquisitions.", "train_386_0512_0768", set()),
    ("This part of the neighbourhood is unchanged between the two dates.", "test_2_0512_ur", {"change"}),
    ("The most striking difference is the appearance of one massive building; no other notable construction "
     "can be seen.", "test_102_0512_0000", set()),
    # quantity words: "dozens" is at least 24 with the numeric tolerance, "half a dozen" is six
    ("Dozens of new buildings have sprung up across the scene.", "test_121_0768_0256", {"counts"}),
    ("Dozens of new houses have sprung up across the scene.", "test_2_0000_0000", set()),
    ("Roughly half a dozen new houses are visible, grouped on the left and in the upper right.", "test_55_lr", set()),
    ("Half a dozen new houses were built.", "test_2_0000_0000", {"counts"}),
    # "the X part of the Y" is the part of Y; an exception lies inside its main clause's place
    ("The left and central parts of the upper half show no new buildings.", "val_27_0000_0256", set()),
    ("The right part of the upper half shows no new buildings.", "val_27_0000_0256", {"location"}),
    ("The western half of the scene is mostly unaffected, apart from a few houses near the top.",
     "train_36_0512_0512", set()),
    # hedged negations ("mostly", "very few") tolerate change up to the large bin in that place
    ("Most new homes are in the northern half, and very few are near the bottom.", "test_7_0256_0512", set()),
    ("The left half of the image is largely unchanged.", "test_121_0768_0256", {"location"}),
    # a verbless list of change nouns continues the negation before it
    ("There are no signs of new construction, demolition or land-use change.", "train_386_0512_0768", set()),
    # count ranges and group sizes
    ("The new buildings appear in small groups of two to four houses.", "test_55_0256_0000", set()),
    ("Between two and four houses were built.", "test_55_0256_0000", {"counts"}),
    # objects placed by a verb of position are the changed objects
    ("Most of the building lies in the lower-left quadrant.", "test_102_0512_0000", {"location"}),
    # "the entire X": every part of X changed
    ("The entire northern half of the image is covered with new houses.", "val_27_0000_0256", {"location"}),
    ("New houses now line the entire bottom edge of the image.", "val_27_0000_0256", set()),
    # "rather than X" denies X; a state word is "unchanged" only when predicated
    ("Houses have been added in a scattered pattern, mostly around the edges of this view rather than in its "
     "center.", "test_55_lr", set()),
    ("Houses have been added mostly in the center of this view rather than around its edges.", "test_55_lr",
     {"location"}),
    ("A diagonal line of buildings runs toward the bottom right, leaving the top-right corner vacant.",
     "test_121_0768_0256", set()),
    ("A diagonal line of buildings runs toward the top left, leaving the bottom-right corner vacant.",
     "test_121_0768_0256", {"location"}),
    # "left of the center" is beside the centre, not the image's left
    ("Its long axis runs from the lower left of the center toward the upper right.", "test_102_0512_0000", set()),
    # "mostly in" a cell or quadrant holding more of the change than any other
    ("The building is mostly at the bottom center.", "test_77_0512_0256", set()),
    ("The building is mostly in the center-right part.", "test_77_0512_0256", {"location"}),
    # "N new structures of varying sizes" is a count ("one of the houses" is not)
    ("Approximately 25 new structures of varying sizes have been built.", "test_121_0768_0256", {"counts"}),
    # LEVIR-CC's own captions of these masks (data/levir-cc): "empty lots" built on, roads as landmarks
    ("some new houses appear in the empty lots on the right .", "test_55_0256_0000", set()),
    ("rows of houses are built along two roads .", "train_36_0512_0512", set()),
    ("two rows of houses are built .", "train_36_0512_0512", set()),
    ("two houses are built along the roads .", "train_36_0512_0512", {"counts"}),
])
def test_revision4_statements(f, text, mask, expected):
    assert rules(text, f[mask]) == expected


@pytest.mark.parametrize("question, qtype, answer, mask, expected", [
    ("Has any development occurred in the north of the image?", "YES/NO",
     "No, the top of the scene remains unchanged; the construction is confined to the middle and lower parts.",
     "test_55_0256_0000", set()),
    ("Has any development occurred in the south of the image?", "YES/NO", "No, the south is unchanged.",
     "test_55_0256_0000", {"existence", "location"}),
    ("Were new houses built in the lower-left part of the image?", "YES/NO", "Yes, a group of new houses was built "
     "there.", "test_55_0256_0000", set()),
    ("Has anything been built in the upper-right area?", "YES/NO", "Yes, new houses were built there.",
     "test_55_0256_0000", {"existence"}),
    # an answer naming no place speaks about the question's place
    ("What happened in the northeast corner?", "WHAT", "Several new houses were built.", "val_27_0000_0256", set()),
    ("What happened in the northeast corner?", "WHAT", "Several new houses were built.", "test_121_0768_0256",
     {"location"}),
    ("Which area changed least?", "COMPARE", "The upper-right corner, where nothing changed.", "test_121_0768_0256",
     set()),
    ("What was present before in the lower-left?", "BEFORE/AFTER", "Bare ground, where new houses now stand.",
     "test_2_0000_0512", set()),
    # questions about a property of the change, or about its direction, are not existence questions
    ("Is the change concentrated in one area?", "YES/NO", "No, the new houses are spread over the whole image.",
     "test_2_0000_0512", set()),
    ("Is there any change in this image?", "YES/NO", "No.", "test_2_0000_0512", {"existence"}),
    ("Were any buildings demolished?", "YES/NO", "No, the changes consist of newly built houses.",
     "test_7_0256_0512", set()),
    ("Were any buildings built?", "YES/NO", "No.", "test_7_0256_0512", {"existence"}),
    # a hedged presence ("just reaches into") needs some change there, not change worth naming
    ("Is there any change in the western third?", "YES/NO", "Only a little; the building just reaches into the "
     "western third at the bottom.", "test_77_0512_0256", set()),
    ("Is there any change in the western third?", "YES/NO", "Only a little; the building just reaches into the "
     "western third at the top.", "test_77_0512_0256", {"location"}),
    ("What changed in the southern part?", "WHAT", "Very little; the southern part is mostly unchanged.",
     "test_7_0256_0512", set()),
    # a bare number answers "how many" about the question's objects
    ("How many new houses are there?", "HOW MUCH", "Just two.", "test_2_0000_0512", {"counts"}),
    ("How many new houses are there?", "HOW MUCH", "Roughly fifteen.", "test_2_0000_0512", set()),
])
def test_revision4_answers(f, question, qtype, answer, mask, expected):
    assert rules(answer, f[mask], question, qtype) == expected


def test_where_answer_is_read_with_its_question(f):
    q = "Where did the most significant change occur?"
    assert rules("In the upper-left corner.", f["test_77_0512_0256"], q, "WHERE") == {"location"}
    assert rules("In the lower part and on the right.", f["test_77_0512_0256"], q, "WHERE") == set()


def test_rule_counts_count_each_text_once_per_rule():
    lists = [[{"rule": "location", "detail": "a"}, {"rule": "location", "detail": "b"}], [{"rule": "numbers",
                                                                                         "detail": "c"}], []]
    counts = rule_counts(lists)
    assert counts["location"] == 1 and counts["numbers"] == 1 and counts["counts"] == 0


# -- the captions job's --validators policy, on its stage functions (no Ray, no HTTP) --------------
def _caption_record(f):
    return {"pair_id": "test_77_0512_0256", "split": "test", "filename": "test_77_0512_0256.png",
            "height": 256, "width": 256, "car": f["car"], "changed_pixels": f["changed_pixels"],
            "components": f["components"], "change_region": "lower area", "cell_shares": [0.0] * 9,
            "mask_facts": f, "hashes": {"a_rel": "a", "b_rel": "b", "label_rel": "l"},
            "a_url": "data:image/png;base64,AA", "b_url": "data:image/png;base64,AA",
            "mask_url": "data:image/png;base64,AA", "image_tokens": 85}


CAPTIONS = {"change_type": "A large new building was constructed on bare land.",
            "spatial_location": "The new building stands in the upper-left corner of the image.",   # wrong place
            "visual_appearance": "The new building has a light grey roof and an L-shaped outline.",
            "scale": "Exactly 17.5% of the image changed.",                                           # copied number
            "implication": "The construction suggests commercial development of the area."}


@pytest.mark.parametrize("policy", ["reject", "flag", "off"])
def test_caption_policy(f, policy):
    from operators.language.caption_ops import (CaptionPrompts, build_judge_request, handle_generate_result,
                                                handle_judge_result)
    from operators.language.captions import CRITERIA, load_template
    from operators.llm.client import LLMResult
    prompts = CaptionPrompts(generate=load_template("caption_generate.v1"), judge=load_template("caption_judge.v1"),
                             validators=policy)
    record = _caption_record(f["test_77_0512_0256"])
    [env] = handle_generate_result(prompts, record, LLMResult(item="x", ok=True, value=CAPTIONS))
    judged_record = json.loads(env["_record"])
    request = build_judge_request(prompts, judged_record)
    text = request.messages[1]["content"][0]["text"]
    bad = ("spatial_location", "scale")
    sent = set(request.schema["required"])
    if policy == "reject":
        assert sent == set(CAPTIONS) - set(bad) and not any(CAPTIONS[b] in text for b in bad)
    else:
        assert sent == set(CAPTIONS) and all(CAPTIONS[b] in text for b in bad)
    reply = {p: {**{c: 9 for c in CRITERIA}, "overall": 9, "reason": "ok"} for p in sent}
    rows = [json.loads(e["_record"]) for e in handle_judge_result(prompts, judged_record,
                                                                  LLMResult(item="x", ok=True, value=reply))]
    captions = {r["perspective"]: r for r in rows if "perspective" in r}
    if policy == "off":
        assert all(r["validator_ok"] is None for r in captions.values())
        return
    assert {p for p, r in captions.items() if r["validator_ok"] is False} == set(bad)
    assert {v["rule"] for v in json.loads(captions["scale"]["validator_violations"])} == {"numbers"}
    if policy == "reject":
        assert captions["scale"].get("overall") is None and not captions["scale"]["selected"]
        assert captions["spatial_location"]["selection_reason"] == "rejected by validator: location"
    else:
        assert captions["scale"]["overall"] == 9 and captions["scale"]["selected"]


# -- revision 5 (causes found by the blind held-out set 3; none of its sentences is used here) ---------
@pytest.mark.parametrize("text, mask, expected", [
    # an amount of change called small two bins off (CAR 0.25 / 0.47 / 0.31) is caught whether "small" is
    # predicated of the change ("the amount of change is small"), attached to an area noun ("a small spot"),
    # or the claim is "hardly alters"; object size ("small houses") is not an amount
    ("The amount of change across the scene is small.", "test_2_0000_0000", {"magnitude"}),
    ("The amount of change across the scene is small.", "test_55_ul", set()),
    ("Overall, the change here is fairly small.", "test_77_lr", {"magnitude"}),
    ("Just a modification in one small spot.", "test_77_lr", {"magnitude"}),
    ("Just a modification in one small spot.", "test_55_ul", set()),
    ("The development is small and hardly alters the neighbourhood.", "test_2_0000_0000", {"magnitude"}),
    ("The development is small and hardly alters the neighbourhood.", "test_55_ul", set()),
    ("Only minor modifications were made.", "test_2_0000_0000", {"magnitude"}),
    ("The amount of change in the west is small.", "test_121_ul", set()),   # of a place (CAR 0.30, west 9%)
    ("Small houses were built across the area.", "test_2_0000_0000", set()),
    ("The new houses are small and closely packed.", "test_2_0000_0000", set()),
    # "exactly as they were", "as before", "nil" state that nothing changed
    ("The houses and the streets are exactly as they were; the amount of change is nil.", "train_386_0512_0768",
     set()),
    ("The roofs and yards look as before, and the change between the dates is nil.", "train_386_0512_0768", set()),
    ("The amount of change is nil.", "test_2_0000_0000", {"change"}),
    ("Everything is exactly as it was.", "test_2_0000_0000", {"change"}),
    # a state word in a clause about the earlier date does not negate the sentence's claim of change
    ("A new warehouse now occupies the lot that was vacant earlier.", "train_386_0512_0768", {"change"}),
    ("Two houses now stand where the field lay empty before.", "train_386_0512_0768", {"change", "counts"}),
    # ... but a state kept is still no change (test_121: the upper-left corner clearly changed)
    ("The upper-left corner was empty before and after.", "test_121_0768_0256", {"location"}),
    ("The upper-left corner is a lot that was left empty.", "test_121_0768_0256", {"location"}),
    ("The lot in the upper-left corner that was vacant earlier is still vacant.", "test_121_0768_0256", {"location"}),
    # a side plus "around the middle" is the cell where they meet (val_27: left and top cells empty, their
    # thirds changed)
    ("The left side of the image, around the middle, is unchanged.", "val_27_0000_0256", set()),
    ("The left side of the image, around the middle, is unchanged.", "test_2_0000_0000", {"location"}),
])
def test_revision5_statements(f, text, mask, expected):
    assert rules(text, f[mask]) == expected


@pytest.mark.parametrize("question, qtype, answer, mask, expected", [
    ("How much of the scene changed?", "HOW MUCH", "Very little.", "test_77_lr", {"magnitude"}),
    ("How much of the scene changed?", "HOW MUCH", "Very little.", "test_55_ul", set()),
    ("How much changed in the west?", "HOW MUCH", "Very little; the change there is small.", "test_121_ul", set()),
    ("What is different between the two dates?", "BEFORE/AFTER", "A new shed now stands where the yard was bare "
     "before.", "train_386_0512_0768", {"change"}),
    ("Is there any change on the left side of the image, around the middle?", "YES/NO", "No, it is unchanged.",
     "val_27_0000_0256", set()),
    ("Is there any change on the left side of the image, around the middle?", "YES/NO", "Yes.",
     "val_27_0000_0256", {"existence"}),
    ("Was anything built at the top, in the center?", "YES/NO", "No, nothing new appears there.",
     "val_27_0000_0256", set()),
    ("Was anything built at the top, in the center?", "YES/NO", "No, nothing new appears there.",
     "test_102_0512_0000", {"existence"}),
    # a list of places is not their meeting point
    ("Was anything built at the top and in the center?", "YES/NO", "No, nothing new appears there.",
     "val_27_0000_0256", {"existence"}),
])
def test_revision5_answers(f, question, qtype, answer, mask, expected):
    assert rules(answer, f[mask], question, qtype) == expected


# Revision 6, made on the failure classes of blind set 4 (not its sentences: these are new ones).
@pytest.mark.parametrize("text, mask, expected", [
    # a hedged round percentage is an estimate: checked against the CAR, not rejected as a copied figure
    ("About 25 percent of the scene is new housing.", "test_2_0000_0000", set()),
    ("About 50 percent of the scene changed.", "test_2_0000_0000", {"numbers"}),
    ("Just under 20% of the image changed.", "test_77_0512_0256", set()),
    ("Just under 20% of the image changed.", "test_2_0000_0000", {"numbers"}),
    ("Roughly 17.6 percent of the image changed.", "test_77_0512_0256", {"numbers"}),   # a decimal: copied
    # "line" is a change verb only as a verb: a list of unchanged things is no change claim
    ("The power line, the tennis courts and the car park look the same before and after.", "train_386_0512_0768",
     set()),
    ("New houses line the street along the bottom.", "train_386_0512_0768", {"change", "location"}),
    # "changed much less" is little change, not change
    ("The lower half gained many houses, while the top changed much less.", "test_55_0256_0000", set()),
    ("The right edge holds part of the new building, while the left changed much less.", "test_77_lr", {"location"}),
    # "leaving X untouched" speaks of X only
    ("A large building covers the lower center, leaving the upper third untouched.", "test_77_0512_0256", set()),
    ("A large building fills the lower center, leaving the lower right untouched.", "test_77_0512_0256", {"location"}),
    # large-amount words predicated of the change, and "larger than what stayed the same"
    ("The amount of change is enormous.", "test_55_ul", {"magnitude"}),
    ("The amount of change is enormous.", "test_2_0000_0000", set()),
    ("The new development is larger than the part that stayed the same.", "test_77_0512_0256", {"magnitude"}),
    ("The new development is larger than the part that stayed the same.", "test_77_lr", set()),
    # how far objects spread is not how much area changed
    ("Houses are scattered across most of the image.", "test_2_0000_0512", set()),
    ("New houses cover most of the image.", "test_2_0000_0512", {"magnitude"}),
    # number words up to ninety-nine; a count by kind is checked as its sum
    ("Twenty-two houses were built.", "test_2_0000_0000", set()),
    ("Some forty-five new houses appeared.", "train_412_0512_0768", {"counts"}),
    ("Two large buildings and five houses appeared.", "test_121_0768_0256", set()),
    ("One warehouse and two houses appeared.", "test_2_0000_0000", {"counts"}),
    ("One large building and several houses appeared.", "test_121_0768_0256", set()),
])
def test_revision6_statements(f, text, mask, expected):
    assert rules(text, f[mask]) == expected


@pytest.mark.parametrize("question, answer, mask, expected", [
    ("Does the after image differ from the before image?", "No, the two images are the same.", "test_77_0512_0256",
     {"change", "existence"}),
    ("Does the after image differ from the before image?", "No, the two images are the same.", "train_386_0512_0768",
     set()),
])
def test_revision6_answers(f, question, answer, mask, expected):
    assert rules(answer, f[mask], question, "YES/NO") == expected


# Revision 7, made on the failure classes of blind set 5 (new sentences, not set 5's).
@pytest.mark.parametrize("text, mask, expected", [
    # a verbal share of the view is checked against the CAR; "the lower half of the image" is a place
    ("Roughly a quarter of the scene is new housing.", "test_2_0000_0000", set()),
    ("Roughly a quarter of the scene is new housing.", "train_412_0512_0768", {"numbers"}),
    ("Nearly half of this view is taken up by the new building.", "test_77_lr", set()),
    ("Nearly half of this view is taken up by the new building.", "test_77_0512_0256", {"numbers"}),
    ("New homes fill the lower half of the image.", "test_55_0256_0000", set()),
    # any hedged whole percentage is an estimate, checked against the CAR
    ("About 12 percent of the image changed.", "train_412_0512_0768", set()),
    ("About 30 percent of the image changed.", "train_412_0512_0768", {"numbers"}),
    # amount words of "this crop / view / it"
    ("Much of this crop changed.", "test_77_ur", {"magnitude"}),
    ("Much of this crop changed.", "test_77_lr", set()),
    ("The new roofs take up a tiny share of the image.", "test_2_0000_0000", {"magnitude"}),
    ("The new roofs take up a tiny share of the image.", "test_55_ul", set()),
    # "filling the empty plots" says what was built on, not that a place stayed empty
    ("About ten new houses went up, filling the empty plots in the lower half.", "test_55_0256_0000", set()),
    # a counted part of a count by kind whose other part is not counted
    ("Three houses plus a row of smaller garages were built.", "test_2_0000_0000", set()),
])
def test_revision7_statements(f, text, mask, expected):
    assert rules(text, f[mask]) == expected


@pytest.mark.parametrize("question, answer, mask, expected", [
    ("What proportion of the scene changed?", "Roughly a third.", "test_7_0256_0512", {"numbers"}),
    ("What proportion of the scene changed?", "Roughly a third.", "test_2_0000_0000", set()),
    ("How much of it was built on?", "Almost all of it.", "test_2_0000_0000", {"magnitude"}),
    ("What is new in the second image?", "Nothing; every roof and road is as it was.", "test_7_0256_0512", {"change"}),
    ("What is new in the second image?", "Nothing; every roof and road is as it was.", "train_386_0512_0768", set()),
    ("What is new in the second image?", "Nothing, except a dozen houses by the road.", "test_7_0256_0512", set()),
])
def test_revision7_answers(f, question, answer, mask, expected):
    assert rules(answer, f[mask], question, "HOW MUCH") == expected


# Revision 8, made on the failure classes of blind set 6 (new sentences, not set 6's).
@pytest.mark.parametrize("text, mask, expected", [
    # percentages hedged after the figure, and ranges, are estimates
    ("Roughly a fifth of the scene, 20 percent or so, is new housing.", "test_77_0512_0256", set()),
    ("Roughly a fifth of the scene, 40 percent or so, is new housing.", "test_77_0512_0256", {"numbers"}),
    ("New homes cover 11 or 12 percent of the image.", "train_412_0512_0768", set()),
    ("New homes cover 30 or 35 percent of the image.", "train_412_0512_0768", {"numbers"}),
    ("About one twentieth of this part changed.", "test_55_ul", set()),
    ("About one twentieth of this part changed.", "test_77_lr", {"numbers"}),
    # "present in both images" is persistence; "can't see any new buildings" denies change
    ("The old school and the row of shops are present in both images; nothing new was built.",
     "train_386_0512_0768", set()),
    ("The old school and the row of shops are present in both images; nothing new was built.",
     "test_2_0000_0000", {"change"}),
    ("I can't see any new buildings between the two dates.", "train_386_0512_0768", set()),
    ("I can't see any new buildings between the two dates.", "test_2_0000_0000", {"change"}),
    # a predicate without a subject of its own completes the bare segments before it
    ("The north, especially the corner by the road, is untouched.", "test_77_0512_0256", set()),
    ("The south, especially the corner by the road, is untouched.", "test_77_0512_0256", {"location"}),
    # amount words: "dominated by", "almost the whole scene"; "most of the frame is fields" is no change claim
    ("This crop is dominated by the new building.", "test_77_lr", set()),
    ("Almost the whole scene has been built over.", "test_2_0000_0000", {"magnitude"}),
    ("New houses appear on a tenth of the scene; most of the frame is fields and roads.", "train_412_0512_0768",
     set()),
    # a sliver under the no-change tolerance is no new buildings, unless hedged as a sliver
    ("A new block of houses has gone up in this view.", "test_55_ul", {"change"}),
    ("A new block of houses has gone up in this view.", "test_2_0000_0000", set()),
    ("Just the tip of a new roof reaches into this view.", "test_55_ul", set()),
])
def test_revision8_statements(f, text, mask, expected):
    assert rules(text, f[mask]) == expected


@pytest.mark.parametrize("question, answer, mask, expected", [
    # the answer word denies the question, not the clause after it
    ("Is there any change in the upper third?", "No, it is all at the bottom.", "test_77_0512_0256", set()),
    ("How much of it was built on?", "A lot; most of it is now houses.", "test_55_ul", {"magnitude"}),
])
def test_revision8_answers(f, question, answer, mask, expected):
    assert rules(answer, f[mask], question, "YES/NO") == expected


# -- issue 32: exception scopes, one object is change, the QA numbers rule (at the paper's 1024 px) --------------
@functools.cache
def synth(*boxes, size=1024):
    """The facts of a 1024 px mask holding ``boxes`` (y, x, h, w); worked out when a test first asks
    (not at import: every pytest process collects this module, and each set costs 0.2 s)."""
    import numpy as np
    mask = np.zeros((size, size), bool)
    for y, x, h, w in boxes:
        mask[y:y + h, x:x + w] = True
    return mask_facts(mask)


def facts_of(boxes):
    return synth(*boxes)


NE_AND_SW = ((100, 800, 120, 120), (800, 100, 120, 120))       # a building in each of two corners
NE_ONLY = ((60, 700, 250, 280),)                               # one block in the upper-right corner
NORTH_AND_ONE_HOUSE = ((50, 100, 300, 800), (850, 480, 50, 50))  # a development and one house far south
ONE_HOUSE = ((120, 820, 55, 55),)                              # 3,025 px: 0.29 % of the crop
THREE_HOUSES = ((200, 200, 55, 55), (500, 520, 55, 55), (800, 850, 55, 55))  # 0.87 %
SPECKS = tuple((y, x, 6, 6) for y in (100, 500, 900) for x in (100, 500, 900))  # 9 x 36 px: no object


@pytest.mark.parametrize("text,facts_,expected", [
    ("Apart from the north-east, where a new block of buildings has appeared, the scene is unchanged.", NE_AND_SW, False),
    ("A new building has been constructed in the upper-right corner; the rest of the image is unchanged.", NE_AND_SW, False),
    ("Apart from the new buildings in the north-east and south-west corners, the scene is unchanged.", NE_AND_SW, True),
    ("Apart from the north-east, where a large new complex now stands, the scene is unchanged.", NE_ONLY, True),
    ("A large block of new structures occupies the upper-right corner; the rest of the image remains the same.",
     NE_ONLY, True),
    ("Except for the upper-right corner, nothing has changed.", NE_AND_SW, False),
    ("Except for the upper-right corner, nothing has changed.", NE_ONLY, True),
    ("A dense new development covers the northern part of the image; elsewhere, nothing has changed.",
     NORTH_AND_ONE_HOUSE, False),
    ("New construction covers the upper part of the image, and a single new house has appeared near the bottom; "
     "nothing else has changed.", NORTH_AND_ONE_HOUSE, True),
    ("Dense new development fills the northern half, while the southern half of the image is unchanged.",
     NORTH_AND_ONE_HOUSE, False),
    ("Apart from the new buildings, nothing has changed.", NE_AND_SW, True),   # no place: no scope to check
])
def test_exception_scope(text, facts_, expected):
    ok, violations = validate_text(text, facts_of(facts_))
    assert ok is expected, violations
    if not expected:
        assert {v.rule for v in violations} == {"location"}


def test_one_house_is_change_and_no_change_is_wrong_from_one_object():
    from operators.language.validators import ValidatorConfig
    assert facts_of(ONE_HOUSE)["car"] == pytest.approx(0.0029, abs=1e-4)
    assert facts_of(THREE_HOUSES)["car"] == pytest.approx(0.0087, abs=1e-4)
    # A correct caption of one new house at 0.29 % passes the change rule (and every other).
    for text in ("A single new house has been built in the upper-right corner.",
                 "Apart from one new house in the north-east corner, the scene is unchanged."):
        assert validate_text(text, facts_of(ONE_HOUSE)) == (True, [])
    assert validate_text("Yes, one new house has been built in the north-east corner.", facts_of(ONE_HOUSE),
                         "Has anything changed between the two images?", "YES/NO") == (True, [])
    # "No, nothing has changed" fails at 0.86 %, and at one house.
    for facts_ in (facts_of(THREE_HOUSES), facts_of(ONE_HOUSE)):
        ok, violations = validate_text("No, nothing has changed.", facts_, "Has anything changed?", "YES/NO")
        assert not ok and {v.rule for v in violations} & {"change", "existence"}
        ok, violations = validate_text("There are no noticeable changes between the two images.", facts_)
        assert not ok and {v.rule for v in violations} == {"change"}
    # Speckle (no component of one object's size) is no change, and no new house.
    assert validate_text("No significant change is visible between the two images.", facts_of(SPECKS)) == (True, [])
    ok, violations = validate_text("Several new houses have been built across the scene.", facts_of(SPECKS))
    assert not ok and violations[0].rule == "change" and "200 px" in violations[0].detail
    # The floor is an option in pixels: raised above one house, the house is speckle.
    assert validate_text("The scene is unchanged.", facts_of(ONE_HOUSE), cfg=ValidatorConfig(min_object_px=4000))[0]
    # A single object makes a place changed, however little of it it covers (0.46 % of the left third).
    assert validate_text("A single small house has been built on the left side of the image.",
                         synth((600, 300, 40, 40))) == (True, [])


@pytest.mark.parametrize("answer,ok", [
    ("Approximately 2 percent of the image changed.", False),
    ("About 15% of the scene is new housing.", False),
    ("It is a small house of roughly 3 hundred square metres.", False),
    ("Around 0.12 of the image area.", False),
    ("A strip of buildings about 60 metres wide.", False),
    ("Roughly eight percent of the area.", False),
    ("Only a small part: two new buildings in opposite corners.", True),
    ("A single two-storey house with a red roof.", True),
])
def test_qa_numbers_rule_rejects_figures_hedged_or_not(answer, ok):
    from operators.language.validators import qa_validator_config
    got, violations = validate_text(answer, facts_of(NE_AND_SW), "How much of the image changed?", "HOW MUCH",
                                    qa_validator_config(), rules=("numbers",))
    assert got is ok, violations
    # Captions and audits keep the estimate rule: a hedged round figure near the CAR passes there.
    assert validate_text("Roughly 3 percent of the image changed.", facts_of(NE_AND_SW), rules=("numbers",))[0]
