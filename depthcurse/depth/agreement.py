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

from depthcurse.depth.definitions import definitions_of
from depthcurse.depth.measure import later_means
from depthcurse.errors import DepthcurseError
from depthcurse.select.scoring import KEPT
from depthcurse.stats.correlation import spearman, spearman_interval
from depthcurse.stats.verdicts import agreement_word


def layer_measures(record: dict) -> dict[str, list[float | None]]:
    """Per layer, each depth-use measure of how much the layer does (None where it has none)."""
    rows, use = record["layers"], record["use"]
    n = len(rows)
    out = {"contribution ||a||/||h|| + ||m||/||h||": [r["attn_norm"] + r["mlp_norm"] for r in rows]}
    if use.get("influence"):
        out["influence on later layers"] = [*later_means(use["influence"]), None]  # the last layer has no later one
        change = "KL" if definitions_of(record).output_change == "kl" else "probability change (L2)"
        out[f"output {change} when skipped"] = list(use["output_change"])
    entering = definitions_of(record).lens_reads == "entering"

    def drops(kl: list[float]) -> list[float | None]:
        """How much nearer the output the lens reads after each layer than before it: rows after each
        layer leave the first layer's drop unknown; rows entering each layer end at the output (KL 0)."""
        if entering:
            return [kl[i] - (kl[i + 1] if i + 1 < n else 0.0) for i in range(n)]
        return [None] + [kl[i - 1] - kl[i] for i in range(1, n)]

    out["logit lens KL drop"] = drops([r["lens_kl"] for r in rows])
    if rows and "tuned_kl" in rows[0]:
        out["tuned lens KL drop"] = drops([r["tuned_kl"] for r in rows])
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
    the sign expected, whether the interval says so (True), says the opposite (False) or cannot tell
    (None), the word for it, and how many distinct values the target holds (a pick of k layers in n:
    2, every layer tied with k - 1 or n - k - 1 others)."""
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
                word = agreement_word(interval, sign)
                rows.append({"measure": measure, "target": target, "rho": rho, "interval": interval, "layers": len(both), "expected_sign": sign,
                             "agrees": {"agrees": True, "opposite": False}.get(word), "verdict": word,
                             "distinct": len({t for _, t in both})})
    return rows
