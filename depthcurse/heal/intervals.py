"""How sure a heal's comparison is: 95% intervals from paired differences.

Every model of a heal (unpruned, pruned, each method's healed one) is measured on the same
held-out windows and the same questions, so the unit of a comparison is the pair: the spread
of a difference between two models is the spread of their per-window (per-question)
differences over the square root of their number, far smaller than the spread of either
score, whose windows differ among themselves far more than the models do. A share (won back,
retained) is a ratio of two such paired means; its interval is the delta method's: for
W = A / B, se(W) = se(A - W B) / |B|, A - W B again a paired mean. Every interval takes Student's
t at the degrees of freedom its standard error has (`stats.intervals`).

A measurement is a list of groups of items: the held-out windows' losses (one group), or a
suite's questions (one group per task, each task's accuracy weighing 1 / tasks in the
average, as `SUITE_METRIC` does)."""

from __future__ import annotations

from depthcurse.stats.intervals import Spread, apart, difference_interval, interval, paired_spread, ratio_interval

__all__ = ["items", "won_back_interval", "retained_interval", "difference_interval", "gap_upper_bound", "apart", "paired_spread"]


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


def won_back_interval(u: float, p: float, h: float, groups: dict[str, list[list[float]]]) -> list[float] | None:
    """The 95% interval of W = (p - h) / (p - u), the share of the removal's cost won back."""
    if p == u:
        return None
    w = (p - h) / (p - u)
    spread = paired_spread(groups, {"pruned": 1.0 - w, "healed": -1.0, "unpruned": w})
    return interval(w, Spread(spread.se / abs(p - u), spread.df))


def retained_interval(top: float, bottom: float, groups: dict[str, list[list[float]]], top_name: str) -> list[float] | None:
    """The 95% interval of R = top / bottom (retained: a model's suite average over the unpruned model's)."""
    return ratio_interval(top, bottom, groups, top_name, "unpruned")


def gap_upper_bound(value: float, limit_of: float, factor: float, groups: dict[str, list[list[float]]], name: str) -> float:
    """The upper end of the 95% interval of `value` - factor * `limit_of` (a healed loss against a
    budget of factor times the unpruned model's), `name` the model that `value` is of; the value
    itself where no spread is known."""
    low_high = interval(value - factor * limit_of, paired_spread(groups, {name: 1.0, "unpruned": -factor}))
    return low_high[1] if low_high else value - factor * limit_of
