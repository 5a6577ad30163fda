"""Post-LN, the original Transformer's block: the norm after each residual add."""

from depthcurse.train.norms.base import Normalisation


class PostLN(Normalisation):
    name = "post"
    title = "Post-LN"
    block = "x = N(x + Attn(x)); x = N(x + MLP(x))"
    reference = "pixeli99/MixLN @ ff45826 peft_pretraining/modeling_llama.py (norm_type post), the Mix-LN paper's Post-LN baseline"
    differs = ("their code draws the embedding N(0, sqrt(2/5)) for every variant it trains; Post-LN's own authors (Vaswani et al.) "
               "give no LLaMA init, so ours is LLaMA's N(0, 0.02) (`mix` takes their embedding draw under --init authors)")

    def kind(self, origin, cfg):
        return "post"
