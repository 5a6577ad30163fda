"""ReplaceMe (Shopkhoev et al., 2025): a removal won back without training, by one linear map per cut.

For a contiguous run of removed layers i..j, the block before it (i - 1) adds its MLP's output m
to the stream y it got from its attention, leaving y + m; the removed run would have left x_{j+1}.
The map T is the least-squares solution of  y + m T = x_{j+1}  over calibration tokens, and is
folded into that MLP's output projection (W <- T^T W, b <- T^T b), so that the saved model is the
unpruned architecture minus k layers, with no new module. Runs are estimated in order of depth,
each with the runs before it already removed and mapped, against the unpruned model's stream.

The solution is written as a correction of the identity, T = I + D: the plain removal is D = 0,
and the ridge term pulls D toward it. With G = M^T M and C = M^T (x_{j+1} - y - m) summed over the
tokens, D = (G + ridge * tr(G)/d * I)^+ C, solved in fp64 (the pseudo-inverse: the smallest
correction when G is singular, as with fewer tokens than dimensions).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn

from depthcurse.errors import DepthcurseError
from depthcurse.heal.streams import first_tensor, stream_after
from depthcurse.surgery import branch_output, find_blocks, find_branch, removed_layers

# The MLP's last linear layer, by the names transformers gives it (Llama/Mistral/Qwen/Gemma,
# GPT-2, GPT-NeoX/Falcon, Phi/OPT-style, Mixtral-style experts' w2 is not a dense MLP).
OUTPUT_PROJECTIONS = ("down_proj", "c_proj", "dense_4h_to_h", "fc2", "fc_out", "w2", "proj_out")


def runs_of(layers: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The contiguous runs of `layers` (sorted): 3,4,5,9 -> (3,4,5), (9,)."""
    runs: list[list[int]] = []
    for i in sorted(layers):
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return [tuple(r) for r in runs]


def foldable_mlp(block: nn.Module, where: str) -> nn.Module:
    """The block's MLP, where a map after it can be folded into it; one clear error where it
    cannot: no MLP branch (Post-LN), a norm or a learned scale between the MLP and the stream
    (Gemma 2/3 and OLMo-2 post-norms, LayerScale: a linear map does not pass a norm)."""
    kind = type(block).__name__
    found = branch_output(block, "mlp")
    if found is None:
        raise DepthcurseError(f"--method linear folds a map into the MLP output of {where}, but {kind} is a Post-LN block (its MLP output is normalised with the stream): "
                              "use --method lora or layer")
    meets, scale = found
    mlp = find_branch(block, "mlp")
    if meets is not mlp or scale is not None:
        what = "a learned scale" if scale is not None else f"a norm ({type(meets).__name__})"
        raise DepthcurseError(f"--method linear folds a map into the MLP output of {where}, but {kind} puts {what} between its MLP and the stream, "
                              "which a folded linear map cannot pass: use --method lora or layer")
    return mlp


def output_projection(block: nn.Module, where: str) -> nn.Module:
    """The last linear layer of the block's `foldable_mlp`, whose output the MLP gives; one clear
    error where it has none as a dense layer (fused experts)."""
    mlp = foldable_mlp(block, where)
    for name in OUTPUT_PROJECTIONS:
        projection = getattr(mlp, name, None)
        if isinstance(projection, nn.Linear) or type(projection).__name__ == "Conv1D":
            return projection
    raise DepthcurseError(f"--method linear folds a map into the MLP output projection of {where}, but {type(mlp).__name__} has none of "
                          f"{', '.join(OUTPUT_PROJECTIONS)} as a dense linear layer (fused experts?): use --method lora or layer")


def check_linear(model: nn.Module, layers: tuple[int, ...]) -> None:
    """Every run of `layers` has a kept block before it whose MLP output a map can be folded into."""
    blocks = find_blocks(model).layers
    for run in runs_of(layers):
        if run[0] == 0:
            raise DepthcurseError(f"--method linear folds a map into the block before each removed run, and layer 0 (removed with {_run_text(run)}) has none before it: "
                                  "use --method lora or layer")
        output_projection(blocks[run[0] - 1], f"layer {run[0] - 1}, before {_run_text(run)}")


def _run_text(run: tuple[int, ...]) -> str:
    return f"layer {run[0]}" if len(run) == 1 else f"layers {run[0]}-{run[-1]}"


def solve_map(gram: torch.Tensor, cross: torch.Tensor, ridge: float = 0.0) -> torch.Tensor:
    """T = I + D, D the least-squares (ridge) solution of (M^T M + r I) D = M^T (target - y - m)
    from the sums `gram` = M^T M and `cross` = M^T (target - y - m); fp64 on the CPU."""
    gram, cross = gram.detach().double().cpu(), cross.detach().double().cpu()
    d = gram.shape[0]
    if ridge > 0:
        gram = gram + ridge * gram.diagonal().mean() * torch.eye(d, dtype=gram.dtype)
    correction = torch.linalg.lstsq(gram, cross, driver="gelsd").solution  # the minimum-norm solution where gram is singular
    return torch.eye(d, dtype=torch.float64) + correction


@dataclass
class _RunStats:
    gram: torch.Tensor
    cross: torch.Tensor
    tokens: int = 0


def _apply_map(t: torch.Tensor) -> Callable:
    def hook(module, args, output):
        return output @ t.to(output.dtype)  # m -> m T, T in fp32 while training, the weights' dtype for bf16 output
    return hook


@contextlib.contextmanager
def mapped(model: nn.Module, maps: dict[int, torch.Tensor]) -> Iterator[nn.Module]:
    """`model` with each map applied as a separate step after the MLP of the block before its run
    (`maps`: the run's first removed layer -> T): what folding computes, kept apart so the model in
    memory is the unpruned one again afterwards. The layers are not removed here."""
    blocks = find_blocks(model).layers
    hooks = []
    try:
        for first, t in maps.items():
            mlp = foldable_mlp(blocks[first - 1], f"layer {first - 1}")
            hooks.append(mlp.register_forward_hook(_apply_map(t.to(next(mlp.parameters()).device, torch.float32))))
        yield model
    finally:
        for h in hooks:
            h.remove()


def estimate_maps(model: nn.Module, layers: tuple[int, ...], batches: list[torch.Tensor], *, ridge: float = 0.0,
                  reduce: Callable[[torch.Tensor], torch.Tensor] = lambda x: x, on_batch: Callable[[int, int], None] | None = None) -> dict[int, torch.Tensor]:
    """One map per run of `layers`, in order of depth (first removed layer -> T, fp64 on the CPU),
    from the token ids in `batches` (every position counts: packed rows have no padding).
    `reduce` sums the statistics over ranks (this rank's share of the batches in each)."""
    check_linear(model, layers)
    blocks = find_blocks(model).layers
    device = model.get_input_embeddings().weight.device
    maps: dict[int, torch.Tensor] = {}
    runs = runs_of(layers)
    done, total = 0, len(runs) * len(batches)
    for run in runs:
        before, last = blocks[run[0] - 1], blocks[run[-1]]
        mlp = foldable_mlp(before, f"layer {run[0] - 1}")
        d = model.get_input_embeddings().weight.shape[-1]
        stats = _RunStats(torch.zeros(d, d, dtype=torch.float64, device=device), torch.zeros(d, d, dtype=torch.float64, device=device))
        earlier = tuple(i for r in runs if r[0] < run[0] for i in r)
        if batches:
            with mapped(model, maps), removed_layers(model, earlier):
                _check_adds_mlp_output(model, before, mlp, batches[0].to(device), f"layer {run[0] - 1}")
        for ids in batches:
            ids = ids.to(device)
            target = stream_after(model, last, ids)  # the unpruned model's stream after the run
            with mapped(model, {k: v for k, v in maps.items()}), removed_layers(model, earlier):
                m, out = _mlp_and_stream(model, before, mlp, ids)
            m, rest = m.flatten(0, -2).double(), (target - out).flatten(0, -2).double()  # out = y + m: the target less what the block leaves
            stats.gram += m.T @ m
            stats.cross += m.T @ rest
            stats.tokens += m.shape[0]
            done += 1
            if on_batch is not None:
                on_batch(done, total)
        maps[run[0]] = solve_map(reduce(stats.gram), reduce(stats.cross), ridge)
    return maps


@torch.no_grad()
def _mlp_and_stream(model: nn.Module, block: nn.Module, mlp: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the MLP output `block` adds, the stream it leaves), before any map of its own."""
    seen = {}
    mlp_hook = mlp.register_forward_hook(lambda module, args, output: seen.__setitem__("m", first_tensor(output).detach()), prepend=True)
    try:
        out = stream_after(model, block, ids)
    finally:
        mlp_hook.remove()
    return seen["m"], out


@torch.no_grad()
def _check_adds_mlp_output(model: nn.Module, block: nn.Module, mlp: nn.Module, ids: torch.Tensor, where: str) -> None:
    """The estimate takes the stream a block leaves as y + m: what its MLP gave, added as it is.
    A probe added to m must come out unchanged in the stream; a block that scales its MLP's output
    first (Granite's residual multiplier) or normalises it (GLM-4) is refused with one line."""
    m, out = _mlp_and_stream(model, block, mlp, ids)
    probe = torch.randn(m.shape, generator=torch.Generator().manual_seed(0)).to(m.device, m.dtype) * m.float().std().clamp(min=1e-6).to(m.dtype)
    handle = mlp.register_forward_hook(lambda module, args, output: output + probe if not isinstance(output, tuple) else (output[0] + probe, *output[1:]))
    try:
        moved = stream_after(model, block, ids) - out
    finally:
        handle.remove()
    if (moved.float() - probe.float()).norm() > 1e-2 * probe.float().norm():
        raise DepthcurseError(f"--method linear estimates a map on the MLP output of {where}, but {type(block).__name__} does not add its MLP's output to the stream "
                              "as it is (a norm or a scale after the MLP, as GLM-4's post-MLP norm or Granite's residual multiplier): use --method lora or layer")


@torch.no_grad()
def fold_maps(model: nn.Module, maps: dict[int, torch.Tensor]) -> None:
    """Each map folded into the output projection of the MLP before its run, in place: the MLP then
    gives m T itself (W <- T^T W and b <- T^T b for a Linear; W <- W T for GPT-2's Conv1D)."""
    blocks = find_blocks(model).layers
    for first, t in maps.items():
        projection = output_projection(blocks[first - 1], f"layer {first - 1}")
        t = t.to(projection.weight.device, torch.float64)
        weight = projection.weight
        if type(projection).__name__ == "Conv1D":  # weight [in, out]: m = x W + b
            weight.copy_((weight.double() @ t).to(weight.dtype))
        else:  # nn.Linear, weight [out, in]: m = x W^T + b
            weight.copy_((t.T @ weight.double()).to(weight.dtype))
        if projection.bias is not None:
            projection.bias.copy_((projection.bias.double() @ t).to(projection.bias.dtype))
