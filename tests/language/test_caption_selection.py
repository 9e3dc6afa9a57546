"""Selection rule, overall score modes, templates, schemas and the LEVIR-CC document."""
import pytest

from operators.language.captions import (CRITERIA, PERSPECTIVES, generation_schema, judge_schema, levir_cc_document,
                                load_template, overall_score, select_captions, tokenize, write_levir_cc)
from operators.llm.schema import schema_errors


def kept(scores):
    return [s.selected for s in select_captions(scores)]


def test_top_three_of_passing():
    assert kept([10, 9, 8, 7, 7]) == [True, True, True, False, False]


def test_ties_at_the_cut_are_all_kept():
    assert kept([9, 8, 8, 8, 5]) == [True, True, True, True, False]
    assert kept([7, 7, 7, 7, 7]) == [True] * 5
    reasons = [s.reason for s in select_captions([9, 8, 8, 8, 5])]
    assert "tied" in reasons[1] and "rejected" in reasons[4]


def test_all_below_seven_rejected():
    sel = select_captions([6, 6.99, 1, 5, 6])
    assert not any(s.selected for s in sel)
    assert all(s.reason.startswith("rejected") for s in sel)


def test_fewer_than_three_passing_all_kept():
    assert kept([7, 3, 9, 2, 1]) == [True, False, True, False, False]


def test_tie_above_cut_does_not_widen():
    # Two tied at the top and one clear third: exactly three kept.
    assert kept([9, 9, 8, 7, 10]) == [True, True, False, False, True]


def test_overall_modes():
    s = {"accuracy": 9, "specificity": 6, "spatial_correctness": 8, "naturalness": 10, "informativeness": 7,
         "overall": 8}
    assert overall_score(s, "judge") == 8
    assert overall_score(s, "mean") == pytest.approx(8.0)
    assert overall_score(s, "min") == 6
    with pytest.raises(ValueError):
        overall_score(s, "max")


def test_templates_load_render_and_carry_versions():
    gen = load_template("caption_generate.v1")
    judge = load_template("caption_judge.v1")
    assert gen.version == "caption_generate.v1" and judge.version == "caption_judge.v1"
    system, user = gen.render(car_percent="12.5", region="upper-left area of the image", components=3)
    assert "upper-left area of the image" in user and "12.5%" in user and system
    for p in PERSPECTIVES:
        assert p in user
    _, juser = judge.render(region="center", captions="change_type: x", keys=", ".join(PERSPECTIVES))
    for c in CRITERIA:
        assert c in juser


def test_schemas_accept_good_and_reject_incomplete_replies():
    good = {p: f"a caption about {p} changes" for p in PERSPECTIVES}
    assert schema_errors(good, generation_schema()) == []
    assert schema_errors({k: v for k, v in good.items() if k != "scale"}, generation_schema())
    entry = {**{c: 8 for c in CRITERIA}, "overall": 8, "reason": "fine"}
    assert schema_errors({p: entry for p in PERSPECTIVES}, judge_schema()) == []
    assert schema_errors({p: dict(entry, accuracy=11) for p in PERSPECTIVES}, judge_schema())


def test_tokenize_levir_cc_style():
    assert tokenize("Two new buildings appear in the upper-left, near a road.") == \
        ["two", "new", "buildings", "appear", "in", "the", "upper", "left", "near", "a", "road"]


def test_levir_cc_document_shape():
    pairs = [{"split": "train", "filename": "train_1.png", "car": 0.1, "selected_captions": ["A road was built.", "B."]},
             {"split": "test", "filename": "test_1.png", "car": 0.0, "selected_captions": []},
             {"split": "val", "filename": "val_1.png", "car": 0.0, "selected_captions": ["Nothing changed."]}]
    doc = levir_cc_document(pairs)
    names = [img["filename"] for img in doc["images"]]
    assert names == ["train_1.png", "val_1.png"]          # no sentences -> left out
    img = doc["images"][0]
    assert img["split"] == img["filepath"] == "train" and img["changeflag"] == 1
    assert [s["raw"].strip() for s in img["sentences"]] == ["A road was built.", "B."]
    assert img["sentences"][0]["tokens"] == ["a", "road", "was", "built"]
    assert img["sentids"] == [0, 1] and doc["images"][1]["sentids"] == [2]
    assert doc["images"][1]["changeflag"] == 0


@pytest.mark.parametrize("n_pairs", [0, 1, 7])
def test_levir_cc_file_written_as_it_goes_is_the_document_byte_for_byte(n_pairs):
    import io
    import json
    pairs = sorted(({"split": ("train", "val")[i % 2], "filename": f"p_{i:02d}.png", "car": 0.1 * (i % 3),
                     "selected_captions": [f"Caption {i}.{k} \u00e9" for k in range(i % 4)]} for i in range(n_pairs)),
                   key=lambda p: (p["split"], p["filename"]))
    batches = [pairs[i:i + 3] for i in range(0, len(pairs), 3)]
    f = io.BytesIO()
    written = write_levir_cc(batches, f)
    doc = levir_cc_document(pairs)
    assert f.getvalue() == json.dumps(doc, indent=1).encode()
    assert written == len(doc["images"])
    if n_pairs == 7:
        assert written == 5 and doc["images"][-1]["sentids"][-1] == sum(i % 4 for i in range(7)) - 1


def test_default_overall_never_selects_a_caption_marked_hallucinated():
    """The judge's own overall is unconstrained: 8 overall for a caption scored 2 for accuracy."""
    hallucinated = {"accuracy": 2, "specificity": 9, "spatial_correctness": 9, "naturalness": 10,
                    "informativeness": 9, "overall": 8}
    good = {"accuracy": 8, "specificity": 7, "spatial_correctness": 8, "naturalness": 9, "informativeness": 8,
            "overall": 8}
    scores = [hallucinated, good, good, good, good]
    assert overall_score(hallucinated) <= 4
    assert not select_captions([overall_score(s) for s in scores])[0].selected
    assert overall_score(good) == pytest.approx(8.0)                 # otherwise the mean of the criteria
    assert select_captions([overall_score(s, "judge") for s in scores])[0].selected   # the option remains


def _scores(mean_parts):
    """Five integer criteria per candidate with the given sums (the judge's scores are integers)."""
    out = []
    for total in mean_parts:
        base, extra = divmod(total, 5)
        values = [base + (1 if k < extra else 0) for k in range(5)]
        out.append({**dict(zip(CRITERIA, values)), "overall": 5, "reason": "r"})
    return out


def test_default_overall_is_an_integer_so_ties_at_the_cut_are_kept():
    """Criteria means 9.0, 8.2, 7.4, 7.2 and 6.4: as integers 9, 8, 7, 7, 6, so the two tied at third place
    are both kept (four captions) and the 6 is rejected; a float mean would keep three."""
    import json
    from operators.language.caption_ops import CaptionPrompts, handle_judge_result
    from operators.llm.client import LLMResult
    scores = _scores([45, 41, 37, 36, 32])
    assert [overall_score(s) for s in scores] == [9, 8, 7, 7, 6]
    assert all(isinstance(overall_score(s), int) for s in scores)
    assert overall_score({**dict(zip(CRITERIA, (7, 7, 8, 8, 8))), "overall": 1}) == 8    # 7.6 rounds up
    assert overall_score({**dict(zip(CRITERIA, (7, 7, 7, 8, 8))), "overall": 1}) == 7    # 7.4 rounds down
    assert overall_score({**dict(zip(CRITERIA, (6, 6, 7, 7, 7))), "overall": 1}) == 7    # 6.6: passes as 7
    prompts = CaptionPrompts(generate=load_template("caption_generate.v2"), judge=load_template("caption_judge.v2"))
    record = {"pair_id": "p", "split": "test", "filename": "p.png", "height": 1024, "width": 1024, "car": 0.1,
              "changed_pixels": 1, "components": 1, "cell_shares": [0.0] * 9, "change_region": "center",
              "captions": [f"caption {p}" for p in PERSPECTIVES], "verdicts": [[True, "[]"]] * 5}
    rows = [json.loads(e["_record"]) for e in handle_judge_result(
        prompts, record, LLMResult(item="p", ok=True, value=dict(zip(PERSPECTIVES, scores))))]
    captions = [r for r in rows if "candidate_index" in r]
    [pair] = [r for r in rows if "n_selected" in r]
    assert [r["overall"] for r in captions] == [9, 8, 7, 7, 6]
    assert [r["selected"] for r in captions] == [True, True, True, True, False]
    assert "tied at the top-3 cut" in captions[2]["selection_reason"] and "tied" in captions[3]["selection_reason"]
    assert captions[4]["selection_reason"] == "rejected: overall 6 below 7"
    assert pair["n_selected"] == 4 and pair["selected_perspectives"] == list(PERSPECTIVES[:4])
    # The float mean (an option, not the paper's) has no tie: three kept, 7.2 below the cut.
    assert kept([overall_score(s, "mean") for s in scores]) == [True, True, True, False, False]


def test_v2_templates_share_one_system_text_and_pair_text():
    names = ("caption_generate.v2", "caption_judge.v2", "qa_generate.v2", "qa_judge.v2")
    templates = [load_template(n) for n in names]
    assert len({t.system for t in templates}) == 1 and len({t.pair for t in templates}) == 1
    assert "$" not in templates[0].system and "$region" in templates[0].pair
    assert load_template("caption_generate.v1").pair == ""          # v1 stays as it was, for old runs
