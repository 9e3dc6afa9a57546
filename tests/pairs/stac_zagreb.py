"""Test fixtures: a static STAC catalogue of the Zagreb Sentinel-2 L2A series (data/s2-zagreb).

The items keep the real Earth Search metadata of each product (id, datetime, platform,
``eo:cloud_cover``, geometry) and get one asset per band file actually in the repository (B02,
B03, B04 as blue/green/red with ``eo:bands``, SCL as ``scl``), each with its projection extension
(``proj:code``, ``proj:transform``, ``proj:shape``) taken from the file and its sidecar: the
published items describe the 10 m originals, these files are 120 m. Files are copied next to the
items with their ``.aux.xml`` sidecars and referenced by relative hrefs.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import rasterio

from tests.conftest import DATA

ZAGREB = DATA / "s2-zagreb"
PRODUCTS = {p.name.split("_")[2]: p for p in sorted(ZAGREB.glob("S2*_L2A"))}  # "20230810" -> dir
BANDS = {"B02": "blue", "B03": "green", "B04": "red"}


def file_grid(path: Path) -> dict:
    """CRS, transform, shape and nodata of a band file (its sidecar allowed)."""
    with rasterio.Env(GDAL_DISABLE_READDIR_ON_OPEN="FALSE"), rasterio.open(path) as src:
        return {"crs": src.crs.to_string(), "transform": list(src.transform)[:6],
                "shape": [src.height, src.width], "nodata": src.nodata, "dtype": src.dtypes[0]}


def _asset(href: str, grid: dict, common: str | None, title: str) -> dict:
    a = {"href": href, "type": "image/tiff; application=geotiff", "title": title,
         "roles": ["data"], "proj:code": grid["crs"], "proj:transform": grid["transform"],
         "proj:shape": grid["shape"],
         "raster:bands": [{"nodata": grid["nodata"], "data_type": grid["dtype"]}]}
    if common:
        a["eo:bands"] = [{"name": common, "common_name": common}]
    return a


def item_dict(date: str, files_prefix: str = "") -> dict:
    """A STAC item for one Zagreb date, asset hrefs relative to the item (``files_prefix``)."""
    folder = PRODUCTS[date]
    original = json.loads((folder / f"{folder.name}.json").read_text())
    props = {k: original["properties"][k] for k in
             ("datetime", "platform", "constellation", "instruments", "eo:cloud_cover",
              "s2:product_uri", "grid:code")}
    assets = {}
    for band, common in BANDS.items():
        assets[common] = _asset(f"{files_prefix}{band}.tif", file_grid(folder / f"{band}.tif"),
                                common, f"{common} ({band})")
    assets["scl"] = _asset(f"{files_prefix}SCL.tif", file_grid(folder / "SCL.tif"), None,
                           "Scene classification map (SCL)")
    return {"type": "Feature", "stac_version": "1.0.0", "id": original["id"],
            "stac_extensions": [
                "https://stac-extensions.github.io/projection/v2.0.0/schema.json",
                "https://stac-extensions.github.io/eo/v1.1.0/schema.json",
                "https://stac-extensions.github.io/raster/v1.1.0/schema.json"],
            "geometry": original["geometry"], "bbox": original["bbox"], "properties": props,
            "links": [], "assets": assets}


def build_catalogue(root: Path, dates) -> Path:
    """A self-contained static catalogue under ``root``; returns ``root/catalog.json``."""
    import pystac

    root.mkdir(parents=True, exist_ok=True)
    cat = pystac.Catalog("zagreb-s2-l2a", "Sentinel-2 L2A 33TWL (Zagreb), Aug 2023, 120 m")
    for date in dates:
        item = pystac.Item.from_dict(item_dict(date))
        cat.add_item(item)
    cat.normalize_hrefs(str(root))
    cat.save(pystac.CatalogType.SELF_CONTAINED)
    for date in dates:
        folder, item_dir = PRODUCTS[date], root / PRODUCTS[date].name
        for name in list(BANDS) + ["SCL"]:
            for suffix in (".tif", ".tif.aux.xml"):
                shutil.copy(folder / f"{name}{suffix}", item_dir / f"{name}{suffix}")
    return root / "catalog.json"


def upload(folder: Path, s3_client, bucket: str, prefix: str) -> str:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            s3_client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(folder)}")
    return f"s3://{bucket}/{prefix}"


def hand_stacked(folder: Path, dates) -> Path:
    """What a user had to do before: one 3-band GeoTIFF per date (B04, B03, B02), lossless."""
    folder.mkdir(parents=True, exist_ok=True)
    for date in dates:
        src_dir = PRODUCTS[date]
        planes = []
        for band in ("B04", "B03", "B02"):
            with rasterio.Env(GDAL_DISABLE_READDIR_ON_OPEN="FALSE"), \
                    rasterio.open(src_dir / f"{band}.tif") as src:
                planes.append(src.read(1))
                profile = dict(crs=src.crs, transform=src.transform, width=src.width,
                               height=src.height, dtype=src.dtypes[0])
        with rasterio.open(folder / f"zagreb_{date}.tif", "w", driver="GTiff", count=3,
                           nodata=0, compress="deflate", **profile) as dst:
            dst.write(np.stack(planes))
    return folder


def scl_cloud_fraction(date: str) -> float:
    with rasterio.open(PRODUCTS[date] / "SCL.tif") as src:
        scl = src.read(1)
    return float(np.isin(scl, (3, 8, 9, 10)).mean())
