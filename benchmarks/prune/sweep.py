"""Wall time of one prune sweep three ways, same model, data and layers, as docs/benchmarks.md reports:

    (a) saved copy per layer: save the pruned checkpoint, then lm-eval's `simple_evaluate` on it
        (model loaded from disk, task built and tokenised again; lm-eval's task index is reused,
        which is kinder to (a) than one `lm_eval` process per layer). ppl has no lm-eval task
        offline, so there (a) is save + load + our in-memory ppl.
    (b) `--engine lm-eval`: one in-memory model, each variant evaluated on its own.
    (c) `--engine reuse`: all variants together (depthcurse.prune.engine).

    DEPTHCURSE_CACHE=/tmp/dc_engine python benchmarks/prune/sweep.py            # all three jobs
    DEPTHCURSE_CACHE=/tmp/dc_engine python benchmarks/prune/sweep.py mmlu-5shot # one

Also printed: the analytic floor, i.e. the token-block passes each way needs (every distinct
input through every kept block for (b); what the engine ran, padding and shared prefixes
included, for (c)), and the largest difference of the headline metric between (a), (b) and (c).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

from depthcurse.loading import load_model  # noqa: E402
from depthcurse.surgery import num_layers, save_pruned  # noqa: E402
from depthcurse.prune import run_sweep  # noqa: E402
from depthcurse.tasks import build_task  # noqa: E402
from depthcurse.tasks.harness import offline_task_data, quiet_lm_eval, task_manager  # noqa: E402

MODEL = "smollm2-135m"
# Sized so that all three ways of all three jobs finish in about 30 minutes on a busy 2-core CPU:
# every third layer, one MMLU subject, few questions. The same for (a), (b) and (c).
JOBS = {
    "mmlu-0shot": dict(task="mmlu_anatomy", num_fewshot=0, limit=12),
    "mmlu-5shot": dict(task="mmlu_anatomy", num_fewshot=5, limit=6),
    "ppl": dict(task="ppl", data="wiki", limit=1, seq_len=512),
}
LAYERS = range(0, 30, 3)
BATCH = 8


def saved_copy_sweep(loaded, spec: dict, variants, task) -> tuple[float, dict]:
    """(a): one checkpoint per variant on disk, each evaluated from scratch."""
    import lm_eval

    started = time.perf_counter()
    metrics = {}
    for removed in variants:
        folder = Path(tempfile.mkdtemp(prefix="bench-copy-"))
        try:
            save_pruned(loaded.model, loaded.tokenizer, removed, folder)
            if spec["task"] == "ppl":
                copy = load_model(str(folder), dtype="fp32", device="cpu")
                metrics[removed] = task.evaluate(copy.model).metrics[task.metric]
                del copy
            else:
                with offline_task_data([]):
                    out = lm_eval.simple_evaluate(
                        model="hf", model_args={"pretrained": str(folder), "dtype": "float32", "device": "cpu"}, tasks=[spec["task"]],
                        num_fewshot=spec["num_fewshot"], limit=spec["limit"], batch_size=BATCH, bootstrap_iters=0, fewshot_random_seed=1234, task_manager=task_manager(),
                    )
                metrics[removed] = out["results"][spec["task"]][f"{task.metric},none"]
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    return time.perf_counter() - started, metrics


def run_job(name: str, loaded, work: Path) -> dict:
    spec = JOBS[name]
    n = num_layers(loaded.model)
    variants = [()] + [(i,) for i in LAYERS if i < n]
    task = build_task(spec["task"], loaded.tokenizer, batch_size=BATCH, **{k: v for k, v in spec.items() if k != "task"})
    result = {"job": name, "spec": spec, "variants": len(variants)}

    a_seconds, a_metrics = saved_copy_sweep(loaded, spec, variants, task)
    result["a_saved_copy_s"] = round(a_seconds, 1)

    t0 = time.perf_counter()
    b = run_sweep(loaded, task, variants[1:], work / f"{name}-b", engine="lm-eval")
    result["b_lm_eval_s"] = round(time.perf_counter() - t0, 1)

    t0 = time.perf_counter()
    c = run_sweep(loaded, task, variants[1:], work / f"{name}-c", engine="reuse")
    result["c_reuse_s"] = round(time.perf_counter() - t0, 1)

    info = c.meta["engine"]
    result.update(
        engine_block_passes=info["block_passes"], plain_block_passes=info["plain_block_passes"],
        floor_ratio=round(info["block_passes"] / info["plain_block_passes"], 3),
        prefix_groups=info["prefix_groups"], rows=info["rows"], requests=info["requests"],
        c_over_b=round(result["c_reuse_s"] / result["b_lm_eval_s"], 3), a_over_c=round(result["a_saved_copy_s"] / result["c_reuse_s"], 2),
    )
    bm = {tuple(v.removed): v.metrics[task.metric] for v in b.variants}
    cm = {tuple(v.removed): v.metrics[task.metric] for v in c.variants}
    result["metric"] = task.metric
    result["max_diff_b_c"] = max(abs(bm[v] - cm[v]) for v in bm)
    result["max_diff_a_b"] = max(abs(a_metrics[v] - bm[v]) for v in bm)
    result["baseline"] = bm[()]
    return result


def main(names: list[str]) -> None:
    # One thread: the machine is shared, and spinning thread pools make timings erratic there.
    torch.set_num_threads(1)
    quiet_lm_eval()
    task_manager()  # lm-eval's task index is built once, outside every timing
    loaded = load_model(MODEL, dtype="fp32", device="cpu")
    print(f"{loaded.name}: {num_layers(loaded.model)} layers, fp32, cpu; torch {torch.__version__}, {torch.get_num_threads()} threads; {platform.processor() or platform.machine()}, {os.cpu_count()} cores", flush=True)
    work = Path(tempfile.mkdtemp(prefix="bench-sweep-"))
    try:
        for name in names:
            started = time.perf_counter()
            r = run_job(name, loaded, work)
            print(json.dumps(r), flush=True)
            print(
                f"{name}: (a) {r['a_saved_copy_s']:.0f} s, (b) {r['b_lm_eval_s']:.0f} s, (c) {r['c_reuse_s']:.0f} s; (c)/(b) {r['c_over_b']:.2f} "
                f"(floor {r['floor_ratio']:.2f}), (a)/(c) {r['a_over_c']:.1f}x; max |diff| of {r['metric']}: b-c {r['max_diff_b_c']:.2g}, a-b {r['max_diff_a_b']:.2g} "
                f"[{time.perf_counter() - started:.0f} s]",
                flush=True,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:] or list(JOBS))
