"""MMLU sweep, `--engine lm-eval` (b) against `--engine reuse` (c), on the real MMLU prompts.

The prompts are lm-eval's own (the offline MMLU copy, `depthcurse assets`), tokenised by SmolLM2's
tokenizer (offline). The model is a published shape with random weights (its vocabulary set to
the tokenizer's), since timings depend on shapes, not values; or, with `--weights smollm2-135m`,
SmolLM2's real weights from the offline cache. Printed: wall time of each side, (c) again
with one row per sequence (padded, `pack=False`) and how far its scores are from the packed ones,
with `--compile` (c) through compiled blocks (compiling, then warm) and how far from eager, the reuse
engine's achieved TFLOP/s (the multiply-adds of the block passes it ran and of the head on
the scored positions, times 2), the arithmetic floor (c)/(b), and how many questions get another
answer from (c) than from (b) in any variant (ties in bf16 are where they may differ).

    python benchmarks/prune/sweep_mmlu.py --shape smollm2-135m --limit 1 --every 10               # CPU, minutes
    python benchmarks/prune/sweep_mmlu.py --weights smollm2-135m --limit 2 --every 3 --skip-b --skip-unpacked --compile
    python benchmarks/prune/sweep_mmlu.py --shape llama-2-7b --device cuda --dtype bf16 --limit 10
    python benchmarks/prune/sweep_mmlu.py --shape llama-2-7b --device cuda --dtype bf16 --limit 0 --skip-b   # full MMLU, reuse only
    python benchmarks/prune/sweep_mmlu.py --weights smollm2-135m --device cuda --dtype bf16 --limit 5
    # full MMLU on a 7B shape, compiled, in parts: rerun the same command until it prints its result
    timeout -s INT 560 python benchmarks/prune/sweep_mmlu.py --shape llama-2-7b --device cuda --dtype bf16 --limit 0 --skip-b \
        --skip-unpacked --compiled-only --store /root/mmlu-7b --peak-tflops 989
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch
import sys
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: peak_memory, which every command's scripts share
from peak_memory import write_json  # noqa: E402
from sweep_shapes import DTYPES, SHAPES, multiply_adds_per_token  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")


def answers(results: dict) -> dict[tuple[str, int], int]:
    """(subtask, question) -> the chosen choice (argmax of the log-likelihoods), from lm-eval's samples."""
    out = {}
    for task, samples in results["samples"].items():
        for s in samples:
            lls = [r[0] for r in s["filtered_resps"]]
            out[(task, s["doc_id"])] = max(range(len(lls)), key=lls.__getitem__)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--weights", choices=["random", "smollm2-135m"], default="random")
    parser.add_argument("--tokenizer", default="smollm2-135m", help="with random weights: the tokenizer (a name or a folder)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--limit", type=int, default=1, help="questions per subject (0: all 14,042)")
    parser.add_argument("--shots", type=int, default=0)
    parser.add_argument("--every", type=int, default=1, help="remove every n-th layer (1: all of them)")
    parser.add_argument("--batch-size", type=int, default=32, help="(b)'s lm-eval batch size")
    parser.add_argument("--max-memory", default="auto", help="(c)'s budget")
    parser.add_argument("--min-prefix-saving", type=int, default=None, help="(c) shares a prefix only where it saves this many token passes (default: the device's rule; 0: wherever 16 tokens are shared)")
    parser.add_argument("--skip-b", action="store_true", help="time the reuse engine only (full MMLU on lm-eval takes hours)")
    parser.add_argument("--skip-unpacked", action="store_true", help="do not also time (c) with one row per sequence (padded)")
    parser.add_argument("--compile", action="store_true", help="also time (c) through compiled blocks (torch.compile), twice: compiling, then warm")
    parser.add_argument("--compiled-only", action="store_true", help="(c) through compiled blocks only, compiling included: no eager run to compare with (a 7B full sweep, where each run takes minutes)")
    parser.add_argument("--store", type=Path, default=None, help="(c) saves its finished batches here, and a rerun of the same command loads them: a sweep longer than one sitting (a device call's 10 minutes) is timed in parts, c_score_s_in_all adds the parts")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's dense peak, for the MFU (H100 SXM bf16: 989)")
    parser.add_argument("--out", type=Path, default=None, help="also write the result as JSON here")
    args = parser.parse_args()

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from depthcurse import assets
    from depthcurse.loading import load_model
    from depthcurse.prune.requests import LmEvalRequests
    from depthcurse.prune.layout import parse_memory
    from depthcurse.prune.scoring import score_requests
    from depthcurse.prune.stepping import Stepper
    from depthcurse.surgery import removed_layers
    from depthcurse.tasks import build_task
    from depthcurse.tasks.harness import quiet_lm_eval

    quiet_lm_eval()
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    started = time.perf_counter()
    if args.weights == "random":
        tokenizer = AutoTokenizer.from_pretrained(assets.resolve_model(args.tokenizer))
        shape = {**SHAPES[args.shape], "vocab_size": len(tokenizer)}
        torch.manual_seed(0)
        with device:
            model = LlamaForCausalLM(LlamaConfig(**shape, attn_implementation="sdpa")).to(dtype).eval()
    else:
        loaded = load_model("smollm2-135m", dtype=args.dtype, device=args.device)
        model, tokenizer, shape = loaded.model, loaded.tokenizer, SHAPES["smollm2-135m"]
    task = build_task("mmlu", tokenizer, limit=args.limit or None, num_fewshot=args.shots, batch_size=args.batch_size)
    start_s = time.perf_counter() - started
    n = shape["num_hidden_layers"]
    variants = [()] + [(i,) for i in range(0, n, args.every)]

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    t0 = time.perf_counter()
    requests = LmEvalRequests(task, model)
    build_s = time.perf_counter() - t0
    budget = parse_memory(args.max_memory, device)
    # warm-up on the engine's shapes (kernel choice, allocator), then the timed run
    main_stepper = Stepper(model, compile=args.compiled_only)
    t0 = time.perf_counter()
    score_requests(main_stepper, requests.requests[:64], variants[:2], max_memory=budget)
    sync()
    warmup_s = time.perf_counter() - t0  # with --compiled-only, mostly compiling
    t0 = time.perf_counter()
    lp, greedy, stats = score_requests(main_stepper, requests.requests, variants, max_memory=budget, min_prefix_saving=args.min_prefix_saving,
                                       store=args.store, fingerprint=f"sweep_mmlu {args.shape} {args.weights} {args.dtype}")
    sync()
    score_s = time.perf_counter() - t0
    unpacked = {}
    if not args.skip_unpacked:  # the same engine, one row per sequence: what packing saves
        t0 = time.perf_counter()
        lp_u, greedy_u, stats_u = score_requests(Stepper(model), requests.requests, variants, max_memory=budget, pack=False,
                                                  min_prefix_saving=args.min_prefix_saving)
        sync()
        unpacked = {"c_unpacked_score_s": round(time.perf_counter() - t0, 2), "c_unpacked_batches": stats_u["batches"],
                    "c_unpacked_padding": round(1 - stats_u["tokens"] / stats_u["batch_tokens"], 3),
                    "packed_vs_unpacked_max_abs_ll": float((lp - lp_u).abs().max()), "packed_vs_unpacked_greedy_differ": int((greedy != greedy_u).sum())}
        unpacked["c_packed_over_unpacked"] = round(score_s / unpacked["c_unpacked_score_s"], 3)
    compiled = {}
    if args.compile and not args.compiled_only:  # the same engine through compiled blocks: the first run compiles, the second is warm
        stepper = Stepper(model, compile=True)
        for run in ("first", "warm"):
            t0 = time.perf_counter()
            lp_c, greedy_c, _ = score_requests(stepper, requests.requests, variants, max_memory=budget, min_prefix_saving=args.min_prefix_saving)
            sync()
            compiled[f"c_compiled_{run}_score_s"] = round(time.perf_counter() - t0, 2)
        compiled.update(c_compiled_over_eager=round(compiled["c_compiled_warm_score_s"] / score_s, 3),
                        compiled_vs_eager_max_abs_ll=float((lp - lp_c).abs().max()), compiled_vs_eager_greedy_differ=int((greedy != greedy_c).sum()))
    t0 = time.perf_counter()
    reuse = {v: requests.results(lp[i], greedy[i], log_samples=True) for i, v in enumerate(variants)}
    metrics_s = time.perf_counter() - t0
    c_s = build_s + score_s + metrics_s

    distinct = {r.inputs for r in requests.requests}
    mean_len = sum(map(len, distinct)) / len(distinct)
    block, head = multiply_adds_per_token(shape, int(mean_len))
    scored = sum(len(r.targets) for r in requests.requests)
    engine_flops = 2 * (stats["block_passes"] * block + len(variants) * scored * head)
    plain_flops = 2 * (stats["plain_block_passes"] * block + len(variants) * scored * head)
    result = {
        "shape": args.shape if args.weights == "random" else "smollm2-135m (real weights)", "vocab": shape["vocab_size"] if args.weights == "random" else len(tokenizer),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or platform.machine(),
        "dtype": args.dtype, "torch": torch.__version__, "threads": torch.get_num_threads(), "shots": args.shots,
        "questions": len(answers(reuse[()])), "requests": len(requests.requests), "mean_input_tokens": round(mean_len, 1),
        "variants": len(variants), "batches": stats["batches"], "prefix_groups": stats["prefix_groups"], "min_prefix_saving": stats["min_prefix_saving"], "max_memory": budget,
        "packing": stats["packing"], "c_padding": round(1 - stats["tokens"] / stats["batch_tokens"], 3),
        "c_compiled": args.compiled_only, "batches_resumed": stats["batches_resumed"],
        "c_score_s_in_all": round(score_s + stats["seconds_resumed"], 2),
        "start_s": round(start_s, 2), "c_warmup_s": round(warmup_s, 2), "c_build_requests_s": round(build_s, 2), "c_score_s": round(score_s, 2), "c_metrics_s": round(metrics_s, 2), "c_reuse_s": round(c_s, 2),
        "c_tflops": round(engine_flops / score_s / 1e12, 2), "floor_c_over_b": round(engine_flops / plain_flops, 3) if not stats["batches_resumed"] else None,  # this part's passes only
        **unpacked, **compiled,
    }
    if args.peak_tflops:
        result["c_mfu"] = round(result["c_tflops"] / args.peak_tflops, 3)
    if not args.skip_b:
        task.run(model)  # warm-up
        sync()
        t0 = time.perf_counter()
        plain = {}
        for v in variants:
            with removed_layers(model, v):
                plain[v] = task.run(model, log_samples=True)
        sync()
        b_s = time.perf_counter() - t0
        differ = {v: sum(a != b for a, b in zip(answers(plain[v]).values(), answers(reuse[v]).values())) for v in variants}
        same_acc = all(task.score(plain[v]).metrics == task.score(reuse[v]).metrics for v in variants)
        result.update(b_lm_eval_s=round(b_s, 2), c_over_b=round(c_s / b_s, 3), answers_differing=sum(differ.values()),
                      variants_with_differences=sum(1 for d in differ.values() if d), accuracy_identical=same_acc,
                      baseline_acc=task.score(plain[()]).metrics.get("acc"))
    print(json.dumps(result), flush=True)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
