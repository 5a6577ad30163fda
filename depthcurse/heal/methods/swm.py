"""Sliding-Window Merging's merge (AAAI 2026; code 920927/Sliding-Window-Merging @ 8fa008e, `SLM.py`,
`merge_layers_return_model`): a removed run folded into the layer before it, the window's layers
taken in turn from the base itself on, each a step of `weight_factor` from the updated base towards
it (`w.add_((theta_j - w) * f)`). Their script calls it with f = 1, where the base ends equal to
the window's last layer, as LaCo's code; f < 1 is an exponential moving average over the window.
Their selection procedure is `select --search swm`."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from depthcurse.heal.merge import Merge
from depthcurse.merging import check_weight_factor, sliding_window_code


@dataclass
class SwmSettings:
    weight_factor: float = 1.0  # the step towards each layer of the window; SLM.py's call uses 1
    biases: bool = False  # merge the biases too (Qwen2's q, k, v); SLM.py merges the seven projection weights alone


class Swm(Merge):
    name = "swm"
    title = "merged into the layer before (Sliding-Window Merging)"
    source = "Sliding-Window Merging, AAAI 2026; github.com/920927/Sliding-Window-Merging @ 8fa008e (SLM.py)"
    Settings = SwmSettings

    def check_settings(self):
        check_weight_factor(self.settings.weight_factor, "--method swm: weight_factor")

    def rule(self):
        return functools.partial(sliding_window_code, weight_factor=self.settings.weight_factor)

    def rule_text(self):
        f = self.settings.weight_factor
        return "as SWM's code computes it, weight factor 1 (the window's last layer)" if f == 1 else f"as SWM's code computes it, weight factor {f:g}"
