"""What a reuse-engine sweep runs, decided before anything runs.

`plan` groups the requests' rows by shared token prefix; `Batcher` cuts them into batches that
fit the memory budget (rows packed into shared sequences, a prefix too large for the budget
shared by a few variants at a time) and counts each batch's token-block passes; `Layout` holds
the result, with its cost, each torchrun rank's share and its identity. Nothing here runs the
model, so a layout can be judged on the meta device (benchmarks/prune/sweep_layout.py); `scoring`
runs it.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field
from typing import Iterable

import torch

from depthcurse.errors import DepthcurseError
from depthcurse.prune.stepping import Stepper
from depthcurse.surgery import check_granularity

MIN_SHARED_PREFIX = 16  # tokens; below this a prefix group saves less than it costs in smaller batches
# Tokens per batch at most: a batch (every variant) is the unit of progress and of resuming, so
# beyond this a bigger batch only delays the next saved checkpoint. A CPU gains little from big
# batches and takes minutes per batch of all variants, so there the cap is lower.
MAX_BATCH_TOKENS = {"cuda": 16384, "cpu": 2048}
# What a block call costs beyond its tokens. On a GPU: its kernel launches from Python (about
# 0.2 ms for an eager decoder layer), whatever the batch, as many FLOPs as CALL_FLOPS_GPU at the
# ~400 TFLOP/s a layer reaches. On a CPU: reading the block's weights from memory, whatever the
# batch, which grows with the block as its FLOPs per token do, so a count of tokens: SmolLM2's block
# took 1.6 ms for 4 tokens against 0.044 ms per token in large batches, and a prefix group's calls
# (after a cached prefix) more; sharing every prefix made 0-shot ARC-Easy and MMLU sweeps 19-28%
# slower than sharing none (benchmarks/prune/prefix_sharing.py, docs/benchmarks.md).
CALL_FLOPS_GPU = 8e10
CALL_TOKENS_CPU = 100


def parse_memory(text: str | int | None, device=None) -> int:
    """'2GB', '512MB', '1.5GiB' or a number of bytes -> bytes. `auto` (or None): 2 GiB on a CPU;
    on a GPU 80% of what is free on `device` once the model is loaded, in whole GiB (so that a
    resumed sweep cuts the same batches)."""
    if text is None or str(text).strip().lower() == "auto":
        if device is not None and torch.device(device).type == "cuda":
            free, _ = torch.cuda.mem_get_info(torch.device(device))
            return max(2**30, int(0.8 * free) // 2**30 * 2**30)
        return 2 * 2**30
    if isinstance(text, int):
        value = text
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*", str(text).lower())
        if match is None:
            raise DepthcurseError(f"bad --max-memory {text!r}: use auto or a size like 2GB or 512MB")
        unit = (match.group(2) or "b").rstrip("b").rstrip("i")
        value = int(float(match.group(1)) * 1024 ** "_kmgt".index(unit or "_"))
    if value < 2**20:
        raise DepthcurseError(f"--max-memory {text} is too small: give at least 1MB")
    return value


@dataclass(frozen=True)
class TokenRequest:
    """Score `targets` as the tokens following positions start, start+1, ... of `inputs`."""

    inputs: tuple[int, ...]
    start: int
    targets: tuple[int, ...]


@dataclass
class Row:
    inputs: tuple[int, ...]
    requests: list[int] = field(default_factory=list)  # indices into the request list

    def first_scored(self, reqs: list[TokenRequest]) -> int:
        return min(reqs[r].start for r in self.requests)


@dataclass
class Group:
    prefix: int  # tokens shared by every row (0: none)
    rows: list[Row]


@dataclass
class Batch:
    group: int
    rows: list[Row]
    bins: list[list[int]]  # the sequences the batch runs as: indices into rows, packed one after another
    variants: tuple[int, ...] | None = None  # indices into the scorer's variants this batch scores (None: all)

    @property
    def packed(self) -> bool:
        return any(len(b) > 1 for b in self.bins)


def _place(free: list[int], width: int) -> int:
    """The sequence a row of `width` tokens goes into: the first with room for it (first fit), or a new one."""
    return next((j for j, f in enumerate(free) if f >= width), len(free))


def _common(a: tuple, b: tuple, limit: int) -> int:
    n = min(len(a), len(b), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def small_batch_tokens(stepper: Stepper) -> int:
    """Tokens below which a batch costs the device about as much as a batch of this many: where a
    block call is bound by its launches (GPU) or its weights' reads (CPU), not its FLOPs."""
    if torch.device(stepper.device).type == "cpu":
        return CALL_TOKENS_CPU
    per_token = 2 * sum(p.numel() for p in stepper.layers[0].parameters())
    return int(CALL_FLOPS_GPU / max(per_token, 1))


def plan(requests: list[TokenRequest], min_prefix: int = MIN_SHARED_PREFIX, min_saving: int = 0) -> list[Group]:
    """Rows (one per distinct input: the choices of a question share one) grouped by shared token prefix.

    Prefixes are found on tokens, not strings (BPE may merge across a string boundary), and end
    before the first scored position of every row, so prefix positions never need the head.
    A group of k rows sharing p tokens is kept only if the (k-1)*p token passes it saves reach
    `min_saving`: a group runs its prefix alone and its rows in batches of their own, and on a
    GPU a small batch costs as much as a full one, and on a CPU as much as CALL_TOKENS_CPU
    tokens (see `small_batch_tokens`). The 0-shot MMLU header shared by a handful of questions, or an ARC
    question shared by its 4 answers, does not pay for that; a 5-shot block does.
    """
    rows: dict[tuple, Row] = {}
    for i, r in enumerate(requests):
        rows.setdefault(r.inputs, Row(r.inputs)).requests.append(i)
    ordered = sorted(rows.values(), key=lambda row: row.inputs)
    groups: list[Group] = []
    loose: list[Row] = []
    current: list[Row] = []
    prefix = 0

    def close():
        if len(current) >= 2 and prefix >= min_prefix and (len(current) - 1) * prefix >= min_saving:
            groups.append(Group(prefix, list(current)))
        else:
            loose.extend(current)

    for row in ordered:
        cap = row.first_scored(requests)
        if current:
            shared = _common(current[0].inputs, row.inputs, min(prefix, cap))
            # k rows sharing p tokens save (k-1)*p token passes: join only if that does not shrink
            # the saving (a subject's few-shot block beats each question's own longer context)
            if shared >= min_prefix and len(current) * shared >= (len(current) - 1) * prefix:
                current.append(row)
                prefix = shared
                continue
            close()
        current, prefix = [row], cap
    if current:
        close()
    if loose:
        groups.append(Group(0, loose))
    return groups


class Batcher:
    """A sweep's cost model: what a batch holds in memory and how many block passes it takes,
    for these variants of this model; and the rows cut into batches that fit the budget."""

    def __init__(self, stepper: Stepper, variants: list[tuple[int, ...]], max_memory: int, max_batch_tokens: int | None = None, pack: bool = False, granularity: str = "layer"):
        self.s = stepper
        check_granularity(stepper.model, granularity)
        self.granularity = granularity  # what a variant's indices remove: whole blocks, or one branch of each
        self.variants = list(variants)
        if () not in self.variants:
            raise ValueError("the unpruned model must be among the variants")
        for v in self.variants:
            if any(not 0 <= i < stepper.n_layers for i in v):
                raise DepthcurseError(f"variant {v} removes a layer outside 0-{stepper.n_layers - 1}")
        self.starts = sorted({min(v) for v in self.variants if v})
        self.everyone = tuple(range(len(self.variants)))  # the variants of a batch that scores them all
        self.budget = max_memory
        self.unshared = 0  # prefix groups whose keys and values did not fit even one variant at a time: run whole
        self.split = 0  # prefix groups whose keys and values for every variant did not fit: a share of the variants at a time
        self.max_batch_tokens = max_batch_tokens or MAX_BATCH_TOKENS.get(torch.device(stepper.device).type, MAX_BATCH_TOKENS["cuda"])
        self.pack = pack  # rows of different lengths share a sequence (see Stepper.packed_context)

    # memory: the kept streams, plus a few more activations per token (attention, MLP), and the
    # packed masks (one per layer type)
    def _bytes_per_token(self, keys: int) -> int:
        c = self.s.config
        width = c.hidden_size * (len(self.starts) + 4) + 2 * getattr(c, "intermediate_size", 4 * c.hidden_size)
        attn = (getattr(c, "num_attention_heads", 1) + (len(set(self.s.types)) if self.pack else 0)) * keys
        return (width + attn) * self.s.embed_tokens.weight.element_size()

    def layers_run(self, v: tuple) -> int:
        """Blocks a removal runs after the unpruned model's stream at its first removed block."""
        return self.s.n_layers - min(v) - (len(v) if self.granularity == "layer" else 0)

    def base_layers(self, chunk: tuple[int, ...]) -> int:
        """Blocks of the unpruned model a share of the variants needs: all of them to score the
        unpruned model itself, else up to the last stream a removal starts from."""
        return self.s.n_layers if any(not self.variants[i] for i in chunk) else max(min(self.variants[i]) for i in chunk)

    def _blocks_per_token(self, chunk: tuple[int, ...]) -> int:
        """Block calls a token takes for a share of the variants: the unpruned model's, then each removal's."""
        return self.base_layers(chunk) + sum(self.layers_run(self.variants[i]) for i in chunk if self.variants[i])

    def _prefix_kv_bytes(self, length: int, chunk: tuple[int, ...]) -> int:
        c = self.s.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        per_layer = 2 * length * getattr(c, "num_key_value_heads", c.num_attention_heads) * head_dim * self.s.embed_tokens.weight.element_size()
        return per_layer * self._blocks_per_token(chunk)

    def _variant_chunks(self, length: int, room: int) -> list[tuple[int, ...]] | None:
        """The variants cut, in order, into shares whose keys and values of a `length`-token prefix
        fit `room`; None if one variant alone does not fit."""
        chunks: list[tuple[int, ...]] = []
        for i in range(len(self.variants)):
            if chunks and self._prefix_kv_bytes(length, chunks[-1] + (i,)) <= room:
                chunks[-1] += (i,)
            elif self._prefix_kv_bytes(length, (i,)) <= room:
                chunks.append((i,))
            else:
                return None
        return chunks

    def batches(self, requests: list[TokenRequest], groups: list[Group]) -> list[Batch]:
        """Rows cut into batches whose kept streams fit the memory budget; longest rows first, as lm-eval sorts.

        Packed, a batch's sequences are as long as its longest row and the shorter rows fill them
        first-fit: once a batch can take no more sequences, the rows after it that fit its gaps
        still go in, so a batch of mixed lengths runs on (nearly) no padding.

        A shared prefix keeps its keys and values for every variant, at most half the budget.
        Where they would not fit (a long 5-shot block, a big model), the group's batches run once
        per share of the variants whose keys and values do: each share repeats the unpruned
        model's pass over the rows (only up to its last removal), which costs far less than
        running every row's whole prompt for every variant. Only where one variant alone does
        not fit do the rows run whole. The scores are the same either way.
        """
        out = []
        for gi, g in enumerate(groups):
            budget, chunks = self.budget, [None]
            if g.prefix:
                room = self.budget // 2
                if self._prefix_kv_bytes(g.prefix, self.everyone) > room:
                    chunks = self._variant_chunks(g.prefix, room)
                    if chunks is None:
                        g.prefix, chunks = 0, [None]
                        self.unshared += 1
                    else:
                        self.split += 1
                if g.prefix:
                    budget -= max(self._prefix_kv_bytes(g.prefix, c or self.everyone) for c in chunks)
            pending, cut = sorted(g.rows, key=lambda r: (-len(r.inputs), r.inputs)), []
            while pending:
                batch, bins, pending = self._fill(pending, g.prefix, budget)
                cut += self._less_padding(batch, bins, g.prefix, budget)
            out += [Batch(gi, batch, bins, chunk) for chunk in chunks for batch, bins in cut]
        return out

    def _padding(self, batch: list[Row], bins: list[list[int]], prefix: int) -> int:
        """Tokens of padding a batch runs: its sequences are as long as its longest row."""
        widths = [len(r.inputs) - prefix for r in batch]
        return len(bins) * max(widths) - sum(widths)

    def _less_padding(self, batch: list[Row], bins: list[list[int]], prefix: int, budget: int, depth: int = 3) -> list[tuple[list[Row], list[list[int]]]]:
        """The batch, or its rows cut in two batches (each cut again, up to `depth` times) where
        the padding that saves outweighs a batch's own cost (`small_batch_tokens`). Rows longer
        than half the longest cannot share a sequence, so a batch of them pads every row to the
        longest: 12 MMLU questions of 54-106 tokens ran 29% padding in one batch (a 0-shot
        sweep 0.54x the lm-eval loop where sharing the prompt's header had given 0.44x, by cutting
        the same rows into three batches). The cut is tried where the rows' lengths drop most."""
        padding, call = self._padding(batch, bins, prefix), small_batch_tokens(self.s)
        if depth == 0 or len(batch) < 2 or padding <= call:
            return [(batch, bins)]
        widths = [len(r.inputs) - prefix for r in batch]  # longest first, as `_fill` took them
        drops = sorted(range(1, len(batch)), key=lambda k: (widths[k] - widths[k - 1], k))[:8]
        best, best_cost = None, padding
        for k in drops:
            parts = [self._fill(rows, prefix, budget) for rows in (batch[:k], batch[k:])]
            if any(left for _, _, left in parts):
                continue  # cannot happen: a part of a batch that fit fits whole
            parts = [(b, s) for b, s, _ in parts]
            cost = sum(self._padding(b, s, prefix) for b, s in parts) + call
            if cost < best_cost:
                best, best_cost = parts, cost
        if best is None:
            return [(batch, bins)]
        return [piece for b, s in best for piece in self._less_padding(b, s, prefix, budget, depth - 1)]

    def passes(self, b: Batch, groups: list[Group]) -> tuple[int, int]:
        """A batch's token-block passes: (its shared prefix's, which a process runs once for
        consecutive batches of one group and share; its rows')."""
        per_token = self._blocks_per_token(b.variants or self.everyone)
        prefix = groups[b.group].prefix
        return prefix * per_token, len(b.bins) * (max(len(r.inputs) for r in b.rows) - prefix) * per_token

    def _fill(self, rows: list[Row], prefix: int, budget: int) -> tuple[list[Row], list[list[int]], list[Row]]:
        """One batch from `rows` (longest first): (its rows, its sequences, the rows left, in order)."""
        widths = [len(r.inputs) - prefix for r in rows]
        descending = [-w for w in widths]  # for bisect: the first row at most a gap long
        longest = widths[0]
        batch: list[Row] = []
        bins: list[list[int]] = []
        free: list[int] = []  # room left in each sequence of the batch
        later: list[Row] = []
        full = False  # no room for another sequence: only the gaps are left to fill
        i = 0
        while i < len(rows):
            width = widths[i]
            if full:
                gap = max(free)
                if gap < widths[-1]:
                    later += rows[i:]
                    break
                if width > gap:
                    k = bisect.bisect_left(descending, -gap, lo=i)
                    later += rows[i:k]
                    i = k
                    continue
            j = _place(free, width) if self.pack else len(free)
            if j == len(free):
                tokens = (len(free) + 1) * longest
                if batch and (tokens * self._bytes_per_token(prefix + longest) > budget or tokens > self.max_batch_tokens):
                    if not self.pack:
                        later += rows[i:]
                        break
                    full = True
                    later.append(rows[i])
                    i += 1
                    continue
                bins.append([])
                free.append(longest)
            bins[j].append(len(batch))
            free[j] -= width
            batch.append(rows[i])
            i += 1
        return batch, bins, later


@dataclass
class Layout:
    """The batches a sweep runs, in order, and the prefix groups they come from: all decided
    before anything runs, so that their cost and each rank's share can be judged without running
    them (on the meta device, before a GPU is booked: benchmarks/prune/sweep_layout.py)."""

    batcher: Batcher
    groups: list[Group]
    batches: list[Batch]
    min_prefix_saving: int = 0  # what a prefix group had to save to be kept (see `plan`)

    def block_passes(self, indices: Iterable[int] | None = None) -> int:
        """The token-block passes that scoring these batches (all, or those at `indices`) in one
        process counts (`VariantScorer.block_passes`)."""
        total, kv_for = 0, None
        for k in range(len(self.batches)) if indices is None else indices:
            b = self.batches[k]
            prefix, rows = self.batcher.passes(b, self.groups)
            if prefix and kv_for != (b.group, b.variants):
                total, kv_for = total + prefix, (b.group, b.variants)
            total += rows
        return total

    def share_out(self, ranks: int, saved: frozenset = frozenset()) -> list[list[int]]:
        """The batches (indices, in order) each of `ranks` processes scores.

        Costliest first, each batch goes to the rank that would finish it soonest (list
        scheduling), a shared prefix costing a rank its passes once: a group's batches stay on one
        rank unless that leaves the ranks uneven. Taking every `ranks`-th batch instead left the
        busiest of 8 ranks 17% above an even share on full MMLU (batches shrink towards the end of
        each group). Batches in `saved` (finished by an earlier run) cost nothing. Depends on the
        layout alone, so every rank computes the same shares.
        """
        if ranks == 1:
            return [list(range(len(self.batches)))]
        cost = {k: (0, 0) if k in saved else self.batcher.passes(b, self.groups) for k, b in enumerate(self.batches)}
        load, held, out = [0] * ranks, [set() for _ in range(ranks)], [[] for _ in range(ranks)]
        for k in sorted(cost, key=lambda k: (-sum(cost[k]), k)):
            prefix, rows = cost[k]
            key = (self.batches[k].group, self.batches[k].variants)
            finish = [load[r] + rows + (0 if key in held[r] else prefix) for r in range(ranks)]
            r = min(range(ranks), key=lambda r: (finish[r], r))
            load[r] = finish[r]
            if prefix:
                held[r].add(key)
            out[r].append(k)
        return [sorted(ks) for ks in out]

    def describe(self) -> list:
        """What identifies the layout: saved batches of another layout never pass for this one's."""
        s = self.batcher
        return [s.granularity, [list(v) for v in s.variants],
                [[b.group, [r.requests for r in b.rows], b.bins, *([b.variants] if b.variants else [])] for b in self.batches],
                [g.prefix for g in self.groups]]


def lay_out(
    stepper: Stepper,
    requests: list[TokenRequest],
    variants: list[tuple[int, ...]],
    *,
    max_memory: int,
    pack: bool,
    share_prefixes: bool = True,
    min_prefix_saving: int | None = None,
    max_batch_tokens: int | None = None,
    granularity: str = "layer",
) -> Layout:
    """The layout `score_requests` runs with these arguments. `pack`: whether rows may share
    sequences, which `score_requests` first asks the model (`Stepper.packing_fails`, which runs it)."""
    batcher = Batcher(stepper, variants, max_memory, max_batch_tokens, pack=pack, granularity=granularity)
    if min_prefix_saving is None:
        min_prefix_saving = 2 * small_batch_tokens(stepper)
    groups = plan(requests, MIN_SHARED_PREFIX if share_prefixes else 10**9, min_prefix_saving)
    return Layout(batcher, groups, batcher.batches(requests, groups), min_prefix_saving)


def plain_block_passes(requests: list[TokenRequest], variants: list[tuple], n_layers: int) -> int:
    """Token-block passes of evaluating each variant from scratch: every distinct input through every kept block, no padding."""
    tokens = sum(len(inputs) for inputs in {r.inputs for r in requests})
    return tokens * sum(n_layers - len(v) for v in variants)
