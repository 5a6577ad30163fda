"""The word a comparison prints, decided by its interval and nothing else: a finding quotes the word
the tool printed, and `tests/test_findings.py` checks every finding in docs/ against this module.

- a difference (a - b): "more" where its interval lies above 0, "less" where below, "cannot tell"
  where it holds 0 or there is none (other words for the two sides where a figure has its own:
  "closer" / "further" for a distance, "earlier" / "later" for a layer);
- an agreement with an expected sign (a correlation): "agrees" where the interval leaves 0 out on
  the expected side, "opposite" on the other, "cannot tell" where it holds 0.

An interval that touches 0 holds it: [0.0, 6.6] cannot tell.
"""

from __future__ import annotations

CANNOT_TELL = "cannot tell"


def difference_word(interval: list[float] | tuple[float, float] | None, above: str = "more", below: str = "less") -> str:
    """`above` where the interval of a difference lies wholly above 0, `below` wholly below, else "cannot tell"."""
    if interval is None:
        return CANNOT_TELL
    low, high = interval
    if low > 0:
        return above
    if high < 0:
        return below
    return CANNOT_TELL


def agreement_word(interval: list[float] | tuple[float, float] | None, expected_sign: int) -> str:
    """"agrees" where the interval leaves 0 out on the side of `expected_sign` (+1 or -1), "opposite"
    on the other, "cannot tell" where it holds 0 or there is none."""
    if expected_sign not in (1, -1):
        raise ValueError(f"an expected sign is +1 or -1, got {expected_sign}")
    word = difference_word(interval)
    if word == CANNOT_TELL:
        return word
    return "agrees" if (word == "more") == (expected_sign == 1) else "opposite"
