"""A ratio of two things timed in turns, and whether it can be trusted.

Each pair (A then B, or B then A) gives one ratio B / A; a machine that slows down between pairs
slows both halves of a pair, so the pairs' ratios stay put where the two medians would not
(pyperf and hyperfine repeat and report a spread the same way). The ratio reported is the median
of the pairs' ratios, with a distribution-free interval for that median (order statistics of the
binomial: no assumption that the noise is normal, and a few wild pairs widen it without moving
it). Measuring goes on until the interval is tight enough or a budget runs out (`enough`).

A verdict then says whether the ratio is a finding: `impossible` when its interval lies wholly below
the lowest share it can reach (`Shares`: for a removal, of the layers, the arithmetic, the bytes) or
wholly above a ceiling (1 for a pruned model, which does a subset of the unpruned model's work);
bounded on both sides, `ok` when the interval lies wholly between the floor and the ceiling (a
change told apart, with its width said) and `unstable` when it reaches the ceiling or crosses the
floor; unbounded, `unstable` when the interval is wider than the tolerance (or too few pairs give
none). An `ok` names its regime: the share it is nearest to.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

CONFIDENCE = 0.95
TOLERANCE = 0.05  # the interval's half-width, relative to the median, below which a ratio is steady
# The fewest pairs whose extremes bound the median at 95% (1 - 2 / 2**6 = 96.9%).
MIN_PAIRS = 6

def median_interval(values: list[float], confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """An interval that holds the median of the distribution `values` come from with probability
    at least `confidence`: the k-th smallest and k-th largest value, k the largest for which
    P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2. None when n is too small for any k."""
    xs = sorted(values)
    n, alpha = len(xs), (1 - confidence) / 2
    tail, k = 0.0, 0
    for j in range(n // 2 + 1):  # tail = P(X <= j - 1) before the step, P(X <= j) after it
        tail += math.comb(n, j) / 2**n
        if tail > alpha:
            k = j  # P(X < j) <= alpha: the j-th order statistic (1-based) still bounds it
            break
    if k == 0:
        return None
    return xs[k - 1], xs[n - k]


@dataclass
class PairedRatio:
    """The ratios B / A of pairs measured in turns."""

    ratios: list[float]
    confidence: float = CONFIDENCE

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)

    @property
    def interval(self) -> tuple[float, float] | None:
        return median_interval(self.ratios, self.confidence)

    @property
    def half_width(self) -> float:
        """Half the interval's width over the median: inf when there is no interval."""
        interval = self.interval
        return math.inf if interval is None else (interval[1] - interval[0]) / 2 / abs(self.median)

    def tight(self, tolerance: float = TOLERANCE) -> bool:
        return self.half_width <= tolerance

    def summary(self) -> dict:
        interval = self.interval
        return {"median": self.median, "interval": list(interval) if interval else None, "confidence": self.confidence,
                "half_width": None if interval is None else self.half_width, "pairs": len(self.ratios), "ratios": list(self.ratios)}


class Shares(dict):
    """What the faster side keeps of the slower one's costs, by name (for a removal: of the layers,
    the arithmetic, the bytes moved): each the time ratio if that cost were all the time costs.
    The lowest is the floor: no ratio of times can go below the share of every cost it keeps."""

    @property
    def lowest(self) -> float:
        return min(self.values())

    def regime(self, ratio: float) -> str:
        """The name of the share `ratio` is nearest to."""
        return min(self, key=lambda name: abs(self[name] - ratio))


@dataclass(frozen=True)
class Verdict:
    status: str  # ok, unstable, impossible
    reason: str
    regime: str | None = None

    @property
    def trusted(self) -> bool:
        return self.status == "ok"


def judge(ratio: PairedRatio, shares: Shares | None = None, ceiling: float | None = None, tolerance: float = TOLERANCE) -> Verdict:
    """Whether `ratio` is a finding, and why not where it is not: steady, not below the lowest of
    `shares`, not above `ceiling` (1 for a pruned model against its source: a subset of its work)."""
    interval, median = ratio.interval, ratio.median
    if interval is None:
        n = len(ratio.ratios)
        return Verdict("unstable", f"{n} {'pair gives' if n == 1 else 'pairs give'} no {ratio.confidence:.0%} interval (at least {MIN_PAIRS} do)")
    lo, hi = interval
    if shares is not None and hi < shares.lowest:
        return Verdict("impossible", f"{median:.3f}x ({lo:.3f}-{hi:.3f}) lies below {shares.lowest:.3f}x, the share of the "
                                     f"{shares.regime(shares.lowest)} kept, which no ratio of the times can beat: the machine changed while it ran")
    if ceiling is not None and lo > ceiling:
        return Verdict("impossible", f"{median:.3f}x ({lo:.3f}-{hi:.3f}) lies above {ceiling:.3f}x: the faster side measured slower, though "
                                     "it runs a subset of the other's work: the machine changed while it ran")
    if shares is not None and ceiling is not None:
        # Bounded on both sides, the interval itself says whether there is a finding: wholly between
        # the floor and the ceiling, the change is told apart, however wide (its width is said);
        # the tolerance then only decides when to stop measuring.
        if hi >= ceiling:
            return Verdict("unstable", f"{median:.3f}x, but its interval {lo:.3f}-{hi:.3f} reaches {ceiling:.3f}x over {len(ratio.ratios)} pairs: "
                                       "no change told apart")
        if lo < shares.lowest and median < shares.lowest:  # said apart: the caption calls only a wholly lower interval impossible
            return Verdict("unstable", f"{median:.3f}x lies below {shares.lowest:.3f}x, the share of the {shares.regime(shares.lowest)} kept, which "
                                       f"no ratio of the times can beat, but its interval {lo:.3f}-{hi:.3f} reaches above it over {len(ratio.ratios)} "
                                       "pairs: unstable, not impossible (that takes the whole interval below): the machine changed while it ran")
        if lo < shares.lowest:
            return Verdict("unstable", f"{median:.3f}x, but its interval {lo:.3f}-{hi:.3f} crosses {shares.lowest:.3f}x, the share of the "
                                       f"{shares.regime(shares.lowest)} kept, over {len(ratio.ratios)} pairs: the machine changed while it ran")
        return Verdict("ok", f"{median:.3f}x ({lo:.3f}-{hi:.3f}, +-{ratio.half_width:.1%}): {1 - hi:.0%} to {1 - lo:.0%} less", shares.regime(median))
    if not ratio.tight(tolerance):
        return Verdict("unstable", f"{median:.3f}x, but its interval {lo:.3f}-{hi:.3f} is +-{ratio.half_width:.1%} wide "
                                   f"(more than +-{tolerance:.0%}) over {len(ratio.ratios)} pairs")
    regime = shares.regime(median) if shares is not None else None
    return Verdict("ok", f"{median:.3f}x ({lo:.3f}-{hi:.3f})", regime)


def enough(ratios: list[PairedRatio], pairs: int, min_pairs: int, max_pairs: int, elapsed: float, budget_s: float,
           tolerance: float = TOLERANCE, last_pair_s: float = 0.0) -> bool:
    """Whether to stop measuring: every ratio tight after `min_pairs`, or `max_pairs` reached, or
    the time budget spent, or another pair as long as the last (`last_pair_s`) would overrun it:
    checked after each pair, so a pair is never cut in half and the budget holds before
    `min_pairs` too (fewer pairs then give no interval, which the verdict says)."""
    if elapsed + last_pair_s > budget_s:
        return True
    if pairs < min_pairs:
        return False
    return pairs >= max_pairs or all(r.tight(tolerance) for r in ratios)
