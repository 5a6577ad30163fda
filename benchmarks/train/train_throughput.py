"""Training throughput and peak memory: our trainer's step against a plain eager loop, one run.

- reference: the papers' way. The same model with its plain modules (kernels off), SDPA
  attention, the full [tokens, vocab] logits into F.cross_entropy, Adam, nothing fused or compiled.
- trainer: `depthcurse.train.loop.train_step` on a model built and wrapped as `lns-train` does it
  (`build_model` + `parallelize`): fused norms and chunked linear + cross-entropy (`--kernels`),
  optionally `--compile` and `--activation-checkpointing`.

Both see the same random token batches, micro-batches, precision and optimizer. Each runs in a
child process of its own (`peak_memory.py`). Peak memory is the rise over the timed steps: on the
CPU of the resident set's high-water mark, on CUDA of torch.cuda.max_memory_allocated. Weights
and Adam state exist before the window opens, so this is activations, gradients and logits. On CUDA it also reports model FLOPs utilisation: (6 N + 12 L d T)
FLOPs per token (N the parameters outside the input embedding, T the sequence length: PaLM's
count, attention as if unmasked) times tokens/s, over `--peak-tflops`. For the 130m and 1b presets it
also prints how long one Table-1 run (2.2B and 8.9B tokens) takes at each measured speed.

    .venv/bin/python benchmarks/train/train_throughput.py                              # tiny, CPU, kernels' PyTorch path
    .venv/bin/python benchmarks/train/train_throughput.py --device cuda --preset 130m  # Triton kernels, bf16-mixed
    .venv/bin/python benchmarks/train/train_throughput.py --device cuda --preset 350m --compile --out /tmp/t.json
    .venv/bin/python benchmarks/train/train_throughput.py --device cuda --preset 130m --compile --compile-scope model \
        --compile-mode reduce-overhead --micro-batch 256 --variants trainer   # a lever alone, no reference

A variant that fails (out of memory, say) is reported by its error's last line; the other still runs.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path

import sys
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: peak_memory, which every command's scripts share
from peak_memory import PeakMemory, run_variants, write_json  # noqa: E402

VARIANTS = ("reference", "trainer")
# Tokens of one run of the paper's Table 1 (paper-notes: 130M about 2.2B tokens, 1B about 8.9B).
TABLE1_RUN_TOKENS = {"130m": 2.2e9, "1b": 8.9e9}


def run_variant(args) -> dict:
    """One variant in this (child) process: warm-up steps, then timed steps; returns the figures."""
    import torch
    import torch.nn.functional as F

    from depthcurse.train import loop as train
    from depthcurse.train.config import TrainConfig
    from depthcurse.train.data import Batch
    from depthcurse.train.distributed import World, parallelize

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    trainer = args.variant == "trainer"
    compiled = args.compile and trainer  # the reference is the plain eager loop
    cfg = TrainConfig(preset=args.preset, norm=args.norm, seq_len=args.seq_len, max_seq_len=args.seq_len,
                            batch_size=args.batch_size, micro_batch=args.micro_batch, precision=args.precision,
                            kernels=args.kernels if trainer else "off", compile=compiled,
                            compile_scope=args.compile_scope if compiled else "blocks",
                            compile_mode=args.compile_mode if compiled else "default",
                            fuse_projections=args.fuse_projections and trainer,
                            activation_checkpointing=args.activation_checkpointing and trainer).resolved()
    precision = train.precision_of(cfg, device)
    amp = train.autocast_for(precision, device)
    model = train.build_model(cfg, args.vocab, device, precision)
    kernels = model.model.kernels
    if args.loss == "fused" and trainer:
        # the plain blocks (inductor's fusion under --compile) with the chunked linear + cross-entropy,
        # which writes each chunk's gradient over its logits in one pass (Triton on CUDA)
        from depthcurse.train.kernels import fused_linear_cross_entropy

        model.loss_fn = functools.partial(fused_linear_cross_entropy, reduction="sum")
    elif args.loss == "plain" and trainer:
        # the fused norms (--kernels) with the loss inductor fuses under --compile
        from depthcurse.train.model import cross_entropy_sum

        model.loss_fn = cross_entropy_sum
    model = parallelize(model, cfg, World(), device)
    optimizer = train.build_optimizer(cfg, model)
    scheduler = train.build_scheduler(cfg, optimizer)
    g = torch.Generator().manual_seed(0)

    def batch() -> Batch:
        ids = torch.randint(0, args.vocab, (cfg.batch_size, cfg.seq_len + 1), generator=g)
        return Batch(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())

    def reference_step(b: Batch) -> float:
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        n_micro = cfg.batch_size // cfg.micro_batch
        for ids, targets in zip(b.input_ids.split(cfg.micro_batch), b.targets.split(cfg.micro_batch)):
            ids, targets = ids.to(device), targets.to(device)
            with amp:
                logits = model(ids)
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1)) / n_micro
            loss.backward()
            total += loss.item()
        optimizer.step()
        scheduler.step()
        return total

    # Attention's kernel: torch's choice (cuDNN's on an H100), or one backend forced for the
    # trainer's forward and backward; compiled code bakes in the backend it was traced under.
    attention = sdpa_backend(args.sdpa_backend if trainer else "auto")

    def step(b: Batch) -> float:
        if args.variant == "reference":
            return reference_step(b)
        with attention():
            return train.train_step(model, optimizer, scheduler, b, cfg.micro_batch, amp, 0.0, device)[0]

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(args.warmup):
        step(batch())
    sync()
    memory = PeakMemory(device)
    memory.start()
    seconds, losses = [], []
    for _ in range(args.steps):
        b = batch()
        started = time.perf_counter()
        losses.append(step(b))
        sync()
        seconds.append(time.perf_counter() - started)
    peak = memory.rise()
    raw = model.module if hasattr(model, "module") else model
    tokens = cfg.batch_size * cfg.seq_len
    median = statistics.median(seconds)
    flops_per_token = raw.flops_per_token(cfg.seq_len)
    result = {
        "variant": args.variant, "kernels": kernels, "compile": f"{cfg.compile_scope}/{cfg.compile_mode}" if cfg.compile else False, "fuse_projections": cfg.fuse_projections, "sdpa_backend": args.sdpa_backend if trainer else "auto", "loss": args.loss if trainer else "model", "activation_checkpointing": cfg.activation_checkpointing,
        "precision": precision, "params": raw.num_params(), "tokens_per_step": tokens, "micro_batch": cfg.micro_batch, "seconds": seconds,
        "median_seconds": median, "tokens_per_s": tokens / median, "peak_bytes": peak,
        "first_loss": float(losses[0]), "last_loss": float(losses[-1]),
    }
    if args.profile:
        result["profile"] = profile_step(step, batch(), sync, device)
    if device.type == "cuda":
        result["mfu"] = flops_per_token * tokens / median / (args.peak_tflops * 1e12)
        result["peak_bytes_kind"] = "torch.cuda.max_memory_allocated above the allocated memory before the timed steps"
    else:
        result["peak_bytes_kind"] = "resident set high-water mark above the size before the timed steps"
    return result


SDPA_BACKENDS = ("auto", "flash", "efficient", "cudnn", "math")


def sdpa_backend(name: str):
    """A context-manager factory that runs scaled_dot_product_attention on one backend only ("auto": torch's choice)."""
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    if name == "auto":
        return contextlib.nullcontext
    backend = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
               "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[name]
    return lambda: sdpa_kernel([backend])


def profile_step(step, b, sync, device) -> dict:
    """One more step under torch.profiler: its wall time, how much of it the device was busy
    (the rest is the host: launches, syncs, the Python between them), and the operators that
    took most of its time, as a table."""
    import torch

    cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    sync()
    with torch.profiler.profile(activities=activities) as prof:
        started = time.perf_counter()
        step(b)
        sync()
        wall = time.perf_counter() - started
    averages = prof.key_averages()
    out = {"wall_seconds": wall, "table": averages.table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total",
                                                         row_limit=25, max_name_column_width=70)}
    if cuda:  # the kernels themselves (each also counts under the operator that launched it)
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        out["device_busy_seconds"] = sum(e.self_device_time_total for e in kernels) / 1e6
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", help="model and batch preset: tiny, 130m, 250m, 350m, 1b")
    parser.add_argument("--norm", default="lns")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: 49152, SmolLM2's, for tiny; 32100, t5-base's, otherwise)")
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per step (default: the preset's)")
    parser.add_argument("--micro-batch", type=int, default=None, help="sequences per forward/backward (default: the preset's)")
    parser.add_argument("--seq-len", type=int, default=None, help="default: the preset's")
    parser.add_argument("--precision", default="auto", help="auto: bf16-mixed on CUDA, fp32 on the CPU")
    parser.add_argument("--kernels", default=None, help="the trainer's kernels (default: auto on CUDA, torch on the CPU, where auto means off)")
    parser.add_argument("--compile", action="store_true", help="compile the trainer's blocks")
    parser.add_argument("--compile-scope", default="blocks", help="with --compile: blocks (each block and the loss) or model (the whole forward)")
    parser.add_argument("--compile-mode", default="default", help="with --compile: torch.compile's mode (reduce-overhead: CUDA graphs; max-autotune)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="which to run, comma-separated (trainer alone saves the reference's compile and steps on a GPU)")
    parser.add_argument("--fuse-projections", action="store_true", help="the trainer: one matmul for q, k, v and one for gate, up")
    parser.add_argument("--loss", choices=("model", "fused", "plain"), default="model",
                        help="the trainer's loss: the model's (with --kernels off the plain one, else fused), the chunked linear + cross-entropy (fused), "
                             "or the full logits into cross-entropy (plain, compiled with --compile)")
    parser.add_argument("--sdpa-backend", choices=SDPA_BACKENDS, default="auto", help="the trainer's attention kernel (auto: torch's choice)")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (more with --compile)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--threads", type=int, default=1, help="1: on a busy CPU, idle threads spinning made small steps many times slower")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="the accelerator's peak, for MFU (H100 SXM dense bf16: 989)")
    parser.add_argument("--profile", action="store_true", help="after the timed steps, profile one more step of each variant: the device's busy share and the top operators")
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # set in the child processes
    args = parser.parse_args()
    if args.vocab is None:
        args.vocab = 49152 if args.preset == "tiny" else 32100
    if args.kernels is None:
        args.kernels = "auto" if args.device.startswith("cuda") else "torch"

    if args.variant:
        print(json.dumps(run_variant(args)))
        return

    chosen = tuple(v for v in VARIANTS if v in args.variants.split(","))
    if not chosen or set(args.variants.split(",")) - set(VARIANTS):
        parser.error(f"--variants takes a comma-separated list of {', '.join(VARIANTS)}")
    results, conditions = run_variants(__file__, chosen, keep_going=True)
    load_before = conditions["load_average_before"]
    ran = [r for r in results.values() if "error" not in r]
    summary = {
        "preset": args.preset, "norm": args.norm, "device": args.device, "vocab": args.vocab, "threads": args.threads,
        "warmup": args.warmup, "steps": args.steps, **conditions, "results": results,
    }
    shown = ran[0] if ran else {}
    print(f"{args.preset} ({shown.get('params', 0) / 1e6:.2f}M parameters, vocab {args.vocab}), {shown.get('tokens_per_step')} tokens per step, "
          f"{args.device}, {shown.get('precision')}, {args.threads} threads, {args.steps} timed steps after {args.warmup}; "
          f"load average before {load_before[0]:.2f}, after {conditions['load_average_after'][0]:.2f}")
    mfu = any("mfu" in r for r in ran)
    print(f"{'variant':<10} {'kernels':>8} {'compile':>30} {'tokens/s':>10} {'median s':>9} {'peak MB':>9}" + ("  MFU" if mfu else ""))
    for r in results.values():
        if "error" in r:
            print(f"{r['variant']:<10} failed: {r['error']}")
            continue
        print(f"{r['variant']:<10} {r['kernels']:>8} {str(r['compile']):>30} {r['tokens_per_s']:>10.0f} {r['median_seconds']:>9.3f} "
              f"{r['peak_bytes'] / 1e6:>9.1f}" + (f"  {r['mfu']:.1%}" if "mfu" in r else ""))
    if args.preset in TABLE1_RUN_TOKENS and ran:
        tokens = TABLE1_RUN_TOKENS[args.preset]
        summary["table1_run_hours"] = {r["variant"]: tokens / r["tokens_per_s"] / 3600 for r in ran}
        print(f"one Table-1 run ({tokens / 1e9:.1f}B tokens) at these speeds: "
              + ", ".join(f"{name} {hours:.1f} h" for name, hours in summary["table1_run_hours"].items()))
    if len(ran) == 2:
        ref, ours = ran
        summary["throughput_ratio_trainer_over_reference"] = ours["tokens_per_s"] / ref["tokens_per_s"]
        summary["peak_memory_ratio_trainer_over_reference"] = ours["peak_bytes"] / ref["peak_bytes"]
        print(f"trainer / reference: throughput {summary['throughput_ratio_trainer_over_reference']:.2f}x, "
              f"peak memory {summary['peak_memory_ratio_trainer_over_reference']:.2f}x; first-step loss {ref['first_loss']:.4f} vs {ours['first_loss']:.4f}")
    for r in ran if args.profile else ():
        p = r["profile"]
        busy = f", device busy {p['device_busy_seconds']:.3f} s ({p['device_busy_seconds'] / p['wall_seconds']:.0%})" if "device_busy_seconds" in p else ""
        print(f"\n{r['variant']}: one step under the profiler, {p['wall_seconds']:.3f} s{busy}\n{p['table']}")
    write_json(args.out, summary)


if __name__ == "__main__":
    main()
