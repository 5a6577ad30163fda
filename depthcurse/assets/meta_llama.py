"""Meta's original Llama layout (`params.json`, `consolidated.NN.pth`, `tokenizer.model`) as a
transformers checkpoint in the cache, converted once.

`meta-llama/Llama-2-7b` on the hub (and every Llama 1/2/3 download from Meta) holds this
layout, not a transformers one. The conversion is the one transformers has long shipped as
`convert_llama_weights_to_hf.py` (no longer in its wheel): shards joined along the dimension
each was split on, the query and key projections permuted from Meta's interleaved rotary pairs
to transformers' half-split ones, the tokenizer built from `tokenizer.model` (SentencePiece for
Llama 1/2, tiktoken for Llama 3). Weights are read with `weights_only=True`, written as
safetensors. The converted folder needs as much memory as the weights to build.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from depthcurse.assets.cache import build_entry, cache_dir, is_built
from depthcurse.errors import DepthcurseError, first_line

PARAMS = "params.json"
SHARD_PATTERN = "consolidated.*.pth"
TOKENIZER = "tokenizer.model"

# Meta's model-parallel split of each weight: output rows (column-parallel) or input columns (row-parallel).
_ROWS = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3", "output")
_COLUMNS = ("attention.wo", "feed_forward.w2")
_HF_NAMES = {
    "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj", "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj", "feed_forward.w1": "mlp.gate_proj", "feed_forward.w2": "mlp.down_proj",
    "feed_forward.w3": "mlp.up_proj", "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
# Llama 3's tokenizer.model is tiktoken's (base64 token, rank per line), with 256 special tokens after it.
_LLAMA3_SPECIAL = {
    "3": ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
          "<|reserved_special_token_2|>", "<|reserved_special_token_3|>", "<|start_header_id|>", "<|end_header_id|>",
          "<|reserved_special_token_4|>", "<|eot_id|>"] + [f"<|reserved_special_token_{i}|>" for i in range(5, 251)],
    "3.1": ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
            "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"] + [f"<|reserved_special_token_{i}|>" for i in range(3, 248)],
}
_LLAMA3_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def is_meta_layout(folder: Path) -> bool:
    """A folder of Meta's original checkpoint: params.json and consolidated shards, no config.json."""
    folder = Path(folder)
    return folder.is_dir() and (folder / PARAMS).is_file() and not (folder / "config.json").is_file()


def converted_path(name: str) -> Path:
    """Where the conversion of `name` (a hub id, or a folder's resolved path) lives in the cache."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "--", name.strip("/"))[-80:]
    return cache_dir() / "models" / "meta" / f"{slug}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def converted_hub_copy(repo: str) -> Path | None:
    """The conversion of hub repository `repo` made earlier (so that it loads offline), or None."""
    dest = converted_path(repo)
    return dest if is_built(dest) else None


def from_hub(repo: str, revision: str | None = None) -> Path | None:
    """The converted checkpoint of a hub repository in Meta's layout (downloaded and converted
    on first use), or None when the repository does not hold that layout."""
    import huggingface_hub  # lazy: only a hub repository without config.json gets here

    try:
        if not huggingface_hub.file_exists(repo, PARAMS, revision=revision):
            return None
        folder = huggingface_hub.snapshot_download(repo, revision=revision, allow_patterns=[PARAMS, SHARD_PATTERN, TOKENIZER])
    except Exception as exc:  # gated, missing, or the network went away: the caller's own message says which model
        raise DepthcurseError(f"cannot download {repo} (Meta's original layout): {first_line(exc)}") from exc
    return convert(Path(folder), name=repo)


def _fingerprint(folder: Path) -> list:
    return [[p.name, p.stat().st_size, int(p.stat().st_mtime)] for p in sorted(folder.iterdir()) if p.is_file()]


def convert(folder: Path, name: str | None = None) -> Path:
    """The transformers checkpoint made from the Meta-layout `folder` (built on first use; rebuilt
    when the folder's files change). `name`: what the cache entry is keyed by (default: the path)."""
    folder = Path(folder).expanduser().resolve()
    dest = converted_path(name or str(folder))
    stamp = _fingerprint(folder)
    meta_file = dest / "depthcurse_asset.json"
    force = meta_file.is_file() and json.loads(meta_file.read_text()).get("source", {}).get("files") != stamp
    return build_entry(dest, lambda out: _convert(folder, out, stamp), force=force)


def _read_params(folder: Path) -> dict:
    try:
        params = json.loads((folder / PARAMS).read_text())
    except (OSError, ValueError) as exc:
        raise DepthcurseError(f"{folder / PARAMS} is not a readable params.json: {first_line(exc)}") from exc
    params = params.get("model", params)
    missing = [k for k in ("dim", "n_layers", "n_heads") if not isinstance(params.get(k), int)]
    if missing:
        raise DepthcurseError(f"{folder / PARAMS} lacks {', '.join(missing)}: not a Meta Llama checkpoint")
    return params


def _load_shards(folder: Path) -> list[dict]:
    import torch  # lazy: `depthcurse assets` and --help load no torch

    files = sorted(folder.glob(SHARD_PATTERN))
    if not files:
        raise DepthcurseError(f"{folder} has {PARAMS} but no {SHARD_PATTERN} weights")
    shards = []
    for f in files:
        try:  # weights_only: a checkpoint file is data, never code to run
            shards.append(torch.load(f, map_location="cpu", weights_only=True, mmap=True))
        except Exception as exc:
            raise DepthcurseError(f"{f} is not a readable PyTorch checkpoint (truncated or corrupt?): {first_line(exc)}") from exc
        if not isinstance(shards[-1], dict):
            raise DepthcurseError(f"{f} holds a {type(shards[-1]).__name__}, not a state dict of weights")
    return shards


def _joined(shards: list[dict], key: str, dim: int, folder: Path):
    import torch  # lazy: as above

    try:
        parts = [s[key] for s in shards]
    except KeyError:
        raise DepthcurseError(f"the weights in {folder} have no {key}: not a Meta Llama checkpoint, or an incomplete one") from None
    return parts[0] if len(parts) == 1 or dim is None else torch.cat(parts, dim=dim)


def _tokenizer_kind(path: Path) -> str:
    head = path.read_bytes()[:64]
    return "tiktoken" if re.match(rb"^[A-Za-z0-9+/=]+ \d+\n", head) else "sentencepiece"


def _convert(folder: Path, out: Path, stamp: list) -> dict:
    import torch  # lazy: as above
    import transformers
    from huggingface_hub import save_torch_state_dict

    params = _read_params(folder)
    if not (folder / TOKENIZER).is_file():
        raise DepthcurseError(f"{folder} has no {TOKENIZER}: the tokenizer of a Meta checkpoint comes from it")
    tokenizer_kind = _tokenizer_kind(folder / TOKENIZER)
    shards = _load_shards(folder)
    dim, n_layers, n_heads = params["dim"], params["n_layers"], params["n_heads"]
    n_kv = params.get("n_kv_heads") or n_heads
    head_dim = dim // n_heads

    def permute(w, heads):  # Meta rotates interleaved pairs (x0, x1), transformers the two halves of a head
        return w.view(heads, head_dim // 2, 2, w.shape[1]).transpose(1, 2).reshape(w.shape)

    # The embedding is split over its columns in Llama 1/2 (ParallelEmbedding), over the vocabulary in Llama 3.
    emb = _joined(shards[:1], "tok_embeddings.weight", None, folder)
    state = {"model.embed_tokens.weight": _joined(shards, "tok_embeddings.weight", 1 if emb.shape[1] != dim else 0, folder),
             "model.norm.weight": _joined(shards, "norm.weight", None, folder),
             "lm_head.weight": _joined(shards, "output.weight", 0, folder)}
    for i in range(n_layers):
        for meta, hf in _HF_NAMES.items():
            split = 0 if meta in _ROWS else 1 if meta in _COLUMNS else None
            w = _joined(shards, f"layers.{i}.{meta}.weight", split, folder)
            if meta == "attention.wq":
                w = permute(w, n_heads)
            elif meta == "attention.wk":
                w = permute(w, n_kv)
            state[f"model.layers.{i}.{hf}.weight"] = w.contiguous()
    vocab = state["model.embed_tokens.weight"].shape[0]
    llama3 = tokenizer_kind == "tiktoken"
    version = "3.1" if params.get("use_scaled_rope") else "3" if llama3 else "2" if params.get("norm_eps", 1e-5) >= 1e-5 else "1"
    rope = {"rope_type": "default", "rope_theta": float(params.get("rope_theta", 10000.0))}
    if params.get("use_scaled_rope"):  # Llama 3.1's long-context rotary frequencies
        rope.update(rope_type="llama3", factor=float(params.get("rope_scaling_factor", 8.0)), low_freq_factor=1.0,
                    high_freq_factor=4.0, original_max_position_embeddings=8192)
    dtype = state["model.embed_tokens.weight"].dtype
    config = transformers.LlamaConfig(
        hidden_size=dim, intermediate_size=state["model.layers.0.mlp.gate_proj.weight"].shape[0], num_hidden_layers=n_layers,
        num_attention_heads=n_heads, num_key_value_heads=n_kv, rms_norm_eps=float(params.get("norm_eps", 1e-5)), vocab_size=vocab,
        max_position_embeddings=int(params.get("max_seq_len") or {"1": 2048, "2": 4096, "3": 8192, "3.1": 131072}[version]),
        rope_parameters=rope, bos_token_id=128000 if llama3 else 1, eos_token_id=128001 if llama3 else 2, tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"], dtype=str(dtype).removeprefix("torch."),
    )
    config.save_pretrained(out)
    save_torch_state_dict(state, out, max_shard_size="5GB")
    del state, shards
    _write_tokenizer(folder / TOKENIZER, out, version, config.max_position_embeddings)
    return {"name": str(folder), "kind": "model", "source": {"meta_folder": str(folder), "files": stamp},
            "notes": f"Meta's original layout converted to LlamaForCausalLM (Llama {version}, {torch.finfo(dtype).bits}-bit weights)"}


def _write_tokenizer(model_file: Path, out: Path, version: str, max_length: int) -> None:
    import transformers  # lazy: as above

    try:
        if version.startswith("3"):
            from tokenizers import processors
            from transformers.convert_slow_tokenizer import TikTokenConverter

            special = _LLAMA3_SPECIAL[version]
            backend = TikTokenConverter(str(model_file), pattern=_LLAMA3_PATTERN, extra_special_tokens=special).converted()
            bos = special[0]
            backend.post_processor = processors.Sequence([
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                                              special_tokens=[(bos, backend.token_to_id(bos))]),
            ])
            tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=special[1], model_max_length=max_length)
        else:
            tok = transformers.LlamaTokenizer.from_pretrained(str(model_file.parent), add_bos_token=True, model_max_length=max_length)
    except Exception as exc:
        raise DepthcurseError(f"cannot build a tokenizer from {model_file}: {first_line(exc)}") from exc
    tok.save_pretrained(out)
