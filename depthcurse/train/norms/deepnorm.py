"""DeepNorm (Wang et al. 2022, DeepNet): Post-LN with the stream up-weighted by a = (2L)^(1/4) and
the branches' matrices drawn down by b = (8L)^(-1/4), for a decoder of L layers."""

import math

from depthcurse.train.norms.base import Normalisation, blocks, original_layers


class DeepNorm(Normalisation):
    name = "deepnorm"
    title = "DeepNorm"
    block = "x = N(a*x + Attn(x)); x = N(a*x + MLP(x)), a = (2L)^(1/4)"
    reference = ("the DeepNet paper's pseudo-code (Figure 2: xavier_normal_ gain b on the FFN, v_proj and out_proj, gain 1 on q_proj "
                 "and k_proj); microsoft/torchscale @ 4d1e0e8 torchscale/architecture/decoder.py")
    differs = ("torchscale divides its base init by (8L)^(1/4) instead (xavier_uniform_ with gain 1/sqrt(2) on q, k, v from fairseq, "
               "PyTorch's default on the FFN): ours is the paper's pseudo-code, the rule the paper gives as DeepNorm. The LNS and "
               "Mix-LN code's DeepNorm baseline (`deeppost`) hard-codes a for 32 layers and draws with gain (8L)^(+1/4)")

    def kind(self, origin, cfg):
        return "post"

    def residual_alpha(self, cfg):
        return (2 * original_layers(cfg)) ** 0.25

    def defining_init(self, model, cfg):
        beta = (8 * original_layers(cfg)) ** -0.25
        for block in blocks(model):
            attn, mlp = block.self_attn, block.mlp
            for lin in (attn.q_proj, attn.k_proj):
                _xavier_normal(lin.weight, 1.0)
            for lin in (attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
                _xavier_normal(lin.weight, beta)


def _xavier_normal(w, gain: float) -> None:
    fan_out, fan_in = w.shape
    w.normal_(0.0, gain * math.sqrt(2.0 / (fan_in + fan_out)))  # torch.nn.init.xavier_normal_, the same draw
