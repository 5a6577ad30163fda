"""95% intervals that are honest at the number of items they rest on.

A mean over n paired items (windows, questions) has a standard error s / sqrt(n) that is itself
estimated from n items; its interval needs Student's t quantile at n - 1 degrees of freedom, not
the normal's 1.96 (at 2 windows t is 12.7: 1.96 would give an interval 6.5x too narrow, at 4 windows
3.18, 38% too narrow). A suite averages several tasks, each a group of questions: the variance is
a sum over groups and its degrees of freedom Welch and Satterthwaite's, as for two independent
samples (two sets of training seeds). A proportion of k successes
in n has Wilson's score interval, which stays inside [0, 1] and covers near 95% at small n where
the normal's does not. A ratio of two paired means (a share kept, a share won back) takes the delta
method's standard error with the same t quantile.

Everything here is a pure function of numbers (`tests/test_statistics.py` checks each against a
value worked out by hand and, by simulation, that the intervals cover 95%).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scipy.special import stdtrit

CONFIDENCE = 0.95


def t_quantile(df: float, confidence: float = CONFIDENCE) -> float:
    """The two-sided `confidence` quantile of Student's t at `df` degrees of freedom (the normal's
    at df = inf): 12.706 at 1, 2.776 at 4, 1.960 at inf for 95%."""
    return float(stdtrit(df, 1 - (1 - confidence) / 2))  # scipy's t quantile is the normal's at df = inf


@dataclass(frozen=True)
class Spread:
    """A standard error and the degrees of freedom it was estimated with."""

    se: float
    df: float

    def half_width(self, confidence: float = CONFIDENCE) -> float:
        return t_quantile(self.df, confidence) * self.se if self.df > 0 else math.inf


UNPAIRED = Spread(float("nan"), 0.0)


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def paired_spread(groups: dict[str, list[list[float]]], coefficients: dict[str, float]) -> Spread:
    """The standard error of sum_m c_m X_m, where X_m is the mean over groups of the mean of model m's
    items in that group, the items paired across models (the same windows, the same questions), and
    its degrees of freedom: n - 1 for one group of n, Welch-Satterthwaite's over several groups
    (each group's variance estimated from its own items). UNPAIRED where the models' items differ in
    number or a group has fewer than two."""
    names = [m for m, c in coefficients.items() if c != 0.0]
    if not names:
        return UNPAIRED
    count = len(groups[names[0]])
    if count == 0 or any(len(groups[m]) != count for m in names):
        return UNPAIRED
    parts, dfs = [], []
    for g in range(count):
        n = len(groups[names[0]][g])
        if n < 2 or any(len(groups[m][g]) != n for m in names):
            return UNPAIRED
        z = [sum(coefficients[m] * groups[m][g][i] for m in names) for i in range(n)]
        centre = sum(z) / n
        parts.append(sum((v - centre) ** 2 for v in z) / (n - 1) / n / count**2)
        dfs.append(n - 1)
    variance = sum(parts)
    if variance == 0.0:
        return Spread(0.0, float(sum(dfs)))
    df = 1 / sum((v / variance) ** 2 / d for v, d in zip(parts, dfs))  # (sum v)^2 / sum(v^2 / d), without squaring tiny variances
    return Spread(math.sqrt(variance), df)


def interval(value: float, spread: Spread, confidence: float = CONFIDENCE) -> list[float] | None:
    """value -+ t(df) * se, or None where there is no honest interval (no spread known)."""
    if not (math.isfinite(value) and math.isfinite(spread.se) and spread.df > 0):
        return None
    h = spread.half_width(confidence)
    return [value - h, value + h]


def mean_interval(values: list[float], confidence: float = CONFIDENCE) -> list[float] | None:
    """The t interval of the mean of `values` (one sample; paired differences are one)."""
    return interval(mean(values), paired_spread({"x": [list(values)]}, {"x": 1.0}), confidence) if values else None


def independent_spread(a: list[float], b: list[float]) -> Spread:
    """The standard error of mean(a) - mean(b), two independent samples (runs of two seeds' sets,
    nothing paired), and Welch and Satterthwaite's degrees of freedom: each sample's own variance,
    not a pooled one, which would be wrong where the two spread differently. UNPAIRED where either
    has fewer than two values."""
    a, b = list(a), list(b)
    if len(a) < 2 or len(b) < 2:
        return UNPAIRED
    parts = []
    for values in (a, b):
        centre = sum(values) / len(values)
        parts.append(sum((v - centre) ** 2 for v in values) / (len(values) - 1) / len(values))
    variance = sum(parts)
    if variance == 0.0:
        return Spread(0.0, float(len(a) + len(b) - 2))
    df = 1 / sum((v / variance) ** 2 / (len(values) - 1) for v, values in zip(parts, (a, b)))
    return Spread(math.sqrt(variance), df)


def welch_interval(a: list[float], b: list[float], confidence: float = CONFIDENCE) -> list[float] | None:
    """Welch's interval of mean(a) - mean(b), two independent samples."""
    return interval(mean(a) - mean(b), independent_spread(a, b), confidence) if a and b else None


def difference_interval(a: float, b: float, groups: dict[str, list[list[float]]], first: str, second: str,
                        confidence: float = CONFIDENCE) -> list[float] | None:
    """The interval of a - b, two models' scores on the same items."""
    return interval(a - b, paired_spread(groups, {first: 1.0, second: -1.0}), confidence)


def ratio_interval(top: float, bottom: float, groups: dict[str, list[list[float]]], top_name: str, bottom_name: str,
                   confidence: float = CONFIDENCE) -> list[float] | None:
    """The interval of R = top / bottom, two paired means (the delta method: se(R) = se(top - R bottom) / |bottom|)."""
    if not bottom:
        return None
    r = top / bottom
    spread = paired_spread(groups, {top_name: 1.0, bottom_name: -r})
    return interval(r, Spread(spread.se / abs(bottom), spread.df), confidence)


def wilson(successes: float, n: int, confidence: float = CONFIDENCE) -> list[float] | None:
    """Wilson's score interval of a proportion: `successes` of `n`."""
    if n <= 0:
        return None
    z = t_quantile(math.inf, confidence)
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    # Wilson's ends lie in [0, 1]; at 0 of n and n of n they are 0 and 1 exactly (rounding would put the estimate outside)
    return [0.0 if successes <= 0 else centre - half, 1.0 if successes >= n else centre + half]


def newcombe(successes_a: float, n_a: int, successes_b: float, n_b: int, confidence: float = CONFIDENCE) -> list[float] | None:
    """Newcombe's hybrid score interval (1998, method 10) of the difference of two proportions,
    a/n_a - b/n_b, from each one's Wilson interval: it stays inside [-1, 1] and covers near 95% at
    small n and near 0 or 1, where the normal's (Wald's) does not. For proportions of the same
    questions it ignores their pairing, which makes it wider than a paired interval: the honest
    choice where only the two means were kept."""
    la, lb = wilson(successes_a, n_a, confidence), wilson(successes_b, n_b, confidence)
    if la is None or lb is None:
        return None
    pa, pb = successes_a / n_a, successes_b / n_b
    d = pa - pb
    return [d - math.sqrt((pa - la[0]) ** 2 + (lb[1] - pb) ** 2), d + math.sqrt((la[1] - pa) ** 2 + (pb - lb[0]) ** 2)]


SKEWED = 1.0  # |G1| above which a paired t interval may under-cover (docs/benchmarks.md, "Intervals": 88-93% at skewness 2)


def skewness(values) -> float | None:
    """The sample skewness G1 = sqrt(n (n - 1)) / (n - 2) * m3 / m2^(3/2) (the adjusted
    Fisher-Pearson coefficient, scipy's `skew(bias=False)`); None below 3 values or with no spread."""
    values = list(values)
    n = len(values)
    if n < 3:
        return None
    centre = sum(values) / n
    m2 = sum((v - centre) ** 2 for v in values) / n
    m3 = sum((v - centre) ** 3 for v in values) / n
    if m2 == 0.0:
        return None
    return math.sqrt(n * (n - 1)) / (n - 2) * m3 / m2 ** 1.5


def skew_warning(differences, what: str) -> str | None:
    """One line where paired differences are skewed enough that their Student's t interval may
    cover less than 95%: |G1| above `SKEWED`."""
    g1 = skewness(differences)
    if g1 is None or abs(g1) <= SKEWED:
        return None
    return (f"{what}: the paired differences are skewed (G1 {g1:+.2f} over {len(list(differences))} items): Student's t interval may cover "
            "less than 95% (88-93% at skewness 2 in simulation; docs/benchmarks.md, Intervals)")


def apart(low_high: list[float] | None) -> bool | None:
    """Whether an interval of a difference excludes 0 (None: no interval)."""
    return None if low_high is None else (low_high[0] > 0 or low_high[1] < 0)
