"""STAC input: catalogues, collections, item files and API searches -> stacked scene records.

What the pairs job needs to select pairs comes from the items themselves, without opening a
raster: the acquisition date (``datetime``, else ``start_datetime``), platform, ``eo:cloud_cover``,
the footprint, and each chosen asset's CRS, transform and shape from the projection extension
(``proj:code`` / ``proj:epsg`` / ``proj:wkt2``, ``proj:transform``, ``proj:shape``, on the asset or
the item). Only an asset without projection information costs a header read (no pixels).

Sources (``--input``):

* a static catalogue or collection: the local path or ``s3://`` URI of its root JSON, walked
  recursively with ``pystac`` (objects on S3 are read through the project's storage layer);
* an items file: a single item, a ``FeatureCollection``, newline-delimited items (``.ndjson``), or
  a GeoParquet file written by ``stac-geoparquet``;
* a STAC API (``--input https://.../v1`` with ``--stac-search '<json>'``, the JSON being
  ``pystac_client``'s ``search()`` arguments: ``collections``, ``bbox``, ``datetime``, ``query``,
  ``max_items`` ...).

``--bands red,green,blue`` names the assets to stack, by asset key or by ``eo:bands`` common name
(or name); ``--cloud-mask scl`` names the cloud layer the same way.
"""
from __future__ import annotations

import io
import json
import posixpath
from typing import Iterable, Optional, Sequence

from operators.io.storage import split_uri
from operators.pairs.catalogue.band_stack import BandAsset, CloudLayer, Stack, header_record
from operators.pairs.imagery.cloud_masks import CloudConfig

DEFAULT_BANDS = ("red", "green", "blue")
JSON_SUFFIXES = (".json", ".geojson")
NDJSON_SUFFIXES = (".ndjson", ".jsonl")
PARQUET_SUFFIXES = (".parquet", ".geoparquet")


def parse_bands(text: str | Sequence[str] | None) -> list[str]:
    if not text:
        return list(DEFAULT_BANDS)
    items = text.split(",") if isinstance(text, str) else list(text)
    return [b.strip() for b in items if b.strip()]


# ---- reading sources ----------------------------------------------------------------------

def _store_io():
    """A pystac StacIO that reads local paths and ``s3://`` through :class:`Store` (http: pystac's)."""
    import pystac
    from pystac.stac_io import DefaultStacIO

    class StoreStacIO(DefaultStacIO):
        def read_text(self, source, *args, **kwargs) -> str:
            href = str(source.href if isinstance(source, pystac.Link) else source)
            return read_source_bytes(href).decode("utf-8")

    return StoreStacIO()


def absolute_href(href: str, base: Optional[str]) -> str:
    """``href`` resolved against the document it came from (keeps ``s3://`` and ``http(s)://``)."""
    if "://" in href or href.startswith("/") or not base:
        return href
    scheme, sep, rest = base.partition("://")
    if not sep:
        scheme, rest = "", base
    joined = posixpath.normpath(posixpath.join(posixpath.dirname(rest), href))
    return f"{scheme}://{joined}" if scheme else joined


def read_source_bytes(uri: str) -> bytes:
    """Bytes of a local, ``s3://`` or ``http(s)://`` document."""
    if str(uri).startswith(("http://", "https://")):
        from urllib.request import urlopen
        with urlopen(uri, timeout=60) as resp:  # noqa: S310 - a user-given catalogue URL
            return resp.read()
    store, name = split_uri(uri)
    return store.read_bytes(name)


def _parquet_is_stac(raw: bytes) -> bool:
    import pyarrow.parquet as pq
    names = set(pq.read_schema(io.BytesIO(raw)).names)
    return {"id", "assets"} <= names


def is_stac_source(uri: str, search: str = "") -> bool:
    """True for STAC inputs (JSON catalogues/items, stac-geoparquet, or an API with a search)."""
    low = str(uri).lower()
    if search:
        return True
    if low.endswith(JSON_SUFFIXES + NDJSON_SUFFIXES):
        return True
    if low.endswith(PARQUET_SUFFIXES):
        return _parquet_is_stac(read_source_bytes(uri))
    return False


def read_items(uri: str, search: str | dict = "") -> list[tuple[dict, Optional[str]]]:
    """Every item of a STAC source as (item dict, the href relative asset links resolve against)."""
    if search:
        return search_items(uri, json.loads(search) if isinstance(search, str) else search)
    low = str(uri).lower()
    raw = read_source_bytes(uri)
    if low.endswith(PARQUET_SUFFIXES):
        import pyarrow.parquet as pq
        from stac_geoparquet.arrow import stac_table_to_items
        return [(d, uri) for d in stac_table_to_items(pq.read_table(io.BytesIO(raw)))]
    if low.endswith(NDJSON_SUFFIXES):
        return [(json.loads(line), uri) for line in raw.decode("utf-8").splitlines() if line.strip()]
    doc = json.loads(raw)
    kind = doc.get("type")
    if kind == "Feature":
        return [(doc, _self_href(doc) or uri)]
    if kind == "FeatureCollection":
        return [(d, _self_href(d) or uri) for d in doc.get("features", [])]
    if kind in ("Catalog", "Collection"):
        import pystac
        root = pystac.read_file(uri, stac_io=_store_io())
        return [(item.to_dict(include_self_link=True, transform_hrefs=False), item.get_self_href())
                for item in root.get_items(recursive=True)]
    raise ValueError(f"{uri} is not a STAC catalogue, collection, item or item collection "
                     f"(type {kind!r})")


def search_items(api_url: str, params: dict) -> list[tuple[dict, Optional[str]]]:
    """A STAC API item search with pystac-client (``params`` = ``Client.search`` arguments)."""
    from pystac_client import Client
    client = Client.open(api_url)
    return [(item.to_dict(transform_hrefs=False), item.get_self_href())
            for item in client.search(**params).items()]


def _self_href(doc: dict) -> Optional[str]:
    for link in doc.get("links", []):
        if link.get("rel") == "self" and link.get("href"):
            return link["href"]
    return None


# ---- item -> scene record -----------------------------------------------------------------

def _band_meta(asset: dict) -> dict:
    for key in ("raster:bands", "bands"):
        if asset.get(key):
            return asset[key][0]
    return {}


def _names(asset: dict) -> set[str]:
    names = set()
    for key in ("eo:bands", "bands"):
        for b in asset.get(key) or []:
            for k in ("common_name", "eo:common_name", "name"):
                if b.get(k):
                    names.add(str(b[k]).lower())
    return names


def find_asset(assets: dict, name: str) -> Optional[str]:
    """Asset key for ``name``: an exact key (any case), else an ``eo:bands`` common name or name.

    Several assets can carry a band (Earth Search has ``red`` as COG and ``red-jp2``): a GeoTIFF
    is preferred, then the first in key order.
    """
    low = name.lower()
    for key in assets:
        if key.lower() == low:
            return key
    hits = [k for k in sorted(assets) if low in _names(assets[k])]
    tiffs = [k for k in hits if "tiff" in str(assets[k].get("type", "")).lower()]
    return (tiffs or hits or [None])[0]


def _crs(asset: dict, props: dict) -> Optional[str]:
    for src in (asset, props):
        if src.get("proj:code"):
            return str(src["proj:code"])
        if src.get("proj:epsg"):
            return f"EPSG:{int(src['proj:epsg'])}"
        if src.get("proj:wkt2"):
            return str(src["proj:wkt2"])
        if src.get("proj:projjson"):
            return json.dumps(src["proj:projjson"])
    return None


def band_asset(item: dict, key: str, base: Optional[str]) -> BandAsset:
    """A band asset's grid from the projection extension (header read only when it is missing)."""
    asset, props = item["assets"][key], item.get("properties", {})
    href = absolute_href(asset["href"], base)
    meta = _band_meta(asset)
    crs = _crs(asset, props)
    transform = asset.get("proj:transform") or props.get("proj:transform")
    shape = asset.get("proj:shape") or props.get("proj:shape")
    nodata = meta.get("nodata")
    dtype = meta.get("data_type")
    if not (crs and transform and shape):
        from operators.pairs.catalogue.band_manifest import band_from_header
        return band_from_header(key, href, nodata=nodata)
    return BandAsset(name=key, href=href, crs=crs, transform=tuple(float(v) for v in transform[:6]),
                     width=int(shape[1]), height=int(shape[0]),
                     nodata=None if nodata is None else float(nodata), dtype=dtype or "uint16")


def item_stack(item: dict, base: Optional[str], bands: Sequence[str], cloud: CloudConfig) -> Stack:
    assets = item.get("assets", {})
    keys = []
    for name in bands:
        key = find_asset(assets, name)
        if key is None:
            raise ValueError(f"item {item.get('id')} has no asset for band {name!r} "
                             f"(assets: {', '.join(sorted(assets))})")
        keys.append(key)
    layer = None
    if cloud.cloud_mask:
        key = find_asset(assets, cloud.cloud_mask)
        if key is None:
            raise ValueError(f"item {item.get('id')} has no cloud layer {cloud.cloud_mask!r}")
        kind = cloud.kind_for(key)
        layer = CloudLayer(band_asset(item, key, base), kind, tuple(cloud.values_for(kind)),
                           cloud.max_crop_cloud)
    return Stack(tuple(band_asset(item, k, base) for k in keys), layer)


def acquired_date(props: dict) -> str:
    text = props.get("datetime") or props.get("start_datetime")
    if not text:
        raise ValueError("item has neither datetime nor start_datetime")
    return str(text)[:10]


def item_record(item: dict, base: Optional[str], bands: Sequence[str], cloud: CloudConfig) -> dict:
    """One scene record (the catalogue's schema plus STAC columns) from one item; no pixel read."""
    props = item.get("properties", {})
    stack = item_stack(item, base, bands, cloud)
    uri = _self_href(item) or base or f"stac-item:{item['id']}"
    cover = props.get("eo:cloud_cover")
    return {
        "scene_id": str(item["id"]), "uri": absolute_href(uri, base), "driver": "STAC",
        **header_record(stack),
        "acquired": acquired_date(props), "date_source": "stac:datetime", "location": None,
        "stretch": None, "stac_id": str(item["id"]), "collection": item.get("collection"),
        "platform": props.get("platform"),
        "cloud_cover": None if cover is None else float(cover),
        "geometry": json.dumps(item.get("geometry")) if item.get("geometry") else None,
        "properties": json.dumps(props, sort_keys=True),
    }


def stac_scene_records(uri: str, search: str, bands: Sequence[str],
                       cloud: CloudConfig) -> tuple[list[dict], list[tuple[str, Exception]]]:
    """Scene records of every item of a STAC source; bad items come back as (item, error)."""
    records, errors, seen = [], [], set()
    for item, base in read_items(uri, search):
        name = str(item.get("id") or base or uri)
        try:
            if item.get("id") in seen:
                raise ValueError(f"duplicate item id {item['id']!r}: kept the first")
            records.append(item_record(item, base, bands, cloud))
            seen.add(item["id"])
        except Exception as exc:  # noqa: BLE001 - one bad item must not stop the catalogue
            errors.append((name, exc))
    return records, errors


def write_items_geoparquet(items: Iterable[dict], target: str) -> None:
    """Items -> a stac-geoparquet file (tests, and users converting a catalogue once)."""
    import pyarrow.parquet as pq
    from stac_geoparquet.arrow import parse_stac_items_to_arrow
    table = parse_stac_items_to_arrow(list(items)).read_all()
    buf = io.BytesIO()
    pq.write_table(table, buf)
    store, name = split_uri(target)
    store.write_bytes(name, buf.getvalue())

