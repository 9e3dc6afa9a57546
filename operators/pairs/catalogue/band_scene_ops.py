"""The pairs job's path for stacked scenes (STAC items, per-band manifests): catalogue without
pixel reads, the cloud-cover pair filter, then per-scene stretches for the scenes that are used.

Order matters for cost: the catalogue reads item JSON (or band headers for manifests), pairs are
selected and filtered by cloud cover on those records, and only then are pixels read - a
decimated read per band of the scenes in accepted pairs, to compute their 8-bit stretch with
clouds excluded. A scene dropped by ``--max-cloud-cover`` is never opened.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa

from operators.io.tables import error_record
from operators.pairs.catalogue.band_manifest import group_record, group_rows, has_band_column
from operators.pairs.catalogue.band_stack import Stack, stack_stretch
from operators.pairs.catalogue.catalogue import SCENES_SCHEMA
from operators.pairs.imagery.cloud_masks import CloudConfig, filter_pairs_by_cloud_cover
from operators.pairs.catalogue.stac import is_stac_source, parse_bands, stac_scene_records

JOB = "build_pairs"

# scenes/ for stacked scenes: the catalogue's columns plus where each scene came from.
BAND_SCENES_SCHEMA = pa.schema(list(SCENES_SCHEMA) + [
    ("stac_id", pa.string()), ("collection", pa.string()), ("platform", pa.string()),
    ("cloud_cover", pa.float64()),
    ("geometry", pa.string()),     # the item's GeoJSON footprint (lon/lat)
    ("properties", pa.string()),   # the item's properties, JSON
    ("stack", pa.string()),        # band assets and cloud layer read for this scene, JSON
])


@dataclass
class BandsConfig:
    """Per-band products and STAC search."""

    bands: str = field(default="", metadata={"help": "assets stacked as R,G,B for STAC items or band manifests: asset keys or eo:bands common names (default: red,green,blue)"})
    stac_search: str = field(default="", metadata={"help": "STAC API item search as JSON (pystac-client search() arguments, e.g. {\"collections\": [...], \"bbox\": [...], \"datetime\": \"...\"}); --input is then the API root URL"})


def is_band_input(source: str, stac_search: str = "") -> bool:
    """STAC sources and per-band manifests take this path; folders and plain manifests do not."""
    return is_stac_source(source, stac_search) or has_band_column(source)


def _group_fn(row: dict, bands, cloud_dict, run_id) -> list[dict]:
    from operators.io.tables import envelope, error_envelope
    try:
        rec = group_record(row["key"], row["rows"], bands, CloudConfig(**cloud_dict))
        return [envelope("scenes", rec)]
    except Exception as exc:  # noqa: BLE001 - a bad product must not stop the archive
        return [error_envelope(row["rows"][0]["uri"], "catalogue", exc, job=JOB, run_id=run_id)]


def catalogue_band_scenes(source: str, cfg: BandsConfig, cloud: CloudConfig,
                          run_id: str) -> tuple[list[dict], list[dict]]:
    """Scene records (no stretch yet) and error rows of a STAC source or a per-band manifest."""
    from dataclasses import asdict

    bands = parse_bands(cfg.bands)
    if is_stac_source(source, cfg.stac_search):
        records, failed = stac_scene_records(source, cfg.stac_search, bands, cloud)
        return records, [error_record(item, "catalogue", exc, job=JOB, run_id=run_id)
                         for item, exc in failed]
    import ray.data
    from operators.io.tables import split_envelopes
    groups = [{"key": k, "rows": [{kk: (None if v is None else str(v)) for kk, v in r.items()}
                                  for r in rows]}
              for k, rows in sorted(group_rows(source).items())]
    env_rows = ray.data.from_items(groups).flat_map(
        _group_fn, fn_kwargs={"bands": bands, "cloud_dict": asdict(cloud), "run_id": run_id},
    ).take_all()
    tables = split_envelopes(env_rows)
    return tables.get("scenes", []), tables.get("errors", [])


def _stretch_fn(row: dict, percentiles) -> dict:
    try:
        return {"scene_id": row["scene_id"], "error": None,
                "stretch": stack_stretch(Stack.from_json(row["stack"]), percentiles)}
    except Exception as exc:  # noqa: BLE001 - reported on the scene and its pairs
        return {"scene_id": row["scene_id"], "stretch": None,
                "error": f"pixel data unreadable: {type(exc).__name__}: {exc}"[:500]}


def prepare_band_pairs(pairs: list[dict], scenes: list[dict], cloud: CloudConfig,
                       percentiles, run_id: str) -> list[dict]:
    """Filter pairs by cloud cover, then stretch the scenes accepted pairs use (a Ray map).

    Updates ``pairs`` and ``scenes`` in place; returns error rows for unreadable scenes (their
    pairs are rejected with that reason).
    """
    import ray.data

    by_id = {s["scene_id"]: s for s in scenes}
    filter_pairs_by_cloud_cover(pairs, by_id, cloud.max_cloud_cover)
    used = sorted({p[k] for p in pairs if p["status"] == "accepted"
                   for k in ("pre_scene", "post_scene")})
    if not used:
        return []
    todo = [{"scene_id": s, "stack": by_id[s]["stack"]} for s in used]
    results = ray.data.from_items(todo).map(
        _stretch_fn, fn_kwargs={"percentiles": tuple(float(p) for p in percentiles)}).take_all()
    errors, bad = [], {}
    for r in results:
        if r["error"]:
            bad[r["scene_id"]] = r["error"]
            errors.append(error_record(by_id[r["scene_id"]]["uri"], "catalogue", r["error"],
                                       error_type="UnreadableScene", job=JOB, run_id=run_id))
        else:
            by_id[r["scene_id"]]["stretch"] = [list(map(float, s)) for s in r["stretch"]]
    for p in pairs:
        broken = [bad[s] for s in (p["pre_scene"], p["post_scene"]) if s in bad]
        if p["status"] == "accepted" and broken:
            p["status"], p["reason"] = "rejected", broken[0]
    return errors
