"""This machine's matrix-multiply peak in fp32 and bf16 at the shapes a block runs (issue 82, item 3).

    .venv/bin/python benchmarks/machine/gemm_peak.py                     # SmolLM2-135M's block shapes, 512 tokens
    .venv/bin/python benchmarks/machine/gemm_peak.py --tokens 1024 --width 896 --intermediate 4864   # Qwen2.5-0.5B's

For each of a block's matmuls (q, k and v, o; gate, up, down at their widths) and for one decoding
step's (one token), torch.matmul in fp32 and in bf16, timed in turns (A B A B) with a warm-up, the
median of `--repeats` pairs: achieved GFLOP/s each way and bf16's speedup. A job's floor is then its
arithmetic at these rates (prefill, a sweep) or its weights' bytes at the memory bandwidth
(decoding: the one-token rows, which read every weight for one row of arithmetic).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch


def timed(fn, repeats: int) -> float:
    fn()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats


SMOLLM2_BLOCK = {"q, o": (576, 576), "k, v": (576, 192), "gate, up": (576, 1536), "down": (1536, 576)}


def rates(rows: int, k: int, n: int, pairs: int = 7, repeats: int = 5) -> tuple[list[float], list[float]]:
    """Seconds of one [rows, k] x [k, n] matmul in fp32 and in bf16, `pairs` of each in turns."""
    g = torch.Generator().manual_seed(0)
    x32, w32 = torch.randn(rows, k, generator=g), torch.randn(k, n, generator=g)
    x16, w16 = x32.bfloat16(), w32.bfloat16()
    fp32, bf16 = [], []
    for _ in range(pairs):  # A B A B: a machine that changes speed changes both
        fp32.append(timed(lambda: torch.matmul(x32, w32), repeats))
        bf16.append(timed(lambda: torch.matmul(x16, w16), repeats))
    return fp32, bf16


def peak_rates(rows: int = 512, shapes: dict = SMOLLM2_BLOCK) -> dict[str, float]:
    """The fastest of a block's matmuls at `rows` rows, GFLOP/s in fp32 and in bf16: the rate a
    job's arithmetic cannot beat here (its floor is its FLOPs at this rate)."""
    best = {"fp32": 0.0, "bf16": 0.0}
    for k, n in shapes.values():
        fp32, bf16 = rates(rows, k, n)
        flops = 2 * rows * k * n
        best = {"fp32": max(best["fp32"], flops / statistics.median(fp32) / 1e9), "bf16": max(best["bf16"], flops / statistics.median(bf16) / 1e9)}
    return best


def bandwidth(size_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes a second this machine reads from memory: the median of `repeats` sums over a buffer far
    larger than any cache (a decoding step's floor is its weights' bytes at this rate)."""
    buffer = torch.ones(size_bytes // 4)
    buffer.sum()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        buffer.sum()
        times.append(time.perf_counter() - started)
    return size_bytes / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--width", type=int, default=576)
    parser.add_argument("--kv-width", type=int, default=192, help="k and v's width (grouped-query attention)")
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    d, kv, f = args.width, args.kv_width, args.intermediate
    shapes = {"q, o": (d, d), "k, v": (d, kv), "gate, up": (d, f), "down": (f, d)}
    print(f"{platform.processor() or platform.machine()}, {args.threads} threads, torch {torch.__version__}, bf16 on the CPU: "
          f"{torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()}")
    print("| matmul | rows | fp32 GFLOP/s | bf16 GFLOP/s | bf16 speedup (median of pairs, in turns) |")
    print("|---|---|---|---|---|")
    for rows in (args.tokens, 1):
        for name, (k, n) in shapes.items():
            fp32, bf16 = rates(rows, k, n, args.pairs, args.repeats)
            flops = 2 * rows * k * n
            ratios = [a / b for a, b in zip(fp32, bf16)]
            print(f"| {name} ({k} x {n}) | {rows} | {flops / statistics.median(fp32) / 1e9:.1f} | {flops / statistics.median(bf16) / 1e9:.1f} | "
                  f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) |")
    print(f"memory bandwidth (sums over 1 GiB): {bandwidth() / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
