"""What a pruned model is measured on: a small registry of tasks, and lm-eval's for the rest.

`build_task(name, tokenizer, ...)` looks `name` up in `TASKS` (a new task is one entry: which
model head it needs and how to build it); any other name is an lm-eval task or group (mmlu,
arc_easy, hellaswag, ...), or a suite of them (`SUITES`, a new one also one entry; or a list). Every task meets the contract in `base` (`Task`, `Score`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from depthcurse.errors import DepthcurseError
from depthcurse.tasks.base import Score, Task
from depthcurse.loading import check_sequence_length, window_length
from depthcurse.tasks.harness import SUITE_METRIC, LmEvalTask, check_task_name
from depthcurse.tasks.perplexity import PerplexityTask
from depthcurse.tasks.probes import PROBES, SHOTS as PROBE_SHOTS
from depthcurse.tasks.representation import RepresentationTask
from depthcurse.tasks.squad import build_squad_task
from depthcurse.text import load_texts

__all__ = ["Score", "Task", "TASKS", "SUITES", "SUITE_METRIC", "build_task", "head_for_task", "suite_members", "suite_groups", "PerplexityTask", "LmEvalTask",
           "RepresentationTask"]


@dataclass(frozen=True)
class TaskEntry:
    head: str  # the model head `load_model` must give: "causal-lm", "qa" or "base"
    build: Callable[..., Task]  # (tokenizer, data=, seq_len=, limit=, batch_size=, model=, model_source=) -> Task
    takes: frozenset = frozenset()  # which of the options `data`, `seq_len`, `num_fewshot`, `bos` it uses


def _perplexity(tokenizer, *, data, seq_len, limit, batch_size, model, bos=True, **_) -> PerplexityTask:
    seq_len = window_length(model, seq_len)
    started = time.perf_counter()
    texts, source = load_texts(data)
    task = PerplexityTask(tokenizer, texts, source=source, seq_len=seq_len, limit=32 if limit is None else limit, batch_size=batch_size, warn_short=limit is not None,
                          bos=bos)
    logging.getLogger("depthcurse").debug("ppl windows built in %.1fs", time.perf_counter() - started)
    return task


def _squad(tokenizer, *, data, limit, batch_size, model_source, **_) -> Task:
    return build_squad_task(tokenizer, data=data, limit=limit, batch_size=batch_size, model_source=model_source)


def _representation(tokenizer, *, data, seq_len, limit, batch_size, model, **_) -> RepresentationTask:
    if model is not None and seq_len is not None:
        check_sequence_length(model, seq_len)
    texts, source = load_texts(data)
    # sentence encoders are trained on short passages (all-MiniLM-L6-v2: 128 tokens)
    return RepresentationTask(tokenizer, model, texts, source=source, seq_len=128 if seq_len is None else seq_len, limit=256 if limit is None else limit, batch_size=batch_size)


#: depthcurse's own tasks; every other name is looked up among lm-eval's.
TASKS: dict[str, TaskEntry] = {
    "ppl": TaskEntry("causal-lm", _perplexity, frozenset({"data", "seq_len", "bos"})),
    "squad": TaskEntry("qa", _squad, frozenset({"data"})),
    "repr": TaskEntry("base", _representation, frozenset({"data", "seq_len"})),
}
LM_EVAL_TAKES = frozenset({"num_fewshot", "max_gen_toks"})
#: named suites of lm-eval tasks, reported each and averaged; any comma-separated list is one too
SUITES: dict[str, tuple[str, ...]] = {
    # the zero-shot commonsense suite the layer-pruning papers report (ShortGPT, LinearPatch, Prune&Comp, LLM-Streamline)
    "commonsense": ("arc_easy", "arc_challenge", "boolq", "hellaswag", "piqa", "winogrande", "openbookqa"),
    # generative capability probes (tasks/probes.py): greedy exact match, one forward per example
    "probes": tuple(PROBES),
}


def suite_members(name: str) -> tuple[str, ...] | None:
    """The tasks of a suite `name` (a named one, or a comma-separated list), or None for one task."""
    if name in SUITES:
        return SUITES[name]
    if "," in name:
        listed = _listed(name)
        inside = [t for t in listed if t in TASKS]
        if inside:
            raise DepthcurseError(f"--task {name}: a list takes lm-eval tasks and named suites ({', '.join(SUITES)}); {inside[0]} is neither")
        members = [m for t in listed for m in SUITES.get(t, (t,))]  # a named suite in a list: its tasks
        twice = next((m for m in members if members.count(m) > 1), None)
        if twice is not None:
            within = [t for t in listed if twice in SUITES.get(t, ())]
            raise DepthcurseError(f"--task {name}: {twice} would be scored twice" + (f" (it is in {within[0]})" if within else "") +
                                  ", and the average would weigh it double: give each task once")
        return tuple(members)
    return None


def suite_groups(name: str) -> dict[str, tuple[str, ...]]:
    """The named suites a list holds (`commonsense,probes`), each averaged on its own beside the
    whole list's average: classification kept against generation kept, in one table."""
    return {t: SUITES[t] for t in _listed(name) if t in SUITES} if "," in name else {}


def _listed(name: str) -> tuple[str, ...]:
    """The names of a comma-separated list, in order (`suite_members` refuses one given twice)."""
    return tuple(t.strip() for t in name.split(",") if t.strip())
_FLAGS = {"data": "--data", "seq_len": "--seq-len", "num_fewshot": "--num-fewshot", "max_gen_toks": "--max-gen-toks", "bos": "--no-bos"}


def head_for_task(name: str) -> str:
    """Which head `load_model` must give the model for task `name`."""
    entry = TASKS.get(name)
    return entry.head if entry else "causal-lm"


def build_task(name: str, tokenizer, *, data: str = "auto", seq_len: int | None = None, limit: int | None = None, num_fewshot: int | None = 0, batch_size: int = 8, seed: int = 1234, model=None, model_source: str | None = None,
               max_gen_toks: int | None = None, bos: bool = True) -> Task:
    """The task called `name`: `ppl`, `squad`, `repr`, any lm-eval task/group name (mmlu, arc_easy, ...),
    or a suite of them, named (`commonsense`: `SUITES`) or listed (arc_easy,piqa), each task scored
    and their average the headline (`SUITE_METRIC`).

    `seq_len` is the ppl window (default 512, or the model's maximum if less) or the repr passage
    length (default 128); one longer than the model accepts is refused.
    `limit` is the number of text windows for ppl (default 32), of questions for squad (default
    all), of passages for repr (default 256), and of examples per lm-eval subtask otherwise
    (default: all). `bos=False` cuts ppl's windows from the text with no BOS first (see
    `PerplexityTask`). `repr` needs the unpruned `model` (it remembers its embeddings); `squad` skips
    the questions a `depthcurse finetune-qa` checkpoint at `model_source` was trained on.
    """
    if tokenizer is None:
        raise DepthcurseError("this model has no tokenizer: text tasks need one")
    if limit is not None and limit <= 0:
        raise DepthcurseError("--limit must be a positive number")
    if num_fewshot is not None and num_fewshot < 0:
        raise DepthcurseError(f"--num-fewshot must be 0 or more, got {num_fewshot}")
    entry = TASKS.get(name)
    members = suite_members(name)
    if entry is None and members is None:
        check_task_name(name)  # an unknown name is the first thing to say, before what it cannot take
    given = {"data": data != "auto", "seq_len": seq_len is not None, "num_fewshot": num_fewshot not in (None, 0), "max_gen_toks": max_gen_toks is not None, "bos": not bos}
    takes = entry.takes if entry is not None else LM_EVAL_TAKES
    for option in (o for o, set_ in given.items() if set_ and o not in takes):
        users = [t for t, e in TASKS.items() if option in e.takes] + (["lm-eval tasks"] if option in LM_EVAL_TAKES else [])
        raise DepthcurseError(f"{_FLAGS[option]} does not apply to --task {name}: it is for {', '.join(users)}")
    if num_fewshot and any(t in PROBES for t in (members or (name,))):
        raise DepthcurseError(f"--num-fewshot does not apply to --task {name}: each probe's prompt carries its own {PROBE_SHOTS} solved examples")
    if entry is not None:
        return entry.build(tokenizer, data=data, seq_len=seq_len, limit=limit, batch_size=batch_size, model=model, model_source=model_source,
                           **({"bos": bos} if "bos" in entry.takes else {}))
    return LmEvalTask(name, tokenizer, num_fewshot=num_fewshot, limit=limit, batch_size=batch_size, seed=seed, max_gen_toks=max_gen_toks,
                      members=members, groups=suite_groups(name))
