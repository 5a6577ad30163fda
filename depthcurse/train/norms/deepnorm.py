"""DeepNorm (Wang et al. 2022, DeepNet): Post-LN with the stream up-weighted by a = (2L)^(1/4) and
the branches' matrices drawn down by b = (8L)^(-1/4), for a decoder of L layers."""

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
        from torch import nn  # lazy: the registry is read without torch

        beta = (8 * original_layers(cfg)) ** -0.25
        for block in blocks(model):
            attn, mlp = block.self_attn, block.mlp
            for lin in (attn.q_proj, attn.k_proj):
                nn.init.xavier_normal_(lin.weight, gain=1.0)
            for lin in (attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
                nn.init.xavier_normal_(lin.weight, gain=beta)
