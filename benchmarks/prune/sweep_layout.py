"""The reuse engine's layout of an MMLU sweep, on the meta device: what a GPU run will compute,
known before a GPU is booked. A published shape (no weights: the meta device), lm-eval's real
MMLU requests (the offline copy, SmolLM2's tokenizer), every single-layer variant; printed per
memory budget: batches, prefix groups (split into shares of the variants, or too large and run
whole), token-block passes (`Layout.block_passes`, equal to what a run counts), and FLOPs. With `--unsplit`, also the layout of a prefix too large for the budget running whole
(the engine before it shared such a prefix with a few variants at a time). With `--ranks`, also
how evenly torchrun's ranks share the batches: the busiest rank's token-block passes against an
even share, for the shares `Layout.share_out` gives and for every N-th batch per rank (the
engine before).

    python benchmarks/prune/sweep_layout.py --shape llama-2-7b --shots 5 --max-memory 16GB,24GB,40GB,52GB --unsplit
    python benchmarks/prune/sweep_layout.py --shape smollm2-135m --dtype fp32 --shots 5 --max-memory 2GB --unsplit --rules cpu
    python benchmarks/prune/sweep_layout.py --shape llama-2-7b --shots 0 --ranks 2,4,8

The H100's `auto` budget for the 7B shape is 52 GiB (0.8 of the 65.9 GiB free beside its 12.8 GiB).
Building 5-shot requests takes about a minute on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import os

import torch
from prefix_sharing import unsplit_prefixes
from sweep_shapes import DTYPES, SHAPES, multiply_adds_per_token

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-2-7b")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--tokenizer", default="smollm2-135m", help="a name or a folder")
    parser.add_argument("--limit", type=int, default=0, help="questions per subject (0: all 14,042)")
    parser.add_argument("--shots", type=int, default=0)
    parser.add_argument("--max-memory", default="52GB", help="budgets, comma-separated")
    parser.add_argument("--rules", choices=["cuda", "cpu"], default="cuda", help="whose prefix-sharing rule and batch cap to plan by")
    parser.add_argument("--unsplit", action="store_true", help="also the layout with a too-large prefix run whole")
    parser.add_argument("--ranks", type=lambda text: [int(n) for n in text.split(",") if n], default=[], metavar="N,N,...",
                        help="numbers of torchrun ranks, comma-separated: how evenly they share the batches")
    args = parser.parse_args()

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from depthcurse import assets
    from depthcurse.prune.requests import LmEvalRequests
    from depthcurse.prune.layout import MAX_BATCH_TOKENS, lay_out, parse_memory
    from depthcurse.prune.stepping import Stepper
    from depthcurse.tasks import build_task
    from depthcurse.tasks.harness import quiet_lm_eval

    quiet_lm_eval()
    tokenizer = AutoTokenizer.from_pretrained(assets.resolve_model(args.tokenizer))
    shape = {**SHAPES[args.shape], "vocab_size": len(tokenizer)}
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**shape, attn_implementation="sdpa")).to(DTYPES[args.dtype]).eval()
    task = build_task("mmlu", tokenizer, limit=args.limit or None, num_fewshot=args.shots)
    requests = LmEvalRequests(task, model).requests
    stepper = Stepper(model)
    stepper.device = torch.device(args.rules)  # that device's rules (prefix sharing, batch cap); nothing runs
    variants = [()] + [(i,) for i in range(stepper.n_layers)]
    distinct = {r.inputs for r in requests}
    block, _ = multiply_adds_per_token(shape, int(sum(map(len, distinct)) / len(distinct)))  # as sweep_mmlu counts them
    print(f"{args.shape} {args.dtype}, MMLU {args.shots}-shot, {len(requests):,} requests, {len(variants)} variants")
    for text in args.max_memory.split(","):
        budget = parse_memory(text)
        for way in ("shares", "unsplit") if args.unsplit else ("shares",):
            with unsplit_prefixes() if way == "unsplit" else contextlib.nullcontext():
                # packed, as a Llama sweep runs (score_requests asks the model, which the meta device cannot answer)
                layout = lay_out(stepper, requests, variants, max_memory=budget, pack=True, max_batch_tokens=MAX_BATCH_TOKENS[args.rules])
            passes, batcher = layout.block_passes(), layout.batcher
            print(f"{text:>8} {way:<8} {len(layout.batches):5d} batches  {sum(1 for g in layout.groups if g.prefix):4d} prefix groups "
                  f"({batcher.split} split, {batcher.unshared} too large)  {passes / 1e6:9.1f} M token-block passes  "
                  f"{2 * passes * block:.3g} FLOPs in the blocks", flush=True)
            for ranks in args.ranks:
                for name, shares in (("shared out", layout.share_out(ranks)),
                                     ("every Nth", [list(range(r, len(layout.batches), ranks)) for r in range(ranks)])):
                    per = [layout.block_passes(ks) for ks in shares]
                    print(f"{'':>17} {ranks} ranks, {name:<10}  busiest {max(per) / 1e6:8.1f} M passes, "
                          f"{max(per) / (passes / ranks):.3f}x an even share; all ranks {sum(per) / passes:.3f}x one process", flush=True)


if __name__ == "__main__":
    main()
