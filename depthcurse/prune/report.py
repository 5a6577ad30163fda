"""Prune results on screen and as figures: the rich table, the sweep plot, the Figure 2 overlay."""

from __future__ import annotations

import math
from pathlib import Path

from rich.table import Table

from depthcurse.angular.result import BlockChoice
from depthcurse.errors import DepthcurseError
from depthcurse.io import ensure_out_dir, save_figure
from depthcurse.prune.greedy import THRESHOLDS, DepthCurves
from depthcurse.prune.results import RESULTS_JSON, Sweep, prune_rows, read_sweep


def plot_prune(sweep: Sweep, path: Path) -> Path:
    import matplotlib  # lazy: only figures need matplotlib (1 s to import)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    singles = sweep.single_removals
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    if singles:
        ax.plot([v.removed[0] for v in singles], [v.metrics[sweep.metric] for v in singles], marker="o", ms=4, lw=1.5, label="layer removed")
    base = sweep.baseline
    worst = max((v.metrics[sweep.metric] for v in singles), default=None) if sweep.run.get("task") == "ppl" else None
    return _finish(fig, ax, path, sweep.metric, sweep.higher_is_better, base.metrics[sweep.metric] if base else None, worst,
                   f"removed layer index (0 to {sweep.n_layers - 1})",
                   f"{sweep.run.get('model')}: {sweep.metric} with one layer removed at a time\neach point: {data_amount(sweep)}")


def _finish(fig, ax, path: Path, metric: str, higher_is_better: bool, baseline: float | None, worst_loss: float | None, xlabel: str, title: str) -> Path:
    """The unpruned line, a log scale when a loss rises more than 4-fold, labels, and the file."""
    if baseline is not None:
        ax.axhline(baseline, color="k", ls="--", lw=1, label=f"unpruned ({baseline:.4g})")
        if worst_loss is not None and worst_loss > 4 * baseline:
            ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"{metric} ({'higher' if higher_is_better else 'lower'} is better)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return save_figure(fig, path)


def data_amount(sweep: Sweep) -> str:
    """What each variant's score rests on, in words: `16 windows x 512 tokens of wiki`, `570 examples of arc_easy, 5-shot`."""
    run, base = sweep.run, sweep.baseline
    task = run.get("task", "?")
    if task == "ppl":
        return f"{run.get('windows', '?')} windows x {run.get('seq_len', '?')} tokens of {run.get('data', '?')}"
    unit = {"squad": "questions", "repr": "passages"}.get(task, "examples")
    shots = run.get("num_fewshot")
    source = run.get("data", "?") if task in ("squad", "repr") else task
    return f"{base.examples if base else '?'} {unit} of {source}" + (f", {shots}-shot" if shots not in (None, 0, []) else "")


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
    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=120)
    largest = 0.0
    for folder in folders:
        sweep = load_prune(folder)
        if sweep.baseline is None:
            raise DepthcurseError(f"{folder}: the sweep has no unpruned baseline yet; rerun its prune command")
        xs, ys = relative_drop_curve(sweep)
        if not xs:
            raise DepthcurseError(f"{folder}: the sweep has no single-layer removals to plot")
        largest = max([largest, *(abs(y) for y in ys if math.isfinite(y))])
        ax.plot(xs, ys, marker="o", ms=4, lw=1.5, label=f"{sweep.run.get('model')} ({sweep.n_layers} layers): {sweep.metric}, {data_amount(sweep)}")
    ax.axhline(0, color="k", lw=0.8)
    if largest > 150:  # a ruinous layer (a Pre-LN layer 0) would flatten every other point
        ax.set_yscale("symlog", linthresh=10)
        lowest = min(min(line.get_ydata()) for line in ax.get_lines()[:-1])
        ax.set_ylim(bottom=min(-2.0, 1.2 * lowest))  # symlog would otherwise show a decade below zero
    ax.set_xlabel("removed layer / number of layers (0 = first layer)")
    ax.set_ylabel("relative drop vs. unpruned (%, up = worse)")
    ax.set_title("one layer removed at a time, no fine-tuning")
    ax.set_xlim(-0.03, 1.0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)


def prune_table(sweep: Sweep) -> Table:
    """The sweep as a rich table; the worst variants are highlighted."""
    rows = prune_rows(sweep)
    title = f"{sweep.run.get('model')} · {sweep.run.get('task')} · {sweep.metric} ({'↑' if sweep.higher_is_better else '↓'} better)"
    shared = sweep.meta.get("engine", {}).get("name") == "reuse"
    caption = "s: seconds spent scoring the variant" + (" (the reuse engine scores them together: an equal share of its time)" if shared else "")
    table = Table(title=title, caption=caption, header_style="bold")
    extra = [m for m in (rows[0] if rows else {}) if m not in {"removed", "drop", "rel_drop", "examples", "seconds"}]
    table.add_column("removed", justify="right")
    for m in extra:
        table.add_column(m, justify="right")
    for name in ("drop", "rel. drop", "examples", "s"):
        table.add_column(name, justify="right")
    drops = sorted((r["drop"] for r in rows if r["removed"] != "none" and math.isfinite(r["drop"])), reverse=True)
    worst = set(drops[: max(1, len(drops) // 10)])
    for r in rows:
        style = "bold red" if r["removed"] != "none" and r["drop"] in worst else ("bold" if r["removed"] == "none" else None)
        table.add_row(
            r["removed"],
            *[_fmt(r[m]) for m in extra],
            _fmt(r["drop"], signed=True),
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


def _fmt(value, signed: bool = False) -> str:
    if isinstance(value, float):
        if not math.isfinite(value):
            return "nan"
        return f"{value:+.4f}" if signed else f"{value:.4f}"
    return str(value)


UNIT_NAMES = {"layer": "layers", "attn": "attention branches", "mlp": "MLP branches"}


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
    if result.run.get("orders_from"):
        table.caption = f"orders chosen on {result.run['orders_from']}, measured on {result.run.get('data', 'this data')}"
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
                   f"fraction of {unit} removed (of {result.n_units})", f"{result.run.get('model')}: {result.run.get('task')}, {unit} removed by each strategy")
