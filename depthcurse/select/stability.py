"""How stable a pick is: the same search rerun on bootstrap resamples of the calibration windows
(and, for a seeded search, under other seeds), and how often each unit comes back.

A pick's held-out interval says how good the chosen removal is; it says nothing of whether other
calibration windows would have chosen the same one, which is the uncertainty that moves the answer
most (select's Finding 3: the pick moves with the text). A resample draws the calibration windows
with replacement (`draws`), the classic nonparametric bootstrap over the unit the text comes in,
and reruns the search on them. Nothing is measured twice: a removal's score on a resample is its
per-window scores, kept by the scorer from the first time any search asked, weighed by how often
each window was drawn (`Resampled`). A greedy resample mostly asks for removals the full-data
search scored already; `exact`'s resamples cost nothing more once it ran.

Reported per cell: how often each unit is chosen, the full-data pick's mean Jaccard with the
resampled picks, how often a resample chose exactly the full-data pick (with its Wilson interval),
and a verdict line.
"""

from __future__ import annotations

from collections import Counter

import torch

from depthcurse.select.search import OBJECTIVES, Removal, canonical, key, parse_key
from depthcurse.stats.intervals import wilson


def draws(windows: int, resamples: int, seed: int) -> list[list[int]]:
    """`resamples` bootstrap draws of the calibration windows' indices, with replacement, sorted
    (a removal's score is a mean: the order is nothing), each from its own seeded generator so that
    resample r is the same whatever R is."""
    out = []
    for r in range(resamples):
        g = torch.Generator().manual_seed(seed * 1_000_003 + r)
        out.append(sorted(torch.randint(windows, (windows,), generator=g).tolist()))
    return out


class Resampled:
    """A scorer's view of one resample: a removal's objective is the mean of its per-window scores
    over the drawn windows (repeats counted), measured once for every resample and search."""

    def __init__(self, scorer, drawn: list[int]):
        self.scorer, self.drawn = scorer, drawn

    def score_many(self, removals: list[Removal], objective: str) -> list[float]:
        out = []
        for removal, (losses, kls, agreements) in zip(removals, self.scorer.per_window(list(removals))):
            mean = lambda values: sum(values[w] for w in self.drawn) / len(self.drawn)  # noqa: E731
            out.append(self.scorer._scores(tuple(removal), mean(losses), mean(kls), mean(agreements))[OBJECTIVES.index(objective)])
        return out

    def score_on_many(self, removals: list[Removal], windows: list[int], last: int, objective: str) -> list[float]:
        """On some of the resample's windows (EvoPress's stages): mapped to the windows they are."""
        return self.scorer.score_on_many(removals, [self.drawn[w] for w in windows], last, objective)


def summary(full: Removal, picks: list[Removal], granularity: str) -> dict:
    """How often each unit is chosen over `picks`, the full-data pick's mean Jaccard with them, and how
    often a pick is the full-data pick (a Wilson 95% interval: a proportion of R)."""
    full = canonical(full, granularity)
    picks = [canonical(p, granularity) for p in picks]
    counts = Counter(u for p in picks for u in p)
    same = sum(p == full for p in picks)
    jaccard = [len(set(full) & set(p)) / len(set(full) | set(p)) for p in picks]
    low, high = wilson(same, len(picks))
    units = canonical(set(counts) | set(full), granularity)
    return {"full": key(full), "picks": [key(p) for p in picks], "resamples": len(picks),
            "frequency": {str(u): counts[u] / len(picks) for u in units}, "mean_jaccard": sum(jaccard) / len(jaccard),
            "same": same, "same_interval": [low, high]}


def verdict(name: str, s: dict) -> str:
    """'wiki/greedy/kl: the pick 14,16,17,18: 16, 17, 18 in every rerun; 14 in 5 of 8; ...'"""
    return f"{name}: the pick {s['full']}: {words(s)}"


def words(s: dict) -> str:
    """'16, 17, 18 in every rerun; 14 in 5 of 8; also 13 (3 of 8); the whole pick in 5 of 8 (...)' (the pick's units first)."""
    n, full = s["resamples"], parse_key(s["full"])
    count = lambda u: round(s["frequency"][str(u)] * n)  # noqa: E731
    groups: dict[int, list] = {}
    for u in full:
        groups.setdefault(count(u), []).append(u)
    said = []
    for c in sorted(groups, reverse=True):
        units = ", ".join(map(str, groups[c]))
        said.append(f"{units} in {'every rerun' if c == n else ('no rerun' if c == 0 else f'{c} of {n}')}")
    # the most frequent first; `frequency` holds the units in their order, which a stable sort keeps for ties
    others = sorted(((count(u), u) for u in parse_key(",".join(s["frequency"])) if u not in full and count(u)), key=lambda cu: -cu[0])
    if others:
        said.append("also " + ", ".join(f"{u} ({c} of {n})" for c, u in others[:4]) + (" ..." if len(others) > 4 else ""))
    low, high = s["same_interval"]
    return "; ".join(said) + f"; the whole pick in {s['same']} of {n} ({low:.0%}-{high:.0%}, Wilson 95%), mean Jaccard {s['mean_jaccard']:.2f}"
