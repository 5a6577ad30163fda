"""Layer surgery: find a model's transformer blocks and take some of them out.

Removing a block is more than deleting it from the list. Hugging Face models read the config
while they run: Qwen2/Gemma pick each layer's attention mask from ``config.layer_types`` by its
position in the loop, ``DynamicCache(config=...)`` sizes the KV cache from
``num_hidden_layers``/``layer_types``, and every attention module indexes that cache with its own
``layer_idx``. A stale value there either raises (IndexError in the cache) or, worse, silently
gives wrong logits. So the surgery keeps all three consistent, and undoes all of it afterwards.

Nothing is copied: the kept blocks are the same module objects (same parameter tensors), just
held by a fresh ``nn.ModuleList``. Swapping the original list back restores the model exactly.
"""

from __future__ import annotations

import copy
import operator
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from depthcurse.errors import DepthcurseError
from depthcurse.granularity import check_granularity_taken

# Where the block list lives, tried in order. Heads (ForCausalLM, ForMaskedLM, ...) wrap the
# base model under its `base_model_prefix` (model, transformer, gpt_neox, bert, ...), bare base
# models hold the list directly. Language-model paths of multimodal models come before anything
# else so that a vision tower's `encoder.layers` is never picked by mistake.
KNOWN_BLOCK_PATHS = (
    "model.language_model.layers",  # Gemma3ForConditionalGeneration and other VLMs (transformers 5)
    "language_model.layers",  # their bare *Model
    "language_model.model.layers",  # older VLM layout (LLaVA-style)
    "model.layers",  # Llama, Mistral, Qwen2/3, Gemma 1/2/3, Phi, Phi3 ... ForCausalLM
    "layers",  # their bare *Model, GPTNeoXModel
    "transformer.h",  # GPT-2, Falcon, Bloom, GPT-J heads
    "transformer.layers",  # generic *ForQuestionAnswering heads of Llama-likes (Qwen2, Mistral...)
    "h",  # GPT2Model, FalconModel
    "gpt_neox.layers",  # GPT-NeoX / Pythia heads
    "model.decoder.layers",  # OPT heads
    "decoder.layers",  # OPTModel
    "bert.encoder.layer",
    "roberta.encoder.layer",
    "mpnet.encoder.layer",
    "electra.encoder.layer",
    "deberta.encoder.layer",
    "encoder.layer",  # bare BertModel, RobertaModel, MPNetModel, ...
    "distilbert.transformer.layer",
    "transformer.layer",  # DistilBertModel
)

# Config lists with one entry per block, filtered with the blocks. The rule is: the names below,
# plus any other attribute whose name ends in "layer_types" (the transformers convention for
# per-layer type lists, e.g. `layer_types`, `mlp_layer_types`), when its length equals the layer
# count. Deliberately NOT "any list of that length": a model with 4 layers and 4 of something
# else (`out_indices`, conv kernel sizes...) must not have that list cut. `mtp_*` lists describe
# the extra multi-token-prediction layers, not the main stack, so they are left alone.
PER_LAYER_CONFIG_LISTS = (
    "layer_types",  # Qwen2/Qwen3/Gemma2/Gemma3/Ministral...: attention mask + cache layer kind
    "mlp_layer_types",  # dense vs MoE per layer
    "indexer_types",  # sparse-attention indexer per layer (GLM-MoE-DSA, ...)
    "no_rope_layers",  # Llama4 / SmolLM3: 0/1 flag per layer
    "num_attention_heads_per_layer",
    "num_key_value_heads_per_layer",
    "layer_origins",  # depthcurse's own lns-train models: each block's original index (LNS, Mix-LN)
)

# Config lists of layer *indices* (not one entry per layer): kept entries are renumbered, removed
# ones dropped. `mlp_only_layers` (Qwen2-MoE/Qwen3-MoE) names the layers with a dense MLP.
LAYER_INDEX_CONFIG_LISTS = ("mlp_only_layers", "moe_layers")  # moe_layers: Llama-4's MoE layers

# Config integers that say "the first k layers are different": DeepSeek-V2/V3's and GLM-4-MoE's
# dense layers before the MoE ones, Qwen2's full-attention layers before the sliding ones. After a
# removal, k becomes the number of kept layers that were among the first k.
LAYER_PREFIX_CONFIG_COUNTS = ("first_k_dense_replace", "max_window_layers")

# Integer attributes some block-list owners cache at init (DistilBERT's Transformer.n_layers).
MODULE_COUNT_ATTRS = ("n_layers", "num_layers", "num_hidden_layers")


@dataclass
class BlockList:
    """Where a model keeps its transformer blocks: ``getattr(parent, attr)``."""

    parent: nn.Module  # module owning the attribute
    attr: str  # attribute name, e.g. "layers", "h", "layer"
    path: str  # dotted path from the model root, e.g. "model.layers"

    @property
    def layers(self) -> nn.ModuleList:
        return getattr(self.parent, self.attr)


def _resolve(model: nn.Module, path: str) -> tuple[nn.Module, str, Any] | None:
    """(parent, attr, value) for a dotted path, or None when any step is missing."""
    *parents, attr = path.split(".")
    parent = model
    for name in parents:
        parent = getattr(parent, name, None)
        if not isinstance(parent, nn.Module):
            return None
    value = getattr(parent, attr, None)
    return (parent, attr, value) if value is not None else None


def _main_config(model: nn.Module):
    """The config that describes the block stack: the text config of multimodal models."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    if hasattr(config, "get_text_config"):
        text_config = config.get_text_config(decoder=True)
        if getattr(text_config, "num_hidden_layers", None) is not None:
            return text_config
    return config


def _configured_layer_count(model: nn.Module) -> int | None:
    config = _main_config(model)
    n = getattr(config, "num_hidden_layers", None) if config is not None else None
    return n if isinstance(n, int) else None


def find_blocks(model: nn.Module) -> BlockList:
    """The list of transformer blocks of ``model``: any common decoder or encoder, any head."""
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        # Two stacks (T5, BART): "the" layer list is ambiguous and num_hidden_layers covers one.
        raise DepthcurseError(
            f"cannot prune {type(model).__name__}: encoder-decoder models are not supported"
        )
    n = _configured_layer_count(model)

    candidates = []
    for path in KNOWN_BLOCK_PATHS:
        found = _resolve(model, path)
        if found is not None and isinstance(found[2], nn.ModuleList):
            candidates.append(BlockList(found[0], found[1], path))
    # Prefer a known path whose length agrees with the config: a bare name like "layers" can
    # exist for other reasons in some architectures.
    blocks = next((c for c in candidates if n is None or len(c.layers) == n), None)
    fallback_known = candidates[0] if candidates else None

    if blocks is None and n:
        # Unknown layout: the largest ModuleList (by parameter count) with one entry per layer.
        best, best_size = None, -1
        for name, module in model.named_modules():
            if isinstance(module, nn.ModuleList) and len(module) == n and name:
                size = sum(p.numel() for p in module.parameters())
                if size > best_size:
                    best, best_size = name, size
        if best is not None:
            parent_path, _, attr = best.rpartition(".")
            parent = model.get_submodule(parent_path) if parent_path else model
            blocks = BlockList(parent, attr, best)

    if blocks is None:
        # A known path whose length disagrees with the config (someone edited the list by hand)
        # is still a better answer than none.
        blocks = fallback_known
    if blocks is None:
        raise DepthcurseError(
            f"cannot find the transformer blocks of {type(model).__name__}: "
            "unsupported architecture"
        )
    return blocks


def num_layers(model: nn.Module) -> int:
    """How many transformer blocks the model has right now."""
    return len(find_blocks(model).layers)


def _index_range_error(index: int, n_layers: int) -> DepthcurseError:
    if n_layers == 0:
        return DepthcurseError(f"layer {index} is out of range: the model has no layers")
    return DepthcurseError(
        f"layer {index} is out of range: the model has {n_layers} layers (0-{n_layers - 1})"
    )


def _normalize_index(index: int, n_layers: int) -> int:
    """Python-style: negative counts from the end. Out of range is a user error."""
    i = index + n_layers if index < 0 else index
    if not 0 <= i < n_layers:
        raise _index_range_error(index, n_layers)
    return i


_SINGLE = re.compile(r"-?\d+")
_RANGE = re.compile(r"(-?\d+)\s*-\s*(-?\d+)")


def parse_removal(spec: str, n_layers: int, option: str = "--layers") -> list[int]:
    """`parse_layers` for layers to remove: at least one must stay."""
    removed = parse_layers(spec, n_layers, option)
    if len(removed) == n_layers:
        raise DepthcurseError(f"{option} {spec} removes all {n_layers} layers")
    return removed


def parse_layers(spec: str | None, n_layers: int, option: str = "--layers") -> list[int]:
    """Parse a layer spec such as ``"0,3,5-8"`` or ``"-1"`` into sorted indices.

    None and "all" mean every layer; an empty spec is an error (a shell variable that came out
    empty should not silently mean every layer), and so is a layer named twice ("3,3", "2-5,4",
    "-1,29" on 30 layers: a typo for another layer, which would go unremoved without a word).
    Ranges are inclusive; negative indices count from the end, in ranges too ("-3--1" is the
    last three layers).
    """
    if spec is None or spec.strip().lower() == "all":
        return list(range(n_layers))
    if not spec.strip(" ,"):
        raise DepthcurseError(f"{option} {spec!r} names no layer: give indices and ranges like 0,3,5-8, or leave it out for every layer")
    named: list[int] = []
    for raw in spec.split(","):
        token = raw.strip()
        if not token:
            continue  # tolerate "1,2," and "1,,2"
        if _SINGLE.fullmatch(token):
            named.append(_normalize_index(int(token), n_layers))
            continue
        match = _RANGE.fullmatch(token)
        if match is None:
            raise DepthcurseError(
                f"bad layer spec {token!r} in {spec!r}: "
                "expected indices and ranges like 0,3,5-8 or -1"
            )
        start = _normalize_index(int(match.group(1)), n_layers)
        end = _normalize_index(int(match.group(2)), n_layers)
        if start > end:
            raise DepthcurseError(f"bad layer range {token!r}: the start comes after the end")
        named.extend(range(start, end + 1))
    if not named:
        raise DepthcurseError(f"bad layer spec {spec!r}: no layers given")
    twice = sorted({i for i in named if named.count(i) > 1})
    if twice:
        raise DepthcurseError(f"{option} {spec!r} names layer{'s' if len(twice) > 1 else ''} {','.join(map(str, twice))} more than once: name each layer once")
    return sorted(named)


def _configs_to_update(model: nn.Module, blocks: BlockList, n: int) -> list:
    """Every distinct config object that describes this stack of n layers.

    Usually one object shared by the head and the base model. Multimodal models keep the count
    in `text_config`, and the language model's own `.config` is that same object; collecting by
    identity covers both layouts without special cases.
    """
    found = []
    modules = [model]
    node = model
    for name in blocks.path.split(".")[:-1]:
        node = getattr(node, name)
        modules.append(node)
    for module in modules:
        config = getattr(module, "config", None)
        if config is None:
            continue
        for candidate in (config, _main_config(module)):
            if (
                candidate is not None
                and getattr(candidate, "num_hidden_layers", None) == n
                and all(candidate is not c for c in found)
            ):
                found.append(candidate)
    for config in found:
        if getattr(config, "is_heterogeneous", False):
            raise DepthcurseError(
                f"cannot prune {type(model).__name__}: configs with per-layer overrides "
                "(per_layer_config) are not supported"
            )
    return found


def _per_layer_list_names(config, n: int) -> list[str]:
    names = []
    for name, value in vars(config).items():
        if name.startswith("mtp_") or not isinstance(value, (list, tuple)) or len(value) != n:
            continue
        if name in PER_LAYER_CONFIG_LISTS or name.endswith("layer_types"):
            names.append(name)
    return names


def _remove(model: nn.Module, layers: Iterable[int]) -> Callable[[], None]:
    """Remove the blocks in place and return a function that puts everything back.

    Every change is logged before it is made, so a failure half-way is undone as well.
    """
    blocks = find_blocks(model)
    old_list = blocks.layers
    n = len(old_list)
    try:
        drop = {_normalize_index(operator.index(i), n) for i in layers}
    except TypeError as err:
        raise DepthcurseError(f"layer indices must be integers: {err}") from None
    undo: list[Callable[[], None]] = []

    def restore() -> None:
        # Reverse order: later changes may sit on top of earlier ones (same attribute twice).
        while undo:
            undo.pop()()

    if not drop:
        return restore

    kept = [i for i in range(n) if i not in drop]
    new_index = {old: new for new, old in enumerate(kept)}
    try:
        configs = _configs_to_update(model, blocks, n)

        # The block list itself: a new container around the same modules, nothing copied.
        setattr(blocks.parent, blocks.attr, nn.ModuleList([old_list[i] for i in kept]))
        undo.append(lambda: setattr(blocks.parent, blocks.attr, old_list))

        for config in configs:
            # Goes through attribute_map, so GPT-2's n_layer and DistilBERT's n_layers follow.
            count = config.num_hidden_layers
            undo.append(lambda c=config, v=count: setattr(c, "num_hidden_layers", v))
            config.num_hidden_layers = len(kept)
            for name in _per_layer_list_names(config, n):
                value = getattr(config, name)
                undo.append(lambda c=config, k=name, v=value: setattr(c, k, v))
                # A new list, never an in-place edit: the original object is what gets restored.
                setattr(config, name, type(value)(value[i] for i in kept))
            for name in LAYER_INDEX_CONFIG_LISTS:
                value = getattr(config, name, None)
                if isinstance(value, (list, tuple)):
                    undo.append(lambda c=config, k=name, v=value: setattr(c, k, v))
                    renumbered = (new_index[i] for i in value if i in new_index)
                    setattr(config, name, type(value)(renumbered))
            for name in LAYER_PREFIX_CONFIG_COUNTS:
                value = vars(config).get(name)
                if isinstance(value, int) and not isinstance(value, bool):
                    undo.append(lambda c=config, k=name, v=value: setattr(c, k, v))
                    setattr(config, name, sum(1 for i in kept if i < value))

        for name in MODULE_COUNT_ATTRS:
            value = vars(blocks.parent).get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value == n:
                undo.append(lambda k=name, v=value: setattr(blocks.parent, k, v))
                setattr(blocks.parent, name, len(kept))

        # The KV cache has one slot per *current* layer; each attention module indexes it with its
        # own layer_idx, so kept blocks must answer to their new position.
        for new, old in enumerate(kept):
            for module in old_list[old].modules():
                value = vars(module).get("layer_idx")
                if isinstance(value, int) and not isinstance(value, bool):
                    undo.append(lambda m=module, v=value: setattr(m, "layer_idx", v))
                    module.layer_idx = new
    except BaseException:
        restore()
        raise
    return restore


def runs_of(layers: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The contiguous runs of `layers` (sorted): 3,4,5,9 -> (3,4,5), (9,)."""
    runs: list[list[int]] = []
    for i in sorted(layers):
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return [tuple(r) for r in runs]


def run_text(run: tuple[int, ...]) -> str:
    return f"layer {run[0]}" if len(run) == 1 else f"layers {run[0]}-{run[-1]}"


@contextmanager
def placed_layers(model: nn.Module, replacements: dict[int, nn.Module]) -> Iterator[nn.Module]:
    """`model` with each of `replacements` (an index -> a block) in that block's place: a trained or
    merged layer where its run's first layer, or its base, stands; put back afterwards."""
    blocks = find_blocks(model).layers
    old = {i: blocks[i] for i in replacements}
    try:
        for i, layer in replacements.items():
            blocks[i] = layer
        yield model
    finally:
        for i, layer in old.items():
            blocks[i] = layer


@contextmanager
def removed_layers(model: nn.Module, layers: Iterable[int]) -> Iterator[nn.Module]:
    """Run ``model`` without the given blocks, then put it back exactly as it was.

    Inside the context the model is a consistent ``n - k`` layer model: the block list, the
    config (``num_hidden_layers``, per-layer lists such as ``layer_types``) and every
    ``layer_idx`` agree, so forward, ``use_cache=True``, ``generate()`` and ``save_pretrained``
    all behave as for a model built with those layers. No weight is copied. Indices may be
    negative (from the end); an empty set is a no-op. Not re-entrant: do not nest on one model.
    """
    restore = _remove(model, layers)
    try:
        yield model
    finally:
        restore()


# Where a pre-norm block keeps each residual branch (h + branch(norm(h))), tried in order
# (`attention`: GPT-NeoX, whose BERT namesake is a Post-LN sub-layer, below).
BRANCH_NAMES = {"attn": ("self_attn", "attn", "self_attention", "attention"), "mlp": ("mlp", "block_sparse_moe", "feed_forward")}
# Post-LN encoder blocks normalise the sum, norm(h + branch(h)), and keep the branch's last step
# inside a sub-module with that norm: each entry is (the branch, the norm taking its sum), the
# norm confirming the layout. Zeroed, the branch leaves norm(h), as in our own Post-LN blocks
# (`train.model.Block`) with their attention or MLP removed.
POST_LN_BRANCHES = {
    "attn": (("attention.output.dense", "attention.output.LayerNorm"),  # BERT, RoBERTa, ELECTRA, DeBERTa
             ("attention.attn", "attention.LayerNorm"),  # MPNet
             ("attention", "sa_layer_norm")),  # DistilBERT
    "mlp": (("output.dense", "output.LayerNorm"), ("ffn", "output_layer_norm")),
}


def _post_ln_branch(block: nn.Module, part: str) -> nn.Module | None:
    for branch, norm in POST_LN_BRANCHES[part]:
        try:
            found, _ = block.get_submodule(branch), block.get_submodule(norm)
        except AttributeError:
            continue
        return found
    return None


def find_branch(block: nn.Module, part: str) -> nn.Module | None:
    """The module computing `part` ("attn" or "mlp") of a pre-norm block, whose output the block
    adds to its stream; None when it has none, as in a Post-LN block."""
    if _post_ln_branch(block, part) is not None:
        return None
    return next((m for m in (getattr(block, name, None) for name in BRANCH_NAMES[part]) if isinstance(m, nn.Module)), None)


# Blocks that normalise a branch's output before adding it to the stream, h + post(branch(pre(h))):
# (the module marking the layout, the attention's post-norm, the MLP's). The mark is needed:
# Llama's `post_attention_layernorm` is its MLP's input norm, Gemma's the attention's post-norm.
BRANCH_POST_NORMS = (
    ("post_feedforward_layernorm", {"attn": "post_attention_layernorm", "mlp": "post_feedforward_layernorm"}),  # Gemma 2/3, OLMo-2
    ("post_mlp_layernorm", {"attn": "post_self_attn_layernorm", "mlp": "post_mlp_layernorm"}),  # GLM-4 (its post_attention_layernorm is the MLP's input norm)
    ("mlp_out_norm", {"attn": "attn_out_norm", "mlp": "mlp_out_norm"}),  # lns-train's sandwich blocks
)


def branch_output(block: nn.Module, part: str) -> tuple[nn.Module, torch.Tensor | float | None] | None:
    """Where a pre-norm block's `part` branch meets its stream: (the module whose output the block
    adds, after the branch's own post-norm where it has one; what the block multiplies it by first, or
    None: a learned scale, as lns-train's LayerScale and SkipInit blocks have, or a number, Granite's
    `residual_multiplier`). None for Post-LN blocks."""
    branch = find_branch(block, part)
    if branch is None:
        return None
    for mark, norms in BRANCH_POST_NORMS:
        post = getattr(block, norms[part], None)
        if isinstance(getattr(block, mark, None), nn.Module) and isinstance(post, nn.Module):
            branch = post
            break
    scale = getattr(block, f"{part}_scale", None)
    if isinstance(scale, nn.Parameter):
        return branch, scale
    multiplier = getattr(block, "residual_multiplier", None)  # Granite: h + multiplier * branch(norm(h))
    return branch, float(multiplier) if isinstance(multiplier, (int, float)) and multiplier != 1 else None


def half_stream(block: nn.Module) -> nn.Module | None:
    """For a block that does not add its attention's output to the stream as it is (lns-train's
    Post-LN blocks, Mix-LN's first ones, normalise the sum; HybridNorm's normalise the stream after
    the attention), the module whose output is the stream between its attention half and its MLP
    half; None for every other block."""
    kind = getattr(getattr(block, "spec", None), "kind", None)
    return {"post": getattr(block, "input_layernorm", None), "hybrid": getattr(block, "post_attention_layernorm", None)}.get(kind)


def branch_of(block: nn.Module, part: str) -> nn.Module:
    """The module computing `part` ("attn" or "mlp") of a block, whose output the block adds to
    its stream (pre-norm) or to the sum it normalises (Post-LN)."""
    module = _post_ln_branch(block, part)
    if module is None:
        module = find_branch(block, part)
    if module is not None:
        return module
    kind = {"attn": "attention", "mlp": "MLP"}[part]
    looked = list(BRANCH_NAMES[part]) + [b for b, _ in POST_LN_BRANCHES[part]]
    raise DepthcurseError(f"--granularity {part} is not defined for {type(block).__name__}: it has no {kind} module where one was looked for "
                          f"({', '.join(dict.fromkeys(looked))})")


def check_granularity(model: nn.Module | None, granularity: str) -> None:
    """A clear error for an unknown granularity, or (given a model) one its blocks do not have."""
    check_granularity_taken("prune", granularity)
    if model is not None and granularity != "layer":
        branch_of(find_blocks(model).layers[0], granularity)


def _zero_branch(module, args, output):
    # The branch's output, zeroed in whatever structure it has (attention: (output, weights)).
    if isinstance(output, tuple):
        return (torch.zeros_like(output[0]), *output[1:])
    return torch.zeros_like(output)


@contextmanager
def removed_units(model: nn.Module, units: Iterable[int], granularity: str = "layer") -> Iterator[nn.Module]:
    """`removed_layers` for `granularity="layer"`; for "attn" or "mlp", the model with that branch
    of each given block contributing nothing (its output zeroed: the stream passes it by), put back
    afterwards. Every other part of those blocks runs as before."""
    check_granularity(model, granularity)
    if granularity == "layer":
        with removed_layers(model, units):
            yield model
        return
    layers = find_blocks(model).layers
    n = len(layers)
    branches = [branch_of(layers[i], granularity) for i in {_normalize_index(operator.index(i), n) for i in units}]
    hooks = [b.register_forward_hook(_zero_branch) for b in branches]
    try:
        yield model
    finally:
        for hook in hooks:
            hook.remove()


def _zero_attention(module: nn.Module):
    """A stand-in forward for an attention module that does not run: its output zero, and where it is
    given a KV cache, zero keys and values written to it for the new positions, so that the cache's
    length (which transformers reads off its first layer) stays the sequence's."""
    kv_heads = module.k_proj.out_features // module.head_dim if hasattr(module, "k_proj") and hasattr(module, "head_dim") else None

    def forward(hidden_states, *args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is not None and kv_heads is not None:
            b, t = hidden_states.shape[:2]
            zeros = hidden_states.new_zeros(b, kv_heads, t, module.head_dim)
            cache.update(zeros, zeros, module.layer_idx)
        return torch.zeros_like(hidden_states), None

    return forward


def _zero_mlp(module: nn.Module):
    """A stand-in forward for an MLP that does not run: zero, in the structure the module gives (an
    expert layer's (output, router logits) where its block unpacks two: GPT-OSS, Llama 4), which the
    module's own forward on one token shows once and the module keeps."""
    forward = type(module).forward.__get__(module)

    def skipped(h, *args, **kwargs):
        if "_depthcurse_outputs" not in module.__dict__:
            out = forward(h[..., :1, :], *args, **kwargs)
            module.__dict__["_depthcurse_outputs"] = len(out) if isinstance(out, tuple) else 0
        n = module.__dict__["_depthcurse_outputs"]
        zeros = torch.zeros_like(h)
        return (zeros, *[None] * (n - 1)) if n else zeros

    return skipped


@contextmanager
def skipped_branches(model: nn.Module, units: Iterable[str]) -> Iterator[nn.Module]:
    """The model with the branches `units` ("a3": block 3's attention, "m7": block 7's MLP) not run at
    all, put back afterwards. Unlike `removed_units`, which zeroes a branch's output after computing it,
    the skipped branch costs nothing: what a draft that skips branches needs (SWIFT's, Draft & Verify's).
    A skipped attention writes zero keys and values to a cache it is given (Llama-like attention:
    `k_proj`, `head_dim`, `layer_idx`), so that later positions see a cache of the right length; its
    zeros are never attended to by any block that runs."""
    layers = find_blocks(model).layers
    swapped = []
    try:
        for unit in units:
            part = {"a": "attn", "m": "mlp"}[unit[0]]
            module = branch_of(layers[_normalize_index(int(unit[1:]), len(layers))], part)
            if find_branch(layers[int(unit[1:])], part) is None:
                raise DepthcurseError(f"cannot skip {unit}: {type(layers[0]).__name__} normalises after its branches (Post-LN); remove the whole block")
            if part == "attn" and int(unit[1:]) == 0 and not (hasattr(module, "k_proj") and hasattr(module, "head_dim")):
                # transformers reads a cache's length off its first layer: an attention there that writes nothing breaks every later position
                raise DepthcurseError(f"cannot skip a0: the model reads its KV cache's length off block 0, whose {type(module).__name__} "
                                      "cannot be given stand-in keys and values (no k_proj and head_dim); keep it, or skip whole blocks")
            module.forward = _zero_attention(module) if part == "attn" else _zero_mlp(module)
            swapped.append(module)
        yield model
    finally:
        for module in swapped:
            del module.forward  # the instance attribute goes: the class's forward is back


def _is_gguf(quantizer) -> bool:
    method = getattr(getattr(quantizer, "quantization_config", None), "quant_method", None)
    return str(getattr(method, "value", method)).lower() == "gguf"


@contextmanager
def _without_gguf_quantizer(model: nn.Module) -> Iterator[None]:
    """Hide a GGUF loader's traces so ``save_pretrained`` writes a plain checkpoint.

    A GGUF-loaded model keeps ``hf_quantizer`` (not serializable: save_pretrained refuses) and a
    ``quantization_config`` that would make the saved folder look quantized on reload. That is
    only honest when the weights were unpacked to ordinary tensors at load time; weights still in
    GGUF blocks would be saved as garbage, so that case is refused.
    """
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None or not _is_gguf(quantizer):
        yield  # no quantizer, or one that save_pretrained knows how to handle itself
        return
    if getattr(quantizer, "packed_modules", None):
        raise DepthcurseError(
            "cannot save a pruned copy of a GGUF model whose weights are still packed: "
            "load it dequantized (GgufConfig(dequantize=True)) first"
        )
    config = model.config
    had_qconfig = "quantization_config" in vars(config)
    qconfig = vars(config).get("quantization_config")
    del model.hf_quantizer
    if had_qconfig:
        delattr(config, "quantization_config")
    try:
        yield
    finally:
        model.hf_quantizer = quantizer
        if had_qconfig:
            config.quantization_config = qconfig


def _check_reloadable(model: nn.Module) -> None:
    """Refuse to write a checkpoint that would reload as a different model.

    Some architectures decide a block's structure or constants from its index when they are
    built: Qwen2-MoE/Qwen3-MoE put an MoE MLP on every `decoder_sparse_step`-th layer, GPT-2 with
    `scale_attn_by_inverse_layer_idx` bakes 1/(layer_idx+1) into each attention. In memory the
    kept blocks keep what they were built with; a reloaded checkpoint rebuilds them from their
    new positions. Structural mismatches show up as different parameter names or shapes of a
    model built (on the meta device, no memory) from the pruned config.
    """
    config = model.config
    if getattr(config, "scale_attn_by_inverse_layer_idx", False):
        raise DepthcurseError(
            f"cannot save a pruned {type(model).__name__}: its attention scale depends on the "
            "layer index (scale_attn_by_inverse_layer_idx), so the kept layers would reload "
            "with other scales"
        )
    try:
        with torch.device("meta"):
            fresh = type(model)(copy.deepcopy(config))
    except Exception:
        return  # cannot build one to compare with: nothing more to check
    ours = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    theirs = {k: tuple(v.shape) for k, v in fresh.state_dict().items()}
    if ours != theirs:
        differing = sorted(set(ours).symmetric_difference(theirs)) or sorted(
            k for k in ours if ours[k] != theirs[k]
        )
        raise DepthcurseError(
            f"cannot save a pruned {type(model).__name__}: with these layers removed the saved "
            f"config describes a different architecture (e.g. {differing[0]}), so it would not "
            "reload as saved"
        )


def save_pruned(model: nn.Module, tokenizer, layers: Iterable[int], out_dir) -> Path:
    """Save a copy of ``model`` without ``layers`` (safetensors) plus the tokenizer, if given.

    The in-memory model is left unchanged: the save happens inside :func:`removed_layers`, whose
    re-indexed ModuleList makes the checkpoint's keys run 0..n-k-1 and whose config has the
    reduced ``num_hidden_layers``, so the folder reloads with ``AutoModelFor*.from_pretrained``.
    (``save_pretrained`` itself records ``architectures`` and ``dtype`` in the config.)
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise DepthcurseError(f"cannot save to {out}: it exists and is not a directory")
    with removed_layers(model, layers), _without_gguf_quantizer(model):
        _check_reloadable(model)
        model.save_pretrained(out)  # transformers 5 always writes safetensors
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out
