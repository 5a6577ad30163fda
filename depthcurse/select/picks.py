"""A select run's pick read back for another command: the removal a draft skips (`speculate --skip-from`)."""

from __future__ import annotations

import json
from pathlib import Path

from depthcurse.errors import DepthcurseError
from depthcurse.io import record_path
from depthcurse.select.grid import SELECT_JSON
from depthcurse.select.scoring import KEPT
from depthcurse.select.search import key

# which objective's pick a draft prefers: the one that chose for drafting, then the closest to it
DRAFT_PREFERENCE = ("acceptance", "speedup", "kl", "ppl")


def same_model(run: dict, described: dict, flag: str, where: str) -> None:
    """A pick names its own model's layers: refuse one read from a select run of another model (its
    recorded source, the hub id or folder, and revision, against the loaded model's), even where
    the layers it names exist here too."""
    theirs = (run.get("source", run.get("model")), run.get("revision"))
    ours = (described["source"] if "source" in run else described["model"], described.get("revision"))
    if theirs != ours:
        said = lambda s, r: f"{s}" + (f" @ {r}" if r else "")  # noqa: E731
        raise DepthcurseError(f"{flag} {where}: the select run was made on {said(*theirs)}, not on {said(*ours)}: its pick names that model's layers "
                              "(run select on this model, or give --skip)")


def checked_pick(pick: tuple, described: dict, n_layers: int, flag: str) -> tuple:
    """`draft_pick`'s removal, where it names this model's units: made on this model (`same_model`)
    and every unit one of its `n_layers` blocks; else one line."""
    removal, where, run = pick
    same_model(run, described, flag, where)
    bad = [u for u in removal if not 0 <= (int(u[1:]) if isinstance(u, str) else u) < n_layers]
    if bad:
        raise DepthcurseError(f"{flag} {where}: layer {bad[0]} is not one of {described['model']}'s {n_layers} (the select run was made on another model)")
    return tuple(removal)


def draft_pick(folder: Path) -> tuple[tuple[int, ...], str, dict]:
    """(the removal, where it came from, the run's settings) of the select run in `folder`: among
    the cells of the first objective of `DRAFT_PREFERENCE` that ran, the pick with the best
    calibration score on its own text (blocks, or attention and MLP branches: the draft skips
    either)."""
    try:
        record = json.loads(record_path(folder, SELECT_JSON).read_text())
        cells, scores, run = record["cells"], record["calibration_scores"], record["run"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DepthcurseError(f"--skip-from {folder}: no select run there ({SELECT_JSON}): {exc}") from None
    for objective in DRAFT_PREFERENCE:
        here = {name: c for name, c in cells.items() if c["objective"] == objective}
        scored = {name: scores[c["calibration"]][key(c["layers"])][KEPT.index(objective)] for name, c in here.items()
                  if len(scores.get(c["calibration"], {}).get(key(c["layers"]), ())) > KEPT.index(objective)}
        if scored:
            name = min(scored, key=lambda n: (scored[n], n))
            return tuple(cells[name]["layers"]), f"{folder} ({name})", run
    if not cells:
        raise DepthcurseError(f"--skip-from {folder}: the select run has chosen nothing yet")
    name = sorted(cells)[0]  # only stream searches ran: no score to rank their picks by
    return tuple(cells[name]["layers"]), f"{folder} ({name})", run
