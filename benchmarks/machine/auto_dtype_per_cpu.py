"""Does bf16 pay on this CPU, and does `--dtype auto` choose what pays? One row per CPU (issue 89, item 2).

    .venv/bin/python benchmarks/machine/auto_dtype_per_cpu.py --out /tmp/b89            # quiet
    .venv/bin/python benchmarks/machine/auto_dtype_per_cpu.py --busy --out /tmp/b89b    # beside one CPU-bound job

Three measurements of bf16 against fp32, each in turns (fp32, bf16, fp32, bf16, ...):
    block     `cpu_precision.measure_ratios`: the block `auto` times before it chooses (SmolLM2-135M's shape)
    body      one forward of SmolLM2-135M's body over 4 x 512 tokens, both models loaded in this process
    sweep     the issue's 4-layer sweep (`depthcurse prune smollm2-135m --task ppl --data wiki --limit 16
              --layers 3,14,17,28 --dtype D`), whole processes one after the other
and what `--dtype auto` chooses here (measured afresh, not read from the cache). `--busy` runs one
CPU-bound process (a Python loop) throughout. Prints a Markdown row for docs/benchmarks.md, with the
CPU model as lscpu names it and the load, and writes auto_dtype.json under --out.
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

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from depthcurse.cpu_precision import BlockShape, bf16_pays, measure_ratios  # noqa: E402
from depthcurse.io import cpu_model  # noqa: E402
from depthcurse.loading import load_model  # noqa: E402


def lscpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return cpu_model()


def body_pairs(pairs: int) -> list[float]:
    bodies = {d: load_model("smollm2-135m", dtype=d).model.model for d in ("fp32", "bf16")}
    ids = torch.randint(0, 40000, (4, 512), generator=torch.Generator().manual_seed(0))
    ratios = []
    with torch.inference_mode():
        for body in bodies.values():
            body(ids)
        for _ in range(pairs):
            took = {}
            for d, body in bodies.items():
                start = time.perf_counter()
                body(ids)
                took[d] = time.perf_counter() - start
            ratios.append(took["bf16"] / took["fp32"])
    return ratios


def sweep_pairs(pairs: int, out: Path) -> list[dict]:
    rows = []
    for p in range(pairs):
        took = {}
        for d in ("fp32", "bf16"):
            folder = out / f"sweep-{d}-{p}"
            start = time.perf_counter()
            subprocess.run([str(ROOT / ".venv/bin/depthcurse"), "prune", "smollm2-135m", "--task", "ppl", "--data", "wiki", "--limit", "16",
                            "--layers", "3,14,17,28", "--dtype", d, "--out", str(folder)], check=True, capture_output=True, cwd=ROOT)
            took[d] = time.perf_counter() - start
        rows.append({"fp32_s": round(took["fp32"], 1), "bf16_s": round(took["bf16"], 1), "ratio": took["bf16"] / took["fp32"]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy", action="store_true", help="one CPU-bound process beside the measurements")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--sweep-pairs", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy else None
    try:
        load_before = os.getloadavg()[0]
        block = measure_ratios(BlockShape(576, 1536, 9), pairs=2 * args.pairs + 1)
        with tempfile.TemporaryDirectory() as kept:
            chooses, why = bf16_pays(BlockShape(576, 1536, 9), Path(kept))
        body = body_pairs(args.pairs)
        sweep = sweep_pairs(args.sweep_pairs, args.out)
        load_after = os.getloadavg()[0]
    finally:
        if busy is not None:
            busy.kill()
    record = {"cpu": lscpu_name(), "cpu_model": cpu_model(), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "flags": {"avx512_bf16": torch.cpu._is_avx512_bf16_supported(), "amx": torch.cpu._is_amx_tile_supported()},
              "busy": args.busy, "load": [round(load_before, 2), round(load_after, 2)], "date": time.strftime("%Y-%m-%d"),
              "block": block, "body": body, "sweep": sweep, "auto": "bf16" if chooses else "fp32", "auto_why": why}
    (args.out / "auto_dtype.json").write_text(json.dumps(record, indent=2) + "\n")
    med = lambda xs: f"{statistics.median(xs):.2f}x ({min(xs):.2f}-{max(xs):.2f})"  # noqa: E731
    print("| CPU | flags | load | block (auto's measurement) | body, 4 x 512 | 4-layer sweep (s, fp32 / bf16) | auto chooses |")
    print(f"| {record['cpu_model']} | {'AVX512-BF16' if record['flags']['avx512_bf16'] else ''}{', AMX' if record['flags']['amx'] else ''} | "
          f"{record['load'][0]}-{record['load'][1]}{' (one CPU-bound job beside)' if args.busy else ''} | {med(block)} | {med(body)} | "
          + ", ".join(f"{r['fp32_s']} / {r['bf16_s']} ({r['ratio']:.2f}x)" for r in sweep) + f" | {record['auto']} |")


if __name__ == "__main__":
    main()
