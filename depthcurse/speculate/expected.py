"""What speculative decoding can buy, from three numbers: the acceptance rate, the draft length and
the draft's cost.

Leviathan, Kalman and Matias (2023), Section 3: when each drafted token is accepted with probability
alpha, independently of the others, a round that drafts gamma tokens and checks them in one pass of
the whole model emits (1 - alpha^(gamma+1)) / (1 - alpha) tokens on average (the accepted ones, and
one more from the check: a correction, or the bonus token after a full acceptance). The round
costs gamma draft steps of c each (in units of one decoding step of the whole model) and one check
of gamma + 1 tokens; Leviathan's Theorem 3.8 prices the check at one step, so that the expected
speedup is E[tokens] / (gamma c + 1). Here the check's own cost `verify` (v, in steps) is a
parameter, since on a machine where checking gamma + 1 tokens costs more than one step (a CPU's
matrix products at batch 1) it is the difference between a draft that pays and one that does not.

From these follow the ceiling (every token accepted: (gamma + 1) / (gamma c + v)), and the
break-even acceptance: the alpha below which drafting is slower than decoding alone.

Pure functions of numbers (no torch): `tests/test_speculate.py` checks each against values worked
out by hand.
"""

from __future__ import annotations

# Bisection halves the interval of alpha each step: 60 steps leave it below 1e-18, past double precision.
BISECTION_STEPS = 60


def expected_tokens(alpha: float, gamma: float) -> float:
    """Tokens a round emits on average: 1 + alpha + ... + alpha^gamma = (1 - alpha^(gamma+1)) / (1 - alpha),
    gamma + 1 at alpha = 1. The closed form also takes a mean draft length (an adaptive policy's)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"an acceptance rate lies in [0, 1], got {alpha}")
    if gamma < 0:
        raise ValueError(f"a draft length is 0 or more, got {gamma}")
    return gamma + 1.0 if alpha == 1.0 else (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, gamma: float, c: float, verify: float = 1.0) -> float:
    """Tokens per unit of time against plain decoding: E[tokens] / (gamma c + v), time in decoding steps."""
    return expected_tokens(alpha, gamma) / (gamma * c + verify)


def ceiling(gamma: float, c: float, verify: float = 1.0) -> float:
    """The speedup when every drafted token is accepted: (gamma + 1) / (gamma c + v)."""
    return expected_speedup(1.0, gamma, c, verify)


def break_even(gamma: float, c: float, verify: float = 1.0) -> float | None:
    """The acceptance rate at which drafting gamma tokens of cost c, checked at cost v, is as fast as
    decoding alone (speedup 1); 0.0 where even alpha = 0 pays (a check cheaper than a step, free
    drafts), None where even alpha = 1 does not. The speedup grows with alpha, so bisection finds it."""
    if expected_speedup(0.0, gamma, c, verify) >= 1.0:
        return 0.0
    if ceiling(gamma, c, verify) < 1.0:
        return None
    low, high = 0.0, 1.0
    for _ in range(BISECTION_STEPS):
        middle = (low + high) / 2
        if expected_speedup(middle, gamma, c, verify) < 1.0:
            low = middle
        else:
            high = middle
    return high


def acceptance_rate(accepted: int, rejections: int) -> float | None:
    """The maximum-likelihood acceptance rate of the i.i.d. model from a run's rounds: each drafted
    token is a trial up to and including the first rejected one, so the trials are the accepted
    tokens plus one per round that ended in a rejection (None: no trial)."""
    trials = accepted + rejections
    return accepted / trials if trials else None


def largest_cost(alpha: float, gamma: float, verify: float = 1.0) -> float:
    """The most a draft step may cost (in decoding steps) for drafting gamma tokens at acceptance alpha
    to pay: c at which the expected speedup is 1 (negative: nothing pays, the check alone costs more)."""
    if gamma <= 0:
        raise ValueError(f"a draft proposes at least one token, got gamma = {gamma}")
    return (expected_tokens(alpha, gamma) - verify) / gamma


def best_gamma(alpha: float, c: float, verify: float = 1.0, most: int = 64) -> tuple[int, float]:
    """The draft length in 1..`most` that maximises the expected speedup, and that speedup."""
    if most < 1:
        raise ValueError(f"the longest draft considered is at least 1, got {most}")
    speedups = [(expected_speedup(alpha, g, c, verify), -g) for g in range(1, most + 1)]
    best, negative_gamma = max(speedups)
    return -negative_gamma, best

