"""An archive gains a scene: the pairs job registers only the new pairs (its slices' settings_key), and the
captions job, resuming by lineage, captions only the new pairs that have masks: the old ones are current
(their files are neither changed nor read again) and the LLM is asked about nothing else."""
from __future__ import annotations

import shutil

import pyarrow.parquet as pq
import pytest

from jobs import build_pairs
from jobs.caption import CaptionJobConfig, run as run_captions
from tests.conftest import DATA

pytestmark = pytest.mark.slow

DEMO = ["--slice-size", "512", "--stride", "128", "--crop-size", "256", "--tile-size", "512",
        "--search-margin-px", "64", "--reference-date", "2021-01-01", "--num-cpus", "2"]
LEVIR_LABELS = sorted((DATA / "levir-cd" / "label").glob("*.png"))


def slices(pairs) -> dict[str, str]:
    """slice id -> the run that registered it (the metadata table's current state)."""
    rows = sorted(pq.read_table(pairs / "metadata", columns=["slice_id", "run_id"]).to_pylist(),
                  key=lambda r: r["run_id"])
    return {r["slice_id"]: r["run_id"] for r in rows}


def test_a_scene_added_to_the_archive_registers_and_captions_only_the_new_pairs(tmp_path, ray_session,
                                                                                 openai_server):
    archive, pairs, caps = tmp_path / "archive", tmp_path / "pairs", tmp_path / "captions"
    archive.mkdir()
    for day in ("20160816", "20170827"):
        shutil.copy(DATA / "naip" / f"m_4709963_se_14_1_{day}.tif", archive)
    build_pairs.main(["--input", str(archive), "--output", str(pairs), *DEMO])
    first = slices(pairs)
    ids1 = sorted(p.stem for p in (pairs / "A").glob("*.png"))
    (pairs / "label").mkdir(exist_ok=True)
    for sid, label in zip(ids1[:3], LEVIR_LABELS):
        shutil.copy(label, pairs / "label" / f"{sid}.png")
    cfg = CaptionJobConfig(input=str(pairs), output=str(caps), model="test-model", base_url=openai_server.base_url,
                           timeout_s=5.0, max_retries=4, backoff_base_s=0.05, actors=1, concurrent_batches=2,
                           batch_size=4, cache=False)
    run_captions(cfg)
    assert set(openai_server.stats()["items_by_key"].values()) == set(ids1[:3])

    shutil.copy(DATA / "naip" / "m_4709963_se_14_1_20200831.tif", archive)     # the archive gains a scene
    summary = build_pairs.main(["--input", str(archive), "--output", str(pairs), *DEMO])
    second = slices(pairs)
    assert {k: second[k] for k in first} == first                    # old slices: not registered again
    assert summary["slices_skipped_as_finished"] == len(first) and summary["slices_this_run"] == len(second) - len(first)
    ids2 = sorted(p.stem for p in (pairs / "A").glob("*.png"))
    new = sorted(set(ids2) - set(ids1))
    assert new and set(ids1) <= set(ids2)
    for sid, label in zip(new[:2], LEVIR_LABELS[3:]):
        shutil.copy(label, pairs / "label" / f"{sid}.png")

    openai_server.reset()
    s = run_captions(cfg)
    assert set(openai_server.stats()["items_by_key"].values()) == set(new[:2])
    assert s["lineage"]["current"] == 3 and s["lineage"]["stale"] == 0 and s["lineage"]["missing"] == 2
