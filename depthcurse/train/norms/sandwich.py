"""Sandwich-LN (Gemma 2, Peri-LN): a norm before and after each branch."""

from depthcurse.train.norms.base import Normalisation


class SandwichLN(Normalisation):
    name = "sandwich"
    title = "Sandwich-LN"
    block = "x = x + N(Attn(N(x))); x = x + N(MLP(N(x))) (Gemma-2 / Peri-LN)"
    reference = "pixeli99/MixLN @ ff45826 peft_pretraining/modeling_llama.py (norm_type sandwich)"

    def kind(self, origin, cfg):
        return "sandwich"
