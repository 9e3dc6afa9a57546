"""The paper's per-slice registration recipe as a Ray Data map: one slice row in, one envelope
(``metadata`` accepted/rejected, or ``errors``) out."""
from __future__ import annotations

from dataclasses import asdict

import numpy as np

from operators.io.tables import envelope, error_envelope
from operators.pairs.catalogue.band_stack import forget_reads
from operators.pairs.registration.registration import (RegistrationConfig, crop_offset,
                                                       feature_image, register_slice_pair)
from operators.pairs.crops.slice_io import (JOB, STAGE, Clock, finish_crop, plain_row, read_post,
                                            read_pre, read_registered_post, single_thread, slice_record,
                                            with_shift_envelopes)


def register_slice_per_slice(row: dict, cfg: RegistrationConfig, out_root: str,
                             run_id: str = "") -> dict:
    """The paper's recipe on one slice row: whole-slice SIFT both dates, fit, warp, crop, screen."""
    single_thread()
    forget_reads()
    clock = Clock()
    try:
        window = [int(v) for v in row["window"]]
        size = window[2]
        pre, pre_valid = read_pre(row, window)
        post, post_valid = read_post(row, window)
        fit = register_slice_pair(feature_image(pre, pre_valid, cfg), pre_valid,
                                  feature_image(post, post_valid, cfg), post_valid, cfg)
        if fit.homography is None:
            return envelope("metadata", slice_record(row, cfg, run_id, clock, fit, "rejected",
                                                fit.reject_reason))
        off = crop_offset(size, cfg.crop_size)
        sl = np.s_[off:off + cfg.crop_size, off:off + cfg.crop_size]
        # The post slice above was resampled onto the grid for SIFT; the crop is resampled once
        # from the post scene's own pixels.
        post_crop, post_crop_valid = read_registered_post(row, fit.homography, cfg)
        return finish_crop(row, cfg, out_root, run_id, clock, fit, pre[(slice(None),) + sl],
                           pre_valid[sl], post_crop, post_crop_valid)
    except Exception as exc:  # noqa: BLE001 - every slice must end as one envelope
        return error_envelope(row.get("slice_id", "?"), STAGE, exc, job=JOB, run_id=run_id)




def _register_map(row: dict, cfg_dict: dict, out_root: str, run_id: str) -> list[dict]:
    """The slice's envelope, then its screening windows' ``shifts`` envelopes."""
    return with_shift_envelopes([register_slice_per_slice(
        plain_row(row), RegistrationConfig(**cfg_dict), out_root, run_id)])


def per_slice_stage(slices, cfg: RegistrationConfig, out_root: str, run_id: str):
    """A lazy Ray Data map, one task per slice (tens of core-seconds each) so both cores and every
    node get work."""
    kwargs = {"cfg_dict": asdict(cfg), "out_root": out_root, "run_id": run_id}
    return slices.repartition(target_num_rows_per_block=1).flat_map(
        _register_map, fn_kwargs=kwargs, num_cpus=1)
