"""What a training run logs: `metrics.jsonl`, one JSON object per logged step, and the progress
report the command line shows."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from depthcurse.io import atomic_write, finite

METRICS = "metrics.jsonl"
SUMMARY = "summary.json"  # written when the run finishes


class MetricsLog:
    """metrics.jsonl: appended and flushed as it happens, so a crash loses no logged step. Each row
    also goes to the live `trackers` (train/tracking.py), which `close()` ends."""

    def __init__(self, path: Path, trackers: list | None = None):
        self.path = Path(path)
        self.trackers = list(trackers or [])

    def rows(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def truncate_after(self, step: int) -> None:
        """On resume, forget what was logged after the checkpoint: those steps run again."""
        kept = [r for r in self.rows() if r.get("step", 0) <= step]
        atomic_write(self.path, "".join(json.dumps(r) + "\n" for r in kept))

    def append(self, row: dict) -> None:
        row = finite(row)
        with open(self.path, "a") as fh:
            fh.write(json.dumps(row) + "\n")
            fh.flush()
        for tracker in self.trackers:
            tracker.log(row)

    def close(self) -> None:
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            tracker.close()

    def __enter__(self) -> "MetricsLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class Progress:
    """One logged step, as the progress bar shows it."""

    step: int
    total: int
    loss: float
    lr: float
    tokens: int
    tokens_per_s: float
    tflops: float | None  # the model's training FLOPs per second, all ranks together (None: not counted, as in heal)
    micro_batch: int  # sequences per forward/backward on each rank
