"""lns-train: exact resume, gradient accumulation, divergence handling, data order, bad input,
and the CLI end to end on a tiny model (a few seconds each on one thread)."""

from __future__ import annotations

import contextlib
import json
import math
import types

import pytest
import torch
from helpers import CORPUS

from depthcurse.train import data as D
from depthcurse.train import loop as train
from depthcurse.train.checkpoint import CHECKPOINT, load_checkpoint
from depthcurse.train.config import NORMS, TrainConfig
from depthcurse.train.report import METHOD_NAMES
from depthcurse.train.metrics import METRICS, SUMMARY, MetricsLog
from depthcurse.errors import DepthcurseError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture()
def tok_dir(tmp_path, tiny_tokenizer):
    path = tmp_path / "tok"
    tiny_tokenizer.save_pretrained(path)
    return path


@pytest.fixture()
def cfg(text_file, tok_dir):
    return TrainConfig(
        preset="tiny", norm="lns", data=str(text_file), tokenizer=str(tok_dir), pack=True, seq_len=16, max_seq_len=32,
        hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4, steps=8, warmup=2, batch_size=4, micro_batch=2,
        val_tokens=64, eval_every=4, save_every=2, log_every=1,
    )


def losses(folder):
    return [r["loss"] for r in MetricsLog(folder / METRICS).rows() if "loss" in r]


def test_resume_continues_exactly(cfg, tmp_path):
    """...and says what it took up, forecasts the steps it runs, and its summary keeps how it was made
    (issue 90: every record keeps the forecast, the wall time and the environment)."""
    said = []
    straight = train.run(cfg, tmp_path / "a", on_note=said.append)
    assert said[0].startswith("the training steps: 8 steps to run, the first took ") and straight["forecast"]["steps"] == 8
    assert straight["wall_time_s"] > 0 and {"command", "commit", "packages", "cpu"} <= set(straight["environment"])
    part = train.run(cfg, tmp_path / "b", stop_after=4)
    assert part == {"finished": False, "step": 4}
    said.clear()
    resumed = train.run(cfg, tmp_path / "b", resume=True, on_note=said.append)
    assert said[0] == f"the training steps: took up the 4 of 8 finished before (kept in {tmp_path / 'b'}), not run again"
    assert said[1].startswith("the training steps: 4 steps to run") and resumed["forecast"]["steps"] == 8
    assert len(losses(tmp_path / "a")) == len(losses(tmp_path / "b")) == 8
    assert losses(tmp_path / "b") == pytest.approx(losses(tmp_path / "a"), rel=1e-6, abs=1e-6)
    assert resumed["val_loss"] == pytest.approx(straight["val_loss"], rel=1e-6)
    a = load_checkpoint(tmp_path / "a" / CHECKPOINT)
    b = load_checkpoint(tmp_path / "b" / CHECKPOINT)
    assert a["train_state"]["step"] == b["train_state"]["step"] == 8 and a["data"] == b["data"]
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("norm", ["dyt", "hybridnorm", "completep"])
def test_the_newer_depth_fixes_resume_exactly(cfg, tmp_path, norm):
    """DyT's alphas, HybridNorm's q/k/v norms, CompleteP's scaled Adam eps: all in the checkpoint."""
    cfg.norm, cfg.layer_metrics_tokens, cfg.base_layers = norm, 0, 1
    straight = train.run(cfg, tmp_path / "a")
    assert train.run(cfg, tmp_path / "b", stop_after=3) == {"finished": False, "step": 3}
    resumed = train.run(cfg, tmp_path / "b", resume=True)
    assert losses(tmp_path / "b") == pytest.approx(losses(tmp_path / "a"), rel=1e-6, abs=1e-6)
    assert resumed["val_loss"] == pytest.approx(straight["val_loss"], rel=1e-6)
    a, b = (load_checkpoint(tmp_path / d / CHECKPOINT) for d in "ab")
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=1e-6, atol=1e-7)
    assert b["optimizer"]["param_groups"][0]["eps"] == pytest.approx(1e-8 / 3 if norm == "completep" else 1e-8)


def test_a_checkpoint_of_the_earlier_layout_resumes_exactly(cfg, tmp_path):
    """Checkpoints written before every part had its own entry kept the step counters at the top."""
    train.run(cfg, tmp_path / "a")
    train.run(cfg, tmp_path / "b", stop_after=4)
    path = tmp_path / "b" / CHECKPOINT
    state = load_checkpoint(path)
    state.update(state.pop("train_state"))
    torch.save(state, path)
    train.run(cfg, tmp_path / "b", resume=True)
    assert losses(tmp_path / "b") == pytest.approx(losses(tmp_path / "a"), rel=1e-6, abs=1e-6)
    assert load_checkpoint(path)["train_state"]["tokens"] == load_checkpoint(tmp_path / "a" / CHECKPOINT)["train_state"]["tokens"]


def test_metrics_and_outputs(cfg, tmp_path):
    summary = train.run(cfg, tmp_path / "run")
    rows = MetricsLog(tmp_path / "run" / METRICS).rows()
    logged = [r for r in rows if "loss" in r]
    assert [r["step"] for r in logged] == list(range(1, 9))
    assert all({"step", "loss", "lr", "tokens"} <= set(r) for r in logged)
    assert logged[-1]["tokens"] == 8 * 4 * 16
    assert [r["step"] for r in rows if "val_loss" in r] == [4, 8]
    assert math.exp(summary["val_loss"]) == pytest.approx(summary["val_ppl"])
    for name in ("loss.png", "layers.png", "summary.json", "config.json", "hf/config.json", "hf-llama/config.json"):
        assert (tmp_path / "run" / name).is_file()
    # both exports are the trained model: our class with LNS, and stock Llama with it folded in
    from depthcurse.loading import load_model

    ours, stock = load_model(str(tmp_path / "run" / "hf")).model, load_model(str(tmp_path / "run" / "hf-llama")).model
    assert type(ours).__name__ == "DepthcurseLlamaForCausalLM" and type(stock).__name__ == "LlamaForCausalLM"
    ids = torch.arange(1, 30)[None]
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids).logits, stock(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    # lr: linear warm-up over 2 steps, then cosine to 10% of the peak at the last step
    lrs = [r["lr"] for r in logged]
    assert lrs[:2] == pytest.approx([cfg.resolved().lr * 0.5, cfg.resolved().lr])
    assert train.lr_factor(8, 2, 8, 0.1) == pytest.approx(0.1)
    assert train.lr_factor(5, 2, 8, 0.1) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 3 / 6)))


def test_every_evaluation_logs_the_layers(cfg, tmp_path, monkeypatch):
    """Per layer at each evaluation: the gradient norms of the step just taken (they make up the
    step's gradient norm with the rest of the model's), the residual variance and the identity
    distance of the model as it is then (checked against `identity_distances` on the same model)."""
    from depthcurse.identity import identity_distances

    seen = {}
    real_step = train.train_step

    def spy(model, *args, **kwargs):
        out = real_step(model, *args, **kwargs)
        if kwargs.get("per_layer") is not None:  # the gradients of the step, as train_step measured them
            rest = sum(p.grad.double().pow(2).sum().item() for n, p in model.named_parameters() if ".layers." not in n and p.grad is not None)
            seen[len(seen)] = (out[1].item(), out[2], rest)
        return out

    monkeypatch.setattr(train, "train_step", spy)
    train.run(cfg, tmp_path / "run")
    evals = [r for r in MetricsLog(tmp_path / "run" / METRICS).rows() if "val_loss" in r]
    assert [r["step"] for r in evals] == [4, 8]
    for (total, layers, rest), row in zip(seen.values(), evals):
        assert row["layer_grad_norm"] == layers and len(layers) == 3
        assert math.sqrt(sum(g * g for g in layers) + rest) == pytest.approx(total, rel=1e-5)  # no clipping in this run
        assert len(row["layer_variance"]) == len(row["identity_distance"]) == len(row["attn_gain"]) == len(row["mlp_gain"]) == 3
        assert row["layer_metrics_tokens"] == 64 and all(d > 0 for d in row["identity_distance"])
    # the last row is the trained model's: the same numbers as measuring the exported weights directly
    model = train.build_model(cfg.resolved(), 400, torch.device("cpu"), "fp32")
    model.load_state_dict(load_checkpoint(tmp_path / "run" / CHECKPOINT)["model"])
    data = D.build_data(str(cfg.data), D.run_tokenizer(str(cfg.tokenizer), str(cfg.data), tmp_path / "run" / "tokenizer"), seq_len=16, pack=True, seed=42, val_tokens=64)
    ids, lengths = data.val_rows, data.val_lengths
    mask = (torch.arange(16)[None] < lengths[:, None]).long()
    want = identity_distances(model.model.layers, [(ids, mask)], lambda i, m: model.model(i), tokens=512, probes=2)
    assert evals[-1]["identity_distance"] == pytest.approx(want.identity, rel=1e-6)
    assert evals[-1]["layer_variance"] == pytest.approx(want.variance, rel=1e-6)


def test_validation_loss_matches_a_direct_computation(cfg, tmp_path):
    """The reported validation loss is the mean next-token loss of the exported model on the
    held-out rows, recomputed here with transformers' Llama (the stock export)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    summary = train.run(cfg, tmp_path / "run")
    llama = LlamaForCausalLM.from_pretrained(tmp_path / "run" / "hf-llama").eval()
    tok = AutoTokenizer.from_pretrained(tmp_path / "run" / "hf-llama")
    data = D.build_data(cfg.data, tok, seq_len=16, pack=True, seed=42, val_tokens=64)
    total = count = 0
    with torch.no_grad():
        for row in data.val_rows:
            logits = llama(input_ids=row[None]).logits[0, :-1]
            total += torch.nn.functional.cross_entropy(logits, row[1:], reduction="sum").item()
            count += len(row) - 1
    assert summary["val_tokens"] == count > 0
    assert summary["val_loss"] == pytest.approx(total / count, rel=1e-5)


def test_a_kill_between_checkpoints_logs_every_step_once_after_the_resume(cfg, tmp_path):
    cfg.save_every = 4

    def killed_at_step_6(progress):
        if progress.step == 6:
            raise KeyboardInterrupt  # logged up to step 6, last checkpoint at step 4

    train.run(cfg, tmp_path / "a")
    with pytest.raises(KeyboardInterrupt):
        train.run(cfg, tmp_path / "b", on_progress=killed_at_step_6)
    assert [r["step"] for r in MetricsLog(tmp_path / "b" / METRICS).rows() if "loss" in r] == [1, 2, 3, 4, 5, 6]
    train.run(cfg, tmp_path / "b", resume=True)
    assert [r["step"] for r in MetricsLog(tmp_path / "b" / METRICS).rows() if "loss" in r] == list(range(1, 9))
    assert losses(tmp_path / "b") == pytest.approx(losses(tmp_path / "a"), rel=1e-6, abs=1e-6)


def test_a_presets_validation_budget_only_caps_while_an_asked_one_warns(cfg, tmp_path, caplog):
    cfg.steps, cfg.warmup, cfg.eval_every, cfg.save_every = 1, 0, 1, 1
    cfg.val_tokens = None  # the tiny preset's 32,768: far more than the test text holds
    with caplog.at_level("WARNING", logger="depthcurse"):
        summary = train.run(cfg, tmp_path / "preset")
    assert 0 < summary["val_tokens"] < 32768 and "held-out" not in caplog.text
    cfg.val_tokens = 10**6
    with caplog.at_level("WARNING", logger="depthcurse"):
        train.run(cfg, tmp_path / "asked")
    assert "asked for --val-tokens 1000000" in caplog.text


def test_gradient_accumulation_changes_nothing(cfg, tmp_path):
    cfg.steps, cfg.eval_every, cfg.save_every = 3, 3, 3
    whole = train.run(cfg, tmp_path / "whole")
    cfg.micro_batch = 1
    split = train.run(cfg, tmp_path / "split")
    assert losses(tmp_path / "split") == pytest.approx(losses(tmp_path / "whole"), rel=1e-5)
    assert split["val_loss"] == pytest.approx(whole["val_loss"], rel=1e-5)


def test_largest_micro_batch_halves_it_while_memory_runs_out(cfg, tmp_path, monkeypatch):
    """--largest-micro-batch: the whole batch first, halved while a step runs out of memory (here
    any training micro-batch of more than 2 sequences, as a GPU would raise, after leaving
    gradients behind); the run then trains as one given --micro-batch 2, loss for loss."""
    assert train.micro_batches_to_try(8, 1) == [8, 4, 2, 1]
    assert train.micro_batches_to_try(48, 16) == [48, 24, 16] and train.micro_batches_to_try(64, 64) == [64]
    cfg.steps, cfg.eval_every, cfg.save_every, cfg.batch_size = 3, 3, 3, 8
    given = train.run(TrainConfig(**{**cfg.to_dict(), "micro_batch": 2}), tmp_path / "given")
    build, tried = train.build_model, []

    def short_of_memory(*args, **kwargs):
        model = build(*args, **kwargs)
        good = model.loss_fn

        def loss_fn(hidden, weight, targets):
            if torch.is_grad_enabled():
                tried.append(hidden.shape[0])
                if hidden.shape[0] > 2:
                    for p in model.parameters():  # what a part-finished step leaves
                        p.grad = torch.full_like(p, 1e3)
                    raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return good(hidden, weight, targets)

        model.loss_fn = loss_fn
        return model

    monkeypatch.setattr(train, "build_model", short_of_memory)
    fitted = train.run(TrainConfig(**{**cfg.to_dict(), "micro_batch": 1, "largest_micro_batch": True}), tmp_path / "fitted")
    assert tried == [8, 4] + [2] * 4 * 3  # then 4 micro-batches of 2 in each of the 3 steps
    assert fitted["micro_batch"] == 2 and {r["micro_batch"] for r in MetricsLog(tmp_path / "fitted" / METRICS).rows() if "loss" in r} == {2}
    assert losses(tmp_path / "fitted") == losses(tmp_path / "given")
    assert fitted["val_loss"] == given["val_loss"]
    tried.clear()
    with pytest.raises(DepthcurseError, match="out of cpu memory in a training step of micro-batches of 4 sequences: try a smaller --micro-batch"):
        train.run(TrainConfig(**{**cfg.to_dict(), "micro_batch": 4, "largest_micro_batch": True}), tmp_path / "too-big")
    assert tried == [8, 4]
    with pytest.raises(DepthcurseError, match="micro-batches of 4 sequences: try a smaller --micro-batch, or --activation-checkpointing, or --largest-micro-batch"):
        train.run(TrainConfig(**{**cfg.to_dict(), "micro_batch": 4}), tmp_path / "given-too-big")


def test_largest_micro_batch_compiles_the_size_that_fits_as_a_given_one(cfg, tmp_path, monkeypatch):
    """Under --compile, a size that fits after sizes that ran out of memory gets static graphs, as a
    run given that --micro-batch does: dynamo would otherwise fail its size guards and make the batch
    size dynamic. It trains the same, loss for loss."""
    from torch._dynamo.utils import guard_failures

    cfg.steps, cfg.eval_every, cfg.save_every, cfg.batch_size = 2, 2, 2, 8
    compiled = {**cfg.to_dict(), "compile": True, "kernels": "off", "layer_metrics_tokens": 0}
    torch._dynamo.reset()
    given = train.run(TrainConfig(**{**compiled, "micro_batch": 2}), tmp_path / "given")
    # at the final norm, after the compiled blocks ran at this size
    _out_of_memory_at_the_final_norm(monkeypatch, lambda hidden: torch.is_grad_enabled() and hidden.shape[0] > 2)
    # Not a count of graphs: how many a run compiles depends on inductor's on-disk cache (a cold
    # one specialises LNS's float scale once more).
    size_guards = []
    reset = torch._dynamo.reset
    monkeypatch.setattr(torch._dynamo, "reset", lambda: (size_guards.extend(_size_guards(guard_failures)), reset()))
    reset()  # the given run's guards are not counted
    fitted = train.run(TrainConfig(**{**compiled, "micro_batch": 1, "largest_micro_batch": True}), tmp_path / "fitted")
    size_guards.extend(_size_guards(guard_failures))
    assert fitted["micro_batch"] == 2
    assert size_guards == []
    assert losses(tmp_path / "fitted") == losses(tmp_path / "given") and fitted["val_loss"] == given["val_loss"]


def _out_of_memory_at_the_final_norm(patch, when) -> None:
    """Models built by the run raise a GPU's out-of-memory error at their final norm where `when(its input)`."""
    build = train.build_model

    def short_of_memory(*args, **kwargs):
        model = build(*args, **kwargs)

        def forward_hook(module, inputs, output):
            if when(inputs[0]):
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

        model.model.norm.register_forward_hook(forward_hook)
        return model

    patch.setattr(train, "build_model", short_of_memory)


def _size_guards(guard_failures) -> list[str]:
    return [reason for reasons in guard_failures.values() for reason in reasons if "size mismatch" in str(reason)]


def test_validation_out_of_memory_is_one_line_and_the_run_resumes_from_the_last_checkpoint(cfg, tmp_path, monkeypatch):
    """A validation forward out of memory (at step 4, before its checkpoint) names the batch and the
    checkpoint kept (step 2); resumed, the run ends as one never stopped."""
    straight = train.run(cfg, tmp_path / "straight")
    with monkeypatch.context() as patch:
        _out_of_memory_at_the_final_norm(patch, lambda hidden: not torch.is_grad_enabled())
        with pytest.raises(DepthcurseError, match=r"^out of cpu memory in validation, in batches of 2 sequences: try a smaller --micro-batch; "
                                                  r"the last good checkpoint \(step 2\) is kept in "):
            train.run(cfg, tmp_path / "b")
    resumed = train.run(cfg, tmp_path / "b", resume=True)
    assert losses(tmp_path / "b") == pytest.approx(losses(tmp_path / "straight"), rel=1e-6, abs=1e-6)
    assert resumed["val_loss"] == pytest.approx(straight["val_loss"], rel=1e-6)


def _poison(monkeypatch, bad, factor: float) -> None:
    """Training micro-batches numbered (from 1) so that `bad(n)` get their loss times `factor`."""
    build, calls = train.build_model, {"n": 0}

    def poisoned(*args, **kwargs):
        model = build(*args, **kwargs)
        good = model.loss_fn

        def loss_fn(hidden, weight, targets):
            calls["n"] += torch.is_grad_enabled()  # count training micro-batches, not validation ones
            loss = good(hidden, weight, targets)
            return loss * factor if torch.is_grad_enabled() and bad(calls["n"]) else loss

        model.loss_fn = loss_fn
        return model

    monkeypatch.setattr(train, "build_model", poisoned)


def test_nan_stops_and_keeps_last_good_checkpoint(cfg, tmp_path, monkeypatch):
    _poison(monkeypatch, lambda n: n > 2 * 5, float("nan"))  # 2 micro-batches per step: step 6 goes NaN
    with pytest.raises(DepthcurseError, match=r"diverged at step 6 .*last good checkpoint \(step 4\)"):
        train.run(cfg, tmp_path / "run")
    ckpt = load_checkpoint(tmp_path / "run" / CHECKPOINT)
    assert ckpt["train_state"]["step"] == 4
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values())
    assert not (tmp_path / "run" / SUMMARY).exists()


def test_a_divergence_between_log_steps_names_its_step_and_keeps_the_checkpoint_before_it(cfg, tmp_path, monkeypatch):
    """The losses are read every few steps, not after each: the first bad step is still the one
    named, and no checkpoint is written after it (the read before each save finds it)."""
    cfg.log_every, cfg.save_every, cfg.eval_every = 3, 4, 100
    _poison(monkeypatch, lambda n: n in (9, 10), float("inf"))  # step 5's micro-batches: read at step 6
    with pytest.raises(DepthcurseError, match=r"diverged at step 5 .*last good checkpoint \(step 4\)"):
        train.run(cfg, tmp_path / "run")
    assert load_checkpoint(tmp_path / "run" / CHECKPOINT)["train_state"]["step"] == 4
    assert [r["step"] for r in MetricsLog(tmp_path / "run" / METRICS).rows()] == [3]


def _tiny_model():
    from depthcurse.train.model import ModelConfig, Transformer

    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4, max_seq_len=32, norm="lns"))


def _random_batch(rows=4, seq=16, vocab=96):
    ids = torch.randint(0, vocab, (rows, seq + 1), generator=torch.Generator().manual_seed(1))
    return D.Batch(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())


@pytest.mark.parametrize("checkpointing", [False, True])
def test_bf16_mixed_casts_each_weight_once_per_step_and_computes_what_per_micro_batch_autocast_does(checkpointing):
    """One autocast region over the step's micro-batches: each fp32 weight is cast to bf16 once
    (the recomputed forwards of activation checkpointing too), where autocast around each
    micro-batch casts it once per micro-batch; the weights after the step are bit for bit
    those of that plain loop."""
    from torch.utils._python_dispatch import TorchDispatchMode

    batch, cpu = _random_batch(), torch.device("cpu")
    ours, theirs = _tiny_model(), _tiny_model()
    ours.set_activation_checkpointing(checkpointing)
    theirs.set_activation_checkpointing(checkpointing)
    weights = {m.weight.data_ptr() for model in (ours, theirs) for m in model.modules() if isinstance(m, torch.nn.Linear)}

    class CountWeightCasts(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in weights and (kwargs or {}).get("dtype") == torch.bfloat16:
                CountWeightCasts.n += 1
            return func(*args, **(kwargs or {}))

    opt_ours, opt_theirs = torch.optim.Adam(ours.parameters(), lr=1e-2), torch.optim.Adam(theirs.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt_ours, lambda s: 1.0)
    with CountWeightCasts():
        loss, _ = train.train_step(ours, opt_ours, sched, batch, 1, train.autocast_for("bf16-mixed", cpu), 0.0, cpu)
    assert CountWeightCasts.n == len(weights) / 2  # 4 micro-batches, each linear weight cast once

    CountWeightCasts.n = 0
    opt_theirs.zero_grad()
    total = 0.0
    with CountWeightCasts():
        for ids, targets in zip(batch.input_ids.split(1), batch.targets.split(1)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                part = theirs(ids, targets) / batch.tokens
            part.backward()
            total += part.item()
    assert CountWeightCasts.n == 4 * len(weights) / 2 * (1 + checkpointing) - 4 * checkpointing  # the head is not recomputed
    opt_theirs.step()
    assert loss.item() == pytest.approx(total, rel=1e-6)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("scope", ["blocks", "model"])
def test_compile_covers_the_loss_and_trains_as_the_eager_model(cfg, scope):
    """--compile with the plain model compiles each block and the head's loss (or, with
    `--compile-scope model`, the whole forward); two steps match the eager model's losses and
    weights, and its per-layer metrics the eager model's."""
    from depthcurse.train.distributed import parallelize

    c = TrainConfig(**{**cfg.to_dict(), "compile": True, "compile_scope": scope, "kernels": "off"}).resolved()
    cpu, batch = torch.device("cpu"), _random_batch()
    eager, compiled = _tiny_model(), parallelize(_tiny_model(), c, train.World(), cpu)
    compiled_parts = [compiled.forward] if scope == "model" else [compiled.loss_fn, compiled.model.layers[0].forward]
    assert all(hasattr(f, "_torchdynamo_orig_callable") for f in compiled_parts)
    got = {}
    for name, model in (("eager", eager), ("compiled", compiled)):
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        got[name] = [train.train_step(model, opt, sched, batch, 2, contextlib.nullcontext(), 1.0, cpu)[0].item() for _ in range(2)]
    assert got["compiled"] == pytest.approx(got["eager"], rel=1e-5)
    for a, b in zip(eager.parameters(), compiled.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # the per-layer metrics of an evaluation go through the blocks' own forwards (a compiled one
    # carries no tangent for the identity distance), and the compiled ones are back after
    val = types.SimpleNamespace(val_rows=batch.input_ids, val_lengths=torch.full((4,), 16))
    profiles = [train.layer_profile(m, val, 64, 2, cpu) for m in (eager, compiled)]
    for key in ("identity_distance", "attn_gain", "mlp_gain", "layer_variance"):
        assert profiles[1][key] == pytest.approx(profiles[0][key], rel=1e-4), key
    assert all(hasattr(f, "_torchdynamo_orig_callable") for f in compiled_parts)


# Measured on an H100, torch 2.11 (docs/benchmarks.md, 2026-11-24): CUDA graphs do not train
# here; the blocks' case dies of a segmentation fault, which would end the whole pytest run.
CUDA_GRAPHS_FAIL = pytest.mark.xfail(run=False, reason="blocks: segmentation fault; model: overwritten CUDA-graph outputs (torch 2.11, H100)")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and GPU autotuning need a GPU")
@pytest.mark.parametrize("scope,mode", [pytest.param("blocks", "reduce-overhead", marks=CUDA_GRAPHS_FAIL),
                                        pytest.param("model", "reduce-overhead", marks=CUDA_GRAPHS_FAIL),
                                        ("model", "max-autotune-no-cudagraphs")])
def test_cuda_compile_modes_train_as_the_eager_model(cfg, scope, mode):
    """On a GPU, in bf16-mixed: CUDA graphs replayed across micro-batches (gradients accumulate
    between replays) and autotuned matmuls train as the eager model does, to bf16's noise."""
    from depthcurse.train.distributed import parallelize

    c = TrainConfig(**{**cfg.to_dict(), "compile": True, "compile_scope": scope, "compile_mode": mode, "kernels": "off"}).resolved()
    gpu, batch = torch.device("cuda"), _random_batch()
    amp = train.autocast_for("bf16-mixed", gpu)
    eager, compiled = _tiny_model().to(gpu), parallelize(_tiny_model().to(gpu), c, train.World(), gpu)
    got = {}
    for name, model in (("eager", eager), ("compiled", compiled)):
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        got[name] = [train.train_step(model, opt, sched, batch, 1, amp, 1.0, gpu)[0].item() for _ in range(3)]
    assert got["compiled"] == pytest.approx(got["eager"], rel=2e-2)
    assert got["compiled"][2] < got["compiled"][0]  # it learns: the gradients were not lost between replays


def test_logged_tflops_count_palms_flops_per_token(cfg, tiny_tokenizer, tmp_path):
    """Training FLOPs per token: 6 x (the parameters outside the input embedding, counted from the
    shapes) + 12 L d T; every logged step's TFLOP/s is its tokens/s times that."""
    L, d, i, T = 3, 32, 48, cfg.seq_len

    def expected(V):  # attention, SwiGLU and two norms per block; the final norm; the head
        return 6 * (L * (4 * d * d + 3 * d * i + 2 * d) + d + V * d) + 12 * L * d * T

    assert _tiny_model().flops_per_token(T) == expected(96)
    summary = train.run(cfg, tmp_path / "run")  # the same shape, with the tokenizer's vocabulary
    per_token = summary["step_tflops"] * 1e12 / summary["step_tokens_per_s"]
    assert per_token == pytest.approx(expected(len(tiny_tokenizer)))
    rows = [r for r in MetricsLog(tmp_path / "run" / METRICS).rows() if "loss" in r]
    for r in rows:
        assert r["tflops"] == pytest.approx(r["tokens_per_s"] * per_token / 1e12)


def test_refuses_to_mix_runs(cfg, tmp_path):
    cfg.steps = 2
    train.run(cfg, tmp_path / "run")
    with pytest.raises(DepthcurseError, match="already holds a run: pass --resume"):
        train.run(cfg, tmp_path / "run")
    cfg.lr = 5e-3
    with pytest.raises(DepthcurseError, match=r"holds a different training run \(differs in: lr: 0.001 -> 0.005\)"):
        train.run(cfg, tmp_path / "run", resume=True)


def test_local_order_is_seeded_sharded_and_resumable():
    rows = torch.arange(40).view(10, 4)
    lengths = torch.full((10,), 4)
    a = D.LocalRows(rows, lengths, seed=3)
    first = [a.next_batch(3).input_ids[:, 0].tolist() for _ in range(5)]  # 15 rows: crosses an epoch
    seen = [r for batch in first for r in batch]
    assert sorted(seen[:10]) == list(range(0, 40, 4))  # one epoch is a permutation of all rows
    b = D.LocalRows(rows, lengths, seed=3)
    b.next_batch(3), b.next_batch(3)
    c = D.LocalRows(rows, lengths, seed=3)
    c.load_state_dict(b.state_dict())
    assert [c.next_batch(3).input_ids[:, 0].tolist() for _ in range(3)] == first[2:]
    r0, r1 = D.LocalRows(rows, lengths, seed=3, rank=0, world_size=2), D.LocalRows(rows, lengths, seed=3, rank=1, world_size=2)
    s0, s1 = set(r0.next_batch(5).input_ids[:, 0].tolist()), set(r1.next_batch(5).input_ids[:, 0].tolist())
    assert not s0 & s1 and len(s0 | s1) == 10


@pytest.fixture()
def fake_c4(monkeypatch, tmp_path):
    """C4's hub stream replaced by a local JSONL file streamed through the same datasets calls."""
    datasets = pytest.importorskip("datasets")
    docs = ["x" if i % 9 == 4 else " ".join([CORPUS[i % len(CORPUS)]] * (1 + i % 4)) + f" Document {i}." for i in range(200)]  # "x": one token, no row
    path = tmp_path / "c4.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    real = datasets.load_dataset

    def load(name, *args, split=None, streaming=False, **kwargs):
        assert name == D.C4_REPO and streaming
        return real("json", data_files=str(path), split="train", streaming=True)

    monkeypatch.setattr(datasets, "load_dataset", load)
    return docs


def _rows_one_document_at_a_time(tok, docs, seq_len, pack, batches, n):
    """The reference: each document tokenised on its own, in stream order, into rows."""
    carry, out, docs = [], [], iter(docs)
    for _ in range(batches):
        ids_list = []
        while len(ids_list) < n:
            ids = tok(next(docs), add_special_tokens=not pack)["input_ids"]
            if pack:
                carry += ids + [tok.eos_token_id]
                while len(carry) >= seq_len and len(ids_list) < n:
                    ids_list.append(carry[:seq_len])
                    carry = carry[seq_len:]
            elif len(ids) >= 2:
                ids_list.append(ids)
        out.append(D.make_rows(ids_list, seq_len, tok.pad_token_id, None, pack=False)[0])
    return out


@pytest.mark.parametrize("pack", [True, False])
def test_no_held_out_document_is_trained_on(tiny_tokenizer, tmp_path, pack):
    """Every document is distinct (a numbered marker in it): the documents seen in the training
    rows and those in the validation rows are two disjoint sets, together all of them."""
    import re

    docs = [f"marker{i}x {CORPUS[i % len(CORPUS)]}" for i in range(40)]
    path = tmp_path / "docs.txt"
    path.write_text("\n\n".join(docs), encoding="utf-8")
    data = D.build_data(str(path), tiny_tokenizer, seq_len=16 if pack else 64, pack=pack, seed=0, val_tokens=10_000)

    def markers(rows, lengths):
        text = "".join(tiny_tokenizer.decode(row[:n]) for row, n in zip(rows.tolist(), lengths.tolist()))
        return {int(m) for m in re.findall(r"marker(\d+)x", text)}

    trained, held_out = markers(data.train.rows, data.train.lengths), markers(data.val_rows, data.val_lengths)
    assert held_out and trained and not trained & held_out
    assert len(trained | held_out) >= 38  # packing drops a last partial row, nothing more


def test_documents_tokenised_many_per_call_are_those_of_one_at_a_time(tiny_tokenizer, monkeypatch):
    monkeypatch.setattr(D, "TOKENISE_DOCS", 7)
    texts = [" ".join(CORPUS[: 1 + i % len(CORPUS)]) for i in range(20)]
    for pack in (True, False):
        want = [tiny_tokenizer(t, add_special_tokens=not pack)["input_ids"] for t in texts]
        assert D.tokenise(tiny_tokenizer, texts, pack) == want


@pytest.mark.parametrize("pack", [True, False])
def test_c4_rows_tokenised_ahead_are_those_of_one_document_at_a_time_and_resume_exactly(fake_c4, tiny_tokenizer, monkeypatch, tmp_path, pack):
    """C4 documents are tokenised several per call; the rows are those of tokenising each in
    turn, and a state saved between batches (documents tokenised but not yet in a row
    included) gives the same next batch (without a shuffle buffer, the stream's position is exact)."""
    monkeypatch.setattr(D, "TOKENISE_DOCS", 7)  # batches that end inside a call, and calls inside a batch
    rows = D.C4Rows(tiny_tokenizer, seq_len=16, pack=pack, seed=0, buffer=1)
    got = [rows.next_batch(5).input_ids for _ in range(4)]
    want = _rows_one_document_at_a_time(tiny_tokenizer, fake_c4, 16, pack, 4, 5)
    for g, w in zip(got, want):
        assert torch.equal(g, w)

    rows = D.C4Rows(tiny_tokenizer, seq_len=16, pack=pack, seed=0, buffer=1)
    rows.next_batch(5), rows.next_batch(5)
    torch.save(rows.state_dict(), tmp_path / "data.pt")
    rows_state = torch.load(tmp_path / "data.pt", weights_only=True)  # as a checkpoint reads it
    assert rows_state["pending"], "the test should save documents tokenised ahead"
    resumed = D.C4Rows(tiny_tokenizer, seq_len=16, pack=pack, seed=0, buffer=1)
    resumed.load_state_dict(rows_state)
    assert torch.equal(resumed.next_batch(5).input_ids, got[2])


def test_c4_training_end_to_end_resumes_exactly_without_a_shuffle_buffer(cfg, fake_c4, monkeypatch, tmp_path):
    """The papers' data path on a local stand-in for C4's stream: training and validation rows
    come through C4Rows, and a run stopped at step 4 resumes to the straight run's losses (with
    the shuffle buffer off, where the stream's saved position is exact)."""
    import datasets

    monkeypatch.setattr(D.assets, "hub_reachable", lambda: True)
    monkeypatch.setattr(datasets.IterableDataset, "shuffle", lambda self, **kwargs: self)
    c = TrainConfig(**{**cfg.to_dict(), "data": "c4", "pack": False})
    straight = train.run(c, tmp_path / "a")
    train.run(c, tmp_path / "b", stop_after=4)
    resumed = train.run(c, tmp_path / "b", resume=True)
    assert len(losses(tmp_path / "b")) == 8
    assert losses(tmp_path / "b") == pytest.approx(losses(tmp_path / "a"), rel=1e-6, abs=1e-6)
    assert resumed["val_loss"] == pytest.approx(straight["val_loss"], rel=1e-6)
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["data"] == "c4-en"


def test_padding_is_never_a_target():
    rows, lengths = D.make_rows([[5, 6, 7], [8, 9, 10, 11, 12, 13], [1]], seq_len=4, pad_id=0, eos_id=None, pack=False)
    assert rows.tolist() == [[5, 6, 7, 0], [8, 9, 10, 11]] and lengths.tolist() == [3, 4]
    assert D.targets_for(rows, lengths).tolist() == [[6, 7, -100, -100], [9, 10, 11, -100]]
    packed, plen = D.make_rows([[5, 6, 7], [8, 9]], seq_len=3, pad_id=0, eos_id=2, pack=True)
    assert packed.tolist() == [[5, 6, 7], [2, 8, 9]] and plen.tolist() == [3, 3]


def test_bad_training_input(cfg, tmp_path):
    bad = [
        (dict(norm="deep"), "unknown norm 'deep'"),
        (dict(preset="7b"), "unknown preset '7b'"),
        (dict(seq_len=64), "--seq-len 64 is longer than the model allows \\(32\\)"),
        (dict(batch_size=4, micro_batch=3), "not a multiple of --micro-batch"),
        (dict(lr=float("nan")), "--lr must be a positive number"),
        (dict(optimizer="sgd"), "unknown optimizer"),
        (dict(compile=True, compile_scope="graph"), "unknown --compile-scope 'graph': use blocks or model"),
        (dict(compile=True, compile_mode="fast"), "unknown --compile-mode 'fast': use one of default, reduce-overhead"),
        (dict(compile_mode="max-autotune"), "--compile-scope and --compile-mode say how to compile: they need --compile"),
        (dict(compile=True, compile_scope="model", parallel="fsdp"), "--compile-scope model does not run under --parallel fsdp"),
    ]
    for change, message in bad:
        c = TrainConfig(**{**cfg.to_dict(), **change})
        with pytest.raises(DepthcurseError, match=message):
            train.run(c, tmp_path / "bad")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n  \n")
    with pytest.raises(DepthcurseError, match="holds no text"):
        train.run(TrainConfig(**{**cfg.to_dict(), "data": str(empty)}), tmp_path / "empty")


def test_cli_train_report_and_prune_the_export(run_cli, text_file, tok_dir, tmp_path):
    common = ["--data", text_file, "--tokenizer", tok_dir, "--seq-len", "16", "--max-seq-len", "32", "--hidden-size", "32",
              "--intermediate-size", "48", "--num-layers", "3", "--heads", "4", "--steps", "4", "--batch-size", "4",
              "--val-tokens", "64", "--eval-every", "2", "--save-every", "2"]
    norms = ("pre", "mix", "dyt", "hybridnorm", "completep")
    for norm in norms:
        code, out, err = run_cli("lns-train", "--norm", norm, *common, "--out", tmp_path / norm)
        assert code == 0, err
        assert "validation loss" in out
    code, out, err = run_cli("lns-report", *(tmp_path / n for n in norms), "--out", tmp_path / "cmp")
    assert code == 0, err
    assert all(name in out for name in ("Pre-LN", "Mix-LN", "DyT", "HybridNorm", "CompleteP")), out
    rows = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert {r["norm"] for r in rows} == set(norms)
    assert set(METHOD_NAMES) == set(NORMS)  # every variant has its name in the table
    # the runs' per-layer metrics side by side (the path, printed at 80 columns, may wrap anywhere)
    assert (tmp_path / "cmp" / "layers.png").is_file() and "layers.png" in out.replace("\n", "")
    # the Mix-LN export is our own class: prune loads it without --trust-remote-code
    code, out, err = run_cli("prune", tmp_path / "mix" / "hf", "--task", "ppl", "--data", text_file, "--seq-len", "16", "--limit", "2", "--out", tmp_path / "prune")
    assert code == 0, err
    assert len(json.loads((tmp_path / "prune" / "prune.json").read_text())["variants"]) == 4

    cases = [
        (["--norm", "postln"], "unknown norm 'postln'"),
        (["--preset", "3b"], "unknown preset '3b'"),
        (["--seq-len", "64"], "longer than the model allows"),
        (["--data", tmp_path / "missing.txt"], "no such data file"),
        (["--mix-ratio", "2"], "--mix-ratio must be between 0 and 1"),
        (["--hidden-size", "30"], "--hidden-size 30 must split into --heads 4 heads of even size"),
        (["--layer-metrics-probes", "0"], "--layer-metrics-probes at least 1"),
    ]
    for extra, message in cases:
        code, out, err = run_cli("lns-train", *common, *extra, "--out", tmp_path / "bad")
        assert code == 1 and message in err and "Traceback" not in err, (extra, err)
        assert len(err.strip().splitlines()) == 1, err
        assert "━" not in out, out  # no progress bar left above the error
    # a start that failed on bad data leaves a folder the corrected command can use
    code, out, err = run_cli("lns-train", *common, "--out", tmp_path / "bad")
    assert code == 0, err
    code, out, err = run_cli("lns-train", "--norm", "pre", *common, "--lr", "0.002", "--resume", "--out", tmp_path / "pre")
    assert code == 1 and "holds a different training run (differs in: lr" in err
    # --resume where nothing was saved yet says that it starts from scratch
    code, out, err = run_cli("lns-train", *common, "--steps", "1", "--resume", "--out", tmp_path / "fresh")
    assert code == 0 and "holds no checkpoint yet, so the run starts from scratch" in err


def test_lns_report_shows_every_run_and_warns_when_they_cannot_be_compared(run_cli, tmp_path):
    """Two Pre-LN runs of one size with other tokenizers: a row each, and a warning."""
    from depthcurse.train import TrainConfig as Config

    for name, tokenizer, ppl in (("pre-smollm", None, 40.0), ("pre-bpe", "bpe:4096", 25.0), ("lns-bpe", "bpe:4096", 24.0)):
        folder = tmp_path / name
        folder.mkdir()
        config = {**Config(norm=name.split("-")[0], tokenizer=tokenizer).resolved().to_dict()}
        (folder / "config.json").write_text(json.dumps(config))
        (folder / "summary.json").write_text(json.dumps({"finished": True, "step": 2000, "val_loss": math.log(ppl), "val_ppl": ppl}))
    code, out, err = run_cli("lns-report", *(tmp_path / n for n in ("pre-smollm", "pre-bpe", "lns-bpe")), "--out", tmp_path / "cmp")
    assert code == 0, err
    assert "Pre-LN · pre-smollm" in out and "Pre-LN · pre-bpe" in out and "40.00" in out and "25.00" in out
    assert "Pre-LN + LNS" in out and "24.00" in out
    assert "the tiny runs differ in tokenizer (None / bpe:4096): their perplexities cannot be compared" in err
    assert "over seeds" not in out  # no two runs differ only in their seed


def test_lns_report_gives_the_mean_and_spread_over_seeds(run_cli, tmp_path):
    from depthcurse.train import TrainConfig as Config

    losses = {1: 5.0, 2: 5.2, 3: 5.3}
    for seed, loss in losses.items():
        folder = tmp_path / f"lns-s{seed}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(Config(norm="lns", seed=seed, eval_every=10 * seed).resolved().to_dict()))
        (folder / "summary.json").write_text(json.dumps({"finished": True, "step": 2000, "val_loss": loss, "val_ppl": math.exp(loss)}))
    other = tmp_path / "lns-wide"  # another width: not one of the seeds
    other.mkdir()
    (other / "config.json").write_text(json.dumps(Config(norm="lns", seed=4, hidden_size=256).resolved().to_dict()))
    (other / "summary.json").write_text(json.dumps({"finished": True, "step": 2000, "val_loss": 4.0, "val_ppl": math.exp(4.0)}))
    code, out, err = run_cli("lns-report", *sorted(tmp_path.glob("lns-*")), "--out", tmp_path / "cmp")
    assert code == 0, err
    rows = (tmp_path / "cmp" / "seeds.csv").read_text().splitlines()
    assert len(rows) == 2 and rows[1].startswith("Pre-LN + LNS,lns,authors,tiny,1 2 3,3,")
    import csv

    row = next(csv.DictReader((tmp_path / "cmp" / "seeds.csv").open()))
    mean = sum(losses.values()) / 3
    assert float(row["val_loss_mean"]) == pytest.approx(mean)
    assert float(row["val_loss_sd"]) == pytest.approx(math.sqrt(sum((x - mean) ** 2 for x in losses.values()) / 2))
    assert (float(row["val_loss_min"]), float(row["val_loss_max"])) == (5.0, 5.3)
    assert "over seeds" in out.replace("\n", " ")


def test_lns_report_says_which_init_a_variant_with_its_authors_own_was_trained_with(run_cli, tmp_path):
    """HybridNorm with its authors' init and with LLaMA's (`--init common`, or a run from before
    --init, whose config has none) are separate rows, each named with its init; Pre-LN, whose authors'
    init is LLaMA's, is named plainly."""
    from depthcurse.train import TrainConfig as Config

    for name, norm, init, ppl in (("hn-authors", "hybridnorm", "authors", 230.0), ("hn-common", "hybridnorm", "common", 990.0),
                                  ("hn-old", "hybridnorm", None, 991.0), ("pre", "pre", "authors", 270.0)):
        folder = tmp_path / name
        folder.mkdir()
        config = Config(norm=norm, **({"init": init} if init else {})).resolved().to_dict()
        if init is None:
            del config["init"]
        (folder / "config.json").write_text(json.dumps(config))
        (folder / "summary.json").write_text(json.dumps({"finished": True, "step": 2000, "val_loss": math.log(ppl), "val_ppl": ppl}))
    code, out, err = run_cli("lns-report", *(tmp_path / n for n in ("hn-authors", "hn-common", "hn-old", "pre")), "--out", tmp_path / "cmp")
    assert code == 0, err
    lines = out.splitlines()
    assert any("HybridNorm (authors init)" in line and "230.00" in line for line in lines)
    assert any("HybridNorm (common init)" in line for line in lines) and any("Pre-LN " in line and "270.00" in line for line in lines)
    rows = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert {r["folder"].rsplit("/", 1)[-1]: r["init"] for r in rows} == {"hn-authors": "authors", "hn-common": "common", "hn-old": "common", "pre": "authors"}
