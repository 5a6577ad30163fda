"""Every way `heal` wins back a removal: a linear map folded into the weights (ReplaceMe), a trained
replacement layer (LLM-Streamline), LoRA after the map, adapters after the first removed layer,
and the comparison of them all, on tiny models built here.

The references are independent of the code under test: least squares on activations captured
here, a model built without the layers with the map as a separate module or the trained layer
copied in by hand, an uninterrupted run, a single heal by each method.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from families import FAMILIES, family_model
from helpers import assert_one_line_error, built_without, heal_config, held_out_windows, tiny_llama

from depthcurse.heal import HealConfig, HealContext, build_method, heal, heal_methods, Models
from depthcurse.heal.adapters import target_modules
from depthcurse.heal.linear import estimate_maps, fold_maps, mapped, solve_map
from depthcurse.heal.objective import HealObjective
from depthcurse.loading import load_model
from depthcurse.train.metrics import METRICS, MetricsLog

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _cfg(docs_file, **kw) -> HealConfig:
    options = dict(layers=(2, 3), data=str(docs_file), steps=6, batch_size=4, seq_len=24, lr=5e-3, eval_windows=4, save_every=2, lora_rank=4, calib_tokens=240)
    return heal_config(**{**options, **kw})


def _maps(folder):
    return {int(k): t for k, t in torch.load(folder / "method.pt", weights_only=True)["state"]["maps"].items()}


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_the_solver_recovers_a_known_map_exactly():
    """Targets made as the stream plus the MLP output times a map: the map comes back."""
    gen = torch.Generator().manual_seed(0)
    d, tokens = 12, 200
    m, y = torch.randn(tokens, d, generator=gen, dtype=torch.float64), torch.randn(tokens, d, generator=gen, dtype=torch.float64)
    t = torch.randn(d, d, generator=gen, dtype=torch.float64)
    target = y + m @ t
    torch.testing.assert_close(solve_map(m.T @ m, m.T @ (target - y - m)), t, rtol=0, atol=1e-9)
    # a ridge pulls the map toward the identity, the plain removal
    far = solve_map(m.T @ m, m.T @ (target - y - m), ridge=1e6)
    assert (far - torch.eye(d)).abs().max() < 1e-4
    # fewer tokens than dimensions: still a map that gives the targets (the smallest correction)
    few = m[:5]
    fitted = solve_map(few.T @ few, few.T @ (target[:5] - y[:5] - few))
    torch.testing.assert_close(y[:5] + few @ fitted, target[:5], rtol=0, atol=1e-8)


def test_the_maps_are_least_squares_on_the_models_own_activations_each_run_after_the_earlier_ones():
    """Runs (1,) and (3, 4) of a 6-layer model. Each map, by least squares on the data matrix
    (torch.linalg.lstsq on the tokens, not the normal equations), from activations taken here with
    output_hidden_states and a hook: the first on the unpruned model, the second on a model built
    without layer 1 with the first map folded in by hand, both against the unpruned model's stream."""
    model = tiny_llama(300, layers=6, seed=3)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(3, 300, (2, 20), generator=gen) for _ in range(3)]  # 120 tokens for 32 dimensions
    maps = estimate_maps(model, (1, 3, 4), batches)
    assert set(maps) == {1, 3}

    def reference(net, before: int, target_index: int, unpruned) -> torch.Tensor:
        ms, outs = [], []
        with torch.no_grad():
            targets = [unpruned(input_ids=ids, output_hidden_states=True).hidden_states[target_index] for ids in batches]
        handle = net.model.layers[before].mlp.register_forward_hook(lambda mod, a, out: ms.append(out))
        try:
            for ids in batches:
                with torch.no_grad():
                    outs.append(net(input_ids=ids, output_hidden_states=True).hidden_states[before + 1])
        finally:
            handle.remove()
        m, out, target = (torch.cat(x).flatten(0, 1).double() for x in (ms, outs, targets))
        return torch.eye(m.shape[1], dtype=torch.float64) + torch.linalg.lstsq(m, target - out).solution

    first = reference(model, 0, 2, model)
    torch.testing.assert_close(maps[1], first, rtol=1e-5, atol=1e-6)
    without_1 = built_without(model, "model.layers", [1])
    down = without_1.model.layers[0].mlp.down_proj
    with torch.no_grad():
        down.weight.copy_((first.T @ down.weight.double()).float())
    torch.testing.assert_close(maps[3], reference(without_1, 1, 5, model), rtol=1e-4, atol=1e-5)  # the map folded into fp32 weights here, applied after the MLP there


def _with_map_module(model, removed, maps):
    """The reference for a folded checkpoint: built without the layers, each map a Linear after its MLP."""
    ref = built_without(model, "model.layers", list(removed))
    kept = [i for i in range(len(model.model.layers)) if i not in removed]
    for first, t in maps.items():
        at = kept.index(first - 1)
        linear = nn.Linear(t.shape[0], t.shape[0], bias=False)
        with torch.no_grad():
            linear.weight.copy_(t.T.float())  # x -> x W^T = x T
        ref.model.layers[at].mlp = nn.Sequential(ref.model.layers[at].mlp, linear)
    return ref.eval()


def test_linear_folds_its_maps_into_a_checkpoint_with_n_minus_k_layers(bos_model_dir, docs_file, tmp_path):
    """The folded checkpoint's logits are the unpruned architecture less k layers with each map as
    a separate module (fp32, 1e-5), and the held-out loss heal.json gives is that model's."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "linear"
    record = heal(load_model(str(bos_model_dir)), _cfg(docs_file, method="linear", layers=(1, 3)), out)
    maps = _maps(out)
    assert set(maps) == {1, 3} and not (out / "checkpoint.pt").exists()  # nothing trained, nothing to resume
    reference = _with_map_module(AutoModelForCausalLM.from_pretrained(bos_model_dir).eval(), (1, 3), maps)
    folded = AutoModelForCausalLM.from_pretrained(out / "hf").eval()
    assert folded.config.num_hidden_layers == 3 and record["hf_layers"] == 3
    assert not any("Sequential" in type(m).__name__ for m in folded.modules())  # no new module
    ids = torch.randint(3, 300, (2, 19), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(_logits(folded, ids), _logits(reference, ids), rtol=0, atol=1e-5)
    windows = held_out_windows(load_model(str(bos_model_dir)).tokenizer, docs_file, 24, 4)
    logp = _logits(reference, windows)[:, :-1].log_softmax(-1).flatten(0, 1)
    expected = torch.nn.functional.nll_loss(logp, windows[:, 1:].flatten()).item()
    assert record["results"]["healed"]["held_out"]["metrics"]["loss"] == pytest.approx(expected, rel=1e-5)  # what was measured is what was saved
    cost = record["cost"]
    assert cost["method"] == "linear" and cost["tokens"] == 240 and cost["seconds"] > 0 and cost["trained_params"] == cost["added_params"] == 0
    assert cost["solved_params"] == 2 * 32 * 32 and cost["calibration"]["tokens"] == 240 and cost["training"] is None
    assert record["results"]["healed"]["held_out"]["metrics"]["kl"] < record["results"]["pruned"]["held_out"]["metrics"]["kl"]


# where a map cannot be folded into the MLP before the cut (layer 1 of the tiny models), and why
CANNOT_FOLD = {"gemma2": "puts a norm (Gemma2RMSNorm) between its MLP and the stream", "gemma3": "puts a norm (Gemma3RMSNorm) between its MLP and the stream",
               "olmo2": "puts a norm (Olmo2RMSNorm) between its MLP and the stream", "glm4": "puts a norm (Glm4RMSNorm) between its MLP and the stream",
               "granite": "puts a residual multiplier (0.5) between its MLP and the stream", **{f: "as a dense linear layer (fused experts?)" for f in (
                   "gpt_oss", "llama4", "mixtral", "olmoe", "qwen3_moe")},
               "granitemoe": "puts a residual multiplier (0.5) between its MLP and the stream"}
# GPT-2 (its MLP's output projection a Conv1D, weight transposed) and BLOOM (its MLP adds the residual itself) besides the prune families
LINEAR_FAMILIES = {**{name: lambda name=name: family_model(name) for name in FAMILIES},
                   "gpt2": lambda: _big(__import__("transformers").GPT2LMHeadModel(__import__("transformers").GPT2Config(
                       vocab_size=128, n_embd=32, n_layer=5, n_head=4, n_positions=64))),
                   "bloom": lambda: _big(__import__("transformers").BloomForCausalLM(__import__("transformers").BloomConfig(
                       vocab_size=128, hidden_size=32, n_layer=5, n_head=4)))}


def _big(model):
    """Weights large enough that every layer visibly changes the output, as `family_model`'s."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    return model.eval()


@pytest.mark.parametrize("family", sorted(LINEAR_FAMILIES))
def test_a_folded_map_in_the_saved_checkpoint_equals_the_map_as_a_module_in_every_family_or_one_line_says_why(family, tmp_path):
    """The model measured (each map a step after the MLP output projection) against the checkpoint
    saved from it (folded into the projection: Llama's down_proj, GPT-NeoX's dense_4h_to_h, Phi's
    fc2, GPT-2's Conv1D, BLOOM's and Falcon's parallel blocks...) and loaded back, or the reason it
    cannot be folded exactly: post-norms (Gemma 2/3, OLMo-2), a scale or norm after the MLP
    (Granite, GLM-4), experts."""
    from transformers import AutoModelForCausalLM

    from depthcurse.errors import DepthcurseError
    from depthcurse.heal.healed import Healed
    from depthcurse.surgery import removed_layers

    model = LINEAR_FAMILIES[family]()
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    try:
        maps = estimate_maps(model, (2,), [ids])
    except DepthcurseError as exc:
        assert family in CANNOT_FOLD and CANNOT_FOLD[family] in str(exc), exc
        return
    assert family not in CANNOT_FOLD
    assert (maps[2] - torch.eye(32, dtype=maps[2].dtype)).abs().max() > 1e-3  # a map that does something
    # least squares on activations taken here: the projection's own output (a copy, before a block
    # adds to it in place, as Falcon does), the stream block 1 leaves and the one block 2 leaves
    from depthcurse.heal.linear import output_projection
    from depthcurse.surgery import find_blocks

    seen = []
    hook = output_projection(find_blocks(model).layers[1], "layer 1").register_forward_hook(lambda mod, a, out: seen.append(out.detach().clone()))
    with torch.no_grad():
        states = model(input_ids=ids, output_hidden_states=True).hidden_states
    hook.remove()
    m, out, target = seen[0].flatten(0, 1).double(), states[2].flatten(0, 1).double(), states[3].flatten(0, 1).double()
    reference = torch.eye(32, dtype=torch.float64) + torch.linalg.lstsq(m, target - out).solution
    torch.testing.assert_close(maps[2], reference, rtol=1e-4, atol=1e-4)
    with mapped(model, maps), removed_layers(model, (2,)):
        measured = _logits(model, ids)
    method = build_method("linear")
    method.maps = maps
    Healed(model, (2,), method).save(None, tmp_path / "hf")
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    torch.testing.assert_close(_logits(saved, ids), measured, rtol=1e-4, atol=1e-4)
    assert saved.config.num_hidden_layers == 4 if hasattr(saved.config, "num_hidden_layers") else True
    with removed_layers(model, (2,)):
        torch.testing.assert_close(_logits(model, ids), _logits(model, ids))  # the model in memory is left as it was
    fold_maps(model, maps)  # and folding in place gives the same
    with removed_layers(model, (2,)):
        torch.testing.assert_close(_logits(model, ids), measured, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_replacement_layer_is_called_as_the_model_calls_its_first_layer_in_every_family(family):
    """A copy of layer 1 put in for the run (1,) gives what layer 1 gives: a zero loss and the
    model's own logits; for the run (1, 2) it is the run's output it is measured against."""
    from depthcurse.heal.replacement import ReplacementObjective, replaced

    model = family_model(family)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    targets = torch.roll(ids, -1, 1)
    own = _logits(model, ids)
    one = ReplacementObjective(model, (1,)).eval()
    assert one(ids, targets).item() == 0
    with replaced(model, one.replaced(), (1,)):
        torch.testing.assert_close(_logits(model, ids), own, rtol=0, atol=0)
    assert ReplacementObjective(model, (1, 2)).eval()(ids, targets).item() > 0


def test_layer_trains_one_layer_per_run_saves_it_in_place_and_resumes_exactly(bos_model_dir, docs_file, tmp_path):
    """Runs (1,) and (3, 4)... here (2, 3): one new layer where layer 2 stood. The saved checkpoint
    (n - k + 1 layers) is a model built without layer 3 with the trained weights copied into layer 2
    by hand; an interrupted run resumed equals an uninterrupted one."""
    from transformers import AutoModelForCausalLM

    cfg = _cfg(docs_file, method="layer", steps=6, save_every=2, lr=1e-2)
    whole = heal(load_model(str(bos_model_dir)), cfg, tmp_path / "whole")
    assert heal(load_model(str(bos_model_dir)), cfg, tmp_path / "cut", stop_after=3) is None  # checkpoint at step 2
    resumed = heal(load_model(str(bos_model_dir)), cfg, tmp_path / "cut")
    trained = [torch.load(tmp_path / d / "checkpoint.pt", weights_only=True)["trained"] for d in ("whole", "cut")]
    assert trained[0].keys() == trained[1].keys() and all(torch.equal(trained[0][k], trained[1][k]) for k in trained[0])
    rows = [[{k: v for k, v in r.items() if k != "tokens_per_s"} for r in MetricsLog(tmp_path / d / METRICS).rows()] for d in ("whole", "cut")]
    assert len(rows[0]) == 6 and rows[0] == rows[1]
    assert whole["results"]["healed"] == resumed["results"]["healed"]

    reference = built_without(AutoModelForCausalLM.from_pretrained(bos_model_dir).eval(), "model.layers", [3])
    prefix = "replacements.2."
    state = {k.removeprefix(prefix): v for k, v in trained[0].items()}
    assert all(k.startswith(prefix) for k in trained[0])
    reference.model.layers[2].load_state_dict(state)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "whole" / "hf").eval()
    assert saved.config.num_hidden_layers == 4 and whole["hf_layers"] == 4
    ids = torch.randint(3, 300, (2, 19), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(_logits(saved, ids), _logits(reference, ids), rtol=0, atol=1e-5)
    layer_params = sum(p.numel() for p in reference.model.layers[2].parameters())
    cost = whole["cost"]
    assert cost["trained_params"] == cost["added_params"] == layer_params and cost["tokens"] == 6 * 4 * 23 and cost["training"]["steps"] == 6


def test_the_distillation_teacher_is_the_unpruned_model_with_maps_and_shared_blocks():
    """`linear+lora` distilling after the first removed layer: the teacher is the unpruned model
    exactly (no map, no adapter, every layer); sharing the first blocks with it gives the student
    the same loss and gradients as running them again, and runs them once per batch."""
    model = tiny_llama(300, layers=6, seed=2)
    ids = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(0))
    targets = torch.roll(ids, -1, 1)
    own = _logits(model, ids)
    linear = build_method("linear")
    linear.maps = estimate_maps(model, (3, 4), [ids])
    lora = build_method("lora", {"targets": "all", "lora_rank": 4, "lora_alpha": 8, "lora_dropout": 0.0, "adapt": "after", "loss": "distill"})
    ctx = HealContext(model=model, layers=(3, 4), calibration=None, earlier=[linear])
    lora.prepare(ctx)
    assert {int(n.split("layers.")[1].split(".")[0]) for n in target_modules(model, (3, 4), "all", after=3)} == {5}
    for name, p in lora.peft.named_parameters():
        if "lora_B" in name:
            with torch.no_grad():
                p.normal_()
    chosen = {(m, a): build_method(m, {"adapt": a}).untouched((3, 4)) for m in ("lora", "linear+lora") for a in ("all", "after")}
    assert chosen == {("lora", "all"): 0, ("linear+lora", "all"): 0, ("lora", "after"): 3, ("linear+lora", "after"): 2}
    assert lora.objective(ctx).shared_blocks == 2  # what a heal by linear+lora shares
    runs = {}
    calls = []
    handle = model.model.layers[0].register_forward_hook(lambda *a: calls.append(1))
    try:
        for shared in (0, 2):  # blocks 0-1: before block 2, whose MLP output the map changes
            objective = HealObjective(ctx, lora, "distill", [model], shared_blocks=shared)
            teacher, _ = objective.teacher_logits(ids)
            torch.testing.assert_close(teacher, own, rtol=0, atol=0)
            calls.clear()
            loss = objective(ids, targets)
            grads = torch.autograd.grad(loss, [p for p in objective.parameters() if p.requires_grad])
            runs[shared] = (loss.detach(), grads, len(calls))
    finally:
        handle.remove()
    torch.testing.assert_close(runs[2][0], runs[0][0], rtol=1e-6, atol=1e-6)
    for a, b in zip(runs[2][1], runs[0][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert (runs[0][2], runs[2][2]) == (2, 1)  # block 0 ran for the teacher and the student, then once


def test_adapters_after_the_cut_train_only_there_and_the_comparison_is_each_method_alone(bos_model_dir, docs_file, tmp_path):
    """`heal_methods`: each method's entry is what a heal by that method alone gives, on the same
    unpruned and pruned measurements; `--adapt after` puts adapters on the blocks after layer 2 only."""
    cfg = _cfg(docs_file, steps=3, adapt="after", every_method=True)
    compared = heal_methods(load_model(str(bos_model_dir)), Models(load_model(str(bos_model_dir)), lambda: load_model(str(bos_model_dir))),
                            cfg, ("lora", "linear"), tmp_path / "both")
    assert compared["run"]["methods"] == ["lora", "linear"] and set(compared["methods"]) == {"lora", "linear"}
    for method in ("lora", "linear"):
        alone = heal(load_model(str(bos_model_dir)), _cfg(docs_file, steps=3, adapt="after", method=method), tmp_path / method)
        entry = compared["methods"][method]
        assert entry["results"] == alone["results"]["healed"] and entry["recovered"] == alone["recovered"]
        assert compared["results"]["pruned"] == alone["results"]["pruned"] and compared["results"]["unpruned"] == alone["results"]["unpruned"]
    adapters = torch.load(tmp_path / "both" / "lora" / "checkpoint.pt", weights_only=True)["trained"]
    assert {int(k.split("layers.")[1].split(".")[0]) for k in adapters} == {4}  # of 0, 1, 4 kept: after layer 2 only
    from depthcurse.report import write_report

    page = write_report([tmp_path / "both"], tmp_path / "page.md").read_text()
    assert "every method on the same removal" in page and "linear map (ReplaceMe)" in page and "seconds" in page


def test_a_healed_curve_takes_several_methods(bos_model_dir, docs_file, tmp_path):
    from depthcurse.heal import heal_curve, plot_heal_curve

    sets = {1: (3,), 2: (2, 3)}
    curve = heal_curve(load_model(str(bos_model_dir)), lambda: load_model(str(bos_model_dir)), _cfg(docs_file, steps=2), sets, "by hand",
                       tmp_path / "curve", methods=("linear", "layer"))
    assert [sorted(p["methods"]) for p in curve["points"]] == [["layer", "linear"]] * 2
    assert (tmp_path / "curve" / "k002" / "layer" / "hf" / "config.json").is_file()
    assert plot_heal_curve(curve, tmp_path / "heal.png").read_bytes()[:4] == b"\x89PNG"


def test_a_healed_curve_by_one_method_names_that_method(bos_model_dir, docs_file, tmp_path):
    """A curve healed by `linear` alone says `linear` in its table, its points and its figure, and
    a curve written before its points named their method reads the curve's `run`."""
    from rich.console import Console

    from depthcurse.heal import curve_table, heal_curve, methods_of

    curve = heal_curve(load_model(str(bos_model_dir)), lambda: load_model(str(bos_model_dir)), _cfg(docs_file, steps=2, method="linear"), {1: (3,)},
                       "by hand", tmp_path / "curve")
    console = Console(record=True, width=400)
    console.print(curve_table(curve))
    text = console.export_text()
    assert "linear map (ReplaceMe)" in text and " linear " in text and "lora" not in text.lower()
    assert [list(methods_of(p)) for p in curve["points"]] == [["linear"]]
    older = {**curve, "points": [{k: v for k, v in p.items() if k != "method"} for p in curve["points"]]}
    console = Console(record=True, width=400)
    console.print(curve_table(older))
    assert "lora" not in console.export_text().lower()


def test_heal_methods_on_the_command_line_and_their_bad_input(run_cli, bos_model_dir, docs_file, tmp_path):
    base = ["heal", bos_model_dir, "--calibration", docs_file, "--steps", "2", "--batch-size", "2", "--seq-len", "24", "--eval-windows", "2"]
    assert_one_line_error(*run_cli(*base, "--layers", "2", "--methods", "linear,layer", "--lora-rank", "2"), "--lora-rank does not apply to any of --methods linear,layer")
    base += ["--calib-tokens", "96"]
    code, stdout, err = run_cli(*base, "--layers", "2", "--methods", "linear,layer", "--out", tmp_path / "cli")
    assert code == 0, err
    text = " ".join(stdout.split())
    assert "every method on the same removal" in text and (tmp_path / "cli" / "layer" / "hf" / "config.json").is_file()
    assert "…" not in stdout  # written to a pipe, not a terminal: the table as wide as its cells, none cut
    assert_one_line_error(*run_cli(*base, "--layers", "2", "--method", "magic"), "unknown --method 'magic': use ffn, laco, layer, linear, linear-cosine, linearpatch, lora")
    assert_one_line_error(*run_cli(*base, "--layers", "2", "--methods", "lora,magic"), "unknown --method 'magic'")
    assert_one_line_error(*run_cli(*base, "--layers", "0,1", "--method", "linear"), "layer 0 (removed with layers 0-1) has none before it")
    assert_one_line_error(*run_cli(*base, "--layers", "2", "--method", "linear", "--calib-tokens", "0"), "--calib-tokens must be at least 1, got 0")
    # a 32 x 32 least-squares map from 24 tokens: its Gram matrix singular, the "healed" model worse than the plain removal
    assert_one_line_error(*run_cli(*base, "--layers", "2", "--method", "linear", "--calib-tokens", "24"),
                          "--method linear's 32 x 32 least-squares map (calib_tokens 24) is fitted on 24 tokens, fewer than 1 x its 32 inputs: under-determined, it would be "
                          "the minimum-norm map, which cannot recover even the identity; give --calib-tokens 32 or more, or accept it with --method-args min_fit_ratio=0.75")
    assert_one_line_error(*run_cli(*base, "--layers", "2", "--methods", "linear,layer,linear"), "--methods linear,layer,linear: linear given more than once")
    assert_one_line_error(*run_cli(*base, "--layers", "2", "--method", "linear", "--eval-windows", "1"), "--eval-windows must be at least 2, got 1")
    assert_one_line_error(*run_cli(*base, "--layers", "2", "--method", "linear", "--ridge", "-1"), "--ridge must be 0 or more, got -1.0")
    assert_one_line_error(*run_cli(*base, "--layers", "2", "--method", "linear", "--loss", "distill"), "--loss does not apply to --method linear (its settings: calib_tokens, min_fit_ratio, ridge)")
    lora = [a for a in base if a not in ("--calib-tokens", "96")]
    assert_one_line_error(*run_cli(*lora, "--layers", "4", "--adapt", "after"), "--adapt after puts adapters on the kept blocks after layer 4, and there is none")
    assert_one_line_error(*run_cli(*lora, "--layers", "2", "--adapt", "before"), "unknown --adapt 'before'")
    assert_one_line_error(*run_cli(*base, "--layers", "2"), "--calib-tokens does not apply to --method lora")
    assert_one_line_error(*run_cli(*lora, "--layers", "2", "--method-args", "rank"), "--method-args 'rank': give key=value pairs")
    assert_one_line_error(*run_cli(*lora, "--layers", "2", "--method-args", "rank=4"), "--method-args rank does not apply to --method lora (its settings: adapt,")
    assert_one_line_error(*run_cli(*lora, "--layers", "2", "--method-args", "lora_rank=four"), "--method-args lora_rank=four: lora's lora_rank takes int")
    assert_one_line_error(*run_cli(*base, "--layers", "2", "--method", "linear", "--methods", "lora,layer"), "give --method M or --methods M,M,..., not both")
    # --method lora, the default, given with --methods: refused too (it was dropped silently)
    assert_one_line_error(*run_cli(*base, "--layers", "2", "--method", "lora", "--methods", "linear"), "not both (--method lora with --methods linear)")

    from transformers import Gemma2Config, Gemma2ForCausalLM

    from transformers import AutoTokenizer

    gemma = tmp_path / "gemma2"
    Gemma2ForCausalLM(Gemma2Config(vocab_size=len(AutoTokenizer.from_pretrained(bos_model_dir)), hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=8, pad_token_id=2, bos_token_id=3, eos_token_id=1)).save_pretrained(gemma)
    (bos_model_dir / "tokenizer.json").exists() and [__import__("shutil").copy(f, gemma) for f in bos_model_dir.glob("*token*")]
    assert_one_line_error(*run_cli(*base[:1], gemma, *base[2:], "--layers", "2", "--method", "linear"),
                          "--method linear cannot heal Gemma2ForCausalLM without layers 2: it folds a map into the MLP output of layer 1, before layer 2, but Gemma2DecoderLayer "
                          "puts a norm (Gemma2RMSNorm) between its MLP and the stream, which a folded linear map cannot pass")
    assert_one_line_error(*run_cli(*base[:1], gemma, *base[2:], "--layers", "2", "--method", "linear+lora"), "--method linear+lora cannot heal Gemma2ForCausalLM")
    # a comparison runs the methods that can, and says which could not, and why
    code, stdout, err = run_cli(*base[:1], gemma, *base[2:], "--layers", "2", "--methods", "layer,linear", "--out", tmp_path / "gemma-both")
    assert code == 1 and "not every method ran: linear could not" in err, err  # the table is written; the exit code says not all ran
    compared = json.loads((tmp_path / "gemma-both" / "heal.json").read_text())
    assert list(compared["methods"]) == ["layer"] and "puts a norm (Gemma2RMSNorm)" in compared["refused"]["linear"]
    assert "- could not run: linear: --method linear cannot heal" in " ".join(stdout.split())  # a verdict line after the table


def test_two_gloo_ranks_estimate_and_train_as_one_process(bos_model_dir, docs_file, tmp_path):
    """`linear` shares its calibration rows among the ranks and adds up their sums; `layer` trains
    its new layers under DDP on each rank's half of every batch: both as one process does."""
    from helpers import torchrun

    two = torchrun("-m", "depthcurse", "heal", bos_model_dir, "--layers", "2,3", "--methods", "linear,layer", "--calibration", docs_file, "--steps", "4",
                   "--batch-size", "4", "--seq-len", "24", "--lr", "5e-3", "--eval-windows", "2", "--calib-tokens", "240", "--device", "cpu",
                   "--out", tmp_path / "two", nproc=2)
    assert two.returncode == 0, two.stderr[-3000:]
    compared = json.loads((tmp_path / "two" / "heal.json").read_text())["methods"]
    ones = {method: heal(load_model(str(bos_model_dir)), _cfg(docs_file, steps=4, eval_windows=2, method=method), tmp_path / method) for method in ("linear", "layer")}
    maps = [_maps(d)[2] for d in (tmp_path / "linear", tmp_path / "two" / "linear")]
    torch.testing.assert_close(maps[0], maps[1], rtol=0, atol=1e-9)
    layers = [torch.load(d / "checkpoint.pt", weights_only=True)["trained"] for d in (tmp_path / "layer", tmp_path / "two" / "layer")]
    for k in layers[0]:
        torch.testing.assert_close(layers[0][k], layers[1][k], rtol=0, atol=1e-5)  # Adam: a gradient summed in another order, normalised
    for method, one in ones.items():
        held = [r["held_out"]["metrics"] for r in (one["results"]["healed"], compared[method]["results"])]
        assert held[0] == pytest.approx(held[1], rel=1e-4, abs=1e-7), method


def test_a_linear_map_on_fewer_tokens_than_its_inputs_is_refused_or_said_where_accepted():
    """32 x 32 maps: 24 calibration tokens are refused by default (naming the tokens that fit and the ratio
    that accepts them); with min_fit_ratio 0.5 they are accepted and the method's description says what the
    map then is, a ridge's where it has one; 32 tokens say nothing (issue 87)."""
    from depthcurse.errors import DepthcurseError

    model = tiny_llama(128, layers=4)
    with pytest.raises(DepthcurseError, match=r"give --calib-tokens 32 or more, or accept it with --method-args min_fit_ratio=0.75$"):
        build_method("linear", {"calib_tokens": "24"}).check(model, (2,))
    accepted = build_method("linear", {"calib_tokens": "24", "min_fit_ratio": "0.5"})
    accepted.check(model, (2,))
    assert accepted.describe() == ("a linear map per removed run on 24 calibration tokens (--method linear's 32 x 32 least-squares map (calib_tokens 24) is "
                                   "fitted on 24 tokens, fewer than its 32 inputs: under-determined, it is the minimum-norm map, which cannot recover even "
                                   "the identity (accepted by --method-args min_fit_ratio=0.5))")
    ridged = build_method("linear", {"calib_tokens": "24", "min_fit_ratio": "0.5", "ridge": "0.1"})
    ridged.check(model, (2,))
    assert "under-determined, it is the ridge's, shrunk toward the identity" in ridged.describe()
    enough = build_method("linear", {"calib_tokens": "32"})
    enough.check(model, (2,))
    assert enough.describe() == "a linear map per removed run on 32 calibration tokens"
