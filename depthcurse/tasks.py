"""What a pruned model is measured on: perplexity on text, or any lm-eval log-likelihood task.

A task is built once (data loaded, prompts tokenised where possible) and then `evaluate`d on
many variants of the same in-memory model. Nothing is cached across calls in a way that could
hand a pruned model the unpruned model's answers: lm-eval's response cache is never enabled.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from depthcurse.errors import DepthcurseError


@dataclass
class Score:
    """One evaluation of one model variant."""

    metrics: dict[str, float]  # e.g. {"acc": 0.41, "acc_norm": 0.45} or {"loss": 3.1, "ppl": 22.2}
    examples: int
    details: dict = field(default_factory=dict)  # per-subject accuracies, token counts...


class Task(Protocol):
    name: str
    metric: str  # the headline metric in `Score.metrics`
    higher_is_better: bool

    def describe(self) -> dict: ...

    def evaluate(self, model: torch.nn.Module) -> Score: ...


# --------------------------------------------------------------------------- perplexity


class PerplexityTask:
    """Mean next-token loss over non-overlapping windows of `seq_len` tokens of real text.

    Documents are joined with the EOS token and cut into windows, so every window is full and
    no padding is needed; the first token of each window has no context and is not scored.
    """

    name = "ppl"
    metric = "loss"
    higher_is_better = False

    def __init__(self, tokenizer, texts: list[str], *, source: str, seq_len: int = 512, limit: int | None = 32, batch_size: int = 4):
        if seq_len < 2:
            raise DepthcurseError("--seq-len must be at least 2")
        self.source, self.seq_len, self.batch_size = source, seq_len, max(1, batch_size)
        want = None if limit is None else limit * seq_len
        eos = tokenizer.eos_token_id
        ids: list[int] = []
        for text in texts:
            ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
            if eos is not None:
                ids.append(eos)
            if want is not None and len(ids) >= want:
                break
        n_windows = len(ids) // seq_len
        if n_windows == 0:
            raise DepthcurseError(f"the text in {source} has {len(ids)} tokens, fewer than one window of --seq-len {seq_len}")
        if limit is not None and n_windows < limit:
            logging.getLogger("depthcurse").warning("%s holds only %d windows of %d tokens; using them all", source, n_windows, seq_len)
        n_windows = n_windows if limit is None else min(n_windows, limit)
        self.windows = torch.tensor(ids[: n_windows * seq_len]).view(n_windows, seq_len)

    def describe(self) -> dict:
        return {"task": "ppl", "data": self.source, "seq_len": self.seq_len, "windows": len(self.windows), "tokens": self.windows.numel()}

    @torch.inference_mode()
    def evaluate(self, model: torch.nn.Module) -> Score:
        device = model.get_input_embeddings().weight.device
        total, count = 0.0, 0
        for batch in self.windows.split(self.batch_size):
            batch = batch.to(device)
            logits = model(input_ids=batch, use_cache=False).logits[:, :-1]
            # fp32 for the loss: bf16 log-softmax over a 50k vocabulary loses the digits a sweep compares
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), batch[:, 1:].reshape(-1).to(logits.device), reduction="sum")
            total += loss.item()
            count += batch[:, 1:].numel()
        return self.score(total, count)

    def score(self, total: float, count: int) -> Score:
        """The score for a summed next-token loss `total` over `count` predicted tokens."""
        mean = total / count
        if not math.isfinite(mean):
            return Score({"loss": float("nan"), "ppl": float("nan")}, len(self.windows), {"tokens": count})
        return Score({"loss": mean, "ppl": math.exp(min(mean, 700.0))}, len(self.windows), {"tokens": count})


# --------------------------------------------------------------------------- lm-eval tasks


def quiet_lm_eval() -> None:
    """lm-eval and datasets log every step at INFO/WARNING and draw their own tqdm bars; the
    CLI shows one rich progress bar instead."""
    os.environ.setdefault("TQDM_DISABLE", "1")
    for name in ("lm_eval", "lm-eval", "datasets", "transformers", "huggingface_hub", "evaluate"):
        logging.getLogger(name).setLevel(logging.ERROR)
    with contextlib.suppress(Exception):
        import datasets
        import huggingface_hub.utils
        import transformers

        datasets.disable_progress_bars()
        huggingface_hub.utils.disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()


_TASK_MANAGER = None


def task_manager():
    """lm-eval's task index (about 15k YAML files, several seconds), built once per process."""
    global _TASK_MANAGER
    if _TASK_MANAGER is None:
        from lm_eval.tasks import TaskManager

        _TASK_MANAGER = TaskManager()
    return _TASK_MANAGER


@contextlib.contextmanager
def offline_task_data(notes: list[str]):
    """Point lm-eval's hub data at the offline cache while tasks are built.

    lm-eval calls `datasets.load_dataset(hub_path, name)`; this redirects the path to the
    hub-style folder `depthcurse assets` made, and drops the splits the offline copy lacks
    (ARC offline has validation only) so lm-eval falls back to the split that exists. Each
    such change is appended to `notes` and saved with the results.
    """
    import datasets
    from lm_eval.api.task import ConfigurableTask

    from depthcurse import assets

    real_load, real_download = datasets.load_dataset, ConfigurableTask.download

    def load_dataset(path, name=None, **kwargs):
        local = assets.local_dataset(path)
        if local is None:
            raise DepthcurseError(f"data set {path} is on the hub, which is not reachable, and is not among the offline assets (see `depthcurse assets`)")
        return real_load(str(local), name=name, **kwargs)

    def download(self, *args, **kwargs):
        real_download(self, *args, **kwargs)
        have = set(self.dataset.keys())
        for attr in ("test_split", "validation_split", "training_split", "fewshot_split"):
            split = getattr(self.config, attr, None)
            if split is not None and split not in have:
                setattr(self.config, attr, None)
                notes.append(f"{self.config.task}: offline copy has no {split!r} split ({attr} unset; lm-eval falls back)")
        if self.config.test_split is None and self.config.validation_split is None:
            raise DepthcurseError(f"{self.config.task}: the offline copy has none of the splits this task evaluates on")

    datasets.load_dataset, ConfigurableTask.download = load_dataset, download
    try:
        yield
    finally:
        datasets.load_dataset, ConfigurableTask.download = real_load, real_download


class LmEvalTask:
    """An lm-eval task or group (mmlu, arc_easy, hellaswag, ...) evaluated on an in-memory model.

    Tasks are built once; each `evaluate` runs lm-eval's own request building, model calls
    and metrics, so the numbers are lm-eval's. Groups report lm-eval's aggregate (for MMLU the
    micro-average over questions) and keep every subtask's score in `details`.
    """

    LOGLIKELIHOOD_TYPES = {"multiple_choice", "loglikelihood", "loglikelihood_rolling"}

    def __init__(self, task: str, tokenizer, *, num_fewshot: int | None = 0, limit: int | None = None, batch_size: int = 8, seed: int = 1234):
        from depthcurse import assets

        quiet_lm_eval()
        self.name, self.tokenizer, self.limit, self.batch_size, self.seed = task, tokenizer, limit, batch_size, seed
        self.offline = not assets.hub_reachable()
        self.notes: list[str] = []
        tm = task_manager()
        if task not in tm.all_tasks:
            close = difflib.get_close_matches(task, tm.all_tasks, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise DepthcurseError(f"unknown task {task!r}: not ppl, and not an lm-eval task{hint}")
        if self.offline:
            assets.go_offline()
        with offline_task_data(self.notes) if self.offline else contextlib.nullcontext():
            loaded = tm.load([task])
        self.loaded = loaded
        bad = sorted(n for n, t in loaded["tasks"].items() if t.get_config("output_type") not in self.LOGLIKELIHOOD_TYPES)
        if bad:
            raise DepthcurseError(f"task {task!r} generates text ({', '.join(bad[:3])}...): prune supports log-likelihood and multiple-choice tasks")
        self.num_fewshot = num_fewshot
        for t in loaded["tasks"].values():
            if num_fewshot is not None:
                t.set_config(key="num_fewshot", value=num_fewshot)
            elif t.get_config("num_fewshot") is None:
                t.set_config(key="num_fewshot", value=0)
            t.set_fewshot_seed(seed=seed)
        first = next(iter(loaded["tasks"].values()))
        self.metric = next(iter(first._metric_fn_list))
        self.higher_is_better = bool(first.higher_is_better().get(self.metric, True))
        self._lm = None

    def describe(self) -> dict:
        shots = sorted({t.get_config("num_fewshot") for t in self.loaded["tasks"].values()})
        return {
            "task": self.name,
            "lm_eval_tasks": sorted(self.loaded["tasks"]),
            "num_fewshot": shots[0] if len(shots) == 1 else shots,
            "limit": self.limit,
            "fewshot_seed": self.seed,
            "offline_data": self.offline,
            "notes": self.notes,
        }

    def _wrapper(self, model):
        # One wrapper serves the whole sweep: the model object is the same, only its block list changes.
        if self._lm is None or self._lm.model is not model:
            self._lm = _quiet_hflm()(pretrained=model, tokenizer=self.tokenizer, batch_size=self.batch_size)
        return self._lm

    def run(self, model, *, log_samples: bool = False) -> dict:
        """lm-eval's raw results dict for `model` (with per-sample logs if asked)."""
        from lm_eval import evaluator

        # stderr bootstraps cost seconds per call and say nothing about a layer's effect
        results = evaluator.evaluate(self._wrapper(model), self.loaded, limit=self.limit, bootstrap_iters=0, log_samples=log_samples)
        if results is None:
            raise DepthcurseError("lm-eval returned no results")
        return results

    def evaluate(self, model) -> Score:
        return self.score(self.run(model))

    def score(self, results: dict) -> Score:
        table = results["results"]
        top = table[self.name]
        metrics = {key.split(",")[0]: float(value) for key, value in top.items() if "," in key and "_stderr" not in key and isinstance(value, (int, float))}
        n_samples = results.get("n-samples", {})
        examples = sum(int(v.get("effective", 0)) for k, v in n_samples.items() if k in self.loaded["tasks"])
        details = {}
        if len(table) > 1:
            details = {
                name: {key.split(",")[0]: float(v) for key, v in row.items() if "," in key and "_stderr" not in key and isinstance(v, (int, float))}
                for name, row in table.items()
                if name != self.name
            }
        return Score(metrics, examples, details)


def _quiet_hflm():
    """lm-eval's HFLM without its per-call tqdm bars (evaluate() gives no way to turn them off)."""
    from lm_eval.models.huggingface import HFLM

    class QuietHFLM(HFLM):
        def loglikelihood(self, requests, disable_tqdm: bool = False):
            return super().loglikelihood(requests, disable_tqdm=True)

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            return super().loglikelihood_rolling(requests, disable_tqdm=True)

    return QuietHFLM


# --------------------------------------------------------------------------- registry


#: Tasks that need a model head other than a language-model head, and which head (see loading.Head).
TASK_HEADS = {"squad": "qa", "repr": "base"}


def head_for_task(name: str) -> str:
    """Which head `load_model` must give the model for task `name`."""
    return TASK_HEADS.get(name, "causal-lm")


def build_task(name: str, tokenizer, *, data: str = "auto", seq_len: int | None = None, limit: int | None = None, num_fewshot: int | None = 0, batch_size: int = 8, seed: int = 1234, model=None, model_source: str | None = None) -> Task:
    """The task called `name`: `ppl`, `squad`, `repr`, or any lm-eval task/group name (mmlu, arc_easy, ...).

    `seq_len` is the ppl window (default 512) or the repr passage length (default 128).
    `limit` is the number of text windows for ppl (default 32), of questions for squad (default
    all), of passages for repr (default 256), and of examples per lm-eval subtask otherwise
    (default: all). `repr` needs the unpruned `model` (it remembers its embeddings); `squad` skips
    the questions a `depthcurse finetune-qa` checkpoint at `model_source` was trained on.
    """
    if tokenizer is None:
        raise DepthcurseError("this model has no tokenizer: text tasks need one")
    if limit is not None and limit <= 0:
        raise DepthcurseError("--limit must be a positive number")
    if name == "ppl":
        from depthcurse.text import load_texts

        started = time.perf_counter()
        texts, source = load_texts(data)
        task = PerplexityTask(tokenizer, texts, source=source, seq_len=512 if seq_len is None else seq_len, limit=32 if limit is None else limit, batch_size=batch_size)
        logging.getLogger("depthcurse").debug("ppl windows built in %.1fs", time.perf_counter() - started)
        return task
    if name == "squad":
        from depthcurse.squad import build_squad_task

        return build_squad_task(tokenizer, data=data, limit=limit, batch_size=batch_size, model_source=model_source)
    if name == "repr":
        from depthcurse.representation import RepresentationTask
        from depthcurse.text import load_texts

        texts, source = load_texts(data)
        # sentence encoders are trained on short passages (all-MiniLM-L6-v2: 128 tokens)
        return RepresentationTask(tokenizer, model, texts, source=source, seq_len=128 if seq_len is None else seq_len, limit=256 if limit is None else limit, batch_size=batch_size)
    if data != "auto":
        raise DepthcurseError(f"--data applies to --task ppl only (and squad, repr); {name} brings its own data")
    return LmEvalTask(name, tokenizer, num_fewshot=num_fewshot, limit=limit, batch_size=batch_size, seed=seed)
