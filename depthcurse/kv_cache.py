"""A transformers KV cache, whatever the version: the keyword a model takes it by, where its output
holds it, how long it is, how to cut it back and how many bytes it holds.

transformers 5.24 renamed `past_key_values` to `cache` (the old name works, with a warning, until
5.40), and `crop` takes a negative count of positions to remove in every version since 4.38.
`speed` and `speculate` both read and cut caches; this is the one place that knows how.
"""

from __future__ import annotations

import inspect

import torch


def cache_keyword(model) -> str:
    """The keyword a model takes its KV cache by: `cache` (transformers 5.24 on) or `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def cache_of(output):
    """The KV cache a forward pass returned."""
    return getattr(output, "cache", None) or output.past_key_values


def cache_length(cache) -> int:
    """Positions a cache holds (0: no cache yet)."""
    return 0 if cache is None else int(cache.get_seq_length())


def record_past(cache) -> None:
    """Let a cache be cut back past a sliding window: its sliding-window layers (Mistral, Qwen 2/3 with
    a window, Cohere 2, GPT-OSS, Llama 4) keep what they would drop until the next `crop`, as
    transformers' own assisted decoding asks of them after the prefill. A cache without such
    layers (or from before transformers had them) is left as it is."""
    if hasattr(cache, "activate_past_recording"):
        cache.activate_past_recording()


def _records_past(cache) -> bool:
    return any(getattr(layer, "record_past", False) for layer in getattr(cache, "layers", ()))


def crop(cache, keep: int) -> None:
    """Keep the first `keep` positions of `cache` (a sliding-window layer that records its past is
    then put back to its window, which `crop(0)` does in the versions that have such layers)."""
    remove = cache_length(cache) - keep
    if remove > 0:
        cache.crop(-remove)
    elif _records_past(cache):
        cache.crop(0)


def cache_bytes(cache) -> int:
    """The bytes of every key and value tensor a KV cache holds."""
    if cache is None:
        return 0
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return sum(t.numel() * t.element_size() for layer in layers for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                   if isinstance(t, torch.Tensor))
    return sum(t.numel() * t.element_size() for kv in cache for t in kv if isinstance(t, torch.Tensor))
