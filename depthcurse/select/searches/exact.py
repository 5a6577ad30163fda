"""The exact optimum: every removal scored on the calibration objective, the best one chosen.

Whole blocks are scored by the prefix walk (`CalibrationScorer.score_many`): the removals that
remove the same blocks below block j share everything up to j, so each shared prefix's stream is
computed once. The removals go in lexicographic order, in chunks saved as they finish, so an
interrupted search resumes where it stopped. A budget (`max_sets`) refuses, before any work, a
space it cannot finish, with how many removals and about how long.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import islice

from depthcurse.errors import DepthcurseError
from depthcurse.forecast import duration
from depthcurse.select.estimate import mean_run
from depthcurse.select.search import Search, Space

CHUNK = 512  # removals a chunk scores before it is saved


def walk_passes(n: int, k: int) -> tuple[int, int]:
    """(block passes, head passes) of the prefix walk over every k-set of n blocks: each node of the
    trie with last removed block a at depth d < k advances past the kept blocks up to its last
    child's (n - k + d - a - 1 of them), each leaf runs the blocks after its last removed one
    (n - 1 - a) and the head; C(a, d - 1) nodes end in a at depth d."""
    blocks = 0
    for d in range(1, k + 1):
        for a in range(d - 1, n - k + d):
            nodes = math.comb(a, d - 1)
            blocks += nodes * ((n - 1 - a) if d == k else max(0, n - k + d - a - 1))
    return blocks, math.comb(n, k)


@dataclass
class ExactSettings:
    max_sets: int = 100_000  # a space with more removals is refused before it starts


class Exact(Search):
    name = "exact"
    title = "exact optimum"
    source = "every removal scored (EvoPress's brute_force_drop.py does it one removal at a time)"
    granularities = ("layer", "sub-block", "branch")
    Settings = ExactSettings

    def check(self, space: Space) -> None:
        if self.settings.max_sets < 1:
            raise DepthcurseError(f"--search-args exact.max_sets must be at least 1, got {self.settings.max_sets}")
        sets = space.sets()
        if sets > self.settings.max_sets:
            if space.granularity == "layer":
                blocks, heads = walk_passes(space.n, space.k)
                work = f"{blocks:,} block passes and {heads:,} head passes by the prefix walk"
            else:
                work = f"about {sets * space.n:,} block passes"
            when = f", about {duration(space.timing.seconds(*self.passes(space, 0)))}" if space.timing is not None else ""
            raise DepthcurseError(f"--search exact: {space.sets_text()} = {sets:,} removals, more than exact.max_sets={self.settings.max_sets:,} "
                                  f"({work}{when}): give --search-args exact.max_sets={sets} to run it, or a smaller --k")

    def passes(self, space: Space, tokens: int) -> tuple[float, float]:
        if space.granularity == "layer":
            return tuple(float(p) for p in walk_passes(space.n, space.k))
        return space.sets() * mean_run(space.n, space.k, space.granularity), float(space.sets())

    def run(self, ctx):
        every = ctx.space.every()
        total, done = ctx.space.sets(), 0
        best = None
        while True:
            chunk = list(islice(every, CHUNK))
            if not chunk:
                break
            ctx.phase(f"exact: {done:,} of {total:,} removals scored")
            for removal, score in zip(chunk, ctx.score_many(chunk)):
                if best is None or score < best[0]:  # ties to the first in lexicographic order
                    best = (score, removal)
            done += len(chunk)
        return best[1]

