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


def _swm_loop(model, windows, threshold):
    """SLM.py's main loop (weight_factor=1, as it calls the merge)."""
    reference = _hidden(model, windows)
    short_model = model
    high_lay = len(short_model.model.layers) - 1 - 1
    low_lay = high_lay - 1
    while low_lay >= 0:
        tmp = _swm_merge(short_model, low_lay, high_lay, weight_factor=1)
        if _sim(reference, tmp, windows) > threshold:
            low_lay -= 1
        elif low_lay + 1 != high_lay:
            short_model = _swm_merge(short_model, low_lay + 1, high_lay, weight_factor=1)
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


@pytest.mark.parametrize("factor", [1.0, 0.5])
def test_swm_is_the_released_scripts_merge_tensor_for_tensor(tmp_path, factor):
    model = _llama(8, 6)
    theirs = _swm_merge(model, 2, 5, factor)
    ours = _healed_checkpoint(model, (3, 4, 5), build_method("swm", {"weight_factor": str(factor)}), tmp_path / "swm")
    _same_weights(ours, theirs)


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
def test_bad_merges_are_one_line_naming_the_method_and_the_setting(spec, args, layers, match):
    import re

    with pytest.raises(DepthcurseError, match=re.escape(match)):
        method = build_method(spec, args)
        method.check(tiny_llama(300, layers=6), layers)


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
    code, out, err = run_cli("heal", bos_model_dir, "--layers", "0-1", "--methods", "laco", "--data", docs_file, "--out", tmp_path / "bad")
    assert_one_line_error(code, out, err, "--method laco: it merges each removed run into the layer before it")


# --------------------------------------------------------------------------- the selection procedures
def _windows(n=3, tokens=12, seed=0):
    return torch.randint(3, 300, (n, tokens), generator=torch.Generator().manual_seed(seed))


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


@pytest.mark.parametrize("threshold", [0.99, 0.9, 0.5])
def test_lacos_procedure_is_the_notebooks_loop(threshold):
    model = _llama(10, 3)
    windows = _windows()
    settings = LacoSearchSettings(merge_layers=3, interval=1, threshold=threshold, lowest=0, highest=9, as_="code")
    state, trail = laco_procedure(model, windows, settings)
    theirs = _laco_loop(model, windows, 3, 1, 0, 9, threshold)
    _same_weights(_merged_state_model(model, state), theirs)
    assert len(theirs.model.layers) == 10 - len(state.gone())


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


@pytest.mark.parametrize("threshold", [0.99, 0.9, 0.5])
def test_swms_procedure_is_the_scripts_loop(threshold):
    model = _llama(10, 4)
    windows = _windows(seed=1)
    state, trail = swm_procedure(model, windows, SwmSearchSettings(threshold=threshold))
    theirs = _swm_loop(model, windows, threshold)
    _same_weights(_merged_state_model(model, state), theirs)


def test_swm_stops_at_k_with_the_window_that_reaches_it():
    model = _llama(10, 4)
    state, trail = swm_procedure(model, _windows(seed=1), SwmSearchSettings(threshold=-0.99), stop_at=4)
    assert state.gone() == (5, 6, 7, 8) and list(state.merged) == [4]  # one window grown down from 7-8 until four are gone


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
