"""Perplexity on real text: the task that needs no benchmark, only text and a language-model head."""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F

from depthcurse.errors import DepthcurseError
from depthcurse.tasks.base import Score


class PerplexityTask:
    """Mean next-token loss over non-overlapping windows of `seq_len` tokens of real text.

    Documents are joined with the EOS token and cut into windows, so every window is full and
    no padding is needed; the first token of each window has no context and is not scored.
    """

    name = "ppl"
    metric = "loss"
    higher_is_better = False

    def __init__(self, tokenizer, texts: list[str], *, source: str, seq_len: int = 512, limit: int | None = 32, batch_size: int = 4, warn_short: bool = True):
        if seq_len < 2:
            raise DepthcurseError("--seq-len must be at least 2")
        self.source, self.seq_len, self.batch_size = source, seq_len, max(1, batch_size)
        want = None if limit is None else limit * seq_len
        eos = tokenizer.eos_token_id
        ids: list[int] = []
        for text in texts:
            ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
            if eos is not None:
                ids.append(eos)
            if want is not None and len(ids) >= want:
                break
        n_windows = len(ids) // seq_len
        if n_windows == 0:
            raise DepthcurseError(f"the text in {source} has {len(ids)} tokens, fewer than one window of --seq-len {seq_len}")
        if warn_short and limit is not None and n_windows < limit:  # a default limit only caps
            logging.getLogger("depthcurse").warning("%s holds only %d windows of %d tokens; using them all", source, n_windows, seq_len)
        n_windows = n_windows if limit is None else min(n_windows, limit)
        self.windows = torch.tensor(ids[: n_windows * seq_len]).view(n_windows, seq_len)

    def describe(self) -> dict:
        return {"task": "ppl", "data": self.source, "seq_len": self.seq_len, "windows": len(self.windows), "tokens": self.windows.numel()}

    @torch.inference_mode()
    def evaluate(self, model: torch.nn.Module) -> Score:
        device = model.get_input_embeddings().weight.device
        total, count = 0.0, 0
        for batch in self.windows.split(self.batch_size):
            batch = batch.to(device)
            logits = model(input_ids=batch, use_cache=False).logits[:, :-1]
            # fp32 for the loss: bf16 log-softmax over a 50k vocabulary loses the digits a sweep compares
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), batch[:, 1:].reshape(-1).to(logits.device), reduction="sum")
            total += loss.item()
            count += batch[:, 1:].numel()
        return self.score(total, count)

    def score(self, total: float, count: int) -> Score:
        """The score for a summed next-token loss `total` over `count` predicted tokens."""
        mean = total / count
        if not math.isfinite(mean):
            return Score({"loss": float("nan"), "ppl": float("nan")}, len(self.windows), {"tokens": count})
        return Score({"loss": mean, "ppl": math.exp(min(mean, 700.0))}, len(self.windows), {"tokens": count})
