"""`depth-use`'s run on a text, and its results: a rich table per layer, verdicts, `depth_use.json`,
`depth_use.csv`, the influence heatmap and the settling figure."""

from __future__ import annotations

import contextlib
import csv
import json
import math
from dataclasses import asdict
from pathlib import Path

from rich.table import Table

from depthcurse.depth.measure import TUNED, DepthUse, half_settled, influence_row_means, measure_depth_use, per_layer_rows, phase_transition, stepper_of
from depthcurse.depth.over_seeds import architecture
from depthcurse.depth.tuned_lens import LensSettings, load_lens, train_tuned_lens
from depthcurse.errors import DepthcurseError
from depthcurse.io import atomic_write, csv_text, json_text, read_record, save_figure
from depthcurse.loading import check_sequence_length
from depthcurse.runtime import World
from depthcurse.tasks import PerplexityTask
from depthcurse.text import load_texts

DEPTH_JSON = "depth_use.json"


def run_depth_use(loaded, data: str, windows: int, seq_len: int, batch_size: int, influence: bool = True, on_step=lambda text, done, total: None,
                  tuned: bool = False, lens: Path | None = None, lens_windows: int | None = None, lens_settings: LensSettings = LensSettings(),
                  lens_out: Path | None = None, world: World = World()) -> dict:
    """`windows` windows of `seq_len` tokens of `data` (ppl's packing), measured; the record. With
    `tuned`, a tuned lens is trained on the next `lens_windows` windows of the same text (held out
    from the measured ones; default as many) and read beside the logit lens, and saved to `lens_out`
    (a lens already there for this model and these settings is read instead: a rerun trains none);
    with `lens`, a saved one is read."""
    if windows < 2:
        raise DepthcurseError(f"--windows must be at least 2 (the intervals are over windows), got {windows}")
    if seq_len < 2 or batch_size < 1:
        raise DepthcurseError("--seq-len must be at least 2 and --batch-size at least 1")
    if tuned and lens is not None:
        raise DepthcurseError("--tuned-lens trains a lens and --lens reads one: give one of them")
    lens_windows = (lens_windows or windows) if tuned else 0
    if tuned:
        lens_settings.check()
    check_sequence_length(loaded.model, seq_len)
    stepper = stepper_of(loaded.model)  # before any work: a model the lens cannot read is one line
    translators, training = (load_lens(lens, stepper) if lens is not None else (None, None))
    texts, label = load_texts(data, option="--data")
    ids = PerplexityTask(loaded.tokenizer, texts, source=label, seq_len=seq_len, limit=windows + lens_windows, warn_short=False).windows
    if len(ids) < windows + lens_windows:
        asked = f"--windows {windows}" + (f" and {lens_windows} more to train the tuned lens on" if lens_windows else "")
        raise DepthcurseError(f"--data {data} holds {len(ids)} windows of {seq_len} tokens, fewer than {asked}")
    model = loaded.model.eval()
    if tuned:
        kept = lens_out if lens_out is not None and lens_out.is_file() else None
        if kept is not None:
            with contextlib.suppress(DepthcurseError):
                translators, training = load_lens(kept, stepper)
                if training.get("settings") != asdict(lens_settings) or training.get("train_windows") != lens_windows:
                    translators = None  # another training's lens: trained again
        if translators is None:
            translators, training = train_tuned_lens(model, stepper, ids[windows:], lens_settings, on_step=on_step)
            if lens_out is not None:
                translators.save(lens_out, training)
    use = measure_depth_use(model, ids[:windows], batch_size, influence=influence, on_step=on_step, tuned=translators, world=world)
    record = {"run": {**{k: v for k, v in loaded.describe().items() if k != "device"}, "architecture": architecture(loaded.model), "data": label,
                      "windows": windows, "seq_len": seq_len},
              "use": use.summary(), "layers": per_layer_rows(use), "phase_transition": phase_transition(use)}
    if translators is not None:
        record["tuned_lens"] = {**training, "source": str(lens) if lens is not None else "trained here",
                                "held_out_kl": [row["tuned_kl"] for row in record["layers"]],
                                "logit_lens_kl": [row["lens_kl"] for row in record["layers"]]}
    return record


def _use(record: dict) -> DepthUse:
    return DepthUse(**record["use"])


def _cell(value: float, interval) -> str:
    return f"{value:.3f}" + (f" [{interval[0]:.3f}, {interval[1]:.3f}]" if interval else "")


def depth_table(record: dict) -> Table:
    run = record["run"]
    table = Table(title=f"{run['model']}: how each layer is used, {run['windows']} windows x {run['seq_len']} tokens of {run['data']}",
                  caption="attention / MLP: the sublayer's output norm over the residual stream it is added to, and their cosine (Csordás et al. 2025, "
                          "Fig. 2); lens: the model's final norm and head on the stream after the layer, against its output (KL, top-1, the output's "
                          "top-1 in the lens's top-5); settles here: tokens whose lens top-1 is the output's from this layer on; influence: the "
                          "layer skipped, the mean relative change of every later layer's contribution, and the output's KL. Means over windows, "
                          "in brackets the 95% interval (Student's t over windows)", caption_justify="left")
    use = _use(record)
    tuned = use.tuned_kl is not None
    if tuned:
        lens = record["tuned_lens"]
        table.caption += (f"; tuned lens: one affine translator per layer (Belrose et al. 2023), trained on {lens['train_windows']} other windows of "
                          f"the text ({lens['settings']['steps']} steps), read on these (held out)")
    for column in ("layer", "attention ||a||/||h||", "MLP ||m||/||h||", "cos(a, h)", "cos(m, h)", "lens KL", "lens top-1", "lens top-5",
                   "settles here", *(("tuned lens KL", "tuned top-1", "tuned settles here") if tuned else ()), "influence on later layers",
                   "output KL when skipped"):
        table.add_column(column, justify="right")
    for row in record["layers"]:
        i = row["layer"]
        later = [v for v in (use.influence[i] if use.influence else []) if v is not None and v == v]  # NaN here, null read back
        table.add_row(str(i), *(_cell(row[n], row[f"{n}_interval"]) for n in ("attn_norm", "mlp_norm", "attn_cos", "mlp_cos", "lens_kl", "lens_top1", "lens_top5")),
                      f"{row['settled_share']:.1%}",
                      *((_cell(row["tuned_kl"], row["tuned_kl_interval"]), _cell(row["tuned_top1"], row["tuned_top1_interval"]),
                         f"{row['tuned_settled_share']:.1%}") if tuned else ()),
                      f"{sum(later) / len(later):.3f}" if later else "-", f"{use.output_change[i]:.3f}" if use.output_change else "-")
    return table


def depth_overview(records: list[dict], names: list[str]) -> Table:
    """Runs side by side, a row each: what each measured on, its phase transition, where half of the
    predictions have settled by each lens, and the layer whose skip changes the output most."""
    table = Table(title="depth-use runs side by side", caption="phase transition: the change point of the influence rows (docs/depth-use.md); "
                  "half settled: the layer by which half of the tokens' lens top-1 stays the output's; most changing skip: the layer whose "
                  "removal moves the output most (KL)", caption_justify="left")
    for column in ("run", "model", "text", "layers", "phase transition", "half settled (logit lens)", "half settled (tuned lens)", "most changing skip"):
        table.add_column(column, justify="left" if column in ("run", "model", "text") else "right")
    for name, record in zip(names, records):
        use, run = _use(record), record["run"]
        phase = record.get("phase_transition")
        worst = max(range(use.n_layers), key=lambda i: use.output_change[i]) if use.output_change else None
        table.add_row(name, str(run.get("model")), f"{run['data']}, {run['windows']} x {run['seq_len']}", str(use.n_layers),
                      "-" if phase is None else f"{phase} ({phase / use.n_layers:.0%})", str(half_settled(use.settled)),
                      "-" if use.tuned_settled is None else str(half_settled(use.tuned_settled)), "-" if worst is None else str(worst))
    return table


def depth_verdicts(record: dict) -> list[str]:
    use, rows = _use(record), record["layers"]
    lines = []
    settled = use.settled
    total = sum(settled) or 1
    lines.append(f"half of the tokens' predictions have settled by layer {half_settled(settled)} of {use.n_layers} (logit lens; "
                 f"{settled[-1] / total:.0%} settle only at the last layer)")
    if use.tuned_settled is not None:
        lens = record["tuned_lens"]
        closer = sum(1 for r in rows[:-1] if r["tuned_kl"] < r["lens_kl"])
        lines.append(f"tuned lens: half settled by layer {half_settled(use.tuned_settled)}; on the held-out windows its KL to the output is below "
                     f"the logit lens's at {closer} of {len(rows) - 1} layers (trained on {lens['train_windows']} windows, {lens['settings']['steps']} "
                     f"steps, {lens['seconds']:.0f} s)")
    phase = record.get("phase_transition")
    if phase is not None:
        means = influence_row_means(use)
        lines.append(f"phase transition at layer {phase} of {use.n_layers} ({phase / use.n_layers:.0%} of the depth): the one drop in how much each "
                     f"layer's skip changes the later layers' work (the influence rows' means, least squares; docs/depth-use.md), "
                     f"{sum(means[:phase]) / phase:.3f} before it, {sum(means[phase:]) / len(means[phase:]):.3f} from it on")
    if use.output_change:
        worst = max(range(use.n_layers), key=lambda i: use.output_change[i])
        lines.append(f"skipping layer {worst} changes the output most (KL {use.output_change[worst]:.3f})")
    return lines


def write_depth(record: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [atomic_write(out / DEPTH_JSON, json_text(record))]

    def rows(tmp: Path) -> None:
        with open(tmp, "w", newline="") as f:
            writer = csv.writer(f)
            use = _use(record)
            tuned = use.tuned_kl is not None
            names = ("attn_norm", "mlp_norm", "attn_cos", "mlp_cos", "lens_kl", "lens_top1", "lens_top5", *(TUNED if tuned else ()))
            writer.writerow(["layer", *names, *(f"{n}_low" for n in names), *(f"{n}_high" for n in names), "settled_share",
                             *(("tuned_settled_share",) if tuned else ()), "output_kl_when_skipped"])
            for row in record["layers"]:
                iv = [row[f"{n}_interval"] or [None, None] for n in names]
                writer.writerow([row["layer"], *(row[n] for n in names), *(i[0] for i in iv), *(i[1] for i in iv), row["settled_share"],
                                 *((row["tuned_settled_share"],) if tuned else ()), use.output_change[row["layer"]] if use.output_change else ""])

    paths.append(atomic_write(out / "depth_use.csv", rows))
    if record.get("agreement"):
        flat = [{**{k: v for k, v in r.items() if k != "interval"}, "low": (r["interval"] or [None, None])[0], "high": (r["interval"] or [None, None])[1]}
                for r in record["agreement"]]
        paths.append(atomic_write(out / "agreement.csv", csv_text(flat)))
    return paths


def plot_influence(record: dict, path: Path) -> Path | None:
    """The influence matrix: layer i skipped (rows), the relative change of layer j's contribution (columns)."""
    use = _use(record)
    if use.influence is None:
        return None
    import matplotlib  # lazy: only figures need matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 5.4), dpi=120)
    grid = [[v if v is not None and v == v else math.nan for v in row] for row in use.influence]
    im = ax.imshow(grid, cmap="magma", origin="upper")
    ax.set_xlabel("later layer j")
    ax.set_ylabel("layer i skipped")
    fig.colorbar(im, ax=ax, label="mean ||c_j(skip i) - c_j|| / ||c_j||")
    ax.set_title(f"{record['run']['model']}: whose later work each layer changes\n({record['run']['windows']} x {record['run']['seq_len']} "
                 f"tokens of {record['run']['data']})", fontsize=9)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_settling(record: dict, path: Path) -> Path:
    """Left: where each token's prediction settles (logit lens), as a share of tokens per layer. Right:
    the lens's top-1 agreement and KL to the output per layer."""
    import matplotlib  # lazy: only figures need matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    use, rows = _use(record), record["layers"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), dpi=120)
    total = sum(use.settled) or 1
    axes[0].bar(range(use.n_layers), [s / total for s in use.settled], color="C0")
    axes[0].set_xlabel("layer after which the lens's top-1 stays the output's")
    axes[0].set_ylabel("share of tokens")
    axes[0].set_title("settling depth (bars: logit lens)", fontsize=9)
    layers = [r["layer"] for r in rows]
    axes[1].plot(layers, [r["lens_top1"] for r in rows], "o-", label="top-1 agreement with the output")
    axes[1].plot(layers, [r["lens_top5"] for r in rows], "s-", label="output's top-1 in the lens's top-5")
    if use.tuned_kl is not None:
        axes[0].step(range(use.n_layers), [s / (sum(use.tuned_settled) or 1) for s in use.tuned_settled], "C3", where="mid", label="tuned lens")
        axes[0].legend(fontsize=7)
        axes[1].plot(layers, [r["tuned_top1"] for r in rows], "^-", color="C3", label="tuned lens top-1 (held out)")
    axes[1].set_xlabel("layer")
    axes[1].set_ylabel("share of tokens")
    twin = axes[1].twinx()
    twin.plot(layers, [r["lens_kl"] for r in rows], "k:", label="KL(output || lens)")
    twin.set_ylabel("KL (nats)")
    axes[1].legend(fontsize=7, loc="center left")
    axes[1].set_title("the logit lens per layer" + (" (and the tuned lens)" if use.tuned_kl is not None else ""), fontsize=9)
    fig.suptitle(f"{record['run']['model']}: where the prediction settles ({record['run']['windows']} x {record['run']['seq_len']} tokens of "
                 f"{record['run']['data']})", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def read_depth(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def read_selects(folders: list[Path]) -> list[dict]:
    """The `select` runs `--agree-with` names, each read back or one line."""
    return [read_record(Path(f), "select.json", "select run", needs=("cells",)) for f in folders]


def agreement_table(record: dict) -> Table:
    rows = record["agreement"]
    table = Table(title="do the layers depth-use calls little used match the ones select measures as cheapest to remove?",
                  caption="Spearman's rho over the layers both rank, with its 95% interval (Fisher's z, Bonett and Wright's standard error); "
                          "a measure of use should rise with a layer's removal cost (+) and fall where a search picked the layer (-). "
                          "agrees: the interval leaves 0 out on the expected side; opposite: on the other; cannot tell: it holds 0",
                  caption_justify="left")
    for column in ("measure", "against", "rho [95%]", "layers", "expected", "verdict"):
        table.add_column(column, justify="left" if column in ("measure", "against", "verdict") else "right")
    for row in rows:
        iv = row["interval"]
        rho = "-" if row["rho"] is None else f"{row['rho']:+.2f}" + (f" [{iv[0]:+.2f}, {iv[1]:+.2f}]" if iv else "")
        verdict = {True: "agrees", False: "opposite", None: "cannot tell"}[row["agrees"]]
        table.add_row(row["measure"], row["target"], rho, str(row["layers"]), "+" if row["expected_sign"] > 0 else "-", verdict)
    return table
