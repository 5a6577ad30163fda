"""A healed depth curve (Gromov et al.'s Figure 1d): the first k layers of an earlier result's
order removed and healed, for each k, against the same removals unhealed.

The order comes from a results folder: a `prune --greedy` result (a strategy's sets, `greedy` by
default), a `prune --block` or `angular-distance` result (for each k the angular block of k
layers, or the k deepest before the last), or a single-layer sweep (its layers, cheapest first).
Each k is a heal run of its own in `kNNN/` (with several methods, a comparison of them, each in
`kNNN/<method>/`), resumable as any is; the unpruned model is measured once, by the first.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Callable

from depthcurse.angular import load_angular
from depthcurse.angular.result import ANGULAR_JSON
from depthcurse.errors import DepthcurseError
from depthcurse.heal.config import RESUMABLE_CHANGES, HealConfig
from depthcurse.heal.compare import Models, heal_methods, method_entry
from depthcurse.heal.intervals import gap_upper_bound, items
from depthcurse.heal.loop import HEAL_JSON, PER_METHOD, check, finished, heal, identity, read_heal
from depthcurse.io import atomic_write, ensure_out_dir, json_text, refuse_other_run
from depthcurse.loading import LoadedModel
from depthcurse.prune.greedy import GREEDY_JSON, read_curves
from depthcurse.prune.results import RESULTS_JSON, read_sweep
from depthcurse.runtime import World
from depthcurse.surgery import num_layers


def parse_ks(text: str, n_layers: int | None = None) -> list[int]:
    """--ks: numbers of layers (2,4,8) or shares of the depth (25%, 12.5%), as numbers of layers of
    a model of `n_layers` (a share is rounded, and at least 1). Without `n_layers`, only checked."""
    ks, tokens = set(), [t.strip() for t in text.split(",") if t.strip()]
    for token in tokens:
        if token.endswith("%"):
            share = _number(token[:-1], f"--ks {text!r}: give numbers of layers or shares of the depth, e.g. 2,4,8 or 25%")
            if not 0 < share <= 100:
                raise DepthcurseError(f"--ks {token}: a share of the depth is more than 0% and at most 100%")
            if n_layers is not None:
                ks.add(max(1, round(share / 100 * n_layers)))
            continue
        try:
            ks.add(int(token))
        except ValueError:
            raise DepthcurseError(f"--ks {text!r}: give numbers of layers or shares of the depth, e.g. 2,4,8 or 25%") from None
    if not tokens or min(ks, default=1) < 1:
        raise DepthcurseError(f"--ks {text!r}: give numbers of layers, each at least 1, or shares of the depth, e.g. 2,4,8 or 25%")
    return sorted(ks)


def parse_share(text: str, option: str = "--max-drop") -> float:
    """A share written 5% or 0.05, more than 0 and at most 100%, as a fraction."""
    value = _number(text.strip().removesuffix("%"), f"{option} {text!r}: give a share, e.g. 5% or 0.05")
    value = value / 100 if text.strip().endswith("%") else value
    if not 0 < value <= 1:
        raise DepthcurseError(f"{option} {text}: a share is more than 0% and at most 100%")
    return value


def _number(text: str, error: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise DepthcurseError(error) from None
    if not math.isfinite(value):
        raise DepthcurseError(error)
    return value


def order_sets(folder: Path, ks: list[int] | None, n_layers: int, strategy: str | None = None) -> tuple[dict[int, tuple[int, ...]], str]:
    """The layers removed at each k of `ks` (None: every k the order has, short of all the layers)
    by the order in `folder`, and that order in words."""
    folder = Path(folder)
    if (folder / GREEDY_JSON).is_file():
        curves = read_curves(folder)
        strategy = strategy or "greedy"
        if curves.granularity != "layer":
            raise DepthcurseError(f"{folder} removes {curves.granularity} branches: heal removes whole layers")
        if strategy not in curves.curves:
            raise DepthcurseError(f"--strategy {strategy}: {folder} has the orders {', '.join(curves.curves)}")
        points = curves.curves[strategy]
        sets = {p.k: tuple(p.removed) for p in points if p.k > 0}  # k = 0 is the unpruned model: nothing to heal
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
    if ks is None:
        ks = sorted(k for k in sets if k < n_layers)
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
    curve = _Curve(loaded, load, cfg, sets, source, out_dir, world, methods, on_method, callbacks)
    for i, k in enumerate(sets):
        if on_point:
            on_point(k, i, len(sets))
        curve.point(k)
    return curve.record if world.main else None


def _over_budget(results: dict, max_drop: float) -> float:
    """How far the upper end of the healed loss's 95% interval lies above the budget, (1 + max_drop)
    times the unpruned model's loss, paired over the held-out windows (negative: within it)."""
    healed, unpruned = results["healed"]["held_out"]["metrics"]["loss"], results["unpruned"]["held_out"]["metrics"]["loss"]
    groups = {"healed": items(results["healed"], "held_out", "loss"), "unpruned": items(results["unpruned"], "held_out", "loss")}
    if None in groups.values():
        return healed - (1 + max_drop) * unpruned  # an earlier run without the windows: the point alone
    return gap_upper_bound(healed, unpruned, 1 + max_drop, groups, "healed")


def heal_within(loaded: LoadedModel, load: Callable[[], LoadedModel], cfg: HealConfig, sets: dict[int, tuple[int, ...]], source: str, out_dir: Path,
                max_drop: float, *, world: World = World(), on_point: Callable[[int, int, int], None] | None = None, **callbacks) -> dict | None:
    """The largest k of `sets` whose healed held-out loss stays within `max_drop` (a fraction) of
    the unpruned model's, the upper end of its 95% interval (paired over the windows) included: a bisection over the order's prefixes (the loss taken to grow with k),
    each heal in `out_dir/kNNN/` as a curve's, reused where it was made already. The record is a
    healed curve of the ks tried, with `budget`: each probe, the k chosen and why."""
    ks = sorted(sets)
    curve = _Curve(loaded, load, cfg, {k: sets[k] for k in ks}, source, out_dir, world, None, None, callbacks, extra={"max_drop": max_drop})
    probes: dict[int, bool] = {}
    lo, hi, best, tries = 0, len(ks) - 1, None, 0
    rounds = math.ceil(math.log2(len(ks) + 1))
    while lo <= hi:
        mid = (lo + hi) // 2
        if on_point:
            on_point(ks[mid], tries, rounds)
        tries += 1
        point = curve.point(ks[mid])
        if not world.main:  # rank 0 decides: the others follow its choice
            within = world.broadcast(None)
        else:
            within = world.broadcast(_over_budget(point["results"], max_drop) <= 0)
        probes[ks[mid]] = within
        if within:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    if not world.main:
        return None
    unpruned = curve.record["points"][0]["results"]["unpruned"]["held_out"]["metrics"]["loss"]
    limit = (1 + max_drop) * unpruned
    chosen = ks[best] if best is not None else 0
    tried = [{"k": p["k"], "healed_loss": p["results"]["healed"]["held_out"]["metrics"]["loss"],
              "healed_loss_upper": _over_budget(p["results"], max_drop) + limit, "within": probes[p["k"]]} for p in curve.record["points"]]
    above = [t["k"] for t in tried if not t["within"]]
    at = next((t for t in tried if t["k"] == chosen), None)
    why = (f"k = {chosen}: its healed held-out loss {at['healed_loss']:.4f} is within {max_drop:.1%} of the unpruned model's {unpruned:.4f} "
           f"(at most {limit:.4f}) with the upper end of its 95% interval ({at['healed_loss_upper']:.4f})" if chosen
           else f"no k of the order stays within {max_drop:.1%} of the unpruned model's loss {unpruned:.4f}, the upper end of its 95% interval included")
    if above:  # a bisection only fails above the k it keeps
        why += f"; k = {min(above)} is not"
    elif chosen == ks[-1]:
        why += f"; it is the order's longest prefix tried ({ks[-1]})"
    curve.record["budget"] = {"max_drop": max_drop, "measure": "held-out loss", "unpruned": unpruned, "limit": limit, "probes": tried, "chosen": chosen,
                              "why": why}
    curve.write()
    return curve.record


class _Curve:
    """A healed curve's points, each a heal (or a comparison of methods) in `kNNN/`, the unpruned
    model measured once; its record written after each point, points in order of k."""

    def __init__(self, loaded, load, cfg, sets, source, out_dir, world, methods, on_method, callbacks, extra=None):
        self.out_dir, self.world, self.sets, self.cfg, self.source = ensure_out_dir(out_dir), world, sets, cfg, source
        self.methods = tuple(methods or (cfg.method,))
        self.loaded, self.on_method, self.callbacks = loaded, on_method, callbacks
        self.checked = {(k, m): identity(loaded, check(loaded, replace(cfg, layers=layers).for_method(m))) for k, layers in sets.items() for m in self.methods}
        run = {key: v for identity_ in self.checked.values() for key, v in identity_.items() if key not in ("layers", *PER_METHOD)}
        run |= {"order": source, "ks": list(sets), "methods": list(self.methods),
                "method_settings": {m: self.checked[(k, m)]["method_settings"] for k in sets for m in self.methods}}
        run.update(extra or {})
        if (self.out_dir / HEAL_JSON).exists():
            refuse_other_run(self.out_dir, read_heal(self.out_dir)["run"], run, ignore=RESUMABLE_CHANGES, what="healed curve")
        self.record = {"run": run, "n_layers": num_layers(loaded.model), "points": []}
        self.unpruned, self.models = None, Models(loaded, load)

    def point(self, k: int) -> dict | None:
        """Heal (or find healed) the first k layers of the order; the point, on rank 0."""
        layers, folder = self.sets[k], self.out_dir / f"k{k:03d}"
        why = f"the first {k} layers of the {self.source}"
        if len(self.methods) > 1:
            compared = heal_methods(self.loaded, self.models, replace(self.cfg, layers=layers), self.methods, folder, world=self.world, unpruned=self.unpruned,
                                    why=why, on_method=self.on_method, **self.callbacks)
            if not self.world.main:
                return None
            point = {"k": k, "layers": list(layers), "results": compared["results"], "methods": compared["methods"], "folder": folder.name}
        else:
            done = finished(folder, self.checked[(k, self.methods[0])])  # finished before an interruption: not loaded again
            if done is None:
                done = heal(self.models.next(), replace(self.cfg, layers=layers).for_method(self.methods[0]), folder, world=self.world,
                            unpruned=self.unpruned, why=why, **self.callbacks)
            if not self.world.main:
                return None
            point = {"k": k, "layers": list(layers), "method": self.methods[0], **method_entry(done), "results": done["results"], "folder": folder.name}
        self.unpruned = point["results"]["unpruned"]
        self.record["points"] = sorted([p for p in self.record["points"] if p["k"] != k] + [point], key=lambda p: p["k"])
        self.write()
        return point

    def write(self) -> None:
        atomic_write(self.out_dir / HEAL_JSON, json_text(self.record))
