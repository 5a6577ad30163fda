"""`depthcurse report DIR...`: several results folders of any kind on one Markdown page.

Each folder is read by the module that wrote it: prune sweeps (the paper's Figure 2 across models
on relative depth, and how many single layers each model can lose within 1/5/10%), greedy depth
curves (each strategy's curve, and the units removable within 1/5/10% against the model's depth),
angular-distance results (the heatmap), heal runs, comparisons of methods and healed depth curves
(with a budget's pick and why), self-speculative decoding runs (`speculate`), what a removal buys (`speed`, alone or in a heal run or a `drop`
checkpoint), the checkpoints drop and heal saved (their card's facts), and lns-train runs (the
paper's Table 1). Figures go to a folder beside the page; the page links them by relative path,
so the two move together; a page that fails leaves no folder behind.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from rich.table import Table
from rich.text import Text

from depthcurse.angular import load_angular
from depthcurse.angular.report import plot_angular
from depthcurse.angular.result import ANGULAR_JSON
from depthcurse.depth import agreement_table, depth_table, depth_verdicts, plot_influence, plot_settling
from depthcurse.depth.map_report import MAP_JSON, map_table, map_verdicts, plot_map
from depthcurse.depth.over_seeds import differences_table, map_over_seeds, repeated, seeds_table, seeds_verdicts, use_over_seeds
from depthcurse.depth.report import DEPTH_JSON, depth_overview, read_depth
from depthcurse.errors import DepthcurseError
from depthcurse.heal import HEAL_JSON, curve_table, heal_table, heal_verdicts, methods_table, plot_heal_curve, read_heal
from depthcurse.io import atomic_write, ensure_out_dir, save_figure
from depthcurse.prune.greedy import GREEDY_JSON, THRESHOLDS, DepthCurves, read_curves
from depthcurse.prune.report import curves_data_text, legend_below, load_prune, plot_greedy, plot_prune_overlay
from depthcurse.prune.results import RESULTS_JSON, UNIT_NAMES, Sweep
from depthcurse.card import PROVENANCE, read_card
from depthcurse.select import SELECT_JSON, plot_select, select_table, select_verdicts
from depthcurse.speculate import SPECULATE_JSON, kind_table, read_speculate, speculate_table, speculate_verdicts
from depthcurse.speculate.report import speedup_figure
from depthcurse.speed import SPEED_JSON, read_speed, speed_table
from depthcurse.train import read_run, table1
from depthcurse.train.config import CONFIG

KINDS = ("greedy", "prune", "angular", "heal", "select", "speculate", "depth", "map", "speed", "checkpoint", "train")


def kind_of(folder: Path) -> str:
    """Which result a folder holds, or one clear error."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DepthcurseError(f"{folder} is not a folder: give results folders that depthcurse wrote")
    # a checkpoint drop or heal made holds a transformers config.json too: its card comes before a training run's config
    for kind, marker in (("greedy", GREEDY_JSON), ("prune", RESULTS_JSON), ("angular", ANGULAR_JSON), ("heal", HEAL_JSON), ("select", SELECT_JSON),
                         ("speculate", SPECULATE_JSON), ("depth", DEPTH_JSON), ("map", MAP_JSON), ("speed", SPEED_JSON), ("checkpoint", PROVENANCE), ("train", CONFIG)):
        if (folder / marker).is_file() and (kind != "train" or "norm" in json.loads((folder / marker).read_text())):
            return kind
    raise DepthcurseError(f"{folder} holds no depthcurse result ({GREEDY_JSON}, {RESULTS_JSON}, {ANGULAR_JSON}, {HEAL_JSON}, {SELECT_JSON}, {SPECULATE_JSON}, {DEPTH_JSON}, {MAP_JSON}, {SPEED_JSON}, "
                          f"a checkpoint's {PROVENANCE}, or an lns-train run's {CONFIG})")


def markdown_table(table: Table) -> str:
    """A rich table as a Markdown table (markup dropped), its title above and its caption below."""
    def plain(cell) -> str:
        return (Text.from_markup(cell).plain if isinstance(cell, str) else str(cell)).replace("|", "\\|").replace("\n", " ")

    headers = [plain(c.header) for c in table.columns]
    columns = [[plain(cell) for cell in c._cells] for c in table.columns]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in zip(*columns)]
    title = f"*{plain(table.title)}*\n\n" if table.title else ""
    caption = f"\n\n{plain(table.caption)}" if table.caption else ""  # what was measured, on what: as the screen shows it
    return title + "\n".join(lines) + caption


def _bullets(lines: list[str]) -> list[str]:
    """Verdict lines after a table, as one Markdown list (none: nothing)."""
    return ["\n".join(f"- {line}" for line in lines)] if lines else []


def _rows(headers: list[str], rows: list[list]) -> str:
    table = Table(*headers)
    for row in rows:
        table.add_row(*map(str, row))
    return markdown_table(table)


def _singles_within(sweep: Sweep, threshold: float) -> str:
    """Single units whose removal costs at most `threshold`, out of those measured: `3 of 7` when
    the sweep measured 7 of the model's units (a --layers subset, or an interrupted sweep)."""
    singles = sweep.single_removals
    within = sum(1 for v in singles if sweep.drop(v)[1] <= threshold)  # NaN is never within
    return str(within) if len(singles) == sweep.n_layers else f"{within} of {len(singles)} measured"


def _is_block(sweep: Sweep) -> bool:
    return "block" in sweep.run


def _prune_section(folders: list[Path], figures: Path) -> str:
    sweeps = [load_prune(f) for f in folders]
    singles = [(f, s) for f, s in zip(folders, sweeps) if not _is_block(s)]
    blocks = [(f, s) for f, s in zip(folders, sweeps) if _is_block(s)]
    parts = []
    if singles:
        overlay = plot_prune_overlay([f for f, _ in singles], figures / "prune_relative_depth.png")
        rows = []
        for folder, s in singles:
            base = s.baseline
            rows.append([s.run.get("model"), s.n_layers, s.unit, s.run.get("task"), s.data_text(), s.metric,
                         f"{base.metrics[s.metric]:.4g}" if base else "-", *(_singles_within(s, t) for t in THRESHOLDS), s.status_text(), folder])
        headers = ["model", "layers", "unit removed", "task", "data", "metric", "unpruned", *(f"single units within {t:.0%}" for t in THRESHOLDS), "result", "folder"]
        parts += [
            "## Prune sweeps: one unit removed at a time",
            f"![relative drop against relative depth]({figures.name}/{overlay.name})",
            "Each curve: the relative drop (up is worse for every metric) when the unit at that relative depth is removed, against each model's own unpruned score.",
            _rows(headers, rows),
        ]
    if blocks:
        parts += ["## Blocks of contiguous layers removed (prune --block)",
                  "The block angular distance picks (Gromov et al.) against the same number of deepest layers before the final one.",
                  _rows(["model", "layers", "task", "data", "n", "rule", "layers removed", "metric", "unpruned", "removed", "rel. drop", "result", "folder"],
                        [row for folder, s in blocks for row in _block_rows(s, folder)])]
    return "\n\n".join(parts)


def _block_rows(sweep: Sweep, folder: Path) -> list[list]:
    base = sweep.baseline
    by_removed = {tuple(v.removed): v for v in sweep.variants}
    rows = []
    for rule, layers in ((r, l) for r, l in sweep.run["block"].items() if r != "n"):
        v = by_removed.get(tuple(layers))
        value, rel = ("not run", "") if v is None else (f"{v.metrics[sweep.metric]:.4g}", f"{sweep.drop(v)[1]:+.1%}")
        label = f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else str(layers[0])
        rows.append([sweep.run.get("model"), sweep.n_layers, sweep.run.get("task"), sweep.data_text(), sweep.run["block"]["n"], rule, label, sweep.metric,
                     f"{base.metrics[sweep.metric]:.4g}" if base else "-", value, rel, sweep.status_text(), folder])
    return rows


def _greedy_section(folders: list[Path], figures: Path) -> str:
    results = [read_curves(f) for f in folders]
    parts = ["## Greedy depth curves: how much depth can go"]
    rows = []
    for i, (folder, r) in enumerate(zip(folders, results)):
        figure = plot_greedy(r, figures / f"greedy_{i}.png")
        parts.append(f"### {r.run.get('model')} · {UNIT_NAMES[r.granularity]} · {curves_data_text(r)}\n\n![greedy curves]({figures.name}/{figure.name})")
        for name in r.curves:
            rows.append([r.run.get("model"), r.n_units, UNIT_NAMES[r.granularity], curves_data_text(r), name, *(r.within_text(name, t) for t in THRESHOLDS), folder])
    parts.append(_rows(["model", "units", "unit removed", "measured on", "strategy", *(f"removable within {t:.0%}" for t in THRESHOLDS), "folder"], rows))
    parts.append(f"![removable depth against model depth]({figures.name}/{_plot_removable(results, figures / 'removable_by_depth.png').name})")
    return "\n\n".join(parts)


def _plot_removable(results: list[DepthCurves], path: Path) -> Path:
    """Per model (x: its number of units), the fraction of units the greedy search removes within 1/5/10%."""
    import matplotlib  # lazy: only figures need matplotlib (1 s to import)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for t, marker in zip(THRESHOLDS, "os^"):
        ax.scatter([r.n_units for r in results], [r.units_within("greedy", t) / r.n_units for r in results], marker=marker, label=f"within {t:.0%}")
    for r in results:
        last = THRESHOLDS[-1]  # "≥": the curve stopped before passing it, so more might go
        ax.annotate(f"{r.run.get('model')} ({r.granularity}) {r.within_text('greedy', last)}", (r.n_units, r.units_within("greedy", last) / r.n_units), fontsize=7)
    ax.set_xlabel("units in the model")
    ax.set_ylabel("fraction removable (greedy)")
    ax.set_title("depth the greedy search removes before the drop passes each threshold", fontsize=10)
    ax.grid(alpha=0.3)
    legend_below(fig, ax)
    return save_figure(fig, path)


def _angular_section(folders: list[Path], figures: Path) -> str:
    parts = ["## Angular distance between layer representations"]
    for i, folder in enumerate(folders):
        result = load_angular(folder)
        figure = plot_angular(result, figures / f"angular_{i}.png", title=f"{result.run.get('model')}: angular distance")
        parts.append(f"### {result.run.get('model')} ({folder})\n\n![angular distance]({figures.name}/{figure.name})")
    return "\n\n".join(parts)


def _heal_section(folders: list[Path], figures: Path) -> str:
    parts = ["## Healing: what a removal's cost is won back by, and at what cost"]
    for i, folder in enumerate(folders):
        record = read_heal(folder)
        if "points" in record:  # a healed depth curve
            if not record["points"]:
                parts.append(f"### {folder}: no point healed yet")
                continue
            figure = plot_heal_curve(record, figures / f"heal_{i}.png")
            parts += [f"### {record['run']['model']} · healed depth curve · {folder}", f"![healed depth curve]({figures.name}/{figure.name})",
                      markdown_table(curve_table(record))]
            if "budget" in record:
                budget = record["budget"]
                parts.append(f"**Within {budget['max_drop']:.1%} of the unpruned model's {budget['measure']}** (at most {budget['limit']:.4f}): "
                             f"k = {budget['chosen']} chosen. {budget['why']}. Probed: "
                             + ", ".join(f"k = {p['k']} ({p['healed_loss']:.4f}, {'within' if p['within'] else 'over'})" for p in budget["probes"]) + ".")
        elif "methods" in record:  # several methods on one removal
            able = [m for m in record["run"]["methods"] if m not in (record.get("refused") or {})]
            done = [m for m in able if m in record["methods"]]
            status = "" if len(done) == len(able) else f" · {len(done)} of {len(able)} methods finished"
            parts += [f"### {record['run']['model']} · methods compared · {folder}{status}", markdown_table(methods_table(record)), *_bullets(heal_verdicts(record))]
        elif "recovered" in record:
            parts += [f"### {record['run']['model']} · {folder}", markdown_table(heal_table(record)), *_bullets(heal_verdicts(record))]
            if (folder / SPEED_JSON).is_file():
                parts.append(markdown_table(speed_table(read_speed(folder))))
        else:
            parts.append(f"### {folder}: not finished (rerun its heal command to finish)")
    return "\n\n".join(parts)


def _select_section(folders: list[Path], figures: Path) -> str:
    parts = ["## Calibration against search: which layers each choice removes, judged on the same held-out text"]
    for i, folder in enumerate(folders):
        record = json.loads((folder / SELECT_JSON).read_text())
        figure = plot_select(record, figures / f"select_{i}.png")
        parts += [f"### {record['run'].get('model')} · k = {record['run']['k']} · {folder}", markdown_table(select_table(record)),
                  *_bullets(select_verdicts(record)), f"![overlap and held-out scores]({figures.name}/{figure.name})"]
    return "\n\n".join(parts)


def _speculate_section(folders: list[Path], figures: Path) -> str:
    parts = ["## Drafting with the model's own depth: speculative decoding against decoding alone"]
    for i, folder in enumerate(folders):
        record = read_speculate(folder)
        figure = save_figure(speedup_figure(record), figures / f"speculate_{i}.png")
        parts += [f"### {record['run'].get('model')} · {folder}", markdown_table(speculate_table(record)), markdown_table(kind_table(record)),
                  *_bullets(speculate_verdicts(record)), f"![measured and expected speedup]({figures.name}/{figure.name})"]
    return "\n\n".join(parts)


def _depth_section(folders: list[Path], figures: Path) -> str:
    """Several depth-use runs side by side (one row each), then each run's table and figures."""
    records = [read_depth(folder / DEPTH_JSON) for folder in folders]
    parts = ["## How each model uses its depth (depth-use)", markdown_table(depth_overview(records, [str(f) for f in folders]))]
    parts += _over_seeds(use_over_seeds(records, [str(f) for f in folders]), "depth-use")
    for i, (folder, record) in enumerate(zip(folders, records)):
        parts += [f"### {record['run'].get('model')} · {folder}", markdown_table(depth_table(record)), *_bullets(depth_verdicts(record))]
        if record.get("agreement"):
            parts.append(markdown_table(agreement_table(record)))
        settling = plot_settling(record, figures / f"depth_settling_{i}.png")
        parts.append(f"![where the prediction settles]({figures.name}/{settling.name})")
        influence = plot_influence(record, figures / f"depth_influence_{i}.png")
        if influence is not None:
            parts.append(f"![whose later work each layer changes]({figures.name}/{influence.name})")
    return "\n\n".join(parts)


def _over_seeds(summary: dict, what: str) -> list[str]:
    """Where some architecture was measured from several seeds: the means over seeds, each other
    architecture against the first, and the verdicts; nothing otherwise."""
    if not repeated(summary):
        return []
    parts = [markdown_table(seeds_table(summary, what))]
    if len(summary["groups"]) > 1:
        parts += [markdown_table(differences_table(summary)), *_bullets(seeds_verdicts(summary))]
    return parts


def _map_section(folders: list[Path], figures: Path) -> str:
    """Depth maps: over seeds where a pair of architectures was mapped more than once, then each map."""
    records = [json.loads((folder / MAP_JSON).read_text()) for folder in folders]
    parts = ["## The depth map: which layers of a deeper model each shallow layer's stream maps to (depth-map)"]
    parts += _over_seeds(map_over_seeds(records, [str(f) for f in folders]), "depth-map")
    for i, (folder, record) in enumerate(zip(folders, records)):
        figure = plot_map(record, figures / f"depth_map_{i}.png")
        parts += [f"### {record['run']['shallow']['model']} -> {record['run']['deep']['model']} · {folder}", markdown_table(map_table(record)),
                  *_bullets(map_verdicts(record)), f"![the depth map]({figures.name}/{figure.name})"]
    return "\n\n".join(parts)


def _speed_section(folders: list[Path]) -> str:
    parts = ["## What a removal buys: speed and memory, pruned against unpruned"]
    for folder in folders:
        record = read_speed(folder)
        parts += [f"### {record['run'].get('pruned', folder)} · {folder}", markdown_table(speed_table(record))]
    return "\n\n".join(parts)


def _checkpoint_section(folders: list[Path]) -> str:
    """Checkpoints drop or heal saved: what was removed (in the first model's numbering), how it was
    healed, and what its card holds of the measurements."""
    parts = ["## Checkpoints made by depthcurse"]
    for folder in folders:
        record = read_card(folder)
        root = record.get("root") or record
        healing = record.get("healing") or {}
        parts.append(f"### {record.get('base_model') or root['model']} without layers {','.join(map(str, root['removed_layers']))} · {folder}\n\n"
                     f"{record['layers_left']} of {root['n_layers']} layers left; made by `{record['made_by']}`"
                     + (f", healed by {healing.get('title') or healing.get('method')}: {healing.get('how', '')}" if healing else "")
                     + f". Why these layers: {record['why']}.")
        if record.get("measured"):
            parts.append(_rows(list(record["measured"][0]), [list(r) for r in record["measured"][1:]]))
        if record.get("speed"):
            parts.append(_rows(list(record["speed"][0]), [list(r) for r in record["speed"][1:]]))
    return "\n\n".join(parts)


def _train_section(folders: list[Path]) -> str:
    return "\n\n".join(["## Training runs: the paper's Table 1 layout", markdown_table(table1([read_run(f) for f in folders]))])


RECORDS = (RESULTS_JSON, GREEDY_JSON, ANGULAR_JSON, HEAL_JSON, SELECT_JSON, SPECULATE_JSON, DEPTH_JSON, MAP_JSON, SPEED_JSON, "summary.json")


def made_with(folder: Path) -> dict | None:
    """The environment a folder's record keeps (`io.environment`: the command, the commit, the versions,
    the CPU or GPUs), wherever its kind keeps it; None for a record from before it was kept."""
    def found(value):
        if isinstance(value, dict):
            if isinstance(value.get("environment"), dict):
                return value["environment"]
            for inner in value.values():
                hit = found(inner)
                if hit is not None:
                    return hit
        return None

    for name in RECORDS:
        path = folder / name if folder.is_dir() else folder
        if path.is_file() and path.suffix == ".json":
            try:
                hit = found(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue
            if hit is not None:
                return hit
    return None


def _made_section(folders: list[Path]) -> str:
    """How each result was made, so that a reader can rerun it: the command as typed, the code's commit
    (and whether the tree had changes), the versions that decide the figures, and the machine."""
    rows = []
    for folder in folders:
        env = made_with(folder)
        if env is None:
            rows.append([f"`{folder}`", "(not kept: a record from before issue 90)", "", "", ""])
            continue
        versions = env.get("packages", {})
        commit = env.get("commit")
        code = f"{versions.get('depthcurse')}" + (f", {commit[:12]}" + (" with changes" if env.get("dirty") else "") if commit else "")
        rows.append([f"`{folder}`", f"`{env.get('command', '-')}`", code,
                     ", ".join(f"{n} {versions.get(n)}" for n in ("torch", "transformers", "lm_eval", "peft") if versions.get(n)),
                     ", ".join(env.get("gpus") or []) or env.get("cpu", "-")])
    return "## How each was made\n\n" + _rows(["folder", "command", "depthcurse (commit)", "versions", "machine"], rows)


def write_report(folders: list[Path], out: Path) -> Path:
    """The page for `folders` at `out` (Markdown), its figures in `<out stem>_figures/`."""
    if not folders:
        raise DepthcurseError("give at least one results folder")
    by_kind: dict[str, list[Path]] = {k: [] for k in KINDS}
    for folder in map(Path, folders):
        by_kind[kind_of(folder)].append(folder)
    out = Path(out)
    if out.suffix.lower() != ".md":
        raise DepthcurseError(f"--out {out}: the report is a Markdown page, give a .md path")
    ensure_out_dir(out.parent, what="the folder of --out")
    figures = out.parent / f"{out.stem}_figures"
    shutil.rmtree(figures, ignore_errors=True)  # figures of an earlier page: replaced, never mixed
    figures.mkdir()
    try:
        sections = ["# depthcurse report", "Folders: " + ", ".join(f"`{f}` ({kind_of(f)})" for f in map(Path, folders))]
        if by_kind["prune"]:
            sections.append(_prune_section(by_kind["prune"], figures))
        if by_kind["greedy"]:
            sections.append(_greedy_section(by_kind["greedy"], figures))
        if by_kind["angular"]:
            sections.append(_angular_section(by_kind["angular"], figures))
        if by_kind["heal"]:
            sections.append(_heal_section(by_kind["heal"], figures))
        if by_kind["select"]:
            sections.append(_select_section(by_kind["select"], figures))
        if by_kind["speculate"]:
            sections.append(_speculate_section(by_kind["speculate"], figures))
        if by_kind["depth"]:
            sections.append(_depth_section(by_kind["depth"], figures))
        if by_kind["map"]:
            sections.append(_map_section(by_kind["map"], figures))
        if by_kind["speed"]:
            sections.append(_speed_section(by_kind["speed"]))
        if by_kind["checkpoint"]:
            sections.append(_checkpoint_section(by_kind["checkpoint"]))
        if by_kind["train"]:
            sections.append(_train_section(by_kind["train"]))
        sections.append(_made_section(list(map(Path, folders))))
    except BaseException:
        shutil.rmtree(figures, ignore_errors=True)  # a page that failed leaves no figures folder behind
        raise
    if not any(figures.iterdir()):
        figures.rmdir()
    return atomic_write(out, "\n\n".join(sections) + "\n")
