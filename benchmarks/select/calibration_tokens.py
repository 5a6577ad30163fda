"""How much calibration text is enough? The pick of greedy and of `exact` at each number of
calibration tokens, how stable it is over bootstrap resamples of those windows, and how far it is
held out from the best removal there is.

    python benchmarks/select/calibration_tokens.py --model smollm2-135m --k 2 --windows 1,4,16,32 --seq-len 64 --held-out 16

One pool of windows of `--data`, split once by a seeded shuffle: `--held-out` windows judged on,
never chosen on, and the first W of the rest for each W of `--windows` (nested: the 4 windows
include the 1). Every k-set and every (k - 1)-set greedy passes through is scored once on the
largest calibration set and once on the held-out windows, each window's score kept
(`CalibrationScorer.per_window`), so that each smaller set, each resample and greedy are
reweighings of the same numbers. The held-out optimum is the best of every k-set on the held-out
windows: a pick's gap is its held-out KL minus that optimum's, paired over the held-out windows
(Student's t). Prints a Markdown table and writes --out (JSON).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch

from depthcurse.loading import load_model
from depthcurse.select.config import SelectConfig
from depthcurse.select.windows import text_windows
from depthcurse.select.scoring import CalibrationScorer
from depthcurse.select.search import key
from depthcurse.select.stability import draws, summary
from depthcurse.stats.intervals import mean_interval

KL = 1  # a per-window tuple's index: loss, KL, agreement


def mean_kl(scores: dict, removal: tuple, windows: list[int]) -> float:
    return sum(scores[removal][KL][w] for w in windows) / len(windows)


def greedy(scores: dict, n: int, k: int, windows: list[int]) -> tuple:
    removed: list[int] = []
    for _ in range(k):
        removed.append(min((mean_kl(scores, tuple(sorted(removed + [u])), windows), u) for u in range(n) if u not in removed)[1])
    return tuple(sorted(removed))


def exact(scores: dict, every: list[tuple], windows: list[int]) -> tuple:
    return min(every, key=lambda r: (mean_kl(scores, r, windows), r))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--data", default="wiki")
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--windows", default="1,4,16,32")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--held-out", type=int, default=16)
    parser.add_argument("--resamples", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", default="runs/calibration-tokens.json")
    args = parser.parse_args()
    sizes = [int(w) for w in args.windows.split(",")]
    loaded = load_model(args.model, fp32_on_cpu="as this benchmark's figures in docs/benchmarks.md were measured")
    model = loaded.model.eval()
    split = text_windows(loaded.tokenizer, args.data, SelectConfig(k=1, calibration=(args.data,), calib_windows=max(sizes), eval_windows=args.held_out,
                                                                 seq_len=args.seq_len, seed=args.seed))
    n = CalibrationScorer(model, split.held_out[:1], 4, {}, lambda: None).n
    every = list(itertools.combinations(range(n), args.k))
    paths = sorted({tuple(sorted(c)) for r in every for j in range(1, args.k) for c in itertools.combinations(r, j)})  # greedy's steps
    started = time.perf_counter()
    calib = CalibrationScorer(model, split.calibration, 4, {}, lambda: None)
    calib_scores = dict(zip(paths + every, calib.per_window(paths + every)))
    held = CalibrationScorer(model, split.held_out, 4, {}, lambda: None)
    held_scores = dict(zip(every, held.per_window(every)))
    seconds = time.perf_counter() - started
    all_held = list(range(args.held_out))
    optimum = exact(held_scores, every, all_held)
    rows, out = [], {"args": vars(args), "held_out_optimum": key(optimum), "seconds": round(seconds, 1), "sizes": {}}
    for size in sizes:
        windows = list(range(size))
        entry = {}
        for name, search in (("greedy", lambda w: greedy(calib_scores, n, args.k, w)), ("exact", lambda w: exact(calib_scores, every, w))):
            pick = search(windows)
            picks = [search([windows[i] for i in d]) for d in draws(size, args.resamples, args.seed)] if size > 1 else []
            gap = [held_scores[pick][KL][w] - held_scores[optimum][KL][w] for w in all_held]
            interval = mean_interval(gap) if any(gap) else [0.0, 0.0]
            entry[name] = {"pick": key(pick), "held_out_gap": sum(gap) / len(gap), "gap_interval": interval,
                           "stability": summary(pick, picks, "layer") if picks else None}
            s = entry[name]["stability"]
            sure = f"{s['same']} of {s['resamples']} ({s['same_interval'][0]:.0%}-{s['same_interval'][1]:.0%}), Jaccard {s['mean_jaccard']:.2f}" if s else "-"
            rows.append(f"| {size * args.seq_len:,} | {name} | {key(pick)} | {sure} | {entry[name]['held_out_gap']:+.4f} "
                        f"[{interval[0]:+.4f}, {interval[1]:+.4f}] |")
        out["sizes"][size * args.seq_len] = entry
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"held-out optimum ({args.held_out} x {args.seq_len} tokens, KL): {key(optimum)}; scoring took {seconds:.0f} s")
    print("| calibration tokens | search | pick | the whole pick in resamples (Wilson 95%) | held-out KL minus the held-out optimum's [95%] |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
