"""LayerScale (Touvron et al. 2021, CaiT): Pre-LN with each branch times a learnt per-channel vector
started small, smaller for deeper stacks."""

from depthcurse.train.norms.base import Normalisation, original_layers


class LayerScale(Normalisation):
    name = "layerscale"
    title = "LayerScale"
    block = "pre with each branch times a learnable per-channel vector"
    reference = "facebookresearch/deit cait_models.py (LayerScale_Block: gamma_1, gamma_2 = init_values * ones; init_values per depth in the CaiT paper)"
    differs = ("CaiT draws its ViT's linears from a truncated N(0, 0.02); here the rest of the model is LLaMA's (N(0, 0.02)): the "
               "variant is the branch scale, on this model")
    branch_scale = "layerscale"

    def branch_scale_init(self, cfg):
        # CaiT's rule for the init value: smaller for deeper stacks
        L = original_layers(cfg)
        return 0.1 if L <= 18 else (1e-5 if L <= 24 else 1e-6)
