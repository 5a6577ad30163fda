"""LLM-Streamline's lightweight FFN (Chen et al., ICLR 2025, arXiv 2403.19135, Table 4: an FFN in
place of the pruned layers): per removed run, the MLP of its first layer with that MLP's norm and
the residual, x + MLP(norm(x)), trained so that it gives the stream the run gave (MSE).

Saved as a stock layer: a copy of the run's first layer whose attention output projection is
zero, so that its attention adds nothing and the layer computes x + MLP(norm(x)) exactly; n - k + 1
layers per run, loaded by `from_pretrained` as it is (its attention still runs, uselessly: the
price of a stock architecture). Where this differs: the paper trains a bare FFN from the hidden
state before the run to the one after it; the authors' later code found a whole layer better
(`--method layer`), which the comparison measures."""

from __future__ import annotations

import copy

import torch
from torch import nn

from depthcurse.heal.linear import attention_output
from depthcurse.heal.methods.layer import Layer
from depthcurse.surgery import find_blocks, find_branch, run_text, runs_of

def ffn_copy(layer: nn.Module) -> nn.Module:
    """A copy of `layer` computing x + MLP(norm(x)): its attention output projection zero and
    frozen (so are the attention and its norm); the MLP and its norm train."""
    new = copy.deepcopy(layer).train()
    new.requires_grad_(False)
    projection = attention_output(new, "the copy")
    with torch.no_grad():
        projection.weight.zero_()
        if getattr(projection, "bias", None) is not None:
            projection.bias.zero_()
    mlp = find_branch(new, "mlp")
    mlp.requires_grad_(True)
    for name in ("post_attention_layernorm", "ln_2", "post_layernorm", "ffn_norm"):  # the MLP's own input norm, where it has one
        norm = getattr(new, name, None)
        if isinstance(norm, nn.Module) and norm is not mlp:
            norm.requires_grad_(True)
    return new


class Ffn(Layer):
    name = "ffn"
    title = "trained FFN (LLM-Streamline)"
    source = "Chen et al. ICLR 2025, arXiv 2403.19135 (the lightweight network: an FFN)"

    def make(self, layer):
        return ffn_copy(layer)

    def check(self, model, layers):
        blocks = find_blocks(model).layers
        for run in runs_of(layers):
            attention_output(blocks[run[0]], f"layer {run[0]}")

    def describe(self):
        return "a trained FFN (MLP, its norm and the residual) per removed run (MSE to the run's output)"

    def changes(self, layers):
        return "; ".join(f"{run_text(run)} replaced by one FFN (layer {run[0]}'s MLP and norm, retrained; its attention output projection "
                         f"zeroed so that it adds nothing), standing where layer {run[0]} stood" for run in runs_of(layers))
