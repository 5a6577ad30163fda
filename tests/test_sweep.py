import csv
import json

import pytest

from helpers import CORPUS, tiny_llama
from depthcurse.errors import DepthcurseError
from depthcurse.io import ensure_out_dir
from depthcurse.loading import LoadedModel
from depthcurse.prune import kept_for_rerun, plot_prune, run_sweep
from depthcurse.surgery import removed_layers
from depthcurse.tasks import PerplexityTask


class Counting:
    """Wraps a real task, counts evaluations and can simulate Ctrl-C on the k-th call."""

    def __init__(self, task, interrupt_at=None):
        self.task, self.calls, self.interrupt_at = task, 0, interrupt_at
        self.name, self.metric, self.higher_is_better = task.name, task.metric, task.higher_is_better

    def describe(self):
        return self.task.describe()

    def evaluate(self, model):
        self.calls += 1
        if self.calls == self.interrupt_at:
            raise KeyboardInterrupt
        return self.task.evaluate(model)


@pytest.fixture()
def setup(tiny_tokenizer):
    import torch

    model = tiny_llama(len(tiny_tokenizer), layers=4)
    loaded = LoadedModel(model=model, tokenizer=tiny_tokenizer, name="tiny", source="tiny", dtype=torch.float32, device=torch.device("cpu"))
    task = PerplexityTask(tiny_tokenizer, CORPUS * 4, source="corpus", seq_len=16, limit=4, batch_size=2)
    return loaded, task


@pytest.mark.parametrize("granularity, unit", [("layer", "layer"), ("attn", "attention branch"), ("mlp", "MLP branch")])
def test_prune_csv_and_json_name_the_unit_removed(setup, tmp_path, granularity, unit):
    loaded, task = setup
    run_sweep(loaded, task, [0, 2], tmp_path, granularity=granularity)
    rows = list(csv.DictReader(open(tmp_path / "prune.csv")))
    assert [(r["unit"], r["removed"]) for r in rows] == [(unit, "none"), (unit, "0"), (unit, "2")]
    assert json.loads((tmp_path / "prune.json").read_text())["unit"] == unit


def test_sweep_writes_one_row_per_variant_with_drops(setup, tmp_path):
    loaded, task = setup
    sweep = run_sweep(loaded, task, [0, 1, 2, 3], tmp_path)
    rows = list(csv.DictReader(open(tmp_path / "prune.csv")))
    assert [r["removed"] for r in rows] == ["none", "0", "1", "2", "3"]
    assert set(rows[0]) >= {"removed", "loss", "ppl", "drop", "rel_drop", "examples", "seconds"}
    base = task.evaluate(loaded.model).metrics["loss"]
    assert float(rows[0]["loss"]) == pytest.approx(base, rel=1e-5)
    with removed_layers(loaded.model, [2]):
        without_2 = task.evaluate(loaded.model).metrics["loss"]
    assert float(rows[3]["loss"]) == pytest.approx(without_2, rel=1e-5)
    assert float(rows[3]["drop"]) == pytest.approx(without_2 - base, rel=1e-4, abs=1e-6)
    data = json.loads((tmp_path / "prune.json").read_text())
    assert data["run"]["model"] == "tiny" and data["run"]["task"] == "ppl" and data["metric"] == "loss"
    assert data["environment"]["packages"]["torch"] and data["wall_time_s"] > 0
    assert len(data["variants"]) == 5
    plot_prune(sweep, tmp_path / "prune.png")
    assert (tmp_path / "prune.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the figure says what each point rests on
    assert sweep.data_text() == f"{task.describe()['windows']} windows x {task.seq_len} tokens of {task.source}"
    assert {r["unit"] for r in rows} == {"layer"} and {r["data"] for r in rows} == {sweep.data_text()}
    assert data["unit"] == "layer" and data["complete"] is True and data["asked"] == [[], [0], [1], [2], [3]]


def test_interrupted_sweep_keeps_finished_variants_and_resumes(setup, tmp_path):
    loaded, task = setup
    first = Counting(task, interrupt_at=3)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(loaded, first, [0, 1, 2, 3], tmp_path)
    kept = json.loads((tmp_path / "prune.json").read_text())["variants"]
    assert [v["removed"] for v in kept] == [[], [0]]
    assert kept_for_rerun(tmp_path) == (2, 0)  # what the interrupted command says it kept
    second = Counting(task)
    sweep = run_sweep(loaded, second, [0, 1, 2, 3], tmp_path)
    assert second.calls == 3  # layers 1, 2, 3 only: nothing finished is recomputed
    assert [v.label for v in sweep.variants] == ["none", "0", "1", "2", "3"]
    third = Counting(task)
    run_sweep(loaded, third, [0, 1, 2, 3], tmp_path)
    assert third.calls == 0


def test_an_interrupted_queue_of_variants_keeps_every_saved_result(setup, tmp_path):
    """Variants evaluated on their own go through prune.variants/ (the queue torchrun's ranks
    share): a result a rank saved before an interruption, not yet in prune.json, is kept; a claim
    without a result is dropped, and another command's result is discarded."""
    loaded, task = setup
    ref = run_sweep(loaded, task, [0, 1, 3], tmp_path / "ref", engine="lm-eval")
    fingerprint = json.dumps(json.loads((tmp_path / "ref" / "prune.json").read_text())["run"], sort_keys=True)
    folder = tmp_path / "out" / "prune.variants"
    folder.mkdir(parents=True)
    saved = {"removed": [3], "metrics": {"loss": 9.0, "ppl": 8103.08}, "examples": 4, "seconds": 1.0, "details": {}}
    (folder / "3.json").write_text(json.dumps({"fingerprint": fingerprint, "rank": 1, "result": saved}))
    assert kept_for_rerun(tmp_path / "out") == (1, 0)
    (folder / "0.json").write_text(json.dumps({"fingerprint": "another command", "rank": 1, "result": {**saved, "removed": [0]}}))
    for name in ("3", "0", "1"):
        (folder / f"{name}.claim").touch()
    counting = Counting(task)
    sweep = run_sweep(loaded, counting, [0, 1, 3], tmp_path / "out", engine="lm-eval")
    assert counting.calls == 3  # the baseline, 0 and 1; not 3, whose saved result stands
    got = {v.label: v.metrics for v in sweep.variants}
    assert got == {**{v.label: v.metrics for v in ref.variants}, "3": saved["metrics"]}
    assert not folder.exists()


def test_a_different_run_in_the_same_folder_is_refused(setup, tmp_path, tiny_tokenizer):
    loaded, task = setup
    run_sweep(loaded, task, [0], tmp_path)
    other = PerplexityTask(tiny_tokenizer, CORPUS * 4, source="corpus", seq_len=8, limit=4)
    with pytest.raises(DepthcurseError, match="holds a different run.*seq_len"):
        run_sweep(loaded, other, [0], tmp_path)
    same_shape = PerplexityTask(tiny_tokenizer, [t[::-1] for t in CORPUS] * 4, source=task.source, seq_len=task.seq_len, limit=len(task.windows))
    assert same_shape.windows.shape == task.windows.shape and same_shape.describe()["data"] == task.describe()["data"]
    with pytest.raises(DepthcurseError, match="holds a different run.*windows_sha256"):  # another text of the same shape and name (issue 88)
        run_sweep(loaded, same_shape, [0], tmp_path)
    said = []
    run_sweep(loaded, task, [0, 1], tmp_path, on_note=said.append)  # the same run, one layer more: what it took up is said
    assert any(line.startswith(f"the sweep's variants: took up the 2 of 3 finished before (kept in {tmp_path / 'prune.json'})") for line in said), said


def test_a_moved_cache_continues_the_sweep_but_the_hubs_copy_is_another_model(setup, tmp_path, monkeypatch, tiny_tokenizer):
    """An alias's offline copy lies in the cache, which may move: the sweep continues with the
    batches it saved. The hub's copy has other weights (the offline one is 4-bit-derived), so it
    is another run. A record written when sources were absolute paths still resumes."""
    from dataclasses import replace

    loaded, _ = setup
    task = PerplexityTask(tiny_tokenizer, CORPUS * 8, source="corpus", seq_len=160, limit=6, batch_size=4)
    out = tmp_path / "out"

    def in_cache(root):
        monkeypatch.setenv("DEPTHCURSE_CACHE", str(root))
        (root / "models" / "tiny").mkdir(parents=True, exist_ok=True)
        return replace(loaded, source=str(root / "models" / "tiny"))

    def stop_after_two(label, done, total):
        if label == "batches" and done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_sweep(in_cache(tmp_path / "a"), task, [0, 3], out, max_memory="1MB", on_variant=stop_after_two)
    resumed = run_sweep(in_cache(tmp_path / "b"), task, [0, 3], out, max_memory="1MB")
    assert resumed.meta["engine"]["batches_resumed"] == 2
    assert resumed.run["source"] == "$DEPTHCURSE_CACHE/models/tiny"
    with pytest.raises(DepthcurseError, match="holds a different run.*source"):
        run_sweep(replace(loaded, source="HuggingFaceTB/tiny"), task, [0, 3], out)
    record = json.loads((out / "prune.json").read_text())
    record["run"]["source"] = str(tmp_path / "b" / "models" / "tiny")
    (out / "prune.json").write_text(json.dumps(record))
    again = Counting(task)
    assert len(run_sweep(in_cache(tmp_path / "b"), again, [0, 3, 1], out, engine="lm-eval").variants) == 4
    assert again.calls == 1


def test_unwritable_out_dir_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(DepthcurseError, match="not writable"):
        ensure_out_dir(blocker / "sub")


def test_the_table_keeps_long_metric_names_apart_and_says_a_sweep_is_partial():
    """gsm8k's two metrics both start with exact_match: cut to the width of a terminal they read
    the same (`exact_match…`), so they are wrapped instead."""
    from rich.console import Console

    from depthcurse.prune import prune_table
    from depthcurse.prune.results import Sweep, VariantResult

    metrics = {"exact_match_strict-match": 0.25, "exact_match_flexible-extract": 0.31}
    sweep = Sweep({"model": "m", "task": "gsm8k", "num_fewshot": 5}, "exact_match_strict-match", True, 4,
                  [VariantResult([], metrics, 100, 1.0), VariantResult([1], metrics, 100, 1.0)], asked=[[], [0], [1]])
    console = Console(width=80, record=True)
    console.print(prune_table(sweep))
    text = console.export_text()
    assert "…" not in text and "strict" in text and "flexible" in text
    assert "partial: 2 of 3 variants measured" in " ".join(text.split())
    assert "100 examples of gsm8k, 5-shot" in " ".join(text.split())
