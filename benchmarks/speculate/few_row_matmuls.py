"""Why speculate's check of gamma + 1 tokens costs more than 1.3 decoding steps on a CPU: the
matmuls of a few rows (issue 89, item 5).

    .venv/bin/python benchmarks/speculate/few_row_matmuls.py --rounds 9

A decoding step reads every weight for one row; a check of 6 tokens reads them once for 6 rows, so
at the bytes' floor both take the weights' bytes at the memory bandwidth, and the check ought to cost
about one step. This times SmolLM2-135M's matmuls (30 layers' q, k, v, o, gate, up and down, random
weights of its shapes, each its own tensor as in the model, so they stream from memory; then the
tied head, 49,152 x 576) at 1 to 8 rows in fp32, each way of computing them in turns in one process
(the order turned round each round):
    linear      `torch.nn.functional.linear(x, w)`, what the model runs (MKL's sgemm)
    x @ wT      the weight transposed once and kept (MKL's sgemm without the transposed operand)
    onednn      oneDNN's linear on a weight packed once for that many rows (Inductor's CPU path)
    rows of 2   the rows two at a time, each pair's matmul reading the weight again
    kernel      depthcurse's few-row kernel (`few_row_linear`), as speculate's check runs it: each
                layer an `nn.Linear` inside `few_row_kernel` (at one row that is torch's linear)
and with `--autotune`, Inductor's `max-autotune` (each layer's seven matmuls compiled, its GEMM
templates tuned for that many rows: about a minute of tuning) against eager, on the layers alone.
Prints, per way and rows, the layers' and the head's median time and its ratio to `linear` at one
row: what a check of that many tokens pays for its matmuls in decoding steps' matmuls.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from depthcurse.few_row_linear import few_row_kernel, status  # noqa: E402
from depthcurse.io import cpu_model  # noqa: E402

SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]  # (out, in): q k v o gate up down
HEAD = (49152, 576)


def ways(weights: list[torch.Tensor], rows: int, stack: contextlib.ExitStack) -> dict:
    """Each way of computing every matmul in `weights` for `rows` rows, as a function of no arguments
    (the kernel's layers stay patched until `stack` closes)."""
    g = torch.Generator().manual_seed(1)
    inputs = {width: torch.randn(rows, width, generator=g) for width in {w.shape[1] for w in weights}}
    transposed = [w.t().contiguous() for w in weights]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]
    layers = torch.nn.ModuleList(torch.nn.Linear(w.shape[1], w.shape[0], bias=False) for w in weights)
    for layer, w in zip(layers, weights):
        layer.weight = torch.nn.Parameter(w, requires_grad=False)  # the same tensor: the same bytes to stream
    stack.enter_context(few_row_kernel(layers))
    return {
        "kernel": lambda: [layer(inputs[layer.in_features]) for layer in layers],
        "linear": lambda: [F.linear(inputs[w.shape[1]], w) for w in weights],
        "x @ wT": lambda: [inputs[w.shape[0]] @ w for w in transposed],
        "onednn": lambda: [torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], p, None, "none", [], "") for w, p in zip(weights, packed)],
        "rows of 2": lambda: [torch.cat([F.linear(x, w) for x in inputs[w.shape[1]].split(2)]) for w in weights],
    }


def autotuned(weights: list[torch.Tensor], rows: int) -> dict:
    """The layers' matmuls, each layer's seven compiled by Inductor's max-autotune, and eager."""
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = 64  # a graph per layer
    layers = [torch.nn.ModuleList(torch.nn.Linear(w.shape[1], w.shape[0], bias=False) for w in weights[i: i + len(SHAPES)])
              for i in range(0, len(weights), len(SHAPES))]
    for i, layer in enumerate(layers):
        for linear, w in zip(layer, weights[i * len(SHAPES):]):
            linear.weight.data = w
    g = torch.Generator().manual_seed(1)
    inputs = {width: torch.randn(rows, width, generator=g) for width in {w.shape[1] for w in weights}}
    run = lambda layer: [linear(inputs[linear.in_features]) for linear in layer]  # noqa: E731
    compiled = [torch.compile(lambda layer=layer: run(layer), mode="max-autotune-no-cudagraphs") for layer in layers]
    start = time.perf_counter()
    for fn in compiled:
        fn()
    print(f"max-autotune at {rows} rows: {time.perf_counter() - start:.1f} s of compiling and tuning", flush=True)
    return {"eager": lambda: [run(layer) for layer in layers], "max-autotune": lambda: [fn() for fn in compiled]}


def timed(work: dict, rounds: int) -> dict[str, float]:
    took = {name: [] for name in work}
    for fn in work.values():
        fn()
    for r in range(rounds):
        for name in (list(work) if r % 2 == 0 else list(work)[::-1]):
            start = time.perf_counter()
            work[name]()
            took[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in took.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--rows", default="1,2,4,6,8")
    parser.add_argument("--autotune", type=int, metavar="ROWS", help="also Inductor's max-autotune at this many rows (the layers alone)")
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    layers = [torch.randn(o, i, generator=g) * 0.02 for _ in range(30) for o, i in SHAPES]
    head = [torch.randn(*HEAD, generator=g) * 0.02]
    print(f"{cpu_model()}, {torch.get_num_threads()} threads, {time.strftime('%Y-%m-%d')}, torch {torch.__version__}, fp32")
    print("| rows | way | 30 layers (ms) | head (ms) | both, in one-row `linear`s |")
    print("|---|---|---|---|---|")
    one = None
    print(f"kernel: {status()}")
    with torch.inference_mode(), contextlib.ExitStack() as stack:
        for rows in map(int, args.rows.split(",")):
            body, top = timed(ways(layers, rows, stack), args.rounds), timed(ways(head, rows, stack), args.rounds)
            if one is None:
                one = body["linear"] + top["linear"]
            for name in body:
                print(f"| {rows} | {name} | {body[name] * 1e3:.1f} | {top[name] * 1e3:.1f} | {(body[name] + top[name]) / one:.2f} |", flush=True)
    if args.autotune:
        with torch.no_grad():  # outside inference_mode: the compiled modules' weights are Parameters
            got = timed(autotuned(layers, args.autotune), args.rounds)
        print(f"| {args.autotune} | the layers, eager / max-autotune | {got['eager'] * 1e3:.1f} / {got['max-autotune'] * 1e3:.1f} | - | - |")


if __name__ == "__main__":
    main()
