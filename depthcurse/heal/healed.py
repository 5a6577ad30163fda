"""The model in memory and what a method did to it, as any of the three models a heal measures.

One copy of the weights serves as the unpruned model (every layer; the method's changes off), the
pruned one (the layers removed) and the healed one (the method's changes on, the layers it
removes gone), entered and left again for each batch if need be. Saving makes the healed model a
normal checkpoint from a copy of the model and the method (the changes folded or merged into the
weights, new layers in place, in the dtype the source was stored in), so that the model in memory
stays the unpruned one: the saved checkpoint is measured against it.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from depthcurse.heal.method import Method
from depthcurse.io import atomic_write
from depthcurse.surgery import removed_layers, save_pruned

MODELS = ("unpruned", "pruned", "healed")
# On the held-out windows: next-token loss and perplexity, and how far from the unpruned model's
# predictions (KL, in nats per token, and the share of top-1 tokens it agrees on).
HELD_OUT_METRICS = ("loss", "ppl", "kl", "agreement")


@dataclass
class Healed:
    model: nn.Module  # the transformers model in memory (its linears wrapped by peft where there are adapters)
    layers: tuple[int, ...]  # removed
    method: Method

    @contextlib.contextmanager
    def as_model(self, name: str) -> Iterator[nn.Module]:
        """The model in memory as the `name` model of `MODELS`."""
        if name == "healed":
            with self.method.applied(self.model), removed_layers(self.model, self.method.removes(self.layers)):
                yield self.model
            return
        with self.method.bypassed(self.model), removed_layers(self.model, self.layers if name == "pruned" else ()):
            yield self.model

    def layer_count(self, n: int) -> int:
        """The healed model's layers, of the unpruned `n`."""
        return n - len(self.method.removes(self.layers))

    def save(self, tokenizer, out: Path, dtype: torch.dtype | None = None) -> tuple[Path, dict]:
        """The healed model saved (atomically) as a checkpoint `from_pretrained` loads, in `dtype`
        (the source checkpoint's), made from a copy: the method's files first (LoRA's adapters in
        peft's format), then its changes put into the weights. Returns the folder and what the
        method's files are."""
        files: dict = {}

        def write(tmp: Path) -> None:
            model, method = copy.deepcopy((self.model, self.method))  # one memo: the copy's method holds the copy's modules
            files.update(method.extra_files(tmp, self.layers))
            model = method.finalize(model)
            with method.placed(model):
                if dtype is not None:
                    model.to(dtype)
                save_pruned(model, tokenizer, method.removes(self.layers), tmp)
            del model, method

        atomic_write(Path(out), write, folder=True)
        return Path(out), files
