"""LNS with scaled-init's output projections: the paper's ablation of the two together."""

from depthcurse.train.norms.scaled_init import ScaledInit
from depthcurse.train.norms.lns import LNS


class LNSScaledInit(ScaledInit):
    name = "lns+scaled-init"
    title = "LNS + Scaled Init"
    block = "lns"
    reference = LNS.reference + "; is_scaled_layer on o_proj and down_proj (scale_pre's init)"
    differs = ""
    lns = True
