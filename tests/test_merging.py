"""Merging instead of removing: LaCo's RDSC and Sliding-Window Merging, as recovery methods and as
select's searches, against ports of their authors' code.

The references: `_laco_merge` and `_swm_merge` are the released `merge_layers_return_model`s
(yangyifei729/LaCo @ 8483587, laco_llama-13b.ipynb; 920927/Sliding-Window-Merging @ 8fa008e, SLM.py)
line for line on a deep copy of a transformers Llama, `_laco_loop` and `_swm_loop` their selection
loops; the paper's formula is worked out by hand on numbers where the two forms differ.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from helpers import assert_one_line_error, tiny_llama

from depthcurse.errors import DepthcurseError
from depthcurse.heal import HealContext
from depthcurse.heal.method import build_method as _build_method
from depthcurse.heal.method import parse_method_args
from depthcurse.heal.healed import Healed
from depthcurse.merging import last_hidden, mean_similarity, rdsc_code, rdsc_paper, sliding_window_code
from depthcurse.select.search import Space, build_searches, parse_search_args
from depthcurse.select.searches.laco import LacoSearchSettings, laco_procedure
from depthcurse.select.searches.swm import SwmSearchSettings, swm_procedure

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROJECTIONS = {"mlp": ("gate_proj", "down_proj", "up_proj"), "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj")}


def build_method(spec, args=None):
    """As the command line builds it: `as=code` is typed `as`."""
    return _build_method(spec, parse_method_args(",".join(f"{k}={v}" for k, v in (args or {}).items())))


def build_search(spec, args):
    return build_searches((spec,), parse_search_args(",".join(f"{k}={v}" for k, v in args.items())))[spec]


def _llama(layers, seed):
    """A tiny Llama whose norms differ from layer to layer (a fresh model's are all ones), so that a
    merge that touched them, or a port that kept the wrong layer's, would show."""
    model = tiny_llama(300, layers=layers, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for module in model.modules():
            if "Norm" in type(module).__name__:
                module.weight.copy_(0.5 + torch.rand(module.weight.shape, generator=g))
    return model


# --------------------------------------------------------------------------- the authors' code, ported
def _laco_merge(model, merge_base_lay, merge_layer_num):
    """laco_llama-13b.ipynb's merge_layers_return_model."""
    merge_layer_num = min(merge_layer_num, len(model.model.layers) - merge_base_lay - 1)
    model_copy = copy.deepcopy(model)
    for diff_lay in range(merge_base_lay + 1, merge_base_lay + 1 + merge_layer_num):
        for part, names in PROJECTIONS.items():
            for proj in names:
                getattr(getattr(model_copy.model.layers[merge_base_lay], part), proj).weight.data.add_(
                    getattr(getattr(model.model.layers[diff_lay], part), proj).weight.data
                    - getattr(getattr(model_copy.model.layers[merge_base_lay], part), proj).weight.data)
    for diff_lay in range(merge_base_lay + merge_layer_num, merge_base_lay, -1):
        del model_copy.model.layers[diff_lay]
    return model_copy


def _swm_merge(model, low_lay, high_lay, weight_factor):
    """SLM.py's merge_layers_return_model."""
    model_copy = copy.deepcopy(model)
    for current_layer_idx in range(low_lay, high_lay + 1):
        for part in ("mlp", "self_attn"):
            for proj in PROJECTIONS[part]:
                getattr(getattr(model_copy.model.layers[low_lay], part), proj).weight.data.add_(
                    (getattr(getattr(model.model.layers[current_layer_idx], part), proj).weight.data
                     - getattr(getattr(model_copy.model.layers[low_lay], part), proj).weight.data) * weight_factor)
    for current_layer_idx in range(high_lay, low_lay, -1):
        del model_copy.model.layers[current_layer_idx]
    for layer_idx, module in enumerate(model_copy.model.layers):
        module.self_attn.layer_idx = layer_idx
    return model_copy


def _sim(model1_hidden, model2, windows):
    """Both scripts' cal_sim: per sentence the cosine of the flattened last hidden states, the mean."""
    sims = []
    for w, h1 in zip(windows, model1_hidden):
        with torch.no_grad():
            h2 = model2(w[None], output_hidden_states=True).hidden_states[-1]
        sims.append(torch.cosine_similarity(h1.squeeze(0).flatten().unsqueeze(0), h2.squeeze(0).flatten().unsqueeze(0)).item())
    return np.mean(sims)


def _hidden(model, windows):
    with torch.no_grad():
        return [model(w[None], output_hidden_states=True).hidden_states[-1] for w in windows]


def _laco_loop(model, windows, merge_layers, interval, lowest, highest, threshold):
    """The notebook's last cell."""
    reference = _hidden(model, windows)
    compressed = copy.deepcopy(model)
    lay = highest - merge_layers
    while lay >= lowest:
        tmp = _laco_merge(compressed, lay, merge_layers - 1)
        if _sim(reference, tmp, windows) > threshold:
            compressed = tmp
            lay -= interval
            if lay >= len(compressed.model.layers):
                lay = len(compressed.model.layers) - 1 - merge_layers
        else:
            lay -= 1
    return compressed


def _swm_loop(model, windows, threshold, weight_factor=1):
    """SLM.py's main loop (weight_factor=1, as it calls the merge; another here for the setting)."""
    reference = _hidden(model, windows)
    short_model = model
    high_lay = len(short_model.model.layers) - 1 - 1
    low_lay = high_lay - 1
    while low_lay >= 0:
        tmp = _swm_merge(short_model, low_lay, high_lay, weight_factor=weight_factor)
        if _sim(reference, tmp, windows) > threshold:
            low_lay -= 1
        elif low_lay + 1 != high_lay:
            short_model = _swm_merge(short_model, low_lay + 1, high_lay, weight_factor=weight_factor)
            high_lay = low_lay
        else:
            high_lay -= 1
            low_lay -= 1
    return short_model


def _same_weights(ours, theirs):
    a, b = ours.state_dict(), theirs.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _healed_checkpoint(model, layers, method, folder):
    from transformers import AutoModelForCausalLM

    method.prepare(HealContext(model=model, layers=tuple(layers), calibration=lambda tokens: []))
    Healed(model, tuple(layers), method).save(None, folder)
    return AutoModelForCausalLM.from_pretrained(folder).eval()


# --------------------------------------------------------------------------- the rules, by hand
@pytest.mark.searching
def test_the_papers_rdsc_the_codes_loop_and_swms_average_on_numbers_worked_by_hand():
    """Base 1, run 2 and 4 (each a 1-element tensor): the paper 1 + (2 - 1) + (4 - 1) = 5; LaCo's code
    1 -> 2 -> 4 (the last layer); SWM at f = 0.5: 1 -> 1 -> 1.5 -> 2.75; at f = 1, 4 as LaCo's code."""
    base, run = torch.tensor([1.0]), [torch.tensor([2.0]), torch.tensor([4.0])]
    assert rdsc_paper(base, run).item() == 5.0
    assert rdsc_code(base, run).item() == 4.0
    assert sliding_window_code(base, run, 0.5).item() == 2.75
    assert sliding_window_code(base, run, 1.0).item() == 4.0
    assert base.item() == 1.0  # the base's own tensor is left as it was
    grid = torch.arange(12.0).reshape(3, 4)  # a 3 x 4 case: every element its own sum
    assert torch.equal(rdsc_paper(grid, [grid * 2, grid * 3]), grid + grid + 2 * grid)


@pytest.mark.searching
def test_laco_as_code_is_the_released_notebook_tensor_for_tensor_and_as_paper_the_formula(tmp_path):
    model = _llama(8, 5)
    theirs = _laco_merge(model, 3, 3)  # layer 3 with 4, 5, 6 merged in
    ours = _healed_checkpoint(model, (4, 5, 6), build_method("laco", {"as": "code"}), tmp_path / "code")
    _same_weights(ours, theirs)
    paper = _healed_checkpoint(model, (4, 5, 6), build_method("laco"), tmp_path / "paper")
    blocks = model.model.layers
    for part, names in PROJECTIONS.items():
        for proj in names:
            w = [getattr(getattr(blocks[i], part), proj).weight.double() for i in (3, 4, 5, 6)]
            expected = (w[0] + (w[1] - w[0]) + (w[2] - w[0]) + (w[3] - w[0])).float()
            assert torch.equal(getattr(getattr(paper.model.layers[3], part), proj).weight, expected)
    assert torch.equal(paper.model.layers[3].input_layernorm.weight, blocks[3].input_layernorm.weight)  # norms the base's own
    assert len(paper.model.layers) == 5 and torch.equal(paper.model.layers[4].mlp.up_proj.weight, blocks[7].mlp.up_proj.weight)
    # the released code leaves the base at the run's last layer (up to rounding): not the paper's sum
    code_q = ours.model.layers[3].self_attn.q_proj.weight
    assert (code_q - blocks[6].self_attn.q_proj.weight).abs().max() < 1e-6
    assert (code_q - paper.model.layers[3].self_attn.q_proj.weight).abs().max() > 0.01


@pytest.mark.searching
@pytest.mark.parametrize("factor", [1.0, 0.5])
def test_swm_is_the_released_scripts_merge_tensor_for_tensor(tmp_path, factor):
    model = _llama(8, 6)
    theirs = _swm_merge(model, 2, 5, factor)
    ours = _healed_checkpoint(model, (3, 4, 5), build_method("swm", {"weight_factor": str(factor)}), tmp_path / "swm")
    _same_weights(ours, theirs)


@pytest.mark.searching
def test_a_merged_model_saves_as_a_stock_checkpoint_with_the_logits_measured_and_two_runs_merge_apart(tmp_path):
    model = _llama(8, 7)
    ids = torch.randint(3, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    method = build_method("laco")
    method.prepare(HealContext(model=model, layers=(2, 3, 6), calibration=lambda tokens: []))
    before = model(input_ids=ids).logits
    healed = Healed(model, (2, 3, 6), method)
    with healed.as_model("healed") as m:
        measured = m(input_ids=ids).logits
    saved = _healed_checkpoint(model, (2, 3, 6), method, tmp_path / "two")
    torch.testing.assert_close(saved(input_ids=ids).logits, measured, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=0, atol=0)  # the model in memory unchanged
    assert saved.config.num_hidden_layers == 5
    assert "layer 1 holds layers 1-3 merged" in method.changes((2, 3, 6)) and "layer 5 holds layers 5-6 merged" in method.changes((2, 3, 6))
    assert method.untouched((2, 3, 6)) == 1


@pytest.mark.searching
def test_a_merge_composes_with_a_training_method():
    composed = build_method("laco+lora", {"laco.as": "code", "lora_rank": "2"})
    assert composed.name == "laco+lora" and composed.recorded()["laco"]["as_"] == "code"
    from depthcurse.heal.method import method_settings_text

    assert "laco.as=code" in method_settings_text(composed)


@pytest.mark.parametrize("spec, args, layers, match", [
    ("laco", {"as": "both"}, (3,), "--method laco: as='both': use paper"),
    ("swm", {"weight_factor": "0"}, (3,), "weight_factor=0.0: a step towards each layer lies in (0, 1]"),
    ("swm", {"weight_factor": "1.5"}, (3,), "lies in (0, 1]"),
    ("laco", {}, (0, 1), "--method laco: it merges each removed run into the layer before it, and layers 0-1 starts at layer 0"),
])
@pytest.mark.searching
def test_bad_merges_are_one_line_naming_the_method_and_the_setting(spec, args, layers, match):
    import re

    with pytest.raises(DepthcurseError, match=re.escape(match)):
        method = build_method(spec, args)
        method.check(tiny_llama(300, layers=6), layers)


@pytest.mark.searching
def test_a_layer_of_another_shape_is_refused_before_any_work():
    import re

    from torch import nn

    model = tiny_llama(300, layers=6)
    model.model.layers[3].mlp.up_proj = nn.Linear(32, 96, bias=False)  # an MLP wider than its neighbours'
    with pytest.raises(DepthcurseError, match=re.escape("--method swm: layer 3 differs from layer 2 in shape (mlp.up_proj.weight)")):
        build_method("swm").check(model, (3, 4))
    from depthcurse.merging import check_uniform

    with pytest.raises(DepthcurseError, match=re.escape("--search laco: layer 3 differs from layer 2 in shape")):
        check_uniform(model, "--search laco")  # the procedures may merge any layer into the one below it


def test_heal_compares_merges_with_a_removal_repair_from_the_command_line(run_cli, bos_model_dir, docs_file, tmp_path):
    code, out, err = run_cli("heal", bos_model_dir, "--layers", "2-3", "--methods", "laco,swm,linear", "--method-args", "laco.as=code",
                             "--data", docs_file, "--eval-windows", "4", "--seq-len", "24", "--calib-tokens", "240", "--out", tmp_path / "h")
    assert code == 0, err
    text = " ".join(out.split())
    assert "LaCo's RDSC" in text and "Sliding-Window Merging" in text and "linear map" in text
    import json

    record = json.loads((tmp_path / "h" / "heal.json").read_text()) if (tmp_path / "h" / "heal.json").exists() else None
    assert record is None or set(record["methods"]) >= {"laco", "swm", "linear"}
    code, out, err = run_cli("heal", bos_model_dir, "--layers", "0-1", "--methods", "laco", "--calibration", docs_file, "--out", tmp_path / "bad")
    assert_one_line_error(code, out, err, "--method laco: it merges each removed run into the layer before it")


# --------------------------------------------------------------------------- the selection procedures
def _windows(n=3, tokens=12, seed=0):
    return torch.randint(3, 300, (n, tokens), generator=torch.Generator().manual_seed(seed))


@pytest.mark.searching
def test_the_similarity_is_the_scripts_cosine_of_flattened_last_hidden_states():
    model, other = tiny_llama(300, layers=6, seed=1), tiny_llama(300, layers=6, seed=2)
    windows = _windows()
    assert mean_similarity(last_hidden(model, windows), last_hidden(other, windows)) == pytest.approx(_sim(_hidden(model, windows), other, windows), abs=1e-6)


def _merged_state_model(model, state):
    """Our procedure's merged model as a stock model: the merged layers in place, the rest gone."""
    out = copy.deepcopy(model)
    for base, layer in state.merged.items():
        out.model.layers[base] = copy.deepcopy(layer)
    for i in sorted(state.gone(), reverse=True):
        del out.model.layers[i]
    return out


@pytest.mark.searching
@pytest.mark.parametrize("threshold", [0.99, 0.9, 0.5])
def test_lacos_procedure_is_the_notebooks_loop(threshold):
    model = _llama(10, 3)
    windows = _windows()
    settings = LacoSearchSettings(merge_layers=3, interval=1, threshold=threshold, lowest=0, highest=9, as_="code")
    state, trail = laco_procedure(model, windows, settings)
    theirs = _laco_loop(model, windows, 3, 1, 0, 9, threshold)
    _same_weights(_merged_state_model(model, state), theirs)
    assert len(theirs.model.layers) == 10 - len(state.gone())


@pytest.mark.searching
def test_lacos_procedure_steps_by_its_interval_after_a_kept_merge_and_by_one_after_a_refused_one():
    """interval 2 at a threshold where some merges are kept and some refused (at interval 1 the two
    steps are the same): the notebook's loop, merge for merge."""
    model = _llama(10, 3)
    windows = _windows()
    _, free = laco_procedure(model, windows, LacoSearchSettings(merge_layers=2, threshold=0.0, highest=9))
    sims = sorted(t[2] for t in free)
    middle = (sims[0] + sims[-1]) / 2
    settings = LacoSearchSettings(merge_layers=2, interval=2, threshold=middle, lowest=0, highest=9, as_="code")
    state, trail = laco_procedure(model, windows, settings)
    assert any(t[3] for t in trail) and not all(t[3] for t in trail)
    theirs = _laco_loop(model, windows, 2, 2, 0, 9, middle)
    _same_weights(_merged_state_model(model, state), theirs)
    steps = [a[0] - b[0] for a, b in zip(trail, trail[1:])]
    assert steps == [2 if t[3] else 1 for t in trail[:-1]]


@pytest.mark.searching
def test_lacos_procedure_tries_and_refuses_on_a_tiny_model_and_stops_at_k():
    """At a threshold between the merges' similarities some are kept and some refused, and with k
    the procedure ends once k layers are gone, the last merge cut to fit."""
    model = _llama(10, 3)
    windows = _windows()
    free, trail = laco_procedure(model, windows, LacoSearchSettings(merge_layers=3, threshold=0.0, highest=9))
    sims = sorted(t[2] for t in trail)
    middle = (sims[0] + sims[-1]) / 2
    _, mixed = laco_procedure(model, windows, LacoSearchSettings(merge_layers=3, threshold=middle, highest=9))
    assert any(t[3] for t in mixed) and not all(t[3] for t in mixed)
    stopped, _ = laco_procedure(model, windows, LacoSearchSettings(merge_layers=3, threshold=0.0, highest=9), stop_at=3)
    assert len(stopped.gone()) == 3 and len(free.gone()) > 3


@pytest.mark.searching
@pytest.mark.parametrize("threshold", [0.99, 0.9, 0.5])
def test_swms_procedure_is_the_scripts_loop(threshold):
    model = _llama(10, 4)
    windows = _windows(seed=1)
    state, trail = swm_procedure(model, windows, SwmSearchSettings(threshold=threshold))
    theirs = _swm_loop(model, windows, threshold)
    _same_weights(_merged_state_model(model, state), theirs)


@pytest.mark.searching
def test_swm_stops_at_k_with_the_window_that_reaches_it():
    model = _llama(10, 4)
    state, trail = swm_procedure(model, _windows(seed=1), SwmSearchSettings(threshold=-0.99), stop_at=4)
    assert state.gone() == (5, 6, 7, 8) and list(state.merged) == [4]  # one window grown down from 7-8 until four are gone


@pytest.mark.searching
def test_the_searches_refuse_settings_that_cannot_work_before_any_work():
    import re

    for spec, args, match in (("laco", {"threshold": "1.5"}, "laco.threshold=1.5: a cosine similarity threshold lies in (-1, 1]"),
                              ("swm", {"threshold": "-1"}, "swm.threshold=-1.0"),
                              ("laco", {"merge_layers": "9"}, "leave no run to merge in 8 layers"),
                              ("laco", {"as": "x"}, "laco.as=x: use paper or code")):
        search = build_search(spec, args)
        with pytest.raises(DepthcurseError, match=re.escape(match)):
            search.check(Space(8, 2))


def test_select_judges_laco_and_swm_beside_greedy(run_cli, tiny_model_dir, text_file, tmp_path):
    import json

    code, out, err = run_cli("select", tiny_model_dir, "--k", "1", "--search", "laco,swm,greedy", "--search-args", "laco.merge_layers=2,laco.threshold=-0.9,swm.threshold=-0.9",
                             "--calibration", text_file, "--calib-windows", "2", "--eval-windows", "8", "--seq-len", "16", "--out", tmp_path / "s")
    assert code == 0, err
    cells = json.loads((tmp_path / "s" / "select.json").read_text())["cells"]
    by_search = {c["search"]: c for c in cells.values()}
    assert set(by_search) == {"laco", "swm", "greedy"} and by_search["laco"]["objective"] == "-" and "merges tried" in by_search["laco"]["notes"][0]
    assert len(by_search["swm"]["layers"]) == 1
    # a threshold no merge passes ends the run in one line once the procedure has run, the finished cells kept
    code, out, err = run_cli("select", tiny_model_dir, "--k", "2", "--search", "greedy,laco", "--search-args", "laco.merge_layers=2,laco.threshold=1",
                             "--calibration", text_file, "--calib-windows", "2", "--eval-windows", "8", "--seq-len", "16", "--out", tmp_path / "short")
    line = err.strip().splitlines()[-1]  # after the progress lines
    assert code == 1 and "Traceback" not in out + err and sum(x.startswith("error:") for x in err.splitlines()) == 1
    assert line.startswith("error: --search laco merged 0 of k = 2 layers away at threshold 1.0 (similarities 0.") and "lower laco.threshold" in line
    kept = json.loads((tmp_path / "short" / "select.json").read_text())["cells"]
    assert [c["search"] for c in kept.values()] == ["greedy"]


# --------------------------------------------------------------------------- MKA's released code
def _mka_layer_fusion(model, layer1_idx, layer2_idx, ratio_i, weight_types):
    """SempraETY/Pruning-via-Merging @ 3b60b00, pipeline.py's layer_fusion (its prints left out)."""
    import numpy as np

    layer1_params = {name: param for name, param in model.named_parameters() if f"model.layers.{layer1_idx}." in name}
    layer2_params = {name: param for name, param in model.named_parameters() if f"model.layers.{layer2_idx}." in name}
    for weight_type in weight_types:
        w1 = layer1_params.get(f"model.layers.{layer1_idx}.{weight_type}")
        w2 = layer2_params.get(f"model.layers.{layer2_idx}.{weight_type}")
        if w1 is not None and w2 is not None:
            ratio_j = 1 - ratio_i
            w_fused = ratio_i * w1.detach().float().cpu().numpy() + ratio_j * w2.detach().float().cpu().numpy()
            w_fused_tensor = torch.tensor(np.asarray(w_fused)).to(w1.device)
            model.state_dict()[f"model.layers.{layer1_idx}.{weight_type}"] = w_fused_tensor.view_as(w1).to(w1.dtype)
    model.model.layers = torch.nn.ModuleList([layer for k, layer in enumerate(model.model.layers) if k != layer2_idx])
    return model


@pytest.mark.searching
def test_mkas_released_fusion_writes_into_a_copy_of_the_state_dict_so_it_only_removes_the_last_layer():
    """docs/healing.md states it: MKA's pipeline.py assigns the fused weights into the dict
    `model.state_dict()` returns, a fresh one, so no parameter changes; with its loop always fusing
    the last two layers, k rounds remove the last k layers and merge nothing."""
    model = tiny_llama(300, layers=6, seed=8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    types = [f"{part}.{proj}.weight" for part, names in PROJECTIONS.items() for proj in names]
    n = 6
    for _ in range(2):  # main()'s loop: the last two layers, twice
        model = _mka_layer_fusion(model, n - 2, n - 1, 0.6, types)
        n -= 1
    after = model.state_dict()
    assert len(model.model.layers) == 4
    for k, v in after.items():  # every tensor left is the unpruned model's own, untouched: layers 0-3
        assert torch.equal(v, before[k]), k


def _qwen2(layers, seed):
    """A tiny Qwen2: its q, k and v projections carry biases, which the authors' Llama scripts never meet."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.Qwen2ForCausalLM(tf.Qwen2Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                                               num_key_value_heads=2, max_position_embeddings=64)).eval()
    with torch.no_grad():
        for block in model.model.layers:  # biases that differ from layer to layer (a fresh model's are zeros)
            for proj in ("q_proj", "k_proj", "v_proj"):
                getattr(block.self_attn, proj).bias.normal_()
    return model


@pytest.mark.searching
@pytest.mark.parametrize("spec, args, port", [("laco", {"as": "code"}, lambda m: _laco_merge(m, 3, 3)), ("swm", {}, lambda m: _swm_merge(m, 3, 6, 1.0))])
def test_a_model_with_biases_merges_as_the_authors_code_by_default_and_its_biases_by_a_setting(tmp_path, spec, args, port):
    """On a Qwen2 the authors' code merges the seven projection weights and leaves q, k and v's biases
    the base layer's: so does the default, tensor for tensor; `biases=true` merges them by the same
    rule (the run's last layer's, at LaCo's code and SWM's factor 1); the card says which."""
    model = _qwen2(8, 9)
    theirs = port(model)
    ours = _healed_checkpoint(model, (4, 5, 6), build_method(spec, args), tmp_path / "default")
    _same_weights(ours, theirs)
    q_bias = lambda m: m.model.layers[3].self_attn.q_proj.bias  # noqa: E731
    assert torch.equal(q_bias(ours), model.model.layers[3].self_attn.q_proj.bias)
    merged = _healed_checkpoint(model, (4, 5, 6), build_method(spec, {**args, "biases": "true"}), tmp_path / "biases")
    assert (q_bias(merged) - model.model.layers[6].self_attn.q_proj.bias).abs().max() < 1e-6
    assert (q_bias(merged) - q_bias(ours)).abs().max() > 0.1
    method = build_method(spec, args)
    method.prepare(HealContext(model=model, layers=(4, 5, 6), calibration=lambda tokens: []))
    assert "(its biases, self_attn.q_proj.bias, self_attn.k_proj.bias, self_attn.v_proj.bias, the base layer's own" in method.changes((4, 5, 6))


# --------------------------------------------------------------------------- what a merge says, pinned by value
LLAMA_WEIGHTS = ("self_attn.q_proj.weight, self_attn.k_proj.weight, self_attn.v_proj.weight, self_attn.o_proj.weight, "
                 "mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight")


@pytest.mark.searching
def test_every_text_a_merge_says_is_pinned_for_each_setting():
    """The card's lines, for both forms of LaCo, SWM at 1 and at 0.5, with and without biases, on a
    model with none (Llama) and one with q, k, v biases (Qwen2)."""
    from depthcurse.merging import projections_text

    llama, qwen = _llama(6, 1), _qwen2(6, 2)
    assert projections_text(llama.model.layers[0]) == projections_text(llama.model.layers[0], True) == LLAMA_WEIGHTS
    biases = "self_attn.q_proj.bias, self_attn.k_proj.bias, self_attn.v_proj.bias"
    assert projections_text(qwen.model.layers[0]) == (LLAMA_WEIGHTS + f" (its biases, {biases}, the base layer's own, as the authors' code leaves them)")
    assert projections_text(qwen.model.layers[0], True) == ("self_attn.q_proj.weight, self_attn.q_proj.bias, self_attn.k_proj.weight, "
                                                            "self_attn.k_proj.bias, self_attn.v_proj.weight, self_attn.v_proj.bias, "
                                                            "self_attn.o_proj.weight, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight")
    paper = "RDSC as LaCo's paper writes it (theta_l + sum_k (theta_l+k - theta_l))"
    code = "RDSC as LaCo's released code computes it (each difference from the updated base: the run's last layer)"
    said = {("laco", ()): paper, ("laco", (("as", "code"),)): code, ("swm", ()): "as SWM's code computes it, weight factor 1 (the window's last layer)",
            ("swm", (("weight_factor", "0.5"),)): "as SWM's code computes it, weight factor 0.5"}
    fresh = build_method("laco", {})  # before `prepare`: nothing merged, and the parameters named in general
    assert fresh.modules() == [] and fresh.changes((2,)).endswith(": its the attention and MLP parameters changed, its norms its own (as the authors' code leaves them)")
    before = list(llama.model.layers)
    with fresh.applied(llama):
        assert all(a is b for a, b in zip(llama.model.layers, before)) and len(llama.model.layers) == 6  # no layer placed
    for (spec, args), rule in said.items():
        method = build_method(spec, dict(args))
        assert method.rule_text() == rule and method.describe() == f"each removed run merged into the layer before it, {rule}"
        method.prepare(HealContext(model=llama, layers=(2, 3, 5), calibration=lambda tokens: []))
        assert method.changes((2, 3, 5)) == (f"layer 1 holds layers 1-3 merged ({rule}); layer 4 holds layers 4-5 merged ({rule}): its {LLAMA_WEIGHTS} "
                                            "changed, its norms its own (as the authors' code leaves them)")
        assert method.untouched((2, 3, 5)) == 1 and sorted(method.merged) == [1, 4] and method.state_dict() == {}
        assert method.modules() == [method.merged[1], method.merged[4]]
    with pytest.raises(DepthcurseError, match=r"^--method laco: as='theirs': use paper \(RDSC as the paper writes it\) or code \(as the released notebook computes it\)$"):
        build_method("laco", {"as": "theirs"})


@pytest.mark.searching
@pytest.mark.parametrize("value, ok", [(1.0, True), (0.5, True), (1e-9, True), (0.0, False), (1.0000001, False), (-0.5, False), (float("nan"), False),
                                       (float("inf"), False)])
def test_a_weight_factor_is_a_step_in_0_to_1_and_a_threshold_a_cosine_in_minus_1_to_1(value, ok):
    from depthcurse.merging import check_threshold, check_weight_factor

    if ok:
        check_weight_factor(value, "--method swm: weight_factor")
    else:
        with pytest.raises(DepthcurseError, match=rf"^--method swm: weight_factor={value}: a step towards each layer lies in \(0, 1\] \(SLM.py uses 1\)$"):
            check_weight_factor(value, "--method swm: weight_factor")
    threshold = value * 2 - 1  # (-1, 1]: 1.0 -> 1, 0.5 -> 0, 1e-9 -> just above -1; 0 -> -1 (refused), ...
    if ok:
        check_threshold(threshold, "laco")
    else:
        with pytest.raises(DepthcurseError, match=r"^--search-args laco.threshold=.*: a cosine similarity threshold lies in \(-1, 1\]$"):
            check_threshold(threshold, "laco")


@pytest.mark.searching
def test_a_run_that_cannot_merge_is_one_line_naming_the_layer_and_the_tensor():
    from depthcurse.merging import check_run, check_uniform

    model = _llama(5, 3)
    check_run(model, (2, 3), "--method laco")
    check_run(model, (1,), "--method laco")
    with pytest.raises(DepthcurseError, match=r"^--method swm: it merges each removed run into the layer before it, and layers 0-2 starts at layer 0, "
                                              r"which has none: remove from layer 1 on$"):
        check_run(model, (0, 1, 2), "--method swm")
    with pytest.raises(DepthcurseError, match=r"^--method laco: it merges each removed run into the layer before it, and layer 0 starts at layer 0"):
        check_run(model, (0,), "--method laco")
    with torch.no_grad():  # layer 3's up projection of another width
        model.model.layers[3].mlp.up_proj.weight = torch.nn.Parameter(torch.zeros(10, model.config.hidden_size))
    with pytest.raises(DepthcurseError, match=r"^--search swm: layer 3 differs from layer 1 in shape \(mlp.up_proj.weight\), so it cannot be merged into it$"):
        check_run(model, (2, 3), "--search swm")
    check_run(model, (2,), "--search swm")  # 2 into 1: neither is layer 3
    with pytest.raises(DepthcurseError, match=r"^--search laco: layer 3 differs from layer 2 in shape \(mlp.up_proj.weight\)"):
        check_uniform(model, "--search laco")
    other = _llama(5, 3)
    other.model.layers[2] = torch.nn.Identity()
    with pytest.raises(DepthcurseError, match=r"^--method laco: layer 2 differs from layer 1 in shape \(self_attn.q_proj.weight\)"):
        check_run(other, (2,), "--method laco")


@pytest.mark.searching
def test_a_merging_states_kept_and_gone_layers_and_the_short_stop_by_value():
    from depthcurse.merging import Merging, merged_away, rdsc_code, similarity_range

    model = _llama(6, 4)
    blocks = model.model.layers
    state = Merging.start(6)
    assert state.kept == [0, 1, 2, 3, 4, 5] and state.merged == {} and state.gone() == ()
    once = state.merge(blocks, 1, 3, rdsc_code)  # positions 2-3 into position 1
    assert once.kept == [0, 1, 4, 5] and once.gone() == (2, 3) and sorted(once.merged) == [1]
    twice = once.merge(blocks, 1, 2, rdsc_code)  # position 2 is layer 4 now: into the merged layer 1
    assert twice.kept == [0, 1, 5] and twice.gone() == (2, 3, 4) and sorted(twice.merged) == [1]
    close = lambda a, b: (a - b).abs().max() < 1e-7  # noqa: E731 (code's RDSC ends on the run's last layer, up to the additions' rounding)
    assert close(twice.merged[1].mlp.up_proj.weight, blocks[4].mlp.up_proj.weight)
    assert not close(twice.merged[1].mlp.up_proj.weight, blocks[3].mlp.up_proj.weight)
    again = twice.merge(blocks, 0, 1, rdsc_code)  # the merged layer 1 into layer 0: it goes, its merge with it
    assert again.kept == [0, 5] and sorted(again.merged) == [0] and close(again.merged[0].mlp.up_proj.weight, blocks[4].mlp.up_proj.weight)
    trail = [(3, 4, 0.91234), (2, 3, 0.5), (1, 2, 0.99999)]
    assert similarity_range(trail) == "0.5000-1.0000"
    assert merged_away("swm", twice, trail, 3, 0.9) == (2, 3, 4)
    with pytest.raises(DepthcurseError, match=r"^--search swm merged 3 of k = 4 layers away at threshold 0.9 \(similarities 0.5000-1.0000\): "
                                              r"lower swm.threshold$"):
        merged_away("swm", twice, trail, 4, 0.9)


def _search_context(model, windows, k, phases=None):
    from depthcurse.select.search import SearchContext

    return SearchContext(space=Space(len(model.model.layers), k), objective="kl", score=None, score_many=None, score_on=None, windows=len(windows),
                         window_tokens=windows.shape[1], streams=None, seed=0, model=model, calibration=windows,
                         phase=(phases.append if phases is not None else (lambda text: None)))


@pytest.mark.searching
def test_the_merge_searches_check_every_bound_and_run_through_the_contract_by_value():
    """Each setting's edge refused or passed by value (laco: merge_layers 2, interval 1, lowest and
    highest at their ends; swm: three layers at least), and a run through `SearchContext`: the
    procedure's layers, its note and its phases, the same as the procedure called alone."""
    import re

    space = Space(8, 2)
    for spec, args in (("laco", {"merge_layers": "2", "interval": "1", "lowest": "5", "highest": "7"}), ("laco", {"threshold": "1"}),
                       ("laco", {"lowest": "0", "highest": "7", "merge_layers": "7"}), ("swm", {"threshold": "1", "weight_factor": "1"})):
        build_search(spec, args).check(space)
    for spec, args, said in (
            ("laco", {"merge_layers": "1"}, "--search-args laco: merge_layers (1) must be at least 2 and interval (1) at least 1"),
            ("laco", {"interval": "0"}, "--search-args laco: merge_layers (7) must be at least 2 and interval (0) at least 1"),
            ("laco", {"merge_layers": "2", "lowest": "6", "highest": "7"}, "--search-args laco: lowest 6, highest 7 and merge_layers 2 leave no run to "
                                                                            "merge in 8 layers (0 <= lowest <= highest - merge_layers, highest < 8)"),
            ("laco", {"merge_layers": "2", "lowest": "-1"}, "--search-args laco: lowest -1, highest 7 and merge_layers 2 leave no run"),
            ("laco", {"merge_layers": "2", "highest": "8"}, "--search-args laco: lowest 0, highest 8 and merge_layers 2 leave no run"),
            ("laco", {"merge_layers": "8"}, "--search-args laco: lowest 0, highest 7 and merge_layers 8 leave no run"),
            ("swm", {"weight_factor": "0"}, "--search-args swm.weight_factor=0.0: a step towards each layer lies in (0, 1] (SLM.py uses 1)")):
        with pytest.raises(DepthcurseError, match="^" + re.escape(said)):
            build_search(spec, args).check(space)
    with pytest.raises(DepthcurseError, match=r"^--search swm slides a window under the last layer: 2 layers leave none$"):
        build_search("swm", {}).check(Space(2, 1))
    build_search("swm", {}).check(Space(3, 1))

    model, windows = _llama(10, 3), _windows()
    for spec, settings, procedure, note in (
            ("laco", LacoSearchSettings(merge_layers=3, threshold=-0.99, highest=9), laco_procedure, r"^\d+ merges tried, \d+ kept; similarities "),
            ("swm", SwmSearchSettings(threshold=-0.99), swm_procedure, r"^\d+ windows tried; similarities ")):
        search = build_search(spec, {"threshold": "-0.99", **({"merge_layers": "3", "highest": "9"} if spec == "laco" else {})})
        phases = []
        ctx = _search_context(model, windows, 3, phases)
        chosen = search.run(ctx)
        state, trail = procedure(model, windows, settings, stop_at=3)
        assert chosen == state.gone() and len(chosen) == 3
        kept = sum(1 for t in trail if t[3])
        lo, hi = min(t[2] for t in trail), max(t[2] for t in trail)
        said = (f"{len(trail)} merges tried, {kept} kept" if spec == "laco" else f"{len(trail)} windows tried") + f"; similarities {lo:.4f}-{hi:.4f}"
        assert ctx.notes == [said] and re.match(note, said)
        assert len(phases) == len(trail) and phases[0].endswith(f"similarity {trail[0][2]:.4f}")
        assert phases[0].startswith("layer 6 with 2 above" if spec == "laco" else "window 7-8")
        with pytest.raises(DepthcurseError, match=rf"^--search {spec} merged \d of k = 3 layers away at threshold 0.9999"):
            build_search(spec, {"threshold": "0.9999", **({"merge_layers": "3", "highest": "9"} if spec == "laco" else {})}).run(_search_context(model, windows, 3))


@pytest.mark.searching
def test_the_procedures_edges_against_the_authors_loops():
    """LaCo with runs of 5 in 10 layers, every merge kept: the run is cut where the model ends (the
    notebook's min(merge_layer_num, len - base - 1)), and `highest` unset is the last layer; with k
    the trail ends at the merge that reaches it. SWM at weight factor 0.5, and at a threshold every
    window passes: its window grows to the bottom (low 0) and, as SLM.py, merges nothing it did not
    refuse. Biases merge through the procedures where asked."""
    model, windows = _llama(10, 3), _windows()
    state, trail = laco_procedure(model, windows, LacoSearchSettings(merge_layers=5, threshold=-0.99, as_="code"))
    _same_weights(_merged_state_model(model, state), _laco_loop(model, windows, 5, 1, 0, 9, -0.99))
    assert trail[0][:2] == (4, 4) and trail[1][:2] == (3, 2)  # from 9 - 5 = 4; then cut to the 2 layers left above layer 3
    stopped, short = laco_procedure(model, windows, LacoSearchSettings(merge_layers=3, threshold=-0.99, highest=9), stop_at=3)
    assert short[-1][3] and sum(t[1] for t in short if t[3]) == 3 == len(stopped.gone())

    deep = _llama(10, 4)
    state, trail = swm_procedure(deep, _windows(seed=1), SwmSearchSettings(threshold=0.9, weight_factor=0.5))
    _same_weights(_merged_state_model(deep, state), _swm_loop(deep, _windows(seed=1), 0.9, weight_factor=0.5))
    state, trail = swm_procedure(deep, _windows(seed=1), SwmSearchSettings(threshold=-0.99))
    assert [t[:2] for t in trail] == [(low, 8) for low in range(7, -1, -1)] and state.gone() == ()
    _same_weights(_merged_state_model(deep, state), _swm_loop(deep, _windows(seed=1), -0.99))

    qwen = _qwen2(8, 9)
    bias = lambda st: st.merged[min(st.merged)].self_attn.q_proj.bias  # noqa: E731
    for procedure, make in ((laco_procedure, lambda b: LacoSearchSettings(merge_layers=3, threshold=-0.99, biases=b)),
                            (swm_procedure, lambda b: SwmSearchSettings(threshold=-0.99, biases=b))):
        kept, _ = procedure(qwen, _windows(), make(False), stop_at=2)
        merged, _ = procedure(qwen, _windows(), make(True), stop_at=2)
        base = min(kept.merged)
        assert torch.equal(bias(kept), qwen.model.layers[base].self_attn.q_proj.bias) and not torch.equal(bias(merged), bias(kept))
