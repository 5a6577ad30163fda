"""`select`'s statistics, as pure functions of its record: how much the cells' choices overlap and
how much of the spread of their held-out scores goes with the calibration text and how much with
the search.

Overlap: the Jaccard index of two cells' chosen sets, its mean over the pairs of distinct cells
that share the calibration text (differing in search or objective) against the pairs that share
the search and objective (differing in text): which of the two moves the choice.

Decomposition: for each held-out measurement, the grid of the cells' mean scores (calibration
texts x searches) split into the texts' share of its sum of squares, the searches' and the rest
(`stats.decomposition`), each with a paired bootstrap interval over the measurement's items (the
same windows or questions for every cell, resampled together: `stats.bootstrap`). It names the
factor that decided only where the two intervals are apart, and says "cannot tell" where there
are too few items to resample.
"""

from __future__ import annotations

import numpy as np

from depthcurse.stats.bootstrap import TooFewItems, resample
from depthcurse.stats.decomposition import COLUMNS, REST, ROWS, decided_by, shares

# the decomposition's factors, as select names them
FACTORS = {ROWS: "calibration", COLUMNS: "search", REST: "rest"}


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
           for source, held in record["held_out"].items() for metric in ("loss", "kl")}
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
