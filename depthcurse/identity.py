"""How close each block is to the identity: the Curse of Depth's mechanism, measured directly.

Under Pre-LN the residual stream's variance grows with depth, so a deep block's Jacobian tends
to the identity and the block barely contributes. For block l with input x (a whole sequence of
the residual stream, [T, d]) and output f_l(x), the identity distance is

    E_v ||J v - v|| / ||v||,   J = df_l/dx at the real input, v ~ N(0, I) over the real tokens,

estimated with a few random probes, each one Jacobian-vector product (forward-mode AD: one
block forward with tangents: about 4x a plain forward of the block, measured on SmolLM2 on a CPU). The same probe's tangent
where the block's attention and MLP branches meet the stream (after a branch's own post-norm,
in Gemma 2/3 and OLMo-2 blocks) gives each branch's gain
E_v ||J_branch v|| / ||v||: how much of a perturbation of the stream the branch passes on (for a
pre-norm block x + g(x), the identity distance is the gain of g as a whole).

The blocks' real inputs (stream, mask, rotary embeddings) are recorded by hooks during one
ordinary forward pass over the first batches; attention then runs on PyTorch's math kernel,
whose operations all have forward-mode derivatives.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.autograd.forward_ad as fwAD

from depthcurse.errors import DepthcurseError
from depthcurse.surgery import BRANCH_NAMES, branch_output


@dataclass
class IdentityDistances:
    identity: list[float]  # [L]: E ||J v - v|| / ||v||
    attn_gain: list[float] | None  # [L]: E ||J_attn v|| / ||v||; None where blocks have no such branch
    mlp_gain: list[float] | None
    tokens: int  # real tokens the probes covered
    probes: int
    seconds: float
    variance: list[float] | None = None  # [L]: mean per-token variance of each block's input over those tokens

    def to_json(self) -> dict:
        return {"identity_distance": self.identity, "attn_gain": self.attn_gain, "mlp_gain": self.mlp_gain,
                "input_variance": self.variance, "tokens": self.tokens, "probes": self.probes, "seconds": self.seconds,
                "definition": "E_v ||J v - v|| / ||v|| over random normal probes v of the real tokens of each sequence, J = d block(x) / dx; "
                              "a branch's gain: E_v ||J_branch v|| / ||v||, J_branch the Jacobian of what the branch adds to the stream (after its own post-norm, if it has one)"}


def _first_tensor(output):
    return output[0] if isinstance(output, (tuple, list)) else output


def _branches(block: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, torch.Tensor | None]]:
    """Where each branch meets the stream (`branch_output`): after its post-norm in Gemma 2/3 and
    OLMo-2 blocks, times its learned scale in LayerScale ones."""
    return {part: m for part in BRANCH_NAMES if (m := branch_output(block, part)) is not None}


class _Recorder:
    """Pre-hooks keeping every block's call (args, kwargs) of one forward pass."""

    def __init__(self, blocks):
        self.blocks, self.calls, self.handles = blocks, [None] * len(blocks), []

    def __enter__(self):
        for i, block in enumerate(self.blocks):
            self.handles.append(block.register_forward_pre_hook(self._hook(i), with_kwargs=True))
        return self

    def _hook(self, i):
        def hook(module, args, kwargs):
            self.calls[i] = (args, dict(kwargs))

        return hook

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def _split_hidden(args: tuple, kwargs: dict):
    """(hidden states, a function giving the call's (args, kwargs) with other hidden states)."""
    if torch.is_tensor(kwargs.get("hidden_states")):
        return kwargs["hidden_states"], lambda h: (args, {**kwargs, "hidden_states": h})
    if args and torch.is_tensor(args[0]) and args[0].dim() == 3:
        return args[0], lambda h: ((h, *args[1:]), kwargs)
    raise DepthcurseError("cannot find the hidden states among a block's inputs: unsupported architecture")


def block_probes(block: torch.nn.Module, args: tuple, kwargs: dict, mask: torch.Tensor, probes: torch.Tensor) -> dict[str, torch.Tensor]:
    """For each probe v ([P, B, T, d], zero on padding): ||J v - v|| and, per branch, ||J_branch v||
    and ||v||, per sequence ([P, B] each). `mask` [B, T] marks the real tokens."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    x, call_with = _split_hidden(args, kwargs)
    real = mask.to(x.device, x.dtype)[..., None]
    branches = _branches(block)
    tangents: dict[str, torch.Tensor] = {}
    def keep(part, scale):
        def hook(module, args, output):
            t = fwAD.unpack_dual(_first_tensor(output)).tangent
            tangents[part] = t if t is None or scale is None else t * (scale.detach() if isinstance(scale, torch.Tensor) else scale)
        return hook

    handles = [m.register_forward_hook(keep(part, scale)) for part, (m, scale) in branches.items()]
    out = {"identity": [], "v": [], **{part: [] for part in branches}}
    try:
        with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
            for v in probes:
                v = v.to(x.device, x.dtype) * real
                with fwAD.dual_level():
                    a, kw = call_with(fwAD.make_dual(x, v))
                    jv = fwAD.unpack_dual(_first_tensor(block(*a, **kw))).tangent
                    if jv is None:
                        raise DepthcurseError(f"{type(block).__name__}: its output does not depend on its input stream")
                out["identity"].append(torch.linalg.vector_norm(((jv - v) * real).float(), dim=(-2, -1)))
                out["v"].append(torch.linalg.vector_norm(v.float(), dim=(-2, -1)))
                for part in branches:
                    t = tangents.get(part)
                    out[part].append(torch.zeros_like(out["v"][-1]) if t is None else torch.linalg.vector_norm((t * real).float(), dim=(-2, -1)))
    finally:
        for h in handles:
            h.remove()
    return {k: torch.stack(v) for k, v in out.items()}


def first_tokens(batches: list[tuple[torch.Tensor, torch.Tensor]], tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The batches' rows in order, the last one cut, holding `tokens` real tokens (or all there are)."""
    out, left = [], tokens
    for ids, mask in batches:
        if left <= 0:
            break
        lengths = mask.sum(1)
        keep = int((lengths.cumsum(0) - lengths < left).sum())  # rows that start within the budget
        ids, mask = ids[:keep].clone(), mask[:keep].clone()
        over = int(mask.sum()) - left
        if over > 0:  # right padding: the last row's tail becomes padding
            last = int(mask[-1].sum())
            mask[-1, last - over : last] = 0
        width = int(mask.sum(0).nonzero().max()) + 1
        out.append((ids[:, :width], mask[:, :width]))
        left -= int(mask.sum())
    return out


def identity_distances(blocks, batches: list[tuple[torch.Tensor, torch.Tensor]], run_forward, *,
                       tokens: int = 1024, probes: int = 4, seed: int = 0) -> IdentityDistances:
    """Identity distance and branch gains of every block, over the first `tokens` real tokens of `batches`.

    `run_forward(ids, mask)` runs the model as the caller's measurement does (hooks see the blocks' real inputs).
    """
    if probes < 1:
        raise DepthcurseError(f"--probes must be at least 1 (got {probes})")
    started = time.perf_counter()
    gen = torch.Generator().manual_seed(seed)
    sums: dict[str, list[float]] = {}
    counts = seen = 0
    for ids, mask in first_tokens(batches, tokens):
        with _Recorder(blocks) as rec, torch.no_grad():
            run_forward(ids, mask)
        for i, call in enumerate(rec.calls):
            if call is None:
                raise DepthcurseError(f"block {i} was not called in the forward pass: cannot measure its Jacobian")
            x, _ = _split_hidden(*call)
            real_rows = x.detach().float()[mask.to(x.device).bool()]
            sums.setdefault("variance", [0.0] * len(blocks))[i] += float(real_rows.var(dim=-1, unbiased=False).sum())
            v = torch.randn((probes, *x.shape), generator=gen)
            got = block_probes(blocks[i], *call, mask, v)
            ratio = {k: (got[k] / got["v"].clamp_min(1e-30))[:, mask.sum(1) > 0] for k in got if k != "v"}
            for k, r in ratio.items():
                sums.setdefault(k, [0.0] * len(blocks))[i] += float(r.sum())
        counts += probes * int((mask.sum(1) > 0).sum())
        seen += int(mask.sum())
    if counts == 0:
        raise DepthcurseError("no tokens to probe the blocks' Jacobians with")
    variance = [v / seen for v in sums.pop("variance")]
    mean = {k: [s / counts for s in v] for k, v in sums.items()}
    return IdentityDistances(mean["identity"], mean.get("attn"), mean.get("mlp"), seen, probes, round(time.perf_counter() - started, 3), variance)
