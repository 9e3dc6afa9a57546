"""AROSICS COREG_LOCAL on the cases of a ``registration_real`` run (a subset: it is slow), side by
side with the pairs job. Runs in AROSICS's own environment (GDAL's Python bindings):

    <arosics-python> -m benchmarks.registration_arosics_local <registration_real workdir> \\
        [case ...] [--grid-res 16] [--window 384]

For each case folder (``pre.tif``, ``post.tif``, ``slices.json`` of the crops the cloud rule
admits), COREG_LOCAL computes its tie-point grid over the whole pair once (``--grid-res`` px,
``--window`` px matching windows, ``max_shift`` the case's geocoding offset plus 50 px, AROSICS's
own outlier filtering, level 3). The defaults are AROSICS's best on the NAIP, Landsat and
Sentinel-2 08-15 cases: at a 48 px grid, windows of 128, 256, 384 and 512 px corrected 0, 34, 51
and 46 of 84 crops; with 384 px windows, grids of 24 and 16 px corrected 63 and 68 (CPU 305 and
627 s; each halving of the grid costs four times the CPU). Per crop: accepted when at least
``MIN_POINTS`` valid inlier tie points lie in the crop (a per-crop rule of this benchmark;
COREG_LOCAL itself corrects the whole scene). The correction at a crop pixel is the inliers' shift interpolated linearly (nearest
outside their hull), an approximation of AROSICS's own GCP warp; the corrected later date at p is
the later date at ``p - s(p)`` (COREG's convention), so the true error is ``|F(p - s(p)) - p|`` on
a 16 px grid, ``F`` the case's known warp. Prints one JSON line: per case and in total, accepted
crops, median true error, false accepts (true max error > 8 px), and CPU seconds.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.registration_arosics import known_warp

MIN_POINTS = 4


def run_case(folder: Path, grid_res: int, window: int) -> dict:
    from arosics import COREG_LOCAL
    from scipy.interpolate import griddata
    spec = json.loads((folder / "slices.json").read_text())
    F = known_warp(spec["warp"])
    crop = spec["crop"]
    t0 = time.process_time()
    cr = COREG_LOCAL(str(folder / "pre.tif"), str(folder / "post.tif"), grid_res=grid_res,
                     window_size=(window, window), max_shift=int(spec["offset_px"]) + 50, q=True,
                     nodata=(0, 0), CPUs=1, ignore_errors=True)
    tbl = cr.CoRegPoints_table
    cpu = time.process_time() - t0
    ok = tbl[(tbl["ABS_SHIFT"] != cr.outFillVal) & (tbl["OUTLIER"] == 0)] \
        if "OUTLIER" in tbl.columns else tbl[tbl["ABS_SHIFT"] != cr.outFillVal]
    pts = np.column_stack([ok["X_IM"].to_numpy(float), ok["Y_IM"].to_numpy(float)])
    sh = np.column_stack([ok["X_SHIFT_PX"].to_numpy(float), ok["Y_SHIFT_PX"].to_numpy(float)])
    out = []
    for col, row, size, _ in spec["windows"]:
        off = (size - crop) // 2
        x0, y0 = col + off, row + off
        inside = (pts[:, 0] >= x0) & (pts[:, 0] < x0 + crop) & \
            (pts[:, 1] >= y0) & (pts[:, 1] < y0 + crop)
        if inside.sum() < MIN_POINTS:
            out.append({"accepted": False, "errors": None})
            continue
        v, u = np.mgrid[0:crop:16, 0:crop:16].astype(np.float64)
        px, py = u.ravel() + x0, v.ravel() + y0
        s = np.column_stack([griddata(pts, sh[:, k], (px, py), method="linear") for k in (0, 1)])
        near = np.column_stack([griddata(pts, sh[:, k], (px, py), method="nearest")
                                for k in (0, 1)])
        s = np.where(np.isfinite(s), s, near)
        fx, fy = F(px - s[:, 0], py - s[:, 1])
        out.append({"accepted": True, "errors": np.hypot(fx - px, fy - py).tolist()})
    acc = [r for r in out if r["accepted"]]
    errs = np.concatenate([r["errors"] for r in acc]) if acc else np.array([np.nan])
    return {"case": spec["case"], "slices": len(out), "accepted": len(acc),
            "median_error_px": float(np.median(errs)),
            "false_accepts": sum(max(r["errors"]) > 8.0 for r in acc),
            "tie_points": int(len(tbl)), "valid_tie_points": int(len(ok)), "cpu_s": cpu}


def main(argv=None) -> None:
    args = list(argv if argv is not None else sys.argv[1:])
    opts = {"--grid-res": 16, "--window": 384}
    for name in opts:
        if name in args:
            i = args.index(name)
            opts[name] = int(args[i + 1])
            del args[i:i + 2]
    work, names = Path(args[0]), set(args[1:])
    results = [run_case(folder, opts["--grid-res"], opts["--window"])
               for folder in sorted(p for p in work.iterdir() if (p / "slices.json").exists())
               if not names or folder.name in names]
    n = sum(r["slices"] for r in results)
    a = sum(r["accepted"] for r in results)
    print(json.dumps({"slices": n, "accepted": a, "accept_rate": a / max(n, 1),
                      "false_accepts": sum(r["false_accepts"] for r in results),
                      "cpu_s": sum(r["cpu_s"] for r in results), "per_case": results}))


if __name__ == "__main__":
    main()
