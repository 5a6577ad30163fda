"""`depthcurse depth-map SHALLOW DEEP`: the depth map's run on a text, its table, verdict lines,
`depth_map.json` and the score's heatmap."""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.table import Table

from depthcurse.depth.csordas_map import MapSettings, their_start
from depthcurse.depth.depth_map import RIDGE, depth_map, deciding, same_tokenizer
from depthcurse.depth.over_seeds import architecture
from depthcurse.errors import DepthcurseError
from depthcurse.fitting import DEFAULT_FIT_RATIO, MIN_FIT_RATIO, check_fit, needed
from depthcurse.io import atomic_write, environment, json_text, save_figure
from depthcurse.loading import check_sequence_length
from depthcurse.tasks import PerplexityTask
from depthcurse.text import load_texts

MAP_JSON = "depth_map.json"


DEFAULT_WINDOWS = 16  # the fewest fitting windows by default; more where the stream is wide (`fit_windows`)


def fitted_tokens(windows: int, seq_len: int, definitions: str) -> int:
    """The tokens a map is fitted on: every token of the windows (theirs: all but the BOS pad)."""
    return windows * (seq_len - (definitions == "csordas"))


def fit_windows(width: int, seq_len: int, definitions: str) -> int:
    """`--calib-windows` by default: 16, or as many as give twice the map's inputs (the shallow stream's
    width and an intercept) where the stream is wider: 2 x 4,097 tokens for a 7B model's stream."""
    per = fitted_tokens(1, seq_len, definitions)
    return max(DEFAULT_WINDOWS, -(-needed(width + 1, DEFAULT_FIT_RATIO) // per))


def run_depth_map(shallow, deep, data: str, windows: int | None, held_out: int, seq_len: int, batch_size: int, ridge: float = RIDGE,
                  on_step=lambda text, done, total: None, definitions: str = "depthcurse", score: str | None = None,
                  settings: MapSettings = MapSettings(), kept: Path | None = None, on_note=lambda text: None, clock=time.perf_counter,
                  min_fit_ratio: float = MIN_FIT_RATIO) -> dict:
    """Both models on `windows` fitting (None: `fit_windows`) and `held_out` held-out windows of `data`
    (ppl's packing, the shallow model's tokenizer, which must be the deep one's). Before any work, a
    map fitted on fewer tokens than its inputs is said (`on_note`), and refused below `min_fit_ratio`
    of them (`fitting.check_fit`)."""
    started = clock()
    if not same_tokenizer(shallow.tokenizer, deep.tokenizer):
        raise DepthcurseError(f"the depth map compares streams token by token: {shallow.source} and {deep.source} have different tokenizers")
    width = shallow.model.get_input_embeddings().weight.shape[-1]
    windows = fit_windows(width, seq_len, definitions) if windows is None else windows
    if windows < 1 or held_out < 2 or seq_len < 2 or batch_size < 1:
        raise DepthcurseError("--calib-windows must be at least 1, --eval-windows at least 2 (the intervals are over them), --seq-len at least 2, "
                              "--batch-size at least 1")
    per, tokens = fitted_tokens(1, seq_len, definitions), fitted_tokens(windows, seq_len, definitions)
    note = check_fit(tokens, width + 1, min_ratio=min_fit_ratio,
                     what=f"each map from the shallow model's {width}-wide stream (--calib-windows {windows} x {per} tokens)",
                     fix=lambda needed_tokens: f"give --calib-windows {-(-needed_tokens // per)} or more", accept=lambda ratio: f"--min-fit-ratio {ratio}",
                     solution="the minimum-norm map (the ridge's)" if definitions == "depthcurse" else "whatever AdamW reaches from its start")
    if note:
        on_note(note)
    for loaded in (shallow, deep):
        check_sequence_length(loaded.model, seq_len)
    texts, label = load_texts(data, option="--data")
    start = their_start(shallow.tokenizer) if definitions == "csordas" else None  # theirs: their BOS pad, then seq_len - 1 text tokens
    task = PerplexityTask(shallow.tokenizer, texts, source=label, seq_len=seq_len, limit=windows + held_out, warn_short=False, start=start)
    ids = task.windows
    if len(ids) < windows + held_out:
        raise DepthcurseError(f"--data {data} holds {len(ids)} windows of {seq_len} tokens, fewer than --calib-windows {windows} and --eval-windows {held_out}")
    result = depth_map(shallow.model.eval(), deep.model.eval(), ids[:windows], ids[windows:], batch_size, ridge, definitions=definitions, score=score,
                       settings=settings, on_step=on_step, kept=kept, on_note=on_note, clock=clock)
    if kept is not None:  # mapped whole: the record holds it now
        kept.unlink(missing_ok=True)
    describe = lambda loaded: {**{k: v for k, v in loaded.describe().items() if k != "device"}, "architecture": architecture(loaded.model)}  # noqa: E731
    run = {"shallow": describe(shallow), "deep": describe(deep), "data": label, "seq_len": seq_len, "start": task.prefix,
           "fit": {"tokens": tokens, "inputs": width + 1, "min_fit_ratio": min_fit_ratio, "under_determined": note}}
    run["same_model"] = all(run["shallow"][k] == run["deep"][k] for k in ("source", "revision"))
    return {"run": run, **result, "wall_time_s": round(clock() - started, 3), "environment": environment()}


def same_model_line(record: dict) -> str:
    """What a map of one model onto itself measures, with the figure its diagonal reached: an exact map
    gives R^2 1 (error 0) there; an under-determined one does not."""
    name, matrix, higher = deciding(record)
    diagonal = [matrix[i][i] for i in range(min(len(matrix), len(matrix[0])))]
    low, high = min(diagonal), max(diagonal)
    figure = f"{low:.3f}" if f"{low:.3f}" == f"{high:.3f}" else f"{low:.3f} to {high:.3f}"
    exact = 1.0 if higher else 0.0
    off = max(abs(v - exact) for v in diagonal)
    how = ("every stream onto its own, as an exact map must" if off < 0.01 else
           f"short of the {exact:g} an exact map gives by up to {off:.3f}: the maps are not exact even onto the stream itself")
    return (f"one model against itself: the diagonal's {_label(name)} is {figure}, {how}; the best matches say nothing of depth, "
            "the rest says how well one layer's stream predicts another's within the model")


def _label(name: str) -> str:
    return {"r2_dims": "per-dimension R^2", "r2": "R^2", "relative_error": "relative error"}[name]


KEPT_FILE = "depth_map.partial.json"


def kept_summary(folder: Path) -> str:
    """What an interrupted depth-map left in `folder` to resume from, in words."""
    try:
        kept = json.loads((folder / KEPT_FILE).read_text())
        return f"{kept['rows']} of {kept['of']} shallow streams' rows kept in {folder / KEPT_FILE}"
    except (OSError, ValueError, KeyError):
        return "no row had finished"


def _stream(record: dict, index: int) -> str:
    if record.get("streams") == "entering":
        return "embedding" if index == 0 else f"after {index - 1}"
    return str(index)


def _cell(value: float, interval) -> str:
    return f"{value:.3f}" + (f" [{interval[0]:.3f}, {interval[1]:.3f}]" if interval else "")


def map_table(record: dict) -> Table:
    run = record["run"]
    name, matrix, higher = deciding(record)
    scores = record["scores"] if "scores" in record else {"r2": {"mean": record["r2"], "interval": record["r2_interval"], "label": "held-out R^2 pooled over dimensions"}}
    entering = record.get("streams") == "entering"
    how = (f"their trained linear map ({record['definitions']['source']}) from each shallow stream (the embedding's output, then after each layer) to "
           f"every deep stream at once" if entering else
           f"a linear map (least squares, ridge {record['ridge']:g}) from the stream after the shallow layer to the stream after each deep layer")
    table = Table(title=f"{run['shallow']['model']} ({record['shallow_layers']} layers) -> {run['deep']['model']} ({record['deep_layers']} layers): "
                        f"which deep layer each shallow layer's stream maps to best, by the {scores[name]['label']}"
                        + (" (one model against itself)" if run.get("same_model") else ""),
                  caption=f"{how}, fitted on {record['fit_windows']} windows of {run['data']} x {run['seq_len']} tokens, scored on "
                          f"{record['held_out_windows']} held-out windows (mean, in brackets the 95% interval, Student's t over windows"
                          + (", an R^2's cut at 1, the most it can be" if "r2_dims" in scores else "")
                          + f"; {'higher' if higher else 'lower'} is better); relative depth: "
                          + ("stream / layers (0: the embedding)" if entering else "(layer + 1) / layers")
                          + ("; per dimension: each dimension's R^2, then their mean (one dimension cannot decide it); pooled: over every dimension "
                             "at once (a dimension counts by its variance)" if "r2_dims" in scores else ""), caption_justify="left")  # pragma: no mutate (the look)
    others = [n for n in scores if n != name]
    for column in ("shallow layer", "relative depth", "best deep layer", "its relative depth", scores[name]["label"],
                   *(scores[n]["label"] for n in others), "at the same relative depth"):
        table.add_column(column, justify="right")  # pragma: no mutate (the look)
    for i, j in enumerate(record["best"]):
        same = max(0, round(record["relative_depth"]["shallow"][i] * record["deep_layers"]) - (0 if entering else 1))  # a relative depth is at most 1: the last stream
        table.add_row(_stream(record, i), f"{record['relative_depth']['shallow'][i]:.2f}", _stream(record, j), f"{record['relative_depth']['best_deep'][i]:.2f}",
                      _cell(matrix[i][j], scores[name]["interval"][i][j]), *(_cell(scores[n]["mean"][i][j], scores[n]["interval"][i][j]) for n in others),
                      f"{matrix[i][same]:.3f} (layer {_stream(record, same)})")
    return table


def map_verdicts(record: dict) -> list[str]:
    depth = record["relative_depth"]
    name, matrix, higher = deciding(record)
    rho, iv = depth["spearman"], depth["spearman_interval"]
    said = "-" if rho is None else f"{rho:+.2f}" + (f" [{iv[0]:+.2f}, {iv[1]:+.2f}]" if iv else "")
    lines = [same_model_line(record)] if record["run"].get("same_model") else []
    lines += [f"each shallow layer's best match lies {depth['mean_abs_difference']:.2f} of the depth away from its own relative depth on average; "
              f"the two orders agree by Spearman's rho {said}"]
    pick = max if higher else min
    last = matrix[-1]
    reach = pick(range(len(last)), key=lambda j: last[j])
    label = _label(name)
    lines.append(f"the shallow model's last layer maps best to deep {'stream' if record.get('streams') == 'entering' else 'layer'} {_stream(record, reach)} "
                 f"of {record['deep_layers']} ({label} {last[reach]:.3f}); "
                 f"the deep model's last layer is reached with {label} {pick(row[-1] for row in matrix):.3f} at best")
    variance = record.get("variance")
    if variance:
        at = variance["dominant_at"]
        for side in ("shallow", "deep"):
            shares = variance[side]
            dominated = [i for i, s in enumerate(shares) if s >= at]
            if dominated:
                lines.append(f"in {len(dominated)} of the {side} model's {len(shares)} streams one dimension holds {at:.0%} of the variance or more "
                             f"(up to {max(shares):.0%}): a pooled R^2 there is mostly that dimension's; the per-dimension R^2 weighs every dimension alike")
    return lines


def plot_map(record: dict, path: Path) -> Path:
    import matplotlib  # lazy: only figures need matplotlib

    matplotlib.use("Agg")  # pragma: no mutate (the drawing's look: what it marks is tested, not its colours and sizes)
    import matplotlib.pyplot as plt

    name, matrix, higher = deciding(record)
    fig, ax = plt.subplots(figsize=(6.4, 5.0), dpi=120)  # pragma: no mutate
    low = min(map(min, matrix))
    im = ax.imshow(matrix, cmap="viridis" if higher else "viridis_r", origin="lower", aspect="auto",
                   vmin=min(0.0, low) if higher else 0.0, vmax=1.0 if higher else max(map(max, matrix)))
    ax.plot(record["best"], range(len(matrix)), "w.", label="best match")
    ns, nd = record["shallow_layers"], record["deep_layers"]
    if record.get("streams") == "entering":
        ax.plot([s / ns * nd for s in range(ns + 1)], range(ns + 1), "w:", label="same relative depth")
    else:
        ax.plot([(i + 1) / ns * nd - 1 for i in range(ns)], range(ns), "w:", label="same relative depth")
    ax.set_xlabel(f"deep {'stream' if record.get('streams') == 'entering' else 'layer'} ({record['run']['deep']['model']})")
    ax.set_ylabel(f"shallow {'stream' if record.get('streams') == 'entering' else 'layer'} ({record['run']['shallow']['model']})")
    ax.legend(fontsize=7, loc="upper left")  # pragma: no mutate
    label = record.get("scores", {}).get(name, {}).get("label", "held-out R^2 of the linear map")
    fig.colorbar(im, ax=ax, label=label)
    ax.set_title(f"the depth map ({record['held_out_windows']} held-out windows of {record['run']['data']})", fontsize=9)
    fig.tight_layout()  # pragma: no mutate
    return save_figure(fig, path)


def write_map(record: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    return [atomic_write(out / MAP_JSON, json_text(record)), plot_map(record, out / "depth_map.png")]
