"""A release carries nothing of the machine it was made on (no absolute path of the builder, no "nan"),
and it does not relabel an input's licence without a recorded reason."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from jobs.publish import main as publish_main
from operators.publish.sources import bundled_terms, portable, portable_source, resolve_licence

REPO = Path(__file__).resolve().parents[2]
LEVIR = REPO / "data" / "levir-cd"


def _text_files(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text(encoding="utf-8") for p in root.rglob("*")
            if p.is_file() and p.suffix not in (".png", ".parquet")}


def test_a_release_of_a_local_folder_names_no_path_of_this_machine_and_no_nan(tmp_path, monkeypatch):
    inp = tmp_path / "work" / "levir-copy"
    shutil.copytree(LEVIR, inp)
    (inp / "licence.txt").write_text("CC-BY-4.0\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)     # absolute paths in, from another working folder
    publish_main(["--input", str(inp), "--output", str(tmp_path / "rel"), "--name", "levir-mini",
                  "--version", "1.0.0", "--date", "2026-01-01"])
    texts = _text_files(tmp_path / "rel" / "1.0.0")
    assert {"release.json", "README.md", "croissant.json", "stats.json"} <= set(texts)
    leaks = {rel for rel, text in texts.items() if str(tmp_path) in text}
    assert not leaks, {rel: texts[rel][texts[rel].index(str(tmp_path)) - 80:][:200] for rel in leaks}
    assert not {rel for rel, text in texts.items() if re.search(r"\bnan\b|\bNaN\b", text)}
    release = json.loads(texts["release.json"])
    assert release["inputs"]["dataset"]["uri"] == "levir-copy"
    assert release["options"]["input"] == "levir-copy"
    assert "`levir-copy`" in texts["README.md"]


def test_scene_sources_are_relative_to_the_run_s_input_or_uris_as_given():
    assert portable_source("/srv/a/data/naip/m_1.tif", ["/srv/a/data/naip"]) == "naip/m_1.tif"
    assert portable_source("/srv/a/data/naip/sub/m_1.tif", ["data/naip"]) == "data/naip/sub/m_1.tif"
    assert portable_source("s3://bucket/naip/m_1.tif", ["s3://bucket/naip"]) == "s3://bucket/naip/m_1.tif"
    assert portable_source("https://x.test/items/S2A/B04.tif", []) == "https://x.test/items/S2A/B04.tif"
    assert portable_source("/srv/a/scenes/m_1.tif", ["/srv/a/scenes/list.csv"]) == "scenes/m_1.tif"
    assert portable_source("/srv/elsewhere/m_1.tif", ["/srv/a/data/naip"]) == "m_1.tif"   # never absolute
    doc = portable({"input": "/srv/a/out/pairs", "note": "read /srv/a/out/pairs/metadata", "car": float("nan"),
                    "keep": "s3://b/out/pairs"}, ["/srv/a/out/pairs"])
    assert doc == {"input": "pairs", "note": "read pairs/metadata", "car": None, "keep": "s3://b/out/pairs"}


def test_relabelling_a_declared_licence_needs_a_recorded_reason():
    with pytest.raises(SystemExit, match="refusing to relabel: the inputs declare --input: CC0-1.0"):
        resolve_licence({"--input": "CC0-1.0"}, "CC-BY-4.0")
    lic, note = resolve_licence({"--input": "CC0-1.0"}, "CC-BY-4.0", "the owner relicensed it (mail of 2026-01-02)")
    assert lic == "CC-BY-4.0" and "overridden: the owner relicensed it (mail of 2026-01-02)" in note
    assert resolve_licence({"--input": "CC0-1.0"}, "CC0-1.0") == ("CC0-1.0", "--licence")   # the same: no relabel
    assert bundled_terms(str(LEVIR))[0] == "LicenseRef-LEVIR-CD-academic"
    assert bundled_terms(str(LEVIR / "A")) is not None and bundled_terms("s3://b/levir-cd") is None


def test_the_bundled_levir_samples_are_not_relabelled_without_an_override(tmp_path, capsys):
    argv = ["--input", str(LEVIR), "--output", str(tmp_path / "rel"), "--name", "levir", "--version", "1.0.0",
            "--date", "2026-01-01", "--licence", "CC-BY-4.0"]
    with pytest.raises(SystemExit, match="refusing to relabel.*LicenseRef-LEVIR-CD-academic"):
        publish_main(argv)
    assert not (tmp_path / "rel").exists()
    why = "a licence granted by the LEVIR-CD authors for this release"
    publish_main(argv + ["--licence-override", why])
    release = json.loads((tmp_path / "rel" / "1.0.0" / "release.json").read_text())
    assert release["licence"] == "CC-BY-4.0" and why in release["licence_source"]
    assert why in (tmp_path / "rel" / "1.0.0" / "README.md").read_text()


def test_unknown_metadata_is_null_in_stac_never_nan():
    from operators.publish import stac
    row = {"id": "p1", "split": "train", "sensor": "nan", "car": None, "pre_source": ["naip/a.tif"],
           "post_source": ["s3://b/naip/b.tif"]}
    item = stac.pair_item(row, {"A": "train/A/p1.png"}, ["manual"], [])
    assert "platform" not in item["properties"]
    assert item["properties"]["changeforge:sources"] == {"pre": ["naip/a.tif"]}
    assert [link["href"] for link in item["links"] if link["rel"] == "derived_from"] == ["s3://b/naip/b.tif"]


def test_the_card_says_what_each_language_input_was(tmp_path):
    inp = tmp_path / "levir"
    shutil.copytree(LEVIR, inp)
    (inp / "licence.txt").write_text("CC-BY-4.0\n")
    caps = tmp_path / "LevirCCcaptions.json"
    shutil.copy(REPO / "data" / "levir-cc" / "LevirCCcaptions.json", caps)
    base = ["--input", str(inp), "--name", "levir", "--version", "1.0.0", "--date", "2026-01-01"]
    publish_main(base + ["--output", str(tmp_path / "rel"), "--captions", str(caps)])
    card = (tmp_path / "rel" / "1.0.0" / "README.md").read_text()
    assert "Captions: read from `LevirCCcaptions.json`, a LEVIR-CC JSON file (the format names no model or prompt)" \
        in card, card
    failed = tmp_path / "captions-run"          # a captions job whose every pair failed: errors/ and source.json
    failed.mkdir()
    (failed / "source.json").write_text(json.dumps({"job": "caption", "input": str(inp)}))
    with pytest.raises(SystemExit, match="--captions captions-run: a captions job output with no finished pair"):
        publish_main(base + ["--output", str(tmp_path / "rel2"), "--captions", str(failed)])
    assert not (tmp_path / "rel2").exists()
