"""Do the layers depth-use calls little used match the ones `select` measures as cheapest to remove?
(issue 73, item 4.) Each depth-use measure is a per-layer number; each `select` run gives two exact
answers to set it against:

- every layer's own removal cost: the calibration score of removing that layer alone, which
  `select.json` keeps wherever a search scored every single removal (greedy's first step, exact
  at k = 1), on the run's objective;
- each pick: which layers a search (exact, greedy, ...) chose at that run's k, 1 or 0 per layer.

The agreement is Spearman's rho with its 95% interval (`stats.correlation`), over the layers both
sides rank. A measure of use should rise with the removal cost (rho > 0) and fall where a layer is
picked (rho < 0): each row says which it expects and whether its interval leaves 0 out.
"""

from __future__ import annotations

from depthcurse.errors import DepthcurseError
from depthcurse.select.scoring import KEPT
from depthcurse.stats.correlation import spearman, spearman_interval



def layer_measures(record: dict) -> dict[str, list[float | None]]:
    """Per layer, each depth-use measure of how much the layer does (None where it has none)."""
    rows, use = record["layers"], record["use"]
    n = len(rows)
    out = {"contribution ||a||/||h|| + ||m||/||h||": [r["attn_norm"] + r["mlp_norm"] for r in rows]}
    if use.get("influence"):
        means = []
        for row in use["influence"]:
            later = [v for v in row if v is not None and v == v]
            means.append(sum(later) / len(later) if later else None)  # the last layer has no later one
        out["influence on later layers"] = means
        out["output KL when skipped"] = list(use["output_change"])
    lens = [r["lens_kl"] for r in rows]  # how much nearer the output the logit lens reads after this layer than before it
    out["logit lens KL drop"] = [None] + [lens[i - 1] - lens[i] for i in range(1, n)]
    if rows and "tuned_kl" in rows[0]:
        tuned = [r["tuned_kl"] for r in rows]
        out["tuned lens KL drop"] = [None] + [tuned[i - 1] - tuned[i] for i in range(1, n)]
    return out


def select_targets(select: dict, objective: str = "kl") -> dict[str, tuple[list[float | None], int]]:
    """From one select record: each layer's own removal cost (where every single removal was scored)
    and each whole-block pick as 1/0 per layer; each with the sign a measure of use should have."""
    n = select["run"]["n_layers"]
    out: dict[str, tuple[list[float | None], int]] = {}
    for source, scores in select.get("calibration_scores", {}).items():
        single = [scores.get(str(i)) for i in range(n)]
        at = KEPT.index(objective)  # select.json keeps each removal's scores in this order
        if all(s is not None and len(s) > at and s[at] is not None for s in single):
            label = select.get("labels", {}).get(source, source)
            out[f"removal cost alone ({objective}, {label})"] = ([s[at] for s in single], +1)
    for name, cell in sorted(select["cells"].items()):
        if all(isinstance(u, int) for u in cell["layers"]):  # whole blocks only: a branch pick names no layer
            picked = set(cell["layers"])
            out[f"picked by {name} at k = {len(picked)}"] = ([1.0 if i in picked else 0.0 for i in range(n)], -1)
    return out


def agreement(record: dict, selects: list[dict], objective: str = "kl") -> list[dict]:
    """Every depth-use measure against every select target: rho, its interval, the layers it ranks,
    the sign expected, and whether the interval says so (True), says the opposite (False) or cannot
    tell (None)."""
    n = len(record["layers"])
    measures = layer_measures(record)
    rows = []
    for select in selects:
        if select["run"]["n_layers"] != n:
            raise DepthcurseError(f"--agree-with: a select run of {select['run']['n_layers']} layers against depth-use's {n}: not the same model")
        if select["run"]["model"] != record["run"]["model"]:
            raise DepthcurseError(f"--agree-with: a select run of {select['run']['model']} against depth-use's {record['run']['model']}")
        for target, (values, sign) in select_targets(select, objective).items():
            for measure, per_layer in measures.items():
                both = [(m, t) for m, t in zip(per_layer, values) if m is not None and t is not None]
                rho = spearman([m for m, _ in both], [t for _, t in both])
                interval = spearman_interval(rho, len(both))
                says = None if interval is None or interval[0] <= 0 <= interval[1] else (interval[0] * sign > 0)
                rows.append({"measure": measure, "target": target, "rho": rho, "interval": interval, "layers": len(both), "expected_sign": sign,
                             "agrees": says})
    return rows
