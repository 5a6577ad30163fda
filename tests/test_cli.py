"""The command line as a user meets it: one clear line and a non-zero exit for bad input."""

import json

import pytest

from helpers import assert_one_line_error


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
        (["prune", "{tmp}/missing.gguf"], "no such GGUF file"),
        (["prune", "some-org/no-such-model"], "hub is not reachable"),
        (["prune", "{tmp}"], "not a model folder"),
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


def test_sigterm_mid_sweep_keeps_finished_variants_and_a_rerun_finishes(tiny_model_dir, tmp_path):
    """The real process, killed as a scheduler would kill it, then rerun with the same command."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from helpers import CORPUS

    text = tmp_path / "long.txt"
    text.write_text("\n\n".join(CORPUS * 600), encoding="utf-8")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "depthcurse", "prune", str(tiny_model_dir), "--data", str(text), "--seq-len", "64", "--limit", "300", "--layers", "0-3", "--engine", "lm-eval", "--out", str(out)]
    env = {**os.environ, "TQDM_DISABLE": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 120
    while not (out / "prune.json").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    if proc.returncode == 0:
        pytest.skip("the sweep finished before the signal arrived")
    assert proc.returncode == 130 and "Traceback" not in err
    assert "rerun the same command to continue" in err
    kept = json.loads((out / "prune.json").read_text())["variants"]
    assert 1 <= len(kept) < 5
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    final = json.loads((out / "prune.json").read_text())["variants"]
    assert [v["removed"] for v in final] == [[], [0], [1], [2], [3]]
    assert final[: len(kept)] == kept  # finished variants were not recomputed
