"""depthcurse: which layers of a model actually do anything, and does the normalisation fix it."""

__version__ = "0.1.0"
