"""Merging a run of layers into the layer before it, instead of removing the run: the weight
arithmetic of LaCo (Yang et al., Findings of EMNLP 2024, arXiv 2402.11187; yangyifei729/LaCo @
8483587, `laco_llama-13b.ipynb`) and Sliding-Window Merging (AAAI 2026; 920927/Sliding-Window-Merging
@ 8fa008e, `SLM.py`), the `Merge` method both recovery methods are, and the merged model their
selection procedures run.

What is merged: every weight of a block that does not belong to a norm (on Llama-likes the
attention's q, k, v, o and the MLP's gate, up and down projections: exactly the seven both scripts
merge). Biases (Qwen2's q, k and v) stay the base layer's own by default, as the scripts, which
touch `.weight` alone, leave them; `biases=True` merges them by the same rule. The norms stay the
base layer's own, as both scripts leave them.

Three rules, each on the base layer's tensor `w` and the run's tensors `t_1 .. t_m`:
- LaCo as its paper writes RDSC: `w + sum_k (t_k - w)`, differences from the *original* base
  (computed in float64, then cast);
- LaCo as its released code computes it: `w.add_(t_k - w)` in place, k = 1 .. m, each difference
  from the *updated* base, so that `w` ends equal to `t_m` (up to the rounding of the dtype's
  additions, which the port reproduces operation for operation);
- Sliding-Window Merging's code: `w.add_((t_j - w) * f)` in place for j over the whole window, the
  base itself first (a zero step), an exponential moving average with weight f (their default 1:
  the last layer of the window, as LaCo's code).
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from depthcurse.errors import DepthcurseError
from depthcurse.surgery import find_blocks, placed_layers, removed_layers, run_text


def is_norm(module: nn.Module) -> bool:
    return "Norm" in type(module).__name__


def merged_names(block: nn.Module, biases: bool = False) -> list[str]:
    """The parameters of `block` a merge changes: every weight whose module is not a norm, and its
    biases too where `biases` (the authors' code merges weights alone)."""
    names = []
    for prefix, module in block.named_modules():
        if is_norm(module):
            continue
        names += [f"{prefix}.{n}" if prefix else n for n, _ in module.named_parameters(recurse=False) if biases or n != "bias"]
    return names


def projections_text(block: nn.Module, biases: bool = False) -> str:
    """The merged parameters in a line: `self_attn.q_proj.weight, ..., mlp.down_proj.weight`, and
    what became of the biases where the block has some."""
    kept = [n for n in merged_names(block, True) if n not in merged_names(block, biases)]
    return ", ".join(merged_names(block, biases)) + (f" (its biases, {', '.join(kept)}, the base layer's own, as the authors' code leaves them)"
                                                      if kept else "")


@torch.no_grad()
def rdsc_paper(base: torch.Tensor, run: list[torch.Tensor]) -> torch.Tensor:
    """LaCo's RDSC as its paper writes it: theta_l + sum_k (theta_{l+k} - theta_l)."""
    w = base.double()
    return (w + sum(t.double() - w for t in run)).to(base.dtype)


@torch.no_grad()
def rdsc_code(base: torch.Tensor, run: list[torch.Tensor]) -> torch.Tensor:
    """LaCo's `merge_layers_return_model` as it runs: each difference from the updated base."""
    w = base.clone()
    for t in run:
        w.add_(t - w)
    return w


# LaCo's merge by `as=`: the paper's formula, or what the released notebook computes
RDSC_FORMS = {"paper": rdsc_paper, "code": rdsc_code}


@torch.no_grad()
def sliding_window_code(base: torch.Tensor, run: list[torch.Tensor], weight_factor: float = 1.0) -> torch.Tensor:
    """Sliding-Window Merging's `merge_layers_return_model` as it runs: the window's layers from
    the base itself on, each a step of `weight_factor` from the updated base towards it."""
    w = base.clone()
    for t in [base, *run]:
        w.add_((t - w) * weight_factor)
    return w


def check_weight_factor(value: float, said: str) -> None:
    """One line where SWM's weight factor (`said`: how the user gave it) is no step towards a layer."""
    if not (math.isfinite(value) and 0 < value <= 1):
        raise DepthcurseError(f"{said}={value}: a step towards each layer lies in (0, 1] (SLM.py uses 1)")


def check_run(model: nn.Module, run: tuple[int, ...], method: str) -> None:
    """One line where `run` cannot be merged into the layer before it (`method`: the option that
    asked, `--method laco` or `--search swm`)."""
    blocks = find_blocks(model).layers
    if run[0] == 0:
        raise DepthcurseError(f"{method}: it merges each removed run into the layer before it, and {run_text(run)} starts at layer 0, "
                              "which has none: remove from layer 1 on")
    base = blocks[run[0] - 1]
    merged = set(merged_names(base, True))  # the biases too: a layer of another shape cannot merge either way
    shapes = {name: tuple(p.shape) for name, p in base.named_parameters() if name in merged}
    for i in run:
        other = {name: tuple(p.shape) for name, p in blocks[i].named_parameters() if name in shapes}
        if type(blocks[i]) is not type(base) or other != shapes:
            differs = next((name for name in shapes if other.get(name) != shapes[name]), type(blocks[i]).__name__)
            raise DepthcurseError(f"{method}: layer {i} differs from layer {run[0] - 1} in shape ({differs}), so it cannot be merged into it")


def check_uniform(model: nn.Module, owner: str) -> None:
    """One line where some layer cannot merge with the others (a procedure may merge any two)."""
    blocks = find_blocks(model).layers
    for i in range(1, len(blocks)):
        check_run(model, (i,), owner)


@torch.no_grad()
def merged_block(blocks, base: int, run: list[int], rule, biases: bool = False) -> nn.Module:
    """A copy of `blocks[base]` whose merged parameters are `rule(base's, [each run layer's])`."""
    out = copy.deepcopy(blocks[base])
    params = dict(out.named_parameters())
    theirs = [dict(blocks[i].named_parameters()) for i in run]
    for name in merged_names(out, biases):
        params[name].copy_(rule(params[name].detach(), [t[name].detach() for t in theirs]))
    return out.requires_grad_(False)


@contextlib.contextmanager
def merged_model(model: nn.Module, placed: dict[int, nn.Module], gone: tuple[int, ...]) -> Iterator[nn.Module]:
    """`model` with each merged layer in its base's place and the merged-away layers removed."""
    with placed_layers(model, placed), removed_layers(model, gone):
        yield model


@dataclass
class Merging:
    """A selection procedure's merged model, merge by merge (LaCo's and SWM's searches): the kept
    layers in order, by their index in the unpruned model, and the merged ones among them."""

    n: int
    kept: list[int]
    merged: dict[int, nn.Module]

    @classmethod
    def start(cls, n: int) -> "Merging":
        return cls(n, list(range(n)), {})

    def gone(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.n) if i not in self.kept)

    def merge(self, blocks, low: int, high: int, rule, biases: bool = False) -> "Merging":
        """The layers at positions low+1 .. high of the merged model merged into the one at `low`."""
        base = self.kept[low]
        layer = lambda i: self.merged.get(i, blocks[i])  # noqa: E731 (a merged layer merges again as it now is)
        run = self.kept[low + 1 : high + 1]
        out = merged_block({base: layer(base), **{i: layer(i) for i in run}}, base, run, rule, biases)
        return Merging(self.n, [i for i in self.kept if i not in run], {**{k: v for k, v in self.merged.items() if k not in run}, base: out})

    def model(self, model: nn.Module):
        return merged_model(model, self.merged, self.gone())


@torch.no_grad()
def last_hidden(model: nn.Module, windows: torch.Tensor) -> list[torch.Tensor]:
    """The model's last hidden state (after its final norm, as `hidden_states[-1]` of transformers),
    one window at a time, as both authors' scripts take it."""
    device = model.get_input_embeddings().weight.device
    return [model(input_ids=w[None].to(device), output_hidden_states=True, use_cache=False).hidden_states[-1].float().cpu() for w in windows]


def mean_similarity(reference: list[torch.Tensor], other: list[torch.Tensor]) -> float:
    """The scripts' similarity: per window, the cosine between the two last hidden states each
    flattened to one vector (every token's), then the mean over windows."""
    sims = [torch.cosine_similarity(a.flatten()[None].double(), b.flatten()[None].double()).item() for a, b in zip(reference, other)]
    return float(sum(sims) / len(sims))


def check_threshold(value: float, owner: str) -> None:
    if not (math.isfinite(value) and -1 < value <= 1):
        raise DepthcurseError(f"--search-args {owner}.threshold={value}: a cosine similarity threshold lies in (-1, 1]")


def similarity_range(trail) -> str:
    """The similarities a procedure met (`trail`: its steps, the similarity third), as a range."""
    return f"{min(t[2] for t in trail):.4f}-{max(t[2] for t in trail):.4f}"


def merged_away(name: str, state: "Merging", trail, k: int, threshold: float) -> tuple[int, ...]:
    """The layers a procedure merged away, or one line where it stopped short of k."""
    gone = state.gone()
    if len(gone) < k:
        raise DepthcurseError(f"--search {name} merged {len(gone)} of k = {k} layers away at threshold {threshold} "
                              f"(similarities {similarity_range(trail)}): lower {name}.threshold")
    return gone
