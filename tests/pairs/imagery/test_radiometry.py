"""8-bit conversion: per-scene stretch and percentiles."""
from __future__ import annotations

import numpy as np
import pytest
import rasterio

from operators.pairs.imagery.radiometry import (band_percentiles, percentiles_of, scene_stretch,
                                               to_uint8)
from tests.conftest import DATA


def test_uint16_to_uint8_uses_scene_stretch():
    data = np.array([[[100, 200, 300, 40000]]], dtype=np.uint16)
    out = to_uint8(data, [[100, 300]])
    assert out.shape == (1, 4, 1) and out.dtype == np.uint8
    assert out[0, :, 0].tolist() == [0, 128, 255, 255]
    valid = np.array([[True, True, False, True]])
    assert to_uint8(data, [[100, 300]], valid)[0, 2, 0] == 0
    # Percentiles ignore invalid (nodata) pixels.
    d = np.zeros((1, 10, 10), np.uint16)
    d[0, :, 5:] = np.arange(50).reshape(10, 5) + 1000
    v = d[0] > 0
    lo, hi = band_percentiles(d, v, (0, 100))[0]
    assert (lo, hi) == (1000.0, 1049.0)


def test_real_uint16_band_stretch_is_per_scene():
    uri = str(DATA / "uint16" / "l8_B4.tif")
    [[lo, hi]] = scene_stretch(uri)
    with rasterio.open(uri) as src:
        full = src.read(1)
    assert np.percentile(full, 2) == pytest.approx(lo, rel=0.05)
    assert np.percentile(full, 98) == pytest.approx(hi, rel=0.05)
    wa, wb = full[:100, :100], full[300:400, 300:400]
    a = to_uint8(wa[None], [[lo, hi]])[:, :, 0]
    b = to_uint8(wb[None], [[lo, hi]])[:, :, 0]
    assert a.dtype == b.dtype == np.uint8
    # The scene's linear mapping, computed independently, in both windows.
    for window, out in ((wa, a), (wb, b)):
        expect = np.clip(np.rint(255 * (window.astype(float) - lo) / (hi - lo)), 0, 255)
        assert np.abs(out.astype(int) - expect).max() <= 1
    # Same value, same byte, wherever the slice is: a DN present in both windows.
    shared = np.intersect1d(wa, wb)
    assert shared.size
    v = shared[len(shared) // 2]
    assert set(a[wa == v].tolist()) == set(b[wb == v].tolist()) and len(set(a[wa == v].tolist())) == 1


def test_histogram_percentiles_equal_numpys():
    """The 8/16-bit histogram path gives np.percentile's linear interpolation exactly (ranks
    between two values, one value, a tail of equal values); other types go to numpy itself."""
    rng = np.random.default_rng(0)
    q = [0, 1, 2, 37.5, 50, 98, 99, 100]
    for dtype, top in ((np.uint8, 256), (np.uint16, 65536), (np.uint16, 40)):
        for n in (1, 2, 7, 1000, 20000):
            v = rng.integers(0, top, n).astype(dtype)
            np.testing.assert_allclose(percentiles_of(v, q), np.percentile(v.astype(float), q),
                                       rtol=0, atol=1e-9)
    tail = np.array([3] + [200] * 50, np.uint8)
    np.testing.assert_allclose(percentiles_of(tail, q), np.percentile(tail.astype(float), q))
    f = rng.random(500).astype(np.float32)
    np.testing.assert_allclose(percentiles_of(f, q), np.percentile(f.astype(float), q))


def test_float_scene_without_nodata_tag_stretches_over_its_finite_pixels(tmp_path):
    """A float32 GeoTIFF with no nodata tag whose gaps are NaN (GDAL's dataset mask calls every
    pixel valid): the stretch comes from the finite pixels, never NaN."""
    data = np.full((1, 40, 40), np.nan, np.float32)
    data[0, :, 20:] = np.linspace(0.1, 0.5, 800, dtype=np.float32).reshape(40, 20)
    path = tmp_path / "gaps.tif"
    with rasterio.open(path, "w", driver="GTiff", width=40, height=40, count=1,
                       dtype="float32") as dst:
        dst.write(data)
    [[lo, hi]] = scene_stretch(str(path), percentiles=(0, 100))
    assert (lo, hi) == pytest.approx((0.1, 0.5))


def test_local_unit_by_tables_is_the_float_path_to_the_bit():
    """8- and 16-bit bands are normalised by table lookups and histogram medians: the grey (and
    SIFT's 8-bit image of it) equals the per-pixel float path's exactly, one band or three,
    with nodata, saturation, clouds and an even or odd count of usable pixels, by CLAHE or the
    percentile stretch, so features and fits do not move."""
    from operators.pairs.imagery.radiometry import _local_unit_float, _to_u8, local_unit

    rng = np.random.default_rng(3)
    for trial in range(24):
        h, w = (int(v) for v in rng.integers(40, 260, 2))
        dtype = (np.uint8, np.uint16)[trial % 2]
        top = np.iinfo(dtype).max
        data = rng.integers(0, top + 1 if trial % 3 else 700, (1 + 2 * (trial % 4 == 3), h, w))
        data = data.astype(dtype)
        data[:, :5] = top                                    # saturated rows
        valid = rng.random((h, w)) > (0.3 if trial % 2 else 0.0)
        cloud = rng.random((h, w)) > 0.9 if trial % 5 == 0 else None
        for method in ("clahe", "percentile"):
            for v in (valid, None):
                ref = _local_unit_float(data, v, method, (1.0, 99.0), 2.0, 64, cloud, 64)
                grey = local_unit(data, v, method, (1.0, 99.0), 2.0, 64, cloud)
                image = local_unit(data, v, method, (1.0, 99.0), 2.0, 64, cloud, as_uint8=True)
                assert grey.dtype == np.float32 and image.dtype == np.uint8
                np.testing.assert_array_equal(grey, ref)
                np.testing.assert_array_equal(image, _to_u8(ref))
    tiny = np.ones((1, 4, 4), np.uint16)
    assert not local_unit(tiny, None, as_uint8=True).any()
