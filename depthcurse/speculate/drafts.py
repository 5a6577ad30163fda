"""The built-in drafts: a model with some blocks skipped, and prompt lookup.

`LayerSkipDraft` is three drafts in one. With the checked model and some of its blocks skipped it is
the self-draft: the same module objects, every weight shared, run through `surgery.removed_layers`
for each of its forward passes and put back before the check, with a KV cache of its own that holds
the skipped model's keys and values. It may skip attention and MLP branches instead of whole blocks,
as Draft & Verify's and SWIFT's drafts do (`surgery.skipped_branches`: the branch does not run). With the last blocks skipped it is
early exit (LayerSkip's draft, without LayerSkip's training). With another model of the same
tokenizer and nothing skipped it is an assistant (transformers' assisted decoding).

`PromptLookupDraft` proposes the tokens that followed the first earlier occurrence of the
sequence's last n-gram (Saxena's prompt lookup decoding, as transformers'
`PromptLookupCandidateGenerator` finds it): no model, no cost but the search.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from depthcurse.kv_cache import cache_bytes
from depthcurse.speculate.draft import CachedModel, Draft, Proposal, Sampler, Stopwatch
from depthcurse.surgery import removed_layers, skipped_branches


class LayerSkipDraft(Draft):
    """`model` with blocks `skip` left out (block indices), or branches (`a3`, `m7`: block 3's
    attention, block 7's MLP, not run at all: `surgery.skipped_branches`), or nothing (the model
    itself, as an assistant); its own KV cache."""

    def __init__(self, model: torch.nn.Module, skip: tuple[int, ...] = (), name: str = "self-draft", shares_weights: bool = True,
                 watch: Stopwatch | None = None):
        super().__init__()
        self.model, self.skip, self.name, self.shares_weights = model, tuple(skip), name, shares_weights
        self.lm = CachedModel(model)
        self.watch = watch or Stopwatch(next(model.parameters()).device)

    def _skipping(self):
        if not self.skip:
            return contextlib.nullcontext()
        return skipped_branches(self.model, self.skip) if isinstance(self.skip[0], str) else removed_layers(self.model, self.skip)

    def check(self) -> None:
        with self._skipping():  # what cannot be skipped is refused on the way in
            pass

    def start(self, prompt: torch.Tensor) -> None:
        self.lm.reset()
        with self._skipping():
            _, seconds = self.watch(lambda: self.lm.feed(prompt))
        self.cost.prefill_seconds += seconds

    def propose(self, sequence: torch.Tensor, most: int, stop: Callable[[float], bool] | None, sampler: Sampler) -> Proposal:
        tokens, distributions = [], []
        pending = sequence[:, self.lm.length:]
        with self._skipping():
            for i in range(most):
                logits, seconds = self.watch(lambda pending=pending: self.lm.feed(pending))
                self.cost.calls += 1
                self.cost.tokens_fed += pending.shape[1]
                self.cost.seconds += seconds
                token, distribution = sampler.pick(logits[-1])
                tokens.append(token)
                distributions.append(distribution)
                if i + 1 == most:
                    break
                # Draft & Verify's confidence: the draft's own softmax (no temperature) at its token
                if stop is not None and stop(float(torch.softmax(logits[-1], -1)[token])):
                    break
                pending = torch.tensor([[token]], device=sequence.device)
        return Proposal(tokens, None if sampler.greedy else torch.stack(distributions))

    def agree(self, length: int) -> None:
        self.lm.keep(length)

    def cache_bytes(self) -> int:
        return cache_bytes(self.lm.cache)


class PromptLookupDraft(Draft):
    """Tokens copied from earlier in the sequence: the first earlier match of its last n-gram
    (n from `max_ngram` down to 1), and up to `most` tokens after it; none where nothing matches.
    transformers' `PromptLookupCandidateGenerator.get_candidates` (5.24) line for line, without its
    logits-processor filter (no processor here) and with its eos cut."""

    name = "prompt-lookup"

    def __init__(self, max_ngram: int = 2, eos: tuple[int, ...] = ()):
        super().__init__()
        if max_ngram < 1:
            raise ValueError(f"prompt lookup matches n-grams of 1 token or more, got {max_ngram}")
        self.max_ngram, self.eos = max_ngram, tuple(eos)

    def propose(self, sequence: torch.Tensor, most: int, stop: Callable[[float], bool] | None, sampler: Sampler) -> Proposal:
        ids = sequence[0]
        length = ids.shape[0]
        for n in range(min(self.max_ngram, length - 1), 0, -1):
            windows = ids.unfold(0, n, 1)
            matches = (windows == ids[-n:]).all(dim=1).nonzero(as_tuple=True)[0]
            for start in matches.tolist():
                begin, end = start + n, min(start + n + most, length)
                if begin < end:
                    chosen = ids[begin:end].tolist()
                    cut = next((i for i, t in enumerate(chosen) if t in self.eos), len(chosen))
                    return Proposal(chosen[:cut])
        return Proposal([])
