"""lm-eval's task index, kept on disk.

`lm_eval.tasks.TaskManager()` parses every task YAML it ships (about 14,000 files, 26,000 YAML
loads with their includes) to learn the names: 6-8 s of every process that runs an lm-eval
task, the largest part of `prune --task mmlu`'s start-up. The index is a dict of plain data
(name, kind, YAML path, the parsed config, tags), so it is saved once as JSON in the offline
cache and read back in about 0.4 s. Its key is the lm-eval version and the task folder's YAML
files (how many, their total size, the newest change), so an upgraded or edited lm-eval
builds a fresh index. Processes that start together on a fresh cache (pytest's workers, a GPU
pass's steps) take a file lock, so one builds and the others read what it saved. Anything
unexpected (another lm-eval layout, an unreadable or unwritable cache, a lock that cannot be
had) falls back to lm-eval building its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
from importlib import metadata
from pathlib import Path

from depthcurse import assets
from depthcurse.errors import DepthcurseError
from depthcurse.io import atomic_write

FOLDER = "lm-eval-task-index"
#: the fields of lm-eval's `Entry` this file stores; another set means another lm-eval: not cached
ENTRY_FIELDS = ("name", "kind", "yaml_path", "cfg", "tags")


def yaml_fingerprint(root: Path) -> str:
    """What the index is built from: the lm-eval version and the YAML files under `root` (0.1 s)."""
    count = size = newest = 0
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(".yaml"):
                st = os.stat(os.path.join(folder, name))
                count, size, newest = count + 1, size + st.st_size, max(newest, st.st_mtime_ns)
    key = f"{metadata.version('lm_eval')}|{Path(root).resolve()}|{count}|{size}|{newest}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _to_json(entry) -> dict:
    return {"name": entry.name, "kind": entry.kind.name, "yaml_path": None if entry.yaml_path is None else str(entry.yaml_path),
            "cfg": entry.cfg, "tags": sorted(entry.tags)}


def _from_json(row: dict, entry_cls, kind_cls):
    path = row["yaml_path"]
    return entry_cls(name=row["name"], kind=kind_cls[row["kind"]], yaml_path=None if path is None else Path(path),
                     cfg=row["cfg"], tags=set(row["tags"]))


def saved_task_index(root: Path) -> dict:
    """lm-eval's `TaskIndex.build([root])`, read from the cache when it was built before from
    the same files, else built and saved. Equal to a fresh build, entry for entry and in order."""
    from lm_eval.tasks._index import Entry, Kind  # lazy: lm-eval costs seconds to import

    path = assets.cache_dir() / FOLDER / f"{yaml_fingerprint(root)}.json"
    with _one_builder(path):  # processes started together (pytest's workers, a pass's steps) build it once, not each
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            return {name: _from_json(row, Entry, Kind) for name, row in json.loads(path.read_text(encoding="utf-8")).items()}
        return _build_and_save(path, root)


@contextlib.contextmanager
def _one_builder(path: Path, wait_s: float = 120.0):
    """Hold the index's lock while reading or building it; where the lock cannot be had (a
    read-only cache, a wait longer than a build) go on without it: the cost is a second build."""
    from filelock import FileLock, Timeout

    lock = None
    with contextlib.suppress(OSError, Timeout):
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(path.parent / ".lock"), timeout=wait_s)
        lock.acquire()
    try:
        yield
    finally:
        if lock is not None and lock.is_locked:
            lock.release()


def _build_and_save(path: Path, root: Path) -> dict:
    from lm_eval.tasks._index import TaskIndex

    index = TaskIndex.build([root])
    with contextlib.suppress(OSError, DepthcurseError, TypeError, ValueError):  # a cache we cannot write only costs time
        rows = {name: _to_json(e) for name, e in index.items()}
        text = json.dumps(rows)
        if json.loads(text) != rows:  # a config JSON would change (a number as a key, a NaN): not saved
            return index
        path.parent.mkdir(parents=True, exist_ok=True)
        for old in path.parent.glob("*.json"):  # the index of an lm-eval no longer installed
            old.unlink(missing_ok=True)
        atomic_write(path, text)
    return index


def task_manager_from_saved_index():
    """`lm_eval.tasks.TaskManager()` with its default index read through `saved_task_index`."""
    import lm_eval.tasks
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._index import Entry, TaskIndex

    if tuple(f.name for f in dataclasses.fields(Entry)) != ENTRY_FIELDS:
        return TaskManager()
    root = Path(lm_eval.tasks.__file__).parent
    index = saved_task_index(root)
    real = TaskIndex.__dict__["build"]

    def build(paths, **kwargs):
        paths = list(paths)
        return dict(index) if paths == [root] and not kwargs else real.__func__(paths, **kwargs)

    # TaskManager's own constructor, with its one walk over the YAML files answered from the saved index
    TaskIndex.build = staticmethod(build)
    try:
        return TaskManager()
    finally:
        TaskIndex.build = real
