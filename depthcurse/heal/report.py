"""Heal results on screen and as figures: the unpruned, pruned and healed model side by side, and
the healed depth curve against the unhealed one (Gromov et al.'s Figure 1d)."""

from __future__ import annotations

import math
from pathlib import Path

from rich.table import Table

from depthcurse.heal.loop import HELD_OUT_METRICS, MODELS
from depthcurse.io import save_figure
from depthcurse.prune.report import legend_below


def _cell(value) -> str:
    return "-" if value is None or (isinstance(value, float) and not math.isfinite(value)) else f"{value:.4g}"


HELD_OUT_HEADERS = {"loss": "held-out loss", "ppl": "held-out ppl", "kl": "held-out KL to unpruned (nats/token)",
                    "agreement": "top-1 agreement with unpruned"}


def _columns(results: dict) -> list[tuple[str, str, str]]:
    """(part, metric, header) for each measurement: held-out loss and perplexity, KL to the
    unpruned model and top-1 agreement with it (where measured), the task's headline metric."""
    held = next((r["held_out"]["metrics"] for name, r in results.items() if name != "unpruned" and "held_out" in r), {})
    cols = [("held_out", m, HELD_OUT_HEADERS[m]) for m in HELD_OUT_METRICS if m in held or m in ("loss", "ppl")]
    task = next((r["task"] for r in results.values() if "task" in r), None)
    if task is not None:
        cols.append(("task", task["metric"], f"{task['data']} {task['metric']}"))
    return cols


def heal_table(record: dict) -> Table:
    """The unpruned, pruned and healed model on the held-out windows and the task, and the share of the removal's cost won back."""
    run, results = record["run"], record["results"]
    title = (f"{run['model']} without layers {','.join(map(str, run['layers']))}: healed {record.get('training', {}).get('steps', run['steps'])} steps, "
             f"{run['loss']} loss, LoRA rank {run['lora_rank']} on {run['targets']}")
    held = next((r["held_out"] for r in results.values()), None)
    caption = f"held out: {record['held_out']['windows'] if 'held_out' in record else '?'} windows x {run['seq_len']} tokens of {held['data'] if held else run['data']}"
    caption += "; recovered: (pruned - healed) / (pruned - unpruned)"
    table = Table(title=title, caption=caption, header_style="bold")
    cols = _columns(results)
    table.add_column("model")
    for _, _, header in cols:
        table.add_column(header, justify="right")
    for name in MODELS:
        r = results.get(name)
        table.add_row(name, *(_cell(r[part]["metrics"].get(m)) if r and part in r else "not measured" for part, m, _ in cols))
    rec = record.get("recovered", {})
    table.add_row("recovered", *(_share(rec.get(f"held_out_{m}" if part == "held_out" else f"task_{m}")) for part, m, _ in cols), style="bold")
    return table


def _share(value) -> str:
    return "-" if value is None else f"{value:.0%}"


def curve_table(curve: dict) -> Table:
    """Per k: the layers removed and, on each measurement, pruned against healed and the share won back."""
    run, points = curve["run"], curve["points"]
    table = Table(title=f"{run['model']}: healed depth curve ({run['order']}), {run['steps']} steps of {run['loss']} loss each", header_style="bold")
    cols = _columns(points[0]["results"]) if points else []
    table.add_column("k", justify="right")
    table.add_column("layers removed")
    for _, _, header in cols:
        table.add_column(f"{header}: pruned → healed (recovered)", justify="right")
    if points:
        base = points[0]["results"]["unpruned"]
        table.add_row("0", "none", *(_cell(base[part]["metrics"].get(m)) if part in base else "-" for part, m, _ in cols), style="bold")
    for p in points:
        r, rec = p["results"], p["recovered"]
        table.add_row(str(p["k"]), ",".join(map(str, p["layers"])),
                      *(f"{_cell(r['pruned'][part]['metrics'].get(m))} → {_cell(r['healed'][part]['metrics'].get(m))} "
                        f"({_share(rec.get(f'held_out_{m}' if part == 'held_out' else f'task_{m}'))})" for part, m, _ in cols))
    return table


def plot_heal_curve(curve: dict, path: Path) -> Path:
    """Each measurement against the fraction of layers removed: pruned, healed, and the unpruned line."""
    import matplotlib  # lazy: only figures need matplotlib (1 s to import)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run, points, n = curve["run"], curve["points"], curve["n_layers"]
    cols = [c for c in _columns(points[0]["results"]) if c[1] != "ppl"] if points else []
    fig, axes = plt.subplots(1, max(1, len(cols)), figsize=(6 * max(1, len(cols)), 4.8), dpi=120, squeeze=False)
    for ax, (part, metric, header) in zip(axes[0], cols):
        base = points[0]["results"]["unpruned"][part]["metrics"].get(metric)
        xs = [0.0] + [p["k"] / n for p in points]  # both curves start at the unpruned model
        for name, style in (("pruned", dict(marker="o", ls="--")), ("healed", dict(marker="s", lw=2))):
            ax.plot(xs, [base] + [p["results"][name][part]["metrics"].get(metric) for p in points], label=f"{name}", **style)
        ax.axhline(base, color="k", lw=1, ls=":", label="unpruned")
        ax.set_xlabel(f"fraction of layers removed (of {n})")
        ax.set_ylabel(header)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{run['model']}: layers removed by the {run['order']}\nhealed with {run['steps']} steps of {run['loss']} loss, "
                 f"LoRA rank {run['lora_rank']} on {run['targets']}, on {run['data']}", fontsize=9)
    legend_below(fig, axes[0][0])
    return save_figure(fig, path)
