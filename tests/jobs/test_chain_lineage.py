"""Derived data follows its inputs, through ``changeforge chain`` as a user runs it (issue 44).

The bundled LEVIR-CD samples go through caption -> qa -> publish to release 1.0.0. Then two masks are
redrawn (one emptied, one grown), one image is only touched (rewritten with the same bytes), and one pair's
QA output row is edited in a copy to record another QA template (as when the template was edited after
that pair was asked). ``chain --explain`` must list exactly those pairs with their causes; the chain re-run
with a new release version (no ``--from-step``) must ask the LLM server for exactly them (the steps run
without the answer cache, so a lineage that redid everything could not hide behind it), and release 1.1.0
must ship the redrawn pairs' new captions. Publish refuses, and ``publish --verify`` fails, a release
pairing an old caption with a new mask."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import cv2
import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.conftest import DATA, REPO
from tests.jobs.chain_runs import changeforge_in_process, run_chain

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

EMPTIED, GROWN, TEMPLATE = "test_102_0512_0000", "test_121_0768_0256", "train_36_0512_0512"
TOUCHED = "test_2_0000_0000"


def chain_file(path: Path, root: Path, levir: Path, llm, version: str) -> None:
    llm_opts = f'model: test-model, base-url: "{llm.base_url}", timeout-s: 5, max-retries: 2, no-cache: true'
    path.write_text(f"""output: {root}
steps:
  - caption: {{input: {levir}, {llm_opts}}}
  - qa: {{{llm_opts}}}
  - publish: {{name: levir-lineage, version: {version}, date: "2026-01-01"}}
""")


def current(table_dir: Path, key=("pair_id",)) -> dict:
    """The current state of a job table (latest run per key) as {key: row}."""
    rows = sorted(pq.read_table(table_dir).to_pylist(), key=lambda r: r["run_id"])
    return {tuple(r[k] for k in key) if len(key) > 1 else r[key[0]]: r for r in rows}


@pytest.fixture(scope="module")
def history(tmp_path_factory, ray_session, openai_test_server_process):
    llm = openai_test_server_process
    llm.restore_defaults()
    llm.reset()
    base = tmp_path_factory.mktemp("chain-lineage")
    levir, root, config = base / "levir", base / "root", base / "chain.yaml"
    shutil.copytree(DATA / "levir-cd", levir)
    (levir / "licence.txt").write_text("LicenseRef-LEVIR-CD-academic\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OPENAI_API_KEY": "test-key",
           "RAY_ADDRESS": ray_session.address_info["gcs_address"]}

    def chain(*extra):
        return run_chain(config, base, env, *extra)

    def status():
        """``changeforge status --config chain.yaml`` in this process (it reads only), with the chain's
        environment and directory."""
        return changeforge_in_process("status", "--config", str(config), cwd=base,
                                      env={name: env[name] for name in ("OPENAI_API_KEY", "RAY_ADDRESS")})

    out = {"base": base, "levir": levir, "root": root, "env": env}
    chain_file(config, root, levir, llm, "1.0.0")
    out["run1"] = chain()
    assert out["run1"]["code"] == 0, tail(out["run1"])
    out["first_requests"] = llm.stats()["total"]
    out["captions1"] = current(root / "captions" / "pairs")
    out["qa1"] = current(root / "qa" / "pairs")

    # The people redraw two masks; a copy tool rewrites one image with the same bytes.
    emptied = levir / "label" / f"{EMPTIED}.png"
    out["old_mask"] = emptied.read_bytes()
    cv2.imwrite(str(emptied), np.zeros_like(cv2.imread(str(emptied), cv2.IMREAD_GRAYSCALE)))
    grown = cv2.imread(str(levir / "label" / f"{GROWN}.png"), cv2.IMREAD_GRAYSCALE)
    grown[:40, :40] = 255
    cv2.imwrite(str(levir / "label" / f"{GROWN}.png"), grown)
    touched = levir / "A" / f"{TOUCHED}.png"
    data = touched.read_bytes()
    touched.unlink()
    touched.write_bytes(data)
    # One pair's QA row, edited in a copy of the row, records another QA template.
    from operators.io import lineage
    from operators.io.tables import new_run_id, write_table_shard
    from operators.io.storage import Store
    from operators.language.qa_ops import TABLE_SCHEMAS
    row = dict(out["qa1"][TEMPLATE])
    row["lineage"] = lineage.dumps({**json.loads(row["lineage"]), "generate_template": "an earlier edit"})
    write_table_shard(Store(str(root / "qa")), "pairs", [{**row, "run_id": new_run_id()}], TABLE_SCHEMAS["pairs"],
                      row["run_id"])

    # Before the chain runs again: publish straight from the old captions and QA is refused.
    from jobs.publish import PublishConfig, run as publish
    with pytest.raises(SystemExit) as refused:
        publish(PublishConfig(input=str(levir), captions=str(root / "captions"), qa=str(root / "qa"),
                              output=str(base / "refused"), name="x", version="1.0.0", date="2026-01-01"))
    out["refused"] = str(refused.value)

    chain_file(config, root, levir, llm, "1.1.0")
    out["explain"] = chain("--explain")
    out["status"] = status()
    out["captions_after_explain"] = current(root / "captions" / "pairs")
    shutil.copytree(root / "captions", base / "captions-1")     # the captions as release 1.0.0 shipped them
    llm.reset()
    out["run2"] = chain()
    assert out["run2"]["code"] == 0, tail(out["run2"])
    stats = llm.stats()
    out["asked"] = sorted(set(stats["items_by_key"].values()))
    out["requests2"] = stats["total"]
    out["captions2"] = current(root / "captions" / "pairs")
    out["qa2"] = current(root / "qa" / "pairs")
    llm.reset()
    out["run3"] = chain()          # nothing changed since: every step current, nothing asked
    out["requests3"] = llm.stats()["total"]
    return out


def tail(run: dict) -> str:
    return run["out"][-3000:] + run["err"][-3000:]


def explained(run: dict, step: str) -> str:
    return next(line for line in run["out"].splitlines() if f"explain: step" in line and f" {step}:" in line)


def test_explain_lists_exactly_the_changed_pairs_with_their_causes(history):
    assert history["explain"]["code"] == 0, tail(history["explain"])
    caption, qa = explained(history["explain"], "caption"), explained(history["explain"], "qa")
    assert "would run" in caption
    assert "9 current, 2 stale (mask 2: test_102_0512_0000, test_121_0768_0256), 0 missing, 1 failed" in caption
    assert "8 current, 3 stale (mask 2, template 1: test_102_0512_0000, test_121_0768_0256, train_36_0512_0512)" in qa
    assert "would run" in explained(history["explain"], "publish")
    assert history["captions_after_explain"] == history["captions1"]     # --explain ran nothing
    # changeforge status says the same, line for line
    lines = lambda run: [ln for ln in run["out"].splitlines() if "explain: step" in ln]  # noqa: E731
    assert history["status"]["code"] == 0 and lines(history["status"]) == lines(history["explain"]), \
        tail(history["status"])
    # docs/lineage.md shows these lines: as printed
    shown = [ln for ln in (REPO / "docs" / "lineage.md").read_text().splitlines() if ln.startswith("[chain] explain:")]
    printed = history["explain"]["out"].splitlines()
    assert len(shown) == 3 and all(ln in printed for ln in shown), history["explain"]["out"]


def test_the_refusal_shown_in_the_docs_is_the_one_printed(history):
    page = (REPO / "docs" / "lineage.md").read_text()
    block = page.split("```\npublish: refused", 1)[1].split("```", 1)[0]
    for line in ("publish: refused" + block).strip().splitlines():
        assert line.strip() in history["refused"], history["refused"]


def test_the_rerun_asks_the_llm_for_exactly_the_changed_pairs(history):
    assert history["first_requests"] > 0
    assert history["asked"] == sorted([EMPTIED, GROWN, TEMPLATE])
    before, after = history["captions1"], history["captions2"]
    redone = sorted(k for k in after if after[k]["run_id"] != before[k]["run_id"])
    assert redone == sorted([EMPTIED, GROWN])
    qa_before, qa_after = history["qa1"], history["qa2"]
    assert sorted(k for k in qa_after if qa_after[k]["run_id"] != qa_before[k]["run_id"]) == \
        sorted([EMPTIED, GROWN, TEMPLATE])
    printed = history["run2"]["out"] + history["run2"]["err"]
    assert "2 redone because their input changed: mask 2" in printed                       # captions
    assert "3 redone because their input changed: caption 2, mask 2, template 1" in printed  # QA: new captions too
    # the emptied mask's new row describes no change
    assert after[EMPTIED]["car"] == 0 and before[EMPTIED]["car"] > 0


def test_a_plain_rerun_after_that_asks_nothing_and_exits_0(history):
    assert history["run3"]["code"] == 0, tail(history["run3"])
    assert history["requests3"] == 0


def test_the_new_release_ships_the_new_captions_and_differs_only_there(history):
    rel = history["root"] / "releases"
    changes = json.loads((rel / "1.1.0" / "changes.json").read_text())
    assert changes["added"] == [] and changes["removed"] == []
    assert set(changes["changed"]) >= {EMPTIED, GROWN} and set(changes["changed"]) <= {EMPTIED, GROWN, TEMPLATE}
    shipped = {i["filename"].rsplit(".", 1)[0]: [s["raw"].strip() for s in i["sentences"]]
               for split in ("train", "val", "test") if (rel / "1.1.0" / split / "captions.json").exists()
               for i in json.loads((rel / "1.1.0" / split / "captions.json").read_text())["images"]}
    for pid in (EMPTIED, GROWN):
        assert shipped.get(pid, []) == list(history["captions2"][pid]["selected_captions"])
        assert shipped.get(pid, []) != list(history["captions1"][pid]["selected_captions"])


def test_publish_refuses_captions_and_qa_of_an_old_mask(history):
    text = history["refused"]
    assert "captions made from another mask than the one released: 2 pair(s) (first: " \
           "test_102_0512_0000, test_121_0768_0256)" in text
    assert "QA pairs made from another mask than the one released: 2 pair(s)" in text
    assert "images" not in text.split("refused", 1)[1].replace("other inputs", "")   # the touched image is unchanged
    assert not (history["base"] / "refused" / "1.0.0" / "SHA256SUMS").exists()


def verify(history, release: Path, *extra) -> subprocess.CompletedProcess:
    """``changeforge publish --verify <release> [extra]`` in this process (test_chain_docs runs the command
    as written, in a process): its exit status and what it printed."""
    done = changeforge_in_process("publish", "--verify", str(release), *extra)
    return subprocess.CompletedProcess(["changeforge", "publish", "--verify", str(release), *extra],
                                       done["code"], done["out"], done["err"])


def test_verify_passes_a_release_made_from_its_sources_and_tells_an_old_one_its_sources_moved(history):
    rel = history["root"] / "releases"
    sources = ("--sources", str(history["levir"]))
    ok = verify(history, rel / "1.1.0", *sources)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "pairs' captions and QA were made from what they ship; sources checked for 11 pairs" in ok.stdout
    old = verify(history, rel / "1.0.0", *sources)
    assert old.returncode == 1
    assert "sources changed since the release (mask): 2 pair(s)" in old.stdout
    alone = verify(history, rel / "1.0.0")    # its dataset, named portably ("levir"), is not found from here
    assert alone.returncode == 0 and "sources not checked (dataset 'levir' not found here" in alone.stdout


def test_a_release_hand_edited_to_pair_an_old_caption_with_a_new_mask_is_refused(history, tmp_path):
    from jobs.publish import PublishConfig, run as publish
    from operators.publish.versions import sha256, sha256sums, parse_sha256sums
    edited = tmp_path / "edited"
    shutil.copytree(history["root"] / "releases" / "1.0.0", edited)
    split = json.loads((edited / "release.json").read_text())["pairs"][EMPTIED]["split"]
    label = edited / split / "label" / f"{EMPTIED}.png"
    label.write_bytes((history["levir"] / "label" / f"{EMPTIED}.png").read_bytes())   # the new, empty mask
    sums = parse_sha256sums((edited / "SHA256SUMS").read_text())
    sums[f"{split}/label/{EMPTIED}.png"] = sha256(label.read_bytes())                 # checksums made to agree
    (edited / "SHA256SUMS").write_text(sha256sums(sums))
    bad = verify(history, edited, "--no-sources")
    assert bad.returncode == 1
    assert f"captions made from another mask than the one released: 1 pair(s) (first: {EMPTIED})" in bad.stdout
    assert f"QA pairs made from another mask than the one released: 1 pair(s) (first: {EMPTIED})" in bad.stdout
    # The same folder given to publish as a dataset, with the captions release 1.0.0 shipped (made from the
    # old masks): refused for exactly that pair.
    (edited / "licence.txt").write_text("LicenseRef-LEVIR-CD-academic\n")
    with pytest.raises(SystemExit) as refused:
        publish(PublishConfig(input=str(edited), captions=str(history["base"] / "captions-1"),
                              output=str(tmp_path / "rel"), name="x", version="1.0.0", date="2026-01-01"))
    assert f"captions made from another mask than the one released: 1 pair(s) (first: {EMPTIED})" in \
        str(refused.value)


def test_reviews_of_the_redrawn_pairs_captions_are_stale_and_left_out_of_the_release_figures(history, tmp_path):
    """On this chain's outputs (no chain run more): a review drawn from the captions as release 1.0.0 shipped
    them, covering a redrawn pair and an untouched one. The review step's --explain counts the redrawn pair's
    reviewed captions stale by caption; the release's review figures leave their verdicts out."""
    import pandas as pd
    from jobs.chain import _data_status, _parser_for
    from jobs.review import REVIEW_SCHEMA
    from operators.io import lineage
    from operators.io.storage import Store
    from operators.io.tables import write_table_shard
    from operators.publish import recipes
    from operators.publish.sources import read_captions
    from operators.review.items import review_items
    from operators.review.outputs import read_current
    then = review_items("captions", read_current(Store(str(history["base"] / "captions-1")), "captions"), None)
    now = review_items("captions", read_current(Store(str(history["root"] / "captions")), "captions"), None)
    sample = then[then["pair_id"].isin([EMPTIED, TOUCHED]) & then["selected"]].reset_index(drop=True)
    now_text = dict(zip(now["item_id"], now["text"]))
    redone = sorted(i for i, t in zip(sample["item_id"], sample["text"]) if now_text.get(i) != t)
    same_text = sorted(i for i in sample["item_id"] if i.startswith(EMPTIED) and i not in redone)  # its mask changed
    assert redone and all(i.startswith(EMPTIED) for i in redone)
    rows = pd.DataFrame({"task_id": range(len(sample)), "annotation_id": range(len(sample)), "status": "reviewed",
                         "item_id": sample["item_id"], "kind": "captions", "pair_id": sample["pair_id"],
                         "facet": sample["facet"], "text": sample["text"], "selected": True, "judge_accept": True,
                         "verdict": "correct", "annotated_at": "2026-01-01", "source": str(history["root"] / "captions"),
                         "lineage": sample["lineage"]})
    review = tmp_path / "review"
    write_table_shard(Store(str(review)), "review", rows.to_dict("records"), REVIEW_SCHEMA, "20260101T000000-aaaaaa")
    (tmp_path / "export.json").write_text("[]")
    module, command, parser = _parser_for("review ingest")
    s = _data_status(module, command, parser, "review ingest",
                     {"export": str(tmp_path / "export.json"), "output": str(review)}, explain=True)
    stale = sorted(redone + same_text)
    causes = ", ".join([f"caption {len(redone)}"] + ([f"mask {len(same_text)}"] if same_text else []))
    assert lineage.status_line(s) == (f"{len(sample) - len(stale)} current, {len(stale)} stale "
                                      f"({causes}: {', '.join(stale[:5])}), 0 missing, 0 failed")
    assert s["needs_run"] is False                   # people's work: counted, never re-run by the chain
    summary = recipes.review_summary(str(review), read_captions(str(history["root"] / "captions")))
    assert summary["reviewed_on_other_text"] == redone
    assert summary["reviewed"] == len(sample) - len(redone) and summary["tasks"] == len(sample)
