"""`depth-use` (issue 73): the logit lens at the last layer is the model's own output, a skipped
layer's influence row is two plain forward passes compared by hand, each sublayer's contribution is
its branch's output against the stream by hand, the settling depth on a case worked by hand, the
phase-transition rule, the command end to end, and the bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch

from csordas_port import port_of_analyze_norms, port_of_current_effects, port_of_run_logitlens
from helpers import assert_one_line_error, table_cells, tiny_llama

from depthcurse import vocab_scores
from depthcurse.depth import measure_depth_use, phase_transition, settling_depth
from depthcurse.depth.definitions import DEFINITIONS
from depthcurse.depth.measure import DepthUse
from depthcurse.depth.report import depth_verdicts
from depthcurse.surgery import removed_layers

# fast on tiny models: `make mutate` runs these against each mutant, but those through the command line (conftest marks them `cli`)
pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.instruments]


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


# --------------------------------------------------------------------------- --as csordas: their code, ported (csordas_port)
def test_depth_use_as_csordas_is_their_code_line_by_line():
    """`--as csordas` on a tiny model against ports of their functions: the influence matrix (skipped
    from the second token on, the largest relative change over tokens and prompts, their 0 before
    the skip and the diagonal), the output's probability change, the logit lens (the stream entering
    each layer, KL(lens || output), the top-5 overlap) and the relative contributions. Ours by default
    gives other numbers on the same model (which a test of the default would not see)."""
    from depthcurse.depth.definitions import DEFINITIONS

    model, ids = _model(), _ids(windows=3, length=12)
    use = measure_depth_use(model, ids, 2, definitions=DEFINITIONS["csordas"])
    d_max, dout_max = port_of_current_effects(model, ids)
    assert torch.tensor(use.influence) == pytest.approx(d_max, rel=1e-4, abs=1e-6)
    assert [use.influence[i][i] for i in range(5)] == pytest.approx([1.0] * 5) and use.influence[3][:3] == [0.0, 0.0, 0.0]
    assert use.output_change == pytest.approx(dout_max[:, 0].tolist(), rel=1e-4)
    kl, overlap = port_of_run_logitlens(model, ids)
    assert [sum(v) / 3 for v in use.lens_kl] == pytest.approx(kl.tolist(), rel=1e-4, abs=1e-6)
    assert [sum(v) / 3 for v in use.lens_top5] == pytest.approx(overlap.tolist(), rel=1e-5)
    att, mlp, att_cos, mlp_cos = port_of_analyze_norms(model, ids)
    assert [sum(v) / 3 for v in use.attn_norm] == pytest.approx(att.tolist(), rel=1e-5)
    assert [sum(v) / 3 for v in use.mlp_norm] == pytest.approx(mlp.tolist(), rel=1e-5)
    assert [sum(v) / 3 for v in use.attn_cos] == pytest.approx(att_cos.tolist(), rel=1e-5, abs=1e-6)
    assert [sum(v) / 3 for v in use.mlp_cos] == pytest.approx(mlp_cos.tolist(), rel=1e-5, abs=1e-6)
    ours = measure_depth_use(model, ids, 2)
    assert ours.lens_kl[0] != pytest.approx(use.lens_kl[0], rel=1e-3) and ours.output_change[0] != pytest.approx(use.output_change[0], rel=1e-3)
    assert len(use.settled) == 6 and sum(use.settled) == ids.numel()  # the last bin: tokens that settle only at the output


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
    # in double from the float logits: Mix-LN's skip moves the output by a KL of 3e-7, which float sums
    # of the log-softmax got to 3e-8 (3.22e-7 for 2.91e-7; the vocabulary kernel's 3.04e-7)
    p, q = torch.log_softmax(logits.double(), -1), torch.log_softmax(skipped_logits.double(), -1)
    assert use.output_change[1] == pytest.approx((p.exp() * (p - q)).sum(-1).mean().item(), rel=1e-4, abs=2e-8)
    # --as csordas reads the attention's and MLP's modules as their code does, whatever the block does with them after
    theirs = measure_depth_use(model, ids, 2, influence=False, definitions=DEFINITIONS["csordas"])
    seen_modules, hooks = {}, []
    for i, block in enumerate(model.model.layers):
        hooks += [block.self_attn.register_forward_hook(lambda mod, a, o, i=i: seen_modules.__setitem__(("a", i), (o[0] if isinstance(o, tuple) else o).float())),
                  block.register_forward_pre_hook(lambda mod, a, k, i=i: seen_modules.__setitem__(("h", i), (a[0] if a else k["hidden_states"]).float()),
                                                  with_kwargs=True)]
    with torch.no_grad():
        model(input_ids=ids)
    for hook in hooks:
        hook.remove()
    for i in range(4):
        a, h = seen_modules["a", i], seen_modules["h", i]
        assert theirs.attn_norm[i] == pytest.approx((a.norm(dim=-1) / h.norm(dim=-1)).mean(-1).tolist(), rel=1e-5)
    assert theirs.attn_norm[0] != pytest.approx(use.attn_norm[0], rel=1e-3)  # the first block's half is not its module's output


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
    assert "how each layer is used, 3 windows x 16 tokens" in said and "half of the tokens' predictions have settled by the stream after layer" in said
    record = json.loads((out / "depth_use.json").read_text())
    assert len(record["layers"]) == 4 and record["use"]["influence"] is not None
    assert all((out / f).is_file() for f in ("depth_use.csv", "settling.png", "influence.png"))
    base = ["depth-use", tiny_model_dir, "--data", text_file, "--seq-len", "16"]
    code, stdout, err = run_cli(*base, "--windows", "3", "--as", "csordas", "--out", tmp_path / "theirs")
    said = " ".join(stdout.split())
    assert code == 0 and "(csordas definitions)" in said and "KL(lens || output)" in said and "||p_skipped - p||_2" in said, err
    assert "half of the tokens' predictions have settled by the stream " in said
    theirs = json.loads((tmp_path / "theirs" / "depth_use.json").read_text())
    assert theirs["definitions"]["name"] == "csordas" and theirs["use"]["definitions"] == "csordas" and len(theirs["use"]["settled"]) == 5
    assert record["definitions"]["name"] == "depthcurse" and len(record["use"]["settled"]) == 4
    assert_one_line_error(*run_cli("report", out, tmp_path / "theirs", "--out", tmp_path / "page.md"), "depth-use runs of two definitions")
    assert_one_line_error(*run_cli(*base, "--as", "theirs", "--out", tmp_path / "x"), "--as theirs: no such definitions (known: depthcurse, csordas)")
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
                          "bert is an encoder without a language-model head: depth-use reads a decoder's next-token predictions: give a decoder")
    assert not out.exists() or not any(out.iterdir())
    for command in (["depth-map", path, path], ["select", path, "--k", "1"], ["speculate", path, "--skip", "1"]):  # none suggests an option it lacks
        code, stdout, err = run_cli(*command, "--out", tmp_path / command[0])
        assert_one_line_error(code, stdout, err, f"bert is an encoder without a language-model head: {command[0]} reads a decoder's next-token predictions")
        assert "--task squad" not in err


def test_a_decoder_the_stepper_cannot_run_is_one_line_naming_why():
    """GPT-2 (learned positions, no rotary embedding): the lens and the skips need prune's stepper."""
    import transformers as tf

    from depthcurse.errors import DepthcurseError

    model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=300, n_embd=32, n_layer=2, n_head=2)).eval()
    with pytest.raises(DepthcurseError, match=r"^depth-use needs the model's blocks, final norm and head one by one \(the logit lens, the skips\): "):
        measure_depth_use(model, _ids(), 2)


# --------------------------------------------------------------------------- the tuned lens
def port_of_tuned_lens_training(model, windows, order, steps, step_windows, micro_batch, lr_scale, momentum, weight_decay):
    """`scripts/train_loop.py` (`Train.execute`), `nn/lenses.py` (`TunedLens.__init__`, `transform_hidden`,
    `forward`), `nn/unembed.py` and `scripts/ingredients.py` (`Optimizer.create_optim`, `create_scheduler`)
    of AlignmentResearch/tuned-lens @ 8db471b, line for line where they decide the numbers, on the
    model's own `output_hidden_states` (no stepper): `config.num_hidden_layers` zero translators (index
    0 the embedding's output, `hidden_states[:-1]`), KL(output || lens) at shift 0 per translator, each
    backward divided by the accumulation, the gradient clipped to 1 over the whole lens, SGD(lr =
    lr_scale (1 - beta), Nesterov), transformers' linear schedule with no warm-up. Left out: their
    bf16 autocast (docs/depth-use.md's table)."""
    from copy import deepcopy

    from transformers import get_linear_schedule_with_warmup

    d_model, num_hidden_layers = model.config.hidden_size, model.config.num_hidden_layers
    translator = torch.nn.Linear(d_model, d_model, bias=True)
    translator.weight.data.zero_()
    translator.bias.data.zero_()
    layer_translators = torch.nn.ModuleList([deepcopy(translator) for _ in range(num_hidden_layers)])

    def lens(h, idx):  # TunedLens.forward: unembed(transform_hidden(h, idx)); Unembed.forward: unembedding(final_norm(h))
        h = h + layer_translators[idx](h)
        return model.lm_head(model.model.norm(h))

    β = momentum
    opt = torch.optim.SGD(layer_translators.parameters(), lr=lr_scale * (1 - β), momentum=β, nesterov=True, weight_decay=weight_decay)
    warmup_steps = 0  # their default for SGD
    scheduler = get_linear_schedule_with_warmup(opt, warmup_steps, steps - warmup_steps)
    grad_acc_steps = step_windows // micro_batch
    batches = [windows[order[i : i + micro_batch]] for i in range(0, steps * step_windows, micro_batch)]
    model.requires_grad_(False)
    for batch_idx, batch in zip(range(steps * grad_acc_steps), batches):
        with torch.no_grad():
            output = model(input_ids=batch, output_hidden_states=True, use_cache=False)
        final_logits = output.logits
        hidden_states = output.hidden_states[:-1]
        labels = final_logits.float().log_softmax(dim=-1)  # shift 0: shift_labels and shift_preds leave both as they are
        for i, h in enumerate(hidden_states):
            logits = lens(h, idx=i)
            loss = torch.sum(labels.exp() * (labels - logits.log_softmax(-1)), dim=-1).mean()
            scaled_loss = loss / grad_acc_steps
            scaled_loss.backward()
        step, rem = divmod(batch_idx, grad_acc_steps)
        if rem == grad_acc_steps - 1:
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
    lr_scale 0.5, momentum 0.8, decay 0.01, micro-batches of 1 and 2): every translator the port's,
    the embedding's (their index 0) included."""
    from depthcurse.depth import LensSettings, train_tuned_lens
    from depthcurse.depth.measure import stepper_of

    model, ids = _model(), _ids(windows=3, length=10)
    settings = LensSettings(steps=3, tokens_per_step=2 * 10, lr_scale=0.5, momentum=0.8, weight_decay=0.01, micro_batch=micro_batch, seed=11)
    lens, record = train_tuned_lens(model, stepper_of(model), ids, settings, clock=iter(range(0, 100, 7)).__next__)
    theirs = port_of_tuned_lens_training(model, ids, _lens_order(3, 2, 3, 11), 3, 2, micro_batch, 0.5, 0.8, 0.01)
    assert sorted(lens.translators, key=int) == [str(i) for i in range(5)]  # index 0: the embedding's output
    for idx, port in enumerate(theirs):
        ours = lens.translators[str(idx)]
        assert torch.allclose(ours.weight, port.weight, atol=1e-6) and torch.allclose(ours.bias, port.bias, atol=1e-6), idx
    assert all(t.weight.abs().sum() > 0 for t in lens.translators.values())  # each moved
    assert record["tokens_per_step"] == 20 and record["train_windows"] == 3 and record["seconds"] == 7 and len(record["train_kl_last_step"]) == 5
    assert record["translated_streams"] == [0, 1, 2, 3, 4]
    assert all(p.requires_grad for p in model.parameters())  # the model's own weights as they were


def test_the_lens_without_the_embeddings_translator_is_not_the_authors_loop():
    """The form this project trained before (no translator for the embedding, so the gradient clip's
    norm leaves it out): every other translator's step differs from the authors' loop, because the
    clip scales them all by a norm that includes the embedding's. Planted: the port itself fails
    against it."""
    from depthcurse.depth import LensSettings, train_tuned_lens
    from depthcurse.depth.measure import stepper_of

    model, ids = _model(), _ids(windows=3, length=10)
    with torch.no_grad():  # a peaked output: gradients large enough for the clip to bind
        model.lm_head.weight.mul_(30)
    settings = LensSettings(steps=2, tokens_per_step=30, micro_batch=3, embedding=False)
    lens, record = train_tuned_lens(model, stepper_of(model), ids, settings)
    assert "0" not in lens.translators and record["translated_streams"] == [1, 2, 3, 4]
    theirs = port_of_tuned_lens_training(model, ids, _lens_order(3, 3, 2, 42), 2, 3, 3, 1.0, 0.9, 1e-3)
    gaps = [(lens.translators[str(i)].weight - theirs[i].weight).abs().max().item() for i in range(1, 5)]
    assert all(g > 1e-6 for g in gaps), gaps
    full, _ = train_tuned_lens(model, stepper_of(model), ids, LensSettings(steps=2, tokens_per_step=30, micro_batch=3))
    assert all(torch.allclose(full.translators[str(i)].weight, theirs[i].weight, atol=1e-6) for i in range(5))


def test_a_step_of_uneven_micro_batches_is_the_mean_over_its_windows():
    """3 windows a step in micro-batches of 2: the batches of 2 and 1 weigh 2/3 and 1/3, so every
    translator equals the one a single micro-batch of 3 trains (each batch alike would weigh the lone
    window as much as the pair: issue 80)."""
    from depthcurse.depth import LensSettings, train_tuned_lens
    from depthcurse.depth.measure import stepper_of

    model, ids = _model(), _ids(windows=3, length=10)
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
    common = dict(steps=2, tokens_per_step=30, lr_scale=0.5)
    uneven, _ = train_tuned_lens(model, stepper_of(model), ids, LensSettings(micro_batch=2, **common))
    whole, _ = train_tuned_lens(model, stepper_of(model), ids, LensSettings(micro_batch=3, **common))
    for k in whole.translators:
        assert torch.allclose(uneven.translators[k].weight, whole.translators[k].weight, atol=1e-6), k
    assert any(t.weight.abs().sum() > 1e-3 for t in whole.translators.values())


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
    with pytest.raises(DepthcurseError, match=r"^--lens .*lens.safetensors was trained on another model \(width 32, 5 layers, head [0-9a-f]{16}; this one: "
                                              r"width 32, 5 layers, head [0-9a-f]{16}\): train one for it with --tuned-lens$"):
        load_lens(path, stepper_of(other))
    (tmp_path / "junk.safetensors").write_bytes(b"not a lens")
    with pytest.raises(DepthcurseError, match=r"^--lens .*junk.safetensors is not a tuned lens written by depth-use \("):
        load_lens(tmp_path / "junk.safetensors", stepper_of(model))
    with pytest.raises(DepthcurseError, match=r"^--lens .*missing.safetensors: no such file$"):
        load_lens(tmp_path / "missing.safetensors", stepper_of(model))
    assert again.fingerprint == json.loads(json.dumps(lens.fingerprint)) and again.embedding == lens.embedding
    bare, bare_record = train_tuned_lens(model, stepper_of(model), ids, LensSettings(steps=2, embedding=False))  # --no-lens-embedding's lens
    back, _ = load_lens(bare.save(tmp_path / "bare.safetensors", bare_record), stepper_of(model))
    assert back.embedding is False and "0" not in back.translators and back.state_dict().keys() == bare.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), bare.state_dict().values()))
    with pytest.raises(DepthcurseError, match="must each be at least 1"):
        train_tuned_lens(model, stepper_of(model), ids, LensSettings(steps=0))


def test_depth_use_trains_a_tuned_lens_keeps_it_and_reads_it_again(run_cli, tiny_model_dir, text_file, tmp_path):
    out = tmp_path / "du"
    base = ["depth-use", tiny_model_dir, "--data", text_file, "--windows", "2", "--seq-len", "16", "--no-influence"]
    code, stdout, err = run_cli(*base, "--tuned-lens", "--lens-steps", "3", "--calib-windows", "3", "--out", out)
    assert code == 0, err
    record = json.loads((out / "depth_use.json").read_text())
    lens = record["tuned_lens"]
    assert lens["settings"]["steps"] == 3 and lens["train_windows"] == 3 and lens["source"] == "trained here" and len(lens["held_out_kl"]) == 4
    assert "tuned lens: half settled by the stream after layer" in " ".join(stdout.split()) and (out / "tuned_lens.safetensors").is_file()
    code, stdout, err = run_cli(*base, "--tuned-lens", "--lens-steps", "3", "--calib-windows", "3", "--out", out)  # kept: read, not trained again
    assert code == 0 and json.loads((out / "depth_use.json").read_text())["tuned_lens"]["seconds"] == lens["seconds"], err
    code, _, err = run_cli(*base, "--lens", out / "tuned_lens.safetensors", "--out", tmp_path / "read")
    assert code == 0 and json.loads((tmp_path / "read" / "depth_use.json").read_text())["layers"] == record["layers"], err
    code, _, err = run_cli("report", out, tmp_path / "read", "--out", tmp_path / "page.md")  # two runs side by side
    page = (tmp_path / "page.md").read_text()
    assert code == 0 and "depth-use runs side by side" in page and page.count("| " + str(out)) == 1 and "tuned lens KL" in page, err
    assert (tmp_path / "page_figures" / "depth_settling_1.png").is_file()
    assert lens["settings"]["embedding"] is True and lens["translated_streams"] == [0, 1, 2, 3]
    code, _, err = run_cli(*base, "--tuned-lens", "--no-lens-embedding", "--lens-steps", "3", "--calib-windows", "3", "--out", tmp_path / "old-form")
    old_form = json.loads((tmp_path / "old-form" / "depth_use.json").read_text())["tuned_lens"]
    assert code == 0 and old_form["settings"]["embedding"] is False and old_form["translated_streams"] == [1, 2, 3], err
    assert_one_line_error(*run_cli(*base, "--tuned-lens", "--lens", out / "tuned_lens.safetensors", "--out", tmp_path / "c"), "give one of them")
    assert_one_line_error(*run_cli(*base, "--tuned-lens", "--calib-windows", "100000", "--out", tmp_path / "d"),
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
    assert out["verdict"] == "agrees" and out["distinct"] == 5
    contribution = rows["contribution ||a||/||h|| + ||m||/||h||", "removal cost alone (kl, wiki)"]
    assert contribution["rho"] == pytest.approx(-0.4) and contribution["agrees"] is None and contribution["verdict"] == "cannot tell"
    pick = rows["output KL when skipped", "picked by wiki/exact/kl at k = 2"]
    assert pick["rho"] == pytest.approx(spearman([0.5, 0.1, 0.4, 0.3, 0.2], [0, 1, 0, 0, 1])) and pick["expected_sign"] == -1
    assert pick["rho"] < 0 and pick["distinct"] == 2  # a pick: two values, the rest ties
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
    assert record["score"] == "r2_dims" and record["best"] == [max(range(6), key=lambda j: (record["scores"]["r2_dims"]["mean"][k][j], -j)) for k in range(3)]
    pooled = depth_map(shallow, deep, ids[:4], ids[4:], batch_size=2, score="r2")  # the pooled R^2 decides instead
    assert pooled["score"] == "r2" and pooled["best"] == [max(range(6), key=lambda j: (pooled["scores"]["r2"]["mean"][k][j], -j)) for k in range(3)]


def test_a_maps_held_out_scores_are_about_the_fitting_windows_mean_by_hand():
    """Shallow layer 1 onto deep layer 2 of two tiny models: both R^2 per held-out window, by hand from
    the streams, the ridge fit and the fitting windows' mean (about the held-out windows' own mean they
    would be other numbers: issue 80)."""
    from depthcurse.depth.depth_map import depth_map, fit_map, streams_of
    from depthcurse.depth.measure import stepper_of

    shallow, deep = tiny_llama(300, layers=2, seed=5).eval(), tiny_llama(300, layers=3, seed=6).eval()
    ids = _ids(windows=7, length=10)
    record = depth_map(shallow, deep, ids[:4], ids[4:], batch_size=3)
    x_fit, x_held = (streams_of(stepper_of(shallow), w, 3)[1] for w in (ids[:4], ids[4:]))
    y_fit, y_held = (streams_of(stepper_of(deep), w, 3)[2] for w in (ids[:4], ids[4:]))
    w, b, mean = fit_map(x_fit.flatten(0, 1), y_fit.flatten(0, 1))
    error = ((y_held - (x_held @ w + b)) ** 2).sum(1)
    spread = ((y_held - mean) ** 2).sum(1)
    pooled, dims = (1 - error.sum(-1) / spread.sum(-1)).tolist(), (1 - error / spread).mean(-1).tolist()
    assert record["scores"]["r2"]["mean"][1][2] == pytest.approx(sum(pooled) / 3, rel=1e-9)
    assert record["scores"]["r2_dims"]["mean"][1][2] == pytest.approx(sum(dims) / 3, rel=1e-9)
    own = ((y_held - y_held.flatten(0, 1).mean(0)) ** 2).sum(1)
    assert abs(sum((1 - error.sum(-1) / own.sum(-1)).tolist()) / 3 - record["scores"]["r2"]["mean"][1][2]) > 1e-6


def test_the_per_dimension_r2_by_hand_where_one_dimension_decides_the_pooled_one():
    """Two held-out windows of 4 tokens x 3 dimensions, a map that gets dimension 0 (variance 100x the
    others) right and the other two wrong: the pooled R^2 is near 1, the per-dimension mean is not;
    each by hand. The largest dimension's share of the variance by hand."""
    from depthcurse.depth.depth_map import held_out_r2, largest_dimension_share

    y = torch.tensor([[[10.0, 1.0, 0.0], [-10.0, 0.0, 1.0], [20.0, -1.0, 0.0], [-20.0, 0.0, -1.0]],
                      [[5.0, 1.0, 1.0], [-5.0, -1.0, 0.0], [15.0, 0.0, -1.0], [-15.0, 1.0, 0.0]]], dtype=torch.float64)
    x = y.clone()
    w = torch.diag(torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))  # dimension 0 exactly, the others predicted as 0
    b = torch.zeros(3, dtype=torch.float64)
    baseline = torch.tensor([0.0, 0.5, -0.5], dtype=torch.float64)  # the fitting windows' mean
    pooled, dims = held_out_r2(x, y, w, b, baseline)
    for k in range(2):
        error = (y[k, :, 1:] ** 2).sum(0)  # dimension 0 has no error
        spread = ((y[k] - baseline) ** 2).sum(0)
        assert pooled[k] == pytest.approx(1 - error.sum().item() / spread.sum().item())
        assert dims[k] == pytest.approx((1 + (1 - error[0] / spread[1]).item() + (1 - error[1] / spread[2]).item()) / 3)
    assert pooled == pytest.approx([1 - 4 / (1000 + 3 + 3), 1 - 5 / (500 + 3 + 3)]) and dims == pytest.approx([(1 + 1 - 2 / 3 + 1 - 2 / 3) / 3, (1 + 1 - 3 / 3 + 1 - 2 / 3) / 3])
    assert pooled[0] > 0.99 and dims[0] < 0.6  # the massive dimension decides the pooled one alone
    variance = y.flatten(0, 1).var(0)
    assert largest_dimension_share(y) == pytest.approx((variance[0] / variance.sum()).item()) and largest_dimension_share(y) > 0.99


def port_of_map_layers(shallow, deep, src_layer, fit, held, steps, batch, seed, lr=2.5e-4, wd=0.01, grad_clip=0.25, warmup=200, min_lr=0.1, order=None,
                       bos_token=None):
    """training/tasks/map_layers.py (`MapLayers.create_model`, `get_src_target`, `run_model`, `validate`)
    with training/framework/task/simple_task.py's `train_step` and task.py's `set_lr` (CosineAnnealingLR
    stepped at iter - warmup, whose closed form `step(epoch)` gives; `set_linear_warmup`), AdamW as
    `create_optimizer` builds it (betas 0.9 / 0.999, eps 1e-8, decay on every parameter), the settings
    of sweeps/map_qwen.yaml unless given. Hooks as theirs: the target is the deep model's embedding
    output then every layer's output; the source the shallow model cut to its first `src_layer`
    layers with the final norm and head replaced by Identity. `fit` and `held` are rows of text, which
    their `get_src_target` pads first with the vocabulary's `bos_token()` (`bos_token`: None, which F.pad
    takes as 0, for a tokenizer without BOS)."""
    import copy
    import math

    import torch.nn.functional as F

    model1, model2 = copy.deepcopy(shallow), copy.deepcopy(deep)
    layer_logs = []
    model1.model.norm, model1.lm_head = torch.nn.Identity(), torch.nn.Identity()
    model2.model.norm, model2.lm_head = torch.nn.Identity(), torch.nn.Identity()

    def layer_hook(module, input, output):
        layer_logs.append(output[0] if isinstance(output, tuple) else output)

    def model_pre_hook(module, args, kwargs):
        layer_logs.clear()
        layer_logs.append(args[0] if args else kwargs["hidden_states"])

    for i in range(len(model1.model.layers) - 1, src_layer - 1, -1):
        del model1.model.layers[i]
    model2.model.layers[0].register_forward_pre_hook(model_pre_hook, with_kwargs=True)
    for i in range(len(model2.model.layers)):
        model2.model.layers[i].register_forward_hook(layer_hook)
    dmodel_1, dmodel_2 = model1.model.embed_tokens.weight.shape[1], model2.model.embed_tokens.weight.shape[1]
    torch.manual_seed(seed)
    model = torch.nn.Linear(dmodel_1, dmodel_2 * (len(model2.model.layers) + 1))

    def get_src_target(data):
        data = F.pad(data, (1, 0), value=bos_token)  # their `F.pad(data["data"][:-1].T, (1, 0), value=self.train_set.vocabulary.bos_token())`
        with torch.no_grad():
            res = model1(input_ids=data, use_cache=False)
            model2(input_ids=data, use_cache=False)
            target = torch.stack(layer_logs, dim=-2)
            layer_logs.clear()
            src = res.logits[:, 1:]  # "Do not include the BOS token in every batch"
            target = target[:, 1:]
        return src, target

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd, betas=(0.9, 0.999), eps=1e-8)
    for it in range(steps):
        current = min_lr * lr + (lr - min_lr * lr) * (1 + math.cos(math.pi * max(0, it - warmup) / steps)) / 2  # lr_scheduler.step(max(0, iter - offset))
        if warmup > it:
            current = current / warmup * (it + 1)  # set_linear_warmup(iter, warmup, get_lr(optimizer))
        for group in optimizer.param_groups:
            group["lr"] = current
        optimizer.zero_grad(set_to_none=True)
        data = fit[order[it * batch : (it + 1) * batch]]
        src, target = get_src_target(data)
        loss = F.mse_loss(model(src), target.flatten(start_dim=-2))
        (loss * 1.0).backward()  # one micro-batch: weight = its size / the batch's
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], grad_clip)
        optimizer.step()
    with torch.no_grad():
        relative_accu, loss_count = 0, 0
        for d in held.split(1):
            src, target = get_src_target(d)
            res = model(src)
            tnorm = target.norm(dim=-1).flatten(end_dim=-2)
            err = (res.view_as(target) - target).norm(dim=-1).flatten(end_dim=-2)
            relative_accu += (err / tnorm.clamp(min=torch.finfo(tnorm.dtype).tiny)).mean(0)
            loss_count += 1
    return model, relative_accu / loss_count


def test_the_map_as_csordas_is_their_map_layers_line_by_line():
    """`depth-map --as csordas` on tiny models, settings other than theirs where they would take too
    long or hide a branch (7 steps, 3 warm-up steps so both the warm-up and the cosine run, lr 0.01,
    a clip of 0.01 that binds, batches of 2 of 3 windows so the rounds wrap, seed 5): every shallow stream's trained map and its
    held-out relative errors equal the port of their task's."""
    from depthcurse.depth.csordas_map import MapSettings, window_order
    from depthcurse.depth.depth_map import depth_map

    shallow, deep = tiny_llama(300, layers=2, seed=5).eval(), tiny_llama(300, layers=3, seed=6).eval()
    text = _ids(windows=5, length=9)
    ids = torch.nn.functional.pad(text, (1, 0), value=0)  # as run_depth_map builds their windows for a tokenizer without BOS (their_start)
    settings = MapSettings(steps=7, batch_windows=2, lr=0.01, warmup=3, seed=5, grad_clip=0.01)
    record = depth_map(shallow, deep, ids[:3], ids[3:], batch_size=2, definitions="csordas", settings=settings)
    assert record["streams"] == "entering" and record["score"] == "relative_error" and record["shallow_layers"] == 2 and record["deep_layers"] == 3
    errors = record["scores"]["relative_error"]["mean"]
    assert len(errors) == 3 and len(errors[0]) == 4  # the embedding's output and after each layer, on both sides
    order = window_order(3, settings)
    for src_layer in range(3):
        _, theirs = port_of_map_layers(shallow, deep, src_layer, text[:3], text[3:], 7, 2, 5, lr=0.01, warmup=3, grad_clip=0.01, order=order)
        assert errors[src_layer] == pytest.approx(theirs.tolist(), rel=1e-4), src_layer
    assert record["best"] == [min(range(4), key=lambda j: (errors[i][j], j)) for i in range(3)]
    assert record["relative_depth"]["shallow"] == [0.0, 0.5, 1.0]
    other = depth_map(shallow, deep, ids[:3], ids[3:], batch_size=2, definitions="csordas",
                      settings=MapSettings(steps=7, batch_windows=2, lr=0.01, warmup=3, seed=6, grad_clip=0.01))
    assert other["scores"]["relative_error"]["mean"] != errors  # the seed sets the map's first weights


def test_their_windows_begin_with_the_tokenizers_bos_id_or_0_where_it_has_none(tiny_tokenizer, bos_tokenizer):
    from depthcurse.depth.csordas_map import their_start

    assert tiny_tokenizer.bos_token_id is None and their_start(tiny_tokenizer) == [0]
    assert bos_tokenizer.bos_token_id is not None and their_start(bos_tokenizer) == [bos_tokenizer.bos_token_id]


def test_the_maps_learning_rate_warms_up_then_follows_their_cosine_by_hand():
    from depthcurse.depth.csordas_map import MapSettings, learning_rate

    s = MapSettings(steps=10, lr=1.0, warmup=4, min_lr_multiplier=0.1)
    assert [learning_rate(s, i) for i in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert learning_rate(s, 4) == pytest.approx(1.0) and learning_rate(s, 9) == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi * 5 / 10)) / 2)
    assert learning_rate(MapSettings(steps=10, lr=1.0, warmup=0, min_lr_multiplier=0.5), 10) == pytest.approx(0.5)


def test_a_model_mapped_onto_itself_says_what_that_measures(run_cli, tiny_model_dir, text_file, tmp_path):
    """depth-map A A: the record, the title and the first verdict line say it is one model against
    itself, with the figure its diagonal reached, so that no one reads its best matches as a finding of
    depth (issue 81); fitted on fewer tokens than the stream's width + 1 it is refused before any work,
    naming the windows that fit, and accepted when asked, said, its diagonal short of 1 (issue 87)."""
    from depthcurse.depth.map_report import same_model_line

    out = tmp_path / "self"
    code, stdout, err = run_cli("depth-map", tiny_model_dir, tiny_model_dir, "--data", text_file, "--calib-windows", "3", "--eval-windows", "2", "--seq-len", "16",
                                "--out", out)
    assert code == 0, err
    record = json.loads((out / "depth_map.json").read_text())
    said = " ".join(stdout.split())
    assert record["run"]["same_model"] is True and "(one model against itself)" in said and same_model_line(record) in said
    assert record["best"] == [0, 1, 2, 3]  # each stream onto its own
    assert "one model against itself: the diagonal's per-dimension R^2 is 1.000, every stream onto its own, as an exact map must" in said  # 48 tokens, 33 inputs
    assert record["run"]["fit"] == {"tokens": 48, "inputs": 33, "min_fit_ratio": 1.0, "under_determined": None}
    base = ("depth-map", tiny_model_dir, tiny_model_dir, "--data", text_file, "--calib-windows", "1", "--eval-windows", "2", "--seq-len", "16")
    assert_one_line_error(*run_cli(*base, "--out", tmp_path / "few"),
                          "each map from the shallow model's 32-wide stream (--calib-windows 1 x 16 tokens) is fitted on 16 tokens, fewer than 1 x its 33 inputs: "
                          "under-determined, it would be the minimum-norm map (the ridge's), which cannot recover even the identity; give --calib-windows 3 or more, "
                          "or accept it with --min-fit-ratio 0.48")
    code, stdout, err = run_cli(*base, "--min-fit-ratio", "0.4", "--out", tmp_path / "accepted")
    assert code == 0, err
    assert ("note: each map from the shallow model's 32-wide stream (--calib-windows 1 x 16 tokens) is fitted on 16 tokens, fewer than its 33 inputs: "
            "under-determined, it is the minimum-norm map (the ridge's), which cannot recover even the identity (accepted by --min-fit-ratio 0.4)") in " ".join(err.split())
    record = json.loads((tmp_path / "accepted" / "depth_map.json").read_text())
    diagonal = [record["scores"]["r2_dims"]["mean"][i][i] for i in range(4)]
    assert max(diagonal) < 0.99 and "short of the 1 an exact map gives by up to" in " ".join(stdout.split())
    assert all(iv is None or iv[1] <= 1.0 for row in record["scores"]["r2_dims"]["interval"] for iv in row)


def test_the_fitting_rule_and_the_default_windows_by_hand():
    from depthcurse.depth.depth_map import _summary
    from depthcurse.depth.map_report import fit_windows, fitted_tokens, same_model_line
    from depthcurse.errors import DepthcurseError
    from depthcurse.fitting import check_fit

    assert fit_windows(576, 128, "depthcurse") == 16  # 2 x 577 = 1,154 tokens: 10 windows, under the 16 of the default
    assert fit_windows(4096, 128, "depthcurse") == 65 and fit_windows(4096, 128, "csordas") == 65  # 8,194 tokens: 64.02 windows of 128, 64.5 of 127
    assert fit_windows(4096, 512, "depthcurse") == 17 and fitted_tokens(3, 16, "csordas") == 45  # 8,194 tokens: 16.004 windows of 512
    say = dict(what="m", fix=lambda n: f"need {n}", accept=lambda r: f"ratio {r}")
    assert check_fit(33, 33, min_ratio=1.0, **say) is None
    assert check_fit(20, 33, min_ratio=0.5, **say) == ("m is fitted on 20 tokens, fewer than its 33 inputs: under-determined, it is the minimum-norm map, "
                                                      "which cannot recover even the identity (accepted by ratio 0.5)")
    with pytest.raises(DepthcurseError, match=r"^m is fitted on 20 tokens, fewer than 0.7 x its 33 inputs: .*; need 24, or accept it with ratio 0.6$"):
        check_fit(20, 33, min_ratio=0.7, **say)  # ceil(0.7 x 33) = 24; 20 / 33 = 0.606: 0.6 accepts them, 0.61 would not
    with pytest.raises(DepthcurseError, match=r"^ratio -1.0: the ratio must be 0 or more$"):
        check_fit(20, 33, min_ratio=-1.0, **say)
    cut = _summary([[[0.998, 1.0, 0.999]]], most=1.0)["interval"][0][0]
    assert cut[1] == 1.0 and cut[0] == pytest.approx(0.999 - 4.303 * 0.001 / 3**0.5, abs=1e-4)  # t(2) = 4.303; the upper end 1.0015 cut
    assert _summary([[[0.998, 1.0, 0.999]]])["interval"][0][0][1] > 1.0
    record = {"score": "r2_dims", "scores": {"r2_dims": {"mean": [[0.95, 0.2], [0.1, 0.97]]}}, "run": {"same_model": True}}
    assert same_model_line(record) == ("one model against itself: the diagonal's per-dimension R^2 is 0.950 to 0.970, short of the 1 an exact map gives by up to "
                                       "0.050: the maps are not exact even onto the stream itself; the best matches say nothing of depth, the rest says how "
                                       "well one layer's stream predicts another's within the model")
    record["scores"] = {"relative_error": {"mean": [[0.001, 0.5], [0.5, 0.002]]}}
    record["score"] = "relative_error"
    assert same_model_line(record).startswith("one model against itself: the diagonal's relative error is 0.001 to 0.002, every stream onto its own, as an exact map must")


def test_depth_map_end_to_end_and_two_tokenizers_are_one_line(run_cli, tiny_model_dir, six_dir, bos_model_dir, text_file, tmp_path):
    out = tmp_path / "map"
    code, stdout, err = run_cli("depth-map", tiny_model_dir, six_dir, "--data", text_file, "--calib-windows", "3", "--eval-windows", "2", "--seq-len", "16", "--out", out)
    assert code == 0, err
    said = " ".join(stdout.split())
    assert "which deep layer each shallow layer's stream maps to best" in said and "best match lies" in said
    record = json.loads((out / "depth_map.json").read_text())
    assert record["shallow_layers"] == 4 and record["deep_layers"] == 6 and len(record["r2"]) == 4 and (out / "depth_map.png").is_file()
    assert record["run"]["same_model"] is False and "one model against itself" not in said
    assert_one_line_error(*run_cli("depth-map", tiny_model_dir, bos_model_dir, "--data", text_file, "--seq-len", "16", "--out", tmp_path / "b"),
                          "have different tokenizers")
    assert_one_line_error(*run_cli("depth-map", tiny_model_dir, six_dir, "--data", text_file, "--eval-windows", "1", "--seq-len", "16", "--out", tmp_path / "c"),
                          "--eval-windows at least 2")
    assert record["score"] == "r2_dims" and set(record["scores"]) == {"r2", "r2_dims"} and len(record["variance"]["deep"]) == 6
    theirs = tmp_path / "theirs"
    code, stdout, err = run_cli("depth-map", tiny_model_dir, six_dir, "--data", text_file, "--calib-windows", "3", "--eval-windows", "2", "--seq-len", "16",
                                "--as", "csordas", "--map-steps", "3", "--out", theirs)
    assert code == 0, err
    said = " ".join(stdout.split())
    assert "by the held-out relative error" in said and "their trained linear map" in said and "lower is better" in said
    mapped = json.loads((theirs / "depth_map.json").read_text())
    assert mapped["definitions"]["name"] == "csordas" and mapped["definitions"]["settings"]["steps"] == 3 and len(mapped["best"]) == 5
    # their windows: the BOS pad (0: this tokenizer has no BOS), then seq_len - 1 text tokens; ours: the text as the tokenizer begins it (no BOS)
    assert mapped["run"]["start"] == [0] and record["run"]["start"] == []
    assert_one_line_error(*run_cli("report", out, theirs, "--out", tmp_path / "page.md"), "maps of two definitions")
    assert_one_line_error(*run_cli("depth-map", tiny_model_dir, six_dir, "--data", text_file, "--seq-len", "16", "--as", "other", "--out", tmp_path / "d"),
                          "--as other: no such definitions for the depth map")
    assert_one_line_error(*run_cli("depth-map", tiny_model_dir, six_dir, "--data", text_file, "--seq-len", "16", "--score", "relative_error",
                                   "--out", tmp_path / "e"), "--score relative_error: the depthcurse map gives r2_dims, r2")
    assert_one_line_error(*run_cli("depth-map", tiny_model_dir, six_dir, "--data", text_file, "--seq-len", "16", "--as", "csordas", "--map-steps", "0",
                                   "--out", tmp_path / "f"), "--map-steps and the map's batch must be at least 1")


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


# --------------------------------------------------------------------------- memory
def _vocabulary_peak(model, ids, batch_size, **kw) -> int:
    """The most elements held at once in tensors as wide as the vocabulary, over a whole measurement:
    every op's outputs watched by a dispatch mode, each counted while it lives."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode

    vocab = model.get_output_embeddings().weight.shape[0]
    alive: dict[int, int] = {}  # storage -> its elements, while any tensor on it lives (a view is its base's storage)
    peak = [0]

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == vocab:
                    storage = t.untyped_storage()
                    if storage.data_ptr() not in alive:
                        alive[storage.data_ptr()] = storage.nbytes() // t.element_size()
                        weakref.finalize(storage, alive.pop, storage.data_ptr(), None)
            peak[0] = max(peak[0], sum(alive.values()))
            return out

    with Watch():
        measure_depth_use(model, ids, batch_size, **kw)
    return peak[0]


def test_no_vocabulary_wide_memory_grows_with_depth_and_the_estimate_covers_it():
    """3 and 8 layers, a batch of 3 windows of 64 tokens, influence on: the most vocabulary-wide elements
    held at once is the same at both depths, and within `depth.memory`'s estimate of b t v + 5 t v (the
    output's log-probabilities and one window's lens row), above b t v (the output's are held). Before
    issue 80 every layer's row was kept: the peak grew by b t v a layer. (The stepper's own check, 2 x 40
    tokens against the model's forward, stays below.)"""
    from depthcurse.depth.memory import WINDOW_TEMPORARIES

    ids = _ids(windows=3, length=64)
    peaks = [_vocabulary_peak(tiny_llama(300, layers=n, seed=3).eval(), ids, 3) for n in (3, 8)]
    assert peaks[0] == peaks[1] and 3 * 64 * 300 < peaks[0] <= (3 + WINDOW_TEMPORARIES) * 64 * 300, peaks


def test_the_memory_estimate_by_hand_and_a_run_that_would_not_fit_is_one_line_naming_the_batch_that_does():
    """n 30, d 576, v 49,152 (SmolLM2-135M), 256 tokens, float32: the measurement holds (31 + 30) b t d 4
    + b t v 4 + 5 t v 4 bytes (0.80 GiB at b = 7, 0.88 at 8), the tuned lens (micro-batch 4) 4 t (31 d 4
    + 6 v 4); with 0.75 GiB free, a batch of 8 does not fit and 6 is the largest that does."""
    from depthcurse.depth.memory import Shape, check_fits, lens_bytes, measuring_bytes, peak_bytes
    from depthcurse.errors import DepthcurseError

    smol = Shape(layers=30, width=576, vocab=49152)
    t = 256
    assert measuring_bytes(smol, 4, t) == (31 + 30) * 4 * t * 576 * 4 + 4 * t * 49152 * 4 + 5 * t * 49152 * 4
    assert lens_bytes(smol, 4, t) == 4 * t * (31 * 576 * 4 + 6 * 49152 * 4) and lens_bytes(smol, 0, t) == 0
    assert peak_bytes(smol, 4, t, 4) == max(measuring_bytes(smol, 4, t), lens_bytes(smol, 4, t))
    free = int(0.75 * 2**30)
    assert [b for b in range(1, 9) if measuring_bytes(smol, b, t) <= free][-1] == 6
    with pytest.raises(DepthcurseError, match=r"^depth-use would need about 0\.9 GiB beyond the model's weights at --batch-size 8 x 256 tokens "
                                              r"\(a 49,152-token vocabulary, 30 layers of width 576\), and 0\.8 GiB is free: --batch-size 6 fits \(about 0\.7 GiB\)$"):
        check_fits(smol, 8, t, free)
    with pytest.raises(DepthcurseError, match="no batch fits at this --seq-len: shorten it$"):
        check_fits(smol, 8, t, 10 * 2**20)
    with pytest.raises(DepthcurseError, match="the tuned lens's training, 4 windows a micro-batch, does not fit: shorten --seq-len$"):
        check_fits(smol, 1, t, measuring_bytes(smol, 1, t), lens_micro_batch=4)
    with pytest.raises(DepthcurseError, match="the tuned lens's training, 4 windows a micro-batch, does not fit"):  # a batch of 2 fits, but not with the lens
        check_fits(smol, 3, t, measuring_bytes(smol, 2, t), lens_micro_batch=4)
    with pytest.raises(DepthcurseError, match=r"free: --batch-size 2 fits \(about 0\.4 GiB\)$"):  # the largest below the batch asked
        check_fits(smol, 3, t, measuring_bytes(smol, 2, t))
    assert lens_bytes(smol, 1, t) == t * (31 * 576 * 4 + 6 * 49152 * 4)  # a micro-batch of one window still trains
    from depthcurse.depth.memory import free_bytes

    psutil = pytest.importorskip("psutil")
    free = free_bytes("cpu")
    assert isinstance(free, int) and abs(free - psutil.virtual_memory().available) < 2**30  # the machine's, now
    from depthcurse.depth.memory import Shape as MemoryShape

    model = tiny_llama(300, layers=3)
    assert MemoryShape.of(model) == MemoryShape(layers=3, width=32, vocab=300, dtype_bytes=4)
    assert MemoryShape.of(model.bfloat16()) == MemoryShape(layers=3, width=32, vocab=300, dtype_bytes=2)
    with pytest.raises(DepthcurseError, match=r"free: --batch-size 1 fits \(about 0\.3 GiB\)$"):  # the smallest batch is named where it alone fits
        check_fits(smol, 3, t, measuring_bytes(smol, 1, t))
    assert check_fits(smol, 2, t, lens_bytes(smol, 4, t), lens_micro_batch=4) == lens_bytes(smol, 4, t) > measuring_bytes(smol, 2, t)
    assert check_fits(smol, 8, t, None) == measuring_bytes(smol, 8, t)  # free memory unknown: the estimate alone


def test_depth_use_says_its_memory_estimate_and_counts_the_lens_training_in_it(run_cli, tiny_model_dir, text_file, tmp_path):
    from depthcurse.depth.memory import Shape, lens_bytes, measuring_bytes, peak_bytes

    code, _, err = run_cli("depth-use", tiny_model_dir, "--data", text_file, "--windows", "2", "--seq-len", "16", "--no-influence", "--out", tmp_path / "du")
    assert code == 0 and "memory: about 0.0 GiB beyond the model's weights at its peak" in " ".join(err.split()), err
    assert json.loads((tmp_path / "du" / "depth_use.json").read_text())["memory_estimate_bytes"] > 0
    from transformers import AutoModelForCausalLM  # with --tuned-lens the estimate is the larger of its training and the measurement

    code, _, err = run_cli("depth-use", tiny_model_dir, "--data", text_file, "--windows", "2", "--seq-len", "16", "--no-influence", "--tuned-lens",
                           "--lens-steps", "1", "--dtype", "fp32", "--out", tmp_path / "lens")
    shape = Shape.of(AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    assert code == 0 and lens_bytes(shape, 4, 16) > measuring_bytes(shape, 4, 16), err
    assert json.loads((tmp_path / "lens" / "depth_use.json").read_text())["memory_estimate_bytes"] == peak_bytes(shape, 4, 16, 4) == lens_bytes(shape, 4, 16)


@pytest.mark.statistics
def test_the_tuned_lens_against_the_logit_lens_paired_over_windows_by_hand():
    """Three windows, four layers (the last the output: left out). Row 0: tuned - logit = -1.8, -2, -2.2
    (mean -2, t at 2 df: -2 -+ 4.303 x 0.2 / sqrt(3)): closer; row 1: +0.5, -0.5, +0.3: cannot tell;
    row 2: +1, +1.2, +0.8: further. Ratios of the means: 9 / 7, 2 / 2.1, 1 / 2. The verdict line says
    each count and the range."""
    from depthcurse.depth.report import depth_verdicts, lens_comparison

    plain = [[5.0, 6.0, 7.0], [2.0, 2.0, 2.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    tuned = [[3.2, 4.0, 4.8], [2.5, 1.5, 2.3], [2.0, 2.2, 1.8], [0.0, 0.0, 0.0]]
    use = DepthUse(4, 3, lens_kl=plain, tuned_kl=tuned, tuned_top1=plain, tuned_top5=plain, lens_top1=plain, lens_top5=plain,
                   settled=[0, 0, 0, 36], tuned_settled=[0, 0, 36, 0], attn_norm=plain, mlp_norm=plain, attn_cos=plain, mlp_cos=plain)
    record = {"use": use.summary(), "layers": [{"layer": i} for i in range(4)],
              "tuned_lens": {"train_windows": 8, "settings": {"steps": 5}, "seconds": 3.0}}
    got = lens_comparison(record)
    half = 4.302653 * 0.2 / math.sqrt(3)
    assert [r["row"] for r in got["rows"]] == [0, 1, 2] and got["rows"][0]["difference"] == pytest.approx(-2.0)
    assert got["rows"][0]["interval"] == pytest.approx([-2 - half, -2 + half], rel=1e-5)
    assert [r["verdict"] for r in got["rows"]] == ["closer", "cannot tell", "further"]
    assert [r["ratio"] for r in got["rows"]] == pytest.approx([18 / 12, 6 / 6.3, 3 / 6])
    assert (got["closer"], got["further"], got["cannot_tell"]) == (1, 1, 1) and got["ratio_range"] == pytest.approx([0.5, 1.5])
    line = next(v for v in depth_verdicts(record) if v.startswith("tuned lens"))
    assert line == ("tuned lens: half settled by the stream after layer 2; on the held-out windows its KL(output || lens) against the logit lens's, "
                    "paired over 3 windows: closer at 1 of 3 rows, further at 1, cannot tell at 1; the logit lens's KL is 0.5-1.5x the tuned lens's "
                    "(trained on 8 windows, 5 steps, 3 s)")


def test_a_norm_that_divides_is_floored_by_the_definitions():
    """Theirs floor a vanishing norm at 1e-6, ours at 1e-12: a contribution of 0 against a change of norm 5."""
    from depthcurse.depth.definitions import DEFINITIONS
    from depthcurse.depth.measure import _relative

    x, zero = torch.tensor([[3.0, 4.0]]), torch.zeros(1, 2)
    assert _relative(x, zero, DEFINITIONS["csordas"].norm_floor).item() == pytest.approx(5e6)
    assert _relative(x, zero, DEFINITIONS["depthcurse"].norm_floor).item() == pytest.approx(5e12)


def test_a_depth_maps_record_keeps_every_setting_and_step_and_its_bad_input_is_one_line():
    """Every field of a map's record beside its scores, for both definitions: the definitions and their
    settings, the windows, the ridge, each score's label and direction, each stream's largest
    dimension's share (by hand, also for a stream whose variance is tiny), the relative depths (after
    layer i: (i + 1) / L; entering layer i: i / L) and the Spearman interval at the streams' n; the
    steps it reports; and three kinds of bad input, one line each."""
    from depthcurse.depth.csordas_map import MapSettings
    from depthcurse.depth.depth_map import MAP_DEFINITIONS, depth_map, largest_dimension_share
    from depthcurse.errors import DepthcurseError
    from depthcurse.stats.correlation import spearman_interval

    shallow, deep = tiny_llama(300, layers=2, seed=5).eval(), tiny_llama(300, layers=3, seed=6).eval()
    ids = _ids(windows=6, length=10)
    steps = []
    record = depth_map(shallow, deep, ids[:4], ids[4:], batch_size=3, ridge=0.01, on_step=lambda *a: steps.append(a))
    assert steps == [("the shallow model's streams", 0, 2), ("the deep model's streams", 1, 2), ("maps from shallow layer 0", 0, 2),
                     ("maps from shallow layer 1", 1, 2)]
    assert record["definitions"] == {**MAP_DEFINITIONS["depthcurse"], "settings": {"ridge": 0.01}}
    assert (record["fit_windows"], record["held_out_windows"], record["ridge"]) == (4, 2, 0.01)
    assert {k: (v["label"], v["higher_is_better"]) for k, v in record["scores"].items()} == {
        "r2_dims": ("held-out R^2 per dimension (the mean over dimensions)", True), "r2": ("held-out R^2 pooled over dimensions", True)}
    assert record["variance"]["dominant_at"] == 0.5 and len(record["variance"]["shallow"]) == 2 and len(record["variance"]["deep"]) == 3
    assert record["relative_depth"]["shallow"] == [0.5, 1.0]
    assert record["relative_depth"]["best_deep"] == [(j + 1) / 3 for j in record["best"]]
    assert record["relative_depth"]["spearman_interval"] == spearman_interval(record["relative_depth"]["spearman"], 2)
    tiny = torch.zeros(2, 3, 4, dtype=torch.float64)
    tiny[..., 0] = torch.tensor([[1e-4, 2e-4, 4e-4], [0.0, 1e-4, 3e-4]])  # one dimension varies, by 1e-4: all of the variance, however small
    tiny[..., 1] = torch.tensor([[1e-4, 1e-4, 1e-4], [1e-4, 1e-4, 1e-4]]) * 0.5
    assert largest_dimension_share(tiny) == pytest.approx(1.0)
    g = torch.Generator().manual_seed(1)
    stream = torch.randn(2, 3, 4, generator=g, dtype=torch.float64)
    variance = stream.flatten(0, 1).var(0)
    assert largest_dimension_share(stream) == pytest.approx(float(variance.max() / variance.sum()))
    settings = MapSettings(steps=2, batch_windows=2, warmup=1)
    steps.clear()
    theirs = depth_map(shallow, deep, ids[:4], ids[4:], batch_size=3, definitions="csordas", settings=settings, on_step=lambda *a: steps.append(a))
    assert steps[2:] == [(f"training the map from shallow stream {i} (their loop)", i, 3) for i in range(3)]
    assert theirs["definitions"] == {**MAP_DEFINITIONS["csordas"], "settings": settings.summary()}
    assert theirs["relative_depth"]["shallow"] == [0.0, 0.5, 1.0] and theirs["relative_depth"]["best_deep"] == [j / 3 for j in theirs["best"]]
    assert len(theirs["scores"]["relative_error"]["mean"]) == 3 and len(theirs["scores"]["relative_error"]["mean"][0]) == 4
    with pytest.raises(DepthcurseError, match=r"^--as theirs: no such definitions for the depth map \(known: depthcurse, csordas\)$"):
        depth_map(shallow, deep, ids[:4], ids[4:], batch_size=3, definitions="theirs")
    with pytest.raises(DepthcurseError, match=r"^--score relative_error: the depthcurse map gives r2_dims, r2$"):
        depth_map(shallow, deep, ids[:4], ids[4:], batch_size=3, score="relative_error")
    with pytest.raises(DepthcurseError, match=r"^the depth map needs at least 2 held-out windows \(its intervals are over them\)$"):
        depth_map(shallow, deep, ids[:4], ids[4:5], batch_size=3)


def _hand_record(influence: bool, entering: bool) -> dict:
    """Three layers' rows, worked by hand below."""
    rows = [{"attn_norm": 0.1, "mlp_norm": 0.2, "lens_kl": 3.0, "tuned_kl": 2.0}, {"attn_norm": 0.3, "mlp_norm": 0.1, "lens_kl": 1.5, "tuned_kl": 1.0},
            {"attn_norm": 0.2, "mlp_norm": 0.6, "lens_kl": 0.5, "tuned_kl": 0.25}]
    use = {"influence": [[float("nan"), 0.4, 0.2], [float("nan"), float("nan"), 0.6], [float("nan")] * 3], "output_change": [0.7, 0.2, 0.9]} if influence else {}
    return {"layers": rows, "use": use, "run": {"model": "m"}, "definitions": {"name": "csordas" if entering else "depthcurse"}}


def test_each_layers_measures_and_selects_targets_by_hand():
    """The rows' means and intervals over windows (a figure of one window has none), settling shares;
    each measure per layer on 3 layers (the drops after each layer, or entering it, where the last
    ends at the output); a select record's removal costs (only where every single removal was scored)
    and its whole-block picks with their signs; and two records of different models refused."""
    from depthcurse.depth.agreement import agreement, layer_measures, select_targets
    from depthcurse.depth.measure import DepthUse, per_layer_rows
    from depthcurse.errors import DepthcurseError
    from depthcurse.select.scoring import KEPT
    from depthcurse.stats import mean_interval

    use = DepthUse(n_layers=2, windows=2, attn_norm=[[1.0, 3.0], [2.0, 2.0]], mlp_norm=[[0.5, 0.5], [1.0, 2.0]], attn_cos=[[0.1, 0.3], [0.2, 0.2]],
                   mlp_cos=[[0.0, 0.2], [0.4, 0.4]], lens_kl=[[4.0, 2.0], [1.0, 1.0]], lens_top1=[[0.0, 0.5], [1.0, 1.0]],
                   lens_top5=[[0.5, 0.5], [1.0, 1.0]], settled=[1, 3], tuned_kl=[[2.0, 2.0], [0.5, 1.5]], tuned_top1=[[0.5, 0.5], [1.0, 1.0]],
                   tuned_top5=[[1.0, 1.0], [1.0, 1.0]], tuned_settled=[2, 2])
    rows = per_layer_rows(use)
    assert rows[0]["attn_norm"] == 2.0 and rows[0]["attn_norm_interval"] == mean_interval([1.0, 3.0]) and rows[1]["mlp_norm"] == 1.5
    assert rows[0]["lens_kl"] == 3.0 and rows[1]["tuned_kl"] == 1.0 and rows[0]["tuned_top1"] == 0.5 and rows[1]["attn_cos"] == pytest.approx(0.2)
    assert [r["settled_share"] for r in rows] == [0.25, 0.75] and [r["tuned_settled_share"] for r in rows] == [0.5, 0.5]
    assert set(rows[0]) == {"layer", "settled_share", "tuned_settled_share"} | {f"{n}{s}" for n in ("attn_norm", "mlp_norm", "attn_cos", "mlp_cos",
                            "lens_kl", "lens_top1", "lens_top5", "tuned_kl", "tuned_top1", "tuned_top5") for s in ("", "_interval")}
    one = per_layer_rows(DepthUse(n_layers=1, windows=1, attn_norm=[[2.0]], mlp_norm=[[1.0]], attn_cos=[[0.0]], mlp_cos=[[0.0]], lens_kl=[[1.0]],
                                  lens_top1=[[1.0]], lens_top5=[[1.0]], settled=[0]))
    assert one[0]["attn_norm_interval"] is None and one[0]["settled_share"] == 0.0 and "tuned_kl" not in one[0] and "tuned_settled_share" not in one[0]

    after = layer_measures(_hand_record(influence=False, entering=False))
    assert after == {"contribution ||a||/||h|| + ||m||/||h||": [pytest.approx(0.3), pytest.approx(0.4), pytest.approx(0.8)],
                     "logit lens KL drop": [None, 1.5, 1.0], "tuned lens KL drop": [None, 1.0, 0.75]}
    theirs = layer_measures(_hand_record(influence=True, entering=True))
    assert theirs["logit lens KL drop"] == [1.5, 1.0, 0.5] and theirs["tuned lens KL drop"] == [1.0, 0.75, 0.25]
    assert theirs["influence on later layers"] == [pytest.approx(0.3), pytest.approx(0.6), None]
    assert theirs["output probability change (L2) when skipped"] == [0.7, 0.2, 0.9]
    assert list(layer_measures(_hand_record(influence=True, entering=False)))[2] == "output KL when skipped"

    at = KEPT.index("kl")
    cost = lambda v: [None] * at + [v]  # noqa: E731 -- a removal's scores in select.json's order
    select = {"run": {"n_layers": 3, "model": "m"}, "labels": {"wiki": "Wikipedia"},
              "calibration_scores": {"wiki": {"0": cost(0.5), "1": cost(0.1), "2": cost(0.9)}, "c4": {"0": cost(0.5), "1": cost(0.2)}},
              "cells": {"greedy": {"layers": [1, 2]}, "exact": {"layers": [1]}, "branches": {"layers": ["a1"]}}}
    targets = select_targets(select)
    assert targets == {"removal cost alone (kl, Wikipedia)": ([0.5, 0.1, 0.9], 1), "picked by exact at k = 1": ([0.0, 1.0, 0.0], -1),
                       "picked by greedy at k = 2": ([0.0, 1.0, 1.0], -1)}
    assert list(targets) == ["removal cost alone (kl, Wikipedia)", "picked by exact at k = 1", "picked by greedy at k = 2"]
    rows = agreement(_hand_record(influence=False, entering=False), [select])
    first = rows[0]
    assert (first["measure"], first["target"], first["layers"], first["expected_sign"], first["distinct"]) == (
        "contribution ||a||/||h|| + ||m||/||h||", "removal cost alone (kl, Wikipedia)", 3, 1, 3)
    assert first["rho"] == pytest.approx(0.5) and first["interval"] is None and (first["verdict"], first["agrees"]) == ("cannot tell", None)  # 3 layers: no interval
    drop = next(r for r in rows if r["measure"] == "logit lens KL drop" and r["target"] == "picked by greedy at k = 2")
    assert drop["layers"] == 2 and drop["distinct"] == 1
    with pytest.raises(DepthcurseError, match=r"^--agree-with: a select run of other against depth-use's m$"):
        agreement(_hand_record(influence=False, entering=False), [{**select, "run": {"n_layers": 3, "model": "other"}}])
    with pytest.raises(DepthcurseError, match=r"^--agree-with: a select run of 4 layers against depth-use's 3: not the same model$"):
        agreement(_hand_record(influence=False, entering=False), [{**select, "run": {"n_layers": 4, "model": "m"}}])


def test_the_lens_settings_edges_and_the_phase_transition_by_hand():
    """Each bound of the tuned lens's settings: 1 step, 1 token, a micro-batch of 1, momentum 0 and lr
    and decay at their edges pass; one past each is one line. The change point of the influence rows'
    means by least squares on 3 and 4 rows worked out by hand, where a split at 1 (not at 2) is the
    least, ties go to the earlier split, and a rise is no transition."""
    from depthcurse.depth.measure import DepthUse, phase_transition
    from depthcurse.depth.tuned_lens import LensSettings
    from depthcurse.errors import DepthcurseError

    LensSettings(steps=1, tokens_per_step=1, micro_batch=1, momentum=0.0, lr_scale=1e-9, weight_decay=0.0).check()
    sizes = r"^--lens-steps, the lens's tokens per step and its micro-batch must each be at least 1 \(got {}\)$"
    for bad, got in (({"steps": 0}, "0, 262144, 4"), ({"tokens_per_step": 0}, "250, 0, 4"), ({"micro_batch": 0}, "250, 262144, 0")):
        with pytest.raises(DepthcurseError, match=sizes.format(got)):
            LensSettings(**bad).check()
    for bad in ({"momentum": 1.0}, {"momentum": -0.1}, {"lr_scale": 0.0}, {"weight_decay": -1e-9}):
        with pytest.raises(DepthcurseError, match=r"^the tuned lens needs 0 <= momentum < 1, lr_scale > 0 and weight_decay >= 0$"):
            LensSettings(**bad).check()

    def rows(means):  # an influence matrix whose row i's later entries are all means[i]
        n = len(means) + 1
        return DepthUse(n_layers=n, windows=1, influence=[[float("nan")] * (i + 1) + [m] * (n - i - 1) for i, m in enumerate(means)] + [[float("nan")] * n])

    assert phase_transition(rows([0.9, 0.1, 0.1])) == 1  # sse: split 1 -> 0, split 2 -> 0.32
    assert phase_transition(rows([0.9, 0.8, 0.1, 0.1])) == 2
    assert phase_transition(rows([0.5, 0.3, 0.1])) == 1  # splits 1 and 2 tie at 0.02: the earlier
    assert phase_transition(rows([0.1, 0.1, 0.9])) is None  # the later segment is the higher
    assert phase_transition(rows([0.9, 0.1])) is None and phase_transition(DepthUse(n_layers=3, windows=1)) is None


def _stop_at(label: str, at: int):
    """An on_step that interrupts (as Ctrl-C does) when `label`'s step `at` begins."""
    def on_step(text, done, total):
        if text.startswith(label) and done == at:
            raise KeyboardInterrupt
    return on_step


def _same(a, b) -> bool:
    """Equal to the last bit, NaN equal to NaN (the influence matrix's unmeasured cells)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def test_an_interrupted_lens_measurement_and_map_resume_to_an_uninterrupted_runs_figures(tmp_path):
    """Ctrl-C at the tuned lens's step 2 of 5, at the measurement's batch 1 of 3 and at the map's row 2
    of 4 (both definitions): each kept what finished, and the rerun's lens, figures and rows equal an
    uninterrupted run's to the last bit (issue 81)."""
    from depthcurse.depth.depth_map import depth_map
    from depthcurse.depth.csordas_map import MapSettings
    from depthcurse.depth.measure import measure_depth_use, stepper_of
    from depthcurse.depth.tuned_lens import LensSettings, partial_step, train_tuned_lens

    model, ids = tiny_llama(300, layers=3, seed=5).eval(), _ids(windows=6, length=10)
    stepper = stepper_of(model)
    settings = LensSettings(steps=5, tokens_per_step=30, micro_batch=2)
    whole, whole_record = train_tuned_lens(model, stepper, ids, settings, clock=lambda: 0.0)
    state = tmp_path / "lens.partial.safetensors"
    with pytest.raises(KeyboardInterrupt):
        train_tuned_lens(model, stepper, ids, settings, on_step=_stop_at("training", 2), state=state, clock=lambda: 0.0)
    assert partial_step(state) == (2, 5)
    heard = []
    resumed, record = train_tuned_lens(model, stepper, ids, settings, state=state, clock=lambda: 0.0, on_step=lambda t, d, n: heard.append(d))
    assert heard == [2, 3, 4]  # the kept steps are not run again
    assert all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(), resumed.state_dict().values()))
    assert record == {**whole_record, "resumed_at_step": 2}
    mid_round = tmp_path / "mid.partial.safetensors"  # stopped after step 1 of 5, half way round the windows: the round goes on, not again
    ticks = iter(range(0, 10_000, 10))
    with pytest.raises(KeyboardInterrupt):
        train_tuned_lens(model, stepper, ids, settings, on_step=_stop_at("training", 1), state=mid_round, clock=lambda: float(next(ticks)))
    ticks = iter(range(1000, 10_000, 10))
    resumed, record = train_tuned_lens(model, stepper, ids, settings, state=mid_round, clock=lambda: float(next(ticks)))
    assert all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(), resumed.state_dict().values()))
    assert record["seconds"] == 10.0 + 50.0  # 10 s kept before the stop, then started at 1000, four steps saved, the end at 1050
    other = tmp_path / "other.partial.safetensors"  # another training's state is not taken up
    state.rename(other)
    fresh, _ = train_tuned_lens(model, stepper, ids, LensSettings(steps=4, tokens_per_step=30, micro_batch=2), state=other, clock=lambda: 0.0)
    assert partial_step(other) == (4, 4)

    whole_use = measure_depth_use(model, ids, batch_size=2, tuned=whole)
    kept = tmp_path / "use.partial.json"
    with pytest.raises(KeyboardInterrupt):
        measure_depth_use(model, ids, batch_size=2, tuned=whole, kept=kept, on_step=_stop_at("the whole model's pass", 1))
    assert json.loads(kept.read_text())["batches"] == 1 and json.loads(kept.read_text())["of"] == 3
    heard = []
    again = measure_depth_use(model, ids, batch_size=2, tuned=whole, kept=kept, on_step=lambda t, d, n: heard.append(d))
    assert _same(again.summary(), whole_use.summary()) and sorted(set(heard)) == [1, 2]  # batch 0 was kept
    other_batches = measure_depth_use(model, ids, batch_size=3, tuned=whole, kept=kept, influence=False, on_step=lambda t, d, n: heard.append((t, d)))
    assert ("the whole model's pass and the lens", 0) in heard and other_batches.windows == 6  # another measurement's batches: all run

    deep = tiny_llama(300, layers=4, seed=6).eval()
    for definitions, label, settings_, ns in (("depthcurse", "maps from shallow layer", MapSettings(), 3),
                                              ("csordas", "training the map", MapSettings(steps=3, warmup=1), 4)):  # after each layer; entering each and the output
        whole_map = depth_map(model, deep, ids[:4], ids[4:], batch_size=2, definitions=definitions, settings=settings_, clock=lambda: 0.0)
        rows = tmp_path / f"{definitions}.partial.json"
        with pytest.raises(KeyboardInterrupt):
            depth_map(model, deep, ids[:4], ids[4:], batch_size=2, definitions=definitions, settings=settings_, kept=rows, on_step=_stop_at(label, 2))
        assert json.loads(rows.read_text())["rows"] == 2 and json.loads(rows.read_text())["of"] == ns
        heard = []
        again = depth_map(model, deep, ids[:4], ids[4:], batch_size=2, definitions=definitions, settings=settings_, kept=rows, clock=lambda: 0.0,
                          on_step=lambda t, d, n: heard.append(d) if t.startswith(label) else None)
        assert _same(again, whole_map) and heard == list(range(2, ns))  # rows 0 and 1 were kept
        heard.clear()
        depth_map(model, deep, ids[:4], ids[4:], batch_size=2, definitions=definitions, settings=settings_, ridge=0.5, kept=rows,
                  on_step=lambda t, d, n: heard.append(d) if t.startswith(label) else None)
        assert heard == list(range(ns))  # another ridge's rows: not taken up


def test_depth_use_and_depth_map_interrupted_say_what_they_kept_and_the_rerun_finishes_as_one_run(run_cli, tiny_model_dir, six_dir, text_file,
                                                                                                   tmp_path, monkeypatch):
    """Through the command line: Ctrl-C after the tuned lens's second step keeps the folder and the
    lens's state and says so in the line every command prints; the rerun trains on from step 2 and its
    figures equal an uninterrupted run's; depth-map stopped after its first row likewise (issue 81)."""
    from depthcurse.depth import depth_map as map_module
    from depthcurse.depth import tuned_lens

    base = ["depth-use", tiny_model_dir, "--data", text_file, "--windows", "2", "--seq-len", "16", "--no-influence", "--tuned-lens", "--lens-steps", "4",
            "--calib-windows", "3"]
    code, _, err = run_cli(*base, "--out", tmp_path / "whole")
    assert code == 0, err
    save = tuned_lens._save_state

    def stopping(path, lens, opt, step, *rest):
        save(path, lens, opt, step, *rest)
        if step == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(tuned_lens, "_save_state", stopping)
    out = tmp_path / "cut"
    code, _, err = run_cli(*base, "--out", out)
    assert code == 130 and f"interrupted: the tuned lens's first 2 of 4 steps kept in {out}; rerun the same command to continue" in " ".join(err.split())
    monkeypatch.setattr(tuned_lens, "_save_state", save)
    code, _, err = run_cli(*base, "--out", out)
    assert code == 0, err
    whole, resumed = (json.loads((tmp_path / name / "depth_use.json").read_text()) for name in ("whole", "cut"))
    assert resumed["tuned_lens"]["resumed_at_step"] == 2 and _same(resumed["layers"], whole["layers"]) and _same(resumed["use"], whole["use"])
    assert not (out / tuned_lens.PARTIAL_FILE).exists() and not (out / "depth_use.partial.json").exists()

    from depthcurse.forecast import Forecast  # Ctrl-C after the measurement's first batch of two: kept, said, taken up

    heard = Forecast.step_done

    def stop_measuring(self, index):
        heard(self, index)
        if self.what.startswith("the measurement") and index == 0:
            raise KeyboardInterrupt

    measured = ["depth-use", tiny_model_dir, "--data", text_file, "--windows", "4", "--batch-size", "2", "--seq-len", "16"]
    monkeypatch.setattr(Forecast, "step_done", stop_measuring)
    code, _, err = run_cli(*measured, "--out", tmp_path / "m")
    assert code == 130 and f"interrupted: 1 of 2 batches of windows measured kept in {tmp_path / 'm'}" in " ".join(err.split()), err
    monkeypatch.setattr(Forecast, "step_done", heard)
    assert run_cli(*measured, "--out", tmp_path / "m")[0] == 0 and run_cli(*measured, "--out", tmp_path / "m-whole")[0] == 0
    cut, whole = (json.loads((tmp_path / name / "depth_use.json").read_text()) for name in ("m", "m-whole"))
    assert _same(cut["use"], whole["use"]) and not (tmp_path / "m" / "depth_use.partial.json").exists()

    held = map_module.held_out_r2
    calls = []

    def stopping_map(*args):
        calls.append(1)
        if len(calls) == 6 * 2 + 1:  # two rows of six maps done: the thirteenth stops it
            raise KeyboardInterrupt
        return held(*args)

    monkeypatch.setattr(map_module, "held_out_r2", stopping_map)
    args = ["depth-map", tiny_model_dir, six_dir, "--data", text_file, "--calib-windows", "3", "--eval-windows", "2", "--seq-len", "16"]
    code, _, err = run_cli(*args, "--out", tmp_path / "map")
    said = " ".join(err.split())
    assert code == 130 and "interrupted: 2 of 4 shallow streams' rows kept in" in said and "rerun the same command to continue" in said
    monkeypatch.setattr(map_module, "held_out_r2", held)
    code, _, err = run_cli(*args, "--out", tmp_path / "map")
    assert code == 0, err
    code, _, err = run_cli(*args, "--out", tmp_path / "map-whole")
    assert code == 0, err
    cut, whole_map = (json.loads((tmp_path / name / "depth_map.json").read_text()) for name in ("map", "map-whole"))
    assert _same(cut["scores"], whole_map["scores"]) and cut["best"] == whole_map["best"]


def test_the_outputs_kl_is_output_kl_to_the_bit_in_any_window_order():
    """`Output.kl` (one window's p held, `vecdot(p, log p - log q)`) against `output_kl` on three windows
    read in the order 1, 0, 0, 2, 1: the same figure to the bit each time, and 0 for the output read
    against itself, whichever window's p was held before."""
    from depthcurse.depth.measure import Output, output_kl

    gen = torch.Generator().manual_seed(8)
    final = torch.log_softmax(torch.randn(3, 4, 50, generator=gen), -1)
    other = torch.log_softmax(torch.randn(3, 4, 50, generator=gen), -1)
    output = Output(final)
    for w in (1, 0, 0, 2, 1):
        assert torch.equal(output.kl(w, other[w]), output_kl(final[w], other[w])), w
        assert torch.equal(output.kl(w, final[w]), torch.zeros(4)) and torch.equal(output.probs(w), final[w].exp())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_lens_rows_figures_by_each_definitions_rule_by_hand(dtype):
    """One window of 2 tokens over a 7-token vocabulary: the KL in each direction (ours KL(output ||
    lens), theirs KL(lens || output)), top-1 agreement, the output's top-1 among the lens's top 5 (ours)
    and the top-5 overlap / 5 (theirs), worked out with numpy; and where each token settles, with and
    without the output as the last row. In fp32 ours is read by the vocabulary kernel where it builds,
    in float64 by torch's log-softmax."""
    import numpy as np

    from depthcurse.depth.definitions import DEFINITIONS
    from depthcurse.depth.measure import Output, _LensFigures

    final_p = np.array([[0.40, 0.20, 0.15, 0.10, 0.08, 0.05, 0.02], [0.04, 0.50, 0.15, 0.11, 0.10, 0.06, 0.04]])
    lens_p = np.array([[0.01, 0.40, 0.20, 0.14, 0.10, 0.08, 0.07], [0.02, 0.40, 0.03, 0.05, 0.21, 0.10, 0.19]])
    final, lens = torch.tensor(np.log(final_p), dtype=dtype)[None], torch.tensor(np.log(lens_p), dtype=dtype) + 3.0  # logits: any shift
    ours_kl = (final_p * (np.log(final_p) - np.log(lens_p))).sum(-1).mean()
    theirs_kl = (lens_p * (np.log(lens_p) - np.log(final_p))).sum(-1).mean()
    top5 = lambda p: set(np.argsort(-p)[:5])  # noqa: E731
    overlap = np.mean([len(top5(final_p[t]) & top5(lens_p[t])) / 5 for t in range(2)])
    assert overlap == pytest.approx(0.8)  # token 0: {0,1,2,3,4} and {1,2,3,4,5} share 4; token 1: {1,2,3,4,5} and {1,4,6,5,3} share 4
    for name, kl, top5_figure in (("depthcurse", ours_kl, 0.5), ("csordas", theirs_kl, overlap)):
        kl_rows, top1_rows, top5_rows = [[]], [[]], [[]]
        figures = _LensFigures(Output(final), DEFINITIONS[name], kl_rows, top1_rows, top5_rows)
        figures.read(0, 0, lens)
        assert kl_rows[0][0] == pytest.approx(kl, rel=1e-6) and top1_rows[0][0] == pytest.approx(0.5)  # token 1 agrees (1), token 0 not (1 against 0)
        assert top5_rows[0][0] == pytest.approx(top5_figure), name  # ours: token 0's output top-1 (0) is not in the lens's top 5, token 1's (1) is
        settled, plus_output = [0, 0], [0, 0]
        figures.settle(settled, with_output=False)
        figures.settle(plus_output, with_output=True)
        assert settled == [1, 1] and plus_output == [1, 1]  # token 1 settles at the lens row; token 0 only at the output (row 1)


class _Clock:
    """A clock the test holds: each reading `tick` seconds after the last."""

    def __init__(self, tick: float):
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def test_depth_use_says_each_parts_forecast_and_keeps_it(tiny_model_dir, text_file):
    from depthcurse.depth import LensSettings, run_depth_use
    from depthcurse.loading import load_model

    loaded = load_model(str(tiny_model_dir))
    notes = []
    record = run_depth_use(loaded, str(text_file), windows=4, seq_len=16, batch_size=2, influence=False, tuned=True, lens_windows=2,
                           lens_settings=LensSettings(steps=3, micro_batch=1), on_note=notes.append, clock=_Clock(0.5), free=None)
    forecasts = [n for n in notes if "steps to run" in n]
    assert forecasts[0].startswith("the tuned lens's steps: 3 steps to run, the first took ") and forecasts[1].startswith(
        "the measurement's batches of windows: 2 steps to run, the first took ")
    assert set(record["forecasts"]) == {"the tuned lens's steps", "the measurement's batches of windows"}
    assert all(f["forecast_seconds"] > 0 and f["seconds"] > 0 for f in record["forecasts"].values())


def test_a_block_that_adds_more_than_its_branches_is_refused_naming_its_family():
    """A block whose stream gets something besides its attention and MLP outputs (a family whose branches
    meet the stream another way, which depth-use would read wrongly) is refused in one line on the first
    batch, the share it is off by said: at 2e-3 of the block's change, past the 1e-3 allowed, and on the last
    block too; at 5e-4 it measures; `--as csordas` reads the modules as they are (issue 87)."""
    from depthcurse.depth.definitions import DEFINITIONS
    from depthcurse.errors import DepthcurseError

    model, ids = _model(), _ids()
    seen = {}
    for block in (2, 4):
        layer = model.model.layers[block]
        probe = [layer.register_forward_pre_hook(lambda m, a, k: seen.__setitem__("in", (a[0] if a else k["hidden_states"]).clone()), with_kwargs=True),
                 layer.register_forward_hook(lambda m, a, out: seen.__setitem__("out", out.clone()))]
        measure_depth_use(model, ids[:2], 2, influence=False)  # the first batch, as the check sees it
        for h in probe:
            h.remove()
        change = seen["out"] - seen["in"]
        direction = torch.randn(change.shape, generator=torch.Generator().manual_seed(block))
        for share, refused in ((2e-3, True), (5e-4, False)):
            delta = direction * (share * change.norm() / direction.norm())
            extra = layer.register_forward_hook(lambda m, a, out, delta=delta: out + delta if out.shape == delta.shape else out)  # the batch checked
            try:
                if not refused:
                    measure_depth_use(model, ids, 2, influence=False)
                    continue
                off = (delta.norm() / (change + delta).norm()).item()
                with pytest.raises(DepthcurseError, match=rf"^depth-use reads what each sublayer adds to the residual stream, but in LlamaDecoderLayer \(block "
                                                          rf"{block}, llama\) the attention and MLP outputs do not add up to the block's change \(off by "
                                                          rf"{off:.2g} of it\): this family is not measured$"):
                    measure_depth_use(model, ids, 2, influence=False)
                measure_depth_use(model, ids, 2, influence=False, definitions=DEFINITIONS["csordas"])
            finally:
                extra.remove()


def test_the_maps_table_and_verdicts_print_every_figure_worked_by_hand():
    """map_table and map_verdicts on records made here, their figures chosen so that another column, a
    swapped comparison or the other model's row prints another number (issue 88): ours (the stream after
    each layer, higher is better) and theirs (the embedding's stream first, lower is better)."""
    from depthcurse.depth.definitions import DEFINITIONS
    from depthcurse.depth.map_report import map_table, map_verdicts, same_model_line

    run = {"shallow": {"model": "s"}, "deep": {"model": "d"}, "data": "wiki", "seq_len": 16, "same_model": False}
    ours = {"run": run, "streams": "after", "shallow_layers": 2, "deep_layers": 4, "fit_windows": 3, "held_out_windows": 2, "ridge": 0.001,
            "score": "r2_dims", "best": [1, 2],
            "scores": {"r2_dims": {"mean": [[0.1, 0.6, 0.3, 0.5], [0.05, 0.15, 0.7, 0.45]], "label": "held-out R^2 per dimension",
                                   "interval": [[None, [0.55, 0.65], None, None], [None, None, [0.6, 0.8], None]]},
                       "r2": {"mean": [[0.2, 0.65, 0.35, 0.55], [0.1, 0.2, 0.75, 0.5]], "label": "held-out R^2 pooled",
                              "interval": [[None, [0.6, 0.7], None, None], [None] * 4]}},
            "relative_depth": {"shallow": [0.5, 1.0], "best_deep": [0.5, 0.75], "mean_abs_difference": 0.125, "spearman": 1.0, "spearman_interval": None},
            "variance": {"shallow": [0.6, 0.7], "deep": [0.6, 0.55, 0.5, 0.2], "dominant_at": 0.5}}  # 0.5 itself: dominated
    table = map_table(ours)
    assert [c.header for c in table.columns] == ["shallow layer", "relative depth", "best deep layer", "its relative depth", "held-out R^2 per dimension",
                                                 "held-out R^2 pooled", "at the same relative depth"]
    # the same relative depth: round(0.5 x 4) - 1 = layer 1 and round(1.0 x 4) - 1 = layer 3, read in the deciding score
    assert table_cells(table) == [["0", "0.50", "1", "0.50", "0.600 [0.550, 0.650]", "0.650 [0.600, 0.700]", "0.600 (layer 1)"],
                                 ["1", "1.00", "2", "0.75", "0.700 [0.600, 0.800]", "0.750", "0.450 (layer 3)"]]
    assert map_verdicts(ours) == [
        "each shallow layer's best match lies 0.12 of the depth away from its own relative depth on average; the two orders agree by Spearman's rho +1.00",
        "the shallow model's last layer maps best to deep layer 2 of 4 (per-dimension R^2 0.700); the deep model's last layer is reached with "
        "per-dimension R^2 0.500 at best",  # layer 3's column: 0.5 from shallow layer 0, 0.45 from the last
        "in 2 of the shallow model's 2 streams one dimension holds 50% of the variance or more (up to 70%): a pooled R^2 there is mostly that "
        "dimension's; the per-dimension R^2 weighs every dimension alike",
        "in 3 of the deep model's 4 streams one dimension holds 50% of the variance or more (up to 60%): a pooled R^2 there is mostly that "
        "dimension's; the per-dimension R^2 weighs every dimension alike"]
    itself = {**ours, "run": {**run, "same_model": True}}
    assert map_verdicts(itself)[0] == same_model_line(itself) and map_verdicts(itself)[1:] == map_verdicts(ours)
    pooled = {**ours, "score": "r2", "relative_depth": {**ours["relative_depth"], "spearman": None}, "variance": None}
    assert map_verdicts(pooled) == [
        "each shallow layer's best match lies 0.12 of the depth away from its own relative depth on average; the two orders agree by Spearman's rho -",
        "the shallow model's last layer maps best to deep layer 2 of 4 (R^2 0.750); the deep model's last layer is reached with R^2 0.550 at best"]
    legacy = {key: value for key, value in ours.items() if key not in ("scores", "score")}  # a record from before the scores were named
    legacy.update(r2=ours["scores"]["r2"]["mean"], r2_interval=[[None, [0.6, 0.7], None, None], [None] * 4])
    assert [c.header for c in map_table(legacy).columns][4] == "held-out R^2 pooled over dimensions"
    assert [row[4] for row in table_cells(map_table(legacy))] == ["0.650 [0.600, 0.700]", "0.750"]
    theirs = {"run": run, "streams": "entering", "shallow_layers": 2, "deep_layers": 2, "fit_windows": 3, "held_out_windows": 2, "ridge": 0.001,
              "definitions": {"source": "their code"}, "score": "relative_error", "best": [0, 1, 2],
              "scores": {"relative_error": {"mean": [[0.2, 0.5, 0.9], [0.6, 0.3, 0.35], [0.9, 0.7, 0.4]], "label": "held-out relative error",
                                           "interval": [[None] * 3] * 3}},
              "relative_depth": {"shallow": [0.0, 0.5, 1.0], "best_deep": [0.0, 0.5, 1.0], "mean_abs_difference": 0.0, "spearman": 1.0,
                                 "spearman_interval": [0.9, 1.0]}}
    assert table_cells(map_table(theirs)) == [["embedding", "0.00", "embedding", "0.00", "0.200", "0.200 (layer embedding)"],
                                             ["after 0", "0.50", "after 0", "0.50", "0.300", "0.300 (layer after 0)"],
                                             ["after 1", "1.00", "after 1", "1.00", "0.400", "0.400 (layer after 1)"]]
    assert map_verdicts(theirs) == [
        "each shallow layer's best match lies 0.00 of the depth away from its own relative depth on average; the two orders agree by Spearman's rho "
        "+1.00 [+0.90, +1.00]",
        "the shallow model's last layer maps best to deep stream after 1 of 2 (relative error 0.400); the deep model's last layer is reached with "
        "relative error 0.350 at best"]  # the lowest of the last column, from the stream after shallow layer 0
    assert map_table(ours).title == ("s (2 layers) -> d (4 layers): which deep layer each shallow layer's stream maps to best, by the held-out R^2 "
                                     "per dimension")
    assert map_table({**ours, "run": {**run, "same_model": True}}).title.endswith("by the held-out R^2 per dimension (one model against itself)")
    assert map_table(ours).caption == (
        "a linear map (least squares, ridge 0.001) from the stream after the shallow layer to the stream after each deep layer, fitted on 3 windows "
        "of wiki x 16 tokens, scored on 2 held-out windows (mean, in brackets the 95% interval, Student's t over windows, an R^2's cut at 1, the most "
        "it can be; higher is better); relative depth: (layer + 1) / layers; per dimension: each dimension's R^2, then their mean (one dimension "
        "cannot decide it); pooled: over every dimension at once (a dimension counts by its variance)")
    assert map_table(theirs).title == "s (2 layers) -> d (2 layers): which deep layer each shallow layer's stream maps to best, by the held-out relative error"
    assert map_table(theirs).caption == (
        "their trained linear map (their code) from each shallow stream (the embedding's output, then after each layer) to every deep stream at "
        "once, fitted on 3 windows of wiki x 16 tokens, scored on 2 held-out windows (mean, in brackets the 95% interval, Student's t over windows; "
        "lower is better); relative depth: stream / layers (0: the embedding)")
    entering = DEFINITIONS["csordas"]
    assert [entering.row_label(r, 3) for r in range(4)] == ["the embedding", "entering layer 1", "entering layer 2", "the output"]
    assert [DEFINITIONS["depthcurse"].row_label(r, 3) for r in range(3)] == ["after layer 0", "after layer 1", "after layer 2"]


def test_a_maps_r2_intervals_are_cut_at_1():
    """The diagonal of a model onto itself, a ridge of 0.05 shrinking it to R^2 0.98, scored on 2 held-out
    windows (t at 1 degree of freedom: 12.7): the t interval reaches past 1, and is cut there; pooled and
    per dimension alike."""
    from depthcurse.depth.depth_map import depth_map

    model = _model()
    held = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(7))
    record = depth_map(model, model, _ids(windows=6, length=12), held, batch_size=3, ridge=0.05)
    for name in ("r2_dims", "r2"):
        diagonal = [record["scores"][name]["interval"][i][i] for i in range(5)]
        assert all(iv[1] <= 1.0 for row in record["scores"][name]["interval"] for iv in row) and 1.0 in [iv[1] for iv in diagonal], name
        assert all(iv[0] < record["scores"][name]["mean"][i][i] for i, iv in enumerate(diagonal))


def test_depth_uses_table_overview_and_agreement_table_cell_by_cell_by_hand():
    """depth_table, depth_overview and agreement_table on records worked out here, whose figures differ
    from column to column and row to row, so that a cell read from another column, another row or
    another lens prints another figure (issue 88: no table builder without a test of its cells)."""
    from depthcurse.depth.measure import DepthUse, per_layer_rows
    from depthcurse.depth.report import agreement_table, depth_overview, depth_table

    use = DepthUse(n_layers=3, windows=2, attn_norm=[[0.1, 0.3], [0.5, 0.5], [0.9, 1.1]], mlp_norm=[[1.0, 1.0], [2.0, 4.0], [3.0, 3.0]],
                   attn_cos=[[0.1, 0.1], [-0.2, -0.2], [0.3, 0.5]], mlp_cos=[[0.6, 0.6], [0.7, 0.7], [0.8, 0.8]],
                   lens_kl=[[5.0, 7.0], [3.0, 3.0], [0.0, 0.0]], lens_top1=[[0.0, 0.5], [0.5, 0.5], [1.0, 1.0]],
                   lens_top5=[[0.25, 0.25], [0.75, 0.75], [1.0, 1.0]], settled=[2, 1, 5],
                   influence=[[float("nan"), 0.4, 0.2], [float("nan"), float("nan"), 0.6], [float("nan")] * 3], output_change=[0.7, 0.2, 0.9])
    record = {"run": {"model": "m", "windows": 2, "seq_len": 4, "data": "wiki"}, "definitions": {"name": "depthcurse"}, "use": use.summary(),
              "layers": per_layer_rows(use), "phase_transition": 1}
    table = depth_table(record)
    assert table.title == "m: how each layer is used, 2 windows x 4 tokens of wiki (depthcurse definitions)"
    assert [c.header for c in table.columns] == ["layer", "attention ||a||/||h||", "MLP ||m||/||h||", "cos(a, h)", "cos(m, h)", "lens KL", "lens top-1",
                                                 "lens top-5", "settles here", "influence on later layers", "output KL when skipped"]
    cells = table_cells(table)
    assert cells[0][:2] == ["0", "0.200 [-1.071, 1.471]"] and cells[1][2] == "3.000 [-9.706, 15.706]" and cells[2][3] == "0.400 [-0.871, 1.671]"
    assert [row[5] for row in cells] == ["6.000 [-6.706, 18.706]", "3.000 [3.000, 3.000]", "0.000 [0.000, 0.000]"]  # the same in both windows: no spread
    assert [row[8] for row in cells] == ["25.0%", "12.5%", "62.5%"] and [row[9] for row in cells] == ["0.300", "0.600", "-"]
    assert [row[10] for row in cells] == ["0.700", "0.200", "0.900"]
    overview = depth_overview([record, {**record, "phase_transition": None, "run": {**record["run"], "model": "n", "data": "code"}}], ["a", "b"])
    assert table_cells(overview) == [["a", "m", "wiki, 2 x 4", "3", "1 (33%)", "2", "-", "2"], ["b", "n", "code, 2 x 4", "3", "-", "2", "-", "2"]]  # 2 + 1 < 4 of 8
    rows = [{"measure": "influence", "target": "removal cost", "rho": 0.84, "interval": [0.66, 0.93], "layers": 29, "distinct": 29, "expected_sign": 1,
             "verdict": "agrees"},
            {"measure": "contribution", "target": "exact's pick", "rho": -0.34, "interval": [-0.63, 0.03], "layers": 30, "distinct": 2, "expected_sign": -1,
             "verdict": "cannot tell"},
            {"measure": "lens", "target": "greedy's pick", "rho": None, "interval": None, "layers": 2, "distinct": 1, "expected_sign": -1, "agrees": None}]
    agreed = agreement_table({"agreement": rows})
    assert [c.header for c in agreed.columns] == ["measure", "against", "rho [95%]", "layers", "the target's distinct values", "expected", "verdict"]
    assert table_cells(agreed) == [["influence", "removal cost", "+0.84 [+0.66, +0.93]", "29", "29", "+", "agrees"],
                                   ["contribution", "exact's pick", "-0.34 [-0.63, +0.03]", "30", "2", "-", "cannot tell"],
                                   ["lens", "greedy's pick", "-", "2", "1", "-", "cannot tell"]]


def test_run_depth_map_fits_its_default_windows_says_an_under_determined_map_and_writes_its_record(tiny_tokenizer, bos_tokenizer, text_file, tmp_path):
    """`run_depth_map` on models in memory (not through the command line): its default fitting windows
    (16 here: the stream is 32 wide), the record's run (both models, the text, the start, the fit, one
    model against itself), its bad input and its under-determined fit each one line or one note; what an
    interrupted map kept, in words; the record and the figure written (issue 88)."""
    from depthcurse.depth.csordas_map import MapSettings, their_start
    from depthcurse.depth.map_report import KEPT_FILE, kept_summary, run_depth_map, write_map
    from depthcurse.errors import DepthcurseError
    from depthcurse.loading import LoadedModel

    def loaded(model, source, tokenizer=tiny_tokenizer):
        return LoadedModel(model=model, tokenizer=tokenizer, name=source, source=source, dtype=torch.float32, device=torch.device("cpu"))

    shallow = loaded(tiny_llama(len(tiny_tokenizer), layers=2, seed=1), "s")
    deep = loaded(tiny_llama(len(tiny_tokenizer), layers=3, seed=2), "d")
    said = []
    record = run_depth_map(shallow, deep, str(text_file), None, 2, 8, 4, on_note=said.append)
    assert record["fit_windows"] == 16 and record["held_out_windows"] == 2 and said[-1].startswith("the map's rows")
    assert record["wall_time_s"] >= 0 and {"command", "commit", "cpu", "packages"} <= set(record["environment"])  # how it was made (issue 90)
    run = record["run"]
    assert run["fit"] == {"tokens": 128, "inputs": 33, "min_fit_ratio": 1.0, "under_determined": None}
    assert (run["shallow"]["source"], run["deep"]["source"], run["data"], run["seq_len"], run["start"], run["same_model"]) == ("s", "d", str(text_file), 8, [], False)
    assert run["shallow"]["architecture"]["num_hidden_layers"] == 2 and run["deep"]["architecture"]["num_hidden_layers"] == 3 and "device" not in run["shallow"]
    assert run_depth_map(shallow, shallow, str(text_file), 16, 2, 8, 4)["run"]["same_model"] is True
    said.clear()
    thin = run_depth_map(shallow, deep, str(text_file), 2, 2, 8, 4, on_note=said.append, min_fit_ratio=0.1)  # 16 tokens for 33 inputs
    assert thin["run"]["fit"]["under_determined"] == said[0] and "--calib-windows 2 x 8 tokens" in said[0] and "the minimum-norm map" in said[0]
    with pytest.raises(DepthcurseError, match="give --calib-windows 5 or more"):
        run_depth_map(shallow, deep, str(text_file), 2, 2, 8, 4)
    for bad in ((0, 2, 8, 4), (4, 1, 8, 4), (4, 2, 1, 4), (4, 2, 8, 0)):
        with pytest.raises(DepthcurseError, match=r"^--calib-windows must be at least 1, --eval-windows at least 2 \(the intervals are over them\), "
                                                  r"--seq-len at least 2, --batch-size at least 1$"):
            run_depth_map(shallow, deep, str(text_file), *bad)
    edge = run_depth_map(shallow, deep, str(text_file), 1, 2, 2, 1, min_fit_ratio=0.01, ridge=0.5, score="r2", clock=lambda: 7.0)  # every least value taken
    assert (edge["fit_windows"], edge["ridge"], edge["score"], edge["wall_time_s"], edge["forecast"]["seconds"]) == (1, 0.5, "r2", 0.0, 0.0)
    assert edge["run"]["fit"]["tokens"] == 2 and "(--calib-windows 1 x 2 tokens)" in edge["run"]["fit"]["under_determined"]
    said.clear()
    settings = MapSettings(steps=2, warmup=1, batch_windows=2)
    theirs = run_depth_map(shallow, deep, str(text_file), 2, 2, 8, 4, definitions="csordas", settings=settings, on_note=said.append, min_fit_ratio=0.1)
    assert theirs["run"]["start"] == their_start(tiny_tokenizer) == [0] and theirs["definitions"]["settings"] == settings.summary()
    assert theirs["run"]["fit"]["tokens"] == 14 and "whatever AdamW reaches from its start" in said[0] and "(--calib-windows 2 x 7 tokens)" in said[0]
    with pytest.raises(DepthcurseError, match=r"^each map from the shallow model's 32-wide stream \(--calib-windows 4 x 8 tokens\) is fitted on 32 tokens, "
                                              r"fewer than 1 x its 33 inputs: under-determined, it would be the minimum-norm map \(the ridge's\), which "
                                              r"cannot recover even the identity; give --calib-windows 5 or more, or accept it with --min-fit-ratio 0\.96$"):
        run_depth_map(shallow, deep, str(text_file), 4, 2, 8, 4)  # what to give, and what to accept
    with pytest.raises(DepthcurseError, match="--data"):
        run_depth_map(shallow, deep, str(tmp_path / "missing.txt"), 16, 2, 8, 4)
    with pytest.raises(DepthcurseError, match="300"):
        run_depth_map(shallow, deep, str(text_file), 16, 2, 300, 4)  # past the model's 256 positions
    with pytest.raises(DepthcurseError, match=r"fewer than --calib-windows 1 and --eval-windows 500$"):
        run_depth_map(shallow, deep, str(text_file), 1, 500, 8, 4, min_fit_ratio=0.01)
    with pytest.raises(DepthcurseError, match=r"holds \d+ windows of 8 tokens, fewer than --calib-windows 500 and --eval-windows 2$"):
        run_depth_map(shallow, deep, str(text_file), 500, 2, 8, 4)
    with pytest.raises(DepthcurseError, match="^the depth map compares streams token by token: s and b have different tokenizers$"):
        run_depth_map(shallow, loaded(tiny_llama(len(bos_tokenizer), layers=2), "b", bos_tokenizer), str(text_file), 4, 2, 8, 4)
    kept = tmp_path / KEPT_FILE
    assert kept_summary(tmp_path) == "no row had finished"
    kept.write_text(json.dumps({"rows": 2, "of": 4}))
    assert kept_summary(tmp_path) == f"2 of 4 shallow streams' rows kept in {kept}"
    kept.unlink()
    seen = []
    run_depth_map(shallow, deep, str(text_file), 16, 2, 8, 4, kept=kept, on_step=lambda text, done, total: seen.append(kept.exists()) if text.startswith("maps") else None)
    assert seen == [False, True] and not kept.exists()  # the first row kept before the second; mapped whole, the record holds it now
    written = write_map(record, tmp_path / "out")
    assert [p.name for p in written] == ["depth_map.json", "depth_map.png"] and json.loads(written[0].read_text())["best"] == record["best"]
    assert written[1].stat().st_size > 1000


def test_the_maps_figure_marks_its_scores_best_matches_and_the_same_relative_depth(tmp_path, monkeypatch):
    """What the heatmap marks, read off the figure before it is saved: the deciding score's matrix on
    its scale (R^2 from its lowest or 0 up to 1; an error from 0 up to its highest), the best matches,
    the line of the same relative depth (after each layer; entering each, the embedding first), the
    axes' and colour bar's labels and the title; `write_map` into a folder not made yet (issue 88)."""
    from depthcurse.depth import map_report

    figures = []
    monkeypatch.setattr(map_report, "save_figure", lambda fig, path: figures.append(fig) or path)
    run = {"shallow": {"model": "s"}, "deep": {"model": "d"}, "data": "wiki"}
    ours = {"run": run, "streams": "after", "shallow_layers": 2, "deep_layers": 4, "held_out_windows": 2, "score": "r2_dims", "best": [1, 2],
            "scores": {"r2_dims": {"mean": [[-0.2, 0.6, 0.3, 0.5], [0.05, 0.15, 0.7, 0.45]], "label": "held-out R^2 per dimension"}}}
    theirs = {"run": run, "streams": "entering", "shallow_layers": 2, "deep_layers": 2, "held_out_windows": 3, "score": "relative_error", "best": [0, 1, 2],
              "scores": {"relative_error": {"mean": [[0.2, 0.5, 0.9], [0.6, 0.3, 0.35], [0.9, 0.7, 0.4]], "label": "held-out relative error"}}}
    for record, scale, diagonal, axis, label in ((ours, (-0.2, 1.0), ([1.0, 3.0], [0, 1]), "layer", "held-out R^2 per dimension"),
                                                 (theirs, (0.0, 0.9), ([0.0, 1.0, 2.0], [0, 1, 2]), "stream", "held-out relative error")):
        map_report.plot_map(record, tmp_path / "map.png")
        ax, bar = figures[-1].axes
        image = ax.images[0]
        assert image.get_array().tolist() == record["scores"][record["score"]]["mean"] and image.get_clim() == scale
        best, same = ax.lines
        assert list(best.get_xdata()) == record["best"] and list(best.get_ydata()) == list(range(len(record["best"])))
        assert (list(same.get_xdata()), list(same.get_ydata())) == diagonal
        assert [t.get_text() for t in ax.get_legend().get_texts()] == ["best match", "same relative depth"]
        assert (ax.get_xlabel(), ax.get_ylabel()) == (f"deep {axis} (d)", f"shallow {axis} (s)") and bar.get_ylabel() == label
        assert ax.get_title() == f"the depth map ({record['held_out_windows']} held-out windows of wiki)"
    monkeypatch.undo()
    written = map_report.write_map(ours, tmp_path / "new" / "folder")
    assert all(p.is_file() for p in written) and map_report.write_map(ours, tmp_path / "new" / "folder") == written  # again into it: no error


def test_one_model_against_itself_and_the_default_windows_worked_by_hand():
    from depthcurse.depth.map_report import fit_windows, same_model_line

    same = {"score": "r2_dims", "scores": {"r2_dims": {"mean": [[0.95, 0.2], [0.1, 0.95]]}}, "run": {"same_model": True}}
    assert same_model_line(same).startswith("one model against itself: the diagonal's per-dimension R^2 is 0.950, short of the 1 an exact map gives by "
                                            "up to 0.050")  # one figure where the diagonal holds one
    at_the_line = {"score": "relative_error", "scores": {"relative_error": {"mean": [[0.01, 0.5], [0.5, 0.01]]}}, "run": {"same_model": True}}
    assert "short of the 0 an exact map gives by up to 0.010" in same_model_line(at_the_line)  # 0.01 off is not "as an exact map must"
    # twice the inputs (the width and an intercept) in tokens, over each window's fitted tokens (theirs: all but their BOS pad)
    assert fit_windows(1000, 8, "depthcurse") == -(-2002 // 8) == 251 and fit_windows(1000, 8, "csordas") == -(-2002 // 7) == 286
    assert fit_windows(32, 8, "depthcurse") == 16


def test_the_maps_settings_refuse_each_bad_value_alone_and_the_definitions_by_name():
    """Each of their map's settings at its least allowed value passes and one below it is the one line,
    the others left at theirs; an unknown definitions' name and two records of different definitions
    are one line each; no record at all is ours (issue 88: mutation found these loose)."""
    from dataclasses import replace

    from depthcurse.depth.csordas_map import MapSettings
    from depthcurse.depth.definitions import DEFINITIONS, find_definitions, same_definitions
    from depthcurse.errors import DepthcurseError

    least = MapSettings(steps=1, batch_windows=1, warmup=0, lr=1e-9, grad_clip=1e-9)
    least.check()
    for field, bad in (("steps", 0), ("batch_windows", 0), ("warmup", -1), ("lr", 0.0), ("grad_clip", 0.0)):
        with pytest.raises(DepthcurseError, match=r"^--map-steps and the map's batch must be at least 1, its warm-up 0 or more, its lr and clip above 0 "
                                                  rf"\(got \{{.*'{field}': {bad}"):
            replace(least, **{field: bad}).check()
    assert find_definitions("csordas") is DEFINITIONS["csordas"]
    with pytest.raises(DepthcurseError, match=r"^--as theirs: no such definitions \(known: depthcurse, csordas\)$"):
        find_definitions("theirs")
    ours, theirs = {"definitions": {"name": "depthcurse"}}, {"definitions": {"name": "csordas"}}
    assert same_definitions([theirs, theirs], ["a", "b"]) == "csordas" and same_definitions([], []) == "depthcurse"
    with pytest.raises(DepthcurseError, match=r"^depth maps of two definitions: a by the depthcurse definitions, b by the csordas ones; their figures are "
                                              r"other quantities, not set side by side \(rerun one with --as\)$"):
        same_definitions([ours, theirs], ["a", "b"], what="depth maps")


def test_run_depth_use_in_memory_writes_its_record_rows_and_figures_and_says_what_it_kept(tiny_tokenizer, text_file, tmp_path, monkeypatch):
    """`run_depth_use` on a model in memory (not through the command line): its bad input word for word,
    the memory note, the record's run and forecasts, the tuned lens trained, saved and read again; then
    `write_depth`'s CSV rows from the record, the two figures read for what they mark, what an
    interrupted run kept in words, and a select run read back or refused (issue 88)."""
    import csv

    from depthcurse.depth import report
    from depthcurse.depth.tuned_lens import LensSettings
    from depthcurse.errors import DepthcurseError
    from depthcurse.loading import LoadedModel

    loaded = LoadedModel(model=tiny_llama(len(tiny_tokenizer), layers=3, seed=3), tokenizer=tiny_tokenizer, name="m", source="m",
                         dtype=torch.float32, device=torch.device("cpu"))
    for args, match in (((1, 8, 2), r"^--windows must be at least 2 \(the intervals are over windows\), got 1$"),
                        ((2, 1, 2), r"^--seq-len must be at least 2 and --batch-size at least 1$"),
                        ((2, 8, 0), r"^--seq-len must be at least 2 and --batch-size at least 1$"),
                        ((500, 8, 2), r"holds \d+ windows of 8 tokens, fewer than --windows 500$")):
        with pytest.raises(DepthcurseError, match=match):
            report.run_depth_use(loaded, str(text_file), *args)
    with pytest.raises(DepthcurseError, match=r"^--tuned-lens trains a lens and --lens reads one: give one of them$"):
        report.run_depth_use(loaded, str(text_file), 2, 8, 2, tuned=True, lens=tmp_path / "x")
    said = []
    settings = LensSettings(steps=2, tokens_per_step=16, micro_batch=2)
    lens_out = tmp_path / "lens.safetensors"
    record = report.run_depth_use(loaded, str(text_file), 4, 8, 2, tuned=True, lens_windows=3, lens_settings=settings, lens_out=lens_out,
                                  on_note=said.append, free=None, clock=lambda: 1.0)
    assert said[0].startswith("memory: about ") and "beyond the model's weights at its peak" in said[0] and "free)" not in said[0]
    assert record["run"]["windows"] == 4 and record["run"]["seq_len"] == 8 and record["run"]["data"] == str(text_file) and "device" not in record["run"]
    assert record["tuned_lens"]["train_windows"] == 3 and record["tuned_lens"]["source"] == "trained here" and lens_out.is_file()
    assert set(record["forecasts"]) == {"the tuned lens's steps", "the measurement's batches of windows"}
    assert record["forecasts"]["the measurement's batches of windows"]["steps"] == 2 and record["wall_time_s"] == 0.0
    assert record["tuned_lens"]["held_out_kl"] == [row["tuned_kl"] for row in record["layers"]]
    again = report.run_depth_use(loaded, str(text_file), 4, 8, 2, tuned=True, lens_windows=3, lens_settings=settings, lens_out=lens_out, free=None,
                                 influence=False)  # the saved lens of these settings is read, not trained again
    assert again["tuned_lens"]["train_windows"] == 3 and again["use"]["influence"] is None
    with pytest.raises(DepthcurseError, match="would need about"):
        report.run_depth_use(loaded, str(text_file), 4, 8, 2, free=1)
    said.clear()
    edge = report.run_depth_use(loaded, str(text_file), 2, 2, 1, influence=False, on_note=said.append)  # the least seq-len and batch; free memory read
    assert edge["run"]["seq_len"] == 2 and said[0].endswith(" free)") and "GiB beyond the model's weights at its peak (" in said[0]
    with pytest.raises(DepthcurseError, match=r"^--data .*missing.txt"):
        report.run_depth_use(loaded, str(tmp_path / "missing.txt"), 2, 8, 2)
    with pytest.raises(DepthcurseError, match="seq"):
        report.run_depth_use(loaded, str(text_file), 2, 300, 2)  # past the model's positions
    with pytest.raises(DepthcurseError, match=r"fewer than --windows 4 and 500 more to train the tuned lens on$"):
        report.run_depth_use(loaded, str(text_file), 4, 8, 2, tuned=True, lens_windows=500, lens_settings=settings, free=None)
    other_steps = report.run_depth_use(loaded, str(text_file), 4, 8, 2, tuned=True, lens_windows=3, lens_out=lens_out, free=None, influence=False,
                                       lens_settings=LensSettings(steps=1, tokens_per_step=16, micro_batch=2))  # another training's lens: trained again
    assert other_steps["tuned_lens"]["settings"]["steps"] == 1 and other_steps["tuned_lens"]["source"] == "trained here"
    other_windows = report.run_depth_use(loaded, str(text_file), 4, 8, 2, tuned=True, lens_windows=2, lens_out=lens_out, free=None, influence=False,
                                         lens_settings=LensSettings(steps=1, tokens_per_step=16, micro_batch=2))
    assert other_windows["tuned_lens"]["train_windows"] == 2
    read = report.run_depth_use(loaded, str(text_file), 4, 8, 2, lens=lens_out, free=None, influence=False)  # --lens: read, not trained
    assert read["tuned_lens"]["source"] == str(lens_out) and read["tuned_lens"]["train_windows"] == 2

    paths = report.write_depth(record, tmp_path / "out" / "new")
    assert [p.name for p in paths] == ["depth_use.json", "depth_use.csv"]
    rows = list(csv.reader(paths[1].open()))
    names = ["attn_norm", "mlp_norm", "attn_cos", "mlp_cos", "lens_kl", "lens_top1", "lens_top5", "tuned_kl", "tuned_top1", "tuned_top5"]
    assert rows[0] == ["layer", *names, *(f"{n}_low" for n in names), *(f"{n}_high" for n in names), "settled_share", "tuned_settled_share",
                       "output_kl_when_skipped"]
    first = record["layers"][0]
    assert rows[1][:3] == ["0", str(first["attn_norm"]), str(first["mlp_norm"])] and rows[1][11] == str(first["attn_norm_interval"][0])
    assert rows[1][21] == str(first["attn_norm_interval"][1]) and rows[1][-1] == str(record["use"]["output_change"][0]) and len(rows) == 4
    with_agreement = {**record, "agreement": [{"measure": "m", "target": "t", "rho": 0.5, "interval": [0.1, 0.8], "layers": 3}]}
    assert report.write_depth(with_agreement, tmp_path / "agree")[-1].read_text().splitlines()[1] == "m,t,0.5,3,0.1,0.8"

    figures = []
    monkeypatch.setattr(report, "save_figure", lambda fig, path: figures.append(fig) or path)
    report.plot_influence(record, tmp_path / "i.png")
    (ax, bar) = figures[-1].axes
    grid = ax.images[0].get_array()
    assert [[None if v is None or v != v else round(float(v), 9) for v in row] for row in grid.tolist()] == \
        [[None if v is None or v != v else round(v, 9) for v in row] for row in record["use"]["influence"]]
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("later layer j", "layer i skipped") and bar.get_ylabel() == \
        "mean ||c_j(skip i) - c_j|| / ||c_j|| (depthcurse definitions)"
    assert report.plot_influence(again, tmp_path / "none.png") is None  # no influence matrix: no figure
    report.plot_settling(record, tmp_path / "s.png")
    left, right, twin = figures[-1].axes
    total = sum(record["use"]["settled"])
    assert [p.get_height() for p in left.patches] == pytest.approx([s / total for s in record["use"]["settled"]])
    assert [list(line.get_ydata()) for line in right.lines] == [[r[n] for r in record["layers"]] for n in ("lens_top1", "lens_top5", "tuned_top1")]
    assert list(twin.lines[0].get_ydata()) == [r["lens_kl"] for r in record["layers"]]
    tuned_total = sum(record["use"]["tuned_settled"])
    assert list(left.lines[0].get_ydata()) == pytest.approx([s / tuned_total for s in record["use"]["tuned_settled"]])
    assert [t.get_text() for t in right.get_legend().get_texts()] == ["top-1 agreement with the output", "output's top-1 in the lens's top-5", "tuned lens top-1 (held out)"]
    assert left.get_xlabel() == "the stream after layer ... from which the lens's top-1 stays the output's" and right.get_xlabel() == "layer (the stream after it)"
    assert (left.get_ylabel(), right.get_ylabel(), twin.get_ylabel()) == ("share of tokens", "share of tokens", "KL (nats)")
    monkeypatch.undo()

    folder = tmp_path / "cut"
    folder.mkdir()
    assert report.kept_summary(folder) == "nothing had finished"
    (folder / report.KEPT_FILE).write_text(json.dumps({"batches": 1, "of": 3}))
    assert report.kept_summary(folder) == f"1 of 3 batches of windows measured kept in {folder}"
    select = tmp_path / "sel"
    select.mkdir()
    (select / "select.json").write_text(json.dumps({"cells": {}, "run": {}}))
    assert report.read_selects([select]) == [{"cells": {}, "run": {}}] and report.read_selects([]) == []
    with pytest.raises(DepthcurseError, match="select"):
        report.read_selects([tmp_path / "nowhere"])


def test_depth_uses_titles_and_captions_by_both_definitions_word_for_word():
    """What each table says it measured, by ours and by Csordás et al.'s definitions, with a tuned lens:
    the title, the caption (the lens's stream, its KL's direction, the skip's token and reduction, the
    interval's rule, the source) and the columns; the overview's and the agreement table's (issue 88)."""
    from depthcurse.depth.measure import DepthUse, per_layer_rows
    from depthcurse.depth.report import agreement_table, depth_overview, depth_table

    use = DepthUse(n_layers=2, windows=2, attn_norm=[[0.1, 0.3], [0.5, 0.5]], mlp_norm=[[1.0, 1.0], [2.0, 4.0]], attn_cos=[[0.1, 0.1], [-0.2, -0.2]],
                   mlp_cos=[[0.6, 0.6], [0.7, 0.7]], lens_kl=[[5.0, 7.0], [3.0, 3.0]], lens_top1=[[0.0, 0.5], [0.5, 0.5]], lens_top5=[[0.25, 0.25], [0.75, 0.75]],
                   settled=[2, 1], tuned_kl=[[2.0, 2.0], [1.0, 1.0]], tuned_top1=[[0.5, 0.5], [1.0, 1.0]], tuned_top5=[[1.0, 1.0], [1.0, 1.0]], tuned_settled=[1, 2])
    tables = {}
    for name in ("depthcurse", "csordas"):
        record = {"run": {"model": "m", "windows": 2, "seq_len": 4, "data": "wiki"}, "definitions": {"name": name}, "use": use.summary(),
                  "layers": per_layer_rows(use), "tuned_lens": {"train_windows": 3, "settings": {"steps": 5}}}
        tables[name] = depth_table(record)
    lens = "; tuned lens: one affine translator per stream (Belrose et al. 2023), trained on 3 other windows of the text (5 steps), read on these (held out)"
    head = "attention / MLP: the sublayer's output norm over the residual stream it is added to, and their cosine (Csordás et al. 2025, Fig. 2); "
    assert tables["depthcurse"].title == "m: how each layer is used, 2 windows x 4 tokens of wiki (depthcurse definitions)"
    assert tables["depthcurse"].caption == (
        head + "lens: the model's final norm and head on the stream after the layer, against its output (KL(output || lens), top-1, output's top-1 in "
        "the lens's top-5); settles here: tokens whose lens top-1 is the output's from this row on; influence: the layer skipped, the relative change "
        "of every later layer's contribution (its row's mean over the later layers), and the output's KL(output || skipped): means over tokens and "
        "windows. Other figures: means over windows, in brackets the 95% interval over windows (Student's t). Definitions: depthcurse "
        "(docs/depth-use.md)" + lens)
    assert tables["csordas"].title == "m: how each layer is used, 2 windows x 4 tokens of wiki (csordas definitions)"
    assert tables["csordas"].caption == (
        head + "lens: the model's final norm and head on the stream entering the layer, against its output (KL(lens || output), top-1, top-5 overlap "
        "with the output's); settles here: tokens whose lens top-1 is the output's from this row on; influence: the layer skipped from token 1 on, "
        "the relative change of every later layer's contribution (its row's mean over the later layers), and the output's ||p_skipped - p||_2: the "
        "largest over tokens and windows (no interval). Other figures: means over windows, in brackets the 95% interval over windows. Definitions: "
        "Csordás, Manning and Potts 2025, robertcsordas/llm_effective_depth (read in ShayanTalaei/llm_effective_depth @ e757a77): "
        "analysis/logitlens.py, analysis/analyze_current_effects.py, analysis/analyze_norms.py" + lens)
    columns = ["layer", "attention ||a||/||h||", "MLP ||m||/||h||", "cos(a, h)", "cos(m, h)", "lens KL", "lens top-1", "lens top-5", "settles here",
               "tuned lens KL", "tuned top-1", "tuned settles here", "influence on later layers"]
    assert [c.header for c in tables["depthcurse"].columns] == [*columns, "output KL when skipped"]
    assert [c.header for c in tables["csordas"].columns] == [*columns, "output change when skipped"]
    assert [c.justify for c in tables["csordas"].columns] == ["right"] * 14
    overview = depth_overview([record], ["a"])
    assert overview.title == "depth-use runs side by side" and overview.caption == (
        "phase transition: the change point of the influence rows (docs/depth-use.md); half settled: the layer by which half of the tokens' lens "
        "top-1 stays the output's; most changing skip: the layer whose removal moves the output most (by the definitions' output change) (csordas "
        "definitions)")
    assert [c.header for c in overview.columns] == ["run", "model", "text", "layers", "phase transition", "half settled (logit lens)",
                                                    "half settled (tuned lens)", "most changing skip"]
    assert [c.justify for c in overview.columns] == ["left"] * 3 + ["right"] * 5
    agreed = agreement_table({"agreement": []})
    assert agreed.title == "do the layers depth-use calls little used match the ones select measures as cheapest to remove?" and agreed.caption == (
        "Spearman's rho over the layers both rank, with its 95% interval (Fisher's z, Bonett and Wright's standard error); a measure of use should "
        "rise with a layer's removal cost (+) and fall where a search picked the layer (-). agrees: the interval leaves 0 out on the expected side; "
        "opposite: on the other; cannot tell: it holds 0. The target's distinct values: how many values it takes over the layers (a pick's "
        "membership: 2)")
    assert [c.justify for c in agreed.columns] == ["left", "left", "right", "right", "right", "right", "left"]


def test_write_depth_and_the_figures_by_their_definitions_without_a_tuned_lens_and_what_a_cut_lens_kept(tmp_path, monkeypatch):
    """A record by Csordás et al.'s definitions without a tuned lens: the CSV's own columns (no tuned
    ones; the output's L2 change), the influence bar's "largest", the settling axes' "entering" streams
    and the output's row, no tuned line; and a lens stopped at step 2 of 5 said in words (issue 88)."""
    import csv

    from depthcurse.depth import report
    from depthcurse.depth.measure import DepthUse, per_layer_rows
    from depthcurse.depth.tuned_lens import PARTIAL_FILE

    use = DepthUse(n_layers=2, windows=2, attn_norm=[[0.1, 0.3], [0.5, 0.5]], mlp_norm=[[1.0, 1.0], [2.0, 4.0]], attn_cos=[[0.1, 0.1], [-0.2, -0.2]],
                   mlp_cos=[[0.6, 0.6], [0.7, 0.7]], lens_kl=[[5.0, 7.0], [3.0, 3.0]], lens_top1=[[0.0, 0.5], [0.5, 0.5]], lens_top5=[[0.25, 0.25], [0.75, 0.75]],
                   settled=[2, 1, 5], influence=[[float("nan"), 0.4], [float("nan"), float("nan")]], output_change=[0.7, 0.2])
    record = {"run": {"model": "m", "windows": 2, "seq_len": 4, "data": "wiki"}, "definitions": {"name": "csordas"}, "use": use.summary(),
              "layers": per_layer_rows(use)}
    _, rows_path = report.write_depth(record, tmp_path / "out")
    rows = list(csv.reader(rows_path.open()))
    names = ["attn_norm", "mlp_norm", "attn_cos", "mlp_cos", "lens_kl", "lens_top1", "lens_top5"]
    assert rows[0] == ["layer", *names, *(f"{n}_low" for n in names), *(f"{n}_high" for n in names), "settled_share", "output_l2_change_when_skipped"]
    assert rows[2][-1] == "0.2" and rows[2][-2] == str(record["layers"][1]["settled_share"]) and len(rows[1]) == 24
    no_skips = {**record, "use": {**record["use"], "output_change": None}}
    assert list(csv.reader(report.write_depth(no_skips, tmp_path / "o2")[1].open()))[1][-1] == ""  # no skip measured: the cell is empty
    figures = []
    monkeypatch.setattr(report, "save_figure", lambda fig, path: figures.append(fig) or path)
    report.plot_influence(record, tmp_path / "i.png")
    assert figures[-1].axes[1].get_ylabel() == "largest ||c_j(skip i) - c_j|| / ||c_j|| (csordas definitions)"
    report.plot_settling(record, tmp_path / "s.png")
    left, right, twin = figures[-1].axes
    assert [p.get_height() for p in left.patches] == pytest.approx([0.25, 0.125, 0.625]) and left.get_legend() is None and not left.lines
    assert left.get_xlabel() == "the stream entering layer ... from which the lens's top-1 stays the output's (2: the output)"
    assert right.get_xlabel() == "layer (the stream entering it)" and len(right.lines) == 2
    assert twin.lines[0].get_label() == "KL(lens || output)"
    monkeypatch.undo()
    (tmp_path / "cut").mkdir()
    report.write_depth(record, tmp_path / "cut")
    assert report.kept_summary(tmp_path / "cut") == "nothing had finished"
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(tmp_path / "cut" / PARTIAL_FILE), metadata={"step": "2", "identity": json.dumps({"settings": {"steps": 5}})})
    (tmp_path / "cut" / report.KEPT_FILE).write_text(json.dumps({"batches": 1, "of": 3}))
    assert report.kept_summary(tmp_path / "cut") == (f"the tuned lens's first 2 of 5 steps and 1 of 3 batches of windows measured kept in {tmp_path / 'cut'}")
    (tmp_path / "cut" / report.KEPT_FILE).write_text("{not json")
    assert report.kept_summary(tmp_path / "cut") == f"the tuned lens's first 2 of 5 steps kept in {tmp_path / 'cut'}"


def test_depth_uses_report_with_a_tuned_lens_and_without_an_output_change_line_by_line_by_hand(tmp_path, monkeypatch):
    """depth-use's report on a record worked out here with a tuned lens, no influence and no output
    change: the lens comparison's rows (the row both lenses read alike left out, not the end of the
    rows; a ratio under a tuned KL sum of 0.5 kept, one over 0 not), every verdict line, the tables'
    tuned cells and "-" cells, the overview, an old agreement record's words, the CSVs and the JSON
    read back, the figures' lines by layer, and what a kept file without its counts says (issue 88)."""
    import csv

    import matplotlib.colors
    import numpy as np

    from depthcurse.depth import report
    from depthcurse.depth.measure import DepthUse, per_layer_rows
    from depthcurse.errors import DepthcurseError

    use = DepthUse(n_layers=4, windows=2, attn_norm=[[0.1, 0.3]] * 4, mlp_norm=[[1.0, 1.0]] * 4, attn_cos=[[0.1, 0.1]] * 4, mlp_cos=[[0.6, 0.6]] * 4,
                   lens_kl=[[0.5, 0.5], [5.0, 7.0], [3.0, 3.0], [1.0, 3.0]], lens_top1=[[0.5, 0.5]] * 4, lens_top5=[[0.75, 0.75]] * 4,
                   settled=[1, 1, 1, 5], tuned_kl=[[0.5, 0.5], [1.0, 3.0], [0.25, 0.25], [0.0, 0.0]],
                   tuned_top1=[[0.25, 0.75], [0.5, 0.5], [1.0, 1.0], [1.0, 1.0]], tuned_top5=[[1.0, 1.0]] * 4, tuned_settled=[4, 2, 1, 1])
    record = {"run": {"model": "m", "windows": 2, "seq_len": 4, "data": "wiki"}, "definitions": {"name": "depthcurse"}, "use": use.summary(),
              "layers": per_layer_rows(use), "phase_transition": None, "tuned_lens": {"train_windows": 3, "settings": {"steps": 5}, "seconds": 12.4}}
    compared = report.lens_comparison(record)
    assert [(r["row"], r["difference"], r["verdict"], r["ratio"]) for r in compared["rows"]] == \
        [(1, -4.0, "closer", 3.0), (2, -2.75, "closer", 12.0), (3, -2.0, "cannot tell", None)]  # 12 / 0.5; row 3's tuned KL sums to 0
    assert (compared["closer"], compared["further"], compared["cannot_tell"], compared["ratio_range"]) == (2, 0, 1, [3.0, 12.0])
    assert report.depth_verdicts(record) == [
        "half of the tokens' predictions have settled by the stream after layer 3 of 4 layers (logit lens; 62% settle only at the output)",
        "tuned lens: half settled by the stream after layer 0; on the held-out windows its KL(output || lens) against the logit lens's, paired over 2 "
        "windows: closer at 2 of 3 rows, further at 0, cannot tell at 1; the logit lens's KL is 3.0-12.0x the tuned lens's (trained on 3 windows, "
        "5 steps, 12 s)"]
    no_ratio = {**record, "use": {**record["use"], "tuned_kl": [[0.5, 0.5], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]}}
    assert report.lens_comparison(no_ratio)["ratio_range"] is None
    assert report.depth_verdicts(no_ratio)[1].endswith("closer at 1 of 3 rows, further at 0, cannot tell at 2 (trained on 3 windows, 5 steps, 12 s)")
    changed = {**record, "use": {**record["use"], "output_change": [0.1, 0.9, 0.3, 0.2]}}
    assert report.depth_verdicts(changed)[-1] == "skipping layer 1 changes the output most (KL(output || skipped) 0.900)"
    theirs = {**record, "definitions": {"name": "csordas"}, "use": {**record["use"], "tuned_kl": None, "settled": [0, 1, 1, 1, 5]}}
    assert report.depth_verdicts(theirs)[0].startswith("half of the tokens' predictions have settled by the stream the output of 4 layers")

    table = report.depth_table(record)
    assert table.caption_justify == "left" and [c.header for c in table.columns][9:] == \
        ["tuned lens KL", "tuned top-1", "tuned settles here", "influence on later layers", "output KL when skipped"]
    assert [row[9:] for row in table_cells(table)] == [["0.500 [0.500, 0.500]", "0.500 [-2.677, 3.677]", "50.0%", "-", "-"],
                                                      ["2.000 [-10.706, 14.706]", "0.500 [0.500, 0.500]", "25.0%", "-", "-"],
                                                      ["0.250 [0.250, 0.250]", "1.000 [1.000, 1.000]", "12.5%", "-", "-"],
                                                      ["0.000 [0.000, 0.000]", "1.000 [1.000, 1.000]", "12.5%", "-", "-"]]
    overview = report.depth_overview([record], ["a"])
    assert overview.caption_justify == "left" and overview.caption.endswith("(by the definitions' output change) (depthcurse definitions)")
    assert table_cells(overview) == [["a", "m", "wiki, 2 x 4", "4", "-", "3", "0", "-"]]
    assert report.depth_overview([], []).caption.endswith("(by the definitions' output change)")
    with pytest.raises(DepthcurseError, match=r"^depth-use runs of two definitions: a by the depthcurse definitions, b by the csordas ones"):
        report.depth_overview([record, theirs], ["a", "b"])
    old = [{"measure": "lens", "target": "t", "rho": 0.5, "interval": None, "layers": 4, "expected_sign": 1, "agrees": flag} for flag in (True, False, None)]
    agreed = report.agreement_table({"agreement": old})
    assert agreed.caption_justify == "left" and table_cells(agreed) == [["lens", "t", "+0.50", "4", "-", "+", word]
                                                                       for word in ("agrees", "opposite", "cannot tell")]
    assert report._cell(0.5, None) == "0.500"

    paths = report.write_depth({**record, "agreement": [{"measure": "m", "target": "t", "rho": 0.5, "interval": None, "layers": 4}]}, tmp_path / "out")
    assert [p.name for p in paths] == ["depth_use.json", "depth_use.csv", "agreement.csv"] and report.read_depth(paths[0])["layers"] == record["layers"]
    rows = list(csv.reader(paths[1].open()))
    assert rows[0][-2:] == ["tuned_settled_share", "output_kl_when_skipped"] and [r[-2:] for r in rows[1:]] == [["0.5", ""], ["0.25", ""], ["0.125", ""],
                                                                                                               ["0.125", ""]]
    assert paths[2].read_text().splitlines() == ["measure,target,rho,layers,low,high", "m,t,0.5,4,,"]

    figures = []
    monkeypatch.setattr(report, "save_figure", lambda fig, path: figures.append(fig) or path)
    assert report.plot_settling(record, tmp_path / "s.png") == tmp_path / "s.png"
    left, right, twin = figures[-1].axes
    color = lambda c: matplotlib.colors.to_hex(c)  # noqa: E731
    assert [(list(line.get_xdata()), line.get_marker(), line.get_linestyle()) for line in right.lines] == \
        [([0, 1, 2, 3], "o", "-"), ([0, 1, 2, 3], "s", "-"), ([0, 1, 2, 3], "^", "-")] and color(right.lines[2].get_color()) == color("C3")
    assert (list(twin.lines[0].get_xdata()), twin.lines[0].get_linestyle(), color(twin.lines[0].get_color())) == ([0, 1, 2, 3], ":", "#000000")
    step = left.lines[0]
    assert (list(step.get_xdata()), step.get_drawstyle(), color(step.get_color()), step.get_label()) == ([0, 1, 2, 3], "steps-mid", color("C3"), "tuned lens")
    assert {color(p.get_facecolor()) for p in left.patches} == {color("C0")}
    with_influence = {**record, "use": {**record["use"], "influence": [[None, 0.5, 0.25, 0.1]] + [[float("nan")] * 4] * 3}}
    assert report.plot_influence(with_influence, tmp_path / "i.png") == tmp_path / "i.png"
    grid = figures[-1].axes[0].images[0].get_array()
    assert grid.dtype.kind == "f" and bool(np.ma.getmaskarray(grid)[0][0]) and float(grid[0][1]) == 0.5  # None: NaN, masked
    monkeypatch.undo()

    folder = tmp_path / "cut"
    folder.mkdir()
    (folder / report.KEPT_FILE).write_text(json.dumps({"batches": 1}))  # a kept file without its count: nothing said of it
    assert report.kept_summary(folder) == "nothing had finished"
    (tmp_path / "sel").mkdir()
    (tmp_path / "sel" / "select.json").write_text(json.dumps({"run": {}}))
    with pytest.raises(DepthcurseError, match=r"sel holds no select run \(select.json\): 'cells'$"):
        report.read_selects([tmp_path / "sel"])


def test_run_depth_use_records_each_part_by_its_definitions_heard_and_kept(tiny_tokenizer, text_file, tmp_path):
    """`run_depth_use`'s record key by key (the model's architecture, the definitions, the memory
    estimate counting the lens's micro-batch, the phase transition, both forecasts, the wall time to
    the millisecond by the clock given, the environment, the logit lens's KLs beside the tuned lens's),
    what it tells `on_step` of both parts, its kept batches taken up then cleared, the lens's state
    kept beside it while it trains, and a lens of another model where the lens goes trained over."""
    from depthcurse.depth import report
    from depthcurse.depth.definitions import DEFINITIONS
    from depthcurse.depth.memory import Shape, peak_bytes
    from depthcurse.depth.over_seeds import architecture
    from depthcurse.depth.tuned_lens import PARTIAL_FILE, LensSettings
    from depthcurse.loading import LoadedModel

    loaded = LoadedModel(model=tiny_llama(len(tiny_tokenizer), layers=3, seed=3), tokenizer=tiny_tokenizer, name="m", source="m",
                         dtype=torch.float32, device=torch.device("cpu"))
    ticks = []

    def clock() -> float:
        ticks.append(len(ticks) * 0.0123456)
        return ticks[-1]

    heard, partial_seen = [], []
    lens_out = tmp_path / "lens.safetensors"
    lens_out.write_bytes(b"not a lens")  # what a lens of another model or a cut write leaves: trained over, not read
    kept = tmp_path / report.KEPT_FILE

    def on_step(text, done, total):
        heard.append((text, done, total))
        if text == "training the tuned lens" and done:
            partial_seen.append((tmp_path / PARTIAL_FILE).is_file())

    settings = LensSettings(steps=2, tokens_per_step=16, micro_batch=3)
    record = report.run_depth_use(loaded, str(text_file), 4, 8, 2, tuned=True, lens_windows=3, lens_settings=settings, lens_out=lens_out, free=None,
                                  on_step=on_step, kept=kept, clock=clock, definitions=DEFINITIONS["csordas"])
    assert set(record) == {"run", "definitions", "memory_estimate_bytes", "use", "layers", "phase_transition", "forecasts", "wall_time_s", "environment",
                           "tuned_lens", "vocabulary_scores"}
    assert record["vocabulary_scores"] == vocab_scores.status()  # what read the lens rows and skips (the kernel, where it builds)
    assert record["run"]["architecture"] == architecture(loaded.model) and record["run"]["architecture"]["num_hidden_layers"] == 3
    assert record["definitions"] == DEFINITIONS["csordas"].summary() and record["use"]["definitions"] == "csordas"
    assert record["memory_estimate_bytes"] == peak_bytes(Shape.of(loaded.model), 2, 8, 3) != peak_bytes(Shape.of(loaded.model), 2, 8, 0)
    assert record["phase_transition"] == report.phase_transition(report._use(record))
    assert record["wall_time_s"] == round(ticks[-1] - ticks[0], 3) and record["wall_time_s"] != round(ticks[-1] - ticks[0], 4)
    assert record["forecasts"]["the tuned lens's steps"]["steps"] == 2 and record["forecasts"]["the measurement's batches of windows"]["steps"] == 2
    assert record["forecasts"]["the measurement's batches of windows"]["seconds"] > 0  # timed by the clock given
    assert {"command", "packages", "cpu"} <= set(record["environment"])
    assert record["tuned_lens"]["logit_lens_kl"] == [row["lens_kl"] for row in record["layers"]]
    assert [h for h in heard if h[0] == "training the tuned lens"] == [("training the tuned lens", 0, 2), ("training the tuned lens", 1, 2)]
    assert ("the whole model's pass and the lens", 1, 2) in heard and partial_seen == [True]
    assert not kept.exists() and not (tmp_path / PARTIAL_FILE).exists() and lens_out.stat().st_size > 100
