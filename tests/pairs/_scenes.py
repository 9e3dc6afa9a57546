"""Scene records for the pure cores' tests: the NAIP test scenes, and made-up scene headers."""
from __future__ import annotations

from tests.conftest import DATA

NAIP = sorted((DATA / "naip").glob("*.tif"))


def scene(uri="s", acquired="2020-01-01", bounds=(0, 0, 1000, 1000), crs="EPSG:32614",
          res=1.0, location=None, **kw):
    """A scene header as the catalogue records it (north-up grid of ``res`` over ``bounds``)."""
    left, bottom, right, top = bounds
    return {"scene_id": uri, "uri": uri, "acquired": acquired, "crs": crs, "bounds": list(bounds),
            "transform": [res, 0.0, left, 0.0, -res, top], "width": int((right - left) / res),
            "height": int((top - bottom) / res), "location": location, "rgb_bands": [1, 2, 3],
            "stretch": [[0, 255]] * 3, **kw}


def utm_tile(name, acquired, col, width=5000.0, step=4750.0):
    """A 5 km tile in UTM 14N at about 45 N, ``col`` steps east (5 % overlap with its neighbour)."""
    x0, y0 = 500000.0 + col * step, 5000000.0
    return scene(name, acquired, bounds=(x0, y0, x0 + width, y0 + width), res=10.0)
