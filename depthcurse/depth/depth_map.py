"""The depth map between two models (Csordás, Manning and Potts 2025, Section 5): a linear map from
a shallow model's residual stream to a deeper one's of the same tokenizer, fitted on some windows of
a text and scored on others. If the deeper model spreads the same computation over more layers,
layers at the same relative depth map best to each other (a diagonal); if it does something new with
its extra depth, the deep model's late layers are out of the shallow one's reach.

Ours (the default): a map from the stream after every shallow layer to the stream after every deep
layer, each pair its own least squares with an intercept and a small ridge (`ridge` times the mean
eigenvalue of the centred input's covariance, so that it does not depend on the stream's scale),
fitted on every token of the fitting windows in float64, and two held-out scores per window, then
their means over windows with Student's t intervals:

- the pooled R^2, 1 - the squared error over the squared deviation about the fitting windows' mean,
  summed over every dimension: a dimension counts by its variance, so where one dimension holds most
  of a stream's variance (a massive activation) the pooled R^2 is mostly that dimension's;
- the per-dimension R^2 (`r2_dims`, the default score): each dimension's R^2, then their mean, so
  every dimension counts alike and no single one can decide it.

How much of each stream's variance its largest dimension holds is kept (`variance`), and the
verdicts say where one dimension holds half of it or more.

Theirs (`--as csordas`, `csordas_map`): one trained linear map from each shallow stream (the
embedding's output too) to all the deep streams at once, scored by the relative error.

For each shallow stream, the deep stream it maps to best by the deciding score, the two relative
depths, and how well the two orders agree (Spearman's rho of the shallow streams' relative depth and
their best match's).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from depthcurse.depth.csordas_map import MapSettings, relative_errors, train_map
from depthcurse.depth.measure import stepper_of
from depthcurse.errors import DepthcurseError
from depthcurse.forecast import Forecast
from depthcurse.io import atomic_write
from depthcurse.kept_state import call_identity
from depthcurse.prune.stepping import Stepper
from depthcurse.stats.correlation import spearman, spearman_interval
from depthcurse.stats.intervals import mean_interval

RIDGE = 1e-3
DOMINANT = 0.5  # a stream whose largest dimension holds this share of its variance or more: the pooled R^2 is mostly that dimension's
SCORES = {
    "r2_dims": ("held-out R^2 per dimension (the mean over dimensions)", True),
    "r2": ("held-out R^2 pooled over dimensions", True),
    "relative_error": ("held-out relative error ||map(x) - y|| / ||y||", False),
}
R2_SCORES = ("r2_dims", "r2")  # at most 1: their intervals are cut there
MAP_DEFINITIONS = {
    "depthcurse": {"name": "depthcurse", "streams": "after", "fit": "ridge least squares per pair of layers (float64)", "scores": ["r2_dims", "r2"],
                   "source": "depthcurse (docs/depth-use.md)"},
    "csordas": {"name": "csordas", "streams": "entering", "fit": "one linear map per shallow stream to every deep stream at once, AdamW on their MSE",
                "scores": ["relative_error"], "source": "Csordás et al. 2025: training/tasks/map_layers.py, ShayanTalaei/llm_effective_depth @ e757a77"},
}


def same_tokenizer(a, b) -> bool:
    return a.get_vocab() == b.get_vocab()


@torch.no_grad()
def streams_of(stepper: Stepper, windows: torch.Tensor, batch_size: int, entering: bool = False, dtype=torch.float64) -> list[torch.Tensor]:
    """The stream after every block (with `entering`, the embedding's output first: every stream a
    layer reads, then the last block's output), [windows, tokens, width] each, batch by batch."""
    batches = []
    for start in range(0, len(windows), batch_size):
        batches.append([h.to(dtype).cpu() for h in stepper.streams(windows[start : start + batch_size], embedding=entering)])
    return [torch.cat([batch[i] for batch in batches]) for i in range(len(batches[0]))]


def fit_map(x: torch.Tensor, y: torch.Tensor, ridge: float = RIDGE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The least-squares map y ~ x W + b over rows ([tokens, width] each), with the ridge scaled to
    x's covariance; (W, b, y's mean) for the scores' baseline."""
    mx, my = x.mean(0), y.mean(0)
    xc, yc = x - mx, y - my
    gram = xc.T @ xc
    lam = ridge * torch.diagonal(gram).mean()
    w = torch.linalg.solve(gram + lam * torch.eye(gram.shape[0], dtype=gram.dtype), xc.T @ yc)
    return w, my - mx @ w, my


def held_out_r2(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, b: torch.Tensor, baseline: torch.Tensor) -> tuple[list[float], list[float]]:
    """Per held-out window ([windows, tokens, width] each): the pooled R^2, 1 - sum_d ||y_d - yhat_d||^2 /
    sum_d ||y_d - baseline_d||^2, and the per-dimension R^2's mean over dimensions, 1 - ||y_d - yhat_d||^2 /
    ||y_d - baseline_d||^2 averaged over d."""
    error = ((y - (x @ w + b)) ** 2).sum(dim=1)  # [windows, width]
    spread = ((y - baseline) ** 2).sum(dim=1).clamp_min(1e-300)
    pooled = 1 - error.sum(-1) / spread.sum(-1)
    dims = (1 - error / spread).mean(-1)
    return pooled.tolist(), dims.tolist()


def largest_dimension_share(stream: torch.Tensor) -> float:
    """The share of a stream's variance ([windows, tokens, width], about its mean over tokens) that its
    largest dimension holds."""
    variance = stream.flatten(0, 1).double().var(0)
    return float(variance.max() / variance.sum().clamp_min(1e-300))


def _summary(per_window: list[list[list[float]]], most: float | None = None) -> dict:
    """A score's mean over windows and its interval, per pair; an interval cut at `most`, where the
    score cannot be higher (an R^2: 1), where the t interval would reach past it."""
    def interval(values):
        iv = mean_interval(values)
        return iv if iv is None or most is None else [iv[0], min(iv[1], most)]
    return {"mean": [[sum(v) / len(v) for v in row] for row in per_window], "interval": [[interval(v) for v in row] for row in per_window]}


def deciding(record: dict) -> tuple[str, list[list[float]], bool]:
    """The score that decides a map's best matches: its name, its matrix, whether higher is better (a
    record from before scores were named: its pooled R^2)."""
    if "scores" not in record:
        return "r2", record["r2"], True
    name = record["score"]
    return name, record["scores"][name]["mean"], SCORES[name][1]


def depth_map(shallow, deep, fit_windows: torch.Tensor, held_windows: torch.Tensor, batch_size: int, ridge: float = RIDGE,
              definitions: str = "depthcurse", score: str | None = None, settings: MapSettings = MapSettings(),
              on_step=lambda text, done, total: None, kept: Path | None = None, on_note=lambda text: None, clock=time.perf_counter) -> dict:
    """Every shallow stream's map to every deep stream, by `definitions` ("depthcurse": ridge per pair,
    R^2 pooled and per dimension; "csordas": their trained map and its relative error): each score per
    held-out window, its mean and interval, each shallow stream's best match by `score` (default: the
    per-dimension R^2, or their relative error), how much of each stream's variance its largest
    dimension holds, and the agreement of the two relative-depth orders. With `kept` (a file), each
    finished shallow stream's row of scores is written there and an interrupted map takes the rows
    up: the rerun's record is an uninterrupted run's. After the first row, `on_note` hears how long the
    rest will take (`forecast`), kept in the record beside the time taken."""
    identity = call_identity(depth_map, locals())  # both models, both sets of windows, every setting
    if definitions not in MAP_DEFINITIONS:
        raise DepthcurseError(f"--as {definitions}: no such definitions for the depth map (known: {', '.join(MAP_DEFINITIONS)})")
    known = MAP_DEFINITIONS[definitions]
    score = score or known["scores"][0]
    if score not in known["scores"]:
        raise DepthcurseError(f"--score {score}: the {definitions} map gives {', '.join(known['scores'])}")
    if len(held_windows) < 2:
        raise DepthcurseError("the depth map needs at least 2 held-out windows (its intervals are over them)")
    if definitions == "csordas":
        settings.check()
    small, large = stepper_of(shallow), stepper_of(deep)  # each checked once: a model the stepper cannot run is one line before any work
    entering = known["streams"] == "entering"
    dtype = torch.float32 if definitions == "csordas" else torch.float64
    on_step("the shallow model's streams", 0, 2)
    xs_fit, xs_held = (streams_of(small, w, batch_size, entering, dtype) for w in (fit_windows, held_windows))
    on_step("the deep model's streams", 1, 2)
    ys_fit, ys_held = (streams_of(large, w, batch_size, entering, dtype) for w in (fit_windows, held_windows))
    ns, nd = len(xs_fit), len(ys_fit)
    per_window = {name: [[[] for _ in range(nd)] for _ in range(ns)] for name in known["scores"]}
    rows_done = 0
    if kept is not None and kept.is_file():
        try:
            restored = json.loads(kept.read_text())
            if restored["identity"] == identity:
                rows_done = restored["rows"]
                for name in known["scores"]:
                    per_window[name][:rows_done] = restored["per_window"][name]
        except (OSError, ValueError, KeyError):
            rows_done = 0

    def keep(rows: int) -> None:
        if kept is not None:  # whole or not at all
            atomic_write(kept, json.dumps({"identity": identity, "rows": rows, "of": ns,
                                           "per_window": {name: per_window[name][:rows] for name in known["scores"]}}))
    forecast = Forecast("the map's rows (one per shallow stream)", say=on_note, clock=clock)
    if definitions == "csordas":
        y_fit, y_held = torch.stack(ys_fit, dim=-2), torch.stack(ys_held, dim=-2)  # [windows, tokens, streams, width]: every deep stream at once
        for i, _ in forecast.over(range(ns), rows_done, kept_in=kept):
            on_step(f"training the map from shallow stream {i} (their loop)", i, ns)
            errors = relative_errors(train_map(xs_fit[i], y_fit, settings), xs_held[i], y_held)
            for j in range(nd):
                per_window["relative_error"][i][j] = errors[:, j].tolist()
            keep(i + 1)
    else:
        for i, _ in forecast.over(range(ns), rows_done, kept_in=kept):
            on_step(f"maps from shallow layer {i}", i, ns)
            x = xs_fit[i].flatten(0, 1)
            for j in range(nd):
                w, b, baseline = fit_map(x, ys_fit[j].flatten(0, 1), ridge)
                per_window["r2"][i][j], per_window["r2_dims"][i][j] = held_out_r2(xs_held[i], ys_held[j], w, b, baseline)
            keep(i + 1)
    scores = {name: {**_summary(values, 1.0 if name in R2_SCORES else None), "label": SCORES[name][0], "higher_is_better": SCORES[name][1]}
              for name, values in per_window.items()}
    matrix, higher = scores[score]["mean"], SCORES[score][1]
    best = [max(range(nd), key=lambda j: (matrix[i][j] if higher else -matrix[i][j], -j)) for i in range(ns)]

    def relative(index: int, layers: int) -> float:  # a stream after layer i: (i + 1) / layers; entering layer i (0 the embedding): i / layers
        return index / layers if entering else (index + 1) / layers

    shallow_depth = [relative(i, ns - entering) for i in range(ns)]
    best_depth = [relative(j, nd - entering) for j in best]
    rho = spearman(shallow_depth, best_depth)
    record = {"definitions": {**known, "settings": settings.summary() if definitions == "csordas" else {"ridge": ridge}},
              "streams": known["streams"], "shallow_layers": ns - entering, "deep_layers": nd - entering, "fit_windows": len(fit_windows),
              "held_out_windows": len(held_windows), "ridge": ridge, "scores": scores, "score": score, "best": best,
              "variance": {"shallow": [largest_dimension_share(x) for x in xs_fit], "deep": [largest_dimension_share(y) for y in ys_fit],
                           "dominant_at": DOMINANT},
              "relative_depth": {"shallow": shallow_depth, "best_deep": best_depth,
                                 "mean_abs_difference": sum(abs(a - b) for a, b in zip(shallow_depth, best_depth)) / ns,
                                 "spearman": rho, "spearman_interval": spearman_interval(rho, ns)}}
    record["forecast"] = forecast.summary()
    if "r2" in scores:  # what readers from before the scores were named read
        record["r2"], record["r2_interval"] = scores["r2"]["mean"], scores["r2"]["interval"]
    return record
