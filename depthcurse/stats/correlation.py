"""Rank correlation with an interval honest at the n it has: Spearman's rho as Pearson's r of the
average ranks (ties share the mean of the ranks they span, so that a variable with ties, a 0/1
"picked or not" among them, is ranked as it is; the textbook 1 - 6 sum d^2 / (n (n^2 - 1)) holds
only without ties), and its 95% interval by Fisher's z with Bonett and Wright's (2000) standard
error for Spearman's rho, sqrt((1 + rho^2 / 2) / (n - 3)). Pure: no torch."""

from __future__ import annotations

import math

from depthcurse.stats.intervals import CONFIDENCE, t_quantile


def ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties given the mean of the ranks they span."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for i in order[start : end + 1]:
            out[i] = (start + end) / 2 + 1
        start = end + 1
    return out


def pearson(x: list[float], y: list[float]) -> float | None:
    """Pearson's r; None where either side is constant (no order to agree with)."""
    mx, my = sum(x) / len(x), sum(y) / len(y)
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx, syy = sum((a - mx) ** 2 for a in x), sum((b - my) ** 2 for b in y)
    if sxx == 0 or syy == 0:
        return None
    return sxy / math.sqrt(sxx * syy)


def spearman(x: list[float], y: list[float]) -> float | None:
    if len(x) != len(y):
        raise ValueError(f"spearman: {len(x)} values against {len(y)}")
    if len(x) < 2:
        return None
    return pearson(ranks(x), ranks(y))


def spearman_interval(rho: float | None, n: int, confidence: float = CONFIDENCE) -> list[float] | None:
    """Fisher's z interval with Bonett and Wright's standard error; None below 4 pairs (n - 3 > 0
    needed) or without a rho. At |rho| = 1 the interval is the point."""
    if rho is None or n < 4:
        return None
    if abs(rho) >= 1:
        return [rho, rho]
    z, se = math.atanh(rho), math.sqrt((1 + rho**2 / 2) / (n - 3))
    half = t_quantile(math.inf, confidence) * se  # the normal's quantile
    return [math.tanh(z - half), math.tanh(z + half)]
