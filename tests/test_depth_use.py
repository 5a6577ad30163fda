"""`depth-use` (issue 73): the logit lens at the last layer is the model's own output, a skipped
layer's influence row is two plain forward passes compared by hand, each sublayer's contribution is
its branch's output against the stream by hand, the settling depth on a case worked by hand, the
phase-transition rule, the command end to end, and the bad input."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import assert_one_line_error, tiny_llama

from depthcurse.depth import measure_depth_use, phase_transition, settling_depth
from depthcurse.depth.measure import DepthUse
from depthcurse.depth.report import depth_verdicts
from depthcurse.surgery import removed_layers

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _model():
    return tiny_llama(300, layers=5, seed=3).eval()


def _ids(windows=3, length=12):
    return torch.randint(3, 300, (windows, length), generator=torch.Generator().manual_seed(1))


def _branches_by_hand(model, ids):
    """Each block's attention and MLP output, and the stream entering it, by hooks put here on a plain forward."""
    seen = {}
    hooks = []
    for i, block in enumerate(model.model.layers):
        hooks.append(block.register_forward_pre_hook(lambda m, args, kwargs, i=i: seen.__setitem__(("h", i), (args[0] if args else kwargs["hidden_states"]).float()),
                                                     with_kwargs=True))
        hooks.append(block.self_attn.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(("a", i), out[0].float())))
        hooks.append(block.mlp.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(("m", i), out.float())))
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits.float()
    for h in hooks:
        h.remove()
    return seen, logits


def test_the_lens_at_the_last_layer_is_the_models_output_and_each_contribution_is_its_branch_by_hand():
    model, ids = _model(), _ids()
    use = measure_depth_use(model, ids, 2, influence=False)
    seen, logits = _branches_by_hand(model, ids)
    last = len(model.model.layers) - 1
    assert use.lens_kl[last] == pytest.approx([0.0] * 3, abs=1e-6) and use.lens_top1[last] == [1.0] * 3 and use.lens_top5[last] == [1.0] * 3
    for i in range(last + 1):
        h, a, m = seen["h", i], seen["a", i], seen["m", i]
        by_hand = (a.norm(dim=-1) / h.norm(dim=-1)).mean(-1)
        assert use.attn_norm[i] == pytest.approx(by_hand.tolist(), rel=1e-5)
        assert use.mlp_norm[i] == pytest.approx((m.norm(dim=-1) / (h + a).norm(dim=-1)).mean(-1).tolist(), rel=1e-5)
        assert use.mlp_cos[i] == pytest.approx(torch.nn.functional.cosine_similarity(m, h + a, dim=-1).mean(-1).tolist(), rel=1e-5, abs=1e-6)
    # the lens on the last stream is the model's log-probs: its top-1 is the model's argmax on every token
    assert sum(use.settled) == ids.numel()


def test_a_skipped_layers_influence_row_is_two_plain_forward_passes_by_hand():
    """Layer 1 skipped: for every later layer j, mean over tokens then windows of ||c_j' - c_j|| / ||c_j||,
    c_j = a_j + m_j from the whole model's forward and from the forward of the model built without
    layer 1; and the output's KL(whole || skipped)."""
    model, ids = _model(), _ids()
    use = measure_depth_use(model, ids, 2)
    whole, logits = _branches_by_hand(model, ids)
    with removed_layers(model, [1]):
        skipped, skipped_logits = _branches_by_hand(model, ids)  # its blocks renumbered: old j is new j - 1
    for j in range(2, 5):
        c, c_skip = whole["a", j] + whole["m", j], skipped["a", j - 1] + skipped["m", j - 1]
        assert use.influence[1][j] == pytest.approx(((c_skip - c).norm(dim=-1) / c.norm(dim=-1)).mean(-1).mean().item(), rel=1e-4)
    assert use.influence[1][0] != use.influence[1][0] and use.influence[1][1] != use.influence[1][1]  # NaN: not later
    p, q = torch.log_softmax(logits[:, :, :], -1), torch.log_softmax(skipped_logits, -1)
    assert use.output_change[1] == pytest.approx((p.exp() * (p - q)).sum(-1).mean().item(), rel=1e-4)


def _own(norm: str, layers: int = 4, seed: int = 0):
    """lns-train's own Hugging Face class (its hf/ export) of `norm`, with trained-looking norm gains."""
    from depthcurse.train import export as E, model as M

    torch.manual_seed(seed)
    model = M.Transformer(M.ModelConfig(vocab_size=300, hidden_size=32, intermediate_size=48, num_layers=layers, num_heads=4, max_seq_len=64,
                                        norm=norm)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return E.to_hf(model).eval()


@pytest.mark.parametrize("norm", ["pre", "mix", "hybridnorm", "dyt", "post"])
def test_lns_trains_own_class_steps_from_the_first_token_only(norm):
    """Its blocks take the rotary tables its base builds and keep no cache: the stepper gives the
    model's own logits from the first token, and refuses a cached prefix or packed documents (so
    prune's engine and select's scorer go on without it, as before)."""
    from depthcurse.prune.stepping import Unsupported, checked_stepper

    model = _own(norm)
    stepper = checked_stepper(model, cached=False)
    ids = _ids(2, 12)
    with torch.no_grad():
        streams = stepper.streams(ids)
        torch.testing.assert_close(stepper.logits(streams[-1]), model(input_ids=ids).logits.float(), rtol=0, atol=1e-5)
    with pytest.raises(Unsupported, match="its blocks keep no cache, so it steps from the first token only"):
        checked_stepper(model)
    assert "no mask of packed documents" in stepper.packing_fails()


def _halves_by_hand(model, ids):
    """Each block's input and output, and its two halves' changes worked out from its own parts: a
    pre-norm block's attention and MLP outputs; a Post-LN block's stream after its first norm (h' =
    LN(h + a)); a HybridNorm block's after its MLP's norm, whose MLP output is then the second change."""
    seen, hooks = {}, []
    for i, block in enumerate(model.model.layers):
        hooks.append(block.register_forward_pre_hook(lambda m, args, i=i: seen.__setitem__(("h", i), args[0].float())))
        hooks.append(block.register_forward_hook(lambda m, args, out, i=i: seen.__setitem__(("out", i), out.float())))
        hooks.append(block.self_attn.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(("attn", i), out.float())))
        hooks.append(block.mlp.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(("mlp", i), out.float())))
        middle = {"post": "input_layernorm", "hybrid": "post_attention_layernorm"}.get(block.spec.kind)
        if middle:
            hooks.append(getattr(block, middle).register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(("middle", i), out.float())))
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    for h in hooks:
        h.remove()
    halves = {}
    for i, block in enumerate(model.model.layers):
        if block.spec.kind == "post":
            halves[i] = (seen["middle", i] - seen["h", i], seen["out", i] - seen["middle", i])
        elif block.spec.kind == "hybrid":
            halves[i] = (seen["middle", i] - seen["h", i], seen["mlp", i])
        else:
            halves[i] = (seen["attn", i], seen["mlp", i])
        torch.testing.assert_close(sum(halves[i]), seen["out", i] - seen["h", i], rtol=0, atol=1e-5)  # the halves make up the block's change
    return seen, halves, logits


@pytest.mark.parametrize("norm", ["mix", "hybridnorm"])
def test_blocks_that_normalise_inside_give_each_halfs_change_and_their_influence_by_hand(norm):
    """Mix-LN (its first block Post-LN, at 4 layers) and HybridNorm: each sublayer's figure is its half's
    change to the stream, and layer 1 skipped changes every later block's change c_j = out_j - h_j
    as two plain forward passes (the whole model, and the model built without layer 1) say."""
    model, ids = _own(norm), _ids()
    use = measure_depth_use(model, ids, 2)
    seen, halves, logits = _halves_by_hand(model, ids)
    assert [b.spec.kind for b in model.model.layers][:1] == ["post" if norm == "mix" else "hybrid"]
    for i in range(4):
        (a, m), h = halves[i], seen["h", i]
        assert use.attn_norm[i] == pytest.approx((a.norm(dim=-1) / h.norm(dim=-1)).mean(-1).tolist(), rel=1e-5)
        assert use.mlp_norm[i] == pytest.approx((m.norm(dim=-1) / (h + a).norm(dim=-1)).mean(-1).tolist(), rel=1e-5)
        assert use.attn_cos[i] == pytest.approx(torch.nn.functional.cosine_similarity(a, h, dim=-1).mean(-1).tolist(), rel=1e-5, abs=1e-6)
    with removed_layers(model, [1]):
        skipped, skipped_halves, skipped_logits = _halves_by_hand(model, ids)
    for j in range(2, 4):
        c, c_skip = sum(halves[j]), sum(skipped_halves[j - 1])
        assert use.influence[1][j] == pytest.approx(((c_skip - c).norm(dim=-1) / c.norm(dim=-1)).mean(-1).mean().item(), rel=1e-4)
    p, q = torch.log_softmax(logits, -1), torch.log_softmax(skipped_logits, -1)
    assert use.output_change[1] == pytest.approx((p.exp() * (p - q)).sum(-1).mean().item(), rel=1e-4)


def test_the_settling_depth_worked_by_hand():
    """Four layers, three tokens; the final top-1 is 7, 8, 9. Token 0 agrees at layers 1, 2, 3 (settles
    at 1); token 1 at 0 and 3 only (3); token 2 everywhere (0)."""
    lens = torch.tensor([[5, 8, 9], [7, 1, 9], [7, 2, 9], [7, 8, 9]])
    assert settling_depth(lens, torch.tensor([7, 8, 9])).tolist() == [1, 3, 0]


def test_the_phase_transition_rule_by_hand():
    """Row means 0.8, 0.7, 0.75, 0.2, 0.25 (the last layer: none). Splits: at 1, SSE 0 + (0.7, 0.75, 0.2,
    0.25 about 0.475) 0.255; at 2, 0.005 + (0.75, 0.2, 0.25 about 0.4) 0.185; at 3, (about 0.75) 0.005 +
    (about 0.225) 0.00125 = 0.00625, the least: layer 3. Rising influence has no transition."""
    nan = float("nan")

    def use(rows):
        influence = [[nan] * (i + 1) + [rows[i]] * (len(rows) - i) for i in range(len(rows))] + [[nan] * (len(rows) + 1)]
        return DepthUse(n_layers=len(rows) + 1, windows=2, influence=influence, output_change=[0.0] * (len(rows) + 1))

    assert phase_transition(use([0.8, 0.7, 0.75, 0.2, 0.25])) == 3
    record = {"use": {**use([0.8, 0.7, 0.75, 0.2, 0.25]).summary(), "settled": [1, 0, 0, 0, 0, 1]}, "layers": [], "phase_transition": 3}
    assert ("phase transition at layer 3 of 6 (50% of the depth): the one drop in how much each layer's skip changes the later layers' work "
            "(the influence rows' means, least squares; docs/depth-use.md), 0.750 before it, 0.225 from it on") in depth_verdicts(record)
    assert phase_transition(use([0.2, 0.25, 0.8, 0.7, 0.75])) is None
    assert phase_transition(use([0.5, 0.4])) is None and phase_transition(DepthUse(n_layers=6, windows=2)) is None


def test_depth_use_end_to_end_and_its_bad_input(run_cli, tiny_model_dir, text_file, tmp_path):
    out = tmp_path / "du"
    code, stdout, err = run_cli("depth-use", tiny_model_dir, "--data", text_file, "--windows", "3", "--seq-len", "16", "--out", out)
    assert code == 0, err
    said = " ".join(stdout.split())
    assert "how each layer is used, 3 windows x 16 tokens" in said and "half of the tokens' predictions have settled by layer" in said
    record = json.loads((out / "depth_use.json").read_text())
    assert len(record["layers"]) == 4 and record["use"]["influence"] is not None
    assert all((out / f).is_file() for f in ("depth_use.csv", "settling.png", "influence.png"))
    base = ["depth-use", tiny_model_dir, "--data", text_file, "--seq-len", "16"]
    assert_one_line_error(*run_cli(*base, "--windows", "1", "--out", tmp_path / "a"), "--windows must be at least 2")
    assert_one_line_error(*run_cli(*base, "--windows", "100000", "--out", tmp_path / "b"), "windows of 16 tokens, fewer than --windows 100000")


def test_a_model_the_lens_cannot_read_is_one_line(run_cli, tmp_path, tiny_tokenizer, text_file):
    """A Post-LN encoder (BERT) has no language-model head the lens could use: one line before any work, nothing written."""
    import transformers as tf

    path = tmp_path / "bert"
    tf.BertForMaskedLM(tf.BertConfig(vocab_size=len(tiny_tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64)).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    out = tmp_path / "du"
    assert_one_line_error(*run_cli("depth-use", path, "--data", text_file, "--windows", "2", "--seq-len", "16", "--out", out),
                          "bert is an encoder without a language-model head")
    assert not out.exists() or not any(out.iterdir())


def test_a_decoder_the_stepper_cannot_run_is_one_line_naming_why():
    """GPT-2 (learned positions, no rotary embedding): the lens and the skips need prune's stepper."""
    import transformers as tf

    from depthcurse.errors import DepthcurseError

    model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=300, n_embd=32, n_layer=2, n_head=2)).eval()
    with pytest.raises(DepthcurseError, match=r"^depth-use needs the model's blocks, final norm and head one by one \(the logit lens, the skips\): "):
        measure_depth_use(model, _ids(), 2)


# --------------------------------------------------------------------------- the tuned lens
def port_of_tuned_lens_training(model, windows, order, steps, step_windows, micro_batch, lr_scale, momentum, weight_decay):
    """`scripts/train_loop.py` and `ingredients.Optimizer` (AlignmentResearch/tuned-lens @ 8db471b), line
    for line where it decides the numbers, on the model's own `output_hidden_states` (no stepper): zero
    translators, KL(output || lens) at shift 0 per layer, each layer's backward divided by the
    accumulation, the gradient clipped to 1, SGD(lr = lr_scale (1 - beta), Nesterov), transformers'
    linear schedule with no warm-up. Theirs also has a translator for the embedding (their idx 0);
    ours reads the stream after each block, so the port keeps the translators of hidden_states[1:-1]."""
    from transformers import get_linear_schedule_with_warmup

    width, n = model.config.hidden_size, model.config.num_hidden_layers
    translator = torch.nn.Linear(width, width)
    translator.weight.data.zero_()
    translator.bias.data.zero_()
    layer_translators = torch.nn.ModuleList([__import__("copy").deepcopy(translator) for _ in range(n - 1)])
    β = momentum
    opt = torch.optim.SGD(layer_translators.parameters(), lr=lr_scale * (1 - β), momentum=β, nesterov=True, weight_decay=weight_decay)
    scheduler = get_linear_schedule_with_warmup(opt, 0, steps - 0)
    grad_acc_steps = step_windows // micro_batch
    model.requires_grad_(False)
    for step in range(steps):
        taken = order[step * step_windows : (step + 1) * step_windows]
        for batch_idx in range(grad_acc_steps):
            batch = windows[taken[batch_idx * micro_batch : (batch_idx + 1) * micro_batch]]
            with torch.no_grad():
                output = model(input_ids=batch, output_hidden_states=True, use_cache=False)
            labels = output.logits.float().log_softmax(dim=-1)
            for i, h in enumerate(output.hidden_states[1:-1]):
                logits = model.lm_head(model.model.norm(h + layer_translators[i](h)))
                loss = torch.sum(labels.exp() * (labels - logits.log_softmax(-1)), dim=-1).mean()
                (loss / grad_acc_steps).backward()
        torch.nn.utils.clip_grad_norm_(layer_translators.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)
        scheduler.step()
    model.requires_grad_(True)
    return layer_translators


def _lens_order(windows, step_windows, steps, seed):
    """The windows each step takes: rounds over all of them, each in a fresh order of random.Random(seed)."""
    import random

    rng, order = random.Random(seed), []
    while len(order) < steps * step_windows:
        round_ = list(range(windows))
        rng.shuffle(round_)
        order += round_
    return order


@pytest.mark.parametrize("micro_batch", [1, 2])
def test_tuned_lens_training_is_the_authors_loop_step_for_step(micro_batch):
    """Settings other than the defaults (3 steps, 2 of 3 windows a step so the rounds wrap, a seed,
    lr_scale 0.5, momentum 0.8, decay 0.01, micro-batches of 1 and 2): every translator the port's."""
    from depthcurse.depth import LensSettings, train_tuned_lens
    from depthcurse.depth.measure import stepper_of

    model, ids = _model(), _ids(windows=3, length=10)
    settings = LensSettings(steps=3, tokens_per_step=2 * 10, lr_scale=0.5, momentum=0.8, weight_decay=0.01, micro_batch=micro_batch, seed=11)
    lens, record = train_tuned_lens(model, stepper_of(model), ids, settings, clock=iter(range(0, 100, 7)).__next__)
    theirs = port_of_tuned_lens_training(model, ids, _lens_order(3, 2, 3, 11), 3, 2, micro_batch, 0.5, 0.8, 0.01)
    for ours, port in zip(lens.translators, theirs):
        assert torch.allclose(ours.weight, port.weight, atol=1e-6) and torch.allclose(ours.bias, port.bias, atol=1e-6)
    assert any(t.weight.abs().sum() > 0 for t in lens.translators)  # it moved
    assert record["tokens_per_step"] == 20 and record["train_windows"] == 3 and record["seconds"] == 7 and len(record["train_kl_last_step"]) == 4
    assert all(p.requires_grad for p in model.parameters())  # the model's own weights as they were


def test_an_untrained_lens_is_the_logit_lens_and_a_trained_one_reads_held_out_windows_closer():
    from depthcurse.depth import LensSettings, TunedLens, train_tuned_lens
    from depthcurse.depth.measure import stepper_of
    from depthcurse.depth.tuned_lens import fingerprint

    model, ids = _model(), _ids(windows=19, length=12)
    with torch.no_grad():  # a peaked output (a random model's is near uniform, and every lens near it): something for a translator to learn
        model.lm_head.weight.mul_(30)
    stepper = stepper_of(model)
    plain = measure_depth_use(model, ids[:3], 2, influence=False, tuned=TunedLens(model.config.hidden_size, 5, fingerprint(stepper)))
    assert plain.tuned_kl == plain.lens_kl and plain.tuned_top1 == plain.lens_top1 and plain.tuned_settled == plain.settled
    lens, _ = train_tuned_lens(model, stepper, ids[3:], LensSettings(steps=30, micro_batch=8))
    use = measure_depth_use(model, ids[:3], 2, influence=False, tuned=lens)
    held_out = [sum(v) / 3 for v in use.tuned_kl[:-1]]
    logit = [sum(v) / 3 for v in use.lens_kl[:-1]]
    assert all(t < g for t, g in zip(held_out, logit)), (held_out, logit)
    assert use.tuned_kl[-1] == use.lens_kl[-1]  # the last layer: the output itself, no translator


def test_a_lens_file_reads_back_and_one_from_another_model_is_one_line(tmp_path):
    from depthcurse.depth import LensSettings, load_lens, train_tuned_lens
    from depthcurse.depth.measure import stepper_of
    from depthcurse.errors import DepthcurseError

    model, ids = _model(), _ids()
    lens, record = train_tuned_lens(model, stepper_of(model), ids, LensSettings(steps=2))
    path = lens.save(tmp_path / "lens.safetensors", record)
    again, training = load_lens(path, stepper_of(model))
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), lens.state_dict().values())) and training == json.loads(json.dumps(record))
    other = tiny_llama(300, layers=5, seed=4).eval()  # same shape, another head
    with pytest.raises(DepthcurseError, match=r"^--lens .*lens.safetensors was trained on another model \(width 32, 5 layers, head [0-9a-f]{16}; this one: "):
        load_lens(path, stepper_of(other))
    (tmp_path / "junk.safetensors").write_bytes(b"not a lens")
    with pytest.raises(DepthcurseError, match="is not a tuned lens written by depth-use"):
        load_lens(tmp_path / "junk.safetensors", stepper_of(model))
    with pytest.raises(DepthcurseError, match="must each be at least 1"):
        train_tuned_lens(model, stepper_of(model), ids, LensSettings(steps=0))


def test_depth_use_trains_a_tuned_lens_keeps_it_and_reads_it_again(run_cli, tiny_model_dir, text_file, tmp_path):
    out = tmp_path / "du"
    base = ["depth-use", tiny_model_dir, "--data", text_file, "--windows", "2", "--seq-len", "16", "--no-influence"]
    code, stdout, err = run_cli(*base, "--tuned-lens", "--lens-steps", "3", "--lens-windows", "3", "--out", out)
    assert code == 0, err
    record = json.loads((out / "depth_use.json").read_text())
    lens = record["tuned_lens"]
    assert lens["settings"]["steps"] == 3 and lens["train_windows"] == 3 and lens["source"] == "trained here" and len(lens["held_out_kl"]) == 4
    assert "tuned lens: half settled by layer" in " ".join(stdout.split()) and (out / "tuned_lens.safetensors").is_file()
    code, stdout, err = run_cli(*base, "--tuned-lens", "--lens-steps", "3", "--lens-windows", "3", "--out", out)  # kept: read, not trained again
    assert code == 0 and json.loads((out / "depth_use.json").read_text())["tuned_lens"]["seconds"] == lens["seconds"], err
    code, _, err = run_cli(*base, "--lens", out / "tuned_lens.safetensors", "--out", tmp_path / "read")
    assert code == 0 and json.loads((tmp_path / "read" / "depth_use.json").read_text())["layers"] == record["layers"], err
    code, _, err = run_cli("report", out, tmp_path / "read", "--out", tmp_path / "page.md")  # two runs side by side
    page = (tmp_path / "page.md").read_text()
    assert code == 0 and "depth-use runs side by side" in page and page.count("| " + str(out)) == 1 and "tuned lens KL" in page, err
    assert (tmp_path / "page_figures" / "depth_settling_1.png").is_file()
    assert_one_line_error(*run_cli(*base, "--tuned-lens", "--lens", out / "tuned_lens.safetensors", "--out", tmp_path / "c"), "give one of them")
    assert_one_line_error(*run_cli(*base, "--tuned-lens", "--lens-windows", "100000", "--out", tmp_path / "d"),
                          "fewer than --windows 2 and 100000 more to train the tuned lens on")


# --------------------------------------------------------------------------- agreement with select
def _depth_record(n=5, model="m"):
    nan = float("nan")
    layers = [{"layer": i, "attn_norm": 0.1 * (i + 1), "mlp_norm": 0.2, "lens_kl": 5.0 - i} for i in range(n)]
    influence = [[nan] * (i + 1) + [1.0 / (i + 1)] * (n - i - 1) for i in range(n)]
    return {"run": {"model": model}, "layers": layers, "use": {"influence": influence, "output_change": [0.5, 0.1, 0.4, 0.3, 0.2][:n]}}


def _select_record(n=5, model="m"):
    costs = {str(i): [0.0, c, 0.0, None] for i, c in enumerate([9.0, 1.0, 8.0, 7.0, 6.0][:n])}
    return {"run": {"model": model, "n_layers": n}, "labels": {"wiki": "wiki"}, "calibration_scores": {"wiki": {**costs, "1,2": [0, 1, 0, None]}},
            "cells": {"wiki/exact/kl": {"layers": [1, 4]}, "wiki/evo/kl": {"layers": ["a1", "m2"]}}}


def test_agreement_sets_each_measure_against_removal_costs_and_picks_by_hand():
    """Five layers. Output KL when skipped 0.5, 0.1, 0.4, 0.3, 0.2 against removal costs 9, 1, 8, 7, 6:
    the same order, rho = +1, expected +: agrees only if its interval leaves 0 out (n = 5: it is the
    point 1). Contribution rises with depth (0.3 ... 0.7) against costs whose ranks are 5, 1, 4, 3, 2:
    no ties, so rho = 1 - 6 x (16 + 1 + 1 + 1 + 9) / 120 = -0.4, cannot tell at n = 5. The pick {1, 4} as 0, 1, 0, 0, 1
    against the output KL: ranks 5, 1, 4, 3, 2 and 2, 4.5, 2, 2, 4.5. The branch pick names no layer:
    left out."""
    from depthcurse.depth.agreement import agreement, select_targets
    from depthcurse.stats.correlation import spearman

    targets = select_targets(_select_record())
    assert list(targets) == ["removal cost alone (kl, wiki)", "picked by wiki/exact/kl at k = 2"]
    assert targets["picked by wiki/exact/kl at k = 2"] == ([0.0, 1.0, 0.0, 0.0, 1.0], -1)
    rows = {(r["measure"], r["target"]): r for r in agreement(_depth_record(), [_select_record()])}
    out = rows["output KL when skipped", "removal cost alone (kl, wiki)"]
    assert out["rho"] == pytest.approx(1.0) and out["interval"] == [pytest.approx(1.0)] * 2 and out["agrees"] is True and out["layers"] == 5
    contribution = rows["contribution ||a||/||h|| + ||m||/||h||", "removal cost alone (kl, wiki)"]
    assert contribution["rho"] == pytest.approx(-0.4) and contribution["agrees"] is None
    pick = rows["output KL when skipped", "picked by wiki/exact/kl at k = 2"]
    assert pick["rho"] == pytest.approx(spearman([0.5, 0.1, 0.4, 0.3, 0.2], [0, 1, 0, 0, 1])) and pick["expected_sign"] == -1
    assert pick["rho"] < 0
    influence = rows["influence on later layers", "removal cost alone (kl, wiki)"]
    assert influence["layers"] == 4  # the last layer has no later one
    lens = rows["logit lens KL drop", "removal cost alone (kl, wiki)"]
    assert lens["layers"] == 4 and lens["rho"] is None  # every drop is 1: nothing to rank
    from depthcurse.errors import DepthcurseError

    with pytest.raises(DepthcurseError, match=r"^--agree-with: a select run of 4 layers against depth-use's 5: not the same model$"):
        agreement(_depth_record(), [_select_record(n=4)])
    with pytest.raises(DepthcurseError, match=r"^--agree-with: a select run of other against depth-use's m$"):
        agreement(_depth_record(), [_select_record(model="other")])


def test_depth_use_agrees_with_a_select_run_on_the_command_line(run_cli, tiny_model_dir, text_file, tmp_path):
    """A select run of the same model (greedy and exact at k = 2, every single removal scored): the
    agreement table and agreement.csv; a folder with no select run is one line before any work."""
    code, _, err = run_cli("select", tiny_model_dir, "--k", "2", "--search", "greedy,exact", "--calibration", text_file, "--calib-windows", "2",
                           "--eval-windows", "2", "--seq-len", "16", "--out", tmp_path / "sel")
    assert code == 0, err
    out = tmp_path / "du"
    code, stdout, err = run_cli("depth-use", tiny_model_dir, "--data", text_file, "--windows", "2", "--seq-len", "16", "--agree-with", tmp_path / "sel",
                                "--out", out)
    assert code == 0, err
    said = " ".join(stdout.split())
    assert "do the layers depth-use calls little used match" in said and "picked by" in said
    record = json.loads((out / "depth_use.json").read_text())
    targets = {r["target"] for r in record["agreement"]}
    assert any(t.startswith("removal cost alone (kl") for t in targets) and any("exact" in t for t in targets) and (out / "agreement.csv").is_file()
    assert_one_line_error(*run_cli("depth-use", tiny_model_dir, "--data", text_file, "--windows", "2", "--seq-len", "16", "--agree-with", tmp_path,
                                   "--out", tmp_path / "x"), "holds no select run (select.json)")
    assert not (tmp_path / "x").exists()


# --------------------------------------------------------------------------- the depth map
def _stretched(shallow):
    """The shallow model with an identity block after each of its blocks (o_proj and down_proj zero:
    the block adds nothing), twice as deep: deep layer 2k and 2k + 1 both give shallow layer k's stream."""
    import copy

    deep = copy.deepcopy(shallow)
    blocks = []
    for block in shallow.model.layers:
        idle = copy.deepcopy(block)
        with torch.no_grad():
            idle.self_attn.o_proj.weight.zero_()
            idle.mlp.down_proj.weight.zero_()
        blocks += [copy.deepcopy(block), idle]
    deep.model.layers = torch.nn.ModuleList(blocks)
    deep.config.num_hidden_layers = len(blocks)
    deep.config.layer_types = ["full_attention"] * len(blocks)
    for i, block in enumerate(deep.model.layers):
        block.self_attn.layer_idx = i
    return deep.eval()


def test_a_map_is_ridge_least_squares_by_hand_and_a_stretched_model_maps_on_the_diagonal():
    """fit_map against the normal equations solved by numpy (centred, ridge 1e-3 x the mean diagonal);
    then a 3-layer model against itself with an identity block after each block (6 layers): shallow
    layer k's stream is deep layer 2k's exactly, so each maps there with R^2 1 (up to the ridge), the
    first of the two equal matches, and the relative depths (k + 1) / 3 and (2k + 1) / 6 keep their order."""
    import numpy as np

    from depthcurse.depth.depth_map import depth_map, fit_map

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 5, generator=g, dtype=torch.float64), torch.randn(40, 3, generator=g, dtype=torch.float64)
    w, b, mean = fit_map(x, y)
    xc, yc = (x - x.mean(0)).numpy(), (y - y.mean(0)).numpy()
    gram = xc.T @ xc
    theirs = np.linalg.solve(gram + 1e-3 * np.trace(gram) / 5 * np.eye(5), xc.T @ yc)
    assert np.allclose(w.numpy(), theirs, atol=1e-12) and np.allclose(b.numpy(), y.mean(0).numpy() - x.mean(0).numpy() @ theirs, atol=1e-12)
    assert torch.equal(mean, y.mean(0))

    shallow = tiny_llama(300, layers=3, seed=5).eval()
    deep = _stretched(shallow)
    ids = _ids(windows=6, length=12)
    with torch.no_grad():
        assert torch.allclose(shallow(input_ids=ids).logits, deep(input_ids=ids).logits, atol=1e-5)
    record = depth_map(shallow, deep, ids[:4], ids[4:], batch_size=2)
    assert record["best"] == [0, 2, 4] and record["shallow_layers"] == 3 and record["deep_layers"] == 6
    assert all(record["r2"][k][2 * k] > 0.999 and record["r2"][k][2 * k + 1] == pytest.approx(record["r2"][k][2 * k], abs=1e-9) for k in range(3))
    assert record["relative_depth"]["best_deep"] == [1 / 6, 3 / 6, 5 / 6] and record["relative_depth"]["spearman"] == pytest.approx(1.0)
    assert record["relative_depth"]["mean_abs_difference"] == pytest.approx(sum(abs((k + 1) / 3 - (2 * k + 1) / 6) for k in range(3)) / 3)
    assert len(record["r2_interval"][0][0]) == 2


def test_depth_map_end_to_end_and_two_tokenizers_are_one_line(run_cli, tiny_model_dir, six_dir, bos_model_dir, text_file, tmp_path):
    out = tmp_path / "map"
    code, stdout, err = run_cli("depth-map", tiny_model_dir, six_dir, "--data", text_file, "--windows", "3", "--held-out", "2", "--seq-len", "16", "--out", out)
    assert code == 0, err
    said = " ".join(stdout.split())
    assert "which deep layer each shallow layer's stream maps to best" in said and "best match lies" in said
    record = json.loads((out / "depth_map.json").read_text())
    assert record["shallow_layers"] == 4 and record["deep_layers"] == 6 and len(record["r2"]) == 4 and (out / "depth_map.png").is_file()
    assert_one_line_error(*run_cli("depth-map", tiny_model_dir, bos_model_dir, "--data", text_file, "--seq-len", "16", "--out", tmp_path / "b"),
                          "have different tokenizers")
    assert_one_line_error(*run_cli("depth-map", tiny_model_dir, six_dir, "--data", text_file, "--held-out", "1", "--seq-len", "16", "--out", tmp_path / "c"),
                          "--held-out at least 2")


def test_three_ranks_share_the_influence_matrix_and_give_one_processs_record(run_cli, six_dir, text_file, tmp_path):
    """`torchrun --nproc-per-node 3 -m depthcurse depth-use` on the CPU (gloo): each rank skips a
    consecutive run of layers (6 layers, costs 6..1: 0 | 1-2 | 3-5), the rows gathered; the record
    is one process's, figure for figure, and rank 0 alone writes."""
    from helpers import torchrun

    from depthcurse.select.scoring import contiguous_shares

    assert contiguous_shares([6 - i for i in range(6)], 3) == [(0, 1), (1, 3), (3, 6)]  # each rank's skips: none empty
    common = ["depth-use", six_dir, "--data", text_file, "--windows", "3", "--seq-len", "16", "--batch-size", "2"]
    code, _, err = run_cli(*map(str, common), "--out", str(tmp_path / "one"))
    assert code == 0, err
    three = torchrun("-m", "depthcurse", *common, "--out", tmp_path / "three", nproc=3)
    assert three.returncode == 0, three.stderr[-3000:]
    one, shared = (json.loads((tmp_path / d / "depth_use.json").read_text()) for d in ("one", "three"))
    assert shared["use"] == one["use"] and shared["layers"] == one["layers"] and shared["phase_transition"] == one["phase_transition"]
    assert (three.stdout + three.stderr).count("wrote ") == 1
