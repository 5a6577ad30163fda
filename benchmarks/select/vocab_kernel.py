"""select's scorer with the vocabulary's work by depthcurse's kernel (`vocab_scores`: each row of
logits read once) against torch's log-softmax, product and argmax (issue 89, item 4): `exact` at
k = 2 on SmolLM2-135M, in turns in one process.

    .venv/bin/python benchmarks/select/vocab_kernel.py --dtype fp32 --chunks 8

A scores the logits by the kernel, B by torch's path (what `DEPTHCURSE_VOCAB_KERNEL=0` gives), the
heads together as `scoring.HEAD_ROWS` has them, in turns (`scorer_turns`). Prints the median ratio
A / B with its pairs' range, the largest relative difference of a window's loss and KL, the windows
whose agreement differs, and the vocabulary's work alone at 1,008 positions in both ways.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scorer_turns import arguments, exact_scorer, in_turns, ratio_line  # noqa: E402

from depthcurse import vocab_scores  # noqa: E402
from depthcurse.select import scoring  # noqa: E402
from depthcurse.select.scoring import Reference  # noqa: E402


def alone(rounds: int = 5) -> str:
    """The vocabulary's work on 4 x 252 positions of random logits against one reference, both ways in turns."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 252, 49152, generator=g) * 4
    reference = Reference.of(torch.log_softmax(torch.randn(252, 49152, generator=g) * 4, -1))
    targets = torch.randint(0, 49152, (252,), generator=g)
    ways = {"kernel": lambda: scoring.logit_scores(logits, targets, reference),
            "torch": lambda: scoring.position_scores(torch.log_softmax(logits, -1), targets, reference)}
    times = {name: [] for name in ways}
    for r in range(rounds):
        for name in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
            started = time.perf_counter()
            ways[name]()
            times[name].append(time.perf_counter() - started)
    return f"alone, 1,008 x 49,152 logits: kernel {statistics.median(times['kernel']) * 1e3:.1f} ms, torch {statistics.median(times['torch']) * 1e3:.1f} ms (medians of {rounds})"


def main() -> None:
    parser = arguments(__doc__)
    args = parser.parse_args()
    print(f"vocabulary: {vocab_scores.status()}")
    scorer, every = exact_scorer(args.dtype)
    kernel = vocab_scores.takes
    ways = {"kernel": lambda: setattr(vocab_scores, "takes", kernel), "torch": lambda: setattr(vocab_scores, "takes", lambda logits: False)}
    times, got = in_turns(scorer, every, args.chunks, args.size, ways)
    vocab_scores.takes = kernel
    worst = [max(abs(a - b) / max(abs(b), 1e-9) for r in got["torch"] for a, b in zip(got["kernel"][r][m], got["torch"][r][m])) for m in range(2)]
    flips = sum(a != b for r in got["torch"] for a, b in zip(got["kernel"][r][2], got["torch"][r][2]))
    print(f"{ratio_line(times, 'kernel', 'torch', args.dtype, args.size)} (HEAD_ROWS {scoring.HEAD_ROWS}); "
          f"largest relative difference of a window's loss {worst[0]:.1e}, of its KL {worst[1]:.1e}; windows whose agreement differs: {flips}")
    print(alone())


if __name__ == "__main__":
    main()
