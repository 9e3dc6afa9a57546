"""The pairs job end to end through Ray Data: real NAIP scenes, bad inputs, labels, resume, S3."""
from __future__ import annotations

import io
import shutil
import time

import cv2
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.build_pairs import PairsJobConfig, run
from operators.io.images import decode_image, encode_png
from operators.pairs.selection.pairing import PairingConfig
from operators.pairs.registration.registration import RegistrationConfig
from operators.io.storage import Store
from operators.io.tables import read_table, with_run_id, write_table_shard
from operators.pairs.crops.slice_io import METADATA_SCHEMA
from operators.pairs.screening.rules import screen_rules
from tests.conftest import DATA

NAIP = {p.name.split("_")[-1][:4]: p for p in sorted((DATA / "naip").glob("*.tif"))}
SMALL = dict(slice_size=512, stride=256)
CROP = 256


def small_job(inp, out, **kw):
    return PairsJobConfig(input=str(inp), output=str(out), **{**SMALL, **kw})


def build_archive(folder):
    folder.mkdir(parents=True, exist_ok=True)
    for year in ("2009", "2016", "2017", "2020"):
        shutil.copy(NAIP[year], folder / NAIP[year].name)
    (folder / "empty_20190101.tif").write_bytes(b"")
    (folder / "corrupt_20190101.tif").write_bytes(NAIP["2017"].read_bytes()[:6000])
    shutil.copy(NAIP["2017"], folder / "no_date_here.tif")
    # Landsat-8 over Alabama: a real scene with a date, but nothing else overlaps it.
    shutil.copy(DATA / "uint16" / "l8_B4.tif", folder / "l8_20200615.tif")
    return folder


@pytest.fixture(scope="module")
def local_run(tmp_path_factory, ray_session):
    base = tmp_path_factory.mktemp("pairs")
    archive = build_archive(base / "archive")
    out = base / "out"
    summary = run(small_job(archive, out), PairingConfig(reference_date="2021-01-01"),
                  RegistrationConfig(crop_size=CROP))
    return archive, out, summary


def test_every_scene_pair_and_slice_ends_somewhere(local_run):
    archive, out, summary = local_run
    store = Store(str(out))
    meta = pq.read_table(str(out / "metadata")).to_pylist()
    pairs = pq.read_table(str(out / "pairs")).to_pylist()
    errors = pq.read_table(str(out / "errors")).to_pylist()
    scenes = pq.read_table(str(out / "scenes")).to_pylist()

    # Scenes: 5 good ones catalogued, the 3 broken ones in errors with a clear reason.
    assert len(scenes) == 5
    by_item = {e["item"].rsplit("/", 1)[-1]: e for e in errors}
    assert "empty file" in by_item["empty_20190101.tif"]["message"]
    assert "corrupt or truncated" in by_item["corrupt_20190101.tif"]["message"]
    assert "no acquisition date" in by_item["no_date_here.tif"]["message"]
    assert "cannot form a pair" in by_item["l8_20200615.tif"]["message"]

    # Pairs: 4 NAIP dates -> 6 candidates; the 2009 ones fail the 10-year lookback from 2021.
    naip_pairs = [p for p in pairs if "l8_" not in p["pre_uri"]]
    assert len(naip_pairs) == 6
    accepted = [p for p in naip_pairs if p["status"] == "accepted"]
    assert len(accepted) == 3
    assert all("older than 10 years" in p["reason"] for p in naip_pairs if p["pre_date"] == "2009-08-18")

    # Slices: NAIP's ~934x723 intersection at 512/256 gives 3 x 2 windows per pair.
    assert len(meta) == 3 * 6 == summary["slices_this_run"]
    assert {m["pair_id"] for m in meta} == {p["pair_id"] for p in accepted}
    assert len({m["slice_id"] for m in meta}) == len(meta)
    ok = [m for m in meta if m["status"] == "accepted"]
    # The output is deterministic (seeded FLANN/RANSAC): these are the counts measured with OpenCV 5.0,
    # exact, so a change in registration or screening shows here. (With SIFT over the whole canvas,
    # two slices straddling a lake shore that changed between the dates were rejected as "displaced
    # region"; SIFT on the valid pixels' bounding box moves their fits by under 0.6 px and screening
    # accepts them, residuals 7.8 and 3.6 px.)
    rejected = sorted(m["reject_reason"].split(":")[0] for m in meta if m["status"] != "accepted")
    assert (len(ok), rejected) == (18, []), rejected
    contract = {"slice_id", "pair_id", "pre_scene", "post_scene", "pre_date", "post_date", "crs",
                "bounds", "homography", "n_matches", "n_inliers", "residual_px", "split", "status",
                "reject_reason"}
    assert contract <= set(meta[0])
    for m in meta:
        assert m["status"] in ("accepted", "rejected")
        assert (m["reject_reason"] is None) == (m["status"] == "accepted")
        assert m["crs"] == "EPSG:26914"
        # A fit exists exactly when the slice got past fitting: accepted, screened-out and
        # nodata-rejected slices carry 9 finite floats; slices rejected by the fit carry none.
        before_fit = m["status"] == "rejected" and m["reject_reason"].startswith(
            ("too few", "degenerate", "RANSAC", "inliers too concentrated"))
        if before_fit:
            assert m["homography"] is None
        else:
            assert len(m["homography"]) == 9 and np.all(np.isfinite(m["homography"]))
    for m in ok:
        a = decode_image(store.read_bytes(f"A/{m['slice_id']}.png"))
        b = decode_image(store.read_bytes(f"B/{m['slice_id']}.png"))
        assert a.shape == b.shape == (CROP, CROP, 3) and a.dtype == np.uint8
        # Independent of the job's screening: the written crops agree everywhere to within the
        # reported residual (global phase correlation of the PNGs cannot exceed the local maximum).
        (dx, dy), _ = cv2.phaseCorrelate(a.mean(axis=2).astype(np.float32),
                                         b.mean(axis=2).astype(np.float32))
        assert np.hypot(dx, dy) <= m["residual_px"] + 0.5 and np.hypot(dx, dy) < 2.0
    for m in meta:
        if m["status"] == "rejected":
            assert not store.exists(f"A/{m['slice_id']}.png")
    # One location, so every accepted slice is in one split (splits are by location, never by
    # slice), the one its metadata rows name; the reference date used is on every row.
    [split] = {m["split"] for m in meta}
    lists = {s: store.read_bytes(f"list/{s}.txt").decode().split() for s in ("train", "val", "test")}
    assert sorted(lists[split]) == sorted(f"{m['slice_id']}.png" for m in ok)
    assert sum(map(len, lists.values())) == len(ok)
    assert {m["reference_date"] for m in meta} == {p["reference_date"] for p in pairs} == {"2021-01-01"}
    assert summary["reference_date"] == "2021-01-01"


def test_registered_crops_line_up(local_run):
    """Independent check of the accepted crops: pre and registered post agree to about a pixel."""
    import cv2

    _, out, _ = local_run
    store = Store(str(out))
    ok = [m for m in pq.read_table(str(out / "metadata")).to_pylist() if m["status"] == "accepted"]
    shifts = []
    for m in ok[:6]:
        a = decode_image(store.read_bytes(f"A/{m['slice_id']}.png"), grey=True).astype(np.float32)
        b = decode_image(store.read_bytes(f"B/{m['slice_id']}.png"), grey=True).astype(np.float32)
        (dx, dy), _ = cv2.phaseCorrelate(a.copy(), b.copy())
        shifts.append(np.hypot(dx, dy))
    assert np.median(shifts) < 1.5


def test_rerun_skips_finished_work_and_adds_labels(local_run, tmp_path):
    archive, shared_out, _ = local_run
    out = tmp_path / "out"   # a copy: the module's output stays as the first run left it
    shutil.copytree(shared_out, out)
    store = Store(str(out))
    meta = pq.read_table(str(out / "metadata")).to_pylist()
    ok = sorted(m["slice_id"] for m in meta if m["status"] == "accepted")
    before_errors = read_table(store, "errors").num_rows

    labels = Store(str(tmp_path / "labels"))
    rng = np.random.default_rng(0)
    expected = {}
    for sid in ok[:2]:
        new = np.zeros((CROP, CROP), np.uint8)
        gone = np.zeros((CROP, CROP), np.uint8)
        y, x = rng.integers(0, CROP - 40, 2)
        new[y:y + 30, x:x + 30] = 255
        gone[10:20, 10:50] = 1  # another annotator's 0/1 convention
        labels.write_bytes(f"label1/{sid}.png", encode_png(new))
        labels.write_bytes(f"label2/{sid}.png", encode_png(gone))
        expected[sid] = (new > 0) | (gone > 0)
    bad = ok[2]
    labels.write_bytes(f"label1/{bad}.png", encode_png(np.zeros((CROP + 1, CROP), np.uint8)))
    labels.write_bytes(f"label2/{bad}.png", encode_png(np.zeros((CROP + 1, CROP), np.uint8)))
    labels.write_bytes("label1/not_a_slice.png", encode_png(np.zeros((CROP, CROP), np.uint8)))

    # First only the broken maps: nothing merges, the errors say why (and the run does not fail).
    only_bad = Store(str(tmp_path / "only-bad"))
    for folder in ("label1", "label2"):
        only_bad.write_bytes(f"{folder}/{bad}.png", labels.read_bytes(f"{folder}/{bad}.png"))
    summary = run(small_job(archive, out, labels=only_bad.uri()), PairingConfig(reference_date="2021-01-01"),
                  RegistrationConfig(crop_size=CROP))
    assert summary["labels_merged_this_run"] == 0 and not store.list("label")

    summary = run(small_job(archive, out, labels=labels.uri()), PairingConfig(reference_date="2021-01-01"),
                  RegistrationConfig(crop_size=CROP))
    assert summary["slices_this_run"] == 0 and summary["slices_skipped_as_finished"] == len(meta)
    assert pq.read_table(str(out / "metadata")).num_rows == len(meta)  # no duplicates
    assert read_table(store, "scenes").num_rows == 5  # the current state: one row per scene
    # The rerun re-catalogued and re-judged everything but wrote no unchanged row again: a reader
    # of the raw Parquet (the history) sees each scene and pair once.
    assert read_table(store, "scenes", current=False).num_rows == 5
    assert read_table(store, "pairs", current=False).num_rows == read_table(store, "pairs").num_rows
    assert summary["labels_merged_this_run"] == 2
    for sid, mask in expected.items():
        merged = decode_image(store.read_bytes(f"label/{sid}.png"), grey=True)
        assert set(np.unique(merged)) <= {0, 255} and np.array_equal(merged > 0, mask)
    errors = read_table(store, "errors").to_pylist()
    msgs = {e["item"]: e["message"] for e in errors if e["stage"] == "labels"}
    assert msgs[bad] == "label maps are 256x257 but the slice crop is 256x256"
    assert "not an accepted slice" in msgs["not_a_slice"]
    # The current errors: the scene errors (once each, though both runs hit them) plus the two
    # label errors.
    assert len(errors) == before_errors + 2


def test_a_rerun_judges_again_the_slices_another_screen_judged(local_run, tmp_path, capsys):
    """An output written by an older release: some slices recorded by other screening rules, some
    from before the column existed. A rerun registers and screens exactly those again (their
    verdicts and residuals are this screen's), leaves the rest, and writes the same crops; the next
    rerun has nothing to do."""
    archive, shared_out, _ = local_run
    out = tmp_path / "out"
    shutil.copytree(shared_out, out)
    store = Store(str(out))
    meta = read_table(store, "metadata").to_pylist()
    assert {m["screen_rules"] for m in meta} == {screen_rules()}
    ids = sorted(m["slice_id"] for m in meta)
    older, legacy = set(ids[0::3]), set(ids[1::3])      # every third slice each; the rest as they were
    assert older and legacy and len(ids) > len(older | legacy)
    # The older release's rows: the same rows (written later, so they are the current state), the
    # one by other rules, the other without the column at all. Their run id is the largest of its
    # second, a second ahead of this clock (a writer whose clock ran ahead; or one in the rerun's own
    # second whose suffix drew larger, as in a CI run): the rerun's rows must still supersede them.
    run_id = time.strftime("%Y%m%dT%H%M%S", time.gmtime(time.time() + 1)) + "-ffffff"
    assert run_id > max(m["run_id"] for m in meta)
    write_table_shard(store, "metadata", [{**m, "screen_rules": "0123456789"} for m in meta
                                          if m["slice_id"] in older], METADATA_SCHEMA, run_id)
    legacy_rows = pa.Table.from_pylist([{**m, "run_id": run_id} for m in meta if m["slice_id"] in legacy],
                                       schema=with_run_id(METADATA_SCHEMA)).drop_columns(["screen_rules"])
    pq.write_table(legacy_rows.replace_schema_metadata(with_run_id(METADATA_SCHEMA).metadata),
                   str(out / "metadata" / f"part-{run_id}-legacy.parquet"))
    crops = {p.relative_to(out): p.read_bytes() for d in ("A", "B") for p in sorted((out / d).glob("*.png"))}
    assert crops
    capsys.readouterr()

    summary = run(small_job(archive, out), PairingConfig(reference_date="2021-01-01"), RegistrationConfig(crop_size=CROP))
    assert summary["slices_this_run"] == len(older | legacy)
    assert summary["slices_skipped_as_finished"] == len(ids) - len(older | legacy)
    assert f"{len(older | legacy)} slice(s) recorded by other screening rules" in capsys.readouterr().out
    now = {m["slice_id"]: m for m in read_table(store, "metadata").to_pylist()}
    assert sorted(now) == ids and {m["screen_rules"] for m in now.values()} == {screen_rules()}
    redone = {m["slice_id"] for m in now.values() if m["run_id"] == summary["run_id"]}
    assert redone == older | legacy
    for m in meta:     # the same screen judged them, so the same verdicts and figures
        assert (now[m["slice_id"]]["status"], now[m["slice_id"]]["residual_px"]) == (m["status"], m["residual_px"])
    assert {p.relative_to(out): p.read_bytes() for d in ("A", "B") for p in sorted((out / d).glob("*.png"))} == crops

    again = run(small_job(archive, out), PairingConfig(reference_date="2021-01-01"), RegistrationConfig(crop_size=CROP))
    assert again["slices_this_run"] == 0 and again["slices_skipped_as_finished"] == len(ids)


@pytest.mark.slow
def test_s3_in_s3_out(s3_bucket, ray_session, s3_client):
    for year in ("2017", "2020"):
        s3_client.upload_file(str(NAIP[year]), s3_bucket, f"archive/{NAIP[year].name}")
    s3_client.put_object(Bucket=s3_bucket, Key="archive/broken_20200101.tif", Body=b"II*\x00garbage")
    out = f"s3://{s3_bucket}/out"
    summary = run(small_job(f"s3://{s3_bucket}/archive", out), PairingConfig(reference_date="2021-01-01"),
                  RegistrationConfig(crop_size=CROP, method="per-slice"))
    assert summary["slices_this_run"] == 6
    store = Store(out)
    meta = read_table(store, "metadata").to_pylist()
    # Streamed in small shards by the tasks, folded by the driver into one shard.
    assert len(store.list("metadata")) == 1
    assert {m["pre_date"] for m in meta} == {"2017-08-27"}
    ok = [m for m in meta if m["status"] == "accepted"]
    assert ok and all(store.exists(f"A/{m['slice_id']}.png") and store.exists(f"B/{m['slice_id']}.png")
                      for m in ok)
    errs = read_table(store, "errors").to_pylist()
    assert [e["item"] for e in errs] == [f"s3://{s3_bucket}/archive/broken_20200101.tif"]
    # The tables read straight from S3 with plain pyarrow (AWS_ENDPOINT_URL is honoured).
    t = pq.read_table(f"{out.replace('s3://', '')}/metadata", filesystem=_s3fs())
    assert t.num_rows == 6


def _s3fs():
    import os
    from urllib.parse import urlparse

    import pyarrow.fs as pafs
    ep = urlparse(os.environ["AWS_ENDPOINT_URL"])
    return pafs.S3FileSystem(endpoint_override=ep.netloc, scheme=ep.scheme, region="us-east-1")


def _manifest(path, names, extra=""):
    path.write_text("uri,acquired\n" + "".join(f"{NAIP[n]},\n" for n in names) + extra)
    return path


@pytest.mark.slow
def test_two_manifest_chunks_into_one_output_keep_both_chunks(tmp_path, ray_session):
    out = tmp_path / "out"
    (tmp_path / "broken_20190101.tif").write_bytes(b"II*\x00garbage")
    one = _manifest(tmp_path / "chunk1.csv", ["2016", "2020"], f"{tmp_path / 'broken_20190101.tif'},\n")
    two = _manifest(tmp_path / "chunk2.csv", ["2017"], "/nonexistent/gone_20190101.tif,\n")
    pairing = PairingConfig(reference_date="2021-01-01")
    reg = RegistrationConfig(crop_size=CROP)
    first = run(small_job(one, out, stride=512), pairing, reg)
    second = run(small_job(two, out, stride=512), pairing, reg)
    store = Store(str(out))
    runs = {first["run_id"], second["run_id"]}
    scenes = read_table(store, "scenes").to_pylist()
    assert sorted(s["acquired"][:4] for s in scenes) == ["2016", "2017", "2020"]
    # Chunk 2's scene pairs with chunk 1's scenes: three pairs, judged once each.
    pairs = read_table(store, "pairs").to_pylist()
    assert len(pairs) == 3 and {p["run_id"] for p in pairs} == runs
    assert read_table(store, "pairs", current=False).num_rows == 3
    meta = read_table(store, "metadata").to_pylist()
    assert {m["run_id"] for m in meta} == runs and len(meta) == 3 * 4
    assert len({m["slice_id"] for m in meta}) == len(meta)
    errors = {e["item"].rsplit("/", 1)[-1] for e in read_table(store, "errors").to_pylist()}
    assert errors == {"broken_20190101.tif", "gone_20190101.tif"}
    accepted = {f"{m['slice_id']}.png" for m in meta if m["status"] == "accepted"}
    listed = {n for s in ("train", "val", "test") for n in store.read_bytes(f"list/{s}.txt").decode().split()}
    assert listed == accepted
    # Another seed would draw this output's locations into other splits: refused, nothing written.
    with pytest.raises(SystemExit, match="different splits"):
        run(small_job(two, out, stride=512, seed=7), pairing, reg)
    assert {r["run_id"] for r in read_table(store, "runs").to_pylist()} == runs


class _Killed(RuntimeError):
    pass


@pytest.mark.slow
def test_run_killed_mid_graph_keeps_finished_rows_and_rerun_duplicates_nothing(tmp_path, ray_session,
                                                                              monkeypatch):
    import sys

    import ray

    archive = tmp_path / "archive"
    archive.mkdir()
    for year in ("2016", "2017", "2020"):
        shutil.copy(NAIP[year], archive / NAIP[year].name)
    out = tmp_path / "out"
    pairing = PairingConfig(reference_date="2021-01-01")
    reg = RegistrationConfig(crop_size=CROP)
    real_wait = ray.wait
    seen, in_flight = [], []

    def wait_then_die(refs, *args, **kw):
        ready, rest = real_wait(refs, *args, **kw)
        if sys._getframe(1).f_globals["__name__"] == "operators.pairs.regional.regional_ops" and ready:
            seen.extend(ready)
            in_flight.extend(rest)
            raise _Killed("driver killed while the regional graph runs")
        return ready, rest

    monkeypatch.setattr(ray, "wait", wait_then_die)
    with pytest.raises(_Killed):  # one pair per window: three windows, two in flight
        run(small_job(archive, out, window_slices=6), pairing, reg)
    monkeypatch.setattr(ray, "wait", real_wait)
    # The job cancelled the tasks still in flight; a cancellation lands asynchronously (on a loaded
    # machine a running task can still finish its rows first), so the state is read once every one
    # has ended, as it would be read after a real driver's death.
    ended, _ = real_wait(in_flight, num_returns=len(in_flight), timeout=300)
    assert len(ended) == len(in_flight), "a cancelled slice task had not ended after 300 s"
    store = Store(str(out))
    kept = read_table(store, "metadata")
    # Every slice task that had finished when the driver died left its rows (>= 1 slice each).
    assert seen and kept is not None and kept.num_rows >= len(seen)

    summary = run(small_job(archive, out, window_slices=6), pairing, reg)
    assert summary["slices_skipped_as_finished"] == kept.num_rows
    history = read_table(store, "metadata", current=False).to_pylist()
    ids = [m["slice_id"] for m in history]
    assert len(ids) == len(set(ids)) == 3 * 6  # every slice once, over both runs
    accepted = sorted(m["slice_id"] for m in history if m["status"] == "accepted")
    for folder in ("A", "B"):
        assert sorted(r.split("/")[-1][:-4] for r in store.list(folder)) == accepted
    # The tile audit of every window of the rerun that had slices to fit.
    assert store.exists(f"_work/tile_runs/{summary['run_id']}.json")


@pytest.mark.slow
def test_rerun_with_other_bands_recomputes_matches_and_verdicts(tmp_path, ray_session):
    """Finished slices are skipped only under the settings and inputs that decided them: other
    --rgb-bands redo every slice and its tiles' matches (stored under a new inputs hash)."""
    archive = tmp_path / "archive"
    archive.mkdir()
    for year in ("2016", "2020"):
        shutil.copy(NAIP[year], archive / NAIP[year].name)
    out = tmp_path / "out"
    pairing, reg = PairingConfig(reference_date="2021-01-01"), RegistrationConfig(crop_size=CROP)
    first = run(small_job(archive, out), pairing, reg)
    n = first["slices_this_run"]
    assert n == 6
    again = run(small_job(archive, out), pairing, reg)
    assert again["slices_this_run"] == 0 and again["slices_skipped_as_finished"] == n
    other = run(small_job(archive, out, rgb_bands=(4, 3, 2)), pairing, reg)
    assert other["slices_this_run"] == n and other["slices_skipped_as_finished"] == 0
    meta = read_table(Store(str(out)), "metadata").to_pylist()
    hist = read_table(Store(str(out)), "metadata", current=False).to_pylist()
    assert len(meta) == n and len(hist) == 2 * n
    assert len({m["settings_key"] for m in hist}) == 2 * n    # per slice, per setting
    work = {p.parent.name for p in (out / "_work" / "guided").glob("*/*/*.npz")}
    assert len(work) == 2, work                # one pair, two inputs hashes
