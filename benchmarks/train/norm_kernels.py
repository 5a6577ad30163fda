"""The trainer's norm (residual add, RMSNorm, LNS scale) forward and backward, three ways:
PyTorch eagerly, the same code compiled by inductor (what `--compile --kernels off` runs),
and our Triton kernels (`--kernels triton`), with the memory traffic each must at least move,
as GB/s and as a share of the device's bandwidth.

The default shape is one 130M micro-batch of 512 x 256 tokens at width 768, as bf16-mixed
training has it: the branch output in bf16, the residual stream in fp32, and y in bf16 for the
matmuls after it. A norm moves little arithmetic, so bandwidth is its measure. Gradients come
back for y and for the new stream r, as in a block. Example:

    .venv/bin/python benchmarks/train/norm_kernels.py --tokens 4096                       # CPU: eager, compiled
    TRITON_INTERPRET=1 .venv/bin/python benchmarks/train/norm_kernels.py --tokens 64 --repeats 1   # and Triton, interpreted
    python benchmarks/train/norm_kernels.py --device cuda --backward-programs 1,2,4,8    # and Triton's backward grid
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import sys
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: peak_memory, which every command's scripts share
from peak_memory import write_json  # noqa: E402

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def min_bytes(tokens: int, hidden: int, x_size: int, r_size: int, y_size: int) -> dict:
    """What any implementation must read and write. Forward: read x and the residual, write y
    and r. Backward: read dy, dr and r, write d x and d residual."""
    row = tokens * hidden
    forward = row * (x_size + r_size + y_size + r_size)
    backward = row * (y_size + 2 * r_size + x_size + r_size)
    return {"forward": forward, "backward": backward}


def time_steps(step, sync, repeats: int) -> list[float]:
    step()  # compiles, and warms the allocator
    sync()
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        sync()
        seconds.append(time.perf_counter() - started)
    return seconds


def measure(args) -> list[dict]:
    import torch

    from depthcurse.train import kernels

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    x_dtype, r_dtype, y_dtype = (getattr(torch, DTYPES[d]) for d in (args.x_dtype, args.residual_dtype, args.y_dtype))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.tokens, args.hidden, generator=g).to(device, x_dtype).requires_grad_()
    residual = torch.randn(args.tokens, args.hidden, generator=g).to(device, r_dtype).requires_grad_()
    weight = (1 + 0.1 * torch.randn(args.hidden, generator=g)).to(device).requires_grad_()
    dy = torch.randn(args.tokens, args.hidden, generator=g).to(device, y_dtype)
    dr = torch.randn(args.tokens, args.hidden, generator=g).to(device, r_dtype)
    scale = 1 / 7**0.5  # LNS at the 7th layer
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    def norm_on(triton_path, fn=kernels.rms_norm):
        return lambda: fn(x, weight, args.eps, scale, residual=residual, use_triton=triton_path, out_dtype=y_dtype)

    ways = {"eager": norm_on(False), "compiled": norm_on(False, torch.compile(kernels.rms_norm))}
    if kernels.triton_available() and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"):  # the interpreter: to check, not to time
        ways["triton"] = norm_on(True)
    bytes_ = min_bytes(args.tokens, args.hidden, x.element_size(), residual.element_size(), dy.element_size())
    want = None
    rows = []
    for way, norm in ways.items():
        grids = args.backward_programs if way == "triton" else [None]
        for per_sm in grids:
            if per_sm is not None:
                from depthcurse.train import triton_kernels

                triton_kernels.BACKWARD_PROGRAMS_PER_SM = per_sm

            def forward():
                with torch.no_grad():
                    return norm()

            def both():
                for t in (x, residual, weight):
                    t.grad = None
                y, r = norm()
                torch.autograd.backward((y, r), (dy, dr))

            fwd = time_steps(forward, sync, args.repeats)
            total = time_steps(both, sync, args.repeats)
            grads = [t.grad.float() for t in (x, residual, weight)]
            want = want or grads
            f, t = statistics.median(fwd), statistics.median(total)
            row = {"way": way, "backward_programs_per_sm": per_sm, "forward_s": f, "forward_backward_s": t,
                   "forward_gbs": bytes_["forward"] / f / 1e9, "forward_backward_gbs": (bytes_["forward"] + bytes_["backward"]) / t / 1e9,
                   "max_grad_difference": max((a - b).abs().max().item() for a, b in zip(grads, want))}
            if args.peak_gbs:
                row["bandwidth_share"] = row["forward_backward_gbs"] / args.peak_gbs
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=512 * 256)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--x-dtype", choices=DTYPES, default="bf16", help="the branch output's dtype")
    parser.add_argument("--residual-dtype", choices=DTYPES, default="fp32", help="the residual stream's dtype")
    parser.add_argument("--y-dtype", choices=DTYPES, default="bf16", help="the norm's output dtype (the matmuls' under autocast)")
    parser.add_argument("--eps", type=float, default=1e-6)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20, help="timed calls after one untimed")
    parser.add_argument("--backward-programs", default=[1], type=lambda text: [int(n) for n in text.split(",")], metavar="N,N,...",
                        help="Triton's backward programs per SM to try, comma-separated")
    parser.add_argument("--peak-gbs", type=float, default=None, help="the device's memory bandwidth (H100 SXM: 3350), for the share")
    parser.add_argument("--out", type=Path, default=None, help="also write the rows as JSON here")
    args = parser.parse_args()
    rows = measure(args)
    print(f"{args.tokens} x {args.hidden}, x {args.x_dtype}, residual {args.residual_dtype}, y {args.y_dtype}, {args.device}")
    print(f"{'way':<9} {'bwd/SM':>6} {'fwd ms':>8} {'fwd GB/s':>9} {'fwd+bwd ms':>11} {'GB/s':>7}" + ("  share" if args.peak_gbs else "") + "  max grad diff")
    for r in rows:
        print(f"{r['way']:<9} {r['backward_programs_per_sm'] or '':>6} {r['forward_s'] * 1e3:>8.3f} {r['forward_gbs']:>9.1f} "
              f"{r['forward_backward_s'] * 1e3:>11.3f} {r['forward_backward_gbs']:>7.1f}"
              + (f"  {r['bandwidth_share']:>5.1%}" if args.peak_gbs else "") + f"  {r['max_grad_difference']:.2e}")
    if args.out:
        write_json(args.out, {"args": {k: v for k, v in vars(args).items() if k != "out"}, "rows": rows})


if __name__ == "__main__":
    main()
