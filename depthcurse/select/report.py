"""`select`'s results as a table, a CSV and a figure: each cell's choice, judged on the same held-out
measurements, the overlap of the choices, and the decomposition of the held-out scores."""

from __future__ import annotations

import csv
import math
from pathlib import Path

from rich.table import Table

from depthcurse.io import atomic_write, save_figure
from depthcurse.select.search import canonical, parse_key
from depthcurse.select.stability import verdict, words
from depthcurse.select.statistics import HELD_OUT_METRICS
from depthcurse.select.statistics import key as _key
from depthcurse.stats.intervals import difference_interval, skew_warning


OBJECTIVE_WORDS = ("ppl: mean next-token loss; kl: mean KL from the unpruned model; acceptance: the rejection, 1 - top-1 agreement with the "
                   "unpruned model; speedup: the expected time per token of self-speculative decoding against decoding alone")
OBJECTIVE_AXIS = {"ppl": "mean loss", "kl": "mean KL from the unpruned model", "acceptance": "rejection: 1 - top-1 agreement",
                  "speedup": "expected time per token, speculative / alone"}


def judged(record: dict) -> list[tuple[str, str, str]]:
    """(column name, where, metric) of every held-out measurement: each text's loss, KL and rejection
    (1 - top-1 agreement; runs made before it was measured have none), the task."""
    out = [(f"{record.get('labels', {}).get(s, s)} {m}", s, m) for s in record["run"]["calibration"] for m in HELD_OUT_METRICS
           if m in record["held_out"].get(s, {}).get("", {"loss": 0, "kl": 0})]
    if record.get("task"):
        out.append((f"{record['run']['task']} {record['task'][''].get('metric')}", "task", ""))
    return out


def cell_scores(record: dict, name: str) -> dict[str, tuple[float, list[float] | None]]:
    """A cell's chosen set on each held-out measurement: its mean and the 95% interval of its
    difference from the unpruned model's (paired windows or questions), put around its mean."""
    layers = _key(record["cells"][name]["layers"])
    out = {}
    for column, where, metric in judged(record):
        if where == "task":
            task = record["task"]
            # a suite's tasks each weigh the same in its headline, and in its interval (a record made before the groups were kept: one pool)
            mine, base = task[layers].get("groups") or [task[layers]["items"]], task[""].get("groups") or [task[""]["items"]]
            value, base_mean = task[layers]["value"], task[""]["value"]
        else:
            mine, base = [record["held_out"][where][layers][metric]], [record["held_out"][where][""][metric]]
            value, base_mean = sum(mine[0]) / len(mine[0]), sum(base[0]) / len(base[0]) if base[0] else float("nan")
        paired = [len(m) for m in mine] == [len(b) for b in base] and all(len(m) > 1 for m in mine)
        low_high = difference_interval(value, base_mean, {"chosen": mine, "unpruned": base}, "chosen", "unpruned") if paired else None
        out[column] = (value, [base_mean + low_high[0], base_mean + low_high[1]] if low_high else None)
    return out


def select_rows(record: dict) -> list[list[str]]:
    header = ["chosen on", "by", "objective", f"layers removed (k = {record['run']['k']})", *(c for c, _, _ in judged(record))]
    rows = [header, ["unpruned", "", "", "none", *(_cell(_unpruned(record, where, metric)) for _, where, metric in judged(record))]]
    for name, cell in record["cells"].items():
        scores = cell_scores(record, name)
        rows.append([cell["calibration_label"], cell["search"], cell["objective"], _key(cell["layers"]),
                     *(_cell(v) + (f" [{lh[0]:.4g}, {lh[1]:.4g}]" if lh else "") for v, lh in (scores[c] for c, _, _ in judged(record)))])
    return rows


def _unpruned(record, where, metric):
    if where == "task":
        return record["task"][""]["value"]
    items = record["held_out"][where][""][metric]
    return sum(items) / len(items)


def _cell(value) -> str:
    return "-" if value is None or (isinstance(value, float) and not math.isfinite(value)) else f"{value:.4g}"


def select_table(record: dict) -> Table:
    run = record["run"]
    kinds = record.get("kinds") or {}
    texts = ", ".join(f"{record.get('labels', {}).get(s, s)} ({kinds[s]})" if s in kinds else record.get("labels", {}).get(s, s) for s in run["calibration"])
    held = record.get("held_out_from", "other windows of the same documents")
    caption = (f"texts: {texts}; each choice judged on held-out windows ({run['eval_windows']} x {run['seq_len']} tokens of each text, never chosen on: {held})"
               + (f" and on {run['task']} (--limit {run['limit']})" if run.get("task") else "")
               + "; in brackets the 95% interval (Student's t) of the difference from the unpruned model over the paired windows or questions, put around the score")
    return _table(f"{run['model']}: which {run['k']} units each calibration and search removes, judged on the same held-out text", caption,
                  select_rows(record), left=4)


def _table(title: str, caption: str, rows: list[list[str]], left: int) -> Table:
    """A table of `rows` (the first the header), its first `left` columns left-aligned."""
    table = Table(title=title, caption=caption, header_style="bold")
    header, *body = rows
    for i, name in enumerate(header):
        table.add_column(name, justify="left" if i < left else "right")
    for row in body:
        table.add_row(*row)
    return table


def select_verdicts(record: dict) -> list[str]:
    """What the grid says, a line each after its table: how much the choices overlap, and per
    held-out measurement which factor its spread goes with (or that it cannot tell)."""
    over, dec = record.get("overlap") or {}, record.get("decomposition") or {}
    lines = []
    if over.get("same_calibration_mean") is not None:
        lines.append(f"overlap of the choices (mean Jaccard): the same text by different searches {over['same_calibration_mean']:.2f} "
                     f"({over['same_calibration_pairs']} pairs)" + (f"; the same search on different texts {over['same_search_mean']:.2f} "
                                                                    f"({over['same_search_pairs']} pairs)" if over.get("same_search_mean") is not None else ""))
    lines += distance_verdicts(record) + skew_verdicts(record)
    if "why_not" in dec:
        return lines + [f"no decomposition: {dec['why_not']}"]
    for name, d in dec.items():
        iv = d["intervals"]
        share = lambda k: f"{d['shares'][k]:.0%}" + (f" [{iv[k][0]:.0%}, {iv[k][1]:.0%}]" if iv.get(k) else "")  # noqa: E731
        lines.append(f"{name}: spread with the calibration {share('calibration')}, with the search {share('search')}, the rest {share('rest')} "
                     f"(share of the sum of squares, 95% paired bootstrap over {d.get('items', '?')} items): {_decided(d['decided_by'])}")
    return lines


def skew_verdicts(record: dict) -> list[str]:
    """Where a pick's paired held-out differences from the unpruned model are skewed enough that
    their interval may under-cover, a line each (the distinct picks, each measurement)."""
    lines = []
    for source, held in (record.get("held_out") or {}).items():
        base = held.get("", {})
        for removal in sorted(k for k in held if k):
            for metric in HELD_OUT_METRICS:
                if metric in held[removal] and metric in base and len(held[removal][metric]) == len(base[metric]):
                    line = skew_warning([a - b for a, b in zip(held[removal][metric], base[metric])],
                                        f"without {removal}, {record.get('labels', {}).get(source, source)} held-out {metric}")
                    if line:
                        lines.append(line)
    return lines


def _decided(verdict: str) -> str:
    return f"decided by the {verdict}" if verdict in ("calibration", "search") else verdict


def write_csv(record: dict, path: Path) -> Path:
    def write(tmp: Path) -> None:
        with open(tmp, "w", newline="") as f:
            writer = csv.writer(f)
            header = ["chosen_on", "search", "objective", "k", "layers_removed"]
            cols = judged(record)
            writer.writerow(header + [f"{c} (held out)" for c, _, _ in cols] + [f"{c} 95% low" for c, _, _ in cols] + [f"{c} 95% high" for c, _, _ in cols])
            for name, cell in record["cells"].items():
                scores = cell_scores(record, name)
                values = [scores[c][0] for c, _, _ in cols]
                lows = [scores[c][1][0] if scores[c][1] else "" for c, _, _ in cols]
                highs = [scores[c][1][1] if scores[c][1] else "" for c, _, _ in cols]
                writer.writerow([cell["calibration_label"], cell["search"], cell["objective"], record["run"]["k"], _key(cell["layers"]), *values, *lows, *highs])

    return atomic_write(path, write)


def plot_select(record: dict, path: Path) -> Path:
    """Left: the Jaccard overlap of every pair of cells' choices. Right: each cell's held-out loss
    on each text, with its 95% interval, the unpruned model's as a line."""
    import matplotlib  # lazy: only figures need matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    over = record["overlap"]
    names = over["cells"]
    losses = [(c, w) for c, w, m in judged(record) if m == "loss"]
    fig, axes = plt.subplots(1, 2, figsize=(6 + 0.5 * len(names), 4.8 + 0.15 * len(names)), dpi=120)
    ax = axes[0]
    im = ax.imshow(over["matrix"], vmin=0, vmax=1, cmap="viridis")
    ax.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=7)
    ax.set_yticks(range(len(names)), names, fontsize=7)
    for i, row in enumerate(over["matrix"]):
        for j, v in enumerate(row):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=6, color="w" if v < 0.6 else "k")
    fig.colorbar(im, ax=ax, fraction=0.046, label="Jaccard overlap of the removed layers")
    ax.set_title(f"the {record['run']['k']} layers each cell chose", fontsize=9)
    ax = axes[1]
    width = 0.8 / max(1, len(losses))
    scores = {name: cell_scores(record, name) for name in names}  # each cell's intervals worked out once
    for j, (column, where) in enumerate(losses):
        values, errs = [], [[], []]
        for name in names:
            v, lh = scores[name][column]
            values.append(v)
            errs[0].append(v - lh[0] if lh else 0)
            errs[1].append(lh[1] - v if lh else 0)
        xs = [i + j * width for i in range(len(names))]
        bars = ax.bar(xs, values, width, yerr=errs, capsize=2, label=f"judged on {column} (held out)")
        ax.axhline(_unpruned(record, where, "loss"), color=bars.patches[0].get_facecolor(), ls=":", lw=1)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("held-out next-token loss (nats); dotted: unpruned")
    tops = [(lh[1] if lh else v) for col, _ in losses for n in names for v, lh in [scores[n][col]]]
    ax.set_ylim(min(_unpruned(record, w, "loss") for _, w in losses) * 0.98, max(tops) * 1.03)
    ax.legend(fontsize=7)
    ax.set_title("every choice, the same held-out windows", fontsize=9)
    fig.suptitle(f"{record['run']['model']}: calibration x search, k = {record['run']['k']}", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def distance_rows(record: dict) -> list[list[str]]:
    """Each pick against the best removal of its text and objective: its calibration score, the
    gap, where it ranks among every removal (exact) and how many random draws beat it, and its
    held-out loss on each text as a paired difference from the best's, with its 95% interval."""
    dist = record.get("distances") or {}
    texts = [f"{record.get('labels', {}).get(s, s)} held-out loss" for s in record["run"]["calibration"]]
    header = ["chosen on / objective", "search", "removed", "calibration score", "gap to the best", "rank among all removals",
              "random draws better", *(f"{c}: minus the best's [95%]" for c in texts)]
    rows = [header]
    for name, d in dist.items():
        for cell, pick in sorted(d["picks"].items(), key=lambda kv: kv[1]["score"]):
            rank = f"{pick['rank']:,} of {pick['of']:,} ({pick['percentile']:.0%} better)" if "rank" in pick else "-"
            better = f"{pick['random_better']:.0%} of {d['random_draws']}" if "random_better" in pick else "-"
            held = []
            for c in texts:
                low_high, holm = pick["held_out"].get(c), (pick.get("held_out_holm") or {}).get(c)
                diff = None if low_high is None else (low_high[0] + low_high[1]) / 2
                held.append("-" if low_high is None else f"{diff:+.4f} [{low_high[0]:+.4f}, {low_high[1]:+.4f}]"
                            + (f" Holm [{holm[0]:+.4f}, {holm[1]:+.4f}]" if holm else ""))
            rows.append([name, record["cells"][cell]["search"] + (" (best)" if pick["is_best"] else ""), pick["layers"], f"{pick['score']:.4f}",
                         f"{pick['gap']:+.4f}", rank, better, *held])
    return rows


def distance_table(record: dict) -> Table | None:
    """How far each pick is from the best removal (the exact optimum where `exact` ran)."""
    dist = record.get("distances") or {}
    if not dist:
        return None
    header, *rows = distance_rows(record)
    exact = any(d["exact"] for d in dist.values())
    caption = ("calibration score: the objective on the calibration windows (" + OBJECTIVE_WORDS + "); the best: " + ("the exact optimum over every removal where exact ran, else the best any search scored" if exact
                                       else "the best removal any search scored (no exact run)")
               + "; held out: the pick's held-out loss minus the best's, paired over the windows, Student's t; Holm: the same "
               "interval adjusted for every pick of the text and objective compared with the best at once (Holm's step-down)")
    return _table(f"{record['run']['model']}: how far each pick of {record['run']['k']} is from the best", caption, [header, *rows], left=3)


def distance_verdicts(record: dict) -> list[str]:
    """Per text and objective: the best removal, and which picks found it."""
    lines = []
    for name, d in (record.get("distances") or {}).items():
        found = sorted({record["cells"][c]["search"] for c, p in d["picks"].items() if p["is_best"]})
        what = "exact optimum" if d["exact"] else f"best of the {d['scored']:,} removals scored (no exact run: not known to be the optimum)"
        lines.append(f"{name}: the {what} removes {d['best']} ({d['best_score']:.4f}); found by {', '.join(found) or 'no other search'}")
    return lines


def plot_distances(record: dict, path: Path) -> Path | None:
    """Where each search's pick falls among every removal's calibration score (exact) or the random
    draws', one panel per text and objective."""
    dist = {n: d for n, d in (record.get("distances") or {}).items() if d["all_scores"] or d["null_scores"]}
    if not dist:
        return None
    import matplotlib  # lazy: only figures need matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(dist), figsize=(5.2 * len(dist), 4.2), dpi=120, squeeze=False)
    for ax, (name, d) in zip(axes[0], dist.items()):
        scores = d["all_scores"] or d["null_scores"]
        what = f"all {len(scores):,} removals" if d["all_scores"] else f"{len(scores)} random removals"
        ax.hist(scores, bins=min(60, max(10, len(scores) // 20)), color="0.75", label=what)
        for i, (cell, pick) in enumerate(sorted(d["picks"].items(), key=lambda kv: kv[1]["score"])):
            color = f"C{i % 10}"
            ax.axvline(pick["score"], color=color, lw=1.5, label=f"{record['cells'][cell]['search']}: {pick['layers']}")
        ax.set_xlabel(f"calibration {d['objective']} ({OBJECTIVE_AXIS[d['objective']]})")
        ax.set_ylabel("removals")
        ax.set_title(f"{name}: where each pick falls", fontsize=9)
        ax.legend(fontsize=6)
    fig.suptitle(f"{record['run']['model']}: k = {record['run']['k']}, every pick against {'every removal' if any(d['all_scores'] for d in dist.values()) else 'random removals'}",
                 fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


# --------------------------------------------------------------------------- the answer, how sure, what next
def answer_picks(record: dict) -> list[tuple[str, str]]:
    """(distance name, cell) of the answer for each text and objective: the pick with the best
    calibration score (exact's, where it ran, is the optimum)."""
    out = []
    for name, d in (record.get("distances") or {}).items():
        if d["picks"]:
            out.append((name, min(d["picks"], key=lambda cell: (d["picks"][cell]["score"], cell))))
    return out


def answer_lines(record: dict) -> list[str]:
    """The first lines `select` prints: per text and objective, the removal, what found it, how good
    it is held out and how stable it is."""
    lines = []
    for name, cell in answer_picks(record):
        d, pick, c = record["distances"][name], record["distances"][name]["picks"][cell], record["cells"][cell]
        same = [other for other, p in d["picks"].items() if p["layers"] == pick["layers"]]
        found = sorted({record["cells"][other]["search"] for other in same})
        how = f"the exact optimum of {d['space']:,} removals; found by {', '.join(found)}" if d["exact"] and pick["is_best"] else \
            f"found by {', '.join(found)}; " + ("not the exact optimum, which exact found" if d["exact"] else "no exact run, so not known to be the optimum")
        scores = cell_scores(record, cell)
        held = [f"{column} {v:.4g} [{lh[0]:.4g}, {lh[1]:.4g}]" for column, (v, lh) in scores.items() if lh and not column.endswith("rejection")]
        stabilities = record.get("stability_summary") or {}
        stability = next((stabilities[other] for other in [cell, *same] if other in stabilities), None)  # any search that chose this removal and was rerun
        sure = f"in {stability['resamples']} reruns on resampled windows, " + words(stability) if stability else "not resampled (--resamples R says how often it comes back)"
        unit = "layers" if record["run"].get("granularity", "layer") == "layer" else "units"
        lines.append(f"answer ({name}): remove {unit} {pick['layers']} ({how}) · held out against the unpruned model: "
                     + "; ".join(held) + f" · how sure: {sure}")
    return lines


def stability_verdicts(record: dict) -> list[str]:
    return [verdict(f"stability of {name}", s) for name, s in (record.get("stability_summary") or {}).items()]


def next_commands(record: dict, model: str, out: Path) -> list[str]:
    """The commands that take the answer further, its units filled in: save it, time it, win it
    back, draft with it."""
    picks = answer_picks(record)
    if not picks:
        return []
    layers = record["distances"][picks[0][0]]["picks"][picks[0][1]]["layers"]
    lines = []
    if record["run"].get("granularity", "layer") == "layer":
        name = Path(str(record["run"]["model"]).rstrip("/")).name or "model"  # a path's last part, a hub id's name: not the whole path under pruned/
        lines += [f"depthcurse drop {model} --layers {layers} --out pruned/{name}-without-{layers.replace(',', '-')}   (save it)",
                  f"depthcurse speed {model} --layers {layers}   (what it buys)",
                  f"depthcurse heal {model} --layers {layers} --methods linear,lora   (win the loss back)"]
    lines.append(f"depthcurse speculate {model} --skip-from {out}   (draft with it: the output stays the whole model's)")
    return lines


def plot_stability(record: dict, path: Path) -> Path | None:
    """How often each unit is chosen over the resamples, a row per resampled cell, the full-data
    pick's units outlined."""
    summaries = record.get("stability_summary") or {}
    if not summaries:
        return None
    import matplotlib  # lazy: only figures need matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    granularity = record["run"].get("granularity", "layer")
    units = list(canonical({u for s in summaries.values() for u in parse_key(",".join(s["frequency"]))}, granularity))
    names = list(summaries)
    grid = [[summaries[n]["frequency"].get(str(u), 0.0) for u in units] for n in names]
    fig, ax = plt.subplots(figsize=(2 + 0.45 * len(units), 1.4 + 0.45 * len(names)), dpi=120)
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="Blues", aspect="auto")
    for i, n in enumerate(names):
        chosen = set(parse_key(summaries[n]["full"]))
        for j, u in enumerate(units):
            ax.text(j, i, f"{grid[i][j]:.2f}".rstrip("0").rstrip("."), ha="center", va="center", fontsize=7, color="w" if grid[i][j] > 0.6 else "k")
            if u in chosen:
                ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, lw=1.5, ec="C3"))
    ax.set_xticks(range(len(units)), [str(u) for u in units], fontsize=7)
    ax.set_yticks(range(len(names)), [f"{n} ({summaries[n]['resamples']} reruns)" for n in names], fontsize=7)
    ax.set_xlabel("unit removed (outlined: the pick on every calibration window)")
    fig.colorbar(im, ax=ax, fraction=0.04, label="share of reruns that remove it")
    fig.suptitle(f"{record['run']['model']}: how often each unit is chosen, k = {record['run']['k']} "
                 "(reruns on bootstrap resamples of the calibration windows, and under --seeds where given)", fontsize=9)
    fig.tight_layout()
    return save_figure(fig, path)
