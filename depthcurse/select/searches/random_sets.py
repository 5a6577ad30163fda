"""Random removals, the null distribution a search is judged against: `sets` removals drawn
uniformly (distinct) from a seed, each scored on the calibration objective; the best of them is
the search's choice (random search), and all of them say where any pick falls among removals
taken blindly."""

from __future__ import annotations

import random
from dataclasses import dataclass

from depthcurse.errors import DepthcurseError
from depthcurse.select.estimate import mean_run
from depthcurse.select.search import Bound, Search, Space, canonical


@dataclass
class RandomSettings:
    sets: int = 200  # removals drawn
    seed: int | None = None  # None: select's --seed


class RandomSets(Search):
    name = "random"
    title = "random (best of the draws)"
    source = "uniform draws from a seed: the null distribution"
    granularities = ("layer", "sub-block", "branch")
    Settings = RandomSettings
    seeded = True

    def check(self, space: Space) -> None:
        if self.settings.sets < 1:
            raise DepthcurseError(f"--search-args random.sets must be at least 1, got {self.settings.sets}")
        if self.settings.sets > space.sets():
            raise DepthcurseError(f"--search-args random.sets={self.settings.sets} is more than the {space.sets():,} removals there are: "
                                  "use exact for all of them")

    def passes(self, space: Space, tokens: int) -> tuple[float, float]:
        return self.settings.sets * mean_run(space.n, space.k, space.granularity), float(self.settings.sets)

    def run(self, ctx):
        rng = random.Random(f"random:{ctx.seed if self.settings.seed is None else self.settings.seed}")
        space, drawn = ctx.space, {}
        bound = Bound(1_000_000, "random's draws")
        while len(drawn) < self.settings.sets:
            bound.step(f"{len(drawn)} of {self.settings.sets} distinct removals found")
            if space.granularity == "layer":
                removal = canonical(rng.sample(range(space.n), space.k), "layer")
            elif space.granularity == "branch":
                removal = canonical(rng.sample(space.units(), space.k), "branch")
            else:
                removal = canonical([f"a{i}" for i in rng.sample(range(space.n), space.k)] + [f"m{i}" for i in rng.sample(range(space.n), space.k)],
                                    "sub-block")
            drawn.setdefault(removal, None)
        removals = self.drawn = list(drawn)
        scores = ctx.score_many(removals)
        return min(zip(scores, removals))[1]
