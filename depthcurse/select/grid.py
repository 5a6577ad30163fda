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
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from depthcurse.angular.measurement import measure
from depthcurse.errors import DepthcurseError
from depthcurse.io import atomic_write, ensure_out_dir, json_text, refuse_other_run
from depthcurse.loading import check_sequence_length
from depthcurse.prune.engine import evaluate_variants, why_unsupported
from depthcurse.prune.stepping import Stepper, Unsupported
from depthcurse.select.statistics import decomposition, key, overlap
from depthcurse.surgery import num_layers, removed_layers
from depthcurse.tasks import PerplexityTask, build_task
from depthcurse.text import load_texts, text_kind

SELECT_JSON = "select.json"
SEARCHES = ("greedy", "one-shot", "angular", "bi")
BY_OBJECTIVE = ("greedy", "one-shot")  # the searches that score removals by the objective
OBJECTIVES = ("ppl", "kl")


@dataclass
class SelectConfig:
    k: int
    calibration: tuple[str, ...]  # text sources (wiki, c4, code, math, dialogue, a file) the choice is made on
    objectives: tuple[str, ...] | None = None  # None: not given (ppl, where a search reads one)
    searches: tuple[str, ...] = ("greedy", "angular")
    calib_windows: int = 8
    eval_windows: int = 16
    seq_len: int = 128
    batch_size: int = 4
    task: str | None = None  # judged on it too (probes, commonsense, an lm-eval task), with `limit`
    limit: int | None = None
    seed: int = 1234

    def checked(self, n_layers: int | None = None) -> "SelectConfig":
        """The config with its defaults filled in, or one line on what is wrong with it."""
        if self.k < 1:
            raise DepthcurseError(f"--k must be at least 1, got {self.k}")
        if n_layers is not None and not self.k < n_layers:
            raise DepthcurseError(f"--k {self.k} is out of range: the model has {n_layers} layers (1-{n_layers - 1})")
        if self.objectives is not None and not any(s in BY_OBJECTIVE for s in self.searches):
            raise DepthcurseError(f"--objective {','.join(self.objectives)}: no search of --search {','.join(self.searches)} reads an objective "
                                  f"(only {' and '.join(BY_OBJECTIVE)} do)")
        objectives = self.objectives if self.objectives is not None else ("ppl",)
        for name, given, known in (("--objective", objectives, OBJECTIVES), ("--search", self.searches, SEARCHES)):
            bad = [g for g in given if g not in known]
            if bad or not given:
                raise DepthcurseError(f"{name} {','.join(given) or '(none)'}: use {', '.join(known)}")
        if not self.calibration:
            raise DepthcurseError("--calibration: give at least one text (wiki, c4, code, math, dialogue, or a file)")
        for name, given in (("--calibration", [str(Path(c).expanduser().resolve()) if Path(c).suffix else c for c in self.calibration]),
                            ("--objective", objectives), ("--search", self.searches)):
            twice = sorted({g for g in given if given.count(g) > 1})
            if twice:
                raise DepthcurseError(f"{name} names {', '.join(twice)} more than once: each cell would be measured twice, as if two")
        if self.limit is not None and self.task is None:
            raise DepthcurseError("--limit applies to --task, which is not given")
        for name in ("calib_windows", "eval_windows", "batch_size"):
            if getattr(self, name) < 1:
                raise DepthcurseError(f"--{name.replace('_', '-')} must be at least 1")
        if self.eval_windows < 2:
            raise DepthcurseError("--eval-windows must be at least 2: the intervals need paired windows")
        if self.seq_len < 8:
            raise DepthcurseError("--seq-len must be at least 8")
        return replace(self, objectives=objectives)

    def cells(self) -> list[tuple[str, str, str]]:
        """(calibration, search, objective) of every cell; a search that reads no objective is one
        cell per text, its objective "-"."""
        return [(c, s, o) for c in self.calibration for s in self.searches for o in (self.objectives if s in BY_OBJECTIVE else ("-",))]


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
        name = key(removed)
        if name not in self.known:
            losses, kls = self._measured(removed)
            self.known[name] = [sum(losses) / len(losses), sum(kls) / len(kls)]
            self.on_new()
        loss, kl = self.known[name]
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


def run_select(loaded, cfg: SelectConfig, out_dir: Path, *, on_phase: Callable[[str], None] | None = None,
               on_step: Callable[[str, int, int], None] | None = None) -> dict:
    """The grid in `out_dir` (resumed from its `select.json`): each cell's choice, the choices'
    held-out measurements, their overlap and the two-way decomposition of the held-out scores."""
    model, tokenizer = loaded.model, loaded.tokenizer
    n = num_layers(model)
    cfg = cfg.checked(n)
    check_sequence_length(model, cfg.seq_len)
    labels = source_labels(cfg.calibration)
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
    for source in cfg.calibration:  # before the first phase: a text that cannot be read is the one line said
        texts[source] = text_windows(tokenizer, source, cfg)
    model.eval()
    for source in cfg.calibration:  # the choices
        todo = [c for c in cells if c[0] == source and cell_name(c, labels) not in record["cells"]]
        if not todo:
            continue
        phase(f"choosing on {labels[source]}")
        known = record["calibration_scores"].setdefault(source, {})
        score = Scorer(model, texts[source], cfg, known, save) if any(c[1] in BY_OBJECTIVE for c in todo) else None
        stream = by_stream(model, texts[source], cfg) if any(c[1] not in BY_OBJECTIVE for c in todo) else {}
        for i, cell in enumerate(todo):
            if on_step:
                on_step(cell_name(cell, labels), i, len(todo))
            _, search, objective = cell
            chosen = (greedy if search == "greedy" else one_shot)(score, n, cfg.k, objective) if search in BY_OBJECTIVE else stream[search]
            record["cells"][cell_name(cell, labels)] = {"calibration": source, "calibration_label": labels[source], "search": search,
                                                        "objective": objective, "layers": chosen}
            save()
    chosen_sets = sorted({tuple(c["layers"]) for c in record["cells"].values()})
    for source in cfg.calibration:  # every choice judged on every text's held-out windows
        held = record["held_out"].setdefault(source, {})
        todo = [s for s in chosen_sets if key(s) not in held]
        if not todo:
            continue
        phase(f"judging on {labels[source]} (held out)")
        base_losses, _, reference = per_window(model, texts[source].held_out, cfg.batch_size)
        held.setdefault("", {"loss": base_losses, "kl": [0.0] * len(base_losses)})
        for i, layers in enumerate(todo):
            if on_step:
                on_step(f"{labels[source]}: without {key(layers)}", i, len(todo))
            with removed_layers(model, layers):
                losses, kls, _ = per_window(model, texts[source].held_out, cfg.batch_size, reference)
            held[key(layers)] = {"loss": losses, "kl": kls}
            save()
    if cfg.task and not all(key(s) in record["task"] for s in chosen_sets):
        phase(f"judging on {cfg.task}")
        record["task"] = judge_on_task(loaded, cfg, [(), *chosen_sets])
        save()
    record["labels"] = labels
    record["kinds"] = {source: text_kind(source) for source in cfg.calibration}
    record["overlap"] = overlap(record["cells"])
    record["decomposition"] = decomposition(record, cfg.seed)
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
        out[key(s)] = {"metric": task.metric, "value": scores[s].metrics[task.metric], "metrics": scores[s].metrics,
                                      "items": [v for part in per.values() for v in part]}
    out["describe"] = task.describe()
    return out
