"""Prune results on screen and as figures: the rich table, the sweep plot, the Figure 2 overlay."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

from rich.table import Table

from depthcurse.angular.result import BlockChoice
from depthcurse.errors import DepthcurseError
from depthcurse.io import ensure_out_dir, save_figure
from depthcurse.prune.greedy import THRESHOLDS, DepthCurves
from depthcurse.prune.results import RESULTS_JSON, UNIT_NAMES, Sweep, data_text, prune_rows, read_sweep
from depthcurse.tasks.probes import PROBES


def plot_prune(sweep: Sweep, path: Path) -> Path:
    import matplotlib  # lazy: only figures need matplotlib (1 s to import)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    singles = sweep.single_removals
    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=120)
    if singles:
        ax.plot([v.removed[0] for v in singles], [v.metrics[sweep.metric] for v in singles], marker="o", ms=4, lw=1.5, label=f"{sweep.unit} removed")
    base = sweep.baseline
    worst = max((v.metrics[sweep.metric] for v in singles), default=None) if sweep.run.get("task") == "ppl" else None
    where = "removed layer index" if sweep.granularity == "layer" else f"index of the layer whose {sweep.unit} is removed"
    status = "" if sweep.complete else f"\n{sweep.status_text()}"
    return _finish(fig, ax, path, sweep.metric, sweep.higher_is_better, base.metrics[sweep.metric] if base else None, worst,
                   f"{where} (0 to {sweep.n_layers - 1})",
                   f"{sweep.run.get('model')}: {sweep.metric} with one {sweep.unit} removed at a time\neach point: {sweep.data_text()}{status}")


def _finish(fig, ax, path: Path, metric: str, higher_is_better: bool, baseline: float | None, worst_loss: float | None, xlabel: str, title: str) -> Path:
    """The unpruned line, a log scale when a loss rises more than 4-fold, labels, and the file."""
    if baseline is not None:
        ax.axhline(baseline, color="k", ls="--", lw=1, label=f"unpruned ({baseline:.4g})")
        if worst_loss is not None and worst_loss > 4 * baseline:
            ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"{metric} ({'higher' if higher_is_better else 'lower'} is better)")
    ax.set_title("\n".join(textwrap.fill(line, 100) for line in title.split("\n")), fontsize=10)
    ax.grid(alpha=0.3)
    legend_below(fig, ax)
    return save_figure(fig, path)


def legend_below(fig, ax, fontsize: float | None = None) -> None:
    """The legend under the axes, where it hides no point of any curve."""
    fig.set_layout_engine("constrained")  # which makes room for a legend "outside" the axes
    handles, labels = ax.get_legend_handles_labels()
    columns = 1 if any(len(label) > 40 for label in labels) else min(3, len(handles)) or 1
    labels = [textwrap.fill(label, 110) for label in labels]  # a long path stays on the figure
    fig.legend(handles, labels, loc="outside lower center", ncols=columns, fontsize=fontsize, frameon=False)


def load_prune(folder: Path) -> Sweep:
    """The sweep in a prune results folder, or one clear error saying why there is none."""
    folder = Path(folder)
    if not folder.exists():
        raise DepthcurseError(f"{folder} does not exist")
    sweep = read_sweep(folder)
    if sweep is None:
        raise DepthcurseError(f"{folder} holds no prune result ({RESULTS_JSON}): give folders that `depthcurse prune` wrote")
    return sweep


def relative_drop_curve(sweep: Sweep) -> tuple[list[float], list[float]]:
    """(removed layer / number of layers, relative drop in percent, positive = worse) per single-layer variant."""
    singles = sweep.single_removals
    return [v.removed[0] / sweep.n_layers for v in singles], [100 * sweep.drop(v)[1] for v in singles]


def plot_prune_overlay(folders: list[Path], path: Path) -> Path:
    """Several sweeps on one figure, comparable across models of any depth (the papers' Figure 2):
    x = removed layer / number of layers, y = relative drop against each model's own baseline,
    signed so that up is worse for every metric (a loss that rises, an accuracy that falls)."""
    import matplotlib  # lazy: only figures need matplotlib (1 s to import)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not folders:
        raise DepthcurseError("give at least one prune results folder")
    ensure_out_dir(Path(path).parent, what="the folder of --out")
    sweeps = [load_prune(folder) for folder in folders]
    for folder, sweep in zip(folders, sweeps):
        if sweep.baseline is None:
            raise DepthcurseError(f"{folder}: the sweep has no unpruned baseline yet; rerun its prune command")
        if not sweep.single_removals:
            raise DepthcurseError(f"{folder}: the sweep has no single-unit removals to plot (a --block result?)")
    fig, ax = plt.subplots(figsize=(8, 4.8 + 0.25 * len(sweeps)), dpi=120, layout="constrained")
    largest = 0.0
    for sweep in sweeps:
        xs, ys = relative_drop_curve(sweep)
        largest = max([largest, *(abs(y) for y in ys if math.isfinite(y))])
        ax.plot(xs, ys, marker="o", ms=4, lw=1.5, label=sweep_label(sweep))
    ax.axhline(0, color="k", lw=0.8)
    if largest > 150:  # a ruinous layer (a Pre-LN layer 0) would flatten every other point
        ax.set_yscale("symlog", linthresh=10)
        lowest = min(min(line.get_ydata()) for line in ax.get_lines()[:-1])
        ax.set_ylim(bottom=min(-2.0, 1.2 * lowest))  # symlog would otherwise show a decade below zero
    units = sorted({s.unit for s in sweeps})
    ax.set_xlabel("index of the layer removed (or whose branch is) / number of layers (0 = first layer)" if units != ["layer"] else "removed layer / number of layers (0 = first layer)")
    ax.set_ylabel("relative drop vs. unpruned (%, up = worse)")
    ax.set_title(f"one {' or one '.join(units)} removed at a time, no fine-tuning")
    ax.set_xlim(-0.03, 1.0)
    ax.grid(alpha=0.3)
    legend_below(fig, ax, fontsize=8)
    return save_figure(fig, path)


def sweep_label(sweep: Sweep) -> str:
    """A sweep in one line: the model, what one removal takes out, the metric, the data, and how far it came."""
    partial = "" if sweep.complete else f" [{sweep.status_text().split(' (')[0]}]"
    return f"{sweep.run.get('model')} ({sweep.n_layers} layers), one {sweep.unit} removed: {sweep.metric}, {sweep.data_text()}{partial}"


def prune_table(sweep: Sweep) -> Table:
    """The sweep as a rich table; the worst variants are highlighted."""
    rows = prune_rows(sweep)
    title = (f"{sweep.run.get('model')} · one {sweep.unit} removed at a time · {sweep.run.get('task')} on {sweep.data_text()} · "
             f"{sweep.metric} ({'↑' if sweep.higher_is_better else '↓'} better)")
    shared = sweep.meta.get("engine", {}).get("name") == "reuse"
    caption = "s: seconds spent scoring the variant" + (" (the reuse engine scores them together: an equal share of its time)" if shared else "")
    if rows and "drop 95% low" in rows[0]:
        caption = (f"drop: the loss against the unpruned model's, in brackets its 95% interval paired over the {sweep.run.get('windows', '?')} windows "
                   f"(Student's t)\n{caption}")
    if not sweep.complete:
        caption = f"{sweep.status_text()}\n{caption}"
    extra = [m for m in (rows[0] if rows else {}) if m not in {"unit", "removed", "data", "drop", "rel_drop", "examples", "seconds", "drop 95% low",
                                                               "drop 95% high"}]
    capabilities = list(sweep.capabilities(sweep.variants[0])) if sweep.variants else []
    if capabilities:  # the probes: a column per capability with its interval, in place of a column per rung (prune.csv keeps both)
        extra = [m for m in extra if m not in PROBES and not any(m.startswith(f"{c} ") for c in capabilities)]
        caption += ("\ncapabilities (probes): the share of the examples solved over the capability's rungs, with its 95% Wilson interval; "
                    "each rung's score is in prune.csv and prune.json")
    table = Table(title=title, caption=caption, header_style="bold")
    table.add_column(f"{sweep.unit} removed", justify="right")
    for m in extra:
        # lm-eval's metric names are long (exact_match_flexible-extract): wrapped, never cut to the same prefix
        table.add_column(m.replace("_", " ") if len(m) > 12 else m, justify="right", overflow="fold", min_width=6)
    for name in ("drop", "rel. drop", "examples", "s"):
        table.add_column(name, justify="right")
    drops = sorted((r["drop"] for r in rows if r["removed"] != "none" and math.isfinite(r["drop"])), reverse=True)
    worst = set(drops[: max(1, len(drops) // 10)])
    for r in rows:
        style = "bold red" if r["removed"] != "none" and r["drop"] in worst else ("bold" if r["removed"] == "none" else None)
        table.add_row(
            r["removed"],
            *[_fmt(r[m]) if m not in capabilities else _with_interval(r, m) for m in extra],
            _fmt(r["drop"], signed=True) + (f" [{r['drop 95% low']:+.4f}, {r['drop 95% high']:+.4f}]" if math.isfinite(r.get("drop 95% low", math.nan)) else ""),
            "" if not math.isfinite(r["rel_drop"]) else f"{r['rel_drop']:+.1%}",
            str(r["examples"]),
            f"{r['seconds']:.1f}",
            style=style,
        )
    return table


def block_table(sweep: Sweep, choices: list[BlockChoice]) -> Table:
    """`prune --block n`: the block angular distance picks against the n deepest layers before the last."""
    n = len(choices[0].layers)
    title = f"{sweep.run.get('model')} · {sweep.run.get('task')} · {n} contiguous layers removed · {sweep.metric} ({'↑' if sweep.higher_is_better else '↓'} better)"
    table = Table(title=title, header_style="bold")
    for col in ("rule", "layers removed", "d(x_l, x_l+n)", sweep.metric, "drop", "rel. drop"):
        table.add_column(col, justify="right")
    by_removed = {tuple(v.removed): v for v in sweep.variants}
    base = sweep.baseline
    if base is not None:
        table.add_row("unpruned", "none", "", _fmt(base.metrics[sweep.metric]), "", "", style="bold")
    for c in choices:
        v = by_removed.get(tuple(c.layers))
        if v is None:
            table.add_row(c.rule, c.label, f"{c.distance:.4f}", "not run", "", "")
            continue
        drop, rel = sweep.drop(v)
        table.add_row(c.rule, c.label, f"{c.distance:.4f}", _fmt(v.metrics[sweep.metric]), _fmt(drop, signed=True),
                      "" if not math.isfinite(rel) else f"{rel:+.1%}")
    return table


def _with_interval(row: dict, name: str) -> str:
    low, high = row.get(f"{name} 95% low"), row.get(f"{name} 95% high")
    return _fmt(row[name]) + (f" [{low:.2f}, {high:.2f}]" if isinstance(low, float) and isinstance(high, float) else "")


def _fmt(value, signed: bool = False) -> str:
    if isinstance(value, float):
        if not math.isfinite(value):
            return "nan"
        return f"{value:+.4f}" if signed else f"{value:.4f}"
    return str(value)


def greedy_table(result: DepthCurves) -> Table:
    """Per strategy: units removed before the relative drop first exceeds 1%, 5%, 10% (≥k: the curve
    stops first), and the last point."""
    unit = UNIT_NAMES[result.granularity]
    table = Table(title=f"{unit} removable ({result.n_units} in all) before {result.metric} drops by more than")
    table.add_column("strategy")
    for t in THRESHOLDS:
        table.add_column(f"{t:.0%}", justify="right")
    table.add_column(f"{result.metric} at the last step", justify="right")
    table.add_column("removed, in order", overflow="fold")
    for name, points in result.curves.items():
        last = points[-1]
        order = [p.removed for p in points]
        steps = [next(iter(set(b) - set(a)), None) for a, b in zip(order, order[1:])] if name == "greedy" else last.removed
        table.add_row(name, *(result.within_text(name, t) for t in THRESHOLDS), f"{last.metric:.4g} (k={last.k})", " ".join(map(str, steps)))
    for name, why in result.notes.items():
        table.add_row(f"[dim]{name}[/]", *["-"] * len(THRESHOLDS), "-", f"[dim]{why}[/]")
    table.caption = f"measured on {curves_data_text(result)}"
    return table


def plot_greedy(result: DepthCurves, path: Path) -> Path:
    """Metric against the fraction of units removed, one line per strategy."""
    import matplotlib  # lazy: only figures need matplotlib (1 s to import)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    for name, points in result.curves.items():
        ax.plot([p.k / result.n_units for p in points], [p.metric for p in points], marker="o" if name == "greedy" else ".", ms=4,
                lw=2 if name == "greedy" else 1.2, label=name)
    unit = UNIT_NAMES[result.granularity]
    worst = max(p.metric for pts in result.curves.values() for p in pts) if result.metric == "loss" else None
    return _finish(fig, ax, path, result.metric, result.higher_is_better, result.curves["greedy"][0].metric, worst,
                   f"fraction of {unit} removed (of {result.n_units})", f"{result.run.get('model')}: {unit} removed by each strategy\n{curves_data_text(result)}")


def curves_data_text(result: DepthCurves) -> str:
    """What a depth curve was measured on, and where its orders were chosen when that was elsewhere."""
    run = result.run
    data = f"{run.get('task', '?')}, {data_text(run)}"
    return f"{data}; orders chosen on {run['orders_from']}" if run.get("orders_from") else data
