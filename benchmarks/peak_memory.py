"""Peak memory of one variant per child process, shared by the benchmark scripts beside it.

Each variant runs in a child process of its own, so one's freed memory cannot hide the other's
peak. On the CPU the peak is the rise of the process's resident-set high-water mark (Linux VmHWM,
reset via /proc/self/clear_refs) above its size when the window opened; glibc is told to give
every block of 64 KiB or more straight back to the system, so the mark follows live tensors. On
CUDA it is torch.cuda.max_memory_allocated above the memory allocated when the window opened.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from depthcurse.speed.measure import PeakMemory  # noqa: F401 (the benchmarks' measure of memory is the library's)


def error_line(stderr: str, returncode: int) -> str:
    """Why a child process failed, in one line: the signal that killed it (a segmentation fault
    prints no exception), else the last exception line it wrote to stderr (warnings printed after
    a traceback come later), else its last line, or its exit status when it wrote nothing."""
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    raised = [line for line in lines if re.match(r"[\w.]*(Error|Exception|Interrupt)\b.*:", line)]
    return (raised or lines or [f"exit status {returncode}"])[-1][:500]


def run_variants(script: str, variants: tuple[str, ...], keep_going: bool = False) -> tuple[dict, dict]:
    """Run `script` once per variant (with this command line plus `--variant NAME`), each in its
    own process; its last stdout line is its result as JSON. Returns (results, conditions). A
    variant that fails ends the run, or with `keep_going` is its error's last line
    (`{"variant": ..., "error": ...}`) and the others still run: one out of memory on a GPU
    need not cost the other's figures."""
    # glibc returns blocks of at least this size to the system on free, so resident memory
    # tracks live tensors instead of a heap that only grows.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    load_before = os.getloadavg()
    results = {}
    for variant in variants:
        proc = subprocess.run([sys.executable, script, *sys.argv[1:], "--variant", variant], env=env, capture_output=True, text=True)
        if proc.returncode == 0:
            results[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
        elif keep_going:
            results[variant] = {"variant": variant, "error": error_line(proc.stderr, proc.returncode)}
        else:
            sys.exit(f"{variant} failed:\n{proc.stderr[-3000:]}")
    conditions = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cpus": os.cpu_count(),
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
    }
    return results, conditions


def write_json(path: Path | None, summary: dict) -> None:
    if path is None:
        return
    from depthcurse.io import atomic_write

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(summary, indent=2) + "\n")
