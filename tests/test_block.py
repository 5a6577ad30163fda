"""`prune --block N`: the block angular distance picks against the N deepest layers, both evaluated."""

import json

import pytest

from helpers import built_without

from depthcurse.angular import AngularResult, load_angular, write_angular
from depthcurse.errors import DepthcurseError
from depthcurse.io import ensure_out_dir


def synthetic(pairwise, max_n=None):
    L = len(pairwise) - 1
    return AngularResult(num_layers=L, max_n=max_n or L, position="last", pairwise=pairwise, samples=1, stat_tokens=1,
                         block_influence=[0.0] * L, relative_update=[0.0] * L, norm=[1.0] * (L + 1), variance=[1.0] * (L + 1))


def test_choices_are_the_argmin_block_and_the_deepest_before_the_last():
    L = 6
    # d(x_i, x_j) grows with j - i, except that blocks 1-2 barely change the stream
    pairwise = [[abs(j - i) * 0.1 for j in range(L + 1)] for i in range(L + 1)]
    pairwise[1][3] = pairwise[3][1] = 0.01
    angular, deepest = synthetic(pairwise).block_choices(2)
    assert (angular.rule, angular.layers, angular.distance) == ("angular", (1, 2), 0.01)
    assert (deepest.rule, deepest.layers) == ("deepest", (3, 4))  # layer 5, the final one, is kept
    assert deepest.distance == pytest.approx(0.2)
    assert synthetic(pairwise).block_choices(5)[1].layers == (0, 1, 2, 3, 4)
    for bad in (0, 6):
        with pytest.raises(DepthcurseError, match="out of range"):
            synthetic(pairwise).block_choices(bad)


def test_angular_json_reads_back(tmp_path):
    pairwise = [[abs(j - i) * 0.1 for j in range(5)] for i in range(5)]
    result = synthetic(pairwise, max_n=3)
    result.run = {"model": "m", "data": "d"}
    write_angular(result, tmp_path)
    back = load_angular(tmp_path)
    assert back.pairwise == result.pairwise and back.max_n == 3 and back.run == result.run
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(DepthcurseError, match="not a depthcurse angular.json"):
        load_angular(tmp_path / "bad.json")
    with pytest.raises(DepthcurseError, match="run `depthcurse angular-distance` first"):
        load_angular(tmp_path / "nowhere")


def test_block_prune_evaluates_both_blocks_like_models_built_without_them(run_cli, tiny_model_dir, text_file, tmp_path, tiny_tokenizer, one_torch_thread):
    from transformers import AutoModelForCausalLM

    from depthcurse.tasks import PerplexityTask

    out = tmp_path / "block"
    args = ["prune", tiny_model_dir, "--task", "ppl", "--data", text_file, "--limit", "3", "--seq-len", "16",
            "--block", "2", "--angular-data", text_file, "--angular-tokens", "400", "--out", out]
    code, stdout, err = run_cli(*args)
    assert code == 0, err
    assert "angular" in stdout and "deepest" in stdout and "d(x_l, x_l+n)" in stdout
    angular = load_angular(out)
    pick = angular.block_choices(2)[0].layers
    data = json.loads((out / "prune.json").read_text())
    assert data["run"]["block"] == {"n": 2, "angular": list(pick), "deepest": [1, 2]}
    removed = [v["removed"] for v in data["variants"]]
    assert removed[0] == [] and {tuple(r) for r in removed[1:]} == {tuple(pick), (1, 2)}

    # independent reference: a model built without those layers, scored by the same task
    texts = text_file.read_text().split("\n\n")
    task = PerplexityTask(tiny_tokenizer, texts, source="t", seq_len=16, limit=3, batch_size=8)
    for v in data["variants"][1:]:
        model = built_without(AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), "model.layers", v["removed"])
        assert v["metrics"]["loss"] == pytest.approx(task.evaluate(model).metrics["loss"], abs=1e-5)

    # a rerun reuses the kept angular pass and the finished variants
    before = (out / "prune.json").read_text()
    code, _, err = run_cli(*args)
    assert code == 0, err
    after = json.loads((out / "prune.json").read_text())
    assert [v["seconds"] for v in after["variants"]] == [v["seconds"] for v in json.loads(before)["variants"]]


def test_block_uses_a_given_angular_result(run_cli, tiny_model_dir, text_file, tmp_path, one_torch_thread):
    pairwise = [[abs(j - i) * 0.1 for j in range(5)] for i in range(5)]
    pairwise[0][1] = pairwise[1][0] = 0.001  # layer 0 "does nothing" in this made-up measurement
    result = synthetic(pairwise)
    write_angular(result, ensure_out_dir(tmp_path / "ang"))
    out = tmp_path / "out"
    code, _, err = run_cli("prune", tiny_model_dir, "--task", "ppl", "--data", text_file, "--limit", "2", "--seq-len", "16",
                           "--block", "1", "--angular", tmp_path / "ang", "--out", out)
    assert code == 0, err
    data = json.loads((out / "prune.json").read_text())
    assert [v["removed"] for v in data["variants"]] == [[], [0], [2]]


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--block", "4"], "out of range"),
        (["--block", "0"], "out of range"),
        (["--block", "2", "--layers", "1"], "exclusive"),
        (["--angular", "x"], "only applies with --block"),
        (["--block", "2", "--angular", "{tmp}/none"], "run `depthcurse angular-distance` first"),
    ],
)
def test_bad_block_input_gets_one_clear_line(run_cli, tiny_model_dir, text_file, tmp_path, extra, match):
    from helpers import assert_one_line_error

    extra = [e.replace("{tmp}", str(tmp_path)) for e in extra]
    code, out, err = run_cli("prune", tiny_model_dir, "--task", "ppl", "--data", text_file, "--out", tmp_path / "o", *extra)
    assert_one_line_error(code, out, err, match)
