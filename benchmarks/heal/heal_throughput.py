"""`depthcurse heal`'s step against transformers' Trainer around the same pieces.

By default in one process, interleaved step by step: the real `Trainer.train()` loop with a
callback that, after each of its steps, runs one step of each of our ways on the same rows, so
that a machine changing between processes cannot make a gap:

    trainer-lm    transformers' Trainer with the same peft LoraConfig, on the same pruned model
                  (`depthcurse drop`'s checkpoint), the same rows in the same order, batch,
                  learning rate, schedule (linear warm-up, cosine to a tenth), clipping and seed
    ours-lm       depthcurse.heal's step (`train.loop.train_step` on `HealObjective`), --loss lm
    ours-after    the same with --adapt after: adapters only on the blocks after the first removed
                  layer (the blocks before it run without a backward pass)
    ours-distill  --loss distill (the teacher: the same weights, layers back, adapters off)

Printed: each way's median time per step over the steps after the first, the median and the
spread (quartiles, extremes) of its per-step ratio to the Trainer's step, and a profile of one
step of each (operators by input shape, torch.profiler). `--separate` runs each way in a child
process of its own instead (`heal()` whole, and the peak resident memory over its training).

    python benchmarks/heal/heal_throughput.py --layers 21-24 --steps 12 --batch-size 4 --seq-len 256
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import sys
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: peak_memory, which every command's scripts share
from peak_memory import PeakMemory, run_variants, write_json  # noqa: E402

from depthcurse.speed.paired import PairedRatio, judge  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

WAYS = ("ours-lm", "ours-distill", "trainer-lm")


def _cfg(args, loss: str, adapt: str = "all"):
    from depthcurse.heal import HealConfig
    from depthcurse.surgery import parse_layers

    return HealConfig(layers=tuple(parse_layers(args.layers, 10**6)), method_args={"loss": loss, "lora_rank": args.rank, "adapt": adapt}, data=args.data,
                      steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, eval_windows=1, seed=args.seed,
                      save_every=10**6).resolved()


def ours(args, loss: str) -> dict:
    import torch

    from depthcurse.heal import heal
    from depthcurse.loading import load_model

    loaded = load_model(args.model, device=args.device, fp32_on_cpu="as this benchmark's figures in docs/benchmarks.md were measured")
    peak = PeakMemory(loaded.device)
    with tempfile.TemporaryDirectory() as out:
        record = heal(loaded, _cfg(args, loss), Path(out), on_start=lambda info: peak.start())
        losses = [r["loss"] for r in map(json.loads, (Path(out) / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    training = record["training"]
    return {"seconds": training["train_seconds"], "tokens_per_s": training["tokens_per_s"], "peak_bytes": peak.rise(), "losses": losses,
            "threads": torch.get_num_threads()}


def trainer(args) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments, TrainerCallback

    from depthcurse.heal.adapters import target_modules
    from depthcurse.loading import load_model, window_length
    from depthcurse.surgery import save_pruned
    from depthcurse.text import start_tokens
    from depthcurse.train.data import build_data

    cfg = _cfg(args, "lm")
    lora = cfg.build().settings
    loaded = load_model(args.model, device=args.device, fp32_on_cpu="as this benchmark's figures in docs/benchmarks.md were measured")
    seq_len = window_length(loaded.model, cfg.seq_len)
    data = build_data(cfg.data, loaded.tokenizer, seq_len=seq_len, pack=True, seed=cfg.seed, val_tokens=seq_len, start=start_tokens(loaded.tokenizer))
    rows = [data.train.next_batch(cfg.batch_size).input_ids for _ in range(cfg.steps)]  # heal's rows, in heal's order
    with tempfile.TemporaryDirectory() as folder:
        save_pruned(loaded.model, loaded.tokenizer, cfg.layers, folder)  # what `depthcurse drop` saves
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=loaded.dtype).to(loaded.device)
    del loaded
    torch.manual_seed(cfg.seed)  # the adapters' A: drawn as heal draws them, block by block
    model = get_peft_model(model, LoraConfig(r=lora.lora_rank, lora_alpha=lora.lora_alpha, lora_dropout=lora.lora_dropout, bias="none",
                                             target_modules=target_modules(model, (), lora.targets)))
    dataset = [{"input_ids": r, "labels": r} for batch in rows for r in batch]
    peak, losses = PeakMemory(model.device), []

    class InOrder(Trainer):
        def _get_train_sampler(self, *a, **k):
            return SequentialSampler(self.train_dataset)

    class Record(TrainerCallback):
        def on_train_begin(self, *a, **k):
            peak.start()

        def on_log(self, _args, state, control, logs=None, **k):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(output_dir=out, per_device_train_batch_size=cfg.batch_size, max_steps=cfg.steps, learning_rate=cfg.lr,
                                  lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": cfg.min_lr_ratio}, warmup_steps=cfg.warmup,
                                  weight_decay=cfg.weight_decay, max_grad_norm=cfg.grad_clip, logging_steps=1, save_strategy="no", report_to=[],
                                  use_cpu=args.device == "cpu", dataloader_num_workers=0, seed=cfg.seed, disable_tqdm=True)
        started = time.perf_counter()
        result = InOrder(model=model, args=targs, train_dataset=dataset, callbacks=[Record()]).train()
        seconds = time.perf_counter() - started
    tokens = cfg.steps * cfg.batch_size * (seq_len - 1)  # targets, as heal counts them
    return {"seconds": seconds, "train_runtime": result.metrics["train_runtime"], "tokens_per_s": tokens / seconds, "peak_bytes": peak.rise(),
            "losses": losses, "threads": torch.get_num_threads()}


def _our_step(args, loss: str, adapt: str, rows):
    """One of our ways, ready to step: its own copy of the model, adapters, optimizer and schedule."""
    import torch

    from depthcurse.heal import HealContext
    from depthcurse.heal.adapters import trainable
    from depthcurse.loading import load_model
    from depthcurse.train.loop import autocast_for, lr_factor, train_step

    cfg = _cfg(args, loss, adapt)
    loaded = load_model(args.model, device=args.device, fp32_on_cpu="as this benchmark's figures in docs/benchmarks.md were measured")
    method = cfg.build()  # heal's LoRA: its adapters, seeded as a heal seeds them, and its objective
    ctx = HealContext(model=loaded.model, layers=cfg.layers, calibration=None, seed=cfg.seed)
    method.prepare(ctx)
    objective = method.objective(ctx).train()
    optimizer = torch.optim.AdamW(trainable(objective), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg.warmup, cfg.steps, cfg.min_lr_ratio))
    amp = autocast_for("bf16-mixed", loaded.device) if loaded.device.type == "cuda" else autocast_for("fp32", loaded.device)

    def step(i: int):
        loss_value, _ = train_step(objective, optimizer, scheduler, rows[i], cfg.micro_batch, amp, cfg.grad_clip, loaded.device)
        return float(loss_value)

    return step, sum(p.numel() for p in trainable(objective))


def interleaved(args) -> dict:
    """The Trainer's loop driving; after each of its steps, one step of each of our ways on its rows."""
    import statistics

    import torch
    from peft import LoraConfig, get_peft_model
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from depthcurse.heal.adapters import target_modules
    from depthcurse.loading import load_model, window_length
    from depthcurse.surgery import save_pruned
    from depthcurse.text import start_tokens
    from depthcurse.train.data import build_data

    cfg = _cfg(args, "lm")
    lora = cfg.build().settings
    loaded = load_model(args.model, device=args.device, fp32_on_cpu="as this benchmark's figures in docs/benchmarks.md were measured")
    seq_len = window_length(loaded.model, cfg.seq_len)
    data = build_data(cfg.data, loaded.tokenizer, seq_len=seq_len, pack=True, seed=cfg.seed, val_tokens=seq_len, start=start_tokens(loaded.tokenizer))
    rows = [data.train.next_batch(cfg.batch_size) for _ in range(cfg.steps)]  # heal's rows, in heal's order
    with tempfile.TemporaryDirectory() as folder:
        save_pruned(loaded.model, loaded.tokenizer, cfg.layers, folder)  # what `depthcurse drop` saves
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=loaded.dtype).to(loaded.device)
    del loaded
    torch.manual_seed(cfg.seed)
    model = get_peft_model(model, LoraConfig(r=lora.lora_rank, lora_alpha=lora.lora_alpha, lora_dropout=lora.lora_dropout, bias="none",
                                             target_modules=target_modules(model, (), lora.targets)))
    dataset = [{"input_ids": r, "labels": r} for batch in rows for r in batch.input_ids]
    ours = {way: _our_step(args, *WAY_SETTINGS[way], rows) for way in args.ways.split(",") if way != "trainer-lm"}
    times: dict[str, list[float]] = {"trainer-lm": [], **{w: [] for w in ours}}
    losses: dict[str, list[float]] = {w: [] for w in times}
    profiles: dict[str, str] = {}

    def profiled(way: str, run):
        if not args.profile:
            return run()
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else []), record_shapes=True) as prof:
            out = run()
        sort = "self_cuda_time_total" if args.device == "cuda" else "self_cpu_time_total"
        profiles[way] = prof.key_averages(group_by_input_shape=True).table(sort_by=sort, row_limit=args.profile_rows, max_name_column_width=40,
                                                                            max_shapes_column_width=60)
        return out

    class InOrder(Trainer):
        def _get_train_sampler(self, *a, **k):
            return SequentialSampler(self.train_dataset)

    class Interleave(TrainerCallback):
        def on_step_begin(self, _args, state, control, **k):
            if args.profile and state.global_step == cfg.steps - 1:  # the last step: profiled
                from torch.profiler import ProfilerActivity, profile

                self.prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else []), record_shapes=True)
                self.prof.__enter__()
            self.t0 = time.perf_counter()

        def on_step_end(self, _args, state, control, **k):
            _sync(args.device)
            times["trainer-lm"].append(time.perf_counter() - self.t0)
            if getattr(self, "prof", None) is not None:
                self.prof.__exit__(None, None, None)
                sort = "self_cuda_time_total" if args.device == "cuda" else "self_cpu_time_total"
                profiles["trainer-lm"] = self.prof.key_averages(group_by_input_shape=True).table(sort_by=sort, row_limit=args.profile_rows,
                                                                                                 max_name_column_width=40, max_shapes_column_width=60)
                self.prof = None
            i = state.global_step - 1
            order = list(ours) if i % 2 == 0 else list(reversed(ours))  # alternated, so no way always runs first
            for way in order:
                t0 = time.perf_counter()
                run = (lambda w=way: ours[w][0](i))
                losses[way].append(profiled(way, run) if i == cfg.steps - 1 else run())
                _sync(args.device)
                times[way].append(time.perf_counter() - t0)

        def on_log(self, _args, state, control, logs=None, **k):
            if logs and "loss" in logs:
                losses["trainer-lm"].append(logs["loss"])

    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(output_dir=out, per_device_train_batch_size=cfg.batch_size, max_steps=cfg.steps, learning_rate=cfg.lr,
                                  lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": cfg.min_lr_ratio}, warmup_steps=cfg.warmup,
                                  weight_decay=cfg.weight_decay, max_grad_norm=cfg.grad_clip, logging_steps=1, save_strategy="no", report_to=[],
                                  use_cpu=args.device == "cpu", dataloader_num_workers=0, seed=cfg.seed, disable_tqdm=True)
        InOrder(model=model, args=targs, train_dataset=dataset, callbacks=[Interleave()]).train()

    measured = slice(1, None)  # the first step of each way warms its caches and allocator
    trainer = times["trainer-lm"][measured]
    summary = {}
    for way, ts in times.items():
        pairs = PairedRatio([t / b for t, b in zip(ts[measured], trainer)])  # each step against the Trainer's step beside it
        ratios = sorted(pairs.ratios)
        q = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else [ratios[0]] * 3
        verdict = judge(pairs)
        summary[way] = {"median_step_s": statistics.median(ts[measured]), "ratio_median": pairs.median, "ratio_interval": pairs.interval,
                        "ratio_quartiles": [q[0], q[2]], "ratio_range": [ratios[0], ratios[-1]], "verdict": verdict.status, "verdict_reason": verdict.reason,
                        "steps_s": ts, "losses": losses[way], "trained_params": ours[way][1] if way in ours else None}
    return {"ways": summary, "profiles": profiles, "tokens_per_step": rows[0].tokens, "threads": torch.get_num_threads()}


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


WAY_SETTINGS = {"ours-lm": ("lm", "all"), "ours-after": ("lm", "after"), "ours-distill": ("distill", "all")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--layers", default="21-24")
    parser.add_argument("--data", default="wiki")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--ways", default=None, help="interleaved: trainer-lm,ours-lm,ours-after,ours-distill; --separate: ours-lm,ours-distill,trainer-lm")
    parser.add_argument("--separate", action="store_true", help="each way in a child process of its own (and its peak memory), not interleaved")
    parser.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True, help="interleaved: profile the last step of each way")
    parser.add_argument("--profile-rows", type=int, default=12)
    parser.add_argument("--variant", choices=WAYS, help=argparse.SUPPRESS)  # a child process: one way
    parser.add_argument("--out", type=Path, default=None, help="also write the result as JSON here")
    args = parser.parse_args()
    if not args.separate and not args.variant:
        args.ways = args.ways or "trainer-lm,ours-lm,ours-after,ours-distill"
        result = interleaved(args)
        print(f"{args.model} without layers {args.layers}: {args.steps} steps of {args.batch_size} x {args.seq_len} tokens, LoRA rank {args.rank} on the MLPs, "
              f"interleaved step by step in one process; {platform.machine()}, {os.cpu_count()} cores, {result['threads']} threads")
        for way, r in result["ways"].items():
            lo, hi = r["ratio_quartiles"]
            interval = "no 95% interval" if r["ratio_interval"] is None else "95% interval {:.3f}-{:.3f}".format(*r["ratio_interval"])
            print(f"{way:<13} median step {r['median_step_s']:7.3f} s   / the Trainer's: median {r['ratio_median']:.3f}x "
                  f"({interval}, quartiles {lo:.3f}-{hi:.3f}, range {r['ratio_range'][0]:.3f}-{r['ratio_range'][1]:.3f})"
                  + ("" if r["verdict"] == "ok" or way == "trainer-lm" else f"  NOT A FINDING: {r['verdict']}: {r['verdict_reason']}"))
        for way, table in result["profiles"].items():
            print(f"\n=== one step of {way} ===\n{table}")
        summary = {"args": {k: v for k, v in vars(args).items() if k not in ("variant", "out")}, **result, "date": time.strftime("%Y-%m-%d")}
        write_json(args.out, summary)
        return
    args.ways = args.ways or ",".join(WAYS)
    if args.variant:
        got = trainer(args) if args.variant == "trainer-lm" else ours(args, args.variant.removeprefix("ours-"))
        print(json.dumps({"variant": args.variant, **got}))
        return
    ways = tuple(w for w in args.ways.split(",") if w)
    results, conditions = run_variants(__file__, ways)
    print(f"{args.model} without layers {args.layers}: {args.steps} steps of {args.batch_size} x {args.seq_len} tokens, LoRA rank {args.rank} on the MLPs; "
          f"{platform.machine()}, {os.cpu_count()} cores")
    for way, r in results.items():
        print(f"{way:<13} {r['seconds']:8.1f} s  {r['tokens_per_s']:8.0f} tokens/s  peak {r['peak_bytes'] / 2**20:8.0f} MiB")
    for step, row in enumerate(zip(*(results[w]["losses"] for w in ways)), 1):
        print(f"step {step:3d}  " + "  ".join(f"{w} {x:.4f}" for w, x in zip(ways, row)))
    summary = {"args": {k: v for k, v in vars(args).items() if k not in ("variant", "out")}, "results": results, **conditions}
    print(json.dumps(summary))
    write_json(args.out, summary)


if __name__ == "__main__":
    main()
