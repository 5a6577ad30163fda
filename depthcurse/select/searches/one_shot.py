"""One-shot ranking: the k blocks whose single removal costs least on the calibration objective
(greedy's first step, read k deep)."""

from depthcurse.select.estimate import trie_passes
from depthcurse.select.search import Search, Space


class OneShot(Search):
    name = "one-shot"
    title = "one-shot"
    source = "the k cheapest single removals"

    def passes(self, space: Space, tokens: int) -> tuple[float, float]:
        return trie_passes([(u,) for u in range(space.n)], space.n), float(space.n)

    def run(self, ctx):
        units = list(range(ctx.space.n))
        scores = ctx.score_many([(u,) for u in units])
        return tuple(sorted(u for _, u in sorted(zip(scores, units))[: ctx.space.k]))
