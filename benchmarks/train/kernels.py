"""Chunked linear + cross-entropy against the naive `F.cross_entropy(hidden @ W.T, targets)`:
peak memory and time of one forward + backward (loss, grads of hidden and W).

Each variant runs in a child process of its own; the peak is measured per step as
`peak_memory.py` describes (resident-set rise on the CPU, torch.cuda.max_memory_allocated on
CUDA). Example:

    .venv/bin/python benchmarks/train/kernels.py                       # N=4096, d=256, V=49152, fp32, CPU
    .venv/bin/python benchmarks/train/kernels.py --tokens 16384 --chunk-size 1024 --out /tmp/k.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import sys
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: peak_memory, which every command's scripts share
from peak_memory import PeakMemory, run_variants, write_json  # noqa: E402

VARIANTS = ("naive", "chunked")


def run_variant(args) -> dict:
    """One variant, in this (child) process: a warm-up step, then timed steps; prints JSON."""
    import torch
    import torch.nn.functional as F

    from depthcurse.train.kernels import default_chunk_size, fused_linear_cross_entropy

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=g).to(device, dtype).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=g) * args.hidden**-0.5).to(device, dtype).requires_grad_()
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=g).to(device)
    chunk = args.chunk_size or default_chunk_size(args.tokens, args.hidden, args.vocab, device.type)

    def step():
        if args.variant == "naive":
            loss = F.cross_entropy(hidden @ weight.T, targets)
        else:
            loss = fused_linear_cross_entropy(hidden, weight, targets, chunk_size=chunk)
        loss.backward()
        return loss.detach()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    peaks, seconds = [], []
    memory = PeakMemory(device)
    for i in range(args.repeats + 1):
        hidden.grad = weight.grad = None
        sync()
        memory.start()
        started = time.perf_counter()
        loss = step()
        sync()
        elapsed = time.perf_counter() - started
        peaks.append(memory.rise())
        if i > 0:  # the first step warms up allocator and kernels
            seconds.append(elapsed)
    return {
        "variant": args.variant, "chunk_size": chunk if args.variant == "chunked" else None,
        "loss": loss.item(), "grad_hidden_abs_sum": hidden.grad.float().abs().sum().item(),
        "grad_weight_abs_sum": weight.grad.float().abs().sum().item(),
        "peak_bytes": max(peaks), "seconds": seconds, "median_seconds": statistics.median(seconds),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--chunk-size", type=int, default=None, help="rows per chunk (default: depthcurse.train.kernels.default_chunk_size)")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="timed steps after one warm-up step")
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # set in the child processes
    args = parser.parse_args()

    if args.variant:
        print(json.dumps(run_variant(args)))
        return

    results, conditions = run_variants(__file__, VARIANTS)
    load_before = conditions["load_average_before"]
    naive, chunked = results["naive"], results["chunked"]
    summary = {
        "shape": {"tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab, "dtype": args.dtype},
        "device": args.device, "threads": args.threads, "repeats": args.repeats, **conditions,
        "results": results,
        "peak_memory_ratio_chunked_over_naive": chunked["peak_bytes"] / naive["peak_bytes"],
        "time_ratio_chunked_over_naive": chunked["median_seconds"] / naive["median_seconds"],
        "loss_abs_diff": abs(chunked["loss"] - naive["loss"]),
    }
    print(f"N={args.tokens} d={args.hidden} V={args.vocab} {args.dtype} on {args.device}, {args.threads} threads, "
          f"load average before {load_before[0]:.2f}, after {summary['load_average_after'][0]:.2f}")
    print(f"{'variant':<8} {'chunk':>6} {'peak MB':>9} {'median s':>9}  steps (s)")
    for r in (naive, chunked):
        print(f"{r['variant']:<8} {str(r['chunk_size'] or '-'):>6} {r['peak_bytes'] / 1e6:>9.1f} {r['median_seconds']:>9.3f}  "
              + " ".join(f"{s:.3f}" for s in r["seconds"]))
    print(f"chunked / naive: peak memory {summary['peak_memory_ratio_chunked_over_naive']:.3f}, "
          f"time {summary['time_ratio_chunked_over_naive']:.3f}; |loss difference| {summary['loss_abs_diff']:.2e}; "
          f"|grad| sums naive {naive['grad_hidden_abs_sum']:.6g} / {naive['grad_weight_abs_sum']:.6g}, "
          f"chunked {chunked['grad_hidden_abs_sum']:.6g} / {chunked['grad_weight_abs_sum']:.6g}")
    write_json(args.out, summary)


if __name__ == "__main__":
    main()
