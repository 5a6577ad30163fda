"""The identity distance of a block, E ||J v - v|| / ||v||, against the exact Jacobian; and the
outlier statistics that tell massive activations apart from the bulk of the stream."""

from __future__ import annotations

import pytest
import torch

from families import family_model
from helpers import tiny_bert
from depthcurse.angular import measurement
from depthcurse.identity import _Recorder, _split_hidden, block_probes, first_tokens, identity_distances
from depthcurse.surgery import removed_units

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _recorded(model, ids, mask):
    blocks = model.model.layers if hasattr(model, "model") else model.encoder.layer
    with _Recorder(blocks) as rec, torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=False) if hasattr(model, "model") else model(input_ids=ids, attention_mask=mask)
    return blocks, rec.calls


def _stream_side(block, part):
    """What a branch adds to the stream, named here without depthcurse's help: Gemma 2/3 and OLMo-2
    put the branch through its own post-norm first, Llama adds the branch's output itself."""
    if hasattr(block, "post_feedforward_layernorm"):
        return getattr(block, {"attn": "post_attention_layernorm", "mlp": "post_feedforward_layernorm"}[part])
    return getattr(block, {"attn": "self_attn", "mlp": "mlp"}[part])


def _exact(block, call, part=None):
    """The exact Jacobian (reverse mode, all of it) of the block's output, or of what a branch adds
    to the stream, in its input stream."""
    x, call_with = _split_hidden(*call)
    seen = {}
    handle = None
    if part is not None:
        module = _stream_side(block, part)
        handle = module.register_forward_hook(lambda m, a, out: seen.__setitem__("out", out[0] if isinstance(out, tuple) else out))

    def f(h):
        a, kw = call_with(h)
        out = block(*a, **kw)
        return seen["out"] if part else (out[0] if isinstance(out, tuple) else out)

    try:
        return torch.autograd.functional.jacobian(f, x)  # [B, T, d, B, T, d]
    finally:
        if handle is not None:
            handle.remove()


@pytest.mark.parametrize("name", ["llama", "gemma2", "olmo2"])
def test_each_probe_is_the_exact_jacobian_times_the_probe(name):
    model = family_model(name, attn="eager").double()
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0  # right padding: probes are zero there and norms skip it
    blocks, calls = _recorded(model, ids, mask)
    probes = torch.randn((3, 2, 7, 32), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for i in (0, 3):
        got = block_probes(blocks[i], *calls[i], mask, probes)
        real = mask.double()[..., None]
        J = _exact(blocks[i], calls[i])
        branches = {part: _exact(blocks[i], calls[i], part) for part in ("attn", "mlp")}
        for p, v in enumerate(probes):
            v = v * real
            jv = torch.einsum("abcxyz,xyz->abc", J, v)
            want = torch.linalg.vector_norm((jv - v) * real, dim=(-2, -1))
            torch.testing.assert_close(got["identity"][p].double(), want, rtol=1e-5, atol=1e-8)
            torch.testing.assert_close(got["v"][p].double(), torch.linalg.vector_norm(v, dim=(-2, -1)), rtol=1e-6, atol=0)
            for part, Jb in branches.items():
                want_b = torch.linalg.vector_norm(torch.einsum("abcxyz,xyz->abc", Jb, v) * real, dim=(-2, -1))
                torch.testing.assert_close(got[part][p].double(), want_b, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("name", ["llama", "gemma2", "gemma3", "olmo2"])
def test_a_pre_norm_block_without_its_mlp_is_its_attention_branch(name):
    """f(x) = x + A(x) once the MLP is removed: J - I is the attention branch's Jacobian, so the
    identity distance and the attention gain are the same number and the MLP gain is 0. For
    Gemma 2/3 and OLMo-2, A includes the branch's post-norm: a gain taken before it is not the
    branch's part of the block's Jacobian (it was, by a factor of 2.3-2.5 on Gemma-3)."""
    model = family_model(name, attn="eager")
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    batches = [(ids, torch.ones_like(ids))]
    blocks = model.model.layers
    with removed_units(model, [1], "mlp"):
        got = identity_distances(blocks, batches, lambda i, m: model(input_ids=i, attention_mask=m, use_cache=False), probes=3)
    assert got.mlp_gain[1] == 0.0 and got.mlp_gain[0] > 0
    assert got.identity[1] == pytest.approx(got.attn_gain[1], rel=1e-5)
    assert got.identity[0] != pytest.approx(got.attn_gain[0], rel=1e-2)  # with its MLP, a block is more than its attention
    assert got.tokens == 18 and got.probes == 3


def test_the_estimate_is_the_jacobians_frobenius_distance_per_dimension():
    """E ||A v|| / ||v|| over normal probes concentrates at ||A||_F / sqrt(n) in n dimensions."""
    model = family_model("llama", attn="eager").double()
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    blocks, calls = _recorded(model, ids, mask)
    J = _exact(blocks[2], calls[2]).reshape(6 * 32, 6 * 32)
    frobenius = torch.linalg.matrix_norm(J - torch.eye(6 * 32, dtype=J.dtype)).item() / (6 * 32) ** 0.5
    got = identity_distances(blocks, [(ids, mask)], lambda i, m: model(input_ids=i, attention_mask=m, use_cache=False), probes=400, seed=5)
    assert got.identity[2] == pytest.approx(frobenius, rel=0.03)


def test_encoders_get_the_identity_distance_without_branch_gains(tiny_tokenizer):
    model = tiny_bert(len(tiny_tokenizer), qa=False)
    ids = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    got = identity_distances(model.encoder.layer, [(ids, torch.ones_like(ids))], lambda i, m: model(input_ids=i, attention_mask=m), probes=2)
    assert len(got.identity) == 4 and all(d > 0 for d in got.identity)
    assert got.attn_gain is None and got.mlp_gain is None  # Post-LN: no branch on the stream


def test_first_tokens_cuts_the_last_row():
    ids = torch.arange(24).reshape(3, 8)
    mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3, [1] * 8])
    (cut_ids, cut_mask), = first_tokens([(ids, mask)], 10)
    assert int(cut_mask.sum()) == 10 and cut_mask[1].tolist() == [1, 1, 0, 0, 0, 0, 0, 0] and cut_ids.shape == (2, 8)
    assert first_tokens([(ids, mask), (ids, mask)], 100)[1][1].sum() == 21


def test_a_massive_activation_is_found_with_its_channel_and_left_out_of_the_bulk(tiny_tokenizer):
    """One block writes a huge value into channel 7 of every token: from its output on, the raw
    variance jumps, the bulk variance does not, and the largest activation names channel 7."""
    model = family_model("llama", attn="eager")
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    batches = [(ids, torch.ones_like(ids))]
    plain = measurement.measure(model, batches, identity_tokens=0)

    def massive(module, args, output):
        output[..., 7] += 500.0
        return output

    handle = model.model.layers[2].register_forward_hook(massive)
    try:
        spiked = measurement.measure(model, batches, identity_tokens=0)
    finally:
        handle.remove()
    assert spiked.max_channel[3:] == [7, 7, 7] and spiked.max_activation[3] > 400
    assert spiked.max_channel[3] != plain.max_channel[3] or plain.max_activation[3] < 50
    assert spiked.variance[3] > 100 * plain.variance[3]
    assert spiked.variance_bulk[:3] == plain.variance_bulk[:3]
    assert spiked.variance_bulk[3] < 10 * plain.variance_bulk[3]


@pytest.mark.parametrize("norm", ["sandwich", "layerscale", "pre"])
def test_lns_train_blocks_gains_are_taken_where_the_branch_meets_the_stream(norm):
    """lns-train's own blocks: a sandwich block's branch passes its output norm and a LayerScale
    block's its learned scale before the stream; without the MLP, the attention gain is the
    block's whole identity distance in each."""
    from depthcurse.train import model as M

    torch.manual_seed(0)
    model = M.Transformer(M.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4, max_seq_len=32, norm=norm)).eval()
    for block in model.model.layers:
        if hasattr(block, "attn_scale"):
            block.attn_scale.data = torch.rand(32) + 0.5  # not the init's 0.1: a gain taken before the scale would differ 10-fold
        for norm_module in block.modules():
            if isinstance(norm_module, M.RMSNorm):
                norm_module.weight.data = torch.rand(32) + 0.5
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    with removed_units(model, [1], "mlp"):
        got = identity_distances(model.model.layers, [(ids, torch.ones_like(ids))], lambda i, m: model.model(i), probes=3)
    assert got.mlp_gain[1] == 0.0
    assert got.identity[1] == pytest.approx(got.attn_gain[1], rel=1e-5)


def test_a_massive_activation_names_the_block_that_writes_it_its_token_and_its_size_against_the_median():
    """Block 2 writes 5,000 into channel 7 of the first row's first token only (as a Pre-LN LLM's
    massive activation, Sun et al.): from x_3 on it is > 100 and > 1,000 x the median, block 2
    writes it, at position 0 on the first row's first token; a heal whose cut removes block 2, or
    whose fold site (the block before the cut) is block 2, says so."""
    from depthcurse.heal.sites import massive_at_sites

    model = family_model("llama", attn="eager")
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))

    def massive(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        hidden[0, 0, 7] += 5000.0  # the first row alone, so its token is the one named
        return output

    handle = model.model.layers[2].register_forward_hook(massive)
    try:
        found = measurement.measure(model, [(ids, torch.ones_like(ids))], identity_tokens=0)
        m = found.massive()
        assert m["writers"] == [2] and m["first_depth"] == 3 and m["written_by"] == 2
        assert m["channel"] == 7 and m["position"] == 0 and m["token"] == int(ids[0, 0]) and m["value"] > 4000
        assert m["ratio"][3] > 1000 and m["ratio"][2] < 1000 and m["median"] == found.median_activation[3]
        assert massive_at_sites(model, ids, (2,), 2)["cut_writers"] == [2]
        sites = massive_at_sites(model, ids, (3, 4), 2)
        assert sites["cut_writers"] == [] and sites["fold_writers"] == [2] and sites["fold_sites"] == [2]
    finally:
        handle.remove()
    assert measurement.measure(model, [(ids, torch.ones_like(ids))], identity_tokens=0).massive()["first_depth"] is None


def test_the_median_activation_is_over_every_token_and_channel_of_a_stream():
    """Sun et al.'s yardstick, each stream's median |activation|, taken over all its values at once
    (tokens and channels): here against torch's median of the model's own hidden states, stream by
    stream (the median of the per-token medians, or of the per-channel ones, is another number)."""
    model = family_model("llama", attn="eager")
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    found = measurement.measure(model, [(ids, torch.ones_like(ids))], position="all", identity_tokens=0)
    with torch.no_grad():
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states
    for k in range(len(hidden) - 1):  # the last of hidden_states is after the final norm; the streams' last is before it
        everything = hidden[k].abs().flatten().median().item()
        assert found.median_activation[k] == pytest.approx(everything, rel=1e-5)
        assert everything != pytest.approx(hidden[k].abs().median(-1).values.median().item(), rel=1e-3)
