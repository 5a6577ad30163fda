"""The reuse engine: score every variant of a prune sweep without recomputing what they share.

Variant "without layer l" is identical to the unpruned model up to block l. So for each batch of
inputs the unpruned model runs once, keeping the residual stream at the input of every block a
variant starts from, and variant l continues from the stream at block l, skipping the removed
blocks: it computes only the blocks after l. On top of that:

* only the positions a task scores go through the final norm and the head (the answer tokens of
  a multiple-choice question; every position of a ppl window, in chunks, so the full
  [tokens, vocab] logits never exist at once);
* inputs that share a long token prefix (the few-shot examples of an MMLU subject) get that
  prefix's keys and values computed once per variant; the rest of each input attends to them;
* lm-eval's requests are built and tokenised once (by lm-eval's own HFLM code), and each
  variant's responses go back through lm-eval's own filters, metrics and aggregation.

The blocks are the model's own decoder-layer modules, called with the arguments the model's own
forward passes them (rotary position embeddings, one additive mask per layer type). Before use,
`Stepper.check` compares this block-by-block forward against the model's forward; an
architecture that does not match, or a task the engine does not know, is reported as
unsupported and the sweep falls back to evaluating each variant on its own.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import io
import json
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from depthcurse import report
from depthcurse.errors import DepthcurseError
from depthcurse.surgery import find_blocks
from depthcurse.tasks import LmEvalTask, PerplexityTask, Score

MIN_SHARED_PREFIX = 16  # tokens; below this a prefix group saves less than it costs in smaller batches
HEAD_CHUNK_BYTES = 256 * 2**20  # fp32 logits computed at once by the head (cross-entropy needs as much again)
# Tokens per batch at most: a batch (every variant) is the unit of progress and of resuming, so
# beyond this a bigger batch only delays the next saved checkpoint. A CPU gains little from big
# batches and takes minutes per batch of all variants, so there the cap is lower.
MAX_BATCH_TOKENS = {"cuda": 16384, "cpu": 2048}


class Unsupported(Exception):
    """This model or task cannot go through the engine; the message says why."""


def parse_memory(text: str | int | None) -> int:
    """'2GB', '512MB', '1.5GiB' or a number of bytes -> bytes. None -> 2 GiB."""
    if text is None:
        return 2 * 2**30
    if isinstance(text, int):
        value = text
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*", str(text).lower())
        if match is None:
            raise DepthcurseError(f"bad --max-memory {text!r}: use a size like 2GB or 512MB")
        unit = (match.group(2) or "b").rstrip("b").rstrip("i")
        value = int(float(match.group(1)) * 1024 ** "_kmgt".index(unit or "_"))
    if value < 2**20:
        raise DepthcurseError(f"--max-memory {text} is too small: give at least 1MB")
    return value


# --------------------------------------------------------------------------- block stepping


class _RecordKV:
    """A stand-in for a transformers Cache: remembers each layer's keys/values (the shared prefix)."""

    def __init__(self):
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key, value, layer_idx, *args, **kwargs):
        self.kv[layer_idx] = (key, value)
        return key, value


class _PrefixKV:
    """A stand-in for a transformers Cache holding a prefix: new keys/values are appended to it."""

    def __init__(self, kv: dict[int, tuple[torch.Tensor, torch.Tensor]]):
        self.kv = kv

    def update(self, key, value, layer_idx, *args, **kwargs):
        pk, pv = self.kv[layer_idx]
        b = key.shape[0]
        return torch.cat([pk.expand(b, *pk.shape[1:]), key], dim=-2), torch.cat([pv.expand(b, *pv.shape[1:]), value], dim=-2)


@dataclass
class _Context:
    """What every block of one forward needs besides the stream: masks and rotary embeddings per layer type."""

    masks: dict
    rope: dict
    position_ids: torch.Tensor


class Stepper:
    """Runs a decoder-only Hugging Face model one block at a time.

    Supported: models whose base keeps `embed_tokens`, `layers`, `norm` and `rotary_emb` (Llama,
    Mistral, Qwen2/3, Gemma 1/2/3 text, Phi3, ...). Sequences are right-padded and use no
    attention mask beyond causality (as lm-eval's HFLM calls the model), so padding never reaches
    a real position.
    """

    def __init__(self, model: torch.nn.Module):
        config = getattr(model, "config", None)
        if config is None or getattr(config, "is_encoder_decoder", False):
            raise Unsupported(f"{type(model).__name__} is not a decoder-only language model")
        blocks = find_blocks(model)
        base = blocks.parent
        missing = [n for n in ("embed_tokens", "norm", "rotary_emb") if not isinstance(getattr(base, n, None), torch.nn.Module)]
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if missing or head is None:
            raise Unsupported(f"{type(model).__name__}: no {', '.join(missing) or 'language-model head'} where Llama-like models keep it")
        self.model, self.layers, self.embed, self.norm, self.rotary, self.head = model, blocks.layers, base.embed_tokens, base.norm, base.rotary_emb, head
        self.config = config = base.config
        n = len(self.layers)
        types = getattr(config, "layer_types", None)
        if types is not None and len(types) == n:
            self.types = list(types)
        elif getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
            self.types = ["sliding_attention"] * n  # Mistral-style: one window for every layer
        else:
            self.types = ["full_attention"] * n
        unknown = set(self.types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise Unsupported(f"{type(model).__name__}: layer types {sorted(unknown)} are not supported")
        self.window = getattr(config, "sliding_window", None)
        # sdpa given no mask applies causality itself (is_causal: the fused kernels, no [T, T]
        # mask in memory), as the model's own forward does; eager attention needs the mask.
        self.implicit_causal = getattr(config, "_attn_implementation", None) == "sdpa"
        self.rope_per_type = "layer_type" in inspect.signature(self.rotary.forward).parameters
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.device = self.embed.weight.device
        self.dtype = self.embed.weight.dtype

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def context(self, length: int, past: int) -> _Context:
        """Masks and rotary embeddings for `length` new positions after `past` cached ones."""
        q = torch.arange(past, past + length, device=self.device)[:, None]
        k = torch.arange(past + length, device=self.device)[None]
        lowest = torch.finfo(self.dtype).min
        masks = {}
        for t in set(self.types):
            window = self.window if t == "sliding_attention" else None
            if self.implicit_causal and past == 0 and (window is None or length <= window):
                masks[t] = None  # no cached prefix and no window cut: plain causality
                continue
            allowed = (k <= q) if window is None else (k <= q) & (q - k < window)
            # additive float masks: eager attention adds them, sdpa accepts them as they are
            masks[t] = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device).masked_fill(~allowed, lowest)[None, None]
        position_ids = torch.arange(past, past + length, device=self.device)[None]
        probe = torch.zeros(1, 1, device=self.device, dtype=self.dtype)
        if self.rope_per_type:
            rope = {t: self.rotary(probe, position_ids, t) for t in set(self.types)}
        else:
            shared = self.rotary(probe, position_ids)
            rope = {t: shared for t in set(self.types)}
        return _Context(masks, rope, position_ids)

    def block(self, i: int, h: torch.Tensor, ctx: _Context, cache=None) -> torch.Tensor:
        t = self.types[i]
        out = self.layers[i](h, attention_mask=ctx.masks[t], position_embeddings=ctx.rope[t], position_ids=ctx.position_ids, past_key_values=cache, use_cache=False)
        return out[0] if isinstance(out, tuple) else out

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and head for the given positions only, in fp32."""
        logits = self.head(self.norm(h)).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    @torch.inference_mode()
    def check(self, length: int = 40) -> None:
        """Raise Unsupported unless block stepping (with and without a cached prefix) gives the model's own logits."""
        max_pos = getattr(self.config, "max_position_embeddings", None) or length
        length = max(4, min(length, max_pos))
        gen = torch.Generator().manual_seed(0)
        vocab = self.head.weight.shape[0]
        ids = torch.randint(0, vocab, (2, length), generator=gen).to(self.device)
        reference = self.model(input_ids=ids, use_cache=False).logits.float()
        h = self.embed(ids)
        ctx = self.context(length, 0)
        for i in range(self.n_layers):
            h = self.block(i, h, ctx)
        full = self.logits(h)
        split = length // 2
        rec = _RecordKV()
        hp, cp = self.embed(ids[:1, :split]), self.context(split, 0)
        for i in range(self.n_layers):
            hp = self.block(i, hp, cp, rec)
        hs, cs, cache = self.embed(ids[:1, split:]), self.context(length - split, split), _PrefixKV(rec.kv)
        for i in range(self.n_layers):
            hs = self.block(i, hs, cs, cache)
        suffix = self.logits(hs)
        tol = 1e-3 if self.dtype == torch.float32 else 5e-2
        scale = reference.abs().max().item() + 1.0
        for name, ours, theirs in (("block-by-block forward", full, reference), ("cached-prefix forward", suffix, reference[:1, split:])):
            err = (ours - theirs).abs().max().item()
            if not err <= tol * scale:
                raise Unsupported(f"{type(self.model).__name__}: the {name} differs from the model's own by {err:.2g}")


# --------------------------------------------------------------------------- requests and plan


@dataclass(frozen=True)
class TokenRequest:
    """Score `targets` as the tokens following positions start, start+1, ... of `inputs`."""

    inputs: tuple[int, ...]
    start: int
    targets: tuple[int, ...]


def lm_eval_token_request(context: list[int], continuation: list[int], max_length: int) -> TokenRequest:
    """What lm-eval's HFLM feeds the model for a (context, continuation) pair, truncated from the left as it does."""
    if not 0 < len(continuation) <= max_length:
        raise DepthcurseError(f"a continuation of {len(continuation)} tokens cannot be scored within the model's {max_length}-token window")
    whole = (list(context) + list(continuation))[-(max_length + 1) :]
    inputs = tuple(whole[:-1])
    return TokenRequest(inputs, len(inputs) - len(continuation), tuple(continuation))


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


def _common(a: tuple, b: tuple, limit: int) -> int:
    n = min(len(a), len(b), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def plan(requests: list[TokenRequest], min_prefix: int = MIN_SHARED_PREFIX) -> list[_Group]:
    """Rows (one per distinct input: the choices of a question share one) grouped by shared token prefix.

    Prefixes are found on tokens, not strings (BPE may merge across a string boundary), and end
    before the first scored position of every row, so prefix positions never need the head.
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
        if len(current) >= 2 and prefix >= min_prefix:
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


# --------------------------------------------------------------------------- scoring all variants


class VariantScorer:
    """Log-likelihoods of token requests under the unpruned model and every variant, batch by batch."""

    def __init__(self, stepper: Stepper, variants: list[tuple[int, ...]], max_memory: int, max_batch_tokens: int | None = None):
        self.s = stepper
        self.variants = list(variants)
        if () not in self.variants:
            raise ValueError("the unpruned model must be among the variants")
        for v in self.variants:
            if any(not 0 <= i < stepper.n_layers for i in v):
                raise DepthcurseError(f"variant {v} removes a layer outside 0-{stepper.n_layers - 1}")
        self.starts = sorted({min(v) for v in self.variants if v})
        self.budget = max_memory
        self.max_batch_tokens = max_batch_tokens or MAX_BATCH_TOKENS.get(torch.device(stepper.device).type, MAX_BATCH_TOKENS["cuda"])
        self.block_passes = 0
        self.need_greedy = True  # whether is_greedy is wanted (lm-eval's tasks) or only log-likelihoods (ppl)

    # memory: the kept streams, plus a few more activations per token (attention, MLP)
    def _bytes_per_token(self, keys: int) -> int:
        c = self.s.config
        width = c.hidden_size * (len(self.starts) + 4) + 2 * getattr(c, "intermediate_size", 4 * c.hidden_size)
        attn = getattr(c, "num_attention_heads", 1) * keys
        return (width + attn) * self.s.embed.weight.element_size()

    def _prefix_kv_bytes(self, length: int) -> int:
        c = self.s.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        per_layer = 2 * length * getattr(c, "num_key_value_heads", c.num_attention_heads) * head_dim * self.s.embed.weight.element_size()
        layers = sum(self.s.n_layers - min(v, default=0) - len(v) for v in self.variants)
        return per_layer * layers

    def batches(self, requests: list[TokenRequest], groups: list[_Group]) -> list[_Batch]:
        """Rows cut into batches whose kept streams fit the memory budget; longest rows first, as lm-eval sorts."""
        out = []
        for gi, g in enumerate(groups):
            budget = self.budget
            if g.prefix:
                kv = self._prefix_kv_bytes(g.prefix)
                if kv > self.budget // 2:
                    raise DepthcurseError(f"--max-memory {self.budget / 2**20:.0f}MB cannot hold the shared prefix of {g.prefix} tokens for every variant; give more")
                budget -= kv
            rows = sorted(g.rows, key=lambda r: (-len(r.inputs), r.inputs))
            batch: list[_Row] = []
            for row in rows:
                width = len(row.inputs) - g.prefix
                longest = len(batch[0].inputs) - g.prefix if batch else width
                n = len(batch) + 1
                cost = n * longest * self._bytes_per_token(g.prefix + longest)
                if batch and (cost > budget or n * longest > self.max_batch_tokens):
                    out.append(_Batch(gi, batch))
                    batch = []
                batch.append(row)
            if batch:
                out.append(_Batch(gi, batch))
        return out

    def _run(self, h, ctx, start: int, removed: tuple, cache) -> torch.Tensor:
        for i in range(start, self.s.n_layers):
            if i not in removed:
                h = self.s.block(i, h, ctx, cache)
                self.block_passes += h.shape[0] * h.shape[1]
        return h

    @torch.inference_mode()
    def prefix_kv(self, tokens: tuple[int, ...]) -> dict:
        """Keys and values of a shared prefix for every variant (only the layers each variant runs)."""
        ids = torch.tensor([tokens], device=self.s.device)
        ctx = self.s.context(len(tokens), 0)
        rec = _RecordKV()
        h, streams = self.s.embed(ids), {}
        for i in range(self.s.n_layers):
            if i in self.starts:
                streams[i] = h
            h = self.s.block(i, h, ctx, rec)
            self.block_passes += h.shape[1]
        out = {(): rec.kv}
        for v in self.variants:
            if v:
                rv = _RecordKV()
                self._run(streams[min(v)], ctx, min(v), v, rv)
                out[v] = rv.kv
        return out

    @torch.inference_mode()
    def score_batch(self, requests: list[TokenRequest], rows: list[_Row], prefix: int, kv: dict | None) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """(log-likelihood [variants, requests] float64, is_greedy [variants, requests] bool, request ids)."""
        s = self.s
        width = max(len(r.inputs) for r in rows) - prefix
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        for b, row in enumerate(rows):
            ids[b, : len(row.inputs) - prefix] = torch.tensor(row.inputs[prefix:])
        # every scored position of the batch, flattened: (row, position, target, request)
        req_ids, b_idx, p_idx, tgt, seg = [], [], [], [], []
        for b, row in enumerate(rows):
            for r in row.requests:
                tr = requests[r]
                n = len(tr.targets)
                b_idx += [b] * n
                p_idx += range(tr.start - prefix, tr.start - prefix + n)
                tgt += tr.targets
                seg += [len(req_ids)] * n
                req_ids.append(r)
        b_idx, p_idx = torch.tensor(b_idx, device=s.device), torch.tensor(p_idx, device=s.device)
        tgt, seg = torch.tensor(tgt, device=s.device), torch.tensor(seg, device=s.device)
        ctx = s.context(width, prefix)
        lp = torch.zeros(len(self.variants), len(req_ids), dtype=torch.float64)
        greedy = torch.zeros(len(self.variants), len(req_ids), dtype=torch.bool)

        def score(vi, h):
            picked = h[b_idx, p_idx]
            chunk = max(1, HEAD_CHUNK_BYTES // (4 * s.head.weight.shape[0]))
            tok_lp, tok_ok = [], []
            for lo in range(0, len(picked), chunk):
                logits, t = s.logits(picked[lo : lo + chunk]), tgt[lo : lo + chunk]
                if self.need_greedy:  # argmax of lm-eval's own log-softmax values, ties included
                    logp = F.log_softmax(logits, dim=-1)
                    tok_lp.append(logp.gather(1, t[:, None])[:, 0])
                    tok_ok.append(logp.argmax(dim=-1) == t)
                else:  # ppl: no [positions, vocab] log-probabilities, no argmax pass
                    tok_lp.append(-F.cross_entropy(logits, t, reduction="none"))
                    tok_ok.append(torch.zeros_like(t, dtype=torch.bool))
            tok_lp, tok_ok = torch.cat(tok_lp), torch.cat(tok_ok)
            lp[vi] = torch.zeros(len(req_ids), dtype=torch.float64, device=s.device).index_add_(0, seg, tok_lp.double()).cpu()
            misses = torch.zeros(len(req_ids), dtype=torch.long, device=s.device).index_add_(0, seg, (~tok_ok).long())
            greedy[vi] = (misses == 0).cpu()

        h = s.embed(ids.to(s.device))
        streams = {}
        base_cache = _PrefixKV(kv[()]) if kv else None
        for i in range(s.n_layers):
            if i in self.starts:
                streams[i] = h
            h = s.block(i, h, ctx, base_cache)
            self.block_passes += h.shape[0] * h.shape[1]
        for vi, v in enumerate(self.variants):
            if not v:
                score(vi, h)
            else:
                score(vi, self._run(streams[min(v)], ctx, min(v), v, _PrefixKV(kv[v]) if kv else None))
        return lp, greedy, req_ids


def plain_block_passes(requests: list[TokenRequest], variants: list[tuple], n_layers: int) -> int:
    """Token-block passes of evaluating each variant from scratch: every distinct input through every kept block, no padding."""
    tokens = sum(len(inputs) for inputs in {r.inputs for r in requests})
    return tokens * sum(n_layers - len(v) for v in variants)


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
    need_greedy: bool = True,
    max_batch_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(log-likelihood [variants, requests], is_greedy [variants, requests], stats) for every variant.

    With `need_greedy=False` is_greedy is all False and the head skips its argmax pass.
    Batches are cut by the memory budget and by `max_batch_tokens` (default: MAX_BATCH_TOKENS for
    the model's device).

    With `store`, each finished batch is saved there atomically and a rerun with the same
    `fingerprint` (same requests, variants and batching) loads it instead of recomputing.
    """
    scorer = VariantScorer(stepper, variants, max_memory, max_batch_tokens)
    scorer.need_greedy = need_greedy
    groups = plan(requests, MIN_SHARED_PREFIX if share_prefixes else 10**9)
    batches = scorer.batches(requests, groups)
    key = hashlib.sha256(json.dumps([fingerprint, [list(v) for v in variants], [[(b.group, r.requests) for r in b.rows] for b in batches], [g.prefix for g in groups]]).encode()).hexdigest()[:16]
    if store is not None:
        state = store / "state.json"
        if store.exists() and (not state.exists() or json.loads(state.read_text()).get("key") != key):
            shutil.rmtree(store)  # partial results of another run: useless here
        store.mkdir(parents=True, exist_ok=True)
        report.atomic_write(state, json.dumps({"key": key, "batches": len(batches)}))
    lp = torch.full((len(variants), len(requests)), float("nan"), dtype=torch.float64)
    greedy = torch.zeros(len(variants), len(requests), dtype=torch.bool)
    kv_group, kv = None, None
    loaded_batches = 0
    for k, batch in enumerate(batches):
        path = store / f"batch_{k:06d}.pt" if store is not None else None
        if path is not None and path.exists():
            saved = torch.load(path, weights_only=True)
            ids, blp, bg = saved["ids"], saved["lp"], saved["greedy"]
            loaded_batches += 1
        else:
            g = groups[batch.group]
            if g.prefix and kv_group != batch.group:
                kv, kv_group = scorer.prefix_kv(g.rows[0].inputs[: g.prefix]), batch.group
            blp, bg, ids = scorer.score_batch(requests, batch.rows, g.prefix, kv if g.prefix else None)
            ids = torch.tensor(ids)
            if path is not None:
                buf = _to_bytes({"ids": ids, "lp": blp, "greedy": bg})
                report.atomic_write(path, buf)
        lp[:, ids], greedy[:, ids] = blp, bg
        if on_batch:
            on_batch(k + 1, len(batches))
    stats = {
        "batches": len(batches),
        "batches_resumed": loaded_batches,
        "prefix_groups": sum(1 for g in groups if g.prefix),
        "rows": sum(len(g.rows) for g in groups),
        "block_passes": scorer.block_passes,
        "plain_block_passes": plain_block_passes(requests, variants, stepper.n_layers),
    }
    return lp, greedy, stats


def _to_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


# --------------------------------------------------------------------------- tasks


def ppl_requests(task: PerplexityTask) -> list[TokenRequest]:
    """Each window predicts its tokens 1..T-1 from the ones before (the last token is never an input)."""
    return [TokenRequest(tuple(w[:-1]), 0, tuple(w[1:])) for w in task.windows.tolist()]


def _request_lm_class():
    from depthcurse.tasks import _quiet_hflm

    class RequestLM(_quiet_hflm()):
        """HFLM that records the token requests lm-eval would run, or answers them from a table.

        Recording goes through HFLM's own tokenisation (context/continuation split, trailing
        whitespace moved to the continuation, empty context -> prefix token), so the requests
        are exactly what lm-eval would feed the model.
        """

        answers: dict | None = None
        recorded: dict

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            if self.answers is not None:
                return [self.answers[("ll", *req.args)] for req in requests]
            return super().loglikelihood(requests, disable_tqdm=True)

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
            for key, context, continuation in requests:
                self.recorded[("ll", *key)] = [(list(context), list(continuation))]
            return [(0.0, False)] * len(requests)

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            if self.answers is not None:
                return [self.answers[("roll", req.args[0])][0] for req in requests]
            from lm_eval import utils

            for req in requests:
                (string,) = req.args
                windows = utils.get_rolling_token_windows(token_list=self.tok_encode(string), prefix_token=self.prefix_token_id, max_seq_len=self.max_length, context_len=1)
                self.recorded[("roll", string)] = [tuple(map(list, utils.make_disjoint_window(w))) for w in windows]
            return [0.0] * len(requests)

    return RequestLM


@contextlib.contextmanager
def _requests_built_once(tasks: dict, built: set):
    """lm-eval rebuilds every request (prompts, few-shot sampling) on each evaluate(); build them once.

    The instances stay on the task objects; each later evaluate only clears their responses.
    """
    for name, t in tasks.items():

        def build(*args, _t=t, _name=name, **kwargs):
            if _name in built:
                for inst in _t._instances:
                    inst.resps.clear()
                    inst.filtered_resps.clear()
                return None
            built.add(_name)
            return type(_t).build_all_requests(_t, *args, **kwargs)

        t.build_all_requests = build
    try:
        yield
    finally:
        for t in tasks.values():
            vars(t).pop("build_all_requests", None)


class LmEvalRequests:
    """An lm-eval task's requests, tokenised once; scores variants from their log-likelihoods."""

    def __init__(self, task: LmEvalTask, model):
        from lm_eval import evaluator

        self.task = task
        self.lm = _request_lm_class()(pretrained=model, tokenizer=task.tokenizer, batch_size=task.batch_size)
        self.lm.recorded = {}
        self.built: set = set()
        with _requests_built_once(task.loaded["tasks"], self.built):
            evaluator.evaluate(self.lm, task.loaded, limit=task.limit, bootstrap_iters=0)
        max_length = self.lm.max_length
        self.keys = list(self.lm.recorded)
        self.requests: list[TokenRequest] = []
        self.spans: list[tuple[int, int]] = []  # each key's requests (a rolling string has several windows)
        for key in self.keys:
            first = len(self.requests)
            self.requests += [lm_eval_token_request(c, t, max_length) for c, t in self.lm.recorded[key]]
            self.spans.append((first, len(self.requests)))

    def score(self, lp: torch.Tensor, greedy: torch.Tensor) -> Score:
        """lm-eval's metrics for one variant's log-likelihoods [requests] (its own filters and aggregation)."""
        return self.task.score(self.results(lp, greedy))

    def results(self, lp: torch.Tensor, greedy: torch.Tensor, *, log_samples: bool = False) -> dict:
        """lm-eval's raw results dict, as `LmEvalTask.run` returns it, for one variant's log-likelihoods."""
        from lm_eval import evaluator

        answers = {}
        for key, (a, b) in zip(self.keys, self.spans):
            if key[0] == "ll":
                answers[key] = (float(lp[a]), bool(greedy[a]))
            else:
                answers[key] = (float(lp[a:b].sum()),)
        self.lm.answers = answers
        try:
            with _requests_built_once(self.task.loaded["tasks"], self.built):
                results = evaluator.evaluate(self.lm, self.task.loaded, limit=self.task.limit, bootstrap_iters=0, log_samples=log_samples)
        finally:
            self.lm.answers = None
        if results is None:
            raise DepthcurseError("lm-eval returned no results")
        return results


def why_unsupported(model, task) -> str | None:
    """None when the engine can run this model and task; otherwise the reason it cannot."""
    if not isinstance(task, (PerplexityTask, LmEvalTask)):
        return f"task {getattr(task, 'name', type(task).__name__)} is not supported by the reuse engine"
    try:
        Stepper(model).check()
    except Unsupported as exc:
        return str(exc)
    return None


def evaluate_variants(
    model,
    task,
    variants: list[tuple[int, ...]],
    *,
    max_memory: int | str | None = None,
    store: Path | None = None,
    fingerprint: str = "",
    on_batch: Callable[[int, int], None] | None = None,
    share_prefixes: bool = True,
    checked: bool = False,
) -> tuple[dict[tuple, Score], dict]:
    """Scores of every variant (tuples of removed layers; () is the unpruned model) and run statistics.

    Raises Unsupported (with the reason) for a model or task the engine cannot run, unless
    `checked` says `why_unsupported` already found none.
    """
    reason = None if checked else why_unsupported(model, task)
    if reason:
        raise Unsupported(reason)
    started = time.perf_counter()
    stepper = Stepper(model)
    asked = list(dict.fromkeys([(), *variants]))
    if isinstance(task, PerplexityTask):
        requests, lm_requests = ppl_requests(task), None
    else:
        lm_requests = LmEvalRequests(task, model)
        requests = lm_requests.requests
    if not requests:
        raise DepthcurseError(f"task {task.name} produced no requests to score")
    t_requests = time.perf_counter() - started
    lp, greedy, stats = score_requests(stepper, requests, asked, max_memory=parse_memory(max_memory), store=store, fingerprint=fingerprint, on_batch=on_batch, share_prefixes=share_prefixes, need_greedy=lm_requests is not None)
    scores = {}
    for vi, v in enumerate(asked):
        if lm_requests is None:
            count = sum(len(r.targets) for r in requests)
            scores[v] = task.score(-float(lp[vi].sum()), count)
        else:
            scores[v] = lm_requests.score(lp[vi], greedy[vi])
    stats.update(
        requests=len(requests),
        seconds_building_requests=round(t_requests, 3),
        seconds=round(time.perf_counter() - started, 3),
    )
    return scores, stats
