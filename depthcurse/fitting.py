"""How many tokens a linear map is fitted on, against what it has to determine.

A map from a stream `width` wide (with an intercept: `width + 1` inputs) to another is one least-squares
problem per output dimension, determined only by at least as many fitting tokens as inputs. On fewer,
the fit is exact on the fitting tokens whatever it learnt, and the solution is the minimum-norm one (a
ridge's, shrunk toward its anchor): mapping a model's stream onto itself from 64 tokens of a 576-wide
stream gives a diagonal R^2 of 0.29-0.81 (issue 87). `depth-map` and heal's linear maps say so before any
work, and refuse below the share of the inputs a user accepts (`--min-fit-ratio`, 1 by default).
"""

from __future__ import annotations

import math
from typing import Callable

from depthcurse.errors import DepthcurseError

MIN_FIT_RATIO = 1.0  # fitting tokens per input, at least, unless a user accepts fewer
DEFAULT_FIT_RATIO = 2.0  # what a default number of fitting windows aims at: twice the inputs


def needed(inputs: int, ratio: float) -> int:
    """The fewest fitting tokens for `ratio` of `inputs`."""
    return math.ceil(ratio * inputs)


def check_fit(tokens: int, inputs: int, *, min_ratio: float, what: str, fix: Callable[[int], str], accept: Callable[[str], str],
              solution: str = "the minimum-norm map") -> str | None:
    """None where `tokens` determine a map of `inputs` inputs; where they do not, a note saying what the
    map then is (`solution`); one line refusing where they are fewer than `min_ratio` x `inputs`, naming
    what fits (`fix(tokens needed)`) and the setting that would accept these (`accept(ratio)`)."""
    if not min_ratio >= 0:
        raise DepthcurseError(f"{accept(str(min_ratio))}: the ratio must be 0 or more")
    if tokens < needed(inputs, min_ratio):
        ratio = f"{math.floor(100 * tokens / inputs) / 100:g}"
        raise DepthcurseError(f"{what} is fitted on {tokens:,} tokens, fewer than {min_ratio:g} x its {inputs:,} inputs: under-determined, it would be "
                              f"{solution}, which cannot recover even the identity; {fix(needed(inputs, min_ratio))}, or accept it with {accept(ratio)}")
    if tokens < inputs:
        return (f"{what} is fitted on {tokens:,} tokens, fewer than its {inputs:,} inputs: under-determined, it is {solution}, "
                f"which cannot recover even the identity (accepted by {accept(f'{min_ratio:g}')})")
    return None
