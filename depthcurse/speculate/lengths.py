"""How many tokens a draft proposes each round: a fixed number, or a policy that adapts.

- `fixed`: gamma tokens every round (Leviathan et al.'s setting, where the expected speedup holds).
- `confidence`: Draft & Verify's adaptive stop (Zhang et al., ACL 2024; dilab-zju/self-speculative-decoding
  @ 688db8b, `decoding.py`, `exact_self_speculative_generate`): drafting stops after a token whose
  probability under the draft falls below a threshold, at most `max_draft` tokens; after each check
  the threshold moves by `step` towards more drafting when the smoothed share of drafted tokens
  accepted (`matchness`) is at least `target` and the draft stopped early, towards less when it is
  below, itself smoothed by `momentum`. Their defaults: max 8, threshold 0.8, auto_parameters
  [1, 0.5, 0.9, 1e-2, 0.9].
- `heuristic`: transformers' `num_assistant_tokens_schedule="heuristic"`
  (`AssistedCandidateGenerator.update_candidate_strategy`): 2 more tokens after a round whose every
  token was accepted, 1 fewer (at least 1) otherwise, from `start` (5: transformers 4.x's default
  num_assistant_tokens when this schedule was its default).

A policy is asked `most()` before a round, `stop(confidence)` after each drafted token (where it
`reads_confidence`), and told
`update(accepted, drafted)` after the check.
"""

from __future__ import annotations

from dataclasses import dataclass

from depthcurse.errors import DepthcurseError

POLICIES = ("fixed", "confidence", "heuristic")


class DraftLength:
    name = ""
    reads_confidence = False  # whether `stop` is asked after each drafted token (the draft's softmax costs a little)

    def most(self) -> int:
        raise NotImplementedError

    def stop(self, confidence: float) -> bool:
        return False

    def update(self, accepted: int, drafted: int) -> None:
        """After a check: `accepted` of the `drafted` tokens kept."""


@dataclass
class Fixed(DraftLength):
    gamma: int
    name = "fixed"

    def most(self) -> int:
        return self.gamma


@dataclass
class Confidence(DraftLength):
    max_draft: int = 8
    threshold: float = 0.8
    every: int = 1  # auto_parameters[0]: checks between updates
    smoothing: float = 0.5  # auto_parameters[1]: of the matchness
    target: float = 0.9  # auto_parameters[2]
    step: float = 1e-2  # auto_parameters[3]
    momentum: float = 0.9  # auto_parameters[4]: of the threshold
    name = "confidence"
    reads_confidence = True

    def __post_init__(self):
        self.matchness, self.checks = 0.0, 0

    def most(self) -> int:
        return self.max_draft

    def stop(self, confidence: float) -> bool:
        return confidence < self.threshold

    def update(self, accepted: int, drafted: int) -> None:
        if drafted == 0:
            return
        self.checks += 1
        if self.checks % self.every:
            return
        self.matchness = self.smoothing * self.matchness + (1 - self.smoothing) * accepted / drafted
        if self.matchness < self.target:
            new = self.threshold + self.step
        else:
            new = self.threshold if drafted == self.max_draft else self.threshold - self.step
        self.threshold = self.momentum * self.threshold + (1 - self.momentum) * new


@dataclass
class Heuristic(DraftLength):
    start: int = 5
    name = "heuristic"

    def __post_init__(self):
        self.gamma = self.start

    def most(self) -> int:
        return self.gamma

    def update(self, accepted: int, drafted: int) -> None:
        self.gamma = self.gamma + 2 if accepted == drafted else max(1, self.gamma - 1)


def build_length(policy: str, draft_tokens: int) -> DraftLength:
    """A fresh policy (each prompt starts its own): `draft_tokens` is gamma for `fixed`, the most a
    round drafts for `confidence`, the first round's length for `heuristic`."""
    if policy not in POLICIES:
        raise DepthcurseError(f"unknown --draft-length {policy!r}: use {', '.join(POLICIES)}")
    if draft_tokens < 1:
        raise DepthcurseError(f"--draft-tokens must be at least 1, got {draft_tokens}")
    return {"fixed": Fixed, "confidence": Confidence, "heuristic": Heuristic}[policy](draft_tokens)
