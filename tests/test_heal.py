"""`depthcurse heal`: LoRA healing of a pruned model, on tiny models built here.

The references are independent of the code under test: the model's own forward (the teacher),
a model built without the layers (`built_without`) with the adapters' updates added to its
weights by hand (the merged checkpoint), one process (two gloo ranks), an uninterrupted run (a
resumed one), a single heal (a curve's point).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace

import pytest
import torch

from helpers import CORPUS, assert_one_line_error, built_without, heal_config, held_out_windows, lora_objective, tiny_llama, torchrun

from depthcurse.heal import HealConfig, heal, heal_curve, kept_summary, order_sets
from depthcurse.heal.adapters import add_adapters, target_modules
from depthcurse.heal.objective import distill_kl
from depthcurse.loading import load_model
from depthcurse.train.metrics import METRICS, MetricsLog

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _cfg(docs_file, **kw) -> HealConfig:
    options = dict(layers=(1, 3), data=str(docs_file), steps=6, batch_size=4, seq_len=24, lr=5e-3, eval_windows=4, save_every=2, lora_rank=4)
    return heal_config(**{**options, **kw})


def _adapters(folder):
    state = torch.load(folder / "checkpoint.pt", map_location="cpu", weights_only=True)["trained"]
    return {k: v for k, v in state.items() if "lora_" in k}


def test_the_teacher_is_the_unpruned_model_exactly_and_the_student_starts_as_the_pruned_one():
    model = tiny_llama(300, layers=5)
    ids = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        own = model(input_ids=ids).logits
        pruned = built_without(model, "model.layers", [1, 3])(input_ids=ids).logits
    # the adapters sit on the kept blocks only, each on all of its linears
    names = target_modules(model, (1, 3), "all")
    assert {int(re.search(r"layers\.(\d+)\.", n).group(1)) for n in names} == {0, 2, 4} and len(names) == 3 * 7
    objective, _, _ = lora_objective(model, (1, 3), "distill", targets="all")
    with torch.no_grad():
        torch.testing.assert_close(objective.student_logits(ids), pruned, rtol=0, atol=0)  # B = 0: the pruned model
        for name, p in objective.named_parameters():
            if "lora_B" in name:
                p.normal_()  # trained adapters: the teacher must not see them
        torch.testing.assert_close(objective.teacher_logits(ids)[0], own, rtol=0, atol=0)
        assert not torch.allclose(objective.student_logits(ids), pruned, atol=1e-3)  # the adapters act on the student


def test_the_distillation_loss_and_its_gradient_are_kl_div_over_the_scored_positions():
    """Chunked, with its gradient made in the forward: against F.kl_div over log-softmaxes, on
    more rows than one chunk holds and with positions that have no target."""
    torch.manual_seed(0)
    student = torch.randn(3, 37, 50, dtype=torch.float64).mul(3).requires_grad_()
    teacher = torch.randn(3, 37, 50, dtype=torch.float64).mul(3)
    scored = torch.rand(3, 37) > 0.2
    scored[1] = False  # a whole row without targets
    ours = distill_kl(student, teacher, scored)
    (grad,) = torch.autograd.grad(2 * ours, student)
    rows = student[scored]
    reference = torch.nn.functional.kl_div(rows.float().log_softmax(-1), teacher[scored].float().log_softmax(-1), log_target=True, reduction="sum")
    (expected,) = torch.autograd.grad(2 * reference, student)
    assert ours.dtype == torch.float32 and grad.dtype == torch.float64
    torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6)
    assert grad[1].abs().max() == 0


def test_a_heal_run_measures_three_models_and_saves_the_merged_checkpoint(bos_model_dir, docs_file, tmp_path):
    """The adapters' loss falls; the held-out windows start with BOS and come from documents never
    trained on; hf/ reloads with n - k layers and gives the adapted model's logits."""
    from transformers import AutoModelForCausalLM

    loaded = load_model(str(bos_model_dir))
    out = tmp_path / "run"
    cfg = _cfg(docs_file, steps=12, save_every=4)
    ids = torch.randint(3, 300, (2, 19), generator=torch.Generator().manual_seed(2))
    captured = {}
    from depthcurse.heal.healed import Healed

    original_save = Healed.save

    def capture(self, tokenizer, folder, **options):
        self.model.eval()
        with torch.no_grad(), self.as_model("healed") as model:
            captured["adapted"] = model(input_ids=ids).logits
        return original_save(self, tokenizer, folder, **options)

    Healed.save = capture
    try:
        record = heal(loaded, cfg, out)
    finally:
        Healed.save = original_save
    rows = MetricsLog(out / METRICS).rows()
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 12 and sum(losses[-3:]) < sum(losses[:3])
    results = record["results"]
    held = [results[m]["held_out"]["metrics"]["loss"] for m in ("unpruned", "pruned", "healed")]
    assert held[2] < held[1]  # healing lowered the pruned model's held-out loss (a random model loses little by the removal)
    # this random model loses nothing by the removal: no gap to win back, and no share made of one (the "118%")
    assert held[1] < held[0] and record["recovered"]["held_out_loss"] is None
    assert record["recovered_why"]["held_out_loss"] == "no gap to win back: the removal did not hurt"
    assert record["held_out"]["bos"] == "<bos>" and record["held_out"]["windows"] == 4
    assert record["training"]["trained_params"] == 3 * 3 * 4 * (32 + 64) and record["training"]["steps"] == 12  # rank 4 on the 3 kept MLPs' 3 linears
    healed = AutoModelForCausalLM.from_pretrained(out / "hf").eval()
    assert healed.config.num_hidden_layers == 3
    with torch.no_grad():
        torch.testing.assert_close(healed(input_ids=ids).logits, captured["adapted"], rtol=0, atol=1e-5)
    assert (out / "loss.png").is_file() and json.loads((out / "config.json").read_text())["layers"] == [1, 3]


@pytest.mark.statistics
def test_a_share_won_back_needs_a_gap_outside_the_noise():
    """(pruned - healed) / (pruned - unpruned) where the removal hurt by more than the half-width
    of the 95% interval of the paired per-window difference (t at n - 1 df); none (and why) where it
    did not hurt, or by less; none on perplexity, whose scale inflates a share of the loss gap."""
    from depthcurse.heal.shares import recovered

    def record(unpruned, pruned, healed):
        part = lambda losses: {"held_out": {"metric": "loss", "metrics": {"loss": sum(losses) / len(losses), "ppl": 1.0}, "per_window": losses}}
        return {"results": {"unpruned": part(unpruned), "pruned": part(pruned), "healed": part(healed)}}

    shares, why, _ = recovered(record([3.0, 3.2, 2.8, 3.0], [4.0, 4.3, 3.9, 4.0], [3.5, 3.7, 3.4, 3.6]))
    assert shares["held_out_loss"] == pytest.approx((4.05 - 3.55) / (4.05 - 3.0)) and not why and "held_out_ppl" not in shares
    shares, why, _ = recovered(record([3.0, 3.2, 2.8, 3.0], [2.9, 3.1, 2.8, 2.9], [2.8, 3.0, 2.7, 2.8]))  # the removal lowered the loss
    assert shares["held_out_loss"] is None and why["held_out_loss"] == "no gap to win back: the removal did not hurt"
    shares, why, _ = recovered(record([3.0, 3.4, 2.6, 3.0], [3.1, 3.2, 2.8, 3.0], [3.0, 3.2, 2.7, 3.0]))  # +0.025, paired spread 0.15
    assert shares["held_out_loss"] is None and "within the noise" in why["held_out_loss"]
    # differences 0.1, 0.3, 0.2, 0.2: mean 0.2, sd 0.08165, se 0.040825; 1.96 se = 0.080 < 0.2 < ... and
    # t(3) se = 3.1824 x 0.040825 = 0.1299 < 0.2: a gap. Differences 0.0, 0.4, 0.1, 0.3: mean 0.2, sd 0.18257,
    # se 0.091287, t(3) se = 0.2905 > 0.2 > 1.96 se = 0.1789: within the noise at 4 windows (a z interval said otherwise)
    shares, why, _ = recovered(record([3.0, 3.0, 3.0, 3.0], [3.1, 3.3, 3.2, 3.2], [3.0, 3.1, 3.1, 3.1]))
    assert shares["held_out_loss"] == pytest.approx((3.2 - 3.075) / 0.2) and not why
    shares, why, _ = recovered(record([3.0, 3.0, 3.0, 3.0], [3.0, 3.4, 3.1, 3.3], [3.0, 3.1, 3.1, 3.1]))
    assert shares["held_out_loss"] is None and "+-0.2905" in why["held_out_loss"]


@pytest.mark.statistics
def test_a_share_won_back_has_the_delta_methods_interval_over_the_paired_windows():
    """W = (p - h) / (p - u) from per-window losses: se(W) = sd(z) / sqrt(n) / |p - u|, z the windows'
    (1 - W) p - h + W u (the delta method), computed here with `statistics`, and Student's t at
    3 degrees of freedom (3.182446, from a printed table). The standard error is over windows: with
    the plain sd (no sqrt(n)) the interval would be twice as wide at n = 4; with 1.96, 38% too narrow."""
    import statistics

    from depthcurse.heal.shares import recovered

    u, p, h = [3.0, 3.2, 2.8, 3.0], [4.0, 4.3, 3.9, 4.1], [3.5, 3.9, 3.4, 3.6]
    part = lambda losses: {"held_out": {"metric": "loss", "metrics": {"loss": sum(losses) / 4, "ppl": 1.0}, "per_window": losses}}
    shares, _, intervals = recovered({"results": {"unpruned": part(u), "pruned": part(p), "healed": part(h)}})
    mu, mp, mh = (sum(x) / 4 for x in (u, p, h))
    w = (mp - mh) / (mp - mu)
    se = statistics.stdev([(1 - w) * pi - hi + w * ui for ui, pi, hi in zip(u, p, h)]) / math.sqrt(4) / (mp - mu)
    assert shares["held_out_loss"] == pytest.approx(w)
    assert intervals["held_out_loss"] == pytest.approx([w - 3.182446 * se, w + 3.182446 * se], rel=1e-6)


@pytest.mark.statistics
def test_retained_has_the_ratios_interval_over_the_paired_questions_of_every_task():
    """retained = average / unpruned average over a suite of two tasks; its interval from each task's
    questions paired between the models (each task weighing 1/2 in the average), by hand, with
    Student's t at Welch and Satterthwaite's degrees of freedom over the two tasks."""
    import statistics

    from depthcurse.heal.shares import retained
    from depthcurse.stats import t_quantile

    def result(a, b):
        return {"task": {"metric": "average", "metrics": {"a": sum(a) / len(a), "b": sum(b) / len(b), "average": (sum(a) / len(a) + sum(b) / len(b)) / 2},
                         "per_example": {"a": a, "b": b}}}

    u = result([1, 1, 0, 1, 1, 0], [1, 0, 1, 1])
    m = result([1, 0, 0, 1, 0, 0], [1, 0, 0, 1])
    out = retained(m, u)["task"]
    r = m["task"]["metrics"]["average"] / u["task"]["metrics"]["average"]
    parts, dfs = [], []
    for key in ("a", "b"):
        z = [mi - r * ui for mi, ui in zip(m["task"]["per_example"][key], u["task"]["per_example"][key])]
        parts.append(statistics.variance(z) / len(z) / 4)
        dfs.append(len(z) - 1)
    se = math.sqrt(sum(parts)) / u["task"]["metrics"]["average"]
    df = sum(parts) ** 2 / sum(v * v / d for v, d in zip(parts, dfs))
    assert 3 < df < 8  # between the smaller task's n - 1 and the sum of both
    t = t_quantile(df)
    assert out["metrics"]["retained"] == pytest.approx(r)
    assert out["intervals"]["retained"] == pytest.approx([r - t * se, r + t * se], rel=1e-9)


@pytest.mark.statistics
def test_every_models_retained_is_against_the_unpruned_models_average():
    """What `heal` calls once its three models are measured: the pruned and the healed model's
    suite averages each as a share of the unpruned model's (0.375 / 0.75 and 0.625 / 0.75), not of each
    other's (0.625 / 0.375 would read 167%), the unpruned model's own 1."""
    from depthcurse.heal.shares import with_retained

    def result(a, b):
        return {"task": {"metric": "average", "metrics": {"a": sum(a) / 4, "b": sum(b) / 4, "average": (sum(a) + sum(b)) / 8},
                         "per_example": {"a": a, "b": b}}}

    results = with_retained({"unpruned": result([1, 1, 1, 0], [1, 1, 1, 0]), "pruned": result([1, 0, 1, 0], [0, 1, 0, 0]),
                             "healed": result([1, 1, 0, 0], [1, 1, 0, 1])})
    assert [results[m]["task"]["metrics"]["retained"] for m in ("unpruned", "pruned", "healed")] == pytest.approx([1.0, 0.5, 0.625 / 0.75])
    low, high = results["healed"]["task"]["intervals"]["retained"]
    assert low < 0.625 / 0.75 < high and "intervals" not in results["unpruned"]["task"]


def test_held_out_windows_are_prunes_ppl_windows_on_documents_never_trained_on(bos_model_dir, docs_file, tmp_path):
    from depthcurse.tasks import PerplexityTask
    from depthcurse.text import load_texts
    from depthcurse.train.data import _split_docs, build_data

    loaded = load_model(str(bos_model_dir))
    texts, _ = load_texts(str(docs_file))
    train_texts, val_texts = _split_docs(texts)
    data = build_data(str(docs_file), loaded.tokenizer, seq_len=24, pack=True, seed=0, val_tokens=4 * 23, start=[loaded.tokenizer.bos_token_id])
    ppl = PerplexityTask(loaded.tokenizer, val_texts, source="v", seq_len=24, limit=4)
    assert torch.equal(data.val_rows[:4], ppl.windows)
    trained = set(re.findall(r"marker\d+x", "".join(loaded.tokenizer.decode(r) for r in data.train.rows.tolist())))
    assert trained and not trained & set(re.findall(r"marker\d+x", " ".join(val_texts)))
    assert set(data.train.rows[:, 0].tolist()) == {loaded.tokenizer.bos_token_id}  # every training row starts as the model expects


def test_an_interrupted_heal_resumed_equals_an_uninterrupted_one(bos_model_dir, docs_file, tmp_path):
    for loss in ("lm", "distill"):
        cfg = _cfg(docs_file, loss=loss, lora_dropout=0.1)
        whole = heal(load_model(str(bos_model_dir)), cfg, tmp_path / f"whole-{loss}")
        assert heal(load_model(str(bos_model_dir)), cfg, tmp_path / f"cut-{loss}", stop_after=3) is None  # as a preemption after step 3 (its checkpoint written then)
        cut = tmp_path / f"cut-{loss}"
        assert kept_summary(cut) == f"a checkpoint at step 3 of 6 kept in {cut}"  # what the interruption line says (issue 90)
        said = []
        resumed = heal(load_model(str(bos_model_dir)), cfg, cut, on_note=said.append)
        assert f"the training steps: took up the 3 of 6 finished before (kept in {cut}), not run again" in said  # and what the rerun took up
        assert kept_summary(cut) == f"finished kept in {cut}"
        a, b = _adapters(tmp_path / f"whole-{loss}"), _adapters(tmp_path / f"cut-{loss}")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        rows = [[{k: v for k, v in r.items() if k != "tokens_per_s"} for r in MetricsLog(tmp_path / f"{d}-{loss}" / METRICS).rows()] for d in ("whole", "cut")]
        assert len(rows[0]) == 6 and rows[0] == rows[1]  # every step logged once, with the same numbers
        assert whole["results"]["healed"] == resumed["results"]["healed"]


def test_a_healed_curves_kth_point_is_a_single_heal_of_those_layers(bos_model_dir, docs_file, tmp_path):
    from depthcurse.prune import run_sweep
    from depthcurse.tasks import PerplexityTask

    loaded = load_model(str(bos_model_dir))
    task = PerplexityTask(loaded.tokenizer, CORPUS * 4, source="corpus", seq_len=24, limit=3)
    run_sweep(loaded, task, range(5), tmp_path / "sweep")  # its one-shot order
    sets, source = order_sets(tmp_path / "sweep", [1, 2], 5)
    assert source.startswith("one-shot order of") and len(sets[2]) == 2 and set(sets[1]) <= set(sets[2])
    cfg = _cfg(docs_file, steps=3)
    curve = heal_curve(loaded, lambda: load_model(str(bos_model_dir)), cfg, sets, source, tmp_path / "curve")
    single = heal(load_model(str(bos_model_dir)), replace(cfg, layers=sets[2]), tmp_path / "single")
    from depthcurse.report import write_report

    page = write_report([tmp_path / "curve", tmp_path / "single"], tmp_path / "page.md").read_text()
    assert "## Healing" in page and "healed depth curve" in page and "| recovered |" in page
    point = curve["points"][1]
    assert point["k"] == 2 and point["layers"] == list(sets[2])
    assert point["results"] == single["results"] and point["recovered"] == single["recovered"]
    a, b = _adapters(tmp_path / "curve" / "k002"), _adapters(tmp_path / "single")
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(Exception, match="--ks 9 goes beyond the order"):
        order_sets(tmp_path / "sweep", [2, 9], 5)


def test_two_gloo_ranks_heal_as_one_process(bos_model_dir, docs_file, tmp_path):
    """Each rank trains on its half of every batch. Without dropout (whose masks each rank draws
    for its own half) the adapters and losses are one process's."""
    two = torchrun("-m", "depthcurse", "heal", bos_model_dir, "--layers", "1,3", "--calibration", docs_file, "--steps", "4", "--batch-size", "4", "--seq-len", "24",
                   "--lr", "5e-3", "--eval-windows", "2", "--lora-rank", "4", "--lora-dropout", "0", "--device", "cpu", "--out", tmp_path / "two", nproc=2)
    assert two.returncode == 0, two.stderr[-3000:]
    heal(load_model(str(bos_model_dir)), _cfg(docs_file, steps=4, eval_windows=2, lora_dropout=0.0), tmp_path / "one")
    a, b = _adapters(tmp_path / "one"), _adapters(tmp_path / "two")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)
    losses = [[r["loss"] for r in MetricsLog(tmp_path / d / METRICS).rows() if "loss" in r] for d in ("one", "two")]
    assert losses[0] == pytest.approx(losses[1], abs=1e-6)


def test_heal_on_the_command_line_and_its_bad_input(run_cli, bos_model_dir, docs_file, tmp_path):
    base = ["heal", bos_model_dir, "--calibration", docs_file, "--steps", "2", "--batch-size", "2", "--seq-len", "24", "--eval-windows", "2", "--lora-rank", "2"]
    out = tmp_path / "cli"
    code, stdout, err = run_cli(*base, "--layers", "2", "--out", out)
    assert code == 0, err
    text = " ".join(stdout.split())
    assert "unpruned" in text and "pruned" in text and "healed" in text and "recovered" in text and (out / "hf" / "config.json").is_file()
    assert_one_line_error(*run_cli(*base, "--layers", "0-4"), "removes all 5 layers")
    assert_one_line_error(*run_cli(*base, "--layers", "1", "--targets", "heads"), "unknown --targets 'heads'")
    assert_one_line_error(*run_cli(*base, "--layers", "1", "--lora-rank", "0"), "--lora-rank must be at least 1")
    assert_one_line_error(*run_cli(*base, "--layers", "1", "--lora-alpha", "0"), "--lora-alpha must be positive")
    assert_one_line_error(*run_cli(*base, "--layers", "1", "--steps", "0"), "--steps must be at least 1")
    assert_one_line_error(*run_cli(*base, "--layers", "1", "--granularity", "attn"), "heal does not take --granularity attn")
    assert_one_line_error(*run_cli(*base, "--layers", "1", "--loss", "kl"), "unknown --loss 'kl'")
    assert_one_line_error(*run_cli(*base, "--layers", "1", "--out", out), "holds a different heal run")
    assert_one_line_error(*run_cli(*base), "give --layers L")
    assert_one_line_error(*run_cli(*base, "--order", out, "--ks", "1"), "holds no order to heal along")
    assert_one_line_error(*run_cli(*base, "--layers", "1", "--task", "squad"), "measures an encoder")
    assert_one_line_error(*run_cli(*base, "--layers", "3,3"), "--layers '3,3' names layer 3 more than once: name each layer once")
    short = tmp_path / "short.txt"
    short.write_text("a few words\n\nand a few more")
    code, stdout, err = run_cli(*base[:3], short, *base[4:], "--layers", "1")
    assert_one_line_error(code, stdout, err, "gives no training rows of 24 tokens: use more text or a shorter --seq-len")
    assert "--pack" not in err  # heal always packs: it has no such option
    from transformers import BertConfig, BertModel

    BertModel(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)).save_pretrained(tmp_path / "bert")
    code, stdout, err = run_cli("heal", tmp_path / "bert", "--layers", "1", "--out", tmp_path / "bert-heal")
    assert_one_line_error(code, stdout, err, "bert is an encoder without a language-model head: heal trains a decoder's next-token predictions")
    assert "squad" not in err  # which heal refuses


def test_the_default_data_is_c4_with_the_hub_and_the_offline_wikipedia_without(bos_model_dir):
    from depthcurse.heal.loop import check

    assert check(load_model(str(bos_model_dir)), HealConfig(layers=(1,))).data == "wiki"  # the tests run offline


def test_heals_numbers_are_plain_transformers_on_the_held_out_documents(bos_model_dir, docs_file, tmp_path, monkeypatch):
    """Every number heal.json holds for the held-out windows, computed here by plain transformers
    on windows made here: the unpruned model as saved, the pruned one built without the layers,
    the healed one reloaded from hf/; the KL to the unpruned model's predictions and the share of
    top-1 tokens they agree on, by F.kl_div. The adapters train with dropout 0.5 (so any left on
    while measuring shows), with a warm-up the learning rates logged must follow, on rows that
    all begin with BOS."""
    import math

    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from depthcurse.heal.objective import HealObjective

    seen = []
    original = HealObjective.forward

    def recording(self, ids, targets):
        seen.append(ids.clone())
        return original(self, ids, targets)

    monkeypatch.setattr(HealObjective, "forward", recording)
    loaded = load_model(str(bos_model_dir))
    cfg = _cfg(docs_file, loss="distill", steps=8, warmup=3, lr=1e-2, lora_dropout=0.5)
    record = heal(loaded, cfg, tmp_path / "run")
    bos = loaded.tokenizer.bos_token_id
    assert record["held_out"]["bos"] == "<bos>" and len(seen) == 8 and all((ids[:, 0] == bos).all() for ids in seen)

    lrs = [r["lr"] for r in MetricsLog(tmp_path / "run" / METRICS).rows()]
    expected_lrs = [1e-2 * ((s + 1) / 3 if s < 3 else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - 3) / 5))) for s in range(8)]
    assert lrs == pytest.approx(expected_lrs, rel=1e-6)

    windows = held_out_windows(loaded.tokenizer, docs_file, 24, 4)
    unpruned = AutoModelForCausalLM.from_pretrained(bos_model_dir).eval()
    models = {"unpruned": unpruned, "pruned": built_without(unpruned, "model.layers", [1, 3]),
              "healed": AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf").eval()}
    with torch.no_grad():
        logp = {name: m(windows).logits[:, :-1].log_softmax(-1).flatten(0, 1) for name, m in models.items()}
    targets = windows[:, 1:].flatten()
    for name in models:
        got = record["results"][name]["held_out"]["metrics"]
        assert got["loss"] == pytest.approx(F.nll_loss(logp[name], targets).item(), rel=1e-5), name
        kl = F.kl_div(logp[name], logp["unpruned"], log_target=True, reduction="sum").item() / len(targets)
        agreement = (logp[name].argmax(-1) == logp["unpruned"].argmax(-1)).float().mean().item()
        assert got["kl"] == pytest.approx(kl, rel=1e-4, abs=1e-7) and got["agreement"] == pytest.approx(agreement), name
    assert record["results"]["pruned"]["held_out"]["metrics"]["kl"] > 0
    pruned_kl, healed_kl = (record["results"][m]["held_out"]["metrics"]["kl"] for m in ("pruned", "healed"))
    assert record["recovered"]["held_out_kl"] == pytest.approx((pruned_kl - healed_kl) / pruned_kl)


def test_a_healed_curve_along_a_greedy_result_removes_k_layers_at_k(bos_model_dir, docs_file, tmp_path):
    from transformers import AutoConfig

    from depthcurse.prune import run_greedy
    from depthcurse.tasks import PerplexityTask

    loaded = load_model(str(bos_model_dir))
    task = PerplexityTask(loaded.tokenizer, CORPUS * 4, source="corpus", seq_len=24, limit=3)
    greedy = run_greedy(loaded, task, tmp_path / "greedy", steps=2, compare=False)
    sets, source = order_sets(tmp_path / "greedy", [1, 2], 5)
    assert source.startswith("greedy order of")
    assert sets == {k: tuple(greedy.curves["greedy"][k].removed) for k in (1, 2)} and [len(sets[k]) for k in (1, 2)] == [1, 2]
    curve = heal_curve(loaded, lambda: load_model(str(bos_model_dir)), _cfg(docs_file, steps=1), sets, source, tmp_path / "curve")
    assert [p["layers"] for p in curve["points"]] == [list(sets[1]), list(sets[2])]
    assert [AutoConfig.from_pretrained(tmp_path / "curve" / f"k00{k}" / "hf").num_hidden_layers for k in (1, 2)] == [4, 3]


def test_a_bf16_model_with_tied_embeddings_heals_to_bf16_and_checkpoints_only_what_trains(bos_tokenizer, docs_file, tmp_path):
    """Trained in fp32 on the CPU, saved in the source's bf16 (as `drop` saves it); the resumable
    checkpoint holds the adapters and their moments, not the frozen output head a tied embedding
    gives a second name (4,096 x 32 fp32 here: 512 KiB, more than all the rest)."""
    from safetensors import safe_open
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=True, eos_token_id=1, pad_token_id=2)
    source = tmp_path / "tied-bf16"
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(source)
    bos_tokenizer.save_pretrained(source)
    loaded = load_model(str(source))
    assert loaded.dtype == torch.float32 and loaded.checkpoint_dtype == torch.bfloat16  # computed in fp32 on a CPU
    out = tmp_path / "run"
    record = heal(loaded, _cfg(docs_file, layers=(1,), steps=2), out)

    with safe_open(out / "hf" / "model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    source_bytes, healed_bytes = ((d / "model.safetensors").stat().st_size for d in (source, out / "hf"))
    assert record["hf_dtype"] == "bfloat16" and record["hf_bytes"] == healed_bytes
    assert healed_bytes < source_bytes  # 3 of 4 layers, in the same dtype (fp32 would be about twice the source)

    state = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=True)
    adapters = record["training"]["trained_params"]
    assert all("lora_" in k for k in state["trained"]) and sum(t.numel() for t in state["trained"].values()) == adapters
    moments = [t for s in state["optimizer"]["state"].values() for name, t in s.items() if name != "step"]
    assert sum(t.numel() for t in moments) == 2 * adapters
    assert (out / "checkpoint.pt").stat().st_size < 3 * 4 * adapters + 48 * 1024  # the frozen head alone is 512 KiB


def test_adding_adapters_says_nothing_on_stderr(recwarn):
    add_adapters(tiny_llama(300, layers=3), (1,), targets="mlp", rank=2, alpha=4, dropout=0.0)
    assert not [str(w.message) for w in recwarn.list if "checkpointing" in str(w.message)]


def test_a_comparison_says_which_methods_it_cannot_tell_apart():
    """Two methods whose healed losses differ by far less than their paired windows spread are a
    tie; a third, clearly worse on every window, is told apart from both; the table says so."""
    from rich.console import Console

    from depthcurse.heal.compare import method_differences
    from depthcurse.heal.report import ties_text

    def entry(losses):
        return {"results": {"held_out": {"metric": "loss", "metrics": {"loss": sum(losses) / len(losses)}, "per_window": losses}}}

    record = {"methods": {"a": entry([3.0, 3.5, 2.9, 3.3]), "b": entry([3.1, 3.4, 3.0, 3.2]), "c": entry([4.0, 4.6, 3.8, 4.4])}}
    diffs = method_differences(record)["held_out_loss"]
    verdict = {tuple(d["methods"]): d["apart"] for d in diffs}
    assert verdict == {("a", "b"): False, ("a", "c"): True, ("b", "c"): True}
    record["ties"] = method_differences(record)
    console = Console(record=True, width=300)
    console.print(ties_text(record))
    assert "cannot tell apart" in console.export_text() and "a = b" in ties_text(record) and "c" not in ties_text(record).split(":", 2)[-1]


def test_a_table_written_to_a_pipe_keeps_every_cell_whole():
    """Off a terminal (a log file, a pipe) rich cuts a table to 80 columns and a wide table's cells
    read `…`; the CLI's console prints it as wide as its cells need, and on a terminal as rich does."""
    import io

    from rich.table import Table

    from depthcurse.cli.shared import TableConsole

    table = Table(title="wide")
    for i in range(12):
        table.add_column(f"column number {i}")
    table.add_row(*[f"{i * 1.23456:.4g} [{i * 0.01:.2f}, {i * 0.02:.2f}]" for i in range(12)])
    piped = io.StringIO()
    TableConsole(file=piped).print(table)
    text = piped.getvalue()
    assert "…" not in text and all(f"column number {i}" in text for i in range(12)) and "13.58 [0.11, 0.22]" in text
    terminal = io.StringIO()
    TableConsole(file=terminal, force_terminal=True, color_system=None, width=80).print(table)
    assert max(len(line) for line in terminal.getvalue().splitlines()) <= 80 and "…" in terminal.getvalue()  # rich's own


def test_kl_and_agreement_are_kept_window_by_window_and_their_shares_get_intervals():
    """Each window's KL to the reference and top-1 agreement average to the run's (equal windows), so a
    share won back on KL or agreement is paired over the windows like the loss's; the unpruned model,
    the reference itself, pairs as 0 and 1 in every window."""
    from depthcurse.heal.intervals import items
    from depthcurse.heal.shares import recovered
    from depthcurse.tasks import PerplexityTask

    gen = torch.Generator().manual_seed(0)
    windows = torch.randint(0, 50, (6, 9), generator=gen)
    task = PerplexityTask.of_windows(windows, source="random", bos=None, batch_size=4)
    tables = {name: torch.randn(50, 50, generator=gen) * scale for name, scale in (("unpruned", 3.0), ("pruned", 1.0), ("healed", 2.0))}
    logits = {name: (lambda ids, t=t: t[ids]) for name, t in tables.items()}
    results = {}
    for name in tables:
        reference = logits["unpruned"] if name != "unpruned" else None
        score = task.evaluate_logits(logits[name], "cpu", reference, per_window=True)
        entry = {"metric": "loss", "metrics": score.metrics, **{k: v for k, v in score.details.items() if k.startswith("per_window")}}
        if reference is None:
            entry["metrics"].update(kl=0.0, agreement=1.0)
        results[name] = {"held_out": entry}
    for name in ("pruned", "healed"):
        m = results[name]["held_out"]
        assert sum(m["per_window_kl"]) / 6 == pytest.approx(m["metrics"]["kl"], rel=1e-6)
        assert sum(m["per_window_agreement"]) / 6 == pytest.approx(m["metrics"]["agreement"], rel=1e-9)
    assert items(results["unpruned"], "held_out", "kl") == [[0.0] * 6] and items(results["unpruned"], "held_out", "agreement") == [[1.0] * 6]
    shares, why, intervals = recovered({"results": results})
    for key in ("held_out_kl", "held_out_agreement", "held_out_loss"):
        if shares.get(key) is not None:
            low, high = intervals[key]
            assert low <= shares[key] <= high, key
    assert any(k in intervals for k in ("held_out_kl", "held_out_agreement"))


def test_what_an_interrupted_heal_kept_is_said_run_folder_by_run_folder(tmp_path):
    """A comparison's or a curve's folders each say theirs: finished, a checkpoint at step N of M, the
    method's fitted state before any step, or a checkpoint cut short; an empty folder, nothing (issue 90)."""
    from depthcurse.heal.loop import METHOD_STATE

    assert kept_summary(tmp_path) == "nothing had finished"
    (tmp_path / "k004" / "linear").mkdir(parents=True)
    torch.save({"maps": torch.zeros(2)}, tmp_path / "k004" / "linear" / METHOD_STATE)
    (tmp_path / "k004" / "lora").mkdir()
    torch.save({"config": {"steps": 10}, "train_state": {"step": 4, "tokens": 0, "seconds": 0.0}}, tmp_path / "k004" / "lora" / "checkpoint.pt")
    (tmp_path / "k008" / "lora").mkdir(parents=True)
    (tmp_path / "k008" / "lora" / "checkpoint.pt").write_bytes(b"cut short")
    assert kept_summary(tmp_path) == (f"k004/linear: the method's fitted state ({METHOD_STATE}), no training step, k004/lora: a checkpoint at step 4 "
                                      f"of 10, k008/lora: a checkpoint that cannot be read kept in {tmp_path}")
