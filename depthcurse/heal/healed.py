"""The model in memory and what a method added to it, as any of the three models a heal measures.

One copy of the weights serves as the unpruned model (every layer; the adapters off, no map, no
new layer), the pruned one (the layers removed) and the healed one (the layers removed and, by
method: LoRA adapters on, the linear maps applied after their MLPs, each removed run's new layer
in its place), entered and left again for each batch if need be. Saving makes the healed model a
normal checkpoint: the adapters merged, the maps folded into their output projections, the new
layers standing where their runs began, in the dtype the source was stored in.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from depthcurse.heal.adapters import save_adapters
from depthcurse.heal.linear import fold_maps, mapped
from depthcurse.heal.replacement import removed_with, replaced
from depthcurse.io import atomic_write
from depthcurse.surgery import removed_layers, save_pruned

MODELS = ("unpruned", "pruned", "healed")
ADAPTERS = "adapters"  # inside hf/: the LoRA adapters in peft's format
# On the held-out windows: next-token loss and perplexity, and how far from the unpruned model's
# predictions (KL, in nats per token, and the share of top-1 tokens it agrees on).
HELD_OUT_METRICS = ("loss", "ppl", "kl", "agreement")


@dataclass
class Healed:
    model: nn.Module  # the transformers model (its linears wrapped by peft where there are adapters)
    layers: tuple[int, ...]  # removed
    peft: object | None = None  # peft's model around `model`, where there are adapters
    maps: dict[int, torch.Tensor] = field(default_factory=dict)  # a run's first layer -> its linear map
    replacements: dict[int, nn.Module] = field(default_factory=dict)  # a run's first layer -> the layer trained in its place

    @contextlib.contextmanager
    def as_model(self, name: str) -> Iterator[nn.Module]:
        """The model in memory as the `name` model of `MODELS`."""
        adapters_off = self.peft.disable_adapter() if self.peft is not None and name != "healed" else contextlib.nullcontext()
        with adapters_off:
            if name == "unpruned":
                yield self.model
            elif name == "pruned":
                with removed_layers(self.model, self.layers):
                    yield self.model
            elif self.replacements:
                with replaced(self.model, self.replacements, self.layers):
                    yield self.model
            else:
                with mapped(self.model, self.maps), removed_layers(self.model, self.layers):
                    yield self.model

    def layer_count(self, n: int) -> int:
        """The healed model's layers, of the unpruned `n`."""
        return n - len(removed_with(self.layers) if self.replacements else self.layers)

    def save(self, tokenizer, out: Path, dtype: torch.dtype | None = None) -> Path:
        """The healed model saved (atomically) as a checkpoint `from_pretrained` loads, in `dtype`
        (the source checkpoint's); LoRA adapters alone on the pruned model also in peft's format,
        in `ADAPTERS/` inside it. Changes the model in memory: afterwards it is the healed one,
        merged, folded and cast."""
        def write(tmp: Path) -> None:
            if self.peft is not None and not self.maps:  # on a map, the adapters belong to the mapped model, not to `drop`'s
                save_adapters(self.peft, self.layers, tmp / ADAPTERS)
            model = self.peft.merge_and_unload() if self.peft is not None else self.model  # merged in the dtype it trained in
            self.peft, self.model = None, model
            if self.maps:
                fold_maps(model, self.maps)
                self.maps = {}
            if dtype is not None:
                model.to(dtype)
                for layer in self.replacements.values():
                    layer.to(dtype)
            if self.replacements:
                with replaced(model, self.replacements, self.layers):
                    save_pruned(model, tokenizer, (), tmp)
            else:
                save_pruned(model, tokenizer, self.layers, tmp)

        atomic_write(Path(out), write, folder=True)
        return Path(out)
