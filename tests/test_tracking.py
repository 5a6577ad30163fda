"""`--report-to`: the live trackers. TensorBoard's event files are read back with TensorBoard's own
reader and must hold exactly what metrics.jsonl holds (each scalar at its step, once), also across
a resume from a checkpoint older than the last logged step; W&B's adapter is checked against a
recording stand-in for the `wandb` module (the real one is optional and needs no test to run)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types

import pytest
from helpers import assert_one_line_error, heal_config

from depthcurse.errors import DepthcurseError
from depthcurse.heal import heal
from depthcurse.loading import load_model
from depthcurse.runtime import peak_tflops
from depthcurse.train import loop as train
from depthcurse.train import tracking
from depthcurse.train.config import TrainConfig
from depthcurse.train.metrics import METRICS, MetricsLog

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard not installed (pip install 'depthcurse[test]')")]


@pytest.fixture()
def cfg(text_file, tiny_tokenizer, tmp_path):
    tiny_tokenizer.save_pretrained(tmp_path / "tok")
    return TrainConfig(
        preset="tiny", norm="lns", data=str(text_file), tokenizer=str(tmp_path / "tok"), pack=True, seq_len=16, max_seq_len=32,
        hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4, steps=8, warmup=2, batch_size=4, micro_batch=4,
        val_tokens=64, eval_every=4, save_every=4, log_every=1, layer_metrics_tokens=32, report_to="tensorboard",
    )


def read_events(folder) -> tuple[dict[str, list[tuple[int, float]]], list[str]]:
    """Every scalar in `folder`'s event files as TensorBoard shows it: tag -> [(step, value)], and the text tags."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder / tracking.TENSORBOARD_DIR), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    texts = [(tag, len(events.Tensors(tag))) for tag in events.Tags()["tensors"]]
    return scalars, texts


def expected_from_metrics(folder) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl as the scalars a tracker should show, written out here from the rows: a
    training row's keys under train/, an evaluation's val_* under val/, each layer of a per-layer
    list as its own chart."""
    out: dict[str, list] = {}
    for row in MetricsLog(folder / METRICS).rows():
        for key, value in row.items():
            if key == "step" or isinstance(value, (str, bool)) or value is None:
                continue
            if isinstance(value, list):
                for i, v in enumerate(value):
                    out.setdefault(f"{key}/{i:02d}", []).append((row["step"], v))
            else:
                out.setdefault("val/" + key[4:] if key.startswith("val_") else "train/" + key, []).append((row["step"], value))
    return out


def assert_events_equal_metrics(folder) -> None:
    got, texts = read_events(folder)
    want = expected_from_metrics(folder)
    assert got.keys() == want.keys()
    for tag, points in want.items():
        assert [s for s, _ in got[tag]] == [s for s, _ in points], tag  # each step once, in order
        # TensorBoard keeps a scalar in float32
        assert [v for _, v in got[tag]] == pytest.approx([v for _, v in points], rel=1e-6, abs=1e-30), tag
    assert texts == [("config/text_summary", 1)]  # the run's config, once


def test_lns_train_event_files_equal_metrics_jsonl_across_a_kill_and_a_resume(cfg, tmp_path):
    def killed_at_step_6(progress):
        if progress.step == 6:
            raise KeyboardInterrupt  # steps 5 and 6 logged, the last checkpoint at step 4

    with pytest.raises(KeyboardInterrupt):
        train.run(cfg, tmp_path / "run", on_progress=killed_at_step_6)
    assert [s for s, _ in read_events(tmp_path / "run")[0]["train/loss"]] == [1, 2, 3, 4, 5, 6]
    train.run(cfg, tmp_path / "run", resume=True)
    rows = MetricsLog(tmp_path / "run" / METRICS).rows()
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 9))
    assert any("layer_grad_norm" in r and "identity_distance" in r for r in rows)  # the per-layer lists are among what is compared
    assert_events_equal_metrics(tmp_path / "run")
    got, _ = read_events(tmp_path / "run")
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/tflops", "val/loss", "layer_grad_norm/02", "layer_variance/00"} <= got.keys()


def test_a_run_started_over_drops_the_curves_of_the_attempt_before(cfg, tmp_path):
    cfg.steps, cfg.eval_every, cfg.save_every, cfg.layer_metrics_tokens = 3, 8, 8, 0

    def killed_at_step_2(progress):
        if progress.step == 2:
            raise KeyboardInterrupt  # before the first checkpoint: the next run starts over

    with pytest.raises(KeyboardInterrupt):
        train.run(cfg, tmp_path / "run", on_progress=killed_at_step_2)
    train.run(cfg, tmp_path / "run", resume=True)
    assert_events_equal_metrics(tmp_path / "run")


def test_mfu_is_logged_against_the_devices_peak_where_it_is_known(cfg, tmp_path, monkeypatch):
    cfg.steps, cfg.eval_every, cfg.save_every, cfg.layer_metrics_tokens, cfg.report_to = 2, 8, 8, 0, "none"
    train.run(cfg, tmp_path / "cpu")
    assert all("mfu" not in r for r in MetricsLog(tmp_path / "cpu" / METRICS).rows())  # a CPU has no peak in the table
    monkeypatch.setattr(train, "peak_tflops", lambda name, precision: 2.5e-3)
    train.run(cfg, tmp_path / "known")
    rows = [r for r in MetricsLog(tmp_path / "known" / METRICS).rows() if "loss" in r]
    assert rows and all(r["mfu"] == pytest.approx(r["tflops"] / 2.5e-3) for r in rows)


def test_the_peak_table_names_only_bf16_on_the_parts_it_knows():
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16-mixed") == 989.0
    assert peak_tflops("NVIDIA H200", "bf16") == 989.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "bf16-mixed") == 312.0
    assert peak_tflops("NVIDIA GH200 480GB", "bf16") == 989.0
    assert peak_tflops("NVIDIA H100 PCIe", "bf16") is None  # another clock, another peak
    assert peak_tflops("NVIDIA H100 80GB HBM3", "fp32") is None
    assert peak_tflops("cpu", "bf16") is None


def test_heal_event_files_equal_metrics_jsonl_across_a_preemption(bos_model_dir, docs_file, tmp_path):
    cfg = heal_config(layers=(1, 3), data=str(docs_file), steps=6, batch_size=4, seq_len=24, lr=5e-3, eval_windows=2, save_every=2,
                      lora_rank=4, report_to="tensorboard")
    assert heal(load_model(str(bos_model_dir)), cfg, tmp_path / "cut", stop_after=3) is None  # step 3 logged, checkpoint at 2
    assert [s for s, _ in read_events(tmp_path / "cut")[0]["train/loss"]] == [1, 2, 3]
    heal(load_model(str(bos_model_dir)), cfg, tmp_path / "cut")
    assert [r["step"] for r in MetricsLog(tmp_path / "cut" / METRICS).rows()] == list(range(1, 7))
    assert_events_equal_metrics(tmp_path / "cut")


class RecordingWandb(types.ModuleType):
    """What depthcurse asks of `wandb`: `init(...)` giving a run with `log(data, step=)` and `finish()`."""

    def __init__(self):
        super().__init__("wandb")
        self.__spec__ = importlib.machinery.ModuleSpec("wandb", None)  # what tells an installed package
        self.inits, self.logged, self.finished = [], [], 0

    def init(self, **kw):
        self.inits.append(kw)
        module = self

        class Run:
            def log(self, data, step):
                module.logged.append((kw["id"], step, data))

            def finish(self):
                module.finished += 1
        return Run()


def test_wandb_continues_the_same_run_on_a_resume_offline_without_a_key(cfg, tmp_path, monkeypatch):
    fake = RecordingWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_PROJECT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg.report_to, cfg.layer_metrics_tokens = "wandb", 0
    assert train.run(cfg, tmp_path / "run", stop_after=4) == {"finished": False, "step": 4}
    train.run(cfg, tmp_path / "run", resume=True)
    first, second = fake.inits
    assert first["id"] == second["id"] == (tmp_path / "run" / tracking.WANDB_ID).read_text().strip()
    assert first["resume"] == "allow" and first["mode"] == "offline" and first["project"] == "depthcurse"
    assert first["dir"] == str(tmp_path / "run") and first["config"]["norm"] == "lns"
    assert fake.finished == 2
    rows = MetricsLog(tmp_path / "run" / METRICS).rows()
    assert [step for _, step, _ in fake.logged] == [r["step"] for r in rows]
    assert [data for _, _, data in fake.logged] == [tracking.scalars(r) for r in rows]

    def killed_at_step_2(progress):
        if progress.step == 2:
            raise KeyboardInterrupt  # before the first checkpoint

    with pytest.raises(KeyboardInterrupt):
        train.run(cfg, tmp_path / "over", on_progress=killed_at_step_2)
    train.run(cfg, tmp_path / "over", resume=True)  # starts over: another W&B run, not the dead attempt's
    assert fake.inits[2]["id"] != fake.inits[3]["id"] == (tmp_path / "over" / tracking.WANDB_ID).read_text().strip()
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert tracking.wandb_mode() == "online"


def test_scalars_name_each_chart_by_its_part_of_the_run():
    row = {"step": 4, "loss": 2.5, "val_loss": 3.0, "layer_grad_norm": [0.1, 0.2], "layer_metrics_error": "ValueError: x", "tokens": 64,
           "grad_norm": None}
    assert tracking.scalars(row) == {"train/loss": 2.5, "val/loss": 3.0, "layer_grad_norm/00": 0.1, "layer_grad_norm/01": 0.2, "train/tokens": 64.0}


def test_report_to_bad_input_is_one_line(run_cli, cfg, tmp_path, monkeypatch):
    for text, message in (("comet", "--report-to comet: use none, or one or more of tensorboard, wandb"),
                          ("none,tensorboard", "use none, or one or more of")):
        with pytest.raises(DepthcurseError, match=message):
            tracking.parse_report_to(text)
    assert tracking.parse_report_to("TensorBoard, tensorboard") == ("tensorboard",)
    monkeypatch.setitem(sys.modules, "wandb", None)  # as Python has it for a package that is not installed
    code, out, err = run_cli("lns-train", "--report-to", "wandb", "--steps", "1", "--out", tmp_path / "x")
    assert_one_line_error(code, out, err, "--report-to wandb: wandb is not installed")
    code, out, err = run_cli("heal", "tiny", "--layers", "1", "--report-to", "neptune", "--out", tmp_path / "y")
    assert_one_line_error(code, out, err, "--report-to neptune: use none")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
