"""Heal results on screen and as figures: the unpruned, pruned and healed model side by side (one
method, or several methods on the same removal with what each cost), and the healed depth curve
against the unhealed one (Gromov et al.'s Figure 1d), a line per method.

The columns lead with what transfers beyond the healing text: how far the model stays from the
unpruned one's predictions (KL, top-1 agreement), the loss on text of another source
(`--eval-data`), the task; then the held-out windows of the healing text itself, which reward a
method for adapting to that text. A method is named as its run recorded it (title, settings), so
that a method from outside reads as well as a built-in one."""

from __future__ import annotations

import math
from pathlib import Path

from rich.table import Table

from depthcurse.heal.healed import MODELS
from depthcurse.io import save_figure
from depthcurse.prune.report import legend_below

LEGACY_METHOD = "lora"  # what a record written before runs named their method was healed by
HEADERS = {("held_out", "kl"): "KL to unpruned (nats/token)", ("held_out", "agreement"): "top-1 agreement with unpruned",
           ("held_out", "loss"): "held-out loss (healing text)", ("held_out", "ppl"): "held-out ppl (healing text)"}


def methods_of(record: dict, method: str | None = None) -> dict[str, dict]:
    """Each method's entry in a comparison, a healed curve's point or a single heal's record; a
    one-method curve's points name their method (or the curve's `run` does: pass it as `method`)."""
    if "methods" in record:
        return record["methods"]
    run = record.get("run", {})
    method = record.get("method") or run.get("method") or method or LEGACY_METHOD
    return {method: {"results": record["results"]["healed"], "recovered": record.get("recovered", {}), "recovered_why": record.get("recovered_why", {}),
                     "recovered_interval": record.get("recovered_interval", {}), "unchanged": record.get("unchanged"),
                     "cost": record.get("cost"), "title": record.get("title") or run.get("method_title"), "how": record.get("how") or run.get("method_how")}}


UNCHANGED_MARK = " (unchanged: as pruned)"  # a method that changed nothing is not called healed


def _cell(value) -> str:
    return "-" if value is None or (isinstance(value, float) and not math.isfinite(value)) else f"{value:.4g}"


def _share(rec: dict, why: dict, key: str, intervals: dict | None = None) -> str:
    """A share won back, with its 95% interval where the run kept the paired items."""
    if key in why:
        return "no gap to win back"
    value = rec.get(key)
    if value is None:
        return "-"
    low_high = (intervals or {}).get(key)
    return f"{value:.0%}" + (f" [{low_high[0]:.0%}, {low_high[1]:.0%}]" if low_high else "")


def _measured(result: dict, part: str, metric: str) -> str:
    """A model's measurement; retained with its 95% interval where the run has one."""
    if part not in result:
        return "-"
    text = _cell(result[part]["metrics"].get(metric))
    low_high = (result[part].get("intervals") or {}).get(metric)
    return text + (f" [{low_high[0]:.3g}, {low_high[1]:.3g}]" if low_high else "")


def sites_text(found: dict | None) -> str:
    """Whether the cut or a fold site writes the unpruned model's massive activation (`heal.sites`)."""
    if not found:
        return ""
    if found.get("first_depth") is None:
        return "no massive activation (Sun et al.) in the unpruned model on the held-out windows"
    said = (f"massive activation (Sun et al.) written by block {', '.join(map(str, found['writers']))} (channel {found['channel']}, "
            f"position {found['position']}, {found['value']:,.4g} against a median of {found['median']:.3g})")
    where = []
    if found["cut_writers"]:
        where.append(f"the cut removes block {', '.join(map(str, found['cut_writers']))}, which writes it")
    if found["fold_writers"]:
        where.append(f"the block right before the cut (block {', '.join(map(str, found['fold_writers']))}) writes it, so a repair folded into "
                     "that block's output (linear's and linear-cosine's map) or scaling it (prune-comp) changes the massive activation too")
    return said + ": " + ("; ".join(where) if where else "neither the cut nor a fold site writes it")


def ties_text(record: dict) -> str:
    """The pairs of methods a comparison cannot tell apart: their difference's 95% interval holds 0."""
    return "; ".join(ties_lines(record))


def ties_lines(record: dict) -> list[str]:
    """A line per ranked measurement on which some methods cannot be told apart (their paired
    difference's 95% interval holds 0), or one line saying every pair was told apart."""
    lines = []
    for key, pairs in (record.get("ties") or {}).items():
        holm = all("apart_holm" in p for p in pairs)  # a record written before the adjustment has the plain intervals alone
        tied = [" = ".join(p["methods"]) for p in pairs if p["apart_holm" if holm else "apart"] is False]
        only_plain = [" = ".join(p["methods"]) for p in pairs if holm and p["apart"] and p["apart_holm"] is False]
        if tied:
            what = f"Holm-adjusted over its {len(pairs)} pairs" if holm else "the 95% interval of the paired difference holds 0"
            lines.append(f"cannot tell apart on {key.replace('_', ' ')} ({what}): " + ", ".join(tied)
                         + (f" (apart before the adjustment: {', '.join(only_plain)})" if only_plain else ""))
    if not lines and record.get("ties"):
        return ["every pair of methods told apart on every ranked measurement (95% intervals of the paired differences, Holm-adjusted)"]
    return lines


def heal_verdicts(record: dict) -> list[str]:
    """What a reader must not miss, a line each, said after the table: a model that was not healed
    at all, the methods that could not run, the ties of a comparison."""
    lines = [f"NOT HEALED: {record['unchanged']}"] if record.get("unchanged") else []
    lines += [f"NOT HEALED: {m}: {e['unchanged']}" for m, e in methods_of(record).items() if e.get("unchanged")] if "methods" in record else []
    lines += [f"could not run: {m}: {why}" for m, why in (record.get("refused") or {}).items()]
    return lines + ties_lines(record)


def _columns(results: dict) -> list[tuple[str, str, str]]:
    """(part, metric, header) for each measurement, what transfers first: KL and agreement to the
    unpruned model, the other text's loss, the task; then the healing text's held-out loss and ppl."""
    measured = [r for name, r in results.items() if name != "unpruned" and isinstance(r, dict)]
    held = next((r["held_out"]["metrics"] for r in measured if "held_out" in r), {})
    cols = [("held_out", m, HEADERS[("held_out", m)]) for m in ("kl", "agreement") if m in held]
    other = next((r["other"] for r in results.values() if isinstance(r, dict) and "other" in r), None)
    if other is not None:
        cols.append(("other", "loss", f"loss on {other['data']}"))
    task = next((r["task"] for r in results.values() if isinstance(r, dict) and "task" in r), None)
    if task is not None and "retained" in task["metrics"]:  # a suite: each task, the average, the share of the unpruned model's kept
        cols += [("task", m, m) for m in task["metrics"] if m not in (task["metric"], "retained")]
        cols += [("task", task["metric"], f"{task['data']} {task['metric']}"), ("task", "retained", "retained (of the unpruned average)")]
    elif task is not None:
        cols.append(("task", task["metric"], f"{task['data']} {task['metric']}"))
    return cols + [("held_out", m, HEADERS[("held_out", m)]) for m in ("loss", "ppl")]


def _recovered_key(part: str, metric: str) -> str:
    return f"{part}_{metric}" if part != "task" else f"task_{metric}"


def method_name(entry: dict, method: str) -> str:
    return entry.get("title") or method


def cost_text(cost: dict | None) -> str:
    if not cost:
        return "cost not recorded"
    parts = [f"{cost['seconds']:,.1f} s", f"{cost['tokens']:,} tokens"]
    for key, said in (("trained_params", "parameters trained"), ("added_params", "added"), ("solved_params", "solved for without training"),
                      ("estimated_params", "estimated and folded in")):
        if cost.get(key):
            parts.append(f"{cost[key]:,} {said}")
    return ", ".join(parts)


def _params(cost: dict) -> str:
    return f"{cost.get('trained_params', 0):,} / {cost.get('added_params', 0):,} / {cost.get('solved_params', cost.get('estimated_params', 0)):,}"


def _held_out_caption(record: dict) -> str:
    run = record["run"]
    on = record.get("measured_on") or {"held_out": record.get("held_out") or {}}
    parts = []
    for part, what in on.items():
        if what:
            parts.append(f"{what.get('windows', '?')} windows x {what.get('seq_len', run.get('seq_len'))} tokens of {what.get('data')}"
                         + (" (held out of the healing text)" if part == "held_out" else " (another source)"))
    return (("measured on " + "; ".join(parts) + ". " if parts else "")
            + "recovered: (pruned - healed) / (pruned - unpruned) of each measurement, and after it in brackets its 95% interval from the paired windows or questions; "
            "no gap where the removal did not hurt or the gap is within 2 standard errors")


def heal_rows(record: dict) -> list[tuple[str, ...]]:
    """The header, then the unpruned, pruned and healed model on each measurement, then the share
    of the removal's cost won back: what `heal_table` shows and the model card holds."""
    results = record["results"]
    cols = _columns(results)
    rows = [("model", *(header for _, _, header in cols))]
    for name in MODELS:
        r = results.get(name)
        label = name + (UNCHANGED_MARK if name == "healed" and record.get("unchanged") else "")
        rows.append((label, *(_measured(r, part, m) if r and part in r else "not measured" for part, m, _ in cols)))
    rec, why, intervals = record.get("recovered", {}), record.get("recovered_why", {}), record.get("recovered_interval", {})
    rows.append(("recovered", *("" if m == "ppl" else _share(rec, why, _recovered_key(part, m), intervals) for part, m, _ in cols)))
    return rows


def heal_table(record: dict) -> Table:
    """The unpruned, pruned and healed model on each measurement, the share of the removal's cost
    won back, and what the method cost."""
    run = record["run"]
    method = run.get("method", LEGACY_METHOD)
    title = (f"{run['model']} without layers {','.join(map(str, run['layers']))}: healed by {run.get('method_title') or method} "
             f"({run.get('method_how') or method})")
    healed_as = record["results"].get("healed", {}).get("as")
    caption = f"{_held_out_caption(record)}; the healed model: {healed_as or 'in memory'}; cost: {cost_text(record.get('cost'))}"
    if sites := sites_text(record.get("massive_activation")):
        caption += ". " + sites
    table = Table(title=title, caption=caption, header_style="bold")
    header, *rows = heal_rows(record)
    for i, name in enumerate(header):
        table.add_column(name, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row, style="bold" if row[0] == "recovered" else None)
    return table


def methods_table(record: dict) -> Table:
    """Several methods on the same removal: each healed model's measurements with the share of the
    cost it won back, what the method cost (seconds, tokens, parameters trained, added, solved
    for), and the methods this model could not take, with why."""
    run, results, methods = record["run"], record["results"], methods_of(record)
    every = {**results, **{m: e["results"] for m, e in methods.items()}}
    cols = _columns(every)
    named = "; ".join(f"{m}: {method_name(e, m)}, {e.get('how') or ''}" for m, e in methods.items())
    refused = record.get("refused") or {}
    caption = f"{_held_out_caption(record)}; each method's cell: healed (recovered). {named}"
    if sites := sites_text(record.get("massive_activation")):
        caption += ". " + sites
    table = Table(title=f"{run['model']} without layers {','.join(map(str, run['layers']))}: every method on the same removal",
                  caption=caption, header_style="bold")
    table.add_column("model")
    for _, _, header in cols:
        table.add_column(header, justify="right")
    for name in ("seconds", "tokens", "parameters trained / added / solved"):
        table.add_column(name, justify="right")
    for name in ("unpruned", "pruned"):
        r = results.get(name, {})
        table.add_row(name, *(_measured(r, part, m) for part, m, _ in cols), "", "", "")
    for method, entry in methods.items():
        r, rec, why, cost = entry["results"], entry.get("recovered", {}), entry.get("recovered_why", {}), entry.get("cost") or {}
        intervals = entry.get("recovered_interval", {})
        label = method + (UNCHANGED_MARK if entry.get("unchanged") else "")
        table.add_row(label, *((_measured(r, part, m) + ("" if m == "ppl" else f" ({_share(rec, why, _recovered_key(part, m), intervals)})")) if part in r else "-"
                                for part, m, _ in cols),
                      f"{cost.get('seconds', float('nan')):,.1f}", f"{cost.get('tokens', 0):,}", _params(cost))
    for method, why in refused.items():
        table.add_row(method, *(["could not run"] + [""] * (len(cols) - 1)), "", "", "")
    return table


def _curve_method(run: dict) -> str:
    """The method of a curve healed one way (a curve of several keeps each point's `methods`)."""
    return (run.get("methods") or [LEGACY_METHOD])[0]


def _title_in(curve: dict, method: str) -> str:
    points = curve.get("points") or []
    entry = methods_of(points[0], _curve_method(curve["run"])).get(method, {}) if points else {}
    return method_name(entry, method)


def curve_table(curve: dict) -> Table:
    """Per k: the layers removed and, on each measurement, the pruned model and each method's
    healed one with the share won back."""
    run, points = curve["run"], curve["points"]
    methods = list(methods_of(points[0], _curve_method(run))) if points else run.get("methods", [LEGACY_METHOD])
    table = Table(title=f"{run['model']}: healed depth curve ({run['order']}); " + "; ".join(f"{m}: {_title_in(curve, m)}" for m in methods),
                  header_style="bold")
    cols = _columns(points[0]["results"]) if points else []
    table.add_column("k", justify="right")
    table.add_column("layers removed")
    table.add_column("model")
    for _, _, header in cols:
        table.add_column(header, justify="right")
    table.add_column("seconds", justify="right")
    if points:
        base = points[0]["results"]["unpruned"]
        table.add_row("0", "none", "unpruned", *(_cell(base[part]["metrics"].get(m)) if part in base else "-" for part, m, _ in cols), "", style="bold")
    for p in points:
        pruned = p["results"]["pruned"]
        table.add_row(str(p["k"]), ",".join(map(str, p["layers"])), "pruned", *(_cell(pruned[part]["metrics"].get(m)) if part in pruned else "-" for part, m, _ in cols), "")
        for method, entry in methods_of(p, _curve_method(run)).items():
            r, rec, why = entry["results"], entry.get("recovered", {}), entry.get("recovered_why", {})
            intervals = entry.get("recovered_interval", {})
            table.add_row("", "", method, *((_measured(r, part, m) + ("" if m == "ppl" else f" ({_share(rec, why, _recovered_key(part, m), intervals)})"))
                                            if part in r else "-" for part, m, _ in cols),
                          f"{(entry.get('cost') or {}).get('seconds', float('nan')):,.1f}")
    return table


def plot_heal_curve(curve: dict, path: Path) -> Path:
    """Each measurement against the fraction of layers removed: pruned, each method's healed
    model, and the unpruned line; with a budget (`--max-drop`), its limit and the k it chose."""
    import matplotlib  # lazy: only figures need matplotlib (1 s to import)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run, points, n = curve["run"], curve["points"], curve["n_layers"]
    cols = [c for c in _columns(points[0]["results"]) if c[1] != "ppl"] if points else []
    methods = list(methods_of(points[0], _curve_method(run))) if points else []
    budget = curve.get("budget")
    fig, axes = plt.subplots(1, max(1, len(cols)), figsize=(5.5 * max(1, len(cols)), 4.8), dpi=120, squeeze=False)
    for ax, (part, metric, header) in zip(axes[0], cols):
        base = points[0]["results"]["unpruned"][part]["metrics"].get(metric)
        xs = [0.0] + [p["k"] / n for p in points]  # every curve starts at the unpruned model
        ax.plot(xs, [base] + [p["results"]["pruned"][part]["metrics"].get(metric) if part in p["results"]["pruned"] else None for p in points],
                marker="o", ls="--", label="pruned")
        for method in methods:
            ys = [methods_of(p, _curve_method(run))[method]["results"].get(part, {}).get("metrics", {}).get(metric) for p in points]
            ax.plot(xs, [base] + ys, marker="s", lw=2, label=f"healed: {_title_in(curve, method)}" if len(methods) > 1 else "healed")
        ax.axhline(base, color="k", lw=1, ls=":", label="unpruned")
        if budget and (part, metric) == ("held_out", "loss"):
            ax.axhline(budget["limit"], color="tab:red", lw=1, ls="-.", label=f"budget: {budget['max_drop']:.1%} over the unpruned loss")
            if budget.get("chosen"):
                ax.axvline(budget["chosen"] / n, color="tab:red", lw=1, alpha=0.6, label=f"chosen: k = {budget['chosen']}")
        ax.set_xlabel(f"fraction of layers removed (of {n})")
        ax.set_ylabel(header)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{run['model']}: layers removed by the {run['order']}, on {run['data']}\n"
                 + "\n".join(f"{_title_in(curve, m)}" for m in methods), fontsize=9)
    legend_below(fig, axes[0][0])
    return save_figure(fig, path)
