"""`depth-use`'s run on a text, and its results: a rich table per layer, verdicts, `depth_use.json`,
`depth_use.csv`, the influence heatmap and the settling figure."""

from __future__ import annotations

import contextlib
import csv
import json
import math
import time
from dataclasses import asdict
from pathlib import Path

from rich.table import Table

from depthcurse import vocab_scores
from depthcurse.depth.definitions import DEFINITIONS, Definitions, definitions_of, same_definitions
from depthcurse.depth.measure import TUNED, DepthUse, half_settled, influence_row_means, measure_depth_use, per_layer_rows, phase_transition, stepper_of
from depthcurse.depth.memory import Shape, check_fits, free_bytes, gib
from depthcurse.depth.over_seeds import architecture
from depthcurse.depth.tuned_lens import PARTIAL_FILE, LensSettings, load_lens, partial_step, train_tuned_lens
from depthcurse.errors import DepthcurseError
from depthcurse.forecast import Forecast
from depthcurse.io import atomic_write, csv_text, environment, json_text, read_record, save_figure
from depthcurse.loading import check_sequence_length
from depthcurse.runtime import World
from depthcurse.stats.intervals import mean_interval
from depthcurse.stats.verdicts import difference_word
from depthcurse.tasks import PerplexityTask
from depthcurse.text import load_texts

DEPTH_JSON = "depth_use.json"


def run_depth_use(loaded, data: str, windows: int, seq_len: int, batch_size: int, influence: bool = True, on_step=lambda text, done, total: None,
                  tuned: bool = False, lens: Path | None = None, lens_windows: int | None = None, lens_settings: LensSettings = LensSettings(),
                  lens_out: Path | None = None, world: World = World(), definitions: Definitions = DEFINITIONS["depthcurse"],
                  on_note=lambda text: None, free: int | None = -1, kept: Path | None = None, clock=time.perf_counter) -> dict:
    """`windows` windows of `seq_len` tokens of `data` (ppl's packing), measured; the record. With
    `tuned`, a tuned lens is trained on the next `lens_windows` windows of the same text (held out
    from the measured ones; default as many) and read beside the logit lens, and saved to `lens_out`
    (a lens already there for this model and these settings is read instead: a rerun trains none);
    with `lens`, a saved one is read. `definitions`: ours, or an anchor's own (`depth.definitions`).
    Before any work the peak memory beyond the weights is estimated (`depth.memory`) and said
    (`on_note`), and a run that would not fit in `free` bytes (-1: what is free now; None: unknown) is
    one line naming the batch size that fits. With `kept` (a file), the measurement's finished batches
    are kept there, as the lens's training is beside `lens_out`: an interrupted run resumes."""
    started = clock()
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
    free = free_bytes(stepper.device) if free == -1 else free  # every input checked: what the work will hold, before any of it
    need = check_fits(Shape.of(loaded.model), batch_size, seq_len, free, lens_settings.micro_batch if tuned else 0)
    on_note(f"memory: about {gib(need)} beyond the model's weights at its peak" + (f" ({gib(free)} free)" if free is not None else ""))
    model = loaded.model.eval()
    forecasts: dict[str, dict] = {}  # each long part's forecast, said after its first step, beside the time it took
    if tuned:
        saved = lens_out if lens_out is not None and lens_out.is_file() else None
        if saved is not None:
            with contextlib.suppress(DepthcurseError):
                translators, training = load_lens(saved, stepper)
                if training.get("settings") != asdict(lens_settings) or training.get("train_windows") != lens_windows:
                    translators = None  # another training's lens: trained again
        if translators is None:  # its state kept beside the lens after every step: an interrupted training resumes
            partial = lens_out.parent / PARTIAL_FILE if lens_out is not None else None
            lens_forecast = Forecast("the tuned lens's steps", say=on_note, clock=clock)
            translators, training = train_tuned_lens(model, stepper, ids[windows:], lens_settings, on_step=on_step, state=partial,
                                                     forecast=lens_forecast)
            forecasts["the tuned lens's steps"] = lens_forecast.summary()
            if lens_out is not None:
                translators.save(lens_out, training)
                partial.unlink(missing_ok=True)
    measuring = Forecast("the measurement's batches of windows", say=on_note, clock=clock)
    use = measure_depth_use(model, ids[:windows], batch_size, influence=influence, on_step=on_step, tuned=translators, world=world,
                            definitions=definitions, kept=kept, forecast=measuring)
    forecasts["the measurement's batches of windows"] = measuring.summary()
    if kept is not None:  # measured whole: what a rerun would take up is the record now
        kept.unlink(missing_ok=True)
    record = {"run": {**{k: v for k, v in loaded.describe().items() if k != "device"}, "architecture": architecture(loaded.model), "data": label,
                      "windows": windows, "seq_len": seq_len},
              "definitions": definitions.summary(), "memory_estimate_bytes": need, "use": use.summary(), "layers": per_layer_rows(use),
              "phase_transition": phase_transition(use), "forecasts": forecasts, "wall_time_s": round(clock() - started, 3),
              "vocabulary_scores": vocab_scores.status(loaded.device), "environment": environment()}  # what read the lens rows and skips
    if translators is not None:
        record["tuned_lens"] = {**training, "source": str(lens) if lens is not None else "trained here",
                                "held_out_kl": [row["tuned_kl"] for row in record["layers"]],
                                "logit_lens_kl": [row["lens_kl"] for row in record["layers"]]}
    return record


KEPT_FILE = "depth_use.partial.json"


def kept_summary(folder: Path) -> str:
    """What an interrupted depth-use left in `folder` to resume from, in words."""
    parts = []
    lens = partial_step(folder / PARTIAL_FILE)
    if lens is not None:
        parts.append(f"the tuned lens's first {lens[0]} of {lens[1]} steps")
    with contextlib.suppress(OSError, ValueError, KeyError):
        kept = json.loads((folder / KEPT_FILE).read_text())
        parts.append(f"{kept['batches']} of {kept['of']} batches of windows measured")
    return (" and ".join(parts) + f" kept in {folder}") if parts else "nothing had finished"


def _use(record: dict) -> DepthUse:
    return DepthUse(**record["use"])


def _cell(value: float, interval) -> str:
    return f"{value:.3f}" + (f" [{interval[0]:.3f}, {interval[1]:.3f}]" if interval else "")


def depth_table(record: dict) -> Table:
    run, d = record["run"], definitions_of(record)
    use = _use(record)
    over = "windows (Student's t)" if d.reduce == "mean" else "windows"
    skipped = "the largest over tokens and windows (no interval)" if d.reduce == "max" else "means over tokens and windows"
    table = Table(title=f"{run['model']}: how each layer is used, {run['windows']} windows x {run['seq_len']} tokens of {run['data']} "
                        f"({d.name} definitions)",
                  caption="attention / MLP: the sublayer's output norm over the residual stream it is added to, and their cosine (Csordás et al. 2025, "
                          f"Fig. 2); lens: the model's final norm and head on the stream {'entering' if d.lens_reads == 'entering' else 'after'} the "
                          f"layer, against its output ({d.kl_label}, top-1, {d.top5_label}); settles here: tokens whose lens top-1 is the output's "
                          "from this row on; influence: the layer skipped"
                          + (f" from token {d.skip_from} on" if d.skip_from else "") + f", the relative change of every later layer's contribution "
                          f"(its row's mean over the later layers), and the output's {d.change_label}: {skipped}. Other figures: means over windows, "
                          f"in brackets the 95% interval over {over}. Definitions: {d.source}", caption_justify="left")
    tuned = use.tuned_kl is not None
    if tuned:
        lens = record["tuned_lens"]
        table.caption += (f"; tuned lens: one affine translator per stream (Belrose et al. 2023), trained on {lens['train_windows']} other windows of "
                          f"the text ({lens['settings']['steps']} steps), read on these (held out)")
    influence = _influence_means(use)
    for column in ("layer", "attention ||a||/||h||", "MLP ||m||/||h||", "cos(a, h)", "cos(m, h)", "lens KL", "lens top-1", "lens top-5",
                   "settles here", *(("tuned lens KL", "tuned top-1", "tuned settles here") if tuned else ()), "influence on later layers",
                   f"output {'KL' if d.output_change == 'kl' else 'change'} when skipped"):
        table.add_column(column, justify="right")
    for row in record["layers"]:
        i = row["layer"]
        table.add_row(str(i), *(_cell(row[n], row[f"{n}_interval"]) for n in ("attn_norm", "mlp_norm", "attn_cos", "mlp_cos", "lens_kl", "lens_top1", "lens_top5")),
                      f"{row['settled_share']:.1%}",
                      *((_cell(row["tuned_kl"], row["tuned_kl_interval"]), _cell(row["tuned_top1"], row["tuned_top1_interval"]),
                         f"{row['tuned_settled_share']:.1%}") if tuned else ()),
                      f"{influence[i]:.3f}" if influence[i] is not None else "-", f"{use.output_change[i]:.3f}" if use.output_change else "-")
    return table


def _influence_means(use: DepthUse) -> list[float | None]:
    """Each layer's influence row's mean over the later layers (None for the last, and without the matrix)."""
    return [*influence_row_means(use), None] if use.influence else [None] * use.n_layers


def depth_overview(records: list[dict], names: list[str]) -> Table:
    """Runs side by side, a row each: what each measured on, its phase transition, where half of the
    predictions have settled by each lens, and the layer whose skip changes the output most."""
    table = Table(title="depth-use runs side by side", caption="phase transition: the change point of the influence rows (docs/depth-use.md); "
                  "half settled: the layer by which half of the tokens' lens top-1 stays the output's; most changing skip: the layer whose "
                  "removal moves the output most (by the definitions' output change)", caption_justify="left")
    same_definitions(records, names, what="depth-use runs")
    for column in ("run", "model", "text", "layers", "phase transition", "half settled (logit lens)", "half settled (tuned lens)", "most changing skip"):
        table.add_column(column, justify="left" if column in ("run", "model", "text") else "right")
    table.caption += f" ({definitions_of(records[0]).name} definitions)" if records else ""
    for name, record in zip(names, records):
        use, run = _use(record), record["run"]
        phase = record.get("phase_transition")
        worst = max(range(use.n_layers), key=lambda i: use.output_change[i]) if use.output_change else None
        table.add_row(name, str(run.get("model")), f"{run['data']}, {run['windows']} x {run['seq_len']}", str(use.n_layers),
                      "-" if phase is None else f"{phase} ({phase / use.n_layers:.0%})", str(half_settled(use.settled)),
                      "-" if use.tuned_settled is None else str(half_settled(use.tuned_settled)), "-" if worst is None else str(worst))
    return table


def lens_comparison(record: dict) -> dict | None:
    """The tuned lens against the logit lens, row by row on the same windows: the difference of their
    KLs to the output (tuned - logit) with its paired 95% interval (Student's t over the windows), the
    word it gives ("closer" below 0, "further" above, "cannot tell"), and the ratio of the means
    (logit / tuned); the rows where both read the output itself are left out. None without a tuned lens."""
    use = _use(record)
    if use.tuned_kl is None:
        return None
    rows = []
    for layer, (plain, lensed) in enumerate(zip(use.lens_kl, use.tuned_kl)):
        if plain == lensed:  # the output's own stream: both read it as it is
            continue
        differences = [t - p for t, p in zip(lensed, plain)]
        interval = mean_interval(differences)
        rows.append({"row": layer, "difference": sum(differences) / len(differences), "interval": interval,
                     "verdict": difference_word(interval, "further", "closer"),
                     "ratio": (sum(plain) / sum(lensed)) if sum(lensed) > 0 else None})
    words = [r["verdict"] for r in rows]
    ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
    return {"rows": rows, "closer": words.count("closer"), "further": words.count("further"), "cannot_tell": words.count("cannot tell"),
            "ratio_range": [min(ratios), max(ratios)] if ratios else None}


def depth_verdicts(record: dict) -> list[str]:
    use, d = _use(record), definitions_of(record)
    lines = []
    settled = use.settled
    total = sum(settled) or 1

    def where(row: int) -> str:
        return d.row_label(row, use.n_layers)

    lines.append(f"half of the tokens' predictions have settled by the stream {where(half_settled(settled))} of {use.n_layers} layers (logit lens; "
                 f"{settled[-1] / total:.0%} settle only at the output)")
    compared = lens_comparison(record)
    if compared is not None:
        lens = record["tuned_lens"]
        ratio = compared["ratio_range"]
        lines.append(f"tuned lens: half settled by the stream {where(half_settled(use.tuned_settled))}; on the held-out windows its {d.kl_label} against the "
                     f"logit lens's, paired over {use.windows} windows: closer at {compared['closer']} of {len(compared['rows'])} rows, further at "
                     f"{compared['further']}, cannot tell at {compared['cannot_tell']}"
                     + (f"; the logit lens's KL is {ratio[0]:.1f}-{ratio[1]:.1f}x the tuned lens's" if ratio else "")
                     + f" (trained on {lens['train_windows']} windows, {lens['settings']['steps']} steps, {lens['seconds']:.0f} s)")
    phase = record.get("phase_transition")
    if phase is not None:
        means = influence_row_means(use)
        lines.append(f"phase transition at layer {phase} of {use.n_layers} ({phase / use.n_layers:.0%} of the depth): the one drop in how much each "
                     f"layer's skip changes the later layers' work (the influence rows' means, least squares; docs/depth-use.md), "
                     f"{sum(means[:phase]) / phase:.3f} before it, {sum(means[phase:]) / len(means[phase:]):.3f} from it on")
    if use.output_change:
        worst = max(range(use.n_layers), key=lambda i: use.output_change[i])
        lines.append(f"skipping layer {worst} changes the output most ({d.change_label} {use.output_change[worst]:.3f})")
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
                             *(("tuned_settled_share",) if tuned else ()), "output_kl_when_skipped" if definitions_of(record).output_change == "kl"
                             else "output_l2_change_when_skipped"])
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

    matplotlib.use("Agg")  # pragma: no mutate (the drawing's look: what it marks is tested, not its colours and sizes)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 5.4), dpi=120)  # pragma: no mutate
    grid = [[v if v is not None and v == v else math.nan for v in row] for row in use.influence]
    im = ax.imshow(grid, cmap="magma", origin="upper")  # pragma: no mutate
    ax.set_xlabel("later layer j")
    ax.set_ylabel("layer i skipped")
    d = definitions_of(record)
    fig.colorbar(im, ax=ax, label=f"{'largest' if d.reduce == 'max' else 'mean'} ||c_j(skip i) - c_j|| / ||c_j|| ({d.name} definitions)")
    ax.set_title(f"{record['run']['model']}: whose later work each layer changes\n({record['run']['windows']} x {record['run']['seq_len']} "
                 f"tokens of {record['run']['data']})", fontsize=9)  # pragma: no mutate
    fig.tight_layout()  # pragma: no mutate
    return save_figure(fig, path)


def plot_settling(record: dict, path: Path) -> Path:
    """Left: where each token's prediction settles (logit lens), as a share of tokens per layer. Right:
    the lens's top-1 agreement and KL to the output per layer."""
    import matplotlib  # lazy: only figures need matplotlib

    matplotlib.use("Agg")  # pragma: no mutate (the drawing's look: what it marks is tested, not its colours and sizes)
    import matplotlib.pyplot as plt

    use, rows, d = _use(record), record["layers"], definitions_of(record)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), dpi=120)  # pragma: no mutate
    total = sum(use.settled) or 1
    axes[0].bar(range(len(use.settled)), [s / total for s in use.settled], color="C0")
    axes[0].set_xlabel(f"the stream {'entering' if d.lens_reads == 'entering' else 'after'} layer ... from which the lens's top-1 stays the output's"
                       + (f" ({use.n_layers}: the output)" if d.lens_reads == "entering" else ""))
    axes[0].set_ylabel("share of tokens")
    axes[0].set_title("settling depth (bars: logit lens)", fontsize=9)  # pragma: no mutate
    layers = [r["layer"] for r in rows]
    axes[1].plot(layers, [r["lens_top1"] for r in rows], "o-", label="top-1 agreement with the output")
    axes[1].plot(layers, [r["lens_top5"] for r in rows], "s-", label=d.top5_label)
    if use.tuned_kl is not None:
        axes[0].step(range(len(use.tuned_settled)), [s / (sum(use.tuned_settled) or 1) for s in use.tuned_settled], "C3", where="mid", label="tuned lens")
        axes[0].legend(fontsize=7)  # pragma: no mutate
        axes[1].plot(layers, [r["tuned_top1"] for r in rows], "^-", color="C3", label="tuned lens top-1 (held out)")
    axes[1].set_xlabel(f"layer (the stream {'entering' if d.lens_reads == 'entering' else 'after'} it)")
    axes[1].set_ylabel("share of tokens")
    twin = axes[1].twinx()
    twin.plot(layers, [r["lens_kl"] for r in rows], "k:", label=d.kl_label)
    twin.set_ylabel("KL (nats)")
    axes[1].legend(fontsize=7, loc="center left")  # pragma: no mutate
    axes[1].set_title("the logit lens per layer" + (" (and the tuned lens)" if use.tuned_kl is not None else ""), fontsize=9)  # pragma: no mutate
    fig.suptitle(f"{record['run']['model']}: where the prediction settles ({record['run']['windows']} x {record['run']['seq_len']} tokens of "  # pragma: no mutate
                 f"{record['run']['data']})", fontsize=10)  # pragma: no mutate
    fig.tight_layout()  # pragma: no mutate
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
                          "agrees: the interval leaves 0 out on the expected side; opposite: on the other; cannot tell: it holds 0. The target's "
                          "distinct values: how many values it takes over the layers (a pick's membership: 2)",
                  caption_justify="left")
    for column in ("measure", "against", "rho [95%]", "layers", "the target's distinct values", "expected", "verdict"):
        table.add_column(column, justify="left" if column in ("measure", "against", "verdict") else "right")
    for row in rows:
        iv = row["interval"]
        rho = "-" if row["rho"] is None else f"{row['rho']:+.2f}" + (f" [{iv[0]:+.2f}, {iv[1]:+.2f}]" if iv else "")
        verdict = row.get("verdict") or {True: "agrees", False: "opposite", None: "cannot tell"}[row["agrees"]]  # a record from before the word was kept
        distinct = row.get("distinct")
        table.add_row(row["measure"], row["target"], rho, str(row["layers"]), "-" if distinct is None else str(distinct),
                      "+" if row["expected_sign"] > 0 else "-", verdict)
    return table
