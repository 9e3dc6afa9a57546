"""A STAC catalogue of a release: one item per pair with the ``label`` extension (a raster change mask,
its classes and how it was made), ``ml-aoi:split``, the pair's images as assets (relative links into
the folder layout) and ``derived_from`` / ``source`` links to the scenes it was cut from when they are
URIs (``s3://``, ``https://``, STAC hrefs); scenes read from local files are named relative to the
pairs run's input in ``changeforge:sources`` (a relative link would resolve inside the release).

Items of pairs without geolocation (a LEVIR-CD layout) have a null geometry, as STAC allows.
"""
from __future__ import annotations

import pystac

from operators.io.validation import is_uri
from operators.publish.sources import known

LABEL_EXT = "https://stac-extensions.github.io/label/v1.0.1/schema.json"
ML_AOI_EXT = "https://stac-extensions.github.io/ml-aoi/v0.2.0/schema.json"
PROJ_EXT = "https://stac-extensions.github.io/projection/v1.1.0/schema.json"
CATALOG = "stac/catalog.json"


def item_path(pair_id: str) -> str:
    return f"stac/items/{pair_id}.json"


def _wgs84(bounds: list[float], crs: str) -> list[float]:
    from rasterio.warp import transform_bounds
    return [float(v) for v in transform_bounds(crs, "EPSG:4326", *bounds, densify_pts=21)]


def pair_item(row: dict, files: dict[str, str], label_methods: list[str], classes: list[dict],
              release_date: str = "1970-01-01") -> dict:
    """The STAC item (dict) of one published pair. ``row``: the pair's Parquet row without images;
    ``files``: layout role -> path relative to the release root. A pair without acquisition dates (a
    LEVIR-CD input) gets the release date as its ``datetime`` and ``acquisition_dates_known: false``."""
    bbox = geometry = None
    if row.get("bounds") and row.get("crs"):
        bbox = _wgs84(row["bounds"], row["crs"])
        w, s, e, n = bbox
        geometry = {"type": "Polygon", "coordinates": [[[w, s], [e, s], [e, n], [w, n], [w, s]]]}
    props = {
        "ml-aoi:split": row["split"],
        "label:properties": None, "label:type": "raster", "label:tasks": ["segmentation", "change detection"],
        "label:description": "change mask: 0 = no change, 255 = change"
                             + ("; label_index: 0 = no change, 1 = new building, 2 = demolished building"
                                if "label_index" in files else ""),
        "label:classes": classes, "label:methods": label_methods,
        "label:overviews": [{"property_key": None, "counts": [
            {"name": "changed_pixels", "count": int(row.get("changed_pixels") or 0)}]}],
        "car": row.get("car"),
    }
    dates = [d for d in (row.get("pre_date"), row.get("post_date")) if d]
    when = None
    if dates:
        props.update(start_datetime=f"{min(dates)}T00:00:00Z", end_datetime=f"{max(dates)}T23:59:59Z")
    else:
        import datetime as dt
        when = dt.datetime.fromisoformat(f"{release_date}T00:00:00+00:00")
        props["acquisition_dates_known"] = False
    if known(row.get("sensor")):   # an unknown sensor is left out, never "nan"
        props["platform"] = str(row["sensor"])
    extensions = [LABEL_EXT, ML_AOI_EXT]
    if row.get("crs") and row.get("bounds"):
        if str(row["crs"]).upper().startswith("EPSG:"):
            props["proj:code"] = str(row["crs"]).upper()
        props["proj:bbox"] = row["bounds"]
        extensions.append(PROJ_EXT)
    item = pystac.Item(id=row["id"], geometry=geometry, bbox=bbox, datetime=when, properties=props,
                       stac_extensions=extensions)
    roles = {"A": ("pre-change image", ["data"]), "B": ("post-change image", ["data"]),
             "label": ("change mask 0/255", ["labels", "labels-raster"]),
             "label1": ("new buildings 0/255", ["labels", "labels-raster"]),
             "label2": ("demolished buildings 0/255", ["labels", "labels-raster"]),
             "label_index": ("index mask 0/1/2", ["labels", "labels-raster"])}
    for role, rel in files.items():
        title, asset_roles = roles[role]
        item.add_asset(role, pystac.Asset(href=f"../../{rel}", media_type=pystac.MediaType.PNG, title=title,
                                          roles=asset_roles))
    local = {}
    for side in ("pre", "post"):
        for href in row.get(f"{side}_source") or []:
            if not is_uri(str(href)):   # a file of the builder's input: a relative href would point into the release
                local.setdefault(side, []).append(str(href))
                continue
            item.add_link(pystac.Link("derived_from", href, title=f"{side} scene"))
            item.add_link(pystac.Link("source", href, title=f"{side} scene (label source imagery)"))
    if local:
        props["changeforge:sources"] = local   # relative to the input of the pairs run that read them
    item.add_link(pystac.Link("root", "../catalog.json", media_type=pystac.MediaType.JSON))
    item.add_link(pystac.Link("parent", "../catalog.json", media_type=pystac.MediaType.JSON))
    return item.to_dict(include_self_link=False, transform_hrefs=False)


def catalog(name: str, version: str, description: str, pair_ids: list[str]) -> dict:
    cat = pystac.Catalog(id=f"{name}-{version}", description=description, title=f"{name} {version}")
    d = cat.to_dict(include_self_link=False, transform_hrefs=False)
    d["links"] = [{"rel": "root", "href": "./catalog.json", "type": "application/json"}] + [
        {"rel": "item", "href": f"./items/{i}.json", "type": "application/geo+json"} for i in pair_ids]
    return d
