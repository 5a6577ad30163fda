"""select's scorer with the unpruned model's predictions worked out once (`select.scoring.Reference`:
p, sum p log p and the top-1 per batch) against the form before it, which recomputed exp(log p) and
the unpruned top-1 for every removal: the same removals of k blocks scored by each in turns in one
process, the first round a warm-up; the ratio of their times and the largest difference in a KL.

    .venv/bin/python benchmarks/select/kl_reference.py --dtype bf16
    .venv/bin/python benchmarks/select/kl_reference.py --dtype fp32
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

from depthcurse.loading import load_model
from depthcurse.select import scoring
from depthcurse.select.config import SelectConfig
from depthcurse.select.scoring import CalibrationScorer
from depthcurse.select.windows import text_windows

NEW = scoring.window_scores


def per_removal_exp(logp, ids, reference):
    """The scores as computed before `Reference`: KL(p || q) = sum exp(log p) (log p - log q), for
    every removal, from the reference's log-probs."""
    losses = -logp.gather(-1, ids[:, 1:, None])[..., 0]
    if reference is None:
        return losses, None, None
    ref = reference.logp.to(logp.device)
    return losses, (ref.exp() * (ref - logp)).sum(-1), (logp.argmax(-1) == ref.argmax(-1)).float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--removals", type=int, default=128, help="how many, from the 1,000th of every removal of k")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    loaded = load_model(args.model, dtype=args.dtype)
    cfg = SelectConfig(k=args.k, calibration=("wiki",), calib_windows=4, eval_windows=2, seq_len=64, batch_size=4)
    scorer = CalibrationScorer(loaded.model, text_windows(loaded.tokenizer, "wiki", cfg).calibration, 4, {}, lambda: None)
    for batch in scorer.batches:  # the old form reads the reference's log-probs
        batch.reference.logp = batch.reference.probs.log()
    removals = list(itertools.combinations(range(scorer.n), args.k))[1000 : 1000 + args.removals]
    times, results = {"old": [], "new": []}, {}
    for r in range(args.rounds):
        for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
            scoring.window_scores = per_removal_exp if name == "old" else NEW
            scorer.windowed.clear()
            started = time.perf_counter()
            results[name] = scorer.per_window(removals)
            times[name].append(time.perf_counter() - started)
    scoring.window_scores = NEW
    ratios = [n / o for n, o in zip(times["new"][1:], times["old"][1:])]
    kl = max(abs(a - b) for x, y in zip(results["old"], results["new"]) for a, b in zip(x[1], y[1]))
    same = all(x[2] == y[2] for x, y in zip(results["old"], results["new"]))
    print(f"{args.dtype}: old {[round(t, 2) for t in times['old']]} s, new {[round(t, 2) for t in times['new']]} s")
    print(f"{args.dtype}: new / old, median of {len(ratios)} rounds {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}); "
          f"largest KL difference {kl:.2e}; every agreement the same: {same}")


if __name__ == "__main__":
    main()
