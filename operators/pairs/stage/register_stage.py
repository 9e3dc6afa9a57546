"""The registration stage: slice rows -> one ``metadata`` or ``errors`` envelope per slice, by the
configured method (``per_slice_ops``: the paper's recipe; ``regional_ops``: tile features shared
between overlapping slices)."""
from __future__ import annotations

from operators.pairs.stage.per_slice_ops import per_slice_stage, register_slice_per_slice
from operators.pairs.regional.regional_ops import regional_stage, register_slice_regional
from operators.pairs.registration.registration import RegistrationConfig
from operators.pairs.crops.slice_io import METADATA_SCHEMA  # noqa: F401 - the stage's output table


def register_slice_row(row: dict, cfg: RegistrationConfig, out_root: str, run_id: str = "") -> dict:
    """Dispatch on ``cfg.method`` (regional assumes its tiles' matches are stored)."""
    if cfg.method == "per-slice":
        return register_slice_per_slice(row, cfg, out_root, run_id)
    return register_slice_regional(row, cfg, out_root, run_id)


def registration_stage(slices, cfg: RegistrationConfig, out_root: str, run_id: str):
    """Slice rows -> one ``metadata`` or ``errors`` envelope per slice (columns _table, _record)."""
    if cfg.method == "per-slice":
        return per_slice_stage(slices, cfg, out_root, run_id)
    return regional_stage(slices, cfg, out_root, run_id)
