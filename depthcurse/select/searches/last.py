"""The k blocks before the final one ("Reassessing Layer Pruning in LLMs", Lu et al. 2024: removing
the last layers, the final one kept, is the simplest rule and among the hardest to beat); for
sub-blocks, both branches of those blocks."""

from depthcurse.select.search import Search


class Last(Search):
    name = "last"
    title = "the last k before the final block"
    source = "Lu et al. 2024, arXiv 2411.15558"
    reads = "nothing"
    granularities = ("layer", "sub-block")

    def passes(self, space, tokens: int) -> tuple[float, float]:
        return 0.0, 0.0  # it reads nothing

    def run(self, ctx):
        n, k = ctx.space.n, ctx.space.k
        blocks = range(n - 1 - k, n - 1)
        if ctx.space.granularity == "layer":
            return tuple(blocks)
        return tuple(f"a{i}" for i in blocks) + tuple(f"m{i}" for i in blocks)
