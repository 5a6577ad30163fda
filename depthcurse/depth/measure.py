"""How a model uses its depth (Csordás, Manning and Potts, "Do Language Models Use Their Depth
Efficiently?", NeurIPS 2025; robertcsordas/llm_effective_depth), on one text, per layer:

- what each sublayer adds: ||a_l|| / ||h|| and ||m_l|| / ||h'|| (the attention's and the MLP's
  outputs against the residual stream they are added to: h entering the block, h' = h + a_l), and
  the cosine of each with that stream (their Figure 2). A block that normalises the stream inside
  (lns-train's Post-LN blocks, Mix-LN's first ones, and HybridNorm's) adds no branch output to the
  stream as it is; there a_l and m_l are what each half changes in the stream, h' - h and the
  block's output - h', which for a pre-norm block are its two outputs again;
- where the prediction settles: the logit lens (the model's own final norm and head on the stream
  after each layer) against the final distribution: KL, top-1 and top-5 agreement, and each token's
  settling depth, the first layer after which the lens's top-1 stays the final one;
- whose later work a layer changes (their Figure 3): layer i skipped, the relative change of every
  later layer j's contribution a_j + m_j, ||c_j' - c_j|| / ||c_j||, and of the output (KL from the
  whole model's). The skip runs from the stream entering layer i, kept from the whole model's pass
  (prune's stepper), so the matrix costs the blocks after each skip: about n / 2 passes.

Each figure is a mean over the tokens of a window, then over windows, with a Student's t interval
over the windows. Where the stepper cannot run the model (or a block has no branch to read), one line
says so before any work.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from depthcurse.errors import DepthcurseError
from depthcurse.prune.stepping import Stepper, Unsupported, checked_stepper
from depthcurse.runtime import World
from depthcurse.select.scoring import contiguous_shares
from depthcurse.stats.intervals import mean_interval
from depthcurse.surgery import branch_output, find_blocks, half_stream

TOP = 5  # the lens's top-k agreement
TUNED = ("tuned_kl", "tuned_top1", "tuned_top5")


@dataclass
class DepthUse:
    """Per layer, over windows: each figure's per-window means (`windows` of them)."""

    n_layers: int
    windows: int
    attn_norm: list[list[float]] = field(default_factory=list)  # [layer][window]: mean over tokens of ||a|| / ||h||
    mlp_norm: list[list[float]] = field(default_factory=list)
    attn_cos: list[list[float]] = field(default_factory=list)
    mlp_cos: list[list[float]] = field(default_factory=list)
    lens_kl: list[list[float]] = field(default_factory=list)  # KL(final || lens after layer l)
    lens_top1: list[list[float]] = field(default_factory=list)
    lens_top5: list[list[float]] = field(default_factory=list)
    settled: list[int] = field(default_factory=list)  # tokens whose prediction settles after layer l
    # the same four through the tuned lens (None without one): KL, top-1, top-5, settling
    tuned_kl: list[list[float]] | None = None
    tuned_top1: list[list[float]] | None = None
    tuned_top5: list[list[float]] | None = None
    tuned_settled: list[int] | None = None
    influence: list[list[float]] | None = None  # [skipped i][later j]: mean relative change of c_j (NaN for j <= i)
    output_change: list[float] | None = None  # [skipped i]: mean KL(whole || skipped) of the output

    def summary(self) -> dict:
        return asdict(self)


def _mean_over(values: list[float]) -> tuple[float, list[float] | None]:
    return sum(values) / len(values), mean_interval(values) if len(values) > 1 else None


def per_layer_rows(use: DepthUse) -> list[dict]:
    """Each layer's figures: the mean over windows and its 95% interval (Student's t)."""
    rows = []
    total = sum(use.settled) or 1
    for layer in range(use.n_layers):
        row = {"layer": layer}
        for name in ("attn_norm", "mlp_norm", "attn_cos", "mlp_cos", "lens_kl", "lens_top1", "lens_top5", *TUNED):
            if getattr(use, name) is not None:
                row[name], row[f"{name}_interval"] = _mean_over(getattr(use, name)[layer])
        row["settled_share"] = use.settled[layer] / total
        if use.tuned_settled is not None:
            row["tuned_settled_share"] = use.tuned_settled[layer] / (sum(use.tuned_settled) or 1)
        rows.append(row)
    return rows


class _Branches:
    """What each sublayer adds to the stream, read by forward hooks while `recording`. A pre-norm
    block's attention and MLP outputs where they meet the stream (times a learned scale where the
    block has one); for a block that normalises the stream inside (lns-train's Post-LN and
    HybridNorm blocks: `surgery.half_stream`), the stream between its two halves, from which each
    half's change follows (`sublayers`): for a pre-norm block the same two outputs."""

    def __init__(self, model):
        self.outputs: dict[tuple[int, str], torch.Tensor] = {}
        self.recording = False
        self.handles = []
        for i, block in enumerate(find_blocks(model).layers):
            middle = half_stream(block)
            if middle is not None:
                self.handles.append(middle.register_forward_hook(self._keep(i, "middle", None)))
                continue
            for part in ("attn", "mlp"):
                found = branch_output(block, part)
                if found is None:
                    raise DepthcurseError(f"depth-use reads pre-norm blocks, whose {part} output is added to the stream; "
                                          f"{type(block).__name__} (block {i}) is not one (a Post-LN block normalises the sum)")
                module, scale = found
                self.handles.append(module.register_forward_hook(self._keep(i, part, scale)))

    def _keep(self, i: int, part: str, scale):
        def hook(module, args, output):
            if self.recording:
                out = output[0] if isinstance(output, tuple) else output
                self.outputs[i, part] = (out * scale if scale is not None else out).float()
        return hook

    def sublayers(self, i: int, before: torch.Tensor, after: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Block i's attention and MLP changes to the stream, given the stream entering and leaving it."""
        middle = self.outputs.get((i, "middle"))
        if middle is None:
            return self.outputs[i, "attn"], self.outputs[i, "mlp"]
        return middle - before.float(), after.float() - middle

    def close(self):
        for h in self.handles:
            h.remove()


def stepper_of(model) -> Stepper:
    """Prune's stepper for `model`, or one line on why the lens and the skips cannot read it."""
    try:
        return checked_stepper(model, cached=False)  # every pass here starts at the first token
    except Unsupported as exc:
        raise DepthcurseError(f"depth-use needs the model's blocks, final norm and head one by one (the logit lens, the skips): {exc}") from None


def _relative(x: torch.Tensor, of: torch.Tensor) -> torch.Tensor:
    return x.norm(dim=-1) / of.norm(dim=-1).clamp_min(1e-12)


def _cos(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(x, y, dim=-1)


def settling_depth(lens_top1: torch.Tensor, final_top1: torch.Tensor) -> torch.Tensor:
    """Each token's settling depth: the first layer l from which the lens's top-1 is the final one at
    every layer after (lens_top1: [layers, tokens]); the last layer always agrees (its lens is the
    model's output)."""
    agrees = lens_top1 == final_top1[None]
    # walking down from the top: a layer settles a token if it and every layer above it agree
    from_here = torch.flip(torch.cumprod(torch.flip(agrees, [0]).int(), 0), [0]).bool()
    return (~from_here).sum(0)  # the layers below the settled run


def output_kl(final: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """KL(output || another distribution) per token, both as log-probabilities: a lens's, or a skip's output."""
    return (final.exp() * (final - logp)).sum(-1)


def _read_lens(lens: list[torch.Tensor], final: torch.Tensor, kl: list, top1: list, top5: list, settled: list[int]) -> None:
    """One lens's figures on a batch (`lens`: its log-probabilities after each layer), added per window."""
    final_top1 = final.argmax(-1)
    for i, logp in enumerate(lens):
        kl[i].extend(output_kl(final, logp).mean(-1).tolist())
        top1[i].extend((logp.argmax(-1) == final_top1).float().mean(-1).tolist())
        top = logp.topk(TOP, dim=-1).indices
        top5[i].extend((top == final_top1[..., None]).any(-1).float().mean(-1).tolist())
    depth = settling_depth(torch.stack([logp.argmax(-1) for logp in lens]).flatten(1), final_top1.flatten())
    for layer in depth.tolist():
        settled[layer] += 1


@torch.no_grad()
def measure_depth_use(model, windows: torch.Tensor, batch_size: int, influence: bool = True, on_step=lambda text, done, total: None,
                      tuned=None, world: World = World()) -> DepthUse:
    """Every figure of `DepthUse` on `windows` (token ids, windows x tokens); the tuned lens's too
    where `tuned` (a `TunedLens` for this model) is given. Under torchrun (`world`) every rank runs
    the whole model's pass and the lenses, and the influence matrix's skips are shared over the
    ranks, each a consecutive run of skipped layers of even cost (the blocks after each), every
    row gathered on every rank: N ranks give one process's matrix."""
    stepper = stepper_of(model)
    n = stepper.n_layers
    start, end = contiguous_shares([n - i for i in range(n)], world.size)[world.rank]  # skip i runs the n - 1 - i blocks after it and the head
    use = DepthUse(n, len(windows))
    for name in ("attn_norm", "mlp_norm", "attn_cos", "mlp_cos", "lens_kl", "lens_top1", "lens_top5", *(TUNED if tuned is not None else ())):
        setattr(use, name, [[] for _ in range(n)])
    use.settled = [0] * n
    if tuned is not None:
        use.tuned_settled = [0] * n
    if influence:
        sums, out_sums = [[0.0] * n for _ in range(n)], [0.0] * n
    branches = _Branches(model)
    batches = [windows[i : i + batch_size] for i in range(0, len(windows), batch_size)]
    try:
        for b, batch in enumerate(batches):
            on_step("the whole model's pass and the lens", b, len(batches))
            ids = batch.to(stepper.device)
            ctx = stepper.context(ids.shape[1], 0)
            h = stepper.embed(ids)
            entering, contributions, lens, tuned_lens = [], [], [], []
            branches.recording = True
            for i in range(n):
                entering.append(h)
                branches.outputs.clear()
                h = stepper.block(i, h, ctx)
                a, m = branches.sublayers(i, entering[i], h)
                before = entering[i].float()
                for name, value in (("attn_norm", _relative(a, before)), ("mlp_norm", _relative(m, before + a)),
                                    ("attn_cos", _cos(a, before)), ("mlp_cos", _cos(m, before + a))):
                    getattr(use, name)[i].extend(value.mean(-1).tolist())
                contributions.append(a + m)
                lens.append(torch.log_softmax(stepper.logits(h), -1))
                if tuned is not None:
                    tuned_lens.append(torch.log_softmax(stepper.logits(tuned(h, i)), -1))
            branches.recording = False
            final = lens[-1]
            _read_lens(lens, final, use.lens_kl, use.lens_top1, use.lens_top5, use.settled)
            if tuned is not None:
                _read_lens(tuned_lens, final, use.tuned_kl, use.tuned_top1, use.tuned_top5, use.tuned_settled)
            if influence:
                for i in range(start, end):  # layer i skipped: the stream entering it goes on to i + 1
                    on_step(f"without layer {i}", b, len(batches))
                    h = entering[i]
                    branches.recording = True
                    for j in range(i + 1, n):
                        branches.outputs.clear()
                        h, entered = stepper.block(j, h, ctx), h
                        changed = sum(branches.sublayers(j, entered, h))
                        sums[i][j] += _relative(changed - contributions[j], contributions[j]).mean(-1).sum().item()
                    branches.recording = False
                    logp = torch.log_softmax(stepper.logits(h), -1)
                    out_sums[i] += output_kl(final, logp).mean(-1).sum().item()
    finally:
        branches.close()
    if influence and world.size > 1:  # every rank's rows, on every rank
        for part in world.all_gather({i: (sums[i], out_sums[i]) for i in range(start, end)}):
            for i, (row, out) in part.items():
                sums[i], out_sums[i] = row, out
    if influence:
        use.influence = [[sums[i][j] / len(windows) if j > i else float("nan") for j in range(n)] for i in range(n)]
        use.output_change = [s / len(windows) for s in out_sums]
    return use


def half_settled(settled: list[int]) -> int:
    """The layer by which half of the tokens' predictions have settled (`settled`: tokens per layer)."""
    total = sum(settled) or 1
    return next(i for i in range(len(settled)) if sum(settled[: i + 1]) >= total / 2)


def influence_row_means(use: DepthUse) -> list[float]:
    """Each layer's mean effect on the layers after it (its influence row's mean), for every layer
    but the last, which has no later one (NaN in memory, null in JSON)."""
    rows = [[v for v in row if v is not None and v == v] for row in use.influence[:-1]]
    return [sum(r) / len(r) for r in rows]


def phase_transition(use: DepthUse) -> int | None:
    """The depth where the layers' influence on later layers drops: the single change point in the
    mean of the row means of the influence matrix (each layer's mean effect on the layers after it),
    the split l that leaves the least squared deviation about the two segments' means (least
    squares), where the first segment's mean is the higher. Csordás et al. read their transition from
    the same figure by eye; this is a rule written down (docs/depth-use.md). None without the matrix,
    with fewer than 3 rows, or where no split lowers the mean."""
    if use.influence is None:
        return None
    means = influence_row_means(use)
    if len(means) < 3:
        return None

    def sse(xs):
        centre = sum(xs) / len(xs)
        return sum((x - centre) ** 2 for x in xs)

    best = min(range(1, len(means)), key=lambda l: (sse(means[:l]) + sse(means[l:]), l))
    return best if sum(means[:best]) / best > sum(means[best:]) / (len(means) - best) else None
