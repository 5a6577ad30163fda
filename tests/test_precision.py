"""`--dtype auto` on a CPU (issue 82): a bf16 checkpoint in bf16 where the processor computes bf16
natively, fp32 where it does not and for work that says why it needs fp32; the header and every
record say which and why."""

from __future__ import annotations

import hashlib
import json
import re

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


# --------------------------------------------------------------------------- whether bf16 pays here, measured (issue 89)
@pytest.mark.statistics
@pytest.mark.usefixtures("one_torch_thread")  # mutmut forks the process that ran it: a forked thread pool is a deadlock
def test_whether_bf16_pays_is_the_median_pair_against_090_measured_once_and_kept(tmp_path, monkeypatch):
    """`bf16_pays` on held measurements: the median of the pairs' ratios (1, 0.95, 0.2: the median 0.95
    does not pay, where the mean, 0.72, would), 0.9 itself pays; what is measured is kept for this
    machine and shape and read back without measuring again; a kept file that cannot be read, or a
    cache that cannot be written, measures again and says so."""
    from depthcurse.cpu_precision import PAYS, BlockShape, bf16_pays, machine_key

    shape = BlockShape(576, 1536, 9)
    calls = []

    def held(ratios):
        return lambda s: calls.append(s) or list(ratios)

    pays, why = bf16_pays(shape, tmp_path / "a", measure=held([1.0, 0.95, 0.2]))
    assert pays is False and PAYS == 0.9 and calls == [shape]
    kept = next((tmp_path / "a").glob("*.json"))
    key = machine_key(shape)
    assert why == (f"auto: fp32, as bf16 does not pay here: a block of this model's shape (576 wide, 256 tokens) took 0.95x fp32's time in bf16 "
                   f"on this CPU ({key['cpu']}, {key['threads']} threads; measured in {kept}), above the 0.90x at which it pays; a CPU where it "
                   "pays computes bf16, whose figures differ in the later decimals")
    record = json.loads(kept.read_text())
    assert kept.name == hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16] + ".json" and kept.read_text().startswith('{\n  "key"')
    assert {k: v for k, v in record.items() if k != "when"} == {"key": key, "ratio": 0.95, "ratios": [1.0, 0.95, 0.2], "rows": 256, "pays_below": 0.9}
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", record["when"]) and list(key) == ["cpu", "torch", "threads", "hidden", "intermediate", "heads"]
    assert key["torch"] == torch.__version__ and key["threads"] == torch.get_num_threads() and key["hidden"] == 576
    pays, why = bf16_pays(shape, tmp_path / "a", measure=held([0.1]))  # kept: not measured again
    assert pays is False and len(calls) == 1 and f"0.95x fp32's time in bf16 on this CPU ({key['cpu']}, {key['threads']} threads; kept in {kept})" in why
    pays, why = bf16_pays(shape, tmp_path / "b", measure=held([0.9, 0.9, 0.95]))
    assert pays is True and why.startswith("auto: the checkpoint's bf16, as a block of this model's shape (576 wide, 256 tokens) took 0.90x")
    assert why.endswith("; a CPU where it does not pay computes fp32, whose figures differ in the later decimals")
    other = BlockShape(64, 128, 2)  # another shape: its own measurement
    assert bf16_pays(other, tmp_path / "b", measure=held([0.5]))[0] is True and calls[-1] == other and len(list((tmp_path / "b").glob("*.json"))) == 2
    kept.write_text(json.dumps({"key": {**key, "threads": 99}, "ratio": 0.1}))  # another machine's figure where this one's goes: measured again
    assert bf16_pays(shape, tmp_path / "a", measure=held([1.5]))[0] is False and len(calls) == 4
    kept.write_text("{not json")
    assert bf16_pays(shape, tmp_path / "a", measure=held([0.3]))[0] is True and len(calls) == 5
    assert bf16_pays(shape, tmp_path / "deep" / "er", measure=held([0.3]))[0] is True  # its folder made, parents and all
    assert len(list((tmp_path / "deep" / "er").glob("*.json"))) == 1
    monkeypatch.setenv("DEPTHCURSE_CACHE", str(tmp_path / "cache"))  # by default, the cache's folder
    bf16_pays(shape, measure=held([0.3]))
    assert len(list((tmp_path / "cache" / "cpu_precision").glob("*.json"))) == 1
    blocked = tmp_path / "file"
    blocked.write_text("")  # the cache's folder is a file: nothing can be kept
    pays, why = bf16_pays(shape, blocked / "x", measure=held([0.5]))
    assert pays is True and f"{key['threads']} threads; measured), a CPU" not in why and f"{key['threads']} threads; measured)" in why


def test_two_processes_of_one_machine_measuring_at_once_take_one_figure(tmp_path):
    """Two torchrun ranks loading one model at once: the first measures while holding the lock beside
    the kept file; the second, having found no kept figure, waits for it and reads the first's instead of
    measuring its own (which would say otherwise here), so both compute in one dtype."""
    import subprocess
    import sys
    import textwrap
    import time

    script = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from depthcurse.cpu_precision import BlockShape, bf16_pays
        first = sys.argv[1] == "first"
        def measure(shape):
            if first:
                Path(r"{tmp_path}", "measuring").touch()
                while not Path(r"{tmp_path}", "go").exists():
                    time.sleep(0.01)
            return [0.5] if first else [2.0]
        Path(r"{tmp_path}", sys.argv[1] + "-ready").touch()
        print(bf16_pays(BlockShape(64, 128, 2), Path(r"{tmp_path}", "kept"), measure=measure)[0])
    """)
    first = subprocess.Popen([sys.executable, "-c", script, "first"], stdout=subprocess.PIPE, text=True)
    while not (tmp_path / "measuring").exists():  # the first holds the lock and has not written its figure
        assert first.poll() is None, first.communicate()
    second = subprocess.Popen([sys.executable, "-c", script, "second"], stdout=subprocess.PIPE, text=True)
    while not (tmp_path / "second-ready").exists():
        assert second.poll() is None, second.communicate()
    time.sleep(0.5)  # the second finds nothing kept and waits on the lock (on a machine too busy to get there, it reads the figure after: passes too)
    (tmp_path / "go").touch()
    assert first.communicate(timeout=120)[0].strip() == "True" and second.communicate(timeout=120)[0].strip() == "True"


@pytest.mark.statistics
@pytest.mark.usefixtures("one_torch_thread")  # mutmut forks the process that ran it: a forked thread pool is a deadlock
def test_the_measured_block_runs_in_both_dtypes_alike_and_is_timed_in_turns():
    """The block `measure_ratios` times is transformers' Llama block (its own `LlamaDecoderLayer` on the
    same weights and input gives the same output), computes the same in bf16 as in fp32 (to bf16's precision), and
    on a clock the test holds each pair is bf16's time over fp32's, fp32 first (2 s then 1 s: 0.5; 4 s
    then 1 s: 0.25), after one of each to warm up, which is not timed."""
    from depthcurse import cpu_precision
    from depthcurse.cpu_precision import BlockShape, _block, measure_ratios

    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    shape = BlockShape(16, 32, 2)
    run = _block(shape, torch.float32)
    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=10000.0,
                         max_position_embeddings=256)
    config._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(config, 0).eval()  # transformers' own block, the reference: the same weights, causal, rotary
    with torch.no_grad():
        for name, linear in (("q", layer.self_attn.q_proj), ("k", layer.self_attn.k_proj), ("v", layer.self_attn.v_proj), ("o", layer.self_attn.o_proj),
                             ("gate", layer.mlp.gate_proj), ("up", layer.mlp.up_proj), ("down", layer.mlp.down_proj)):
            linear.weight.copy_(run.weights[name].T)
        positions = torch.arange(run.x.shape[1])[None].expand(2, -1)
        theirs = layer(run.x, attention_mask=None, position_ids=positions, position_embeddings=LlamaRotaryEmbedding(config)(run.x, positions))
    torch.testing.assert_close(run(), theirs[0] if isinstance(theirs, tuple) else theirs, rtol=1e-5, atol=1e-5)
    full, half = run(), _block(shape, torch.bfloat16)()
    assert full.shape == (2, 128, 16) and half.dtype == torch.bfloat16
    assert torch.allclose(half.float(), full, rtol=0.05, atol=0.05) and not torch.equal(half.float(), full)
    assert measure_ratios(shape, pairs=2, clock=iter([0.0, 2.0, 2.0, 3.0, 3.0, 7.0, 7.0, 8.0]).__next__) == [0.5, 0.25]
    made = []
    real = cpu_precision._block
    cpu_precision._block = lambda s, dtype: made.append(dtype) or real(s, dtype)
    try:
        measure_ratios(shape, pairs=1)
    finally:
        cpu_precision._block = real
    assert made == [torch.float32, torch.bfloat16]


@pytest.mark.statistics
@pytest.mark.usefixtures("one_torch_thread")  # mutmut forks the process that ran it: a forked thread pool is a deadlock
def test_a_config_gives_the_blocks_shape_and_auto_follows_the_measurement_on_a_cpu_with_the_flag(monkeypatch):
    """Llama's, GPT-2's (no MLP width: 4 x hidden) and an odd head count's shapes; a config without
    widths gives none (auto takes the flag's word). With the flag and a shape, auto is what the
    measurement says, with its line; `DEPTHCURSE_CPU_BF16=1` takes the flag's word unmeasured, and
    0 or no flag is fp32 without measuring."""
    from types import SimpleNamespace

    from depthcurse import cpu_precision
    from depthcurse.cpu_precision import BlockShape

    assert BlockShape.of_config(SimpleNamespace(hidden_size=576, intermediate_size=1536, num_attention_heads=9)) == BlockShape(576, 1536, 9)
    assert BlockShape.of_config(SimpleNamespace(n_embd=768, n_inner=None, n_head=12)) == BlockShape(768, 3072, 12)
    assert BlockShape.of_config(SimpleNamespace(n_embd=768, n_inner=1000, n_head=6)) == BlockShape(768, 1000, 6)  # GPT-2's names
    assert BlockShape.of_config(SimpleNamespace(d_model=256, ffn_dim=700, num_attention_heads=8)) == BlockShape(256, 700, 8)  # OPT's
    assert BlockShape.of_config(SimpleNamespace(d_model=96)) == BlockShape(96, 384, 1)  # no heads said: one per 64 wide, at least one
    assert BlockShape.of_config(SimpleNamespace(hidden_size=100, intermediate_size=300, num_attention_heads=7)) == BlockShape(100, 300, 1)
    assert BlockShape.of_config(SimpleNamespace(d_model=128)) == BlockShape(128, 512, 2)
    assert BlockShape.of_config(SimpleNamespace(vocab_size=5)) is None
    shape = BlockShape(576, 1536, 9)
    asked = []
    monkeypatch.setattr(cpu_precision, "bf16_pays", lambda s: asked.append(s) or (False, "auto: fp32, as bf16 does not pay here: held"))
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True, raising=False)
    monkeypatch.delenv("DEPTHCURSE_CPU_BF16", raising=False)
    assert pick_dtype("auto", "cpu", shape=shape) == (torch.float32, "auto: fp32, as bf16 does not pay here: held") and asked == [shape]
    assert pick_dtype("auto", "cpu") == (torch.bfloat16, NATIVE) and pick_dtype("bf16", "cpu", shape=shape).dtype == torch.bfloat16
    monkeypatch.setenv("DEPTHCURSE_CPU_BF16", "1")
    assert pick_dtype("auto", "cpu", shape=shape) == (torch.bfloat16, NATIVE)
    monkeypatch.setenv("DEPTHCURSE_CPU_BF16", "0")
    assert pick_dtype("auto", "cpu", shape=shape) == (torch.float32, NOT_NATIVE) and asked == [shape]
    assert pick_dtype("auto", "cpu", shape=shape, fp32_on_cpu="as it trains").dtype == torch.float32 and len(asked) == 1
