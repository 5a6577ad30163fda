"""Scoring token requests under every variant at once, batch by batch, resumably.

`VariantScorer` runs a `Layout`'s batches: each through the unpruned model once, every variant
continuing from the stream at its first removed block; `score_requests` lays the sweep out, runs
this rank's share of it and keeps each finished batch on disk, so an interrupted sweep
recomputes nothing it finished.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from array import array
from contextlib import nullcontext
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from depthcurse.io import atomic_write
from depthcurse.prune.layout import Batch, Batcher, TokenRequest, lay_out, plain_block_passes
from depthcurse.prune.stepping import Stepper, _PrefixKV, _RecordKV
from depthcurse.runtime import World
from depthcurse.surgery import removed_units

HEAD_CHUNK_BYTES = 256 * 2**20  # fp32 logits computed at once by the head (cross-entropy needs as much again)


class VariantScorer:
    """Log-likelihoods of token requests under the unpruned model and every variant of a
    `Batcher`, batch by batch."""

    def __init__(self, batcher: Batcher, need_greedy: bool = True):
        self.batcher = batcher
        self.s = batcher.s
        self.need_greedy = need_greedy  # whether is_greedy is wanted (lm-eval's tasks) or only log-likelihoods (ppl)
        self.block_passes = 0

    def _base_pass(self, h, ctx, cache, chunk: tuple[int, ...]) -> tuple[torch.Tensor, dict]:
        """The unpruned model's blocks as far as `chunk` needs them: (the stream after them, the
        streams each removal starts from, by block)."""
        streams, last = {}, self.batcher.base_layers(chunk)
        for i in range(last):
            if i in self.batcher.starts:
                streams[i] = h
            h = self.s.block(i, h, ctx, cache)
            self.block_passes += h.shape[0] * h.shape[1]
        streams[last] = h  # where the chunk's last removal starts (or, the whole model run, its output)
        return h, streams

    def _run(self, h, ctx, start: int, removed: tuple, cache) -> torch.Tensor:
        """The stream at block `start` through the rest of the variant: removed blocks skipped, or
        (attn/mlp granularity) every block run with the removed branches zeroed."""
        skipped = removed if self.batcher.granularity == "layer" else ()
        with removed_units(self.s.model, removed, self.batcher.granularity) if not skipped else nullcontext():
            for i in range(start, self.s.n_layers):
                if i not in skipped:
                    h = self.s.block(i, h, ctx, cache)
                    self.block_passes += h.shape[0] * h.shape[1]
        return h

    @torch.inference_mode()
    def prefix_kv(self, tokens: tuple[int, ...], chunk: tuple[int, ...] | None = None) -> dict:
        """Keys and values of a shared prefix for the variants of `chunk` (indices; None: every
        variant), only the layers each runs; under `()` the unpruned model's, for the blocks the chunk needs."""
        chunk = chunk or self.batcher.everyone
        ids = torch.tensor([tokens], device=self.s.device)
        ctx = self.s.context(len(tokens), 0)
        rec = _RecordKV()
        _, streams = self._base_pass(self.s.embed(ids), ctx, rec, chunk)
        out = {(): rec.kv}
        for v in (self.batcher.variants[i] for i in chunk):
            if v:
                rv = _RecordKV()
                self._run(streams[min(v)], ctx, min(v), v, rv)
                out[v] = rv.kv
        return out

    @torch.inference_mode()
    def score_batch(self, requests: list[TokenRequest], batch: Batch, prefix: int, kv: dict | None) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """(log-likelihood [variants, requests] float64, is_greedy [variants, requests] bool, request ids),
        for the batch's variants (`batch.variants`, in that order; all of them if None)."""
        s = self.s
        rows = batch.rows
        chunk = batch.variants or self.batcher.everyone
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
        for vi, v in enumerate(self.batcher.variants[i] for i in chunk):
            if not v:
                score(vi, h)
            else:
                score(vi, self._run(streams[min(v)], ctx, min(v), v, _PrefixKV(kv[v]) if kv else None))
        return lp.cpu(), (misses == 0).cpu(), req_ids


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
    scorer, groups, batches = VariantScorer(layout.batcher, need_greedy), layout.groups, layout.batches
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
            done.append((torch.tensor(batch.variants or scorer.batcher.everyone), ids, blp, bg))
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
        "prefix_groups_too_large": layout.batcher.unshared,
        "prefix_groups_split": layout.batcher.split,
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
