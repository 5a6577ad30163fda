"""The healed model's measurements as the hub's `model-index` lists them: one entry per dataset and
metric (each held-out text; each task of a suite by its own headline metric; the suite's average
and the share it retained, in percent as the tables say it). A pure function of `heal.json`'s
record, which the card writes (`card.write_card`)."""

from __future__ import annotations

import math

from depthcurse.heal.healed import HELD_OUT_METRICS
from depthcurse.tasks.harness import SUITE_METRIC


def evaluation_results(record: dict) -> list[dict]:
    """What the card's `model-index` lists, in the hub's form: the healed model's measurements, one
    entry per dataset with its metrics (each held-out text; each task of a suite on its own, by its
    headline metric; the suite's average and its retained share, in percent as the tables say it)."""
    out = []
    for part, scored in record["results"].get("healed", {}).items():
        if not isinstance(scored, dict) or "metrics" not in scored:
            continue
        metrics, data = scored["metrics"], str(scored.get("data"))
        if part != "task":
            found = [("text-generation", data, m, metrics.get(m)) for m in HELD_OUT_METRICS]
        elif "retained" in metrics:  # a suite
            members = scored.get("member_metrics") or {}
            grouped = {k for k in metrics if k.endswith((f" {SUITE_METRIC}", " retained"))}  # a named suite of a list, averaged on its own
            found = [("multiple-choice", name, members.get(name, "acc"), metrics[name]) for name in metrics if name not in (SUITE_METRIC, "retained", *grouped)]
            found += [("multiple-choice", k.rsplit(" ", 1)[0], SUITE_METRIC if k.endswith(SUITE_METRIC) else "retained %",
                       metrics[k] * (1 if k.endswith(SUITE_METRIC) else 100)) for k in sorted(grouped)]
            found += [("multiple-choice", data, SUITE_METRIC, metrics[SUITE_METRIC]), ("multiple-choice", data, "retained %", 100 * metrics["retained"])]
        else:
            found = [("multiple-choice", data, scored["metric"], metrics.get(scored["metric"]))]
        out += [{"task": task, "dataset": dataset, "metric": metric, "value": float(value), "part": part}
                for task, dataset, metric, value in found if isinstance(value, (int, float)) and math.isfinite(value)]
    return out
