"""select's prefix walk with the heads of removals that reach them one after another scored in one
matmul (`scoring.HEAD_ROWS` positions) against each removal's head alone (issue 89, item 4): `exact`
at k = 2 on SmolLM2-135M, in turns in one process.

    .venv/bin/python benchmarks/select/heads_together.py --dtype fp32 --chunks 8 --rows 1024

A scores up to `--rows` positions of waiting removals at once, B each removal's 252 alone
(`HEAD_ROWS` 0, the walk before), in turns (`scorer_turns`). Prints the median ratio A / B with its
pairs' range and the largest difference of each figure of any window.
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
    parser.add_argument("--rows", type=int, default=1024, help="positions the head scores at once in A")
    args = parser.parse_args()
    scorer, every = exact_scorer(args.dtype)
    ways = {"together": lambda: setattr(scoring, "HEAD_ROWS", args.rows), "alone": lambda: setattr(scoring, "HEAD_ROWS", 0)}
    times, got = in_turns(scorer, every, args.chunks, args.size, ways)
    worst = [max(abs(a - b) for r in got["alone"] for a, b in zip(got["together"][r][m], got["alone"][r][m])) for m in range(3)]
    print(f"{ratio_line(times, 'together', 'alone', args.dtype, args.size)}; "
          f"largest difference of a loss {worst[0]:.2e}, a KL {worst[1]:.2e}, an agreement {worst[2]:.2e}")


if __name__ == "__main__":
    main()
