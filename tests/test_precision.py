"""`--dtype auto` on a CPU (issue 82): a bf16 checkpoint in bf16 where the processor computes bf16
natively, fp32 where it does not and for work that says why it needs fp32; the header and every
record say which and why."""

from __future__ import annotations

import json

import pytest
import torch

from depthcurse.errors import DepthcurseError
from depthcurse.runtime import cpu_computes_bf16, pick_dtype

NATIVE = "auto: the checkpoint's bf16, which this CPU computes natively; a CPU without computes fp32, whose figures differ in the later decimals"
NOT_NATIVE = "auto: fp32, as this CPU has no native bf16; a CPU with it computes bf16, whose figures differ in the later decimals"


def test_the_environment_says_otherwise_than_the_detection_and_unset_the_processor_decides(monkeypatch):
    monkeypatch.setenv("DEPTHCURSE_CPU_BF16", "1")
    assert cpu_computes_bf16() is True
    monkeypatch.setenv("DEPTHCURSE_CPU_BF16", "0")
    assert cpu_computes_bf16() is False
    monkeypatch.setenv("DEPTHCURSE_CPU_BF16", "yes")  # not 0 or 1: the processor decides
    detected = any(getattr(torch.cpu, name)() for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported") if hasattr(torch.cpu, name))
    assert cpu_computes_bf16() is detected
    monkeypatch.delenv("DEPTHCURSE_CPU_BF16")
    assert cpu_computes_bf16() is detected


def test_every_branch_of_auto_and_an_asked_dtype(monkeypatch):
    monkeypatch.setenv("DEPTHCURSE_CPU_BF16", "1")
    assert pick_dtype("auto", "cpu") == (torch.bfloat16, NATIVE)
    assert pick_dtype("auto", "cpu", stored=torch.float32) == (torch.float32, "auto: fp32 on a CPU for a checkpoint not stored in bf16")
    assert pick_dtype("auto", "cpu", stored=None).dtype == torch.float32  # a quantised GGUF: no one dtype
    assert pick_dtype("auto", "cpu", stored=torch.float16).dtype == torch.float32
    assert pick_dtype("auto", "cpu", fp32_on_cpu="as it trains") == (torch.float32, "auto: fp32 on a CPU as it trains")
    assert pick_dtype("auto", "cpu", keep_checkpoint=True) == ("auto", "auto: the checkpoint's own dtype")
    assert pick_dtype("auto", "cuda", fp32_on_cpu="as it trains") == ("auto", "auto: the checkpoint's own dtype")
    assert pick_dtype("fp32", "cpu") == (torch.float32, "--dtype fp32")
    assert pick_dtype("bf16", "cuda", fp32_on_cpu="as it trains") == (torch.bfloat16, "--dtype bf16")
    assert pick_dtype("fp16", "cpu").dtype == torch.float16
    monkeypatch.setenv("DEPTHCURSE_CPU_BF16", "0")
    assert pick_dtype("auto", "cpu") == (torch.float32, NOT_NATIVE)
    with pytest.raises(DepthcurseError, match="unknown --dtype 'half': use auto, bf16, fp16 or fp32"):
        pick_dtype("half", "cpu")


@pytest.fixture
def bf16_model_dir(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    half = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).save_pretrained(half)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (half / name).write_bytes((tiny_model_dir / name).read_bytes())
    return half


def test_a_bf16_checkpoint_loads_in_bf16_on_a_native_cpu_and_the_record_and_header_say_why(bf16_model_dir, tiny_model_dir, monkeypatch):
    from depthcurse.cli.shared import model_line
    from depthcurse.loading import load_model

    monkeypatch.setenv("DEPTHCURSE_CPU_BF16", "1")
    loaded = load_model(str(bf16_model_dir))
    assert loaded.dtype == torch.bfloat16 and loaded.describe()["dtype"] == "bfloat16" and loaded.describe()["dtype_why"] == NATIVE
    assert model_line(loaded).endswith(f"4 layers, bfloat16, cpu) · {NATIVE}")
    kept = load_model(str(bf16_model_dir), fp32_on_cpu="as it trains")
    assert kept.dtype == torch.float32 and kept.dtype_why == "auto: fp32 on a CPU as it trains"
    asked = load_model(str(bf16_model_dir), dtype="fp32")
    assert asked.dtype == torch.float32 and asked.dtype_why == "--dtype fp32" and model_line(asked).endswith("4 layers, float32, cpu)")
    assert load_model(str(tiny_model_dir)).dtype_why == "auto: fp32 on a CPU for a checkpoint not stored in bf16"
    monkeypatch.setenv("DEPTHCURSE_CPU_BF16", "0")
    assert load_model(str(bf16_model_dir)).dtype_why == NOT_NATIVE


def test_prune_computes_in_bf16_and_speculate_in_fp32_on_a_native_cpu(run_cli, bf16_model_dir, text_file, tmp_path, monkeypatch):
    from depthcurse.speculate.run import FP32_ON_CPU

    monkeypatch.setenv("DEPTHCURSE_CPU_BF16", "1")
    code, out = run_cli("prune", bf16_model_dir, "--data", text_file, "--seq-len", "16", "--limit", "2", "--layers", "0", "--out", tmp_path / "prune")[:2]
    assert code == 0 and f"bfloat16, cpu) · {NATIVE}" in " ".join(out.split())
    run = json.loads((tmp_path / "prune" / "prune.json").read_text())["run"]
    assert (run["dtype"], run["dtype_why"]) == ("bfloat16", NATIVE)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the cat sat on the mat\n\nthe dog ran in the park\n")
    code, out, err = run_cli("speculate", bf16_model_dir, "--skip", "1", "--prompts", prompts, "--max-new-tokens", "4", "--out", tmp_path / "spec")
    assert code == 0, err
    run = json.loads((tmp_path / "spec" / "speculate.json").read_text())["run"]
    assert (run["dtype"], run["dtype_why"]) == ("float32", f"auto: fp32 on a CPU {FP32_ON_CPU}")


def test_every_other_command_runs_on_a_bf16_checkpoint_in_the_dtype_auto_picks(run_cli, bf16_model_dir, text_file, tmp_path, monkeypatch):
    """On a CPU with native bf16 the measurements compute in bf16 and say so; the commands that train
    keep fp32 and say why."""
    from depthcurse.depth.tuned_lens import FP32_ON_CPU as LENS
    from depthcurse.heal.loop import FP32_ON_CPU as HEAL

    monkeypatch.setenv("DEPTHCURSE_CPU_BF16", "1")
    text = ["--data", text_file, "--seq-len", "16"]
    runs = {
        "angular": (["angular-distance", bf16_model_dir, *text, "--tokens", "64", "--token-position", "all", "--out", tmp_path / "ang"], "angular.json", "bfloat16", NATIVE),
        "depth-use": (["depth-use", bf16_model_dir, *text, "--windows", "2", "--out", tmp_path / "du"], "depth_use.json", "bfloat16", NATIVE),
        "lens": (["depth-use", bf16_model_dir, *text, "--windows", "2", "--no-influence", "--tuned-lens", "--lens-steps", "2", "--calib-windows", "2",
                  "--out", tmp_path / "lens"], "depth_use.json", "float32", f"auto: fp32 on a CPU {LENS}"),
        # a lens read on a bf16 checkpoint: by auto (fp32 on a CPU, as the lens trains), and in bf16 when asked, the lens's fp32
        # translators reading the bf16 stream (it was a dtype-mismatch error)
        "lens read": (["depth-use", bf16_model_dir, *text, "--windows", "2", "--no-influence", "--lens", tmp_path / "lens" / "tuned_lens.safetensors",
                       "--out", tmp_path / "lens-read"], "depth_use.json", "float32", f"auto: fp32 on a CPU {LENS}"),
        "lens in bf16": (["depth-use", bf16_model_dir, *text, "--windows", "2", "--no-influence", "--dtype", "bf16",
                          "--lens", tmp_path / "lens" / "tuned_lens.safetensors", "--out", tmp_path / "lens-bf16"], "depth_use.json", "bfloat16", "--dtype bf16"),
        "lens trained in bf16": (["depth-use", bf16_model_dir, *text, "--windows", "2", "--no-influence", "--dtype", "bf16", "--tuned-lens",
                                  "--lens-steps", "2", "--calib-windows", "2", "--out", tmp_path / "lens-trained-bf16"], "depth_use.json", "bfloat16", "--dtype bf16"),
        "depth-map": (["depth-map", bf16_model_dir, bf16_model_dir, *text, "--calib-windows", "3", "--eval-windows", "2", "--out", tmp_path / "map"],
                      "depth_map.json", "bfloat16", NATIVE),
        "select": (["select", bf16_model_dir, "--k", "1", "--search", "greedy", "--calibration", text_file, "--calib-windows", "2", "--eval-windows", "2",
                    "--seq-len", "16", "--out", tmp_path / "sel"], "select.json", "bfloat16", NATIVE),
        "heal": (["heal", bf16_model_dir, "--layers", "1", "--calibration", text_file, "--steps", "2", "--batch-size", "2", "--seq-len", "16",
                  "--eval-windows", "2", "--lora-rank", "2", "--out", tmp_path / "heal"], "heal.json", "float32", f"auto: fp32 on a CPU {HEAL}"),
    }
    for name, (args, record, dtype, why) in runs.items():
        code, out, err = run_cli(*args)
        assert code == 0, f"{name}: {err}"
        run = json.loads((args[-1] / record).read_text())["run"]
        run = run.get("shallow", run)  # a depth map's run describes both models
        assert (run["dtype"], run["dtype_why"]) == (dtype, why), name


def test_a_runs_identity_compares_its_dtype_not_why_it_is_that():
    """A run recorded before the reason was (or with another reason for the same dtype) resumes; another dtype is another run."""
    from depthcurse.io import changed_settings

    assert changed_settings({"dtype": "float32"}, {"dtype": "float32", "dtype_why": "--dtype fp32"}) == []
    assert changed_settings({"dtype": "float32", "dtype_why": NOT_NATIVE}, {"dtype": "bfloat16", "dtype_why": NATIVE}) == ["dtype: 'float32' -> 'bfloat16'"]
