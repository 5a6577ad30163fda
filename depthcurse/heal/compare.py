"""Every way to win back a removal, side by side: one heal per method on the same removal, the same
data, the same held-out windows and task, each in `out_dir/<method>/` (resumable as any heal), the
unpruned and the pruned model measured once for all. `heal.json` in `out_dir` holds the comparison:
each method's healed model, the share of the cost it won back, and what it cost (seconds, tokens,
parameters trained or added).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from depthcurse.errors import DepthcurseError
from depthcurse.heal.config import METHODS, RESUMABLE_CHANGES, HealConfig
from depthcurse.heal.loop import HEAL_JSON, check, finished, heal, identity, read_heal
from depthcurse.io import atomic_write, ensure_out_dir, json_text, refuse_other_run
from depthcurse.loading import LoadedModel
from depthcurse.runtime import World


def parse_methods(text: str) -> tuple[str, ...]:
    methods = tuple(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise DepthcurseError(f"--methods {text!r}: give methods among {', '.join(METHODS)}, e.g. lora,linear")
    return methods


def method_entry(point: dict) -> dict:
    """What one method's heal gives a comparison: its healed model's measurements, the share won back, the cost."""
    return {"results": point["results"]["healed"], "recovered": point["recovered"], "cost": point.get("cost"),
            "hf_layers": point.get("hf_layers"), "hf_bytes": point.get("hf_bytes")}


class Models:
    """The models to heal, one per heal (healing changes the model it is given): `loaded` first,
    then a fresh `load()` each time; none is loaded for a heal finished before."""

    def __init__(self, loaded: LoadedModel, load: Callable[[], LoadedModel]):
        self.loaded, self.load, self.fresh = loaded, load, [loaded]

    def next(self) -> LoadedModel:
        return self.fresh.pop() if self.fresh else self.load()


def heal_methods(loaded: LoadedModel, models: Models, cfg: HealConfig, methods: tuple[str, ...], out_dir: Path, *,
                 world: World = World(), unpruned: dict | None = None, why: str | None = None,
                 on_method: Callable[[str, int, int], None] | None = None, **callbacks) -> dict | None:
    """Heal `cfg.layers` by each of `methods`, each on `models.next()`, checked against `loaded`
    first; the comparison's record, `heal.json` in `out_dir`, on rank 0. `unpruned`: that model's
    measurement if it was made already (a healed curve's)."""
    out_dir = ensure_out_dir(out_dir)
    checked = {m: identity(loaded, check(loaded, cfg.for_method(m))) for m in methods}  # every method's input, before the first runs
    run = {k: v for identity_ in checked.values() for k, v in identity_.items() if k != "method"} | {"methods": list(methods)}
    if (out_dir / HEAL_JSON).exists():
        refuse_other_run(out_dir, read_heal(out_dir)["run"], run, ignore=RESUMABLE_CHANGES, what="comparison of methods")
    record = {"run": run, "results": {}, "methods": {}}
    shared = {"unpruned": unpruned, "pruned": None}
    for i, method in enumerate(methods):
        if on_method:
            on_method(method, i, len(methods))
        folder = out_dir / method
        point = finished(folder, checked[method])  # finished before an interruption: not loaded again
        if point is None:
            point = heal(models.next(), cfg.for_method(method), folder, world=world, why=why, **shared, **callbacks)
        if not world.main:
            continue
        shared = {name: point["results"][name] for name in ("unpruned", "pruned")}
        record["results"] = dict(shared)
        record["held_out"] = point.get("held_out")
        record["methods"][method] = {**method_entry(point), "folder": method}
        atomic_write(out_dir / HEAL_JSON, json_text(record))
    return record if world.main else None
