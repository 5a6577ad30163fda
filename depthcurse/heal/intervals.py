"""How sure a heal's comparison is: 95% intervals from paired differences.

Every model of a heal (unpruned, pruned, each method's healed one) is measured on the same
held-out windows and the same questions, so the unit of a comparison is the pair: the spread
of a difference between two models is the spread of their per-window (per-question)
differences over the square root of their number, far smaller than the spread of either
score, whose windows differ among themselves far more than the models do. A share (won back,
retained) is a ratio of two such paired means; its interval is the delta method's: for
W = A / B, se(W) = se(A - W B) / |B|, A - W B again a paired mean.

A measurement is a list of groups of items: the held-out windows' losses (one group), or a
suite's questions (one group per task, each task's accuracy weighing 1 / tasks in the
average, as `SUITE_METRIC` does)."""

from __future__ import annotations

import math

Z95 = 1.959964  # the normal's 97.5% quantile: a two-sided 95% interval


def items(result: dict, part: str, metric: str) -> list[list[float]] | None:
    """The paired items a model's `metric` on `part` averages, as groups, or None where the run
    did not keep them: per-window losses (KL, agreement) for a held-out text's; per-question scores for a
    task's headline (a suite: each member's; `retained` is the average's) or one member's column."""
    entry = result.get(part) if isinstance(result, dict) else None
    if not isinstance(entry, dict):
        return None
    if part in ("held_out", "other"):
        windows = entry.get("per_window")
        if not windows:
            return None
        if metric == "loss":
            return [list(windows)]
        if metric in ("kl", "agreement"):
            kept = entry.get(f"per_window_{metric}")
            if kept:
                return [list(kept)]
            if entry["metrics"].get("kl") == 0.0 and entry["metrics"].get("agreement") == 1.0:  # the reference itself: 0 and 1 in every window
                return [[0.0 if metric == "kl" else 1.0] * len(windows)]
        return None
    per_example = entry.get("per_example")
    if not per_example:
        return None
    if metric in per_example:  # one task of a suite, or a single task by its own name
        return [list(per_example[metric])]
    if metric in (entry.get("metric"), "retained"):
        return [list(v) for v in per_example.values()]
    return None


def standard_error(groups: dict[str, list[list[float]]], coefficients: dict[str, float]) -> float:
    """The standard error of sum_m c_m X_m, X_m = mean over groups of the mean of model m's items
    in that group, the items paired across models (the same windows, the same questions)."""
    names = [m for m, c in coefficients.items() if c != 0.0]
    count = len(groups[names[0]])
    variance = 0.0
    for g in range(count):
        n = len(groups[names[0]][g])
        if n < 2 or any(len(groups[m][g]) != n for m in names):
            return float("nan")  # not paired: different windows or questions
        z = [sum(coefficients[m] * groups[m][g][i] for m in names) for i in range(n)]
        mean = sum(z) / n
        variance += sum((v - mean) ** 2 for v in z) / (n - 1) / n / count**2
    return math.sqrt(variance)


def interval(value: float, se: float) -> list[float] | None:
    return [value - Z95 * se, value + Z95 * se] if math.isfinite(value) and math.isfinite(se) else None


def won_back_interval(u: float, p: float, h: float, groups: dict[str, list[list[float]]]) -> list[float] | None:
    """The 95% interval of W = (p - h) / (p - u), the share of the removal's cost won back."""
    if p == u:
        return None
    w = (p - h) / (p - u)
    se = standard_error(groups, {"pruned": 1.0 - w, "healed": -1.0, "unpruned": w}) / abs(p - u)
    return interval(w, se)


def ratio_interval(top: float, bottom: float, groups: dict[str, list[list[float]]], top_name: str) -> list[float] | None:
    """The 95% interval of R = top / bottom (retained: a model's suite average over the unpruned model's)."""
    if not bottom:
        return None
    r = top / bottom
    se = standard_error(groups, {top_name: 1.0, "unpruned": -r}) / abs(bottom)
    return interval(r, se)


def difference_interval(a: float, b: float, groups: dict[str, list[list[float]]], first: str, second: str) -> list[float] | None:
    """The 95% interval of a - b, two models' scores on the same items."""
    return interval(a - b, standard_error(groups, {first: 1.0, second: -1.0}))


def gap_upper_bound(value: float, limit_of: float, factor: float, groups: dict[str, list[list[float]]], name: str) -> float:
    """The upper end of the 95% interval of `value` - factor * `limit_of` (a healed loss against a
    budget of factor times the unpruned model's), `name` the model that `value` is of."""
    se = standard_error(groups, {name: 1.0, "unpruned": -factor})
    return value - factor * limit_of + Z95 * (se if math.isfinite(se) else 0.0)


def apart(low_high: list[float] | None) -> bool | None:
    """Whether an interval of a difference excludes 0 (None: no interval)."""
    return None if low_high is None else (low_high[0] > 0 or low_high[1] < 0)
