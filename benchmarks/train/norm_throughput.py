"""What each normalisation costs a training step, against Pre-LN's, in one process and in turns.

Every variant is built as `lns-train` builds it (`build_model` + `parallelize`: the same preset,
precision, kernels and compile settings) and steps on the same random batches; a round takes one
step of each, in alternating order (A B C ..., then ... C B A), so a machine that slows down
slows every variant of a round alike. The figure is each variant's median over the rounds of
(its step's seconds / Pre-LN's step's seconds in the same round), with a 95% interval for that
median (`depthcurse.speed.paired`); rounds go on until every interval is within 5% or the time
runs out. DyT's tanh has no statistic to fuse: under `--kernels triton` it runs in PyTorch while
the RMSNorms run in Triton, which is part of what this measures.

    .venv/bin/python benchmarks/train/norm_throughput.py                                    # tiny, CPU
    python3 benchmarks/train/norm_throughput.py --device cuda --preset 130m --batch-size 64   # Triton kernels, bf16-mixed
    python3 benchmarks/train/norm_throughput.py --device cuda --preset 130m --batch-size 64 --compile
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

NORMS = ("pre", "lns", "mix", "dyt", "hybridnorm", "completep")


def measure(norms=NORMS, *, preset: str = "tiny", device: str = "cpu", batch_size: int = 8, seq_len: int = 128, kernels: str = "auto",
            compile: bool = False, warmup: int = 2, max_rounds: int = 40, deadline: float | None = None, vocab: int = 32100,
            shape: dict | None = None) -> dict:
    """Each of `norms` (Pre-LN first, the reference) stepped in turns; returns the figures, as far
    as they came by `deadline` (time.monotonic()): a variant not built and warmed up by then is
    left out and named in `not_reached`. `shape`: TrainConfig fields over the preset's."""
    import torch

    from depthcurse.runtime import peak_tflops
    from depthcurse.speed.paired import MIN_PAIRS, PairedRatio
    from depthcurse.train import loop as train
    from depthcurse.train.config import TrainConfig
    from depthcurse.train.data import Batch
    from depthcurse.train.distributed import World, parallelize

    norms = ("pre", *[n for n in norms if n != "pre"])
    gpu = torch.device(device)
    g = torch.Generator().manual_seed(0)
    runs, built = {}, {}
    late = lambda: deadline is not None and time.monotonic() >= deadline  # noqa: E731
    for norm in norms:
        if late():
            break
        t0 = time.monotonic()
        cfg = TrainConfig(preset=preset, norm=norm, seq_len=seq_len, max_seq_len=seq_len, batch_size=batch_size, micro_batch=batch_size,
                          device=device, kernels=kernels, compile=compile, **(shape or {})).resolved()
        precision = train.precision_of(cfg, gpu)
        raw = train.build_model(cfg, vocab, gpu, precision)
        model = parallelize(raw, cfg, World(), gpu)
        optimizer, amp = train.build_optimizer(cfg, model), train.autocast_for(precision, gpu)
        runs[norm] = (model, optimizer, train.build_scheduler(cfg, optimizer), amp, raw)
        built[norm] = {"params": raw.num_params(), "kernels": raw.model.kernels, "precision": precision,
                       "flops_per_token": raw.flops_per_token(seq_len), "build_s": time.monotonic() - t0}

    def batch() -> Batch:
        ids = torch.randint(0, vocab, (batch_size, seq_len + 1), generator=g)
        return Batch(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())

    def step(norm: str, b: Batch) -> float:
        model, optimizer, scheduler, amp, _ = runs[norm]
        started = time.perf_counter()
        train.train_step(model, optimizer, scheduler, b, batch_size, amp, 0.0, gpu)
        if gpu.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started

    for norm in list(runs):  # compiles (with --compile) and Triton's first launches
        if late():
            del runs[norm], built[norm]
            continue
        t0 = time.monotonic()
        for _ in range(warmup):
            step(norm, batch())
        built[norm]["warmup_s"] = time.monotonic() - t0
    not_reached = [n for n in norms if n not in runs]
    norms = tuple(runs)
    seconds = {n: [] for n in norms}
    while norms and len(seconds["pre"]) < max_rounds and not late():
        b = batch()
        order = norms if len(seconds["pre"]) % 2 == 0 else norms[::-1]
        for norm in order:
            seconds[norm].append(step(norm, b))
        ratios = {n: PairedRatio([s / p for s, p in zip(seconds[n], seconds["pre"])]) for n in norms if n != "pre"}
        if len(seconds["pre"]) >= MIN_PAIRS and all(r.tight() for r in ratios.values()):
            break
    rounds = len(seconds["pre"]) if norms else 0
    tokens = batch_size * seq_len
    name = torch.cuda.get_device_name(gpu) if gpu.type == "cuda" else "cpu"
    peak = peak_tflops(name, built["pre"]["precision"]) if norms else None
    out = {"preset": preset, "shape": shape or {}, "device": name, "batch": f"{batch_size} x {seq_len} tokens", "compile": compile, "rounds": rounds,
           "complete": rounds >= MIN_PAIRS and not not_reached, "not_reached": not_reached, "norms": {}}
    for norm in norms:
        median = statistics.median(seconds[norm]) if seconds[norm] else None
        entry = {**built[norm], "median_seconds": median, "tokens_per_s": tokens / median if median else None, "seconds": seconds[norm]}
        if median and peak:
            entry["mfu"] = built[norm]["flops_per_token"] * tokens / median / (peak * 1e12)
        if norm != "pre" and rounds:
            entry["time_vs_pre"] = PairedRatio([s / p for s, p in zip(seconds[norm], seconds["pre"])]).summary()
        out["norms"][norm] = entry
    return out


def line(result: dict) -> str:
    """One line: each variant's step time as a multiple of Pre-LN's."""
    parts = []
    for norm, entry in result["norms"].items():
        if norm == "pre":
            parts.append(f"pre {entry['tokens_per_s']:,.0f} tokens/s" if entry["tokens_per_s"] else "pre: no round")
        elif "time_vs_pre" in entry:
            parts.append(f"{norm} {entry['time_vs_pre']['median']:.3f}x")
    missed = f"; not reached: {', '.join(result['not_reached'])}" if result["not_reached"] else ""
    return f"step time against Pre-LN ({result['rounds']} rounds, {result['batch']}): " + ", ".join(parts) + missed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--norms", default=",".join(NORMS))
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--kernels", default="auto")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--max-rounds", type=int, default=40)
    parser.add_argument("--budget-s", type=float, default=300.0, help="stop starting rounds after this long")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    norms = tuple(n for n in args.norms.split(",") if n)
    result = measure(norms, preset=args.preset, device=args.device, batch_size=args.batch_size, seq_len=args.seq_len, kernels=args.kernels,
                     compile=args.compile, max_rounds=args.max_rounds, deadline=time.monotonic() + args.budget_s)
    result["command"] = " ".join(["benchmarks/train/norm_throughput.py", *sys.argv[1:]])
    print(line(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
