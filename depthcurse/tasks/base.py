"""The contract every task meets, as lm-eval's `api/` is for its tasks: the sweep, the engine and
the reports depend on this, never on a particular task.

A task is built once (data loaded, prompts tokenised where possible) and then `evaluate`d on
many variants of the same in-memory model. Nothing may be cached across calls in a way that
could hand a pruned model the unpruned model's answers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class Score:
    """One evaluation of one model variant."""

    metrics: dict[str, float]  # e.g. {"acc": 0.41, "acc_norm": 0.45} or {"loss": 3.1, "ppl": 22.2}
    examples: int
    details: dict = field(default_factory=dict)  # per-subject accuracies, token counts...


class Task(Protocol):
    """What `prune` measures a model variant on."""

    name: str
    metric: str  # the headline metric in `Score.metrics`
    higher_is_better: bool

    def describe(self) -> dict: ...

    def evaluate(self, model: torch.nn.Module) -> Score: ...
