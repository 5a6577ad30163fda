"""SkipInit (De and Smith 2020): Pre-LN with each branch times a learnt scalar started at 0."""

from depthcurse.train.norms.base import Normalisation


class SkipInit(Normalisation):
    name = "skipinit"
    title = "SkipInit"
    block = "pre with each branch times a learnable scalar"
    reference = "De and Smith, NeurIPS 2020 (the scalar alpha = 0 on each residual branch)"
    differs = "SkipInit removes the norms; here the Pre-LN norms stay (as the Curse of Depth paper's comparison has them)"
    branch_scale = "skipinit"
