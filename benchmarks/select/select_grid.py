"""`select`'s grid (a text's windows and the unpruned model's predictions made once, a removal's
calibration score once for every search and objective that asks, each distinct choice judged once)
against its cells run as separate `select` runs of one text, one search, one objective each (what a
researcher scripting the comparison by hand runs), in turns A B A B in one process, the model loaded
once (separate commands would also load it each time). The same choices either way is checked.

    python benchmarks/select/select_grid.py --model smollm2-135m --calibration wiki,runs/lee.txt --k 2 --calib-windows 4 --eval-windows 8 --seq-len 64
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from depthcurse.loading import load_model
from depthcurse.select import SelectConfig, run_select


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--calibration", default="wiki")
    parser.add_argument("--searches", default="greedy,one-shot,angular,bi")
    parser.add_argument("--objectives", default="ppl,kl")
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--calib-windows", type=int, default=4)
    parser.add_argument("--eval-windows", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    loaded = load_model(args.model, fp32_on_cpu="as this benchmark's figures in docs/benchmarks.md were measured")
    common = dict(k=args.k, calib_windows=args.calib_windows, eval_windows=args.eval_windows, seq_len=args.seq_len)
    grid = SelectConfig(calibration=tuple(args.calibration.split(",")), objectives=tuple(args.objectives.split(",")),
                        searches=tuple(args.searches.split(",")), **common)
    cells = grid.cells()
    times = {"grid": [], "cells": []}
    chosen = {}
    for r in range(args.repeats):
        for kind in (("grid", "cells") if r % 2 == 0 else ("cells", "grid")):
            folder = Path(tempfile.mkdtemp())
            started = time.perf_counter()
            if kind == "grid":
                record = run_select(loaded, grid, folder / "grid")
                chosen["grid"] = sorted((c["calibration"], c["search"], c["objective"], tuple(c["layers"])) for c in record["cells"].values())
            else:
                got = []
                for i, (c, s, o) in enumerate(cells):
                    one = SelectConfig(calibration=(c,), searches=(s,), objectives=(o,) if o != "-" else None, **common)
                    record = run_select(loaded, one, folder / f"cell{i}")
                    got += [(x["calibration"], x["search"], x["objective"], tuple(x["layers"])) for x in record["cells"].values()]
                chosen["cells"] = sorted(got)
            times[kind].append(time.perf_counter() - started)
            shutil.rmtree(folder)
    ratio = statistics.median(times["grid"]) / statistics.median(times["cells"])
    print(f"{len(cells)} cells; grid {times['grid']} s; cells one by one {times['cells']} s; grid / cells = {ratio:.3f}x")
    print(f"the same choices: {chosen['grid'] == chosen['cells']}")


if __name__ == "__main__":
    main()
