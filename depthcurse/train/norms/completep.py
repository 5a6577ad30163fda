"""CompleteP (Dey et al., NeurIPS 2025): depth-muP at alpha = 1, each branch times L0/L and Adam's
eps with it, L0 the base depth its hyper-parameters were tuned at."""

from depthcurse.train.norms.base import Normalisation, original_layers


class CompleteP(Normalisation):
    name = "completep"
    title = "CompleteP"
    block = "pre with each branch times L0/L (L0 = --base-layers), and Adam's eps times L0/L"
    reference = "EleutherAI/nanoGPT-mup, branch completep @ 6f8bc3b (model.py: depth_multiplier ** -alpha on each branch; train.py: eps)"
    differs = ("its base Adam eps is 1e-12 (ours 1e-8, every variant's), its weight decay 0.1 (ours 0: --weight-decay would also "
               "decay the norm gains, which their optimizer groups exempt), its head tied; the depth rules are theirs")
    stock_llama = True

    def branch_multiplier(self, cfg):
        return cfg.base_layers / original_layers(cfg)

    def adam_eps_factor(self, cfg):
        return cfg.base_layers / cfg.num_layers
