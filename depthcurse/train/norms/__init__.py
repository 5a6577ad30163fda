"""The normalisation variants `lns-train` trains, one module each (`base` is the contract and the
registry). Importing this package registers the built-in ones, in the order `--norm` lists them."""

from depthcurse.train.norms.base import KINDS, REGISTRY, Normalisation, find_norm
from depthcurse.train.norms import (  # noqa: F401  (each registers its variant by defining it)
    pre, post, deepnorm, mix, lns, scaled_init, sandwich, layerscale, skipinit, depth_scaled_init, lns_scaled_init, dyt, hybridnorm,
    completep,
)

BUILTIN_NORMS = tuple(REGISTRY)

__all__ = ["KINDS", "REGISTRY", "Normalisation", "find_norm", "BUILTIN_NORMS"]
