import math

import pytest
import torch

from helpers import CORPUS, tiny_llama
from depthcurse.errors import DepthcurseError
from depthcurse.tasks import PerplexityTask, build_task


def test_perplexity_equals_transformers_loss(tiny_tokenizer):
    """Our token-weighted mean loss equals the mean of HF's own per-window loss (equal-length windows)."""
    model = tiny_llama(len(tiny_tokenizer))
    task = PerplexityTask(tiny_tokenizer, CORPUS * 4, source="corpus", seq_len=24, limit=5, batch_size=2)
    assert task.windows.shape == (5, 24)
    score = task.evaluate(model)
    with torch.no_grad():
        reference = torch.stack([model(input_ids=w[None], labels=w[None]).loss for w in task.windows]).mean().item()
    assert score.metrics["loss"] == pytest.approx(reference, rel=1e-5)
    assert score.metrics["ppl"] == pytest.approx(math.exp(reference), rel=1e-5)
    assert score.examples == 5 and score.details["tokens"] == 5 * 23


def test_ppl_windows_begin_with_bos_and_score_what_lm_evals_rolling_requests_score(bos_tokenizer):
    """A window is BOS then text, every text token scored: lm-eval's rolling log-likelihood of the
    same tokens (its first window starts from the model's prefix token, BOS), to rounding. With
    --no-bos the text is cut as it comes, its first token unscored (GPTQ's WikiText windows)."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    model = tiny_llama(len(bos_tokenizer))
    bos = bos_tokenizer.bos_token_id
    text = CORPUS[0]
    ids = bos_tokenizer(text, add_special_tokens=False)["input_ids"]
    task = PerplexityTask(bos_tokenizer, [text], source="t", seq_len=len(ids) + 1, limit=1, batch_size=1)
    assert task.windows.tolist() == [[bos] + ids] and task.describe()["bos"] == "<bos>"
    ours = task.evaluate(model).metrics["loss"] * len(ids)
    # add_bos_token=False: lm-eval encodes the text without BOS (left unset, it encodes the text with
    # its BOS, then puts its prefix token, BOS again, before that)
    lm = HFLM(pretrained=model, tokenizer=bos_tokenizer, max_length=len(ids) + 1, batch_size=1, add_bos_token=False)
    [theirs] = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True)
    assert ours == pytest.approx(-theirs, rel=1e-5)

    plain = PerplexityTask(bos_tokenizer, [text], source="t", seq_len=len(ids), limit=1, batch_size=1, bos=False)
    assert plain.windows.tolist() == [ids] and plain.describe()["bos"] is None
    with torch.no_grad():
        assert plain.evaluate(model).metrics["loss"] == pytest.approx(model(input_ids=plain.windows, labels=plain.windows).loss.item(), rel=1e-5)
    # every window of a longer text begins with BOS; a tokenizer that adds none gets none
    many = PerplexityTask(bos_tokenizer, CORPUS * 4, source="t", seq_len=16, limit=5)
    assert many.windows[:, 0].tolist() == [bos] * 5 and bos not in many.windows[:, 1:].tolist()[0]


def test_perplexity_batch_size_does_not_change_the_result(tiny_tokenizer):
    model = tiny_llama(len(tiny_tokenizer))
    a = PerplexityTask(tiny_tokenizer, CORPUS * 4, source="c", seq_len=16, limit=6, batch_size=1).evaluate(model)
    b = PerplexityTask(tiny_tokenizer, CORPUS * 4, source="c", seq_len=16, limit=6, batch_size=4).evaluate(model)
    assert a.metrics["loss"] == pytest.approx(b.metrics["loss"], rel=1e-6)


def test_a_default_limit_only_caps_while_an_asked_one_warns(tiny_tokenizer, text_file, caplog):
    with caplog.at_level("WARNING", logger="depthcurse"):
        default = build_task("ppl", tiny_tokenizer, data=str(text_file), seq_len=128)
    assert default.describe()["windows"] < 32 and "windows" not in caplog.text
    with caplog.at_level("WARNING", logger="depthcurse"):
        build_task("ppl", tiny_tokenizer, data=str(text_file), seq_len=128, limit=10_000)
    assert "holds only" in caplog.text


def test_too_little_text_is_a_clear_error(tiny_tokenizer):
    with pytest.raises(DepthcurseError, match="fewer than one window"):
        PerplexityTask(tiny_tokenizer, ["short"], source="tiny", seq_len=512)


def test_build_task_checks_its_inputs(tiny_tokenizer, text_file):
    with pytest.raises(DepthcurseError, match="--limit"):
        build_task("ppl", tiny_tokenizer, data=str(text_file), limit=0)
    with pytest.raises(DepthcurseError, match="--data does not apply to --task mmlu: it is for ppl, squad, repr"):
        build_task("mmlu", tiny_tokenizer, data=str(text_file))
    with pytest.raises(DepthcurseError, match="--seq-len does not apply to --task arc_easy: it is for ppl, repr"):
        build_task("arc_easy", tiny_tokenizer, seq_len=64)
    with pytest.raises(DepthcurseError, match="--num-fewshot does not apply to --task ppl: it is for lm-eval tasks"):
        build_task("ppl", tiny_tokenizer, data=str(text_file), num_fewshot=5)
    with pytest.raises(DepthcurseError, match="--num-fewshot must be 0 or more, got -1"):
        build_task("arc_easy", tiny_tokenizer, num_fewshot=-1)
    # the unknown name is what is wrong, whatever else was given with it
    with pytest.raises(DepthcurseError, match="unknown task 'nonsense_task'"):
        build_task("nonsense_task", tiny_tokenizer, data="wiki")
    with pytest.raises(DepthcurseError, match="no tokenizer"):
        build_task("ppl", None)
    model = tiny_llama(len(tiny_tokenizer))  # 256 positions
    with pytest.raises(DepthcurseError, match="--seq-len 100000 is longer than LlamaForCausalLM accepts \\(256 positions\\)"):
        build_task("ppl", tiny_tokenizer, data=str(text_file), seq_len=100000, model=model)
    task = build_task("ppl", tiny_tokenizer, data=str(text_file), seq_len=32, limit=3)
    assert task.describe()["windows"] == 3


def test_unknown_lm_eval_task_suggests_close_names(tiny_tokenizer):
    with pytest.raises(DepthcurseError, match=r"unknown task 'arc_easyy'.*arc_easy"):
        build_task("arc_easyy", tiny_tokenizer)
