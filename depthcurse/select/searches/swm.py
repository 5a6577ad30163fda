"""Sliding-Window Merging's procedure (AAAI 2026; 920927/Sliding-Window-Merging @ 8fa008e, `SLM.py`,
its main loop): a window [low, high] slides down from the top, the last layer kept out (high starts
at n - 2, low one below). The window is merged into its lowest layer (`heal --methods swm`'s merge,
weight factor 1 in their call) and compared with the unpruned model by the cosine of the last
hidden states; above `threshold`, the window grows down (low - 1); below it, the window as it was
before this step is merged for good if it holds two layers or more and the next window starts
under it, else both ends step down. A window still growing when low passes 0 is left unmerged, as
their loop leaves it.

Here the procedure stops once k layers are gone: a window that reaches what is left of k is
merged then. It gives the layers merged away (numbered as in the unpruned model), which `select`
judges as a removal beside the other searches; ending with fewer than k is one line (lower
`swm.threshold`). Their similarity is LaCo's: per window the cosine of the flattened last hidden
states, averaged; their threshold default 0.72, their samples `target_count` (10) windows of 128
tokens of BookCorpus, here the calibration windows."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from depthcurse.errors import DepthcurseError
from depthcurse.merging import Merging, check_threshold, check_uniform, check_weight_factor, last_hidden, mean_similarity, merged_away, similarity_range, sliding_window_code
from depthcurse.select.search import Bound, Search
from depthcurse.surgery import find_blocks


@dataclass
class SwmSearchSettings:
    threshold: float = 0.72  # --threshold
    weight_factor: float = 1.0  # merge_layers_return_model's weight_factor, 1 in their loop
    biases: bool = False  # merge the biases too; SLM.py merges the seven projection weights alone


def swm_procedure(model, windows, s: SwmSearchSettings, stop_at: int | None = None, on_step=lambda text: None) -> tuple[Merging, list]:
    """SLM.py's loop on `model` (left as it was); `stop_at`: end once that many layers are gone
    (None: as theirs, to the bottom). The merged model and every (low, high, similarity, above)."""
    blocks = find_blocks(model).layers
    rule = functools.partial(sliding_window_code, weight_factor=s.weight_factor)
    reference = last_hidden(model, windows)
    state, trail = Merging.start(len(blocks)), []
    high = len(blocks) - 2
    low = high - 1
    bound = Bound(4 * len(blocks) + 4, "swm's procedure")  # each step lowers low, or high to low: 2n steps at most
    while low >= 0 and (stop_at is None or len(state.gone()) < stop_at):
        bound.step(f"window {low}-{high}")
        candidate = state.merge(blocks, low, high, rule, s.biases)
        with candidate.model(model) as merged:
            sim = mean_similarity(reference, last_hidden(merged, windows))
        trail.append((low, high, sim, sim > s.threshold))
        on_step(f"window {low}-{high}: similarity {sim:.4f}")
        if sim > s.threshold:
            if stop_at is not None and len(state.gone()) + high - low >= stop_at:
                state = candidate  # the window takes what is left of k: merged now
                break
            low -= 1
        elif low + 1 != high:
            state = state.merge(blocks, low + 1, high, rule, s.biases)
            high = low
        else:
            high -= 1
            low -= 1
    return state, trail


class Swm(Search):
    name = "swm"
    title = "Sliding-Window Merging"
    source = "Sliding-Window Merging, AAAI 2026; github.com/920927/Sliding-Window-Merging @ 8fa008e (SLM.py)"
    reads = "model"
    Settings = SwmSearchSettings

    def check(self, space):
        check_threshold(self.settings.threshold, "swm")
        check_weight_factor(self.settings.weight_factor, "--search-args swm.weight_factor")
        if space.n < 3:
            raise DepthcurseError(f"--search swm slides a window under the last layer: {space.n} layers leave none")

    def run(self, ctx):
        check_uniform(ctx.model, "--search swm")
        state, trail = swm_procedure(ctx.model, ctx.calibration, self.settings, stop_at=ctx.space.k, on_step=ctx.phase)
        ctx.notes.append(f"{len(trail)} windows tried; similarities {similarity_range(trail)}")
        return merged_away("swm", state, trail, ctx.space.k, self.settings.threshold)
