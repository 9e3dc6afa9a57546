"""jobs.publish on a real chain output: NAIP pairs from the pairs job (demo geometry), masks for a few
slices (LEVIR-CD masks, and drawn S2Looking label1/label2 maps ingested through the pairs job's
--label-maps), captions and QA from the language jobs against the OpenAI test server; then two versions
of a release, read back the ways users read them."""
from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import pyarrow.parquet as pq
import pytest

from jobs import build_pairs
from jobs.caption import CaptionJobConfig, run as run_captions
from jobs.publish import PublishConfig, run as publish
from jobs.qa import QAJobConfig, run as run_qa
from tests.conftest import DATA, own_llm_namespace

pytestmark = pytest.mark.slow

DEMO = ["--slice-size", "512", "--stride", "128", "--crop-size", "256", "--tile-size", "512",
        "--search-margin-px", "64", "--reference-date", "2021-01-01", "--num-cpus", "2"]
LEVIR_LABELS = sorted((DATA / "levir-cd" / "label").glob("*.png"))


def grey(path) -> np.ndarray:
    img = cv2.imread(str(path), cv2.IMREAD_UNCHANGED)
    assert img is not None, path
    return img if img.ndim == 2 else img.max(axis=2)


def draw_maps(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Two annotator maps (new buildings, demolished) drawn as filled shapes, 0/255, with one overlap."""
    rng = np.random.default_rng(seed)
    new, gone = np.zeros((256, 256), np.uint8), np.zeros((256, 256), np.uint8)
    for _ in range(3):
        x, y = rng.integers(10, 200, 2)
        cv2.rectangle(new, (int(x), int(y)), (int(x) + 30, int(y) + 20), 255, -1)
        cx, cy = rng.integers(30, 220, 2)
        cv2.circle(gone, (int(cx), int(cy)), 12, 255, -1)
    cv2.rectangle(gone, (0, 0), (15, 15), 255, -1)
    cv2.rectangle(new, (10, 10), (25, 25), 255, -1)   # 6x6 px marked in both maps
    return new, gone


@pytest.fixture(scope="module")
def chain(tmp_path_factory, ray_session, openai_test_server_process):
    server = openai_test_server_process
    server.restore_defaults()
    base = tmp_path_factory.mktemp("publish-chain")
    archive = base / "archive"
    archive.mkdir()
    for tif in sorted((DATA / "naip").glob("*.tif")):
        if tif.stem.endswith(("20160816", "20170827")):   # one pair of dates keeps the run small
            shutil.copy(tif, archive / tif.name)
    pairs = base / "pairs"
    build_pairs.main(["--input", str(archive), "--output", str(pairs), *DEMO])
    ids = sorted(p.stem for p in (pairs / "A").glob("*.png"))
    assert len(ids) >= 8

    # Masks: LEVIR-CD masks (256 px, 0/255) for three slices; two annotators' maps for two more,
    # ingested by a rerun of the pairs job (--label-maps merges them into label/), the maps kept beside.
    (pairs / "label").mkdir(exist_ok=True)
    for sid, label in zip(ids[:3], LEVIR_LABELS):
        shutil.copy(label, pairs / "label" / f"{sid}.png")
    ann = base / "annotations"
    for k, sid in enumerate(ids[3:5]):
        new, gone = draw_maps(k)
        for folder, m in (("label1", new), ("label2", gone)):
            (ann / folder).mkdir(parents=True, exist_ok=True)
            cv2.imwrite(str(ann / folder / f"{sid}.png"), m)
    build_pairs.main(["--input", str(archive), "--output", str(pairs), "--label-maps", str(ann), *DEMO])
    for folder in ("label1", "label2"):
        shutil.copytree(ann / folder, pairs / folder)
    labelled = ids[:5]
    assert sorted(p.stem for p in (pairs / "label").glob("*.png")) == labelled

    common = dict(model="test-model", base_url=server.base_url, timeout_s=5.0, max_retries=4, max_reasks=3,
                  backoff_base_s=0.05, actors=1, concurrent_batches=2, batch_size=4, progress_every_s=5.0)
    caps = base / "captions"
    qa = base / "qa"
    with own_llm_namespace("publish-chain"):   # limiters of its own, not the account's default
        run_captions(CaptionJobConfig(input=str(pairs), output=str(caps), **common))
        run_qa(QAJobConfig(input=str(caps), output=str(qa), **common))

    rel = base / "releases"
    first = publish(PublishConfig(input=str(pairs), captions=str(caps), qa=str(qa), output=str(rel),
                                  name="naip-demo", version="1.0.0", licence="CC0-1.0", shard_mb=0.5,
                                  rows_per_group=2, date="2026-01-01"))
    # A later version: two more slices annotated.
    added = ids[5:7]
    for sid, label in zip(added, LEVIR_LABELS[3:]):
        shutil.copy(label, pairs / "label" / f"{sid}.png")
    second = publish(PublishConfig(input=str(pairs), captions=str(caps), qa=str(qa), output=str(rel),
                                   name="naip-demo", version="1.1.0", licence="CC0-1.0", shard_mb=0.5,
                                   rows_per_group=2, date="2026-02-01"))
    return {"pairs": pairs, "caps": caps, "qa": qa, "rel": rel, "v1": rel / "1.0.0", "v2": rel / "1.1.0",
            "labelled": labelled, "added": added, "two_maps": ids[3:5], "first": first, "second": second,
            "base": base}


def selected_captions(caps: Path) -> dict[str, list[str]]:
    t = pq.read_table(caps / "pairs").to_pylist()
    return {r["pair_id"]: r["selected_captions"] for r in t}


def test_datasets_loads_every_split_with_decoded_images(chain, tmp_path):
    import datasets  # the test extra: a missing package fails, never skips
    v1 = chain["v1"]
    assert len(list((v1 / "data").glob("train-*.parquet"))) >= 2          # shards cut by size
    ds = datasets.load_dataset(str(v1), cache_dir=str(tmp_path / "hf"))
    assert set(ds) == {"train"}                                            # one location: one split
    train = ds["train"]
    assert train.num_rows == len(chain["labelled"]) == chain["first"]["pairs"]["train"]
    assert sorted(train["id"]) == chain["labelled"]
    caps = selected_captions(chain["caps"])
    vqa = {Path(i["filename"]).stem: i["qa"] for i in json.loads((chain["qa"] / "VQA.json").read_text())["images"]}
    for row in train:
        assert row["pre"].size == row["post"].size == row["mask"].size == (256, 256)
        assert row["mask"].mode == "L"
        assert (row["captions"] or []) == (caps.get(row["id"]) or [])
        assert (row["qa"] or []) == vqa.get(row["id"], [])
        assert (row["mask_index"] is not None) == (row["id"] in chain["two_maps"])
    # The plain Parquet route reads the same rows.
    files = sorted(str(p) for p in (v1 / "data").glob("train-*.parquet"))
    plain = datasets.load_dataset("parquet", data_files={"train": files}, cache_dir=str(tmp_path / "hf2"))
    assert plain["train"].num_rows == train.num_rows


def test_croissant_validates_and_iterates_pairs(chain):
    import mlcroissant as mlc
    v1 = chain["v1"]
    cli = Path(sys.executable).with_name("mlcroissant")
    cmd = [str(cli)] if cli.exists() else [sys.executable, "-m", "mlcroissant"]
    proc = subprocess.run([*cmd, "validate", "--jsonld", str(v1 / "croissant.json")], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "error" not in (proc.stdout + proc.stderr).lower()
    doc = json.loads((v1 / "croissant.json").read_text())
    assert doc["rai:dataAnnotationProtocol"] and "test-model" in doc["rai:dataAnnotationProtocol"]
    records = list(mlc.Dataset(str(v1 / "croissant.json")).records("pairs"))
    ids = sorted(r["pairs/id"].decode() for r in records)
    assert ids == chain["labelled"]
    for r in records:
        sid = r["pairs/id"].decode()
        mask = np.asarray(r["pairs/mask"])
        assert np.array_equal(mask, grey(v1 / "train" / "label" / f"{sid}.png"))
        assert np.asarray(r["pairs/pre"]).shape == (256, 256, 3)
    # Captions and QA record sets: per pair, the selected ones.
    caps = selected_captions(chain["caps"])
    got = {r["captions/id"].decode(): [c.decode() for c in r["captions/captions"]]
           for r in mlc.Dataset(str(v1 / "croissant.json")).records("captions")}
    assert got == {k: list(caps.get(k) or []) for k in chain["labelled"]}
    vqa = {Path(i["filename"]).stem: i["qa"] for i in json.loads((chain["qa"] / "VQA.json").read_text())["images"]}
    got = {r["qa/id"].decode(): [{k: q[f"qa/qa/{k}"].decode() for k in ("type", "question", "answer")}
                                 for q in r["qa/qa"]]
           for r in mlc.Dataset(str(v1 / "croissant.json")).records("qa")}
    assert got == {k: vqa.get(k, []) for k in chain["labelled"]}


def test_croissant_pairs_without_qa_iterate_as_empty_lists(chain, tmp_path):
    """A QA source that kept nothing for some labelled pairs: those pairs read back with no QA (a null list
    would come back from mlcroissant as one record of null fields)."""
    import mlcroissant as mlc
    doc = json.loads((chain["qa"] / "VQA.json").read_text())
    dropped = set(chain["labelled"][:2])
    doc["images"] = [i for i in doc["images"] if Path(i["filename"]).stem not in dropped]
    (tmp_path / "vqa").mkdir()
    (tmp_path / "vqa" / "VQA.json").write_text(json.dumps(doc))
    publish(PublishConfig(input=str(chain["pairs"]), captions=str(chain["caps"]), qa=str(tmp_path / "vqa"),
                          output=str(tmp_path / "rel"), name="naip-demo", version="1.0.0", licence="CC0-1.0",
                          date="2026-01-01"))
    v = tmp_path / "rel" / "1.0.0"
    got = {r["qa/id"].decode(): r["qa/qa"] for r in mlc.Dataset(str(v / "croissant.json")).records("qa")}
    assert set(got) == set(chain["labelled"]) | set(chain["added"])     # the pairs folder as it is now
    for sid in dropped:
        assert got[sid] == [], (sid, got[sid])
    kept = {Path(i["filename"]).stem: i["qa"] for i in doc["images"]}
    for sid in set(got) - dropped:
        assert [{k: q[f"qa/qa/{k}"].decode() for k in ("type", "question", "answer")} for q in got[sid]] \
            == kept.get(sid, [])
    rows = [r for f in sorted((v / "data").glob("*.parquet")) for r in pq.read_table(f, columns=["id", "qa"]).to_pylist()]
    assert all(r["qa"] == [] for r in rows if r["id"] in dropped)


class BitemporalFolder:
    """A LEVIR-CD loader as open-cd and torchgeo write it: <root>/<split>/{A,B,label}/<name>.png,
    masks read as single channel and turned to class ids by ``mask // 255`` (0 = no change, 1 = change)."""

    def __init__(self, root: Path, split: str):
        self.files = sorted((root / split / "A").glob("*.png"))
        self.root, self.split = root, split

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        name = self.files[i].name
        a = cv2.cvtColor(cv2.imread(str(self.root / self.split / "A" / name)), cv2.COLOR_BGR2RGB)
        b = cv2.cvtColor(cv2.imread(str(self.root / self.split / "B" / name)), cv2.COLOR_BGR2RGB)
        mask = cv2.imread(str(self.root / self.split / "label" / name), cv2.IMREAD_GRAYSCALE)
        return {"image1": a, "image2": b, "mask": (mask // 255).astype(np.int64), "name": name}


def test_folder_layout_loads_with_a_plain_loader_and_masks_match_the_run(chain):
    v1, pairs = chain["v1"], chain["pairs"]
    data = BitemporalFolder(v1, "train")
    assert len(data) == len(chain["labelled"])
    for k in range(len(data)):
        s = data[k]
        sid = s["name"][:-4]
        assert s["image1"].shape == s["image2"].shape == (256, 256, 3)
        assert set(np.unique(s["mask"])) <= {0, 1}
        run_mask = grey(pairs / "label" / s["name"]) > 0
        assert np.array_equal(s["mask"] == 1, run_mask)
        assert np.array_equal(s["image1"], cv2.cvtColor(cv2.imread(str(pairs / "A" / s["name"])), cv2.COLOR_BGR2RGB))
    # S2Looking maps: label1/label2 as given, the index mask 1 = new, 2 = demolished, union = label/.
    for sid in chain["two_maps"]:
        new = grey(pairs / "label1" / f"{sid}.png") > 0
        gone = grey(pairs / "label2" / f"{sid}.png") > 0
        assert np.array_equal(grey(v1 / "train" / "label1" / f"{sid}.png") > 0, new)
        assert np.array_equal(grey(v1 / "train" / "label2" / f"{sid}.png") > 0, gone)
        index = grey(v1 / "train" / "label_index" / f"{sid}.png")
        assert set(np.unique(index)) <= {0, 1, 2}
        assert np.array_equal(index == 1, new) and np.array_equal(index == 2, gone & ~new)
        assert np.array_equal(index > 0, grey(pairs / "label" / f"{sid}.png") > 0)
    # Parquet masks decode to the same pixels.
    for shard in sorted((v1 / "data").glob("*.parquet")):
        for row in pq.read_table(shard, columns=["id", "mask", "mask_index"]).to_pylist():
            mask = cv2.imdecode(np.frombuffer(row["mask"]["bytes"], np.uint8), cv2.IMREAD_UNCHANGED)
            assert np.array_equal(mask > 0, grey(pairs / "label" / f"{row['id']}.png") > 0)
            assert set(np.unique(mask)) <= {0, 255}
            if row["mask_index"]:
                index = cv2.imdecode(np.frombuffer(row["mask_index"]["bytes"], np.uint8), cv2.IMREAD_UNCHANGED)
                assert np.array_equal(index, grey(v1 / "train" / "label_index" / f"{row['id']}.png"))
    # Per-split language files.
    cc = json.loads((v1 / "train" / "captions.json").read_text())
    caps = selected_captions(chain["caps"])
    assert {i["filename"][:-4]: [s["raw"].strip() for s in i["sentences"]] for i in cc["images"]} == \
        {k: v for k, v in caps.items() if v}


def test_every_checksum_verifies(chain):
    for release in (chain["v1"], chain["v2"]):
        listed = {}
        for line in (release / "SHA256SUMS").read_text().splitlines():
            digest, rel = line.split("  ", 1)
            listed[rel] = digest
            assert hashlib.sha256((release / rel).read_bytes()).hexdigest() == digest, rel
        on_disk = {str(p.relative_to(release)) for p in release.rglob("*") if p.is_file()}
        assert set(listed) == on_disk - {"SHA256SUMS"}
        assert shutil.which("sha256sum"), "sha256sum (GNU coreutils) is not on PATH"
        proc = subprocess.run(["sha256sum", "--quiet", "-c", "SHA256SUMS"], cwd=release, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_second_version_changelog_names_exactly_the_added_pairs(chain):
    v2 = chain["v2"]
    changes = json.loads((v2 / "changes.json").read_text())
    assert changes == {"version": "1.1.0", "previous": "1.0.0", "added": chain["added"], "removed": [], "changed": []}
    log = (v2 / "CHANGELOG.md").read_text()
    assert log.index("## 1.1.0") < log.index("## 1.0.0")
    assert all(f"`{sid}`" in log for sid in chain["added"])
    assert "2 pairs added, 0 removed, 0 changed" in log
    versions = json.loads((chain["rel"] / "versions.json").read_text())
    assert [v["version"] for v in versions] == ["1.0.0", "1.1.0"]
    release = json.loads((v2 / "release.json").read_text())
    assert release["previous_version"] == "1.0.0" and release["licence"] == "CC0-1.0"
    assert [r["run_id"] for r in release["inputs"]["dataset"]["runs"]] == \
        sorted({r["run_id"] for r in pq.read_table(chain["pairs"] / "runs").to_pylist()})
    assert release["code_version"]["commit"]


def test_stac_items_carry_labels_splits_and_sources(chain):
    import pystac
    v1 = chain["v1"]
    cat = pystac.Catalog.from_file(str(v1 / "stac" / "catalog.json"))
    items = list(cat.get_items())
    assert sorted(i.id for i in items) == chain["labelled"]
    meta = {r["slice_id"]: r for r in pq.read_table(chain["pairs"] / "metadata").to_pylist()}
    for item in items:
        assert item.properties["ml-aoi:split"] == "train"
        assert item.properties["label:type"] == "raster"
        assert any("label" in e for e in item.stac_extensions)
        for key, asset in item.assets.items():
            assert (Path(item.get_self_href()).parent / asset.href).resolve().is_file(), (key, asset.href)
        # URIs are links; files of the pairs run's input are named relative to it in changeforge:sources
        # (a relative link would resolve inside the release)
        sources = sorted(link.href for link in item.links if link.rel == "derived_from") or sorted(
            s for side in item.properties.get("changeforge:sources", {}).values() for s in side)
        m = meta[item.id]
        assert sources and all(Path(s).name.split("_")[-1][:8] in (m["pre_date"].replace("-", ""),
                                                                 m["post_date"].replace("-", "")) for s in sources)
        w, s, e, n = item.bbox
        assert -99.5 < w < e < -99.0 and 47.0 < s < n < 47.5       # NAIP quarter-quad m_4709963


def test_card_reports_the_release(chain):
    import yaml
    text = (chain["v1"] / "README.md").read_text()
    front = yaml.safe_load(text.split("---\n")[1])
    assert front["license"] == "cc0-1.0"
    assert front["configs"] == [{"config_name": "default",
                                 "data_files": [{"split": "train", "path": "data/train-*.parquet"}]}]
    n_sel = sum(len(v or []) for k, v in selected_captions(chain["caps"]).items() if k in chain["labelled"])
    assert f"| Selected captions | {n_sel:,} | {n_sel:,} |" in text
    assert "deviations: slice_size 512 (paper 3000)" in text
    assert "## Known limitations" in text and "## Citation" in text


def _text_files(release: Path) -> dict[str, str]:
    out = {}
    for p in release.rglob("*"):
        if p.is_file() and p.suffix not in (".png", ".parquet"):
            out[str(p.relative_to(release))] = p.read_text(encoding="utf-8")
    return out


def test_a_release_carries_nothing_of_the_machine_it_was_made_on(chain):
    """Sources relative to the pairs run's input (or URIs), no absolute path of the builder, no "nan";
    the card says what each input was: the pairs job's runs, the captions and QA jobs' models and
    prompt versions."""
    base = str(chain["base"])                  # the temporary folder every input and output is in
    texts = _text_files(chain["v1"])
    assert texts, "no text files in the release"
    leaks = {rel: text.count(base) for rel, text in texts.items() if base in text}
    assert not leaks, leaks
    nans = {rel for rel, text in texts.items() if re.search(r"\bnan\b|\bNaN\b", text)}
    assert not nans, nans
    rows = [r for shard in sorted(chain["v1"].rglob("*.parquet"))
            for r in pq.read_table(shard, columns=["id", "sensor", "pre_source", "post_source"]).to_pylist()]
    sources = [s for r in rows for s in (r.get("pre_source") or []) + (r.get("post_source") or [])]
    assert sources and all(s.startswith("archive/") and s.endswith(".tif") for s in sources), sources[:4]
    assert all(r.get("sensor") in (None, "") or r["sensor"] != "nan" for r in rows)
    card = texts["README.md"]
    assert "not recorded" not in card, card
    assert "test-model" in card and "caption_generate.v4" in card and "qa_generate.v4" in card, card
