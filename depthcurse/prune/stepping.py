"""Running a decoder one block at a time, with the arguments its own forward passes each block.

The reuse engine needs the residual stream between blocks, and to restart from it: `Stepper`
calls the model's own decoder-layer modules with the rotary embeddings and the additive mask
(one per layer type) that the model's forward would give them, and can record or feed a shared
prefix's keys and values. `Stepper.check` compares this against the model's own forward.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from depthcurse.surgery import find_blocks


class Unsupported(Exception):
    """This model or task cannot go through the engine; the message says why."""


class _LayerKV:
    """What transformers' attention calls as its cache, for one block: records the block's keys and
    values, or puts a prefix's before them. One object per block, so a compiled block sees no dict
    keyed by layer (which it would guard on, and recompile for, layer by layer)."""

    def __init__(self, prefix: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.prefix, self.recorded = prefix, None

    def update(self, key, value, *args, **kwargs):
        if self.prefix is None:
            self.recorded = (key, value)
            return key, value
        pk, pv = self.prefix
        b = key.shape[0]
        return torch.cat([pk.expand(b, *pk.shape[1:]), key], dim=-2), torch.cat([pv.expand(b, *pv.shape[1:]), value], dim=-2)

    def get_seq_length(self, layer_idx=0):
        # what is cached before these positions (Llama-4's temperature tuning asks)
        return 0 if self.prefix is None else self.prefix[0].shape[-2]


class _RecordKV:
    """A stand-in for a transformers Cache: remembers each layer's keys/values (the shared prefix)."""

    def __init__(self):
        self.views: dict[int, _LayerKV] = {}

    def layer(self, i: int) -> _LayerKV:
        self.views[i] = _LayerKV()
        return self.views[i]

    @property
    def kv(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        return {i: v.recorded for i, v in self.views.items()}


class _PrefixKV:
    """A stand-in for a transformers Cache holding a prefix: new keys/values are appended to it."""

    def __init__(self, kv: dict[int, tuple[torch.Tensor, torch.Tensor]]):
        self.kv = kv

    def layer(self, i: int) -> _LayerKV:
        return _LayerKV(self.kv[i])


@dataclass
class _Context:
    """What every block of one forward needs besides the stream: masks and rotary embeddings per layer type."""

    masks: dict
    rope: dict
    position_ids: torch.Tensor
    inputs: dict | None = None  # a model that builds its blocks' inputs itself (`block_inputs`): those


def compile_blocks(layers) -> list:
    """Each block through torch.compile: inductor fuses what eager runs as separate kernels (norms,
    rotary, SwiGLU, residual adds). Shapes are dynamic, since every batch has its own width; the
    blocks share one code object, so a graph per kind of call (cache, mask, layer kind) serves all."""
    # Blocks of a kind share compiled code; calls differ by cache stand-in, mask and attention
    # type, and each such variant counts towards the limit: more than the default 8.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return [torch.compile(layer, dynamic=True) for layer in layers]


def _hooked(module: torch.nn.Module) -> bool:
    # Hooked blocks run eagerly: a branch removed for --granularity, or accelerate's device hooks
    # (offloaded blocks), would each be another guard and another graph, for one variant.
    return any(m._forward_hooks or m._forward_pre_hooks or hasattr(m, "_hf_hook") for m in module.modules())


# What a decoder's base calls its last norm: Llama and most since, GPT-NeoX (Pythia), Phi-1/1.5/2, Falcon.
FINAL_NORMS = ("norm", "final_layer_norm", "final_layernorm", "ln_f")


class Stepper:
    """Runs a decoder-only Hugging Face model one block at a time.

    Supported: models whose base keeps its input embeddings, blocks, a final norm and a
    `rotary_emb` (Llama, Mistral, Qwen2/3, Gemma 1/2/3 text, Phi 1-3, GPT-NeoX/Pythia, rotary
    Falcon, ...). Sequences are right-padded and use no attention mask beyond causality (as
    lm-eval's HFLM calls the model), so padding never reaches a real position.

    A base that builds its blocks' inputs itself, `block_inputs(length, device)` and `embed(ids)`
    (lns-train's own class, whatever its norm), is stepped from the first token only: its blocks
    keep no cache, so a shared prefix (prune's engine, select's scorer) is Unsupported and
    `check(cached=False)` is what depth-use and the depth map ask.
    """

    def __init__(self, model: torch.nn.Module, compile: bool = False):
        config = getattr(model, "config", None)
        if config is None or getattr(config, "is_encoder_decoder", False):
            raise Unsupported(f"{type(model).__name__} is not a decoder-only language model")
        blocks = find_blocks(model)
        base = blocks.parent
        self.own = callable(getattr(base, "block_inputs", None)) and callable(getattr(base, "embed", None))
        embeddings = getattr(base, "embed_tokens", None) if self.own else base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
        parts = {"embeddings": embeddings,
                 "final norm": next((getattr(base, n) for n in FINAL_NORMS if isinstance(getattr(base, n, None), torch.nn.Module)), None),
                 # a base of its own builds the rotary tables in `block_inputs`: no module to find
                 **({} if self.own else {"rotary embedding": getattr(base, "rotary_emb", None)}),
                 "language-model head": model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None}
        missing = [name for name, part in parts.items() if not isinstance(part, torch.nn.Module)]
        if missing:
            raise Unsupported(f"{type(model).__name__}: no {', '.join(missing)} where Llama-like models keep it")
        self.model, self.layers, self.base = model, blocks.layers, base
        self.embed_tokens, self.norm, self.head = parts["embeddings"], parts["final norm"], parts["language-model head"]
        self.rotary = parts.get("rotary embedding")
        # The keyword a block takes its cache by: `cache` since transformers 5.24 (`past_key_values`
        # still works there, with a warning, until 5.40), GPT-NeoX's `layer_past`, else `past_key_values`.
        params = inspect.signature(self.layers[0].forward).parameters
        self.cache_arg = next((n for n in ("cache", "past_key_values", "layer_past", "past_key_value") if n in params), "past_key_values")
        if getattr(config, "alibi", False):
            raise Unsupported(f"{type(model).__name__}: ALiBi position biases, not rotary embeddings")
        self.extra = {"alibi": None} if "alibi" in params else {}  # rotary Falcon's blocks still take the argument
        self.config = config = getattr(base, "config", config)
        n = len(self.layers)
        types = getattr(config, "layer_types", None)
        if types is not None and len(types) == n:
            self.types = list(types)
        elif getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
            self.types = ["sliding_attention"] * n  # Mistral-style: one window for every layer
        else:
            self.types = ["full_attention"] * n
        unknown = set(self.types) - {"full_attention", "sliding_attention", "chunked_attention"}
        if unknown:
            raise Unsupported(f"{type(model).__name__}: layer types {sorted(unknown)} are not supported")
        self.window = getattr(config, "sliding_window", None)
        self.chunk = getattr(config, "attention_chunk_size", None)  # Llama-4: attention within fixed chunks of positions
        if "chunked_attention" in self.types and not self.chunk:
            raise Unsupported(f"{type(model).__name__}: chunked attention layers without an attention_chunk_size")
        # sdpa given no mask applies causality itself (is_causal: the fused kernels, no [T, T]
        # mask in memory), as the model's own forward does; eager attention needs the mask.
        self.implicit_causal = getattr(config, "_attn_implementation", None) == "sdpa"
        self.rope_per_type = not self.own and "layer_type" in inspect.signature(self.rotary.forward).parameters
        # Scalars some families apply outside their blocks: Granite scales the embeddings up and the
        # logits down, Cohere scales the logits, Gemma 2/3 soft-cap them.
        self.embedding_multiplier = float(getattr(config, "embedding_multiplier", None) or 1.0)
        logit_scale = getattr(model, "logit_scale", None)
        self.logit_scale = float(logit_scale) if isinstance(logit_scale, (int, float)) else 1.0  # Cohere: logits * logit_scale
        self.logits_scaling = float(getattr(config, "logits_scaling", None) or 1.0)  # Granite: logits / logits_scaling
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.device = self.embed_tokens.weight.device
        self.dtype = self.embed_tokens.weight.dtype
        self.compiled = compile_blocks(self.layers) if compile else None

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.own:
            return self.base.embed(ids)
        h = self.embed_tokens(ids)
        return h * self.embedding_multiplier if self.embedding_multiplier != 1.0 else h

    def _reach(self, t: str) -> int | None:
        """How far back a layer of type `t` attends at most (None: to the start)."""
        return {"sliding_attention": self.window, "chunked_attention": self.chunk}.get(t)

    def _restrict(self, t: str, allowed: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """`allowed` narrowed to what a layer of type `t` sees: query positions `q`, key positions `k` (broadcast)."""
        if t == "sliding_attention" and self.window is not None:
            return allowed & (q - k < self.window)
        if t == "chunked_attention":
            return allowed & (torch.div(q, self.chunk, rounding_mode="floor") == torch.div(k, self.chunk, rounding_mode="floor"))
        return allowed

    def context(self, length: int, past: int) -> _Context:
        """Masks and rotary embeddings for `length` new positions after `past` cached ones."""
        if self.own:
            if past:
                raise Unsupported(f"{type(self.model).__name__}: its blocks keep no cache, so it steps from the first token only")
            return _Context({}, {}, torch.arange(length, device=self.device)[None], self.base.block_inputs(length, self.device))
        q = torch.arange(past, past + length, device=self.device)[:, None]
        k = torch.arange(past + length, device=self.device)[None]
        masks = {}
        for t in set(self.types):
            reach = self._reach(t)
            if self.implicit_causal and past == 0 and (reach is None or length <= reach):
                masks[t] = None  # no cached prefix and no window or chunk cut: plain causality
                continue
            masks[t] = self._additive(self._restrict(t, k <= q, q, k))[None, None]
        position_ids = torch.arange(past, past + length, device=self.device)[None]
        return _Context(masks, self._rope(position_ids), position_ids)

    def packed_context(self, docs: torch.Tensor, positions: torch.Tensor, past: int) -> _Context:
        """Masks and rotary embeddings for rows that each hold several documents one after another.

        `docs` [rows, width] gives each token's document (every padding run a document of its own,
        so that no query row is fully masked), `positions` its position within the document; all
        documents attend to the same `past` cached positions (a shared prefix) before their own.
        A document then sees exactly what it would see alone in a row: causality and sliding
        windows hold per document, and its rotary positions restart after the prefix.
        """
        if self.own:
            raise Unsupported(f"{type(self.model).__name__}: its blocks take no mask of packed documents")
        docs, positions = docs.to(self.device), positions.to(self.device)
        position_ids = past + positions
        same = (docs[:, :, None] == docs[:, None, :]) & (positions[:, :, None] >= positions[:, None, :])
        seen = torch.cat([torch.ones(*docs.shape, past, dtype=torch.bool, device=self.device), same], dim=-1)
        key_pos = torch.cat([torch.arange(past, device=self.device).expand(docs.shape[0], past), position_ids], dim=-1)
        masks = {t: self._additive(self._restrict(t, seen, position_ids[:, :, None], key_pos[:, None, :]))[:, None] for t in set(self.types)}
        return _Context(masks, self._rope(position_ids), position_ids)

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        # additive float masks: eager attention adds them, sdpa accepts them as they are
        return torch.zeros(allowed.shape, dtype=self.dtype, device=self.device).masked_fill(~allowed, torch.finfo(self.dtype).min)

    def _rope(self, position_ids: torch.Tensor) -> dict:
        probe = torch.zeros(1, 1, device=self.device, dtype=self.dtype)
        if self.rope_per_type:
            return {t: self.rotary(probe, position_ids, t) for t in set(self.types)}
        shared = self.rotary(probe, position_ids)
        return {t: shared for t in set(self.types)}

    def block(self, i: int, h: torch.Tensor, ctx: _Context, cache=None) -> torch.Tensor:
        if ctx.inputs is not None:
            if cache is not None:
                raise Unsupported(f"{type(self.model).__name__}: its blocks keep no cache, so it steps from the first token only")
            return self.layers[i](h, **ctx.inputs)
        t = self.types[i]
        layer = self.layers[i]
        if self.compiled is not None and not _hooked(layer):
            layer = self.compiled[i]
        out = layer(h, attention_mask=ctx.masks[t], position_embeddings=ctx.rope[t], position_ids=ctx.position_ids,
                    use_cache=False, **{self.cache_arg: cache.layer(i) if cache is not None else None}, **self.extra)
        return out[0] if isinstance(out, tuple) else out

    def streams(self, ids: torch.Tensor, embedding: bool = False) -> list[torch.Tensor]:
        """The stream after every block on `ids`, from their first token (no cache), with `embedding`
        the embedding's output first (every stream a block reads, then the last's output): what the
        lenses and the depth map read."""
        ctx = self.context(ids.shape[1], 0)
        h = self.embed(ids.to(self.device))
        out = [h] if embedding else []
        for i in range(self.n_layers):
            h = self.block(i, h, ctx)
            out.append(h)
        return out

    def head_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The final norm and head alone, `lm_head(norm(h))` in fp32: no logit scale or soft-cap (a
        logit lens read as Csordás et al.'s code reads it)."""
        return self.head(self.norm(h)).float()

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The model's logits for the given positions only, in fp32: the final norm and head, then the
        family's own scale and soft-cap (Granite, Cohere, Gemma 2), each in the model's dtype as its
        forward computes them, so that a bf16 model's logits are its own to the bit."""
        logits = self.head(self.norm(h))
        if self.logit_scale != 1.0:
            logits = logits * self.logit_scale
        if self.logits_scaling != 1.0:
            logits = logits / self.logits_scaling
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float()

    @torch.inference_mode()
    def check(self, length: int = 40, cached: bool = True) -> None:
        """Raise Unsupported unless block stepping (and, where `cached`, stepping after a cached
        prefix) gives the model's own logits."""
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
        tol = 1e-3 if self.dtype == torch.float32 else 5e-2
        scale = reference.abs().max().item() + 1.0
        err = (full - reference).abs().max().item()
        if not err <= tol * scale:
            raise Unsupported(f"{type(self.model).__name__}: the block-by-block forward differs from the model's own by {err:.2g}")
        if not cached:
            return
        split = length // 2
        rec = _RecordKV()
        hp, cp = self.embed(ids[:1, :split]), self.context(split, 0)
        for i in range(self.n_layers):
            hp = self.block(i, hp, cp, rec)
        hs, cs, cache = self.embed(ids[:1, split:]), self.context(length - split, split), _PrefixKV(rec.kv)
        for i in range(self.n_layers):
            hs = self.block(i, hs, cs, cache)
        suffix = self.logits(hs)
        err = (suffix - reference[:1, split:]).abs().max().item()
        if not err <= tol * scale:
            raise Unsupported(f"{type(self.model).__name__}: the cached-prefix forward differs from the model's own by {err:.2g}")

    @torch.inference_mode()
    def packing_fails(self) -> str | None:
        """None when documents packed into one row (after a cached prefix, as `packed_context` runs
        them) get the model's own logits for each document alone; otherwise why not."""
        if self.own:
            return f"{type(self.model).__name__}: its blocks take no mask of packed documents"
        if getattr(self.config, "_attn_implementation", None) not in ("sdpa", "eager"):
            return f"attention {self.config._attn_implementation!r} does not take an arbitrary mask"
        if getattr(self.config, "attn_temperature_tuning", False) and not all(getattr(self.config, "no_rope_layers", None) or [1]):
            # Llama-4 scales a NoPE layer's queries by the position in the row, not in the document:
            # the same (1) for every row shorter than floor_scale, which a short check cannot tell apart
            return f"{type(self.model).__name__}: attention temperature tuning scales queries by their position in the row"
        # The model's own blocks, not the compiled ones: this probe's batch of one would compile
        # graphs specialised to it (dynamo specialises sizes of 1) that no real batch uses again.
        compiled, self.compiled = self.compiled, None
        try:
            return self._packing_differs()
        finally:
            self.compiled = compiled

    def _packing_differs(self) -> str | None:
        gen = torch.Generator().manual_seed(1)
        vocab = self.head.weight.shape[0]
        prefix, lengths, width = 8, (13, 9), 24
        tokens = torch.randint(0, vocab, (prefix + width,), generator=gen).to(self.device)
        docs = torch.tensor([[0] * lengths[0] + [1] * lengths[1] + [2] * (width - sum(lengths))])
        positions = torch.cat([torch.arange(n) for n in (*lengths, width - sum(lengths))])[None]
        rec = _RecordKV()
        hp, cp = self.embed(tokens[None, :prefix]), self.context(prefix, 0)
        for i in range(self.n_layers):
            hp = self.block(i, hp, cp, rec)
        h, ctx, cache = self.embed(tokens[None, prefix:]), self.packed_context(docs, positions, prefix), _PrefixKV(rec.kv)
        for i in range(self.n_layers):
            h = self.block(i, h, ctx, cache)
        packed = self.logits(h[0])
        tol = 1e-3 if self.dtype == torch.float32 else 5e-2
        offset = 0
        for n in lengths:
            alone = torch.cat([tokens[:prefix], tokens[prefix + offset : prefix + offset + n]])
            reference = self.model(input_ids=alone[None], use_cache=False).logits[0, prefix:].float()
            err = (packed[offset : offset + n] - reference).abs().max().item()
            if not err <= tol * (reference.abs().max().item() + 1.0):
                return f"{type(self.model).__name__}: a packed document's logits differ from its own by {err:.2g}"
            offset += n
        return None


def checked_stepper(model: torch.nn.Module, cached: bool = True) -> Stepper:
    """A stepper shown to give `model`'s own logits (`Stepper.check`; after a cached prefix too
    where `cached`), or Unsupported saying why, also where building or checking it failed another
    way (an architecture whose blocks want something the stepper does not give them)."""
    try:
        stepper = Stepper(model)
        stepper.check(cached=cached)
    except Unsupported:
        raise
    except (AssertionError, RuntimeError) as exc:
        raise Unsupported(f"{type(model).__name__}: stepping through its blocks failed ({type(exc).__name__}: {exc})") from exc
    return stepper
