"""The lns-train model: Pre-LN equals transformers' Llama, each variant is what the papers
define, and exports reload with identical logits (stock Llama for Pre-LN/LNS, our own class
for the rest), also after layers are removed."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

from depthcurse.train import export as E
from depthcurse.train import model as M
from depthcurse.train.config import NORMS, TrainConfig
from depthcurse.errors import DepthcurseError
from helpers import under_triton_interpreter

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# As in test_kernels.py: Triton picks interpreted or compiled kernels when they are defined, so
# the Triton cases run in a child pytest process started with TRITON_INTERPRET=1.
INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
KERNEL_PATHS = ["torch", "triton"] if INTERPRETER else ["torch"] + (["triton-cuda"] if torch.cuda.is_available() else [])  # compiled Triton on a GPU

V = 97


def tiny(norm: str, layers: int = 4, seed: int = 0, **kw) -> M.Transformer:
    torch.manual_seed(seed)
    cfg = M.ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_layers=layers, num_heads=4, max_seq_len=64, norm=norm, **kw)
    model = M.Transformer(cfg).eval()
    with torch.no_grad():  # trained-looking gains, so folding and norm placement are really exercised
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return model


def ids(batch=2, T=19, seed=1):
    return torch.randint(0, V, (batch, T), generator=torch.Generator().manual_seed(seed))


def llama_twin(model: M.Transformer):
    """A LlamaForCausalLM built from its own config class, holding a plain copy of our weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = model.cfg
    config = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                         num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_heads,
                         max_position_embeddings=c.max_seq_len, rms_norm_eps=c.norm_eps, tie_word_embeddings=False)
    llama = LlamaForCausalLM(config).eval()
    missing, unexpected = llama.load_state_dict(model.state_dict(), strict=True)
    assert not missing and not unexpected
    return llama


def test_pre_ln_equals_transformers_llama():
    model = tiny("pre")
    x = ids()
    with torch.no_grad():
        ours, theirs = model(x), llama_twin(model)(input_ids=x).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-5)


def test_pre_ln_equals_llama_with_right_padding():
    model = tiny("pre")
    hf = E.to_hf(model)
    x = ids(T=12)
    mask = torch.ones_like(x)
    mask[0, 7:] = 0
    with torch.no_grad():
        ours = hf(input_ids=x, attention_mask=mask).logits
        theirs = llama_twin(model)(input_ids=x, attention_mask=mask).logits
    torch.testing.assert_close(ours[0, :7], theirs[0, :7], rtol=0, atol=2e-5)
    torch.testing.assert_close(ours[1], theirs[1], rtol=0, atol=2e-5)


def test_loss_is_next_token_cross_entropy():
    model = tiny("pre")
    x = ids()
    targets = torch.full_like(x, -100)
    targets[:, :-1] = x[:, 1:]
    with torch.no_grad():
        logits = model(x)
        expected = F.cross_entropy(logits[:, :-1].reshape(-1, V), x[:, 1:].reshape(-1), reduction="sum")
        torch.testing.assert_close(model(x, targets), expected, rtol=1e-6, atol=1e-4)


def test_lns_factors_bound_to_original_index():
    model = tiny("lns", layers=6)
    for l, block in enumerate(model.model.layers, start=1):
        assert block.input_layernorm.scale == block.post_attention_layernorm.scale == 1 / math.sqrt(l)
    assert model.model.norm.scale == 1.0
    assert isinstance(model.model.layers[3].input_layernorm.scale, float)  # not a buffer to_empty could wipe


def test_lns_output_is_norm_times_factor():
    model = tiny("lns")
    block = model.model.layers[2]
    x = torch.randn(2, 5, 32)
    rms = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(block.input_layernorm(x), block.input_layernorm.weight * rms / math.sqrt(3))


def test_lns_exports_as_folded_stock_llama():
    model = tiny("lns")
    x = ids()
    with torch.no_grad():
        ours = model(x)
        stock = E.to_stock_llama(model)(input_ids=x).logits
        unscaled = llama_twin(model)(input_ids=x).logits  # what loading LNS weights into Llama silently gives
    torch.testing.assert_close(stock, ours, rtol=0, atol=2e-5)
    assert (unscaled - ours).abs().max() > 1e-2


def _rms(z, weight, eps=1e-6):
    return weight * (z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps))


def _hybrid_attention(attn, x, cos, sin):
    """HybridNorm's attention from its equations: Q, K, V = x W, each head's vector RMS-normed
    (with its own gain), RoPE on Q and K, causal softmax(Q K^T / sqrt(d_h)) V, then W_o."""
    B, T, _ = x.shape
    heads = [(x @ lin.weight.T).view(B, T, attn.num_heads, attn.head_dim).transpose(1, 2) for lin in (attn.q_proj, attn.k_proj, attn.v_proj)]
    q, k, v = (_rms(h, norm.weight) for h, norm in zip(heads, (attn.q_norm, attn.k_norm, attn.v_norm)))
    q, k = M.apply_rope(q, cos, sin), M.apply_rope(k, cos, sin)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(attn.head_dim)
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    y = scores.softmax(-1) @ v
    return y.transpose(1, 2).reshape(B, T, -1) @ attn.o_proj.weight.T


def _naive_block(block, x, cos, sin, cfg=None):
    """The papers' block formulas written out, using the block's own sub-modules (the new
    variants' norms and attention from their equations, on the block's weights)."""
    s, attn, mlp = block.spec, lambda h: block.self_attn(h, cos, sin), block.mlp
    if s.qkv_norm:  # HybridNorm's attention from its equations, in its hybrid blocks and HybridNorm*'s Pre-Norm first block
        attn = lambda h: _hybrid_attention(block.self_attn, h, cos, sin)
    if s.kind == "hybrid":
        x = x + _hybrid_attention(block.self_attn, x, cos, sin)
        h = _rms(x, block.post_attention_layernorm.weight)
        return h + mlp(h)
    n1, n2 = block.input_layernorm, block.post_attention_layernorm
    if cfg is not None and cfg.norm == "dyt":  # w * tanh(alpha x), by hand
        n1, n2 = (lambda z, m=n: m.weight * torch.tanh(m.alpha * z) for n in (n1, n2))
    c = cfg.base_layers / cfg.num_layers if cfg is not None and cfg.norm == "completep" else 1.0
    if c != 1.0:
        x = x + c * attn(n1(x))
        return x + c * mlp(n2(x))
    if s.kind == "post":
        x = n1(s.residual_alpha * x + attn(x))
        return n2(s.residual_alpha * x + mlp(x))
    if s.kind == "sandwich":
        x = x + block.attn_out_norm(attn(n1(x)))
        return x + block.mlp_out_norm(mlp(n2(x)))
    g1 = block.attn_scale if s.branch_scale else 1.0
    g2 = block.mlp_scale if s.branch_scale else 1.0
    x = x + g1 * attn(n1(x))
    return x + g2 * mlp(n2(x))


@pytest.mark.parametrize("norm", NORMS)
def test_every_variant_trains_and_matches_its_formula(norm):
    model = tiny(norm, layers=8).train()
    if norm == "skipinit":  # at init the branches are off; give them a value so the formula is tested
        with torch.no_grad():
            for b in model.model.layers:
                b.attn_scale.fill_(0.5)
                b.mlp_scale.fill_(-0.25)
    cos, sin = M.rope_cos_sin(7, model.cfg.head_dim, model.cfg.rope_theta)
    x = torch.randn(2, 7, 32)
    if norm == "dyt":  # trained-looking DyT: alphas and gains away from their start
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".alpha"):
                    p.mul_(1 + 0.5 * torch.rand_like(p))
    for block in model.model.layers:
        torch.testing.assert_close(block(x, cos, sin), _naive_block(block, x, cos, sin, model.cfg))
    t = ids()
    loss = model(t, torch.roll(t, -1, 1))
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_variant_structure():
    L = 8
    kinds = lambda m: [b.spec.kind for b in m.model.layers]
    assert kinds(tiny("mix", layers=L)) == ["post"] * 2 + ["pre"] * 6  # round(0.25 * 8)
    assert kinds(tiny("mix", layers=12)) == ["post"] * 3 + ["pre"] * 9
    assert kinds(tiny("mix", layers=L, mix_ratio=0.5)) == ["post"] * 4 + ["pre"] * 4
    assert kinds(tiny("post", layers=L)) == ["post"] * L
    assert kinds(tiny("sandwich", layers=L)) == ["sandwich"] * L
    deep = tiny("deepnorm", layers=L)
    assert all(b.spec.residual_alpha == (2 * L) ** 0.25 for b in deep.model.layers)
    assert all(b.spec.residual_alpha == 1.0 for b in tiny("post", layers=L).model.layers)
    ls = tiny("layerscale", layers=L)
    assert ls.model.layers[0].attn_scale.shape == (32,) and float(ls.model.layers[0].attn_scale[0].detach()) == pytest.approx(0.1)
    si = M.Transformer(M.ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, norm="skipinit"))
    assert si.model.layers[0].attn_scale.shape == () and float(si.model.layers[0].attn_scale.detach()) == 0.0


def test_the_new_variants_structure_and_constants():
    """DyT's alpha0 per branch (the LLaMA code's 0.8 and 0.2) and its sqrt(d) embedding scalar;
    HybridNorm's per-head q, k, v norms and no attention input norm; CompleteP's L0/L on every
    branch and Adam's eps, plain floats."""
    from depthcurse.train.loop import build_optimizer

    dyt = tiny("dyt", layers=4)
    block = dyt.model.layers[0]
    assert isinstance(block.input_layernorm, M.DyT) and block.input_layernorm.alpha0 == 0.8 and block.post_attention_layernorm.alpha0 == 0.2
    assert dyt.model.norm.alpha0 == 0.2 and float(dyt.model.embed_scale.detach()) == pytest.approx(math.sqrt(32))
    hybrid = tiny("hybridnorm", layers=4).model.layers[1]
    assert not hasattr(hybrid, "input_layernorm") and hybrid.self_attn.q_norm.weight.shape == (8,) and hybrid.spec.kind == "hybrid"
    cp = tiny("completep", layers=24, base_layers=6)
    assert all(b.spec.branch_multiplier == 0.25 and isinstance(b.spec.branch_multiplier, float) for b in cp.model.layers)
    cfg = TrainConfig(norm="completep", num_layers=24, base_layers=6, hidden_size=32, num_heads=4).resolved()
    assert build_optimizer(cfg, cp).param_groups[0]["eps"] == pytest.approx(1e-8 * 6 / 24)
    assert build_optimizer(TrainConfig(norm="pre").resolved(), cp).param_groups[0]["eps"] == 1e-8


@pytest.mark.parametrize("norm", NORMS)
def test_every_variants_constants_survive_meta_device_initialisation(norm):
    """Built on the meta device, materialised by to_empty (garbage values), then initialised: every
    depth-bound constant is the same plain float, and every parameter that is not drawn at random
    (norm gains, DyT's alpha, its embedding scalar, LayerScale's and SkipInit's scales) the value a
    model built on the CPU starts with. A constant kept in a buffer would be wiped here."""
    built = tiny(norm, layers=6)
    M.init_weights(built, built.cfg)
    with torch.device("meta"):
        meta = M.Transformer(built.cfg)
    meta.to_empty(device="cpu")
    with torch.no_grad():
        for p in meta.parameters():
            p.fill_(float("nan"))
        M.init_weights(meta, meta.cfg)
    for a, b in zip(built.model.layers, meta.model.layers):
        assert a.spec == b.spec
        norms = [(n, m) for n, m in a.named_modules() if isinstance(m, (M.RMSNorm, M.DyT))]
        assert all(getattr(m, "scale", None) == getattr(b.get_submodule(n), "scale", None) for n, m in norms)
    random = (torch.nn.Linear, torch.nn.Embedding)
    drawn = {f"{n}.weight" for n, m in built.named_modules() if isinstance(m, random)}
    for name, p in meta.named_parameters():
        assert torch.isfinite(p).all(), name
        if name not in drawn:
            torch.testing.assert_close(p, built.get_parameter(name), rtol=0, atol=0, msg=name)


def _std(w):
    return float(w.detach().std())


TRUNCATED_3_SIGMA = 0.986572  # the std of N(0, 1) cut off at +-3


def _expected_std(norm: str, init: str, name: str, l: int, L: int, d: int, inter: int) -> float:
    """Each variant's rule for one matrix of block l (0-based) of L, from its authors' code: LLaMA's
    N(0, 0.02); scaled-init's 0.02/sqrt(2L) on the output projections; depth-scaled-init's
    0.02/sqrt(2(l+1)) on every matrix of block l; DeepNorm's xavier normal (gain 1 on q and k, beta =
    (8L)^(-1/4) on the rest); HybridNorm's OLMo full_megatron (init "authors": every matrix cut off at
    3 sigma at the small-init rule's sqrt(2/(5d)) (their configs' 0.013975424859373685 at d = 2048),
    output projections that over sqrt(2L), an untied head 1/sqrt(d)); Mix-LN's embedding N(0, sqrt(2/5))
    (init "authors")."""
    fan = {"q": (d, d), "k": (d, d), "v": (d, d), "o": (d, d), "gate": (d, inter), "up": (d, inter), "down": (inter, d)}
    output = name in ("o", "down")
    if norm in ("hybridnorm", "hybridnorm-star") and init == "authors":
        if name == "head":
            return TRUNCATED_3_SIGMA / math.sqrt(d)
        base = math.sqrt(2 / (5 * d))
        return TRUNCATED_3_SIGMA * (base / math.sqrt(2 * L) if output else base)
    if name == "embed" and norm == "mix" and init == "authors":
        return math.sqrt(2 / 5)  # the Mix-LN code's _init_weights draws every embedding N(0, sqrt(2/5))
    if name in ("embed", "head"):
        return 0.02
    if norm == "deepnorm":
        gain = 1.0 if name in ("q", "k") else (8 * L) ** -0.25
        return gain * math.sqrt(2 / sum(fan[name]))
    if norm in ("scaled-init", "lns+scaled-init") and output:
        return 0.02 / math.sqrt(2 * L)
    if norm == "depth-scaled-init":
        return 0.02 / math.sqrt(2 * (l + 1))
    return 0.02


@pytest.mark.parametrize("init", ("authors", "common"))
@pytest.mark.parametrize("norm", NORMS)
def test_every_variants_initialisation_is_its_authors_rule(norm, init):
    """The std of each named matrix at depth 12, blocks 0 and 7, against `_expected_std`; under
    HybridNorm's full_megatron also the 3-sigma cut-off (no value beyond it)."""
    torch.manual_seed(0)
    L, d, inter = 12, 128, 352
    model = M.Transformer(M.ModelConfig(vocab_size=2000, hidden_size=d, intermediate_size=inter, num_layers=L, num_heads=4, norm=norm, init=init))
    named = {"embed": model.model.embed_tokens.weight, "head": model.lm_head.weight}
    for l in (0, 7):
        block = model.model.layers[l]
        parts = {"q": block.self_attn.q_proj, "k": block.self_attn.k_proj, "v": block.self_attn.v_proj, "o": block.self_attn.o_proj,
                 "gate": block.mlp.gate_proj, "up": block.mlp.up_proj, "down": block.mlp.down_proj}
        for name, lin in parts.items():
            expected = _expected_std(norm, init, name, l, L, d, inter)
            assert _std(lin.weight) == pytest.approx(expected, rel=0.04), (name, l)
            if norm.startswith("hybridnorm") and init == "authors":
                assert float(lin.weight.abs().max()) <= 3 * expected / TRUNCATED_3_SIGMA + 1e-9, (name, l)
    for name, w in named.items():
        assert _std(w) == pytest.approx(_expected_std(norm, init, name, 0, L, d, inter), rel=0.04), name


def test_hybridnorms_base_std_is_its_configs_rule_at_the_models_width():
    from depthcurse.train.norms.hybridnorm import small_init_std

    assert small_init_std(2048) == 0.013975424859373685  # BryceZhuo/HybridNorm's two configs, init_std
    assert small_init_std(64) == pytest.approx(0.0790569, rel=1e-6)


def test_hybridnorm_star_is_pre_norm_in_its_first_block_only():
    """The authors' HybridNorm*: norm_pos_special_config {0: attn_norm on, ffn_residual off}: block 0
    Pre-Norm on both branches with its QKV-norm kept, every other block HybridNorm's."""
    star = tiny("hybridnorm-star", layers=4)
    first, rest = star.model.layers[0], star.model.layers[1:]
    assert first.spec.kind == "pre" and first.spec.qkv_norm and hasattr(first, "input_layernorm") and hasattr(first.self_attn, "q_norm")
    assert all(b.spec.kind == "hybrid" and not hasattr(b, "input_layernorm") for b in rest)
    assert all(b.spec.kind == "hybrid" for b in tiny("hybridnorm", layers=4).model.layers)


def test_same_seed_same_initial_weights_for_pre_and_lns():
    a, b = tiny("pre"), tiny("lns")
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.parametrize("norm", ["mix", "lns", "deepnorm", "dyt", "hybridnorm", "completep"])
def test_own_class_export_reloads_through_load_model(norm, tmp_path, tiny_tokenizer):
    from depthcurse.loading import load_model
    from depthcurse.surgery import removed_layers, save_pruned

    model = tiny(norm, layers=6)
    E.export(model, tmp_path / "hf", tiny_tokenizer)
    lm = load_model(str(tmp_path / "hf"), device="cpu", dtype="fp32")
    assert type(lm.model).__name__ == "DepthcurseLlamaForCausalLM"
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(lm.model(input_ids=x).logits, model(x), rtol=0, atol=0)
        # Removing layers keeps every block's depth-bound constants: same as deleting the block by hand.
        with removed_layers(lm.model, [1, 3]):
            pruned = lm.model(input_ids=x).logits
        kept = torch.nn.ModuleList([b for i, b in enumerate(model.model.layers) if i not in (1, 3)])
        model.model.layers = kept
        torch.testing.assert_close(pruned, model(x), rtol=0, atol=0)
    # ...and a pruned checkpoint saved to disk reloads with the same blocks.
    save_pruned(lm.model, lm.tokenizer, [1, 3], tmp_path / "pruned")
    again = load_model(str(tmp_path / "pruned"), device="cpu", dtype="fp32")
    assert again.model.config.layer_origins == [0, 2, 4, 5]
    with torch.no_grad():
        torch.testing.assert_close(again.model(input_ids=x).logits, pruned, rtol=0, atol=0)


def test_stock_export_reloads_through_load_model(tmp_path, tiny_tokenizer):
    from depthcurse.loading import load_model

    model = tiny("lns")
    E.export(model, tmp_path / "llama", tiny_tokenizer, stock=True)
    lm = load_model(str(tmp_path / "llama"), device="cpu", dtype="fp32")
    assert type(lm.model).__name__ == "LlamaForCausalLM"
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(lm.model(input_ids=x).logits, model(x), rtol=0, atol=2e-5)


def test_bad_model_input():
    with pytest.raises(DepthcurseError, match="unknown norm"):
        M.ModelConfig(norm="rmsnorm-everywhere")
    with pytest.raises(DepthcurseError, match="unknown preset"):
        TrainConfig(preset="7b").resolved()
    with pytest.raises(DepthcurseError, match="longer than the model allows"):
        tiny("pre")(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(DepthcurseError, match="no stock Llama"):
        E.to_stock_llama(tiny("mix"))


# --------------------------------------------------------------------------- kernels, checkpointing


def loss_and_grads(model: M.Transformer, x, targets) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = model(x, targets)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def next_token_targets(x):
    targets = torch.roll(x, -1, dims=1)
    targets[:, -1] = -100
    targets[0, -5:] = -100  # some ignored positions, as padding gives
    return targets


@pytest.mark.parametrize("kernels", KERNEL_PATHS)
@pytest.mark.parametrize("norm", ["pre", "lns", "mix", "sandwich", "layerscale", "deepnorm", "dyt", "hybridnorm", "completep"])
def test_kernels_match_the_plain_model(norm, kernels):
    """The fused path (residual add inside the norms, chunked linear + cross-entropy) gives the
    plain model's summed loss and every parameter's gradient, fp32. Mix-LN covers post blocks
    followed by pre ones; a chunk of 8 rows makes the loss really chunked."""
    plain = tiny(norm, layers=3, mix_ratio=0.34).train()
    with torch.no_grad():
        for block in plain.model.layers:  # non-zero branch scales, so SkipInit/LayerScale gradients matter
            for name in ("attn_scale", "mlp_scale"):
                if hasattr(block, name):
                    getattr(block, name).fill_(0.5)
    device = "cuda" if kernels == "triton-cuda" else "cpu"
    fused = M.Transformer(plain.cfg, kernels=kernels.removesuffix("-cuda")).train()
    fused.load_state_dict(plain.state_dict())
    fused.loss_fn.keywords["chunk_size"] = 8
    plain, fused = plain.to(device), fused.to(device)
    x = ids(batch=2, T=16).to(device)
    targets = next_token_targets(x)
    loss, grads = loss_and_grads(plain, x, targets)
    fused_loss, fused_grads = loss_and_grads(fused, x, targets)
    torch.testing.assert_close(fused_loss, loss, rtol=1e-5, atol=1e-5)
    for name, g in grads.items():
        scale = g.abs().max().item()
        torch.testing.assert_close(fused_grads[name], g, rtol=1e-4, atol=1e-5 * max(scale, 1.0), msg=name)
    with torch.no_grad():  # and the logits, the path that export and evaluation use
        torch.testing.assert_close(fused(x), plain(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernels", KERNEL_PATHS)
def test_kernels_match_the_plain_model_in_compiled_blocks(kernels):
    """`--compile --kernels triton|torch`: the compiled blocks call the fused norms inside their
    graphs (no graph break) and give the plain eager model's loss and gradients. Mix-LN has
    both the post blocks' and the pre blocks' fused calls."""
    plain = tiny("mix", layers=3, mix_ratio=0.34).train()
    device = "cuda" if kernels == "triton-cuda" else "cpu"
    fused = M.Transformer(plain.cfg, kernels=kernels.removesuffix("-cuda")).train()
    fused.load_state_dict(plain.state_dict())
    assert_compiled_blocks_train_as(plain.to(device), fused.to(device), device)


def assert_compiled_blocks_train_as(plain: M.Transformer, other: M.Transformer, device: str = "cpu") -> None:
    """`other`'s blocks compiled as `parallelize` compiles them: one graph a block, no break, and
    `plain`'s loss and gradients."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    for block in other.model.layers:
        block.forward = torch.compile(block.forward)
    x = ids(batch=2, T=16).to(device)
    targets = next_token_targets(x)
    loss, grads = loss_and_grads(plain, x, targets)
    other_loss, other_grads = loss_and_grads(other, x, targets)
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"], dict(counters["graph_break"])
    torch.testing.assert_close(other_loss, loss, rtol=1e-5, atol=1e-5)
    for name, g in grads.items():
        torch.testing.assert_close(other_grads[name], g, rtol=1e-4, atol=1e-5 * max(g.abs().max().item(), 1.0), msg=name)


def test_fused_norms_feed_matmuls_in_the_autocast_dtype_and_keep_the_stream():
    """Under autocast the fused norms whose output only feeds matmuls (attention's and the MLP's
    inputs) write it in bf16, what autocast would cast it to anyway; the residual
    stream stays fp32, also where a Post-LN norm's output is the stream (Mix-LN)."""
    plain = tiny("mix", layers=3, mix_ratio=0.34).train()
    fused = M.Transformer(plain.cfg, kernels="torch").train()
    fused.load_state_dict(plain.state_dict())
    seen = {}
    hooks = [m.register_forward_pre_hook(lambda mod, args, name=name: seen.__setitem__(name, args[0].dtype))
             for name, m in fused.named_modules() if name.endswith(("q_proj", "gate_proj"))]
    hooks += [block.register_forward_hook(lambda mod, args, out, i=i: seen.__setitem__(f"stream {i}", out[0].dtype))
              for i, block in enumerate(fused.model.layers)]
    x = ids(batch=2, T=16)
    targets = next_token_targets(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = fused(x, targets)
        want = plain(x, targets)
    for h in hooks:
        h.remove()
    assert fused.model.layers[0].spec.kind == "post" and fused.model.layers[2].spec.kind != "post"
    # a pre block's matmuls get the norm's bf16 output; a post block's attention gets the stream
    pre = [n for n in seen if n.endswith("proj") and not n.startswith("model.layers.0.")]
    assert pre and {seen[n] for n in pre} == {torch.bfloat16}
    assert seen["model.layers.0.self_attn.q_proj"] == torch.float32
    assert [seen[f"stream {i}"] for i in range(3)] == [torch.float32] * 3
    torch.testing.assert_close(loss, want, rtol=2e-2, atol=0)  # bf16 matmuls in another order


@pytest.mark.parametrize("kernels", ["off", "torch"])
@pytest.mark.parametrize("norm", ["lns", "post"])
def test_activation_checkpointing_changes_nothing(norm, kernels):
    model = M.Transformer(tiny(norm, layers=3).cfg, kernels=kernels).train()
    x = ids(batch=2, T=16)
    targets = next_token_targets(x)
    loss, grads = loss_and_grads(model, x, targets)
    model.set_activation_checkpointing(True)
    ckpt_loss, ckpt_grads = loss_and_grads(model, x, targets)
    assert ckpt_loss.item() == loss.item()  # the same operations in the same order
    for name, g in grads.items():
        torch.testing.assert_close(ckpt_grads[name], g, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("kernels", ["off", "torch"])
@pytest.mark.parametrize("norm", ["lns", "mix", "deepnorm"])
def test_fused_projections_compute_what_the_separate_ones_do(norm, kernels):
    """`--fuse-projections`: one matmul for q, k and v and one for gate and up, on the weights
    concatenated at each call, give the separate matmuls' loss, every weight's own gradient and
    the logits (fp32), with the same parameters; `build_model` applies the setting."""
    from depthcurse.train import loop

    reference = tiny(norm, layers=3, mix_ratio=0.34)
    separate, fused = (M.Transformer(reference.cfg, kernels=kernels).train() for _ in range(2))
    for model in (separate, fused):
        model.load_state_dict(reference.state_dict())
    fused.set_fused_projections(True)
    assert list(fused.state_dict()) == list(separate.state_dict())
    x = ids(batch=2, T=16)
    targets = next_token_targets(x)
    loss, grads = loss_and_grads(separate, x, targets)
    fused_loss, fused_grads = loss_and_grads(fused, x, targets)
    torch.testing.assert_close(fused_loss, loss, rtol=1e-5, atol=1e-5)
    for name, g in grads.items():
        torch.testing.assert_close(fused_grads[name], g, rtol=1e-4, atol=1e-5 * max(g.abs().max().item(), 1.0), msg=name)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), separate(x), rtol=1e-5, atol=1e-5)
    built = loop.build_model(TrainConfig(fuse_projections=True, layer_metrics_tokens=0).resolved(), V, torch.device("cpu"), "fp32")
    assert all(b.self_attn.fused and b.mlp.fused for b in built.model.layers)


def test_resolve_kernels():
    assert M.resolve_kernels("auto", "cpu") == "off"
    assert M.resolve_kernels("auto", "cuda", compile=True) == "off"  # inductor fuses the plain blocks faster
    assert M.resolve_kernels("triton", "cuda", compile=True) == "triton"  # asked for: kept
    assert M.resolve_kernels("torch", "cpu") == "torch"
    with pytest.raises(DepthcurseError, match="unknown --kernels 'cuda'"):
        M.resolve_kernels("cuda", "cpu")


@pytest.mark.parametrize("kernels", ["off", "torch"])
@pytest.mark.parametrize("norm", ["dyt", "hybridnorm", "completep"])
def test_the_newer_depth_fixes_compile_as_the_eager_model(norm, kernels):
    """--compile: each block compiled as `parallelize` does, with the plain model and with the
    fused kernels' PyTorch path (DyT has no norm to fuse: its tanh stays where it is and inductor
    fuses it): one graph a block, no break, the eager loss and gradients."""
    plain = tiny(norm, layers=3).train()
    compiled = M.Transformer(plain.cfg, kernels=kernels).train()
    compiled.load_state_dict(plain.state_dict())
    assert_compiled_blocks_train_as(plain, compiled)


@pytest.mark.skipif(INTERPRETER, reason="this is the child run itself")
def test_kernels_under_the_triton_interpreter():
    # every norm of test_kernels_match_the_plain_model, and in compiled blocks
    under_triton_interpreter(__file__, "kernels_match and triton", expected=10, timeout=900)


@pytest.mark.parametrize("norm", ["lns", "mix", "dyt", "hybridnorm", "completep"])
def test_trainer_export_from_a_gathered_state_equals_the_model(norm, tmp_path, tiny_tokenizer):
    """export_run rebuilds the model from its state dict (on the meta device, no init): same logits."""
    from depthcurse.loading import load_model
    from depthcurse.train.export import export_run

    model = tiny(norm, layers=4)
    exports = export_run(model.state_dict(), model.cfg, tiny_tokenizer, tmp_path)
    x = ids()
    with torch.no_grad():
        expected = model(x)
        ours = load_model(exports["hf"], device="cpu", dtype="fp32").model
        torch.testing.assert_close(ours(input_ids=x).logits, expected, rtol=0, atol=0)
        if "hf-llama" in exports:
            stock = load_model(exports["hf-llama"], device="cpu", dtype="fp32").model
            torch.testing.assert_close(stock(input_ids=x).logits, expected, rtol=0, atol=2e-5)


def test_a_normalisation_is_one_module_found_by_name_and_nothing_else_tests_for_it():
    """Every variant is a module of train/norms registered by defining its class, with its authors'
    code named; no module outside train/norms compares a norm with a variant's name."""
    import re
    from pathlib import Path

    from depthcurse.train.norms import KINDS, REGISTRY, find_norm

    assert tuple(REGISTRY) == NORMS
    for name, norm in REGISTRY.items():
        assert find_norm(name) is norm and norm.title and norm.reference and norm.block, name
        assert all(norm.kind(origin, M.ModelConfig(norm=name, num_layers=8, hidden_size=32, num_heads=4)) in KINDS for origin in range(8))
    root = Path(M.__file__).resolve().parents[1]
    names = "|".join(re.escape(n) for n in REGISTRY)
    compare = re.compile(rf"""norm\s*(==|!=)\s*["']({names})["']|norm\s+(not\s+)?in\s+\(\s*["']({names})["']""")
    offenders = [f"{p.relative_to(root)}:{i}" for p in root.rglob("*.py") if "norms" not in p.parts
                 for i, line in enumerate(p.read_text().splitlines(), 1) if compare.search(line)]
    assert not offenders, offenders


def test_a_users_own_normalisation_plugs_in_by_defining_it():
    """A variant defined outside the package (here, in the test): Post-LN in the odd blocks, its
    own init rule; it is found by name, builds, trains and initialises by its rule, no file of ours edited."""
    from depthcurse.train.norms import REGISTRY, Normalisation

    class OddPost(Normalisation):
        name = "test-odd-post"
        title = "odd blocks Post-LN"
        block = "post in odd blocks, pre in even ones"
        reference = "this test"

        def kind(self, origin, cfg):
            return "post" if origin % 2 else "pre"

        def defining_init(self, model, cfg):
            model.lm_head.weight.normal_(0.0, 0.5)

    try:
        model = tiny("test-odd-post", layers=4)
        assert [b.spec.kind for b in model.model.layers] == ["pre", "post", "pre", "post"]
        assert _std(model.lm_head.weight) == pytest.approx(0.5, rel=0.2)
        t = ids()
        loss = model(t, torch.roll(t, -1, 1))
        loss.backward()
        assert torch.isfinite(loss)
        assert TrainConfig(norm="test-odd-post").resolved().norm == "test-odd-post"
    finally:
        REGISTRY.pop("test-odd-post", None)
    with pytest.raises(DepthcurseError, match="unknown norm 'test-odd-post'"):
        TrainConfig(norm="test-odd-post").resolved()
