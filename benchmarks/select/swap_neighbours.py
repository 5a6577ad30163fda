"""Where `exact` cannot run (k = 8 of 30: 5.9 million removals), how good is a pick? Every removal
one swap away from it (one removed block put back, one kept block removed: k (n - k) of them)
scored on the same calibration windows by `CalibrationScorer.score_many`: a pick that none of them
beats is a local optimum of EvoPress's own move (its level-switch mutation), and the best
neighbour says how far the nearest better removal is, if any.

    python benchmarks/select/swap_neighbours.py --model smollm2-135m --removal 3,4,5,6,7,16,17,18 --objective kl

The windows are `select`'s (`--calib-windows 4 --eval-windows 16 --seq-len 64 --seed 1234`, the
calibration part), so the scores are those of the select runs in docs/probes-and-select.md.
Prints one Markdown line.
"""

from __future__ import annotations

import argparse
import time

from depthcurse.loading import load_model
from depthcurse.select.config import SelectConfig
from depthcurse.select.windows import text_windows
from depthcurse.select.scoring import CalibrationScorer
from depthcurse.select.search import key, parse_key


def neighbours(removal: tuple[int, ...], n: int) -> list[tuple[int, ...]]:
    """Every removal one swap from `removal`: one of its blocks kept instead, one kept block removed."""
    kept = [i for i in range(n) if i not in removal]
    return [tuple(sorted((set(removal) - {out}) | {into})) for out in removal for into in kept]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--removal", action="append", required=True, help="a removal, e.g. 3,4,5,6,7,16,17,18 (repeat for several)")
    parser.add_argument("--objective", default="kl", choices=("ppl", "kl"))
    parser.add_argument("--data", default="wiki")
    parser.add_argument("--calib-windows", type=int, default=4)
    parser.add_argument("--eval-windows", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    loaded = load_model(args.model, fp32_on_cpu="as this benchmark's figures in docs/benchmarks.md were measured")
    model = loaded.model.eval()
    cfg = SelectConfig(k=1, calibration=(args.data,), calib_windows=args.calib_windows, eval_windows=args.eval_windows, seq_len=args.seq_len, seed=args.seed)
    windows = text_windows(loaded.tokenizer, args.data, cfg).calibration
    scorer = CalibrationScorer(model, windows, cfg.batch_size, {}, lambda: None)
    for text in args.removal:
        removal = parse_key(text)
        around = neighbours(removal, scorer.n)
        started = time.perf_counter()
        scores = scorer.score_many([removal, *around])  # the prefix walk, under no_grad itself
        seconds = time.perf_counter() - started
        own = scores[0][args.objective]
        ranked = sorted(zip((s[args.objective] for s in scores[1:]), around))
        better = [(s, r) for s, r in ranked if s < own]
        best_score, best = ranked[0]
        print(f"- {{{key(removal)}}}: {args.objective} {own:.4f} on the calibration windows; of its {len(around)} swap neighbours "
              f"{len(better)} score lower" + (f" (the best, {{{key(best)}}}, {best_score:.4f}: {best_score - own:+.4f})" if better else
                                               f": a local optimum (the nearest, {{{key(best)}}}, {best_score - own:+.4f})")
              + f"; {seconds:.0f} s.")


if __name__ == "__main__":
    main()
