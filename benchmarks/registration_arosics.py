"""AROSICS COREG on the slices of a ``registration_real`` run, side by side with the pairs job.

Runs in a separate environment that has AROSICS (it needs GDAL's Python bindings; see the
project's toolchain notes), not in the project's venv:

    <arosics-python> -m benchmarks.registration_arosics <registration_real workdir> [--window 512]

For every case folder of the workdir (``pre.tif``, ``post.tif`` and ``slices.json``, written by
``registration_real``) and every slice, AROSICS ``COREG`` estimates one shift of the post date
at the slice's kept crop (a matching window of ``--window`` px centred on the crop, ``max_shift``:
the case's geocoding offset plus 50 px). The default window is AROSICS's best of 128, 192, 256,
the slice (320-384) and 512 px on these cases (0.13, 0.12, 0.52, 0.57, 0.58 accepted). A slice
counts as accepted when COREG reports success. The corrected post date is the post date moved by
that shift, so the true error at crop pixel p is ``|F(p - s) - p|`` with ``F`` the case's known
warp, on a 16 px grid as in ``registration_real``. Prints one JSON line: accept rate, median true
error of accepted crops (px), false accepts (true max error > 8 px) and CPU seconds.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np


def known_warp(p: dict):
    """F of ``benchmarks._scenes.KnownWarp`` (post pixel -> pre pixel) from its fields."""
    def F(x, y):
        c = (p["size"] - 1) / 2.0
        th = np.deg2rad(p["degrees"])
        a, b = p["scale"] * np.cos(th), p["scale"] * np.sin(th)
        dx, dy = x - c, y - c
        k = 2 * np.pi / p["wave_len_px"]
        fx = c + a * dx - b * dy + p["offset"][0] + p["wave_px"] * np.sin(k * y + 0.7)
        fy = c + b * dx + a * dy + p["offset"][1] + p["wave_px"] * np.cos(k * x + 1.9)
        return fx, fy
    return F


def run_case(folder: Path, window: int = 512) -> list[dict]:
    from arosics import COREG
    from osgeo import gdal
    spec = json.loads((folder / "slices.json").read_text())
    F = known_warp(spec["warp"])
    crop = spec["crop"]
    gt = gdal.Open(str(folder / "pre.tif")).GetGeoTransform()
    out = []
    for col, row, size, _ in spec["windows"]:
        off = (size - crop) // 2
        cx, cy = col + off + crop / 2.0, row + off + crop / 2.0
        wp = (gt[0] + cx * gt[1], gt[3] + cy * gt[5])
        t0 = time.process_time()
        try:
            cr = COREG(str(folder / "pre.tif"), str(folder / "post.tif"), wp=wp,
                       ws=(window, window), max_shift=int(spec["offset_px"]) + 50, q=True, nodata=(0, 0),
                       ignore_errors=True)
            cr.calculate_spatial_shifts()
            ok = bool(cr.success)
            s = (cr.x_shift_px or 0.0, cr.y_shift_px or 0.0)
        except Exception:  # noqa: BLE001 - AROSICS raises on windows it cannot use
            ok, s = False, (0.0, 0.0)
        cpu = time.process_time() - t0
        err = None
        if ok:
            v, u = np.mgrid[0:crop:16, 0:crop:16].astype(np.float64)
            px, py = u.ravel() + col + off, v.ravel() + row + off
            fx, fy = F(px - s[0], py - s[1])
            err = np.hypot(fx - px, fy - py).tolist()
        out.append({"case": spec["case"], "window": [col, row, size, size], "accepted": ok,
                    "shift": list(s), "errors": err, "cpu_s": cpu})
    return out


def main(argv=None) -> None:
    args = list(argv if argv is not None else sys.argv[1:])
    window = 512
    if "--window" in args:
        i = args.index("--window")
        window = int(args[i + 1])
        del args[i:i + 2]
    work = Path(args[0])
    results = []
    for folder in sorted(p for p in work.iterdir() if (p / "slices.json").exists()):
        results.extend(run_case(folder, window))
    acc = [r for r in results if r["accepted"]]
    errs = np.concatenate([r["errors"] for r in acc]) if acc else np.array([np.nan])
    print(json.dumps({
        "slices": len(results), "accepted": len(acc),
        "accept_rate": len(acc) / max(len(results), 1),
        "median_error_px": float(np.median(errs)),
        "false_accepts": sum(max(r["errors"]) > 8.0 for r in acc),
        "cpu_s": sum(r["cpu_s"] for r in results),
        "per_case": {c: [sum(r["accepted"] for r in results if r["case"] == c),
                         sum(r["case"] == c for r in results)]
                     for c in sorted({r["case"] for r in results})}}))


if __name__ == "__main__":
    main()
