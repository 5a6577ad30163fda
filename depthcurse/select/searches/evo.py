"""EvoPress's depth search (Sieberling et al., ICML 2025), as its authors' code runs it:
IST-DASLab/EvoPress @ 50888a0, `evo_drop_search.py`, with the defaults of `scripts/run_drop_search.sh`.

A (mu + lambda) elitist evolution over removals. The first population: the fittest
`population_size` of `initially_generated` distinct random removals, scored on `initial_tokens`
calibration tokens. Each generation: `offspring` distinct children, each a copy of a random parent
with 1 to `max_mutations` level-switch mutations (the number the smaller of two uniform draws, so
fewer are likelier; each swaps one removed unit of a kind for a kept one of that kind); then
selection in stages, each scoring the survivors of the last on a fresh random minibatch of more
calibration tokens (`tokens_per_selection`) and keeping the best `survivors_per_selection`, the
parents joining the children before the last stage (elitism). Generations: k (n - k) / 1.5, their
script's rule. Whole blocks (their `--drop_entire_block`) or, by default in their code, k attention
and k MLP branches apart (`sub-block` granularity).

Line for line where it matters, so that the same seed and the same scores make the same candidates
(`tests/test_search.py` checks it against a port of their loop): Python's `random` seeded once and
drawn in their order (their block mode draws the MLP sample too and overwrites it; a mutation of
the MLP half in block mode is lost, as in theirs), their minibatch rule (windows drawn without
repeats until the stage's tokens are reached, the last cut), numpy's argsort for the survivors.

Where the calibration text holds fewer tokens than a stage asks (theirs: 2,048 then 32,768; the
first population 2,048), every stage is scaled by the same factor, so that the largest scores all
of the calibration tokens and the others keep their proportion (at least 2 tokens, one
prediction); the cell says so in its notes. The fitness is the cell's objective: their default is
KL (`--objective kl`); ppl ranks as their exp(mean loss) does.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass

import numpy as np

from depthcurse.errors import DepthcurseError
from depthcurse.select.estimate import mean_run
from depthcurse.select.search import Bound, Search, Space

DRAWS = 1_000_000  # random draws a loop may take to find what it wants (their loops have no bound: a duplicate is drawn again)

# scripts/run_drop_search.sh @ 50888a0 (and evo_drop_search.py's argparse defaults where the script sets none)
PAPER_DEFAULTS = {"population_size": 1, "offspring": 32, "initially_generated": 64, "initial_tokens": 2048, "survivors_per_selection": "2/1",
                  "tokens_per_selection": "2048/32768", "max_mutations": 3, "generations": None, "fitness": "kl", "seed": None}


@dataclass
class EvoSettings:
    population_size: int = 1
    offspring: int = 32
    initially_generated: int = 64
    initial_tokens: int = 2048
    survivors_per_selection: str = "2/1"  # survivors after each selection stage, "/"-separated
    tokens_per_selection: str = "2048/32768"  # calibration tokens each stage scores on
    max_mutations: int = 3
    generations: int | None = None  # None: k (n - k) / 1.5, their script's rule
    seed: int | None = None  # None: select's --seed (which also splits the windows): another here reruns the search alone


def stages(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split("/")]
    except ValueError:
        raise DepthcurseError(f"--search-args evo.{name}={text}: give whole numbers separated by /, e.g. 2/1") from None
    if not values or min(values) < 1:
        raise DepthcurseError(f"--search-args evo.{name}={text}: each stage needs at least 1")
    return values


def generations_for(n: int, k: int) -> int:
    """Their script's rule, k (n - k) / 1.5, cut to a whole number as its awk `int()` does."""
    return int(k * (n - k) / 1.5)


def scaled_tokens(asked: list[int], available: int) -> tuple[list[int], float]:
    """Each stage's tokens, scaled down by one factor where the calibration text holds fewer tokens
    than the largest asks (that one then scores all of them); at least 2 each (one prediction)."""
    most = max(asked)
    if most <= available:
        return list(asked), 1.0
    factor = available / most
    return [max(2, min(available, round(t * factor))) for t in asked], factor


class Evo(Search):
    name = "evo"
    title = "EvoPress (evolutionary)"
    source = "Sieberling et al. 2025 (EvoPress, ICML), github.com/IST-DASLab/EvoPress @ 50888a0 evo_drop_search.py"
    granularities = ("layer", "sub-block")
    Settings = EvoSettings
    seeded = True

    def check(self, space: Space) -> None:
        s = self.settings
        survivors, tokens = stages(s.survivors_per_selection, "survivors_per_selection"), stages(s.tokens_per_selection, "tokens_per_selection")
        for name in ("population_size", "offspring", "initially_generated", "initial_tokens", "max_mutations"):
            if getattr(s, name) < 1:
                raise DepthcurseError(f"--search-args evo.{name} must be at least 1, got {getattr(s, name)}")
        if s.generations is not None and s.generations < 0:
            raise DepthcurseError(f"--search-args evo.generations must be 0 or more, got {s.generations}")
        if len(survivors) != len(tokens):
            raise DepthcurseError(f"--search-args evo: survivors_per_selection {s.survivors_per_selection} and tokens_per_selection "
                                  f"{s.tokens_per_selection} must have one entry per selection stage each ({len(survivors)} against {len(tokens)})")
        if survivors[-1] != s.population_size:
            raise DepthcurseError(f"--search-args evo: the last stage keeps {survivors[-1]}, which must be population_size ({s.population_size})")
        if survivors[0] > s.offspring:
            raise DepthcurseError(f"--search-args evo: its first stage keeps {survivors[0]} of {s.offspring} offspring: survivors cannot outnumber the offspring")
        if s.population_size > s.initially_generated:
            raise DepthcurseError(f"--search-args evo: population_size {s.population_size} is more than the {s.initially_generated} removals "
                                  "initially generated it is chosen from")
        total = space.sets()
        for what, count in (("initially_generated", s.initially_generated), ("offspring + population_size", s.offspring + s.population_size)):
            if count > total:
                raise DepthcurseError(f"--search-args evo: {what} ({count}) is more than the {total:,} distinct removals of {space.sets_text()}: "
                                      "the search would never find enough (use exact)")

    def passes(self, space: Space, tokens: int) -> tuple[float, float]:
        """Every stage's candidates on its share of the calibration tokens, each run from its first
        removed unit (a removal drawn at random: `mean_run`)."""
        s = self.settings
        survivors = stages(s.survivors_per_selection, "survivors_per_selection")
        (initial, *stage_tokens), _ = scaled_tokens([s.initial_tokens, *stages(s.tokens_per_selection, "tokens_per_selection")], tokens)
        generations = s.generations if s.generations is not None else generations_for(space.n, space.k)
        counts = [s.offspring, *survivors[:-1]]
        counts[-1] += s.population_size  # the parents join the last stage
        heads = s.initially_generated * initial / tokens + generations * sum(c * t / tokens for c, t in zip(counts, stage_tokens))
        return heads * mean_run(space.n, space.k, space.granularity), heads

    # --------------------------------------------------------------------------- their state, as they keep it
    def _blank(self, n: int) -> dict:
        return {"attn": [False] * n, "mlp": [False] * n}

    def _removal(self, state: dict, block_mode: bool) -> tuple:
        if block_mode:
            return tuple(i for i, r in enumerate(state["attn"]) if r)
        return tuple(f"a{i}" for i, r in enumerate(state["attn"]) if r) + tuple(f"m{i}" for i, r in enumerate(state["mlp"]) if r)

    def _minibatch(self, rng: random.Random, windows: int, window_tokens: int, num_tokens: int) -> tuple[list[int], int]:
        """Their `selection`'s minibatch: windows drawn at random without repeats until `num_tokens`,
        the last cut to fit; (window indices, tokens of the last one)."""
        ids, used, last = [], 0, window_tokens
        bound = Bound(DRAWS, "evo's minibatch draw")
        while used < num_tokens:
            bound.step(f"{num_tokens:,} tokens asked of {windows} windows of {window_tokens}")
            i = rng.randint(0, windows - 1)
            if i in ids:  # avoid duplicates
                continue
            ids.append(i)
            if used + window_tokens > num_tokens:
                last = num_tokens - used
                used = num_tokens
            else:
                last = window_tokens
                used += window_tokens
        return ids, last

    def _select(self, ctx, rng, candidates: list[dict], survive: int, num_tokens: int, block_mode: bool, trace: list) -> tuple[list[dict], list[float]]:
        ids, last = self._minibatch(rng, ctx.windows, ctx.window_tokens, num_tokens)
        fitnesses = ctx.score_on_many([self._removal(c, block_mode) for c in candidates], ids, last)
        trace.append({"tokens": num_tokens, "candidates": [self._removal(c, block_mode) for c in candidates], "windows": ids, "last": last})
        best = np.argsort(fitnesses)[:survive]
        return [candidates[i] for i in best], [fitnesses[i] for i in best]

    def run(self, ctx):
        s, space = self.settings, ctx.space
        n, k, block_mode = space.n, space.k, space.granularity == "layer"
        survivors = stages(s.survivors_per_selection, "survivors_per_selection")
        available = ctx.windows * ctx.window_tokens
        (initial_tokens, *stage_tokens), factor = scaled_tokens([s.initial_tokens, *stages(s.tokens_per_selection, "tokens_per_selection")], available)
        if factor < 1.0:
            asked = ", then ".join(f"{t:,}" for t in stages(s.tokens_per_selection, "tokens_per_selection"))
            ctx.notes.append(f"evo: the calibration windows hold {available:,} tokens, fewer than its stages ask ({s.initial_tokens:,} for the first "
                             f"population; {asked} in each generation): every stage scaled by {factor:.4g}, to {initial_tokens:,}; "
                             f"{', then '.join(f'{t:,}' for t in stage_tokens)} (the largest: every calibration token)")
        generations = s.generations if s.generations is not None else generations_for(n, k)
        rng = random.Random(ctx.seed if s.seed is None else s.seed)
        self.trace = trace = []
        legal = list(range(n))
        initial: list[dict] = []
        bound = Bound(DRAWS, "evo's first population")
        while len(initial) < s.initially_generated:
            bound.step(f"{len(initial)} of {s.initially_generated} distinct removals found")
            state = self._blank(n)
            for i in rng.sample(legal, k):
                state["attn"][i] = True
            for i in rng.sample(legal, k):
                state["mlp"][i] = True
            if block_mode:
                state["mlp"] = copy.deepcopy(state["attn"])
            if state in initial:  # avoid duplicates
                continue
            initial.append(state)
        ctx.phase("evo: the first population")
        population, _ = self._select(ctx, rng, initial, s.population_size, initial_tokens, block_mode, trace)
        for generation in range(generations):
            ctx.phase(f"evo: generation {generation + 1} of {generations}")
            children: list[dict] = []
            bound = Bound(DRAWS, f"evo's offspring (generation {generation + 1})")
            while len(children) < s.offspring:
                bound.step(f"{len(children)} of {s.offspring} distinct children found")
                child = copy.deepcopy(rng.choice(population))
                flips = min(rng.randint(1, s.max_mutations), rng.randint(1, s.max_mutations))  # bias towards fewer
                for _ in range(flips):
                    kind = "attn" if rng.randint(0, 1) == 0 else "mlp"
                    remove = rng.randint(0, n - 1)
                    while child[kind][remove]:
                        bound.step("a kept unit to remove")
                        remove = rng.randint(0, n - 1)
                    add = rng.randint(0, n - 1)
                    while not child[kind][add]:
                        bound.step("a removed unit to keep")
                        add = rng.randint(0, n - 1)
                    child[kind][remove] = True
                    child[kind][add] = False
                if block_mode:
                    child["mlp"] = copy.deepcopy(child["attn"])
                if child in children or child in population:  # avoid duplicates
                    continue
                children.append(child)
            for survive, tokens in zip(survivors, stage_tokens):
                if survive == survivors[-1]:  # elitist: the parents join the last stage (their test compares values, as here)
                    for parent in population:
                        if parent not in children:
                            children.append(parent)
                children, _ = self._select(ctx, rng, children, survive, tokens, block_mode, trace)
            population = children
        return self._removal(population[0], block_mode)
