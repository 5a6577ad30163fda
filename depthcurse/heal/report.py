"""Heal results on screen and as figures: the unpruned, pruned and healed model side by side (one
method, or several methods on the same removal with what each cost), and the healed depth curve
against the unhealed one (Gromov et al.'s Figure 1d), a line per method."""

from __future__ import annotations

import math
from pathlib import Path

from rich.table import Table

from depthcurse.heal.healed import HELD_OUT_METRICS, MODELS
from depthcurse.io import save_figure
from depthcurse.prune.report import legend_below

HELD_OUT_HEADERS = {"loss": "held-out loss", "ppl": "held-out ppl", "kl": "held-out KL to unpruned (nats/token)",
                    "agreement": "top-1 agreement with unpruned"}
METHOD_NAMES = {"lora": "LoRA", "linear": "linear map (ReplaceMe)", "layer": "trained layer (LLM-Streamline)", "linear+lora": "linear map, then LoRA"}


def methods_of(record: dict, method: str | None = None) -> dict[str, dict]:
    """Each method's entry in a comparison, a healed curve's point or a single heal's record; a
    one-method curve's points name their method (or the curve's `run` does: pass it as `method`)."""
    if "methods" in record:
        return record["methods"]
    method = record.get("method") or record.get("run", {}).get("method") or method or "lora"
    return {method: {"results": record["results"]["healed"], "recovered": record.get("recovered", {}), "cost": record.get("cost")}}


def _cell(value) -> str:
    return "-" if value is None or (isinstance(value, float) and not math.isfinite(value)) else f"{value:.4g}"


def _share(value) -> str:
    return "-" if value is None else f"{value:.0%}"


def _columns(results: dict) -> list[tuple[str, str, str]]:
    """(part, metric, header) for each measurement: held-out loss and perplexity, KL to the
    unpruned model and top-1 agreement with it (where measured), the task's headline metric."""
    held = next((r["held_out"]["metrics"] for name, r in results.items() if name != "unpruned" and "held_out" in r), {})
    cols = [("held_out", m, HELD_OUT_HEADERS[m]) for m in HELD_OUT_METRICS if m in held or m in ("loss", "ppl")]
    task = next((r["task"] for r in results.values() if "task" in r), None)
    if task is not None:
        cols.append(("task", task["metric"], f"{task['data']} {task['metric']}"))
    return cols


def _recovered_key(part: str, metric: str) -> str:
    return f"held_out_{metric}" if part == "held_out" else f"task_{metric}"


def method_text(run: dict, method: str) -> str:
    """How `method` healed, in a few words (the settings it used)."""
    lora = f"LoRA rank {run['lora_rank']} on {run['targets']}" + (" after the first removed layer" if run.get("adapt") == "after" else "")
    trained = f"{run['steps']} steps of {run['loss']} loss"
    linear = f"a linear map per removed run on {run.get('calib_tokens', 0):,} calibration tokens" + (f", ridge {run['ridge']}" if run.get("ridge") else "")
    return {"lora": f"{lora}, {trained}", "linear": linear, "layer": f"a trained layer per removed run, {run['steps']} steps of MSE",
            "linear+lora": f"{linear}, then {lora}, {trained}"}[method]


def cost_text(cost: dict | None) -> str:
    if not cost:
        return "cost not recorded"
    parts = [f"{cost['seconds']:,.1f} s", f"{cost['tokens']:,} tokens"]
    if cost.get("trained_params"):
        parts.append(f"{cost['trained_params']:,} parameters trained")
    if cost.get("added_params"):
        parts.append(f"{cost['added_params']:,} added")
    if cost.get("estimated_params"):
        parts.append(f"{cost['estimated_params']:,} estimated and folded in")
    return ", ".join(parts)


def _held_out_caption(record: dict, results: dict) -> str:
    run = record["run"]
    held = next((r["held_out"] for r in results.values() if "held_out" in r), None)
    windows = record["held_out"]["windows"] if record.get("held_out") else "?"
    return f"held out: {windows} windows x {run['seq_len']} tokens of {held['data'] if held else run['data']}; recovered: (pruned - healed) / (pruned - unpruned)"


def heal_rows(record: dict) -> list[tuple[str, ...]]:
    """The header, then the unpruned, pruned and healed model on each measurement, then the share
    of the removal's cost won back: what `heal_table` shows and the model card holds."""
    results = record["results"]
    cols = _columns(results)
    rows = [("model", *(header for _, _, header in cols))]
    for name in MODELS:
        r = results.get(name)
        rows.append((name, *(_cell(r[part]["metrics"].get(m)) if r and part in r else "not measured" for part, m, _ in cols)))
    rec = record.get("recovered", {})
    rows.append(("recovered", *(_share(rec.get(_recovered_key(part, m))) for part, m, _ in cols)))
    return rows


def heal_table(record: dict) -> Table:
    """The unpruned, pruned and healed model on the held-out windows and the task, the share of the
    removal's cost won back, and what the method cost."""
    run = record["run"]
    method = run.get("method", "lora")
    title = f"{run['model']} without layers {','.join(map(str, run['layers']))}: healed by {METHOD_NAMES[method]} ({method_text(run, method)})"
    caption = f"{_held_out_caption(record, record['results'])}; cost: {cost_text(record.get('cost'))}"
    table = Table(title=title, caption=caption, header_style="bold")
    header, *rows = heal_rows(record)
    for i, name in enumerate(header):
        table.add_column(name, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row, style="bold" if row[0] == "recovered" else None)
    return table


def methods_table(record: dict) -> Table:
    """Several methods on the same removal: each healed model's measurements with the share of the
    cost it won back, and what the method cost (seconds, tokens, parameters trained or added)."""
    run, results, methods = record["run"], record["results"], methods_of(record)
    every = {**results, **{m: e["results"] for m, e in methods.items()}}
    cols = _columns(every)
    named = "; ".join(f"{m}: {METHOD_NAMES[m]}, {method_text(run, m)}" for m in methods)
    table = Table(title=f"{run['model']} without layers {','.join(map(str, run['layers']))}: every method on the same removal",
                  caption=f"{_held_out_caption(record, results)}; each method's cell: healed (recovered). {named}", header_style="bold")
    table.add_column("model")
    for _, _, header in cols:
        table.add_column(header, justify="right")
    for name in ("seconds", "tokens", "parameters trained / added"):
        table.add_column(name, justify="right")
    for name in ("unpruned", "pruned"):
        r = results.get(name, {})
        table.add_row(name, *(_cell(r[part]["metrics"].get(m)) if part in r else "-" for part, m, _ in cols), "", "", "")
    for method, entry in methods.items():
        r, rec, cost = entry["results"], entry.get("recovered", {}), entry.get("cost") or {}
        table.add_row(method, *(f"{_cell(r[part]['metrics'].get(m))} ({_share(rec.get(_recovered_key(part, m)))})" if part in r else "-"
                                              for part, m, _ in cols),
                      f"{cost.get('seconds', float('nan')):,.1f}", f"{cost.get('tokens', 0):,}",
                      f"{cost.get('trained_params', 0):,} / {cost.get('added_params', 0):,}")
    return table


def _curve_method(run: dict) -> str:
    """The method of a curve healed one way (a curve of several keeps each point's `methods`)."""
    return (run.get("methods") or ["lora"])[0]


def curve_table(curve: dict) -> Table:
    """Per k: the layers removed and, on each measurement, the pruned model and each method's
    healed one with the share won back."""
    run, points = curve["run"], curve["points"]
    methods = list(methods_of(points[0], _curve_method(run))) if points else run.get("methods", ["lora"])
    table = Table(title=f"{run['model']}: healed depth curve ({run['order']}); " + "; ".join(f"{METHOD_NAMES[m]}: {method_text(run, m)}" for m in methods),
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
        table.add_row(str(p["k"]), ",".join(map(str, p["layers"])), "pruned", *(_cell(pruned[part]["metrics"].get(m)) for part, m, _ in cols), "")
        for method, entry in methods_of(p, _curve_method(run)).items():
            r, rec = entry["results"], entry.get("recovered", {})
            table.add_row("", "", method, *(f"{_cell(r[part]['metrics'].get(m))} ({_share(rec.get(_recovered_key(part, m)))})" for part, m, _ in cols),
                          f"{(entry.get('cost') or {}).get('seconds', float('nan')):,.1f}")
    return table


def plot_heal_curve(curve: dict, path: Path) -> Path:
    """Each measurement against the fraction of layers removed: pruned, each method's healed
    model, and the unpruned line."""
    import matplotlib  # lazy: only figures need matplotlib (1 s to import)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run, points, n = curve["run"], curve["points"], curve["n_layers"]
    cols = [c for c in _columns(points[0]["results"]) if c[1] != "ppl"] if points else []
    methods = list(methods_of(points[0], _curve_method(run))) if points else []
    fig, axes = plt.subplots(1, max(1, len(cols)), figsize=(5.5 * max(1, len(cols)), 4.8), dpi=120, squeeze=False)
    for ax, (part, metric, header) in zip(axes[0], cols):
        base = points[0]["results"]["unpruned"][part]["metrics"].get(metric)
        xs = [0.0] + [p["k"] / n for p in points]  # every curve starts at the unpruned model
        ax.plot(xs, [base] + [p["results"]["pruned"][part]["metrics"].get(metric) for p in points], marker="o", ls="--", label="pruned")
        for method in methods:
            ys = [methods_of(p, _curve_method(run))[method]["results"][part]["metrics"].get(metric) for p in points]
            ax.plot(xs, [base] + ys, marker="s", lw=2, label=f"healed: {METHOD_NAMES[method]}" if len(methods) > 1 else "healed")
        ax.axhline(base, color="k", lw=1, ls=":", label="unpruned")
        ax.set_xlabel(f"fraction of layers removed (of {n})")
        ax.set_ylabel(header)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{run['model']}: layers removed by the {run['order']}, on {run['data']}\n"
                 + "\n".join(f"{METHOD_NAMES[m]}: {method_text(run, m)}" for m in methods), fontsize=9)
    legend_below(fig, axes[0][0])
    return save_figure(fig, path)
