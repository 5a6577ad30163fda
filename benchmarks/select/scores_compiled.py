"""The vocabulary's work of select's scorer, eager against `torch.compile`d, in turns (issue 89, item 4).

    .venv/bin/python benchmarks/select/scores_compiled.py --positions 252 --rounds 10

`select.scoring.position_scores` (a removal's log-softmax over SmolLM2's 49,152-token vocabulary, the
loss, the KL against the unpruned model's p and the top-1 agreement) on `--positions` positions of
fp32 logits, eager and compiled by Inductor (static shapes), alternating round by round. Prints the
compile time, each one's median time, their ratio, and each one's largest KL error against the same
sums in float64. Nothing in depthcurse compiles it yet: this measures whether it would pay.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from depthcurse.io import cpu_model  # noqa: E402
from depthcurse.select.scoring import Reference, position_scores  # noqa: E402

VOCAB = 49152


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--positions", type=int, default=252, help="4 windows x 63 predictions: a batch of exact's scorer")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    unpruned = torch.randn(args.positions, VOCAB, generator=gen) * 4
    logits = unpruned + torch.randn(args.positions, VOCAB, generator=gen) * 0.3  # a removal's: near the unpruned model's
    reference = Reference.of(torch.log_softmax(unpruned, -1))
    targets = torch.randint(0, VOCAB, (args.positions,), generator=gen)
    exact = (reference.probs.double() * (torch.log_softmax(unpruned.double(), -1) - torch.log_softmax(logits.double(), -1))).sum(-1)

    def eager(z):
        return position_scores(torch.log_softmax(z, -1), targets, reference)

    started = time.perf_counter()
    compiled = torch.compile(eager, dynamic=False)
    compiled(logits)
    compile_s = time.perf_counter() - started
    times = {"eager": [], "compiled": []}
    errors = {}
    for r in range(args.rounds):
        for name, fn in (("eager", eager), ("compiled", compiled)) if r % 2 == 0 else (("compiled", compiled), ("eager", eager)):
            start = time.perf_counter()
            out = fn(logits)
            times[name].append(time.perf_counter() - start)
            errors[name] = (out[1].double() - exact).abs().max().item()
    eager_s, compiled_s = statistics.median(times["eager"]), statistics.median(times["compiled"])
    print(f"{cpu_model()}, {torch.get_num_threads()} threads, {time.strftime('%Y-%m-%d')}: {args.positions} positions x {VOCAB:,}: "
          f"compile {compile_s:.1f} s; eager {eager_s * 1e3:.1f} ms, compiled {compiled_s * 1e3:.1f} ms (median of {args.rounds}): "
          f"{compiled_s / eager_s:.2f}x; largest KL error against float64: eager {errors['eager']:.1e}, compiled {errors['compiled']:.1e}")


if __name__ == "__main__":
    main()
