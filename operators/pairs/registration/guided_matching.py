"""Guided matching: re-match features near where a pair-level prior says their partner lies.

Lowe's ratio test compares a feature's best partner with its second best among *all* candidates.
Between dates years apart (fields re-ploughed, trees grown, cloud), a correct partner is rarely
twice as close as the best of thousands of look-alikes, so the test throws most correct matches
away: on the real NAIP 2016/2020 pair a 384 px slice keeps a median of 11 correct matches, too few
for a homography. Once the pair's geometry is roughly known, the look-alikes that matter are only
those near the predicted position; the same test among the candidates within ``guided_radius_px``
keeps ten times more correct matches (median 160 per slice on that pair).

The prior comes from the first, unguided pass (ratio matches within each tile's search window,
of a sample of each tile's pre features, :func:`prior_sample`):

* pair level: a RANSAC affine (pre -> post, common-grid pixels) over all the pair's matches;
* tile level: the same fit on the matches whose pre point lies within one tile of the tile's core,
  used when it has enough inliers and is a plausible between-dates mapping; the local fit follows
  relief displacement and off-nadir differences across a large scene that a single affine misses.

Pure numpy/OpenCV/SciPy; ``regional`` and ``regional_ops`` wire it into the tile graph.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional

import cv2
import numpy as np
from scipy.spatial import cKDTree

from operators.pairs.registration.registration import RegistrationConfig, seed_flann
from operators.pairs.registration.tiles import grow, inside, tile_core

Cell = tuple[int, int]


@dataclass
class MatchPrior:
    """Affine maps pre -> post (2x3, common-grid pixels): one for the pair, one per tile where the
    tile's neighbourhood supports its own."""

    pair: Optional[np.ndarray]                       # None: no usable prior, guided = unguided
    pair_inliers: int = 0
    tiles: dict[Cell, np.ndarray] = field(default_factory=dict)

    def for_tile(self, tile_col: int, tile_row: int) -> Optional[np.ndarray]:
        return self.tiles.get((int(tile_col), int(tile_row)), self.pair)

    def to_bytes(self) -> bytes:
        doc = {"pair": None if self.pair is None else self.pair.tolist(),
               "pair_inliers": self.pair_inliers,
               "tiles": [[c, r, A.tolist()] for (c, r), A in sorted(self.tiles.items())]}
        return json.dumps(doc).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "MatchPrior":
        doc = json.loads(data)
        pair = None if doc["pair"] is None else np.asarray(doc["pair"], np.float64)
        return cls(pair, int(doc["pair_inliers"]),
                   {(int(c), int(r)): np.asarray(A, np.float64) for c, r, A in doc["tiles"]})


def robust_affine(pre_xy: np.ndarray, post_xy: np.ndarray, threshold_px: float,
                  seed: int) -> tuple[Optional[np.ndarray], int]:
    """RANSAC affine pre -> post; (2x3, inlier count) or (None, 0)."""
    if len(pre_xy) < 3:
        return None, 0
    seed_flann(seed)  # cv2's RANSAC draws from the same per-thread RNG: same input, same fit
    A, inliers = cv2.estimateAffine2D(np.asarray(pre_xy, np.float64).reshape(-1, 1, 2),
                                      np.asarray(post_xy, np.float64).reshape(-1, 1, 2),
                                      method=cv2.RANSAC, ransacReprojThreshold=float(threshold_px),
                                      maxIters=5000, confidence=0.999, refineIters=10)
    if A is None or inliers is None or not np.all(np.isfinite(A)):
        return None, 0
    return A, int(inliers.sum())


def plausible_affine(A: np.ndarray, cfg: RegistrationConfig) -> bool:
    """Same bounds as a slice homography: orientation kept, scale and anisotropy limited."""
    M = np.asarray(A, np.float64)[:, :2]
    if np.linalg.det(M) <= 0:
        return False
    s = np.linalg.svd(M, compute_uv=False)
    return bool(s[0] <= cfg.max_scale_change and s[1] >= 1.0 / cfg.max_scale_change
                and s[0] / s[1] <= cfg.max_anisotropy)


def prior_sample(n_features: int, cfg: RegistrationConfig) -> Optional[np.ndarray]:
    """Indices of the pre features a tile's first pass matches, or None for all of them.

    That pass only feeds the affine prior (guided matching redoes every feature), and an affine
    over a pair (or a tile's neighbourhood) is fitted as well from a thousand matches per tile as
    from ten thousand: at most ``prior_features_per_tile``, taken at even steps through the
    detector's order (OpenCV sorts keypoints by position, so the sample spans the tile).
    Without guided matching the first pass is the final one and keeps every feature."""
    cap = int(cfg.prior_features_per_tile)
    if not cfg.guided_matching or cap <= 0 or n_features <= cap:
        return None
    return np.unique(np.linspace(0, n_features - 1, cap).round().astype(np.int64))


def sampled_prior_holds(prior: MatchPrior, cfg: RegistrationConfig) -> bool:
    """Whether a prior fitted to a sampled first pass is kept: it must rest on at least
    ``prior_sample_min_inliers`` pair-level inliers. Below that (a pair of few tiles, dates whose
    ratio test keeps a few % of the matches) a tenth of the features can give a weak or wrong
    consensus, and the pair's first pass is redone over every feature."""
    return prior.pair is not None and prior.pair_inliers >= int(cfg.prior_sample_min_inliers)


def first_pass_sampled(cfg: RegistrationConfig) -> bool:
    """Whether stored first-pass matches may hold a sample only (then they are never final)."""
    return bool(cfg.guided_matching and cfg.prior_features_per_tile > 0)


def fit_match_prior(pre_xy: np.ndarray, post_xy: np.ndarray, tiles: list[Cell],
                    cfg: RegistrationConfig) -> MatchPrior:
    """The pair's prior from its unguided matches (common-grid coordinates)."""
    pre_xy = np.asarray(pre_xy, np.float64).reshape(-1, 2)
    post_xy = np.asarray(post_xy, np.float64).reshape(-1, 2)
    A, n = robust_affine(pre_xy, post_xy, cfg.prior_ransac_px, cfg.flann_seed)
    if A is None or n < cfg.prior_min_inliers or not plausible_affine(A, cfg):
        return MatchPrior(None, n)
    prior = MatchPrior(A, n)
    ts = cfg.tile_size
    for tc, tr in tiles:
        # The tile and the ring of tiles around it: enough support, still local.
        near = inside(pre_xy, grow(tile_core(tc, tr, ts), ts))
        if near.sum() < cfg.prior_min_inliers:
            continue
        L, m = robust_affine(pre_xy[near], post_xy[near], cfg.prior_ransac_px, cfg.flann_seed)
        if L is not None and m >= cfg.prior_min_inliers and plausible_affine(L, cfg):
            prior.tiles[(int(tc), int(tr))] = L
    return prior


CHANCE_SHIFTS = ((4.0, 0.0), (-4.0, 0.0), (0.0, 4.0), (0.0, -4.0))  # wrong priors, in guided radii


def chance_rate(pred_xy: np.ndarray, post_xy: np.ndarray, cfg: RegistrationConfig) -> np.ndarray:
    """Per predicted position, the probability that a wrong guided match lands within the RANSAC
    threshold of the model, measured on this pool of post keypoints.

    A wrong partner is one of the ``guided_candidates`` post keypoints nearest the prediction
    (within ``guided_radius_px``), whichever the descriptors pick; it lands within the threshold
    as often as the candidates do. Keypoints crowd on texture, so on real imagery that is not
    (threshold / radius)^2: the nearest 8 lie closer than the radius. The prediction is moved by
    four wrong priors (``CHANCE_SHIFTS`` x the radius, so the true partner is never a candidate)
    and each position's rate is the mean, over the moves that find candidates, of the share of
    its candidates within the threshold (the expectation of a uniform pick: no draw, no noise).
    NaN where no move finds a candidate. Returns (N,) float64."""
    pred = np.asarray(pred_xy, np.float64).reshape(-1, 2)
    post = np.asarray(post_xy, np.float64).reshape(-1, 2)
    out = np.full(len(pred), np.nan)
    if len(pred) == 0 or len(post) == 0:
        return out
    r, t = float(cfg.guided_radius_px), float(cfg.ransac_threshold_px)
    k = int(min(cfg.guided_candidates, len(post)))
    moved = np.concatenate([pred + np.float64(s) * r for s in CHANCE_SHIFTS])
    d, _ = cKDTree(post).query(moved, k=k, distance_upper_bound=r)
    d = np.asarray(d).reshape(len(CHANCE_SHIFTS), len(pred), k)
    n_cand = np.isfinite(d).sum(axis=2)
    share = np.where(n_cand > 0, (d <= t).sum(axis=2) / np.maximum(n_cand, 1), np.nan)
    seen = n_cand.sum(axis=0) > 0
    out[seen] = np.nanmean(share[:, seen], axis=0)
    return out


def guided_match(pre_xy: np.ndarray, pre_desc: np.ndarray, post_xy: np.ndarray,
                 post_desc: np.ndarray, affine: np.ndarray,
                 cfg: RegistrationConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each pre feature against the post features within ``guided_radius_px`` of ``affine(pre)``.

    Ratio test among those candidates (the ``guided_candidates`` nearest to the prediction); a
    lone candidate (no ratio test possible) is kept only within ``guided_max_distance``. Matches
    are mutual nearest neighbours: the post feature is also closest, in descriptor distance, to
    this pre feature among every pre feature that has it as a candidate. So one post feature
    serves at most one pre feature. Returns (pre_idx, post_idx, distance).
    """
    empty = (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32))
    if len(pre_xy) == 0 or len(post_xy) == 0:
        return empty
    pred = cv2.transform(np.asarray(pre_xy, np.float64).reshape(-1, 1, 2),
                         np.asarray(affine, np.float64)).reshape(-1, 2)
    k = int(min(cfg.guided_candidates, len(post_xy)))
    _, idx = cKDTree(np.asarray(post_xy, np.float64)).query(
        pred, k=k, distance_upper_bound=float(cfg.guided_radius_px))
    idx = np.asarray(idx).reshape(len(pre_xy), k)
    present = idx < len(post_xy)                        # missing neighbours come back as n
    safe = np.where(present, idx, 0)
    qd = np.asarray(pre_desc, np.float32)
    td = np.asarray(post_desc, np.float32)
    dist = np.full(idx.shape, np.inf, np.float32)
    for start in range(0, len(qd), 2048):               # bounded memory: 2048 x k x 128 floats
        sl = slice(start, start + 2048)
        diff = td[safe[sl]] - qd[sl, None, :]
        dist[sl] = np.sqrt(np.einsum("nkd,nkd->nk", diff, diff))
    dist[~present] = np.inf
    order = np.argsort(dist, axis=1, kind="stable")
    rows = np.arange(len(pre_xy))
    best, second = dist[rows, order[:, 0]], (dist[rows, order[:, 1]] if k > 1
                                               else np.full(len(pre_xy), np.inf, np.float32))
    lone = ~np.isfinite(second)
    keep = np.isfinite(best) & np.where(lone, best <= cfg.guided_max_distance,
                                        best < cfg.guided_ratio * second)
    # Mutual: the smallest distance any pre feature has to each post feature (over all
    # candidate pairs, not only the pairs that passed the ratio test).
    reverse = np.full(len(post_xy), np.inf, np.float32)
    np.minimum.at(reverse, safe[present], dist[present])
    ti_all = safe[rows, order[:, 0]]
    keep &= best <= reverse[ti_all]
    qi, ti, d = rows[keep], ti_all[keep], best[keep]
    # Ties (two pre features at the same distance): the post feature goes to the first.
    o = np.lexsort((qi, d))
    _, first = np.unique(ti[o], return_index=True)
    sel = np.sort(o[first])
    return qi[sel].astype(np.int64), ti[sel].astype(np.int64), d[sel].astype(np.float32)
