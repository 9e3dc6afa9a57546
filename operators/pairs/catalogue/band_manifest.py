"""Per-band product folders without STAC: a manifest with one row per band file.

Columns: ``uri`` (absolute, or relative to the manifest), ``acquired`` (ISO date), ``location``
(optional), ``band`` (a name: ``B04``, ``red``, ``SCL`` ...), optional ``scene`` (which rows form
one scene; default: same location, date and folder) and optional ``cloud_cover`` (percent, for
``--max-cloud-cover``). Rows of one scene become one stacked scene, exactly like a STAC item's
assets, so the same stacking code reads both. ``--bands`` matches the ``band`` column by name or
by the common name of a Sentinel-2 / Landsat band id (``B04`` and ``SR_B4`` are ``red``).

These files carry no projection metadata, so each band's header is read (no pixels); sibling
files are allowed for that read, so a CRS kept only in a ``.aux.xml`` sidecar is found.
"""
from __future__ import annotations

import posixpath
from typing import Optional, Sequence

import rasterio

from operators.io.storage import gdal_env
from operators.pairs.catalogue.band_stack import BandAsset, CloudLayer, Stack, header_record, raster_path
from operators.pairs.catalogue.catalogue import _resolve, is_manifest, manifest_rows, parse_date, scene_id_for
from operators.pairs.imagery.cloud_masks import CloudConfig

# Common names (STAC eo) of the band ids products use in file names.
SENTINEL2_BANDS = {"b01": "coastal", "b02": "blue", "b03": "green", "b04": "red",
                   "b05": "rededge1", "b06": "rededge2", "b07": "rededge3", "b08": "nir",
                   "b8a": "nir08", "b09": "nir09", "b10": "cirrus", "b11": "swir16",
                   "b12": "swir22"}
LANDSAT89_BANDS = {"sr_b1": "coastal", "sr_b2": "blue", "sr_b3": "green", "sr_b4": "red",
                   "sr_b5": "nir08", "sr_b6": "swir16", "sr_b7": "swir22"}
COMMON_NAMES = {**SENTINEL2_BANDS, **LANDSAT89_BANDS}


def has_band_column(manifest_uri: str) -> bool:
    """A manifest (CSV/Parquet) whose rows are single bands of multi-file products."""
    if not is_manifest(manifest_uri):
        return False
    rows = manifest_rows(manifest_uri)
    return bool(rows) and "band" in rows[0]


def band_matches(band: str, wanted: str) -> bool:
    b, w = str(band).strip().lower(), wanted.strip().lower()
    return b == w or COMMON_NAMES.get(b) == w


def band_from_header(name: str, href: str, nodata: Optional[float] = None) -> BandAsset:
    """A band's grid from its file header (sidecars allowed; no pixel read)."""
    env = {**gdal_env(), "GDAL_DISABLE_READDIR_ON_OPEN": "FALSE"}
    try:
        with rasterio.Env(**env), rasterio.open(raster_path(href)) as src:
            if not src.crs:
                raise ValueError(f"band {name} ({href}) has no CRS, in the file or a sidecar")
            return BandAsset(name=name, href=href, crs=src.crs.to_string(),
                             transform=tuple(src.transform)[:6], width=src.width,
                             height=src.height,
                             nodata=nodata if nodata is not None else src.nodata,
                             dtype=src.dtypes[0])
    except rasterio.errors.RasterioIOError as exc:
        raise ValueError(f"band {name} is not a readable raster: {exc}") from None


def group_rows(manifest_uri: str) -> dict[str, list[dict]]:
    """Manifest rows grouped into scenes (the ``scene`` column, else location + date + folder)."""
    groups: dict[str, list[dict]] = {}
    for r in manifest_rows(manifest_uri):
        uri = _resolve(str(r["uri"]).strip(), manifest_uri)
        row = {**r, "uri": uri}
        key = str(r.get("scene") or "") or "|".join(
            [str(r.get("location") or ""), str(r.get("acquired") or ""), posixpath.dirname(uri)])
        groups.setdefault(key, []).append(row)
    return groups


def _pick(rows: list[dict], name: str, scene: str) -> dict:
    hits = [r for r in rows if band_matches(r["band"], name)]
    if not hits:
        raise ValueError(f"scene {scene} has no band {name!r} (bands: "
                         f"{', '.join(sorted(str(r['band']) for r in rows))})")
    return hits[0]


def group_record(key: str, rows: list[dict], bands: Sequence[str], cloud: CloudConfig) -> dict:
    """One stacked scene record from the manifest rows of one product (band headers read)."""
    first = rows[0]
    scene = str(first.get("scene") or posixpath.basename(posixpath.dirname(first["uri"])) or key)
    stack_bands = tuple(band_from_header(str(r["band"]), r["uri"])
                        for r in (_pick(rows, b, scene) for b in bands))
    layer = None
    if cloud.cloud_mask:
        r = _pick(rows, cloud.cloud_mask, scene)
        kind = cloud.kind_for(str(r["band"]))
        layer = CloudLayer(band_from_header(str(r["band"]), r["uri"]), kind,
                           tuple(cloud.values_for(kind)), cloud.max_crop_cloud)
    acquired = parse_date(str(first.get("acquired") or ""))
    if acquired is None:
        raise ValueError(f"scene {scene}: 'acquired' {first.get('acquired')!r} is not an ISO date")
    cover = first.get("cloud_cover")
    return {
        "scene_id": scene_id_for(posixpath.dirname(first["uri"]) + "/" + scene),
        # The product folder (plus the scene name when a ``scene`` column splits a folder).
        "uri": posixpath.dirname(first["uri"]) + (f"#{scene}" if first.get("scene") else ""),
        "driver": "bands",
        **header_record(Stack(stack_bands, layer)),
        "acquired": acquired.isoformat(), "date_source": "manifest",
        "location": str(first["location"]).strip() if first.get("location") else None,
        "stretch": None, "stac_id": None, "collection": None, "platform": None,
        "cloud_cover": None if cover in (None, "") else float(cover),
        "geometry": None, "properties": None,
    }
