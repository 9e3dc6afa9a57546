"""The whole chain on real data, each job on the previous job's real output: two NAIP scenes -> pairs job
(the demo geometry) -> annotate export into a real Label Studio -> two annotators through its API
(brush masks of known shapes, one pair in disagreement) -> annotate ingest -> captions and QA against
the OpenAI-compatible test server -> validate -> review export -> report -> score change with the
pre-labels as predictions. One run for the module; each test checks one seam."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import cv2
import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.annotation import drawing
from tests.annotation.drawing import brush
from tests.conftest import DATA, own_llm_namespace
from tests.review.test_review_label_studio import api

# The session's Label Studio serves the pairs output from a folder of its document root; the whole chain is
# set up in the first test, hence the longer timeout.
pytestmark = [pytest.mark.slow, pytest.mark.labelstudio, pytest.mark.timeout(600)]

SCENES = ("m_4709963_se_14_1_20160816.tif", "m_4709963_se_14_1_20200831.tif")
CROP = 256


def rect(y0, y1, x0, x1):
    return drawing.rect((CROP, CROP), y0, y1, x0, x1)


# What the two annotators draw, by position of the pair in sorted order; the rest stays unannotated.
PLAN = {
    0: [{"new": rect(10, 60, 20, 90), "demolished": rect(100, 140, 150, 230)}],            # one annotation
    1: [{"new": rect(30, 80, 30, 80)}, {"new": rect(30, 80, 32, 80)}],                      # two that agree
    2: [{"new": rect(0, 50, 0, 50)}, {"new": rect(150, 250, 150, 250)}],                    # two that disagree
    3: [{}],                                                                                # "no change here"
}


def masks_of(drawn: dict) -> dict:
    return {c: drawn.get(c, np.zeros((CROP, CROP), bool)) for c in ("new", "demolished")}


@pytest.fixture(scope="module")
def chain(tmp_path_factory, ray_session, openai_test_server_process, label_studio):
    from jobs import annotate, build_pairs, caption, qa, report, review, score, validate
    from operators.pairs.selection.pairing import PairingConfig
    from operators.pairs.registration.registration import RegistrationConfig

    base = tmp_path_factory.mktemp("chain")
    # The session's Label Studio (one per session) serves the pairs output from its document root (the
    # export's image URLs are relative to the pairs folder's parent: the folder sits right under it).
    archive, root = base / "archive", label_studio.document_root
    archive.mkdir()
    for name in SCENES:
        shutil.copy(DATA / "naip" / name, archive / name)
    pairs = root / "pairs"          # under Label Studio's document root: served as local files
    out = {"base": base, "pairs": pairs}
    out["build"] = build_pairs.run(
        # Seed 3 draws the archive's one location into the test split: a job that labelled pairs by its
        # --default-split (train) instead of list/ would show at every seam.
        build_pairs.PairsJobConfig(input=str(archive), output=str(pairs), slice_size=512, stride=128, seed=3),
        PairingConfig(reference_date="2021-01-01"),
        RegistrationConfig(crop_size=CROP, tile_size=512, search_margin_px=64))

    server = label_studio
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LABEL_STUDIO_API_KEY", server.token)
        mp.setenv("OPENAI_API_KEY", "test-key")
        export_cfg = annotate.ExportConfig(input=str(pairs), output=str(base / "tasks"), prelabel="cva",
                                           annotations_per_task=2, label_studio_url=server.url)
        out["export"] = annotate.run_export(export_cfg)
        out["export_again"] = annotate.run_export(dataclasses.replace(   # reuses the project, imports
            export_cfg, output=str(base / "tasks-again"), prelabel=""))      # nothing twice
        pid = out["export"]["label_studio"]["project_id"]
        out["project"] = api(server, f"/api/projects/{pid}")
        listed = sorted(api(server, f"/api/tasks?project={pid}&page_size=100")["tasks"],
                        key=lambda t: t["data"]["pair_id"])
        out["listed"] = listed
        out["served"] = api(server, listed[0]["data"]["pre"])
        second = api(server, "/api/users/", {"email": "second@changeforge.test", "username": "second",
                                              "first_name": "Second", "last_name": "Annotator"})["id"]
        first = api(server, "/api/current-user/whoami")["id"]
        out["annotators"] = (first, second)
        for i, drawings in PLAN.items():
            for who, drawn in zip((first, second), drawings):
                image = {"new": "post", "demolished": "pre"}
                api(server, f"/api/tasks/{listed[i]['id']}/annotations/", {
                    "result": [brush(c, image[c], m) for c, m in drawn.items()], "completed_by": who,
                    "lead_time": 30.0 + i})
        out["ingest"] = annotate.run_ingest(annotate.IngestConfig(input=str(pairs), export=server.url,
                                                                  project_id=pid))

        llm = openai_test_server_process
        llm.configure(latency_ms=0, reject_json_schema=False, faults=[])
        common = dict(model="test-model", base_url=llm.base_url, timeout_s=5.0, max_retries=2, actors=1,
                      concurrent_batches=4, batch_size=4, progress_every_s=5.0)
        with own_llm_namespace("chain-e2e"):   # limiters of its own, not the account's default
            out["caption"] = caption.run(caption.CaptionJobConfig(input=str(pairs), output=str(base / "captions"), **common))
            out["qa"] = qa.run(qa.QAJobConfig(input=str(base / "captions"), output=str(base / "qa"), **common))
    out["validate"] = validate.run(str(base / "qa" / "VQA.json"), str(base / "audit"))
    out["review"] = review.run_export(review.ExportConfig(input=str(base / "captions"), output=str(base / "review"),
                                                          sample=4, include_rejected=True))
    rcfg = report.ReportConfig(input=[str(base / "captions"), str(base / "qa")], output=str(base / "report"))
    out["report"] = report.run(rcfg)
    out["gallery"] = report.gallery(rcfg, report.load_inputs(rcfg.input))
    out["score"] = score.run_change(score.ChangeScoreConfig(pred=str(base / "tasks" / "prelabels" / "cva"),
                                                            label=str(pairs / "label"), output=str(base / "score")))
    return out


def read_mask(path: Path) -> np.ndarray:
    m = cv2.imread(str(path), cv2.IMREAD_UNCHANGED)
    assert m is not None and m.ndim == 2 and set(np.unique(m)) <= {0, 255}, path
    return m > 0


def list_splits(pairs: Path) -> dict[str, str]:
    return {line.strip()[:-4]: split for split in ("train", "val", "test")
            for line in (pairs / "list" / f"{split}.txt").read_text().splitlines() if line.strip()}


def test_export_every_accepted_pair_is_a_task_with_its_split_and_prelabel(chain):
    pairs, splits = chain["pairs"], list_splits(chain["pairs"])
    stems = sorted(p.stem for p in (pairs / "A").glob("*.png"))
    assert len(stems) == chain["build"]["accepted_total"] >= 6 and sorted(splits) == stems
    assert set(splits.values()) == {"test"}
    tasks = json.loads((chain["base"] / "tasks" / "tasks.json").read_text())
    assert {t["data"]["pair_id"]: t["data"]["split"] for t in tasks} == splits
    assert all(t["predictions"][0]["model_version"] == "changeforge:cva" for t in tasks)
    # In Label Studio: every task once, with its prediction, images served from the pairs output.
    assert chain["project"]["maximum_annotations"] == 2
    again = chain["export_again"]["label_studio"]
    assert again["project_id"] == chain["project"]["id"] and again["imported"] == 0
    assert again["already_there"] == len(stems)
    assert sorted(t["data"]["pair_id"] for t in chain["listed"]) == stems
    assert all(t["total_predictions"] == 1 for t in chain["listed"])
    assert chain["served"] == (pairs / "A" / f"{chain['listed'][0]['data']['pair_id']}.png").read_bytes()


def test_ingest_masks_equal_the_drawn_shapes_and_the_disagreement_is_withheld(chain):
    pairs, listed = chain["pairs"], chain["listed"]
    for i in (0, 1, 3):
        stem, drawn = listed[i]["data"]["pair_id"], masks_of(PLAN[i][0])
        assert np.array_equal(read_mask(pairs / "label1" / f"{stem}.png"), drawn["new"])
        assert np.array_equal(read_mask(pairs / "label2" / f"{stem}.png"), drawn["demolished"])
        assert np.array_equal(read_mask(pairs / "label" / f"{stem}.png"), drawn["new"] | drawn["demolished"])
    withheld = [t["data"]["pair_id"] for t in listed[2:3] + listed[4:]]
    for stem in withheld:
        assert not any((pairs / f / f"{stem}.png").exists() for f in ("label", "label1", "label2"))
    pending = {r["pair_id"]: r["status"] for r in pq.read_table(pairs / "annotation_pending").to_pylist()}
    assert pending == {withheld[0]: "disagreement", **{s: "unannotated" for s in withheld[1:]}}
    assert chain["ingest"]["merged"] == 3 and chain["ingest"]["disagreements"] == [withheld[0]]


def test_agreement_and_prelabel_iou_equal_an_independent_computation(chain):
    rows = pq.read_table(chain["pairs"] / "annotations").to_pylist()
    listed = chain["listed"]
    for i in (1, 2):
        a, b = (masks_of(d)["new"] for d in PLAN[i])
        inter, union = int((a & b).sum()), int((a | b).sum())
        row = next(r for r in rows if r["pair_id"] == listed[i]["data"]["pair_id"] and r["class"] == "new"
                   and r["order"] == 0)
        assert row["agreement_iou"] == pytest.approx(inter / union)
        assert row["agreement_f1"] == pytest.approx(2 * inter / (a.sum() + b.sum()))
        assert {r["annotator"] for r in rows if r["pair_id"] == row["pair_id"]} == {str(x) for x in chain["annotators"]}
    stem = listed[0]["data"]["pair_id"]
    cva = read_mask(chain["base"] / "tasks" / "prelabels" / "cva" / f"{stem}.png")
    drawn = PLAN[0][0]["new"]
    row = next(r for r in rows if r["pair_id"] == stem and r["class"] == "new")
    assert row["iou_vs_prelabel"] == pytest.approx((cva & drawn).sum() / (cva | drawn).sum())
    assert row["lead_time_s"] == 30.0 and row["pixels"] == drawn.sum()


def test_captions_and_qa_take_the_pairs_output_with_its_splits(chain):
    pairs, splits = chain["pairs"], list_splits(chain["pairs"])
    merged = sorted(p.stem for p in (pairs / "label").glob("*.png"))
    n_unlabelled = len(splits) - len(merged)
    for job, folder in (("caption", "captions"), ("qa", "qa")):
        s = chain[job]
        assert s["pairs_found"] == len(merged) == 3 and s["errors"] == 0
        assert s["pairs_skipped"] == {"no change mask in label/ yet (not annotated)": n_unlabelled}
        rows = pq.read_table(chain["base"] / folder / "pairs").to_pylist()
        assert sorted(r["pair_id"] for r in rows) == merged
        assert all(r["split"] == splits[r["pair_id"]] for r in rows)
    source = json.loads((chain["base"] / "qa" / "source.json").read_text())
    assert Path(source["dataset"]) == pairs
    cc = json.loads((chain["base"] / "captions" / "LevirCCcaptions.json").read_text())
    written = {i["filename"][:-4]: i["split"] for i in cc["images"]}   # pairs with a selected caption
    assert written and written == {m: splits[m] for m in written} and set(written) <= set(merged)


def test_validate_review_and_report_find_the_dataset_without_images_options(chain):
    vqa = json.loads((chain["base"] / "qa" / "VQA.json").read_text())
    n_answers = sum(len(i["qa"]) for i in vqa["images"])
    assert chain["validate"]["claims"] == n_answers > 0 and chain["validate"]["errors"] == 0
    tasks = json.loads((chain["base"] / "review" / "tasks.json").read_text())
    assert len(tasks) == 4 and all("pairs/A/" in t["data"]["pre"] for t in tasks)
    assert chain["report"]["captions"] and chain["report"]["qa"] and chain["report"]["car"]["source"]
    assert chain["gallery"] and all(g.images["pre"] is not None and g.images["mask"] is not None
                                    for g in chain["gallery"])


def test_score_change_with_the_prelabels_as_predictions(chain):
    pairs = chain["pairs"]
    labelled = sorted(p.name for p in (pairs / "label").glob("*.png"))
    tp = fp = fn = 0
    for name in labelled:
        pred = read_mask(chain["base"] / "tasks" / "prelabels" / "cva" / name)
        truth = read_mask(pairs / "label" / name)
        tp, fp, fn = tp + int((pred & truth).sum()), fp + int((pred & ~truth).sum()), fn + int((~pred & truth).sum())
    doc = chain["score"]
    assert doc["n_images"] == len(labelled) == 3
    assert doc["n_errors"] == len(list((pairs / "A").glob("*.png"))) - 3       # predictions without a mask yet
    assert doc["f1"] == pytest.approx(2 * tp / (2 * tp + fp + fn))
