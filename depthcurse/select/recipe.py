"""The recommended answer to "which k layers should I remove, and how sure is that?": what
`depthcurse select MODEL --k K` runs when no search is given.

The rule, from select's findings on SmolLM2-135M (docs/probes-and-select.md):
- The objective is KL from the unpruned model (EvoPress's default). It ranks removals by what they
  change in the model's predictions, not by how well the text happens to be predicted; on short
  texts it is the steadier objective (docs/speculate.md, Finding 2).
- greedy always runs: it is cheap (about k n removals), and at k = 4 it found the exact optimum
  (Finding 6).
- exact runs where its estimated time fits `--budget` (and `exact.max_sets`): it names the optimum,
  and every pick's rank among all removals. Where it does not fit, evo runs: from k = 6 it beats
  greedy held out (Finding 7).
- Each deterministic search (greedy, exact) is rerun on 8 bootstrap resamples of the calibration
  windows, which reuses the scores it measured (`select.stability`): the answer's "how sure". evo's
  resamples cost a whole search each and run only with `--resamples`.

The answer is the recipe's pick with the best calibration score (exact's where it ran).
"""

from __future__ import annotations

from dataclasses import dataclass

from depthcurse.forecast import duration
from depthcurse.select.search import Space, build_searches

OBJECTIVE = "kl"
RESAMPLES = 8


@dataclass(frozen=True)
class Recipe:
    searches: tuple[str, ...]
    why: str

    def summary(self) -> dict:
        return {"searches": list(self.searches), "why": self.why}


def recipe(space: Space, tokens: int, budget_minutes: float, search_args: dict | None = None) -> Recipe:
    """greedy, plus exact where its estimate on this machine (`space.timing`) fits the budget and
    its `max_sets`, else evo."""
    exact = build_searches(("exact",), {k: v for k, v in (search_args or {}).items() if k.startswith("exact.")})["exact"]
    blocks, heads = exact.passes(space, tokens)
    seconds = space.timing.seconds(blocks, heads) if space.timing is not None else float("inf")
    sets = space.sets()
    if sets <= exact.settings.max_sets and seconds <= budget_minutes * 60:
        return Recipe(("greedy", "exact"), f"exact fits: {sets:,} removals, about {duration(seconds)} here (--budget {budget_minutes:g} minutes)")
    over = f"about {duration(seconds)} here, over --budget {budget_minutes:g} minutes" if seconds > budget_minutes * 60 else \
        f"more than exact.max_sets={exact.settings.max_sets:,}"
    return Recipe(("greedy", "evo"), f"exact does not fit ({sets:,} removals, {over}): evo instead")
