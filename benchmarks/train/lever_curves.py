"""Issue 18's other half: does a speed lever leave the loss curve of the first steps where it was?

Each lever of `train_levers.py` (the same options, which `lns-train` takes as they are) trains
the same run for `--steps` steps on real text (the offline Wikipedia text, which the GPU machine
gets from `.gpu/`), one `depthcurse lns-train` process each. Printed per lever: the largest and
the mean relative difference of its logged losses from the baseline's, step by step. The noise
scale to read them against is the `fp32` row: the same run without bf16 at all. A lever whose
curve is as close to the baseline as fp32's is, or closer, changes nothing beyond bf16's noise.

    python benchmarks/train/lever_curves.py --device cuda --preset 130m --steps 100 --levers baseline,fp32,micro-batch-256,pure-bf16
    .venv/bin/python benchmarks/train/lever_curves.py --levers baseline,fp32,compile-model --steps 6   # CPU: tiny preset
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: peak_memory, which every command's scripts share
from peak_memory import error_line, write_json  # noqa: E402
from train_levers import LEVERS  # noqa: E402

from depthcurse.train.metrics import METRICS, MetricsLog  # noqa: E402

CURVE_LEVERS = {**LEVERS, "fp32": ["--compile", "--precision", "fp32"]}  # the noise scale


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levers", default="baseline,fp32,micro-batch-256,compile-model,pure-bf16", help=f"comma-separated, from: {', '.join(CURVE_LEVERS)}")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--norm", default="lns")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--tokenizer", default=None, help="a name or folder (default: lns-train's for wiki, SmolLM2's; on the GPU machine the bundle's copy, /root/dccache/tok)")
    parser.add_argument("--out", type=Path, default=None, help="also write every lever's losses and differences as JSON here")
    args = parser.parse_args()
    names = args.levers.split(",")
    unknown = [n for n in names if n not in CURVE_LEVERS]
    if unknown or "baseline" not in names:
        parser.error(f"--levers takes baseline and others from: {', '.join(CURVE_LEVERS)}")
    names = ["baseline"] + [n for n in names if n != "baseline"]
    common = ["--preset", args.preset, "--device", args.device, "--norm", args.norm, "--data", "wiki", "--steps", str(args.steps),
              "--warmup", str(max(1, args.steps // 10)), "--log-every", "1", "--eval-every", str(args.steps), "--save-every", str(args.steps),
              "--layer-metrics-tokens", "0"] + (["--tokenizer", args.tokenizer] if args.tokenizer else [])
    print(f"{args.preset} on {args.device}, {args.norm}, {args.steps} steps of the offline Wikipedia text per lever", flush=True)
    curves: dict[str, list[float] | str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            out = Path(tmp) / name
            cmd = [sys.executable, "-m", "depthcurse", "lns-train", *common, *CURVE_LEVERS[name], "--out", str(out)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
            if proc.returncode != 0:
                curves[name] = error_line(proc.stderr, proc.returncode)
                print(f"{name:<16} failed: {curves[name]}", flush=True)
                continue
            curves[name] = [r["loss"] for r in MetricsLog(out / METRICS).rows() if "loss" in r]
            print(_line(name, curves[name], curves["baseline"]), flush=True)
    write_json(args.out, {"preset": args.preset, "device": args.device, "steps": args.steps, "levers": {n: CURVE_LEVERS[n] for n in names}, "losses": curves})


def _line(name: str, losses: list[float], baseline) -> str:
    if not isinstance(baseline, list):
        return f"{name:<16} first loss {losses[0]:.4f}, last {losses[-1]:.4f} (no baseline to compare with)"
    diffs = [abs(a - b) / abs(b) for a, b in zip(losses, baseline)]
    return (f"{name:<16} loss {losses[0]:.4f} -> {losses[-1]:.4f}   from the baseline: largest {max(diffs):.2e}, "
            f"mean {sum(diffs) / len(diffs):.2e} ({' '.join(CURVE_LEVERS[name]) or 'eager'})")


if __name__ == "__main__":
    main()
