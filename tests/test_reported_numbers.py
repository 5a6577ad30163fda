"""What the tool reports from its measurements, pinned: every number below is worked out by hand in
the test (or its docstring) from records built here, and every sentence a reader gets is compared
whole. Pure functions of numbers and records: no model; `make mutate` runs these against each
mutant of the statistics core (docs/benchmarks.md, "Mutation score")."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from depthcurse.heal.intervals import gap_upper_bound, items, won_back_interval
from depthcurse.heal.model_index import evaluation_results
from depthcurse.heal.shares import gap_interval, gap_noise, recovered, retained, with_retained
from depthcurse.select.statistics import decomposition, key, measurements, overlap
from depthcurse.speed.paired import PairedRatio, Shares, Verdict, enough, judge, median_interval
from depthcurse.stats import MIN_ITEMS, Spread, apart, resample, shares
from depthcurse.stats.bootstrap import check_items
from depthcurse.stats.intervals import newcombe
from depthcurse.tasks.probes import PROBES, SHOTS, STOP, capability_scores, describe, examples, per_rung, task_config

pytestmark = pytest.mark.statistics

T3 = 3.182446  # Student's t, 97.5%, 3 degrees of freedom (a printed table)


# --------------------------------------------------------------------------- speed: a ratio of two things timed in turns


def test_a_ratio_with_too_few_pairs_has_no_interval_and_says_how_many_it_needs():
    assert judge(PairedRatio([0.9] * 5)) == Verdict("unstable", "5 pairs give no 95% interval (at least 6 do)")
    assert judge(PairedRatio([0.9])) == Verdict("unstable", "1 pair gives no 95% interval (at least 6 do)")


SHARES = Shares(layers=0.7, arithmetic=0.8, bytes=0.85)


def test_every_verdict_of_a_bounded_ratio_word_for_word():
    """Six pairs bound the median by their extremes (k = 1: P(X < 1) = 1/64 <= 2.5%)."""
    below = judge(PairedRatio([0.5, 0.52, 0.54, 0.56, 0.58, 0.6]), SHARES, ceiling=1.0)
    assert below == Verdict("impossible", "0.550x (0.500-0.600) lies below 0.700x, the share of the layers kept, which no ratio of the "
                                          "times can beat: the machine changed while it ran")
    above = judge(PairedRatio([1.05, 1.06, 1.07, 1.08, 1.09, 1.1]), SHARES, ceiling=1.0)
    assert above == Verdict("impossible", "1.075x (1.050-1.100) lies above 1.000x: the faster side measured slower, though it runs a "
                                          "subset of the other's work: the machine changed while it ran")
    reaches = judge(PairedRatio([0.9, 0.95, 0.98, 1.02, 1.05, 1.1]), SHARES, ceiling=1.0)
    assert reaches == Verdict("unstable", "1.000x, but its interval 0.900-1.100 reaches 1.000x over 6 pairs: no change told apart")
    touches = judge(PairedRatio([0.8, 0.85, 0.9, 0.95, 0.98, 1.0]), SHARES, ceiling=1.0)
    assert touches.status == "unstable" and "reaches 1.000x" in touches.reason  # its upper end at the ceiling exactly: not a change
    crosses = judge(PairedRatio([0.65, 0.7, 0.72, 0.75, 0.78, 0.8]), SHARES, ceiling=1.0)
    assert crosses == Verdict("unstable", "0.735x, but its interval 0.650-0.800 crosses 0.700x, the share of the layers kept, over 6 pairs: "
                                          "the machine changed while it ran")
    under = judge(PairedRatio([0.6, 0.62, 0.64, 0.68, 0.7, 0.75]), SHARES, ceiling=1.0)  # the median under the floor, the interval not (issue 81)
    assert under == Verdict("unstable", "0.660x lies below 0.700x, the share of the layers kept, which no ratio of the times can beat, but its "
                                        "interval 0.600-0.750 reaches above it over 6 pairs: unstable, not impossible (that takes the whole interval "
                                        "below): the machine changed while it ran")
    ok = judge(PairedRatio([0.75, 0.78, 0.80, 0.80, 0.82, 0.85]), SHARES, ceiling=1.0)  # half-width (0.85 - 0.75) / 2 / 0.8 = 6.25%
    assert ok == Verdict("ok", "0.800x (0.750-0.850, +-6.2%): 15% to 25% less", "arithmetic")
    at_floor = judge(PairedRatio([0.7, 0.72, 0.74, 0.76, 0.78, 0.8]), SHARES, ceiling=1.0)
    assert at_floor.status == "ok" and at_floor.regime == "layers"  # the lower end on the floor itself: not below it


def test_an_unbounded_ratio_is_a_finding_when_its_interval_is_tight():
    wide = judge(PairedRatio([0.5, 0.6, 0.7, 0.8, 0.9, 1.0]))  # (1.0 - 0.5) / 2 / 0.75 = 33.3%
    assert wide == Verdict("unstable", "0.750x, but its interval 0.500-1.000 is +-33.3% wide (more than +-5%) over 6 pairs")
    tight = judge(PairedRatio([0.8, 0.8, 0.8, 0.8, 0.8, 0.81]))
    assert tight == Verdict("ok", "0.800x (0.800-0.810)", None)
    assert judge(PairedRatio([0.8, 0.8, 0.8, 0.8, 0.8, 0.81]), SHARES) == Verdict("ok", "0.800x (0.800-0.810)", "arithmetic")
    assert judge(PairedRatio([0.8, 0.8, 0.8, 0.8, 0.8, 0.81]), ceiling=1.0).regime is None
    # exactly at the tolerance is steady: (0.84 - 0.76) / 2 / 0.8 = 5%
    assert PairedRatio([0.76, 0.8, 0.8, 0.8, 0.8, 0.84]).tight(0.05) and not PairedRatio([0.75, 0.8, 0.8, 0.8, 0.8, 0.84]).tight(0.05)
    assert Verdict("ok", "").trusted and not Verdict("unstable", "").trusted


def test_a_ratios_summary_and_the_shares_it_is_judged_against():
    ratio = PairedRatio([0.75, 0.78, 0.80, 0.80, 0.82, 0.85])
    assert ratio.summary() == {"median": 0.8, "interval": [0.75, 0.85], "confidence": 0.95, "half_width": pytest.approx(0.0625), "pairs": 6,
                               "ratios": [0.75, 0.78, 0.80, 0.80, 0.82, 0.85]}
    assert PairedRatio([0.8] * 3).summary() == {"median": 0.8, "interval": None, "confidence": 0.95, "half_width": None, "pairs": 3, "ratios": [0.8] * 3}
    assert PairedRatio([0.8] * 3).half_width == math.inf
    assert SHARES.lowest == 0.7 and SHARES.regime(0.79) == "arithmetic" and SHARES.regime(0.84) == "bytes" and SHARES.regime(0.2) == "layers"


def test_the_median_interval_at_other_confidences():
    # 1 - 2/64: P(X <= 0) = 1/64 equals alpha, which still bounds (P(X < 1) <= alpha): the extremes of 6
    assert median_interval([float(i) for i in range(6)], confidence=1 - 2 / 64) == (0.0, 5.0)
    # 20%: alpha 0.4, P(X <= 3) = 0.254 <= 0.4 < P(X <= 4) = 0.5 for 9 values: the 4th smallest and largest
    assert median_interval([float(i) for i in range(9)], confidence=0.2) == (3.0, 5.0)
    assert median_interval([3.0, 1.0, 2.0, 6.0, 5.0, 4.0, 0.0]) == (0.0, 6.0)  # unsorted: sorted first


def test_measuring_stops_when_steady_or_out_of_time_never_halfway_through_a_pair():
    steady, wide = PairedRatio([0.8] * 8), PairedRatio([0.5, 0.9, 0.6, 0.95, 0.55, 0.85, 0.7, 0.99])
    assert enough([steady], 8, 6, 40, 0.0, 300.0) and not enough([steady, wide], 8, 6, 40, 0.0, 300.0)
    assert not enough([steady], 5, 6, 40, 0.0, 300.0)  # below min_pairs: on, however steady
    assert enough([steady], 6, 6, 40, 0.0, 300.0)  # at min_pairs: steady is enough
    assert enough([wide], 40, 6, 40, 0.0, 300.0) and not enough([wide], 39, 6, 40, 0.0, 300.0)  # max_pairs reached
    assert enough([wide], 3, 6, 40, 250.0, 300.0, last_pair_s=60.0)  # another pair as long as the last would overrun
    assert not enough([wide], 3, 6, 40, 240.0, 300.0, last_pair_s=60.0)  # ends at the budget exactly: begun
    assert not enough([wide], 3, 6, 40, 299.0, 300.0)  # no last pair given: none assumed


# --------------------------------------------------------------------------- heal: what a record's measurements are


def test_the_items_a_measurement_averages():
    windows = {"metric": "loss", "metrics": {"loss": 2.0, "kl": 0.3, "agreement": 0.8}, "per_window": [1.0, 3.0],
               "per_window_kl": [0.2, 0.4], "per_window_agreement": [0.7, 0.9]}
    result = {"held_out": windows, "other": {**windows, "per_window": [5.0, 6.0]}}
    assert items(result, "held_out", "loss") == [[1.0, 3.0]] and items(result, "other", "loss") == [[5.0, 6.0]]
    assert items(result, "held_out", "kl") == [[0.2, 0.4]] and items(result, "held_out", "agreement") == [[0.7, 0.9]]
    assert items(result, "held_out", "ppl") is None  # a perplexity is no mean of windows
    reference = {"held_out": {"metric": "loss", "metrics": {"loss": 2.0, "kl": 0.0, "agreement": 1.0}, "per_window": [1.0, 3.0, 2.0]}}
    assert items(reference, "held_out", "kl") == [[0.0, 0.0, 0.0]] and items(reference, "held_out", "agreement") == [[1.0, 1.0, 1.0]]
    unkept = {"held_out": {"metric": "loss", "metrics": {"loss": 2.0, "kl": 0.3, "agreement": 0.8}, "per_window": [1.0, 3.0]}}
    assert items(unkept, "held_out", "kl") is None and items(unkept, "held_out", "agreement") is None
    assert items({"held_out": {"metrics": {}, "per_window": []}}, "held_out", "loss") is None
    assert items({"held_out": "not measured"}, "held_out", "loss") is None and items(None, "held_out", "loss") is None
    assert items({}, "task", "acc") is None
    suite = {"task": {"metric": "average", "metrics": {}, "per_example": {"arc_easy": [1, 0], "piqa": [1, 1, 0]}}}
    assert items(suite, "task", "average") == [[1, 0], [1, 1, 0]] and items(suite, "task", "retained") == [[1, 0], [1, 1, 0]]
    assert items(suite, "task", "piqa") == [[1, 1, 0]] and items(suite, "task", "acc_norm") is None
    assert items({"task": {"metric": "acc", "metrics": {}}}, "task", "acc") is None


def test_the_upper_end_of_a_healed_loss_against_its_budget():
    """u = 3.0, 3.2, 2.8, 3.0 and h = 3.4, 3.6, 3.3, 3.5 against 1.1 u: z = 0.10, 0.08, 0.22, 0.20, mean
    0.15, sum of squares about it 0.0148, sd sqrt(0.0148 / 3), se that / 2; upper end 0.15 + t(3) se."""
    u, h = [3.0, 3.2, 2.8, 3.0], [3.4, 3.6, 3.3, 3.5]
    se = math.sqrt(0.0148 / 3) / 2
    assert gap_upper_bound(3.45, 3.0, 1.1, {"healed": [h], "unpruned": [u]}, "healed") == pytest.approx(0.15 + T3 * se, rel=1e-6)
    assert gap_upper_bound(3.45, 3.0, 1.1, {"healed": [h[:3]], "unpruned": [u]}, "healed") == pytest.approx(0.15)  # unpaired: the point
    assert won_back_interval(3.0, 3.0, 2.5, {}) is None  # no cost to win back


def test_the_noise_of_a_gap_paired_or_of_two_proportions():
    """Paired where the items were kept: differences 0.1, 0.3, 0.2, 0.2 (se 0.040825, 3 df). Otherwise
    a task's accuracy as two proportions of its 100 examples, by Newcombe's interval: 0.6 against 0.4,
    Wilson's intervals [0.50200, 0.69061] and [0.30939, 0.49800], so from 0.2 down sqrt(0.09800^2 +
    0.09800^2) and up sqrt(0.09061^2 + 0.09061^2): [0.06141, 0.32813] (the normal's would be 0.2 -+
    0.13579, symmetric); nothing known: no interval."""
    held = lambda w: {"metric": "loss", "metrics": {"loss": sum(w) / 4}, "per_window": w}  # noqa: E731
    results = {"unpruned": {"held_out": held([3.0] * 4)}, "pruned": {"held_out": held([3.1, 3.3, 3.2, 3.2])}}
    spread = gap_noise(results, "held_out", "loss")
    assert spread.se == pytest.approx(0.0408248, rel=1e-5) and spread.df == 3
    assert gap_interval(results, "held_out", "loss", 0.2)[0] == pytest.approx([0.2 - T3 * 0.0408248, 0.2 + T3 * 0.0408248], rel=1e-5)
    task = lambda acc, n: {"metric": "acc", "metrics": {"acc": acc}, "examples": n}  # noqa: E731
    two = {"unpruned": {"task": task(0.6, 100)}, "pruned": {"task": task(0.4, 100)}}
    assert gap_noise(two, "task", "acc") is None
    low_high, how = gap_interval(two, "task", "acc", 0.2)
    assert low_high == pytest.approx([0.061411, 0.328126], abs=2e-6) and how.startswith("Newcombe's, two proportions of 100 examples")
    lower_better = {"unpruned": {"task": task(0.4, 100)}, "pruned": {"task": task(0.6, 100)}}  # an error rate: the hurt is pruned - unpruned
    assert gap_interval(lower_better, "task", "acc", 0.2)[0] == pytest.approx([0.061411, 0.328126], abs=2e-6)
    edges = gap_interval({"unpruned": {"task": task(1.0, 50)}, "pruned": {"task": task(0.0, 50)}}, "task", "acc", 1.0)[0]
    assert edges == pytest.approx([0.8991, 1.0], abs=1e-4)  # at 1 and 0 Wilson's intervals still have width: so does the difference's
    for u, p, n in ((12.0, 14.0, 100), (0.6, 1.4, 100), (-0.1, 0.4, 100), (0.6, 0.4, 0), (None, 0.4, 100), (0.6, None, 100)):
        assert gap_interval({"unpruned": {"task": task(u, n)}, "pruned": {"task": task(p, n)}}, "task", "acc", 0.2)[0] is None, (u, p, n)
    unkept = {"unpruned": {"held_out": {"metric": "loss", "metrics": {"loss": 3.0}}}, "pruned": {"held_out": {"metric": "loss", "metrics": {"loss": 3.2}}}}
    assert gap_noise(unkept, "held_out", "loss") is None and gap_interval(unkept, "held_out", "loss", 0.2)[0] is None


def test_newcombes_interval_covers_95_percent_where_walds_does_not():
    """Two proportions near the edge (0.9 and 0.8) of 30 examples each, 4,000 draws: Newcombe's
    interval covers the true 0.1 about 95% of the time; the normal's (Wald's) falls short."""
    rng = np.random.default_rng(7)
    newc = wald = 0
    for _ in range(4000):
        a, b = rng.binomial(30, 0.9), rng.binomial(30, 0.8)
        low, high = newcombe(a, 30, b, 30)
        newc += low <= 0.1 <= high
        pa, pb = a / 30, b / 30
        h = 1.959964 * math.sqrt((pa * (1 - pa) + pb * (1 - pb)) / 30)
        wald += pa - pb - h <= 0.1 <= pa - pb + h
    assert 0.935 <= newc / 4000 <= 0.975 and wald / 4000 < newc / 4000


def _models(**parts):
    """results for unpruned, pruned, healed from {part: (u, p, h)} of per-window lists or task dicts."""
    out = {m: {} for m in ("unpruned", "pruned", "healed")}
    for part, triple in parts.items():
        for m, value in zip(out, triple):
            out[m][part] = value
    return out


def test_what_healing_won_back_on_every_measurement_and_why_not():
    """held_out: loss 3 -> 4 -> 3.5 won back (4 - 3.5) / (4 - 3) = 0.5; agreement (higher is better)
    1 -> 0.6 -> 0.8: (0.6 - 0.8) / (0.6 - 1) = 0.5; KL 0 -> 0.4 -> 0.1: 0.75. other: loss 3 -> 3 -> 2.9,
    no gap. task (acc, higher better) 0.8 -> 0.4 -> 0.7 over 100 examples: 0.75."""
    def held(losses, kl, agreement):
        return {"metric": "loss", "metrics": {"loss": sum(losses) / 4, "ppl": math.exp(sum(losses) / 4), "kl": sum(kl) / 4, "agreement": sum(agreement) / 4},
                "per_window": losses, "per_window_kl": kl, "per_window_agreement": agreement}

    results = _models(
        held_out=(held([3.0, 3.1, 2.9, 3.0], [0.0] * 4, [1.0] * 4), held([4.0, 4.2, 3.8, 4.0], [0.4, 0.5, 0.3, 0.4], [0.6, 0.5, 0.7, 0.6]),
                  held([3.5, 3.6, 3.4, 3.5], [0.1, 0.1, 0.1, 0.1], [0.8, 0.8, 0.8, 0.8])),
        other=(held([3.0] * 4, [0.0] * 4, [1.0] * 4), held([3.0] * 4, [0.0] * 4, [1.0] * 4), held([2.9] * 4, [0.0] * 4, [1.0] * 4)),
        task=tuple({"metric": "acc", "higher_is_better": True, "metrics": {"acc": a}, "examples": 100} for a in (0.8, 0.4, 0.7)),
        note="a string where a measurement would be")
    won, why, intervals = recovered({"results": results})
    assert won == pytest.approx({"held_out_loss": 0.5, "held_out_kl": 0.75, "held_out_agreement": 0.5, "other_loss": None, "other_kl": None,
                                 "other_agreement": None, "task_acc": 0.75})
    assert why == {"other_loss": "no gap to win back: the removal did not hurt", "other_kl": "no gap to win back: the removal did not hurt",
                   "other_agreement": "no gap to win back: the removal did not hurt"}
    assert set(intervals) == {"held_out_loss", "held_out_kl", "held_out_agreement"}  # the task kept no questions: no interval
    low, high = intervals["held_out_loss"]
    assert low < 0.5 < high
    assert recovered({"results": {"unpruned": {}, "pruned": {}}}) == ({}, {}, {})  # not healed yet
    nan = _models(held_out=tuple({"metric": "loss", "metrics": {"loss": v}} for v in (3.0, float("nan"), 3.1)))
    assert recovered({"results": nan}) == ({}, {}, {})
    lower = _models(task=tuple({"metric": "error", "higher_is_better": False, "metrics": {"error": e}, "examples": 100} for e in (0.2, 0.6, 0.3)))
    assert recovered({"results": lower})[0] == pytest.approx({"task_error": 0.75})  # (0.6 - 0.3) / (0.6 - 0.2)
    missing = _models(held_out=({"metric": "loss", "metrics": {"loss": 3.0}}, {"metric": "loss", "metrics": {"loss": 4.0}}, {"metric": "loss", "metrics": {}}))
    assert recovered({"results": missing}) == ({}, {}, {})
    noisy = _models(held_out=tuple({"metric": "loss", "metrics": {"loss": sum(w) / 4}, "per_window": w}
                                   for w in ([3.0, 3.0, 3.0, 3.0], [3.0, 3.4, 3.1, 3.3], [3.0, 3.1, 3.1, 3.1])))
    _, why, _ = recovered({"results": noisy})
    assert why["held_out_loss"] == ("no gap to win back: 0.2 is within the noise (the 95% interval of the pruned-minus-unpruned difference reaches 0: "
                                    "+-0.2905)")
    close = _models(task=tuple({"metric": "acc", "higher_is_better": True, "metrics": {"acc": a}, "examples": 50} for a in (0.62, 0.5, 0.6)))
    _, why, _ = recovered({"results": close})  # 0.12 of 50 examples each: Newcombe's interval reaches 0
    assert why["task_acc"].startswith("no gap to win back: 0.12 is within the noise") and "Newcombe's, two proportions of 50 examples: [-0.07" in why["task_acc"]


def test_retained_for_a_list_of_two_named_suites():
    """commonsense and probes in one list: the whole list's average 0.45 of the unpruned 0.6 (75%),
    each suite its own share (0.5 / 0.6, 0.4 / 0.6); a suite whose unpruned average is 0 has no share."""
    def suite(c, p, per_example=None):
        metrics = {"arc_easy": c, "probe_add_1d": p, "commonsense average": c, "probes average": p, "average": (c + p) / 2}
        return {"task": {"metric": "average", "metrics": metrics, **({"per_example": per_example} if per_example else {})}}

    unpruned, pruned = suite(0.6, 0.6), suite(0.5, 0.4)
    out = retained(pruned, unpruned)["task"]["metrics"]
    assert out["retained"] == pytest.approx(0.75) and out["commonsense retained"] == pytest.approx(0.5 / 0.6)
    assert out["probes retained"] == pytest.approx(0.4 / 0.6) and "intervals" not in pruned["task"]  # no questions kept: no interval
    zero = retained(suite(0.5, 0.4), suite(0.6, 0.0))["task"]["metrics"]
    assert math.isnan(zero["probes retained"]) and zero["commonsense retained"] == pytest.approx(0.5 / 0.6)
    assert math.isnan(retained(suite(0.5, 0.4), suite(0.0, 0.0))["task"]["metrics"]["retained"])
    plain = {"task": {"metric": "acc", "metrics": {"acc": 0.5}}}
    assert retained(plain, suite(0.6, 0.6)) == {"task": {"metric": "acc", "metrics": {"acc": 0.5}}}  # one task: no suite, no share
    assert retained({"held_out": {}}, None) == {"held_out": {}}
    own = retained(suite(0.6, 0.6, {"arc_easy": [1, 0], "probe_add_1d": [1, 0]}), None)["task"]
    assert own["metrics"]["retained"] == 1.0 and "intervals" not in own  # the unpruned model: 1, and nothing to compare
    paired = retained(suite(0.5, 0.5, {"arc_easy": [1, 0, 1, 0], "probe_add_1d": [0, 1, 1, 0]}),
                      suite(0.75, 0.5, {"arc_easy": [1, 1, 1, 0], "probe_add_1d": [0, 1, 1, 0]}))["task"]
    low, high = paired["intervals"]["retained"]
    assert low < 0.5 / 0.625 < high
    assert with_retained({"unpruned": suite(0.6, 0.6), "pruned": suite(0.3, 0.3)})["pruned"]["task"]["metrics"]["retained"] == pytest.approx(0.5)


def test_the_model_index_of_a_healed_model_entry_by_entry():
    """Each held-out text by every metric it has; a list of suites by member (its headline, acc where
    none is named), each named suite's average and retained (percent), the whole list's; a plain task
    by its metric; nothing that is not finite, nothing of the unpruned or pruned model."""
    healed = {
        "held_out": {"metric": "loss", "data": "wiki (held out)", "metrics": {"loss": 3.5, "ppl": 33.1, "kl": 0.2, "agreement": float("nan")}},
        "task": {"metric": "average", "data": "commonsense,probes", "member_metrics": {"arc_easy": "acc_norm"},
                 "metrics": {"arc_easy": 0.5, "probe_add_1d": 0.25, "commonsense average": 0.5, "commonsense retained": 0.8,
                             "probes average": 0.25, "probes retained": 0.5, "average": 0.375, "retained": 0.6}},
        "note": "not a measurement",
    }
    record = {"results": {"unpruned": {"held_out": {"metric": "loss", "data": "x", "metrics": {"loss": 1.0}}}, "healed": healed}}
    assert evaluation_results(record) == [
        {"task": "text-generation", "dataset": "wiki (held out)", "metric": "loss", "value": 3.5, "part": "held_out"},
        {"task": "text-generation", "dataset": "wiki (held out)", "metric": "ppl", "value": 33.1, "part": "held_out"},
        {"task": "text-generation", "dataset": "wiki (held out)", "metric": "kl", "value": 0.2, "part": "held_out"},
        {"task": "multiple-choice", "dataset": "arc_easy", "metric": "acc_norm", "value": 0.5, "part": "task"},
        {"task": "multiple-choice", "dataset": "probe_add_1d", "metric": "acc", "value": 0.25, "part": "task"},
        {"task": "multiple-choice", "dataset": "commonsense", "metric": "average", "value": 0.5, "part": "task"},
        {"task": "multiple-choice", "dataset": "commonsense", "metric": "retained %", "value": 80.0, "part": "task"},
        {"task": "multiple-choice", "dataset": "probes", "metric": "average", "value": 0.25, "part": "task"},
        {"task": "multiple-choice", "dataset": "probes", "metric": "retained %", "value": 50.0, "part": "task"},
        {"task": "multiple-choice", "dataset": "commonsense,probes", "metric": "average", "value": 0.375, "part": "task"},
        {"task": "multiple-choice", "dataset": "commonsense,probes", "metric": "retained %", "value": 60.0, "part": "task"},
    ]
    plain = {"results": {"healed": {"task": {"metric": "acc", "data": "arc_easy", "metrics": {"acc": 0.4, "acc_norm": 0.5}}}}}
    assert evaluation_results(plain) == [{"task": "multiple-choice", "dataset": "arc_easy", "metric": "acc", "value": 0.4, "part": "task"}]
    assert evaluation_results({"results": {}}) == []


# --------------------------------------------------------------------------- select: its record's statistics


def _grid_record(with_task: bool = True, eval_items: int = 8):
    """Texts A (labelled "alpha") and B x searches g and a: each cell's items a level plus one shared noise."""
    noise = [0.3, -0.2, 0.1, 0.0, 0.5, -0.4, 0.2, -0.5, 0.15, -0.05][:eval_items]
    levels = {("A", "g"): 1.0, ("A", "a"): 3.0, ("B", "g"): 1.2, ("B", "a"): 3.4}
    cells, held, task = {}, {"A": {}, "B": {}}, {}
    for i, ((text, search), level) in enumerate(levels.items()):
        cells[f"{text}/{search}"] = {"calibration": text, "search": search, "objective": "-", "layers": [i, 9]}
        for source in held:
            held[source][key([i, 9])] = {"loss": [level + e for e in noise], "kl": [level + 2 * e for e in noise]}
        task[key([i, 9])] = {"metric": "acc", "value": 0.0, "items": [-level + e for e in noise]}
    for source in held:
        held[source][""] = {"loss": list(noise), "kl": [0.0] * len(noise)}
    task[""] = {"metric": "acc", "value": 0.5, "items": list(noise)}
    task["describe"] = {"task": "probes"}
    record = {"run": {"calibration": ["A", "B"], "task": "probes" if with_task else None}, "cells": cells, "held_out": held,
              "labels": {"A": "alpha", "B": "B"}}
    if with_task:
        record["task"] = task
    return record, levels


def test_select_names_each_measurement_by_its_texts_label_and_the_task():
    record, _ = _grid_record()
    found = measurements(record)
    assert list(found) == ["alpha held-out loss", "alpha held-out kl", "B held-out loss", "B held-out kl", "probes acc"]
    assert found["probes acc"][""] == record["task"][""]["items"] and "describe" not in found["probes acc"]
    assert found["B held-out kl"][key([1, 9])] == record["held_out"]["B"][key([1, 9])]["kl"]
    assert list(measurements({**record, "labels": {}})) [0] == "A held-out loss"  # no label: the source as given
    del record["labels"]
    assert list(measurements(record))[2] == "B held-out loss"


def test_select_decomposes_every_measurement_with_paired_intervals():
    """The levels' grid: rows (A 2.0, B 2.3), columns (g 1.1, a 3.2), grand 2.15; rows' SS 0.09,
    columns' 4.41, total 4.51: the same for every measurement (the task's levels negated), each cell's
    mean its level (the noise sums to 0); every resample moves all cells alike, so each interval is a
    point and the search decides."""
    record, levels = _grid_record()
    got = decomposition(record, seed=0)
    assert list(got) == ["alpha held-out loss", "alpha held-out kl", "B held-out loss", "B held-out kl", "probes acc"]
    for name, d in got.items():
        assert d["shares"] == pytest.approx({"calibration": 0.09 / 4.51, "search": 4.41 / 4.51, "rest": 0.01 / 4.51}), name
        assert d["intervals"]["search"] == pytest.approx([4.41 / 4.51] * 2) and d["intervals"]["calibration"] == pytest.approx([0.09 / 4.51] * 2)
        assert d["decided_by"] == "search" and d["items"] == 8
    assert got["alpha held-out loss"]["scores"] == pytest.approx({"A|a/-": 3.0, "A|g/-": 1.0, "B|a/-": 3.4, "B|g/-": 1.2})
    assert got["probes acc"]["scores"]["B|a/-"] == pytest.approx(-3.4)
    # rows that decide: the levels transposed (texts far apart, searches close)
    for source in record["held_out"]:
        for k, cell in zip([key([i, 9]) for i in range(4)], [(0, 0), (0, 1), (1, 0), (1, 1)]):
            record["held_out"][source][k]["loss"] = [(5.0 if cell[0] else 1.0) + 0.1 * cell[1] + e for e in record["held_out"][source][""]["loss"]]
    assert decomposition(record, seed=0)["alpha held-out loss"]["decided_by"] == "calibration"


def test_select_says_why_it_cannot_decompose():
    record, _ = _grid_record(eval_items=4)
    said = decomposition(record, seed=0)["alpha held-out loss"]
    assert said["decided_by"] == ("cannot tell (4 held-out items are too few to resample: n items have C(2n-1, n) distinct resamples (35 here) "
                                  "and a bootstrap interval from fewer than 8 covers well under 95%)")
    assert said["intervals"] == {"calibration": None, "search": None, "rest": None} and said["shares"]["search"] == pytest.approx(4.41 / 4.51)
    record, _ = _grid_record(with_task=False)
    assert "probes acc" not in decomposition(record, seed=0)
    one_search = {**record, "cells": {k: v for k, v in record["cells"].items() if v["search"] == "g"}}
    assert decomposition(one_search, seed=0) == {"why_not": "a decomposition needs two calibration texts and two searches (or objectives) at least"}
    partial = {**record, "cells": {k: v for k, v in record["cells"].items() if k != "B/a"}}
    assert decomposition(partial, seed=0) == {"why_not": "the grid is not complete yet"}
    three = {**record, "run": {**record["run"], "calibration": ["A", "B", "C"]}}  # a text with no cells yet: 6 cells asked, 4 there
    assert decomposition(three, seed=0) == {"why_not": "the grid is not complete yet"}
    unjudged = {**record, "held_out": {"A": record["held_out"]["A"], "B": {k: v for k, v in record["held_out"]["B"].items() if k != key([3, 9])}}}
    assert list(decomposition(unjudged, seed=0)) == ["alpha held-out loss", "alpha held-out kl"]  # B's not judged on every choice yet


def test_overlap_of_cells_with_no_pairs_of_a_kind():
    cells = {"A/g": {"calibration": "A", "search": "g", "objective": "-", "layers": [1, 2]}}
    assert overlap(cells) == {"cells": ["A/g"], "matrix": [[1.0]], "same_calibration_mean": None, "same_calibration_pairs": 0,
                              "same_search_mean": None, "same_search_pairs": 0}
    assert key([3, 1, 2]) == "3,1,2" and key([]) == ""


# --------------------------------------------------------------------------- the bootstrap's edges


def test_the_bootstrap_leaves_out_undefined_resamples_and_gives_none_where_most_are():
    d = np.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0])

    def statistic(picks):  # defined only where the resample holds the 1: about 1 - (7/8)^8 = 66% of draws
        values = d[picks].sum(1)
        return {"mean": d[picks].mean(1), "odd": np.where(values > 0, values, np.nan)}

    got = resample(statistic, 8, seed=5, draws=500)
    assert got["odd"] is None and got["mean"][0] == 0.0 and 0.375 <= got["mean"][1] <= 0.5
    again = resample(statistic, 8, seed=5, draws=500)
    assert again == got and resample(statistic, 8, seed=6, draws=500) != got  # the seed decides the draws
    every = resample(lambda picks: {"largest": picks.max(1).astype(float), "smallest": picks.min(1).astype(float)}, 8, seed=0, draws=500)
    assert every["largest"][1] == 7.0 and every["smallest"][0] == 0.0  # indices from 0 to n - 1
    almost = resample(lambda picks: {"m": np.where(np.arange(len(picks)) < 25, np.nan, 1.0)}, 8, seed=0, draws=500)
    assert almost["m"] == [1.0, 1.0]  # 475 of 500 defined: 95%, enough
    short = resample(lambda picks: {"m": np.where(np.arange(len(picks)) < 26, np.nan, 1.0)}, 8, seed=0, draws=500)
    assert short["m"] is None
    narrow = resample(lambda picks: {"m": np.random.default_rng(0).normal(0, 1, len(picks))}, 100, seed=0, draws=2000, confidence=0.5)
    assert -0.8 < narrow["m"][0] < -0.6 and 0.6 < narrow["m"][1] < 0.8  # 50%: the quartiles of a normal, +-0.674
    with pytest.raises(Exception, match="^7 items are too few"):
        check_items(MIN_ITEMS - 1)
    with pytest.raises(Exception, match=r"^0 windows are too few to resample: n items have C\(2n-1, n\) distinct resamples \(0 here\)"):
        check_items(0, "windows")
    check_items(MIN_ITEMS)


def test_small_intervals_and_their_edges():
    from depthcurse.stats import interval, mean_interval, ratio_interval, difference_interval, wilson

    assert Spread(1.0, 0.0).half_width() == math.inf and Spread(2.0, 3.0).half_width(0.9) == pytest.approx(2 * 2.353363, rel=1e-6)
    assert interval(1.0, Spread(1.0, 0.0)) is None and interval(1.0, Spread(0.5, 4.0), 0.9) == pytest.approx([1 - 0.5 * 2.131847, 1 + 0.5 * 2.131847], abs=1e-6)
    assert mean_interval([1.0, 3.0], 0.9) == pytest.approx([2.0 - 6.313752, 2.0 + 6.313752], abs=1e-5)  # sd sqrt(2), se 1, t(1) at 90%
    assert mean_interval([1.0, 3.0]) == pytest.approx([2.0 - 12.706205, 2.0 + 12.706205], abs=1e-5) and mean_interval([]) is None
    groups = {"a": [[1.0, 2.0, 4.0]], "b": [[0.0, 1.0, 1.0]]}  # differences 1, 1, 3: mean 5/3, sd sqrt(4/3), se sqrt(4/9)
    assert difference_interval(7 / 3, 2 / 3, groups, "a", "b", 0.9) == pytest.approx([5 / 3 - 2.919986 * 2 / 3, 5 / 3 + 2.919986 * 2 / 3], abs=1e-5)
    ratio = ratio_interval(7 / 3, 2 / 3, groups, "a", "b", 0.9)  # r = 3.5; z = a - 3.5 b: 1, -1.5, 0.5; sd sqrt(3.25 / 2)... / (2/3)
    z = [1.0, -1.5, 0.5]
    se = math.sqrt(sum((v - 0.0) ** 2 for v in z) / 2) / math.sqrt(3) / (2 / 3)
    assert ratio == pytest.approx([3.5 - 2.919986 * se, 3.5 + 2.919986 * se], abs=1e-5)
    # 90%: z = 1.644854, z^2 = 2.705543; centre 0.5; half 1.644854 x sqrt(0.025 + 0.006764) / 1.270554 = 0.230728
    assert wilson(5, 10, 0.9) == pytest.approx([0.269272, 0.730728], abs=2e-6)
    assert wilson(10, 10) == [pytest.approx(0.722467, abs=1e-6), 1.0] and wilson(0, 3)[0] == 0.0
    assert apart([0.1, 0.5]) is True and apart([-0.5, -0.1]) is True and apart([-0.1, 0.5]) is False
    assert apart([0.0, 0.5]) is False and apart([-0.5, 0.0]) is False and apart(None) is None


def test_a_grid_of_small_numbers_keeps_its_shares():
    y = np.array([[1, 2, 3, 2], [2, 2, 5, 3], [6, 8, 7, 7]], dtype=float)
    assert shares(y * 0.01) == pytest.approx({"rows": 56 / 66, "columns": 6 / 66, "rest": 4 / 66})  # total 0.0066 < 1
    assert shares([[1, 2, 3, 2], [2, 2, 5, 3], [6, 8, 7, 7]]) == pytest.approx({"rows": 56 / 66, "columns": 6 / 66, "rest": 4 / 66})  # ints


# --------------------------------------------------------------------------- the probes: what they are, pinned


def test_the_first_examples_of_every_probe_are_these():
    """The examples are the same for a seed on every machine; the second of each, as made on 2026-11-27
    (and the same as the examples the docs' findings were measured on: issue 60's)."""
    second = {name: (ex["prompt"].split(STOP)[-1], ex["answer"]) for name in PROBES for ex in [examples(name, n=2)[1]]}
    assert second == {
        "probe_add_1d": ("0+3=", "3"), "probe_add_2d": ("93+46=", "139"), "probe_add_3d": ("382+877=", "1259"),
        "probe_mul_1d": ("7*6=", "42"), "probe_mul_2d": ("87*8=", "696"),
        "probe_brackets_1": ("{ ->", " }"), "probe_brackets_2": ("< > { < ->", " > }"), "probe_brackets_4": ("[ [ ( ( ->", " ) ) ] ]"),
        "probe_copy_4": ("j w r x ->", " j w r x"), "probe_copy_8": ("i t c i q o e b ->", " i t c i q o e b"),
        "probe_copy_16": ("g s o k a s i d x d s k d i a m ->", " g s o k a s i d x d s k d i a m"),
        "probe_recall_2": ("l=3 v=4 ; v ->", " 4"), "probe_recall_4": ("s=7 h=5 e=2 a=4 ; h ->", " 5"),
        "probe_recall_8": ("d=6 p=2 l=7 f=0 c=3 z=4 v=3 r=8 ; r ->", " 8"),
    }
    first = examples("probe_mul_2d", n=1)[0]
    assert first["id"] == 0 and first["target"] == first["answer"] + STOP and first["prompt"].count(STOP) == SHOTS
    assert [e["id"] for e in examples("probe_copy_4", n=3)] == [0, 1, 2] and len(examples("probe_copy_4")) == 500


def test_the_ladders_span_their_whole_ranges():
    """Over many draws: 1-digit operands take 0-9, n digits 10^(n-1) to 10^n - 1; the multiplier 2-9;
    brackets wander (some close before the cut) over all four kinds; letters and keys all 26; values 0-9."""
    seen = {name: [PROBES[name].make(random.Random(i)) for i in range(400)] for name in PROBES}
    ones = {int(q.split("+")[0]) for q, _ in seen["probe_add_1d"]} | {int(q.split("+")[1][:-1]) for q, _ in seen["probe_add_1d"]}
    assert ones == set(range(10))
    twos = [int(x) for q, _ in seen["probe_add_2d"] for x in q[:-1].split("+")]
    assert min(twos) < 15 and max(twos) > 95 and all(10 <= x <= 99 for x in twos)
    threes = [int(x) for q, _ in seen["probe_add_3d"] for x in q[:-1].split("+")]
    assert all(100 <= x <= 999 for x in threes) and max(threes) > 990 and min(threes) < 110
    multipliers = {int(q[:-1].split("*")[1]) for q, _ in seen["probe_mul_1d"] + seen["probe_mul_2d"]}
    assert multipliers == set(range(2, 10)) and {int(q.split("*")[0]) for q, _ in seen["probe_mul_1d"]} == set(range(10))
    brackets = [q.removesuffix(" ->").split() for q, _ in seen["probe_brackets_4"]]
    assert {b for q in brackets for b in q} == set("([{<)]}>") and any(len(q) > 4 for q in brackets)  # closings on the way up
    assert all(len(a.split()) == 4 for _, a in seen["probe_brackets_4"])
    letters = {c for q, _ in seen["probe_copy_8"] for c in q.removesuffix(" ->").split()}
    assert letters == set("abcdefghijklmnopqrstuvwxyz")
    keys = [dict(p.split("=") for p in q.split(" ; ")[0].split()) for q, _ in seen["probe_recall_8"]]
    assert {k for d in keys for k in d} == set("abcdefghijklmnopqrstuvwxyz") and {v for d in keys for v in d.values()} == set("0123456789")
    assert all(len(set(d)) == 8 for d in keys)  # eight different keys
    asked = [q.split(" ; ")[1].removesuffix(" ->") for q, _ in seen["probe_recall_8"]]
    positions = {list(d).index(k) for d, k in zip(keys, asked)}
    assert positions == set(range(8))  # any of the keys is asked for


def test_a_probe_is_an_lm_eval_loglikelihood_task_and_says_how_it_was_made():
    config = task_config("probe_recall_4", seed=7)
    dataset = config.pop("custom_dataset")
    assert config == {"task": "probe_recall_4", "test_split": "test", "output_type": "loglikelihood", "doc_to_text": "prompt",
                      "doc_to_target": "target", "target_delimiter": "", "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
                      "num_fewshot": 0, "metadata": {"version": 1, "seed": 7, "shots": SHOTS}}
    rows = dataset()["test"]
    assert len(rows) == 500 and rows[3] == examples("probe_recall_4", seed=7, n=4)[3]
    assert task_config("probe_add_1d")["metadata"]["seed"] == 1234
    assert describe(["arc_easy", "probe_copy_4", "probe_add_2d"]) == {
        "probes": {"probe_copy_4": {"capability": "copying", "rung": "copy 4 letters"}, "probe_add_2d": {"capability": "arithmetic", "rung": "addition, 2 digits"}},
        "probe_seed": 1234, "probe_shots": 5, "probe_metric": "greedy exact match of the answer and a newline (teacher-forced argmax)"}
    assert describe(["arc_easy"]) == {}
    assert [(p.capability, p.rung) for p in PROBES.values()][:2] == [("arithmetic", "addition, 1 digit"), ("arithmetic", "addition, 2 digits")]
    assert PROBES["probe_mul_1d"].rung == "multiplication, 1 digit x 1" and PROBES["probe_recall_8"].rung == "recall 1 of 8 keys"


def test_capabilities_without_probes_or_examples():
    assert capability_scores({"arc_easy": 0.5}, 20) == {} and capability_scores({"probe_add_1d": 0.5}, 0) == {}
    got = capability_scores({"probe_copy_4": 0.25, "probe_copy_8": 0.5}, 4)
    assert got == {"copying": {"score": 0.375, "solved": 3, "examples": 8, "rungs": ["probe_copy_4", "probe_copy_8"],
                               "interval": pytest.approx([0.1368, 0.6943], abs=1e-4)}}
    assert per_rung(0) == 500 and per_rung(499) == 499


# --------------------------------------------------------------------------- edges a survivor of `make mutate` showed untested


def test_a_verdict_at_the_floor_or_the_ceiling_exactly_is_no_impossibility():
    floor = judge(PairedRatio([0.5, 0.55, 0.6, 0.6, 0.65, 0.7]), SHARES, ceiling=1.0)  # its upper end at the floor 0.7 itself
    assert floor.status == "unstable" and "lies below 0.700x" in floor.reason and "reaches above it" in floor.reason  # its median under the floor
    ceiling = judge(PairedRatio([1.0, 1.02, 1.04, 1.06, 1.08, 1.1]), SHARES, ceiling=1.0)  # its lower end at the ceiling itself
    assert ceiling.status == "unstable" and "reaches 1.000x" in ceiling.reason
    assert PairedRatio([0.75, 1.0, 1.0, 1.0, 1.0, 1.25]).tight(0.25)  # half-width 0.25 exactly: steady at 0.25
    assert not enough([PairedRatio([0.5, 0.9, 0.6, 0.95, 0.55, 0.85])], 3, 6, 40, 299.5, 300.0)  # the last pair's length unknown: 0


def test_the_noise_of_a_gap_pairs_the_two_models_window_by_window():
    """u = 3.0, 3.4, 2.8, 3.2 and p = u + (0.1, 0.3, 0.2, 0.2): the paired differences' se 0.040825,
    not the spread of either model's windows (u alone: sd 0.2582) nor of their sum."""
    held = lambda w: {"metric": "loss", "metrics": {"loss": sum(w) / 4}, "per_window": w}  # noqa: E731
    u = [3.0, 3.4, 2.8, 3.2]
    p = [a + d for a, d in zip(u, (0.1, 0.3, 0.2, 0.2))]
    assert gap_noise({"unpruned": {"held_out": held(u)}, "pruned": {"held_out": held(p)}}, "held_out", "loss").se == pytest.approx(0.0408248, rel=1e-5)
    task = lambda acc: {"metric": "acc", "metrics": {"acc": acc}, "examples": 100}  # noqa: E731
    for a, b in ((0.0, 0.5), (1.0, 0.5), (0.5, 0.0), (0.5, 1.0)):  # a proportion may be 0 or 1: its Wilson interval still has width
        low, high = gap_interval({"unpruned": {"task": task(a)}, "pruned": {"task": task(b)}}, "task", "acc", a - b)[0]
        assert low < a - b < high and high - low == pytest.approx(2 * 0.0954, abs=0.01), (a, b)
    assert gap_interval({"unpruned": {"task": task(1.5)}, "pruned": {"task": task(0.5)}}, "task", "acc", 1.0)[0] is None


def test_what_was_won_back_where_parts_are_missing_or_not_measurements():
    """A part that is no measurement (a dict without metrics) first, a part one model lacks, a
    metric one model lacks: each skipped, the rest still computed; a task's loss-like metric (no
    higher_is_better) lower is better."""
    held = lambda loss, kl: {"metric": "loss", "metrics": {k: v for k, v in (("loss", loss), ("kl", kl)) if v is not None}}  # noqa: E731
    results = {
        "unpruned": {"sites": {"writers": [2]}, "held_out": held(3.0, 0.0), "other": held(3.0, 0.0), "task": {"metric": "error", "metrics": {"error": 0.2}}},
        "pruned": {"sites": {"writers": [2]}, "held_out": held(4.0, 0.4), "other": held(4.0, 0.4), "task": {"metric": "error", "metrics": {"error": 0.6}}},
        "healed": {"sites": {"writers": [2]}, "held_out": held(None, 0.1), "task": {"metric": "error", "metrics": {"error": 0.3}}},
    }
    won, why, _ = recovered({"results": results})
    assert won == pytest.approx({"held_out_kl": 0.75, "task_error": 0.75}) and why == {}
    results["pruned"]["task"]["higher_is_better"] = True  # said: higher is better, so 0.6 over 0.2 cost nothing
    assert recovered({"results": results})[1]["task_error"] == "no gap to win back: the removal did not hurt"
    # an unpruned model whose KL is 0 but whose agreement is not 1 is no reference: its windows are not made up
    odd = {"held_out": {"metric": "loss", "metrics": {"loss": 2.0, "kl": 0.0, "agreement": 0.9}, "per_window": [1.0, 3.0]}}
    assert items(odd, "held_out", "kl") is None and items(odd, "held_out", "agreement") is None


def test_the_model_index_skips_what_is_not_a_measurement_wherever_it_is():
    healed = {"sites": {"writers": [2]}, "held_out": {"metric": "loss", "data": "wiki", "metrics": {"loss": 3.5}}}
    assert evaluation_results({"results": {"healed": healed}}) == [
        {"task": "text-generation", "dataset": "wiki", "metric": "loss", "value": 3.5, "part": "held_out"}]


def test_selects_decomposition_goes_on_past_an_unjudged_text_and_draws_by_its_seed():
    record, _ = _grid_record()
    unjudged = {**record, "held_out": {"A": {k: v for k, v in record["held_out"]["A"].items() if k != key([3, 9])}, "B": record["held_out"]["B"]}}
    assert list(decomposition(unjudged, seed=0)) == ["B held-out loss", "B held-out kl", "probes acc"]
    rng = np.random.default_rng(0)
    for source in record["held_out"]:  # each cell its own noise: the intervals have width, drawn by the seed
        for k, v in record["held_out"][source].items():
            v["loss"] = [x + float(e) for x, e in zip(v["loss"], rng.normal(0, 0.5, 8))]
    once, again = decomposition(record, seed=3), decomposition(record, seed=3)
    assert once["alpha held-out loss"]["intervals"] == again["alpha held-out loss"]["intervals"]
    assert once["alpha held-out loss"]["intervals"]["search"][0] < once["alpha held-out loss"]["intervals"]["search"][1]
    assert decomposition(record, seed=4)["alpha held-out loss"]["intervals"] != once["alpha held-out loss"]["intervals"]


def test_the_bootstraps_refusal_names_what_it_was_given():
    with pytest.raises(Exception, match=r"^3 items are too few to resample"):
        resample(lambda picks: {"m": picks.mean(1)}, 3, seed=0)
    assert capability_scores({"probe_copy_4": 1.0}, 1) == {"copying": {"score": 1.0, "solved": 1, "examples": 1, "rungs": ["probe_copy_4"],
                                                                        "interval": [pytest.approx(0.206549, abs=1e-6), 1.0]}}


@pytest.mark.filterwarnings("error")
def test_a_grid_without_spread_has_no_shares_and_warns_of_nothing():
    assert all(math.isnan(v) for v in shares(np.full((3, 4), 2.5)).values())
    stacked = shares(np.stack([np.full((2, 2), 1.0), np.array([[1.0, 2.0], [3.0, 4.0]])], axis=-1))
    assert math.isnan(stacked["rows"][0]) and stacked["rows"][1] == pytest.approx(0.8)  # rows' SS 2 x 2 x 1 = 4 of 5


# --------------------------------------------------------------------------- select: how far each pick is from the best


def _distance_record(with_exact: bool):
    """One text, k = 2 of 4 blocks: the six removals' calibration [loss, KL], by hand; held-out
    losses of three windows for the picks."""
    scores = {"0,1": [3.0, 0.5], "0,2": [2.5, 0.4], "0,3": [2.8, 0.1], "1,2": [2.9, 0.3], "1,3": [2.7, 0.2], "2,3": [3.1, 0.6],
              "1": [2.0, 0.05], "2": [2.1, 0.06]}  # single removals (greedy's first step) are not k-sets
    cells = {"t/greedy/ppl": {"calibration": "t", "search": "greedy", "objective": "ppl", "layers": [1, 3]},
             "t/angular": {"calibration": "t", "search": "angular", "objective": "-", "layers": [2, 3]},
             "t/random/ppl": {"calibration": "t", "search": "random", "objective": "ppl", "layers": [0, 2], "drawn": ["0,2", "2,3", "0,1"]}}
    if with_exact:
        cells["t/exact/ppl"] = {"calibration": "t", "search": "exact", "objective": "ppl", "layers": [0, 2]}
    held = {"": {"loss": [1.0, 1.0, 1.0], "kl": [0.0] * 3}, "1,3": {"loss": [1.3, 1.5, 1.4], "kl": [0.1] * 3},
            "2,3": {"loss": [1.6, 1.9, 1.6], "kl": [0.2] * 3}, "0,2": {"loss": [1.1, 1.2, 1.3], "kl": [0.05] * 3}}
    return {"run": {"k": 2, "n_layers": 4, "calibration": ["t"], "objectives": ["ppl", "kl"]}, "cells": cells, "labels": {"t": "t"},
            "calibration_scores": {"t": scores}, "held_out": {"t": held}}


def test_each_pick_against_the_exact_optimum_by_hand():
    """ppl: the optimum 0,2 (2.5); greedy's 1,3 (2.7) ranks 2 of 6 (one better: 1/6), angular's 2,3
    (3.1) 6 of 6; of the random draws (2.5, 3.1, 3.0) one beats greedy's pick and two beat angular's.
    Held out, greedy minus the optimum: 0.2, 0.3, 0.1, mean 0.2, sd 0.1, t(2) 4.3027."""
    from depthcurse.select.statistics import distances

    got = distances(_distance_record(with_exact=True))
    ppl = got["t ppl"]
    assert (ppl["best"], ppl["best_score"], ppl["exact"], ppl["space"], ppl["scored"]) == ("0,2", 2.5, True, 6, 6)
    assert ppl["all_scores"] == [2.5, 2.7, 2.8, 2.9, 3.0, 3.1] and ppl["null_scores"] == [2.5, 3.0, 3.1] and ppl["random_draws"] == 3
    greedy = ppl["picks"]["t/greedy/ppl"]
    assert (greedy["layers"], greedy["score"], greedy["gap"], greedy["is_best"], greedy["rank"], greedy["of"]) == ("1,3", 2.7, pytest.approx(0.2), False, 2, 6)
    assert greedy["percentile"] == pytest.approx(1 / 6) and greedy["random_better"] == pytest.approx(1 / 3)
    assert greedy["held_out"]["t held-out loss"] == pytest.approx([0.2 - 4.302653 * 0.1 / math.sqrt(3), 0.2 + 4.302653 * 0.1 / math.sqrt(3)], abs=1e-5)
    angular = ppl["picks"]["t/angular"]
    assert (angular["rank"], angular["random_better"], angular["is_best"]) == (6, pytest.approx(2 / 3), False)
    assert ppl["picks"]["t/exact/ppl"]["is_best"] and ppl["picks"]["t/exact/ppl"]["rank"] == 1 and ppl["picks"]["t/exact/ppl"]["gap"] == 0.0
    kl = got["t kl"]  # no exact and no random cell by KL: the best any search scored, no ranks, no null
    assert (kl["best"], kl["exact"], kl["all_scores"], kl["null_scores"]) == ("0,3", False, None, None)
    assert set(kl["picks"]) == {"t/angular"} and "rank" not in kl["picks"]["t/angular"] and "random_better" not in kl["picks"]["t/angular"]
    assert kl["picks"]["t/angular"]["gap"] == pytest.approx(0.5)


def test_without_exact_the_best_is_the_best_scored_and_ties_go_to_the_first_key():
    from depthcurse.select.statistics import distances

    record = _distance_record(with_exact=False)
    record["calibration_scores"]["t"]["1,2"] = [2.5, 0.3]  # a tie with 0,2 at 2.5
    ppl = distances(record)["t ppl"]
    assert (ppl["best"], ppl["exact"], ppl["all_scores"]) == ("0,2", False, None)
    record["run"]["objectives"] = ["kl"]
    assert list(distances(record)) == ["t kl"]
    record["calibration_scores"]["t"] = {"1": [2.0, 0.1]}
    assert distances(record) == {}  # no k-set scored: nothing to place


def test_prunes_greedy_says_where_its_pick_falls_among_an_exact_runs_removals():
    from depthcurse.select.statistics import optimum_lines

    record = _distance_record(with_exact=True)
    record["run"].update(model="m", calib_windows=4, seq_len=64)
    assert optimum_lines(record, {1: (1,), 2: (3, 1)}, "m") == [
        "optimum at k = 2 (select's exact, ppl on t's 4 calibration windows x 64 tokens): without 0,2, 2.5000; greedy's 1,3 ranks 2 of 6 there (2.7000, +0.2000)"]
    assert optimum_lines(record, {2: (0, 2)}, "m")[0].endswith("greedy's 0,2 is it")
    assert optimum_lines(record, {2: (0, 2)}, "another model") == [] and optimum_lines(record, {3: (0, 1, 2)}, "m") == []
    record["run"]["granularity"] = "sub-block"
    assert optimum_lines(record, {2: (0, 2)}, "m") == []


def test_sub_block_picks_are_placed_among_their_own_kind_of_removal_and_labels_name_the_text():
    """Sub-blocks at k = 1 of 3 blocks: a removal is one attention and one MLP branch (2 units), the
    space C(3, 1)^2 = 9; a single branch (1 unit) or a whole block is not one of them. The text is
    named by its label, here and in prune's line."""
    from depthcurse.select.statistics import distances, optimum_lines

    scores = {"a0,m1": [2.2, 0.2], "a1,m1": [2.0, 0.1], "a2,m0": [2.6, 0.4], "a0": [1.0, 0.0], "1": [0.5, 0.0]}
    cells = {"x/exact/ppl": {"calibration": "t", "search": "exact", "objective": "ppl", "layers": ["a1", "m1"]},
             "x/last": {"calibration": "t", "search": "last", "objective": "-", "layers": ["a0", "m1"]}}
    record = {"run": {"k": 1, "n_layers": 3, "granularity": "sub-block", "objectives": ["ppl"], "model": "m", "calib_windows": 2, "seq_len": 8},
              "cells": cells, "labels": {"t": "x"}, "calibration_scores": {"t": scores}}
    got = distances(record)
    assert list(got) == ["x ppl"]
    ppl = got["x ppl"]
    assert (ppl["space"], ppl["scored"], ppl["best"], ppl["all_scores"]) == (9, 3, "a1,m1", [2.0, 2.2, 2.6])
    assert (ppl["picks"]["x/last"]["rank"], ppl["picks"]["x/last"]["gap"]) == (2, pytest.approx(0.2))
    assert optimum_lines(record, {1: ("a1", "m1")}, "m") == []  # prune's line is for whole blocks only
    record["run"]["granularity"] = "layer"
    record["cells"] = {"x/exact/ppl": {"calibration": "t", "search": "exact", "objective": "ppl", "layers": [1]}}
    assert optimum_lines(record, {1: (1,)}, "m") == ["optimum at k = 1 (select's exact, ppl on x's 2 calibration windows x 8 tokens): without 1, 0.5000; greedy's 1 is it"]


def test_an_objective_no_cell_read_is_skipped_and_the_next_still_placed_and_a_bare_record_places_nothing():
    from depthcurse.select.statistics import distances, optimum_lines

    record = _distance_record(with_exact=False)
    record["cells"] = {"t/greedy/kl": {"calibration": "t", "search": "greedy", "objective": "kl", "layers": [1, 3]}}
    got = distances(record)
    assert list(got) == ["t kl"] and got["t kl"]["best"] == "0,3"  # ppl: no cell there, passed over; kl after it
    del record["labels"]
    assert list(distances(record)) == ["t kl"]  # no labels: the text by its source
    assert distances({"run": record["run"], "cells": record["cells"]}) == {}
    assert optimum_lines({"cells": {}}, {2: (0, 1)}) == []
    exact = _distance_record(with_exact=True)
    exact["run"].update(model="m", calib_windows=4, seq_len=64)
    exact["calibration_scores"] = {"other text": exact["calibration_scores"]["t"]}  # the exact cell's text has no scores
    assert optimum_lines(exact, {2: (1, 3)}, "m") == []
    del exact["labels"]
    exact["calibration_scores"] = {"t": _distance_record(with_exact=True)["calibration_scores"]["t"]}
    assert optimum_lines(exact, {2: (1, 3)}, "m")[0].startswith("optimum at k = 2 (select's exact, ppl on t's 4 calibration windows")
