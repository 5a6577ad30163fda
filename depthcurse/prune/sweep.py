"""The prune sweep: the unpruned baseline, then the model with each selected layer removed.

Results go to disk (atomically) after every variant, so an interrupted sweep keeps what it
finished and a rerun of the same command continues from there without recomputing anything.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Callable, Iterable

from depthcurse.errors import DepthcurseError
from depthcurse.io import ensure_out_dir, environment, refuse_other_run
from depthcurse.loading import LoadedModel
from depthcurse.prune import engine
from depthcurse.prune.results import PARTIAL_DIR, Sweep, VariantResult, read_sweep, removal_key, variant_label, write_sweep
from depthcurse.runtime import World
from depthcurse.surgery import check_granularity, num_layers, removed_units
from depthcurse.tasks.base import Task

ENGINES = ("reuse", "lm-eval")


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
    granularity: str = "layer",
    compile: bool = False,
    world: World = World(),
) -> Sweep | None:
    """Evaluate the baseline and each variant, saving after each one.

    A variant is a layer index (that layer removed) or a collection of indices removed together
    (a block). With `granularity` "attn" or "mlp", only that branch of each indexed block is
    removed (the stream passes it by). The unpruned baseline always runs first.

    `on_variant(label, done, total)` is called before each variant is evaluated (for progress
    display). KeyboardInterrupt propagates, with every finished variant already on disk.

    `engine="reuse"` (see `depthcurse.prune.engine`) scores all variants together, batch by batch,
    reusing what they share (with `compile`, through compiled blocks); its finished batches are
    kept in `prune.partial/` until the end, and `on_variant("batches", done, total)` reports them.
    A model or task it cannot run falls back to `engine="lm-eval"`: each variant evaluated on its
    own, in memory. Which one ran, and why, is saved in prune.json under "engine".

    Under torchrun (`world`) every rank calls this with its own copy of the model: the reuse
    engine splits the requests over the ranks, and rank 0 computes the metrics, writes the files
    and returns the sweep; the other ranks return None. The fallback splits the variants: each
    rank evaluates one variant at a time on its own, as one process would.
    """
    if engine not in ENGINES:
        raise DepthcurseError(f"unknown --engine {engine!r}: use {' or '.join(ENGINES)}")
    started = time.perf_counter()
    model = loaded.model
    check_granularity(model, granularity)
    # Which layers were asked for is not part of the identity: a rerun with more layers extends the sweep.
    run = {**loaded.describe(), **task.describe(), **(run_extra or {})}
    if granularity != "layer":  # absent for whole layers, so that earlier sweeps still resume
        run["granularity"] = granularity
    run.pop("device", None)  # a resumed run may move between machines; the dtype is what matters
    run["device_kind"] = loaded.device.type
    out_dir = ensure_out_dir(out_dir)
    sweep = Sweep(run=run, metric=task.metric, higher_is_better=task.higher_is_better, n_layers=num_layers(model))
    previous_wall = 0.0
    previous = read_sweep(out_dir)
    if previous is not None:  # an interrupted or shorter run of the same command: continue it
        refuse_other_run(out_dir, previous.run, run)
        sweep.variants, previous_wall = previous.variants, previous.meta.get("wall_time_s", 0.0)
    done = {tuple(v.removed) for v in sweep.variants}
    asked = [()] + [removal_key(v) for v in variants]
    asked = list(dict.fromkeys(asked))
    todo = [r for r in asked if r not in done]
    total = len(asked)
    engine_info = {"name": "lm-eval" if todo else engine}
    if engine == "reuse" and todo:
        engine_info = _reuse(loaded, task, todo, sweep, out_dir, run, max_memory, on_variant, started, previous_wall, world, granularity, compile)
        if engine_info["name"] == "reuse":
            todo = []
    by_rank = [0] * world.size
    if todo and world.size > 1:
        engine_info["variants_by_rank"] = by_rank  # this run's, not a resumed one's
    # Each variant on its own (the fallback, or --engine lm-eval). Under torchrun the ranks take
    # one variant each per turn, and rank 0 saves the turn's results before the next.
    for first in range(0, len(todo), world.size):
        turn, result = todo[first : first + world.size], None
        if world.rank < len(turn):
            removed = turn[world.rank]
            if on_variant:
                on_variant(variant_label(removed), total - len(todo) + first, total)
            t0 = time.perf_counter()
            with removed_units(model, removed, granularity):
                score = task.evaluate(model)
            result = VariantResult(list(removed), score.metrics, score.examples, round(time.perf_counter() - t0, 3), score.details)
        results = world.gather(result)
        if results is None:
            continue  # rank 0 has the scores and writes the files
        for rank, got in enumerate(results):
            if got is not None:
                sweep.variants.append(got)
                by_rank[rank] += 1
        sweep.variants.sort(key=lambda v: (len(v.removed), v.removed))
        _save(sweep, out_dir, previous_wall + time.perf_counter() - started, engine_info)
    if not world.main:
        return None
    if on_variant:
        on_variant("done", total, total)
    _save(sweep, out_dir, previous_wall + time.perf_counter() - started, engine_info)
    return sweep


def _save(sweep: Sweep, out_dir: Path, wall: float, engine_info: dict) -> None:
    sweep.meta = {"wall_time_s": round(wall, 3), "environment": environment(), "engine": engine_info}
    write_sweep(sweep, out_dir)


def _reuse(loaded, task, todo, sweep, out_dir, run, max_memory, on_variant, started, previous_wall, world, granularity, compile) -> dict:
    """Score `todo` with the reuse engine and add the results to `sweep`; the engine info for prune.json.

    Returns {"name": "lm-eval", "fallback": reason} when the engine cannot run this model or
    task, or fails on it part-way (alone: under torchrun the failure ends every rank, since the
    others wait for its scores). Bad input (DepthcurseError) stays an error.
    """
    reason = engine.why_unsupported(loaded.model, task)
    if reason:
        return {"name": "lm-eval", "fallback": reason}
    t0 = time.perf_counter()
    store = out_dir / PARTIAL_DIR
    progress = (lambda done, total: on_variant("batches", done, total)) if on_variant else None
    try:
        scores, stats = engine.evaluate_variants(loaded.model, task, todo, max_memory=max_memory, store=store, fingerprint=json.dumps(run, sort_keys=True, default=str),
                                                 on_batch=progress, checked=True, granularity=granularity, compile=compile, world=world)
    except DepthcurseError:
        raise
    except Exception as exc:
        if world.size > 1:
            raise
        return {"name": "lm-eval", "fallback": f"the reuse engine failed part-way ({type(exc).__name__}: {exc})"}
    if scores is None:
        return {"name": "reuse"}  # another rank: its share is with rank 0
    # The variants are scored together: each is credited an equal share of the engine's time,
    # batches finished before an interruption included.
    share = round((time.perf_counter() - t0 + stats["seconds_resumed"]) / len(todo), 3)
    for removed in todo:
        score = scores[removed]
        sweep.variants.append(VariantResult(list(removed), score.metrics, score.examples, share, score.details))
    sweep.variants.sort(key=lambda v: (len(v.removed), v.removed))
    info = {"name": "reuse", **stats}
    _save(sweep, out_dir, previous_wall + time.perf_counter() - started, info)
    shutil.rmtree(store, ignore_errors=True)  # everything it held is in prune.json now
    return info
