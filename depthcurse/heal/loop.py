"""`depthcurse heal`: remove layers, train LoRA adapters on the rest, measure what came back.

One run lives in one folder, as an `lns-train` run does, and is made of its pieces: the data
(`train.data`, rows beginning with the model's BOS), the step (`train.loop.train_step`, which
trains `heal.objective.HealObjective` like any model), the checkpoint (`CheckpointManager`: the
adapters, optimizer, schedule, data position and RNG), the metrics log. The folder holds
`config.json` (what the run is), `checkpoint.pt` (what trains, nothing frozen), `metrics.jsonl`,
`heal.json` (the model unpruned, pruned and healed, on held-out windows of the training data,
with how far each stays from the unpruned model's predictions, and on `--task`, each written as
it is measured), `loss.png`, and `hf/`: the adapters merged and the layers gone, in the source
checkpoint's dtype.

An interrupted run continues from its last checkpoint exactly where it would have been; under
torchrun the ranks share each batch (DDP over the adapters) and rank 0 measures and writes.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

from depthcurse.card import provenance, write_card
from depthcurse.errors import DepthcurseError
from depthcurse.heal.adapters import add_adapters, target_modules, trainable
from depthcurse.heal.healed import ADAPTERS, HELD_OUT_METRICS, MODELS, Healed
from depthcurse.heal.linear import check_linear, estimate_maps, runs_of
from depthcurse.heal.config import CONFIG, RESUMABLE_CHANGES, HealConfig
from depthcurse.heal.objective import HealObjective
from depthcurse.heal.replacement import ReplacementObjective
from depthcurse.heal.report import heal_rows
from depthcurse.io import atomic_write, ensure_out_dir, environment, json_text, refuse_other_run
from depthcurse.loading import LoadedModel, window_length
from depthcurse.runtime import World
from depthcurse.surgery import num_layers, parse_layers
from depthcurse.tasks import PerplexityTask, build_task, head_for_task
from depthcurse.text import start_text, start_tokens, text_source
from depthcurse.train.checkpoint import CHECKPOINT, CheckpointManager, ModelState, OptimizerState, RNGState, TrainState, load_checkpoint
from depthcurse.train.data import build_data
from depthcurse.train.loop import Diverged, StepLosses, autocast_for, lr_factor, train_step
from depthcurse.train.metrics import METRICS, MetricsLog, Progress
from depthcurse.train.report import plot_loss

HEAL_JSON = "heal.json"
HF_DIR = "hf"


def check(loaded: LoadedModel, cfg: HealConfig) -> HealConfig:
    """`cfg` resolved and checked against the model: every bad input said before anything runs."""
    cfg = replace(cfg.resolved(), data=text_source(cfg.data))
    if not cfg.layers:
        raise DepthcurseError("give the layers to remove (--layers) or an order to heal along (--order DIR --ks ...)")
    n = num_layers(loaded.model)
    parse_layers(",".join(map(str, cfg.layers)), n)  # in range
    if any(i < 0 for i in cfg.layers):
        raise DepthcurseError("give layer indices from 0")
    if len(cfg.layers) >= n:
        raise DepthcurseError(f"--layers removes all {n} layers: nothing would be left to heal")
    if cfg.task is not None and head_for_task(cfg.task) != "causal-lm":
        raise DepthcurseError(f"--task {cfg.task} measures an encoder; heal trains a decoder's next-token predictions: use ppl-style text or an lm-eval task")
    if cfg.adapters:
        target_modules(loaded.model, cfg.layers, cfg.targets, _adapted_after(cfg))
    if cfg.maps:
        check_linear(loaded.model, cfg.layers)
    window_length(loaded.model, cfg.seq_len)
    return cfg


def identity(loaded: LoadedModel, cfg: HealConfig) -> dict:
    """What the run's folder records and a rerun must match."""
    run = {**loaded.describe(), **cfg.identity(), "seq_len": window_length(loaded.model, cfg.seq_len)}
    run.pop("device", None)  # a resumed run may move between machines
    run["device_kind"] = loaded.device.type
    return run


def heal(loaded: LoadedModel, cfg: HealConfig, out_dir: Path, *, world: World = World(), unpruned: dict | None = None, pruned: dict | None = None,
         why: str | None = None, stop_after: int | None = None, on_start: Callable[[dict], None] | None = None,
         on_progress: Callable[[Progress], None] | None = None, on_phase: Callable[[str], None] | None = None) -> dict | None:
    """Heal `loaded` with `cfg`'s layers removed, by `cfg.method`, in `out_dir` (continued if it
    holds this run); returns the record `heal.json` holds, on rank 0 (None elsewhere, or when
    `stop_after` ended the call after that many steps, as a preemption would).

    The model is the one in memory, and leaves healed (merged, folded: `hf/` holds it without the
    removed layers, and a model card saying how it was made: `why` these layers, if not by hand).
    `unpruned` and `pruned` are those models' measurements if they were made already (a healed
    curve measures the unpruned model once for every k, a comparison of methods both models once
    for every method).
    """
    cfg = check(loaded, cfg)
    run = identity(loaded, cfg)
    out_dir = ensure_out_dir(out_dir)
    state = _prepare(out_dir, run, world)
    done = finished(out_dir, run)
    if done is not None:
        return done if world.main else None
    record = read_heal(out_dir) if (out_dir / HEAL_JSON).exists() else {"run": run, "results": {}}
    started = time.perf_counter()
    phase = on_phase or (lambda text: None)

    model, tokenizer, device = loaded.model, loaded.tokenizer, loaded.device
    seq_len = run["seq_len"]
    start = start_tokens(tokenizer)
    phase("building the data")
    # The same stream on every rank: each takes its slice of each batch (as lns-train does).
    data = build_data(cfg.data, tokenizer, seq_len=seq_len, pack=True, seed=cfg.seed, val_tokens=cfg.eval_windows * (seq_len - 1), start=start,
                      pack_optional=False)
    held_out = PerplexityTask.of_windows(data.val_rows[: cfg.eval_windows], source=f"{data.label} (held out)", bos=start_text(tokenizer, start),
                                         batch_size=cfg.micro_batch)
    task = build_task(cfg.task, tokenizer, limit=cfg.limit, num_fewshot=cfg.num_fewshot, batch_size=cfg.micro_batch, seed=cfg.seed,
                      model=model, model_source=loaded.source) if cfg.task else None
    if world.main:
        atomic_write(out_dir / CONFIG, json.dumps(run, indent=2) + "\n")

    healed = Healed(model, cfg.layers)
    calibration = None
    if cfg.maps:
        phase("estimating the linear maps")
        healed.maps, calibration = _linear_maps(model, cfg, data, out_dir, world, phase)
    objective = None
    if cfg.adapters:
        torch.manual_seed(cfg.seed)  # the adapters' A matrices: the same on every rank and every resume
        healed.peft = add_adapters(model, cfg.layers, targets=cfg.targets, rank=cfg.lora_rank, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
                                   after=_adapted_after(cfg))
        objective = HealObjective(healed.peft, cfg.layers, cfg.loss, maps=healed.maps, shared_blocks=shared_blocks(cfg))
    elif cfg.method == "layer":
        torch.manual_seed(cfg.seed)
        objective = ReplacementObjective(model, cfg.layers)
        healed.replacements = objective.replaced()
    trained = sum(p.numel() for p in trainable(objective)) if objective is not None else 0  # counted now: saving merges adapters away
    if on_start and world.main:
        on_start({"start_step": 0, "steps": cfg.steps if objective is not None else 0, "trained": trained, "data": data.label,
                  "held_out_tokens": held_out.windows[:, 1:].numel(), "device": str(device), "world_size": world.size})
    progress = None
    if objective is not None:
        progress = _train(objective, cfg, data, out_dir, run, state, world, device, len(tokenizer), stop_after, on_progress, phase)
        if progress.step < cfg.steps:
            return None
    del state
    if not world.main:
        return None

    # Measured after training, on rank 0 alone: the other ranks have nothing left to wait for.
    (objective or model).eval()  # dropout off, the adapters' too: the healed model is measured as it is saved
    results = record["results"]
    for name, given in (("unpruned", unpruned), ("pruned", pruned)):
        if given is not None:
            results.setdefault(name, given)
    as_model = {name: functools.partial(healed.as_model, name) for name in MODELS}
    for name in MODELS:
        if name in results:
            continue  # measured before an interruption
        phase(f"measuring the {name} model")
        results[name] = measure(as_model[name], device, held_out, task, reference=as_model["unpruned"] if name != "unpruned" else None)
        _write(out_dir, record)
    phase("saving the healed checkpoint")
    n = num_layers(model)
    record["hf"] = str(healed.save(tokenizer, out_dir / HF_DIR, dtype=loaded.save_dtype))
    record["hf_layers"] = healed.layer_count(n)
    record["hf_dtype"] = str(loaded.save_dtype).removeprefix("torch.")
    record["hf_bytes"] = sum(f.stat().st_size for f in (out_dir / HF_DIR).glob("*.safetensors"))
    record["recovered"] = recovered(record)
    if progress is not None:
        record["training"] = {"steps": progress.step, "tokens": progress.tokens, "train_seconds": round(progress.seconds, 3),
                              "tokens_per_s": progress.tokens / max(progress.seconds, 1e-9), "trained_params": trained}
        if cfg.adapters:
            record["training"]["adapters"] = trained
    record["cost"] = _cost(cfg, calibration, progress, trained, model)
    record["held_out"] = held_out.describe()
    record["environment"] = environment()
    record["wall_time_s"] = round(record.get("wall_time_s", 0.0) + time.perf_counter() - started, 3)
    card = provenance(loaded, list(cfg.layers), n, why=why or "chosen by hand (--layers)", made_by="depthcurse heal", command=cfg.command(loaded.name),
                      layers_left=record["hf_layers"], healing={**cfg.healing(), "adapters": ADAPTERS if (out_dir / HF_DIR / ADAPTERS).is_dir() else None})
    write_card(out_dir / HF_DIR, {**card, "measured": heal_rows(record)})  # before heal.json says finished
    _write(out_dir, record)
    if progress is not None:
        plot_loss(MetricsLog(out_dir / METRICS).rows(), out_dir / "loss.png",
                  title=f"{loaded.name} without layers {','.join(map(str, cfg.layers))}: {cfg.method} ({_loss_name(cfg)})")
    return record


def _loss_name(cfg: HealConfig) -> str:
    return "MSE to the removed runs' output" if cfg.method == "layer" else f"{cfg.loss} loss"


def _adapted_after(cfg: HealConfig) -> int | None:
    """The adapters go on the kept blocks after this one (None: on every kept block)."""
    return min(cfg.layers) if cfg.adapt == "after" else None


def shared_blocks(cfg: HealConfig) -> int:
    """How many first blocks the student and the teacher run alike: none holds an adapter or a
    map and none is removed (`--adapt after`: those before the first removed layer, less the one
    whose MLP output a map changes)."""
    if cfg.adapt != "after":
        return 0
    return max(0, min(cfg.layers) - (1 if cfg.maps else 0))


def _cost(cfg: HealConfig, calibration: dict | None, progress: TrainState | None, trained: int, model) -> dict:
    """What the method cost: seconds of its own work (estimating, training; not the measurements),
    the tokens it read, and the parameters it trained, added to the model, or estimated."""
    hidden = model.get_input_embeddings().weight.shape[-1]
    seconds = (calibration["seconds"] if calibration else 0.0) + (progress.seconds if progress else 0.0)
    tokens = (calibration["tokens"] if calibration else 0) + (progress.tokens if progress else 0)
    return {"method": cfg.method, "seconds": round(seconds, 3), "tokens": tokens, "calibration": calibration,
            "training": {"steps": progress.step, "tokens": progress.tokens, "seconds": round(progress.seconds, 3)} if progress else None,
            "trained_params": trained, "added_params": trained if cfg.method == "layer" else 0,
            "estimated_params": len(runs_of(cfg.layers)) * hidden * hidden if cfg.maps else 0}


MAPS = "maps.pt"


def _linear_maps(model, cfg: HealConfig, data, out_dir: Path, world: World, phase) -> tuple[dict[int, torch.Tensor], dict]:
    """The linear maps of `cfg`'s runs, and what estimating them cost: from `maps.pt` in the run's
    folder, or estimated on `calib_tokens` of the training text (each rank a share of the rows,
    the sums added up) and kept there."""
    path = out_dir / MAPS
    if not path.exists():
        started = time.perf_counter()
        rows = calibration_rows(data.train, cfg.calib_tokens, cfg.seed)
        batches = list(rows.split(cfg.micro_batch))[world.rank :: world.size]
        maps = estimate_maps(model, cfg.layers, batches, ridge=cfg.ridge, reduce=world.sum,
                             on_batch=lambda done, total: phase(f"estimating the linear maps ({done}/{total} batches)"))
        record = {"maps": {str(k): t for k, t in maps.items()}, "seconds": time.perf_counter() - started, "tokens": rows.numel()}
        if world.main:
            atomic_write(path, lambda tmp: torch.save(record, tmp))
        world.barrier()
    saved = load_checkpoint(path)
    return {int(k): t for k, t in saved["maps"].items()}, {"seconds": round(float(saved["seconds"]), 3), "tokens": int(saved["tokens"])}


def calibration_rows(train, tokens: int, seed: int) -> torch.Tensor:
    """Rows of the training text holding at least `tokens` tokens (all of it if it holds fewer):
    local text in a seeded order of its own, not the training order's; C4's next rows."""
    if hasattr(train, "rows"):
        n = min(len(train.rows), math.ceil(tokens / train.rows.shape[1]))
        order = torch.randperm(len(train.rows), generator=torch.Generator().manual_seed(seed + 1))
        return train.rows[order[:n]]
    rows = [train.next_batch(1).input_ids]
    while sum(r.numel() for r in rows) < tokens:
        rows.append(train.next_batch(1).input_ids)
    return torch.cat(rows)


def _train(objective, cfg: HealConfig, data, out_dir: Path, run: dict, state: dict | None, world: World, device, vocab: int,
           stop_after: int | None, on_progress, phase) -> TrainState:
    """The trained methods' loop: `train.loop.train_step` on `objective`, resumable from `state`."""
    wrapped = objective
    if world.parallel:
        from torch.nn.parallel import DistributedDataParallel  # lazy: only a torchrun launch needs it

        wrapped = DistributedDataParallel(objective, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(trainable(objective), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg.warmup, cfg.steps, cfg.min_lr_ratio))
    progress = TrainState()
    checkpoints = CheckpointManager(out_dir, {
        "adapters" if cfg.adapters else "layers": ModelState(wrapped, trainable_only=True), "optimizer": OptimizerState(wrapped, optimizer),
        "scheduler": scheduler, "data": data.train, "rng": RNGState(), "train_state": progress,
    }, config=run, world=world)
    metrics = MetricsLog(out_dir / METRICS)
    if state is not None:
        checkpoints.load(state)
        if world.main:
            metrics.truncate_after(progress.step)
    elif world.main and (out_dir / METRICS).exists():
        (out_dir / METRICS).unlink()  # a run that stopped before its first checkpoint starts over

    amp = autocast_for("bf16-mixed", device) if device.type == "cuda" else autocast_for("fp32", device)
    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    # a next-token loss this high is lost; an MSE has no such scale: only a non-finite one is
    losses = StepLosses(limit=2 * math.log(vocab) if cfg.method != "layer" else math.inf)
    wrapped.train()
    tick, tick_tokens = time.perf_counter(), 0
    if progress.step < end:
        phase("training")
    while progress.step < end:
        batch = data.train.next_batch(cfg.batch_size)
        lr = optimizer.param_groups[0]["lr"]
        t0 = time.perf_counter()
        loss, grad_norm = train_step(wrapped, optimizer, scheduler, batch, cfg.micro_batch, amp, cfg.grad_clip, device, world)
        progress.step += 1
        progress.tokens += batch.tokens
        tick_tokens += batch.tokens
        losses.add(progress.step, loss, grad_norm)
        step = progress.step
        logged = step % cfg.log_every == 0 or step == end
        if logged or step % cfg.save_every == 0:
            try:
                loss_value, norm_value = losses.read()
            except Diverged as exc:
                raise DepthcurseError(f"healing diverged at step {exc.step} ({exc}): lower --lr or raise --warmup") from exc
        progress.seconds += time.perf_counter() - t0
        if logged:
            now = time.perf_counter()
            rate = tick_tokens / max(now - tick, 1e-9)
            tick, tick_tokens = now, 0
            if world.main:
                metrics.append({"step": step, "loss": loss_value, "lr": lr, "tokens": progress.tokens, "grad_norm": norm_value, "tokens_per_s": rate})
                if on_progress:
                    on_progress(Progress(step, cfg.steps, loss_value, lr, progress.tokens, rate, None, cfg.micro_batch))
        if step % cfg.save_every == 0 or step == end:
            checkpoints.save()
    return progress


def logits_in(as_model: Callable[[], contextlib.AbstractContextManager]) -> Callable[[torch.Tensor], torch.Tensor]:
    """ids -> the logits of the model that `as_model()` makes of the one in memory, entered for
    each batch: one model in memory serves as several, alternately."""
    def logits_of(ids: torch.Tensor) -> torch.Tensor:
        with as_model() as model:
            return model(input_ids=ids, use_cache=False).logits
    return logits_of


def measure(as_model: Callable[[], contextlib.AbstractContextManager], device, held_out: PerplexityTask, task, *,
            reference: Callable[[], contextlib.AbstractContextManager] | None = None) -> dict:
    """The model `as_model()` makes, on the held-out windows (against the `reference` model's
    predictions where given: KL and top-1 agreement) and on the task."""
    score = held_out.evaluate_logits(logits_in(as_model), device, logits_in(reference) if reference is not None else None)
    out = {"held_out": _scored(held_out, score)}
    if reference is None:
        out["held_out"]["metrics"].update(kl=0.0, agreement=1.0)  # the reference itself
    if task is not None:
        with as_model() as model:
            out["task"] = _scored(task, task.evaluate(model))
    return out


def _scored(task, score) -> dict:
    return {"metric": task.metric, "higher_is_better": task.higher_is_better, "metrics": score.metrics, "examples": score.examples,
            "data": task.describe().get("data", task.describe().get("task"))}


def recovered(record: dict) -> dict:
    """Per measurement (`HELD_OUT_METRICS` on the held-out windows, the task's headline metric):
    the share of what the removal cost that healing won back, (pruned - healed) / (pruned -
    unpruned); 1 is all of it, 0 none, negative worse than pruned. None where the removal cost
    nothing."""
    results = record["results"]
    if not all(m in results for m in MODELS):
        return {}
    out = {}
    for part in results["pruned"]:
        for metric in HELD_OUT_METRICS if part == "held_out" else (results["pruned"][part]["metric"],):
            u, p, h = (results[m][part]["metrics"].get(metric) for m in MODELS)
            if None in (u, p, h):
                continue
            gap = p - u
            out[f"{part}_{metric}" if part == "held_out" else f"task_{metric}"] = (p - h) / gap if gap and math.isfinite(gap) else None
    return out


def _prepare(out_dir: Path, run: dict, world: World) -> dict | None:
    """The checkpoint to continue from (None: from the start); a folder of another run is refused."""
    saved_cfg, ckpt = out_dir / CONFIG, out_dir / CHECKPOINT
    if saved_cfg.exists():
        refuse_other_run(out_dir, json.loads(saved_cfg.read_text()), run, ignore=RESUMABLE_CHANGES, what="heal run")
    elif any(out_dir.iterdir()) and (out_dir / HEAL_JSON).exists():
        refuse_other_run(out_dir, read_heal(out_dir)["run"], run, ignore=RESUMABLE_CHANGES, what="heal run")
    world.barrier()  # every rank has checked the folder before rank 0 writes into it
    return load_checkpoint(ckpt) if ckpt.exists() else None


def finished(out_dir: Path, run: dict) -> dict | None:
    """The record of `run` if `out_dir` holds it finished (measured and saved), else None."""
    if not (out_dir / HEAL_JSON).is_file():
        return None
    record = read_heal(out_dir)
    same = not [k for k in set(record["run"]) | set(run) if k not in RESUMABLE_CHANGES and record["run"].get(k) != run.get(k)]
    return record if same and "recovered" in record and (out_dir / HF_DIR / "config.json").is_file() else None


def _write(out_dir: Path, record: dict) -> None:
    atomic_write(out_dir / HEAL_JSON, json_text(record))


def read_heal(folder: Path) -> dict:
    """A heal run's or a healed curve's `heal.json`, or one clear error."""
    path = Path(folder)
    path = path / HEAL_JSON if path.is_dir() else path
    try:
        record = json.loads(path.read_text())
        record["run"]
        return record
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DepthcurseError(f"{folder} holds no heal result ({HEAL_JSON}): {exc}") from None
