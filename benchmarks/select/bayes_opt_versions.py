"""Draft & Verify's optimiser under the bayesian-optimization version its authors pin (1.4.3,
dilab-zju/self-speculative-decoding @ 688db8b, `ssd.yml`) and the one depthcurse runs (`>=1.5,<2`;
SWIFT pins 1.5.1): their `LayerSkippingSearching` loop (`random_state=1`, `set_gp_params(alpha=1e-2)`,
their probes, `maximize(init_points=0, n_iter)`: UCB, kappa 2.576) on the same deterministic black box,
and where the two sequences of points part.

One process per version (a version is an import): `--site DIR` puts a `pip install --target DIR
bayesian-optimization==1.4.3` first on the path. The black box is a fixed function of the skip set
(each branch's made-up cost and saving), so that the optimiser alone differs.

    python benchmarks/select/bayes_opt_versions.py --n 8 --iters 60 --site /tmp/bo143 --out /tmp/bo
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path


def trace(n: int, iters: int) -> dict:
    import warnings

    import bayes_opt
    import numpy as np
    from bayes_opt import BayesianOptimization

    rng = np.random.RandomState(7)
    saving, harm = rng.uniform(0.5, 1.5, 2 * n), rng.uniform(0.0, 2.0, 2 * n)
    seen = []

    def black_box(**params):  # their `_black_box_evaluate_function`: a coordinate above 0.5 skips its branch
        x = np.array([params[f"x{i}"] for i in range(2 * n)]) > 0.5
        seen.append([int(i) for i in np.flatnonzero(x)])
        return float(1 + saving[x].sum() / (2 * n) - (harm[x] ** 2).sum() / (2 * n))

    bo = BayesianOptimization(f=black_box, pbounds={f"x{i}": (0, 1) for i in range(2 * n)}, random_state=1, verbose=0)
    bo.set_gp_params(alpha=1e-2)
    bo.probe(params={f"x{i}": float(i % 2) for i in range(2 * n)}, lazy=True)  # a probe, as their notebook's
    stopped = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            bo.maximize(init_points=0, n_iter=iters)
        except Exception as exc:  # 1.4.3 raises on a point it has seen (NotUniqueError): their search would stop there
            stopped = f"{type(exc).__name__}: {str(exc)[:200]}"
    from importlib.metadata import version

    return {"version": version("bayesian-optimization"), "where": bayes_opt.__file__, "points": seen, "best": bo.max["target"], "stopped": stopped}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=8, help="blocks (2n coordinates)")
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--site", type=Path, help="a folder holding bayesian-optimization 1.4.3 (pip install --target)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(trace(args.n, args.iters)))
        return
    runs = []
    for site in (None, args.site):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site)] * bool(site) + [os.environ.get("PYTHONPATH", "")]).strip(os.pathsep)}
        done = subprocess.run([sys.executable, __file__, "--one", "--n", str(args.n), "--iters", str(args.iters), "--out", "-"],
                              capture_output=True, text=True, env=env)
        if done.returncode:
            raise SystemExit(f"bayesian-optimization from {site or 'the environment'} failed:\n{done.stderr[-2000:]}")
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    a, b = runs
    same = next((i for i, (p, q) in enumerate(zip(a["points"], b["points"])) if p != q), min(len(a["points"]), len(b["points"])))
    summary = {"versions": [a["version"], b["version"]], "n": args.n, "iterations": args.iters, "points": [len(a["points"]), len(b["points"])],
               "same_points_before_parting": same, "points_equal": sum(p == q for p, q in zip(a["points"], b["points"])),
               "best": [a["best"], b["best"]], "stopped": [a["stopped"], b["stopped"]]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bayes_opt_versions.json").write_text(json.dumps({**summary, "runs": runs}, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
