"""What drafting costs on this machine, measured before a search chooses a draft for speed
(`select --objective speedup`): a decoding step of the whole model, the share of it one block takes,
one attention branch's and one MLP branch's apart, and a check of gamma + 1 tokens, each the median
of a few interleaved timings.

A draft without k blocks then costs c = 1 - k x (one block's share) of a step; one without a
attention and m MLP branches c = 1 - a x (an attention's share) - m x (an MLP's share): the two
kinds are priced apart, because they are not alike (in Qwen2.5-0.5B an MLP branch holds 7 times an
attention branch's weights). Its expected speedup at acceptance alpha is
`expected.expected_speedup(alpha, gamma, c, v)`. The objective a search minimises is the expected
time per token against decoding alone, 1 / that speedup.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from depthcurse.errors import DepthcurseError
from depthcurse.few_row_linear import few_row_kernel
from depthcurse.speculate.draft import CachedModel, Stopwatch
from depthcurse.speculate.expected import expected_speedup
from depthcurse.surgery import num_layers, removed_layers, skipped_branches


@dataclass(frozen=True)
class DraftCosts:
    gamma: int  # tokens a round drafts
    block_share: float  # of a decoding step, one block's
    verify: float  # a check of gamma + 1 tokens, in decoding steps
    step_s: float = 0.0  # a decoding step's seconds, as measured
    attention_share: float | None = None  # of a decoding step, one attention branch's (None: a record from before: half a block)
    mlp_share: float | None = None  # one MLP branch's
    check_linear: str = ""  # what computed the check's matmuls (`few_row_linear.status()`; "": a record from before issue 89)

    def saved(self, removal) -> float:
        """The share of a decoding step a draft without `removal` saves: its blocks (ints) at a block's
        share, its branches ("a3", "m7") each at its own kind's."""
        units = list(removal)
        if not units or not isinstance(units[0], str):
            return len(units) * self.block_share
        attention, mlp = (self.block_share / 2, self.block_share / 2) if self.attention_share is None else (self.attention_share, self.mlp_share)
        return sum(attention if u[0] == "a" else mlp for u in units)

    def c(self, removal) -> float:
        """A draft step's cost without `removal` (blocks or branches), in decoding steps (never below 0)."""
        return max(0.0, 1.0 - self.saved(removal))

    def speedup(self, agreement: float, removal) -> float:
        return expected_speedup(agreement, self.gamma, self.c(removal), self.verify)

    def time_per_token(self, agreement: float, removal) -> float:
        """What a search minimises: the expected time per token against decoding alone (1 / speedup)."""
        return 1.0 / self.speedup(agreement, removal)

    def summary(self) -> dict:
        return asdict(self)


@torch.inference_mode()
def measure_costs(model: torch.nn.Module, gamma: int, steps: int = 12, prompt_tokens: int = 32, seed: int = 0,
                  now: Callable[[], float] = time.perf_counter) -> DraftCosts:
    """The costs of drafting for `model` on this machine: `steps` decoding steps of the whole model,
    of the model without its later half of blocks, without their attention branches, without their
    MLP branches, and checks of gamma + 1 tokens, in turns after a random prompt of `prompt_tokens`
    tokens; each the median of its timings. (A model whose branches cannot be skipped on their own,
    Post-LN: its branches priced at half a block.)"""
    device = next(model.parameters()).device
    watch = Stopwatch(device, now)
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (1, prompt_tokens + gamma + 1), generator=torch.Generator().manual_seed(seed)).to(device)
    prompt, check = ids[:, :prompt_tokens], ids[:, prompt_tokens:]
    n = num_layers(model)
    half = tuple(range(n - n // 2, n))
    variants = {"whole": contextlib.nullcontext, "blocks": lambda: removed_layers(model, half)}
    try:
        with skipped_branches(model, [f"a{i}" for i in half] + [f"m{i}" for i in half]):
            pass
        variants["attention"] = lambda: skipped_branches(model, [f"a{i}" for i in half])
        variants["mlp"] = lambda: skipped_branches(model, [f"m{i}" for i in half])
    except DepthcurseError:
        pass
    with few_row_kernel(model) as linear:  # as speculate checks
        median = _medians(model, variants, prompt, check, steps, watch)
    whole = median["whole"]
    share = lambda name: max(0.0, (whole - median[name]) / len(half) / whole)  # noqa: E731
    return DraftCosts(gamma, share("blocks"), median["check"] / whole, whole,
                      share("attention") if "attention" in median else None, share("mlp") if "mlp" in median else None, linear)


def _medians(model, variants: dict, prompt: torch.Tensor, check: torch.Tensor, steps: int, watch: Stopwatch) -> dict[str, float]:
    """Each variant's decoding step and the whole model's check, in turns, the median of each."""
    prompt_tokens = prompt.shape[1]
    lms = {name: CachedModel(model) for name in variants}
    for name, lm in lms.items():
        with variants[name]():
            lm.feed(prompt)
    token = check[:, :1]
    times = {name: [] for name in [*variants, "check"]}
    for _ in range(steps + 1):  # the first round warms up, untimed
        for name in times:
            lm = lms["whole" if name == "check" else name]
            with (variants[name] if name != "check" else contextlib.nullcontext)():
                _, seconds = watch(lambda: lm.feed(check if name == "check" else token))
            lm.keep(prompt_tokens)
            times[name].append(seconds)
    return {name: statistics.median(t[1:]) for name, t in times.items()}
