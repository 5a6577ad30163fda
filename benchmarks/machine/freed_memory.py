"""Does keeping freed memory in the process (`depthcurse.heap`) pay, job by job, on this CPU? (issue 89, item 4)

    .venv/bin/python benchmarks/machine/freed_memory.py --out /tmp/b89h
    .venv/bin/python benchmarks/machine/freed_memory.py --jobs vocabulary --rounds 10 --out /tmp/b89h

`vocabulary` times, in two fresh processes (the C library's thresholds are the process's, set once:
A and B cannot share one), the vocabulary's elementwise work on SmolLM2-135M's shape (252 positions
x 49,152 tokens, fp32): the KL's product with p, an exp, a log-softmax. The other jobs are whole
commands in fp32, each run with `DEPTHCURSE_KEEP_FREED=0` (the C library's own thresholds) and
without (the default: kept), in turns (A B, then B A), its wall time and peak resident memory
(the child's rusage) each time:
    select     exact at k = 2 (435 removals, 4 x 64 calibration tokens, 4 held-out windows)
    depth-use  the logit lens and the influence matrix over 8 x 128 wiki tokens (the default: no tuned lens)
    sweep      issue 89's 4-layer ppl sweep (16 x 512 wiki tokens, layers 3, 14, 17, 28)
Prints a Markdown row per job for docs/benchmarks.md, with the CPU model and the load, and writes
freed_memory.json under --out.
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
sys.path.insert(0, str(ROOT))

from depthcurse.io import cpu_model  # noqa: E402

CLI = str(ROOT / ".venv/bin/depthcurse")
JOBS = {
    "select": ["select", "smollm2-135m", "--k", "2", "--search", "exact", "--calib-windows", "4", "--seq-len", "64", "--eval-windows", "4"],
    "depth-use": ["depth-use", "smollm2-135m", "--data", "wiki", "--windows", "8", "--seq-len", "128"],
    "sweep": ["prune", "smollm2-135m", "--task", "ppl", "--data", "wiki", "--limit", "16", "--layers", "3,14,17,28"],
}
VOCABULARY = """
import statistics, sys, time, json
from depthcurse import heap
if sys.argv[1] == "kept":
    heap.keep_freed_memory()
import torch
n, v, rounds = 252, 49152, int(sys.argv[2])
logp = torch.log_softmax(torch.randn(n, v, generator=torch.Generator().manual_seed(0)) * 3, -1)
p = logp.exp()
work = {"KL's product with p": lambda: torch.linalg.vecdot(p, logp), "exp": lambda: logp.exp(), "log-softmax": lambda: torch.log_softmax(logp, -1)}
out = {}
with torch.inference_mode():
    for name, fn in work.items():
        fn()
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times)
print(json.dumps(out))
"""


def run(argv: list[str], keep: bool, folder: Path) -> dict:
    """One whole process: its wall time and its peak resident memory (the child's own rusage)."""
    env = {**os.environ, "DEPTHCURSE_KEEP_FREED": "1" if keep else "0"}
    with tempfile.TemporaryFile() as said:  # a file, not a pipe: the progress lines would fill a pipe nobody reads until the exit
        start = time.perf_counter()
        child = subprocess.Popen([*argv, "--out", str(folder)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=said)
        _, status, usage = os.wait4(child.pid, 0)
        took = time.perf_counter() - start
        if status != 0:
            said.seek(0)
            raise SystemExit(f"{' '.join(argv)} failed: {said.read().decode()[-2000:]}")
    return {"seconds": took, "peak_mb": usage.ru_maxrss / 1024}


def vocabulary(rounds: int) -> dict:
    got = {}
    for mode in ("own", "kept", "own", "kept"):
        out = subprocess.run([sys.executable, "-c", VOCABULARY, mode, str(rounds)], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        for name, seconds in json.loads(out).items():
            got.setdefault(name, {"own": [], "kept": []})[mode].append(seconds)
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", default="vocabulary,select,depth-use,sweep")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10, help="vocabulary: timings of each piece in a process")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    record = {"cpu": cpu_model(), "date": time.strftime("%Y-%m-%d"), "jobs": {}}
    for job in args.jobs.split(","):
        if job == "vocabulary":
            record["jobs"][job] = vocabulary(args.rounds)
            continue
        runs = {"own": [], "kept": []}
        for p in range(args.pairs):
            for keep in ((False, True) if p % 2 == 0 else (True, False)):
                mode = "kept" if keep else "own"
                runs[mode].append(run([CLI, *JOBS[job], "--dtype", "fp32"], keep, args.out / f"{job}-{mode}-{p}"))
                print(job, mode, runs[mode][-1], flush=True)
        record["jobs"][job] = runs
    record["load"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    (args.out / "freed_memory.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"{record['cpu']}, {record['date']}, load {record['load'][0]}-{record['load'][1]}")
    print("| job | the C library's own | freed memory kept | kept / own | peak memory, own / kept (MB) |")
    print("|---|---|---|---|---|")
    for job, runs in record["jobs"].items():
        if job == "vocabulary":
            for name, t in runs.items():
                own, kept = statistics.median(t["own"]), statistics.median(t["kept"])
                print(f"| {name}, 252 x 49,152 fp32 | {own * 1e3:.1f} ms | {kept * 1e3:.1f} ms | **{kept / own:.2f}x** | - |")
            continue
        own = [r["seconds"] for r in runs["own"]]
        kept = [r["seconds"] for r in runs["kept"]]
        ratios = [k / o for k, o in zip(kept, own)]
        print(f"| {job} | {', '.join(f'{s:.1f}' for s in own)} s | {', '.join(f'{s:.1f}' for s in kept)} s | "
              f"**{statistics.median(ratios):.2f}x** ({min(ratios):.2f}-{max(ratios):.2f}) | "
              f"{max(r['peak_mb'] for r in runs['own']):.0f} / {max(r['peak_mb'] for r in runs['kept']):.0f} |")


if __name__ == "__main__":
    main()
