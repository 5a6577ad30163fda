"""Sliding-Window Merging's merge (AAAI 2026; code 920927/Sliding-Window-Merging @ 8fa008e, `SLM.py`,
`merge_layers_return_model`): a removed run folded into the layer before it, the window's layers
taken in turn from the base itself on, each a step of `weight_factor` from the updated base towards
it (`w.add_((theta_j - w) * f)`). Their script calls it with f = 1, where the base ends equal to
the window's last layer, as LaCo's code; f < 1 is an exponential moving average over the window.
Their selection procedure is `select --search swm`."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from depthcurse.errors import DepthcurseError
from depthcurse.heal.merge import Merge
from depthcurse.merging import sliding_window_code


@dataclass
class SwmSettings:
    weight_factor: float = 1.0  # the step towards each layer of the window; SLM.py's call uses 1


class Swm(Merge):
    name = "swm"
    title = "merged into the layer before (Sliding-Window Merging)"
    source = "Sliding-Window Merging, AAAI 2026; github.com/920927/Sliding-Window-Merging @ 8fa008e (SLM.py)"
    Settings = SwmSettings

    def check_settings(self):
        f = self.settings.weight_factor
        if not (math.isfinite(f) and 0 < f <= 1):
            raise DepthcurseError(f"--method swm: weight_factor={f}: a step towards each layer lies in (0, 1] (SLM.py uses 1)")

    def rule(self):
        return functools.partial(sliding_window_code, weight_factor=self.settings.weight_factor)

    def rule_text(self):
        f = self.settings.weight_factor
        return "as SWM's code computes it, weight factor 1 (the window's last layer)" if f == 1 else f"as SWM's code computes it, weight factor {f:g}"
