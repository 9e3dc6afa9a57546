"""Regional registration: features once per tile of a scene pair, one homography per slice.

The paper's slices (3000 px at stride 1024) overlap so much that every pixel sits in about nine of
them; SIFT per slice extracts the same features nine times. Here the pair's common grid is cut into
feature tiles (``tile_size`` px, anchored at the grid origin) and the work runs in two tile passes:

1. features: SIFT on each date's tile plus ``tile_context_px`` (so SIFT sees past the edge),
   keeping only keypoints that lie in the tile's core, so every feature of either date belongs to
   exactly one tile and is computed once (``TileFeatures``: points + uint8 descriptors);
2. matches: the tile's pre features (with guided matching, a sample of them: this pass only
   feeds the prior) are FLANN-matched (ratio test) against the post features of
   the tile and its neighbours lying within ``search_margin_px`` of the core, so the true partner
   is a candidate even when the dates are misaligned by up to the margin (geocoding error, ~40-100
   px in S2Looking). Only the matched point pairs (common-grid coordinates plus descriptor
   distance) are kept (``TileMatches``).
3. guided matches (``guided_matching``, default on): the pair's first-pass matches give an affine
   prior per pair and per tile neighbourhood (``guided_matching``); each tile's pre features are
   matched again against the post features near their predicted position, which keeps many more
   correct matches between dates years apart than a ratio test against the whole search window.

A slice then gathers the (guided) matches of the tiles it overlaps, keeps those whose pre point
lies inside the slice window (the pre slice is the reference; its partner may lie outside the
window when the dates are misaligned), fits its own RANSAC homography, and reads only the pixels
its kept crop needs.

Everything here is pure: numpy in, numpy out. ``regional_ops`` does the reading and the Ray work.
"""
from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import numpy as np

from operators.pairs.registration.guided_matching import MatchPrior, chance_rate, guided_match, prior_sample
from operators.pairs.registration.tiles import grow, inside, tile_core, tiles_for_window
from operators.pairs.registration.registration import (HomographyFit, RegistrationConfig, checked_fit,
                                                       detect_features, match_descriptors)


@dataclass
class TileMatches:
    """Matched point pairs in common-grid pixel coordinates (pixel centres at integers)."""

    pre_xy: np.ndarray     # (N, 2) float32
    post_xy: np.ndarray    # (N, 2) float32
    distance: np.ndarray   # (N,) float32 descriptor distance of the best match
    # (N,) float32: per guided match, the measured chance that a wrong partner chosen near its
    # prediction lands within the RANSAC threshold (``chance_rate``); None: not measured.
    chance: Optional[np.ndarray] = None

    def __len__(self) -> int:
        return int(len(self.pre_xy))

    @classmethod
    def empty(cls) -> "TileMatches":
        return cls(np.zeros((0, 2), np.float32), np.zeros((0, 2), np.float32),
                   np.zeros(0, np.float32))

    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        extra = {} if self.chance is None else {"chance": self.chance}
        np.savez_compressed(buf, pre_xy=self.pre_xy, post_xy=self.post_xy, distance=self.distance,
                            **extra)
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> "TileMatches":
        with np.load(io.BytesIO(data)) as z:
            chance = z["chance"].astype(np.float32) if "chance" in z.files else None
            return cls(z["pre_xy"].astype(np.float32), z["post_xy"].astype(np.float32),
                       z["distance"].astype(np.float32), chance)

    @classmethod
    def concat(cls, parts: Iterable["TileMatches"]) -> "TileMatches":
        parts = [p for p in parts if len(p)]
        if not parts:
            return cls.empty()
        chance = None if any(p.chance is None for p in parts) else \
            np.concatenate([p.chance for p in parts])
        return cls(np.concatenate([p.pre_xy for p in parts]),
                   np.concatenate([p.post_xy for p in parts]),
                   np.concatenate([p.distance for p in parts]), chance)


# ---- tile geometry --------------------------------------------------------------------------

def tile_read_window(tile_col: int, tile_row: int, cfg: RegistrationConfig):
    """Window to read (either date) for a tile's features, on the common grid."""
    return grow(tile_core(tile_col, tile_row, cfg.tile_size), cfg.tile_context_px)


def search_window(tile_col: int, tile_row: int, cfg: RegistrationConfig):
    """Where the post partners of a tile's pre features may lie."""
    return grow(tile_core(tile_col, tile_row, cfg.tile_size), cfg.search_margin_px)


def neighbour_tiles(tile_col: int, tile_row: int, cfg: RegistrationConfig) -> list[tuple[int, int]]:
    """Tiles whose post features can match this tile's pre features (incl. the tile itself)."""
    return tiles_for_window(search_window(tile_col, tile_row, cfg), cfg.tile_size)


# ---- per tile -------------------------------------------------------------------------------

@dataclass
class TileFeatures:
    """SIFT features of both dates whose keypoints lie in one tile's core (common-grid coords)."""

    pre_xy: np.ndarray     # (N, 2) float32
    pre_desc: np.ndarray   # (N, 128) uint8
    post_xy: np.ndarray    # (M, 2) float32
    post_desc: np.ndarray  # (M, 128) uint8

    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        # Descriptors are near-incompressible; plain npz is faster to write and read.
        np.savez(buf, pre_xy=self.pre_xy, pre_desc=self.pre_desc, post_xy=self.post_xy,
                 post_desc=self.post_desc)
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> "TileFeatures":
        with np.load(io.BytesIO(data)) as z:
            return cls(z["pre_xy"], z["pre_desc"], z["post_xy"], z["post_desc"])


def core_features(grey: np.ndarray, valid: np.ndarray, read_window: Sequence[int],
                  core: Sequence[int], cfg: RegistrationConfig) -> tuple[np.ndarray, np.ndarray]:
    """SIFT on a tile read with context; keeps keypoints in the core, in common-grid coords."""
    xy, desc = detect_features(grey, valid, cfg)
    xy = xy + np.float32(read_window[:2])
    keep = inside(xy, core)
    return xy[keep], desc[keep]


def tile_features(pre_grey: np.ndarray, pre_valid: np.ndarray, post_grey: np.ndarray,
                  post_valid: np.ndarray, read_window: Sequence[int], core: Sequence[int],
                  cfg: RegistrationConfig) -> TileFeatures:
    """Both dates' features of one tile; both arrays cover ``read_window`` on the common grid."""
    return block_features(pre_grey, pre_valid, post_grey, post_valid, read_window, [core],
                          cfg)[0]


def block_features(pre_grey: np.ndarray, pre_valid: np.ndarray, post_grey: np.ndarray,
                   post_valid: np.ndarray, read_window: Sequence[int],
                   cores: Sequence[Sequence[int]], cfg: RegistrationConfig) -> list[TileFeatures]:
    """Features of several tiles from one SIFT run per date over ``read_window`` (their cores
    plus context): each tile keeps the keypoints in its core. Adjacent tiles need no context
    of their own along their shared edges, so the pyramid there is computed once."""
    pre_xy, pre_desc = detect_features(pre_grey, pre_valid, cfg)
    post_xy, post_desc = detect_features(post_grey, post_valid, cfg)
    origin = np.float32(read_window[:2])
    pre_xy, post_xy = pre_xy + origin, post_xy + origin
    out = []
    for core in cores:
        a, b = inside(pre_xy, core), inside(post_xy, core)
        out.append(TileFeatures(pre_xy[a], pre_desc[a], post_xy[b], post_desc[b]))
    return out


def search_pool(neighbours: Iterable[TileFeatures], tile_col: int, tile_row: int,
                cfg: RegistrationConfig) -> tuple[np.ndarray, np.ndarray]:
    """Post features of the neighbourhood that lie in the tile's search window."""
    pool = [(n.post_xy, n.post_desc) for n in neighbours if len(n.post_xy)]
    if not pool:
        return np.zeros((0, 2), np.float32), np.zeros((0, 128), np.uint8)
    post_xy = np.concatenate([p[0] for p in pool])
    post_desc = np.concatenate([p[1] for p in pool])
    keep = inside(post_xy, search_window(tile_col, tile_row, cfg))
    return post_xy[keep], post_desc[keep]


def match_tile(own: TileFeatures, neighbours: Iterable[TileFeatures], tile_col: int,
               tile_row: int, cfg: RegistrationConfig, sample: bool = False) -> TileMatches:
    """Match a tile's pre features against the post features within its search window.

    ``neighbours`` are the TileFeatures of ``neighbour_tiles`` (the tile itself included).
    ``sample``: the first pass of guided matching, which feeds only the prior: at most
    ``prior_features_per_tile`` pre features are matched (:func:`prior_sample`).
    """
    if len(own.pre_xy) == 0:
        return TileMatches.empty()
    pre_xy, pre_desc = own.pre_xy, own.pre_desc
    pick = prior_sample(len(pre_xy), cfg) if sample else None
    if pick is not None:
        pre_xy, pre_desc = pre_xy[pick], pre_desc[pick]
    post_xy, post_desc = search_pool(neighbours, tile_col, tile_row, cfg)
    qi, ti, dist = match_descriptors(pre_desc, post_desc, cfg)
    return TileMatches(pre_xy[qi].astype(np.float32), post_xy[ti].astype(np.float32),
                       dist.astype(np.float32))


def guided_match_tile(own: TileFeatures, neighbours: Iterable[TileFeatures], tile_col: int,
                      tile_row: int, prior: MatchPrior, cfg: RegistrationConfig) -> TileMatches:
    """Second pass: a tile's pre features against the post features near their predicted place.

    Without a usable prior (too few first-pass matches in the whole pair) the first pass's
    matching is repeated on every feature, so a slice always has its matches from one pass.
    """
    affine = prior.for_tile(tile_col, tile_row)
    if affine is None:
        return match_tile(own, neighbours, tile_col, tile_row, cfg)
    if len(own.pre_xy) == 0:
        return TileMatches.empty()
    post_xy, post_desc = search_pool(neighbours, tile_col, tile_row, cfg)
    qi, ti, dist = guided_match(own.pre_xy, own.pre_desc, post_xy, post_desc, affine, cfg)
    A = np.asarray(affine, np.float64)
    pred = own.pre_xy[qi].astype(np.float64) @ A[:, :2].T + A[:, 2]
    return TileMatches(own.pre_xy[qi].astype(np.float32), post_xy[ti].astype(np.float32),
                       dist.astype(np.float32), chance_rate(pred, post_xy, cfg).astype(np.float32))


# ---- per slice ------------------------------------------------------------------------------

def slice_matches(matches: TileMatches, window: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(post_xy, pre_xy) in slice coordinates for matches whose pre point is inside the slice."""
    keep = inside(matches.pre_xy, window)
    offset = np.float32(window[:2])
    return matches.post_xy[keep] - offset, matches.pre_xy[keep] - offset


def slice_chance_rate(matches: TileMatches, window: Sequence[int]) -> Optional[float]:
    """The chance rate of a wrong match in the slice: the mean of its matches' measured rates
    (``TileMatches.chance``), or None when they were not measured."""
    if matches.chance is None:
        return None
    rates = matches.chance[inside(matches.pre_xy, window)]
    rates = rates[np.isfinite(rates)]
    return float(rates.mean()) if len(rates) else None


def fit_slice(matches: TileMatches, window: Sequence[int], cfg: RegistrationConfig) -> HomographyFit:
    """One RANSAC homography (post-slice -> pre-slice) from the regional matches in a slice; the
    chance its inliers must beat is measured on the slice's own keypoints where guided matching
    measured it (:func:`slice_chance_rate`)."""
    post_xy, pre_xy = slice_matches(matches, window)
    return checked_fit(post_xy, pre_xy, int(window[2]), cfg, slice_chance_rate(matches, window))
