"""Tuning only the last layers and the head (Lu et al., "Reassessing Layer Pruning in LLMs: New
Insights and Methods", ICLR 2026, arXiv 2411.15558; code yaolu-zjut/Navigation-LLM-layer-pruning):
after the removal, the last `layers` kept layers and `lm_head` are trained in full on the
next-token loss, everything else frozen. The paper removes the last 25% of layers and tunes the
last three left, which beat LoRA there.

The tuned layers and head are copies, swapped in while the healed model runs, so that the model
in memory stays the unpruned one for the measurements and a distillation's teacher. On a model
whose head is its input embedding (tied: SmolLM2), tuning the head tunes the embedding too, as
training a tied model does; `head=false` leaves both."""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch
from torch import nn

from depthcurse.errors import DepthcurseError
from depthcurse.heal.method import HealContext, Method
from depthcurse.heal.objective import HealObjective
from depthcurse.surgery import find_blocks, placed_layers


@dataclass
class TuneLastSettings:
    layers: int = 3  # the last kept layers trained in full
    head: bool = True  # and the output head
    loss: str = "lm"


class TuneLast(Method):
    name = "tune-last"
    title = "the last layers and the head tuned"
    source = "Lu et al. ICLR 2026, arXiv 2411.15558 (partial-layer fine-tuning: lm_head and the last three layers)"
    Settings = TuneLastSettings
    trains = True

    def check_settings(self):
        if self.settings.layers < 0:
            raise DepthcurseError(f"--method-args layers must be 0 or more, got {self.settings.layers}")
        if self.settings.layers == 0 and not self.settings.head:
            raise DepthcurseError("--method-args layers=0,head=false tunes nothing")
        if self.settings.loss not in ("lm", "distill"):
            raise DepthcurseError(f"unknown --loss {self.settings.loss!r}: use lm (next-token) or distill (KL from the unpruned model)")
        self.loss_name = f"{self.settings.loss} loss"

    def _tuned(self, model, layers) -> list[int]:
        kept = [i for i in range(len(find_blocks(model).layers)) if i not in layers]
        return kept[len(kept) - self.settings.layers:] if self.settings.layers else []

    def check(self, model, layers):
        kept = len(find_blocks(model).layers) - len(layers)
        if self.settings.layers > kept:
            raise DepthcurseError(f"it tunes the last {self.settings.layers} kept layers, and the removal keeps {kept}")
        if self.settings.head and model.get_output_embeddings() is None:
            raise DepthcurseError(f"it tunes the output head, and {type(model).__name__} has none")

    def describe(self):
        s = self.settings
        return f"the last {s.layers} kept layers" + (" and the head" if s.head else "") + f" trained in full, {s.loss} loss"

    def changes(self, layers):
        s = self.settings
        tied = getattr(self, "tied", False)
        head = (" and the output head" + (" (tied to the input embedding, which changed with it)" if tied else "")) if s.head else ""
        return f"layers {', '.join(map(str, getattr(self, 'tuned', [])))} (the last {s.layers} kept){head} trained in full"

    def untouched(self, layers):
        return 0 if self.settings.head else min(min(layers), min(self.tuned or [min(layers)]))

    def prepare(self, ctx: HealContext):
        model = ctx.model
        self.tuned = self._tuned(model, ctx.layers)
        blocks = find_blocks(model).layers
        model.requires_grad_(False)
        self.copies = {i: copy.deepcopy(blocks[i]).requires_grad_(True) for i in self.tuned}
        head = model.get_output_embeddings()
        self.tied = head is not None and head.weight is model.get_input_embeddings().weight
        self.head = nn.Parameter(head.weight.detach().clone()) if self.settings.head else None

    def objective(self, ctx):
        holder = nn.ModuleList(self.copies.values())
        if self.head is not None:
            holder.register_parameter("head", self.head)
        return HealObjective(ctx, self, self.settings.loss, [holder])

    @contextlib.contextmanager
    def applied(self, model):
        with placed_layers(model, getattr(self, "copies", {})), self._head(model):
            yield model

    placed = applied

    @contextlib.contextmanager
    def _head(self, model):
        if getattr(self, "head", None) is None:
            yield
            return
        out, inp = model.get_output_embeddings(), model.get_input_embeddings()
        old = out.weight
        out.weight = self.head
        if self.tied:
            inp.weight = self.head
        try:
            yield
        finally:
            out.weight = old
            if self.tied:
                inp.weight = old

    def modules(self):
        return list(getattr(self, "copies", {}).values())

    def finalize(self, model):
        # the tuned head put in for good (the layers go in at `placed`, as they are saved)
        if self.head is not None:
            with torch.no_grad():
                model.get_output_embeddings().weight.copy_(self.head)
        return model

    def cost(self, model, layers):
        trained = sum(p.numel() for m in self.modules() for p in m.parameters()) + (self.head.numel() if getattr(self, "head", None) is not None else 0)
        return {"trained_params": trained, "added_params": 0, "solved_params": 0}
