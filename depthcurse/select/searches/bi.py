"""ShortGPT's Block Influence (Men et al. 2024): 1 - cos(a block's input, its output) over every
calibration token; the k blocks of least influence go."""

from depthcurse.select.search import Search


class BlockInfluence(Search):
    name = "bi"
    title = "Block Influence"
    source = "Men et al. 2024 (ShortGPT), arXiv 2403.03853"
    reads = "streams"

    def passes(self, space, tokens: int) -> tuple[float, float]:
        return float(space.n), 0.0  # the unpruned pass that keeps the streams (once for every stream search)

    def run(self, ctx):
        influence = ctx.streams().block_influence
        return tuple(sorted(sorted(range(ctx.space.n), key=lambda l: (influence[l], l))[: ctx.space.k]))
