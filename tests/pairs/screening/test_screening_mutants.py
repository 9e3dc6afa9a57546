"""Screening's accept rule at the two points CI's mutation sample (tools/mutation.py, seed 35) showed
untested: the quadrants are the crop's halves, and a window's support is any window two grid steps
away, in every direction. A file of its own beside test_screening.py (which other work edits)."""
from __future__ import annotations

import numpy as np

from operators.pairs.registration.registration import RegistrationConfig
from operators.pairs.screening.windows import AGREE_PX, WindowShift, confirmed, quadrants_reached, supported
from tests.pairs.screening.test_screening import CFG, C, pre_of, scene, screen  # noqa: F401 - scene: a fixture


def w(row, col, dx=0.5, dy=0.0):
    return WindowShift(64.0 * col, 64.0 * row, dx, dy, 0.9, row, col)


def test_quadrants_reached_are_the_halves_a_centre_lies_in_the_centre_line_counting_right_and_below():
    """Generated window centres on a crop (odd and even sides; 40 % of them on a centre line or a
    quarter pixel either side of it): the quadrants counted are those of the reference, a centre on the line x = w / 2 (y = h / 2)
    in the right (lower) half."""
    rng = np.random.default_rng(48)
    for _ in range(2000):
        W, H = (int(v) for v in rng.integers(16, 1100, 2))
        n = int(rng.integers(0, 7))
        near = [0.0, -0.25, 0.25]      # on the line, or a quarter pixel either side of it
        xs = np.where(rng.random(n) < 0.4, W / 2 + rng.choice(near, n), rng.uniform(0, W, n))
        ys = np.where(rng.random(n) < 0.4, H / 2 + rng.choice(near, n), rng.uniform(0, H, n))
        shifts = [WindowShift(float(x), float(y), 0.0, 0.0, 0.9, 0, 0) for x, y in zip(xs, ys)]
        halves = {("left" if 2 * x < W else "right", "top" if 2 * y < H else "bottom") for x, y in zip(xs, ys)}
        assert quadrants_reached(shifts, W, H) == len(halves), (W, H, xs, ys)


def test_support_comes_from_two_steps_away_in_every_direction():
    for dr, dc in ((-2, -2), (-2, -1), (-2, 0), (-1, 2), (0, 2), (1, 2), (2, 2), (2, -1), (-1, -2), (1, -2)):
        a, b = w(3, 3), w(3 + dr, 3 + dc)
        assert supported([a, b]) == [a, b], (dr, dc)
    a = w(3, 3)
    assert supported([a, w(4, 4)]) == [] and supported([a, w(3, 4)]) == []     # overlapping: no support
    assert supported([a, w(3, 5, dx=0.5 + AGREE_PX + 0.01)]) == []               # disagreeing
    assert supported([a, w(3, 5, dx=0.5 + AGREE_PX)]) == [a, w(3, 5, dx=0.5 + AGREE_PX)]
    assert supported([]) == []


def test_the_quadrants_are_the_crops_halves(scene):  # noqa: F811
    # Clouds over the right half (x >= 480): the windows seen lie left of the centre, in two quadrants,
    # whatever their spread across the left half.
    pre = pre_of(scene)
    valid = np.ones((C, C), bool)
    valid[:, 480:] = False
    r = screen(pre, pre, valid)
    assert r.reject_reason.startswith("insufficient evidence") and " in 2 quadrant(s) " in r.reject_reason


def test_a_corner_bound_exactly_at_the_limit_is_accepted(scene, monkeypatch):  # noqa: F811
    # The rule is value + k x SE <= the limit (issue 34): at the limit the crop passes, a hair above it
    # fails. The corner estimate is set, since a measured one never lands on the limit exactly.
    from operators.pairs.screening import screening

    pre = pre_of(scene)
    limit = CFG.max_residual_px
    for bound, accepted in ((limit, True), (limit + 1e-6, False)):
        monkeypatch.setattr(screening, "corner_residual",
                            lambda *a, b=bound, **k: screening.CornerEstimate(b - 2.0, 1.0, b))
        r = screen(pre, pre)
        assert (r.reject_reason is None) is accepted, (bound, r.reject_reason)
        if not accepted:
            assert r.reject_reason.startswith("residual") and "at a crop corner" in r.reject_reason


def test_a_group_is_windows_near_in_both_grid_directions_not_a_remainder_of_them():
    # Three agreeing displacements above the limit in one row (or one column), six grid steps apart: no
    # two are within two steps, so no region (`a.col % b.col` for the difference would join 1, 7, 13).
    calm = [w(r, c, 0.3, -0.2) for r in (0, 4, 8) for c in (0, 4, 8)]
    along_a_row = [w(3, 1, 12.0), w(3, 7, 12.2), w(3, 13, 11.8)]
    along_a_column = [w(1, 3, 12.0), w(7, 3, 12.2), w(13, 3, 11.8)]
    assert confirmed(calm + along_a_row, 8.0) == calm
    assert confirmed(calm + along_a_column, 8.0) == calm
    near = [w(3, 1, 12.0), w(3, 3, 12.2), w(3, 5, 11.8)]      # two steps apart each: one group
    assert confirmed(calm + near, 8.0) == calm + near


def test_holes_in_the_mask_do_not_pull_the_windows_to_zero(scene):  # noqa: F811
    # Masked pixels (clouds, nodata) sit at the same place in both dates: left at 0 in a window's
    # template they would match the post's 0s at no shift. Filled with the window's mean, the windows
    # measure the crop's real shift. A 16 px hole every 64 px: each window is 94 % usable.
    from operators.pairs.registration.registration import translation
    from tests.pairs.screening.test_screening import X0, Y0, post_from
    valid = np.ones((C, C), bool)
    for y in range(24, C, 64):
        for x in range(24, C, 64):
            valid[y:y + 16, x:x + 16] = False
    r = screen(pre_of(scene), post_from(scene, translation(X0 + 3, Y0 + 4)), valid)
    measured = [float(np.hypot(s.dx, s.dy)) for s in r.shifts]
    assert len(measured) >= 20
    assert abs(float(np.median(measured)) - 5.0) < 0.5, np.median(measured)


def test_each_shift_is_placed_at_its_windows_centre(scene):  # noqa: F811
    # The corner fields extrapolate from where the windows are: a centre half a pixel off
    # ((win / 1) / 2 for (win - 1) / 2) moves every corner estimate. Pixel centres are integers, so
    # a window starting at x covering win pixels is centred at x + (win - 1) / 2.
    from operators.pairs.screening.windows import window_starts
    r = screen(pre_of(scene), pre_of(scene))
    win = CFG.screen_window()
    starts = window_starts(C, win)
    assert len(r.measured) > 20
    for s in r.shifts + r.measured:
        assert (s.x, s.y) == (starts[s.col] + (win - 1) / 2, starts[s.row] + (win - 1) / 2), s


def test_nothing_measured_is_insufficient_evidence_even_when_no_share_is_asked(scene):  # noqa: F811
    # With --screen-min-assessed 0 the share test cannot fail; a crop whose textured windows all find
    # no match (an unrelated later date) must still be rejected for what it is: nothing assessed.
    from dataclasses import replace
    from operators.pairs.screening.screening import screen_alignment
    pre = pre_of(scene)
    post = np.random.default_rng(3).random((C, C), dtype=np.float32)
    r = screen_alignment(pre, post, np.ones((C, C), bool), replace(CFG, screen_min_assessed=0.0))
    assert r.n_windows > 0 and r.n_confident == 0
    assert r.reject_reason.startswith("insufficient evidence: 0% of the textured area assessed"), \
        r.reject_reason


# equivalent mutant: core/ReplaceBinaryOperator_Add_LShift on `grid = np.full((rows.max() + 3, cols.max() + 3, 2), np.nan)`: (<< 3 for + 3) the rows and columns are offset by 2, so their maximum m >= 2 and 8 m >= m + 3: the grid only grows, with NaN (no window) in the extra cells.
# equivalent mutant: core/ReplaceBinaryOperator_Add_Sub on `other = grid[rows + dr, cols + dc]`: (rows - dr, or cols - dc) the ring of offsets, max(|dr|, |dc|) == 2, is the same set mirrored, and a window is kept when any neighbour on the ring agrees (the OR over all of it): the same neighbours in another order (3,000 random grids, both mirrors: the same windows kept)
# equivalent mutant: core/ReplaceBinaryOperator_Mul_Pow on `if count[i, j] < win * win:     # unusable pixels take the window's mean`: (win ** win) the mean fill then runs on fully usable windows too, where np.where(valid, a, mean) with valid everywhere is a itself (same values, same dtype): only a copy more.
# equivalent mutant: core/ReplaceComparisonOperator_Lt_LtE on `if count[i, j] < win * win:     # unusable pixels take the window's mean`: with count[i, j] == win * win every pixel is usable, and np.where(valid, a, mean) with valid everywhere is a itself (same values, same dtype)
# equivalent mutant: core/ReplaceComparisonOperator_Lt_NotEq on `if count[i, j] < win * win:     # unusable pixels take the window's mean`: count[i, j] counts usable pixels of the window, never more than win * win, so != and < agree
# equivalent mutant: core/ReplaceComparisonOperator_Lt_LtE on `return mean2 - mean * mean < FLAT_STD * FLAT_STD`: they differ only on a window whose variance is exactly 1e-6 in float64 (a box filter's sums of float32 grey), a set of measure zero; the generated test leaves windows within 1e-9 of the boundary out for the same reason
# equivalent mutant: core/ReplaceComparisonOperator_Eq_GtE on `if max(abs(dr), abs(dc)) == 2:`: (>= 2) dr and dc run over -2..2, so the larger of their sizes is never above 2.
# equivalent mutant: core/NumberReplacer on `step = max(1, win // 2)`: (max(2, ...)) the two differ only for windows of 3 px or less, and there are none: --screen-window-px is 0 (automatic, at least 16 px) or at least 8 (tests/pairs/registration/test_registration_config.py); only a crop under 4 px, which has nothing to screen, would get such windows.
# equivalent mutant: core/ReplaceBinaryOperator_BitAnd_FloorDiv on `roof_share = float((moved & ~wide).mean())`: (moved // ~wide) on boolean arrays x // True is x and x // False is 0 (numpy's integer division by zero gives 0), which is moved & ~wide; only its mean (the same) is read.


# Written for the survivors of a sample drawn before them (`python tools/mutation.py --module
# operators/pairs/screening/screening.py --sample 24 --seed 56`: 19 of 24 killed, stop 56).

def test_the_quadrants_are_the_crops_halves_across_rows_too(scene):  # noqa: F811
    # Clouds over the bottom half (y >= 480): the windows seen lie above the centre, in two quadrants
    # (a quarter of the side for the split, `h >> 2`, would count four).
    pre = pre_of(scene)
    valid = np.ones((C, C), bool)
    valid[480:, :] = False
    r = screen(pre, pre, valid)
    assert r.reject_reason.startswith("insufficient evidence") and " in 2 quadrant(s) " in r.reject_reason


def test_a_hull_covering_exactly_the_share_asked_passes():
    """The rule is coverage >= screen_min_coverage: a crop whose windows' hull covers exactly the share
    asked has its evidence spread enough; a hair more asked, not."""
    from dataclasses import replace

    from operators.pairs.screening.fields import hull_share
    from operators.pairs.screening.screening import Evidence, too_little_spread

    trusted = [w(r, c, 0.3, -0.2) for r in (1, 5, 14) for c in (1, 7, 14)]
    share = hull_share(trusted, C, C)
    assert 0.3 < share < 0.9
    for asked, passes in ((share, True), (share + 1e-9, False)):
        cfg = replace(CFG, screen_min_coverage=asked)
        ev = Evidence(C, C, 128, trusted, trusted, trusted, len(trusted), [], [], [], None, cfg)
        assert (too_little_spread(ev) is None) is passes, (asked, too_little_spread(ev))


def test_repeated_texture_is_looked_for_in_windows_of_64_px_and_more_only(scene, monkeypatch):  # noqa: F811
    """Natural texture matches itself by chance in small windows: under REPEAT_MIN_WINDOW (64 px)
    no window is searched for a period; from 64 px on, every usable window is."""
    from operators.pairs.screening import screening

    assert screening.REPEAT_MIN_WINDOW == 64
    calls = []
    real = screening.repeat_period

    def spy(pre, x, y, win, *a, **k):
        calls.append(win)
        return real(pre, x, y, win, *a, **k)

    monkeypatch.setattr(screening, "repeat_period", spy)
    pre = pre_of(scene)[:512, :512]
    for win, searched in ((56, False), (64, True)):
        calls.clear()
        cfg = RegistrationConfig(crop_size=512, screen_window_px=win)
        screening.screen_alignment(pre, pre, np.ones(pre.shape, bool), cfg)
        assert bool(calls) is searched and set(calls) <= {win}, (win, calls[:3])



def test_the_far_search_starts_from_cells_of_2_x_2_windows(scene, monkeypatch):  # noqa: F811
    """The windows the near search missed are grouped in cells of 2 x 2 (far_candidates: one search
    per cell, a displaced region of a quarter of the crop side holds one); CI's moving sample (seed
    3361975891) showed a grouping by single rows (`i // 2` -> `i + 2`) passing every test."""
    from operators.pairs.screening import screening

    cells = []
    real = screening.far_candidates

    def spy(missed, texture):
        cells.append(missed)
        return real(missed, texture)

    monkeypatch.setattr(screening, "far_candidates", spy)
    pre = pre_of(scene)
    post = np.roll(pre, (20, -15), axis=(0, 1))        # nothing found near: every window goes far
    screen(pre, post)
    missed = cells[0]
    assert missed and all(i // 2 == ci and j // 2 == cj for (ci, cj), ws in missed.items() for i, j in ws)
    assert max(len(ws) for ws in missed.values()) == 4


def _stayed_put_reference(pre, post, x, y, shape, hit, near, cfg):
    """docs (stayed_put's docstring): a far hit whose whole window, moved by the hit, lies in the
    crop, where post and pre both have texture, is a look-alike when post-there correlates with
    pre-there at least as well as the forward match less the peak margin. Anything else stands."""
    dx, dy, ncc = hit
    h, w = post.shape
    wh, ww = shape
    bx, by = x + int(round(dx)), y + int(round(dy))
    if np.hypot(dx, dy) <= near or not (0 <= bx <= w - ww and 0 <= by <= h - wh):
        return False
    a = post[by:by + wh, bx:bx + ww].astype(np.float64).ravel()
    b = pre[by:by + wh, bx:bx + ww].astype(np.float64).ravel()
    if min(a.std(), b.std()) < cfg.screen_min_texture:
        return False
    return float(np.corrcoef(a, b)[0, 1]) >= ncc - cfg.screen_peak_margin


def test_the_shift_back_compares_whole_windows_inside_the_crop_only():
    """stayed_put against its documented rule over 1,500 generated far hits (seeded): landing
    places flush with or 1-8 px past each of the crop's four edges (a window cut at the edge would
    be compared on what is left of it), hits at exactly ``near``, and places where the ground
    stayed, moved, changed in part, is flat, or is hazed in one date; the forward match's
    correlation either anywhere or within 0.03 of the rule's margin. CI's moving sample (3ebebde)
    showed the bottom edge's guard (`by + wh > h` -> `by ^ wh > h`) passing every test: no far
    hit had left the crop downwards."""
    from operators.pairs.screening.screening import stayed_put

    rng = np.random.default_rng(7)
    h, w, win, near = 160, 192, 40, 13                  # 5-12-13: a hit exactly at ``near``
    pre = rng.random((h, w)).astype(np.float32)
    post = pre.copy()                                   # the edges stayed put: a cut window there
    post[30:90, 70:140] = rng.random((60, 70))          # correlates as a look-alike would
    post[100:150, 130:190] += 0.6 * rng.random((50, 60))    # changed in part: correlates ~0.85
    haze = rng.random((50, 60))                         # one date hazed: the same ground, too
    pre[100:150, 60:120], post[100:150, 60:120] = 0.5 + 0.05 * (haze - 0.5), haze   # faint to judge
    pre[100:150, 0:60], post[100:150, 0:60] = haze, 0.5 + 0.05 * (haze - 0.5)
    pre[20:70, 8:58] = post[20:70, 8:58] = 0.5          # flat in both dates
    blocks = [(70, 30, 60, 70), (130, 100, 50, 60), (60, 100, 50, 60), (0, 100, 50, 60), (8, 20, 50, 50)]
    sides = ["inside", "at near", "block", "left", "right", "top", "bottom"]
    seen = dict.fromkeys(sides + ["flush", "look-alike", "near the margin"], 0)
    for case in range(1500):
        side = sides[case % len(sides)]
        x, y = int(rng.integers(0, w - win + 1)), int(rng.integers(0, h - win + 1))
        past = int(rng.integers(0, 9))                  # 0: flush with the edge, else px past it
        bx, by = int(rng.integers(0, w - win + 1)), int(rng.integers(0, h - win + 1))
        if side == "at near":
            ox, oy = [(13, 0), (0, -13), (-5, 12), (12, -5)][case % 4]
            x, y = int(np.clip(x, max(0, -ox), w - win - max(0, ox))), int(np.clip(y, max(0, -oy), h - win - max(0, oy)))
            bx, by = x + ox, y + oy
        elif side == "block":
            bx0, by0, bh, bw = blocks[case % len(blocks)]
            bx, by = bx0 + int(rng.integers(0, bw - win + 1)), by0 + int(rng.integers(0, bh - win + 1))
        elif side != "inside":
            bx = {"left": -past, "right": w - win + past}.get(side, bx)
            by = {"top": -past, "bottom": h - win + past}.get(side, by)
            seen["flush"] += past == 0
        fx, fy = (0.0, 0.0) if side == "at near" else rng.choice([0.0, 0.25, -0.25, 0.49, -0.49], 2)
        dx, dy = bx - x + fx, by - y + fy
        ncc = float(rng.uniform(0.3, 1.0))
        if case % 2 and 0 <= bx <= w - win and 0 <= by <= h - win:      # near the rule's margin
            a, b = post[by:by + win, bx:bx + win].ravel(), pre[by:by + win, bx:bx + win].ravel()
            if min(a.std(), b.std()) > 0:
                there = np.corrcoef(a, b)[0, 1]
                ncc = float(there + CFG.screen_peak_margin + rng.uniform(-0.03, 0.03))
                seen["near the margin"] += 1
        hit = (dx, dy, ncc)
        want = _stayed_put_reference(pre, post, x, y, (win, win), hit, near, CFG)
        assert stayed_put(pre, post, x, y, (win, win), hit, near, CFG) == want, (case, side, x, y, hit)
        seen[side] += np.hypot(dx, dy) > near or side == "at near"
        seen["look-alike"] += want
    assert min(seen.values()) >= 50, seen


def test_the_round_trip_searches_back_the_part_of_a_shifted_window_inside_the_crop():
    """round_trip where the window, shifted by its offset, reaches past the crop's edge (issue 48:
    the round trip is never skipped silently at the border). Over generated cases with known
    truth on real texture (NAIP, post = pre moved by a whole-pixel shift, content continuing past
    the edges), at both geometries: windows whose shifted place lies 0-100 % past one of the four
    edges (the offset toward it that far or a few px farther: a near or a far hit), the offset
    claimed either the true one or 5-12 px off it. Documented rule: less than half a window
    inside is never confirmed; a wrong offset is never confirmed where the content's true place
    is in the pre crop (at the border it once was, whatever it was); the true offset with half a window or more inside is confirmed (the clipped
    part searched back; counted, as flat parts of the texture can fail it)."""
    from benchmarks._fields import scene

    from operators.pairs.screening.peaks import PeakTest, round_trip

    rng = np.random.default_rng(11)
    counts = {"inside too little": 0, "wrong": 0, "true, enough inside": 0, "true confirmed": 0,
              "true, exactly half inside": 0, "true, exactly half, confirmed": 0}
    for crop in (192, 1024):
        cfg = RegistrationConfig(crop_size=crop)
        win, near = cfg.screen_window(), int(np.ceil(cfg.screen_near_factor * cfg.max_residual_px))
        src = scene("naip", crop)
        peak = PeakTest.of(cfg)
        for case in range(200):
            side = case % 4                                 # the edge the shifted window reaches past
            past = int(rng.integers(0, win + 1))            # px of the window past it
            toward = past + int(rng.integers(0, 9))         # the offset's component toward the edge
            across = int(rng.integers(-12, 13))
            if case % 8 == 0:                                # exactly half the window inside
                past, toward, across = win // 2, win // 2 + int(rng.integers(0, 9)), 0
            claim = np.array([(-toward, across), (toward, across), (across, -toward), (across, toward)][side])
            along = int(rng.integers(0, crop - win + 1))
            bx, by = [(-past, along), (crop - win + past, along), (along, -past), (along, crop - win + past)][side]
            x0, y0 = bx - int(claim[0]), by - int(claim[1])
            if not (0 <= x0 <= crop - win and 0 <= y0 <= crop - win):   # the window itself in the crop
                x0, y0 = int(np.clip(x0, 0, crop - win)), int(np.clip(y0, 0, crop - win))
                claim = np.array([bx - x0, by - y0])
            wrong = case % 3 == 2
            e = np.zeros(2, int)
            if wrong:
                e[int(rng.integers(0, 2))] = int(rng.integers(5, 13)) * int(rng.choice([-1, 1]))
            d = claim - e                                   # the true shift
            ox = int(rng.integers(190, src.shape[1] - crop - 190))
            oy = int(rng.integers(190, src.shape[0] - crop - 190))
            pre = src[oy:oy + crop, ox:ox + crop]
            post = src[oy - d[1]:oy - d[1] + crop, ox - d[0]:ox - d[0] + crop]     # post(p) = pre(p - d)
            confirmed = round_trip(pre, post, x0, y0, win, float(claim[0]), float(claim[1]), near,
                                   cfg.screen_min_ncc, cfg.screen_peak_margin, peak)
            cx0, cy0 = max(bx, 0), max(by, 0)                      # the part inside the crop
            cx1, cy1 = min(bx + win, crop), min(by + win, crop)
            inside = (cx1 - cx0) * (cy1 - cy0) / win ** 2
            # Where that part's content truly sat in pre: a wrong offset can be told only when
            # it is in the pre crop (else nothing there says where it came from).
            told = 0 <= cx0 - d[0] and cx1 - d[0] <= crop and 0 <= cy0 - d[1] and cy1 - d[1] <= crop
            if inside < 0.5:                                 # "half a window": the documented share
                counts["inside too little"] += 1
                assert not confirmed, (crop, case, claim, inside)
            elif wrong and told:
                counts["wrong"] += 1
                assert not confirmed, (crop, case, d, claim, inside)
            elif not wrong:
                counts["true, enough inside"] += 1
                counts["true confirmed"] += confirmed
                counts["true, exactly half inside"] += inside == 0.5
                counts["true, exactly half, confirmed"] += inside == 0.5 and confirmed
    assert counts["inside too little"] >= 50 and counts["wrong"] >= 50, counts
    assert counts["true confirmed"] >= 0.9 * counts["true, enough inside"] >= 50, counts
    assert counts["true, exactly half, confirmed"] >= 0.9 * counts["true, exactly half inside"] >= 10, counts
