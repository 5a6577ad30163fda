"""Greedy depth curves: how much depth can go, and which, measured exactly.

Step k removes, among the units still there (layers, or the attention/MLP branches of layers),
the one whose removal costs least on the task: every candidate is evaluated, as a prune sweep
whose variants are "what is gone so far, plus one more". With the reuse engine those variants
share the stream up to their first removed block, so an exact greedy curve costs a few sweeps.

For comparison, on the same data, the orders cheaper rules give:
* one-shot: the single-removal sweep's ranking (step 1 of the greedy search), cheapest first;
* block-influence: ShortGPT's Block Influence, 1 - cos(x_l, x_l+1), lowest first (layers only);
* angular: Gromov et al.'s contiguous block l*..l*+n-1 with the smallest d(x_l, x_l+n), for each n
  (layers only);
* last: the n deepest units before the final layer.

Each step is its own sweep folder (`steps/NNN/`), resumable as any sweep is, so an interrupted
or extended search recomputes nothing it finished; `greedy.json` sums them up.

`replay_orders` measures the orders of an earlier result on other data (held-out text, another
task): whether the units a strategy chose on one text are also the cheap ones on another.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from depthcurse.errors import DepthcurseError
from depthcurse.io import atomic_write, csv_text, ensure_out_dir, environment, json_text, read_record
from depthcurse.loading import LoadedModel
from depthcurse.prune.results import Sweep, read_sweep, removal_key
from depthcurse.prune.sweep import run_sweep
from depthcurse.runtime import World
from depthcurse.surgery import check_granularity, num_layers
from depthcurse.tasks.base import Task

GREEDY_JSON = "greedy.json"
GREEDY_CSV = "greedy.csv"
STEPS_DIR = "steps"
ORDERS_DIR = "orders"  # the other strategies' sets, evaluated together
STRATEGIES = ("greedy", "one-shot", "block-influence", "angular", "last")
THRESHOLDS = (0.01, 0.05, 0.10)  # relative drops the table counts units within


@dataclass
class CurvePoint:
    k: int  # units removed
    removed: list[int]
    metric: float
    drop: float  # absolute worsening against the unpruned model (positive: worse)
    relative_drop: float


@dataclass
class DepthCurves:
    """Every strategy's metric after removing k units, k = 0..K; what `greedy.json` holds."""

    run: dict
    granularity: str
    n_units: int
    metric: str
    higher_is_better: bool
    curves: dict[str, list[CurvePoint]]
    notes: dict[str, str] = field(default_factory=dict)  # strategies left out, and why
    made: dict = field(default_factory=dict)  # how it was made: the wall time of its sweeps (kept across a resume) and the environment

    def units_within(self, strategy: str, threshold: float) -> int:
        """Units removed before the relative drop first exceeds `threshold`."""
        within = 0
        for p in self.curves[strategy][1:]:
            if not p.relative_drop <= threshold:  # NaN counts as past it
                break
            within = p.k
        return within

    def within_text(self, strategy: str, threshold: float) -> str:
        """`units_within` for a table: "≥k" when the curve ends without passing `threshold` before
        every unit is gone, so that more might go."""
        within = self.units_within(strategy, threshold)
        open_ended = self.curves[strategy][-1].k == within < max_units(self.n_units, self.granularity)
        return f"≥{within}" if open_ended else str(within)

    def to_json(self) -> dict:
        return {
            "run": self.run, "granularity": self.granularity, "n_units": self.n_units, "metric": self.metric,
            "higher_is_better": self.higher_is_better, "notes": self.notes,
            "units_within": {s: {f"{t:.0%}": self.units_within(s, t) for t in THRESHOLDS} for s in self.curves},
            "curves": {s: [asdict(p) for p in points] for s, points in self.curves.items()}, **self.made,
        }

    @classmethod
    def from_json(cls, data: dict) -> "DepthCurves":
        curves = {s: [CurvePoint(**p) for p in points] for s, points in data["curves"].items()}
        made = {key: data[key] for key in ("wall_time_s", "environment") if key in data}
        return cls(data["run"], data["granularity"], data["n_units"], data["metric"], data["higher_is_better"], curves, data.get("notes", {}), made)


def read_curves(path: Path) -> DepthCurves:
    """A greedy result, from its folder or its greedy.json."""
    return read_record(path, GREEDY_JSON, "greedy result", shape=DepthCurves.from_json)


def max_units(n_layers: int, granularity: str) -> int:
    """At least one block stays: a model without any is not a model."""
    return n_layers - 1 if granularity == "layer" else n_layers


def _point(sweep: Sweep, removed: tuple[int, ...]) -> CurvePoint:
    v = next(v for v in sweep.variants if tuple(v.removed) == removed)
    drop, relative = sweep.drop(v)
    return CurvePoint(len(removed), list(removed), v.metrics[sweep.metric], drop, relative)


def heuristic_orders(n_layers: int, granularity: str, k_max: int, one_shot: Sweep, angular=None, missing: str = "no angular-distance pass") -> tuple[dict[str, list[tuple[int, ...]]], dict[str, str]]:
    """The sets each cheaper rule removes for k = 1..k_max, and the rules left out with the reason."""
    singles = sorted(one_shot.single_removals, key=lambda v: (one_shot.drop(v)[0], v.removed[0]))
    ranked = [v.removed[0] for v in singles]
    orders = {
        "one-shot": [removal_key(ranked[:k]) for k in range(1, k_max + 1)],
        # the deepest k before the final one; all n branches at k = n (only branches go that far)
        "last": [tuple(range(n_layers - 1 - k, n_layers - 1)) if k < n_layers else tuple(range(n_layers)) for k in range(1, k_max + 1)],
    }
    notes = {}
    if granularity != "layer":
        notes["block-influence"] = notes["angular"] = f"measured between whole blocks: not defined for --granularity {granularity}"
    elif angular is None:
        notes["block-influence"] = notes["angular"] = missing
    else:
        by_influence = sorted(range(n_layers), key=lambda l: (angular.block_influence[l], l))
        orders["block-influence"] = [removal_key(by_influence[:k]) for k in range(1, k_max + 1)]
        reach = min(k_max, angular.max_n, n_layers - 1)
        orders["angular"] = [angular.block_choices(k)[0].layers for k in range(1, reach + 1)]
        if reach < k_max:
            notes["angular"] = f"blocks up to n={reach} (the angular pass's max n)"
    return orders, notes


def run_greedy(
    loaded: LoadedModel,
    task: Task,
    out_dir: Path,
    *,
    steps: int,
    granularity: str = "layer",
    max_drop: float | None = None,
    compare: bool = True,
    angular: Callable[[], object] | None = None,
    run_extra: dict | None = None,
    engine: str = "reuse",
    max_memory: str | int | None = None,
    compile: bool = False,
    on_step: Callable[[str, int, int], None] | None = None,
    on_variant: Callable[[str, int, int], None] | None = None,
    world: World = World(),
) -> DepthCurves | None:
    """The greedy curve for up to `steps` units (stopping after the step whose relative drop
    passes `max_drop`) and, with `compare`, the heuristic orders measured for as many units.

    `angular()` gives an `AngularResult` for the block-influence and angular orders (None: left
    out). `on_step(label, done, total)` reports the steps; `on_variant` each step's sweep.
    Under torchrun every rank calls this; rank 0 writes and returns the result.
    """
    check_granularity(loaded.model, granularity)
    n = num_layers(loaded.model)
    limit = max_units(n, granularity)
    if not 1 <= steps <= limit:
        raise DepthcurseError(f"--greedy {steps} is out of range: {type(loaded.model).__name__} has {n} layers, so 1-{limit} {granularity} units can go")
    if max_drop is not None and not max_drop > 0:
        raise DepthcurseError(f"--max-drop must be positive (a relative drop, e.g. 0.05 for 5%), got {max_drop}")
    out_dir = ensure_out_dir(out_dir)
    common = dict(engine=engine, max_memory=max_memory, compile=compile, granularity=granularity, world=world, on_variant=on_variant)
    removed: list[int] = []
    points: list[CurvePoint] = []
    step_sweeps: list[Sweep] = []
    for k in range(1, steps + 1):
        if on_step:
            on_step(f"step {k}: which {granularity} goes next", k - 1, steps)
        step_dir = out_dir / STEPS_DIR / f"{k:03d}"
        candidates = [tuple(sorted(removed + [u])) for u in range(n) if u not in removed]
        run_sweep(loaded, task, candidates, step_dir, run_extra={**(run_extra or {}), "greedy_removed": sorted(removed)}, **common)
        world.barrier()  # every rank reads rank 0's results: all take the same next step
        sweep = read_sweep(step_dir)
        step_sweeps.append(sweep)
        if not points:
            points.append(_point(sweep, ()))
        # cheapest removal; ties go to the lowest unit, so the path never depends on the order of evaluation
        best = min((sweep.drop(v)[0], [u for u in v.removed if u not in removed][0]) for v in sweep.variants if len(v.removed) == k)[1]
        removed.append(best)
        points.append(_point(sweep, tuple(sorted(removed))))
        if max_drop is not None and not points[-1].relative_drop <= max_drop:
            break
    curves = {"greedy": points}
    notes = {}
    if compare:
        pass_, missing = None, "no angular-distance pass"
        if angular is not None and granularity == "layer":
            try:
                pass_ = angular()
            except DepthcurseError as exc:  # no text to measure on, say: the other strategies still stand
                missing = f"no angular-distance pass: {exc}"
        orders, notes = heuristic_orders(n, granularity, len(removed), step_sweeps[0], pass_, missing)
        # what the steps measured (the greedy points, step 1's single removals) is not measured again
        measured = {tuple(v.removed): _point(s, tuple(v.removed)) for s in step_sweeps for v in s.variants}
        todo = sorted({s for sets in orders.values() for s in sets if s not in measured})
        if todo:
            if on_step:
                on_step("the other strategies' orders", steps, steps)
            run_sweep(loaded, task, todo, out_dir / ORDERS_DIR, run_extra=run_extra, **common)
            world.barrier()
            others = read_sweep(out_dir / ORDERS_DIR)
            measured.update({s: _point(others, s) for s in todo})
        for name in STRATEGIES[1:]:
            if name in orders:
                curves[name] = [points[0]] + [measured[s] for s in orders[name]]
    if not world.main:
        return None
    first = step_sweeps[0]
    result = DepthCurves(first.run, granularity, n, first.metric, first.higher_is_better, curves, notes,
                         made_by([*step_sweeps, *([others] if compare and todo else [])]))
    write_curves(result, out_dir)
    return result


def replay_orders(
    loaded: LoadedModel,
    task: Task,
    chosen: DepthCurves,
    out_dir: Path,
    *,
    source: str = "",
    run_extra: dict | None = None,
    engine: str = "reuse",
    max_memory: str | int | None = None,
    compile: bool = False,
    on_variant: Callable[[str, int, int], None] | None = None,
    world: World = World(),
) -> DepthCurves | None:
    """Every strategy's sets from `chosen` (an earlier greedy result, from `source`), measured on
    this task and data: one sweep of all of them, the curves in the same form as `run_greedy`'s."""
    check_granularity(loaded.model, chosen.granularity)
    n = num_layers(loaded.model)
    if n != chosen.n_units:
        raise DepthcurseError(f"the orders in {source or 'that result'} were chosen on a model with {chosen.n_units} layers; {type(loaded.model).__name__} has {n}")
    sets = {name: [tuple(p.removed) for p in points[1:]] for name, points in chosen.curves.items()}
    todo = sorted({s for chosen_sets in sets.values() for s in chosen_sets})
    extra = {**(run_extra or {}), "orders_from": source}
    run_sweep(loaded, task, todo, out_dir / ORDERS_DIR, run_extra=extra, engine=engine, max_memory=max_memory, compile=compile, granularity=chosen.granularity, world=world, on_variant=on_variant)
    world.barrier()
    if not world.main:
        return None
    sweep = read_sweep(out_dir / ORDERS_DIR)
    curves = {name: [_point(sweep, ())] + [_point(sweep, s) for s in chosen_sets] for name, chosen_sets in sets.items()}
    run = {**sweep.run, "orders_from": f"{source or 'another result'} ({chosen.run.get('task')} on {chosen.run.get('data', '?')})"}
    result = DepthCurves(run, chosen.granularity, n, sweep.metric, sweep.higher_is_better, curves, dict(chosen.notes), made_by([sweep]))
    write_curves(result, out_dir)
    return result


def made_by(sweeps: list[Sweep]) -> dict:
    """How curves were made: the wall time of the sweeps they were measured by (each kept with its
    sweep, so a resumed run counts the time before the interruption too) and this process's environment."""
    return {"wall_time_s": round(sum(s.meta.get("wall_time_s", 0.0) for s in sweeps), 3), "environment": environment()}


def write_curves(result: DepthCurves, out_dir: Path) -> list[Path]:
    rows = [
        {"strategy": s, "k": p.k, "fraction_removed": round(p.k / result.n_units, 6), "removed": " ".join(map(str, p.removed)),
         result.metric: p.metric, "drop": p.drop, "relative_drop": p.relative_drop}
        for s, points in result.curves.items() for p in points
    ]
    return [atomic_write(out_dir / GREEDY_JSON, json_text(result.to_json())), atomic_write(out_dir / GREEDY_CSV, csv_text(rows))]
