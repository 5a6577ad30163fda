"""The contract a draft meets, and what the decoding loop and every draft share.

A draft proposes the next few tokens; the whole model checks them in one pass and keeps the longest
prefix it agrees with (`decoding`). What a draft is given: the sequence so far (prompt and every
token kept), how many tokens it may propose, when to stop early (`lengths`: a draft-length policy
sees each proposed token's confidence), and the `Sampler` (greedy, or temperature sampling, whose
draws a speculative check must see the draft's distribution of). What it gives: a `Proposal`, the
tokens and, for sampling, the distribution each was drawn from (None for a draft that does not draw,
such as prompt lookup: its tokens are certain, a one-hot distribution). After the check it is told
how much of the sequence it saw still stands (`agree`), so that a draft with a KV cache rolls it
back to the accepted prefix. It counts its own forward passes and their seconds (`DraftCost`),
which is what its cost per token, c, is measured from.

`drafts` holds the built-in drafts: the model with some blocks skipped (the self-draft, early exit,
an assistant model of the same tokenizer with none skipped) and prompt lookup. A draft of one's own
subclasses `Draft`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from depthcurse.kv_cache import cache_keyword, cache_length, cache_of, crop, record_past


@dataclass
class Proposal:
    tokens: list[int]
    # [len(tokens), vocab]: the distribution each token was drawn from (sampling); None: each token certain
    distributions: torch.Tensor | None = None


@dataclass
class DraftCost:
    """A draft's forward passes after its prefill, the tokens they fed, and their seconds; its prefill apart."""

    calls: int = 0
    tokens_fed: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0


class Draft:
    """What proposes tokens for the whole model to check. Subclass it and give `start`, `propose` and
    `agree`; `name` says what it is in tables."""

    name: str = ""
    shares_weights: bool = False  # the draft runs the checked model's own weights (no copy, no second model)

    def __init__(self):
        self.cost = DraftCost()

    def check(self) -> None:
        """One clear error, before any work, where this draft cannot run on its model."""

    def start(self, prompt: torch.Tensor) -> None:
        """A new sequence begins with `prompt` ([1, P]): forget the last one, prefill on this one."""

    def propose(self, sequence: torch.Tensor, most: int, stop: Callable[[float], bool] | None, sampler: "Sampler") -> Proposal:
        """At most `most` tokens to follow `sequence` ([1, L]), ending early where `stop(confidence)`
        says so after a token (confidence: the draft's probability of the token it proposed; `stop`
        None: never early)."""
        raise NotImplementedError

    def agree(self, length: int) -> None:
        """The first `length` tokens of the sequence it last saw, with its proposal, still stand."""

    def cache_bytes(self) -> int:
        """The bytes of the draft's own KV cache now (0: it keeps none)."""
        return 0


@dataclass
class Sampler:
    """How the next token is picked from logits: the largest (greedy, temperature 0), or drawn from
    softmax(logits / temperature) with `generator` (no top-k, no top-p: the distribution itself)."""

    temperature: float = 0.0
    generator: torch.Generator | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def distribution(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution the next token is drawn from (greedy: the softmax of the logits themselves)."""
        logits = logits.float()
        return torch.softmax(logits if self.greedy else logits / self.temperature, dim=-1)

    def draw(self, distribution: torch.Tensor) -> int:
        return int(torch.multinomial(distribution.cpu(), 1, generator=self.generator))

    def pick(self, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """The next token and the distribution it was drawn from (greedy: the largest logit, as
        `model.generate` takes it, the first of equal ones, and no distribution)."""
        if self.greedy:
            return int(logits.argmax(-1)), None
        distribution = self.distribution(logits)
        return self.draw(distribution), distribution


class Stopwatch:
    """Seconds of a call: wall time, after the GPU's queue has drained where there is one (a forward
    pass on a GPU returns before its work is done)."""

    def __init__(self, device: torch.device, now: Callable[[], float] = time.perf_counter):
        self.cuda, self.now = torch.device(device).type == "cuda", now

    def __call__(self, fn: Callable):
        """(fn(), its seconds)."""
        if self.cuda:
            torch.cuda.synchronize()
        started = self.now()
        out = fn()
        if self.cuda:
            torch.cuda.synchronize()
        return out, self.now() - started


@dataclass
class CachedModel:
    """A causal LM with a KV cache of its own: `feed` runs new tokens after those cached and gives
    their logits ([tokens, vocab], in fp32); `keep` cuts the cache back."""

    model: torch.nn.Module
    cache: object = None
    keyword: str = field(init=False)

    def __post_init__(self):
        self.keyword = cache_keyword(self.model)

    @property
    def length(self) -> int:
        return cache_length(self.cache)

    def reset(self) -> None:
        self.cache = None

    @torch.inference_mode()
    def feed(self, ids: torch.Tensor) -> torch.Tensor:
        kwargs = {self.keyword: self.cache} if self.cache is not None else {}
        out = self.model(input_ids=ids, use_cache=True, **kwargs)
        if self.cache is None:  # after the prefill (which drops what a window no longer sees): keep what a cut may need
            record_past(cache_of(out))
        self.cache = cache_of(out)
        return out.logits[0].float()

    def keep(self, length: int) -> None:
        if self.cache is not None:
            crop(self.cache, length)
