"""Depth-Scaled Init: Pre-LN with every linear of block l drawn N(0, 0.02/sqrt(2l))."""

import math

from depthcurse.train.norms.base import Normalisation, blocks


class DepthScaledInit(Normalisation):
    name = "depth-scaled-init"
    title = "Depth-Scaled Init"
    block = "pre"
    reference = "the Curse of Depth paper's comparison (no code: the formula 0.02/sqrt(2(l+1)), l 0-based)"
    stock_llama = True

    def defining_init(self, model, cfg):
        from torch import nn  # lazy: the registry is read without torch

        for block in blocks(model):
            std = cfg.init_std / math.sqrt(2 * (block.origin + 1))
            for m in block.modules():
                if isinstance(m, nn.Linear):
                    m.weight.normal_(0.0, std)
