"""The change-proposal cores on a synthetic pair whose change is known: textured ground, a bright new
roof in the post image, sensor noise and a global brightness shift (which none may call change)."""
import numpy as np
import pytest

from operators.annotation.proposals import METHODS, otsu_threshold, propose, separability


def synthetic_pair(h=61, w=83, seed=0):
    rng = np.random.default_rng(seed)
    ground = rng.normal(100, 12, (h, w, 3))
    a = ground + rng.normal(0, 3, (h, w, 3))
    b = ground * 1.05 + 4 + rng.normal(0, 3, (h, w, 3))     # illumination change, not a change
    truth = np.zeros((h, w), bool)
    truth[20:40, 30:55] = True
    b[truth] = (220, 200, 190)
    return np.clip(a, 0, 255).astype(np.uint8), np.clip(b, 0, 255).astype(np.uint8), truth


@pytest.mark.parametrize("method", METHODS)
def test_each_method_finds_the_new_roof(method):
    a, b, truth = synthetic_pair()
    p = propose(method, a, b)
    assert p.mask.shape == truth.shape and p.mask.dtype == bool
    tp = (p.mask & truth).sum()
    f1 = 2 * tp / (p.mask.sum() + truth.sum())
    assert f1 > 0.9, f1
    assert 0.5 < p.score <= 1.0


def test_otsu_and_separability_on_a_two_level_sample():
    v = np.r_[np.full(300, 10.0), np.full(100, 50.0)]
    t = otsu_threshold(v)
    assert 10 < t <= 50
    assert separability(v, v > t) == pytest.approx(1.0)
    assert separability(v, np.zeros_like(v, bool)) == 0.0


def test_shape_mismatch_and_unknown_method_are_errors():
    a, b, _ = synthetic_pair()
    with pytest.raises(ValueError, match="differ in shape"):
        propose("cva", a, b[:-1])
    with pytest.raises(ValueError, match="unknown proposal method"):
        propose("magic", a, b)
