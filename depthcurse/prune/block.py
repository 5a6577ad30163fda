"""`prune --block N`: the N contiguous layers angular distance picks (Gromov et al.), against the
N deepest layers before the final one, the rule of thumb the heuristic has to beat."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from depthcurse.angular import AngularResult, BlockChoice, load_angular, measure_loaded, write_angular
from depthcurse.angular.result import ANGULAR_JSON
from depthcurse.errors import DepthcurseError
from depthcurse.surgery import num_layers

# The angular pass `--block` makes when it has none to reuse: Gromov et al.'s last-token distance
# (rows of 512 tokens, or the model's maximum if less).
BLOCK_PASS = {"seq_len": None, "batch_size": 4, "position": "last", "identity_tokens": 0}  # the blocks' Jacobians are not needed to pick one


def block_choices(loaded, n: int, out_dir: Path, *, angular: Path | None = None, data: str = "auto", tokens: int = 65536,
                  measure: Callable[..., AngularResult] | None = None) -> list[BlockChoice]:
    """The angular pick and the deepest block of `n` layers for the model `loaded` (the angular
    distances from `block_pass`)."""
    L = num_layers(loaded.model)
    if not 1 <= n <= L - 1:
        raise DepthcurseError(f"--block {n} is out of range: the model has {L} layers (use 1-{L - 1}; the final layer is kept)")
    return block_pass(loaded, out_dir, angular=angular, data=data, tokens=tokens, measure=measure).block_choices(n)


def block_pass(loaded, out_dir: Path, *, angular: Path | None = None, data: str = "auto", tokens: int = 65536,
               measure: Callable[..., AngularResult] | None = None) -> AngularResult:
    """The angular distances that pick blocks: from `angular` (an `angular-distance` result), else
    from this results folder's own earlier pass on the same text, else from a new pass:
    `measure(data=, tokens=, **BLOCK_PASS)` (default: `measure_loaded` without progress), kept
    in `out_dir`."""
    L = num_layers(loaded.model)
    kept = Path(out_dir) / ANGULAR_JSON
    source = angular if angular is not None else (kept if kept.exists() else None)
    result = load_angular(source) if source is not None else None
    if result is not None and angular is None and (result.run.get("tokens_requested"), result.run.get("data_asked")) != (tokens, data):
        result = None  # an earlier pass on other text: measure again
    if result is not None and result.num_layers != L:
        raise DepthcurseError(f"{source} was measured on a {result.num_layers}-layer model; {loaded.name} has {L} layers")
    if result is None:
        measure = measure or (lambda **options: measure_loaded(loaded, **options)[0])
        result = measure(data=data, tokens=tokens, **BLOCK_PASS)
        result.run["data_asked"] = data
        write_angular(result, out_dir)
    return result
