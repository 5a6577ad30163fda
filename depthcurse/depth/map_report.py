"""`depthcurse depth-map SHALLOW DEEP`: the depth map's run on a text, its table, verdict lines,
`depth_map.json` and the R^2 heatmap."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from depthcurse.depth.depth_map import RIDGE, depth_map, same_tokenizer
from depthcurse.depth.over_seeds import architecture
from depthcurse.errors import DepthcurseError
from depthcurse.io import atomic_write, json_text, save_figure
from depthcurse.loading import check_sequence_length
from depthcurse.tasks import PerplexityTask
from depthcurse.text import load_texts

MAP_JSON = "depth_map.json"


def run_depth_map(shallow, deep, data: str, windows: int, held_out: int, seq_len: int, batch_size: int, ridge: float = RIDGE,
                  on_step=lambda text, done, total: None) -> dict:
    """Both models on `windows` fitting and `held_out` held-out windows of `data` (ppl's packing, the
    shallow model's tokenizer, which must be the deep one's)."""
    if not same_tokenizer(shallow.tokenizer, deep.tokenizer):
        raise DepthcurseError(f"the depth map compares streams token by token: {shallow.source} and {deep.source} have different tokenizers")
    if windows < 1 or held_out < 2 or seq_len < 2 or batch_size < 1:
        raise DepthcurseError("--windows must be at least 1, --held-out at least 2 (the intervals are over them), --seq-len at least 2, --batch-size at least 1")
    for loaded in (shallow, deep):
        check_sequence_length(loaded.model, seq_len)
    texts, label = load_texts(data, option="--data")
    ids = PerplexityTask(shallow.tokenizer, texts, source=label, seq_len=seq_len, limit=windows + held_out, warn_short=False).windows
    if len(ids) < windows + held_out:
        raise DepthcurseError(f"--data {data} holds {len(ids)} windows of {seq_len} tokens, fewer than --windows {windows} and --held-out {held_out}")
    result = depth_map(shallow.model.eval(), deep.model.eval(), ids[:windows], ids[windows:], batch_size, ridge, on_step=on_step)
    describe = lambda loaded: {**{k: v for k, v in loaded.describe().items() if k != "device"}, "architecture": architecture(loaded.model)}  # noqa: E731
    return {"run": {"shallow": describe(shallow), "deep": describe(deep), "data": label, "seq_len": seq_len}, **result}


def map_table(record: dict) -> Table:
    run = record["run"]
    table = Table(title=f"{run['shallow']['model']} ({record['shallow_layers']} layers) -> {run['deep']['model']} ({record['deep_layers']} layers): "
                        f"which deep layer each shallow layer's stream maps to best",
                  caption=f"a linear map (least squares, ridge {record['ridge']:g}) from the stream after the shallow layer to the stream after each "
                          f"deep layer, fitted on {record['fit_windows']} windows of {run['data']} x {run['seq_len']} tokens; R^2 on "
                          f"{record['held_out_windows']} held-out windows (mean, in brackets the 95% interval, Student's t over windows); relative "
                          "depth: (layer + 1) / layers", caption_justify="left")
    for column in ("shallow layer", "relative depth", "best deep layer", "its relative depth", "held-out R^2", "R^2 to the same relative depth"):
        table.add_column(column, justify="right")
    nd = record["deep_layers"]
    for i, j in enumerate(record["best"]):
        iv = record["r2_interval"][i][j]
        same = min(nd - 1, max(0, round((i + 1) / record["shallow_layers"] * nd) - 1))
        table.add_row(str(i), f"{(i + 1) / record['shallow_layers']:.2f}", str(j), f"{(j + 1) / nd:.2f}",
                      f"{record['r2'][i][j]:.3f}" + (f" [{iv[0]:.3f}, {iv[1]:.3f}]" if iv else ""), f"{record['r2'][i][same]:.3f} (layer {same})")
    return table


def map_verdicts(record: dict) -> list[str]:
    depth = record["relative_depth"]
    rho, iv = depth["spearman"], depth["spearman_interval"]
    said = "-" if rho is None else f"{rho:+.2f}" + (f" [{iv[0]:+.2f}, {iv[1]:+.2f}]" if iv else "")
    lines = [f"each shallow layer's best match lies {depth['mean_abs_difference']:.2f} of the depth away from its own relative depth on average; "
             f"the two orders agree by Spearman's rho {said}"]
    last = record["r2"][-1]
    reach = max(range(record["deep_layers"]), key=lambda j: last[j])
    lines.append(f"the shallow model's last layer maps best to deep layer {reach} of {record['deep_layers']} (R^2 {last[reach]:.3f}); "
                 f"the deep model's last layer is reached with R^2 {max(row[-1] for row in record['r2']):.3f} at best")
    return lines


def plot_map(record: dict, path: Path) -> Path:
    import matplotlib  # lazy: only figures need matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 5.0), dpi=120)
    im = ax.imshow(record["r2"], cmap="viridis", origin="lower", aspect="auto", vmin=min(0.0, min(map(min, record["r2"]))), vmax=1.0)
    ax.plot(record["best"], range(record["shallow_layers"]), "w.", label="best match")
    ns, nd = record["shallow_layers"], record["deep_layers"]
    ax.plot([(i + 1) / ns * nd - 1 for i in range(ns)], range(ns), "w:", label="same relative depth")
    ax.set_xlabel(f"deep layer ({record['run']['deep']['model']})")
    ax.set_ylabel(f"shallow layer ({record['run']['shallow']['model']})")
    ax.legend(fontsize=7, loc="upper left")
    fig.colorbar(im, ax=ax, label="held-out R^2 of the linear map")
    ax.set_title(f"the depth map ({record['held_out_windows']} held-out windows of {record['run']['data']})", fontsize=9)
    fig.tight_layout()
    return save_figure(fig, path)


def write_map(record: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    return [atomic_write(out / MAP_JSON, json_text(record)), plot_map(record, out / "depth_map.png")]
