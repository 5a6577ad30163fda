"""What `--granularity` names: one meaning per value, in every command that takes it.

Each command takes the values its removals can be (prune sweeps one branch kind in turn; select
searches k of them; heal heals whole blocks); a value it does not take is refused in one line that
says what the value means and which command takes it. docs/commands.md's vocabulary lists them.
"""

from __future__ import annotations

from depthcurse.errors import DepthcurseError

GRANULARITY_MEANINGS = {
    "layer": "whole blocks",
    "attn": "attention branches only, the residual stream passing them by",
    "mlp": "MLP branches only, the residual stream passing them by",
    "sub-block": "k attention and k MLP branches, chosen apart: EvoPress's space",
    "branch": "k branches of either kind: SWIFT's and Draft & Verify's space",
}
GRANULARITIES_TAKEN = {"prune": ("layer", "attn", "mlp"), "select": ("layer", "sub-block", "branch"), "heal": ("layer",)}


def granularity_help(command: str) -> str:
    """`--granularity`'s help for `command`: the values it takes, each with its one meaning."""
    return "What a removal takes: " + "; ".join(f"{v} ({GRANULARITY_MEANINGS[v]})" for v in GRANULARITIES_TAKEN[command]) + "."


def check_granularity_taken(command: str, value: str) -> None:
    """One line for a value `command` does not take: unknown to every command, or another's."""
    taken = GRANULARITIES_TAKEN[command]
    if value in taken:
        return
    if value not in GRANULARITY_MEANINGS:
        raise DepthcurseError(f"unknown --granularity {value!r}: {command} takes {', '.join(taken)}")
    others = [c for c, values in GRANULARITIES_TAKEN.items() if value in values]
    raise DepthcurseError(f"{command} does not take --granularity {value} ({GRANULARITY_MEANINGS[value]}; {' and '.join(others)} "
                          f"{'takes' if len(others) == 1 else 'take'} it): {command} takes {', '.join(taken)}")
