"""What drafting costs on this machine, measured before a search chooses a draft for speed
(`select --objective speedup`): a decoding step of the whole model, the share of it one block takes,
and a check of gamma + 1 tokens, each the median of a few interleaved timings.

A draft without k blocks then costs c(k) = 1 - k x (one block's share) of a step, and its expected
speedup at acceptance alpha is `expected.expected_speedup(alpha, gamma, c(k), v)`. The objective a
search minimises is the expected time per token against decoding alone, 1 / that speedup.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from depthcurse.speculate.draft import CachedModel, Stopwatch
from depthcurse.speculate.expected import expected_speedup
from depthcurse.surgery import num_layers, removed_layers


@dataclass(frozen=True)
class DraftCosts:
    gamma: int  # tokens a round drafts
    block_share: float  # of a decoding step, one block's
    verify: float  # a check of gamma + 1 tokens, in decoding steps
    step_s: float = 0.0  # a decoding step's seconds, as measured

    def c(self, blocks: float) -> float:
        """A draft step's cost without `blocks` blocks, in decoding steps (never below 0)."""
        return max(0.0, 1.0 - blocks * self.block_share)

    def speedup(self, agreement: float, blocks: float) -> float:
        return expected_speedup(agreement, self.gamma, self.c(blocks), self.verify)

    def time_per_token(self, agreement: float, blocks: float) -> float:
        """What a search minimises: the expected time per token against decoding alone (1 / speedup)."""
        return 1.0 / self.speedup(agreement, blocks)

    def summary(self) -> dict:
        return asdict(self)


@torch.inference_mode()
def measure_costs(model: torch.nn.Module, gamma: int, steps: int = 12, prompt_tokens: int = 32, seed: int = 0,
                  now: Callable[[], float] = time.perf_counter) -> DraftCosts:
    """The costs of drafting for `model` on this machine: `steps` decoding steps of the whole model,
    of the model without its later half of blocks, and checks of gamma + 1 tokens, in turns after a
    random prompt of `prompt_tokens` tokens; each the median of its timings."""
    device = next(model.parameters()).device
    watch = Stopwatch(device, now)
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (1, prompt_tokens + gamma + 1), generator=torch.Generator().manual_seed(seed)).to(device)
    prompt, check = ids[:, :prompt_tokens], ids[:, prompt_tokens:]
    n = num_layers(model)
    half = tuple(range(n - n // 2, n))
    whole_lm, part_lm = CachedModel(model), CachedModel(model)
    whole_lm.feed(prompt)
    with removed_layers(model, half):
        part_lm.feed(prompt)
    token = check[:, :1]
    times = {"whole": [], "part": [], "check": []}
    for _ in range(steps + 1):  # the first round warms up, untimed
        for name in times:
            lm = part_lm if name == "part" else whole_lm
            feed = check if name == "check" else token
            if name == "part":
                with removed_layers(model, half):
                    _, seconds = watch(lambda: lm.feed(feed))
            else:
                _, seconds = watch(lambda: lm.feed(feed))
            lm.keep(prompt_tokens)
            times[name].append(seconds)
    whole, part, checked = (statistics.median(times[k][1:]) for k in ("whole", "part", "check"))
    return DraftCosts(gamma, max(0.0, (whole - part) / len(half) / whole), checked / whole, whole)
