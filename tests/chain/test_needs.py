"""operators.chain.needs: the optional parts a chain step needs, named before anything runs (pure, quick)."""
from __future__ import annotations

import pytest

from operators.chain import needs
from operators.labelstudio import client as sc


def test_installed_finds_real_modules_and_refuses_missing_or_malformed_names():
    assert needs._installed("json") and needs._installed("json.decoder")
    assert not needs._installed("changeforge_no_such_module")
    assert not needs._installed("json.no_such_part.x")       # ImportError from the parent
    assert not needs._installed("")                          # ValueError: an empty name


@pytest.fixture
def nothing_optional(monkeypatch, tmp_path):
    """No optional import name installed, and no Label Studio SDK venv."""
    real = needs._installed
    monkeypatch.setattr(needs, "_installed", lambda m: False if m in (
        "matplotlib", "pycocoevalcap", "sklearn", "label_studio_sdk") else real(m))
    monkeypatch.setattr(sc, "sdk_python", lambda: str(tmp_path / "venv" / "bin" / "python"))
    monkeypatch.setitem(needs.PROGRAM_CHECKS, "java", lambda: None)    # Java: its own test below
    return tmp_path


def test_each_missing_part_is_one_line_with_its_install_hint(nothing_optional):
    assert needs.missing("report", {}) == [
        "step 'report' needs matplotlib (the report's figures): pip install 'changeforge[report]' "
        "(from a checkout: pip install -e '.[report]')"]
    assert needs.missing("score captions", {}) == [
        "step 'score captions' needs pycocoevalcap (caption scoring (BLEU, METEOR, ROUGE-L, CIDEr-D)): "
        "pip install 'changeforge[score]' (from a checkout: pip install -e '.[score]')"]
    assert needs.missing("annotate export", {"prelabel": "pca-kmeans"}) == [
        "step 'annotate export' needs sklearn (the pca-kmeans change proposals): pip install "
        "'changeforge[prelabels]' (from a checkout: pip install -e '.[prelabels]')"]
    # another prelabel, another step with the same option, or no such step: nothing needed
    assert needs.missing("annotate export", {"prelabel": "none"}) == []
    assert needs.missing("review export", {"prelabel": "pca-kmeans"}) == []
    assert needs.missing("caption", {}) == []


def test_label_studio_is_needed_only_when_the_step_talks_to_a_server(nothing_optional):
    venv = nothing_optional / "venv"
    for step, option in (("annotate export", "label-studio-url"), ("annotate ingest", "export"),
                         ("review export", "label-studio-url"), ("review ingest", "export")):
        for url in ("http://127.0.0.1:8080", "https://studio.example"):
            assert needs.missing(step, {option: url}) == [
                f"step {step!r} talks to Label Studio but label-studio-sdk is neither importable here nor at "
                f"{venv}/bin/python: python -m venv {venv} && {venv}/bin/pip install {sc.SDK_VERSION} "
                f"(or set {sc.PYTHON_ENV})"]
        assert needs.missing(step, {option: "exports/project-3.json"}) == []
    assert needs.missing("annotate ingest", {"label-studio-url": "http://127.0.0.1:8080"}) == []  # not its option
    assert needs.missing("caption", {"export": "http://127.0.0.1:8080"}) == []


def test_an_sdk_venv_on_disk_or_an_importable_sdk_is_enough(nothing_optional, monkeypatch):
    python = nothing_optional / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    assert needs.missing("review ingest", {"export": "http://127.0.0.1:8080"}) == []
    python.unlink()
    monkeypatch.setattr(needs, "_installed", lambda m: m == "label_studio_sdk")
    assert needs.missing("review ingest", {"export": "http://127.0.0.1:8080"}) == []
    assert len(needs.missing("report", {"export": "http://127.0.0.1:8080"})) == 1     # matplotlib still missing


def _path_with(tmp_path, java: str | None) -> str:
    """A PATH holding only a ``java`` script with the body ``java`` (None: no java at all)."""
    bin_ = tmp_path / "bin"
    bin_.mkdir(exist_ok=True)
    if java is not None:
        (bin_ / "java").write_text("#!/bin/sh\n" + java + "\n")
        (bin_ / "java").chmod(0o755)
    return str(bin_)


@pytest.mark.parametrize("java, why", [(None, "java not found: the caption metrics need Java"),
                                       ("exit 1", "/bin/java does not run (")])
def test_score_captions_needs_a_java_that_runs(monkeypatch, tmp_path, java, why):
    monkeypatch.setattr(needs, "_installed", lambda m: True)
    monkeypatch.setenv("PATH", _path_with(tmp_path, java))
    [line] = needs.missing("score captions", {})
    assert line.startswith("step 'score captions' needs a working java: ") and why in line, line
    assert "apt-get install -y default-jre-headless" in line
    for step in ("score qa", "score change", "caption", "report"):     # they run no Java before their work
        assert needs.missing(step, {}) == [], step


def test_a_java_that_runs_is_enough(monkeypatch, tmp_path):
    monkeypatch.setattr(needs, "_installed", lambda m: True)
    monkeypatch.setenv("PATH", _path_with(tmp_path, "exit 0"))
    assert needs.missing("score captions", {}) == []
