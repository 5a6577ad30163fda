"""Scoring token requests under every variant at once, batch by batch, resumably.

`plan` groups the requests' rows by shared token prefix; `VariantScorer` cuts them into batches
that fit the memory budget and runs each batch through the unpruned model once, every variant
continuing from the stream at its first removed block; `score_requests` keeps each finished
batch on disk, so an interrupted sweep recomputes nothing it finished.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import re
import shutil
import time
from array import array
from contextlib import nullcontext
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import torch
import torch.nn.functional as F

from depthcurse.errors import DepthcurseError
from depthcurse.io import atomic_write
from depthcurse.prune.stepping import Stepper, _PrefixKV, _RecordKV
from depthcurse.runtime import World
from depthcurse.surgery import check_granularity, removed_units

MIN_SHARED_PREFIX = 16  # tokens; below this a prefix group saves less than it costs in smaller batches
HEAD_CHUNK_BYTES = 256 * 2**20  # fp32 logits computed at once by the head (cross-entropy needs as much again)
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
# slower than sharing none (benchmarks/prefix_sharing.py, docs/benchmarks.md).
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
class _Row:
    inputs: tuple[int, ...]
    requests: list[int] = field(default_factory=list)  # indices into the request list

    def first_scored(self, reqs: list[TokenRequest]) -> int:
        return min(reqs[r].start for r in self.requests)


@dataclass
class _Group:
    prefix: int  # tokens shared by every row (0: none)
    rows: list[_Row]


@dataclass
class _Batch:
    group: int
    rows: list[_Row]
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


def plan(requests: list[TokenRequest], min_prefix: int = MIN_SHARED_PREFIX, min_saving: int = 0) -> list[_Group]:
    """Rows (one per distinct input: the choices of a question share one) grouped by shared token prefix.

    Prefixes are found on tokens, not strings (BPE may merge across a string boundary), and end
    before the first scored position of every row, so prefix positions never need the head.
    A group of k rows sharing p tokens is kept only if the (k-1)*p token passes it saves reach
    `min_saving`: a group runs its prefix alone and its rows in batches of their own, and on a
    GPU a small batch costs as much as a full one, and on a CPU as much as CALL_TOKENS_CPU
    tokens (see `small_batch_tokens`). The 0-shot MMLU header shared by a handful of questions, or an ARC
    question shared by its 4 answers, does not pay for that; a 5-shot block does.
    """
    rows: dict[tuple, _Row] = {}
    for i, r in enumerate(requests):
        rows.setdefault(r.inputs, _Row(r.inputs)).requests.append(i)
    ordered = sorted(rows.values(), key=lambda row: row.inputs)
    groups: list[_Group] = []
    loose: list[_Row] = []
    current: list[_Row] = []
    prefix = 0

    def close():
        if len(current) >= 2 and prefix >= min_prefix and (len(current) - 1) * prefix >= min_saving:
            groups.append(_Group(prefix, list(current)))
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
        groups.append(_Group(0, loose))
    return groups


class VariantScorer:
    """Log-likelihoods of token requests under the unpruned model and every variant, batch by batch."""

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
        self.block_passes = 0
        self.need_greedy = True  # whether is_greedy is wanted (lm-eval's tasks) or only log-likelihoods (ppl)

    # memory: the kept streams, plus a few more activations per token (attention, MLP), and the
    # packed masks (one per layer type)
    def _bytes_per_token(self, keys: int) -> int:
        c = self.s.config
        width = c.hidden_size * (len(self.starts) + 4) + 2 * getattr(c, "intermediate_size", 4 * c.hidden_size)
        attn = (getattr(c, "num_attention_heads", 1) + (len(set(self.s.types)) if self.pack else 0)) * keys
        return (width + attn) * self.s.embed_tokens.weight.element_size()

    def _layers_run(self, v: tuple) -> int:
        """Blocks a removal runs after the unpruned model's stream at its first removed block."""
        return self.s.n_layers - min(v) - (len(v) if self.granularity == "layer" else 0)

    def _base_layers(self, chunk: tuple[int, ...]) -> int:
        """Blocks of the unpruned model a share of the variants needs: all of them to score the
        unpruned model itself, else up to the last stream a removal starts from."""
        return self.s.n_layers if any(not self.variants[i] for i in chunk) else max(min(self.variants[i]) for i in chunk)

    def _blocks_per_token(self, chunk: tuple[int, ...]) -> int:
        """Block calls a token takes for a share of the variants: the unpruned model's, then each removal's."""
        return self._base_layers(chunk) + sum(self._layers_run(self.variants[i]) for i in chunk if self.variants[i])

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

    def batches(self, requests: list[TokenRequest], groups: list[_Group]) -> list[_Batch]:
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
                cut.append((batch, bins))
            out += [_Batch(gi, batch, bins, chunk) for chunk in chunks for batch, bins in cut]
        return out

    def _passes(self, b: _Batch, groups: list[_Group]) -> tuple[int, int]:
        """A batch's token-block passes: (its shared prefix's, which a process runs once for
        consecutive batches of one group and share; its rows')."""
        per_token = self._blocks_per_token(b.variants or self.everyone)
        prefix = groups[b.group].prefix
        return prefix * per_token, len(b.bins) * (max(len(r.inputs) for r in b.rows) - prefix) * per_token

    def _fill(self, rows: list[_Row], prefix: int, budget: int) -> tuple[list[_Row], list[list[int]], list[_Row]]:
        """One batch from `rows` (longest first): (its rows, its sequences, the rows left, in order)."""
        widths = [len(r.inputs) - prefix for r in rows]
        descending = [-w for w in widths]  # for bisect: the first row at most a gap long
        longest = widths[0]
        batch: list[_Row] = []
        bins: list[list[int]] = []
        free: list[int] = []  # room left in each sequence of the batch
        later: list[_Row] = []
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

    def _base_pass(self, h, ctx, cache, chunk: tuple[int, ...]) -> tuple[torch.Tensor, dict]:
        """The unpruned model's blocks as far as `chunk` needs them: (the stream after them, the
        streams each removal starts from, by block)."""
        streams, last = {}, self._base_layers(chunk)
        for i in range(last):
            if i in self.starts:
                streams[i] = h
            h = self.s.block(i, h, ctx, cache)
            self.block_passes += h.shape[0] * h.shape[1]
        streams[last] = h  # where the chunk's last removal starts (or, the whole model run, its output)
        return h, streams

    def _run(self, h, ctx, start: int, removed: tuple, cache) -> torch.Tensor:
        """The stream at block `start` through the rest of the variant: removed blocks skipped, or
        (attn/mlp granularity) every block run with the removed branches zeroed."""
        skipped = removed if self.granularity == "layer" else ()
        with removed_units(self.s.model, removed, self.granularity) if not skipped else nullcontext():
            for i in range(start, self.s.n_layers):
                if i not in skipped:
                    h = self.s.block(i, h, ctx, cache)
                    self.block_passes += h.shape[0] * h.shape[1]
        return h

    @torch.inference_mode()
    def prefix_kv(self, tokens: tuple[int, ...], chunk: tuple[int, ...] | None = None) -> dict:
        """Keys and values of a shared prefix for the variants of `chunk` (indices; None: every
        variant), only the layers each runs; under `()` the unpruned model's, for the blocks the chunk needs."""
        chunk = chunk or self.everyone
        ids = torch.tensor([tokens], device=self.s.device)
        ctx = self.s.context(len(tokens), 0)
        rec = _RecordKV()
        _, streams = self._base_pass(self.s.embed(ids), ctx, rec, chunk)
        out = {(): rec.kv}
        for v in (self.variants[i] for i in chunk):
            if v:
                rv = _RecordKV()
                self._run(streams[min(v)], ctx, min(v), v, rv)
                out[v] = rv.kv
        return out

    @torch.inference_mode()
    def score_batch(self, requests: list[TokenRequest], batch: _Batch, prefix: int, kv: dict | None) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """(log-likelihood [variants, requests] float64, is_greedy [variants, requests] bool, request ids),
        for the batch's variants (`batch.variants`, in that order; all of them if None)."""
        s = self.s
        rows = batch.rows
        chunk = batch.variants or self.everyone
        width = max(len(r.inputs) for r in rows) - prefix
        ids = torch.zeros(len(batch.bins), width, dtype=torch.long)
        docs = torch.empty(len(batch.bins), width, dtype=torch.long)
        positions = torch.empty(len(batch.bins), width, dtype=torch.long)
        where = {}  # row -> (sequence, offset)
        for b, members in enumerate(batch.bins):
            offset = 0
            for d in members:
                n = len(rows[d].inputs) - prefix
                ids[b, offset : offset + n] = torch.tensor(rows[d].inputs[prefix:])
                docs[b, offset : offset + n], positions[b, offset : offset + n] = d, torch.arange(n)
                where[d] = (b, offset)
                offset += n
            docs[b, offset:], positions[b, offset:] = len(rows) + b, torch.arange(width - offset)  # padding: its own document
        # every scored position of the batch, flattened: (sequence, index, target, request)
        req_ids, b_idx, p_idx, tgt, seg = [], [], [], [], []
        for d, row in enumerate(rows):
            b, offset = where[d]
            for r in row.requests:
                tr = requests[r]
                n = len(tr.targets)
                b_idx += [b] * n
                p_idx += range(offset + tr.start - prefix, offset + tr.start - prefix + n)
                tgt += tr.targets
                seg += [len(req_ids)] * n
                req_ids.append(r)
        b_idx, p_idx = torch.tensor(b_idx, device=s.device), torch.tensor(p_idx, device=s.device)
        tgt, seg = torch.tensor(tgt, device=s.device), torch.tensor(seg, device=s.device)
        ctx = s.packed_context(docs, positions, prefix) if batch.packed else s.context(width, prefix)
        # Scores stay on the device until the batch is done: one transfer per batch, not two per variant.
        lp = torch.zeros(len(chunk), len(req_ids), dtype=torch.float64, device=s.device)
        misses = torch.zeros(len(chunk), len(req_ids), dtype=torch.long, device=s.device)

        def score(vi, h):
            # A model spread over devices (device_map) ends on another device than it starts on.
            picked = h[b_idx.to(h.device), p_idx.to(h.device)]
            step = max(1, HEAD_CHUNK_BYTES // (4 * s.head.weight.shape[0]))
            tok_lp, tok_ok = [], []
            for lo in range(0, len(picked), step):
                logits = s.logits(picked[lo : lo + step])
                t = tgt[lo : lo + step].to(logits.device)
                if self.need_greedy:  # argmax of lm-eval's own log-softmax values, ties included
                    logp = F.log_softmax(logits, dim=-1)
                    tok_lp.append(logp.gather(1, t[:, None])[:, 0])
                    tok_ok.append(logp.argmax(dim=-1) == t)
                else:  # ppl: no [positions, vocab] log-probabilities, no argmax pass
                    tok_lp.append(-F.cross_entropy(logits, t, reduction="none"))
                    tok_ok.append(torch.zeros_like(t, dtype=torch.bool))
            tok_lp, tok_ok = torch.cat(tok_lp).to(s.device), torch.cat(tok_ok).to(s.device)
            lp[vi].index_add_(0, seg, tok_lp.double())
            misses[vi].index_add_(0, seg, (~tok_ok).long())

        h, streams = self._base_pass(s.embed(ids.to(s.device)), ctx, _PrefixKV(kv[()]) if kv else None, chunk)
        for vi, v in enumerate(self.variants[i] for i in chunk):
            if not v:
                score(vi, h)
            else:
                score(vi, self._run(streams[min(v)], ctx, min(v), v, _PrefixKV(kv[v]) if kv else None))
        return lp.cpu(), (misses == 0).cpu(), req_ids


@dataclass
class Layout:
    """The batches a sweep runs, in order, and the prefix groups they come from: all decided
    before anything runs, so that their cost and each rank's share can be judged without running
    them (on the meta device, before a GPU is booked: benchmarks/sweep_layout.py)."""

    scorer: VariantScorer
    groups: list[_Group]
    batches: list[_Batch]
    min_prefix_saving: int = 0  # what a prefix group had to save to be kept (see `plan`)

    def block_passes(self, indices: Iterable[int] | None = None) -> int:
        """The token-block passes that scoring these batches (all, or those at `indices`) in one
        process counts in `VariantScorer.block_passes`."""
        total, kv_for = 0, None
        for k in range(len(self.batches)) if indices is None else indices:
            b = self.batches[k]
            prefix, rows = self.scorer._passes(b, self.groups)
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
        cost = {k: (0, 0) if k in saved else self.scorer._passes(b, self.groups) for k, b in enumerate(self.batches)}
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
        s = self.scorer
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
    scorer = VariantScorer(stepper, variants, max_memory, max_batch_tokens, pack=pack, granularity=granularity)
    if min_prefix_saving is None:
        min_prefix_saving = 2 * small_batch_tokens(stepper)
    groups = plan(requests, MIN_SHARED_PREFIX if share_prefixes else 10**9, min_prefix_saving)
    return Layout(scorer, groups, scorer.batches(requests, groups), min_prefix_saving)


def plain_block_passes(requests: list[TokenRequest], variants: list[tuple], n_layers: int) -> int:
    """Token-block passes of evaluating each variant from scratch: every distinct input through every kept block, no padding."""
    tokens = sum(len(inputs) for inputs in {r.inputs for r in requests})
    return tokens * sum(n_layers - len(v) for v in variants)


def requests_digest(requests: list[TokenRequest]) -> str:
    """A fingerprint of the requests' tokens, so that saved batches of other text never pass for these."""
    digest = hashlib.sha256()
    for inputs in dict.fromkeys(r.inputs for r in requests):  # a question's choices share one input
        digest.update(array("q", inputs).tobytes())
    for r in requests:
        digest.update(array("q", (r.start, *r.targets)).tobytes())
    return digest.hexdigest()[:16]


def _batch_path(store: Path, k: int) -> Path:
    return store / f"batch_{k:06d}.pt"


def saved_batch_count(store: Path) -> int:
    """Batches of all variants an interrupted `score_requests` saved in `store`."""
    return sum(1 for _ in store.glob("batch_*.pt"))


def score_requests(
    stepper: Stepper,
    requests: list[TokenRequest],
    variants: list[tuple[int, ...]],
    *,
    max_memory: int,
    store: Path | None = None,
    fingerprint: str = "",
    on_batch: Callable[[int, int], None] | None = None,
    share_prefixes: bool = True,
    min_prefix_saving: int | None = None,
    need_greedy: bool = True,
    max_batch_tokens: int | None = None,
    pack: bool = True,
    granularity: str = "layer",
    world: World = World(),
) -> tuple[torch.Tensor | None, torch.Tensor | None, dict]:
    """(log-likelihood [variants, requests], is_greedy [variants, requests], stats) for every variant.

    With `share_prefixes`, rows that share a token prefix run it once per variant where that saves
    at least `min_prefix_saving` token passes (default: twice `small_batch_tokens`, for the
    group's prefix pass and its last, partly filled batch). With `need_greedy=False` is_greedy is all False and the head skips its argmax pass. With
    `pack`, rows of different lengths share sequences (no padding) where the model's attention
    takes the block-diagonal mask that needs (`Stepper.packing_fails`); `stats["packing"]` says
    whether it did, or why not. A variant's indices are the blocks it removes, or with
    `granularity` "attn"/"mlp" the blocks whose attention/MLP branch it removes.
    Batches are cut by the memory budget and by `max_batch_tokens` (default: MAX_BATCH_TOKENS for
    the model's device).

    With `store`, each finished batch is saved there atomically (with the seconds it took, by a
    background thread, so that the device never waits for the disk) and a rerun with the same
    `fingerprint`, requests (their tokens), variants and batching loads it instead of
    recomputing; anything else in `store` is discarded. `stats["seconds_resumed"]` is the time
    the loaded batches took when they were computed.

    Under torchrun (`world`), each rank takes its share of the batches (`Layout.share_out`:
    even in token-block passes); rank 0 gathers every rank's scores and returns them, the other
    ranks return (None, None, stats). A store is shared by the ranks and does not depend on their
    number: a sweep resumes on any number of ranks.
    """
    not_packed = stepper.packing_fails() if pack else "not asked"
    layout = lay_out(stepper, requests, variants, max_memory=max_memory, pack=not not_packed, share_prefixes=share_prefixes,
                     min_prefix_saving=min_prefix_saving, max_batch_tokens=max_batch_tokens, granularity=granularity)
    scorer, groups, batches = layout.scorer, layout.groups, layout.batches
    scorer.need_greedy = need_greedy
    key = hashlib.sha256(json.dumps([fingerprint, requests_digest(requests), layout.describe()]).encode()).hexdigest()[:16]
    saved: list[int] = []  # batches an earlier run finished
    if store is not None:
        state = store / "state.json"
        if world.main:
            if store.exists() and (not state.exists() or json.loads(state.read_text()).get("key") != key):
                shutil.rmtree(store)  # partial results of another run: useless here
            store.mkdir(parents=True, exist_ok=True)
            saved = [k for k in range(len(batches)) if _batch_path(store, k).exists()]
            atomic_write(state, json.dumps({"key": key, "batches": len(batches), "saved": saved}))
        world.barrier()  # no rank reads the store before rank 0 has cleared another run's
        if not world.main:  # rank 0's list, read before any rank adds to the store: the same shares everywhere
            saved = json.loads(state.read_text())["saved"]
    mine = layout.share_out(world.size, frozenset(saved))[world.rank]
    done: list[tuple] = []  # (variant indices, request ids, log-likelihoods, is_greedy) of this rank's batches
    kv_for, kv = None, None
    loaded_batches, resumed_seconds = 0, 0.0
    with ThreadPoolExecutor(max_workers=1) as saver:
        pending = []
        for i, k in enumerate(mine):
            batch = batches[k]
            path = _batch_path(store, k) if store is not None else None
            if path is not None and path.exists():
                loaded = torch.load(path, weights_only=True)
                ids, blp, bg = loaded["ids"], loaded["lp"], loaded["greedy"]
                loaded_batches += 1
                resumed_seconds += float(loaded.get("seconds", 0.0))
            else:
                started = time.perf_counter()
                g = groups[batch.group]
                if g.prefix and kv_for != (batch.group, batch.variants):
                    kv, kv_for = scorer.prefix_kv(g.rows[0].inputs[: g.prefix], batch.variants), (batch.group, batch.variants)
                blp, bg, ids = scorer.score_batch(requests, batch, g.prefix, kv if g.prefix else None)
                ids = torch.tensor(ids)
                if path is not None:
                    finished = {"ids": ids, "lp": blp, "greedy": bg, "seconds": time.perf_counter() - started}
                    pending.append(saver.submit(atomic_write, path, lambda tmp, obj=finished: torch.save(obj, tmp)))
            done.append((torch.tensor(batch.variants or scorer.everyone), ids, blp, bg))
            if on_batch:
                on_batch(i + 1, len(mine))
        for future in pending:  # every finished batch is on disk before the scores are used
            future.result()
    local = {"block_passes": scorer.block_passes, "batches_resumed": loaded_batches, "seconds_resumed": resumed_seconds}
    gathered = world.gather((done, local))
    if gathered is None:
        return None, None, local
    lp = torch.full((len(variants), len(requests)), float("nan"), dtype=torch.float64)
    greedy = torch.zeros(len(variants), len(requests), dtype=torch.bool)
    for rank_done, _ in gathered:
        for rows, ids, blp, bg in rank_done:
            lp[rows[:, None], ids], greedy[rows[:, None], ids] = blp, bg
    stats = {
        "batches": len(batches),
        "batches_resumed": sum(g[1]["batches_resumed"] for g in gathered),
        "seconds_resumed": round(sum(g[1]["seconds_resumed"] for g in gathered), 3),
        "prefix_groups": sum(1 for g in groups if g.prefix),
        "prefix_groups_too_large": scorer.unshared,
        "prefix_groups_split": scorer.split,
        "min_prefix_saving": layout.min_prefix_saving,
        "rows": sum(len(g.rows) for g in groups),
        "packing": not_packed or "packed",
        # tokens the batches hold against those they run, padding included (after shared prefixes)
        "tokens": sum(len(r.inputs) - groups[b.group].prefix for b in batches for r in b.rows),
        "batch_tokens": sum(len(b.bins) * (len(b.rows[0].inputs) - groups[b.group].prefix) for b in batches),
        "block_passes": sum(g[1]["block_passes"] for g in gathered),
        "plain_block_passes": plain_block_passes(requests, variants, stepper.n_layers),
        "max_memory": max_memory,
        "ranks": world.size,
    }
    if world.size > 1:
        stats["block_passes_by_rank"] = [g[1]["block_passes"] for g in gathered]
    return lp, greedy, stats
