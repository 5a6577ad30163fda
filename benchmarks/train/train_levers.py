"""Issue 18's levers, each timed alone: the trainer's tokens/s, MFU and peak memory with one
setting changed from a baseline, in one command.

Each lever is a `train_throughput.py --variants trainer` run (a child process of its own, so one
that runs out of memory or hangs costs only its own row) with the baseline's options plus its
own. The baseline is the fastest setting measured so far on an H100 (`--compile`: compiled plain
blocks and loss, bf16-mixed, the preset's micro-batch). Printed: one row per lever with its ratio
to the baseline's tokens/s and its first and last loss (the same random batches for all, so a
lever that changes the numerics beyond bf16's noise shows there). The JSON (`--out`) is rewritten
after every lever, so a run cut short keeps the rows it finished.

    python benchmarks/train/train_levers.py --device cuda --preset 130m --out /tmp/levers.json          # all levers: more than one device call
    python benchmarks/train/train_levers.py --device cuda --preset 130m --levers micro-batch-256,cuda-graphs
    python benchmarks/train/train_levers.py --device cuda --preset 130m --micro-batch 512 --levers baseline,autotune,pure-bf16   # on top of the best micro-batch
    .venv/bin/python benchmarks/train/train_levers.py --levers baseline,compile-model --steps 5           # CPU, tiny preset
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: peak_memory, which every command's scripts share
from peak_memory import error_line, write_json  # noqa: E402

# name -> its options; every lever is the baseline's (`--compile`) with one thing changed
LEVERS: dict[str, list[str]] = {
    "baseline": ["--compile"],
    "eager": [],  # the eager trainer (Triton kernels on CUDA), for scale
    "micro-batch-128": ["--compile", "--micro-batch", "128"],
    "micro-batch-256": ["--compile", "--micro-batch", "256"],
    "micro-batch-512": ["--compile", "--micro-batch", "512"],  # no accumulation at batch 512
    "compile-model": ["--compile", "--compile-scope", "model"],
    "cuda-graphs": ["--compile", "--compile-mode", "reduce-overhead"],
    "autotune": ["--compile", "--compile-mode", "max-autotune-no-cudagraphs"],
    "pure-bf16": ["--compile", "--precision", "bf16"],
    "fused-projections": ["--compile", "--fuse-projections"],
    "triton-kernels": ["--compile", "--kernels", "triton"],  # our norms inside the compiled blocks, and our loss
}
# Levers of train_throughput.py's own options, not (yet) lns-train's: weighed here first, made
# lns-train options if they pay (so lever_curves.py, which runs lns-train, takes only LEVERS).
THROUGHPUT_LEVERS: dict[str, list[str]] = {
    # attention's kernel, where torch picks cuDNN's on an H100 (13% of a 130M step at micro-batch 512)
    "sdpa-flash": ["--compile", "--sdpa-backend", "flash"],
    "sdpa-efficient": ["--compile", "--sdpa-backend", "efficient"],
    # the head's loss: inductor's fused log-softmax (8% of the step at micro-batch 512) or our
    # chunked one, one pass over each chunk's logits that leaves their gradient in place
    "fused-loss": ["--compile", "--loss", "fused"],
    # our Triton norms (with the residual add and the LNS scale; 16% of the step is inductor's
    # norms at micro-batch 512), now called inside the compiled blocks, with inductor's loss
    "triton-norms": ["--compile", "--kernels", "triton", "--loss", "plain"],
}
ALL_LEVERS = {**LEVERS, **THROUGHPUT_LEVERS}


def lever_command(name: str, common: list[str], out: Path) -> list[str]:
    script = Path(__file__).with_name("train_throughput.py")
    return [sys.executable, str(script), *common, *ALL_LEVERS[name], "--variants", "trainer", "--out", str(out)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levers", default=",".join(LEVERS), help=f"comma-separated, from: {', '.join(ALL_LEVERS)} (default: those of lns-train's options)")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--norm", default="lns")
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="every lever's micro-batch, the baseline's too (default: the preset's); a micro-batch lever still sets its own")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (compiling happens there)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="the accelerator's peak, for MFU (H100 SXM dense bf16: 989)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one lever may take before it is stopped and reported as such")
    parser.add_argument("--out", type=Path, default=None, help="also write the rows as JSON here (after every lever)")
    args = parser.parse_args()
    names = args.levers.split(",")
    unknown = [n for n in names if n not in ALL_LEVERS]
    if unknown:
        parser.error(f"unknown lever(s) {', '.join(unknown)}: use {', '.join(ALL_LEVERS)}")
    if "baseline" in names:  # first: every other row is a ratio to it
        names = ["baseline"] + [n for n in names if n != "baseline"]
    common = ["--preset", args.preset, "--device", args.device, "--norm", args.norm, "--warmup", str(args.warmup),
              "--steps", str(args.steps), "--peak-tflops", str(args.peak_tflops)]
    if args.micro_batch:  # before the lever's own options: the last of two --micro-batch wins
        common += ["--micro-batch", str(args.micro_batch)]
    if not args.device.startswith("cuda"):
        common += ["--kernels", "off"]  # on a CPU the benchmark's default is the kernels' PyTorch path; `auto` is the GPU's

    micro = f"micro-batch {args.micro_batch}" if args.micro_batch else "the preset's micro-batch"
    print(f"{args.preset} on {args.device}, {micro}: {len(names)} levers, each {args.warmup} untimed + {args.steps} timed steps of the trainer alone", flush=True)
    rows: list[dict] = []
    summary = {"preset": args.preset, "device": args.device, "micro_batch": args.micro_batch, "levers": ALL_LEVERS, "rows": rows}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            out = Path(tmp) / f"{name}.json"
            cmd = lever_command(name, common, out)
            started = time.perf_counter()
            failed = _run(cmd, args.timeout, out)
            row = {"lever": name, "options": ALL_LEVERS[name], "seconds": time.perf_counter() - started}
            if failed is None:
                trainer = json.loads(out.read_text())["results"]["trainer"]
                failed = trainer.get("error")
                row.update({k: trainer[k] for k in ("tokens_per_s", "median_seconds", "peak_bytes", "first_loss", "last_loss", "mfu", "precision", "compile", "micro_batch")
                            if k in trainer})
            if failed:
                row["error"] = failed
            rows.append(row)
            write_json(args.out, summary)
            print(_line(row, rows[0]), flush=True)


def _run(cmd: list[str], timeout: float, out: Path) -> str | None:
    """None when the command wrote `out`, else why not in one line. The command runs in a
    session of its own so that a timeout stops its variant's child process too (which holds the GPU)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return f"stopped after {timeout:.0f} s"
    if proc.returncode == 0 and out.exists():
        return None
    return error_line(err, proc.returncode)


def _line(row: dict, baseline: dict) -> str:
    if "error" in row:
        return f"{row['lever']:<16} failed: {row['error']}"
    ratio = f"{row['tokens_per_s'] / baseline['tokens_per_s']:.2f}x" if "tokens_per_s" in baseline else "-"
    mfu = f"{row['mfu']:.1%}" if "mfu" in row else "-"
    return (f"{row['lever']:<16} {row['tokens_per_s']:>10.0f} tokens/s {ratio:>6} of baseline  MFU {mfu:>6}  peak {row['peak_bytes'] / 1e6:>8.0f} MB  "
            f"loss {row['first_loss']:.4f} -> {row['last_loss']:.4f}  ({' '.join(row['options']) or 'eager'}, micro-batch {row.get('micro_batch')}, {row['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
