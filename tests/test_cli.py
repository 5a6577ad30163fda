"""The command line as a user meets it: one clear line and a non-zero exit for bad input."""

import json

import pytest


def assert_one_line_error(code, out, err, match):
    assert code != 0
    assert "Traceback" not in out + err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error:") and match in lines[0], lines[0]


def test_prune_on_a_local_model_writes_table_and_files(run_cli, tiny_model_dir, text_file, tmp_path):
    out = tmp_path / "out"
    code, stdout, err = run_cli("prune", tiny_model_dir, "--task", "ppl", "--data", text_file, "--limit", "3", "--seq-len", "16", "--out", out)
    assert code == 0, err
    assert {p.name for p in out.iterdir()} >= {"prune.csv", "prune.json", "prune.png"}
    data = json.loads((out / "prune.json").read_text())
    assert [v["removed"] for v in data["variants"]] == [[], [0], [1], [2], [3]]
    assert "removed" in stdout and "rel. drop" in stdout


def test_drop_saves_a_checkpoint_that_reloads(run_cli, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    code, _, err = run_cli("drop", tiny_model_dir, "--layers", "1-2", "--out", tmp_path / "pruned")
    assert code == 0, err
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "pruned")
    assert model.config.num_hidden_layers == 2


@pytest.mark.parametrize(
    "args, match",
    [
        (["prune", "./no/such/model", "--task", "ppl"], "no such model path"),
        (["prune", "{model}", "--layers", "7", "--data", "{text}"], "out of range"),
        (["prune", "{model}", "--layers", "x-y", "--data", "{text}"], "x-y"),
        (["prune", "{model}", "--task", "ppl", "--data", "{tmp}/missing.jsonl"], "no such data file"),
        (["prune", "{model}", "--task", "ppl", "--data", "{tmp}/empty.txt"], "holds no text"),
        (["prune", "{model}", "--task", "ppl", "--data", "{text}", "--out", "{tmp}/blocker/sub"], "not writable"),
        (["prune", "{model}", "--task", "hellaswagg"], "unknown task"),
        (["prune", "{model}", "--dtype", "fp8"], "unknown --dtype"),
        (["prune", "{encoder}", "--task", "ppl"], "encoder"),
        (["drop", "{model}", "--layers", "0-3", "--out", "{tmp}/all"], "removes all 4 layers"),
    ],
)
def test_bad_input_gets_one_clear_line(run_cli, tiny_model_dir, text_file, tmp_path, args, match):
    from transformers import BertConfig, BertModel

    (tmp_path / "empty.txt").write_text("\n\n")
    (tmp_path / "blocker").write_text("a file, not a folder")
    encoder = tmp_path / "bert"
    BertModel(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)).save_pretrained(encoder)
    fill = {"model": tiny_model_dir, "text": text_file, "tmp": tmp_path, "encoder": encoder}
    args = [a.format(**{k: str(v) for k, v in fill.items()}) for a in args]
    assert_one_line_error(*run_cli(*args), match)


def test_debug_shows_the_traceback(run_cli):
    from depthcurse.errors import DepthcurseError

    with pytest.raises(DepthcurseError):
        run_cli("--debug", "prune", "./no/such/model")
