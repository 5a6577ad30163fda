"""Layer surgery against independently built reference models (tiny random configs, CPU).

The reference for "model X without layers S" is a fresh model built from a config with
n - |S| layers whose state dict is X's, with the kept blocks' keys renamed to their new
positions. If the surgery missed any piece of state the model reads at run time (layer_types,
layer_idx, num_hidden_layers), the two would disagree.
"""

from __future__ import annotations

import re

import pytest
import torch
import transformers as tf
from torch import nn

from depthcurse.errors import DepthcurseError
from helpers import built_without

from depthcurse.surgery import (
    BlockList,
    find_blocks,
    num_layers,
    parse_layers,
    removed_layers,
    save_pruned,
)

N = 5  # layers in every tiny model
VOCAB = 128
SEQ = 10  # longer than the sliding window (4) of the sliding-attention models

LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"]

DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=N,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)

# name -> (config factory, model class, path of the block list)
ARCHS = {
    "llama": (lambda: tf.LlamaConfig(**DECODER), tf.LlamaForCausalLM, "model.layers"),
    "qwen2": (lambda: tf.Qwen2Config(**DECODER, use_sliding_window=True, sliding_window=4,
                                     layer_types=list(LAYER_TYPES)),
              tf.Qwen2ForCausalLM, "model.layers"),
    "qwen3": (lambda: tf.Qwen3Config(**DECODER, head_dim=8, use_sliding_window=True, sliding_window=4,
                                     layer_types=list(LAYER_TYPES)),
              tf.Qwen3ForCausalLM, "model.layers"),
    "gemma2": (lambda: tf.Gemma2Config(**DECODER, head_dim=8, sliding_window=4, layer_types=list(LAYER_TYPES)),
               tf.Gemma2ForCausalLM, "model.layers"),
    "gemma3": (lambda: tf.Gemma3TextConfig(**DECODER, head_dim=8, sliding_window=4,
                                           layer_types=list(LAYER_TYPES)),
               tf.Gemma3ForCausalLM, "model.layers"),
    "phi3": (lambda: tf.Phi3Config(**DECODER), tf.Phi3ForCausalLM, "model.layers"),
    "mistral": (lambda: tf.MistralConfig(**DECODER, sliding_window=4), tf.MistralForCausalLM, "model.layers"),
    "gpt2": (lambda: tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=N, n_head=4, n_positions=64),
             tf.GPT2LMHeadModel, "transformer.h"),
    "gpt_neox": (lambda: tf.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=N,
                                          num_attention_heads=4, intermediate_size=64,
                                          max_position_embeddings=64),
                 tf.GPTNeoXForCausalLM, "gpt_neox.layers"),
    "opt": (lambda: tf.OPTConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=N, ffn_dim=64,
                                 num_attention_heads=4, max_position_embeddings=64,
                                 word_embed_proj_dim=32, pad_token_id=1),
            tf.OPTForCausalLM, "model.decoder.layers"),
    "falcon": (lambda: tf.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=N,
                                       num_attention_heads=4),
               tf.FalconForCausalLM, "transformer.h"),
    "bert": (lambda: tf.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=N,
                                   num_attention_heads=4, intermediate_size=64, max_position_embeddings=64),
             tf.BertForMaskedLM, "bert.encoder.layer"),
    "distilbert": (lambda: tf.DistilBertConfig(vocab_size=VOCAB, dim=32, n_layers=N, n_heads=4,
                                               hidden_dim=64, max_position_embeddings=64),
                   tf.DistilBertModel, "transformer.layer"),
}
ENCODERS = {"bert", "distilbert"}
REMOVALS = {"first": [0], "middle": [2], "last": [N - 1], "two": [1, 3]}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def build(cls, config):
    """A tiny model with weights large enough that every layer visibly changes the output."""
    config._attn_implementation = "eager"
    model = cls(config)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.eval()


def make(name):
    make_config, cls, _ = ARCHS[name]
    torch.manual_seed(0)
    return build(cls, make_config())


def inputs(name, padded):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (2, SEQ), generator=gen)
    mask = torch.ones_like(ids)
    if padded:  # second row: 3 pad tokens, on the left for decoders, on the right for encoders
        if name in ENCODERS:
            mask[1, -3:] = 0
        else:
            mask[1, :3] = 0
    return dict(input_ids=ids, attention_mask=mask)


def out(model, batch, **kw):
    with torch.no_grad():
        o = model(**batch, **kw)
    return o.logits if hasattr(o, "logits") else o.last_hidden_state


def exact(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


def layer_idx_values(model):
    return [(name, m.layer_idx) for name, m in model.named_modules() if isinstance(getattr(m, "layer_idx", None), int)]


@pytest.mark.parametrize("name", list(ARCHS))
def test_removed_layers_matches_reference_and_restores(name):
    model = make(name)
    path = ARCHS[name][2]
    blocks = find_blocks(model)
    assert blocks.path == path
    padded = name in ("llama", "qwen2", "gemma3", "bert", "distilbert")
    batch = inputs(name, padded)

    before = out(model, batch)
    config_before = model.config.to_dict()
    idx_before = layer_idx_values(model)
    ptrs_before = {k: p.data_ptr() for k, p in model.named_parameters()}
    list_before = blocks.layers

    for label, removed in REMOVALS.items():
        with removed_layers(model, removed) as pruned:
            assert pruned is model
            assert num_layers(model) == N - len(removed)
            assert model.config.num_hidden_layers == N - len(removed)
            got = out(model, batch)
        expected = out(built_without(model, path, removed), batch)
        exact(got, expected)
        # Not vacuous: the layer did something.
        assert not torch.allclose(got, before, atol=1e-3), label

    # Everything back: output, config, layer_idx, same ModuleList, same tensors.
    exact(out(model, batch), before)
    assert model.config.to_dict() == config_before
    assert layer_idx_values(model) == idx_before
    assert find_blocks(model).layers is list_before
    assert {k: p.data_ptr() for k, p in model.named_parameters()} == ptrs_before


def test_no_copies_inside_context():
    model = make("llama")
    ptrs = {p.data_ptr() for p in model.parameters()}
    with removed_layers(model, [1, 3]):
        inside = {p.data_ptr() for p in model.parameters()}
    assert inside <= ptrs and len(inside) < len(ptrs)


def test_stale_layer_types_would_be_wrong():
    """Why layer_types is filtered: keeping it stale changes the output of Qwen2 silently."""
    model = make("qwen2")
    batch = inputs("qwen2", padded=False)
    with removed_layers(model, [0]):
        good = out(model, batch)
        fixed = model.config.layer_types
        model.config.layer_types = LAYER_TYPES[:-1]  # what a naive truncation would leave
        stale = out(model, batch)
        model.config.layer_types = fixed
    assert not torch.allclose(good, stale, atol=1e-3)
    assert model.config.layer_types == LAYER_TYPES


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_generate_with_cache_matches_reference(name):
    model = make(name)
    model.generation_config.pad_token_id = 0
    batch = inputs(name, padded=True)
    removed = [1, 3]
    kw = dict(max_new_tokens=8, do_sample=False, min_new_tokens=8)
    with removed_layers(model, removed):
        with torch.no_grad():
            # use_cache forward first: the cache is built from the config, indexed by layer_idx
            o = model(**batch, use_cache=True)
            assert len(o.past_key_values.layers) == N - 2
            got = model.generate(**batch, **kw)
    ref = built_without(model, "model.layers", removed)
    ref.generation_config.pad_token_id = 0
    with torch.no_grad():
        expected = ref.generate(**batch, **kw)
    assert torch.equal(got, expected)
    # and the cached decoding agrees with a full forward without cache
    with removed_layers(model, removed), torch.no_grad():
        nocache = model.generate(**batch, **kw, use_cache=False)
    assert torch.equal(got, nocache)


def test_config_restored_on_exception():
    model = make("qwen2")
    before = model.config.to_dict()
    idx = layer_idx_values(model)
    blocks = find_blocks(model).layers
    with pytest.raises(RuntimeError):
        with removed_layers(model, [0, 4]):
            assert model.config.layer_types == LAYER_TYPES[1:4]
            raise RuntimeError("boom")
    assert model.config.to_dict() == before
    assert model.config.layer_types == LAYER_TYPES
    assert layer_idx_values(model) == idx
    assert find_blocks(model).layers is blocks


def test_attribute_mapped_layer_counts():
    gpt2, distil = make("gpt2"), make("distilbert")
    with removed_layers(gpt2, [0]), removed_layers(distil, [0, 1]):
        assert gpt2.config.n_layer == N - 1
        assert distil.config.n_layers == N - 2
        assert distil.transformer.n_layers == N - 2
    assert gpt2.config.n_layer == N and distil.config.n_layers == N and distil.transformer.n_layers == N


def test_empty_removal_is_noop_and_all_removed_works():
    model = make("qwen2")
    batch = inputs("qwen2", padded=False)
    blocks = find_blocks(model).layers
    with removed_layers(model, []):
        assert find_blocks(model).layers is blocks
        assert model.config.num_hidden_layers == N
    with removed_layers(model, range(N)):
        assert num_layers(model) == 0 and model.config.layer_types == []
        got = out(model, batch)
        with torch.no_grad():
            hidden = model.model.norm(model.model.embed_tokens(batch["input_ids"]))
        exact(got, model.lm_head(hidden))
        with torch.no_grad():
            model(**batch, use_cache=True)
    assert num_layers(model) == N


def test_negative_and_duplicate_indices():
    model = make("llama")
    batch = inputs("llama", padded=False)
    with removed_layers(model, [4]):
        a = out(model, batch)
    with removed_layers(model, [-1, 4]):
        b = out(model, batch)
    exact(a, b)
    with pytest.raises(DepthcurseError, match="out of range"):
        with removed_layers(model, [5]):
            pass
    with pytest.raises(DepthcurseError, match="integers"):
        with removed_layers(model, ["1"]):
            pass
    assert num_layers(model) == N


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "b": 2}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return tf.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


def test_save_pruned_round_trip(tmp_path):
    model = make("qwen2")
    batch = inputs("qwen2", padded=True)
    before = out(model, batch)
    config_before = model.config.to_dict()
    with removed_layers(model, [1, 3]):
        inside = out(model, batch)

    saved = save_pruned(model, tiny_tokenizer(), [1, 3], tmp_path / "pruned")
    assert (saved / "model.safetensors").is_file()
    assert tf.AutoTokenizer.from_pretrained(saved)("a b")["input_ids"] == [1, 2]

    # the in-memory model is unchanged
    exact(out(model, batch), before)
    # save_pretrained itself records `architectures` and `dtype`; nothing else may change
    after = model.config.to_dict()
    for key in ("architectures", "dtype"):
        after.pop(key), config_before.pop(key)
    assert after == config_before
    assert num_layers(model) == N

    from safetensors import safe_open

    with safe_open(saved / "model.safetensors", "pt") as f:
        indices = {int(m.group(1)) for k in f.keys() if (m := re.match(r"model\.layers\.(\d+)\.", k))}
    assert indices == {0, 1, 2}

    reloaded = tf.AutoModelForCausalLM.from_pretrained(saved, attn_implementation="eager").eval()
    assert reloaded.config.num_hidden_layers == N - 2
    assert reloaded.config.layer_types == [LAYER_TYPES[i] for i in (0, 2, 4)]
    exact(out(reloaded, batch), inside)


def test_save_pruned_strips_gguf_quantizer(tmp_path):
    from transformers.utils.quantization_config import GgufConfig

    model = make("llama")

    class FakeGguf:  # what a dequantized GGUF load leaves behind
        quantization_config = GgufConfig(gguf_file="x.gguf")
        packed_modules = {}

        def is_serializable(self, safe_serialization=None):
            return False

    quantizer = FakeGguf()
    model.hf_quantizer = quantizer
    model.config.quantization_config = {"quant_method": "gguf"}
    saved = save_pruned(model, None, [0], tmp_path / "g")
    assert "quantization_config" not in (saved / "config.json").read_text()
    assert model.hf_quantizer is quantizer  # restored afterwards
    assert model.config.quantization_config == {"quant_method": "gguf"}

    quantizer.packed_modules = {"model.layers.0.mlp.up_proj": object()}
    with pytest.raises(DepthcurseError, match="packed"):
        save_pruned(model, None, [0], tmp_path / "h")
    assert num_layers(model) == N


def moe_config(**kw):
    return tf.Qwen2MoeConfig(**DECODER, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                             num_experts=4, num_experts_per_tok=2, **kw)


def test_moe_dense_layer_indices_follow(tmp_path):
    """Qwen2-MoE names its dense layers by index (mlp_only_layers): renumbered, and still reloadable."""
    model = build(tf.Qwen2MoeForCausalLM, moe_config(mlp_only_layers=[1, 3]))
    batch = inputs("llama", padded=False)
    with removed_layers(model, [0, 2]):
        assert model.config.mlp_only_layers == [0, 1]
        inside = out(model, batch)
    assert model.config.mlp_only_layers == [1, 3]
    saved = save_pruned(model, None, [0, 2], tmp_path / "moe")
    reloaded = tf.AutoModelForCausalLM.from_pretrained(saved, attn_implementation="eager").eval()
    assert reloaded.config.mlp_only_layers == [0, 1]
    exact(out(reloaded, batch), inside)


def test_save_refuses_index_dependent_structure(tmp_path):
    # MoE on every 2nd layer: removing layer 0 shifts which kept layers a reload would make MoE
    model = build(tf.Qwen2MoeForCausalLM, moe_config(decoder_sparse_step=2))
    with pytest.raises(DepthcurseError, match="different architecture"):
        save_pruned(model, None, [0], tmp_path / "a")
    assert num_layers(model) == N
    save_pruned(model, None, [0, 1], tmp_path / "b")  # the pattern survives removing a pair

    # GPT-2 variants (Stanford CRFM) bake 1/(layer_idx+1) into each attention at build time
    config = ARCHS["gpt2"][0]()
    config.scale_attn_by_inverse_layer_idx = True
    gpt2 = build(tf.GPT2LMHeadModel, config)
    with pytest.raises(DepthcurseError, match="scale_attn_by_inverse_layer_idx"):
        save_pruned(gpt2, None, [0], tmp_path / "c")
    assert not (tmp_path / "c").exists()


# --- find_blocks across heads -------------------------------------------------------------


def on_meta(cls, config):
    with torch.device("meta"):
        return cls(config)


@pytest.mark.parametrize(
    "cls, make_config, path",
    [
        (tf.LlamaModel, lambda: tf.LlamaConfig(**DECODER), "layers"),
        (tf.LlamaForSequenceClassification, lambda: tf.LlamaConfig(**DECODER), "model.layers"),
        (tf.Qwen2ForQuestionAnswering, lambda: tf.Qwen2Config(**DECODER), "transformer.layers"),
        (tf.GPT2Model, ARCHS["gpt2"][0], "h"),
        (tf.GPT2ForSequenceClassification, ARCHS["gpt2"][0], "transformer.h"),
        (tf.GPTNeoXModel, ARCHS["gpt_neox"][0], "layers"),
        (tf.OPTModel, ARCHS["opt"][0], "decoder.layers"),
        (tf.FalconModel, ARCHS["falcon"][0], "h"),
        (tf.PhiForCausalLM, lambda: tf.PhiConfig(**DECODER), "model.layers"),
        (tf.GemmaForCausalLM, lambda: tf.GemmaConfig(**DECODER, head_dim=8), "model.layers"),
        (tf.BertModel, ARCHS["bert"][0], "encoder.layer"),
        (tf.BertForQuestionAnswering, ARCHS["bert"][0], "bert.encoder.layer"),
        (tf.RobertaForSequenceClassification,
         lambda: tf.RobertaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=N, num_attention_heads=4,
                                  intermediate_size=64),
         "roberta.encoder.layer"),
        (tf.MPNetForMaskedLM,
         lambda: tf.MPNetConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=N, num_attention_heads=4,
                                intermediate_size=64),
         "mpnet.encoder.layer"),
        (tf.DistilBertForQuestionAnswering, ARCHS["distilbert"][0], "distilbert.transformer.layer"),
    ],
)
def test_find_blocks_paths(cls, make_config, path):
    model = on_meta(cls, make_config())
    blocks = find_blocks(model)
    assert isinstance(blocks, BlockList)
    assert blocks.path == path
    assert blocks.layers is model.get_submodule(path)
    assert num_layers(model) == N


def test_multimodal_gemma3_prunes_text_config(tmp_path):
    text = tf.Gemma3TextConfig(**DECODER, head_dim=8, sliding_window=4, layer_types=list(LAYER_TYPES))
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, image_size=16, patch_size=8)
    config = tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                             image_token_index=127, boi_token_index=125, eoi_token_index=126)
    model = build(tf.Gemma3ForConditionalGeneration, config)
    assert find_blocks(model).path == "model.language_model.layers"
    batch = inputs("gemma3", padded=False)
    with removed_layers(model, [0, 3]):
        assert model.config.text_config.num_hidden_layers == N - 2
        assert model.config.text_config.layer_types == [LAYER_TYPES[i] for i in (1, 2, 4)]
        assert model.model.language_model.config.num_hidden_layers == N - 2
        assert model.config.vision_config.num_hidden_layers == 2  # the vision tower is untouched
        inside = out(model, batch, use_cache=True)
    assert model.config.text_config.layer_types == LAYER_TYPES

    saved = save_pruned(model, None, [0, 3], tmp_path / "vlm")
    reloaded = tf.AutoModelForImageTextToText.from_pretrained(saved, attn_implementation="eager").eval()
    assert reloaded.config.text_config.num_hidden_layers == N - 2
    exact(out(reloaded, batch), inside)


def test_find_blocks_fallback_and_error():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

    class Config:
        num_hidden_layers = 3

    class OddModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = Config()
            self.small = nn.ModuleList([nn.Identity() for _ in range(3)])
            self.stack = nn.ModuleList([Block() for _ in range(3)])

    model = OddModel()
    assert find_blocks(model).path == "stack"

    class FooForCausalLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.stuff = nn.ModuleList([nn.Linear(2, 2)])

    with pytest.raises(DepthcurseError, match="FooForCausalLM: unsupported architecture"):
        find_blocks(FooForCausalLM())


def test_encoder_decoder_refused():
    config = tf.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
    with pytest.raises(DepthcurseError, match="encoder-decoder"):
        find_blocks(on_meta(tf.T5ForConditionalGeneration, config))


# --- parse_layers ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("0,3,5-8", [0, 3, 5, 6, 7, 8]),
        ("8-5", None),
        (None, list(range(10))),
        ("all", list(range(10))),
        (" ALL ", list(range(10))),
        ("3", [3]),
        ("-1", [9]),
        ("-1,0", [0, 9]),
        ("-3--1", [7, 8, 9]),
        ("2-2", [2]),
        ("5, 1 ,3", [1, 3, 5]),
        ("1,2,", [1, 2]),
        ("0-9", list(range(10))),
    ],
)
def test_parse_layers(spec, expected):
    if expected is None:
        with pytest.raises(DepthcurseError, match="8-5"):
            parse_layers(spec, 10)
    else:
        assert parse_layers(spec, 10) == expected


def test_parse_layers_errors():
    for empty in ("", " ", ",", " , "):  # an empty shell variable: never "every layer"
        with pytest.raises(DepthcurseError, match="names no layer"):
            parse_layers(empty, 10)
    with pytest.raises(DepthcurseError, match=r"^layer 40 is out of range: the model has 30 layers \(0-29\)$"):
        parse_layers("1,40", 30)
    with pytest.raises(DepthcurseError, match="layer -31 is out of range"):
        parse_layers("-31", 30)
    with pytest.raises(DepthcurseError, match="layer 30 is out of range"):
        parse_layers("28-30", 30)
    for twice, named in (("3,3", "layer 3"), ("5, 1 ,1,5", "layers 1,5"), ("2-5,4", "layer 4"), ("-1,29", "layer 29")):  # a typo, never silently one layer
        with pytest.raises(DepthcurseError, match=f"^--layers '{twice}' names {named} more than once: name each layer once$"):
            parse_layers(twice, 30)
    for garbage in ("abc", "1,x", "1.5", "3-", "1-2-3", "--1"):
        with pytest.raises(DepthcurseError) as err:
            parse_layers(garbage, 30)
        bad = [t for t in garbage.split(",") if not re.fullmatch(r"\d+", t)][0]
        assert repr(bad) in str(err.value)
