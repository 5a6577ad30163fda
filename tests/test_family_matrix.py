"""Every instrument on every decoder family researchers prune (issue 87), against references that do
not use depthcurse: `speculate` against `model.generate`; `depth-use` against hooks put on the
family's own modules here (what its modeling code adds to the stream, its logits' own rule);
`--as csordas` against the port of their functions (`csordas_port`); `select`'s single removals
against a model built without the layer; `angular-distance` against the model's own hidden states;
the depth map of a model onto itself on its diagonal. A Post-LN encoder where a command takes one,
and a one-line refusal where it does not.

Tiny random models (`families`: 5 layers, width 32, the per-layer features that make removal hard),
a few tokens each, fp32; `test_precision.py`'s bf16 lane runs the same instruments in bf16.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from csordas_port import assert_as_their_code
from families import FAMILIES, N, VOCAB, family_model
from helpers import built_without, tiny_bert

from depthcurse.depth.definitions import DEFINITIONS
from depthcurse.depth.measure import measure_depth_use
from depthcurse.errors import DepthcurseError
from depthcurse.surgery import find_blocks

pytestmark = [pytest.mark.usefixtures("one_torch_thread")]

WINDOWS = torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(11))  # longer than the 8-token windows and chunks


# --------------------------------------------------------------------------- what each family's code does, read off it
# (the attention module, the MLP module, the attention's post-norm, the MLP's post-norm, the number the block multiplies
# each by before adding it to the stream); a family not named: Llama's (self_attn, mlp, no post-norm, 1)
STREAM_SIDE = {
    "gemma2": ("self_attn", "mlp", "post_attention_layernorm", "post_feedforward_layernorm", 1.0),
    "gemma3": ("self_attn", "mlp", "post_attention_layernorm", "post_feedforward_layernorm", 1.0),
    "olmo2": ("self_attn", "mlp", "post_attention_layernorm", "post_feedforward_layernorm", 1.0),
    "glm4": ("self_attn", "mlp", "post_self_attn_layernorm", "post_mlp_layernorm", 1.0),
    "granite": ("self_attn", "mlp", None, None, 0.5),  # residual_multiplier (families.SCALES)
    "granitemoe": ("self_attn", "block_sparse_moe", None, None, 0.5),
    "llama4": ("self_attn", "feed_forward", None, None, 1.0),
    "gpt_neox": ("attention", "mlp", None, None, 1.0),
    "falcon": ("self_attention", "mlp", None, None, 1.0),
    "falcon_new": ("self_attention", "mlp", None, None, 1.0),
}
# the final norm and the head: (the base, its final norm, the head)
HEAD_SIDE = {"gpt_neox": ("gpt_neox", "final_layer_norm", "lm_head"), "falcon": ("transformer", "ln_f", "lm_head"),
             "falcon_new": ("transformer", "ln_f", "lm_head"), "phi": ("model", "final_layernorm", "lm_head")}
# what each family does to lm_head(norm(h)) before its softmax: Gemma 2's soft-cap (30), Cohere's logit scale (0.5), Granite's 1 / logits_scaling (4)
LOGIT_RULE = {"gemma2": lambda x: 30.0 * torch.tanh(x / 30.0), "cohere": lambda x: x * 0.5, "cohere2": lambda x: x * 0.5,
              "granite": lambda x: x / 4.0, "granitemoe": lambda x: x / 4.0}


def _first(output):
    return output[0] if isinstance(output, tuple) else output


def _head(model, name: str, raw: bool = False):
    base, norm, head = HEAD_SIDE.get(name, ("model", "norm", "lm_head"))
    rule = (lambda x: x) if raw else LOGIT_RULE.get(name, lambda x: x)
    return lambda h: rule(getattr(model, head)(getattr(getattr(model, base), norm)(h)).float())


def _by_hooks(model, name: str, ids, skip: int | None = None):
    """One forward of the model's own: each block's input and output, what its attention and MLP add
    to the stream (by the family's names above), the output's logits; with `skip`, that block's
    output replaced by its input (the block skipped)."""
    attn, mlp, attn_post, mlp_post, multiplier = STREAM_SIDE.get(name, ("self_attn", "mlp", None, None, 1.0))
    seen, hooks = {}, []
    for i, block in enumerate(find_blocks(model).layers):
        def block_hook(module, args, kwargs, output, i=i):
            inputs = args[0] if args else kwargs["hidden_states"]
            seen["in", i] = inputs
            out = inputs if i == skip else _first(output)
            seen["out", i] = out
            return (out, *output[1:]) if isinstance(output, tuple) else out
        hooks.append(block.register_forward_hook(block_hook, with_kwargs=True))
        for part, module, post in (("a", attn, attn_post), ("m", mlp, mlp_post)):
            where = getattr(block, post or module)
            hooks.append(where.register_forward_hook(lambda mod, a, o, key=(part, i): seen.__setitem__(key, _first(o).clone() * multiplier)))
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits.float()
    for h in hooks:
        h.remove()
    for i in range(N):
        seen["a", i], seen["m", i] = (seen[part, i].reshape(seen["in", i].shape).float() for part in ("a", "m"))
    return seen, logits


@pytest.mark.parametrize("name", list(FAMILIES))
def test_depth_use_equals_the_familys_own_forward_read_by_hooks(name):
    """Each sublayer's size and cosine against the stream it is added to, the logit lens's KL (the
    family's soft-cap and logit scale on the lens as on the output), and a skipped layer's influence
    row and output change: `measure_depth_use`'s defaults against the model's own forward read here."""
    model = family_model(name)
    use = measure_depth_use(model, WINDOWS, 2)
    seen, logits = _by_hooks(model, name, WINDOWS)
    for i in range(N):
        h, a, m = seen["in", i].float(), seen["a", i], seen["m", i]
        torch.testing.assert_close(a + m, seen["out", i].float() - h, rtol=1e-4, atol=1e-4)  # the two are what the block adds
        assert use.attn_norm[i] == pytest.approx((a.norm(dim=-1) / h.norm(dim=-1)).mean(-1).tolist(), rel=1e-4), i
        assert use.mlp_norm[i] == pytest.approx((m.norm(dim=-1) / (h + a).norm(dim=-1)).mean(-1).tolist(), rel=1e-4), i
        assert use.attn_cos[i] == pytest.approx(F.cosine_similarity(a, h, dim=-1).mean(-1).tolist(), rel=1e-4, abs=1e-5), i
        assert use.mlp_cos[i] == pytest.approx(F.cosine_similarity(m, h + a, dim=-1).mean(-1).tolist(), rel=1e-4, abs=1e-5), i
    final, head = logits.log_softmax(-1), _head(model, name)
    for i in range(N):  # the row after layer i; the last is the output itself
        lens = head(seen["out", i]).log_softmax(-1)
        assert use.lens_kl[i] == pytest.approx((final.exp() * (final - lens)).sum(-1).mean(-1).tolist(), rel=1e-3, abs=1e-5), i
    assert use.lens_kl[N - 1] == pytest.approx([0.0] * 3, abs=1e-5)  # the rule above is the family's: its last row is the output
    for skip in (0, N // 2):
        skipped, skipped_logits = _by_hooks(model, name, WINDOWS, skip=skip)
        for j in range(skip + 1, N):
            c, c_skip = (s["out", j].float() - s["in", j].float() for s in (seen, skipped))
            want = ((c_skip - c).norm(dim=-1) / c.norm(dim=-1)).mean(-1).mean().item()
            assert use.influence[skip][j] == pytest.approx(want, rel=1e-3, abs=1e-6), (skip, j)
        q = skipped_logits.log_softmax(-1)
        assert use.output_change[skip] == pytest.approx((final.exp() * (final - q)).sum(-1).mean().item(), rel=1e-3, abs=1e-6)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_depth_use_as_csordas_equals_the_port_of_their_functions(name):
    """`--as csordas` against their `test_effect`, `run_logitlens` and `analyze_norms`, ported, reading
    the modules their code reads: the attention's and MLP's module outputs (before Gemma's, OLMo 2's and
    GLM-4's post-norms and Granite's multiplier), the lens raw (no soft-cap or logit scale)."""
    model = family_model(name)
    use = measure_depth_use(model, WINDOWS, 2, definitions=DEFINITIONS["csordas"])
    assert_as_their_code(use, model, WINDOWS, name, rel=1e-4, absolute=1e-5)


# where ours and theirs read other things, on the same model: (what differs, the figure that shows it)
OURS_DIFFERS = {"gemma2": "lens_kl", "cohere": "lens_kl", "granite": "attn_norm", "olmo2": "attn_norm", "glm4": "mlp_norm"}


@pytest.mark.parametrize("name", sorted(OURS_DIFFERS))
def test_ours_reads_the_stream_and_the_models_logits_where_theirs_reads_modules_and_the_raw_head(name):
    """On a post-norm, multiplied or soft-capped family, `--as csordas` with our reading (a flag away:
    the default's `contributions` and `lens_logits`) gives other figures than theirs: each choice is
    one that changes a number there."""
    from dataclasses import replace

    model = family_model(name)
    theirs = measure_depth_use(model, WINDOWS, 2, influence=False, definitions=DEFINITIONS["csordas"])
    ours_reading = replace(DEFINITIONS["csordas"], contributions="stream", lens_logits="model")
    other = measure_depth_use(model, WINDOWS, 2, influence=False, definitions=ours_reading)
    figure = OURS_DIFFERS[name]
    assert getattr(other, figure)[1] != pytest.approx(getattr(theirs, figure)[1], rel=1e-3)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_select_scores_each_single_removal_as_the_model_built_without_that_layer(name):
    """Every single removal's loss, KL to the unpruned model and top-1 agreement per window, against the
    logits of a model built from a config without the layer."""
    from depthcurse.select.scoring import CalibrationScorer

    model = family_model(name)
    scorer = CalibrationScorer(model, WINDOWS, 2, {}, lambda: None)
    got = scorer.per_window([(i,) for i in range(N)])
    whole = F.log_softmax(model(input_ids=WINDOWS, use_cache=False).logits[:, :-1].float(), -1)
    for i in range(N):
        with torch.no_grad():
            logp = F.log_softmax(built_without(model, find_blocks(model).path, [i])(input_ids=WINDOWS, use_cache=False).logits[:, :-1].float(), -1)
        loss = -logp.gather(-1, WINDOWS[:, 1:, None])[..., 0]
        kl = (whole.exp() * (whole - logp)).sum(-1)
        agree = (logp.argmax(-1) == whole.argmax(-1)).float()
        for got_one, want in zip(got[i], (loss, kl, agree)):
            assert got_one == pytest.approx(want.mean(1).tolist(), rel=1e-4, abs=1e-5), i


@pytest.mark.parametrize("name", list(FAMILIES))
def test_speculate_decodes_generates_tokens_in_every_family(name):
    """Greedy self-speculative decoding (whole blocks and single branches skipped; prompt lookup) gives
    `model.generate`'s tokens, one for one, past the sliding windows and chunks (8 tokens) of the
    families that have them."""
    from transformers import GenerationConfig

    from depthcurse.speculate.decoding import DecodeSettings, plain, speculative
    from depthcurse.speculate.draft import Stopwatch
    from depthcurse.speculate.drafts import LayerSkipDraft, PromptLookupDraft
    from depthcurse.speculate.lengths import build_length

    model = family_model(name)
    prompt = torch.randint(0, VOCAB, (1, 11), generator=torch.Generator().manual_seed(4))
    config = GenerationConfig(max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    reference = model.generate(prompt, generation_config=config)[0, prompt.shape[1]:].tolist()
    settings, watch = DecodeSettings(max_new_tokens=24, eos=()), Stopwatch(torch.device("cpu"))
    assert plain(model, prompt, settings, watch).tokens == reference
    for skip in ((N // 2,), (1, 3), (f"a{N // 2}",), ("m1", "m3")):
        assert speculative(model, LayerSkipDraft(model, skip), prompt, settings, build_length("fixed", 3), watch).tokens == reference, skip
    assert speculative(model, PromptLookupDraft(2, ()), prompt, settings, build_length("fixed", 3), watch).tokens == reference


@pytest.mark.parametrize("name", list(FAMILIES))
def test_angular_distance_equals_the_models_own_hidden_states(name):
    """d(x_l, x_{l+n}) over every token against the streams the model's own forward returns (its
    hidden states but the last, which is after the final norm: the last block's output instead); the
    diagonal is 0 and the matrix symmetric."""
    from depthcurse.angular.measurement import measure

    model = family_model(name)
    mask = torch.ones_like(WINDOWS)
    result = measure(model, [(WINDOWS[:2], mask[:2]), (WINDOWS[2:], mask[2:])], position="all", identity_tokens=0)
    last = []
    hook = find_blocks(model).layers[-1].register_forward_hook(lambda m, a, o: last.append(_first(o)))
    with torch.no_grad():
        states = model(input_ids=WINDOWS, output_hidden_states=True, use_cache=False).hidden_states
    hook.remove()
    streams = [s.double().flatten(0, 1) for s in (*states[:N], last[0])]
    unit = [s / s.norm(dim=-1, keepdim=True) for s in streams]
    for l in range(N + 1):
        assert result.pairwise[l][l] == pytest.approx(0.0, abs=1e-3)
        for k in range(l + 1, N + 1):
            want = (torch.arccos((unit[l] * unit[k]).sum(-1).clamp(-1, 1)) / torch.pi).mean().item()
            assert result.pairwise[l][k] == pytest.approx(want, abs=1e-4) and result.pairwise[k][l] == pytest.approx(want, abs=1e-4), (l, k)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_depth_map_of_the_model_onto_itself_holds_its_diagonal(name):
    """Each stream maps onto its own (R^2 1 per dimension, fitted on more tokens than the width) and
    best there."""
    from depthcurse.depth.depth_map import depth_map

    model = family_model(name)
    fit = torch.randint(0, VOCAB, (6, 12), generator=torch.Generator().manual_seed(2))  # 72 tokens, width 32
    for ridge, within in ((0.0, 1e-6), (1e-3, 5e-3)):  # the default ridge shrinks the map a little: R^2 a hair under 1
        record = depth_map(model, model, fit, WINDOWS, batch_size=3, ridge=ridge)
        assert record["best"] == list(range(N))
        diagonal = [record["scores"]["r2_dims"]["mean"][i][i] for i in range(N)]
        assert diagonal == pytest.approx([1.0] * N, abs=within) and max(diagonal) <= 1.0


# --------------------------------------------------------------------------- a Post-LN encoder
def test_a_post_ln_encoder_is_measured_where_a_command_takes_one_and_refused_in_one_line_elsewhere():
    """BERT: angular-distance measures it (its hooks read every block); depth-use and the depth map
    read a decoder's blocks, final norm and head, and refuse it with one line that says so."""
    from depthcurse.angular.measurement import measure
    from depthcurse.depth.depth_map import depth_map

    bert = tiny_bert(VOCAB, layers=4, qa=False).eval()
    ids = WINDOWS[:, :10]
    result = measure(bert, [(ids, torch.ones_like(ids))], position="all", identity_tokens=0)
    assert len(result.pairwise) == 5 and result.pairwise[0][4] > 0
    for run in (lambda: measure_depth_use(bert, ids, 2), lambda: depth_map(bert, bert, ids, ids, batch_size=2)):
        with pytest.raises(DepthcurseError, match=r"^depth-use needs the model's blocks, final norm and head one by one .*BertModel"):
            run()
