"""Greedy removal: k steps, each removing the unit whose removal (on top of the earlier ones) costs
least on the calibration objective, measured exactly (the "iterative" pruning of Shortened LLaMA's
PPL criterion, Kim et al. 2024; Gromov et al.'s baseline)."""

from depthcurse.select.search import Search


class Greedy(Search):
    name = "greedy"
    title = "greedy"
    source = "the k cheapest removals one at a time, each measured on top of the earlier ones"

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
