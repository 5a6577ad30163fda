"""select's scorer with the head run a chunk of positions at a time against the whole batch at once
(issue 89, item 4): `exact` at k = 2 on SmolLM2-135M, in turns in one process.

    .venv/bin/python benchmarks/select/head_in_chunks.py --dtype fp32 --chunks 8 --rows 128

The scorer is `exact`'s (`CalibrationScorer.per_window` over chunks of the k = 2 removals, 4 x 64
wiki tokens); A runs `head_scores` `--rows` positions at a time, B with the whole batch in one chunk
(the default, `SCORE_ROWS` None: every position's logits and log-probs at once). Each chunk of removals is
scored by A and B in turns (A B, then B A), their windows' figures forgotten before each, and every
removal's KL and loss on every window compared. Prints the median ratio A / B with its pairs' range and the largest
difference of any figure.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from depthcurse.io import cpu_model  # noqa: E402
from depthcurse.loading import load_model  # noqa: E402
from depthcurse.select import scoring  # noqa: E402
from depthcurse.select.config import SelectConfig  # noqa: E402
from depthcurse.select.scoring import CalibrationScorer  # noqa: E402
from depthcurse.select.windows import text_windows  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--size", type=int, default=55, help="removals a chunk scores")
    parser.add_argument("--rows", type=int, default=128, help="positions the head scores at a time in A")
    args = parser.parse_args()
    loaded = load_model("smollm2-135m", dtype=args.dtype)
    cfg = SelectConfig(k=2, calibration=("wiki",), calib_windows=4, eval_windows=2, seq_len=64, batch_size=4)
    windows = text_windows(loaded.tokenizer, "wiki", cfg).calibration
    scorer = CalibrationScorer(loaded.model, windows, 4, {}, lambda: None)
    every = list(itertools.combinations(range(scorer.n), 2))
    chunks = [every[i * args.size:(i + 1) * args.size] for i in range(args.chunks)]
    rows = {"chunked": args.rows, "whole": 10**9}
    times, got = {name: [] for name in rows}, {name: {} for name in rows}
    for r, chunk in enumerate(chunks):
        for name in (list(rows) if r % 2 == 0 else list(rows)[::-1]):
            scoring.SCORE_ROWS = rows[name]
            scorer.windowed.clear()
            started = time.perf_counter()
            for removal, (losses, kls, _) in zip(chunk, scorer.per_window(chunk)):  # every window measured again: nothing kept
                got[name][removal] = {"ppl": losses, "kl": kls}
            times[name].append(time.perf_counter() - started)
    ratios = [a / b for a, b in zip(times["chunked"], times["whole"])]
    worst = max(abs(a - b) for r in got["whole"] for m in ("kl", "ppl") for a, b in zip(got["chunked"][r][m], got["whole"][r][m]))
    print(f"{cpu_model()}, {torch.get_num_threads()} threads, {args.dtype}, {time.strftime('%Y-%m-%d')}: "
          f"chunked {sum(times['chunked']):.2f} s, whole {sum(times['whole']):.2f} s over {len(chunks)} chunks of {args.size} removals; "
          f"chunked / whole {statistics.median(ratios):.3f} (pairs {min(ratios):.3f}-{max(ratios):.3f}); largest difference of a KL or loss {worst:.2e}")


if __name__ == "__main__":
    main()
