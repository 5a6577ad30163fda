"""LoRA adapters on the kept blocks, trained on text (Gromov et al., "The Unreasonable
Ineffectiveness of the Deeper Layers", 2024: QLoRA healing on C4 after the removal), with peft.
The adapters start at zero (B = 0), so the healed model starts as the pruned one; saved, they
are merged into their weights, and kept in peft's format for the pruned model too."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch

from depthcurse.errors import DepthcurseError
from depthcurse.heal.adapters import PARTS, add_adapters, save_adapters, target_modules, trainable
from depthcurse.heal.method import HealContext, Method, at_least
from depthcurse.heal.objective import HealObjective

ADAPTERS = "adapters"  # inside hf/: the adapters in peft's format
LOSSES = ("lm", "distill")
ADAPT = ("all", "after")  # every kept block, or only those after the first removed layer


@dataclass
class LoraSettings:
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.05
    targets: str = "mlp"  # the paper's: the MLPs; attn or all
    adapt: str = "all"
    loss: str = "lm"  # next-token, as the paper; distill: KL from the unpruned model


class Lora(Method):
    name = "lora"
    title = "LoRA"
    source = "Gromov et al. 2024, arXiv 2403.17887; peft"
    Settings = LoraSettings
    trains = True

    def check_settings(self):
        s = self.settings
        at_least(s, "lora_rank")
        if not s.lora_alpha > 0:
            raise DepthcurseError(f"--lora-alpha must be positive, got {s.lora_alpha}")
        if not 0 <= s.lora_dropout < 1:
            raise DepthcurseError(f"--lora-dropout must be in [0, 1), got {s.lora_dropout}")
        if s.targets not in PARTS:
            raise DepthcurseError(f"unknown --targets {s.targets!r}: use mlp (the paper's), attn or all")
        if s.adapt not in ADAPT:
            raise DepthcurseError(f"unknown --adapt {s.adapt!r}: use all (every kept block) or after (the blocks after the first removed layer)")
        if s.loss not in LOSSES:
            raise DepthcurseError(f"unknown --loss {s.loss!r}: use lm (next-token) or distill (KL from the unpruned model)")
        self.loss_name = f"{s.loss} loss"

    def _after(self, layers) -> int | None:
        return min(layers) if self.settings.adapt == "after" else None

    def check(self, model, layers):
        target_modules(model, layers, self.settings.targets, self._after(layers))

    def describe(self):
        s = self.settings
        return f"LoRA rank {s.lora_rank} on {s.targets}" + (" after the first removed layer" if s.adapt == "after" else "") + f", {s.loss} loss"

    def changes(self, layers):
        s = self.settings
        where = "the kept blocks after the first removed layer" if s.adapt == "after" else "every kept block"
        return f"LoRA adapters (rank {s.lora_rank}, on the {s.targets} of {where}) merged into those weights"

    def untouched(self, layers):
        return min(layers) if self.settings.adapt == "after" else 0

    def prepare(self, ctx: HealContext):
        s = self.settings
        torch.manual_seed(ctx.seed)  # the adapters' A matrices: the same on every rank and every resume
        self.peft = add_adapters(ctx.model, ctx.layers, targets=s.targets, rank=s.lora_rank, alpha=s.lora_alpha, dropout=s.lora_dropout,
                                 after=self._after(ctx.layers))

    def objective(self, ctx: HealContext):
        shared = min(m.untouched(ctx.layers) for m in [*ctx.earlier, self])
        return HealObjective(ctx, self, self.settings.loss, [ctx.model], shared_blocks=shared)

    @contextlib.contextmanager
    def bypassed(self, model):
        peft = getattr(self, "peft", None)
        with peft.disable_adapter() if peft is not None else contextlib.nullcontext():
            yield model

    def cost(self, model, layers):
        peft = getattr(self, "peft", None)
        return {"trained_params": sum(p.numel() for p in trainable(peft)) if peft is not None else 0, "added_params": 0, "solved_params": 0}

    def extra_files(self, folder: Path, layers):
        save_adapters(self.peft, layers, Path(folder) / ADAPTERS)
        return {"adapters": ADAPTERS}

    def finalize(self, model):
        return self.peft.merge_and_unload()  # merged in the dtype it trained in
