"""A healed depth curve (Gromov et al.'s Figure 1d): the first k layers of an earlier result's
order removed and healed, for each k, against the same removals unhealed.

The order comes from a results folder: a `prune --greedy` result (a strategy's sets, `greedy` by
default), a `prune --block` or `angular-distance` result (for each k the angular block of k
layers, or the k deepest before the last), or a single-layer sweep (its layers, cheapest first).
Each k is a heal run of its own in `kNNN/` (with several methods, a comparison of them, each in
`kNNN/<method>/`), resumable as any is; the unpruned model is measured once, by the first.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable

from depthcurse.angular import load_angular
from depthcurse.angular.result import ANGULAR_JSON
from depthcurse.errors import DepthcurseError
from depthcurse.heal.config import RESUMABLE_CHANGES, HealConfig
from depthcurse.heal.compare import Models, heal_methods
from depthcurse.heal.loop import HEAL_JSON, check, finished, heal, identity, read_heal
from depthcurse.io import atomic_write, ensure_out_dir, json_text, refuse_other_run
from depthcurse.loading import LoadedModel
from depthcurse.prune.greedy import GREEDY_JSON, read_curves
from depthcurse.prune.results import RESULTS_JSON, read_sweep
from depthcurse.runtime import World
from depthcurse.surgery import num_layers


def parse_ks(text: str) -> list[int]:
    try:
        ks = sorted({int(k) for k in text.split(",") if k.strip()})
    except ValueError:
        raise DepthcurseError(f"--ks {text!r}: give numbers of layers, e.g. 2,4,8") from None
    if not ks or ks[0] < 1:
        raise DepthcurseError(f"--ks {text!r}: give numbers of layers, each at least 1, e.g. 2,4,8")
    return ks


def order_sets(folder: Path, ks: list[int], n_layers: int, strategy: str | None = None) -> tuple[dict[int, tuple[int, ...]], str]:
    """The layers removed at each k of `ks` by the order in `folder`, and that order in words."""
    folder = Path(folder)
    if (folder / GREEDY_JSON).is_file():
        curves = read_curves(folder)
        strategy = strategy or "greedy"
        if curves.granularity != "layer":
            raise DepthcurseError(f"{folder} removes {curves.granularity} branches: heal removes whole layers")
        if strategy not in curves.curves:
            raise DepthcurseError(f"--strategy {strategy}: {folder} has the orders {', '.join(curves.curves)}")
        points = curves.curves[strategy]
        sets = {p.k: tuple(p.removed) for p in points}
        source, have = f"{strategy} order of {folder}", len(points) - 1
        n = curves.n_units
    elif (folder / ANGULAR_JSON).is_file():
        result = load_angular(folder)
        strategy = strategy or "angular"
        rules = {"angular": 0, "deepest": 1}
        if strategy not in rules:
            raise DepthcurseError(f"--strategy {strategy}: an angular result gives the orders angular and deepest")
        have, n = min(result.max_n, result.num_layers - 1), result.num_layers
        sets = {k: tuple(result.block_choices(k)[rules[strategy]].layers) for k in range(1, have + 1)}
        source = f"{strategy} blocks of {folder}"
    elif (folder / RESULTS_JSON).is_file():
        sweep = read_sweep(folder)
        if strategy not in (None, "one-shot"):
            raise DepthcurseError(f"--strategy {strategy}: a prune sweep gives one order, one-shot (its layers, cheapest first)")
        if sweep.granularity != "layer":
            raise DepthcurseError(f"{folder} removes {sweep.granularity} branches: heal removes whole layers")
        ranked = [v.removed[0] for v in sorted(sweep.single_removals, key=lambda v: (sweep.drop(v)[0], v.removed[0]))]
        sets = {k: tuple(sorted(ranked[:k])) for k in range(1, len(ranked) + 1)}
        source, have, n = f"one-shot order of {folder}", len(ranked), sweep.n_layers
    else:
        raise DepthcurseError(f"{folder} holds no order to heal along: give a prune --greedy, prune --block, angular-distance or prune result")
    if n != n_layers:
        raise DepthcurseError(f"the order in {folder} was made on a model with {n} layers; this one has {n_layers}")
    beyond = [k for k in ks if k not in sets]
    if beyond:
        raise DepthcurseError(f"--ks {','.join(map(str, beyond))} goes beyond the order in {folder}: it has {have} step(s)")
    return {k: sets[k] for k in ks}, source


def heal_curve(loaded: LoadedModel, load: Callable[[], LoadedModel], cfg: HealConfig, sets: dict[int, tuple[int, ...]], source: str, out_dir: Path, *,
               world: World = World(), methods: tuple[str, ...] | None = None, on_point: Callable[[int, int, int], None] | None = None,
               on_method: Callable[[str, int, int], None] | None = None, **callbacks) -> dict | None:
    """Heal each of `sets` (k -> layers) in `out_dir/kNNN/` (with several `methods`, each in
    `out_dir/kNNN/<method>/`), `loaded` for the first and `load()` for each next (healing
    changes the model in memory); the curve's record, `heal.json` in `out_dir`, on rank 0."""
    out_dir = ensure_out_dir(out_dir)
    methods = tuple(methods or (cfg.method,))
    checked = {(k, m): identity(loaded, check(loaded, replace(cfg, layers=layers).for_method(m))) for k, layers in sets.items() for m in methods}  # every input, before the first trains
    run = {key: v for identity_ in checked.values() for key, v in identity_.items() if key not in ("layers", "method")} | {"order": source, "ks": list(sets)}
    if len(methods) > 1 or methods[0] != "lora":
        run["methods"] = list(methods)
    if (out_dir / HEAL_JSON).exists():
        refuse_other_run(out_dir, read_heal(out_dir)["run"], run, ignore=RESUMABLE_CHANGES, what="healed curve")
    record = {"run": run, "n_layers": num_layers(loaded.model), "points": []}
    unpruned, models = None, Models(loaded, load)
    for i, (k, layers) in enumerate(sets.items()):
        if on_point:
            on_point(k, i, len(sets))
        folder = out_dir / f"k{k:03d}"
        if len(methods) > 1:
            compared = heal_methods(loaded, models, replace(cfg, layers=layers), methods, folder, world=world, unpruned=unpruned, on_method=on_method, **callbacks)
            if not world.main:
                continue
            unpruned = compared["results"]["unpruned"]
            point = {"k": k, "layers": list(layers), "results": compared["results"], "methods": compared["methods"], "folder": f"k{k:03d}"}
        else:
            done = finished(folder, checked[(k, methods[0])])  # finished before an interruption: not loaded again
            if done is None:
                done = heal(models.next(), replace(cfg, layers=layers).for_method(methods[0]), folder, world=world, unpruned=unpruned, **callbacks)
            if not world.main:
                continue
            unpruned = done["results"]["unpruned"]
            point = {"k": k, "layers": list(layers), "results": done["results"], "recovered": done["recovered"], "cost": done.get("cost"), "folder": f"k{k:03d}"}
        record["points"].append(point)
        atomic_write(out_dir / HEAL_JSON, json_text(record))
    return record if world.main else None
