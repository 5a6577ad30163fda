"""lm-eval's task index read from the cache equals the one lm-eval builds, and is rebuilt when
its YAML files change."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("lm_eval")
from lm_eval.tasks._index import TaskIndex  # noqa: E402

from depthcurse.tasks import task_index  # noqa: E402

TASKS = {
    "_base_yaml": "dataset_path: some/set\noutput_type: multiple_choice\ndoc_to_text: '{{question}}'\nmetadata:\n  version: 1.0\n",
    "a/t1.yaml": "include: ../_base_yaml\ntask: t1\ntag: [tg, other]\nnum_fewshot: 5\n",
    "a/t2.yaml": "include: ../_base_yaml\ntask: t2\ntag: tg\ndoc_to_choice: !function utils.choices\nfewshot_config:\n  sampler: first_n\n",
    "g.yaml": "group: g\ntask: [t1, t2]\naggregate_metric_list:\n  - metric: acc\n    weight_by_size: true\n",
    "notes.yaml": "just: a file that is no task\n",
}


@pytest.fixture
def yaml_root(tmp_path, monkeypatch):
    monkeypatch.setenv("DEPTHCURSE_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "tasks"
    for name, text in TASKS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def saved_files(tmp_path):
    return sorted((tmp_path / "cache" / task_index.FOLDER).glob("*.json"))


def test_the_saved_index_equals_lm_evals_and_is_read_back(yaml_root, tmp_path, monkeypatch):
    built = TaskIndex.build([yaml_root])
    assert set(built) == {"t1", "t2", "g", "tg", "other"}  # the fixture covers tasks, a group, tags
    first = task_index.saved_task_index(yaml_root)
    assert first == built and list(first) == list(built)
    assert len(saved_files(tmp_path)) == 1

    monkeypatch.setattr(TaskIndex, "build", staticmethod(lambda *a, **k: pytest.fail("rebuilt, not read back")))
    again = task_index.saved_task_index(yaml_root)
    assert again == built and list(again) == list(built)
    assert again["t2"].cfg["doc_to_choice"] == built["t2"].cfg["doc_to_choice"]  # !function kept as lm-eval leaves it
    assert again["tg"].tags == {"t1", "t2"} and again["t1"].yaml_path == built["t1"].yaml_path


def test_an_edited_yaml_or_a_broken_cache_builds_afresh(yaml_root, tmp_path):
    task_index.saved_task_index(yaml_root)
    before = saved_files(tmp_path)

    t1 = yaml_root / "a" / "t1.yaml"
    t1.write_text(TASKS["a/t1.yaml"].replace("num_fewshot: 5", "num_fewshot: 3"))
    os.utime(t1, ns=(t1.stat().st_mtime_ns + 10**9,) * 2)
    edited = task_index.saved_task_index(yaml_root)
    assert edited["t1"].cfg["num_fewshot"] == 3
    after = saved_files(tmp_path)
    assert len(after) == 1 and after != before  # the stale index is replaced, not kept beside it

    after[0].write_text('{"t1": {"name": "t1"')  # cut off mid-write by something other than us
    assert task_index.saved_task_index(yaml_root) == TaskIndex.build([yaml_root])
    assert task_index.saved_task_index(yaml_root)["t1"].cfg["num_fewshot"] == 3


@pytest.mark.parametrize("odd", ["generation_kwargs:\n  1: one\n", "released: 2024-01-02\n"], ids=["number-as-key", "date"])
def test_a_config_json_would_change_or_cannot_hold_is_not_saved(yaml_root, tmp_path, odd):
    (yaml_root / "odd.yaml").write_text("task: odd\n" + odd)
    assert task_index.saved_task_index(yaml_root) == TaskIndex.build([yaml_root])
    assert saved_files(tmp_path) == []


def test_an_unwritable_cache_only_costs_time(yaml_root, tmp_path, monkeypatch):
    blocker = tmp_path / "file-not-folder"
    blocker.write_text("")
    monkeypatch.setenv("DEPTHCURSE_CACHE", str(blocker))
    assert task_index.saved_task_index(yaml_root) == TaskIndex.build([yaml_root])


def test_lm_evals_task_manager_from_the_saved_index(tmp_path, monkeypatch):
    """The real index (about 14,000 YAML files): built once into an empty cache, then the task
    manager made from the saved copy knows every name, kind and file lm-eval's own does."""
    import lm_eval.tasks

    monkeypatch.setenv("DEPTHCURSE_CACHE", str(tmp_path))
    lm_evals_build = TaskIndex.__dict__["build"]
    built = task_index.saved_task_index(task_index.Path(lm_eval.tasks.__file__).parent)
    manager = task_index.task_manager_from_saved_index()
    assert manager.task_index == built and list(manager.task_index) == list(built)
    assert "mmlu" in manager.all_groups and "mmlu_anatomy" in manager.all_subtasks and "ai2_arc" in manager.all_tags
    assert TaskIndex.__dict__["build"] is lm_evals_build  # lm-eval's own build is back for anyone else


BUILD_COUNTED = """
import sys, time
from pathlib import Path
from lm_eval.tasks._index import TaskIndex
from depthcurse.tasks import task_index
real = TaskIndex.build
def counted(paths, **kw):
    with open(sys.argv[2], "a") as f:
        f.write("built\\n")
    time.sleep(1.5)  # a build long enough for the other process to arrive while it runs
    return real(paths, **kw)
TaskIndex.build = staticmethod(counted)
print(sorted(task_index.saved_task_index(Path(sys.argv[1]))))
"""


def test_processes_started_together_build_the_index_once(yaml_root, tmp_path):
    """pytest's workers, or a GPU pass's planner and its mmlu step, start on a fresh cache at once:
    one builds while the other waits and reads what it saved (each building cost 7-8 s, 20-50 s on
    a loaded machine, and timed the mmlu step out in CI)."""
    builds = tmp_path / "builds.txt"
    env = {**os.environ, "DEPTHCURSE_CACHE": str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, "-c", BUILD_COUNTED, str(yaml_root), str(builds)], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs[0] == outs[1] and "t1" in outs[0]
    assert builds.read_text().splitlines() == ["built"]
    assert len(saved_files(tmp_path)) == 1
