"""A trained model as a Hugging Face checkpoint that `prune` and `angular-distance` load.

Two forms: `hf/`, our own model class registered with transformers (any normalisation), and
`hf-llama/`, a stock LlamaForCausalLM for the variants that are plain Pre-LN at inference (LNS
folds into the norm gains). Both are built from one mapping of our config fields to Hugging
Face's names (`HF_NAMES`), read in both directions.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from depthcurse.errors import DepthcurseError
from depthcurse.train.model import STOCK_LLAMA_NORMS, Block, Body, DyT, ModelConfig, RMSNorm, Transformer

MODEL_TYPE = "depthcurse_llama"

# ModelConfig field -> its name in a Hugging Face config. The first eight are LlamaConfig's too.
HF_NAMES = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "max_seq_len": "max_position_embeddings",
    "norm_eps": "rms_norm_eps",
    "init_std": "initializer_range",
    "rope_theta": "rope_theta",
    "norm": "norm",
    "mix_ratio": "mix_ratio",
    "layer_origins": "layer_origins",
    "trained_layers": "trained_layers",
    "dyt_alpha_attn": "dyt_alpha_attn",
    "dyt_alpha_ffn": "dyt_alpha_ffn",
    "dyt_alpha_final": "dyt_alpha_final",
    "base_layers": "base_layers",
    "init": "init_rule",
}
LLAMA_SHARED = tuple(HF_NAMES)[:8]

_HF = None


def _hf_classes():
    """The transformers classes for our variants, defined and registered on first use so that
    importing this module does not import transformers' model code."""
    global _HF
    if _HF is not None:
        return _HF
    # lazy: transformers' model machinery costs seconds to import, and only loading or exporting needs it
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel
    from transformers.modeling_outputs import CausalLMOutputWithPast

    class DepthcurseLlamaConfig(PretrainedConfig):
        model_type = MODEL_TYPE

        def __init__(self, **kwargs):
            # Defaults and checks are ModelConfig's; the attributes carry Hugging Face's names.
            ours = ModelConfig(**{field: kwargs.pop(hf) for field, hf in HF_NAMES.items() if hf in kwargs})
            for field, value in asdict(ours).items():
                setattr(self, HF_NAMES[field], value)
            kwargs.setdefault("tie_word_embeddings", False)
            super().__init__(**kwargs)

        def model_config(self) -> ModelConfig:
            return ModelConfig(**{field: getattr(self, hf) for field, hf in HF_NAMES.items()})

    class DepthcurseLlamaForCausalLM(PreTrainedModel, GenerationMixin):
        config_class = DepthcurseLlamaConfig
        base_model_prefix = "model"
        _no_split_modules = ["Block"]
        _supports_sdpa = True

        def __init__(self, config):
            super().__init__(config)
            cfg = config.model_config()
            self.model = Body(cfg)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            self.post_init()

        def _init_weights(self, module):
            # Real weights always come from a checkpoint; this only fills fresh tensors sanely.
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, DyT):
                nn.init.ones_(module.weight)
                nn.init.constant_(module.alpha, module.alpha0)
            elif isinstance(module, Block) and module.spec.branch_scale == "layerscale":
                nn.init.constant_(module.attn_scale, module.spec.layerscale_init)
                nn.init.constant_(module.mlp_scale, module.spec.layerscale_init)

        def get_input_embeddings(self):
            return self.model.embed_tokens

        def set_input_embeddings(self, value):
            self.model.embed_tokens = value

        def get_output_embeddings(self):
            return self.lm_head

        def forward(self, input_ids=None, attention_mask=None, labels=None, **_ignored):
            logits = self.lm_head(self.model(input_ids, attention_mask))
            loss = None
            if labels is not None:
                loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1), ignore_index=-100)
            return CausalLMOutputWithPast(loss=loss, logits=logits)

    AutoConfig.register(MODEL_TYPE, DepthcurseLlamaConfig, exist_ok=True)
    AutoModelForCausalLM.register(DepthcurseLlamaConfig, DepthcurseLlamaForCausalLM, exist_ok=True)
    # `angular-distance` asks for a bare model; ours hands its Body over as `base_model`.
    AutoModel.register(DepthcurseLlamaConfig, DepthcurseLlamaForCausalLM, exist_ok=True)
    _HF = (DepthcurseLlamaConfig, DepthcurseLlamaForCausalLM)
    return _HF


def register_with_transformers() -> None:
    """Make `from_pretrained` (and so `depthcurse.loading.load_model`) know our model type."""
    _hf_classes()


def _special_ids(tokenizer) -> dict:
    if tokenizer is None:
        return {}
    return {k: getattr(tokenizer, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}


def hf_config(cfg: ModelConfig, tokenizer=None):
    Config, _ = _hf_classes()
    return Config(**{hf: getattr(cfg, field) for field, hf in HF_NAMES.items()}, **_special_ids(tokenizer))


def to_hf(model: Transformer, tokenizer=None):
    """Our model as a DepthcurseLlamaForCausalLM (any norm), sharing no storage with `model`."""
    _, CausalLM = _hf_classes()
    hf = CausalLM(hf_config(model.cfg, tokenizer))
    hf.load_state_dict(model.state_dict())
    return hf.eval()


def to_stock_llama(model: Transformer, tokenizer=None):
    """A Pre-LN-family model as a stock LlamaForCausalLM; LNS factors are folded into the norm
    gains (gain/sqrt(l)) and CompleteP's branch multipliers into the output projections, which is
    exact at inference."""
    from transformers import LlamaConfig, LlamaForCausalLM  # lazy: see _hf_classes

    cfg = model.cfg
    if cfg.norm not in STOCK_LLAMA_NORMS:
        raise DepthcurseError(f"norm {cfg.norm!r} has no stock Llama equivalent (only {', '.join(STOCK_LLAMA_NORMS)})")
    config = LlamaConfig(
        **{HF_NAMES[field]: getattr(cfg, field) for field in LLAMA_SHARED},
        num_key_value_heads=cfg.num_heads, rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False, **_special_ids(tokenizer),
    )
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for i, block in enumerate(model.model.layers):
        for name in ("input_layernorm", "post_attention_layernorm"):
            norm = getattr(block, name)
            state[f"model.layers.{i}.{name}.weight"] = norm.weight.detach() * norm.scale
        c = block.spec.branch_multiplier  # CompleteP's L0/L on each branch: folded into the projection that ends it
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            state[f"model.layers.{i}.{name}.weight"] = model.get_submodule(f"model.layers.{i}.{name}").weight.detach() * c
    llama = LlamaForCausalLM(config)
    llama.load_state_dict(state)
    return llama.eval()


def export(model: Transformer, out_dir, tokenizer=None, *, stock: bool = False) -> Path:
    """Save as a Hugging Face checkpoint folder (safetensors + tokenizer) that `load_model`,
    `depthcurse prune` and `angular-distance` load: our own class, or a stock Llama."""
    out_dir = Path(out_dir)
    hf = to_stock_llama(model, tokenizer) if stock else to_hf(model, tokenizer)
    hf.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir


def export_run(model_state: dict, model_cfg: ModelConfig, tokenizer, out_dir: Path) -> dict:
    """hf/ (our class, any norm) and, for Pre-LN-family variants, hf-llama/ (stock Llama), from
    the gathered state: a plain fp32 CPU model, whatever wrapper, device and precision trained it."""
    with torch.device("meta"):  # no initialisation to throw away: the weights come from the state
        model = Transformer(model_cfg)
    # Safe on meta: the LNS factors are plain floats of the modules, not tensors the state replaces.
    model.load_state_dict({k: v.float() for k, v in model_state.items()}, assign=True)
    exports = {"hf": str(export(model, out_dir / "hf", tokenizer))}
    if model.cfg.norm in STOCK_LLAMA_NORMS:
        exports["hf-llama"] = str(export(model, out_dir / "hf-llama", tokenizer, stock=True))
    return exports
