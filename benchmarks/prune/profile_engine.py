"""Where a batch of the reuse engine spends its GPU time: torch.profiler over one batch of every
variant, on a published shape with random weights and rows of MMLU-like lengths (no data needed).

Printed: the batch's wall time and achieved TFLOP/s packed and padded, and the operators that
took most device time. Timings depend on shapes, not values.

    python benchmarks/prune/profile_engine.py --shape llama-2-7b --device cuda --dtype bf16
    python benchmarks/prune/profile_engine.py --shape smollm2-135m            # CPU, a smaller batch
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from sweep_shapes import DTYPES, SHAPES, multiply_adds_per_token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--tokens", type=int, default=None, help="tokens in the batch (default: the device's batch cap)")
    parser.add_argument("--rows", default="60-250", help="row lengths, uniform in this range (0-shot MMLU: mean 126)")
    parser.add_argument("--top", type=int, default=18, help="operators to list")
    args = parser.parse_args()

    from transformers import LlamaConfig, LlamaForCausalLM

    from depthcurse.prune.layout import MAX_BATCH_TOKENS, TokenRequest
    from depthcurse.prune.scoring import score_requests
    from depthcurse.prune.stepping import Stepper

    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    shape = SHAPES[args.shape]
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)  # initialised in place: a 7B model never exists in fp32
    with device:
        model = LlamaForCausalLM(LlamaConfig(**shape, attn_implementation="sdpa")).eval()
    torch.set_default_dtype(torch.float32)
    cap = args.tokens or MAX_BATCH_TOKENS[device.type]
    lo, hi = map(int, args.rows.split("-"))
    gen = torch.Generator().manual_seed(0)
    requests, total = [], 0
    while total < 0.97 * cap:  # a batch's worth, as packing fills it
        n = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        row = tuple(torch.randint(3, shape["vocab_size"], (n,), generator=gen).tolist())
        requests += [TokenRequest(row, n - 1, (c,)) for c in (4, 5, 6, 7)]  # four choices, one answer token each
        total += n
    n_layers = shape["num_hidden_layers"]
    variants = [()] + [(i,) for i in range(n_layers)]
    stepper = Stepper(model)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    block, head = multiply_adds_per_token(shape, (lo + hi) // 2)
    result = {"shape": args.shape, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "dtype": args.dtype, "rows": len(requests) // 4, "tokens": total}
    for name, pack in (("packed", True), ("padded", False)):
        score_requests(stepper, requests[:64], variants[:3], max_memory=2**36, pack=pack, max_batch_tokens=cap)  # warm-up
        sync()
        t0 = time.perf_counter()
        _, _, stats = score_requests(stepper, requests, variants, max_memory=2**36, pack=pack, max_batch_tokens=cap)
        sync()
        seconds = time.perf_counter() - t0
        flops = 2 * (stats["block_passes"] * block + len(variants) * len(requests) * head)
        result[name] = {"batches": stats["batches"], "padding": round(1 - stats["tokens"] / stats["batch_tokens"], 3), "seconds": round(seconds, 3), "tflops": round(flops / seconds / 1e12, 1)}
    print(json.dumps(result), flush=True)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        score_requests(stepper, requests, variants, max_memory=2**36, max_batch_tokens=cap)
        sync()
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=args.top, max_name_column_width=60))


if __name__ == "__main__":
    main()
