"""The `lns-train` loop: one trainer for every normalisation variant.

The pieces are separate, and compose (torchtitan's layout): `config` says what the run is,
`model` builds it, `distributed` wraps it for torchrun (DDP or FSDP2, compilation, activation
checkpointing), `data` feeds it, `checkpoint` saves and restores every part, `metrics` logs,
`export` writes the Hugging Face checkpoints at the end. This module joins them:

  TrainConfig.resolved -> build_model -> parallelize -> build_optimizer / build_scheduler
  -> train_step (gradient accumulation, clipping) -> StepLosses (divergence check) -> evaluate
  -> CheckpointManager.save / load -> MetricsLog -> export_run

A run lives in one folder: `config.json` (the resolved configuration), `checkpoint.pt` (model,
optimizer, scheduler, RNG and data position, rewritten atomically), `metrics.jsonl` (one JSON
object per logged step), `summary.json`, `loss.png`, and at the end `hf/` (a Hugging Face
checkpoint with the right norms) plus `hf-llama/` (a stock LlamaForCausalLM) for Pre-LN-family
variants.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import time
from pathlib import Path
from typing import Callable

import torch

from depthcurse.errors import DepthcurseError
from depthcurse.forecast import Forecast
from depthcurse.identity import identity_distances
from depthcurse.io import atomic_write, environment, json_text
from depthcurse.train.checkpoint import CheckpointManager, ModelState, OptimizerState, RNGState, TrainState, prepare_out_dir
from depthcurse.train.config import CONFIG, TrainConfig
from depthcurse.train.data import build_data, require_source, run_tokenizer
from depthcurse.runtime import World, peak_tflops
from depthcurse.train.distributed import eager_blocks, gradient_sync, parallelize, setup_world
from depthcurse.train.export import export_run
from depthcurse.train.metrics import METRICS, SUMMARY, MetricsLog, Progress
from depthcurse.train.tracking import open_trackers
from depthcurse.train.model import ModelConfig, Transformer, resolve_kernels
from depthcurse.train.norms import find_norm
from depthcurse.train.report import plot_layers, plot_loss


def precision_of(cfg: TrainConfig, device: torch.device) -> str:
    if cfg.precision != "auto":
        return cfg.precision
    # bf16 matmuls on a CPU are slow and gain nothing at tiny sizes.
    return "bf16-mixed" if device.type == "cuda" else "fp32"


def autocast_for(precision: str, device: torch.device):
    if precision == "bf16-mixed":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def model_config(cfg: TrainConfig, vocab_size: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_layers=cfg.num_layers, num_heads=cfg.num_heads, max_seq_len=cfg.max_seq_len,
        norm=cfg.norm, mix_ratio=cfg.mix_ratio, dyt_alpha_attn=cfg.dyt_alpha_attn, dyt_alpha_ffn=cfg.dyt_alpha_ffn, dyt_alpha_final=cfg.dyt_alpha_ffn,
        base_layers=cfg.base_layers, init=cfg.init,
    )


def build_model(cfg: TrainConfig, vocab_size: int, device: torch.device, precision: str) -> Transformer:
    torch.manual_seed(cfg.seed)  # same seed, same initial weights, whatever the norm, on every rank
    model = Transformer(model_config(cfg, vocab_size), kernels=resolve_kernels(cfg.kernels, device, cfg.compile)).to(device)
    model.set_fused_projections(cfg.fuse_projections)
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    return model


ADAM_EPS = 1e-8


def build_optimizer(cfg: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """Adam(W) over what trains. CompleteP (alpha = 1) scales Adam's eps by L0/L (the code's
    `adam_eps *= depth_multiplier ** -alpha`), and the learning rates by (L/L0)^(alpha - 1) = 1."""
    cls = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
    params = [p for p in model.parameters() if p.requires_grad]
    fused = {"fused": True} if params and params[0].is_cuda else {}
    eps = ADAM_EPS * find_norm(cfg.norm).adam_eps_factor(cfg)
    return cls(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=eps, weight_decay=cfg.weight_decay, **fused)


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up to the peak, then cosine down to `min_ratio` of it at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg.warmup, cfg.steps, cfg.min_lr_ratio))


class Diverged(DepthcurseError):
    def __init__(self, step: int, why: str):
        super().__init__(why)
        self.step = step


def train_step(model, optimizer, scheduler, batch, micro_batch: int, amp, grad_clip: float, device, world: World = World(),
               per_layer: torch.nn.ModuleList | None = None) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, list[float]]:
    """One optimizer step over the global `batch`: this rank's slice of it, split into
    micro-batches. The loss is the mean over the global batch's real target tokens, whatever the
    split over ranks and micro-batches, so neither changes anything. Returns the loss and the
    gradient norm (before clipping) as tensors on the device: reading them waits for the GPU,
    so the step never does (`StepLosses` reads them at log, evaluation and save steps). With
    `per_layer` (the blocks), also each block's gradient norm, read at once."""
    n_tokens = batch.tokens  # every rank holds the whole global batch: no all-reduce needed
    # The whole slice moves once, without waiting: a copy from pageable memory would wait for
    # the GPU to finish the previous step's work, once per micro-batch.
    ids, targets = world.shard(batch.input_ids), world.shard(batch.targets)
    ids, targets = to_device(ids, device), to_device(targets, device)
    micro = list(zip(ids.split(micro_batch), targets.split(micro_batch)))
    optimizer.zero_grad(set_to_none=True)
    total = torch.zeros((), device=device)
    # One autocast region for the whole step: autocast keeps its bf16 copy of each fp32 weight
    # until the outermost region ends, so the weights are cast once per step, not per micro-batch.
    # Not under FSDP2: a kept cast was made by the first micro-batch's graph, whose cast node
    # the autograd engine runs last (the oldest), so in later micro-batches a weight's gradient
    # arrives after its block's post-backward has already reduce-scattered (2 ranks: 7.7e-3 off
    # in the loss by step 4, tests/test_distributed.py). Alone and under DDP it only arrives late.
    # The backward passes run with autocast off, as outside any region.
    step_amp, micro_amp = (contextlib.nullcontext(), amp) if world.parallel == "fsdp" else (amp, contextlib.nullcontext())
    with step_amp:
        for i, (ids, targets) in enumerate(micro):
            with gradient_sync(model, world, on=i == len(micro) - 1):
                with micro_amp:
                    loss = model(ids, targets) / n_tokens
                with autocast_off(device):
                    # DDP and FSDP average the ranks' gradients; the ranks' losses are shares of one sum.
                    (loss * world.size if world.size > 1 else loss).backward()
            total += loss.detach().float()
    total = world.sum(total)
    layer_norms = _layer_grad_norms(per_layer, world) if per_layer is not None else None
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    grad_norm = torch.nn.utils.get_total_norm(grads)
    if grad_clip > 0:
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), grad_clip, grad_norm)
    if hasattr(grad_norm, "full_tensor"):  # FSDP: a DTensor over the shards
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    scheduler.step()
    return (total, grad_norm) if layer_norms is None else (total, grad_norm, layer_norms)


def micro_batches_to_try(batch: int, floor: int) -> list[int]:
    """`--largest-micro-batch`'s candidates, largest first: the whole batch, halved while it stays
    a whole divisor of the batch and above `floor`, then `floor` (the preset's or --micro-batch)."""
    sizes = [batch]
    while sizes[-1] % 2 == 0 and sizes[-1] // 2 > floor:
        sizes.append(sizes[-1] // 2)
    if sizes[-1] != floor:
        sizes.append(floor)
    return sizes


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`; to a GPU from pinned memory, queued behind the work already there."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def autocast_off(device: torch.device):
    return torch.autocast(device_type=device.type, enabled=False)


class StepLosses:
    """The steps' losses and gradient norms, kept on the device until a log, evaluation or
    checkpoint step reads them all at once (one wait for the GPU instead of one per step). A
    step that diverged (a non-finite loss or norm, or a loss over `limit`) is found then, by
    its number: the weights in memory may have taken a few bad steps since, but the last
    checkpoint was written after a read that found every step before it good."""

    def __init__(self, limit: float):
        self.limit = limit
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    def add(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        self.pending.append((step, loss, grad_norm))

    def read(self) -> tuple[float, float]:
        """The last pending step's (loss, gradient norm), after checking every pending step."""
        values = torch.stack([torch.stack([loss.float(), norm.float().to(loss.device)]) for _, loss, norm in self.pending]).tolist()
        steps = [step for step, _, _ in self.pending]
        self.pending = []
        for step, (loss, norm) in zip(steps, values):
            if not (math.isfinite(loss) and math.isfinite(norm)):
                raise Diverged(step, f"loss {loss} / gradient norm {norm}")
            if loss > self.limit:
                raise Diverged(step, f"loss {loss:.3f}, over twice that of a uniform guess")
        return values[-1][0], values[-1][1]


def _layer_grad_norms(blocks: torch.nn.ModuleList, world: World) -> list[float]:
    """Each block's gradient norm. FSDP's gradients are shards: their squares are summed over the ranks."""
    device = next(blocks.parameters()).device
    squares = torch.stack([
        sum(((p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).detach().double().pow(2).sum()
             for p in block.parameters() if p.grad is not None), torch.zeros((), dtype=torch.float64, device=device))
        for block in blocks
    ])  # on the device: one transfer below, not one per parameter
    if world.parallel == "fsdp":
        squares = world.sum(squares)
    return squares.sqrt().cpu().tolist()


def layer_profile(raw, data, tokens: int, probes: int, device) -> dict:
    """Each block's residual variance (its input's) and identity distance and branch gains over
    the first `tokens` validation tokens, on the unwrapped model in its own precision (no autocast), kernels off."""
    ids, lengths = data.val_rows, data.val_lengths
    mask = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
    rows = [(ids[i : i + 8], mask[i : i + 8]) for i in range(0, len(ids), 8)]  # identity_distances reads only the first `tokens`
    was_training, kernels = raw.training, raw.model.kernels
    raw.eval()
    raw.model.kernels = "off"  # the fused path hands a block's last branch to the next one: J would not be the block's
    try:
        with eager_blocks(raw):
            got = identity_distances(raw.model.layers, rows, lambda ids, mask: raw.model(ids.to(device)), tokens=tokens, probes=probes)
    finally:
        raw.model.kernels = kernels
        raw.train(was_training)
    return {"layer_variance": got.variance, "identity_distance": got.identity, "attn_gain": got.attn_gain, "mlp_gain": got.mlp_gain,
            "layer_metrics_tokens": got.tokens}


def _layer_metrics(cfg, raw, data, device, world, layer_grad_norms) -> dict:
    """What an evaluation adds per layer: the gradient norms of the step just taken, and (alone or
    under DDP, on rank 0) the residual variance and identity distances on validation tokens. A
    failure there is noted in the row and never stops the run."""
    out = {"layer_grad_norm": layer_grad_norms}
    if world.parallel == "fsdp" or not world.main:  # FSDP's blocks hold shards: no single-rank forward
        return out
    try:
        out.update(layer_profile(raw, data, cfg.layer_metrics_tokens, cfg.layer_metrics_probes, device))
    except Exception as exc:  # a diagnostic: its failure is noted, and the run goes on
        out["layer_metrics_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return out


@torch.no_grad()
def evaluate(model, data, batch_size: int, amp, device) -> dict:
    """Mean next-token loss over the fixed validation rows, and its perplexity."""
    was_training = model.training
    model.eval()
    total, count = torch.zeros((), dtype=torch.float64, device=device), 0
    for batch in data.val_batches(batch_size):
        with amp:
            total += model(to_device(batch.input_ids, device), to_device(batch.targets, device)).double()
        count += batch.tokens
    model.train(was_training)
    loss = total.item() / count
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0)) if math.isfinite(loss) else float("nan"), "val_tokens": count}


def run(cfg: TrainConfig, out_dir, *, resume: bool = False, on_progress: Callable[[Progress], None] | None = None,
        on_eval: Callable[[int, dict], None] | None = None, on_start: Callable[[dict], None] | None = None,
        stop_after: int | None = None, on_note: Callable[[str], None] = lambda text: None) -> dict:
    """Train (or continue training) the run in `out_dir`; returns the summary.

    `stop_after` ends the call after that many total steps, as a preemption would (checkpoint
    written, no final evaluation or export): the next `resume=True` call continues exactly.
    Under torchrun every rank calls this; only rank 0 writes files or calls the callbacks. After the
    first step `on_note` hears the forecast of the steps (`forecast.Forecast`), which the summary keeps.
    """
    asked_val_tokens = cfg.val_tokens is not None  # a preset's budget only caps: no warning when the text is shorter
    cfg = cfg.resolved()
    world, device = setup_world(cfg)
    metrics = MetricsLog(Path(out_dir) / METRICS)
    try:
        return _run(cfg, Path(out_dir), world, device, resume, on_progress, on_eval, on_start, stop_after, asked_val_tokens, metrics, on_note)
    finally:
        metrics.close()  # the live trackers: a W&B run is finished, an event file closed
        world.close()


def _run(cfg, out_dir, world, device, resume, on_progress, on_eval, on_start, stop_after, asked_val_tokens, metrics, on_note) -> dict:
    started = time.perf_counter()
    cfg_dict = cfg.to_dict()
    saved = prepare_out_dir(out_dir, cfg_dict, resume)
    world.barrier()  # every rank has checked the folder before rank 0 writes into it
    if world.main and not (out_dir / CONFIG).exists() and (out_dir / "tokenizer").is_dir():
        shutil.rmtree(out_dir / "tokenizer")  # left by an attempt that failed before it started: maybe other data

    precision = precision_of(cfg, device)
    amp = autocast_for(precision, device)
    require_source(cfg.data)  # C4 offline is the data's problem, not the tokenizer's
    tokenizer = run_tokenizer(cfg.tokenizer, cfg.data, out_dir / "tokenizer", world)
    # One global stream on every rank (not rank-sharded): each rank takes its slice of the same
    # batch, so the run and its checkpoint do not depend on the number of ranks.
    data = build_data(cfg.data, tokenizer, seq_len=cfg.seq_len, pack=cfg.pack, seed=cfg.seed, val_tokens=cfg.val_tokens, warn_short=asked_val_tokens)
    raw = build_model(cfg, len(tokenizer), device, precision)
    if world.main:
        # Written once the data and the model are known to be usable: a failed start leaves a folder the corrected command can use.
        atomic_write(out_dir / CONFIG, json.dumps(cfg_dict, indent=2) + "\n")
    model = parallelize(raw, cfg, world, device)
    optimizer = build_optimizer(cfg, model)
    scheduler = build_scheduler(cfg, optimizer)
    micro_batch = min(cfg.micro_batch, cfg.batch_size // world.size)
    # Largest first: at 130M on an H100, one micro-batch of 512 trained 1.21x as fast as 8 of 64.
    to_try = micro_batches_to_try(cfg.batch_size, micro_batch) if cfg.largest_micro_batch else [micro_batch]

    progress = TrainState()
    checkpoints = CheckpointManager(out_dir, {
        "model": ModelState(model), "optimizer": OptimizerState(model, optimizer), "scheduler": scheduler,
        "data": data.train, "rng": RNGState(), "train_state": progress,
    }, config=cfg_dict, world=world)
    last_saved = None
    if saved is not None:
        checkpoints.load(saved)
        last_saved = progress.step
        if world.main:
            metrics.truncate_after(progress.step)
    elif world.main and (out_dir / METRICS).exists():
        (out_dir / METRICS).unlink()  # a run that died before its first checkpoint starts over
    resumed = saved is not None
    del saved  # a whole model and optimizer on the CPU
    if world.main:
        metrics.trackers = open_trackers(cfg.report_to, out_dir, config=cfg_dict, name=out_dir.name, resume_step=last_saved)

    info = {"params": raw.num_params(), "device": str(device), "resumed": resumed,
            "precision": precision, "kernels": raw.model.kernels, "world_size": world.size, "parallel": world.parallel,
            "data": data.label, "val_tokens": data.val_tokens, "start_step": progress.step, "steps": cfg.steps,
            "vocab_size": len(tokenizer)}
    if on_start and world.main:
        on_start(info)
    model.train()
    start_step, layer_grad_norms = progress.step, None
    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    tick, tick_tokens = time.perf_counter(), 0
    flops_per_token = raw.flops_per_token(cfg.seq_len)
    peak = peak_tflops(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", precision)  # None: no MFU
    step_losses = StepLosses(limit=2 * math.log(len(tokenizer)))
    forecast = Forecast("the training steps", say=on_note if world.main else (lambda text: None))
    for _ in forecast.over(range(end), progress.step, kept_in=out_dir):  # one step of progress.step each
        batch = data.train.next_batch(cfg.batch_size)
        lr = optimizer.param_groups[0]["lr"]
        t0 = time.perf_counter()
        profile_now = cfg.layer_metrics_tokens > 0 and ((progress.step + 1) % cfg.eval_every == 0 or progress.step + 1 == cfg.steps)
        while True:
            try:
                out = train_step(model, optimizer, scheduler, batch, to_try[0], amp, cfg.grad_clip, device, world,
                                 per_layer=raw.model.layers if profile_now else None)
                break
            except torch.OutOfMemoryError as exc:
                if len(to_try) == 1:
                    raise _out_of_memory(cfg, device, to_try[0], out_dir, last_saved) from exc
            # Out of the handler, whose traceback holds the failed step's tensors until it ends.
            # The step failed before the optimizer's, so nothing but gradients is left to clear.
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if cfg.compile:
                # Or the next size would get graphs with a dynamic batch size (dynamo's answer to
                # a second size), not the static ones a run given that --micro-batch compiles.
                torch._dynamo.reset()
            to_try.pop(0)
        micro_batch = to_try[0]
        to_try = to_try[:1]  # the first that fits is the run's
        layer_grad_norms = out[2] if profile_now else None
        progress.step += 1
        progress.tokens += batch.input_ids.numel()
        tick_tokens += batch.input_ids.numel()
        step = progress.step
        step_losses.add(step, out[0], out[1])
        logged = step % cfg.log_every == 0 or step == end
        if logged or step % cfg.eval_every == 0 or step % cfg.save_every == 0:
            try:
                loss, grad_norm = step_losses.read()  # waits for the GPU: what it spends there counts as training
            except Diverged as exc:
                raise _diverged(exc, out_dir, last_saved) from exc
        progress.seconds += time.perf_counter() - t0
        if logged:
            now = time.perf_counter()
            rate = tick_tokens / max(now - tick, 1e-9)
            tflops = rate * flops_per_token / 1e12
            if world.main:
                metrics.append({"step": step, "loss": loss, "lr": lr, "tokens": progress.tokens, "grad_norm": grad_norm, "tokens_per_s": rate,
                                "tflops": tflops, **({"mfu": tflops / (peak * world.size)} if peak else {}), "micro_batch": micro_batch})
            tick, tick_tokens = now, 0
            if on_progress and world.main:
                on_progress(Progress(step, cfg.steps, loss, lr, progress.tokens, rate, tflops, micro_batch))
        if step % cfg.eval_every == 0 and step < cfg.steps:
            result = _validate(model, data, cfg, micro_batch, amp, device, out_dir, last_saved)
            if profile_now:
                result.update(_layer_metrics(cfg, raw, data, device, world, layer_grad_norms))
            if world.main:
                metrics.append({"step": step, "tokens": progress.tokens, **result})
            if on_eval and world.main:
                on_eval(step, result)
        if step % cfg.save_every == 0 or step == end:
            checkpoints.save()
            last_saved = step

    if progress.step < cfg.steps:
        return {"finished": False, "step": progress.step}
    final = _validate(model, data, cfg, micro_batch, amp, device, out_dir, last_saved)
    if cfg.layer_metrics_tokens > 0 and progress.step > start_step:  # the last step's gradients are at hand
        final.update(_layer_metrics(cfg, raw, data, device, world, layer_grad_norms))
    model_state = ModelState(model).state_dict()  # every rank takes part
    step_rate = progress.tokens / max(progress.seconds, 1e-9)  # over the training steps' own time
    summary = {
        "finished": True, "norm": cfg.norm, "preset": cfg.preset, "step": progress.step, "tokens": progress.tokens,
        "train_seconds": progress.seconds, "step_tokens_per_s": step_rate, "step_tflops": step_rate * flops_per_token / 1e12, **final, "params": info["params"], "precision": precision, "device": str(device),
        "kernels": info["kernels"], "world_size": world.size, "parallel": world.parallel, "micro_batch": micro_batch,
        "data": data.label, "config": cfg_dict, "forecast": forecast.summary(),
        "wall_time_s": round(time.perf_counter() - started, 3),  # this process's (a resumed run's since it resumed; train_seconds: every step's)
    }
    if not world.main:
        return summary
    rows = metrics.rows()
    if not rows or rows[-1].get("val_loss") is None or rows[-1].get("step") != progress.step:
        metrics.append({"step": progress.step, "tokens": progress.tokens, **final})
    if on_eval:
        on_eval(progress.step, final)
    summary["exports"] = export_run(model_state, raw.cfg, tokenizer, out_dir)
    summary["environment"] = environment()
    atomic_write(out_dir / SUMMARY, json_text(summary))
    plot_loss(metrics.rows(), out_dir / "loss.png", title=f"{cfg.preset} · {cfg.norm} ({cfg.init} init) · {data.label}")
    plot_layers({"": metrics.rows()}, out_dir / "layers.png", title=f"{cfg.preset} · {cfg.norm} ({cfg.init} init): per layer at each evaluation")
    return summary


def _out_of_memory(cfg: TrainConfig, device: torch.device, micro_batch: int, out_dir: Path, last_saved: int | None) -> DepthcurseError:
    ways = ["a smaller --micro-batch"] + ([] if cfg.activation_checkpointing else ["--activation-checkpointing"])
    if not cfg.largest_micro_batch and micro_batch > 1:
        ways.append("--largest-micro-batch with a smaller --micro-batch as its floor")
    return DepthcurseError(f"out of {device.type} memory in a training step of micro-batches of {micro_batch} sequences: try {', or '.join(ways)}; "
                           f"{_kept(out_dir, last_saved)}")


def _validate(model, data, cfg: TrainConfig, micro_batch: int, amp, device, out_dir: Path, last_saved: int | None) -> dict:
    """`evaluate` in batches of --micro-batch sequences, or of the training micro-batch that
    --largest-micro-batch found (a forward without gradients needs less memory than a step); out
    of memory there is one line, not a traceback."""
    batch = micro_batch if cfg.largest_micro_batch else cfg.micro_batch
    try:
        return evaluate(model, data, batch, amp, device)
    except torch.OutOfMemoryError as exc:
        way = "a smaller --micro-batch without --largest-micro-batch" if cfg.largest_micro_batch else "a smaller --micro-batch"
        raise DepthcurseError(f"out of {device.type} memory in validation, in batches of {batch} sequences: try {way}; "
                              f"{_kept(out_dir, last_saved)}") from exc


def _kept(out_dir: Path, last_saved: int | None) -> str:
    return f"the last good checkpoint (step {last_saved}) is kept in {out_dir}" if last_saved is not None else "no checkpoint had been written yet"


def _diverged(exc: Diverged, out_dir: Path, last_saved: int | None) -> DepthcurseError:
    return DepthcurseError(f"training diverged at step {exc.step} ({exc}); {_kept(out_dir, last_saved)}: lower --lr, raise --warmup or set --grad-clip")
