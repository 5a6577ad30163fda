"""Tiny random configs of the decoder families researchers prune, for the per-family tests.

Each entry is one family as its hub checkpoints configure it, shrunk: 5 layers, hidden 32,
and the per-layer features that make removal hard switched on where the family has them
(sliding/full and chunked/full attention patterns, NoPE layers, dense layers among MoE ones,
multi-head latent attention, embedding and logit scales). `DISTINCT` names, per family, a
layer whose kind differs from a neighbour's, the removal where other tools go wrong.
"""

from __future__ import annotations

import torch
import transformers as tf

N = 5
VOCAB = 128
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=N, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, pad_token_id=None, bos_token_id=None, eos_token_id=None)
TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"]
MOE = dict(num_local_experts=4, num_experts_per_tok=2)
MLA = dict(num_key_value_heads=4, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
           first_k_dense_replace=2, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, n_group=1, topk_group=1)
SCALES = dict(embedding_multiplier=3.0, logits_scaling=4.0, residual_multiplier=0.5, attention_multiplier=0.2)

# name -> (model class, config factory)
FAMILIES = {
    "llama": (tf.LlamaForCausalLM, lambda: tf.LlamaConfig(**BASE)),
    "llama3.1": (tf.LlamaForCausalLM, lambda: tf.LlamaConfig(**BASE, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16))),
    "mistral": (tf.MistralForCausalLM, lambda: tf.MistralConfig(**BASE, sliding_window=8)),
    "mixtral": (tf.MixtralForCausalLM, lambda: tf.MixtralConfig(**BASE, **MOE)),
    "qwen2": (tf.Qwen2ForCausalLM, lambda: tf.Qwen2Config(**BASE, use_sliding_window=True, sliding_window=8, max_window_layers=2)),
    "qwen2_moe": (tf.Qwen2MoeForCausalLM, lambda: tf.Qwen2MoeConfig(**BASE, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                                                                   num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1])),
    "qwen3": (tf.Qwen3ForCausalLM, lambda: tf.Qwen3Config(**BASE, head_dim=8, use_sliding_window=True, sliding_window=8, layer_types=list(TYPES))),
    "qwen3_moe": (tf.Qwen3MoeForCausalLM, lambda: tf.Qwen3MoeConfig(**BASE, head_dim=8, moe_intermediate_size=16, num_experts=4,
                                                                   num_experts_per_tok=2, mlp_only_layers=[3])),
    "gemma2": (tf.Gemma2ForCausalLM, lambda: tf.Gemma2Config(**BASE, head_dim=8, sliding_window=8, layer_types=list(TYPES))),
    "gemma3": (tf.Gemma3ForCausalLM, lambda: tf.Gemma3TextConfig(**BASE, head_dim=8, sliding_window=8, layer_types=list(TYPES))),
    "phi3": (tf.Phi3ForCausalLM, lambda: tf.Phi3Config(**BASE)),
    "olmo2": (tf.Olmo2ForCausalLM, lambda: tf.Olmo2Config(**BASE)),
    "olmoe": (tf.OlmoeForCausalLM, lambda: tf.OlmoeConfig(**BASE, num_experts=4, num_experts_per_tok=2)),
    "granite": (tf.GraniteForCausalLM, lambda: tf.GraniteConfig(**BASE, **SCALES)),
    "granitemoe": (tf.GraniteMoeForCausalLM, lambda: tf.GraniteMoeConfig(**BASE, **SCALES, **MOE)),
    "glm4": (tf.Glm4ForCausalLM, lambda: tf.Glm4Config(**BASE, head_dim=8)),
    "gpt_oss": (tf.GptOssForCausalLM, lambda: tf.GptOssConfig(**BASE, head_dim=8, sliding_window=8, layer_types=list(TYPES), **MOE)),
    "smollm3": (tf.SmolLM3ForCausalLM, lambda: tf.SmolLM3Config(**BASE, no_rope_layers=[1, 1, 0, 1, 1])),
    "cohere": (tf.CohereForCausalLM, lambda: tf.CohereConfig(**BASE, logit_scale=0.5)),
    "cohere2": (tf.Cohere2ForCausalLM, lambda: tf.Cohere2Config(**BASE, sliding_window=8, layer_types=list(TYPES), logit_scale=0.5)),
    "llama4": (tf.Llama4ForCausalLM, lambda: tf.Llama4TextConfig(**BASE, head_dim=8, intermediate_size_mlp=64, num_local_experts=4,
                                                                 num_experts_per_tok=1, attention_chunk_size=8, no_rope_layers=[1, 1, 0, 1, 0],
                                                                 moe_layers=[1, 3], floor_scale=4, attn_scale=0.5)),
    "deepseek_v2": (tf.DeepseekV2ForCausalLM, lambda: tf.DeepseekV2Config(**{**BASE, **MLA, "q_lora_rank": None})),
    "deepseek_v3": (tf.DeepseekV3ForCausalLM, lambda: tf.DeepseekV3Config(**{**BASE, **MLA, "q_lora_rank": 16})),
    # Pythia's family (the size suite from 14M to 12B): blocks under gpt_neox, a parallel
    # residual, a quarter of each head rotated, LayerNorm with biases.
    "gpt_neox": (tf.GPTNeoXForCausalLM, lambda: tf.GPTNeoXConfig(**BASE, rotary_pct=0.25, use_parallel_residual=True)),
    "phi": (tf.PhiForCausalLM, lambda: tf.PhiConfig(**BASE, partial_rotary_factor=0.5)),  # phi-1, 1.5, 2: `final_layernorm`
    "falcon": (tf.FalconForCausalLM, lambda: tf.FalconConfig(**BASE)),  # 7B's layout: one key/value head, parallel attention and MLP
    "falcon_new": (tf.FalconForCausalLM, lambda: tf.FalconConfig(**{**BASE, "num_kv_heads": 2}, new_decoder_architecture=True)),  # 40B/180B's
}

# a layer whose kind differs from a neighbour's: attention type, dense among MoE, NoPE, ...
DISTINCT = {"qwen2": 1, "qwen2_moe": 1, "qwen3": 1, "qwen3_moe": 3, "gemma2": 1, "gemma3": 1, "gpt_oss": 1, "smollm3": 2,
            "cohere2": 1, "llama4": 3, "deepseek_v2": 1, "deepseek_v3": 1}


def removals(name: str) -> list[tuple[int, ...]]:
    """First, a middle and the last layer, the family's distinct layer, and two at once."""
    out = [(0,), (2,), (N - 1,)]
    if name in DISTINCT and (DISTINCT[name],) not in out:
        out.append((DISTINCT[name],))
    return [*out, (1, 3)]


def family_model(name: str, attn: str | None = None) -> torch.nn.Module:
    """The family's tiny model (`attn`: the attention implementation, else the family's default),
    its weights large enough that every layer visibly changes the output."""
    cls, make_config = FAMILIES[name]
    config = make_config()
    if attn:
        config._attn_implementation = attn
    torch.manual_seed(0)
    model = cls(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.eval()
