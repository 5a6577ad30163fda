"""A removal's score on the calibration windows, and what scoring cost.

Every search asks the same question, "how much does removing these units cost on the calibration
windows?", and the answers are shared: a removal's loss and KL are measured once (`known`, kept in
`select.json`) for every search and objective that asks. Where prune's `Stepper` runs the model
(Llama-like decoders), the unpruned model's stream entering every block is kept once, and a removal
runs from its first removed block on: the blocks before it compute exactly what the unpruned model
does. `score_many` goes further for whole blocks: the removals that remove the same blocks below
block j share everything up to j, so a depth-first walk over the removed-block prefixes (a trie of
the removals) computes each shared prefix's stream once, holding at most k + 1 streams of a batch
at a time (`exact` scores every k-set this way). Elsewhere (another architecture, or sub-blocks,
whose removal runs through the block's own forward with a branch zeroed), a removal runs from its
first touched block with the units removed.

Costs are counted in full-calibration passes: a block (or the output head) applied to every
calibration window once is one pass; `naive` is what scoring every removal from the first block
would have cost.

Under torchrun each rank holds the model and every window, and the removals asked for at once
(`score_many`, `score_on_many`) are shared out: each rank scores a consecutive run of them, as one
process would score it, and every rank is given every score, so the searches on all ranks take
the same next step. The cost then counts the blocks and heads of every rank.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from depthcurse import vocab_scores
from depthcurse.prune.stepping import Stepper, Unsupported, checked_stepper
from depthcurse.runtime import World
from depthcurse.select.search import OBJECTIVES, Removal, key
from depthcurse.speculate.costs import DraftCosts
from depthcurse.surgery import num_layers, removed_layers, removed_units

KEPT = OBJECTIVES  # a removal's calibration scores, in this order, in `select.json`


@dataclass
class Cost:
    """What scoring took, in full-calibration passes (fractions where some windows ran)."""

    window_blocks: float = 0  # blocks applied, times the windows they were applied to (a cut window: its share of the tokens)
    window_heads: float = 0  # output-head applications, times their windows
    sets: int = 0  # removals scored on every calibration window
    subset_scores: int = 0  # removals scored on some windows (EvoPress's stages)
    tokens: int = 0  # tokens scored in all (every window's length, each time it is scored)
    seconds: float = 0.0
    naive_window_blocks: int = 0  # the blocks a plain forward of every scored removal would have run

    def minus(self, before: "Cost") -> "Cost":
        """What was spent since `before` (a copy taken then)."""
        return Cost(**{f: getattr(self, f) - getattr(before, f) for f in self.__dataclass_fields__})

    def summary(self, windows: int) -> dict:
        return {"block_passes": self.window_blocks / windows, "head_passes": self.window_heads / windows,
                "naive_block_passes": self.naive_window_blocks / windows, "sets_scored": self.sets,
                "subset_scores": self.subset_scores, "tokens_scored": self.tokens, "seconds": round(self.seconds, 3)}


@dataclass
class Reference:
    """The unpruned model's predictions as every removal's KL and agreement read them, worked out
    once: KL(p || q) = sum p log p - sum p log q, so that a removal costs one product with p over the
    vocabulary where it cost an exp, a difference and a product, and the top-1 token is found once,
    not for every removal (the head's vocabulary-wide work was half of `exact`'s time in bf16:
    docs/benchmarks.md, "bf16 against fp32 on every command")."""

    probs: torch.Tensor  # [b, T - 1, V]: p
    self_term: torch.Tensor  # [b, T - 1]: sum p log p
    top1: torch.Tensor  # [b, T - 1]

    @classmethod
    def of(cls, logp: torch.Tensor) -> "Reference":
        probs = logp.exp()
        return cls(probs, torch.linalg.vecdot(probs, logp), top1_of(logp))

    def __getitem__(self, index) -> "Reference":
        """The same positions of every part (rows, and predictions along a window)."""
        return Reference(self.probs[index], self.self_term[index], self.top1[index])

    def to(self, device) -> "Reference":
        return Reference(self.probs.to(device), self.self_term.to(device), self.top1.to(device))

    def flat(self) -> "Reference":
        """Every position in one row of rows, as `head_scores` reads them."""
        return Reference(self.probs.reshape(-1, self.probs.shape[-1]), self.self_term.reshape(-1), self.top1.reshape(-1))


def window_scores(logp: torch.Tensor, ids: torch.Tensor, reference: Reference | None
                  ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A batch's log-probs of the next tokens as each position's loss [b, T-1] and, against
    `reference` (the unpruned model's predictions), each position's KL(unpruned || model) and whether
    its top-1 token is the unpruned model's (1.0) or not (0.0): teacher-forced agreement, what a
    greedy self-draft's acceptance is at each position."""
    return position_scores(logp, ids[:, 1:], reference)


# Positions the head scores at a time (`head_scores`; None: the whole batch at once). Alone, the head and
# the scores of 4 x 64 positions of SmolLM2-135M in fp32 took 0.71x the time in chunks of 64; inside
# exact's scorer, in turns, chunks of 64 took 1.12x and of 128 1.01x (0.99-1.03) the whole batch's, so
# the whole batch stays the default (docs/benchmarks.md, "Where the time goes on the Intel Xeon without
# AMX"); benchmarks/select/head_in_chunks.py measures it on another machine.
SCORE_ROWS: int | None = None

# Positions the prefix walk's head scores in one matmul: removals whose streams reach the head one
# after another wait, and are scored together while their positions stay within this many (a batch
# of more positions is scored alone). The head's matmul runs faster on more rows (SmolLM2-135M's, fp32,
# 252 rows at 246 GFLOP/s and 1,008 at 297 here), and the logits of this many positions are what it
# holds at once (0.2 GB at a vocabulary of 49,152; twice that with torch's log-softmax, where the
# vocabulary kernel is not used); 0: each removal alone.
# docs/benchmarks.md, "exact's heads together"; benchmarks/select/heads_together.py measures it.
HEAD_ROWS = 1024


def head_scores(logits_of: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor, ids: torch.Tensor, reference: Reference | None,
                rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`window_scores` of the stream entering the head (`h`: [b, T, d], or [g, b, T, d]: g removals'
    streams on the same windows, scored in one matmul; `logits_of`: the final norm, the head and the
    family's scale, in fp32), `rows` positions at a time: no vocabulary-wide tensor of the whole
    batch is made, and each position's figures are the whole batch's at once (a row's log-softmax,
    gather, product and argmax are its own). Figures come back in `h`'s leading shape, [b, T - 1] or
    [g, b, T - 1]."""
    b, t = ids.shape
    flat = h[..., : t - 1, :].reshape(-1, b * (t - 1), h.shape[-1])  # [g, positions, d]
    rows = rows or SCORE_ROWS or flat.shape[1]  # SCORE_ROWS read when called: the benchmark sets it
    targets = ids[:, 1:].reshape(-1).to(h.device)
    ref = None if reference is None else reference.flat()
    parts = []
    for start in range(0, flat.shape[1], rows):
        piece = slice(start, start + rows)
        parts.append(logit_scores(logits_of(flat[:, piece]), targets[piece], None if ref is None else ref[piece]))
    return tuple(None if parts[0][i] is None else torch.cat([p[i] for p in parts], 1).view(*h.shape[:-2], t - 1) for i in range(3))


def logit_scores(logits: torch.Tensor, targets: torch.Tensor, reference: Reference | None
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`position_scores` from the logits: by the vocabulary kernel in one read of them on the CPU
    (`vocab_scores`: its self-test holds it to torch's definitions in double within 1e-5), else the log-softmax's."""
    if vocab_scores.takes(logits):
        return vocab_scores.scored(logits, targets, *(() if reference is None else (reference.probs, reference.self_term, reference.top1)))
    return position_scores(torch.log_softmax(logits, dim=-1), targets, reference)


def position_scores(logp: torch.Tensor, targets: torch.Tensor, reference: Reference | None
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Each position's loss, KL and agreement (`window_scores`) from its log-probs and next token,
    positions in any leading shape (`targets` and `reference` broadcast over `logp`'s leading dimensions:
    several removals' log-probs against the one reference)."""
    losses = -logp.gather(-1, targets.expand(logp.shape[:-1])[..., None])[..., 0]
    if reference is None:
        return losses, None, None
    ref = reference.to(logp.device)
    # KL >= 0; the two sums' rounding can leave a model equal to the unpruned one a hair below 0. vecdot
    # sums pairwise: as a batched matrix product (3x faster here) the sum was off by 2.5e-3 of 22
    kl = (ref.self_term - torch.linalg.vecdot(ref.probs, logp)).clamp_min(0.0)
    return losses, kl, (top1_of(logp) == ref.top1).float()


def top1_of(logp: torch.Tensor) -> torch.Tensor:
    """The most probable token, the first of a tie: `argmax`'s answer in 0.6x its time on a CPU
    (`max`'s indices, whose rule for a tie is the same; docs/benchmarks.md, "depth-use's reads of the output")."""
    return logp.max(-1).indices


def masked_means(values: torch.Tensor, mask: torch.Tensor | None) -> list[float]:
    """Each window's mean of a per-prediction figure ([windows, tokens - 1]) over the predictions its
    mask scores (1 where scored: the model's own continuations, `select.continuations`); every
    prediction where there is no mask."""
    if mask is None:
        return values.mean(1).tolist()
    mask = mask.to(values.device, values.dtype)
    return ((values * mask).sum(1) / mask.sum(1)).tolist()


def removal_context(model, removal: Removal, granularity: str):
    """The model with `removal` out, as a context: whole blocks, or each kind of branch zeroed."""
    if granularity == "layer":
        return removed_layers(model, removal)
    stack = contextlib.ExitStack()
    for kind, part in (("a", "attn"), ("m", "mlp")):
        units = [int(u[1:]) for u in removal if u[0] == kind]
        if units:
            stack.enter_context(removed_units(model, units, part))
    return stack


@dataclass
class _Batch:
    ids: torch.Tensor
    mask: torch.Tensor | None = None  # the predictions scored (None: every one)
    ctx: object = None
    entering: list[torch.Tensor] = field(default_factory=list)  # the unpruned stream entering each block
    reference: Reference | None = None  # the unpruned model's predictions
    losses: list[float] = field(default_factory=list)  # the unpruned model's mean loss on each window


class CalibrationScorer:
    """The calibration windows' scores of any removal; `known` maps a removal's key to its scores in
    the order of `KEPT` (kept by the caller: `on_new` is called after each new one). `costs`: what
    drafting costs here, for the speedup objective (None: it is not asked, its score None). `mask`:
    which predictions of each window are scored ([windows, tokens - 1]; None: every one)."""

    def __init__(self, model, windows: torch.Tensor, batch_size: int, known: dict[str, list[float]], on_new: Callable[[], None],
                 granularity: str = "layer", world: World = World(), costs: DraftCosts | None = None, mask: torch.Tensor | None = None):
        self.model, self.windows, self.batch_size, self.known, self.on_new = model, windows, batch_size, known, on_new
        self.mask = mask
        self.costs = costs
        self.world = world  # under torchrun: the removals scored are shared over the ranks, every rank given every score
        self.granularity, self.n = granularity, num_layers(model)
        self.cost = Cost()
        # each removal's loss, KL and top-1 agreement on every window, in memory (not in `select.json`):
        # what a bootstrap resample of the windows reweighs instead of running the removal again
        self.windowed: dict[str, tuple[list[float], list[float], list[float]]] = {}
        self.stepper = self._stepper()
        self.batches = self._unpruned()

    @property
    def window_count(self) -> int:
        return len(self.windows)

    def _stepper(self) -> Stepper | None:
        try:
            return checked_stepper(self.model)
        except Unsupported:
            return None

    @torch.no_grad()
    def _unpruned(self) -> list[_Batch]:
        """Per batch of windows: the unpruned stream entering every block and the unpruned model's
        log-probs, from one pass (the model's own forward where there is no stepper)."""
        batches = []
        for start in range(0, len(self.windows), self.batch_size):
            ids = self.windows[start : start + self.batch_size]
            mask = None if self.mask is None else self.mask[start : start + self.batch_size]
            if self.stepper is None:
                logits = self.model(input_ids=ids.to(self.model.get_input_embeddings().weight.device), use_cache=False).logits
                logp = torch.log_softmax(logits[:, :-1].float(), -1).cpu()
                batches.append(_Batch(ids, mask, reference=Reference.of(logp), losses=masked_means(window_scores(logp, ids, None)[0], mask)))
                continue
            ids = ids.to(self.stepper.device)
            ctx = self.stepper.context(ids.shape[1], 0)
            h, entering = self.stepper.embed(ids), []
            for i in range(self.n):
                entering.append(h)
                h = self.stepper.block(i, h, ctx)
            logp = torch.log_softmax(self.stepper.logits(h)[:, :-1], dim=-1).cpu()
            batches.append(_Batch(ids, mask, ctx, entering, Reference.of(logp), masked_means(window_scores(logp, ids.cpu(), None)[0], mask)))
        return batches

    # --------------------------------------------------------------------------- one removal, every window
    def __call__(self, removal: Removal) -> dict[str, float]:
        """Every objective of `removal` on every calibration window (`KEPT`), measured once."""
        return self.score_many([removal])[0]

    def _scores(self, removal: Removal, loss: float, kl: float, agreement: float) -> list[float | None]:
        speedup = self.costs.time_per_token(agreement, removal) if self.costs is not None else None  # blocks, or each branch at its kind's measured cost
        return [loss, kl, 1.0 - agreement, speedup]

    def _unknown(self, removal: Removal) -> bool:
        # a record written before an objective existed keeps fewer scores: such a removal is measured again
        scores = self.known.get(key(removal))
        return scores is None or len(scores) < len(KEPT) or (self.costs is not None and scores[KEPT.index("speedup")] is None)

    def score_many(self, removals: list[Removal]) -> list[dict[str, float]]:
        """Every removal of `removals` on every window, those not yet known measured together (for
        whole blocks by the prefix walk); their scores, in order."""
        if any(not r for r in removals) and self._unknown(()):  # nothing removed: the unpruned model, measured already
            self.known[""] = self._scores((), *(sum(v) / len(v) for v in self.unpruned_windows()))
        todo = sorted({key(r): tuple(r) for r in removals if r and self._unknown(r)}.values())
        if todo:
            for removal, (losses, kls, agreements) in zip(todo, self.per_window(todo)):
                self.known[key(removal)] = self._scores(removal, sum(losses) / len(losses), sum(kls) / len(kls), sum(agreements) / len(agreements))
            self.on_new()
        return [dict(zip(KEPT, self.known[key(r)])) for r in removals]

    def unpruned_windows(self) -> tuple[list[float], list[float], list[float]]:
        """The unpruned model's loss, KL (0) and top-1 agreement (1) on each window."""
        losses = [v for b in self.batches for v in b.losses]
        return losses, [0.0] * len(losses), [1.0] * len(losses)

    def per_window(self, removals: list[Removal]) -> list[tuple[list[float], list[float], list[float]]]:
        """Each removal's loss, KL and top-1 agreement on every window, in order, each measured once
        in this process (a resumed run knows the means alone, and measures a removal again where a
        resample asks for its windows)."""
        todo = sorted({key(r): tuple(r) for r in removals if r and key(r) not in self.windowed}.values())
        if todo:
            started = time.perf_counter()
            walk = self._walk if self.stepper is not None and self.granularity == "layer" else self._one_by_one
            for removal, scores in zip(todo, self._shared(todo, walk)):
                self.windowed[key(removal)] = scores
                self.cost.naive_window_blocks += (self.n - len(removal)) * len(self.windows)
            self.cost.sets += len(todo)
            self.cost.tokens += len(todo) * self.windows.numel()
            self.cost.seconds += time.perf_counter() - started
        return [self.windowed[key(r)] if r else self.unpruned_windows() for r in removals]

    @torch.no_grad()
    def _walk(self, removals: list[Removal]) -> list[tuple[list[float], list[float], list[float]]]:
        """The depth-first walk over the removed-block prefixes, batch by batch: each node of the
        trie of `removals` advances its stream past the kept blocks before its child's removed one,
        once, and a removal's leaf runs the blocks after its last removed one and the head."""
        trie: dict = {}
        for r in removals:
            node = trie
            for layer in r:
                node = node.setdefault(layer, {})
            node[None] = r  # the leaf: the removal that ends here
        out: dict[Removal, tuple[list[float], list[float], list[float]]] = {r: ([], [], []) for r in removals}
        for batch in self.batches:
            width = len(batch.ids)
            waiting: list[tuple[torch.Tensor, Removal]] = []  # streams at the head, scored together (HEAD_ROWS)

            def score_waiting():
                if not waiting:
                    return
                h = torch.stack([h for h, _ in waiting])
                self.cost.window_heads += width * len(waiting)
                for g, figures in enumerate(zip(*head_scores(self.stepper.logits, h, batch.ids, batch.reference))):
                    for kept, values in zip(out[waiting[g][1]], figures):
                        kept.extend(masked_means(values, batch.mask))
                waiting.clear()

            def finish(h, at: int, removal):
                for i in range(at, self.n):
                    h = self.stepper.block(i, h, batch.ctx)
                self.cost.window_blocks += (self.n - at) * width
                waiting.append((h, removal))
                positions = width * (h.shape[1] - 1)  # a removal's predictions on this batch
                if (len(waiting) + 1) * positions > max(HEAD_ROWS, positions):
                    score_waiting()  # one more would pass HEAD_ROWS

            def visit(node: dict, h: torch.Tensor | None, at: int):
                """`h`: the stream entering block `at` with this node's blocks removed (None at the
                root: the unpruned stream, kept for every block)."""
                if None in node:
                    finish(h, at, node[None])
                for layer in sorted(k for k in node if k is not None):
                    if h is None:
                        child_h = batch.entering[layer]
                    else:
                        for i in range(at, layer):  # the kept blocks between, once for every child after them
                            h = self.stepper.block(i, h, batch.ctx)
                        self.cost.window_blocks += (layer - at) * width
                        at, child_h = layer, h
                    visit(node[layer], child_h, layer + 1)

            visit(trie, None, 0)
            score_waiting()
        return [out[r] for r in removals]

    def _weights(self, pieces) -> list[torch.Tensor | None]:
        """Each (window, tokens) piece's scored predictions (None: every one)."""
        return [None if self.mask is None else self.mask[w, : t - 1] for w, t in pieces]

    @staticmethod
    def _mean(values: list[torch.Tensor], weights: list[torch.Tensor | None]) -> float:
        """The mean over the scored predictions of several pieces together."""
        weight = None if weights[0] is None else torch.cat(weights)
        if weight is None or not weight.sum() > 0:  # no mask; or an EvoPress stage's window cut before its first scored prediction: every one counts
            return float(torch.cat(values).mean())
        return float((torch.cat(values) * weight.to(values[0].dtype)).sum() / weight.sum())

    @torch.no_grad()
    def _one_by_one(self, removals: list[Removal]) -> list[tuple[list[float], list[float], list[float]]]:
        every = [(w, self.windows.shape[1]) for w in range(len(self.windows))]
        weights = self._weights(every)
        return [tuple([self._mean([v], [m]) for v, m in zip(values, weights)] for values in self._measured(removal, every)) for removal in removals]

    # --------------------------------------------------------------------------- some windows
    def score_on(self, removal: Removal, windows: list[int], last_tokens: int, objective: str) -> float:
        """`objective` on the given windows, the last cut to its first `last_tokens` tokens, as
        EvoPress's selection stages score a minibatch: the mean over every next-token prediction
        (a window of t tokens makes t - 1). The cut window runs as a window of `last_tokens` tokens,
        as theirs does (causal: its predictions are the full window's first ones). Not kept: a
        stage's minibatch is its own."""
        return self.score_on_many([removal], windows, last_tokens, objective)[0]

    def score_on_many(self, removals: list[Removal], windows: list[int], last_tokens: int, objective: str) -> list[float]:
        """`score_on` of each removal on the same minibatch; under torchrun the removals are shared
        over the ranks (consecutive runs, even in blocks) and the scores gathered."""
        started = time.perf_counter()
        pieces = [(w, self.windows.shape[1]) for w in windows[:-1]] + [(windows[-1], min(last_tokens, self.windows.shape[1]))]
        weights = self._weights(pieces)

        def mine(share):
            out = []
            for removal in share:
                measured = dict(zip(("ppl", "kl", "agreement"), self._measured(removal, pieces)))
                if objective in ("ppl", "kl"):
                    out.append(self._mean(measured[objective], weights))
                else:
                    loss, kl, agreement = (self._mean(measured[m], weights) for m in ("ppl", "kl", "agreement"))
                    out.append(self._scores(removal, loss, kl, agreement)[KEPT.index(objective)])
            return out

        scores = self._shared(removals, mine)
        self.cost.subset_scores += len(removals)
        self.cost.tokens += len(removals) * sum(t for _, t in pieces)
        self.cost.seconds += time.perf_counter() - started
        return scores

    # --------------------------------------------------------------------------- over the ranks
    def _work(self, removal: Removal) -> int:
        """The blocks a removal runs from its first touched one, and the head as one more: the
        cost that sharing removals out over the ranks evens (a walk's shared prefixes aside)."""
        return self.n - self._first(removal) + 1

    def _shared(self, items: list, compute: Callable[[list], list]) -> list:
        """`compute` over `items`, each rank its consecutive share (`contiguous_shares`: a prefix
        walk keeps its shared prefixes), every rank given every result in order, and the blocks
        and heads every rank ran added to this rank's cost. Alone: `compute(items)`."""
        if self.world.size == 1:
            return compute(items)
        bounds = contiguous_shares([self._work(r) for r in items], self.world.size)
        before = replace(self.cost)
        start, end = bounds[self.world.rank]
        mine = compute(items[start:end])
        ran = (self.cost.window_blocks - before.window_blocks, self.cost.window_heads - before.window_heads)
        gathered = self.world.all_gather((mine, ran))
        self.cost.window_blocks = before.window_blocks + sum(r[1][0] for r in gathered)
        self.cost.window_heads = before.window_heads + sum(r[1][1] for r in gathered)
        return [x for part, _ in gathered for x in part]

    def _removed(self, removal: Removal):
        return removal_context(self.model, removal, self.granularity)

    def _first(self, removal: Removal) -> int:
        return min(int(u) if self.granularity == "layer" else int(u[1:]) for u in removal)

    @torch.no_grad()
    def _measured(self, removal: Removal, pieces) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """Per-position loss, KL and top-1 agreement of `removal` on each (window, tokens) of `pieces` (a window's
        first `tokens` tokens, t - 1 predictions each): from its first touched block on the kept
        unpruned streams where the stepper runs, else the model's forward. Windows of one batch
        and one length run together."""
        T = self.windows.shape[1]
        groups: dict[tuple[int, int], list[int]] = {}
        for w, t in pieces:
            groups.setdefault((w // self.batch_size, t), []).append(w)
        found: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        for (b, t), ws in groups.items():
            batch = self.batches[b]
            rows = torch.tensor([w % self.batch_size for w in ws])
            ids = batch.ids[rows, :t]
            with self._removed(removal):
                if self.stepper is None:
                    logits = self.model(input_ids=ids.to(self.model.get_input_embeddings().weight.device), use_cache=False).logits
                    logp = torch.log_softmax(logits[:, :-1].float(), -1)
                    self.cost.window_blocks += (self.n - (len(removal) if self.granularity == "layer" else 0)) * len(ws) * t / T
                else:
                    first = self._first(removal)
                    h = batch.entering[first][rows.to(batch.entering[first].device), :t]
                    ctx = batch.ctx if t == T else self.stepper.context(t, 0)
                    # whole blocks: the kept ones after the first removed; sub-blocks: every block from the
                    # first touched one, its branch zeroed by the hooks `_removed` put on
                    kept = [i for i in range(first, self.n) if self.granularity != "layer" or i not in removal]
                    for i in kept:
                        h = self.stepper.block(i, h, ctx)
                    self.cost.window_blocks += len(kept) * len(ws) * t / T
                scores = (window_scores(logp, ids.to(logp.device), batch.reference[rows, : t - 1]) if self.stepper is None
                          else head_scores(self.stepper.logits, h, ids, batch.reference[rows, : t - 1]))
            self.cost.window_heads += len(ws) * t / T
            for j, w in enumerate(ws):
                found[w, t] = tuple(s[j].cpu() for s in scores)
        return tuple([found[p][i] for p in pieces] for i in range(3))


def contiguous_shares(costs: list[float], ranks: int) -> list[tuple[int, int]]:
    """[start, end) of each rank's consecutive run of items, the runs' costs as even as cutting in
    order allows: rank r's run ends where the running total first reaches (r + 1) / ranks of the
    whole (a rank may get none where items are fewer than ranks)."""
    total, bounds, start, running, item = sum(costs), [], 0, 0.0, 0
    for r in range(ranks):
        target = total * (r + 1) / ranks
        while item < len(costs) and (r == ranks - 1 or running + costs[item] / 2 <= target):
            running += costs[item]
            item += 1
        bounds.append((start, item))
        start = item
    return bounds
