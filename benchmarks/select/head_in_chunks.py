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

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scorer_turns import arguments, exact_scorer, in_turns, ratio_line  # noqa: E402

from depthcurse.select import scoring  # noqa: E402


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--rows", type=int, default=128, help="positions the head scores at a time in A")
    args = parser.parse_args()
    scorer, every = exact_scorer(args.dtype)
    ways = {"chunked": lambda: setattr(scoring, "SCORE_ROWS", args.rows), "whole": lambda: setattr(scoring, "SCORE_ROWS", 10**9)}
    times, got = in_turns(scorer, every, args.chunks, args.size, ways)
    worst = max(abs(a - b) for r in got["whole"] for m in range(2) for a, b in zip(got["chunked"][r][m], got["whole"][r][m]))
    print(f"{ratio_line(times, 'chunked', 'whole', args.dtype, args.size)}; largest difference of a KL or loss {worst:.2e}")


if __name__ == "__main__":
    main()
