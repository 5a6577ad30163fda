"""Pre-LN, LLaMA's block: the baseline every other variant changes one thing of."""

from depthcurse.train.norms.base import Normalisation


class PreLN(Normalisation):
    name = "pre"
    title = "Pre-LN"
    block = "x = x + Attn(N(x)); x = x + MLP(N(x))"
    reference = "meta-llama/llama (LLaMA); its N(0, 0.02) init as transformers' LlamaPreTrainedModel._init_weights"
    stock_llama = True
