"""Dynamic Tanh (Zhu et al., CVPR 2025): every norm replaced by w * tanh(alpha x), alpha learnt."""

from depthcurse.train.norms.base import Normalisation


class DyT(Normalisation):
    name = "dyt"
    title = "DyT"
    block = "pre with every norm D(x) = gamma * tanh(alpha * x); the embedding times a learnt scalar"
    reference = "jiachenzhu/DyT @ aab5dde (its LLaMA model: no bias, alpha0 per branch, the embedding scalar sqrt(d); LLaMA's init)"
    dyt = True
