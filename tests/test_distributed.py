"""lns-train across processes: `torchrun --nproc-per-node 2 -m depthcurse lns-train` on the CPU
(gloo) computes what one process computes with the same global batch, with DDP and with FSDP2; a
checkpoint written by 2 ranks resumes in 1 process exactly; only rank 0 writes and talks; a bad
launch is one line.

Each torchrun child is a real process with one thread (OMP_NUM_THREADS=1); the model is tiny and
runs 4 steps, so a launch takes seconds (most of it importing torch twice).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import CORPUS, torchrun
from depthcurse.errors import DepthcurseError
from depthcurse.train import loop as train
from depthcurse.train.checkpoint import CHECKPOINT, load_checkpoint
from depthcurse.train.config import TrainConfig
from depthcurse.train.metrics import METRICS, SUMMARY, MetricsLog

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[1]
# Per-rank batch 2 = micro-batch 2, against 2 micro-batches of 2 in one process.
SHAPE = dict(norm="lns", pack=True, seq_len=16, max_seq_len=32, hidden_size=32, intermediate_size=48, num_layers=3,
             num_heads=4, steps=4, warmup=1, batch_size=4, micro_batch=2, val_tokens=64, eval_every=2, save_every=2, log_every=1)
FLAGS = {"num_layers": "--num-layers", "num_heads": "--heads"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_tokenizer):
    """Text, tokenizer and the one-process reference run, shared by the tests below."""
    root = tmp_path_factory.mktemp("dist")
    text = root / "text.txt"
    text.write_text("\n\n".join(CORPUS * 8), encoding="utf-8")
    tiny_tokenizer.save_pretrained(root / "tok")
    cfg = TrainConfig(preset="tiny", data=str(text), tokenizer=str(root / "tok"), **SHAPE)
    reference = train.run(cfg, root / "one")
    return root, cfg, reference


def cli_args(cfg: TrainConfig) -> list[str]:
    args = []
    for name in ("data", "tokenizer", *SHAPE):
        value = getattr(cfg, name)
        flag = FLAGS.get(name, "--" + name.replace("_", "-"))
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + flag[2:])
        else:
            args += [flag, str(value)]
    return args



def logged_losses(folder: Path) -> list[float]:
    return [r["loss"] for r in MetricsLog(folder / METRICS).rows() if "loss" in r]


def assert_same_run(folder: Path, reference_folder: Path) -> None:
    assert logged_losses(folder) == pytest.approx(logged_losses(reference_folder), rel=1e-5, abs=1e-6)
    a = load_checkpoint(folder / CHECKPOINT)
    b = load_checkpoint(reference_folder / CHECKPOINT)
    assert a["train_state"]["step"] == b["train_state"]["step"] and a["data"] == b["data"] and a["model"].keys() == b["model"].keys()
    for k in b["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=1e-5, atol=1e-6, msg=k)
    # Adam's moments, keyed by parameter name whatever wrote them
    for k, state in b["optimizer"]["state"].items():
        torch.testing.assert_close(a["optimizer"]["state"][k]["exp_avg"], state["exp_avg"], rtol=1e-4, atol=1e-8, msg=k)


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_equal_one_process(setup, parallel):
    root, cfg, reference = setup
    out = root / f"two-{parallel}"
    proc = torchrun("-m", "depthcurse", "lns-train", *cli_args(cfg), "--parallel", parallel, "--out", out)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert_same_run(out, root / "one")
    summary = json.loads((out / SUMMARY).read_text())
    assert summary["world_size"] == 2 and summary["parallel"] == parallel
    assert summary["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-5)
    # only rank 0 printed its progress and wrote the exports
    assert proc.stdout.count("validation loss") == 3 and proc.stdout.count("wrote ") == 1, proc.stdout
    assert (out / "hf-llama" / "config.json").is_file()


@pytest.mark.parametrize("norm,parallel", [("dyt", "fsdp"), ("hybridnorm", "fsdp"), ("completep", "fsdp"), ("completep", "ddp")])
def test_the_newer_depth_fixes_on_two_ranks_equal_one_process(setup, norm, parallel):
    """DyT's learnt alphas, HybridNorm's q/k/v norms and CompleteP's branch scale and Adam eps,
    sharded by FSDP2 or replicated by DDP. The DDP run also reports to TensorBoard: one writer,
    rank 0's, its events those of metrics.jsonl."""
    root, cfg, _ = setup
    variant = TrainConfig(**{**cfg.to_dict(), "norm": norm})
    if not (root / f"one-{norm}" / SUMMARY).exists():
        train.run(variant, root / f"one-{norm}")
    out = root / f"two-{norm}-{parallel}"
    tracked = ["--report-to", "tensorboard"] if parallel == "ddp" else []
    proc = torchrun("-m", "depthcurse", "lns-train", *cli_args(variant), "--parallel", parallel, *tracked, "--out", out)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert_same_run(out, root / f"one-{norm}")
    if tracked:
        from test_tracking import assert_events_equal_metrics

        assert len(list((out / "tensorboard").iterdir())) == 1  # rank 1 opened no writer
        assert_events_equal_metrics(out)


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_in_bf16_mixed_equal_one_process(setup, parallel):
    """bf16 autocast with gradient accumulation: one region over a step's micro-batches (each
    weight cast once per step) with DDP, one per micro-batch with FSDP2 (with the casts kept from
    the first micro-batch, later micro-batches' weight gradients reached the blocks after FSDP2's
    post-backward had reduce-scattered: the loss was 7.7e-3 off by step 4). 2 ranks of 2
    micro-batches each train as one process of 4 does."""
    root, cfg, _ = setup
    mixed = TrainConfig(**{**cfg.to_dict(), "precision": "bf16-mixed", "micro_batch": 1})
    reference = train.run(mixed, root / "one-bf16") if not (root / "one-bf16" / SUMMARY).exists() else json.loads((root / "one-bf16" / SUMMARY).read_text())
    out = root / f"two-{parallel}-bf16"
    proc = torchrun("-m", "depthcurse", "lns-train", *cli_args(mixed), "--precision", "bf16-mixed", "--parallel", parallel, "--out", out)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert logged_losses(out) == pytest.approx(logged_losses(root / "one-bf16"), rel=1e-4)
    assert json.loads((out / SUMMARY).read_text())["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-4)
    a, b = load_checkpoint(out / CHECKPOINT)["model"], load_checkpoint(root / "one-bf16" / CHECKPOINT)["model"]
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=1e-3, atol=1e-5, msg=k)


RESUME_SCRIPT = """
import sys
from depthcurse.train import TrainConfig, loop
cfg = TrainConfig(**eval(sys.argv[1]))
print(loop.run(cfg, sys.argv[2], stop_after=2, resume=False))
"""


def test_checkpoint_of_two_fsdp_ranks_resumes_in_one_process(setup, tmp_path):
    """FSDP shards weights and Adam state over the ranks; the checkpoint holds them whole, by
    parameter name, so a 2-rank run stopped at step 2 continues in one process exactly."""
    root, cfg, reference = setup
    script = tmp_path / "part.py"
    script.write_text(RESUME_SCRIPT)
    out = tmp_path / "run"
    saved = {**cfg.to_dict(), "parallel": "fsdp"}
    proc = torchrun(script, repr(saved), out)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    ckpt = load_checkpoint(out / CHECKPOINT)
    assert ckpt["train_state"]["step"] == 2 and ckpt["world_size"] == 2
    resumed = train.run(cfg, out, resume=True)  # no torchrun: one process, no wrapper
    assert_same_run(out, root / "one")
    assert resumed["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-5)


def test_bad_launches(setup, run_cli, monkeypatch, tmp_path):
    root, cfg, _ = setup
    with pytest.raises(DepthcurseError, match="unknown --parallel 'zero3': use ddp or fsdp"):
        train.run(TrainConfig(**{**cfg.to_dict(), "parallel": "zero3"}), tmp_path / "a")
    code, out, err = run_cli("lns-train", *cli_args(cfg), "--parallel", "fsdp", "--out", tmp_path / "b")
    assert code == 1 and "--parallel fsdp needs several processes: launch with torchrun" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    # as torchrun would start rank 0 of 3: checked before any process group exists
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    code, out, err = run_cli("lns-train", *cli_args(cfg), "--out", tmp_path / "c")
    assert code == 1 and "--batch-size 4 does not split evenly over 3 ranks" in err, err
    assert len(err.strip().splitlines()) == 1, err
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(DepthcurseError, match="each of the 2 ranks gets 3 sequences, not a multiple of --micro-batch 2"):
        train.run(TrainConfig(**{**cfg.to_dict(), "batch_size": 6, "micro_batch": 2}), tmp_path / "d")
    with pytest.raises(DepthcurseError, match="--largest-micro-batch runs in one process"):
        train.run(TrainConfig(**{**cfg.to_dict(), "largest_micro_batch": True}), tmp_path / "d2")
    # Another rank fails too and leaves it to rank 0, whose exit ends the launch within the grace
    # period; still running after it (here, with no rank 0), it says the error with its rank.
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr("depthcurse.cli.shared.RANK_0_GRACE_S", 0.0)
    monkeypatch.setattr("depthcurse.io.SIBLING_WAIT_S", 0.0)  # no rank 0 makes its folder here: rank 1 would wait out the 120 s
    code, out, err = run_cli("lns-train", *cli_args(cfg), "--batch-size", "6", "--micro-batch", "2", "--out", tmp_path / "e")
    assert code == 1 and out.strip() == "", (out, err)
    assert err.strip().splitlines() == ["error: rank 1: each of the 2 ranks gets 3 sequences, not a multiple of --micro-batch 2"], err
