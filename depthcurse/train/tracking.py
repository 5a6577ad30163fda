"""Live trackers: what `metrics.jsonl` records, also sent to TensorBoard or Weights & Biases as it
happens (`--report-to`, in the sense of transformers' Trainer), so a run that takes hours is
watched while it runs.

A tracker is a small contract (`Tracker`: `log(row)`, `close()`) and a registry entry
(`TRACKERS`); `metrics.MetricsLog.append` writes each row to the file and then to the trackers,
so a tracker sees exactly the rows the file holds. Only rank 0 opens trackers. A resumed run
writes into the same curves: TensorBoard purges what was logged after the checkpoint (those steps
run again), W&B continues the same run id (kept in the run folder).
"""

from __future__ import annotations

import importlib.util
import json
import math
import netrc
import os
import shutil
import uuid
from pathlib import Path
from typing import Protocol

from depthcurse.errors import DepthcurseError
from depthcurse.io import atomic_write

TENSORBOARD_DIR = "tensorboard"  # in the run folder: `tensorboard --logdir RUN` (or a folder of runs)
WANDB_ID = "wandb-run-id"  # the W&B run a resume continues


class Tracker(Protocol):
    def log(self, row: dict) -> None: ...

    def close(self) -> None: ...


def scalars(row: dict) -> dict[str, float]:
    """One metrics.jsonl row as tracker scalars: `train/<key>` for a step's, `val/<key>` for an
    evaluation's, `<key>/<layer>` for each entry of a per-layer list (a chart section per
    measurement, a chart per layer). Text (an error noted in the row) and `step` (the x axis) are
    not scalars."""
    out = {}
    for key, value in row.items():
        if key == "step" or isinstance(value, bool):
            continue
        if isinstance(value, (list, tuple)):
            width = max(2, len(str(len(value) - 1)))
            out.update({f"{key}/{i:0{width}d}": float(v) for i, v in enumerate(value) if _number(v)})
        elif _number(value):
            out[f"val/{key[4:]}" if key.startswith("val_") else f"train/{key}"] = float(value)
    return out


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class TensorBoard:
    """Event files in `<run>/tensorboard`, written by torch's SummaryWriter and flushed at each row
    (a crash loses no logged step)."""

    needs = ("tensorboard", "tensorboard")  # (module to import, package to install)

    def __init__(self, out_dir: Path, *, config: dict, name: str, resume_step: int | None):
        from torch.utils.tensorboard import SummaryWriter  # lazy: only a run that reports to it

        log_dir = Path(out_dir) / TENSORBOARD_DIR
        if resume_step is None and log_dir.exists():
            shutil.rmtree(log_dir)  # a run that starts over: its old curves are not this run's
        # purge_step: events at or after it from the interrupted run are hidden, as metrics.jsonl
        # forgets the rows after the checkpoint; the repeated steps draw over them.
        self.writer = SummaryWriter(str(log_dir), purge_step=None if resume_step is None else resume_step + 1)
        if resume_step is None:
            self.writer.add_text("config", f"{name}\n\n```json\n{json.dumps(config, indent=2, default=str)}\n```", 0)

    def log(self, row: dict) -> None:
        step = int(row["step"])
        for tag, value in scalars(row).items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandB:
    """A W&B run in `<run>/wandb`: online where an API key is set up (`WANDB_API_KEY` or `wandb
    login`), otherwise in W&B's offline mode (`wandb sync <run>/wandb/offline-run-*` uploads it
    later); `WANDB_MODE`, `WANDB_PROJECT` and W&B's other variables are honoured."""

    needs = ("wandb", "wandb")

    def __init__(self, out_dir: Path, *, config: dict, name: str, resume_step: int | None):
        import wandb  # lazy: an optional package

        id_file = Path(out_dir) / WANDB_ID
        if resume_step is not None and id_file.is_file():
            run_id = id_file.read_text().strip()
        else:
            run_id = uuid.uuid4().hex[:12]
            atomic_write(id_file, run_id + "\n")
        # W&B's steps only increase: on a resume from an older checkpoint the steps already logged
        # keep their first values (metrics.jsonl and TensorBoard hold the rerun's).
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "depthcurse"), name=name, id=run_id, resume="allow",
                              dir=str(out_dir), config=config, mode=os.environ.get("WANDB_MODE") or wandb_mode())

    def log(self, row: dict) -> None:
        self.run.log(scalars(row), step=int(row["step"]))

    def close(self) -> None:
        self.run.finish()


def wandb_mode() -> str:
    """online with an API key at hand (the variable or `wandb login`'s netrc entry), offline without."""
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        return "online" if netrc.netrc().authenticators("api.wandb.ai") else "offline"
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return "offline"


TRACKERS: dict[str, type] = {"tensorboard": TensorBoard, "wandb": WandB}


def parse_report_to(text: str | None) -> tuple[str, ...]:
    """`--report-to` (`none`, one name or a comma list) as names, each known and installed: one
    clear line before anything runs otherwise."""
    names = [n.strip().lower() for n in (text or "none").split(",") if n.strip()]
    if names in ([], ["none"]):
        return ()
    unknown = [n for n in names if n not in TRACKERS]
    if unknown or "none" in names:
        raise DepthcurseError(f"--report-to {text}: use none, or one or more of {', '.join(TRACKERS)} (comma separated)")
    for name in names:
        module, package = TRACKERS[name].needs
        if importlib.util.find_spec(module) is None:
            raise DepthcurseError(f"--report-to {name}: {package} is not installed (pip install {package}, or pip install 'depthcurse[tracking]')")
    return tuple(dict.fromkeys(names))


def open_trackers(report_to: str | None, out_dir: Path, *, config: dict, name: str, resume_step: int | None) -> list[Tracker]:
    """The trackers `report_to` names, opened for the run in `out_dir`; `resume_step`: the step of
    the checkpoint a resumed run continues from (None: a run from the start)."""
    opened = []
    try:
        for tracker in parse_report_to(report_to):
            opened.append(TRACKERS[tracker](Path(out_dir), config=config, name=name, resume_step=resume_step))
    except Exception:
        for t in opened:
            t.close()
        raise
    return opened
