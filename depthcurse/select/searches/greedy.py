"""Greedy removal: k steps, each removing the unit whose removal (on top of the earlier ones) costs
least on the calibration objective, measured exactly (the "iterative" pruning of Shortened LLaMA's
PPL criterion, Kim et al. 2024; Gromov et al.'s baseline)."""

import random

from depthcurse.select.estimate import trie_passes
from depthcurse.select.search import Search, Space

DRAWS = 8  # the chosen sets the estimate averages the walk over


class Greedy(Search):
    name = "greedy"
    title = "greedy"
    source = "the k cheapest removals one at a time, each measured on top of the earlier ones"

    def passes(self, space: Space, tokens: int) -> tuple[float, float]:
        """Each step's candidates through the prefix walk, for earlier choices drawn at random
        (the mean over `DRAWS` draws; choices low in the model cost more)."""
        rng, n, blocks = random.Random(0), space.n, 0.0
        for step in range(space.k):
            for _ in range(DRAWS):
                chosen = rng.sample(range(n), step)
                blocks += trie_passes([sorted(chosen + [u]) for u in range(n) if u not in chosen], n) / DRAWS
        return blocks, float(sum(n - step for step in range(space.k)))

    def run(self, ctx):
        removed: list[int] = []
        for step in range(ctx.space.k):
            ctx.phase(f"greedy step {step + 1} of {ctx.space.k}")
            candidates = [u for u in range(ctx.space.n) if u not in removed]
            scores = ctx.score_many([tuple(sorted(removed + [u])) for u in candidates])
            # ties to the lowest block: the path never depends on the order of evaluation
            best = min(zip(scores, candidates))[1]
            removed.append(best)
        return tuple(sorted(removed))
