"""How a model uses its depth (Csordás, Manning and Potts, "Do Language Models Use Their Depth
Efficiently?", NeurIPS 2025; robertcsordas/llm_effective_depth), on one text, per layer:

- what each sublayer adds: ||a_l|| / ||h|| and ||m_l|| / ||h'|| (the attention's and the MLP's
  outputs against the residual stream they are added to: h entering the block, h' = h + a_l), and
  the cosine of each with that stream (their Figure 2). A block that normalises the stream inside
  (lns-train's Post-LN blocks, Mix-LN's first ones, and HybridNorm's) adds no branch output to the
  stream as it is; there a_l and m_l are what each half changes in the stream, h' - h and the
  block's output - h', which for a pre-norm block are its two outputs again;
- where the prediction settles: the logit lens (the model's own final norm and head on a layer's
  stream) against the final distribution: KL, top-1 and top-5 agreement, and each token's settling
  depth, the first row from which the lens's top-1 stays the final one;
- whose later work a layer changes (their Figure 3): layer i skipped, the relative change of every
  later layer j's contribution c_j = a_j + m_j (the block's whole change, its output minus its
  input), ||c_j' - c_j|| / ||c_j||, and of the output. The skip runs from
  the stream entering layer i, kept from the whole model's pass (prune's stepper), so the matrix
  costs the blocks after each skip: about n / 2 passes.

Which stream the lens reads, the KL's direction, the top-5 figure, which tokens a skip touches, how a
figure is reduced over tokens and windows and how the output's change is scored are `definitions`:
ours by default, Csordás et al.'s code's with `--as csordas` (`depth.definitions`). With ours each
figure is a mean over the tokens of a window, then over windows, with a Student's t interval over
the windows; theirs takes the skips' maxima, which have none.

Memory: the streams entering every block are kept for a batch (layers x tokens x width), never a
layer's full-vocabulary distribution: each lens row is reduced to its figures and its top-1 as it is
read, a window at a time, so the vocabulary-wide tensors are the output's log-probabilities for the
batch and one window's temporaries, whatever the depth (`depth.memory` estimates the peak).
Where the stepper cannot run the model (or a block has no branch to read), one line says so before
any work.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from depthcurse import vocab_scores
from depthcurse.depth.definitions import DEFINITIONS, Definitions
from depthcurse.errors import DepthcurseError
from depthcurse.forecast import Forecast
from depthcurse.io import atomic_write
from depthcurse.kept_state import call_identity
from depthcurse.prune.stepping import Stepper, Unsupported, checked_stepper
from depthcurse.runtime import World
from depthcurse.select.scoring import contiguous_shares, top1_of
from depthcurse.stats.intervals import mean_interval
from depthcurse.surgery import branch_output, find_blocks, find_branch, half_stream

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
    lens_kl: list[list[float]] = field(default_factory=list)  # [lens row][window]: the definitions' KL of the lens and the output
    lens_top1: list[list[float]] = field(default_factory=list)
    lens_top5: list[list[float]] = field(default_factory=list)
    settled: list[int] = field(default_factory=list)  # tokens whose prediction settles at each lens row (a last bin: the output, where the rows stop short of it)
    # the same four through the tuned lens (None without one): KL, top-1, top-5, settling
    tuned_kl: list[list[float]] | None = None
    tuned_top1: list[list[float]] | None = None
    tuned_top5: list[list[float]] | None = None
    tuned_settled: list[int] | None = None
    influence: list[list[float]] | None = None  # [skipped i][layer j]: the relative change of c_j, reduced over tokens and windows (NaN where not measured)
    output_change: list[float] | None = None  # [skipped i]: the output's change, reduced over tokens and windows
    definitions: str = "depthcurse"

    def summary(self) -> dict:
        return asdict(self)


def _mean_over(values: list[float]) -> tuple[float, list[float] | None]:
    return sum(values) / len(values), mean_interval(values) if len(values) > 1 else None


def per_layer_rows(use: DepthUse) -> list[dict]:
    """Each layer's figures: the mean over windows and its 95% interval (Student's t); a lens
    figure is its row's (the stream after the layer, or entering it, by the definitions)."""
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
    """What each sublayer adds to the stream, read by forward hooks while `recording`.

    By `contributions="stream"` (ours): a pre-norm block's attention and MLP outputs where they meet
    the stream (after a branch's own post-norm, times a learned scale or Granite's residual
    multiplier: `surgery.branch_output`); for a block that normalises the stream inside (lns-train's
    Post-LN and HybridNorm blocks: `surgery.half_stream`), the stream between its two halves, from
    which each half's change follows (`sublayers`). The two must add up to the block's own change, or
    the block is refused in one line (a family whose branches meet the stream some other way).
    By `contributions="modules"` (Csordás et al.'s `analyze_norms.py`): the attention's and the MLP's
    module outputs as they are, before any post-norm or multiplier. Each output is kept in the
    model's dtype, copied (Falcon adds the attention to its MLP's output in place), in the stream's
    shape (Llama 4's experts give one row per token)."""

    def __init__(self, model, contributions: str):
        self.outputs: dict[tuple[int, str], torch.Tensor] = {}
        self.recording = False
        self.handles = []
        self.blocks = find_blocks(model).layers
        self.family = getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__
        self.checked = contributions == "modules"  # their modules' outputs are what they are: nothing to add up
        for i, block in enumerate(self.blocks):
            middle = half_stream(block) if contributions == "stream" else None
            if middle is not None:
                self.handles.append(middle.register_forward_hook(self._keep(i, "middle", None)))
                continue
            for part in ("attn", "mlp"):
                found = branch_output(block, part) if contributions == "stream" else _module(block, part)
                if found is None:
                    raise DepthcurseError(f"depth-use reads pre-norm blocks, whose {part} output is added to the stream; "
                                          f"{type(block).__name__} (block {i}, {self.family}) is not one (a Post-LN block normalises the sum)")
                module, scale = found
                self.handles.append(module.register_forward_hook(self._keep(i, part, scale)))

    def _keep(self, i: int, part: str, scale):
        def hook(module, args, output):
            if self.recording:
                out = output[0] if isinstance(output, tuple) else output
                self.outputs[i, part] = out * scale if scale is not None else out.clone()
        return hook

    def sublayers(self, i: int, before: torch.Tensor, after: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Block i's attention and MLP contributions, in the model's dtype, given the stream entering and leaving it."""
        middle = self.outputs.get((i, "middle"))
        if middle is not None:
            return middle.float() - before.float(), after.float() - middle.float()
        a, m = (self.outputs[i, part].reshape(before.shape) for part in ("attn", "mlp"))
        if not self.checked:
            self._check_sum(i, a, m, before, after)
        return a, m

    def _check_sum(self, i: int, a, m, before, after) -> None:
        """Once, on the first batch: the two contributions add up to the block's change (to its
        dtype's rounding of the stream), or one line says this family's block adds something else."""
        change = after.float() - before.float()
        error = (a.float() + m.float() - change).norm()
        eps = torch.finfo(after.dtype).eps
        if not error <= 1e-3 * change.norm() + 4 * eps * (before.float().norm() + after.float().norm()):
            raise DepthcurseError(f"depth-use reads what each sublayer adds to the residual stream, but in {type(self.blocks[i]).__name__} "
                                  f"(block {i}, {self.family}) the attention and MLP outputs do not add up to the block's change "
                                  f"(off by {(error / change.norm().clamp_min(1e-30)).item():.2g} of it): this family is not measured")
        if i == len(self.blocks) - 1:
            self.checked = True

    def close(self):
        for h in self.handles:
            h.remove()


def _module(block, part: str) -> tuple[torch.nn.Module, None] | None:
    """The branch's own module, read as their `layer.self_attn.output[0]` and `layer.mlp.output` (no scale)."""
    module = find_branch(block, part)
    return None if module is None else (module, None)


def contribution_figures(a: torch.Tensor, m: torch.Tensor, h: torch.Tensor, definitions: Definitions) -> dict[str, torch.Tensor]:
    """Per window [windows]: each sublayer's size against the stream it is added to, ||a|| / ||h|| and
    ||m|| / ||h + a||, and its cosine with it, each the mean over the window's tokens. With
    `norms_in="model"` (theirs) the norms, their floor, h + a and the cosines, summed over the tokens,
    are taken in the model's dtype and then cast, as their `analyze_norms.py` does."""
    floor = definitions.norm_floor
    # figures are [windows, tokens] after a norm or a cosine over the width: dim 1 is the window's tokens
    if definitions.norms_in == "model":
        into_mlp = a + h
        rel = lambda x, of: x.norm(dim=2).float() / of.norm(dim=2).clamp(min=floor).float()  # noqa: E731
        cos = lambda x, y: torch.nn.functional.cosine_similarity(x, y, dim=2).sum(1).float() / x.shape[1]  # noqa: E731
        return {"attn_norm": rel(a, h).mean(1), "mlp_norm": rel(m, into_mlp).mean(1), "attn_cos": cos(a, h), "mlp_cos": cos(m, into_mlp)}
    a, m, h = a.float(), m.float(), h.float()
    return {"attn_norm": _relative(a, h, floor).mean(1), "mlp_norm": _relative(m, h + a, floor).mean(1),
            "attn_cos": _cos(a, h).mean(1), "mlp_cos": _cos(m, h + a).mean(1)}


def stepper_of(model) -> Stepper:
    """Prune's stepper for `model`, or one line on why the lens and the skips cannot read it."""
    try:
        return checked_stepper(model, cached=False)  # every pass here starts at the first token
    except Unsupported as exc:
        raise DepthcurseError(f"depth-use needs the model's blocks, final norm and head one by one (the logit lens, the skips): {exc}") from None


def _relative(x: torch.Tensor, of: torch.Tensor, floor: float) -> torch.Tensor:
    return x.norm(dim=-1) / of.norm(dim=-1).clamp_min(floor)


def _cos(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(x, y, dim=-1)


def settling_depth(lens_top1: torch.Tensor, final_top1: torch.Tensor) -> torch.Tensor:
    """Each token's settling depth: the first row l from which the lens's top-1 is the final one at
    every row after (lens_top1: [rows, tokens]); a last row that is the output always agrees."""
    agrees = lens_top1 == final_top1[None]
    # walking down from the top: a row settles a token if it and every row above it agree
    from_here = torch.flip(torch.cumprod(torch.flip(agrees, [0]).int(), 0), [0]).bool()
    return (~from_here).sum(0)  # the rows below the settled run


def output_kl(final: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """KL(output || another distribution) per token, both as log-probabilities: a lens's, or a skip's output."""
    return (final.exp() * (final - logp)).sum(-1)


class Output:
    """The output's distribution as the lens rows and the skips read it: its log-probabilities for the
    batch, its top-1, and one window's probabilities at a time, so that KL(output || q) = sum p (log p -
    log q) costs a read a difference and one product-and-sum (`vecdot`), where `output_kl` costs an
    exp, a difference, a product and a sum: 0.67x their time, the same figure to the bit
    (docs/benchmarks.md, "depth-use's reads of the output"). One window's p, not the batch's, so the
    memory is `depth.memory`'s estimate still; the lens rows are read a window at a time, every row of
    a window before the next window. (sum p log p - sum p log q, as select's scorer reads it, would
    save the difference too, but a skip that barely moves the output has a KL of the order of the
    sums' rounding: in a test, 3.8e-7 for 3.2e-7.) On the CPU the vocabulary kernel reads a row's KL
    from its logits in one pass instead (`vocab_scores.lens_read`, its sums in double), where it
    takes them."""

    def __init__(self, logp: torch.Tensor):
        self.logp, self.top1 = logp, top1_of(logp)
        self._window, self._probs = -1, None

    def __len__(self) -> int:
        return len(self.logp)

    def probs(self, w: int) -> torch.Tensor:
        """Window w's probabilities, held until another window's are asked for."""
        if w != self._window:
            self._probs = None  # the old window's freed before the new one's is made
            self._window, self._probs = w, self.logp[w].exp()
        return self._probs

    def kl(self, w: int, logp: torch.Tensor) -> torch.Tensor:
        """KL(output || logp) per token of window w: `output_kl(self.logp[w], logp)`."""
        return torch.linalg.vecdot(self.probs(w), self.logp[w] - logp)


class _LensFigures:
    """One lens's figures on a batch, as each row of each window is read: its KL to the output, top-1
    and top-5 per window, and its top-1 (kept for the settling depth: tokens, not a vocabulary). A row
    is read a window at a time, so a batch's vocabulary-wide tensors are the output's log-probabilities
    and one window's temporaries, whatever the batch size or the depth. Each row's figures are kept in
    the order of the windows."""

    def __init__(self, output: Output, definitions: Definitions, kl: list, top1: list, top5: list):
        self.output, self.d = output, definitions
        self.final_top5 = output.logp.topk(TOP, dim=-1).indices if definitions.top5 == "overlap" else None
        self.kl, self.top1, self.top5 = kl, top1, top5
        self.argmax: dict[int, list[torch.Tensor]] = {}  # row: each window's top-1

    def read(self, row: int, w: int, logits: torch.Tensor | None) -> None:
        """Row `row`'s figures on window w, from its logits [tokens, vocab] (None: the output's own row)."""
        kl, top1, top = self._figures(w, logits)
        self.kl[row].append(kl.mean(-1).item())
        self.argmax.setdefault(row, []).append(top1)
        self.top1[row].append((top1 == self.output.top1[w]).float().mean(-1).item())
        if self.final_top5 is None:  # the output's top-1 among the lens's top 5
            hit = (top == self.output.top1[w][..., None]).any(-1).float()
        else:  # their set overlap: |top-5 of the lens and of the output| / 5
            hit = (top[..., :, None] == self.final_top5[w][..., None, :]).any(-1).float().sum(-1) / TOP
        self.top5[row].append(hit.mean(-1).item())

    def _figures(self, w: int, logits: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per token: the row's KL to the output (by `d.lens_kl`), its top-1 and its top 5. KL(output ||
        lens) in one read of the logits where the vocabulary kernel takes them (`vocab_scores`: the
        top 5 with it, and its sums in double), else from the log-softmax."""
        if logits is not None and self.d.lens_kl == "output||lens" and vocab_scores.takes(logits):
            kl, top = vocab_scores.lens_read(logits, self.output.logp[w], self.output.probs(w), TOP)
            return kl, top[..., 0], top
        logp = self.output.logp[w] if logits is None else torch.log_softmax(logits, -1)
        kl = self.output.kl(w, logp) if self.d.lens_kl == "output||lens" else output_kl(logp, self.output.logp[w])
        return kl, self.output.top1[w] if logits is None else top1_of(logp), logp.topk(TOP, dim=-1).indices

    def settle(self, settled: list[int], with_output: bool) -> None:
        rows = [torch.stack(self.argmax[row]) for row in sorted(self.argmax)] + ([self.output.top1] if with_output else [])
        for layer in settling_depth(torch.stack(rows).flatten(1), self.output.top1.flatten()).tolist():
            settled[layer] += 1


def _folded(kept: float, per_token: torch.Tensor, how: str) -> float:
    """A per-token figure of a batch [windows, tokens] reduced over each window's tokens and folded
    into what the windows before gave (`kept`, NaN before the first): a sum of the windows' means
    (divided by the windows at the end), or the largest token of any window."""
    if how == "max":
        new = per_token.amax().item()
        return new if kept != kept else max(kept, new)
    new = per_token.mean(-1).sum().item()
    return new if kept != kept else kept + new


def _output_change(output: Output, w: int, logits: torch.Tensor, definitions: Definitions) -> torch.Tensor:
    """Per token of window w, from the skipped model's logits: KL(output || skipped) (in one read of
    them where the vocabulary kernel takes them), or the L2 norm of the change of the output's
    probabilities (theirs)."""
    if definitions.output_change == "kl" and vocab_scores.takes(logits):
        return vocab_scores.lens_read(logits, output.logp[w], output.probs(w), 0)[0]
    logp = torch.log_softmax(logits, -1)
    if definitions.output_change == "kl":
        return output.kl(w, logp)
    return (logp.exp() - output.probs(w)).norm(dim=-1)


FIGURES = ("attn_norm", "mlp_norm", "attn_cos", "mlp_cos", "lens_kl", "lens_top1", "lens_top5", *TUNED, "settled", "tuned_settled")


def _kept_batches(path: Path | None, identity: dict) -> dict | None:
    """The figures of the batches an interrupted measurement finished, where they are this one's."""
    if path is None or not path.is_file():
        return None
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return kept if kept.get("identity") == identity else None


@torch.no_grad()
def measure_depth_use(model, windows: torch.Tensor, batch_size: int, influence: bool = True, on_step=lambda text, done, total: None,
                      tuned=None, world: World = World(), definitions: Definitions = DEFINITIONS["depthcurse"], kept: Path | None = None,
                      forecast: Forecast | None = None) -> DepthUse:
    """Every figure of `DepthUse` on `windows` (token ids, windows x tokens), by `definitions`; the
    tuned lens's too where `tuned` (a `TunedLens` for this model) is given. Under torchrun (`world`)
    every rank runs the whole model's pass and the lenses, and the influence matrix's skips are
    shared over the ranks, each a consecutive run of skipped layers of even cost (the blocks after
    each), every row gathered on every rank: N ranks give one process's matrix. With `kept`, every
    finished batch's figures are written there (a rank's own file under torchrun) and an interrupted
    measurement takes them up: the rerun's figures are an uninterrupted run's, to the last bit."""
    identity = call_identity(measure_depth_use, locals())  # the model, the windows, the lens, every setting and this rank's place
    d = definitions
    stepper = stepper_of(model)
    n = stepper.n_layers
    start, end = contiguous_shares([n - i for i in range(n)], world.size)[world.rank]  # skip i runs the n - 1 - i blocks after it and the head
    use = DepthUse(n, len(windows), definitions=d.name)
    for name in ("attn_norm", "mlp_norm", "attn_cos", "mlp_cos", "lens_kl", "lens_top1", "lens_top5", *(TUNED if tuned is not None else ())):
        setattr(use, name, [[] for _ in range(n)])
    entering_rows = d.lens_reads == "entering"  # rows 0..n-1 read the streams entering the layers; the output is one more
    use.settled = [0] * (n + entering_rows)
    if tuned is not None:
        use.tuned_settled = [0] * (n + entering_rows)
    if influence:
        nan = float("nan")
        totals = [[nan] * n for _ in range(n)]  # a skip's row over the windows: a sum (mean) or a maximum
        out_totals = [nan] * n
    branches = _Branches(model, d.contributions)
    batches = [windows[i : i + batch_size] for i in range(0, len(windows), batch_size)]
    if kept is not None and world.size > 1:
        kept = kept.with_name(f"{kept.stem}.rank{world.rank}{kept.suffix}")
    done = 0
    restored = _kept_batches(kept, identity)
    if restored is not None:
        done = restored["batches"]
        for name in FIGURES:
            setattr(use, name, restored["use"][name])
        if influence:
            totals, out_totals = restored["totals"], restored["out_totals"]
    forecast = forecast or Forecast("the measurement's batches of windows")
    try:
        for b, batch in forecast.over(batches, done, kept_in=kept):
            on_step("the whole model's pass and the lens", b, len(batches))
            ids = batch.to(stepper.device)
            ctx = stepper.context(ids.shape[1], 0)
            h = stepper.embed(ids)
            streams, contributions = [h], []  # the stream entering every block, then the last block's output
            branches.recording = True
            for i in range(n):
                branches.outputs.clear()
                h = stepper.block(i, streams[i], ctx)
                streams.append(h)
                for name, value in contribution_figures(*branches.sublayers(i, streams[i], h), streams[i], d).items():
                    getattr(use, name)[i].extend(value.tolist())
                if influence:
                    contributions.append(h.float() - streams[i].float())  # c_i = a_i + m_i: the block's whole change
            branches.recording = False
            output = Output(torch.log_softmax(stepper.logits(streams[n]), -1))
            reads = range(n) if entering_rows else range(1, n + 1)  # which of the n + 1 streams the lens rows read
            plain = _LensFigures(output, d, use.lens_kl, use.lens_top1, use.lens_top5)
            lensed = _LensFigures(output, d, use.tuned_kl, use.tuned_top1, use.tuned_top5) if tuned is not None else None
            lens = stepper.logits if d.lens_logits == "model" else stepper.head_logits  # theirs: lm_head(norm(h)), no soft-cap or logit scale
            for w in range(len(batch)):  # every row of a window, then the next: its output's p made once
                for row, s in enumerate(reads):  # a row's distribution is reduced as it is read: no vocabulary-wide tensor per layer is kept
                    plain.read(row, w, None if s == n else lens(streams[s][w]))
                    if lensed is not None:
                        lensed.read(row, w, None if s == n else stepper.logits(tuned(streams[s][w], s)))
            plain.settle(use.settled, entering_rows)
            if lensed is not None:
                lensed.settle(use.tuned_settled, entering_rows)
            if influence:
                for i in range(start, end):  # layer i skipped: the stream entering it goes on to i + 1 (from d.skip_from on)
                    on_step(f"without layer {i}", b, len(batches))
                    h = streams[i]
                    if d.skip_from:  # their first token(s) keep the layer's own output
                        h = torch.cat([streams[i + 1][:, : d.skip_from], h[:, d.skip_from :]], dim=1)
                    if d.diagonal:
                        for j in range(i):
                            totals[i][j] = 0.0  # nothing before the skip changes
                        changed = h.float() - streams[i].float()  # the skipped layer's own contribution now
                        totals[i][i] = _folded(totals[i][i], _relative(changed - contributions[i], contributions[i], d.norm_floor), d.reduce)
                    for j in range(i + 1, n):
                        h, entered = stepper.block(j, h, ctx), h
                        change = _relative(h.float() - entered.float() - contributions[j], contributions[j], d.norm_floor)
                        totals[i][j] = _folded(totals[i][j], change, d.reduce)
                    moved = torch.stack([_output_change(output, w, stepper.logits(h[w]), d) for w in range(len(h))])  # a window at a time
                    out_totals[i] = _folded(out_totals[i], moved, d.reduce)
            if kept is not None:  # this batch's figures, kept whole or not at all (NaN as JSON's NaN: read back by this code alone)
                state = {"identity": identity, "batches": b + 1, "of": len(batches), "use": {name: getattr(use, name) for name in FIGURES}}
                if influence:
                    state.update(totals=totals, out_totals=out_totals)
                atomic_write(kept, json.dumps(state))
    finally:
        branches.close()
    if influence and world.size > 1:  # every rank's rows, on every rank
        for part in world.all_gather({i: (totals[i], out_totals[i]) for i in range(start, end)}):
            for i, (row, out) in part.items():
                totals[i], out_totals[i] = row, out
    if influence:
        per = len(windows) if d.reduce == "mean" else 1
        use.influence = [[v / per for v in row] for row in totals]
        use.output_change = [v / per for v in out_totals]
    return use


def half_settled(settled: list[int]) -> int:
    """The layer by which half of the tokens' predictions have settled (`settled`: tokens per layer)."""
    total = sum(settled) or 1
    return next(i for i in range(len(settled)) if sum(settled[: i + 1]) >= total / 2)


def later_means(influence: list[list[float]]) -> list[float]:
    """Each row's mean over the later layers (j > i) of an influence matrix, for every layer but the
    last, which has no later one."""
    rows = [[v for v in row[i + 1 :] if v is not None and v == v] for i, row in enumerate(influence[:-1])]  # NaN in memory, null in JSON
    return [sum(r) / len(r) for r in rows]


def influence_row_means(use: DepthUse) -> list[float]:
    """Each layer's mean effect on the layers after it (its influence row's mean over j > i)."""
    return later_means(use.influence)


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
