"""The prune sweep: the unpruned baseline, then the model with each selected layer removed.

Results go to disk (atomically) after every variant, so an interrupted sweep keeps what it
finished and a rerun of the same command continues from there without recomputing anything.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from depthcurse import report
from depthcurse.errors import DepthcurseError
from depthcurse.loading import LoadedModel
from depthcurse.surgery import num_layers, removed_layers
from depthcurse.tasks import Task

RESULTS_JSON = "prune.json"


@dataclass
class VariantResult:
    removed: list[int]  # [] for the unpruned baseline
    metrics: dict[str, float]
    examples: int
    seconds: float
    details: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        return variant_label(self.removed)


def removal_key(variant: int | Iterable[int]) -> tuple[int, ...]:
    """A variant as the sorted tuple of removed layers: 3 -> (3,), [5, 4] -> (4, 5)."""
    return (variant,) if isinstance(variant, int) else tuple(sorted(set(variant)))


def variant_label(removed: Iterable[int]) -> str:
    removed = list(removed)
    return "none" if not removed else ",".join(map(str, removed))


@dataclass
class Sweep:
    """Everything `prune.json` holds; `variants[0]` is the baseline once it has run."""

    run: dict  # what identifies the run: resuming requires the same
    metric: str
    higher_is_better: bool
    n_layers: int
    variants: list[VariantResult] = field(default_factory=list)
    meta: dict = field(default_factory=dict)  # versions, wall time: informative, not identity

    @property
    def baseline(self) -> VariantResult | None:
        return next((v for v in self.variants if not v.removed), None)

    def drop(self, v: VariantResult) -> tuple[float, float]:
        """(absolute, relative) worsening against the baseline: positive means worse."""
        base = self.baseline
        if base is None:
            return float("nan"), float("nan")
        b, x = base.metrics[self.metric], v.metrics[self.metric]
        worse = b - x if self.higher_is_better else x - b
        return worse, (worse / abs(b) if b else float("nan"))

    def to_json(self) -> dict:
        return {"run": self.run, "metric": self.metric, "higher_is_better": self.higher_is_better, "n_layers": self.n_layers, **self.meta, "variants": [asdict(v) for v in self.variants]}

    @classmethod
    def from_json(cls, data: dict) -> "Sweep":
        keys = {"run", "metric", "higher_is_better", "n_layers", "variants"}
        return cls(
            run=data["run"],
            metric=data["metric"],
            higher_is_better=data["higher_is_better"],
            n_layers=data["n_layers"],
            variants=[VariantResult(**v) for v in data["variants"]],
            meta={k: v for k, v in data.items() if k not in keys},
        )


def load_previous(out_dir: Path, run: dict) -> list[VariantResult]:
    """Finished variants of the same run in `out_dir`; a different run there is an error, not overwritten."""
    path = out_dir / RESULTS_JSON
    if not path.exists():
        return []
    try:
        old = Sweep.from_json(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError) as exc:
        raise DepthcurseError(f"{path} is not a depthcurse prune result ({exc}); remove it or choose another --out") from exc
    if old.run != run:
        differ = sorted(k for k in set(run) | set(old.run) if run.get(k) != old.run.get(k))
        raise DepthcurseError(f"{out_dir} holds a different run (differs in: {', '.join(differ)}); choose another --out or delete it")
    return old.variants


def run_sweep(
    loaded: LoadedModel,
    task: Task,
    variants: Iterable[int | Iterable[int]],
    out_dir: Path,
    *,
    run_extra: dict | None = None,
    on_variant: Callable[[str, int, int], None] | None = None,
    engine: str = "reuse",
    max_memory: str | int | None = None,
) -> Sweep:
    """Evaluate the baseline and each variant, saving after each one.

    A variant is a layer index (that layer removed) or a collection of indices removed together
    (a block). The unpruned baseline always runs first.

    `on_variant(label, done, total)` is called before each variant is evaluated (for progress
    display). KeyboardInterrupt propagates, with every finished variant already on disk.

    `engine="reuse"` (see depthcurse.engine) scores all variants together, batch by batch,
    reusing what they share; its finished batches are kept in `prune.partial/` until the end, and
    `on_variant("batches", done, total)` reports them. A model or task it cannot run falls back
    to `engine="lm-eval"`: each variant evaluated on its own, in memory. Which one ran, and why,
    is saved in prune.json under "engine".
    """
    if engine not in ENGINES:
        raise DepthcurseError(f"unknown --engine {engine!r}: use {' or '.join(ENGINES)}")
    started = time.perf_counter()
    model = loaded.model
    # Which layers were asked for is not part of the identity: a rerun with more layers extends the sweep.
    run = {**loaded.describe(), **task.describe(), **(run_extra or {})}
    run.pop("device", None)  # a resumed run may move between machines; the dtype is what matters
    run["device_kind"] = loaded.device.type
    out_dir = report.ensure_out_dir(out_dir)
    sweep = Sweep(run=run, metric=task.metric, higher_is_better=task.higher_is_better, n_layers=num_layers(model))
    sweep.variants = load_previous(out_dir, run)
    done = {tuple(v.removed) for v in sweep.variants}
    asked = [()] + [removal_key(v) for v in variants]
    asked = list(dict.fromkeys(asked))
    todo = [r for r in asked if r not in done]
    previous_wall = 0.0
    if (out_dir / RESULTS_JSON).exists():
        previous_wall = json.loads((out_dir / RESULTS_JSON).read_text()).get("wall_time_s", 0.0)
    total = len(asked)
    engine_info = {"name": "lm-eval" if todo else engine}
    if engine == "reuse" and todo:
        engine_info = _reuse(loaded, task, todo, sweep, out_dir, run, max_memory, on_variant, started, previous_wall)
        if engine_info["name"] == "reuse":
            todo = []
    for removed in todo:
        if on_variant:
            on_variant(variant_label(removed), total - len(todo) + todo.index(removed), total)
        t0 = time.perf_counter()
        with removed_layers(model, removed):
            score = task.evaluate(model)
        sweep.variants.append(VariantResult(list(removed), score.metrics, score.examples, round(time.perf_counter() - t0, 3), score.details))
        sweep.variants.sort(key=lambda v: (len(v.removed), v.removed))
        sweep.meta = {"wall_time_s": round(previous_wall + time.perf_counter() - started, 3), "environment": report.environment(), "engine": engine_info}
        report.write_prune_tables(sweep, out_dir)
    if on_variant:
        on_variant("done", total, total)
    sweep.meta = {"wall_time_s": round(previous_wall + time.perf_counter() - started, 3), "environment": report.environment(), "engine": engine_info}
    report.write_prune_tables(sweep, out_dir)
    return sweep


ENGINES = ("reuse", "lm-eval")
PARTIAL_DIR = "prune.partial"


def _reuse(loaded, task, todo, sweep, out_dir, run, max_memory, on_variant, started, previous_wall) -> dict:
    """Score `todo` with the reuse engine and add the results to `sweep`; the engine info for prune.json.

    Returns {"name": "lm-eval", "fallback": reason} without doing anything when the engine
    cannot run this model or task.
    """
    import shutil

    from depthcurse import engine

    reason = engine.why_unsupported(loaded.model, task)
    if reason:
        return {"name": "lm-eval", "fallback": reason}
    t0 = time.perf_counter()
    store = out_dir / PARTIAL_DIR
    progress = (lambda done, total: on_variant("batches", done, total)) if on_variant else None
    scores, stats = engine.evaluate_variants(loaded.model, task, todo, max_memory=max_memory, store=store, fingerprint=json.dumps(run, sort_keys=True, default=str), on_batch=progress, checked=True)
    # The variants finish together: each is credited an equal share of the time.
    share = round((time.perf_counter() - t0) / len(todo), 3)
    for removed in todo:
        score = scores[removed]
        sweep.variants.append(VariantResult(list(removed), score.metrics, score.examples, share, score.details))
    sweep.variants.sort(key=lambda v: (len(v.removed), v.removed))
    info = {"name": "reuse", "max_memory": engine.parse_memory(max_memory), **stats}
    sweep.meta = {"wall_time_s": round(previous_wall + time.perf_counter() - started, 3), "environment": report.environment(), "engine": info}
    report.write_prune_tables(sweep, out_dir)
    shutil.rmtree(store, ignore_errors=True)  # everything it held is in prune.json now
    return info
