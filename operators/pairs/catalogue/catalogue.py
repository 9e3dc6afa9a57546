"""Catalogue: find scenes and read what pairing needs from their headers.

Inputs are a folder or ``s3://`` prefix (every file is tried as a raster: formats are detected by
content, so a GeoTIFF named ``.jp2`` works and a text file named ``.tif`` is an error row), or a
manifest (CSV or Parquet with ``uri``, ``acquired`` and optional ``location``).

Acquisition dates come, in order of trust, from the manifest, from the TIFF/GDAL metadata tags, or
from a date in the file name (``YYYYMMDD`` or ``YYYY-MM-DD``). A scene without a date is an error
row: pairing by time gap is meaningless without one.
"""
from __future__ import annotations

import csv
import datetime as dt
import hashlib
import io
import posixpath
import re
from dataclasses import dataclass
from typing import Iterable, Sequence

import pyarrow as pa
import pyarrow.parquet as pq
import rasterio

from operators.pairs.imagery.radiometry import scene_stretch
from operators.io.storage import Store, gdal_env, gdal_path, is_s3, split_uri

# Sidecars GDAL keeps next to rasters; trying to open them as scenes only produces noise.
SIDECAR_SUFFIXES = (".aux.xml", ".ovr", ".msk", ".md", ".txt", ".json", ".xml", ".csv",
                    ".parquet", ".geojson", ".prj", ".tfw", ".wld")
MANIFEST_SUFFIXES = (".csv", ".parquet")

SCENES_SCHEMA = pa.schema([
    ("scene_id", pa.string()), ("uri", pa.string()), ("driver", pa.string()),
    ("crs", pa.string()), ("bounds", pa.list_(pa.float64())), ("transform", pa.list_(pa.float64())),
    ("width", pa.int64()), ("height", pa.int64()), ("res", pa.list_(pa.float64())),
    ("dtype", pa.string()), ("count", pa.int64()), ("nodata", pa.float64()),
    ("acquired", pa.string()), ("date_source", pa.string()), ("location", pa.string()),
    ("rgb_bands", pa.list_(pa.int64())), ("stretch", pa.list_(pa.list_(pa.float64()))),
])


@dataclass(frozen=True)
class SceneInput:
    """One scene to catalogue: where it is, plus what a manifest may already say about it."""

    uri: str
    acquired: str | None = None
    location: str | None = None


def is_manifest(uri: str) -> bool:
    return str(uri).lower().endswith(MANIFEST_SUFFIXES)


def _resolve(uri: str, manifest_uri: str) -> str:
    """Manifest URIs may be relative to the manifest's own folder."""
    if is_s3(uri) or uri.startswith("/"):
        return uri
    store, _ = split_uri(manifest_uri)
    return store.uri(uri)


def manifest_rows(manifest_uri: str) -> list[dict]:
    """The rows of a CSV (UTF-8, a BOM allowed) or Parquet manifest, as dicts."""
    store, name = split_uri(manifest_uri)
    raw = store.read_bytes(name)
    if manifest_uri.lower().endswith(".parquet"):
        return pq.read_table(io.BytesIO(raw)).to_pylist()
    return list(csv.DictReader(io.StringIO(raw.decode("utf-8-sig"))))


def read_manifest(manifest_uri: str) -> list[SceneInput]:
    rows = manifest_rows(manifest_uri)
    if rows and "uri" not in rows[0]:
        raise ValueError(f"manifest {manifest_uri} has no 'uri' column (columns: {sorted(rows[0])})")
    out = []
    for r in rows:
        acquired = r.get("acquired")
        out.append(SceneInput(
            uri=_resolve(str(r["uri"]).strip(), manifest_uri),
            acquired=str(acquired).strip() if acquired not in (None, "") else None,
            location=str(r["location"]).strip() if r.get("location") not in (None, "") else None,
        ))
    return out


def list_scene_inputs(source: str) -> list[SceneInput]:
    """Scenes under a folder/prefix, or the rows of a manifest."""
    if is_manifest(source):
        return read_manifest(source)
    store = Store(source)
    rels = [r for r in store.list("") if not r.lower().endswith(SIDECAR_SUFFIXES)]
    return [SceneInput(uri=store.uri(r)) for r in rels]


# -- dates ---------------------------------------------------------------------------------
_DATE_TAGS = ("ACQUISITIONDATETIME", "ACQUISITION_DATE", "DATE_ACQUIRED", "TIFFTAG_DATETIME",
              "DATETIME", "acquired", "datetime")
_NAME_DATE = re.compile(r"(?<!\d)((?:19|20)\d{2})[-_]?(0[1-9]|1[0-2])[-_]?(0[1-9]|[12]\d|3[01])(?!\d)")


def parse_date(text: str) -> dt.date | None:
    """ISO dates, ``YYYY:MM:DD hh:mm:ss`` (TIFF), ``YYYYMMDD``; None when nothing valid is found."""
    text = str(text).strip()
    m = re.match(r"^((?:19|20)\d{2})[-:/]?(\d{2})[-:/]?(\d{2})", text)
    if not m:
        return None
    try:
        return dt.date(int(m.group(1)), int(m.group(2)), int(m.group(3)))
    except ValueError:
        return None


def date_from_name(name: str) -> dt.date | None:
    for m in _NAME_DATE.finditer(posixpath.basename(name)):
        try:
            return dt.date(int(m.group(1)), int(m.group(2)), int(m.group(3)))
        except ValueError:
            continue
    return None


def acquisition_date(scene: SceneInput, tags: dict[str, str]) -> tuple[dt.date, str]:
    if scene.acquired:
        d = parse_date(scene.acquired)
        if d is None:
            raise ValueError(f"manifest date {scene.acquired!r} is not an ISO date")
        return d, "manifest"
    for key in _DATE_TAGS:
        if key in tags:
            d = parse_date(tags[key])
            if d is not None:
                return d, f"tag:{key}"
    d = date_from_name(scene.uri)
    if d is not None:
        return d, "filename"
    raise ValueError("no acquisition date: not in a manifest, the raster's tags, or the file name "
                     "(give a manifest with an 'acquired' column)")


def scene_id_for(uri: str) -> str:
    """Readable and unique: the file stem plus a short hash of the full URI."""
    stem = posixpath.basename(str(uri)).split(".")[0]
    return f"{stem}-{hashlib.sha1(str(uri).encode()).hexdigest()[:6]}"


_COLOUR_NAMES = {  # band description -> colour; B02-B04 is Sentinel-2 and Landsat 8/9 naming
    "red": "red", "b04": "red", "b4": "red",
    "green": "green", "b03": "green", "b3": "green",
    "blue": "blue", "b02": "blue", "b2": "blue",
}


def _colour_of(interp: str | None, description: str | None) -> str | None:
    if interp in ("red", "green", "blue", "alpha"):
        return interp
    words = re.findall(r"[a-z0-9]+", str(description or "").lower())
    named = {_COLOUR_NAMES[w] for w in words if w in _COLOUR_NAMES}
    return named.pop() if len(named) == 1 else None


def default_rgb_bands(count: int, rgb_bands: Sequence[int] | None,
                      colorinterp: Sequence[str] | None = None,
                      descriptions: Sequence[str | None] | None = None) -> list[int]:
    """``--rgb-bands`` if given; else red, green, blue found by the bands' colour interpretation or
    descriptions; else the first three (or first) bands that are not alpha."""
    if rgb_bands:
        bad = [b for b in rgb_bands if b < 1 or b > count]
        if bad:
            raise ValueError(f"--rgb-bands {list(rgb_bands)} asks for band(s) {bad} of a {count}-band scene")
        return list(rgb_bands)
    interp = list(colorinterp or [None] * count)
    desc = list(descriptions or [None] * count)
    colours = [_colour_of(interp[i], desc[i]) for i in range(count)]
    found = {c: i + 1 for i, c in reversed(list(enumerate(colours))) if c}
    if all(c in found for c in ("red", "green", "blue")):
        return [found["red"], found["green"], found["blue"]]
    plain = [i + 1 for i, c in enumerate(colours) if c != "alpha"] or [1]
    return plain[:3] if len(plain) >= 3 else plain[:1]


def read_scene_header(scene: SceneInput, rgb_bands: Sequence[int] | None = None,
                      stretch_percentiles: Sequence[float] = (2.0, 98.0)) -> dict:
    """A catalogue record for one scene; raises ValueError/OSError with a clear message on bad input."""
    store, name = split_uri(scene.uri)
    try:
        size = store.size(name)
    except (FileNotFoundError, OSError) as exc:
        raise FileNotFoundError(f"scene file is missing or unreachable: {scene.uri}") from exc
    except Exception as exc:  # noqa: BLE001 - botocore's 404 on S3
        raise FileNotFoundError(f"scene object is missing or unreachable: {scene.uri} ({exc})") from None
    if size == 0:
        raise ValueError("empty file (0 bytes)")
    try:
        with rasterio.Env(**gdal_env()):
            with rasterio.open(gdal_path(scene.uri)) as src:
                tags = {**src.tags(), **{k: v for k, v in src.tags(ns="IMAGE_STRUCTURE").items()}}
                header = dict(
                    driver=src.driver, crs=src.crs.to_string() if src.crs else None,
                    bounds=list(src.bounds), transform=list(src.transform)[:6],
                    width=src.width, height=src.height, res=list(src.res),
                    dtype=src.dtypes[0], count=src.count,
                    nodata=None if src.nodata is None else float(src.nodata),
                )
                colorinterp = [c.name for c in src.colorinterp]
                descriptions = list(src.descriptions)
    except rasterio.errors.RasterioIOError as exc:
        raise ValueError(f"not a readable raster: {exc}") from None
    if not header["crs"]:
        raise ValueError("raster has no CRS (not georeferenced): cannot pair or slice it")
    acquired, source = acquisition_date(scene, tags)
    bands = default_rgb_bands(header["count"], rgb_bands, colorinterp, descriptions)
    try:
        # Reading pixels (decimated) here also catches truncated files whose header is intact.
        stretch = scene_stretch(scene.uri, bands, percentiles=stretch_percentiles)
    except rasterio.errors.RasterioError as exc:
        raise ValueError(f"pixel data unreadable (corrupt or truncated raster): {exc}") from None
    return {
        "scene_id": scene_id_for(scene.uri), "uri": scene.uri, **header,
        "acquired": acquired.isoformat(), "date_source": source, "location": scene.location,
        "rgb_bands": bands,
        "stretch": stretch,
    }


def catalogue_scenes(scenes: Iterable[SceneInput], **kw) -> tuple[list[dict], list[tuple[str, Exception]]]:
    """Plain-Python catalogue (the job runs :func:`read_scene_header` in a Ray map instead)."""
    records, errors = [], []
    for s in scenes:
        try:
            records.append(read_scene_header(s, **kw))
        except Exception as exc:  # noqa: BLE001 - every scene ends somewhere
            errors.append((s.uri, exc))
    return records, errors
