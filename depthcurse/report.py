"""Results on disk and on screen: CSV, JSON and PNG written atomically, and rich tables."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import platform
import tempfile
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from rich.table import Table

from depthcurse.errors import DepthcurseError

if TYPE_CHECKING:
    from depthcurse.sweep import Sweep

_UMASK = os.umask(0)
os.umask(_UMASK)

PACKAGES = ("depthcurse", "torch", "transformers", "lm_eval", "datasets", "accelerate", "safetensors")


def environment() -> dict:
    import torch

    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    env = {"python": platform.python_version(), "platform": platform.platform(), "packages": versions, "torch_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return env


def ensure_out_dir(path: Path) -> Path:
    path = Path(path).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-", delete=True)
        probe.close()
    except OSError as exc:
        raise DepthcurseError(f"--out {path} is not writable: {exc.strerror or exc}") from exc
    return path


def csv_text(rows: list[dict], *, digits: int | None = 8, empty_header: list[str] | None = None) -> str:
    """Rows of dicts as CSV text: floats to `digits` significant digits (None: as Python prints
    them), None as an empty cell; the header is the first row's keys (or `empty_header`)."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]) if rows else list(empty_header or []), lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if v is None else (f"{v:.{digits}g}" if digits and isinstance(v, float) else v)) for k, v in row.items()})
    return buf.getvalue()


def atomic_write(path: Path, data: str | bytes) -> None:
    """Write to a temporary file beside `path`, then rename: a reader (or a crash) never sees half a file."""
    mode = "wb" if isinstance(data, bytes) else "w"
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, mode) as fh:
            fh.write(data)
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; results should read like any other file
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _clean(value):
    """JSON has no NaN/inf: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def prune_rows(sweep: "Sweep") -> list[dict]:
    """One flat row per variant: removed, metrics, drop, relative drop, examples, seconds."""
    rows = []
    metric_names = list(dict.fromkeys(k for v in sweep.variants for k in v.metrics))
    for v in sweep.variants:
        drop, rel = sweep.drop(v)
        row = {"removed": v.label}
        row.update({m: v.metrics.get(m, float("nan")) for m in metric_names})
        row.update({"drop": drop, "rel_drop": rel, "examples": v.examples, "seconds": v.seconds})
        rows.append(row)
    return rows


def write_prune_tables(sweep: "Sweep", out_dir: Path) -> None:
    atomic_write(out_dir / "prune.csv", csv_text(prune_rows(sweep), digits=6, empty_header=["removed"]))
    atomic_write(out_dir / "prune.json", json.dumps(_clean(sweep.to_json()), indent=2) + "\n")


def plot_prune(sweep: "Sweep", path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    singles = sorted((v for v in sweep.variants if len(v.removed) == 1), key=lambda v: v.removed[0])
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    if singles:
        ax.plot([v.removed[0] for v in singles], [v.metrics[sweep.metric] for v in singles], marker="o", ms=4, lw=1.5, label="layer removed")
    base = sweep.baseline
    if base is not None:
        ax.axhline(base.metrics[sweep.metric], color="k", ls="--", lw=1, label=f"unpruned ({base.metrics[sweep.metric]:.4g})")
    task = sweep.run.get("task", "")
    shots = sweep.run.get("num_fewshot")
    task_label = f"{task}, {shots}-shot" if shots not in (None, 0, []) else str(task)
    if task == "ppl":
        task_label = f"ppl on {sweep.run.get('data')}"
        if singles and base is not None and max(v.metrics["loss"] for v in singles) > 4 * base.metrics["loss"]:
            ax.set_yscale("log")
    ax.set_xlabel(f"removed layer index (0 to {sweep.n_layers - 1})")
    ax.set_ylabel(f"{sweep.metric} ({'higher' if sweep.higher_is_better else 'lower'} is better)")
    ax.set_title(f"{sweep.run.get('model')}: {task_label}, one layer removed at a time")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return save_figure(fig, path)


def load_prune(folder: Path) -> "Sweep":
    """The sweep saved in a prune results folder (or its prune.json)."""
    from depthcurse.sweep import RESULTS_JSON, Sweep

    folder = Path(folder)
    path = folder if folder.suffix == ".json" else folder / RESULTS_JSON
    if not path.is_file():
        raise DepthcurseError(f"{folder} holds no prune result ({RESULTS_JSON}): give folders that `depthcurse prune` wrote")
    try:
        return Sweep.from_json(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError) as exc:
        raise DepthcurseError(f"{path} is not a depthcurse prune result ({exc})") from exc


def relative_drop_curve(sweep: "Sweep") -> tuple[list[float], list[float]]:
    """(removed layer / number of layers, relative drop in percent, positive = worse) per single-layer variant."""
    singles = sorted((v for v in sweep.variants if len(v.removed) == 1), key=lambda v: v.removed[0])
    return [v.removed[0] / sweep.n_layers for v in singles], [100 * sweep.drop(v)[1] for v in singles]


def plot_prune_overlay(folders: list[Path], path: Path) -> Path:
    """Several sweeps on one figure, comparable across models of any depth (the papers' Figure 2):
    x = removed layer / number of layers, y = relative drop against each model's own baseline,
    signed so that up is worse for every metric (a loss that rises, an accuracy that falls)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not folders:
        raise DepthcurseError("give at least one prune results folder")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
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
        task = sweep.run.get("task", "?")
        ax.plot(xs, ys, marker="o", ms=4, lw=1.5, label=f"{sweep.run.get('model')} ({sweep.n_layers} layers): {task}, {sweep.metric}")
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


def prune_table(sweep: "Sweep") -> Table:
    """The sweep as a rich table; the worst variants are highlighted."""
    rows = prune_rows(sweep)
    title = f"{sweep.run.get('model')} · {sweep.run.get('task')} · {sweep.metric} ({'↑' if sweep.higher_is_better else '↓'} better)"
    table = Table(title=title, header_style="bold")
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


def block_table(sweep: "Sweep", choices) -> Table:
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


# --------------------------------------------------------------------------- angular distances




def write_angular(result, out_dir: Path) -> list[Path]:
    """angular.csv (l, n, distance, count), angular.json (everything) and layers.csv."""
    out_dir = Path(out_dir)
    paths = [out_dir / "angular.csv", out_dir / "angular.json", out_dir / "layers.csv"]
    atomic_write(paths[0], csv_text(result.angular_rows()))
    atomic_write(paths[1], json.dumps(_clean(result.to_json()), indent=2) + "\n")
    atomic_write(paths[2], csv_text(result.layer_rows()))
    return paths


def save_figure(fig, path: Path) -> Path:
    """Render `fig` as PNG, write it atomically (a reader never sees half a file) and free it."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write(Path(path), buf.getvalue())
    return Path(path)


def plot_angular(result, path: Path, *, normalize: bool = True, title: str | None = None) -> Path:
    """Heatmap of d(x_l, x_{l+n}): x = l, y = n; cells with l+n > L masked; l* of each row marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    L, max_n = result.num_layers, result.max_n
    grid = np.array([[np.nan if v is None else v for v in row] for row in result.matrix()], dtype=float)
    shown = grid.copy()
    if normalize:
        for i, row in enumerate(grid):
            lo, hi = np.nanmin(row), np.nanmax(row)
            shown[i] = (row - lo) / (hi - lo) if hi > lo else np.where(np.isnan(row), np.nan, 0.0)
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#e6e6e6")
    fig, ax = plt.subplots(figsize=(max(6.0, 0.28 * L + 3), max(4.5, 0.22 * max_n + 2.5)), dpi=120)
    im = ax.imshow(np.ma.masked_invalid(shown), origin="lower", aspect="auto", cmap=cmap,
                   extent=(-0.5, L - 0.5, 0.5, max_n + 0.5), interpolation="nearest")
    best = result.best_blocks()
    ax.scatter([b["l"] for b in best], [b["n"] for b in best], marker="x", s=18, c="red", lw=1.2, label="l* = argmin over l")
    ax.set_xlabel("l, first block of the pruned run (stream x_l)")
    ax.set_ylabel("n, number of blocks skipped")
    ax.set_xlim(-0.5, L - 0.5)
    ax.set_ylim(0.5, max_n + 0.5)
    run = result.run or {}
    where = "last non-pad token" if result.position == "last" else "all non-pad tokens"
    ax.set_title(title or f"{run.get('model', 'model')}: angular distance d(x_l, x_l+n)\n{where}, {result.samples} samples, data {run.get('data', '?')}", fontsize=10)
    bar = fig.colorbar(im, ax=ax)
    bar.set_label("d, min-max normalised per row (n)" if normalize else "d = arccos(cos)/pi")
    ax.legend(loc="upper right", fontsize=8, framealpha=0.8)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_layers(result, path: Path, *, title: str | None = None) -> Path:
    """Four panels: Block Influence, relative update size, residual norm and variance by depth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L = result.num_layers
    blocks, depths = list(range(L)), list(range(L + 1))
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), dpi=110)
    panels = [
        (axes[0, 0], blocks, result.block_influence, "Block Influence 1 - cos(x_l, x_l+1)", "block l", False),
        (axes[0, 1], blocks, result.relative_update, "relative update |x_l+1 - x_l| / |x_l|", "block l", False),
        (axes[1, 0], depths, result.norm, "mean L2 norm of x_l", "depth l (L = after last block, before final norm)", True),
        (axes[1, 1], depths, result.variance, "mean per-token variance of x_l", "depth l (L = after last block, before final norm)", True),
    ]
    for ax, xs, ys, label, xlabel, log in panels:
        ax.plot(xs, ys, marker="o", ms=3, lw=1.3)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel(xlabel, fontsize=9)
        if log and min(ys) > 0:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    run = result.run or {}
    fig.suptitle(title or f"{run.get('model', 'model')}: per-layer statistics over {result.stat_tokens} tokens ({run.get('data', '?')})", fontsize=11)
    fig.tight_layout()
    return save_figure(fig, path)


def angular_table(result) -> Table:
    """Best block per n: the run of n blocks whose input and output streams are closest."""
    run = result.run or {}
    table = Table(title=f"{run.get('model', 'model')} · most redundant run of n blocks (l* = argmin_l d(x_l, x_l+n))", header_style="bold")
    for col in ("n", "l*", "blocks", "d(x_l*, x_l*+n)"):
        table.add_column(col, justify="right")
    for b in result.best_blocks():
        table.add_row(str(b["n"]), str(b["l"]), b["layers"], f"{b['distance']:.4f}")
    return table
