"""The statistics every comparison rests on, pinned to values worked out by hand (or printed in a
table) on cases where a wrong formula gives another number, their 95% intervals shown by
simulation to cover 93-97% at the numbers of items the tool allows, and their laws as properties.

Pure functions of numbers: no model, no torch, seconds in all; `make mutate` runs these."""

from __future__ import annotations

import math
import random
import statistics

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from depthcurse.select.statistics import decomposition, jaccard, overlap
from depthcurse.stats import (MIN_ITEMS, UNPAIRED, TooFewItems, decided_by, difference_interval, independent_spread, interval, mean_interval,
                              paired_spread, ratio_interval, resample, shares, t_quantile, welch_interval, wilson)
from depthcurse.stats.bootstrap import expanded_levels
from depthcurse.stats.intervals import Spread

# The tests by hand and the laws are marked `statistics`: `make mutate` runs them against each mutant.
# The simulations (coverage) run in `make test` alone: seconds each, and every formula they exercise
# is pinned by a value worked out by hand above them.
statistics_test = pytest.mark.statistics

# --------------------------------------------------------------------------- values by hand


@statistics_test
def test_t_quantiles_are_the_printed_tables():
    # Student's t, two-sided 95% (and one 90%), from any printed table: 1.96 would be 6.5x too narrow at 1 df
    for df, value in ((1, 12.7062), (2, 4.3027), (3, 3.1824), (4, 2.7764), (7, 2.3646), (31, 2.0395), (math.inf, 1.9600)):
        assert t_quantile(df) == pytest.approx(value, abs=1e-4)
    assert t_quantile(4, 0.90) == pytest.approx(2.1318, abs=1e-4)
    # Welch gives fractional df: the quantile is where t's density, integrated here numerically, reaches 0.975
    df = 2.5
    q = t_quantile(df)
    x = np.linspace(0.0, q, 200001)
    density = math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2)) * (1 + x * x / df) ** (-(df + 1) / 2)
    assert 0.5 + float(np.sum((density[1:] + density[:-1]) / 2 * np.diff(x))) == pytest.approx(0.975, abs=1e-7)
    assert 3.1824 < q < 4.3027


@statistics_test
def test_one_groups_paired_spread_is_sd_over_root_n_at_n_minus_one_df():
    a = [1.0, 2.0, 4.0, 3.0, 5.0]
    b = [0.5, 2.5, 3.0, 3.0, 4.0]
    # differences 0.5, -0.5, 1, 0, 1: mean 0.4, squares about it 0.01 + 0.81 + 0.36 + 0.16 + 0.36 = 1.7, sd = sqrt(1.7 / 4)
    spread = paired_spread({"a": [a], "b": [b]}, {"a": 1.0, "b": -1.0})
    assert spread.se == pytest.approx(math.sqrt(1.7 / 4) / math.sqrt(5)) and spread.df == 4
    assert difference_interval(3.0, 2.6, {"a": [a], "b": [b]}, "a", "b") == pytest.approx(
        [0.4 - 2.776445 * math.sqrt(1.7 / 20), 0.4 + 2.776445 * math.sqrt(1.7 / 20)], rel=1e-6)


@statistics_test
def test_several_groups_take_welch_satterthwaites_degrees_of_freedom():
    # a suite of 3 tasks of 3, 4 and 5 questions, each weighing 1/3; z = a - b per question
    a = [[1, 1, 0], [1, 0, 1, 1], [0, 1, 1, 1, 0]]
    b = [[0, 1, 0], [0, 0, 1, 0], [0, 0, 1, 1, 1]]
    # z: [1, 0, 0] var 1/3; [1, 0, 0, 1] var 1/3; [0, 1, 0, 0, -1] var 0.5
    parts = [1 / 3 / 3 / 9, 1 / 3 / 4 / 9, 0.5 / 5 / 9]
    spread = paired_spread({"a": a, "b": b}, {"a": 1.0, "b": -1.0})
    assert spread.se == pytest.approx(math.sqrt(sum(parts)))
    assert spread.df == pytest.approx(sum(parts) ** 2 / (parts[0] ** 2 / 2 + parts[1] ** 2 / 3 + parts[2] ** 2 / 4))
    assert 2 < spread.df < 9  # between the smallest group's n - 1 and all of theirs


@statistics_test
def test_unpaired_or_too_few_items_give_no_interval():
    assert paired_spread({"a": [[1.0, 2.0]], "b": [[1.0, 2.0, 3.0]]}, {"a": 1.0, "b": -1.0}) == UNPAIRED  # other windows
    assert paired_spread({"a": [[1.0]], "b": [[2.0]]}, {"a": 1.0, "b": -1.0}) == UNPAIRED  # one window: no spread to estimate
    assert paired_spread({"a": [[1.0, 2.0]], "b": [[1.0, 2.0], [3.0, 4.0]]}, {"a": 1.0, "b": -1.0}) == UNPAIRED  # other groups
    assert paired_spread({"a": [[1.0, 2.0]]}, {"a": 0.0}) == UNPAIRED
    assert interval(1.0, UNPAIRED) is None and interval(float("nan"), Spread(1.0, 3)) is None and mean_interval([2.0]) is None
    # the same differences everywhere: no spread, the interval a point
    assert paired_spread({"a": [[2.0, 3.0]], "b": [[1.0, 2.0]]}, {"a": 1.0, "b": -1.0}) == Spread(0.0, 1.0)
    assert difference_interval(2.5, 1.5, {"a": [[2.0, 3.0]], "b": [[1.0, 2.0]]}, "a", "b") == [1.0, 1.0]


@statistics_test
def test_welchs_interval_of_two_independent_samples_by_hand():
    """a = 1, 2, 6 (mean 3, variance 7) and b = 0, 1, 1, 2 (mean 1, variance 2/3): se^2 = 7/3 + 1/6 =
    5/2, df = (5/2)^2 / ((7/3)^2 / 2 + (1/6)^2 / 3) = 2.2881, t(2.2881) = 3.8230, so 2 -+ 6.0446. The
    pooled variance's would be 2 -+ 2.571 * sqrt(16/5 * 7/12) = 2 -+ 3.513, at 5 df."""
    spread = independent_spread([1.0, 2.0, 6.0], [0.0, 1.0, 1.0, 2.0])
    assert spread.se == pytest.approx(math.sqrt(2.5)) and spread.df == pytest.approx(6.25 / (49 / 18 + 1 / 108))
    assert t_quantile(spread.df) == pytest.approx(3.82295, abs=1e-5)
    assert welch_interval([1.0, 2.0, 6.0], [0.0, 1.0, 1.0, 2.0]) == pytest.approx([2 - 6.044621, 2 + 6.044621], abs=1e-6)
    assert welch_interval([0.0, 1.0, 1.0, 2.0], [1.0, 2.0, 6.0]) == pytest.approx([-2 - 6.044621, -2 + 6.044621], abs=1e-6)
    assert welch_interval([1.0, 2.0, 6.0], [1.0, 2.0, 6.0], confidence=0.9) == pytest.approx([-4.60532, 4.60532], abs=1e-5)  # t(4) 2.13185 * sqrt(14/3) = 2.13185 * 2.16025
    assert independent_spread([1.0], [1.0, 2.0]) == UNPAIRED and welch_interval([1.0], [1.0, 2.0]) is None and welch_interval([], [1.0]) is None
    assert independent_spread([1.0, 1.0], [2.0, 2.0, 2.0]) == Spread(0.0, 3.0)
    assert welch_interval([1.0, 1.0], [2.0, 2.0, 2.0]) == [-1.0, -1.0]


@statistics_test
def test_a_ratio_of_paired_means_has_the_delta_methods_interval():
    top, bottom = [0.6, 0.5, 0.8, 0.4], [1.0, 0.9, 1.2, 0.8]
    r = sum(top) / sum(bottom)  # 2.3 / 3.9
    z = [t - r * b for t, b in zip(top, bottom)]
    se = statistics.stdev(z) / 2 / (3.9 / 4)
    assert ratio_interval(2.3 / 4, 3.9 / 4, {"t": [top], "b": [bottom]}, "t", "b") == pytest.approx([r - 3.182446 * se, r + 3.182446 * se], rel=1e-6)
    assert ratio_interval(1.0, 0.0, {"t": [top], "b": [bottom]}, "t", "b") is None


@statistics_test
def test_wilsons_interval_is_newcombes_table():
    # Newcombe (1998), "Two-sided confidence intervals for the single proportion", table I, method 3
    for (k, n), (low, high) in (((81, 263), (0.2553, 0.3662)), ((15, 148), (0.0624, 0.1605)), ((0, 20), (0.0, 0.1611)),
                                ((1, 29), (0.0061, 0.1718)), ((29, 29), (0.8830, 1.0))):
        assert wilson(k, n) == pytest.approx([low, high], abs=1e-4)
    assert wilson(0, 0) is None


@statistics_test
def test_the_two_way_shares_of_a_three_by_four_grid_by_hand():
    """Rows (calibration) means 2, 3, 7; columns (search) 3, 4, 5, 4; grand 4. Rows' sum of squares
    4 columns x (4 + 1 + 9) = 56, columns' 3 rows x (1 + 0 + 1 + 0) = 6, total 66, the rest 4. Each
    part weighted by the other factor's count: weighting the rows by their own count (3) gives 42."""
    y = np.array([[1, 2, 3, 2], [2, 2, 5, 3], [6, 8, 7, 7]], dtype=float)
    got = shares(y)
    assert got == pytest.approx({"rows": 56 / 66, "columns": 6 / 66, "rest": 4 / 66})
    transposed = shares(y.T)
    assert transposed == pytest.approx({"rows": 6 / 66, "columns": 56 / 66, "rest": 4 / 66})
    assert all(math.isnan(v) for v in shares(np.ones((3, 4))).values())  # no spread: no shares
    # a stack of grids (one per bootstrap draw) gives each grid's shares
    stacked = shares(np.stack([y, y.T.reshape(3, 4), 2 * y + 1], axis=-1))
    assert stacked["rows"][0] == pytest.approx(56 / 66) and stacked["rows"][2] == pytest.approx(56 / 66)


@statistics_test
def test_decided_by_names_a_factor_only_where_the_intervals_are_apart():
    assert decided_by({"rows": [0.6, 0.9], "columns": [0.0, 0.2]}) == "rows"
    assert decided_by({"rows": [0.0, 0.2], "columns": [0.3, 0.9]}) == "columns"
    assert decided_by({"rows": [0.1, 0.5], "columns": [0.4, 0.9]}).startswith("cannot tell apart")
    assert decided_by({"rows": [0.2, 0.5], "columns": [0.5, 0.9]}).startswith("cannot tell apart")  # touching is not apart
    assert decided_by({"rows": [0.5, 0.9], "columns": [0.2, 0.5]}).startswith("cannot tell apart")  # nor from the other side
    # the rows' interval reaching above the columns' but starting inside it: overlapping, however high it reaches
    assert decided_by({"rows": [0.3, 0.95], "columns": [0.4, 0.9]}).startswith("cannot tell apart")
    assert decided_by({"rows": [0.4, 0.9], "columns": [0.3, 0.95]}).startswith("cannot tell apart")
    assert decided_by({"rows": None, "columns": [0.5, 0.9]}).startswith("cannot tell")
    assert decided_by({"rows": [0.6, 0.9], "columns": [0.0, 0.2]}, "4 items are too few").startswith("cannot tell (4 items")


@statistics_test
def test_overlap_means_pair_each_two_distinct_cells_once():
    """Texts A, B, C; searches g and a. Same text, other search: (A/g, A/a) J({1,2},{2,3}) = 1/3, (B/g, B/a)
    J({1,3},{2,3}) = 1/3: mean 1/3 over 2 pairs. Same search, other text: (A/g, B/g) 1/3, (A/g, C/g) 1,
    (B/g, C/g) 1/3, (A/a, B/a) 1: mean 2/3 over 4 pairs. Pairs differing in both count in neither, and
    no cell is paired with itself (which would add 1s)."""
    cell = lambda text, search, layers: {"calibration": text, "search": search, "objective": "-", "layers": layers}  # noqa: E731
    cells = {"A/g": cell("A", "g", [1, 2]), "A/a": cell("A", "a", [2, 3]), "B/g": cell("B", "g", [1, 3]), "B/a": cell("B", "a", [2, 3]),
             "C/g": cell("C", "g", [1, 2])}
    got = overlap(cells)
    assert got["same_calibration_mean"] == pytest.approx(1 / 3) and got["same_calibration_pairs"] == 2
    assert got["same_search_mean"] == pytest.approx(2 / 3) and got["same_search_pairs"] == 4
    assert got["matrix"][0][1] == pytest.approx(1 / 3) and got["matrix"][2][2] == 1.0 and got["cells"] == list(cells)
    # the objective is part of the search: greedy by ppl and greedy by kl on one text are "same text"
    cells = {"A/g/ppl": {**cell("A", "g", [1]), "objective": "ppl"}, "A/g/kl": {**cell("A", "g", [2]), "objective": "kl"},
             "B/g/ppl": {**cell("B", "g", [1]), "objective": "ppl"}}
    got = overlap(cells)
    assert (got["same_calibration_pairs"], got["same_search_pairs"], got["same_search_mean"]) == (1, 1, 1.0)
    assert jaccard([], []) == 1.0 and jaccard([1, 2, 3], [3, 4]) == 0.25


# --------------------------------------------------------------------------- the bootstrap


@statistics_test
def test_the_bootstrap_refuses_too_few_items_and_says_why():
    with pytest.raises(TooFewItems, match=r"4 windows are too few to resample: .* \(35 here\)"):
        resample(lambda picks: {"m": picks.mean(1)}, 4, seed=0, what="windows")
    assert MIN_ITEMS == 8
    resample(lambda picks: {"m": picks.mean(1)}, 8, seed=0)


@statistics_test
def test_the_expanded_percentiles_are_hesterbergs():
    # z = sqrt(n / (n - 1)) t_{n-1}: at n = 8, sqrt(8/7) x 2.364624 = 2.527905, tail Phi(-2.527905) = 0.005736
    low, high = expanded_levels(8)
    assert low == pytest.approx(0.005736, abs=2e-6) and high == pytest.approx(1 - 0.005736, abs=2e-6)
    assert expanded_levels(1000)[0] == pytest.approx(0.025, abs=5e-4)  # large n: the plain percentiles


@statistics_test
def test_the_bootstrap_resamples_every_cell_with_the_same_items():
    """Cells that differ by a constant and share every item's noise have the same shares in every
    resample when the items are drawn once for all cells (paired); drawn apart, the noise would
    spread them."""
    noise = np.random.default_rng(1).normal(0, 5, 20)
    table = np.array([[1.0, 2.0, 3.0], [2.0, 2.5, 7.0]])[..., None] + noise  # (rows, columns, items)
    got = resample(lambda picks: shares(table[..., picks].mean(-1)), 20, seed=3)
    point = shares(table.mean(-1))
    for name in ("rows", "columns"):
        assert got[name] == pytest.approx([point[name], point[name]], abs=1e-9)


@statistics_test
def test_selects_decomposition_from_its_record_by_hand():
    """Two texts x two searches, 8 windows each: every cell's loss is a constant plus the same
    window noise, so the shares are those of the constants' grid and the paired intervals points;
    with 4 windows the bootstrap is refused and the verdict is "cannot tell"."""
    noise = [0.3, -0.2, 0.1, 0.0, 0.5, -0.4, 0.2, -0.5]
    grid = {("A", "g"): 1.0, ("A", "a"): 3.0, ("B", "g"): 1.2, ("B", "a"): 3.4}  # rows 2.0, 2.3; columns 1.1, 3.2; grand 2.15
    cells, held = {}, {"A": {}, "B": {}}
    for (text, search), level in grid.items():
        layers = [len(cells)]
        cells[f"{text}/{search}"] = {"calibration": text, "search": search, "objective": "-", "layers": layers}
        for source in held:
            held[source][",".join(map(str, layers))] = {"loss": [level + e for e in noise], "kl": [level / 2 + e for e in noise]}
    for source in held:
        held[source][""] = {"loss": [e for e in noise], "kl": [0.0] * 8}
    record = {"run": {"calibration": ["A", "B"], "task": None}, "cells": cells, "held_out": held, "labels": {"A": "A", "B": "B"}}
    got = decomposition(record, seed=0)
    # rows' SS 2 x (0.15^2 x 2) = 0.09, columns' 2 x (1.05^2 x 2) = 4.41, total 0.25^2 x 2 + 0.05^2 x 2 ... = 4.54
    total = sum((v - 2.15) ** 2 for v in grid.values())
    assert got["A held-out loss"]["shares"] == pytest.approx({"calibration": 0.09 / total, "search": 4.41 / total, "rest": 1 - 4.5 / total})
    assert got["A held-out loss"]["decided_by"] == "search" and got["A held-out loss"]["items"] == 8
    assert got["B held-out kl"]["shares"]["search"] == pytest.approx(4.41 / 4 / (total / 4))
    short = {**record, "held_out": {s: {k: {m: v[:4] for m, v in d.items()} for k, d in h.items()} for s, h in held.items()}}
    said = decomposition(short, seed=0)["A held-out loss"]
    assert said["decided_by"].startswith("cannot tell (4 held-out items are too few") and said["intervals"]["search"] is None
    assert decomposition({**record, "run": {"calibration": ["A"], "task": None}}, seed=0) == {
        "why_not": "a decomposition needs two calibration texts and two searches (or objectives) at least"}


# --------------------------------------------------------------------------- coverage, by simulation

# Skewness 2/3 (gamma, shape 9): about the largest of the per-window loss differences measured on
# SmolLM2-135M without layer 17, 12-15 or 15-18, on wiki, code and dialogue (-0.27 to 0.62; 48 windows
# of 128 tokens); its per-window KLs reach 2.2, under which (an exponential's 2) t covers 88-91% at 4-8
# windows and 93% at 32 (docs/benchmarks.md, "Intervals").
SKEWED = ("skewed", lambda rng, size: rng.gamma(9.0, 1.0, size), 9.0)
NORMAL = ("normal", lambda rng, size: rng.normal(1.0, 2.0, size), 1.0)


@pytest.mark.parametrize("n", [2, 4, 8, 32])
@pytest.mark.parametrize("name, draw, truth", [NORMAL, SKEWED])
def test_the_paired_t_interval_covers_95_percent(n, name, draw, truth):
    rng = np.random.default_rng(n)
    runs, covered = 3000, 0
    for _ in range(runs):
        u = rng.normal(3.0, 1.0, n)  # the unpruned model's windows; the pruned one's add the difference
        p = u + draw(rng, n)
        low, high = difference_interval(float(p.mean()), float(u.mean()), {"p": [list(p)], "u": [list(u)]}, "p", "u")
        covered += low <= truth <= high
    assert 0.93 <= covered / runs <= 0.97, f"{name} n={n}: {covered / runs:.3f}"


@pytest.mark.parametrize("n", [2, 4, 8, 32])
def test_the_welch_interval_of_a_suite_covers_95_percent(n):
    """A suite of three tasks of n, 2n and 3n questions with other spreads: the average's difference."""
    rng = np.random.default_rng(100 + n)
    runs, covered = 3000, 0
    sizes, spreads = (n, 2 * n, 3 * n), (0.5, 1.0, 2.0)
    for _ in range(runs):
        a = [list(rng.normal(0.0, s, m) + 0.1) for m, s in zip(sizes, spreads)]
        b = [list(rng.normal(0.0, 0.1, m)) for m in sizes]
        z = [[x - y for x, y in zip(ga, gb)] for ga, gb in zip(a, b)]
        value = sum(sum(g) / len(g) for g in z) / 3
        low, high = interval(value, paired_spread({"a": a, "b": b}, {"a": 1.0, "b": -1.0}))
        covered += low <= 0.1 <= high
    assert 0.93 <= covered / runs <= 0.97, f"n={n}: {covered / runs:.3f}"


@pytest.mark.parametrize("sizes", [(3, 3), (3, 5), (8, 4)])
def test_welchs_interval_of_two_independent_samples_covers_95_percent(sizes):
    """Two sets of seeds, of other sizes and spreads (sd 2 against 0.5): the difference of their means."""
    rng = np.random.default_rng(300 + sum(sizes))
    runs, covered = 3000, 0
    for _ in range(runs):
        a, b = rng.normal(1.0, 2.0, sizes[0]), rng.normal(0.0, 0.5, sizes[1])
        low, high = welch_interval(list(a), list(b))
        covered += low <= 1.0 <= high
    assert 0.93 <= covered / runs <= 0.97, f"{sizes}: {covered / runs:.3f}"


@pytest.mark.parametrize("n", [2, 4, 8, 32])
@pytest.mark.parametrize("name, draw, truth", [NORMAL, SKEWED])
def test_the_delta_method_ratio_interval_covers_95_percent(n, name, draw, truth):
    """retained = healed mean / unpruned mean over paired items, the truth (truth + 10) / 10."""
    rng = np.random.default_rng(200 + n)
    runs, covered = 3000, 0
    for _ in range(runs):
        u = rng.normal(10.0, 1.0, n)
        h = u + draw(rng, n)
        low, high = ratio_interval(float(h.mean()), float(u.mean()), {"h": [list(h)], "u": [list(u)]}, "h", "u")
        covered += low <= (truth + 10.0) / 10.0 <= high
    assert 0.93 <= covered / runs <= 0.97, f"{name} n={n}: {covered / runs:.3f}"


@pytest.mark.parametrize("n", [2, 4, 8, 32])
def test_wilsons_interval_covers_95_percent_over_the_proportions(n):
    """Averaged over the true proportion (uniform): Wilson's average coverage is near 95% at every n,
    where the normal's (Wald's) is far below (at n = 8, about 80%)."""
    rng = random.Random(n)
    runs, covered = 20000, 0
    for _ in range(runs):
        p = rng.random()
        k = sum(rng.random() < p for _ in range(n))
        low, high = wilson(k, n)
        covered += low <= p <= high
    assert 0.93 <= covered / runs <= 0.97, f"n={n}: {covered / runs:.3f}"


@pytest.mark.parametrize("n", [8, 32])
@pytest.mark.parametrize("name, draw, truth", [NORMAL, SKEWED])
def test_the_paired_bootstrap_covers_95_percent_where_it_runs(n, name, draw, truth):
    """The paired bootstrap of a mean difference, from the fewest items it accepts (8) up; below
    that it refuses (above)."""
    rng = np.random.default_rng(300 + n)
    runs, covered = 1500, 0
    for r in range(runs):
        d = draw(rng, n)
        low, high = resample(lambda picks: {"mean": d[picks].mean(1)}, n, seed=r, draws=1000)["mean"]
        covered += low <= truth <= high
    assert 0.925 <= covered / runs <= 0.97, f"{name} n={n}: {covered / runs:.3f}"


# --------------------------------------------------------------------------- laws


grids = st.integers(2, 4).flatmap(lambda r: st.integers(2, 5).flatmap(
    lambda c: st.lists(st.floats(-100, 100, allow_nan=False), min_size=r * c, max_size=r * c).map(lambda v: np.array(v).reshape(r, c))))


@statistics_test
@settings(max_examples=60, deadline=None)
@given(grids, st.floats(-50, 50), st.floats(0.1, 10))
def test_shares_sum_to_one_and_ignore_a_shift_and_a_scale(y, shift, scale):
    got = shares(y)
    if np.ptp(y) < 1e-6:
        return
    assert sum(got.values()) == pytest.approx(1.0, abs=1e-9) and all(-1e-12 <= v <= 1 + 1e-12 for v in got.values())
    moved = shares(y * scale + shift)
    assert moved == pytest.approx(got, abs=1e-6)
    assert shares(y.T) == pytest.approx({"rows": got["columns"], "columns": got["rows"], "rest": got["rest"]}, abs=1e-9)


@statistics_test
@settings(max_examples=80, deadline=None)
@given(st.sets(st.integers(0, 12)), st.sets(st.integers(0, 12)))
def test_jaccard_is_symmetric_and_one_only_for_equal_sets(a, b):
    assert jaccard(a, b) == jaccard(b, a) and 0.0 <= jaccard(a, b) <= 1.0
    assert (jaccard(a, b) == 1.0) == (a == b)


@statistics_test
@settings(max_examples=80, deadline=None)
@given(st.lists(st.floats(-10, 10, allow_nan=False), min_size=2, max_size=30))
def test_an_interval_holds_its_estimate_and_narrows_with_more_items(values):
    got = mean_interval(values)
    centre = sum(values) / len(values)
    assert got[0] <= centre + 1e-9 and centre - 1e-9 <= got[1]
    if max(values) - min(values) > 1e-3:
        wider, narrower = got[1] - got[0], (lambda g: g[1] - g[0])(mean_interval(values + values))
        assert narrower < wider


@statistics_test
@settings(max_examples=80, deadline=None)
@given(st.integers(1, 200).flatmap(lambda n: st.tuples(st.integers(0, n), st.just(n))))
def test_wilson_holds_the_proportion_inside_zero_one_and_narrows_with_n(kn):
    k, n = kn
    low, high = wilson(k, n)
    assert 0.0 <= low <= k / n <= high <= 1.0
    low2, high2 = wilson(4 * k, 4 * n)
    assert high2 - low2 < high - low


# --------------------------------------------------------------------------- Holm (issue 72)
@statistics_test
def test_holm_adjusted_p_values_worked_by_hand():
    """p = 0.01, 0.04, 0.03, 0.005 (m = 4). Sorted: 0.005 x 4 = 0.02; 0.01 x 3 = 0.03; 0.03 x 2 = 0.06;
    0.04 x 1 = 0.04, raised to 0.06 (never below an earlier step). Bonferroni would give 0.04, 0.16,
    0.12, 0.02."""
    from depthcurse.stats.multiple import holm

    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02], abs=1e-15)
    assert holm([0.5, 0.9]) == [1.0, 1.0] and holm([]) == []


@statistics_test
def test_holm_family_intervals_p_values_and_decisions_by_hand():
    """Three differences with se 1 at 9 df: t = 3.5, 2.5, 0.5. Their two-sided p-values by scipy's t;
    the smallest tested at 1 - 0.05 / 3, the next at 1 - 0.05 / 2, the last at 95%."""
    from scipy import stats as sps

    from depthcurse.stats.intervals import Spread
    from depthcurse.stats.multiple import holm_family

    family = holm_family([(2.5, Spread(1.0, 9)), (3.5, Spread(1.0, 9)), (0.5, Spread(1.0, 9)), (1.0, Spread(float("nan"), 0))])
    p = [2 * sps.t.sf(t, 9) for t in (2.5, 3.5, 0.5)]
    assert [f["p"] for f in family[:3]] == pytest.approx(p, rel=1e-12)
    assert family[1]["p_holm"] == pytest.approx(3 * p[1]) and family[0]["p_holm"] == pytest.approx(max(3 * p[1], 2 * p[0]))
    assert family[2]["p_holm"] == pytest.approx(max(2 * p[0], p[2]))
    half = lambda level: sps.t.ppf(1 - (1 - level) / 2, 9)  # noqa: E731
    assert family[1]["interval_holm"] == pytest.approx([3.5 - half(1 - 0.05 / 3), 3.5 + half(1 - 0.05 / 3)])
    assert family[0]["interval_holm"] == pytest.approx([2.5 - half(1 - 0.05 / 2), 2.5 + half(1 - 0.05 / 2)])
    assert family[2]["interval_holm"] == pytest.approx([0.5 - half(0.95), 0.5 + half(0.95)])
    # 0.0067 x 3 = 0.020 is apart; 0.0339 x 2 = 0.068 is not, though its plain interval excludes 0
    assert [f["apart_holm"] for f in family] == [False, True, False, None] and family[0]["p"] < 0.05
    assert family[3]["p"] is None


@statistics_test
def test_holm_keeps_the_family_wise_error_at_5_percent_where_plain_intervals_do_not():
    """Six null differences of 10 paired items each, 4,000 families: the chance of any false "apart"
    is about 26% with plain 95% intervals and at most 5% with Holm's."""
    from depthcurse.stats.intervals import Spread
    from depthcurse.stats.multiple import holm_family

    rng = np.random.default_rng(72)
    plain = adjusted = 0
    for _ in range(4000):
        x = rng.normal(size=(6, 10))
        family = [(float(r.mean()), Spread(float(r.std(ddof=1) / np.sqrt(10)), 9)) for r in x]
        out = holm_family(family)
        plain += any(f["p"] < 0.05 for f in out)
        adjusted += any(f["apart_holm"] for f in out)
    assert 0.22 < plain / 4000 < 0.31 and adjusted / 4000 <= 0.06


@statistics_test
def test_the_sample_skewness_worked_by_hand_and_its_warning():
    """1, 2, 3, 10: mean 4, deviations -3, -2, -1, 6; m2 = 50 / 4 = 12.5, m3 = 180 / 4 = 45;
    g1 = 45 / 12.5^1.5 = 1.01823; G1 = sqrt(4 x 3) / 2 x g1 = 1.76363 (the biased g1 would be 1.018)."""
    from scipy import stats as sps

    from depthcurse.stats.intervals import skew_warning, skewness

    assert skewness([1, 2, 3, 10]) == pytest.approx(1.763632, rel=1e-6) == sps.skew([1, 2, 3, 10], bias=False)
    assert skewness([1, 2]) is None and skewness([3, 3, 3]) is None and skewness([1, 2, 3]) == 0.0
    said = skew_warning([1, 2, 3, 10], "without 3, wiki held-out kl")
    assert said.startswith("without 3, wiki held-out kl: the paired differences are skewed (G1 +1.76 over 4 items)")
    assert skew_warning([1, 2, 3, 4.5], "x") is None  # G1 0.42: within the bound


@statistics_test
def test_holm_and_its_p_values_at_their_edges():
    """No spread (se 0): p 0 for a difference, 1 for none; no interval where the value, the se or the df
    is not usable; an adjusted p-value is capped at 1; an unknown difference in the middle of a family
    is left out and the rest still adjusted."""
    from depthcurse.stats.intervals import Spread
    from depthcurse.stats.multiple import holm, holm_family, t_p_value

    assert t_p_value(0.3, Spread(0.0, 4)) == 0.0 and t_p_value(0.0, Spread(0.0, 4)) == 1.0
    assert t_p_value(float("nan"), Spread(1.0, 4)) is None and t_p_value(0.3, Spread(float("inf"), 4)) is None and t_p_value(0.3, Spread(1.0, 0)) is None
    assert holm([0.6, 0.7]) == [1.0, 1.0]
    family = holm_family([(3.5, Spread(1.0, 9)), (1.0, Spread(float("nan"), 0)), (0.5, Spread(1.0, 9))])
    assert family[1] == {"p": None, "p_holm": None, "interval_holm": None, "apart_holm": None}
    assert family[2]["p_holm"] == pytest.approx(max(2 * family[0]["p"], family[2]["p"])) and family[2]["interval_holm"] is not None


# --------------------------------------------------------------------------- Spearman's rho (issue 73)
@pytest.mark.statistics
def test_spearman_ranks_ties_by_their_mean_and_differs_from_the_textbook_formula_there():
    """x = 10, 20, 20, 30, 40 and y = 1, 0, 1, 0, 1 (a pick, 1/0). Ranks: x 1, 2.5, 2.5, 4, 5; y's
    zeros share ranks 1-2 (1.5), its ones 3-5 (4): 4, 1.5, 4, 1.5, 4. About the means (3, 3):
    sum dx dy = -2 + 0.75 - 0.5 - 1.5 + 2 = -1.25, sum dx^2 = 9.5, sum dy^2 = 7.5, so
    rho = -1.25 / sqrt(71.25) = -0.14809. The textbook 1 - 6 sum d^2 / (n (n^2 - 1)) gives
    1 - 6 x 19.5 / 120 = +0.025 on these ranks. The interval: z = atanh(rho), se = sqrt((1 + rho^2 / 2)
    / (n - 3)), z -+ 1.96 se back through tanh."""
    import math

    from scipy import stats as sp

    from depthcurse.stats.correlation import ranks, spearman, spearman_interval

    x, y = [10, 20, 20, 30, 40], [1, 0, 1, 0, 1]
    assert ranks(x) == [1, 2.5, 2.5, 4, 5] and ranks(y) == [4, 1.5, 4, 1.5, 4]
    rho = spearman(x, y)
    assert rho == pytest.approx(-1.25 / math.sqrt(71.25), abs=1e-12) == pytest.approx(sp.spearmanr(x, y).statistic, abs=1e-12)
    assert rho != pytest.approx(0.025, abs=0.05)
    z, se = math.atanh(rho), math.sqrt((1 + rho**2 / 2) / 2)
    assert spearman_interval(rho, 5) == pytest.approx([math.tanh(z - 1.959963984540054 * se), math.tanh(z + 1.959963984540054 * se)], abs=1e-12)
    assert spearman_interval(rho, 5) == pytest.approx([-0.9125, 0.8467], abs=1e-4)
    assert spearman_interval(rho, 3) is None and spearman_interval(None, 10) is None and spearman_interval(1.0, 10) == [1.0, 1.0]
    assert spearman_interval(-1.0, 4) == [-1.0, -1.0] and spearman_interval(0.5, 4) is not None
    assert spearman([1, 2, 3], [5, 5, 5]) is None and spearman([5, 5, 5], [1, 2, 3]) is None and spearman([1], [2]) is None
    assert spearman([1, 2], [3, 4]) == pytest.approx(1.0) and spearman([1, 2], [4, 3]) == pytest.approx(-1.0)  # two pairs: the order alone
    half90 = 1.6448536269514722 * se  # at 90%: the normal's 0.95 quantile
    assert spearman_interval(rho, 5, confidence=0.9) == pytest.approx([math.tanh(z - half90), math.tanh(z + half90)], abs=1e-12)
    assert spearman([3, 1, 2, 7], [30, 10, 20, 70]) == pytest.approx(1.0) and spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="spearman: 3 values against 2"):
        spearman([1, 2, 3], [1, 2])


@pytest.mark.statistics
def test_spearmans_interval_covers_95_percent_at_small_n():
    """Bivariate normal with Pearson r = 0.6: the population Spearman rho is (6 / pi) asin(r / 2). At
    n = 8 and n = 20, 1,500 seeded samples each, the interval covers it 93-97% of the time."""
    import math

    from depthcurse.stats.correlation import spearman, spearman_interval

    rng = np.random.default_rng(5)
    r = 0.6
    truth = 6 / math.pi * math.asin(r / 2)
    for n in (8, 20):
        covered = 0
        for _ in range(1500):
            a = rng.standard_normal(n)
            b = r * a + math.sqrt(1 - r * r) * rng.standard_normal(n)
            lo, hi = spearman_interval(spearman(list(a), list(b)), n)
            covered += lo <= truth <= hi
        assert 0.93 <= covered / 1500 <= 0.97, (n, covered / 1500)


@pytest.mark.statistics
def test_the_verdict_words_are_the_intervals_by_hand():
    """A difference's word: above 0, below 0, or holding it (an end at 0 holds it: [0.0, 6.6] is
    Mix-LN's tuned-lens settling once called "later"); its own words where a figure has them; an
    agreement's word from the expected sign."""
    from depthcurse.stats.verdicts import agreement_word, difference_word

    assert difference_word([0.02, 0.08]) == "more" and difference_word([-0.08, -0.02]) == "less" and difference_word([-0.01, 0.02]) == "cannot tell"
    assert difference_word([0.0, 6.6]) == "cannot tell" and difference_word([-6.6, 0.0]) == "cannot tell" and difference_word(None) == "cannot tell"
    assert difference_word([1e-12, 1.0]) == "more" and difference_word([-1.0, -1e-12]) == "less"
    assert difference_word([0.1, 0.2], "later", "earlier") == "later" and difference_word([-0.2, -0.1], "further", "closer") == "closer"
    assert agreement_word([0.46, 0.87], +1) == "agrees" and agreement_word([0.46, 0.87], -1) == "opposite"
    assert agreement_word([-0.69, -0.05], -1) == "agrees" and agreement_word([-0.69, -0.05], +1) == "opposite"
    assert agreement_word([-0.63, 0.03], -1) == "cannot tell" and agreement_word(None, +1) == "cannot tell" and agreement_word([0.0, 0.5], +1) == "cannot tell"
    with pytest.raises(ValueError, match=r"^an expected sign is \+1 or -1, got 0$"):
        agreement_word([0.1, 0.2], 0)
