"""LayerNorm Scaling (Sun et al., NeurIPS 2025, "The Curse of Depth"): Pre-LN with block l's two
norm outputs times 1/sqrt(l); a plain float folded into the gains at export."""

from depthcurse.train.norms.base import Normalisation


class LNS(Normalisation):
    name = "lns"
    title = "Pre-LN + LNS"
    block = "pre with both norm outputs of block l times 1/sqrt(l): h = (gamma * x_hat) / sqrt(l)"
    reference = "lmsdss/LayerNorm-Scaling @ 3ac54dd peft_pretraining/modeling_llama.py (norm_type LNS: scale_factor = 1 / sqrt(layer_index + 1); _init_weights)"
    differs = ("none in the block or the init (LLaMA's N(0, 0.02), the embedding too). Their layer compares NORM_TYPE, lower-cased, "
               "with 'LNS' (upper case), a branch that lower-cased input never reaches; ours is the paper's formula")
    stock_llama = True
    lns = True
