"""ppl sweep, `--engine lm-eval` (b) against `--engine reuse` (c), on a published model shape with
random weights: wall time depends on the shapes, not the values, so this runs where the real
weights are not (a GPU machine without the hub) and at sizes the CPU cannot (Llama-2-7B).

Both sides are timed as library calls, no files written, each after one warm-up call on its
own shapes: (b) evaluates each variant on its own (`surgery.removed_layers` +
`PerplexityTask.evaluate`), (c) calls `engine.evaluate_variants` (its architecture check and
request building included). Also printed: the analytic floor
(token-block passes (c) needs over (b)'s, and the same with the head's multiply-adds counted)
and the largest difference of the mean loss between (b) and (c).

    python benchmarks/prune/sweep_shapes.py --shape smollm2-135m                     # CPU, fp32
    python benchmarks/prune/sweep_shapes.py --shape llama-2-7b --device cuda --dtype bf16 --windows 8 --seq-len 4096
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
import sys
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: peak_memory, which every command's scripts share
from peak_memory import write_json  # noqa: E402

# From the models' published config.json files.
SHAPES = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True),
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=True),
    "llama-2-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=False),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class TokenIds:
    """Stands in for a tokenizer: each text is already a list of token ids."""

    eos_token_id = None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": text}


def multiply_adds_per_token(c: dict, seq_len: int) -> tuple[float, float]:
    """(one block, the head) per token: projections, MLP, and attention over seq_len/2 keys on average."""
    d, h, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = d // h
    block = d * d * 2 + d * kv * head_dim * 2 + 3 * d * c["intermediate_size"] + 2 * h * head_dim * seq_len / 2
    return block, d * c["vocab_size"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8, help="windows per forward pass of (b)")
    parser.add_argument("--every", type=int, default=1, help="remove every n-th layer (1: all of them)")
    parser.add_argument("--max-memory", default="16GB", help="(c)'s budget for kept streams")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None, help="also write the result as JSON here")
    args = parser.parse_args()

    from transformers import LlamaConfig, LlamaForCausalLM

    from depthcurse.prune import engine
    from depthcurse.surgery import removed_layers
    from depthcurse.tasks import PerplexityTask

    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    shape = SHAPES[args.shape]
    torch.manual_seed(0)
    with device:
        model = LlamaForCausalLM(LlamaConfig(**shape, attn_implementation="sdpa")).to(dtype).eval()
    g = torch.Generator().manual_seed(1)
    texts = [torch.randint(0, shape["vocab_size"], (args.seq_len,), generator=g).tolist() for _ in range(args.windows)]
    task = PerplexityTask(TokenIds(), texts, source="random tokens", seq_len=args.seq_len, limit=args.windows, batch_size=args.batch_size)
    n = shape["num_hidden_layers"]
    variants = [()] + [(i,) for i in range(0, n, args.every)]

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    # Warm-up, each side on its own shapes: cuBLAS and cuDNN choose kernels per shape on first
    # use, and the allocator grows. Measured cold, (c) on a GPU took up to 3x its warm time.
    task.evaluate(model)
    engine.evaluate_variants(model, task, variants[1:2], max_memory=args.max_memory)
    sync()
    t0 = time.perf_counter()
    b = {}
    for v in variants:
        with removed_layers(model, v):
            b[v] = task.evaluate(model).metrics["loss"]
    sync()
    b_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    scores, stats = engine.evaluate_variants(model, task, variants[1:], max_memory=args.max_memory)
    sync()
    c_s = time.perf_counter() - t0

    block, head = multiply_adds_per_token(shape, args.seq_len)
    tokens = task.windows.numel() - len(task.windows)  # inputs: every window's last token is only a target
    plain_work = stats["plain_block_passes"] * block + len(variants) * tokens * head
    engine_work = stats["block_passes"] * block + len(variants) * tokens * head
    result = {
        "shape": args.shape, "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or platform.machine(),
        "dtype": args.dtype, "torch": torch.__version__, "threads": torch.get_num_threads(), "windows": args.windows, "seq_len": args.seq_len,
        "variants": len(variants), "b_lm_eval_s": round(b_s, 3), "c_reuse_s": round(c_s, 3), "c_over_b": round(c_s / b_s, 3),
        "floor_block_passes": round(stats["block_passes"] / stats["plain_block_passes"], 3),
        "floor_with_head": round(engine_work / plain_work, 3),
        "max_loss_diff_b_c": max(abs(b[v] - scores[v].metrics["loss"]) for v in variants),
        "batches": stats["batches"], "baseline_loss": b[()],
    }
    print(json.dumps(result), flush=True)
    print(f"{args.shape} {args.dtype} on {result['device']}: {len(variants)} variants x {args.windows} x {args.seq_len} tokens; "
          f"(b) {b_s:.2f} s, (c) {c_s:.2f} s, (c)/(b) {c_s / b_s:.3f}; floor {result['floor_with_head']:.3f} "
          f"(blocks alone {result['floor_block_passes']:.3f}); max |loss diff| {result['max_loss_diff_b_c']:.2g}")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
