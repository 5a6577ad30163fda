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
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from depthcurse.angular.measurement import measure
from depthcurse.errors import DepthcurseError
from depthcurse.io import atomic_write, ensure_out_dir, json_text, refuse_other_run
from depthcurse.loading import check_sequence_length
from depthcurse.prune.engine import evaluate_variants, why_unsupported
from depthcurse.runtime import World
from depthcurse.select import searches as _builtin  # noqa: F401 (defines the built-in searches, which registers them)
from depthcurse.select.estimate import PassTiming, duration, estimate_summary, pass_timing
from depthcurse.select.recipe import OBJECTIVE as RECIPE_OBJECTIVE
from depthcurse.select.recipe import RESAMPLES as RECIPE_RESAMPLES
from depthcurse.select.recipe import recipe
from depthcurse.select.scoring import CalibrationScorer, contiguous_shares, removal_context, window_scores
from depthcurse.select.stability import Resampled, draws, summary
from depthcurse.select.search import GRANULARITIES, OBJECTIVES, Search, SearchContext, Space, build_searches, checked_asks, key, settings_text
from depthcurse.speculate.costs import DraftCosts, measure_costs
from depthcurse.select.statistics import decomposition, distances, overlap
from depthcurse.surgery import num_layers
from depthcurse.tasks import PerplexityTask, build_task
from depthcurse.text import load_texts, text_kind, text_source

SELECT_JSON = "select.json"


@dataclass
class SelectConfig:
    k: int
    calibration: tuple[str, ...]  # text sources (wiki, c4, code, math, dialogue, a file) the choice is made on
    objectives: tuple[str, ...] | None = None  # None: not given (ppl where searches are given; the recipe's kl where not)
    searches: tuple[str, ...] | None = None  # names, or module:Class / file.py:Class of one's own; None: the recipe (`select.recipe`)
    calib_windows: int = 8
    eval_windows: int = 16
    seq_len: int = 128
    batch_size: int = 4
    task: str | None = None  # judged on it too (probes, commonsense, an lm-eval task), with `limit`
    limit: int | None = None
    seed: int = 1234
    granularity: str = "layer"  # or "sub-block": k attention and k MLP branches
    search_args: dict = field(default_factory=dict)  # --search-args, name.key -> value
    draft_tokens: int = 4  # gamma of the draft the speedup objective prices
    resamples: int | None = None  # bootstrap resamples of the calibration windows each search reruns on; None: the recipe's, else none
    seeds: tuple[int, ...] = ()  # other seeds each seeded search (evo, random, swift) reruns under, on every window
    budget: float = 30.0  # minutes: the recipe runs exact where its estimate fits, else evo

    @property
    def recipe(self) -> bool:
        return self.searches is None

    def built(self) -> dict[str, Search]:
        """The searches, by name, their settings set."""
        return build_searches(self.searches, self.search_args)

    def checked(self, n_layers: int | None = None, space: Space | None = None) -> "SelectConfig":
        """The config with its defaults filled in, or one line on what is wrong with it; given the
        model's layers (or the space, with what a pass costs here), every search's own check of the
        space too (a budget it cannot keep)."""
        if self.k < 1:
            raise DepthcurseError(f"--k must be at least 1, got {self.k}")
        if self.granularity not in GRANULARITIES:
            raise DepthcurseError(f"unknown --granularity {self.granularity!r}: use {', '.join(GRANULARITIES)}")
        if self.resamples is not None and self.resamples < 0:
            raise DepthcurseError(f"--resamples must be 0 or more, got {self.resamples}")
        if self.resamples == 1:
            raise DepthcurseError("--resamples 1: one resample says nothing of how often a pick comes back: give 0, or 2 or more")
        if len(set(self.seeds)) != len(self.seeds) or self.seed in self.seeds:
            raise DepthcurseError(f"--seeds {','.join(map(str, self.seeds))}: each must be given once, and differ from --seed {self.seed}")
        if self.budget <= 0:
            raise DepthcurseError(f"--budget must be more than 0 minutes, got {self.budget:g}")
        if self.recipe:
            if self.granularity != "layer":
                raise DepthcurseError(f"--granularity {self.granularity} needs --search: the recipe (greedy, then exact or evo) removes whole blocks")
            return replace(self, searches=("greedy",)).checked(n_layers, space)._replace_back(self)
        if not self.searches:
            raise DepthcurseError("--search (none): give at least one search")
        twice = sorted({g for g in self.searches if self.searches.count(g) > 1})
        if twice:
            raise DepthcurseError(f"--search names {', '.join(twice)} more than once: each cell would be measured twice, as if two")
        searches = self.built()
        for name, search in searches.items():
            if self.granularity not in search.granularities:
                raise DepthcurseError(f"--search {name} removes {' or '.join(search.granularities)} units, not {self.granularity} "
                                      f"(--granularity {self.granularity} takes {', '.join(n for n, s in searches.items() if self.granularity in s.granularities) or 'exact, evo, random, last'})")
        if self.objectives is not None and not any(s.reads == "objective" for s in searches.values()):
            raise DepthcurseError(f"--objective {','.join(self.objectives)}: no search of --search {','.join(self.searches)} reads an objective "
                                  f"(only {', '.join(n for n, s in sorted(searches.items()) if s.reads == 'objective') or 'greedy, one-shot, exact, evo and random'} do)")
        objectives = self.objectives if self.objectives is not None else ("ppl",)
        bad = [o for o in objectives if o not in OBJECTIVES]
        if bad or not objectives:
            raise DepthcurseError(f"--objective {','.join(objectives) or '(none)'}: use {', '.join(OBJECTIVES)}")
        if not self.calibration:
            raise DepthcurseError("--calibration: give at least one text (wiki, c4, code, math, dialogue, or a file)")
        if "auto" in self.calibration:  # what `auto` is here, kept in the record, and caught where the same text is named twice
            return replace(self, calibration=tuple(text_source(c) for c in self.calibration)).checked(n_layers, space)
        for name, given in (("--calibration", [str(Path(c).expanduser().resolve()) if Path(c).suffix else c for c in self.calibration]),
                            ("--objective", objectives)):
            twice = sorted({g for g in given if given.count(g) > 1})
            if twice:
                raise DepthcurseError(f"{name} names {', '.join(twice)} more than once: each cell would be measured twice, as if two")
        if self.limit is not None and self.task is None:
            raise DepthcurseError("--limit applies to --task, which is not given")
        if self.task is not None and self.granularity != "layer":
            raise DepthcurseError(f"--task judges whole-block removals (prune's reuse engine); with --granularity {self.granularity} the choices "
                                  "are judged on the held-out windows alone: leave --task out")
        for name in ("calib_windows", "eval_windows", "batch_size"):
            if getattr(self, name) < 1:
                raise DepthcurseError(f"--{name.replace('_', '-')} must be at least 1")
        if self.eval_windows < 2:
            raise DepthcurseError("--eval-windows must be at least 2: the intervals need paired windows")
        if self.seq_len < 8:
            raise DepthcurseError("--seq-len must be at least 8")
        if self.draft_tokens < 1:
            raise DepthcurseError(f"--draft-tokens must be at least 1, got {self.draft_tokens}")
        if self.draft_tokens != SelectConfig.draft_tokens and "speedup" not in objectives:
            raise DepthcurseError(f"--draft-tokens {self.draft_tokens} prices a draft for --objective speedup, which is not asked")
        if n_layers is not None or space is not None:
            space = (space or Space(n_layers, self.k, self.granularity)).check()
            for search in searches.values():
                search.check(space)
        return replace(self, objectives=objectives)

    def _replace_back(self, given: "SelectConfig") -> "SelectConfig":
        """The recipe's config checked as greedy's (every other check the same), its searches left to choose."""
        return replace(self, searches=None, objectives=given.objectives)

    def cells(self) -> list[tuple[str, str, str]]:
        """(calibration, search, objective) of every cell; a search that reads no objective is one
        cell per text, its objective "-"."""
        searches = self.built()
        return [(c, name, o) for c in self.calibration for name, search in searches.items()
                for o in (self.objectives if search.reads == "objective" else ("-",))]

    def identity(self) -> dict:
        """What a run is, as `select.json` keeps it (the granularity and settings where not the defaults,
        so that a run made before they existed is the same run)."""
        out = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()}
        if out["granularity"] == "layer":
            del out["granularity"]
        if not out["search_args"]:
            del out["search_args"]
        for name in ("resamples", "seeds"):  # they add to a run, not change it: a finished run may be given more
            del out[name]
        if out["budget"] == SelectConfig.budget or not self.recipe:
            del out["budget"]
        if "speedup" not in (out["objectives"] or ()):
            del out["draft_tokens"]
        return out


def source_labels(sources) -> dict[str, str]:
    """A short name for each calibration text that no other shares: a source's own name (wiki, code)
    or a file's name without its suffix, with as many of its folders before it as it takes to tell
    two files of one name apart (a/lee, b/lee)."""
    parts = {s: (Path(s).expanduser().resolve().with_suffix("").parts if Path(s).suffix else (s,)) for s in sources}
    out = {}
    for s, p in parts.items():
        depth = 1
        while depth < len(p) and any(o != s and parts[o][-depth:] == p[-depth:] for o in parts):
            depth += 1
        out[s] = "/".join(p[-depth:])
    return out


def cell_name(cell, labels: dict[str, str]) -> str:
    c, s, o = cell
    return f"{labels[c]}/{s}" + (f"/{o}" if o != "-" else "")


@dataclass
class Texts:
    """One source's windows: those the choice is made on and those it is judged on, apart."""

    label: str
    calibration: torch.Tensor
    held_out: torch.Tensor


def text_windows(tokenizer, source: str, cfg: SelectConfig) -> Texts:
    """`calib_windows` + `eval_windows` windows of `source` (heal's and ppl's packing), split by a
    seeded shuffle so that neither part is one stretch of the text, and no window is in both."""

    texts, label = load_texts(source, option="--calibration")
    want = cfg.calib_windows + cfg.eval_windows
    windows = PerplexityTask(tokenizer, texts, source=label, seq_len=cfg.seq_len, limit=want, warn_short=False).windows
    if len(windows) < want:
        raise DepthcurseError(f"{label} holds {len(windows)} windows of {cfg.seq_len} tokens: fewer than --calib-windows + --eval-windows ({want})")
    order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(cfg.seed))
    return Texts(label, windows[order[: cfg.calib_windows]], windows[order[cfg.calib_windows:want]])


@torch.no_grad()
def per_window(model, windows: torch.Tensor, batch_size: int, reference: list[torch.Tensor] | None = None
               ) -> tuple[list[float], list[float] | None, list[float] | None, list[torch.Tensor]]:
    """Each window's mean next-token loss and, against `reference` (the unpruned model's log-probs,
    batch by batch), its mean KL(unpruned || model) and rejection (1 - top-1 agreement); and this
    model's log-probs batch by batch."""
    device = model.get_input_embeddings().weight.device
    losses, kls, rejections, logprobs = [], [] if reference is not None else None, [] if reference is not None else None, []
    for b, start in enumerate(range(0, len(windows), batch_size)):
        ids = windows[start : start + batch_size].to(device)
        logp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[:, :-1].float(), dim=-1)
        loss, kl, agreement = window_scores(logp, ids, reference[b] if reference is not None else None)
        losses += loss.mean(1).tolist()
        if reference is not None:
            kls += kl.mean(1).tolist()
            rejections += (1.0 - agreement.mean(1)).tolist()
        logprobs.append(logp.cpu())
    return losses, kls, rejections, logprobs


def stream_pass(model, windows: torch.Tensor, batch_size: int, k: int):
    """The angular-distance pass the stream searches read, over every token of the calibration
    windows (`angular.measure`: a few windows have too few last tokens)."""
    masks = torch.ones_like(windows)
    batches = [(windows[i : i + batch_size], masks[i : i + batch_size]) for i in range(0, len(masks), batch_size)]
    return measure(model, batches, position="all", max_n=k, identity_tokens=0)


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
    given, cfg = cfg, cfg.checked()
    Space(n, cfg.k, cfg.granularity).check()
    check_sequence_length(model, cfg.seq_len)
    labels = source_labels(cfg.calibration)
    phase = on_phase or (lambda text: None)
    out_dir = ensure_out_dir(out_dir)
    run = {**{k: v for k, v in loaded.describe().items() if k != "device"}, **cfg.identity(), "n_layers": n}
    path = out_dir / SELECT_JSON
    record = world.broadcast(json.loads(path.read_text()) if world.main and path.exists() else {})  # read before any rank writes
    if record:
        refuse_other_run(out_dir, record["run"], run, what="select run")
    record = {"run": run, "calibration_scores": {}, "cells": {}, "held_out": {}, "task": {}, **{k: v for k, v in record.items() if k != "run"}}
    save = lambda: atomic_write(path, json_text(record)) if world.main else None  # noqa: E731
    started = time.perf_counter()
    note = on_note or (lambda text: None)
    texts: dict[str, Texts] = {}
    for source in cfg.calibration:  # before the first phase: a text that cannot be read is the one line said
        texts[source] = text_windows(tokenizer, source, cfg)
    model.eval()
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
        calibration = texts[source].calibration
        scorer = CalibrationScorer(model, calibration, cfg.batch_size, known, save, cfg.granularity, world, costs) \
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
                                 streams=_streams(model, windows, cfg), seed=seed, model=model, calibration=windows,
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
                estimate = estimate_summary(*expected, timing)
                note(f"{name}: expect {estimate['block_passes']:,.0f} block passes and {estimate['head_passes']:,.0f} head passes, "
                     f"about {duration(estimate['seconds'])} ({timing.block * 1e3:.1f} ms a block pass, {timing.head * 1e3:.1f} ms a head pass here)")
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
        base_losses, _, _, reference = per_window(model, texts[source].held_out, cfg.batch_size)
        held.setdefault("", {"loss": base_losses, "kl": [0.0] * len(base_losses), "rejection": [0.0] * len(base_losses)})
        start, end = contiguous_shares([1] * len(todo), world.size)[world.rank]  # under torchrun: this rank's share
        mine = {}
        for i, removal in enumerate(todo[start:end]):
            if on_step:
                on_step(f"{labels[source]}: without {key(removal)}", i, end - start)
            with removal_context(model, removal, cfg.granularity):
                losses, kls, rejections, _ = per_window(model, texts[source].held_out, cfg.batch_size, reference)
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
    record["kinds"] = {source: text_kind(source) for source in cfg.calibration}
    record["overlap"] = overlap(record["cells"])
    record["decomposition"] = decomposition(record, cfg.seed)
    record["distances"] = distances(record)
    record["stability_summary"] = {name: summary(record["cells"][name]["layers"], [p["layers"] for p in picks], cfg.granularity)
                                   for name, picks in record.get("stability", {}).items() if len(picks) >= 2 and name in record["cells"]}
    record["wall_time_s"] = round(record.get("wall_time_s", 0.0) + time.perf_counter() - started, 3)
    save()
    return record


def _variations(search: Search, cfg: SelectConfig, resamples: int, windows: int) -> list[tuple[list[int] | None, int]]:
    """(the drawn windows, the seed) of each rerun: the resamples, then (a seeded search) each other seed on every window."""
    out = [(drawn, cfg.seed) for drawn in draws(windows, resamples, cfg.seed)]
    return out + ([(None, s) for s in cfg.seeds] if search.seeded else [])


def _streams(model, windows: torch.Tensor, cfg: SelectConfig) -> Callable:
    """The angular pass over these windows, made once when a stream search asks."""
    return functools.cache(lambda: stream_pass(model, windows, cfg.batch_size, cfg.k))


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
        out[key(s)] = {"metric": task.metric, "value": scores[s].metrics[task.metric], "metrics": scores[s].metrics,
                                      "items": [v for part in per.values() for v in part]}
    out["describe"] = task.describe()
    return world.broadcast(out)
