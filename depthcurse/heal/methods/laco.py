"""LaCo's merge (Yang et al., "LaCo: Large Language Model Pruning via Layer Collapse", Findings of
EMNLP 2024, arXiv 2402.11187; code yangyifei729/LaCo @ 8483587, `laco_llama-13b.ipynb`,
`merge_layers_return_model`): a removed run folded into the layer before it by "reserving
differences while seeking common" (RDSC).

The paper writes RDSC as theta_l + sum_k (theta_{l+k} - theta_l). The released code updates the base
in place and subtracts the *updated* weights (`w.add_(theta_k - w)`), which leaves the base equal to
the run's last layer: `as=paper` (the default) is the formula, `as=code` what the notebook computes,
operation for operation (tests/test_merging.py ports the notebook's function and compares every
tensor). Their selection procedure is `select --search laco`."""

from __future__ import annotations

from dataclasses import dataclass

from depthcurse.errors import DepthcurseError
from depthcurse.heal.merge import Merge
from depthcurse.merging import RDSC_FORMS


@dataclass
class LacoSettings:
    as_: str = "paper"  # `as=paper`: theta_l + sum_k (theta_{l+k} - theta_l); `as=code`: the released notebook's in-place loop
    biases: bool = False  # merge the biases too (Qwen2's q, k, v); the notebook merges the seven projection weights alone


class Laco(Merge):
    name = "laco"
    title = "merged into the layer before (LaCo's RDSC)"
    source = "Yang et al. Findings of EMNLP 2024, arXiv 2402.11187; github.com/yangyifei729/LaCo @ 8483587 (laco_llama-13b.ipynb)"
    Settings = LacoSettings

    def check_settings(self):
        if self.settings.as_ not in RDSC_FORMS:
            raise DepthcurseError(f"--method laco: as={self.settings.as_!r}: use paper (RDSC as the paper writes it) or code (as the released notebook computes it)")

    def rule(self):
        return RDSC_FORMS[self.settings.as_]

    def rule_text(self):
        if self.settings.as_ == "paper":
            return "RDSC as LaCo's paper writes it (theta_l + sum_k (theta_l+k - theta_l))"
        return "RDSC as LaCo's released code computes it (each difference from the updated base: the run's last layer)"
