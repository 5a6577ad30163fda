"""`depthcurse heal`: remove layers, win the removal back by a method, measure what came back.

One run lives in one folder, as an `lns-train` run does, and is made of its pieces: the method
(`heal.method`: estimated on calibration text, or trained), the data (`train.data`, rows beginning
with the model's BOS), the step (`train.loop.train_step`, which trains the method's objective like
any model), the checkpoint (`CheckpointManager`: what trains, the optimizer, schedule, data position
and RNG), the metrics log. The folder holds `config.json` (what the run is), `method.pt` (what the
method estimated), `checkpoint.pt` (what trains, nothing frozen), `metrics.jsonl`, `heal.json` (the
model unpruned, pruned and healed, on held-out windows of the training data and of `--eval-data`,
with how far each stays from the unpruned model's predictions, and on `--task`, each written as it
is measured), `loss.png`, and `hf/`: the healed checkpoint in the source checkpoint's dtype. The
healed model measured is that checkpoint, loaded as a user loads it.

An interrupted run continues from its last checkpoint exactly where it would have been; under
torchrun the ranks share each batch (DDP over what trains) and rank 0 measures and writes.
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
from depthcurse.forecast import Forecast
from depthcurse.heal.adapters import trainable
from depthcurse.heal.config import CONFIG, RESUMABLE_CHANGES, HealConfig
from depthcurse.heal.healed import MODELS, Healed
from depthcurse.heal.method import HealContext, Method
from depthcurse.heal.model_index import evaluation_results
from depthcurse.heal.report import cost_text, heal_rows, sites_text
from depthcurse.heal.shares import recovered, with_retained
from depthcurse.heal.sites import massive_at_sites
from depthcurse.io import atomic_write, changed_settings, ensure_out_dir, environment, json_text, read_record, refuse_other_run
from depthcurse.kept_state import file_digest
from depthcurse.loading import LoadedModel, load_model, window_length
from depthcurse.prune.engine import evaluate_variants, why_unsupported
from depthcurse.runtime import DTYPES, World
from depthcurse.surgery import num_layers, parse_layers
from depthcurse.tasks import PerplexityTask, build_task, head_for_task
from depthcurse.text import load_texts, start_text, start_tokens, text_source
from depthcurse.train.checkpoint import CHECKPOINT, CheckpointManager, ModelState, OptimizerState, RNGState, TrainState, load_checkpoint
from depthcurse.train.data import build_data
from depthcurse.train.loop import Diverged, StepLosses, autocast_for, lr_factor, train_step
from depthcurse.train.metrics import METRICS, MetricsLog, Progress
from depthcurse.train.tracking import open_trackers
from depthcurse.train.report import plot_loss

HEAL_JSON = "heal.json"
HF_DIR = "hf"

# Why `--dtype auto` is fp32 on a CPU here (runtime.pick_dtype): heal trains, and under bf16 autocast
# the losses drift from fp32's step by step (docs/benchmarks.md, "bf16 against fp32 on every command").
FP32_ON_CPU = "as heal trains, and bf16 moves a training run's losses"


def check(loaded: LoadedModel, cfg: HealConfig) -> HealConfig:
    """`cfg` resolved and checked against the model: every bad input said before anything runs."""
    cfg = replace(cfg.resolved(), data=text_source(cfg.data), eval_data=text_source(cfg.eval_data) if cfg.eval_data else None)
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
    refusal(loaded, cfg.build(), cfg.layers, raise_it=True)
    window_length(loaded.model, cfg.seq_len)
    return cfg


def refusal(loaded: LoadedModel, method: Method, layers: tuple[int, ...], raise_it: bool = False) -> str | None:
    """Why `method` cannot heal this model without `layers` (its architecture), in one line; None if it can."""
    try:
        method.check(loaded.model, tuple(sorted(layers)))
    except DepthcurseError as exc:
        why = f"--method {method.name} cannot heal {type(loaded.model).__name__} without layers {','.join(map(str, sorted(layers)))}: {exc}"
        if raise_it:
            raise DepthcurseError(why) from None
        return why
    return None


def identity(loaded: LoadedModel, cfg: HealConfig) -> dict:
    """What the run's folder records and a rerun must match."""
    method = cfg.build()
    run = {**loaded.describe(), **cfg.identity(), "seq_len": window_length(loaded.model, cfg.seq_len), "method_title": method.title,
           "method_how": method.describe(), "data_sha256": file_digest(cfg.data), "eval_data_sha256": file_digest(cfg.eval_data)}  # a file's text: another under its name is another run
    run.pop("device", None)  # a resumed run may move between machines
    run["device_kind"] = loaded.device.type
    return run


METHOD_STATE = "method.pt"
PER_METHOD = ("method", "method_settings", "method_title", "method_how")  # what a run's identity says of its method alone


def heal(loaded: LoadedModel, cfg: HealConfig, out_dir: Path, *, world: World = World(), unpruned: dict | None = None, pruned: dict | None = None,
         why: str | None = None, stop_after: int | None = None, on_start: Callable[[dict], None] | None = None,
         on_progress: Callable[[Progress], None] | None = None, on_phase: Callable[[str], None] | None = None,
         on_note: Callable[[str], None] = lambda text: None) -> dict | None:
    """Heal `loaded` with `cfg`'s layers removed, by `cfg.method`, in `out_dir` (continued if it
    holds this run); returns the record `heal.json` holds, on rank 0 (None elsewhere, or when
    `stop_after` ended the call after that many steps, as a preemption would).

    The model in memory stays the unpruned one (the method's changes are switched on and off
    around it); `hf/` holds the healed checkpoint, made from a copy, with a model card saying how
    it was made (`why` these layers, if not by hand), and that checkpoint is what is measured as
    the healed model. `unpruned` and `pruned` are those models' measurements if they were made
    already (a healed curve measures the unpruned model once for every k, a comparison of methods
    both models once for every method). After the first training step `on_note` hears how long the
    steps will take (`forecast`), kept in the record beside the time they took.
    """
    cfg = check(loaded, cfg)
    method = cfg.build()
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
    held_out = {"held_out": PerplexityTask.of_windows(data.val_rows[: cfg.eval_windows], source=f"{data.label} (held out)", bos=start_text(tokenizer, start),
                                                      batch_size=cfg.micro_batch)}
    if cfg.eval_data:
        texts, source = load_texts(cfg.eval_data)
        held_out["other"] = PerplexityTask(tokenizer, texts, source=source, seq_len=seq_len, limit=cfg.eval_windows, batch_size=cfg.micro_batch)
    task = build_task(cfg.task, tokenizer, limit=cfg.limit, num_fewshot=cfg.num_fewshot, batch_size=cfg.micro_batch, seed=cfg.seed,
                      model=model, model_source=loaded.source) if cfg.task else None
    if hasattr(task, "per_example"):
        task.per_example = True  # each question's score kept: the intervals pair the models question by question
    if world.main:
        atomic_write(out_dir / CONFIG, json.dumps(run, indent=2) + "\n")

    note = on_note if world.main else (lambda text: None)
    ctx = HealContext(model=model, layers=cfg.layers, calibration=functools.lru_cache(maxsize=None)(lambda tokens: calibration_batches(data.train, tokens, cfg, world)),
                      world=world, seed=cfg.seed, phase=phase, note=note)
    _prepare_method(method, ctx, out_dir, world, phase)
    healed = Healed(model, cfg.layers, method)
    with healed.as_model("healed"), healed.as_model("unpruned"):
        pass  # the method's context hooks checked (they give the model) before anything is measured
    objective = method.objective(ctx) if method.trains else None
    trained = sum(p.numel() for p in trainable(objective)) if objective is not None else 0
    if method.trains and not trained:  # else the "healed" checkpoint would be the plain removal, called healed
        raise DepthcurseError(f"--method {cfg.method}: it says it trains (trains = True), but its objective() "
                              + ("gave none" if objective is None else "has no trainable parameter"))
    if on_start and world.main:
        on_start({"start_step": 0, "steps": cfg.steps if objective is not None else 0, "trained": trained, "data": data.label,
                  "held_out_tokens": held_out["held_out"].windows[:, 1:].numel(), "device": str(device), "world_size": world.size})
    progress = None
    if objective is not None:
        forecast = Forecast("the training steps", say=note)
        progress = _train(objective, method, cfg, data, out_dir, run, state, world, device, len(tokenizer), stop_after, on_progress, phase, forecast)
        if progress.step < cfg.steps:
            return None
    del state
    if not world.main:
        return None

    # Measured after training, on rank 0 alone: the other ranks have nothing left to wait for.
    (objective or model).eval()  # dropout off: the healed model is measured as it is saved
    results = record["results"]
    given = {"unpruned": unpruned, "pruned": pruned}
    for name, measured in given.items():
        if measured is not None:
            results.setdefault(name, measured)
    as_model = {name: functools.partial(healed.as_model, name) for name in MODELS}
    if "massive_activation" not in record:
        with healed.as_model("unpruned") as unpruned_model:
            record["massive_activation"] = massive_at_sites(unpruned_model, held_out["held_out"].windows, cfg.layers, cfg.micro_batch)
    # One plan for the models this run measures (those a curve or a comparison gave are not): its
    # forecast counts the loop's own steps. The healed model is measured as saved, so the checkpoint
    # is written in its step; it is kept with the finished record alone, so a rerun measures it again.
    n = num_layers(model)
    plan = [name for name in MODELS if given.get(name) is None]
    kept = sum(name in results for name in plan if name != "healed")  # measured before an interruption: the plan's first ones
    measuring = Forecast("the models' measurements (" + ", ".join(plan) + ")", say=note)
    for index, name in measuring.over(plan, kept, kept_in=out_dir / HEAL_JSON):
        if name != "healed":
            phase(f"measuring the {name} model ({index + 1} of {len(plan)})")
            results[name] = measure(as_model[name], device, held_out, task, reference=as_model["unpruned"] if name != "unpruned" else None)
            _write(out_dir, record)
            continue
        phase("saving the healed checkpoint")
        hf, files = healed.save(tokenizer, out_dir / HF_DIR, dtype=loaded.save_dtype)
        record["hf"] = str(hf)
        record["hf_layers"] = healed.layer_count(n)
        record["hf_dtype"] = str(loaded.save_dtype).removeprefix("torch.")
        record["hf_bytes"] = sum(f.stat().st_size for f in hf.glob("*.safetensors"))
        record["hf_files"] = files
        phase(f"measuring the healed model, the saved checkpoint ({index + 1} of {len(plan)})")
        saved = load_model(str(hf), dtype=next(k for k, v in DTYPES.items() if v == loaded.dtype), device=device.type)
        results["healed"] = measure(lambda: contextlib.nullcontext(saved.model), device, held_out, task, reference=as_model["unpruned"])
        results["healed"]["as"] = f"the saved checkpoint ({record['hf_dtype']}) loaded in {str(loaded.dtype).removeprefix('torch.')}"
        del saved
    record["forecasts"] = {**{what: f.summary() for what, f in ctx.forecasts.items()}, "the models' measurements": measuring.summary()}
    with_retained(results)
    record["recovered"], record["recovered_why"], record["recovered_interval"] = recovered(record)
    record["unchanged"] = unchanged(results)
    if progress is not None:
        record["training"] = {"steps": progress.step, "tokens": progress.tokens, "train_seconds": round(progress.seconds, 3),
                              "tokens_per_s": progress.tokens / max(progress.seconds, 1e-9), "trained_params": trained, "loss": method.loss_name,
                              "forecast": forecast.summary()}
    record["cost"] = _cost(method, progress, model, cfg.layers)
    record["held_out"] = {part: t.describe() for part, t in held_out.items()}["held_out"]
    record["measured_on"] = {part: t.describe() for part, t in held_out.items()}
    record["environment"] = environment()
    record["wall_time_s"] = round(record.get("wall_time_s", 0.0) + time.perf_counter() - started, 3)
    card = provenance(loaded, list(cfg.layers), n, why=why or "chosen by hand (--layers)", made_by="depthcurse heal", command=cfg.command(loaded.name),
                      layers_left=record["hf_layers"], healing={**cfg.healing(method), "changes": method.changes(cfg.layers), "files": files,
                               "cost": cost_text(record["cost"])},
                      new_at=tuple(sorted(set(cfg.layers) - set(method.removes(cfg.layers)))))
    write_card(hf, {**card, "measured": heal_rows(record), "evaluation": evaluation_results(record), "measured_note": measured_note(record),
                    "unchanged": record["unchanged"]})
    # the card before heal.json says finished
    _write(out_dir, record)
    if progress is not None:
        plot_loss(MetricsLog(out_dir / METRICS).rows(), out_dir / "loss.png",
                  title=f"{loaded.name} without layers {','.join(map(str, cfg.layers))}: {method.name} ({method.loss_name})")
    return record


def _prepare_method(method: Method, ctx: HealContext, out_dir: Path, world: World, phase) -> None:
    """What the method estimates, from `method.pt` in the run's folder (a resumed run reads it
    again) or made now and kept there."""
    path = out_dir / METHOD_STATE
    if path.exists():
        method.load_state_dict(load_checkpoint(path)["state"], ctx)
        return
    phase(f"preparing {method.name}")
    method.prepare(ctx)
    state = method.state_dict()
    if world.main and _holds_something(state):
        atomic_write(path, lambda tmp: torch.save({"method": method.name, "state": state}, tmp))
    world.barrier()


def _holds_something(state) -> bool:
    return bool(state) and (not isinstance(state, dict) or any(_holds_something(v) if isinstance(v, dict) else True for v in state.values()))


def _calibrations(method: Method) -> list[dict]:
    """What each of the method's parts spent estimating (seconds, tokens)."""
    return [c for m in getattr(method, "members", [method]) if (c := getattr(m, "calibration", None))]


def _cost(method: Method, progress: TrainState | None, model, layers) -> dict:
    """What the method cost: seconds of its own work (estimating, training; not the measurements),
    the tokens it read, and the parameters it trained, added to the model, or solved for."""
    calibrations = _calibrations(method)
    calibration = {"seconds": round(sum(c["seconds"] for c in calibrations), 3), "tokens": sum(c["tokens"] for c in calibrations)} if calibrations else None
    seconds = (calibration["seconds"] if calibration else 0.0) + (progress.seconds if progress else 0.0)
    tokens = (calibration["tokens"] if calibration else 0) + (progress.tokens if progress else 0)
    return {"method": method.name, "seconds": round(seconds, 3), "tokens": tokens, "calibration": calibration,
            "training": {"steps": progress.step, "tokens": progress.tokens, "seconds": round(progress.seconds, 3)} if progress else None,
            **method.cost(model, layers)}


def calibration_rows(train, tokens: int, seed: int) -> torch.Tensor:
    """Rows of the training text holding at least `tokens` tokens (all of it if it holds fewer):
    local text in a seeded order of its own, not the training order's; C4's next rows, read from
    where the stream is and the stream put back there, so that training starts at the same row
    whether the rows were drawn in this run or read back from an earlier one."""
    if hasattr(train, "rows"):
        n = min(len(train.rows), math.ceil(tokens / train.rows.shape[1]))
        order = torch.randperm(len(train.rows), generator=torch.Generator().manual_seed(seed + 1))
        return train.rows[order[:n]]
    position = train.state_dict()
    try:
        rows = [train.next_batch(1).input_ids]
        while sum(r.numel() for r in rows) < tokens:
            rows.append(train.next_batch(1).input_ids)
    finally:
        train.load_state_dict(position)
    return torch.cat(rows)


def calibration_batches(train, tokens: int, cfg: HealConfig, world: World) -> list[torch.Tensor]:
    """This rank's share of the calibration rows, in micro-batches."""
    rows = calibration_rows(train, tokens, cfg.seed)
    return list(rows.split(cfg.micro_batch))[world.rank :: world.size]


UNCHANGED = "the healed model measures exactly as the plain removal (every held-out window's loss and KL): the method changed nothing"


def unchanged(results: dict) -> str | None:
    """Why the healed model is no healed model (`UNCHANGED`), where it scores as the pruned one on
    every held-out window to float precision; None where it differs."""
    p, h = results.get("pruned", {}).get("held_out", {}), results.get("healed", {}).get("held_out", {})
    kept = [key for key in ("per_window", "per_window_kl") if key in p]
    same = kept and all(key in h and len(p[key]) == len(h[key]) and all(abs(a - b) <= 1e-6 * max(1.0, abs(a)) for a, b in zip(p[key], h[key]))
                        for key in kept)
    return UNCHANGED if same else None


def measured_note(record: dict) -> str:
    """Which measurement is on which text, and how much of it: what a reader of the card needs."""
    parts = []
    for part, what in (record.get("measured_on") or {}).items():
        said = "held out of the text it was healed on (it rewards adapting to that text)" if part == "held_out" else "another source, not trained on"
        parts.append(f"{what.get('data')}: {what.get('windows')} windows of {what.get('seq_len')} tokens ({what.get('tokens'):,} tokens), {said}")
    healed = record["results"].get("healed", {}).get("as")
    sites = sites_text(record.get("massive_activation"))
    return (("Measured on " + "; ".join(parts) + "." if parts else "") + (f" The healed model measured is {healed}." if healed else "")
            + " KL and top-1 agreement: to the unpruned model's predictions on the held-out windows. In brackets after a share won back"
            " or retained: its 95% interval, from the differences window by window and question by question (every model is measured"
            " on the same ones)." + (f" {sites[0].upper()}{sites[1:]}." if sites else ""))


def _train(objective, method: Method, cfg: HealConfig, data, out_dir: Path, run: dict, state: dict | None, world: World, device, vocab: int,
           stop_after: int | None, on_progress, phase, forecast: Forecast | None = None) -> TrainState:
    """The trained methods' loop: `train.loop.train_step` on `objective`, resumable from `state`."""
    wrapped = objective
    if world.parallel:
        from torch.nn.parallel import DistributedDataParallel  # lazy: only a torchrun launch needs it

        wrapped = DistributedDataParallel(objective, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(trainable(objective), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg.warmup, cfg.steps, cfg.min_lr_ratio))
    progress = TrainState()
    checkpoints = CheckpointManager(out_dir, {
        "trained": ModelState(wrapped, trainable_only=True), "optimizer": OptimizerState(wrapped, optimizer),
        "scheduler": scheduler, "data": data.train, "rng": RNGState(), "train_state": progress,
    }, config=run, world=world)
    metrics = MetricsLog(out_dir / METRICS)
    if state is not None:
        checkpoints.load(state)
        if world.main:
            metrics.truncate_after(progress.step)
    elif world.main and (out_dir / METRICS).exists():
        (out_dir / METRICS).unlink()  # a run that stopped before its first checkpoint starts over
    if world.main:
        metrics.trackers = open_trackers(cfg.report_to, out_dir, config=run, name="/".join(out_dir.parts[-2:]),
                                         resume_step=None if state is None else progress.step)
    with metrics:  # closes the live trackers, however the loop ends
        amp = autocast_for("bf16-mixed", device) if device.type == "cuda" else autocast_for("fp32", device)
        end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
        # a next-token loss this high is lost; an MSE has no such scale: only a non-finite one is
        losses = StepLosses(limit=2 * math.log(vocab) if method.next_token_loss else math.inf)
        wrapped.train()
        tick, tick_tokens = time.perf_counter(), 0
        if progress.step < end:
            phase("training")
        for _ in (forecast or Forecast("the training steps")).over(range(end), progress.step, kept_in=out_dir):
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


def measure(as_model: Callable[[], contextlib.AbstractContextManager], device, held_out: dict[str, PerplexityTask], task, *,
            reference: Callable[[], contextlib.AbstractContextManager] | None = None) -> dict:
    """The model `as_model()` makes, on each held-out text (against the `reference` model's
    predictions where given: KL and top-1 agreement) and on the task."""
    out = {}
    for part, windows in held_out.items():
        score = windows.evaluate_logits(logits_in(as_model), device, logits_in(reference) if reference is not None else None, per_window=True)
        out[part] = _scored(windows, score)
        if reference is None:
            out[part]["metrics"].update(kl=0.0, agreement=1.0)  # the reference itself
    if task is not None:
        with as_model() as model:
            out["task"] = _scored(task, evaluate_task(model, task))
    return out


def evaluate_task(model, task):
    """`task`'s score of `model` as it is: by prune's reuse engine where it runs the task (lm-eval's
    own requests and metrics, the same numbers, about half the time of lm-eval's loop), else the task's own loop."""
    if why_unsupported(model, task) is None:
        scores, _ = evaluate_variants(model, task, [()], checked=True)
        return scores[()]
    return task.evaluate(model)


def _scored(task, score) -> dict:
    kept = {key: score.details[key] for key in ("per_window", "per_window_kl", "per_window_agreement", "per_example") if key in score.details}
    if getattr(task, "member_metrics", None):
        kept["member_metrics"] = task.member_metrics  # each member's headline, which the card's model-index names
    return {"metric": task.metric, "higher_is_better": task.higher_is_better, "metrics": score.metrics, "examples": score.examples,
            "data": task.describe().get("data", task.describe().get("task")), **kept}


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
    same = not changed_settings(record["run"], run, ignore=RESUMABLE_CHANGES)
    return record if same and "recovered" in record and (out_dir / HF_DIR / "config.json").is_file() else None


def kept_summary(out_dir: Path) -> str:
    """What an interrupted heal left in `out_dir` to resume from, in words, run folder by run folder (a
    comparison's methods, a curve's points): finished, a checkpoint at step N of M, or the method's
    fitted state (a map, a compensation) before any training step; "nothing had finished" where none is."""
    folders = sorted({p.parent for name in (CONFIG, METHOD_STATE, CHECKPOINT, HEAL_JSON) for p in Path(out_dir).rglob(name)})
    said = []
    for folder in folders:
        where = "" if folder == Path(out_dir) else f"{folder.relative_to(out_dir)}: "
        try:
            record = read_heal(folder) if (folder / HEAL_JSON).is_file() else {}
        except DepthcurseError:
            record = {}
        if "recovered" in record and (folder / HF_DIR / "config.json").is_file():
            said.append(f"{where}finished")
            continue
        kept = []
        if (folder / CHECKPOINT).is_file():
            try:  # the step counters alone, the weights left on disk (mmap)
                state = torch.load(folder / CHECKPOINT, map_location="cpu", weights_only=True, mmap=True)
                step, steps = int(state["train_state"]["step"]), int(state["config"].get("steps", 0))
                kept.append(f"a checkpoint at step {step}" + (f" of {steps}" if steps else ""))
            except Exception:  # noqa: BLE001 (a checkpoint cut short: it says so, and the rerun refuses it in one line)
                kept.append("a checkpoint that cannot be read")
        elif (folder / METHOD_STATE).is_file():
            kept.append(f"the method's fitted state ({METHOD_STATE}), no training step")
        measured = [name for name in MODELS if name in record.get("results", {})]
        if measured:  # the models measured after the training, each kept as it finished
            kept.append(f"the {' and '.join(measured)} model{'s' if len(measured) > 1 else ''} measured")
        if kept:
            said.append(where + ", ".join(kept))
    return (", ".join(said) + f" kept in {out_dir}") if said else "nothing had finished"


def _write(out_dir: Path, record: dict) -> None:
    atomic_write(out_dir / HEAL_JSON, json_text(record))


def read_heal(folder: Path) -> dict:
    """A heal run's or a healed curve's `heal.json`, or one clear error."""
    return read_record(folder, HEAL_JSON, "heal result", needs=("run",))
