"""`depthcurse select`: does the calibration or the search decide which layers go?

"Rethinking Layer Redundancy: Calibration Matters More Than Search" (arXiv 2604.24938) finds that
the layers a depth-pruning method removes depend more on its calibration (the text, and the
objective the choice is judged by) than on its search algorithm. This runs that question on one
model as one grid: for each calibration text x objective x search, the k layers chosen; each
choice judged on the same held-out measurements (held-out windows of every text, and a task such
as the probes or the commonsense suite); how much the chosen sets overlap (Jaccard); and how much
of the spread of the held-out scores goes with the calibration and how much with the search.

The searches reuse what prune has: `greedy` (remove the layer whose removal costs least, k times,
measured exactly), `one-shot` (the k cheapest single removals), `angular` (Gromov et al.'s block
of k adjacent layers, the least angular distance between its input and output) and `bi` (ShortGPT's
Block Influence, 1 - cos(input, output), the k lowest); the first two by the objective (`ppl`:
the next-token loss on the calibration windows; `kl`: KL from the unpruned model's predictions),
the last two by the text alone. Work is shared: a text's windows and the unpruned model's
predictions on them are made once, a removal's calibration score once for every search and
objective that asks for it, and the held-out measurements once per distinct chosen set. Every
finished piece is in `select.json` as soon as it is made, so an interrupted run resumes there.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from depthcurse.angular.measurement import measure
from depthcurse.errors import DepthcurseError
from depthcurse.io import atomic_write, ensure_out_dir, json_text, refuse_other_run
from depthcurse.prune.engine import evaluate_variants, why_unsupported
from depthcurse.prune.stepping import Stepper, Unsupported
from depthcurse.surgery import num_layers, removed_layers
from depthcurse.tasks import PerplexityTask, build_task
from depthcurse.text import load_texts

SELECT_JSON = "select.json"
SEARCHES = ("greedy", "one-shot", "angular", "bi")
BY_OBJECTIVE = ("greedy", "one-shot")  # the searches that score removals by the objective
OBJECTIVES = ("ppl", "kl")
BOOTSTRAP = 1000


@dataclass
class SelectConfig:
    k: int
    calibration: tuple[str, ...]  # text sources (wiki, c4, a file) the choice is made on
    objectives: tuple[str, ...] = ("ppl",)
    searches: tuple[str, ...] = ("greedy", "angular")
    calib_windows: int = 8
    eval_windows: int = 16
    seq_len: int = 128
    batch_size: int = 4
    task: str | None = None  # judged on it too (probes, commonsense, an lm-eval task), with `limit`
    limit: int | None = None
    seed: int = 1234

    def checked(self, n_layers: int | None = None) -> "SelectConfig":
        if self.k < 1:
            raise DepthcurseError(f"--k must be at least 1, got {self.k}")
        if n_layers is not None and not self.k < n_layers:
            raise DepthcurseError(f"--k {self.k} is out of range: the model has {n_layers} layers (1-{n_layers - 1})")
        for name, given, known in (("--objective", self.objectives, OBJECTIVES), ("--search", self.searches, SEARCHES)):
            bad = [g for g in given if g not in known]
            if bad or not given:
                raise DepthcurseError(f"{name} {','.join(given) or '(none)'}: use {', '.join(known)}")
        if not self.calibration:
            raise DepthcurseError("--calibration: give at least one text (wiki, c4, or a file)")
        for name in ("calib_windows", "eval_windows", "batch_size"):
            if getattr(self, name) < 1:
                raise DepthcurseError(f"--{name.replace('_', '-')} must be at least 1")
        if self.eval_windows < 2:
            raise DepthcurseError("--eval-windows must be at least 2: the intervals need paired windows")
        if self.seq_len < 8:
            raise DepthcurseError("--seq-len must be at least 8")
        return self

    def cells(self) -> list[tuple[str, str, str]]:
        """(calibration, search, objective) of every cell; a search that reads no objective is one
        cell per text, its objective "-"."""
        return [(c, s, o) for c in self.calibration for s in self.searches for o in (self.objectives if s in BY_OBJECTIVE else ("-",))]


def cell_name(cell) -> str:
    c, s, o = cell
    return f"{Path(c).stem if Path(c).suffix else c}/{s}" + (f"/{o}" if o != "-" else "")


@dataclass
class Texts:
    """One source's windows: those the choice is made on and those it is judged on, apart."""

    label: str
    calibration: torch.Tensor
    held_out: torch.Tensor


def text_windows(tokenizer, source: str, cfg: SelectConfig) -> Texts:
    """`calib_windows` + `eval_windows` windows of `source` (heal's and ppl's packing), split by a
    seeded shuffle so that neither part is one stretch of the text."""

    texts, label = load_texts(source)
    want = cfg.calib_windows + cfg.eval_windows
    windows = PerplexityTask(tokenizer, texts, source=label, seq_len=cfg.seq_len, limit=want, warn_short=False).windows
    if len(windows) < want:
        raise DepthcurseError(f"{label} holds {len(windows)} windows of {cfg.seq_len} tokens: fewer than --calib-windows + --eval-windows ({want})")
    order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(cfg.seed))
    return Texts(label, windows[order[: cfg.calib_windows]], windows[order[cfg.calib_windows:want]])


@torch.no_grad()
def per_window(model, windows: torch.Tensor, batch_size: int, reference: list[torch.Tensor] | None = None) -> tuple[list[float], list[float] | None, list[torch.Tensor]]:
    """Each window's mean next-token loss and, against `reference` (the unpruned model's log-probs,
    batch by batch), its mean KL(unpruned || model); and this model's log-probs batch by batch."""
    device = model.get_input_embeddings().weight.device
    losses, kls, logprobs = [], [] if reference is not None else None, []
    for b, start in enumerate(range(0, len(windows), batch_size)):
        ids = windows[start : start + batch_size].to(device)
        logp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[:, :-1].float(), dim=-1)
        batch_losses, batch_kls = window_scores(logp, ids, reference[b] if reference is not None else None)
        losses += batch_losses
        if reference is not None:
            kls += batch_kls
        logprobs.append(logp.cpu())
    return losses, kls, logprobs


def window_scores(logp: torch.Tensor, ids: torch.Tensor, reference: torch.Tensor | None) -> tuple[list[float], list[float]]:
    """A batch's log-probs of the next tokens as each window's mean loss and, against `reference`
    (the unpruned model's log-probs), its mean KL(unpruned || model)."""
    losses = (-logp.gather(-1, ids[:, 1:, None])[..., 0]).mean(1).tolist()
    if reference is None:
        return losses, []
    ref = reference.to(logp.device)
    return losses, (ref.exp() * (ref - logp)).sum(-1).mean(1).tolist()


class Scorer:
    """A text's calibration score of any removal: (loss, KL), each measured once and kept. Where
    prune's `Stepper` runs the model (Llama-like decoders), the unpruned model's stream entering
    every block is kept once for the calibration windows, and a removal runs from its first removed
    block on (the blocks before it compute as in the unpruned model): about half the block passes
    of a greedy search. Elsewhere, the model's own forward with the layers removed."""

    def __init__(self, model, texts: Texts, cfg: SelectConfig, known: dict[str, list[float]], on_new: Callable[[], None]):
        self.model, self.texts, self.cfg, self.known, self.on_new = model, texts, cfg, known, on_new
        self.streams, self.reference = self._streams()
        if self.streams is None:
            _, _, self.reference = per_window(model, texts.calibration, cfg.batch_size)  # the unpruned model's predictions, once

    @torch.no_grad()
    def _streams(self) -> tuple[list[tuple[object, object, list[torch.Tensor]]] | None, list[torch.Tensor] | None]:
        """Per batch: the stepper, its context and the stream entering each block; and the unpruned
        model's log-probs from the same pass (None, None: no stepper)."""
        try:
            stepper = Stepper(self.model)
            stepper.check()
        except (Unsupported, AssertionError, RuntimeError):
            return None, None
        out, reference = [], []
        for start in range(0, len(self.texts.calibration), self.cfg.batch_size):
            ids = self.texts.calibration[start : start + self.cfg.batch_size].to(stepper.device)
            ctx = stepper.context(ids.shape[1], 0)
            h, entering = stepper.embed(ids), []
            for i in range(stepper.n_layers):
                entering.append(h)
                h = stepper.block(i, h, ctx)
            out.append((stepper, ctx, entering))
            reference.append(torch.log_softmax(stepper.logits(h)[:, :-1], dim=-1).cpu())
        return out, reference

    @torch.no_grad()
    def _measured(self, removed: tuple[int, ...]) -> tuple[list[float], list[float]]:
        if self.streams is None:
            with removed_layers(self.model, removed):
                losses, kls, _ = per_window(self.model, self.texts.calibration, self.cfg.batch_size, self.reference)
            return losses, kls
        losses, kls = [], []
        first = min(removed)
        for b, (stepper, ctx, entering) in enumerate(self.streams):
            h = entering[first]
            for i in range(first, stepper.n_layers):
                if i not in removed:
                    h = stepper.block(i, h, ctx)
            ids = self.texts.calibration[b * self.cfg.batch_size : (b + 1) * self.cfg.batch_size].to(h.device)
            batch_losses, batch_kls = window_scores(torch.log_softmax(stepper.logits(h)[:, :-1], dim=-1), ids, self.reference[b])
            losses += batch_losses
            kls += batch_kls
        return losses, kls

    def __call__(self, removed: tuple[int, ...]) -> dict[str, float]:
        removed = tuple(sorted(removed))
        key = ",".join(map(str, removed))
        if key not in self.known:
            losses, kls = self._measured(removed)
            self.known[key] = [sum(losses) / len(losses), sum(kls) / len(kls)]
            self.on_new()
        loss, kl = self.known[key]
        return {"ppl": loss, "kl": kl}


def greedy(score: Scorer, n: int, k: int, objective: str) -> list[int]:
    removed: list[int] = []
    for _ in range(k):  # ties to the lowest layer: the path never depends on the order of evaluation
        best = min((score(tuple(removed + [u]))[objective], u) for u in range(n) if u not in removed)[1]
        removed.append(best)
    return sorted(removed)


def one_shot(score: Scorer, n: int, k: int, objective: str) -> list[int]:
    return sorted(sorted(range(n), key=lambda u: (score((u,))[objective], u))[:k])


def by_stream(model, texts: Texts, cfg: SelectConfig) -> dict[str, list[int]]:
    """The two searches that read the residual stream alone, from one angular-distance pass over the
    calibration windows (`angular.measure`, over every token: a few windows have too few last tokens)."""

    masks = torch.ones_like(texts.calibration)
    batches = [(texts.calibration[i : i + cfg.batch_size], masks[i : i + cfg.batch_size]) for i in range(0, len(masks), cfg.batch_size)]
    result = measure(model, batches, position="all", max_n=cfg.k, identity_tokens=0)
    n = result.num_layers
    return {"angular": list(result.block_choices(cfg.k)[0].layers),
            "bi": sorted(sorted(range(n), key=lambda l: (result.block_influence[l], l))[: cfg.k])}


def jaccard(a, b) -> float:
    a, b = set(a), set(b)
    return len(a & b) / len(a | b) if a | b else 1.0


def run_select(loaded, cfg: SelectConfig, out_dir: Path, *, on_phase: Callable[[str], None] | None = None,
               on_step: Callable[[str, int, int], None] | None = None) -> dict:
    """The grid in `out_dir` (resumed from its `select.json`): each cell's choice, the choices'
    held-out measurements, their overlap and the two-way decomposition of the held-out scores."""
    model, tokenizer = loaded.model, loaded.tokenizer
    n = num_layers(model)
    cfg = cfg.checked(n)
    phase = on_phase or (lambda text: None)
    out_dir = ensure_out_dir(out_dir)
    run = {**{k: v for k, v in loaded.describe().items() if k != "device"}, **{k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items()},
           "n_layers": n}
    path = out_dir / SELECT_JSON
    record = json.loads(path.read_text()) if path.exists() else {}
    if record:
        refuse_other_run(out_dir, record["run"], run, what="select run")
    record = {"run": run, "calibration_scores": {}, "cells": {}, "held_out": {}, "task": {}, **{k: v for k, v in record.items() if k != "run"}}
    save = lambda: atomic_write(path, json_text(record))  # noqa: E731
    started = time.perf_counter()
    cells = cfg.cells()
    texts: dict[str, Texts] = {}
    for source in cfg.calibration:
        phase(f"tokenising {source}")
        texts[source] = text_windows(tokenizer, source, cfg)
    model.eval()
    for source in cfg.calibration:  # the choices
        todo = [c for c in cells if c[0] == source and cell_name(c) not in record["cells"]]
        if not todo:
            continue
        phase(f"choosing on {texts[source].label}")
        known = record["calibration_scores"].setdefault(source, {})
        score = Scorer(model, texts[source], cfg, known, save) if any(c[1] in BY_OBJECTIVE for c in todo) else None
        stream = by_stream(model, texts[source], cfg) if any(c[1] not in BY_OBJECTIVE for c in todo) else {}
        for i, cell in enumerate(todo):
            if on_step:
                on_step(cell_name(cell), i, len(todo))
            _, search, objective = cell
            chosen = (greedy if search == "greedy" else one_shot)(score, n, cfg.k, objective) if search in BY_OBJECTIVE else stream[search]
            record["cells"][cell_name(cell)] = {"calibration": source, "calibration_label": texts[source].label, "search": search,
                                               "objective": objective, "layers": chosen}
            save()
    chosen_sets = sorted({tuple(c["layers"]) for c in record["cells"].values()})
    for source in cfg.calibration:  # every choice judged on every text's held-out windows
        held = record["held_out"].setdefault(source, {})
        todo = [s for s in chosen_sets if ",".join(map(str, s)) not in held]
        if not todo:
            continue
        phase(f"judging on {texts[source].label} (held out)")
        base_losses, _, reference = per_window(model, texts[source].held_out, cfg.batch_size)
        held.setdefault("", {"loss": base_losses, "kl": [0.0] * len(base_losses)})
        for i, layers in enumerate(todo):
            if on_step:
                on_step(f"{texts[source].label}: without {','.join(map(str, layers))}", i, len(todo))
            with removed_layers(model, layers):
                losses, kls, _ = per_window(model, texts[source].held_out, cfg.batch_size, reference)
            held[",".join(map(str, layers))] = {"loss": losses, "kl": kls}
            save()
    if cfg.task and not all(",".join(map(str, s)) in record["task"] for s in chosen_sets):
        phase(f"judging on {cfg.task}")
        record["task"] = judge_on_task(loaded, cfg, [(), *chosen_sets])
        save()
    record["labels"] = {source: t.label for source, t in texts.items()}
    record["overlap"] = overlap(record)
    record["decomposition"] = decomposition(record, cfg)
    record["wall_time_s"] = round(record.get("wall_time_s", 0.0) + time.perf_counter() - started, 3)
    save()
    return record


def judge_on_task(loaded, cfg: SelectConfig, sets: list[tuple[int, ...]]) -> dict:
    """Every chosen set on the task at once, by prune's reuse engine (each question's score kept)."""

    task = build_task(cfg.task, loaded.tokenizer, limit=cfg.limit, batch_size=cfg.batch_size, seed=cfg.seed, model=loaded.model, model_source=loaded.source)
    task.per_example = True
    why = why_unsupported(loaded.model, task)
    if why is not None:
        raise DepthcurseError(f"--task {cfg.task}: prune's reuse engine cannot score it ({why})")
    scores, _ = evaluate_variants(loaded.model, task, sets, checked=True)
    out = {}
    for s in sets:
        per = scores[s].details.get("per_example") or {}
        out[",".join(map(str, s))] = {"metric": task.metric, "value": scores[s].metrics[task.metric], "metrics": scores[s].metrics,
                                      "items": [v for part in per.values() for v in part]}
    out["describe"] = task.describe()
    return out


def overlap(record: dict) -> dict:
    """Jaccard of every pair of cells' choices, and its mean over the pairs that share the
    calibration (differing in search or objective) against those that share the search and
    objective (differing in calibration): which of the two moves the choice."""
    names = list(record["cells"])
    sets = {n: record["cells"][n]["layers"] for n in names}
    matrix = [[jaccard(sets[a], sets[b]) for b in names] for a in names]
    same_cal, same_search = [], []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            ca, cb = record["cells"][a], record["cells"][b]
            if ca["calibration"] == cb["calibration"]:
                same_cal.append(jaccard(sets[a], sets[b]))
            elif (ca["search"], ca["objective"]) == (cb["search"], cb["objective"]):
                same_search.append(jaccard(sets[a], sets[b]))
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    return {"cells": names, "matrix": matrix, "same_calibration_mean": mean(same_cal), "same_calibration_pairs": len(same_cal),
            "same_search_mean": mean(same_search), "same_search_pairs": len(same_search)}


def _shares(y: dict[tuple[str, str], float], rows: list[str], cols: list[str]) -> dict[str, float]:
    """Two-way decomposition without replication: the share of the total sum of squares that goes
    with the rows (calibration), with the columns (search), and the rest (their interaction)."""
    grand = sum(y.values()) / len(y)
    row = {r: sum(y[r, c] for c in cols) / len(cols) for r in rows}
    col = {c: sum(y[r, c] for r in rows) / len(rows) for c in cols}
    total = sum((v - grand) ** 2 for v in y.values())
    if total <= 0:
        return {"calibration": float("nan"), "search": float("nan"), "rest": float("nan")}
    ss_row = len(cols) * sum((v - grand) ** 2 for v in row.values())
    ss_col = len(rows) * sum((v - grand) ** 2 for v in col.values())
    return {"calibration": ss_row / total, "search": ss_col / total, "rest": max(0.0, 1 - (ss_row + ss_col) / total)}


def decomposition(record: dict, cfg: SelectConfig) -> dict:
    """Per measurement judged on (each text's held-out loss and KL, the task): how much of the
    spread of the cells' scores goes with the calibration text and how much with the search (and
    objective), with 95% intervals from resampling the held-out windows (or questions), paired
    across cells."""
    cells = record["cells"]
    rows = list(cfg.calibration)
    cols = sorted({(c["search"], c["objective"]) for c in cells.values()})
    if len(rows) < 2 or len(cols) < 2:
        return {"why_not": "a decomposition needs two calibration texts and two searches (or objectives) at least"}
    where = {(c["calibration"], (c["search"], c["objective"])): ",".join(map(str, c["layers"])) for c in cells.values()}
    # each measurement: a chosen set's key -> its items (windows or questions), paired across sets
    measures: dict[str, Callable[[str], list[float]]] = {
        f"{record.get('labels', {}).get(source, source)} held-out {metric}": (lambda key, source=source, metric=metric: record["held_out"][source][key][metric])
        for source in cfg.calibration for metric in ("loss", "kl")}
    if record.get("task"):
        measures[f"{cfg.task} {record['task'][''].get('metric')}"] = lambda key: record["task"][key]["items"]
    mean = lambda items, pick: sum(items[i] for i in pick) / len(pick)  # noqa: E731
    rng = random.Random(cfg.seed)
    out = {}
    if len(where) < len(rows) * len(cols):
        return out  # a cell not chosen yet: no full grid to decompose
    for name, items_of in measures.items():
        size = len(items_of(""))
        if size < 2:
            continue
        every = range(size)
        grid = {(r, c): mean(items_of(where[r, c]), every) for r in rows for c in cols}
        shares = _shares(grid, rows, cols)
        draws = {k: [] for k in shares}
        for _ in range(BOOTSTRAP):
            pick = [rng.randrange(size) for _ in range(size)]
            s = _shares({(r, c): mean(items_of(where[r, c]), pick) for r in rows for c in cols}, rows, cols)
            for k, v in s.items():
                if math.isfinite(v):
                    draws[k].append(v)
        intervals = {k: _percentiles(v) for k, v in draws.items()}
        out[name] = {"shares": shares, "intervals": intervals, "scores": {f"{r}|{c[0]}/{c[1]}": v for (r, c), v in grid.items()},
                     "decided_by": _decided(shares, intervals)}
    return out


def _percentiles(values: list[float]) -> list[float] | None:
    if len(values) < 20:
        return None
    values = sorted(values)
    return [values[int(0.025 * (len(values) - 1))], values[int(0.975 * (len(values) - 1))]]


def _decided(shares: dict, intervals: dict) -> str:
    """Which factor the spread goes with, said only where the intervals tell the two apart."""
    c, s = intervals.get("calibration"), intervals.get("search")
    if c is None or s is None:
        return "cannot tell (too few resamples)"
    if c[0] > s[1]:
        return "calibration"
    if s[0] > c[1]:
        return "search"
    return "cannot tell apart (the 95% intervals of the two shares overlap)"
