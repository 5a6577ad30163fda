"""Load a pretrained model for measurement: hub id, local folder, GGUF file or offline alias.

Every command goes through `load_model`, so dtype/device policy and the error messages for a
model that cannot be had live in one place.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import transformers
from safetensors import SafetensorError

from depthcurse import assets
from depthcurse.assets import meta_llama
from depthcurse.cpu_precision import BlockShape
from depthcurse.errors import DepthcurseError, first_line, one_line
from depthcurse.patches import apply_saved_patches
from depthcurse.runtime import check_dtype, pick_device, pick_dtype
from depthcurse.train.export import register_with_transformers

Head = Literal["causal-lm", "qa", "base"]

# Encoder-only families: an LM task on them is a user error, not a crash deep in lm-eval.
ENCODER_TYPES = {"bert", "roberta", "xlm-roberta", "mpnet", "distilbert", "albert", "electra", "deberta", "deberta-v2", "modernbert"}


@dataclass
class LoadedModel:
    """A model ready for evaluation, plus what the results files record about it."""

    model: torch.nn.Module
    tokenizer: object | None
    name: str  # what the user typed
    source: str  # what it resolved to (hub id or local path)
    dtype: torch.dtype
    device: torch.device  # where the inputs go (the embedding's device under device_map)
    revision: str | None = None
    # The dtype the checkpoint stores its weights in (None: not one dtype, as a quantised GGUF):
    # what a copy saved from this model keeps, whatever dtype it was loaded in to compute.
    checkpoint_dtype: torch.dtype | None = None
    dtype_why: str = ""  # why this dtype (`runtime.Precision.why`): asked for, or what auto chose here

    @property
    def save_dtype(self) -> torch.dtype:
        """The dtype a checkpoint made from this model is saved in: the source's own."""
        return self.checkpoint_dtype or self.dtype

    def describe(self) -> dict:
        return {
            "model": self.name,
            "source": assets.portable_path(self.source),  # the hub id, or the folder (in the cache: relative to it)
            "revision": self.revision,
            "model_class": type(self.model).__name__,
            "dtype": str(self.dtype).removeprefix("torch."),
            "dtype_why": self.dtype_why,
            "device": str(self.device),
        }


def max_positions(model: torch.nn.Module) -> int | None:
    """The longest sequence the model accepts, where its config says."""
    most = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return most if isinstance(most, int) else None


def window_length(model: torch.nn.Module | None, asked: int | None, default: int = 512) -> int:
    """Tokens per window or row: `asked`, which the model must accept, or else `default`, less for
    a model with fewer positions."""
    if asked is None:
        return min(default, max_positions(model) or default)
    check_sequence_length(model, asked)
    return asked


def check_sequence_length(model: torch.nn.Module, length: int, option: str = "--seq-len") -> None:
    """Refuse sequences longer than the model has positions for: they would run for nothing, or fail deep inside."""
    most = max_positions(model)
    if most is not None and length > most:
        raise DepthcurseError(f"{option} {length} is longer than {type(model).__name__} accepts ({most} positions): use {option} {most} or less")


def _auto_class(head: Head, config, new_head: bool = False, not_encoder: str | None = None):
    if head == "qa":
        if config.model_type not in ENCODER_TYPES:
            if new_head:  # finetune-qa
                raise DepthcurseError(
                    f"a span (QA) head goes on an encoder (BERT-style); {config.model_type} is a decoder: "
                    "fine-tune an encoder instead, e.g. `depthcurse finetune-qa minilm-l6`"
                )
            raise DepthcurseError(
                f"--task squad needs an extractive QA encoder (BERT-style, fine-tuned on SQuAD); {config.model_type} is a decoder: "
                "use e.g. bert-large-uncased-whole-word-masking-finetuned-squad, or fine-tune one with `depthcurse finetune-qa minilm-l6`"
            )
        return transformers.AutoModelForQuestionAnswering
    if head == "base":
        return transformers.AutoModel
    if config.model_type in ENCODER_TYPES:
        raise DepthcurseError(
            f"{config.model_type} is an encoder without a language-model head: "
            + (not_encoder or "use an encoder task (e.g. --task squad with a QA model), or a decoder model for this task")
        )
    return transformers.AutoModelForCausalLM


def resolve_source(name: str) -> tuple[str, dict]:
    """Turn what the user typed into from_pretrained arguments: (path_or_id, extra kwargs)."""
    resolved = assets.resolve_model(name)
    path = Path(resolved).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise DepthcurseError(f"no such GGUF file: {path}")
        return str(path.parent), {"gguf_file": path.name}
    if path.exists():
        if meta_llama.is_meta_layout(path):  # Meta's original download: converted once, into the cache
            return str(meta_llama.convert(path)), {}
        if not (path / "config.json").is_file():
            raise DepthcurseError(f"{path} is not a model folder (no config.json in it)")
        return str(path), {}
    # Looks like a filesystem path, not a hub id: don't send it to the hub.
    if resolved.startswith((".", "/", "~")) or resolved.count("/") > 1 or os.sep + os.sep in resolved:
        raise DepthcurseError(f"no such model path: {resolved}")
    converted = meta_llama.converted_hub_copy(resolved)  # a hub repository in Meta's layout, converted earlier
    return (str(converted), {}) if converted else (resolved, {})


def load_model(
    name: str,
    *,
    head: Head = "causal-lm",
    dtype: str = "auto",
    device: str = "auto",
    trust_remote_code: bool = False,
    revision: str | None = None,
    tokenizer: bool = True,
    new_head: bool = False,
    gpus: list[int] | None = None,
    keep_dtype: bool = False,
    not_encoder: str | None = None,
    fp32_on_cpu: str | None = None,
) -> LoadedModel:
    """Load `name` (hub id, local folder, .gguf file or offline alias) in eval mode.

    On CUDA the model goes through `device_map="auto"`, so a model larger than one GPU is
    spread over all visible GPUs by accelerate, or over `gpus` only (one rank's share of a
    node under torchrun).

    A head the checkpoint lacks would be initialised randomly by transformers, which makes the
    measurement meaningless: that is refused unless `new_head` (for fine-tuning one). So is a
    checkpoint missing any other weight, or holding weights the model has no place for.

    `dtype="auto"` is `runtime.pick_dtype`'s choice (on a CPU: a bf16 checkpoint in bf16 where the
    CPU computes it natively, fp32 otherwise); `keep_dtype` makes it the checkpoint's dtype on a CPU
    too (`drop` saves what it loaded); `fp32_on_cpu` (why, "as ...") keeps fp32 on a CPU.
    `not_encoder` is what to advise when a decoder is needed and `name` is an encoder (a command
    that takes no encoder task says what it does take).
    """
    # Checkpoints exported by `lns-train` (Post-LN, Mix-LN, ...) use depthcurse's own model
    # class: registering it is what lets them load without trust_remote_code.
    register_with_transformers()
    dev = pick_device(device)
    check_dtype(dtype)  # before anything loads; what auto means waits for the checkpoint's stored dtype
    source, kwargs = resolve_source(name)
    local = Path(source).exists()
    if revision is not None and local:
        raise DepthcurseError(f"--revision {revision} picks a version on the hub, but {name} is loaded from {source}, which has one: leave --revision out")
    offline = not local and not assets.hub_reachable()
    common = dict(trust_remote_code=trust_remote_code, revision=revision, local_files_only=offline, **kwargs)

    try:
        with _damaged_files_named(source, kwargs):
            config = transformers.AutoConfig.from_pretrained(source, **common)
    except (OSError, ValueError) as exc:
        # A hub repository without config.json may hold Meta's original layout (meta-llama/Llama-2-7b).
        converted = None if local or offline else meta_llama.from_hub(source, revision)
        if converted is None:
            raise DepthcurseError(_explain_load_failure(name, source, offline, exc)) from exc
        source, local = str(converted), True
        common = dict(common, revision=None, local_files_only=False)
        config = transformers.AutoConfig.from_pretrained(source, **common)

    stored = _stored_dtype(config)
    precision = pick_dtype(dtype, dev, keep_checkpoint=keep_dtype, stored=stored, fp32_on_cpu=fp32_on_cpu, shape=BlockShape.of_config(config))
    auto_cls = _auto_class(head, config, new_head, not_encoder)
    load_kwargs = dict(common, dtype=precision.dtype)
    if dev == "cuda":
        load_kwargs["device_map"] = "auto"
        if gpus is not None:
            load_kwargs["max_memory"] = {i: torch.cuda.mem_get_info(i)[0] for i in gpus}
    try:
        with _damaged_files_named(source, kwargs):
            model, info = auto_cls.from_pretrained(source, output_loading_info=True, **load_kwargs)
    except ValueError as exc:
        if "Unrecognized configuration class" in str(exc):
            raise DepthcurseError(
                f"{type(config).__name__} ({config.model_type}) has no {head} model class in transformers: "
                "unsupported architecture for this task"
            ) from exc
        raise DepthcurseError(_explain_load_failure(name, source, offline, exc)) from exc
    except OSError as exc:
        raise DepthcurseError(_explain_load_failure(name, source, offline, exc)) from exc
    _refuse_incomplete(name, source, model, info, head, new_head)
    if dev == "cpu":
        model.to("cpu")
    model.eval()
    if local and not kwargs:
        apply_saved_patches(model, Path(source))  # a LinearPatch checkpoint's patches, which no stock weight holds

    tok = None
    if tokenizer:
        if local and not kwargs and not any((Path(source) / f).is_file() for f in TOKENIZER_FILES):
            raise DepthcurseError(f"{source} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): "
                                  "copy the tokenizer files of the model it came from into it")
        try:
            tok = transformers.AutoTokenizer.from_pretrained(source, **common)
        except (OSError, ValueError) as exc:
            raise DepthcurseError(f"cannot load the tokenizer of {name}: {' '.join(str(exc).split())}") from exc

    input_device = model.get_input_embeddings().weight.device
    revision_seen = revision or getattr(config, "_commit_hash", None)
    return LoadedModel(
        model=model,
        tokenizer=tok,
        name=name,
        source=source if not kwargs else str(Path(source) / kwargs["gguf_file"]),
        dtype=next(model.parameters()).dtype,
        device=input_device,
        revision=revision_seen,
        checkpoint_dtype=stored,
        dtype_why=precision.why,
    )


def _stored_dtype(config) -> torch.dtype | None:
    """The dtype the config says the weights are stored in (`dtype`, `torch_dtype` before
    transformers 5), read before loading, which overwrites it with the dtype loaded in."""
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value.removeprefix("torch."), None)
    return value if isinstance(value, torch.dtype) and value.is_floating_point else None


@contextlib.contextmanager
def _damaged_files_named(source: str, kwargs: dict):
    """A truncated or corrupt weights file fails deep in a reader with a message about bytes and
    shapes; say which file it is and what is wrong with it instead."""
    try:
        yield
    except DepthcurseError:
        raise
    except SafetensorError as exc:
        files = sorted(Path(source).glob("*.safetensors")) if Path(source).is_dir() else []
        where = ", ".join(str(f) for f in files[:3]) if files else f"the safetensors weights of {source}"
        raise DepthcurseError(f"{where} is corrupt or incomplete (a truncated download or copy?): {first_line(exc)}") from exc
    except Exception as exc:
        if "gguf_file" not in kwargs:
            raise
        path = Path(source) / kwargs["gguf_file"]
        raise DepthcurseError(f"{path} is not a readable GGUF file: it looks truncated or corrupt ({one_line(exc)})") from exc


# What a folder's tokenizer is read from, by one tokenizer class or another.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")

# Parts of a bare encoder that no measurement here runs (repr mean-pools the stream, angular reads
# it): a checkpoint saved with a task head has no pooler, and its random one changes nothing.
UNUSED_BASE_MODULES = ("pooler.",)


def _refuse_incomplete(name: str, source: str, model, info: dict, head: Head, new_head: bool) -> None:
    """Refuse a model whose checkpoint does not hold every weight it runs: transformers draws a
    missing one at random (a layer missing from the file would be measured as free to remove), and
    a weight the model has no place for (a layer beyond its config, a misnamed tensor) means the
    file and the config disagree. Weights of another task's head (an `lm_head` when the base model
    is asked for, a QA checkpoint's `qa_outputs`) are not the model's and are left out quietly.
    The QA head itself may be missing with `new_head` (finetune-qa puts one on)."""
    prefix = getattr(model, "base_model_prefix", "") + "."
    missing = sorted(info.get("missing_keys", ()))
    if head == "base":
        missing = [k for k in missing if not k.startswith(UNUSED_BASE_MODULES)]
    head_missing = [k for k in missing if head == "qa" and not k.startswith(prefix)]
    if head_missing and not new_head:
        raise DepthcurseError(
            f"{name} has no trained question-answering head ({_keys_text(head_missing)} missing from the checkpoint, so it would be random): "
            f"fine-tune one with `depthcurse finetune-qa {name}`, or use a SQuAD-fine-tuned model"
        )
    missing = [k for k in missing if k not in head_missing]
    if missing:
        raise DepthcurseError(f"{source} lacks weights the model needs: {_keys_text(missing)} {'is' if len(missing) == 1 else 'are'} missing from the checkpoint "
                              "(transformers would fill them at random); use a complete checkpoint")
    own = {child for child, _ in model.named_children()}
    unexpected = sorted(k for k in info.get("unexpected_keys", ()) if k.startswith(prefix) or k.partition(".")[0] in own)
    if unexpected:
        raise DepthcurseError(f"{source} holds weights the model has no place for: {_keys_text(unexpected)} "
                              "(its config and its weights disagree: a layer count or a name that was edited?)")


def _keys_text(keys: list[str], shown: int = 3) -> str:
    """Checkpoint keys in a few words: the tensors of a module with a layer index together
    (`model.layers.1.* (9 tensors)`), a lone one by its full name, the first `shown` of them, and
    how many more."""
    groups: dict[str, list[str]] = {}
    for key in keys:
        parts = key.split(".")
        cut = next((i + 1 for i, part in enumerate(parts) if part.isdigit()), None)
        groups.setdefault(".".join(parts[:cut]) + ".*" if cut is not None and cut < len(parts) else key, []).append(key)
    items = [f"{g} ({len(members)} tensors)" if len(members) > 1 else members[0] for g, members in groups.items()]
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more


def _explain_load_failure(name: str, source: str, offline: bool, exc: BaseException) -> str:
    if offline:
        return (
            f"cannot load {name!r}: the model hub is not reachable and it is not in the local cache "
            "(offline aliases: see `depthcurse assets`)"
        )
    msg = first_line(exc)
    if "does not appear to have a file named" in msg or "is not a local folder and is not a valid model identifier" in msg:
        return f"unknown model {name!r}: not a local folder and not a model on the hub"
    return f"cannot load {name!r}: {msg}"
