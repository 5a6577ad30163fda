"""Training results on disk and on screen: loss curves, and runs side by side in the layout of
the Curse of Depth paper's Table 1 (one row per method, one perplexity column per size)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from rich.table import Table

from depthcurse.errors import DepthcurseError
from depthcurse.io import atomic_write, csv_text, save_figure
from depthcurse.train.config import CONFIG, RESUMABLE_CHANGES
from depthcurse.train.metrics import METRICS, SUMMARY, MetricsLog
from depthcurse.train.norms import REGISTRY, Normalisation

# Table 1's row order (the paper's, then the newer fixes); each variant's name is its module's title.
TABLE1_ORDER = ("post", "deepnorm", "mix", "pre", "lns", "layerscale", "skipinit", "depth-scaled-init", "scaled-init", "lns+scaled-init",
                "sandwich", "dyt", "hybridnorm", "hybridnorm-star", "completep")
METHOD_NAMES = {name: REGISTRY[name].title for name in (*TABLE1_ORDER, *(n for n in REGISTRY if n not in TABLE1_ORDER))}
SIZE_ORDER = ("tiny", "130m", "250m", "350m", "1b")


def _split(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    train = [r for r in rows if r.get("loss") is not None]
    val = [r for r in rows if r.get("val_loss") is not None]
    return train, val


def plot_loss(rows: list[dict], path: Path, title: str = "") -> Path:
    return plot_runs({"": rows}, path, title=title)


def plot_runs(runs: dict[str, list[dict]], path: Path, title: str = "") -> Path:
    """Training loss (lines) and validation loss (dots) against step, one colour per run."""
    import matplotlib  # lazy: only figures need matplotlib (1 s to import)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    for i, (label, rows) in enumerate(runs.items()):
        train, val = _split(rows)
        colour = f"C{i}"
        if train:
            ax.plot([r["step"] for r in train], [r["loss"] for r in train], color=colour, lw=1, alpha=0.8, label=f"{label} train".strip())
        if val:
            ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], color=colour, marker="o", ms=4, ls="--",
                    label=f"{label} validation ({val[-1]['val_loss']:.3f})".strip())
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # runs with nothing logged yet draw no line
        ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)


LAYER_PANELS = (("layer_grad_norm", "gradient norm of block l", True), ("layer_variance", "residual variance at the input of block l", True),
                ("identity_distance", "identity distance E|Jv - v| / |v| of block l", True))


def _layer_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if any(r.get(key) for key, _, _ in LAYER_PANELS)]


def plot_layers(runs: dict[str, list[dict]], path: Path, title: str = "") -> Path | None:
    """Per-layer metrics against depth. One run: a line per evaluation step, coloured from early
    (light) to late (dark). Several runs: each run's last evaluation, one colour per run.
    None when no run logged any (runs made before these metrics, or with them off)."""
    runs = {label: _layer_rows(rows) for label, rows in runs.items()}
    runs = {label: rows for label, rows in runs.items() if rows}
    if not runs:
        return None
    import matplotlib  # lazy: only figures need matplotlib (1 s to import)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(LAYER_PANELS), figsize=(5 * len(LAYER_PANELS), 4.2), dpi=110)
    over_time = len(runs) == 1
    for ax, (key, label, log) in zip(axes, LAYER_PANELS):
        for i, (name, rows) in enumerate(runs.items()):
            shown = rows if over_time else rows[-1:]
            for j, row in enumerate(shown):
                values = row.get(key)
                if not values:
                    continue
                if over_time:
                    colour = plt.get_cmap("viridis")(0.9 - 0.8 * j / max(1, len(shown) - 1))
                    ax.plot(range(len(values)), values, color=colour, marker="o", ms=2.5, lw=1, label=f"step {row['step']}")
                else:
                    ax.plot(range(len(values)), values, color=f"C{i}", marker="o", ms=3, lw=1.3, label=f"{name} (step {row['step']})".strip())
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("block l")
        if log and all(v > 0 for line in ax.get_lines() for v in line.get_ydata()) and ax.get_lines():
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        keep = range(len(handles)) if len(handles) <= 8 else sorted({0, len(handles) - 1, *range(0, len(handles), max(1, len(handles) // 6))})
        axes[0].legend([handles[k] for k in keep], [labels[k] for k in keep], fontsize=7)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return save_figure(fig, path)


def read_run(folder: Path) -> dict:
    """A run folder's configuration, metrics and (if finished) summary."""
    folder = Path(folder)
    cfg_path = folder / CONFIG
    if not cfg_path.is_file():
        raise DepthcurseError(f"{folder} is not an lns-train run folder (no config.json)")
    config = json.loads(cfg_path.read_text())
    rows = MetricsLog(folder / METRICS).rows()
    summary_path = folder / SUMMARY
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    _, val = _split(rows)
    last_val = val[-1] if val else {}
    return {
        "folder": str(folder), "norm": config["norm"], "preset": config["preset"], "config": config, "metrics": rows,
        "init": config.get("init", "common"),  # a run from before --init drew LLaMA's init for every variant
        "finished": bool(summary and summary.get("finished")),
        "step": (summary or {}).get("step", rows[-1]["step"] if rows else 0),
        "val_loss": (summary or last_val).get("val_loss"), "val_ppl": (summary or last_val).get("val_ppl"),
    }


def method_label(norm: str, init: str) -> str:
    """A variant's name in a table, with its init where its authors' differs from LLaMA's (the
    two are different runs of one norm: `--init authors` and `--init common`)."""
    name = METHOD_NAMES.get(norm, norm)
    own = REGISTRY.get(norm)
    return f"{name} ({init} init)" if own is not None and type(own).authors_init is not Normalisation.authors_init else name


def compare_rows(runs: list[dict]) -> list[dict]:
    return [{"method": method_label(r["norm"], r["init"]), "norm": r["norm"], "init": r["init"], "preset": r["preset"], "steps": r["step"],
             "finished": r["finished"], "val_loss": r["val_loss"], "val_ppl": r["val_ppl"], "folder": r["folder"]} for r in runs]


def table1(runs: list[dict]) -> Table:
    """Perplexity per method (rows) and size (columns), as in the paper's Table 1. Every run gets
    a cell: a method with several runs of one size (other seeds, tokenizers...) gets a row per
    run, named by its folder."""
    sizes = [s for s in SIZE_ORDER if any(r["preset"] == s for r in runs)]
    table = Table(title="validation perplexity (lower is better); * = run not finished", header_style="bold")
    table.add_column("method")
    for s in sizes:
        table.add_column(s.upper() if s != "tiny" else "tiny", justify="right")
    order = list(METHOD_NAMES)
    for norm, init in sorted({(r["norm"], r["init"]) for r in runs}, key=lambda k: (order.index(k[0]) if k[0] in order else len(order), k[1])):
        mine = [r for r in runs if (r["norm"], r["init"]) == (norm, init)]
        name = method_label(norm, init)
        if max(sum(r["preset"] == s for r in mine) for s in sizes) == 1:
            table.add_row(name, *(_cell(next((r for r in mine if r["preset"] == s), None)) for s in sizes))
            continue
        for r in mine:
            table.add_row(f"{name} · {Path(r['folder']).name}", *(_cell(r) if r["preset"] == s else "" for s in sizes))
    return table


def _cell(run: dict | None) -> str:
    if run is None:
        return ""
    ppl = run["val_ppl"]
    text = "-" if ppl is None or not math.isfinite(ppl) else f"{ppl:.2f}"
    return text + ("" if run["finished"] else "*")


def seed_groups(runs: list[dict]) -> list[dict]:
    """Finished runs that differ only in --seed, grouped: their validation loss's mean, sample
    standard deviation and range, and the perplexity of the mean loss."""
    groups: dict[str, list[dict]] = {}
    for r in runs:
        if r["finished"] and r["val_loss"] is not None:
            same = {k: v for k, v in r["config"].items() if k != "seed" and k not in RESUMABLE_CHANGES}
            groups.setdefault(json.dumps(same, sort_keys=True, default=str), []).append(r)
    out = []
    for members in groups.values():
        seeds = sorted({m["config"]["seed"] for m in members})
        if len(seeds) < 2:
            continue
        losses = [m["val_loss"] for m in members]
        mean = sum(losses) / len(losses)
        sd = math.sqrt(sum((x - mean) ** 2 for x in losses) / (len(losses) - 1))
        first = members[0]
        out.append({"method": method_label(first["norm"], first["init"]), "norm": first["norm"], "init": first["init"], "preset": first["preset"],
                    "seeds": seeds, "runs": len(members), "val_loss_mean": mean, "val_loss_sd": sd,
                    "val_loss_min": min(losses), "val_loss_max": max(losses), "val_ppl_of_mean": math.exp(min(mean, 700.0))})
    return out


def seeds_table(groups: list[dict]) -> Table:
    table = Table(title="over seeds: validation loss, mean ± sample sd (range)", header_style="bold")
    for col, justify in (("method", "left"), ("size", "left"), ("seeds", "left"), ("loss", "right"), ("range", "right"), ("ppl of mean", "right")):
        table.add_column(col, justify=justify)
    for g in groups:
        table.add_row(g["method"], g["preset"], ", ".join(map(str, g["seeds"])), f"{g['val_loss_mean']:.4f} ± {g['val_loss_sd']:.4f}",
                      f"{g['val_loss_min']:.4f}-{g['val_loss_max']:.4f}", f"{g['val_ppl_of_mean']:.2f}")
    return table


# Settings that must agree for two runs' validation perplexities to be comparable at all.
COMPARABLE_SETTINGS = ("tokenizer", "data", "seq_len", "pack", "val_tokens")


def incomparable(runs: list[dict]) -> list[str]:
    """For each size, the settings that differ between its runs and make their perplexities
    incomparable (another tokenizer measures per-token loss over other tokens), in words."""
    out = []
    for size in dict.fromkeys(r["preset"] for r in runs):
        same_size = [r for r in runs if r["preset"] == size]
        for key in COMPARABLE_SETTINGS:
            values = list(dict.fromkeys(str(r["config"].get(key)) for r in same_size))
            if len(values) > 1:
                out.append(f"the {size} runs differ in {key} ({' / '.join(values)}): their perplexities cannot be compared")
    return out


def write_compare(runs: list[dict], out_dir: Path) -> list[Path]:
    rows = compare_rows(runs)
    atomic_write(out_dir / "compare.csv", csv_text(rows, digits=None))
    atomic_write(out_dir / "compare.json", json.dumps(rows, indent=2) + "\n")
    labels = {}
    for r in runs:
        label = f"{r['preset']} {r['norm']}"
        labels[label if label not in labels else f"{label} ({Path(r['folder']).name})"] = r["metrics"]
    png = plot_runs(labels, out_dir / "compare.png", title="training runs compared")
    layers = plot_layers(labels, out_dir / "layers.png", title="per-layer metrics at each run's last evaluation")
    paths = [out_dir / "compare.csv", out_dir / "compare.json", png, *([layers] if layers else [])]
    groups = seed_groups(runs)
    if groups:
        atomic_write(out_dir / "seeds.csv", csv_text([{**g, "seeds": " ".join(map(str, g["seeds"]))} for g in groups], digits=None))
        paths.append(out_dir / "seeds.csv")
    return paths
