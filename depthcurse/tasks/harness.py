"""lm-eval tasks (mmlu, arc_easy, hellaswag, ...) on an in-memory model, with lm-eval's own prompts,
requests, metrics and aggregation, and its data redirected to the offline cache where the hub
is out of reach. lm-eval's response cache is never enabled: it keys on the request, not the
model, and would hand a pruned model the unpruned model's answers.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
from pathlib import Path

from depthcurse import assets
from depthcurse.errors import DepthcurseError
from depthcurse.tasks.base import Score
from depthcurse.tasks.probes import PROBES, task_config
from depthcurse.tasks.probes import describe as describe_probes
from depthcurse.tasks.task_index import task_manager_from_saved_index


def quiet_lm_eval() -> None:
    """lm-eval and datasets log every step at INFO/WARNING and draw their own tqdm bars; the
    CLI shows one rich progress bar instead."""
    os.environ.setdefault("TQDM_DISABLE", "1")
    for name in ("lm_eval", "lm-eval", "datasets", "transformers", "huggingface_hub", "evaluate"):
        logging.getLogger(name).setLevel(logging.ERROR)
    with contextlib.suppress(Exception):
        # lazy: this is where the bars to turn off live; the import is this call's cost, paid once
        import datasets
        import huggingface_hub.utils
        import transformers

        datasets.disable_progress_bars()
        huggingface_hub.utils.disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()


def compile_templates_once() -> None:
    """lm-eval compiles a prompt's Jinja template anew for every document it renders: most of the
    time of building 5-shot MMLU's prompts. Compile each template once; what it renders is the same."""
    from lm_eval import utils  # lazy: lm-eval costs seconds to import; only its tasks need it

    if getattr(utils.apply_template, "compiled_once", False) or not hasattr(utils, "env"):
        return
    compiled: dict = {}

    def apply_template(template: str, doc: dict) -> str:
        if template not in compiled:
            compiled[template] = utils.env.from_string(template)
        return compiled[template].render(**doc)

    apply_template.compiled_once = True
    apply_template.original = utils.apply_template
    utils.apply_template = apply_template


_TASK_MANAGER = None


def task_manager():
    """lm-eval's task manager, built once per process, its index read from the cache
    (`task_index`: 0.4 s, against 6-8 s to parse about 14,000 YAML files)."""
    global _TASK_MANAGER
    if _TASK_MANAGER is None:
        _TASK_MANAGER = task_manager_from_saved_index()
    return _TASK_MANAGER


def check_task_name(task: str) -> None:
    """An unknown task name is one clear line, with the closest names lm-eval knows."""
    names = task_manager().all_tasks
    if task not in names:
        close = difflib.get_close_matches(task, names, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise DepthcurseError(f"unknown task {task!r}: not ppl, squad or repr, and not an lm-eval task{hint}")


# `datasets` builders that read local files (a task YAML with `dataset_path: json` and `data_files`).
LOCAL_BUILDERS = {"json", "csv", "parquet", "text", "arrow", "pandas"}


@contextlib.contextmanager
def offline_task_data(notes: list[str]):
    """Point lm-eval's hub data at the offline cache while tasks are built.

    lm-eval calls `datasets.load_dataset(hub_path, name)`; this redirects the path to the
    hub-style folder `depthcurse assets` made, and drops the splits the offline copy lacks
    (ARC offline has validation only) so lm-eval falls back to the split that exists. Each
    such change is appended to `notes` and saved with the results.
    """
    import datasets  # lazy: datasets and lm-eval's task code cost seconds; only lm-eval tasks need them
    from lm_eval.api.task import ConfigurableTask

    real_load, real_download = datasets.load_dataset, ConfigurableTask.download

    def load_dataset(path, name=None, **kwargs):
        if path in LOCAL_BUILDERS or Path(str(path)).exists():  # a task reading local files: nothing to redirect
            return real_load(path, name=name, **kwargs)
        local = assets.local_dataset(path)
        if local is None:
            raise DepthcurseError(f"data set {path} is on the hub, which is not reachable, and is not among the offline assets (see `depthcurse assets`)")
        files = assets.hub_folder_files(local, name) if not kwargs else None
        if files is not None:  # our own folder: its files straight to the parquet builder (the same rows, faster)
            return real_load("parquet", data_files=files)
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
        shots = getattr(self, "fewshot_cfg", None)
        if shots is not None and getattr(shots, "split", None) is not None and shots.split not in have:
            # few-shot examples from the evaluated split itself; lm-eval then leaves each question out of its own prompt
            fallback = self.config.test_split or self.config.validation_split
            notes.append(f"{self.config.task}: offline copy has no {shots.split!r} split for few-shot examples; they come from {fallback!r}")
            shots.split = fallback

    datasets.load_dataset, ConfigurableTask.download = load_dataset, download
    try:
        yield
    finally:
        datasets.load_dataset, ConfigurableTask.download = real_load, real_download


def metric_name(key: str) -> str:
    """lm-eval's "metric,filter" result key as one name: the metric alone for the unfiltered
    responses ("acc,none" -> "acc"), else with its filter ("exact_match,strict-match" ->
    "exact_match_strict-match"), so that every filter of a generative task keeps its own score."""
    metric, _, filt = key.partition(",")
    return metric if filt in ("", "none") else f"{metric}_{filt}"


class LmEvalTask:
    """An lm-eval task or group (mmlu, arc_easy, hellaswag, gsm8k, ...) evaluated on an in-memory model.

    Tasks are built once; each `evaluate` runs lm-eval's own request building, model calls
    (log-likelihoods, or greedy generation for `generate_until` tasks) and metrics, so the
    numbers are lm-eval's. Groups report lm-eval's aggregate (for MMLU the micro-average over
    questions) and keep every subtask's score in `details`. The headline metric is the task's
    first, on its first filter (GSM8K: exact_match on strict-match); every filter's are kept.
    """

    LOGLIKELIHOOD_TYPES = {"multiple_choice", "loglikelihood", "loglikelihood_rolling"}
    OUTPUT_TYPES = LOGLIKELIHOOD_TYPES | {"generate_until"}

    def __init__(self, task: str, tokenizer, *, num_fewshot: int | None = 0, limit: int | None = None, batch_size: int = 8, seed: int = 1234,
                 max_gen_toks: int | None = None, members: tuple[str, ...] | None = None, groups: dict[str, tuple[str, ...]] | None = None):
        quiet_lm_eval()
        self.name, self.tokenizer, self.limit, self.batch_size, self.seed = task, tokenizer, limit, batch_size, seed
        self.members = tuple(members) if members else None  # a suite: several tasks, their average the headline
        self.groups = dict(groups or {})  # named suites in a list, each also averaged on its own ("<suite> average")
        self.offline = not assets.hub_reachable()
        self.notes: list[str] = []
        names = list(self.members or (task,))
        for name in names:
            if name not in PROBES:  # depthcurse's own probes are built from their config, not found in lm-eval's index
                check_task_name(name)
        tm = task_manager()
        compile_templates_once()
        if self.offline:
            assets.go_offline()
        with offline_task_data(self.notes) if self.offline else contextlib.nullcontext():
            loaded = tm.load([task_config(n) if n in PROBES else n for n in names])
        self.loaded = loaded
        types = {n: t.get_config("output_type") for n, t in loaded["tasks"].items()}
        bad = sorted(n for n, kind in types.items() if kind not in self.OUTPUT_TYPES)
        if bad:
            raise DepthcurseError(f"task {task!r} has requests of a kind prune cannot score ({', '.join(f'{n}: {types[n]}' for n in bad[:3])})")
        self.generative = any(kind == "generate_until" for kind in types.values())
        if max_gen_toks is not None and not self.generative:
            raise DepthcurseError(f"--max-gen-toks applies to generative tasks (gsm8k, nq_open, ...); {task} scores log-likelihoods")
        if max_gen_toks is not None and max_gen_toks <= 0:
            raise DepthcurseError(f"--max-gen-toks must be a positive number, got {max_gen_toks}")
        self.max_gen_toks = max_gen_toks
        self.num_fewshot = num_fewshot
        for t in loaded["tasks"].values():
            if num_fewshot is not None:
                t.set_config(key="num_fewshot", value=num_fewshot)
            elif t.get_config("num_fewshot") is None:
                t.set_config(key="num_fewshot", value=0)
            t.set_fewshot_seed(seed=seed)
            if max_gen_toks is not None and t.get_config("output_type") == "generate_until":
                t.config.generation_kwargs = {**(t.config.generation_kwargs or {}), "max_gen_toks": max_gen_toks}
        self.headlines = {name: _headline(t) for name, t in loaded["tasks"].items()}
        first = next(iter(loaded["tasks"].values()))
        metric, first_filter = next(iter(self.headlines.values()))
        self.metric = metric_name(f"{metric},{first_filter}") if not self.members else SUITE_METRIC
        self.higher_is_better = bool(first.higher_is_better().get(metric, True))
        # A suite's member scored by its own headline (not whichever metric its row lists last)
        self.member_metrics = {name: metric_name(",".join(self.headlines[name])) for name in self.members or () if name in self.headlines}
        self._lm = None
        # Keep each question's headline score in `details["per_example"]` (lm-eval's logged samples):
        # what a paired interval between two models needs; off for sweeps, whose tables rank no pairs.
        self.per_example = False

    def describe(self) -> dict:
        shots = sorted({t.get_config("num_fewshot") for t in self.loaded["tasks"].values()})
        return {
            "task": self.name,
            **({"suite": list(self.members)} if self.members else {}),
            **({"suite_groups": {g: list(m) for g, m in self.groups.items()}} if self.groups else {}),
            "lm_eval_tasks": sorted(self.loaded["tasks"]),
            "num_fewshot": shots[0] if len(shots) == 1 else shots,
            "limit": self.limit,
            "fewshot_seed": self.seed,
            "offline_data": self.offline,
            **describe_probes(self.loaded["tasks"]),
            "notes": self.notes,
            **({"max_gen_toks": self.max_gen_toks} if self.max_gen_toks is not None else {}),
        }

    def _wrapper(self, model):
        # One wrapper serves the whole sweep: the model object is the same, only its block list changes.
        if self._lm is None or self._lm.model is not model:
            self._lm = quiet_hflm()(pretrained=model, tokenizer=self.tokenizer, batch_size=self.batch_size)
        return self._lm

    def run(self, model, *, log_samples: bool = False) -> dict:
        """lm-eval's raw results dict for `model` (with per-sample logs if asked)."""
        from lm_eval import evaluator  # lazy: as in offline_task_data

        # stderr bootstraps cost seconds per call and say nothing about a layer's effect
        results = evaluator.evaluate(self._wrapper(model), self.loaded, limit=self.limit, bootstrap_iters=0, log_samples=log_samples)
        if results is None:
            raise DepthcurseError("lm-eval returned no results")
        return results

    def evaluate(self, model) -> Score:
        return self.score(self.run(model, log_samples=self.per_example))

    def score(self, results: dict) -> Score:
        score = self._suite_score(results) if self.members else self._task_score(results)
        per_example = self._per_example(results) if self.per_example else None
        if per_example:
            score.details["per_example"] = per_example
        return score

    def _per_example(self, results: dict) -> dict[str, list[float]] | None:
        """Each question's headline score, in document order: per member of a suite, or the task's
        questions under its name (a group's subtasks pooled, as its micro-average pools them).
        None where lm-eval logged no samples or a sample's score is not one number per question."""
        samples = results.get("samples") or {}
        leaves = self.headlines
        if not samples or not set(leaves) <= set(samples):
            return None

        def scores(name):
            metric, kept = leaves[name]
            rows = sorted((s for s in samples[name] if s.get("filter", "none") == kept), key=lambda s: s["doc_id"])
            values = [s.get(metric) for s in rows]
            return [float(v) for v in values] if all(isinstance(v, (int, float)) for v in values) else None

        if self.members:
            if not set(self.members) <= set(leaves):
                return None  # a member that is a group: its own average is not one per question
            out = {m: scores(m) for m in self.members}
        else:
            pooled = [scores(name) for name in sorted(leaves)]
            out = {self.name: [v for part in pooled for v in part]} if None not in pooled else {self.name: None}
        return out if None not in out.values() else None

    def _task_score(self, results: dict) -> Score:
        table = results["results"]
        top = table[self.name]
        metrics = {metric_name(key): float(value) for key, value in top.items() if "," in key and "_stderr" not in key and isinstance(value, (int, float))}
        n_samples = results.get("n-samples", {})
        examples = sum(int(v.get("effective", 0)) for k, v in n_samples.items() if k in self.loaded["tasks"])
        details = {}
        if len(table) > 1:
            details = {
                name: {metric_name(key): float(v) for key, v in row.items() if "," in key and "_stderr" not in key and isinstance(v, (int, float))}
                for name, row in table.items()
                if name != self.name
            }
        return Score(metrics, examples, details)


    def _suite_score(self, results: dict) -> Score:
        """Each member's headline metric (its first, as lm-eval lists it: acc for the commonsense
        tasks), and their unweighted average, as the pruning papers report a zero-shot suite."""
        table = results["results"]
        metrics, details = {}, {}
        for name in self.members:
            row = {metric_name(key): float(v) for key, v in table[name].items() if "," in key and "_stderr" not in key and isinstance(v, (int, float))}
            details[name] = row
            metrics[name] = row[self.member_metrics[name]] if name in self.member_metrics else next(iter(row.values()))  # a group: its first
        metrics[SUITE_METRIC] = sum(metrics[n] for n in self.members) / len(self.members)
        for group, members in self.groups.items():
            metrics[f"{group} {SUITE_METRIC}"] = sum(metrics[n] for n in members) / len(members)
        n_samples = results.get("n-samples", {})
        examples = sum(int(v.get("effective", 0)) for k, v in n_samples.items() if k in self.loaded["tasks"])
        return Score(metrics, examples, details)


SUITE_METRIC = "average"  # a suite's headline: the mean of its tasks' headline metrics


def _headline(task) -> tuple[str, str]:
    """An lm-eval task's headline: its first metric, on its first filter (what each question scores too)."""
    filters = [f.get("name", "none") for f in (task.get_config("filter_list") or [])] or ["none"]
    return next(iter(task._metric_fn_list)), filters[0]


def quiet_hflm():
    """lm-eval's HFLM without its per-call tqdm bars (evaluate() gives no way to turn them off)."""
    from lm_eval.models.huggingface import HFLM  # lazy: as in offline_task_data

    class QuietHFLM(HFLM):
        def loglikelihood(self, requests, disable_tqdm: bool = False):
            return super().loglikelihood(requests, disable_tqdm=True)

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            return super().loglikelihood_rolling(requests, disable_tqdm=True)

        def generate_until(self, requests, disable_tqdm: bool = False):
            return super().generate_until(requests, disable_tqdm=True)

    return QuietHFLM
