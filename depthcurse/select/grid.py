"""`depthcurse select`: which k units each calibration text, objective and search removes, how
good each choice is, and what decided it.

"Rethinking Layer Redundancy: Calibration Matters More Than Search" (arXiv 2604.24938) finds that
the layers a depth-pruning method removes depend more on its calibration (the text, and the
objective the choice is judged by) than on its search algorithm. This runs that question on one
model as one grid: for each calibration text x objective x search, the k units chosen; each choice
judged on the same held-out measurements (held-out windows of every text, and a task such as the
probes or the commonsense suite); how much the chosen sets overlap (Jaccard); how much of the spread
of the held-out scores goes with the calibration and how much with the search; and how far each
choice falls from the best removal there is (`exact`) or from blind draws (`random`).

A search is one class behind the contract of `select.search`, found by name in its registry
(`select/searches/`: greedy, one-shot, angular, bi, exact, evo, random, last; a user's own by
`file.py:Class`). Work is shared: a text's windows, the unpruned model's predictions and its
stream entering every block are made once (`select.scoring`), a removal's calibration score once
for every search and objective that asks for it, and the held-out measurements once per distinct
chosen set. Every finished piece is in `select.json` as soon as it is made, so an interrupted run
resumes there.
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

from depthcurse import vocab_scores
from depthcurse.errors import DepthcurseError
from depthcurse.forecast import duration, took_up
from depthcurse.io import atomic_write, ensure_out_dir, environment, json_text, refuse_other_run
from depthcurse.kept_state import plain
from depthcurse.loading import check_sequence_length
from depthcurse.prune.engine import evaluate_variants, why_unsupported
from depthcurse.runtime import World
from depthcurse.select.config import SelectConfig, cell_name, source_labels
from depthcurse.select.continuations import continuation_texts, is_continuations
from depthcurse.select.estimate import PassTiming, pass_timing
from depthcurse.select.recipe import OBJECTIVE as RECIPE_OBJECTIVE
from depthcurse.select.recipe import RESAMPLES as RECIPE_RESAMPLES
from depthcurse.select.recipe import recipe
from depthcurse.select.scoring import CalibrationScorer, contiguous_shares, removal_context
from depthcurse.select.stability import Resampled, draws, summary
from depthcurse.select.search import OBJECTIVES, Search, SearchContext, Space, checked_asks, key, settings_text
from depthcurse.speculate.costs import DraftCosts, measure_costs
from depthcurse.select.statistics import decomposition, distances, overlap
from depthcurse.surgery import num_layers
from depthcurse.select.windows import HELD_OUT, Texts, per_window, stream_pass, text_windows
from depthcurse.tasks import build_task
from depthcurse.text import text_kind

SELECT_JSON = "select.json"


def run_select(loaded, cfg: SelectConfig, out_dir: Path, *, on_phase: Callable[[str], None] | None = None,
               on_step: Callable[[str, int, int], None] | None = None, on_note: Callable[[str], None] | None = None, world: World = World()) -> dict:
    """The grid in `out_dir` (resumed from its `select.json`): each cell's choice with what it cost,
    the choices' held-out measurements, their overlap, the two-way decomposition of the held-out
    scores and each choice's distance from the best removal found.

    Under torchrun (`world`) every rank runs the grid on its own copy of the model and the same
    searches make the same decisions everywhere: the removals a search scores at once (`exact`'s
    sets, a `greedy` step's candidates, an `evo` stage's offspring, `random`'s draws) and the
    chosen sets judged held out are shared over the ranks and every score gathered on every rank,
    each computed as one process computes it, so that N ranks choose exactly what one does. Rank 0
    alone writes `select.json`. (The stream searches, and LaCo's and SWM's merges, run whole on
    every rank: they score no removals.)

    With no searches given, the recipe (`select.recipe`) chooses them from this machine's measured
    speed. Before each search starts, its expected passes and seconds are said (`on_note`) and kept
    beside the time it took. With resamples (or seeds), each search is rerun on bootstrap resamples
    of the calibration windows (or under each seed) and how often its pick comes back is kept
    (`select.stability`)."""
    model, tokenizer = loaded.model, loaded.tokenizer
    n = num_layers(model)
    given, cfg = cfg, cfg.checked(n_layers=n)  # every search's own check against this model's layers too, before any phase is said
    check_sequence_length(model, cfg.seq_len)
    labels = source_labels(cfg.calibration)
    phase = on_phase or (lambda text: None)
    out_dir = ensure_out_dir(out_dir)
    texts: dict[str, Texts] = {}
    for source in cfg.calibration:  # before the first phase: a text that cannot be read is the one line said
        if not is_continuations(source):
            texts[source] = text_windows(tokenizer, source, cfg)
    # the texts' windows are inputs of the run: another text under the same name is another run (the continuations are kept in the record itself)
    run = {**{k: v for k, v in loaded.describe().items() if k != "device"}, **cfg.identity(), "n_layers": n,
           "texts": {source: plain(windows) for source, windows in texts.items()}}
    path = out_dir / SELECT_JSON
    record = world.broadcast(json.loads(path.read_text()) if world.main and path.exists() else {})  # read before any rank writes
    if record:
        refuse_other_run(out_dir, record["run"], run, what="select run")
    record = {"run": run, "calibration_scores": {}, "cells": {}, "held_out": {}, "task": {}, **{k: v for k, v in record.items() if k != "run"}}
    save = lambda: atomic_write(path, json_text(record)) if world.main else None  # noqa: E731
    started = time.perf_counter()
    note = on_note or (lambda text: None)
    if record["cells"]:
        note(took_up("the grid's cells", len(record["cells"]), len(cfg.cells()), path))
    model.eval()
    for source in filter(is_continuations, cfg.calibration):  # the model's own, generated once (rank 0's on every rank) and kept: a resumed run scores the same
        kept = record.setdefault("continuations", {})
        if source not in kept:
            phase(f"the model's greedy continuations of the {source} prompts")
            kept[source] = world.broadcast(continuation_texts(model, tokenizer, source, cfg)[1] if world.main else None)
            save()
        texts[source] = continuation_texts(model, tokenizer, source, cfg, kept[source])[0]
    if "pass_timing" not in record:  # this machine's speed, measured once (rank 0's on every rank), kept: a resumed run estimates alike
        record["pass_timing"] = world.broadcast(pass_timing(model, texts[cfg.calibration[0]].calibration, cfg.batch_size).summary() if world.main else None)
    timing = PassTiming(record["pass_timing"]["seconds_per_block_pass"], record["pass_timing"]["seconds_per_head_pass"])
    space = Space(n, cfg.k, cfg.granularity, timing=timing)
    tokens = cfg.calib_windows * cfg.seq_len
    is_recipe = given.recipe
    if is_recipe:  # chosen once, kept: a resumed run is the same run
        if "recipe" not in record:
            record["recipe"] = {**recipe(space, tokens, cfg.budget, cfg.search_args).summary(), "objectives": list(given.objectives or (RECIPE_OBJECTIVE,))}
        given = replace(given, searches=tuple(record["recipe"]["searches"]), objectives=tuple(record["recipe"]["objectives"]))
    cfg = given.checked(space=space)  # every search's own check, before any of them runs
    if is_recipe:
        note(f"the recipe: by {', '.join(cfg.objectives)}, {' and '.join(cfg.searches)} ({record['recipe']['why']})")
    cells = cfg.cells()
    searches = cfg.built()
    resamples = cfg.resamples if cfg.resamples is not None else (RECIPE_RESAMPLES if is_recipe else 0)
    # the recipe's own resamples rerun its deterministic searches alone (theirs reuse the scores measured); --resamples reruns every one
    resamples_of = {name: resamples if cfg.resamples is not None or not s.seeded else 0 for name, s in searches.items()}
    resampled = {name for name, s in searches.items() if s.reads != "nothing" and (resamples_of[name] or (s.seeded and cfg.seeds))}
    if cfg.resamples:  # before any search runs: the resamples asked for held to --budget (the recipe's own rerun on scores it has)
        rerun_cost(searches, resamples_of, space, tokens, cfg.budget, note)
    costs = None
    if "speedup" in cfg.objectives:  # measured once, kept: a resumed run prices its drafts as it began
        if "draft_costs" not in record:
            phase("timing a draft's costs")
            # rank 0's timing, on every rank: the ranks' searches must score every draft alike
            record["draft_costs"] = world.broadcast(measure_costs(model, cfg.draft_tokens).summary() if world.main else None)
        costs = DraftCosts(**record["draft_costs"])
    for source in cfg.calibration:  # the choices, and how stable each is
        stable = record.setdefault("stability", {})
        here = [c for c in cells if c[0] == source]
        variations = {c: _variations(searches[c[1]], cfg, resamples_of[c[1]], len(texts[source].calibration)) for c in here}
        todo = [c for c in here if cell_name(c, labels) not in record["cells"]]
        unstable = [c for c in here if c[1] in resampled and len(stable.get(cell_name(c, labels), [])) < len(variations[c])]
        if not todo and not unstable:
            continue
        phase(f"choosing on {labels[source]}")
        known = record["calibration_scores"].setdefault(source, {})
        calibration, mask = texts[source].calibration, texts[source].calibration_mask
        scorer = CalibrationScorer(model, calibration, cfg.batch_size, known, save, cfg.granularity, world, costs, mask) \
            if any(searches[c[1]].reads == "objective" for c in todo + unstable) else None

        steps = len(todo) + len(unstable)

        def context(cell, step: int, drawn: list[int] | None = None, seed: int = cfg.seed, asked: set | None = None, label: str = "") -> SearchContext:
            """The search's view of the calibration windows: all of them, or a resample (`drawn`)."""
            objective, name = cell[2], cell_name(cell, labels) + label
            windows = calibration if drawn is None else calibration[drawn]
            view = Resampled(scorer, drawn) if drawn is not None and scorer is not None else None
            asked = set() if asked is None else asked

            def score_many(removals):
                removals = checked_asks(searches[cell[1]], space, removals)
                asked.update(key(r) for r in removals)
                return view.score_many(removals, objective) if view is not None else [d[objective] for d in scorer.score_many(removals)]

            score_on_many = (lambda rs, w, t: view.score_on_many(checked_asks(searches[cell[1]], space, rs), w, t, objective)) if view is not None \
                else (lambda rs, w, t: scorer.score_on_many(checked_asks(searches[cell[1]], space, rs), w, t, objective))
            return SearchContext(space=space, objective=objective, windows=len(windows), window_tokens=windows.shape[1],
                                 score=lambda r: score_many([r])[0], score_many=score_many,
                                 score_on=lambda r, w, t: score_on_many([r], w, t)[0], score_on_many=score_on_many,
                                 streams=_streams(model, windows, cfg, mask if mask is None or drawn is None else mask[drawn]), seed=seed,
                                 model=model, calibration=windows,
                                 phase=lambda text: on_step(f"{name}: {text}", step, steps) if on_step else None)

        for cell in todo:
            name = cell_name(cell, labels)
            if on_step:
                on_step(name, todo.index(cell), steps)
            search = searches[cell[1]]
            asked: set[str] = set()  # the removals this search scored on every window, shared with another or not
            ctx = context(cell, todo.index(cell), asked=asked)
            before = replace(scorer.cost) if scorer is not None else None
            expected = search.passes(space, tokens)
            if expected is not None:
                here = timing.scaled(calibration.numel() / texts[cfg.calibration[0]].calibration.numel())  # timed on the first text's windows
                estimate = here.estimate(*expected)
                note(f"{name}: expect {estimate['block_passes']:,.0f} block passes and {estimate['head_passes']:,.0f} head passes, "
                     f"about {duration(estimate['seconds'])} ({here.block * 1e3:.1f} ms a block pass, {here.head * 1e3:.1f} ms a head pass here)")
            cell_started = time.perf_counter()
            chosen = search.run(ctx)
            entry = {"calibration": source, "calibration_label": labels[source], "search": cell[1], "objective": cell[2],
                     "layers": list(chosen), "seconds": round(time.perf_counter() - cell_started, 3)}
            if expected is not None:
                entry["estimate"] = estimate
            if scorer is not None:  # what scoring cost this cell (removals another cell had scored cost nothing again)
                entry["cost"] = {**scorer.cost.minus(before).summary(len(calibration)), "removals_asked": len(asked)}
            if settings_text(search):
                entry["settings"] = settings_text(search)
            if ctx.notes:
                entry["notes"] = ctx.notes
            if getattr(search, "drawn", None) is not None:  # the random draws: the null distribution a pick is placed in
                entry["drawn"] = [key(r) for r in search.drawn]
            record["cells"][name] = entry
            save()
        for cell in unstable:  # each pick's stability: the search again on each resample (or seed), kept as each finishes
            name, search = cell_name(cell, labels), searches[cell[1]]
            picks = stable.setdefault(name, [])
            for r, (drawn, seed) in enumerate(variations[cell][len(picks):], start=len(picks)):
                where = f"resample {r + 1} of {resamples_of[cell[1]]}" if r < resamples_of[cell[1]] else f"seed {seed}"
                if on_step:
                    on_step(f"{name}: {where}", len(todo) + unstable.index(cell), steps)
                with _quiet(search):
                    chosen = search.run(context(cell, len(todo) + unstable.index(cell), drawn, seed, label=f" ({where})"))
                picks.append({"windows": drawn, "seed": seed, "layers": list(chosen)})
                save()
        if scorer is not None:  # every choice's own calibration score (a stream search's too), for its distance from the best
            scorer.score_many([tuple(c["layers"]) for c in record["cells"].values() if c["calibration"] == source])
    chosen_sets = sorted({tuple(c["layers"]) for c in record["cells"].values()}, key=key)
    for source in cfg.calibration:  # every choice judged on every text's held-out windows
        held = record["held_out"].setdefault(source, {})
        todo = [s for s in chosen_sets if key(s) not in held]
        if not todo:
            continue
        phase(f"judging on {labels[source]} (held out)")
        held_mask = texts[source].held_out_mask
        base_losses, _, _, reference = per_window(model, texts[source].held_out, cfg.batch_size, mask=held_mask)
        held.setdefault("", {"loss": base_losses, "kl": [0.0] * len(base_losses), "rejection": [0.0] * len(base_losses)})
        start, end = contiguous_shares([1] * len(todo), world.size)[world.rank]  # under torchrun: this rank's share
        mine = {}
        for i, removal in enumerate(todo[start:end]):
            if on_step:
                on_step(f"{labels[source]}: without {key(removal)}", i, end - start)
            with removal_context(model, removal, cfg.granularity):
                losses, kls, rejections, _ = per_window(model, texts[source].held_out, cfg.batch_size, reference, held_mask)
            mine[key(removal)] = {"loss": losses, "kl": kls, "rejection": rejections}
            if world.size == 1:  # alone, each set kept as it finishes: an interrupted run resumes there
                held[key(removal)] = mine[key(removal)]
                save()
        if world.size > 1:
            for part in world.all_gather(mine):
                held.update(part)
            save()
    if cfg.task and not all(key(s) in record["task"] for s in chosen_sets):
        phase(f"judging on {cfg.task}")
        record["task"] = judge_on_task(loaded, cfg, [(), *chosen_sets], world)
        save()
    record["labels"] = labels
    record["held_out_from"] = HELD_OUT[cfg.held_out]
    record["kinds"] = {source: "the model's own greedy continuations of prompts" if is_continuations(source) else text_kind(source) for source in cfg.calibration}
    record["overlap"] = overlap(record["cells"])
    record["decomposition"] = decomposition(record, cfg.seed)
    record["distances"] = distances(record)
    record["stability_summary"] = {name: summary(record["cells"][name]["layers"], [p["layers"] for p in picks], cfg.granularity)
                                   for name, picks in record.get("stability", {}).items() if len(picks) >= 2 and name in record["cells"]}
    record["wall_time_s"] = round(record.get("wall_time_s", 0.0) + time.perf_counter() - started, 3)
    record["vocabulary_scores"] = vocab_scores.status(model.get_input_embeddings().weight.device)  # what scored the logits, the last process's
    record["environment"] = environment()
    save()
    return record


def rerun_cost(searches: dict[str, Search], resamples_of: dict[str, int], space: Space, tokens: int, budget_minutes: float, note) -> float:
    """The most the resamples can cost: each rerun of a search at most its own estimate again (a
    removal already scored on every window costs nothing again, so often far less), said, and
    refused in one line, with the resamples that fit, where it passes `--budget`."""
    per_run = {name: space.timing.seconds(*searches[name].passes(space, tokens)) for name, n in resamples_of.items()
               if n and searches[name].reads == "objective" and searches[name].passes(space, tokens) is not None}
    if not per_run:
        return 0.0
    most = sum(resamples_of[name] * seconds for name, seconds in per_run.items())
    reruns = max(resamples_of[name] for name in per_run)
    if most > budget_minutes * 60:
        fits = int(budget_minutes * 60 // max(sum(per_run.values()), 1e-9))
        raise DepthcurseError(f"--resamples {reruns:,}: the reruns of {', '.join(per_run)} may take up to {duration(most)} here, over --budget "
                              f"{budget_minutes:g} minutes; give --resamples {fits} or fewer" + (", or a larger --budget" if fits >= 2 else
                                                                                                   " (0: no resamples), or a larger --budget"))
    note(f"the resamples: {reruns:,} reruns of {', '.join(per_run)}, at most about {duration(most)} here (within --budget {budget_minutes:g} minutes)")
    return most


def _variations(search: Search, cfg: SelectConfig, resamples: int, windows: int) -> list[tuple[list[int] | None, int]]:
    """(the drawn windows, the seed) of each rerun: the resamples, then (a seeded search) each other seed on every window."""
    out = [(drawn, cfg.seed) for drawn in draws(windows, resamples, cfg.seed)]
    return out + ([(None, s) for s in cfg.seeds] if search.seeded else [])


def _streams(model, windows: torch.Tensor, cfg: SelectConfig, mask: torch.Tensor | None = None) -> Callable:
    """The angular pass over these windows (their tokens up to the last scored prediction's target,
    where `mask` scores only some), made once when a stream search asks."""
    return functools.cache(lambda: stream_pass(model, windows, cfg.batch_size, cfg.k, mask))


@contextlib.contextmanager
def _quiet(search: Search):
    """A rerun leaves what the search kept of its first run (`drawn`, `trace`) as it was."""
    kept = {name: getattr(search, name) for name in ("drawn", "trace") if hasattr(search, name)}
    try:
        yield
    finally:
        for name, value in kept.items():
            setattr(search, name, value)


def judge_on_task(loaded, cfg: SelectConfig, sets: list[tuple[int, ...]], world: World = World()) -> dict:
    """Every chosen set on the task at once, by prune's reuse engine (each question's score kept;
    under torchrun its requests shared over the ranks, the result rank 0's, given to every rank)."""

    task = build_task(cfg.task, loaded.tokenizer, limit=cfg.limit, batch_size=cfg.batch_size, seed=cfg.seed, model=loaded.model, model_source=loaded.source)
    task.per_example = True
    why = why_unsupported(loaded.model, task)
    if why is not None:
        raise DepthcurseError(f"--task {cfg.task}: prune's reuse engine cannot score it ({why})")
    scores, _ = evaluate_variants(loaded.model, task, sets, checked=True, world=world)
    if not world.main:
        return world.broadcast(None)
    out = {}
    for s in sets:
        per = scores[s].details.get("per_example") or {}
        # each task's questions apart ("groups"): a suite's headline weighs its tasks equally, and so must its interval
        out[key(s)] = {"metric": task.metric, "value": scores[s].metrics[task.metric], "metrics": scores[s].metrics,
                       "items": [v for part in per.values() for v in part], "groups": [list(part) for part in per.values()]}
    out["describe"] = task.describe()
    return world.broadcast(out)
