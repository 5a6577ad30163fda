"""`select`'s statistics, as pure functions of its record: how much the cells' choices overlap and
how much of the spread of their held-out scores goes with the calibration text and how much with
the search.

Overlap: the Jaccard index of two cells' chosen sets, its mean over the pairs of distinct cells
that share the calibration text (differing in search or objective) against the pairs that share
the search and objective (differing in text): which of the two moves the choice.

Distances: for each calibration text and objective, every pick against the best removal there is
(the exact optimum) or that any search found, and where it falls among every removal or among
blind random draws.

Decomposition: for each held-out measurement, the grid of the cells' mean scores (calibration
texts x searches) split into the texts' share of its sum of squares, the searches' and the rest
(`stats.decomposition`), each with a paired bootstrap interval over the measurement's items (the
same windows or questions for every cell, resampled together: `stats.bootstrap`). It names the
factor that decided only where the two intervals are apart, and says "cannot tell" where there
are too few items to resample.
"""

from __future__ import annotations

import math

import numpy as np

from depthcurse.stats.bootstrap import TooFewItems, resample
from depthcurse.stats.decomposition import COLUMNS, REST, ROWS, decided_by, shares
from depthcurse.select.search import OBJECTIVES
from depthcurse.stats.intervals import difference_interval, paired_spread
from depthcurse.stats.multiple import holm_family

# the decomposition's factors, as select names them
FACTORS = {ROWS: "calibration", COLUMNS: "search", REST: "rest"}
OBJECTIVES_KEPT = OBJECTIVES  # the order a calibration score keeps them in
HELD_OUT_METRICS = ("loss", "kl", "rejection")  # each held-out window's, per chosen set


def key(layers) -> str:
    return ",".join(map(str, layers))


def jaccard(a, b) -> float:
    a, b = set(a), set(b)
    return len(a & b) / len(a | b) if a | b else 1.0


def overlap(cells: dict[str, dict]) -> dict:
    """Jaccard of every pair of cells' choices (the matrix, the diagonal 1), and its mean over the
    pairs of distinct cells that share the calibration (differing in search or objective) against
    those that share the search and objective (differing in calibration)."""
    names = list(cells)
    sets = {n: cells[n]["layers"] for n in names}
    matrix = [[jaccard(sets[a], sets[b]) for b in names] for a in names]
    same_cal, same_search = [], []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            ca, cb = cells[a], cells[b]
            if ca["calibration"] == cb["calibration"]:
                same_cal.append(jaccard(sets[a], sets[b]))
            elif (ca["search"], ca["objective"]) == (cb["search"], cb["objective"]):
                same_search.append(jaccard(sets[a], sets[b]))
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    return {"cells": names, "matrix": matrix, "same_calibration_mean": mean(same_cal), "same_calibration_pairs": len(same_cal),
            "same_search_mean": mean(same_search), "same_search_pairs": len(same_search)}


def measurements(record: dict) -> dict[str, dict[str, list[float]]]:
    """Every held-out measurement the cells are judged on, by name: each chosen set's items (its
    per-window losses or KLs on one text's held-out windows; its per-question scores on the task),
    the unpruned model's under the key ""."""
    labels = record.get("labels", {})
    out = {f"{labels.get(source, source)} held-out {metric}": {k: v[metric] for k, v in held.items()}
           for source, held in record["held_out"].items() for metric in HELD_OUT_METRICS if metric in held.get("", {})}
    task = record.get("task") or {}
    if task:
        out[f"{record['run']['task']} {task[''].get('metric')}"] = {k: v["items"] for k, v in task.items() if k != "describe"}
    return out


def decomposition(record: dict, seed: int) -> dict:
    """Per held-out measurement: the shares of the spread of the cells' scores that go with the
    calibration text and with the search (and objective), their paired bootstrap intervals, and
    which decided. `why_not` where the grid cannot be decomposed."""
    cells = record["cells"]
    rows = list(record["run"]["calibration"])
    cols = sorted({(c["search"], c["objective"]) for c in cells.values()})
    if len(rows) < 2 or len(cols) < 2:
        return {"why_not": "a decomposition needs two calibration texts and two searches (or objectives) at least"}
    where = {(c["calibration"], (c["search"], c["objective"])): key(c["layers"]) for c in cells.values()}
    if len(where) < len(rows) * len(cols):
        return {"why_not": "the grid is not complete yet"}
    out = {}
    for name, items in measurements(record).items():
        if any(where[r, c] not in items for r in rows for c in cols):
            continue  # not judged on this one yet
        # items[cell, item]: every cell's scores on the same items, in the grid's order
        table = np.array([[items[where[r, c]] for c in cols] for r in rows], dtype=float)
        n = table.shape[-1]
        point = {FACTORS[k]: v for k, v in shares(table.mean(-1)).items()}
        try:
            drawn = resample(lambda picks: shares(table[..., picks].mean(-1)), n, seed=seed, what="held-out items")  # (rows, cols, draws)
            intervals, why_not = {FACTORS[k]: v for k, v in drawn.items()}, None
        except TooFewItems as exc:
            intervals, why_not = {FACTORS[k]: None for k in FACTORS}, str(exc)
        verdict = decided_by({ROWS: intervals["calibration"], COLUMNS: intervals["search"]}, why_not)
        out[name] = {"shares": point, "intervals": intervals, "items": n, "decided_by": FACTORS.get(verdict, verdict),
                     "scores": {f"{r}|{c[0]}/{c[1]}": float(table[i, j].mean()) for i, r in enumerate(rows) for j, c in enumerate(cols)}}
    return out


def _size(removal_key: str) -> int:
    return len([u for u in removal_key.split(",") if u])


def distances(record: dict) -> dict:
    """Per calibration text and objective: the best removal scored there (the exact optimum where
    `exact` ran, else the best any search found), and each cell's pick against it: its calibration
    score and gap, its rank and percentile among every removal of the space (where `exact` ran) and
    among the random draws (where `random` ran: the share of blind draws better than it), and on
    each held-out measurement the 95% interval of its paired difference from the optimum's."""
    cells, run = record["cells"], record["run"]
    k, units = run["k"], run["k"] * (2 if run.get("granularity", "layer") == "sub-block" else 1)
    labels = record.get("labels", {})
    measured = measurements(record) if record.get("held_out") else {}
    out = {}
    for source, known in record.get("calibration_scores", {}).items():
        for index, objective in enumerate(OBJECTIVES_KEPT):
            if objective not in (run.get("objectives") or record.get("recipe", {}).get("objectives") or ["ppl"]):
                continue
            here = {n: c for n, c in cells.items() if c["calibration"] == source and c["objective"] in (objective, "-")}
            scores = {name: v[index] for name, v in known.items() if _size(name) == units and len(v) > index and v[index] is not None}
            if not here or not scores:
                continue
            exact = next((c for c in here.values() if c["search"] == "exact" and c["objective"] == objective), None)
            best = key(exact["layers"]) if exact else min(scores, key=lambda name: (scores[name], name))
            draws = next((c["drawn"] for c in here.values() if c["search"] == "random" and c["objective"] == objective and c.get("drawn")), None)
            null = sorted(scores[d] for d in draws if d in scores) if draws else None
            everything = sorted(scores.values()) if exact else None
            picks = {}
            for name, cell in here.items():
                mine = key(cell["layers"])
                if mine not in scores:
                    continue
                value = scores[mine]
                pick = {"layers": mine, "score": value, "gap": value - scores[best], "is_best": mine == best}
                if everything is not None:
                    better = sum(1 for v in everything if v < value)
                    pick.update(rank=better + 1, of=len(everything), percentile=better / len(everything))
                if null:
                    pick["random_better"] = sum(1 for v in null if v < value) / len(null)
                pick["held_out"] = {m: difference_interval(sum(items[mine]) / len(items[mine]), sum(items[best]) / len(items[best]),
                                                           {"pick": [items[mine]], "best": [items[best]]}, "pick", "best")
                                    for m, items in measured.items() if mine in items and best in items}
                picks[name] = pick
            for m, items in measured.items():  # every distinct pick against the best at once: Holm over the family
                family = sorted({p["layers"] for p in picks.values() if not p["is_best"] and p["layers"] in items and best in items})
                differences = [(sum(items[f]) / len(items[f]) - sum(items[best]) / len(items[best]),
                                paired_spread({"pick": [items[f]], "best": [items[best]]}, {"pick": 1.0, "best": -1.0})) for f in family]
                adjusted = dict(zip(family, holm_family(differences)))
                for p in picks.values():
                    if p["layers"] in adjusted:
                        p.setdefault("held_out_holm", {})[m] = adjusted[p["layers"]]["interval_holm"]
            out[f"{labels.get(source, source)} {objective}"] = {
                "calibration": source, "objective": objective, "best": best, "best_score": scores[best], "exact": exact is not None,
                "space": math.comb(run["n_layers"], k) ** (1 if units == k else 2), "scored": len(scores),
                "random_draws": len(null) if null else 0, "picks": picks, "all_scores": everything, "null_scores": null}
    return out


def optimum_lines(select_record: dict, removed_at: dict[int, tuple], model: str | None = None) -> list[str]:
    """For `prune --greedy`: where a `select` run with `exact` at some k lies in the same folder,
    where greedy's removal at that k falls among every removal on that run's calibration windows
    (its rank, and the optimum's removal and score), one line per text and objective. `removed_at`:
    k -> the units greedy had removed after k steps."""
    run = select_record.get("run", {})
    if model is not None and run.get("model") not in (None, model):
        return []
    k = run.get("k")
    removal = removed_at.get(k)
    if removal is None:
        return []
    mine, lines = key(sorted(removal)), []
    labels = select_record.get("labels", {})
    for cell in select_record.get("cells", {}).values():
        if cell["search"] != "exact" or run.get("granularity", "layer") != "layer":
            continue
        index = OBJECTIVES_KEPT.index(cell["objective"])
        scores = {name: v[index] for name, v in select_record["calibration_scores"].get(cell["calibration"], {}).items() if _size(name) == k}
        if mine not in scores:
            continue
        best = key(cell["layers"])
        rank = 1 + sum(1 for v in scores.values() if v < scores[mine])
        where = f"{labels.get(cell['calibration'], cell['calibration'])}'s {run.get('calib_windows')} calibration windows x {run.get('seq_len')} tokens"
        lines.append(f"optimum at k = {k} (select's exact, {cell['objective']} on {where}): without {best}, {scores[best]:.4f}; greedy's {mine} "
                     + ("is it" if mine == best else f"ranks {rank:,} of {len(scores):,} there ({scores[mine]:.4f}, {scores[mine] - scores[best]:+.4f})"))
    return lines
