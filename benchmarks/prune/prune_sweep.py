"""Wall time of full prune sweeps on this machine, as docs/benchmarks.md reports them.

    python benchmarks/prune/prune_sweep.py ppl    # SmolLM2-135M, 31 variants, 16 x 512 wiki tokens each
    python benchmarks/prune/prune_sweep.py mmlu   # SmolLM2-135M, 31 variants, 4 questions x 57 subjects

Runs the real command (`depthcurse prune ...`) in a fresh results folder and prints the total
wall time (process start to exit, model loading included) and the per-variant times that
prune.json records.
"""

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

JOBS = {
    "ppl": ["--task", "ppl", "--data", "wiki", "--limit", "16"],
    "mmlu": ["--task", "mmlu", "--limit", "4"],
}


def main(job: str) -> None:
    out = Path(tempfile.mkdtemp(prefix=f"bench-{job}-"))
    cmd = [sys.executable, "-m", "depthcurse", "prune", "smollm2-135m", *JOBS[job], "--out", str(out)]
    started = time.perf_counter()
    subprocess.run(cmd, check=True, env={**os.environ, "TQDM_DISABLE": "1"})
    wall = time.perf_counter() - started
    data = json.loads((out / "prune.json").read_text())
    secs = [v["seconds"] for v in data["variants"]]
    print(f"command: {' '.join(cmd[2:])}")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch threads {data['environment']['torch_threads']}")
    print(f"variants: {len(secs)}, examples each: {data['variants'][0]['examples']}")
    print(f"wall time: {wall:.0f} s; per variant: median {statistics.median(secs):.1f} s, min {min(secs):.1f} s, max {max(secs):.1f} s")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "ppl")
