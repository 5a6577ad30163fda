"""Depth diagnostics from one forward pass over real text: angular distances between residual
streams (Gromov et al.), ShortGPT Block Influence, relative update size and residual-stream
growth. The hooks that read the stream are in `capture`; what comes out is in `result`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from depthcurse.angular.capture import StreamCapture
from depthcurse.identity import identity_distances
from depthcurse.angular.result import AngularResult
from depthcurse.errors import DepthcurseError
from depthcurse.io import environment
from depthcurse.loading import window_length
from depthcurse.surgery import find_blocks
from depthcurse.text import load_texts

POSITIONS = ("last", "all")


MIN_VECTORS = 8  # token vectors a distance is averaged over, at least


def check_options(*, tokens: int, seq_len: int, batch_size: int, position: str) -> None:
    """Validate the options that do not need the model (raises DepthcurseError)."""
    if tokens <= 0:
        raise DepthcurseError(f"--tokens must be positive (got {tokens})")
    if seq_len is not None and seq_len < 1:
        raise DepthcurseError(f"--seq-len must be at least 1 (got {seq_len})")
    if batch_size < 1:
        raise DepthcurseError(f"--batch-size must be at least 1 (got {batch_size})")
    if position not in POSITIONS:
        raise DepthcurseError(f"unknown --token-position {position!r}: use last or all")


def check_max_n(max_n: int | None, n_layers: int) -> int:
    """The largest block size n, 1..L; None means L."""
    if n_layers < 1:
        raise DepthcurseError("the model has no layers")
    if max_n is None:
        return n_layers
    if not 1 <= max_n <= n_layers:
        raise DepthcurseError(f"--max-n {max_n} is out of range: the model has {n_layers} layers (use 1-{n_layers})")
    return max_n


@dataclass
class TokenisedData:
    sequences: list[list[int]]
    tokens: int  # real tokens kept (the budget, or everything the data holds)
    exhausted: bool  # the data ran out before the budget was reached


def tokenise_docs(tokenizer, docs: Iterable[str], *, seq_len: int, budget: int, chunk: int = 64) -> TokenisedData:
    """One document per row, truncated to `seq_len`, until `budget` real tokens are reached.

    The tokenizer's own special tokens are kept (BOS for Llama-likes that add one, CLS/SEP for
    BERT). The last document is cut so that exactly `budget` tokens are used when the data
    holds at least that many.
    """
    if tokenizer is None:
        raise DepthcurseError("this model has no tokenizer: angular distances need one to read text")
    docs = [d for d in docs if isinstance(d, str) and d.strip()]
    seqs: list[list[int]] = []
    total = 0
    for start in range(0, len(docs), chunk):
        enc = tokenizer(docs[start : start + chunk], truncation=True, max_length=seq_len)["input_ids"]
        for ids in enc:
            ids = list(ids)
            if not ids:
                continue
            take = min(len(ids), budget - total)
            seqs.append(ids[:take])
            total += take
            if total >= budget:
                return TokenisedData(seqs, total, exhausted=False)
    if not seqs:
        raise DepthcurseError("the data holds no tokens after tokenisation")
    return TokenisedData(seqs, total, exhausted=True)


def pad_id_of(tokenizer) -> int:
    for name in ("pad_token_id", "eos_token_id", "unk_token_id"):
        value = getattr(tokenizer, name, None) if tokenizer is not None else None
        if isinstance(value, int):
            return value
    return 0


def make_batches(sequences: list[list[int]], batch_size: int, pad_id: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids, attention_mask) per batch, right-padded to the batch's longest row."""
    batches = []
    for start in range(0, len(sequences), batch_size):
        rows = sequences[start : start + batch_size]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            mask[i, : len(r)] = 1
        batches.append((ids, mask))
    return batches


def forward_module(model: torch.nn.Module) -> torch.nn.Module:
    """The bare transformer under any head: no logits are computed (they are not needed)."""
    base = getattr(model, "base_model", None)
    return base if isinstance(base, torch.nn.Module) else model


def run_forward(module: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, device) -> None:
    kwargs = {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}
    if getattr(getattr(module, "config", None), "use_cache", None) is not None:
        kwargs["use_cache"] = False
    module(**kwargs)


def measure_text(
    model: torch.nn.Module,
    tokenizer,
    data: str = "auto",
    *,
    tokens: int = 65536,
    seq_len: int = 512,
    batch_size: int = 4,
    position: str = "last",
    max_n: int | None = None,
    device=None,
    on_batch: Callable[[int, int], None] | None = None,
    on_start: Callable[[], None] | None = None,
    identity_tokens: int = 1024,
    probes: int = 4,
) -> tuple[AngularResult, TokenisedData, str]:
    """`measure` on text read by `load_texts(data)`: one document per row, up to `tokens` tokens.

    `on_start()` is called once the text is read and tokenised, before the first forward pass.
    Returns the result, what was tokenised (check `.exhausted`) and the data's label.
    """
    check_options(tokens=tokens, seq_len=seq_len, batch_size=batch_size, position=position)
    docs, label = load_texts(data)
    tokenised = tokenise_docs(tokenizer, docs, seq_len=seq_len, budget=tokens)
    vectors = len(tokenised.sequences) if position == "last" else tokenised.tokens
    if vectors < MIN_VECTORS:
        per = "one per document (--token-position last)" if position == "last" else "one per token"
        raise DepthcurseError(f"--tokens {tokens} gives {vectors} token vector{'s' if vectors != 1 else ''} of {label}, {per}: every angular distance is a "
                              f"mean over them, and fewer than {MIN_VECTORS} make a heatmap of noise; give more --tokens"
                              + (" or --token-position all" if position == "last" else ""))
    batches = make_batches(tokenised.sequences, batch_size, pad_id_of(tokenizer))
    if on_start is not None:
        on_start()
    result = measure(model, batches, position=position, max_n=max_n, device=device, on_batch=on_batch, identity_tokens=identity_tokens, probes=probes)
    result.max_token_text = [tokenizer.decode([t]) if t >= 0 else "" for t in result.max_token]
    result.run = {"data": label, "tokens_requested": tokens, "tokens_seen": tokenised.tokens, "data_exhausted": tokenised.exhausted,
                  "seq_len": seq_len, "batch_size": batch_size, "token_position": position}
    return result, tokenised, label


def measure_loaded(loaded, data: str = "auto", **options) -> tuple[AngularResult, TokenisedData, str]:
    """`measure_text` on a model from `depthcurse.loading.load_model`, with the model's
    description and the environment recorded in the result's `run`. `seq_len=None` means 512,
    or the model's maximum if that is less; a longer one than the model accepts is refused."""
    started = time.perf_counter()
    options["seq_len"] = window_length(loaded.model, options.get("seq_len"))
    result, tokenised, label = measure_text(loaded.model, loaded.tokenizer, data, device=loaded.device, **options)
    result.run = {**loaded.describe(), **result.run, "wall_time_s": round(time.perf_counter() - started, 3), "environment": environment()}
    return result, tokenised, label


def measure(
    model: torch.nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    position: str = "last",
    max_n: int | None = None,
    device=None,
    on_batch: Callable[[int, int], None] | None = None,
    identity_tokens: int = 1024,
    probes: int = 4,
) -> AngularResult:
    """Angular distances and per-layer statistics of `model` over `batches` (ids, mask); with
    `identity_tokens` > 0, each block's identity distance and branch gains (`depthcurse.identity`) over the
    first that many tokens, with `probes` random probes each."""
    if position not in POSITIONS:
        raise DepthcurseError(f"unknown --token-position {position!r}: use last or all")
    if not batches:
        raise DepthcurseError("no data to measure")
    blocks = find_blocks(model).layers
    L = len(blocks)
    max_n = check_max_n(max_n, L)
    module = forward_module(model)
    if device is None:
        device = model.get_input_embeddings().weight.device
    total = sum(int(m.sum()) for _, m in batches)
    done = 0
    started = time.perf_counter()
    with torch.inference_mode(), StreamCapture(blocks, position) as cap:
        for ids, mask in batches:
            cap.start_batch(mask, ids)
            run_forward(module, ids, mask, device)
            cap.finish_batch()
            done += int(mask.sum())
            if on_batch is not None:
                on_batch(done, total)
    seconds = time.perf_counter() - started
    identity = None
    if identity_tokens > 0:
        identity = identity_distances(blocks, batches, lambda i, m: run_forward(module, i, m, device), tokens=identity_tokens, probes=probes).to_json()
    s = cap.sums
    pairwise = (s.angle_sum / s.samples).cpu().tolist()
    t = s.stat_tokens
    return AngularResult(
        num_layers=L,
        max_n=max_n,
        position=position,
        pairwise=pairwise,
        samples=s.samples,
        stat_tokens=t,
        block_influence=[1.0 - c / t for c in s.cos_sum],
        relative_update=[u / t for u in s.update_sum],
        norm=[v / t for v in s.norm_sum],
        variance=[v / t for v in s.var_sum],
        sequences=sum(int(m.shape[0]) for _, m in batches),
        seconds=seconds,
        variance_bulk=[v / t for v in s.bulk_var_sum],
        max_activation=s.max_abs,
        max_channel=s.max_channel,
        max_position=s.max_position,
        max_token=s.max_token,
        median_activation=[m / s.batches for m in s.median_sum],
        identity=identity,
    )
