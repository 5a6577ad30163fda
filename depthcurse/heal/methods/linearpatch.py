"""LinearPatch (Chen et al., NeurIPS 2025, arXiv 2505.24680; code chenxinrui-tsinghua/LinearPatch):
at each cut, the stream entering the first layer after the removed run is multiplied by one
matrix P = H D H^T: H a Hadamard rotation, the authors' own matrix (`depthcurse.heal.hadamard`: QuaRot's
stored matrices times Sylvester's doublings; which spreads the few channels with huge outliers over
all of them), D per-channel scales that make the rotated stream's mean magnitude before the cut
that of the stream the run would have given (`layer_select.get_scale_params`, averaged batch by
batch). `rotate=false` is the code's `diag`: P = D. Optionally P is then trained by distillation
(`distill=true`: heal's steps, KL to the unpruned model); the paper distils offline on the top-K
logits, here the full distribution, online.

P acts on the whole residual stream, which no weight of a stock pre-norm layer can absorb: the
checkpoint is the stock pruned model with P kept beside it (`patches.PATCH_FILE`), which
depthcurse puts back when it loads the folder; `from_pretrained` alone gives the plain removal.
The authors' code keeps it as a module too (a forward hook)."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
from torch import nn

from depthcurse.heal.hadamard import hadamard, stored_order
from depthcurse.heal.method import HealContext, Method, at_least
from depthcurse.heal.objective import HealObjective
from depthcurse.heal.streams import stream_after, stream_before
from depthcurse.patches import FINAL, final_norm, patched, save_patches
from depthcurse.surgery import find_blocks, removed_layers, run_text, runs_of


@dataclass
class LinearPatchSettings:
    calib_tokens: int = 16384
    rotate: bool = True  # the Hadamard rotation (the paper's); false: a diagonal scale alone
    distill: bool = False  # then trained by KL to the unpruned model, for heal's --steps


class LinearPatch(Method):
    name = "linearpatch"
    title = "linear patch (LinearPatch)"
    source = "Chen et al. NeurIPS 2025, arXiv 2505.24680; github.com/chenxinrui-tsinghua/LinearPatch"
    Settings = LinearPatchSettings
    loss_name = "distill loss"

    def check_settings(self):
        at_least(self.settings, "calib_tokens")
        self.trains = self.settings.distill

    def check(self, model, layers):
        d = model.get_input_embeddings().weight.shape[-1]
        if self.settings.rotate and stored_order(d) is None:
            hadamard(d)  # says in one line why not
        n = len(find_blocks(model).layers)
        if max(layers) == n - 1:
            final_norm(model)  # a cut at the end patches the stream entering the final norm

    def describe(self):
        s = self.settings
        how = "a Hadamard rotation and channel scales" if s.rotate else "channel scales"
        return f"{how} per cut on {s.calib_tokens:,} calibration tokens" + (", then distilled" if s.distill else "")

    def changes(self, layers):
        return ("; ".join(f"the stream after {run_text(run)} multiplied by a {self._d} x {self._d} patch" for run in runs_of(layers))
                + f", kept beside the weights in {'linear_patch.safetensors'} (depthcurse puts it back; from_pretrained alone does not)")

    @property
    def _d(self):
        return getattr(self, "hidden", "d")

    def _sites(self, model, layers) -> dict[int, int | str]:
        """Each run's first layer -> where its patch goes in the unpruned numbering (the block after the run, or the final norm)."""
        n = len(find_blocks(model).layers)
        return {run[0]: (run[-1] + 1 if run[-1] + 1 < n else FINAL) for run in runs_of(layers)}

    @torch.no_grad()
    def prepare(self, ctx: HealContext):
        started = time.perf_counter()
        model = ctx.model
        model.requires_grad_(False)  # only the patches train (distill=true)
        d = model.get_input_embeddings().weight.shape[-1]
        self.hidden = d
        rotation = hadamard(d).float() if self.settings.rotate else torch.eye(d)
        batches = ctx.calibration(self.settings.calib_tokens)
        blocks = find_blocks(model).layers
        self.sites = self._sites(model, ctx.layers)
        runs = runs_of(ctx.layers)
        self.patches: dict[int, torch.Tensor] = {}
        for run in runs:
            earlier = tuple(i for r in runs if r[0] < run[0] for i in r)
            ratio, count = None, 0
            with self._patched(model, earlier_only=run[0]), removed_layers(model, earlier):
                kept = [i for i in range(len(blocks)) if i not in earlier]
                first, last = find_blocks(model).layers[kept.index(run[0])], find_blocks(model).layers[kept.index(run[-1])]
                for ids in ctx.steps(f"the patch after {run_text(run)}: calibration batches", batches):
                    ids = ids.to(ctx.device)
                    before = stream_before(model, first, ids).float().flatten(0, -2) @ rotation.to(ctx.device)
                    after = stream_after(model, last, ids).float().flatten(0, -2) @ rotation.to(ctx.device)
                    r = after.abs().mean(0) / before.abs().mean(0)
                    ratio = r if ratio is None else ratio + r
                    count += 1
            total = ctx.world.sum(torch.stack([ratio.double().cpu(), torch.full_like(ratio, count).double().cpu()]))
            scales = (total[0] / total[1]).float()
            self.patches[run[0]] = rotation @ torch.diag(scales) @ rotation.T  # P = H D H^T
        tokens = int(ctx.world.sum(torch.tensor(sum(b.numel() for b in batches))).item())
        self.calibration = {"seconds": round(time.perf_counter() - started, 3), "tokens": tokens}
        self._trainable()

    def _trainable(self):
        self.weights = nn.ParameterDict({str(k): nn.Parameter(p.float(), requires_grad=self.settings.distill) for k, p in self.patches.items()})

    def _patched(self, model, earlier_only: int | None = None):
        """The model with the patches on (with `earlier_only`, those of runs before that layer)."""
        weights = getattr(self, "weights", None)
        chosen = {first: (weights[str(first)] if weights is not None else p) for first, p in getattr(self, "patches", {}).items()
                  if earlier_only is None or first < earlier_only}
        return patched(model, {self.sites[first]: p for first, p in chosen.items()})

    def state_dict(self):
        return {"patches": {str(k): v for k, v in self.patches.items()}, "sites": {str(k): v for k, v in self.sites.items()},
                "calibration": self.calibration, "hidden": self.hidden}

    def load_state_dict(self, state, ctx):
        self.patches = {int(k): v for k, v in state["patches"].items()}
        self.sites = {int(k): v if v == FINAL else int(v) for k, v in state["sites"].items()}
        self.calibration, self.hidden = state["calibration"], state["hidden"]
        self._trainable()

    def objective(self, ctx):
        holder = nn.Module()
        holder.weights = self.weights
        return HealObjective(ctx, self, "distill", [holder])

    def applied(self, model):
        return self._patched(model) if getattr(self, "patches", None) else contextlib.nullcontext(model)

    def cost(self, model, layers):
        d = model.get_input_embeddings().weight.shape[-1]
        n = len(runs_of(layers)) * d * d
        return {"trained_params": n if self.settings.distill else 0, "added_params": n, "solved_params": 0 if self.settings.distill else len(runs_of(layers)) * d}

    def extra_files(self, folder, layers):
        sites = {}
        for first, site in self.sites.items():
            matrix = self.weights[str(first)].detach()
            sites[FINAL if site == FINAL else sum(1 for i in range(site) if i not in layers)] = matrix  # the block's index in the pruned model
        save_patches(sites, folder)
        return {"patches": "linear_patch.safetensors"}
