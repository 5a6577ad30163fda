"""Many comparisons at once: Holm's family-wise adjustment.

A table of every pair of 5 methods makes 10 comparisons; at 95% each, one pair in two such tables is
"apart" by chance alone. Holm's step-down procedure (1979) keeps the chance of any false "apart" in
the family at 5% and is uniformly more powerful than Bonferroni's: the comparisons sorted by their
p-values p_(1) <= ... <= p_(m), the i-th is rejected while every p_(j) <= alpha / (m - j + 1) for
j <= i. Its adjusted p-values are max_{j <= i} min(1, (m - j + 1) p_(j)).

Each difference's p-value is its t test's, at the degrees of freedom its interval uses (two-sided).
The adjusted interval of the i-th is the t interval at the level its step tests, 1 - alpha / (m - i
+ 1); "apart" after adjustment is Holm's decision (the adjusted p-value below alpha), which also
keeps every later comparison tied once one is not rejected.
"""

from __future__ import annotations

import math

from scipy.special import stdtr

from depthcurse.stats.intervals import CONFIDENCE, Spread, interval


def t_p_value(value: float, spread: Spread) -> float | None:
    """The two-sided p-value of `value` against 0 under Student's t at the spread's degrees of freedom."""
    if not (math.isfinite(value) and math.isfinite(spread.se) and spread.df > 0):
        return None
    if spread.se == 0.0:
        return 0.0 if value != 0.0 else 1.0
    return float(2 * stdtr(spread.df, -abs(value) / spread.se))


def holm(p_values: list[float]) -> list[float]:
    """Holm's adjusted p-values, in the order given."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def holm_family(differences: list[tuple[float, Spread]], confidence: float = CONFIDENCE) -> list[dict]:
    """For each (difference, its spread) of one family: its p-value, Holm's adjusted p-value, the
    interval at the level Holm's step tests it at, and whether Holm calls it apart (None where a
    difference has no spread: it is left out of the family, which then counts one fewer)."""
    alpha = 1 - confidence
    known = [i for i, (v, s) in enumerate(differences) if t_p_value(v, s) is not None]
    p = {i: t_p_value(*differences[i]) for i in known}
    adjusted = dict(zip(known, holm([p[i] for i in known])))
    ranks = {i: r for r, i in enumerate(sorted(known, key=lambda i: p[i]))}
    out = []
    for i, (value, spread) in enumerate(differences):
        if i not in p:
            out.append({"p": None, "p_holm": None, "interval_holm": None, "apart_holm": None})
            continue
        level = 1 - alpha / (len(known) - ranks[i])
        out.append({"p": p[i], "p_holm": adjusted[i], "interval_holm": interval(value, spread, level), "apart_holm": adjusted[i] < alpha})
    return out
