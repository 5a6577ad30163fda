"""`depthcurse heal`'s step against the loop a user would write around the same pieces, one run:

    ours-lm       depthcurse.heal.heal, --loss lm
    ours-distill  the same, --loss distill (the teacher: the same weights, layers back, adapters off)
    trainer-lm    transformers' Trainer with the same peft LoraConfig, on the same pruned model
                  (`depthcurse drop`'s checkpoint), the same rows in the same order, batch, steps,
                  learning rate, schedule (linear warm-up, cosine to a tenth), clipping and seed

Each in a child process of its own (peak_memory.run_variants). Printed per way: the training
steps' time and tokens/s, the peak resident memory over the training (on a CPU; CUDA: the peak
allocated), and the losses step by step, side by side.

    python benchmarks/heal_throughput.py --layers 21-24 --steps 12 --batch-size 4 --seq-len 256
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

from peak_memory import PeakMemory, run_variants, write_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

WAYS = ("ours-lm", "ours-distill", "trainer-lm")


def _cfg(args, loss: str):
    from depthcurse.heal import HealConfig
    from depthcurse.surgery import parse_layers

    return HealConfig(layers=tuple(parse_layers(args.layers, 10**6)), loss=loss, data=args.data, steps=args.steps, batch_size=args.batch_size,
                      seq_len=args.seq_len, lr=args.lr, eval_windows=1, seed=args.seed, save_every=10**6, lora_rank=args.rank).resolved()


def ours(args, loss: str) -> dict:
    import torch

    from depthcurse.heal import heal
    from depthcurse.loading import load_model

    loaded = load_model(args.model, device=args.device)
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
    loaded = load_model(args.model, device=args.device)
    seq_len = window_length(loaded.model, cfg.seq_len)
    data = build_data(cfg.data, loaded.tokenizer, seq_len=seq_len, pack=True, seed=cfg.seed, val_tokens=seq_len, start=start_tokens(loaded.tokenizer))
    rows = [data.train.next_batch(cfg.batch_size).input_ids for _ in range(cfg.steps)]  # heal's rows, in heal's order
    with tempfile.TemporaryDirectory() as folder:
        save_pruned(loaded.model, loaded.tokenizer, cfg.layers, folder)  # what `depthcurse drop` saves
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=loaded.dtype).to(loaded.device)
    del loaded
    torch.manual_seed(cfg.seed)  # the adapters' A: drawn as heal draws them, block by block
    model = get_peft_model(model, LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout, bias="none",
                                             target_modules=target_modules(model, (), cfg.targets)))
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
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--variant", choices=WAYS, help=argparse.SUPPRESS)  # a child process: one way
    parser.add_argument("--out", type=Path, default=None, help="also write the result as JSON here")
    args = parser.parse_args()
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
