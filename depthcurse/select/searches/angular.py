"""Gromov et al. (2024, "The Unreasonable Ineffectiveness of the Deeper Layers"): the block of k
adjacent layers whose input and output are closest in angular distance, read off one pass over the
calibration windows (every token)."""

from depthcurse.select.search import Search


class Angular(Search):
    name = "angular"
    title = "angular distance"
    source = "Gromov et al. 2024, arXiv 2403.17887"
    reads = "streams"

    def passes(self, space, tokens: int) -> tuple[float, float]:
        return float(space.n), 0.0  # the unpruned pass that keeps the streams (once for every stream search)

    def run(self, ctx):
        return tuple(ctx.streams().block_choices(ctx.space.k)[0].layers)
