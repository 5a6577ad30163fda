"""RMSNorm, the rotary embedding and the rest of a block fused by torch.compile: does it pay on this
CPU, in fp32 and in bf16? (issue 89, item 3)

    .venv/bin/python benchmarks/machine/block_compiled.py --rounds 7

The block `--dtype auto` measures (`cpu_precision._block`: one Llama block of SmolLM2-135M's shape,
RMSNorm in fp32 as transformers computes it, rotary, causal attention, SwiGLU) over 2 x 128 tokens,
eager and through `torch.compile` (Inductor's default mode: the elementwise work around the matmuls
fused into generated C++ loops), in fp32 and bf16: the four run in turns in one process, the order
turned round each round, after a first call of each (the compile). Prints each one's median time,
its ratio to eager fp32, and the compiled output's largest difference from eager's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from depthcurse.cpu_precision import BlockShape, _block  # noqa: E402
from depthcurse.io import cpu_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    shape = BlockShape(576, 1536, 9)
    runs, compile_s, diff = {}, {}, {}
    for dtype in ("fp32", "bf16"):
        eager = _block(shape, getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[dtype]))
        compiled = torch.compile(eager)
        start = time.perf_counter()
        out = compiled()
        compile_s[dtype] = time.perf_counter() - start
        diff[dtype] = (out.float() - eager().float()).abs().max().item()
        runs[f"{dtype} eager"], runs[f"{dtype} compiled"] = eager, compiled
    took = {name: [] for name in runs}
    for r in range(args.rounds):
        for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            start = time.perf_counter()
            runs[name]()
            took[name].append(time.perf_counter() - start)
    base = statistics.median(took["fp32 eager"])
    print(f"{cpu_model()}, {torch.get_num_threads()} threads, {time.strftime('%Y-%m-%d')}, torch {torch.__version__}")
    print("| block, 2 x 128 tokens | median (ms) | against eager fp32 | compile (s) | largest difference from eager |")
    print("|---|---|---|---|---|")
    for name, times in took.items():
        dtype, how = name.split()
        median = statistics.median(times)
        compiled = f"{compile_s[dtype]:.1f} | {diff[dtype]:.1e}" if how == "compiled" else "- | -"
        print(f"| {name} | {median * 1e3:.2f} | {median / base:.2f}x | {compiled} |")


if __name__ == "__main__":
    main()
