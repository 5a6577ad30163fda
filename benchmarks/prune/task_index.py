"""Start-up of every command that runs an lm-eval task: lm-eval's own `TaskManager()` (parsing
its about 14,000 task YAML files) against `harness.task_manager()` reading the index saved in
the cache, each in a fresh process (the cost is per process), alternating, in one run. The
first saved-index process builds and writes the index (timed apart, as "first run").

    .venv/bin/python benchmarks/prune/task_index.py
    .venv/bin/python benchmarks/prune/task_index.py --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = """
import json, sys, time
import lm_eval.tasks
from depthcurse.tasks.harness import task_manager  # imports torch and transformers: a command's cost either way
start = time.perf_counter()
manager = lm_eval.tasks.TaskManager() if sys.argv[1] == "lm-eval" else task_manager()
print(json.dumps({"seconds": time.perf_counter() - start, "names": len(manager.all_tasks)}))
"""


def child(kind: str, env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, kind], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="processes per kind, after the saved index's first")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "DEPTHCURSE_CACHE": cache, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        first = child("saved", env)
        times: dict[str, list[float]] = {"lm-eval": [], "saved": []}
        names = {first["names"]}
        for _ in range(args.repeats):
            for kind in times:
                row = child(kind, env)
                times[kind].append(row["seconds"])
                names.add(row["names"])
    if len(names) != 1:
        raise SystemExit(f"the two task managers know different numbers of names: {sorted(names)}")
    own, saved = statistics.median(times["lm-eval"]), statistics.median(times["saved"])
    print(f"names in the index: {names.pop():,}")
    print(f"lm-eval's TaskManager():          median {own:.2f} s  ({', '.join(f'{t:.2f}' for t in times['lm-eval'])})")
    print(f"saved index, first run (builds):  {first['seconds']:.2f} s")
    print(f"saved index, later runs:          median {saved:.2f} s  ({', '.join(f'{t:.2f}' for t in times['saved'])})")
    print(f"ratio saved / lm-eval: {saved / own:.3f}")


if __name__ == "__main__":
    main()
