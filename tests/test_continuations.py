"""`select --calibration continuations[:FILE]` (issue 79, item 4): the windows are the prompts and
the whole model's greedy continuations (equal to `model.generate`'s), and a removal's calibration and
held-out scores count only the predictions a draft makes (the continuation's tokens after its
first), by hand on a tiny model; padding changes nothing before it; a resumed run scores the kept
windows without generating again."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import assert_one_line_error

from depthcurse.loading import load_model
from depthcurse.select.continuations import windows_of
from depthcurse.select.search import OBJECTIVES
from depthcurse.surgery import removed_layers

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["the river flows through the valley and", "water boils at one hundred degrees", "paris is the capital of", "the old town and the bridge",
           "one hundred degrees celsius at sea", "the capital of france is paris and", "rome is the capital of italy", "berlin is a city in"]


@pytest.fixture()
def prompts_file(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("\n\n".join(PROMPTS) + "\n")
    return path


@pytest.mark.searching
def test_windows_are_right_padded_and_score_the_draft_predictions_only():
    """Prompt [5, 6, 7] and continuation [8, 9, 10]: predictions at positions 3 and 4 (of tokens 9 and
    10); the first continuation token (8) is the whole model's prefill's, never drafted."""
    ids, mask = windows_of([([5, 6, 7], [8, 9, 10]), ([1, 2], [3, 4])], pad=0)
    assert ids.tolist() == [[5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 0, 0]]
    assert mask.tolist() == [[0, 0, 0, 1, 1], [0, 0, 1, 0, 0]]


@pytest.mark.searching
def test_the_stream_searches_read_each_windows_tokens_up_to_its_last_scored_target():
    from depthcurse.select.windows import tokens_read

    _, mask = windows_of([([5, 6, 7], [8, 9, 10]), ([1, 2], [3, 4])], pad=0)
    assert tokens_read(mask).tolist() == [[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]


@pytest.mark.searching
def test_select_on_continuations_scores_where_a_draft_predicts_by_hand(run_cli, tiny_model_dir, prompts_file, tmp_path):
    out = tmp_path / "sel"
    source = f"continuations:{prompts_file}"
    args = ["select", tiny_model_dir, "--k", "1", "--search", "exact", "--objective", "acceptance", "--calibration", source,
            "--calib-windows", "3", "--eval-windows", "3", "--seq-len", "8", "--resamples", "0", "--seed", "7", "--out", out]
    code, stdout, err = run_cli(*args)
    assert code == 0, err
    record = json.loads((out / "select.json").read_text())
    kept = record["continuations"][source]
    assert len(kept["ids"]) == 6 and record["kinds"][source] == "the model's own greedy continuations of prompts"
    order = torch.randperm(8, generator=torch.Generator().manual_seed(7)).tolist()[:6]
    assert [int(p.rsplit("#", 1)[1]) for p in kept["prompts"]] == order  # a seeded shuffle of the file's prompts
    loaded = load_model(str(tiny_model_dir))
    model, tokenizer = loaded.model.eval(), loaded.tokenizer
    for (prompt, continuation), i in zip(kept["ids"], order):
        ids = tokenizer(PROMPTS[i], return_tensors="pt").input_ids
        assert prompt == ids[0].tolist()
        made = model.generate(ids, do_sample=False, max_new_tokens=8, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        assert continuation == made[0, ids.shape[1]:].tolist()  # the whole model's own greedy continuation

    def rejection_by_hand(pairs, removal):
        rates = []
        for prompt, continuation in pairs:
            ids = torch.tensor([prompt + continuation])
            with torch.no_grad():
                whole = model(input_ids=ids).logits[0, :-1].argmax(-1)
                with removed_layers(model, removal):
                    part = model(input_ids=ids).logits[0, :-1].argmax(-1)
            scored = range(len(prompt), len(prompt) + len(continuation) - 1)
            rates.append(1 - sum(float(part[t] == whole[t]) for t in scored) / len(scored))
        return rates

    calibration = kept["ids"][:3]
    for layer in range(4):
        by_hand = rejection_by_hand(calibration, [layer])
        assert record["calibration_scores"][source][str(layer)][OBJECTIVES.index("acceptance")] == pytest.approx(sum(by_hand) / 3, abs=1e-6)
    (cell,) = record["cells"].values()
    chosen = cell["layers"]
    assert record["held_out"][source][",".join(map(str, chosen))]["rejection"] == pytest.approx(rejection_by_hand(kept["ids"][3:], chosen), abs=1e-6)
    # a resumed run reads the kept windows (no second generation) and is the same run
    kept_text = (out / "select.json").read_text()
    code, _, err = run_cli(*args)
    assert code == 0 and json.loads((out / "select.json").read_text())["continuations"] == json.loads(kept_text)["continuations"], err
    assert_one_line_error(*run_cli("select", tiny_model_dir, "--k", "1", "--calibration", "continuations:nowhere.txt", "--out", tmp_path / "b"),
                          "--calibration continuations:nowhere.txt: no such prompts file")


@pytest.mark.searching
def test_a_prompt_the_model_ends_at_once_is_passed_over_and_said(tiny_model_dir, prompts_file):
    """The model's end-of-sequence set to its own first greedy token after prompt 3: that prompt gives
    one token, no draft position, and is passed over for the next of the shuffle; too few left is one line."""
    from types import SimpleNamespace

    from depthcurse.errors import DepthcurseError
    from depthcurse.select.continuations import continuation_texts

    loaded = load_model(str(tiny_model_dir))
    model, tokenizer = loaded.model.eval(), loaded.tokenizer
    ids = tokenizer(PROMPTS[3], return_tensors="pt").input_ids
    with torch.no_grad():
        first = int(model(input_ids=ids).logits[0, -1].argmax())
    model.generation_config.eos_token_id = first
    cfg = SimpleNamespace(calib_windows=2, eval_windows=2, seq_len=5, seed=7)
    texts, kept = continuation_texts(model, tokenizer, f"continuations:{prompts_file}", cfg)
    order = torch.randperm(8, generator=torch.Generator().manual_seed(7)).tolist()
    assert order.index(3) < 4 and f"{prompts_file}#3" in kept["passed_over"]  # reached among the first four, and passed over
    assert 3 not in [int(p.rsplit("#", 1)[1]) for p in kept["prompts"]] and len(kept["ids"]) == 4
    assert texts.calibration.shape[0] == 2 and texts.held_out_mask.shape[0] == 2
    with pytest.raises(DepthcurseError, match="prompts give the model a continuation of 2 tokens or more"):
        continuation_texts(model, tokenizer, f"continuations:{prompts_file}", SimpleNamespace(calib_windows=4, eval_windows=4, seq_len=5, seed=7))


@pytest.mark.searching
def test_each_texts_cost_is_said_for_its_own_windows(tiny_model_dir, prompts_file, tmp_path, monkeypatch):
    """The pass is timed once, on the first text's windows (here made up: 1 s a block pass, 2 s a head
    pass); a text of longer windows (the prompts and their continuations) is estimated at its own
    tokens, not at the first text's."""
    from depthcurse.select import SelectConfig, run_select
    from depthcurse.select import grid
    from depthcurse.select.continuations import continuation_texts
    from depthcurse.select.estimate import PassTiming
    from depthcurse.select.windows import text_windows

    text = tmp_path / "text.txt"
    text.write_text(" ".join(PROMPTS * 6))
    monkeypatch.setattr(grid, "pass_timing", lambda *a, **k: PassTiming(1.0, 2.0))
    loaded = load_model(str(tiny_model_dir))
    source = f"continuations:{prompts_file}"
    cfg = SelectConfig(k=1, calibration=(str(text), source), objectives=("acceptance",), searches=("greedy",), calib_windows=2, eval_windows=2,
                       seq_len=8, resamples=0)
    record = run_select(loaded, cfg, tmp_path / "sel")
    plain = text_windows(loaded.tokenizer, str(text), cfg.checked()).calibration
    longer = continuation_texts(loaded.model, loaded.tokenizer, source, cfg, record["continuations"][source])[0].calibration
    assert longer.numel() > plain.numel()
    for name, cell in record["cells"].items():
        factor = (longer if cell["calibration"] == source else plain).numel() / plain.numel()
        expected = cell["estimate"]["block_passes"] * 1.0 * factor + cell["estimate"]["head_passes"] * 2.0 * factor
        assert cell["estimate"]["seconds"] == pytest.approx(expected, abs=0.1), name


@pytest.mark.searching
@pytest.mark.parametrize("path", ["stepper", "forward"])
def test_the_unpruned_models_loss_is_over_the_scored_predictions_as_every_removals_is(tiny_model_dir, path, monkeypatch):
    """On masked windows (a prompt, its continuation, padding) the unpruned model's per-window loss is
    the mean of -log p over the scored predictions alone, worked out by hand, as a removal's is: over
    every prediction it would be another figure, and a removal could seem to lower the loss (issue 88).
    Both ways the unpruned pass runs: block by block, and the model's own forward (no stepper)."""
    from depthcurse.select.scoring import CalibrationScorer

    if path == "forward":
        monkeypatch.setattr(CalibrationScorer, "_stepper", lambda self: None)

    loaded = load_model(str(tiny_model_dir))
    model = loaded.model.eval()
    pairs = [([5, 6, 7, 8], [9, 10, 11]), ([12, 13], [14, 15, 16, 17, 18])]
    ids, mask = windows_of(pairs, 0)
    scorer = CalibrationScorer(model, ids, 2, {}, lambda: None, mask=mask)
    losses, _, _ = scorer.unpruned_windows()
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[:, :-1].float(), -1)
    nll = -logp.gather(-1, ids[:, 1:, None])[..., 0]
    by_hand = [(nll[w] * mask[w]).sum().item() / mask[w].sum().item() for w in range(2)]
    every = [nll[w].mean().item() for w in range(2)]
    assert losses == pytest.approx(by_hand, abs=1e-5) and all(abs(a - b) > 1e-3 for a, b in zip(by_hand, every))
    for layer in range(2):  # a removal's, by the same rule
        with torch.no_grad(), removed_layers(model, [layer]):
            part = -torch.log_softmax(model(input_ids=ids).logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        assert scorer.per_window([(layer,)])[0][0] == pytest.approx([(part[w] * mask[w]).sum().item() / mask[w].sum().item() for w in range(2)], abs=1e-5)


def test_the_suites_pool_holds_twice_the_prompts_wanted_for_those_the_model_ends_at_once():
    """The offline suite's pool is twice the prompts asked, a kind at a time, so a prompt the model
    ends at once has spares behind it (issue 88)."""
    from depthcurse.select.continuations import _prompts
    from depthcurse.speculate.prompts import KINDS

    for wanted in (1, 4, 5, 16):
        pool = _prompts("continuations", wanted)
        assert len(pool) == 2 * -(-wanted // len(KINDS)) * len(KINDS) >= 2 * wanted, wanted
