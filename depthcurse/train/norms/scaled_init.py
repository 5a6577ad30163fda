"""Scaled Init (GPT-2, Megatron): Pre-LN with the branches' output projections drawn N(0, 0.02/sqrt(2L))."""

import math

from depthcurse.train.norms.base import Normalisation, blocks, original_layers


class ScaledInit(Normalisation):
    name = "scaled-init"
    title = "Scaled Init"
    block = "pre"
    reference = "lmsdss/LayerNorm-Scaling @ 3ac54dd peft_pretraining/modeling_llama.py (scale_pre: is_scaled_layer on o_proj, down_proj; _init_weights)"
    stock_llama = True

    def defining_init(self, model, cfg):
        std = cfg.init_std / math.sqrt(2 * original_layers(cfg))
        for block in blocks(model):
            for w in (block.self_attn.o_proj.weight, block.mlp.down_proj.weight):
                w.normal_(0.0, std)
