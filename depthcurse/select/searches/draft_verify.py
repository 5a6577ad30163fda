"""Draft & Verify's skip-set search (Zhang et al., ACL 2024), as its authors' code runs it:
dilab-zju/self-speculative-decoding @ 688db8b, `searching.py` (`LayerSkippingSearching`) as
`search.ipynb` drives it.

A Gaussian-process Bayesian optimiser (bayes_opt's `BayesianOptimization`: Matern kernel, alpha 1e-2,
random state 1, upper confidence bound with kappa 2.576) over a point in [0, 1]^(2n): coordinate i
above 0.5 skips the attention of block i, coordinate n + i the MLP of block i. Their black box is the
tokens per second of self-speculative decoding with that draft on a few prompts; here it is the cell's
objective on the calibration windows: with `--objective speedup` (theirs, in expectation) the expected
speedup, which is their tokens per second over decoding alone's; with any other objective, minus
the objective. `maximize(init_points=0, n_iter)`: one random point first, then `n_iter` suggestions.
The choice is the best point's skip set. Their notebook first probes two hand-picked sets for
Llama-2-13B (`probes=theirs`: `THEIRS`, for a model of 40 blocks or more); any others as
`probes=a8+a10+m6;a3` (sets separated by ";", branches by "+", since `--search-args` splits on
commas) or `probes=@FILE` (a set a line, branches by commas, "+" or spaces, "#" comments). Theirs puts
an MLP probe at coordinate i + 40, Llama-2-13B's n, where here it is i + n: the same on their model.
They pin bayesian-optimization 1.4.3 (`ssd.yml`); this runs 1.5, whose points part from 1.4.3's
after the second under the same seed, and 1.4.3 stops their search with `NotUniqueError` where the
optimiser suggests a point it has seen (`benchmarks/select/bayes_opt_versions.py`, docs/speculate.md).

Unlike every other search here, the number skipped is the search's own: any number of branches
(`--granularity branch`; `--k` is not a constraint on it). A point that skips nothing scores as the
whole model drafting for itself (agreement 1, no block saved).
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from pathlib import Path

from depthcurse.errors import DepthcurseError
from depthcurse.select.estimate import mean_run
from depthcurse.select.search import Search, Space


@dataclass
class DraftVerifySettings:
    n_iter: int = 1000  # search.ipynb's layer_searching.search(1000)
    kappa: float = 2.576  # bayes_opt 1.5's default acquisition: upper confidence bound
    optimizer_seed: int = 1
    probes: str = ""  # sets probed first: "theirs", "@FILE", or "a8+a10+m6;a3"


def skipped(params: dict, n: int) -> tuple:
    """Their `_black_box_evaluate_function`'s reading of a point: attention of block i where x_i > 0.5,
    MLP of block i where x_(n+i) > 0.5."""
    attention = [f"a{i}" for i in range(n) if params[f"x{i}"] > 0.5]
    mlp = [f"m{i - n}" for i in range(n, 2 * n) if params[f"x{i}"] > 0.5]
    return tuple(attention + mlp)


def probe_point(removal, n: int) -> dict:
    params = {f"x{i}": 0.0 for i in range(2 * n)}
    for unit in removal:
        params[f"x{int(unit[1:]) + (n if unit[0] == 'm' else 0)}"] = 1.0
    return params


# search.ipynb's two `layer_searching.probe(attn_skip_layers, mlp_skip_layers)` calls, for Llama-2-13B's 40 blocks
THEIRS = ((tuple(f"a{i}" for i in (8, 10, 15, 18, 20, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38)), ()),
          (tuple(f"a{i}" for i in (3, 5, 6, 8, 10, 11, 14, 15, 18, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 33, 34, 35, 36, 37)),
           tuple(f"m{i}" for i in (6, 9, 10, 11, 15, 24, 25, 27, 28, 35))))


def probe_sets(text: str) -> list[tuple[str, ...]]:
    """The sets `probes` names: `theirs`, `@FILE`, or sets separated by ";" with branches by "+"."""
    text = text.strip()
    if text == "theirs":
        return [attention + mlp for attention, mlp in THEIRS]
    if text.startswith("@"):
        path = Path(text[1:])
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise DepthcurseError(f"--search-args draft-verify.probes={text}: cannot read {path} ({exc.strerror or exc})") from None
        groups = [line.split("#", 1)[0] for line in lines]
    else:
        groups = text.split(";")
    return [tuple(u for u in re.split(r"[,+\s]+", g) if u) for g in groups if g.strip()]


def parse_probes(text: str, n: int) -> list[tuple]:
    out = []
    for units in probe_sets(text):
        bad = [u for u in units if not (u[:1] in "am" and u[1:].isdigit() and int(u[1:]) < n)]
        if bad:
            raise DepthcurseError(f"--search-args draft-verify.probes: {bad[0]!r} is not a branch of this model (a0-a{n - 1}, m0-m{n - 1})"
                                  + (": theirs are for Llama-2-13B's 40 blocks" if text.strip() == "theirs" else ""))
        out.append(units)
    return out


class DraftVerify(Search):
    name = "draft-verify"
    title = "Draft & Verify (Bayesian optimisation)"
    source = "Zhang et al. 2024 (Draft & Verify, ACL), github.com/dilab-zju/self-speculative-decoding @ 688db8b searching.py"
    granularities = ("branch",)
    chooses_k = True
    Settings = DraftVerifySettings

    def passes(self, space: Space, tokens: int) -> tuple[float, float]:
        """`n_iter` points and its probes, each a set of about n branches (each of the 2n is kept with even odds)."""
        points = self.settings.n_iter + len(parse_probes(self.settings.probes, space.n))
        return points * mean_run(space.n, space.n, "branch"), float(points)

    def check(self, space: Space) -> None:
        if self.settings.n_iter < 0:
            raise DepthcurseError(f"--search-args draft-verify.n_iter must be 0 or more, got {self.settings.n_iter}")
        parse_probes(self.settings.probes, space.n)

    def run(self, ctx):
        from bayes_opt import BayesianOptimization, UtilityFunction  # lazy: only this search and swift need it

        n, s = ctx.space.n, self.settings
        speed = ctx.objective == "speedup"
        self.trace, self.targets = [], []  # each point's skip set, and what the optimiser was given for it

        def black_box(**params):
            removal = skipped(params, n)
            self.trace.append(removal)
            value = ctx.score(removal)
            self.targets.append(1.0 / value if speed else -value)  # their tokens per second: the expected speedup
            return self.targets[-1]

        bo = BayesianOptimization(f=black_box, pbounds={f"x{i}": (0, 1) for i in range(2 * n)}, random_state=s.optimizer_seed, verbose=0)
        bo.set_gp_params(alpha=1e-2)
        for removal in parse_probes(s.probes, n):
            bo.probe(params=probe_point(removal, n), lazy=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            bo.maximize(init_points=0, n_iter=s.n_iter, acquisition_function=UtilityFunction(kind="ucb", kappa=s.kappa, xi=0.0))
        chosen = skipped(bo.max["params"], n)
        ctx.notes.append(f"draft-verify: {len(self.trace)} points scored (n_iter {s.n_iter}, its bound), {len(chosen)} branches chosen")
        if not chosen:
            raise DepthcurseError("--search draft-verify: its best point skips nothing (the whole model drafting for itself): no draft beats it")
        return chosen
