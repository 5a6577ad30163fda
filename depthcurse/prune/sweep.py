"""The prune sweep: the unpruned baseline, then the model with each selected layer removed.

Results go to disk (atomically) after every variant, so an interrupted sweep keeps what it
finished and a rerun of the same command continues from there without recomputing anything.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Iterable

from depthcurse import assets
from depthcurse.errors import DepthcurseError
from depthcurse.forecast import following, took_up
from depthcurse.io import atomic_write, ensure_out_dir, environment, json_text, refuse_other_run
from depthcurse.loading import LoadedModel
from depthcurse.prune import engine
from depthcurse.prune.results import PARTIAL_DIR, RESULTS_JSON, VARIANTS_DIR, Sweep, VariantResult, read_sweep, removal_key, variant_label, write_sweep
from depthcurse.prune.scoring import saved_batch_count
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
    on_note: Callable[[str], None] = lambda text: None,
) -> Sweep | None:
    """Evaluate the baseline and each variant, saving after each one.

    A variant is a layer index (that layer removed) or a collection of indices removed together
    (a block). With `granularity` "attn" or "mlp", only that branch of each indexed block is
    removed (the stream passes it by). The unpruned baseline always runs first.

    `on_variant(label, done, total)` is called before each variant is evaluated (for progress
    display). KeyboardInterrupt propagates, with every finished variant already on disk. After the
    first batch (or variant), `on_note` hears how long the rest will take (`forecast.following`),
    kept in prune.json's "engine" beside the time taken.

    `engine="reuse"` (see `depthcurse.prune.engine`) scores all variants together, batch by batch,
    reusing what they share (with `compile`, through compiled blocks); its finished batches are
    kept in `prune.partial/` until the end, and `on_variant("batches", done, total)` reports them.
    A model or task it cannot run falls back to `engine="lm-eval"`: each variant evaluated on its
    own, in memory. Which one ran, and why, is saved in prune.json under "engine".

    Under torchrun (`world`) every rank calls this with its own copy of the model: the reuse
    engine splits the requests over the ranks, and rank 0 computes the metrics, writes the files
    and returns the sweep; the other ranks return None. The fallback splits the variants: the
    ranks take them from a shared queue, each evaluating one at a time on its own, as one process would.
    """
    if engine not in ENGINES:
        raise DepthcurseError(f"unknown --engine {engine!r}: use {' or '.join(ENGINES)}")
    started = time.perf_counter()
    heard = {"batches": following("the sweep's batches (every variant at once)", on_note if world.main else (lambda text: None)),
             "variants": following("the sweep's variants", on_note if world.main else (lambda text: None))}
    forecasts: dict = {}
    def report(label: str, done: int, total: int) -> None:
        """The caller's `on_variant`, and the forecast of what it reports."""
        if label != "done":
            kind = "batches" if label == "batches" else "variants"
            forecasts[kind] = heard[kind](done, total)
        if on_variant:
            on_variant(label, done, total)

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
        saved = dict(previous.run)
        if isinstance(saved.get("source"), str):  # written before sources in the cache were relative to it
            saved["source"] = assets.portable_path(saved["source"])
        refuse_other_run(out_dir, saved, run)
        sweep.variants, previous_wall = previous.variants, previous.meta.get("wall_time_s", 0.0)
    done = {tuple(v.removed) for v in sweep.variants}
    asked = [()] + [removal_key(v) for v in variants]
    asked = list(dict.fromkeys(asked))
    sweep.asked = [list(a) for a in asked]
    todo = [r for r in asked if r not in done]
    total = len(asked)
    if len(todo) < total and world.main:
        on_note(took_up("the sweep's variants", total - len(todo), total, out_dir / RESULTS_JSON))
    engine_info = {"name": "lm-eval" if todo else engine}
    if engine == "reuse" and todo:
        engine_info = _reuse(loaded, task, todo, sweep, out_dir, run, max_memory, report, started, previous_wall, world, granularity, compile)
        if engine_info["name"] == "reuse":
            todo = []
    if todo:
        by_rank = [0] * world.size
        if world.size > 1:
            engine_info["variants_by_rank"] = by_rank  # this run's, not a resumed one's
        _each_on_its_own(model, task, todo, sweep, out_dir, granularity, world, report, by_rank,
                         fingerprint=json.dumps(run, sort_keys=True, default=str), total=total,
                         save=lambda: _save(sweep, out_dir, previous_wall + time.perf_counter() - started, engine_info))
    if not world.main:
        return None
    report("done", total, total)
    for what, forecast in forecasts.items():
        engine_info.setdefault("forecasts", {})[what] = forecast.summary()
    _save(sweep, out_dir, previous_wall + time.perf_counter() - started, engine_info)
    shutil.rmtree(out_dir / VARIANTS_DIR, ignore_errors=True)  # all it held is in prune.json (or, resumed by the reuse engine, was redone)
    return sweep


def _each_on_its_own(model, task, todo, sweep, out_dir, granularity, world, on_variant, by_rank, *, fingerprint, total, save) -> None:
    """Evaluate each of `todo` on its own (the fallback, or --engine lm-eval), the ranks sharing
    them as a queue; on rank 0, add the results to `sweep` and count in `by_rank` who evaluated
    them, calling `save` as they come.

    A rank takes the next variant no rank has claimed (a file created exclusively in
    prune.variants/, so the ranks share the out folder: one node, or a shared file system),
    evaluates it and saves its result there; rank 0 adds the finished ones to prune.json after
    each of its own and at the end. A slow variant (a generative task's rambling model) holds up
    only its own rank: taking turns instead, every rank waited for the slowest variant of each
    turn, 16-22% longer on 2-8 ranks for a gsm8k sweep's measured variant times. An interrupted
    sweep keeps every saved result, and its claims of unfinished variants are dropped.
    """
    folder = out_dir / VARIANTS_DIR
    earlier: set[str] = set()
    if world.main:
        folder.mkdir(exist_ok=True)
        for claim in folder.glob("*.claim"):
            result = claim.with_suffix(".json")
            if not result.exists():
                claim.unlink()  # an interrupted run's: its variant did not finish
            elif json.loads(result.read_text())["fingerprint"] != fingerprint:
                result.unlink()  # another command's, interrupted before it wrote prune.json
                claim.unlink()
        earlier = {p.name for p in folder.glob("*.json")}
    world.barrier()  # no rank claims before rank 0 has dropped the stale claims
    merged = {v.label for v in sweep.variants}  # a result's file is named by its variant's label

    def merge():
        for path in sorted(folder.glob("*.json")):
            if path.stem in merged:
                continue  # added already: not read again
            got = json.loads(path.read_text())
            sweep.variants.append(VariantResult(**got["result"]))
            merged.add(path.stem)
            if path.name not in earlier:  # an earlier run's ranks need not be this run's
                by_rank[got["rank"]] += 1
        sweep.variants.sort(key=lambda v: (len(v.removed), v.removed))
        save()

    for removed in todo:
        name = variant_label(removed)
        try:
            os.close(os.open(folder / f"{name}.claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue  # another rank's, or finished by an earlier run
        if on_variant:
            on_variant(name, len(sweep.variants), total)
        t0 = time.perf_counter()
        with removed_units(model, removed, granularity):
            score = task.evaluate(model)
        result = VariantResult(list(removed), score.metrics, score.examples, round(time.perf_counter() - t0, 3), score.details)
        atomic_write(folder / f"{name}.json", json_text({"fingerprint": fingerprint, "rank": world.rank, "result": asdict(result)}))
        if world.main:
            merge()
    world.barrier()  # every rank's results are saved
    if world.main:
        merge()


def kept_for_rerun(out_dir: Path) -> tuple[int, int]:
    """What an interrupted sweep in `out_dir` keeps for a rerun of its command: (finished
    variants, in prune.json or saved by a rank and not yet added; finished batches of all variants)."""
    sweep = read_sweep(out_dir)
    labels = {v.label for v in sweep.variants} if sweep is not None else set()
    labels |= {p.stem for p in (out_dir / VARIANTS_DIR).glob("*.json")}
    return len(labels), saved_batch_count(out_dir / PARTIAL_DIR)


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
