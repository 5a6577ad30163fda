"""What a heal's measurements say as shares: how much of the suite a model kept (`retained`) and how
much of the removal's cost healing won back (`recovered`), each with its 95% interval from the
paired windows and questions; a gap within the noise is no gap. Pure functions of the records
`loop.measure` makes (no model runs here), so `make mutate` checks them with fast tests."""

from __future__ import annotations

import math

from depthcurse.heal.healed import HELD_OUT_METRICS, MODELS
from depthcurse.heal.intervals import items, paired_spread, retained_interval, won_back_interval
from depthcurse.stats.intervals import Spread, newcombe
from depthcurse.tasks.harness import SUITE_METRIC


def retained(measured: dict, unpruned: dict | None) -> dict:
    """A suite's average as the share of the unpruned model's ("retained %", as the pruning papers
    report their zero-shot suites), put beside it in the task's metrics, with its 95% interval
    from the paired questions in the task's `intervals`. `unpruned` None: `measured` is the
    unpruned model (retained 1)."""
    task = measured.get("task")
    if task is not None and SUITE_METRIC in task["metrics"]:
        base_result = unpruned or measured
        base = base_result["task"]["metrics"][SUITE_METRIC]
        task["metrics"]["retained"] = task["metrics"][SUITE_METRIC] / base if base else float("nan")
        for key in [k for k in task["metrics"] if k.endswith(f" {SUITE_METRIC}")]:  # each named suite of a list: its own share kept
            group_base = base_result["task"]["metrics"].get(key)
            task["metrics"][key.replace(SUITE_METRIC, "retained")] = task["metrics"][key] / group_base if group_base else float("nan")
        groups = {"measured": items(measured, "task", "retained"), "unpruned": items(base_result, "task", "retained")}
        if unpruned is not None and None not in groups.values():
            task["intervals"] = {"retained": retained_interval(task["metrics"][SUITE_METRIC], base, groups, "measured")}
    return measured


def with_retained(results: dict) -> dict:
    """Every model's share of the suite kept, each against the unpruned model's (`retained`)."""
    for name in MODELS:
        if name in results:
            retained(results[name], results["unpruned"] if name != "unpruned" else None)
    return results


def recovered(record: dict) -> tuple[dict, dict, dict]:
    """Per measurement (held-out loss, KL and agreement, the other text's, the task's headline
    metric): the share of what the removal cost that healing won back, (pruned - healed) /
    (pruned - unpruned); 1 is all of it, 0 none, negative worse than pruned. None where there was
    no gap to win back (the removal did not hurt, or the gap is within the noise: the 95% interval
    of the pruned-minus-unpruned difference reaches 0), with why in the second dict; the third,
    each share's 95% interval where the paired windows or questions were kept. Perplexity has no
    share: on its scale a share of the loss gap reads larger."""
    results = record["results"]
    if not all(m in results for m in MODELS):
        return {}, {}, {}
    out, why, intervals = {}, {}, {}
    for part in results["pruned"]:
        if not isinstance(results["pruned"][part], dict) or "metrics" not in results["pruned"][part]:
            continue
        metrics = [m for m in HELD_OUT_METRICS if m != "ppl"] if part in ("held_out", "other") else [results["pruned"][part]["metric"]]
        for metric in metrics:
            u, p, h = (results[m][part]["metrics"].get(metric) if part in results[m] else None for m in MODELS)
            if None in (u, p, h) or not all(map(math.isfinite, (u, p, h))):
                continue
            key = f"{part}_{metric}"
            higher = results["pruned"][part].get("higher_is_better", False) if part == "task" else metric == "agreement"
            gap = (u - p) if higher else (p - u)  # what the removal cost, positive when it hurt
            low_high, how = gap_interval(results, part, metric, gap)
            if gap <= 0:
                out[key], why[key] = None, "no gap to win back: the removal did not hurt"
            elif low_high is not None and not low_high[0] > 0:
                out[key], why[key] = None, (f"no gap to win back: {gap:.4g} is within the noise (the 95% interval of the pruned-minus-unpruned "
                                            f"difference reaches 0: {how})")
            else:
                out[key] = (p - h) / (p - u)
                groups = {m: items(results[m], part, metric) for m in MODELS}
                if None not in groups.values():
                    intervals[key] = won_back_interval(u, p, h, groups)
    return out, why, intervals


def gap_noise(results: dict, part: str, metric: str) -> Spread | None:
    """The standard error of the pruned-minus-unpruned difference of `metric` and its degrees of
    freedom, paired over the windows or questions where both models kept them; None where they did
    not (`gap_interval` then takes the two means alone)."""
    groups = {m: items(results[m], part, metric) for m in ("unpruned", "pruned")}
    if None not in groups.values():
        spread = paired_spread(groups, {"pruned": 1.0, "unpruned": -1.0})
        if math.isfinite(spread.se):
            return spread
    return None


def gap_interval(results: dict, part: str, metric: str, gap: float) -> tuple[list[float] | None, str]:
    """The 95% interval of `gap` (what the removal cost, positive when it hurt) and how it was had:
    paired where the items were kept; for a task's proportion kept only as a mean, Newcombe's
    interval of two proportions of its examples (unpaired, so wider than it need be); None where
    nothing but the two means is known (any gap then counts, and the reason says so)."""
    spread = gap_noise(results, part, metric)
    if spread is not None:
        h = spread.half_width()
        return [gap - h, gap + h], f"+-{h:.4g}"
    u, p = results["unpruned"][part], results["pruned"][part]
    n = p.get("examples") or 0 if part == "task" else 0
    a, b = u["metrics"].get(metric), p["metrics"].get(metric)
    if n and a is not None and b is not None and 0 <= a <= 1 and 0 <= b <= 1:
        low, high = newcombe(a * n, n, b * n, n)  # unpruned minus pruned
        hurt = [low, high] if abs(gap - (a - b)) <= abs(gap + (a - b)) else [-high, -low]
        return hurt, f"Newcombe's, two proportions of {n} examples: [{hurt[0]:+.4g}, {hurt[1]:+.4g}]"
    return None, "no per-item scores and no proportion: not known"