"""jobs.publish on LEVIR-CD layouts (the real crops in data/levir-cd): split folders read back by
datasets and mlcroissant, the licence rule, and a release read from and written to S3 (moto)."""
from __future__ import annotations

import hashlib
import json
import shutil

import cv2
import numpy as np
import pytest

from jobs.publish import PublishConfig, main, run
from tests.conftest import DATA

LEVIR = DATA / "levir-cd"
NAMES = sorted(p.stem for p in (LEVIR / "A").glob("*.png"))
SPLIT_OF = {n: ("val" if n == "test_2_0000_0000" else n.split("_")[0]) for n in NAMES}


def publishable() -> dict[str, str]:
    """Independently: pairs with a mask whose A, B and mask sizes agree, by split."""
    out = {}
    for n in NAMES:
        label = LEVIR / "label" / f"{n}.png"
        if not label.exists():
            continue
        shapes = {cv2.imread(str(LEVIR / r / f"{n}.png"), cv2.IMREAD_UNCHANGED).shape[:2] for r in ("A", "B")}
        shapes.add(cv2.imread(str(label), cv2.IMREAD_UNCHANGED).shape[:2])
        if len(shapes) == 1:
            out[n] = SPLIT_OF[n]
    return out


def split_layout(root, names=NAMES):
    for n in names:
        for role in ("A", "B", "label"):
            src = LEVIR / role / f"{n}.png"
            if src.exists():
                (root / SPLIT_OF[n] / role).mkdir(parents=True, exist_ok=True)
                shutil.copy(src, root / SPLIT_OF[n] / role / src.name)
    return root


@pytest.fixture(scope="module")
def levir_release(tmp_path_factory):
    base = tmp_path_factory.mktemp("levir-release")
    inp = split_layout(base / "levir")
    (inp / "licence.txt").write_text("LicenseRef-LEVIR-CD-academic\n")
    summary = main(["--input", str(inp), "--output", str(base / "rel"), "--name", "levir-mini", "--version", "0.1.0",
                    "--date", "2026-01-01"])
    return base / "rel" / "0.1.0", summary


def test_split_folders_load_in_every_split_with_the_licence_carried(levir_release, tmp_path):
    import datasets  # the test extra: a missing package fails, never skips
    release, summary = levir_release
    expected = publishable()
    assert summary["licence"] == "LicenseRef-LEVIR-CD-academic"
    ds = datasets.load_dataset(str(release), cache_dir=str(tmp_path / "hf"))
    assert {s: ds[s].num_rows for s in ds} == {s: list(expected.values()).count(s) for s in ("train", "val", "test")}
    for split in ds:
        for row in ds[split]:
            assert expected[row["id"]] == split
            mask = np.asarray(row["mask"])
            assert np.array_equal(mask > 0, cv2.imread(str(LEVIR / "label" / f"{row['id']}.png"),
                                                       cv2.IMREAD_UNCHANGED).reshape(mask.shape[0], mask.shape[1], -1).max(axis=2) > 0)
            assert set(np.unique(mask)) <= {0, 255}
    excluded = {e["item"]: e["message"] for e in json.loads((release / "excluded.json").read_text())}
    assert set(excluded) == set(NAMES) - set(expected)
    assert excluded["test_113_0256"] == "A is 768x384 but B is 768x383"   # the real crop's defect
    card = (release / "README.md").read_text()
    assert 'license: "other"' in card and 'license_name: "LicenseRef-LEVIR-CD-academic"' in card


def test_croissant_of_a_levir_release_iterates(levir_release):
    import mlcroissant as mlc
    release, _ = levir_release
    ds = mlc.Dataset(str(release / "croissant.json"))
    ids = sorted(r["pairs/id"].decode() for r in ds.records("pairs"))
    assert ids == sorted(publishable())


def test_unknown_licence_is_refused_and_nothing_is_written(tmp_path):
    # A copy outside the repository's data/ (whose bundled terms are known) and without a licence.txt.
    import shutil
    levir = tmp_path / "levir"
    shutil.copytree(LEVIR, levir)
    with pytest.raises(SystemExit, match="licence of --input is unknown"):
        run(PublishConfig(input=str(levir), output=str(tmp_path / "rel"), name="x", version="1.0.0"))
    assert not (tmp_path / "rel").exists()
    with pytest.raises(SystemExit, match="not a semantic version"):
        run(PublishConfig(input=str(levir), output=str(tmp_path / "rel"), name="x", version="1.0", licence="MIT"))


def test_release_from_and_to_s3(s3_client, s3_bucket):
    for path in LEVIR.rglob("*.png"):
        s3_client.upload_file(str(path), s3_bucket, f"levir/{path.relative_to(LEVIR)}")
    summary = run(PublishConfig(input=f"s3://{s3_bucket}/levir", output=f"s3://{s3_bucket}/releases", name="levir-s3",
                                version="1.0.0", licence="CC-BY-4.0", date="2026-01-01", threads=4))
    assert summary["output"] == f"s3://{s3_bucket}/releases/1.0.0"
    prefix = "releases/1.0.0/"
    keys = set()
    for page in s3_client.get_paginator("list_objects_v2").paginate(Bucket=s3_bucket, Prefix=prefix):
        keys |= {o["Key"][len(prefix):] for o in page.get("Contents", [])}
    sums = s3_client.get_object(Bucket=s3_bucket, Key=prefix + "SHA256SUMS")["Body"].read().decode()
    listed = dict(line.split("  ", 1)[::-1] for line in sums.splitlines())
    assert set(listed) == keys - {"SHA256SUMS"}
    for rel, digest in listed.items():
        body = s3_client.get_object(Bucket=s3_bucket, Key=prefix + rel)["Body"].read()
        assert hashlib.sha256(body).hexdigest() == digest, rel
    # The flat layout's split comes from the name prefix (train_ / test_).
    assert sorted(k for k in keys if "/A/" in k) == sorted(f"{n.split('_')[0]}/A/{n}.png" for n in publishable())
    versions = json.loads(s3_client.get_object(Bucket=s3_bucket, Key="releases/versions.json")["Body"].read())
    assert [v["version"] for v in versions] == ["1.0.0"]


def test_rerun_of_a_version_is_idempotent_and_drops_what_left(tmp_path):
    inp = split_layout(tmp_path / "levir")
    cfg = PublishConfig(input=str(inp), output=str(tmp_path / "rel"), name="x", version="1.0.0", licence="MIT",
                        date="2026-01-01")
    run(cfg)
    release = tmp_path / "rel" / "1.0.0"
    before = {p.relative_to(release): p.read_bytes() for p in release.rglob("*") if p.is_file()}
    again = run(cfg)
    after = {p.relative_to(release): p.read_bytes() for p in release.rglob("*") if p.is_file()}
    assert after == before and again["stale_removed"] == 0          # byte for byte (same date, same code)
    gone = "train_36_0512_0512"
    for role in ("A", "B", "label"):
        (inp / "train" / role / f"{gone}.png").unlink()
    third = run(cfg)
    files = {str(p.relative_to(release)) for p in release.rglob("*") if p.is_file()}
    assert not any(gone in f for f in files) and third["stale_removed"] >= 4   # A, B, label, STAC item
    listed = {line.split("  ", 1)[1] for line in (release / "SHA256SUMS").read_text().splitlines()}
    assert listed == files - {"SHA256SUMS"}


def test_a_pair_marked_unusable_in_a_split_folder_dataset_is_left_out_of_the_release(tmp_path):
    """annotate ingest names a split folder's pair ``<split>/<stem>``: the summary's exclusion must find
    it (the pair has a mask from the input, so only the summary keeps it out)."""
    from operators.annotation.decisions import DecisionConfig
    from operators.annotation.scheme import parse_classes
    from operators.annotation.summary import SUMMARY_FILE, build_summary
    from operators.io.layout import discover_pairs
    kept = ["train_386_0512_0768", "val_27_0000_0256", "test_102_0512_0000"]
    cloudy = "train_36_0512_0512"
    inp = split_layout(tmp_path / "levir", [cloudy, *kept])
    (inp / "licence.txt").write_text("CC0-1.0\n")
    found = discover_pairs(str(inp))
    cloudy_id = next(p["pair_id"] for p in found if p["pair_id"].endswith(cloudy))
    assert cloudy_id == f"train/{cloudy}"                      # the id as annotation writes it
    summary = build_summary(pairs=found, states={cloudy_id: {"status": "unusable", "reason": "cloud"}},
                            history=[], exported=set(), classes=parse_classes("change:post"),
                            cfg=DecisionConfig(), generated_at="2026-02-01T10:00:00Z")
    (inp / SUMMARY_FILE).write_text(json.dumps(summary))
    s = main(["--input", str(inp), "--output", str(tmp_path / "rel"), "--name", "t", "--version", "1.0.0",
              "--date", "2026-01-01"])
    release = tmp_path / "rel" / "1.0.0"
    assert s["pairs"] == {"train": 1, "val": 1, "test": 1} and s["excluded"] == 1
    published = {k: v["split"] for k, v in json.loads((release / "release.json").read_text())["pairs"].items()}
    assert published == {n: n.split("_")[0] for n in kept}
    assert not list(release.rglob(f"*{cloudy}*"))              # no image, mask or STAC item of it
    excluded = json.loads((release / "excluded.json").read_text())
    assert [(e["item"], e["status"], e["reason"]) for e in excluded] == [(cloudy, "unusable", "cloud")]
