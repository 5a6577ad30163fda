"""Plain decoding and speculative decoding, one prompt at a time, with what each step cost.

`plain` is the whole model's decoding with its KV cache: the prompt prefilled, then one token per
forward pass, picked as `model.generate` picks it (greedy: the largest logit; sampling: drawn from
softmax(logits / temperature)), stopping at an end-of-sequence token or after `max_new_tokens`.

`speculative` emits the same tokens (greedy) or tokens from the same distribution (sampling) with a
draft. The whole model prefills the prompt and picks the first token itself (Draft & Verify does
the same); then each round the draft proposes up to gamma tokens (`lengths`: fixed, or a policy),
the whole model runs the last kept token and the proposal in one pass (gamma + 1 positions: the
check), and keeps:
- greedy: the proposal up to its first token that differs from the whole model's choice, then the
  whole model's own choice there (a correction, or after a full acceptance the bonus token);
- sampling (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023): each proposed token x in turn with
  probability min(1, p(x) / q(x)), p the whole model's distribution and q the draft's; at the
  first rejection a token drawn from the residual norm(max(0, p - q)), after a full acceptance the
  bonus drawn from p. A draft that does not draw (prompt lookup) has a certain q: one-hot on its
  token. The emitted tokens are distributed as the whole model's, whatever the draft.
Both KV caches are then cut back to the kept prefix: the whole model's to every kept token but
the last, the draft's to what it saw that still stands.

Each `Generation` counts the forward passes and their seconds (the check's, the draft's, the
prefills), from which `summary` measures the draft's cost c and the check's v per decoding step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from depthcurse.kv_cache import cache_bytes
from depthcurse.speculate.draft import CachedModel, Draft, Proposal, Sampler, Stopwatch
from depthcurse.speculate.lengths import DraftLength


@dataclass(frozen=True)
class DecodeSettings:
    max_new_tokens: int = 64
    eos: tuple[int, ...] = ()  # tokens that end a generation (kept in it), as `model.generate` stops
    temperature: float = 0.0  # 0: greedy
    seed: int = 0  # of the sampling generator (each prompt its own: the caller passes a seed per prompt)

    def sampler(self) -> Sampler:
        generator = torch.Generator().manual_seed(self.seed) if self.temperature > 0 else None
        return Sampler(self.temperature, generator)


@dataclass
class Generation:
    tokens: list[int]
    prefill_s: float  # the whole model's prefill of the prompt (it picks the first token)
    decode_s: float  # from after the prefills to the last token
    steps: int  # forward passes of the whole model after its prefill (plain: one per token; speculative: the checks)
    step_s: float  # their seconds
    # speculative decoding only
    rounds: list[list[int]] = field(default_factory=list)  # [drafted, accepted] of every round with a proposal
    draft_calls: int = 0
    draft_tokens_fed: int = 0
    draft_s: float = 0.0
    draft_prefill_s: float = 0.0
    draft_cache_bytes: int = 0  # the draft's own KV cache at the end (its extra memory)
    cache_bytes: int = 0  # the whole model's KV cache at the end

    @property
    def decoded(self) -> int:
        """Tokens after the first (which the prefill picks): what the decoding time bought."""
        return max(0, len(self.tokens) - 1)


def _ended(tokens: list[int], settings: DecodeSettings) -> bool:
    return len(tokens) >= settings.max_new_tokens or (bool(tokens) and tokens[-1] in settings.eos)


def _cut(new: list[int], room: int, eos: tuple[int, ...]) -> list[int]:
    """`new` up to `room` tokens and through its first end-of-sequence token."""
    new = new[:room]
    end = next((i for i, t in enumerate(new) if t in eos), None)
    return new if end is None else new[: end + 1]


@torch.inference_mode()
def plain(model: torch.nn.Module, prompt: torch.Tensor, settings: DecodeSettings, watch: Stopwatch) -> Generation:
    """The whole model alone: prefill, then a token per forward pass."""
    sampler, lm = settings.sampler(), CachedModel(model)
    logits, prefill_s = watch(lambda: lm.feed(prompt))
    tokens = [sampler.pick(logits[-1])[0]]
    started, steps, step_s = watch.now(), 0, 0.0
    while not _ended(tokens, settings):
        token = torch.tensor([[tokens[-1]]], device=prompt.device)
        logits, seconds = watch(lambda token=token: lm.feed(token))
        steps, step_s = steps + 1, step_s + seconds
        tokens.append(sampler.pick(logits[-1])[0])
    return Generation(tokens, prefill_s, watch.now() - started, steps, step_s, cache_bytes=cache_bytes(lm.cache))


def accept_greedy(logits: torch.Tensor, proposed: list[int]) -> tuple[list[int], int]:
    """The kept tokens and how many of the proposal they take: the proposal up to its first token
    that is not the whole model's choice, then the whole model's choice there."""
    choices = logits.argmax(-1).tolist()
    n = 0
    while n < len(proposed) and proposed[n] == choices[n]:
        n += 1
    return proposed[:n] + [choices[n]], n


def acceptance_probability(p: torch.Tensor, q: torch.Tensor | None, token: int) -> float:
    """min(1, p(x) / q(x)) for proposed token x (q None: a certain proposal, q(x) = 1)."""
    qx = 1.0 if q is None else float(q[token])
    return min(1.0, float(p[token]) / qx) if qx > 0 else 1.0


def residual(p: torch.Tensor, q: torch.Tensor | None, token: int) -> torch.Tensor:
    """norm(max(0, p - q)): what a rejection draws from (q None: one-hot on `token`)."""
    if q is None:
        q = torch.zeros_like(p)
        q[token] = 1.0
    rest = (p - q).clamp(min=0)
    total = rest.sum()
    # p = q leaves nothing; a rejection then has probability 0 and never asks (guarded all the same)
    return rest / total if total > 0 else p


def accept_sampled(p: torch.Tensor, q: torch.Tensor | None, proposed: list[int], sampler: Sampler) -> tuple[list[int], int]:
    """Leviathan et al.'s rule: `p` [m + 1, vocab] the whole model's distributions at the proposal's
    positions and after it, `q` [m, vocab] the draft's (None: certain)."""
    for i, token in enumerate(proposed):
        qi = None if q is None else q[i]
        u = float(torch.rand(1, generator=sampler.generator))
        if u >= acceptance_probability(p[i], qi, token):
            return proposed[:i] + [sampler.draw(residual(p[i], qi, token))], i
    return proposed + [sampler.draw(p[len(proposed)])], len(proposed)


@torch.inference_mode()
def speculative(model: torch.nn.Module, draft: Draft, prompt: torch.Tensor, settings: DecodeSettings, length: DraftLength,
                watch: Stopwatch) -> Generation:
    """The whole model's tokens, proposed by `draft` and checked a round at a time."""
    sampler, lm = settings.sampler(), CachedModel(model)
    before = (draft.cost.calls, draft.cost.tokens_fed, draft.cost.seconds, draft.cost.prefill_seconds)
    logits, prefill_s = watch(lambda: lm.feed(prompt))
    tokens = [sampler.pick(logits[-1])[0]]
    draft.start(prompt)
    sequence = torch.cat([prompt, torch.tensor([tokens], device=prompt.device)], dim=1)
    started, steps, step_s, rounds = watch.now(), 0, 0.0, []
    while not _ended(tokens, settings):
        room = settings.max_new_tokens - len(tokens)
        most = min(length.most(), room - 1)  # the check adds one token of its own
        proposal = draft.propose(sequence, most, length.stop if length.reads_confidence else None, sampler) if most > 0 else Proposal([])
        proposed = proposal.tokens[:most]
        check = torch.tensor([[tokens[-1], *proposed]], device=prompt.device)
        logits, seconds = watch(lambda check=check: lm.feed(check))
        steps, step_s = steps + 1, step_s + seconds
        if sampler.greedy:
            new, accepted = accept_greedy(logits, proposed)
        else:
            q = None if proposal.distributions is None else proposal.distributions[: len(proposed)]
            new, accepted = accept_sampled(sampler.distribution(logits), q, proposed, sampler)
        agreed = sequence.shape[1] + accepted  # the draft saw the sequence and its proposal; this much of it stands
        kept = _cut(new, room, settings.eos)
        if proposed:
            # an end-of-sequence token among the accepted ends the generation there: the proposal after it
            # never stands, so the round counts the tokens through it, all accepted
            drafted, accepted = (len(proposed), accepted) if len(kept) == len(new) else (len(kept), len(kept))
            rounds.append([drafted, accepted])
            length.update(accepted, drafted)
        new = kept
        tokens += new
        sequence = torch.cat([sequence, torch.tensor([new], device=prompt.device)], dim=1)
        lm.keep(sequence.shape[1] - 1)
        draft.agree(min(agreed, sequence.shape[1]))
    decode_s = watch.now() - started
    cost = draft.cost
    return Generation(tokens, prefill_s, decode_s, steps, step_s, rounds, cost.calls - before[0], cost.tokens_fed - before[1],
                      cost.seconds - before[2], cost.prefill_seconds - before[3], draft.cache_bytes(), cache_bytes(lm.cache))
