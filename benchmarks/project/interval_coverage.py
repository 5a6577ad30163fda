"""How often each 95% interval the tool reports covers the truth, by simulation, at the numbers of
items it allows: the paired t interval of a mean difference, Welch's over a suite of three tasks,
the delta method's ratio, Wilson's proportion (averaged over the true proportion), the paired
bootstrap (from its 8 items up), and, for comparison, the normal interval (mean +- 1.96 se) that
every interval was before issue 64. The differences are drawn normal, skewed (gamma, skewness 2/3)
heavily skewed (exponential, skewness 2, as SmolLM2's per-window KLs can be) and lognormal (sigma 1,
skewness 6.2), where `select` now says a sample's skewness (|G1| > 1) means its interval may under-cover.

    python benchmarks/project/interval_coverage.py --runs 4000

Prints one Markdown table (docs/benchmarks.md, "Intervals"); seeded, so the same table each run.
"""

from __future__ import annotations

import argparse
import random

import numpy as np

from depthcurse.stats import difference_interval, interval, paired_spread, ratio_interval, resample, wilson

DRAWS = {
    "normal": (lambda rng, size: rng.normal(1.0, 2.0, size), 1.0),
    "skewed (2/3)": (lambda rng, size: rng.gamma(9.0, 1.0, size), 9.0),
    "heavy (2)": (lambda rng, size: rng.exponential(1.0, size), 1.0),
    "lognormal (6.2)": (lambda rng, size: rng.lognormal(0.0, 1.0, size), float(np.exp(0.5))),
}
SIZES = (2, 4, 8, 16, 32)


def paired_t(rng, n, draw, truth, normal=False):
    u = rng.normal(3.0, 1.0, n)
    p = u + draw(rng, n)
    if normal:
        spread = paired_spread({"p": [list(p)], "u": [list(u)]}, {"p": 1.0, "u": -1.0})
        d = float(p.mean() - u.mean())
        return d - 1.959964 * spread.se <= truth <= d + 1.959964 * spread.se
    low, high = difference_interval(float(p.mean()), float(u.mean()), {"p": [list(p)], "u": [list(u)]}, "p", "u")
    return low <= truth <= high


def suite(rng, n, draw, truth):
    sizes = (n, 2 * n, 3 * n)
    a = [list(draw(rng, m) * s) for m, s in zip(sizes, (0.5, 1.0, 2.0))]
    b = [[0.0] * m for m in sizes]
    value = sum(sum(g) / len(g) for g in a) / 3
    low, high = interval(value, paired_spread({"a": a, "b": b}, {"a": 1.0, "b": -1.0}))
    return low <= truth * (0.5 + 1.0 + 2.0) / 3 <= high


def ratio(rng, n, draw, truth):
    u = rng.normal(10.0, 1.0, n)
    h = u + draw(rng, n)
    low, high = ratio_interval(float(h.mean()), float(u.mean()), {"h": [list(h)], "u": [list(u)]}, "h", "u")
    return low <= (truth + 10.0) / 10.0 <= high


def bootstrap(rng, n, draw, truth, seed):
    d = draw(rng, n)
    low, high = resample(lambda picks: {"mean": d[picks].mean(1)}, n, seed=seed, draws=1000)["mean"]
    return low <= truth <= high


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=4000)
    args = parser.parse_args()
    rows = []
    for name, (draw, truth) in DRAWS.items():
        for kind, one in (("paired t (n - 1 df)", lambda rng, n: paired_t(rng, n, draw, truth)),
                          ("paired, the normal's 1.96 (before)", lambda rng, n: paired_t(rng, n, draw, truth, normal=True)),
                          ("a suite's average, Welch's df (tasks of n, 2n, 3n)", lambda rng, n: suite(rng, n, draw, truth)),
                          ("ratio, delta method", lambda rng, n: ratio(rng, n, draw, truth))):
            cells = []
            for n in SIZES:
                rng = np.random.default_rng(n)
                cells.append(sum(one(rng, n) for _ in range(args.runs)) / args.runs)
            rows.append((kind, name, cells))
        cells = []
        for n in SIZES:
            if n < 8:
                cells.append(None)
                continue
            rng = np.random.default_rng(300 + n)
            runs = max(1, args.runs // 4)
            cells.append(sum(bootstrap(rng, n, draw, truth, seed) for seed in range(runs)) / runs)
        rows.append(("paired bootstrap, expanded percentiles", name, cells))
    cells = []
    for n in SIZES:
        rng = random.Random(n)
        hits = 0
        for _ in range(args.runs * 5):
            p = rng.random()
            k = sum(rng.random() < p for _ in range(n))
            low, high = wilson(k, n)
            hits += low <= p <= high
        cells.append(hits / (args.runs * 5))
    rows.append(("Wilson, a proportion (p uniform)", "binomial", cells))
    print("| interval | differences drawn | " + " | ".join(f"n = {n}" for n in SIZES) + " |")
    print("|---|---|" + "---|" * len(SIZES))
    for kind, name, cells in rows:
        print(f"| {kind} | {name} | " + " | ".join("refused" if c is None else f"{c:.1%}" for c in cells) + " |")


if __name__ == "__main__":
    main()
