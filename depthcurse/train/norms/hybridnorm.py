"""HybridNorm (Zhuo et al. 2025): QKV-norm in attention (no norm on the block's input), Post-Norm on
the FFN; HybridNorm* makes the first block Pre-Norm. Both drawn by OLMo's `full_megatron` init, as
the authors' configs name it."""

import math

from depthcurse.train.norms.base import Normalisation, blocks, original_layers


class HybridNorm(Normalisation):
    name = "hybridnorm"
    title = "HybridNorm"
    block = "x = x + Attn(x), q, k and v each RMS-normed per head (no norm before attention); x = N(x); x = x + MLP(x)"
    reference = ("BryceZhuo/HybridNorm @ f0dd605 dense_model/olmo/model.py (OLMoSequentialBlock; reset_parameters under "
                 "init_fn full_megatron), configs/exps/1.2B-dense-HybriedNorm.yaml (init_fn full_megatron, init_cutoff_factor 3, weight_tying)")
    differs = ("their config ties the head to the embedding; every variant here has an untied head, which full_megatron draws at "
               "1/sqrt(d). Their init_std, 0.013975424859373685 in both configs, is sqrt(2 / (5 x 2048)), the small-init rule at their "
               "width 2048; here the same rule at the model's width, sqrt(2 / (5 d)) (0.0791 at d = 64, 0.0140 at 2048)")

    def kind(self, origin, cfg):
        return "hybrid"

    def qkv_norm(self, origin, cfg):
        return True

    def authors_init(self, model, cfg):
        """OLMo's full_megatron: every matrix N(0, init_std) cut off at 3 sigma, the branches' output
        projections (attn_out, ff_out) at init_std / sqrt(2 L), the embedding at init_std, an untied
        head (ff_out of the model) at 1 / sqrt(d); init_std the authors' configs' sqrt(2 / (5 d)) (the
        small-init rule, which their 0.013975424859373685 is at d = 2048), at this model's width."""
        from torch import nn  # lazy: the registry is read without torch

        def cut(w, std):
            nn.init.trunc_normal_(w, mean=0.0, std=std, a=-3.0 * std, b=3.0 * std)

        std, L = small_init_std(cfg.hidden_size), original_layers(cfg)
        cut(model.model.embed_tokens.weight, std)
        cut(model.lm_head.weight, 1.0 / math.sqrt(cfg.hidden_size))
        for block in blocks(model):
            attn, mlp = block.self_attn, block.mlp
            for lin in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
                cut(lin.weight, std)
            for lin in (attn.o_proj, mlp.down_proj):
                cut(lin.weight, std / math.sqrt(2.0 * L))


def small_init_std(d: int) -> float:
    """sqrt(2 / (5 d)) (Nguyen and Salazar 2019's small init): 0.013975424859373685 at d = 2048, the
    init_std of both of HybridNorm's configs."""
    return math.sqrt(2.0 / (5.0 * d))


class HybridNormStar(HybridNorm):
    name = "hybridnorm-star"
    title = "HybridNorm*"
    block = "hybridnorm, but block 0 Pre-Norm on both branches (its QKV-norm kept)"
    reference = HybridNorm.reference + "; README: norm_pos_special_config {0: {attn_norm: True, ffn_residual: False}}"

    def kind(self, origin, cfg):
        return "pre" if origin == 0 else "hybrid"
