"""SWIFT's skip-set search (Xia et al., ICLR 2025), as its authors' code runs it:
hemingkx/SWIFT @ 88caed7, `model/swift/utils.py` (`swift_optimization`, `layer_random_search`,
`layer_bayes_search`, `get_next_point_to_probe`) with the settings of `evaluation_llama/inference_swift.py`.

SWIFT chooses the attention and MLP branches its self-draft skips while it generates: every few
steps it tries another set on the text generated so far and keeps it if the draft's greedy choices
match the text more often ("matchness": teacher-forced top-1 agreement on a context window). Here the
same loop runs on the calibration windows, each candidate scored by the cell's objective; with
`--objective acceptance` that is their matchness (1 - rejection), on every calibration window.

Their space: k branches in all (`--granularity branch`), of blocks 1 to n - 2 (the first and last
blocks are always kept); their k is int(2 (n - 2) x skip_ratio), 0.45 by default (here `--k`, or
`swift.skip_ratio` for theirs, the search then choosing how many as theirs does). Each
iteration draws k of the 2 (n - 2) branches at random (numpy's `choice` without replacement, from the
search's seed), except every `bayes_interval`-th, where a Gaussian-process Bayesian optimiser
(bayes_opt's, Matern kernel, alpha 1e-2, upper confidence bound with kappa 2.5, its own random state
1) suggests a point in [0, 1]^(2(n-2)) and the k largest coordinates are skipped. Every candidate is
registered with the optimiser (a drawn set as its 0/1 point); it replaces the set kept so far when it
scores better. The search stops after `max_tolerance_iter` + 1 candidates in a row without a better
one, after `max_opt_iter` + 1 candidates (their `tolerance > 300` and `opt_iter > 1000`: 301 and 1,001),
or (acceptance only) when the matchness passes `max_score`.

Their scores are "higher is better" from 0; a cell's objective is "lower is better", so the optimiser
is given -objective (the Gaussian process normalises its targets: an offset changes nothing it
suggests) and, for acceptance, the comparison starts at matchness 0 as theirs does. Their run script
(`eval_llama.sh`) sets `max_score` 0.93 where their parser's default is 0.95, and their draft starts
from the attention and MLP of every other block (1, 3, 5, ...), which stays the draft where no
candidate matches once (`swift.start=odd`; ours refuses to choose then). Their scoring on generated
text is `select --calibration continuations --seq-len 51` (their script's context window of 50 scores 50
predictions; a window of 51 tokens scores 50).
Their script's settings in one flag: `--search-args swift.skip_ratio=0.45,swift.max_score=0.93,swift.start=odd`.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from dataclasses import dataclass

import numpy as np

from depthcurse.errors import DepthcurseError
from depthcurse.select.estimate import mean_run
from depthcurse.select.search import Search, Space


@dataclass
class SwiftSettings:
    bayes: bool = True  # --bayes (their evaluation script turns it on)
    bayes_interval: int = 25
    max_opt_iter: int = 1000
    max_tolerance_iter: int = 300
    max_score: float = 0.95  # matchness that ends the search (acceptance only): their parser's default; their run script's 0.93
    kappa: float = 2.5
    optimizer_seed: int = 1  # bayes_opt's random_state, as theirs
    seed: int | None = None  # the random draws' (numpy): None, select's --seed
    skip_ratio: float | None = None  # their --skip-ratio (script: 0.45): k = int(2 (n - 2) x skip_ratio) branches, --k aside; None: --k
    start: str = "none"  # "odd": their starting draft (blocks 1, 3, 5, ... below n - 1, both branches), kept where nothing matches; "none": refuse then


def bounds(n: int) -> dict:
    """Their `pbounds`: a coordinate per branch of blocks 1 to n - 2, attention first."""
    return {f"x{i}": (0, 1) for i in range((n - 2) * 2)}


def units_of(coordinates, n: int) -> tuple:
    """Coordinates (their `x{i}` names, or indices into the 2(n - 2) branches) as branches: x_i is the
    attention of block i + 1 below n - 2, else the MLP of block i - (n - 2) + 1."""
    out = []
    for c in coordinates:
        i = int(str(c).lstrip("x"))
        out.append(f"a{i + 1}" if i < n - 2 else f"m{i - (n - 2) + 1}")
    return tuple(sorted(out, key=lambda u: (u[0], int(u[1:]))))


def point_of(removal, n: int) -> dict:
    """`get_next_point_to_probe`: a drawn set as the optimiser's point, 1.0 where a branch is skipped."""
    skipped = set(removal)
    return {f"x{i}": 1.0 if (f"a{i + 1}" if i < n - 2 else f"m{i - (n - 2) + 1}") in skipped else 0.0 for i in range((n - 2) * 2)}


def starting_set(n: int) -> tuple:
    """`inference_swift.py`'s unified initialisation: the attention and MLP of blocks 1, 3, 5, ... below n - 1."""
    return units_of([*(i - 1 for i in range(1, n - 1, 2)), *(i - 1 + n - 2 for i in range(1, n - 1, 2))], n)


def optimizer(n: int, seed: int):
    from bayes_opt import BayesianOptimization  # lazy: only this search and draft-verify need it

    found = BayesianOptimization(f=None, pbounds=bounds(n), random_state=seed, verbose=0, allow_duplicate_points=True)
    found.set_gp_params(alpha=1e-2)
    return found


class Swift(Search):
    name = "swift"
    title = "SWIFT (random and Bayesian, on the fly)"
    source = "Xia et al. 2025 (SWIFT, ICLR), github.com/hemingkx/SWIFT @ 88caed7 model/swift/utils.py"
    granularities = ("branch",)
    Settings = SwiftSettings
    seeded = True

    @property
    def chooses_k(self) -> bool:
        """With their skip_ratio it sets its own k, as theirs does (`--k` aside)."""
        return self.settings.skip_ratio is not None

    def k_of(self, space: Space) -> int:
        s = self.settings
        return int((space.n - 2) * 2 * s.skip_ratio) if s.skip_ratio is not None else space.k

    def passes(self, space: Space, tokens: int) -> tuple[float, float]:
        """At most: `max_opt_iter` + 1 candidates (its tolerance or max_score often stop it sooner)."""
        most = self.settings.max_opt_iter + 1
        return most * mean_run(space.n, self.k_of(space), "branch"), float(most)

    def check(self, space: Space) -> None:
        s = self.settings
        if space.n < 3:
            raise DepthcurseError(f"--search swift keeps the first and last blocks and skips branches between them: {space.n} blocks leave none")
        if s.skip_ratio is not None and not 0 < s.skip_ratio < 1:
            raise DepthcurseError(f"--search-args swift.skip_ratio must lie between 0 and 1 (theirs: 0.45), got {s.skip_ratio}")
        k = self.k_of(space)
        if k < 1:
            raise DepthcurseError(f"--search-args swift.skip_ratio={s.skip_ratio}: int(2 x {space.n - 2} x {s.skip_ratio}) = {k} branches, none to skip")
        if k > 2 * (space.n - 2):
            raise DepthcurseError(f"--search swift: k = {k} is more than the {2 * (space.n - 2)} branches of blocks 1-{space.n - 2}")
        if s.start not in ("none", "odd"):
            raise DepthcurseError(f"--search-args swift.start={s.start}: use none or odd (their starting draft)")
        if s.start == "odd" and s.skip_ratio is None and len(starting_set(space.n)) != k:
            raise DepthcurseError(f"--search-args swift.start=odd starts from {len(starting_set(space.n))} branches, not k = {k}: "
                                  "give swift.skip_ratio too (their search sets its own k)")
        for name in ("bayes_interval", "max_opt_iter", "max_tolerance_iter"):
            if getattr(s, name) < 1:
                raise DepthcurseError(f"--search-args swift.{name} must be at least 1, got {getattr(s, name)}")

    def run(self, ctx):
        from bayes_opt import UtilityFunction  # lazy: see `optimizer`

        s, n = self.settings, ctx.space.n
        k = self.k_of(ctx.space)
        rng = np.random.RandomState(ctx.seed if s.seed is None else s.seed)
        bo, utility = optimizer(n, s.optimizer_seed), UtilityFunction(kind="ucb", kappa=s.kappa, xi=0.0)
        matchness = ctx.objective == "acceptance"
        best = 0.0 if matchness else -np.inf  # their origin_score
        kept, opt_iter, tolerance, stopped = (starting_set(n) if s.start == "odd" else None), 0, 0, None
        self.trace = []
        while stopped is None:
            if (opt_iter + 1) % s.bayes_interval == 0 and s.bayes:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    point = bo.suggest(utility)
                ranked = sorted(point.items(), reverse=True, key=lambda item: item[1])
                candidate = units_of([name for name, _ in ranked[:k]], n)
            else:
                candidate = units_of(rng.choice((n - 2) * 2, k, replace=False), n)
                point = point_of(candidate, n)
            value = ctx.score(candidate)
            score = 1.0 - value if matchness else -value
            with contextlib.redirect_stdout(io.StringIO()):  # bayes_opt prints a line for each repeated point
                bo.register(params=point, target=score)
            self.trace.append(candidate)
            if score > best:
                best, kept, tolerance = score, candidate, 0
                if matchness and score > s.max_score:
                    stopped = f"stopped: matchness {score:.4f} passed max_score {s.max_score}"
            else:
                tolerance += 1
            opt_iter += 1
            if stopped is None and tolerance > s.max_tolerance_iter:
                stopped = f"stopped: {tolerance} candidates in a row without a better one (max_tolerance_iter {s.max_tolerance_iter})"
            if stopped is None and opt_iter > s.max_opt_iter:
                stopped = f"stopped at the bound: {opt_iter} candidates (max_opt_iter {s.max_opt_iter})"
        ctx.notes.append(f"swift {stopped}, after {opt_iter} candidates" + (f"; k = {k} (skip_ratio {s.skip_ratio})" if s.skip_ratio is not None else "")
                         + ("; no candidate matched once: their starting draft kept" if s.start == "odd" and best == (0.0 if matchness else -np.inf) else ""))
        if kept is None:  # every candidate scored 0 matchness: theirs keeps its first set, which need not be k branches
            raise DepthcurseError("--search swift: no candidate matched the unpruned model once (matchness 0 throughout): nothing to choose")
        return kept
