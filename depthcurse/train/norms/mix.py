"""Mix-LN (Li et al., ICLR 2025): Post-LN for the first round(mix_ratio * L) blocks, Pre-LN after."""

import math

from depthcurse.train.norms.base import Normalisation, original_layers


class MixLN(Normalisation):
    name = "mix"
    title = "Mix-LN"
    block = "the first round(--mix-ratio * L) blocks post, the rest pre (3 of 12, 6 of 24 at 0.25)"
    reference = "pixeli99/MixLN @ ff45826 peft_pretraining/modeling_llama.py (LlamaDecoderLayer: post_pre with POST_NUM; _init_weights)"
    differs = ("the number of Post-LN blocks is round(mix_ratio * L) where the code takes it as a count (POST_NUM): the same blocks at "
               "the paper's 0.25")

    def kind(self, origin, cfg):
        return "post" if origin < round(cfg.mix_ratio * original_layers(cfg)) else "pre"

    def authors_init(self, model, cfg):
        # `_init_weights` draws nn.Embedding with std (2/5)^0.5 (0.632), not the config's 0.02; every linear N(0, 0.02)
        model.model.embed_tokens.weight.normal_(0.0, math.sqrt(2 / 5))
