"""The depth map between two models (Csordás, Manning and Potts 2025, Section 5): a linear map from
the residual stream after every layer of a shallow model to the stream after every layer of a
deeper one of the same tokenizer, fitted on some windows of a text and scored on others. If the
deeper model spreads the same computation over more layers, layers at the same relative depth map
best to each other (a diagonal); if it does something new with its extra depth, the deep model's
late layers are out of the shallow one's reach.

Each map is least squares with an intercept and a small ridge (`ridge` times the mean eigenvalue
of the centred input's covariance, so that it does not depend on the stream's scale), fitted on
every token of the fitting windows in float64. Its score is the held-out R^2: 1 - the squared
error over the squared deviation about the fitting windows' mean, per held-out window, then the
mean over windows with a Student's t interval. For each shallow layer, the deep layer it maps to
best and the two relative depths ((layer + 1) / layers), and how well the two orders agree
(Spearman's rho of the shallow layers' relative depth and their best match's).
"""

from __future__ import annotations

import torch

from depthcurse.depth.measure import stepper_of
from depthcurse.errors import DepthcurseError
from depthcurse.prune.stepping import Stepper
from depthcurse.stats.correlation import spearman, spearman_interval
from depthcurse.stats.intervals import mean_interval

RIDGE = 1e-3


def same_tokenizer(a, b) -> bool:
    return a.get_vocab() == b.get_vocab()


@torch.no_grad()
def streams_after_each_layer(stepper: Stepper, windows: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    """The stream after every block, [windows, tokens, width] in float64, batch by batch."""
    batches = [[h.double().cpu() for h in stepper.streams(windows[start : start + batch_size])] for start in range(0, len(windows), batch_size)]
    return [torch.cat([batch[i] for batch in batches]) for i in range(stepper.n_layers)]


def fit_map(x: torch.Tensor, y: torch.Tensor, ridge: float = RIDGE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The least-squares map y ~ x W + b over rows ([tokens, width] each), with the ridge scaled to
    x's covariance; (W, b, y's mean) for the score's baseline."""
    mx, my = x.mean(0), y.mean(0)
    xc, yc = x - mx, y - my
    gram = xc.T @ xc
    lam = ridge * torch.diagonal(gram).mean()
    w = torch.linalg.solve(gram + lam * torch.eye(gram.shape[0], dtype=gram.dtype), xc.T @ yc)
    return w, my - mx @ w, my


def held_out_r2(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, b: torch.Tensor, baseline: torch.Tensor) -> list[float]:
    """Per held-out window ([windows, tokens, width] each), 1 - ||y - (x W + b)||^2 / ||y - baseline||^2."""
    error = ((y - (x @ w + b)) ** 2).sum(dim=(1, 2))
    spread = ((y - baseline) ** 2).sum(dim=(1, 2)).clamp_min(1e-300)
    return (1 - error / spread).tolist()


def depth_map(shallow, deep, fit_windows: torch.Tensor, held_windows: torch.Tensor, batch_size: int, ridge: float = RIDGE,
              on_step=lambda text, done, total: None) -> dict:
    """Every shallow layer's map to every deep layer: held-out R^2 per window, its mean and interval,
    each shallow layer's best match, and the agreement of the two relative-depth orders."""
    if len(held_windows) < 2:
        raise DepthcurseError("the depth map needs at least 2 held-out windows (its intervals are over them)")
    small, large = stepper_of(shallow), stepper_of(deep)  # each checked once: a model the stepper cannot run is one line before any work
    on_step("the shallow model's streams", 0, 2)
    xs_fit, xs_held = streams_after_each_layer(small, fit_windows, batch_size), streams_after_each_layer(small, held_windows, batch_size)
    on_step("the deep model's streams", 1, 2)
    ys_fit, ys_held = streams_after_each_layer(large, fit_windows, batch_size), streams_after_each_layer(large, held_windows, batch_size)
    ns, nd = len(xs_fit), len(ys_fit)
    r2 = [[[] for _ in range(nd)] for _ in range(ns)]
    for i in range(ns):
        on_step(f"maps from shallow layer {i}", i, ns)
        x = xs_fit[i].flatten(0, 1)
        for j in range(nd):
            w, b, baseline = fit_map(x, ys_fit[j].flatten(0, 1), ridge)
            r2[i][j] = held_out_r2(xs_held[i], ys_held[j], w, b, baseline)
    mean = [[sum(v) / len(v) for v in row] for row in r2]
    best = [max(range(nd), key=lambda j: (mean[i][j], -j)) for i in range(ns)]
    shallow_depth = [(i + 1) / ns for i in range(ns)]
    best_depth = [(j + 1) / nd for j in best]
    rho = spearman(shallow_depth, best_depth)
    return {"shallow_layers": ns, "deep_layers": nd, "fit_windows": len(fit_windows), "held_out_windows": len(held_windows), "ridge": ridge,
            "r2": mean, "r2_interval": [[mean_interval(v) for v in row] for row in r2], "best": best,
            "relative_depth": {"shallow": shallow_depth, "best_deep": best_depth,
                               "mean_abs_difference": sum(abs(a - b) for a, b in zip(shallow_depth, best_depth)) / ns,
                               "spearman": rho, "spearman_interval": spearman_interval(rho, ns)}}
