"""ReplaceMe's least-squares map (Shopkhoev et al., 2025, arXiv 2505.02819; code mts-ai/ReplaceMe,
`lstsq`): per removed run, the map T with  y + m T ~ x_after  solved in closed form on calibration
tokens, folded into the MLP output projection of the block before the run. No training, no new
module: the saved model is the unpruned architecture less k layers."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from depthcurse.errors import DepthcurseError
from depthcurse.fitting import MIN_FIT_RATIO, check_fit
from depthcurse.heal.linear import LeastSquares, check_linear, estimate_maps, fold_maps, mapped, output_projection
from depthcurse.heal.method import HealContext, Method, at_least
from depthcurse.surgery import find_blocks, runs_of


@dataclass
class LinearSettings:
    calib_tokens: int = 16384  # tokens of the training text the maps are estimated on
    ridge: float = 0.0  # pulls each map toward the identity (the plain removal), relative to the mean eigenvalue of its Gram matrix
    min_fit_ratio: float = MIN_FIT_RATIO  # the fewest calibration tokens per input of a map accepted (below 1: under-determined)


class Linear(Method):
    """A linear map per removed run, folded into the weights; which map, `solver` says."""

    name = "linear"
    title = "linear map (ReplaceMe)"
    source = "Shopkhoev et al. 2025, arXiv 2505.02819; github.com/mts-ai/ReplaceMe (lstsq)"
    Settings = LinearSettings
    fit_note: str | None = None  # what `check` or `prepare` found of the map's calibration tokens (`fitting.check_fit`)

    def check_settings(self):
        at_least(self.settings, "calib_tokens")
        if not self.settings.ridge >= 0:
            raise DepthcurseError(f"--ridge must be 0 or more, got {self.settings.ridge}")

    def solver(self, ctx: HealContext):
        return lambda d, device: LeastSquares(d, device, self.settings.ridge)

    def fit_check(self, tokens: int, d: int, where: str) -> str | None:
        """`fitting.check_fit` of a d x d map on `tokens` calibration tokens: None, a note (kept for
        `describe`), or one line refusing below `min_fit_ratio` of its d inputs."""
        return check_fit(tokens, d, min_ratio=self.settings.min_fit_ratio, what=f"--method {self.name}'s {d} x {d} least-squares map ({where})",
                         fix=lambda n: f"give --calib-tokens {n} or more", accept=lambda ratio: f"--method-args min_fit_ratio={ratio}",
                         solution="the ridge's, shrunk toward the identity" if self.settings.ridge else "the minimum-norm map")

    def check(self, model, layers):
        check_linear(model, layers)
        d = model.get_input_embeddings().weight.shape[-1]
        self.fit_note = self.fit_check(self.settings.calib_tokens, d, f"calib_tokens {self.settings.calib_tokens:,}")

    def describe(self):
        return (f"a linear map per removed run on {self.settings.calib_tokens:,} calibration tokens"
                + (f", ridge {self.settings.ridge}" if self.settings.ridge else "")
                + (f" ({self.fit_note})" if self.fit_note else ""))

    def changes(self, layers):
        return "; ".join(f"a {_dim(self)} linear map folded into the MLP output projection of layer {run[0] - 1} (before layers {run[0]}-{run[-1]})"
                         for run in runs_of(layers)) + ": those weights changed, no new module"

    def untouched(self, layers):
        return min(layers) - 1

    def prepare(self, ctx: HealContext):
        started = time.perf_counter()
        batches = ctx.calibration(self.settings.calib_tokens)
        tokens = int(ctx.world.sum(torch.tensor(sum(b.numel() for b in batches))).item())
        d = ctx.model.get_input_embeddings().weight.shape[-1]
        self.fit_note = self.fit_check(tokens, d, "the tokens the calibration text gave")
        self.maps = estimate_maps(ctx.model, ctx.layers, batches, reduce=ctx.world.sum, solver=self.solver(ctx),
                                  on_batch=ctx.hear("the linear maps' calibration batches"))
        self.calibration = {"seconds": round(time.perf_counter() - started, 3), "tokens": tokens}
        self.hidden = ctx.model.get_input_embeddings().weight.shape[-1]

    def state_dict(self):
        return {"maps": {str(k): t for k, t in self.maps.items()}, "calibration": self.calibration, "hidden": self.hidden}

    def load_state_dict(self, state, ctx):
        self.maps = {int(k): t for k, t in state["maps"].items()}
        self.calibration, self.hidden = state["calibration"], state["hidden"]

    def applied(self, model):
        return mapped(model, self.maps) if getattr(self, "maps", None) else contextlib.nullcontext(model)

    def cost(self, model, layers):
        d = model.get_input_embeddings().weight.shape[-1]
        return {"trained_params": 0, "added_params": 0, "solved_params": len(runs_of(layers)) * d * d}

    def finalize(self, model):
        fold_maps(model, self.maps)
        return model


def _dim(method) -> str:
    d = getattr(method, "hidden", None)
    return f"{d} x {d}" if d else "d x d"


def projection_names(model, layers) -> list[str]:
    """The full names of the weights a map is folded into, for a card."""
    blocks = find_blocks(model).layers
    names = {id(m): n for n, m in model.named_modules()}
    return [names[id(output_projection(blocks[run[0] - 1], f"layer {run[0] - 1}"))] + ".weight" for run in runs_of(layers)]
