"""LLM-Streamline's trained layer (Chen et al., ICLR 2025, arXiv 2403.19135; code
Lyy1029/LLM-Streamline): per removed run, a copy of its first layer trained so that, from the
stream the unpruned model brings to the run, it gives the stream the run gave (MSE). The saved
checkpoint keeps that layer where the run began: n - k + 1 layers per run, a stock architecture."""

from __future__ import annotations

import torch

from depthcurse.heal.method import HealContext, Method
from depthcurse.heal.replacement import ReplacementObjective, removed_with, trainable_copy
from depthcurse.surgery import placed_layers, run_text, runs_of


class Layer(Method):
    name = "layer"
    title = "trained layer (LLM-Streamline)"
    source = "Chen et al. ICLR 2025, arXiv 2403.19135 (the lightweight network: a Transformer layer)"
    trains = True
    loss_name = "MSE to the removed runs' output"
    next_token_loss = False  # an MSE has no next-token scale: only a non-finite one diverged

    def make(self, layer):
        return trainable_copy(layer)

    def describe(self):
        return "a trained layer per removed run (MSE to the run's output)"

    def changes(self, layers):
        return "; ".join(f"{run_text(run)} replaced by one layer trained to give {'their' if len(run) > 1 else 'its'} output (initialised from "
                         f"layer {run[0]}), standing where layer {run[0]} stood" for run in runs_of(layers))

    def removes(self, layers):
        return removed_with(layers)

    def prepare(self, ctx: HealContext):
        torch.manual_seed(ctx.seed)
        self.trainer = ReplacementObjective(ctx.model, ctx.layers, make=self.make)
        self.replacements = self.trainer.replaced()

    def objective(self, ctx):
        return self.trainer

    def applied(self, model):
        return placed_layers(model, getattr(self, "replacements", {}))

    placed = applied

    def modules(self):
        return list(getattr(self, "replacements", {}).values())

    def cost(self, model, layers):
        trained = sum(p.numel() for m in self.modules() for p in m.parameters() if p.requires_grad)
        return {"trained_params": trained, "added_params": sum(p.numel() for m in self.modules() for p in m.parameters()), "solved_params": 0}
