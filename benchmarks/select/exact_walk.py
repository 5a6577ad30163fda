"""`exact`'s prefix walk on a real model: its block passes against the naive count (every removal
through every kept block) and against its own count (`walk_passes`: each shared prefix once), its
wall time against what those block and head passes cost timed alone, the head's share, and the
memory the walk adds.

    python benchmarks/select/exact_walk.py --model smollm2-135m --k 3 --windows 4 --seq-len 64

Prints one Markdown list for docs/benchmarks.md ("The best k layers").
"""

from __future__ import annotations

import argparse
import itertools
import math
import resource
import statistics
import time

import torch

from depthcurse.loading import load_model
from depthcurse.select.config import SelectConfig
from depthcurse.select.windows import text_windows
from depthcurse.select.scoring import CalibrationScorer
from depthcurse.select.searches.exact import CHUNK, walk_passes


def timed(fn, repeats: int = 7) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--data", default="wiki")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, fp32_on_cpu="as this benchmark's figures in docs/benchmarks.md were measured")
    model = loaded.model.eval()
    cfg = SelectConfig(k=args.k, calibration=(args.data,), calib_windows=args.windows, eval_windows=2, seq_len=args.seq_len, batch_size=args.windows)
    windows = text_windows(loaded.tokenizer, args.data, cfg).calibration
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scorer = CalibrationScorer(model, windows, args.windows, {}, lambda: None)
    kept = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    n = scorer.n
    every = list(itertools.combinations(range(n), args.k))
    started = time.perf_counter()
    for i in range(0, len(every), CHUNK):
        scorer.score_many(every[i : i + CHUNK])
    wall = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cost = scorer.cost.summary(len(windows))
    blocks, heads = walk_passes(n, args.k)
    # the same passes, timed alone: one block over the windows, the head (final norm and output) over them
    stepper, batch = scorer.stepper, scorer.batches[0]
    with torch.no_grad():
        h = batch.entering[n // 2]
        block_s = timed(lambda: stepper.block(n // 2, h, batch.ctx))
        head_s = timed(lambda: torch.log_softmax(stepper.logits(h)[:, :-1], dim=-1))
    alone = cost["block_passes"] * block_s + cost["head_passes"] * head_s
    best = min(scorer.known.items(), key=lambda kv: kv[1][0])
    print(f"- `exact` at k = {args.k} on {args.model} ({n} blocks, C({n}, {args.k}) = {math.comb(n, args.k):,} removals), {args.windows} windows x "
          f"{args.seq_len} tokens of {args.data}, {args.threads} threads: **{wall:.1f} s** ({len(every) / wall:.0f} removals a second)")
    print(f"- block passes: {cost['block_passes']:,.0f}, against the naive {math.comb(n, args.k):,} x {n - args.k} = {cost['naive_block_passes']:,.0f} "
          f"(**{cost['block_passes'] / cost['naive_block_passes']:.3f}x**) and the walk's own count {blocks:,} "
          f"(**{cost['block_passes'] / blocks:.3f}x**; chunks of {CHUNK} share no prefix across their boundary); head passes {cost['head_passes']:,.0f} (one a removal)")
    print(f"- timed alone: a block pass {block_s * 1e3:.2f} ms, a head pass {head_s * 1e3:.2f} ms ({head_s / block_s:.1f} blocks); the walk's passes "
          f"timed alone {alone:.1f} s, the walk **{wall / alone:.3f}x** that; the head's share of the passes' time "
          f"{cost['head_passes'] * head_s / alone:.0%}")
    print(f"- memory: the kept unpruned streams and reference log-probs {(kept - before) / 1024:.0f} MB; the walk's peak above them "
          f"{max(0, peak - kept) / 1024:.0f} MB (at most k + 1 = {args.k + 1} streams of {windows.numel() * model.config.hidden_size * 4 / 2**20:.2f} MB each)")
    print(f"- the optimum: without {best[0]}, loss {best[1][0]:.4f} (KL {best[1][1]:.4f})")


if __name__ == "__main__":
    main()
