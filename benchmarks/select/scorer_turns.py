"""(a helper) `exact`'s scorer at k = 2 on SmolLM2-135M, two ways of it in turns in one process, for
`head_in_chunks.py`, `heads_together.py` and `vocab_kernel.py`.

The scorer is `exact`'s (`CalibrationScorer.per_window` over chunks of the k = 2 removals, 4 x 64
wiki tokens). Each chunk of removals is scored by both ways in turns (A B, then B A), their windows'
figures forgotten before each; each way is a function that sets the scorer up for it.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from depthcurse.heap import keep_freed_memory  # noqa: E402
from depthcurse.io import cpu_model  # noqa: E402
from depthcurse.loading import load_model  # noqa: E402
from depthcurse.select.config import SelectConfig  # noqa: E402
from depthcurse.select.scoring import CalibrationScorer  # noqa: E402
from depthcurse.select.windows import text_windows  # noqa: E402


def arguments(doc: str) -> argparse.ArgumentParser:
    """The options every script on this helper takes (a script adds its own)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--size", type=int, default=55, help="removals a chunk scores")
    return parser


def exact_scorer(dtype: str) -> tuple[CalibrationScorer, list[tuple[int, int]]]:
    """The scorer on 4 x 64 wiki tokens, and every removal of 2 blocks; freed memory kept first, as the command line keeps it."""
    print(f"heap: {keep_freed_memory()}")
    loaded = load_model("smollm2-135m", dtype=dtype)
    cfg = SelectConfig(k=2, calibration=("wiki",), calib_windows=4, eval_windows=2, seq_len=64, batch_size=4)
    windows = text_windows(loaded.tokenizer, "wiki", cfg).calibration
    scorer = CalibrationScorer(loaded.model, windows, 4, {}, lambda: None)
    return scorer, list(itertools.combinations(range(scorer.n), 2))


def in_turns(scorer: CalibrationScorer, every: list, chunks: int, size: int, ways: dict[str, Callable[[], None]]):
    """Each way's seconds per chunk and every removal's (losses, KLs, agreements) per window."""
    times, got = {name: [] for name in ways}, {name: {} for name in ways}
    for r in range(chunks):
        chunk = every[r * size:(r + 1) * size]
        for name in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
            ways[name]()
            scorer.windowed.clear()
            started = time.perf_counter()
            for removal, figures in zip(chunk, scorer.per_window(chunk)):  # every window measured again: nothing kept
                got[name][removal] = figures
            times[name].append(time.perf_counter() - started)
    return times, got


def ratio_line(times: dict, a: str, b: str, dtype: str, size: int) -> str:
    """The machine, the sums and the median ratio a / b with its pairs' range."""
    ratios = [x / y for x, y in zip(times[a], times[b])]
    return (f"{cpu_model()}, {torch.get_num_threads()} threads, {dtype}, {time.strftime('%Y-%m-%d')}, load {Path('/proc/loadavg').read_text().split()[0]}: "
            f"{a} {sum(times[a]):.2f} s, {b} {sum(times[b]):.2f} s over {len(ratios)} chunks of {size} removals; "
            f"{a} / {b} {statistics.median(ratios):.3f} (pairs {min(ratios):.3f}-{max(ratios):.3f})")
