"""`select` under torchrun against one process on the same cores: a search's wall time with its
removals shared over N ranks (one thread each) against one process with N threads, interleaved
(A B A B), and the block passes the ranks ran in all against one process's (the prefix walk may
run a prefix twice where two ranks' runs meet; an evo stage's offspring, never).

    python benchmarks/select/select_ranks.py --model smollm2-135m --k 2 --search exact --windows 2 --seq-len 64

Prints one Markdown list for docs/benchmarks.md ("The best k layers").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(ranks: int, args, out: Path) -> tuple[dict, dict]:
    """One select run: the search's cell, and every removal's calibration scores."""
    command = ["select", args.model, "--k", str(args.k), "--search", args.search, "--objective", args.objective, "--calibration", args.data,
               "--calib-windows", str(args.windows), "--eval-windows", "2", "--seq-len", str(args.seq_len), "--batch-size", str(args.windows),
               "--out", str(out)] + (["--search-args", args.search_args] if args.search_args else [])
    env = {**os.environ, "OMP_NUM_THREADS": str(args.cores // ranks)}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", "-m", "depthcurse"] if ranks > 1 \
        else [sys.executable, "-m", "depthcurse"]
    proc = subprocess.run(launcher + command, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{ranks} rank(s) failed: {proc.stderr[-2000:]}")
    record = json.loads((out / "select.json").read_text())
    cell = next(c for c in record["cells"].values() if c["search"] == args.search)
    return cell, record["calibration_scores"][args.data]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--search", default="exact")
    parser.add_argument("--search-args", default="")
    parser.add_argument("--objective", default="ppl")
    parser.add_argument("--data", default="wiki")
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--cores", type=int, default=2, help="threads of the one process; ranks of the launch (one thread each)")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    seconds: dict[int, list[float]] = {1: [], args.cores: []}
    cells, scores = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for ranks in (1, args.cores):  # A B A B
                cells[ranks], scores[ranks] = run(ranks, args, Path(tmp) / f"r{ranks}-{i}")
                seconds[ranks].append(cells[ranks]["seconds"])
    one, many = cells[1], cells[args.cores]
    same = one["layers"] == many["layers"]
    gap = max(abs(a - b) for key in scores[1] for a, b in zip(scores[1][key], scores[args.cores][key]))
    a, b = statistics.median(seconds[1]), statistics.median(seconds[args.cores])
    print(f"- `python benchmarks/select/select_ranks.py --model {args.model} --k {args.k} --search {args.search}"
          f"{' --search-args ' + args.search_args if args.search_args else ''} --windows {args.windows} --seq-len {args.seq_len}` "
          f"({args.cores} cores, {time.strftime('%Y-%m-%d')}): the {args.search} cell took {a:.1f} s in one process of {args.cores} threads "
          f"(runs {', '.join(f'{s:.1f}' for s in seconds[1])}) and {b:.1f} s on {args.cores} ranks of one thread "
          f"({', '.join(f'{s:.1f}' for s in seconds[args.cores])}): {a / b:.2f}x. Block passes: {many['cost']['block_passes']:,.1f} over the ranks "
          f"against {one['cost']['block_passes']:,.1f} alone ({many['cost']['block_passes'] / one['cost']['block_passes']:.3f}x). "
          f"The same removal chosen: {'yes' if same else 'NO'} ({one['layers']}); the largest difference of a calibration score, "
          f"threads against ranks: {gap:.2e}.")


if __name__ == "__main__":
    main()
