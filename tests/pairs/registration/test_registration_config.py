"""RegistrationConfig split by concern: the same flat options and run-file keys fill the nested
settings, flat and nested construction agree, and the settings keys follow the concerns."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from jobs.build_pairs import build_parser
from operators.io.cli import config_from_args, parse_job_args
from operators.pairs.crops.slice_io import settings_key
from operators.pairs.registration.config import (GROUPS, FeatureConfig, RegistrationConfig, ScreeningConfig,
                                                 SchedulingConfig)

# One option of every concern, none at its default.
FLAGS = ["--registration", "per-slice", "--crop-size", "512", "--sift-sigma", "1.7", "--ratio", "0.7",
         "--ransac-method", "ransac", "--max-residual-px", "4", "--no-rescue", "--tile-size", "512",
         "--search-margin-px", "64", "--slices-per-task", "2"]
EXPECTED = {("method",): "per-slice", ("crop_size",): 512, ("features", "sift_sigma"): 1.7,
            ("matching", "ratio"): 0.7, ("fit", "ransac_method"): "ransac",
            ("screening", "max_residual_px"): 4.0, ("rescuing", "rescue"): False,
            ("tiling", "tile_size"): 512, ("tiling", "search_margin_px"): 64,
            ("scheduling", "slices_per_task"): 2}


def _reg(argv):
    naip = str(Path(__file__).resolve().parents[3] / "data" / "naip")   # --input must exist
    return config_from_args(RegistrationConfig, parse_job_args(build_parser(), argv + ["--input", naip, "--output", "o"]))


def _check(cfg):
    for path, value in EXPECTED.items():
        got = cfg
        for name in path:
            got = getattr(got, name)
        assert got == value, path


def test_flat_options_fill_the_nested_settings():
    cfg = _reg(FLAGS)
    _check(cfg)
    assert cfg.screening.max_residual_m == 0.0 and cfg.features.sift_octave_layers == 3   # defaults kept


def test_flat_run_file_keys_fill_the_nested_settings(tmp_path):
    run = tmp_path / "run.yaml"
    run.write_text("registration: per-slice\ncrop_size: 512\nsift-sigma: 1.7\nratio: 0.7\n"
                   "ransac_method: ransac\nmax_residual_px: 4\nrescue: false\ntile_size: 512\n"
                   "search_margin_px: 64\nslices_per_task: 2\n")
    _check(_reg(["--config", str(run)]))


def test_every_setting_has_one_flat_option_and_one_group():
    parser = build_parser()
    flags = {s for a in parser._actions for s in a.option_strings}
    names = list(RegistrationConfig.field_help())
    grouped = [f.name for cls in GROUPS.values() for f in dataclasses.fields(cls)]
    assert len(grouped) == len(set(grouped)) == len(names) - 2          # method and crop_size on top
    assert sorted(names) == sorted(RegistrationConfig().flat())
    assert all(f"--{n.replace('_', '-')}" in flags for n in names if n != "method")
    assert "--registration" in flags


def test_flat_and_nested_construction_agree():
    flat = RegistrationConfig(crop_size=512, sift_sigma=1.7, max_residual_px=4.0, slices_per_task=2)
    nested = RegistrationConfig(crop_size=512, features=FeatureConfig(sift_sigma=1.7),
                                screening={"max_residual_px": 4.0}, scheduling=SchedulingConfig(slices_per_task=2))
    assert flat == nested == RegistrationConfig(**dataclasses.asdict(flat))
    assert (flat.max_residual_px, flat.screening.max_residual_px) == (4.0, 4.0)
    changed = dataclasses.replace(flat, max_residual_px=2.5)
    assert (changed.max_residual_px, changed.sift_sigma, flat.max_residual_px) == (2.5, 1.7, 4.0)
    part = ScreeningConfig(max_residual_px=3.0)
    cfg = RegistrationConfig(screening=part)
    cfg.max_residual_px = 5.0                  # the flat name writes through to its group ...
    assert cfg.screening.max_residual_px == 5.0 and part.max_residual_px == 3.0   # ... never to a shared one
    with pytest.raises(TypeError, match="max_residual"):
        RegistrationConfig(max_residual=3)
    with pytest.raises(ValueError):
        RegistrationConfig(search_margin_px=2000)
    with pytest.raises(ValueError):
        RegistrationConfig(method="magic")


def test_keys_follow_the_concerns():
    row = {"bands_pre": [1, 2, 3], "window": [0, 0, 3000, 3000], "pre_uri": "a", "post_uri": "b"}
    base = RegistrationConfig()
    scheduling = RegistrationConfig(slices_per_task=2, match_tiles_per_task=1, keep_features=True)
    screening = RegistrationConfig(max_residual_px=4.0)
    tiling = RegistrationConfig(tile_size=512)
    assert settings_key(row, scheduling) == settings_key(row, base)
    assert settings_key(row, screening) != settings_key(row, base) != settings_key(row, tiling)
    assert base.features_key() == scheduling.features_key() == screening.features_key()
    assert tiling.features_key() != base.features_key()
    assert RegistrationConfig(max_anisotropy=1.1).features_key() != base.features_key()


def test_outputs_written_before_a_later_setting_keep_their_keys():
    """Keys of the default settings as the release before ``--tile-block`` computed them (captured
    from that code): with the later settings at their old values (tile_block 1, every feature in
    the first pass) neither key changes, so those outputs resume; the new defaults change both
    (their features and matches differ)."""
    row = {"bands_pre": [1, 2, 3], "bands_post": [1, 2, 3], "window": [0, 0, 512, 512],
           "stretch_pre": [[0, 255]] * 3, "stretch_post": [[0, 255]] * 3, "pre_uri": "a.tif", "post_uri": "b.tif"}
    old = RegistrationConfig(tile_block=1, prior_features_per_tile=0)
    assert (old.features_key(), settings_key(row, old)) == ("551c52802e", "39b3e28366")
    for new in (RegistrationConfig(), RegistrationConfig(tile_block=2, prior_features_per_tile=0),
                RegistrationConfig(tile_block=1, prior_features_per_tile=1000)):
        assert new.features_key() != old.features_key()
        assert settings_key(row, new) != settings_key(row, old)


def test_per_slice_keys_ignore_the_regional_only_later_settings():
    """The per-slice recipe reads neither tile_block nor the first pass's sample: its outputs keep
    their keys under the new defaults (no per-slice slice is redone), whatever those values."""
    row = {"bands_pre": [1], "bands_post": [1], "window": [0, 0, 512, 512],
           "stretch_pre": [[0, 255]], "stretch_post": [[0, 255]], "pre_uri": "a.tif", "post_uri": "b.tif"}
    old = RegistrationConfig(method="per-slice", tile_block=1, prior_features_per_tile=0)
    for new in (RegistrationConfig(method="per-slice"),
                RegistrationConfig(method="per-slice", tile_block=3, prior_features_per_tile=7)):
        assert settings_key(row, new) == settings_key(row, old)
    # Settings the recipe does read still count, and the regional method keeps them apart.
    assert settings_key(row, RegistrationConfig(method="per-slice", ratio=0.7)) != \
        settings_key(row, old)
    assert settings_key(row, RegistrationConfig()) != \
        settings_key(row, RegistrationConfig(prior_features_per_tile=0))


@pytest.mark.parametrize("argv, says", [
    (["--screen-window-px", "3"], "--screen-window-px 3: must be 0 (automatic) or at least 8"),
    (["--screen-min-assessed", "1.5"], "--screen-min-assessed 1.5: must be at most 1"),
])
def test_a_screening_setting_out_of_range_stops_in_one_line_before_work(argv, says, capsys):
    with pytest.raises(SystemExit) as stop:
        _reg(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err
    assert _reg(["--screen-window-px", "8"]).screening.screen_window_px == 8
    assert _reg(["--screen-window-px", "0"]).screen_window() == 128
