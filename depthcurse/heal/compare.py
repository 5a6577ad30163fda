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
from depthcurse.heal.config import RESUMABLE_CHANGES, HealConfig
from depthcurse.heal.intervals import apart, items
from depthcurse.stats.intervals import interval, paired_spread
from depthcurse.stats.multiple import holm_family
from depthcurse.heal.loop import HEAL_JSON, PER_METHOD, check, finished, heal, identity, read_heal, refusal
from depthcurse.heal.method import build_method, said
from depthcurse.io import atomic_write, ensure_out_dir, json_text, refuse_other_run
from depthcurse.loading import LoadedModel
from depthcurse.runtime import World


def parse_methods(text: str) -> tuple[str, ...]:
    """Method names (each a registered one, `a+b`, or `module:Class`), each checked to be found."""
    methods = tuple(m.strip() for m in text.split(",") if m.strip())
    if not methods:
        raise DepthcurseError(f"--methods {text!r}: give methods, e.g. lora,linear")
    twice = sorted({m for m in methods if methods.count(m) > 1})
    if twice:
        raise DepthcurseError(f"--methods {text}: {', '.join(twice)} given more than once (each method runs once)")
    named: dict[str, str] = {}
    for m in methods:
        name = build_method(m).name  # an unknown name is one line, naming the known ones
        if name in named:
            raise DepthcurseError(f"--methods {text}: {named[name]} and {m} are both named {name!r}, so the table and heal.json could not tell "
                                  "them apart: give one a name of its own")
        named[name] = m
    return methods


def check_settings(cfg: HealConfig, methods: tuple[str, ...]) -> None:
    """Every setting given applies to at least one of `methods`, and each method's are valid."""
    used = set()
    for m in methods:
        mine = cfg.for_method(m)
        mine.resolved()
        used |= set(mine.method_args)
    unused = [k for k in cfg.method_args if k not in used]
    if unused:
        raise DepthcurseError(f"{said(unused[0])} does not apply to any of --methods {','.join(methods)}")


def method_entry(point: dict) -> dict:
    """What one method's heal gives a comparison: its healed model's measurements, the share won
    back (and why not, where there was no gap), the cost, and how it healed."""
    return {"results": point["results"]["healed"], "recovered": point["recovered"], "recovered_why": point.get("recovered_why", {}),
            "recovered_interval": point.get("recovered_interval", {}), "cost": point.get("cost"), "hf_layers": point.get("hf_layers"), "hf_bytes": point.get("hf_bytes"),
            "title": point["run"].get("method_title"), "how": point["run"].get("method_how"), "unchanged": point.get("unchanged")}


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
    first; the comparison's record, `heal.json` in `out_dir`, on rank 0. A method this model's
    architecture cannot take is left out, with why, and the others run; so is one refused later (in
    its prepare or training: a `DepthcurseError`, or any error of a method from outside). `unpruned`: that model's
    measurement if it was made already (a healed curve's)."""
    out_dir = ensure_out_dir(out_dir)
    refused = {m: why_not for m in methods if (why_not := refusal(loaded, cfg.for_method(m).build(), cfg.layers)) is not None}
    able = tuple(m for m in methods if m not in refused)
    if not able:
        raise DepthcurseError(f"none of --methods {','.join(methods)} can heal this model: {next(iter(refused.values()))}")
    checked = {m: identity(loaded, check(loaded, cfg.for_method(m))) for m in able}  # every method's input, before the first runs
    run = {k: v for identity_ in checked.values() for k, v in identity_.items() if k not in PER_METHOD} | {"methods": list(methods)}
    run["method_settings"] = {m: checked[m]["method_settings"] for m in able}
    if (out_dir / HEAL_JSON).exists():
        refuse_other_run(out_dir, read_heal(out_dir)["run"], run, ignore=RESUMABLE_CHANGES, what="comparison of methods")
    record = {"run": run, "results": {}, "methods": {}, "refused": refused}
    shared = {"unpruned": unpruned, "pruned": None}
    for i, method in enumerate(able):
        if on_method:
            on_method(method, i, len(able))
        folder = out_dir / _folder(method)
        point = finished(folder, checked[method])  # finished before an interruption: not loaded again
        if point is None:
            try:
                point = heal(models.next(), cfg.for_method(method), folder, world=world, why=why, **shared, **callbacks)
            except Exception as exc:  # refused late (its prepare, its training): the others still run, and the record says why
                if not isinstance(exc, DepthcurseError) and cfg.for_method(method).build().builtin:
                    raise  # a built-in method's own error is a bug of ours: not a refusal to file away
                refused[method] = str(exc) if isinstance(exc, DepthcurseError) else f"it raised {type(exc).__name__}: {exc}"
                if world.main:
                    record["refused"] = refused
                    atomic_write(out_dir / HEAL_JSON, json_text(record))
                continue
        if not world.main:
            continue
        shared = {name: point["results"][name] for name in ("unpruned", "pruned")}
        record["results"] = dict(shared)
        record["held_out"] = point.get("held_out")
        record["measured_on"] = point.get("measured_on")
        record["massive_activation"] = point.get("massive_activation")
        record["methods"][method] = {**method_entry(point), "folder": _folder(method)}
        record["ties"] = method_differences(record)
        atomic_write(out_dir / HEAL_JSON, json_text(record))
    if all(m in refused for m in able):
        raise DepthcurseError(f"none of --methods {','.join(methods)} healed this model: " + "; ".join(f"{m}: {w}" for m, w in refused.items()))
    return record if world.main else None


# What the methods are ranked on: (part, metric), the suite's average standing for its retained share.
RANKED = (("held_out", "loss"), ("other", "loss"), ("task", None))


def method_differences(record: dict) -> dict[str, list[dict]]:
    """Every pair of methods on each ranked measurement: the difference of their healed models'
    scores with its 95% interval from the paired windows or questions, and whether that interval
    excludes 0 (`apart`); beside it, Holm's adjustment over the measurement's pairs (`p_holm`,
    `interval_holm`, `apart_holm`: what the verdicts use). A pair not apart is a tie the comparison
    cannot break."""
    methods = record.get("methods") or {}
    out: dict[str, list[dict]] = {}
    names = list(methods)
    for part, metric in RANKED:
        key, pairs = None, []
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                ra, rb = methods[a]["results"], methods[b]["results"]
                if part not in ra or part not in rb:
                    continue
                m = metric or ra[part]["metric"]
                key = f"{part}_{m}"
                va, vb = ra[part]["metrics"].get(m), rb[part]["metrics"].get(m)
                groups = {a: items(ra, part, m), b: items(rb, part, m)}
                if va is None or vb is None or None in groups.values():
                    continue
                spread = paired_spread(groups, {a: 1.0, b: -1.0})
                low_high = interval(va - vb, spread)
                pairs.append({"methods": [a, b], "difference": va - vb, "interval": low_high, "apart": apart(low_high), "spread": spread})
        if key and pairs:  # the family of this measurement's pairs, Holm-adjusted
            for pair, adjusted in zip(pairs, holm_family([(p["difference"], p.pop("spread")) for p in pairs])):
                pair.update(adjusted)
            out[key] = pairs
    return out


def _folder(method: str) -> str:
    """A method's folder in a comparison (an outside `module:Class` or `file.py:Class` made a name)."""
    return method.replace(":", "-").replace("/", "-")
