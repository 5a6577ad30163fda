"""Prune&Comp's magnitude compensation (Chen et al., AAAI 2026, arXiv 2507.18212; code
chenxinrui-tsinghua/PruneAndComp, `magcomp.py`): a removal leaves a gap in the stream's magnitude
at the cut; one scalar per cut, the mean over channels of mean|x_after| / mean|x_before| on
calibration text (averaged batch by batch, as the code), scales every weight that writes into the
stream before the cut (the embedding, and each earlier layer's attention and MLP output
projections). The norms every layer reads through do not see a scale, so the stream reaching the
cut is the old one times that scalar, at no cost at inference and with no new module.

The loop is the authors' (`mag+.py`'s main loop with `magcomp.py`): one removed layer per round,
its scale measured on the model with the earlier rounds' layers removed and their compensation
folded in, then folded in itself. Their rounds go in the order their importance score picks; here
the layers are given, and the rounds go in order of depth. `per=run` is this tool's earlier way:
one scale per run of adjacent removed layers, measured across the whole run (on SmolLM2-135M
without 12-15 it won back 15.6% where the authors' loop won back 13.1%, docs/healing.md).

A model whose input embedding is its output head (tied: SmolLM2) has its head untied in the
checkpoint, which keeps the unscaled copy: the logits stay the model's own."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
from torch import nn

from depthcurse.errors import DepthcurseError
from depthcurse.heal.linear import attention_output, output_projection
from depthcurse.heal.method import HealContext, Method, at_least
from depthcurse.heal.streams import stream_after, stream_before
from depthcurse.surgery import branch_output, find_blocks, removed_layers, run_text, runs_of

POSITION_EMBEDDINGS = ("wpe", "embed_positions", "position_embeddings")  # learned absolute positions, which also write into the stream


@dataclass
class PruneCompSettings:
    calib_tokens: int = 16384
    per: str = "layer"  # "layer": a scale per removed layer, round by round (the authors' loop); "run": one per run of adjacent layers


def writers(model: nn.Module, before: int) -> list[nn.Module]:
    """The modules whose output goes into the stream before block `before`: the embeddings, and
    each earlier block's attention and MLP output projections."""
    base = getattr(model, model.base_model_prefix, model)
    out = [model.get_input_embeddings()] + [m for name in POSITION_EMBEDDINGS if isinstance(m := getattr(base, name, None), nn.Embedding)]
    blocks = find_blocks(model).layers
    for i in range(before):
        where = f"layer {i}"
        for part in ("attn", "mlp"):
            found = branch_output(blocks[i], part)
            if found is None:
                raise DepthcurseError(f"it scales what {where} writes into the stream, but {type(blocks[i]).__name__} is a Post-LN block")
            meets, _ = found
            if isinstance(meets, nn.Module) and "Norm" in type(meets).__name__:
                raise DepthcurseError(f"it scales what {where} writes into the stream, but {type(blocks[i]).__name__} puts a norm "
                                      f"({type(meets).__name__}) after its {part} branch, whose output a scaled weight does not scale")
        out += [attention_output(blocks[i], where), output_projection(blocks[i], where)]
    return out


def _scale_hook(factor: float):
    def hook(module, args, output):
        return (output[0] * factor, *output[1:]) if isinstance(output, tuple) else output * factor
    return hook


@contextlib.contextmanager
def scaled(model: nn.Module, factors: dict[int, float]) -> None:
    """`model` with what its writers before each cut write multiplied by that cut's factor
    (`factors`: a run's first removed layer -> c), as hooks: what folding computes."""
    hooks = []
    try:
        for module, factor in _per_writer(model, factors).items():
            hooks.append(module.register_forward_hook(_scale_hook(factor)))
        yield model
    finally:
        for h in hooks:
            h.remove()


def _per_writer(model, factors) -> dict[nn.Module, float]:
    out: dict[nn.Module, float] = {}
    for first, c in factors.items():
        for module in writers(model, first):
            out[module] = out.get(module, 1.0) * c
    return out


class PruneComp(Method):
    name = "prune-comp"
    title = "magnitude compensation (Prune&Comp)"
    source = "Chen et al. AAAI 2026, arXiv 2507.18212; github.com/chenxinrui-tsinghua/PruneAndComp (magcomp.py)"
    Settings = PruneCompSettings

    def check_settings(self):
        at_least(self.settings, "calib_tokens")
        if self.settings.per not in ("layer", "run"):
            raise DepthcurseError(f"per={self.settings.per!r}: use layer (a scale per removed layer, the authors' loop) or run (one per run of adjacent layers)")

    def check(self, model, layers):
        for run in runs_of(layers):
            writers(model, run[0])

    def _rounds(self, layers) -> list[tuple[int, ...]]:
        """What each round removes and compensates, in order: a layer (the authors' loop) or a run."""
        return [(i,) for i in sorted(layers)] if self.settings.per == "layer" else runs_of(layers)

    def describe(self):
        unit = "removed layer, round by round (the authors' loop)" if self.settings.per == "layer" else "removed run"
        return f"one scale per {unit} on {self.settings.calib_tokens:,} calibration tokens, folded into the writers before it"

    def changes(self, layers):
        factors = getattr(self, "factors", {})
        parts = [f"everything written into the stream before {run_text(run)} (the embedding and the attention and MLP output projections of "
                 f"layers 0-{run[0] - 1}) scaled by {factors.get(run[0], float('nan')):.4f}" for run in self._rounds(layers)]
        return "; ".join(parts) + ": those weights changed, no new module" + ("; the tied output head untied, unscaled" if getattr(self, "tied", False) else "")

    def untouched(self, layers):
        return 0

    @torch.no_grad()
    def prepare(self, ctx: HealContext):
        started = time.perf_counter()
        model = ctx.model
        blocks = find_blocks(model).layers
        batches = ctx.calibration(self.settings.calib_tokens)
        self.check(model, ctx.layers)
        _check_invariant(model, min(ctx.layers), batches[0].to(ctx.device) if batches else None)
        self.factors: dict[int, float] = {}
        rounds = self._rounds(ctx.layers)
        for run in rounds:
            earlier = tuple(i for r in rounds if r[0] < run[0] for i in r)
            ratio, count = None, 0
            with scaled(model, self.factors), removed_layers(model, earlier):
                kept = [i for i in range(len(blocks)) if i not in earlier]  # the run's blocks, renumbered without the earlier runs
                first, last = kept.index(run[0]), kept.index(run[-1])
                for ids in ctx.steps(f"the scale of {run_text(run)}: calibration batches", batches):
                    ids = ids.to(ctx.device)
                    before = stream_before(model, find_blocks(model).layers[first], ids)
                    after = stream_after(model, find_blocks(model).layers[last], ids)
                    # per channel: mean |x| over the batch's tokens after the run over before it (the code's d_clip[j] / d_clip[i])
                    r = after.abs().float().flatten(0, -2).mean(0) / before.abs().float().flatten(0, -2).mean(0)
                    ratio = r if ratio is None else ratio + r
                    count += 1
            total = ctx.world.sum(torch.stack([ratio.double().cpu(), torch.full_like(ratio, count).double().cpu()]))
            self.factors[run[0]] = float((total[0] / total[1]).mean())
        tokens = int(ctx.world.sum(torch.tensor(sum(b.numel() for b in batches))).item())
        self.calibration = {"seconds": round(time.perf_counter() - started, 3), "tokens": tokens}
        self.tied = _tied(model)

    def state_dict(self):
        return {"factors": {str(k): v for k, v in self.factors.items()}, "calibration": self.calibration, "tied": self.tied}

    def load_state_dict(self, state, ctx):
        self.factors = {int(k): float(v) for k, v in state["factors"].items()}
        self.calibration, self.tied = state["calibration"], state["tied"]

    def applied(self, model):
        return scaled(model, getattr(self, "factors", {}))

    def cost(self, model, layers):
        return {"trained_params": 0, "added_params": 0, "solved_params": len(self._rounds(layers))}

    @torch.no_grad()
    def finalize(self, model):
        if _tied(model):  # the head keeps the unscaled table: untied, in the checkpoint too
            head = model.get_output_embeddings()
            head.weight = nn.Parameter(head.weight.detach().clone())
            model.config.tie_word_embeddings = False
            text = getattr(model.config, "get_text_config", lambda: model.config)()
            text.tie_word_embeddings = False
        for module, factor in _per_writer(model, self.factors).items():
            module.weight.mul_(factor)
            if getattr(module, "bias", None) is not None:
                module.bias.mul_(factor)
        return model


def _tied(model) -> bool:
    head = model.get_output_embeddings()
    return head is not None and head.weight is model.get_input_embeddings().weight


@torch.no_grad()
def _check_invariant(model: nn.Module, first: int, ids: torch.Tensor | None) -> None:
    """The compensation takes for granted that scaling every writer before a cut scales the stream
    there, the layers reading it through scale-free norms: tried with a factor of 2."""
    if ids is None or first == 0:
        return
    block = find_blocks(model).layers[first]
    plain = stream_before(model, block, ids)
    with scaled(model, {first: 2.0}):
        doubled = stream_before(model, block, ids)
    if (doubled.float() - 2 * plain.float()).norm() > 1e-3 * plain.float().norm() * 2:
        raise DepthcurseError(f"scaling every writer before layer {first} does not scale the stream there by the same factor in {type(model).__name__} "
                              "(a layer reads the stream other than through a norm)")
