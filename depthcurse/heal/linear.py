"""ReplaceMe's maps (Shopkhoev et al., 2025): one linear map per cut, folded into the weights.

For a contiguous run of removed layers i..j, the block before it (i - 1) adds its MLP output
projection's output m to the stream y it got so far, leaving y + m; the removed run would have
left x_{j+1}. A map T with  y + m T ~ x_{j+1}  over calibration tokens is folded into that
projection (W <- T^T W, b <- T^T b), so that the saved model is the unpruned architecture minus k
layers, with no new module. Runs are estimated in order of depth, each with the runs before it
already removed and mapped, against the unpruned model's stream. Which T: least squares here
(`LeastSquares`, `solve_map`); the methods in `heal/methods/` choose (ReplaceMe's cosine variant
brings its own solver).

The solution is written as a correction of the identity, T = I + D: the plain removal is D = 0,
and the ridge term pulls D toward it. With G = M^T M and C = M^T (x_{j+1} - y - m) summed over the
tokens, D = (G + ridge * tr(G)/d * I)^+ C, solved in fp64 (the pseudo-inverse: the smallest
correction when G is singular, as with fewer tokens than dimensions).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch import nn

from depthcurse.errors import DepthcurseError
from depthcurse.heal.streams import first_tensor, stream_after
from depthcurse.surgery import branch_output, find_blocks, find_branch, removed_layers, run_text, runs_of

# The MLP's last linear layer, by the names transformers gives it (Llama/Mistral/Qwen/Gemma,
# GPT-2, GPT-NeoX/Falcon, Phi/OPT-style, Mixtral-style experts' w2 is not a dense MLP).
OUTPUT_PROJECTIONS = ("down_proj", "c_proj", "dense_4h_to_h", "fc2", "fc_out", "w2", "proj_out")


def foldable_mlp(block: nn.Module, where: str) -> nn.Module:
    """The block's MLP, where a map after it can be folded into it; one clear error where it
    cannot: no MLP branch (Post-LN), a norm or a learned scale between the MLP and the stream
    (Gemma 2/3 and OLMo-2 post-norms, LayerScale: a linear map does not pass a norm)."""
    kind = type(block).__name__
    found = branch_output(block, "mlp")
    if found is None:
        raise DepthcurseError(f"it folds a map into the MLP output of {where}, but {kind} is a Post-LN block (its MLP output is normalised with the stream)")
    meets, scale = found
    mlp = find_branch(block, "mlp")
    if meets is not mlp or scale is not None:
        what = (f"a norm ({type(meets).__name__})" if meets is not mlp else "a learned scale" if isinstance(scale, torch.Tensor)
                else f"a residual multiplier ({scale:g})")
        raise DepthcurseError(f"it folds a map into the MLP output of {where}, but {kind} puts {what} between its MLP and the stream, "
                              "which a folded linear map cannot pass")
    return mlp


def output_projection(block: nn.Module, where: str) -> nn.Module:
    """The last linear layer of the block's `foldable_mlp`, whose output the MLP gives; one clear
    error where it has none as a dense layer (fused experts)."""
    mlp = foldable_mlp(block, where)
    for name in OUTPUT_PROJECTIONS:
        projection = getattr(mlp, name, None)
        # Under peft's adapter (linear+lora trains LoRA on this projection too) the map follows the
        # adapted projection, as the saved checkpoint has it: the adapter merged, then the map folded.
        base = getattr(projection, "base_layer", projection)
        if isinstance(base, nn.Linear) or type(base).__name__ == "Conv1D":
            return projection
    raise DepthcurseError(f"it folds a map into the MLP output projection of {where}, but {type(mlp).__name__} has none of "
                          f"{', '.join(OUTPUT_PROJECTIONS)} as a dense linear layer (fused experts?)")


# The attention's output projection, by the names transformers gives it.
ATTENTION_OUTPUTS = ("o_proj", "dense", "out_proj", "c_proj", "wo")


def attention_output(block: nn.Module, where: str) -> nn.Module:
    """The last linear layer of the block's attention, whose output the block adds to its stream
    (a replacement FFN silences its attention through it; a compensation scales it)."""
    found = branch_output(block, "attn")
    attn = find_branch(block, "attn")
    if found is None or attn is None:
        raise DepthcurseError(f"it trains the MLP of {where} alone, its attention silenced, but {type(block).__name__} is a Post-LN block")
    for name in ATTENTION_OUTPUTS:
        projection = getattr(attn, name, None)
        if isinstance(projection, nn.Linear) or type(projection).__name__ == "Conv1D":
            return projection
    raise DepthcurseError(f"it silences the attention of {where} through its output projection, and {type(attn).__name__} has none of "
                          f"{', '.join(ATTENTION_OUTPUTS)} as a dense layer")


def check_linear(model: nn.Module, layers: tuple[int, ...]) -> None:
    """Every run of `layers` has a kept block before it whose MLP output a map can be folded into."""
    blocks = find_blocks(model).layers
    for run in runs_of(layers):
        if run[0] == 0:
            raise DepthcurseError(f"it folds a map into the block before each removed run, and layer 0 (removed with {run_text(run)}) has none before it")
        output_projection(blocks[run[0] - 1], f"layer {run[0] - 1}, before {run_text(run)}")


def solve_map(gram: torch.Tensor, cross: torch.Tensor, ridge: float = 0.0) -> torch.Tensor:
    """T = I + D, D the least-squares (ridge) solution of (M^T M + r I) D = M^T (target - y - m)
    from the sums `gram` = M^T M and `cross` = M^T (target - y - m); fp64 on the CPU."""
    gram, cross = gram.detach().double().cpu(), cross.detach().double().cpu()
    d = gram.shape[0]
    if ridge > 0:
        gram = gram + ridge * gram.diagonal().mean() * torch.eye(d, dtype=gram.dtype)
    correction = torch.linalg.lstsq(gram, cross, driver="gelsd").solution  # the minimum-norm solution where gram is singular
    return torch.eye(d, dtype=torch.float64) + correction


class LeastSquares:
    """Sums of M^T M and M^T (target - y - m) over the tokens seen; the map they solve for."""

    def __init__(self, d: int, device, ridge: float = 0.0):
        self.gram = torch.zeros(d, d, dtype=torch.float64, device=device)
        self.cross = torch.zeros(d, d, dtype=torch.float64, device=device)
        self.tokens, self.ridge = 0, ridge

    def add(self, m: torch.Tensor, out: torch.Tensor, target: torch.Tensor, index: int) -> None:
        m, rest = m.double(), (target - out).double()
        self.gram += m.T @ m
        self.cross += m.T @ rest
        self.tokens += m.shape[0]

    def solve(self, reduce: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return solve_map(reduce(self.gram), reduce(self.cross), self.ridge)


def _apply_map(t: torch.Tensor) -> Callable:
    def hook(module, args, output):
        return output @ t.to(output.dtype)  # m -> m T, T in fp32 while training, the weights' dtype for bf16 output
    return hook


@contextlib.contextmanager
def mapped(model: nn.Module, maps: dict[int, torch.Tensor]) -> Iterator[nn.Module]:
    """`model` with each map applied as a separate step after the MLP output projection of the
    block before its run (`maps`: the run's first removed layer -> T): what folding computes, kept
    apart so the model in memory is the unpruned one again afterwards. The layers are not removed here."""
    blocks = find_blocks(model).layers
    hooks = []
    try:
        for first, t in maps.items():
            projection = output_projection(blocks[first - 1], f"layer {first - 1}")
            hooks.append(projection.register_forward_hook(_apply_map(t.to(projection.weight.device, torch.float32))))  # peft's wrapper gives its base's
        yield model
    finally:
        for h in hooks:
            h.remove()


def estimate_maps(model: nn.Module, layers: tuple[int, ...], batches: list[torch.Tensor], *, ridge: float = 0.0,
                  reduce: Callable[[torch.Tensor], torch.Tensor] = lambda x: x, on_batch: Callable[[int, int], None] | None = None,
                  solver: Callable[[int, torch.device], object] | None = None) -> dict[int, torch.Tensor]:
    """One map per run of `layers`, in order of depth (first removed layer -> T, fp64 on the CPU),
    from the token ids in `batches` (every position counts: packed rows have no padding), each run
    with the runs before it removed and mapped. `solver(d, device)` gathers each run's tokens
    (`add(m, y + m, target, batch index)`) and solves them (`solve(reduce)`): least squares by
    default. `reduce` sums over ranks (this rank's share of the batches in each)."""
    check_linear(model, layers)
    blocks = find_blocks(model).layers
    device = model.get_input_embeddings().weight.device
    d = model.get_input_embeddings().weight.shape[-1]
    solver = solver or (lambda d, device: LeastSquares(d, device, ridge))
    maps: dict[int, torch.Tensor] = {}
    runs = runs_of(layers)
    done, total = 0, len(runs) * len(batches)
    for run in runs:
        before, last = blocks[run[0] - 1], blocks[run[-1]]
        projection = output_projection(before, f"layer {run[0] - 1}")
        pairs = solver(d, device)
        earlier = tuple(i for r in runs if r[0] < run[0] for i in r)
        if batches:
            with mapped(model, maps), removed_layers(model, earlier):
                _check_exact(model, before, projection, batches[0].to(device), f"layer {run[0] - 1}")
        for index, ids in enumerate(batches):
            ids = ids.to(device)
            target = stream_after(model, last, ids)  # the unpruned model's stream after the run
            with mapped(model, maps), removed_layers(model, earlier):
                m, out = _output_and_stream(model, before, projection, ids)
            pairs.add(m.flatten(0, -2), out.flatten(0, -2), target.flatten(0, -2), index)  # out = y + m: what the block leaves
            done += 1
            if on_batch is not None:
                on_batch(done, total)
        maps[run[0]] = pairs.solve(reduce)
    return maps


@torch.no_grad()
def _output_and_stream(model: nn.Module, block: nn.Module, projection: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(what the block's MLP output projection gives, the stream the block leaves), before any map
    of its own. A copy of the former: a block may add to it in place afterwards (Falcon adds its
    attention output into the MLP's)."""
    seen = {}
    hook = projection.register_forward_hook(lambda module, args, output: seen.__setitem__("m", first_tensor(output).detach().clone()), prepend=True)
    try:
        out = stream_after(model, block, ids)
    finally:
        hook.remove()
    return seen["m"], out


@torch.no_grad()
def _check_exact(model: nn.Module, block: nn.Module, projection: nn.Module, ids: torch.Tensor, where: str) -> None:
    """What the estimate and the fold take for granted, tried on the block itself: the stream it
    leaves is y + m, m its MLP output projection's output added as it is (a probe added to m comes
    out unchanged in the stream), and a map folded into the projection's weights gives what the
    map applied after it gives. A block that scales or normalises its MLP's output (Granite's
    residual multiplier, GLM-4's post-MLP norm) is refused with one line."""
    m, out = _output_and_stream(model, block, projection, ids)
    gen = torch.Generator().manual_seed(0)
    probe = torch.randn(m.shape, generator=gen).to(m.device, m.dtype) * m.float().std().clamp(min=1e-6).to(m.dtype)
    handle = projection.register_forward_hook(lambda module, args, output: output + probe)
    try:
        moved = stream_after(model, block, ids) - out
    finally:
        handle.remove()
    d = m.shape[-1]
    t = torch.eye(d, dtype=torch.float64) + 0.1 * torch.randn(d, d, generator=gen, dtype=torch.float64) / d**0.5
    handle = projection.register_forward_hook(_apply_map(t.to(projection.weight.device, torch.float32)))
    try:
        as_module = stream_after(model, block, ids)
    finally:
        handle.remove()
    saved = {name: p.detach().clone() for name, p in projection.named_parameters()}
    try:
        _fold_into(projection, t)
        folded = stream_after(model, block, ids)
    finally:
        for name, p in projection.named_parameters():
            p.copy_(saved[name])
    additive = (moved.float() - probe.float()).norm() <= 1e-2 * probe.float().norm()
    exact = (folded.float() - as_module.float()).norm() <= 1e-3 * as_module.float().norm().clamp(min=1e-12)
    if not (additive and exact):
        raise DepthcurseError(f"it estimates a map on the MLP output projection of {where}, but {type(block).__name__} does not add that output to the stream "
                              "as it is (a norm or a scale after the MLP, as GLM-4's post-MLP norm or Granite's residual multiplier)")


def _fold_into(projection: nn.Module, t: torch.Tensor) -> None:
    """The projection made to give m T itself: W <- T^T W and b <- T^T b for a Linear (weight
    [out, in], m = x W^T + b); W <- W T for GPT-2's Conv1D (weight [in, out], m = x W + b)."""
    t = t.to(projection.weight.device, torch.float64)
    weight = projection.weight
    if type(projection).__name__ == "Conv1D":
        weight.copy_((weight.double() @ t).to(weight.dtype))
    else:
        weight.copy_((t.T @ weight.double()).to(weight.dtype))
    if projection.bias is not None:
        projection.bias.copy_((projection.bias.double() @ t).to(projection.bias.dtype))


@torch.no_grad()
def fold_maps(model: nn.Module, maps: dict[int, torch.Tensor]) -> None:
    """Each map folded into the output projection of the MLP before its run, in place: the MLP then gives m T itself."""
    blocks = find_blocks(model).layers
    for first, t in maps.items():
        _fold_into(output_projection(blocks[first - 1], f"layer {first - 1}"), t)
