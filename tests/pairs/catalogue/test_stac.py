"""STAC sources -> stacked scene records, with no raster opened (issue 14)."""
from __future__ import annotations

import json
import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from operators.pairs.imagery.cloud_masks import CloudConfig
from operators.pairs.catalogue.stac import (absolute_href, find_asset, is_stac_source, stac_scene_records,
                                            write_items_geoparquet)
from tests.pairs.stac_zagreb import PRODUCTS, build_catalogue, item_dict

DATES = ["20230810", "20230813"]
RGB = ["red", "green", "blue"]


def _records(uri, search="", bands=RGB, cloud=None):
    recs, errs = stac_scene_records(str(uri), search, bands, cloud or CloudConfig())
    return {r["stac_id"]: r for r in recs}, errs


def test_catalogue_items_give_date_grid_cover_and_hrefs(tmp_path):
    root = build_catalogue(tmp_path / "cat", DATES)
    recs, errs = _records(root, cloud=CloudConfig(cloud_mask="scl"))
    assert errs == []
    r = recs["S2B_33TWL_20230810_0_L2A"]
    assert r["acquired"] == "2023-08-10" and r["platform"] == "sentinel-2b"
    assert r["cloud_cover"] == pytest.approx(69.286209)
    assert r["crs"] == "EPSG:32633" and (r["width"], r["height"]) == (915, 915)
    assert r["bounds"] == [499980.0, 5100000.0 - 915 * 120, 499980.0 + 915 * 120, 5100000.0]
    stack = json.loads(r["stack"])
    assert [Path(b["href"]).name for b in stack["bands"]] == ["B04.tif", "B03.tif", "B02.tif"]
    assert stack["cloud"]["kind"] == "scl" and stack["cloud"]["values"] == [3, 8, 9, 10]
    assert json.loads(r["properties"])["eo:cloud_cover"] == pytest.approx(69.286209)


def test_no_raster_is_opened_to_catalogue(tmp_path):
    """Projection extension complete: records come from JSON alone, even if the files are gone."""
    root = build_catalogue(tmp_path / "cat", DATES)
    for tif in (tmp_path / "cat").rglob("*.tif"):
        tif.unlink()
    recs, errs = _records(root)
    assert errs == [] and len(recs) == 2


def test_items_file_ndjson_and_geoparquet_agree(tmp_path):
    items = [item_dict(d, files_prefix=f"{PRODUCTS[d]}/") for d in DATES]
    fc = tmp_path / "items.json"
    fc.write_text(json.dumps({"type": "FeatureCollection", "features": items}))
    nd = tmp_path / "items.ndjson"
    nd.write_text("\n".join(json.dumps(i) for i in items))
    gp = tmp_path / "items.parquet"
    write_items_geoparquet(items, str(gp))
    assert all(is_stac_source(str(p)) for p in (fc, nd, gp))
    got = [_records(p)[0] for p in (fc, nd, gp)]
    keys = ("acquired", "crs", "transform", "width", "height", "cloud_cover", "platform")
    for recs in got[1:]:
        assert {k: {i: r[k] for i, r in recs.items()} for k in keys} == \
            {k: {i: r[k] for i, r in got[0].items()} for k in keys}
    stack = json.loads(got[2]["S2B_33TWL_20230813_0_L2A"]["stack"])
    assert stack["bands"][0]["href"] == str(PRODUCTS["20230813"] / "B04.tif")


def test_plain_manifest_parquet_is_not_stac(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"uri": ["a.tif"], "acquired": ["2020-01-01"]}), tmp_path / "m.parquet")
    assert not is_stac_source(str(tmp_path / "m.parquet"))


def test_bands_by_key_or_common_name_and_errors():
    assets = {"red": {"type": "image/tiff"}, "b04-jp2": {"type": "image/jp2",
                                                         "eo:bands": [{"common_name": "red"}]},
              "B8": {"type": "image/tiff; application=geotiff",
                     "eo:bands": [{"name": "B8", "common_name": "nir"}]},
              "nir-jp2": {"type": "image/jp2", "eo:bands": [{"common_name": "nir"}]}}
    assert find_asset(assets, "RED") == "red"
    assert find_asset(assets, "nir") == "B8"          # GeoTIFF preferred over JPEG2000
    assert find_asset(assets, "swir16") is None


def test_missing_band_is_an_error_row_not_a_crash(tmp_path):
    good = item_dict("20230813", files_prefix=f"{PRODUCTS['20230813']}/")
    bad = item_dict("20230810", files_prefix=f"{PRODUCTS['20230810']}/")
    bad["assets"].pop("green")
    (tmp_path / "items.json").write_text(json.dumps({"type": "FeatureCollection",
                                                     "features": [good, bad, good]}))
    recs, errs = _records(tmp_path / "items.json")
    assert list(recs) == ["S2B_33TWL_20230813_0_L2A"]
    msgs = {item: str(exc) for item, exc in errs}
    assert "no asset for band 'green'" in msgs["S2B_33TWL_20230810_0_L2A"]
    assert "duplicate item id" in msgs["S2B_33TWL_20230813_0_L2A"]


def test_header_read_only_when_projection_is_missing(tmp_path):
    item = item_dict("20230813", files_prefix=f"{PRODUCTS['20230813']}/")
    for a in item["assets"].values():
        a.pop("proj:transform")
    (tmp_path / "one.json").write_text(json.dumps(item))
    recs, errs = _records(tmp_path / "one.json")
    assert errs == []
    assert recs["S2B_33TWL_20230813_0_L2A"]["transform"] == [120.0, 0.0, 499980.0, 0.0, -120.0,
                                                            5100000.0]


def test_absolute_href_keeps_schemes():
    assert absolute_href("B04.tif", "s3://b/cat/x/item.json") == "s3://b/cat/x/B04.tif"
    assert absolute_href("../y/B04.tif", "/data/cat/x/item.json") == "/data/cat/y/B04.tif"
    assert absolute_href("https://h/B04.tif", "s3://b/i.json") == "https://h/B04.tif"


# ---- STAC API search against a recorded response ------------------------------------------

RECORDED = Path(__file__).parent / "recorded_stac_search.json"


@pytest.fixture()
def recorded_api(tmp_path):
    """A local server answering like Earth Search from a recorded landing page and search."""
    recorded = json.loads(RECORDED.read_text())
    seen = []

    class Handler(SimpleHTTPRequestHandler):
        def _send(self, doc):
            body = json.dumps(doc).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):  # noqa: N802
            seen.append(("GET", self.path))
            if self.path.rstrip("/").endswith("/v1"):
                return self._send(_landing(recorded, self.server.server_port))
            return self._send(recorded["search"])

        def do_POST(self):  # noqa: N802
            length = int(self.headers.get("Content-Length", 0))
            seen.append(("POST", self.path, json.loads(self.rfile.read(length) or b"{}")))
            return self._send(recorded["search"])

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(Handler, directory=str(tmp_path)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/v1", seen
    server.shutdown()


def _landing(recorded, port):
    doc = json.loads(json.dumps(recorded["landing"]))
    for link in doc["links"]:
        link["href"] = link["href"].replace("https://earth-search.aws.element84.com",
                                            f"http://127.0.0.1:{port}")
    return doc


def test_stac_search_through_pystac_client(recorded_api):
    url, seen = recorded_api
    search = json.dumps({"collections": ["sentinel-2-l2a"], "bbox": [15.8, 45.7, 16.1, 45.9],
                         "datetime": "2023-08-10/2023-08-20", "max_items": 10})
    assert is_stac_source(url, search)
    recs, errs = _records(url, search, cloud=CloudConfig(cloud_mask="scl"))
    assert errs == []
    assert sorted(recs) == ["S2A_33TWL_20230815_0_L2A", "S2B_33TWL_20230813_0_L2A"]
    r = recs["S2B_33TWL_20230813_0_L2A"]
    stack = json.loads(r["stack"])
    # Earth Search items: 10 m bands on the 10980 px grid, SCL at 20 m; the scene grid is the finest.
    assert (r["width"], r["res"][0]) == (10980, 10.0)
    assert stack["cloud"]["asset"]["transform"][0] == 20.0
    assert all(b["href"].startswith("https://sentinel-cogs.s3.us-west-2.amazonaws.com/")
               for b in stack["bands"])
    post = [s for s in seen if s[0] == "POST"]
    assert post and post[0][2]["collections"] == ["sentinel-2-l2a"]
