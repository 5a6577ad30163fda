"""LLM-Streamline's replacements (Chen et al., ICLR 2025): one trained module in place of each removed run.

For a contiguous run i..j, a module made from layer i (`make`: a copy of the layer, or of its
MLP alone) is trained so that, given the stream the unpruned model brings to layer i (and
everything else layer i was called with: rotary embeddings, mask), it leaves the stream the run
left after layer j: the mean squared error over the hidden size, summed over the positions with
a target. The model is frozen and runs once per batch without a gradient, up to the last run's
end; only the new modules train, so no backward pass goes through the model. Saved, each new
module stands where layer i stood (`placed`) and the rest of its run is gone: a normal
checkpoint with n - k + 1 layers per run.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Callable, Iterator

import torch
from torch import nn

from depthcurse.heal.streams import StopForward, first_tensor, run_stopped
from depthcurse.surgery import find_blocks, placed_layers, removed_layers, runs_of


class ReplacementObjective(nn.Module):
    """What `train.loop.train_step` trains for `--method layer`: `(ids, targets) -> summed loss`.
    The replacement layers are its only trainable parameters (`replacements`, one per run, keyed
    by the run's first layer)."""

    def __init__(self, model: nn.Module, layers: tuple[int, ...], make: Callable[[nn.Module], nn.Module] | None = None):
        super().__init__()
        self.runs = runs_of(layers)
        self.model = model.requires_grad_(False)  # frozen: the teacher, whose streams the new layers learn to give
        blocks = find_blocks(model).layers
        make = make or trainable_copy
        self.replacements = nn.ModuleDict({str(run[0]): make(blocks[run[0]]) for run in self.runs})

    def replaced(self) -> dict[int, nn.Module]:
        return {int(first): layer for first, layer in self.replacements.items()}

    def train(self, mode: bool = True) -> "ReplacementObjective":
        super().train(mode)
        self.model.eval()  # the frozen model gives the streams as it gives them in use: no dropout
        return self

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        inputs, outputs = self._streams(ids)
        scored = (targets != -100).unsqueeze(-1)
        total = torch.zeros((), dtype=torch.float32, device=ids.device)
        for run in self.runs:
            args, kwargs = inputs[run[0]]
            out = first_tensor(self.replacements[str(run[0])](*args, **kwargs)).float()
            error = (out - outputs[run[-1]].float()).pow(2).mean(-1, keepdim=True)
            total = total + torch.where(scored, error, 0.0).sum()
        return total

    @torch.no_grad()
    def _streams(self, ids: torch.Tensor):
        """What the frozen model calls each run's first layer with, and the stream each run's last
        layer leaves, in one forward stopped after the deepest run."""
        blocks = find_blocks(self.model).layers
        inputs, outputs, handles = {}, {}, []
        deepest = self.runs[-1][-1]

        def take_input(first):
            def hook(module, args, kwargs):
                inputs[first] = (args, kwargs)
            return hook

        def take_output(last):
            def hook(module, args, output):
                outputs[last] = first_tensor(output).detach()
                if last == deepest:
                    raise StopForward
            return hook

        for run in self.runs:
            handles.append(blocks[run[0]].register_forward_pre_hook(take_input(run[0]), with_kwargs=True))
            handles.append(blocks[run[-1]].register_forward_hook(take_output(run[-1])))
        try:
            run_stopped(self.model, ids)
        finally:
            for h in handles:
                h.remove()
        return inputs, outputs


def trainable_copy(layer: nn.Module) -> nn.Module:
    new = copy.deepcopy(layer)
    new.train()
    for p in new.parameters():
        p.requires_grad_(True)
    return new


def removed_with(layers: tuple[int, ...]) -> tuple[int, ...]:
    """The layers a replacement removes: each run but its first layer, whose place the new layer takes."""
    return tuple(i for run in runs_of(layers) for i in run[1:])


@contextlib.contextmanager
def replaced(model: nn.Module, replacements: dict[int, nn.Module], layers: tuple[int, ...]) -> Iterator[nn.Module]:
    """`model` with each new layer where its run's first layer stands and the rest of each run
    removed (n - k + 1 layers per run); put back afterwards."""
    with placed_layers(model, replacements), removed_layers(model, removed_with(layers)):
        yield model
