"""When sharing a prompt prefix pays: the reuse engine's scoring time on one lm-eval task three ways, one run.

    (1) every shared prefix of 16 tokens or more run once per variant (`min_prefix_saving=0`);
    (2) the engine's rule: a group only where the token passes it saves reach twice
        `layout.small_batch_tokens` (what one block call costs on this device, in tokens);
    (3) no sharing: every row in full, packed into large batches;
    (4) the rule, but a prefix whose keys and values for every variant exceed half the memory
        budget runs whole, as before the engine shared such a prefix with a share of the
        variants at a time (`Batcher._variant_chunks`): 5-shot MMLU's long history blocks.

A prefix group runs its prefix alone and its rows in batches of their own, so it trades token
passes for block calls. Printed per way: seconds, batches, prefix groups, token-block passes.
SmolLM2-135M's real weights from the offline cache; the tasks' offline copies (`depthcurse assets`).

    python benchmarks/prune/prefix_sharing.py --task arc_easy --limit 40
    python benchmarks/prune/prefix_sharing.py --task mmlu --limit 2
    python benchmarks/prune/prefix_sharing.py --task mmlu --limit 1 --shots 5 --every 10
    python benchmarks/prune/prefix_sharing.py --task mmlu_high_school_european_history --limit 5 --shots 5 --every 1 --ways rule,unsplit
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import time
from pathlib import Path
from unittest import mock

import torch

import sys
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: peak_memory, which every command's scripts share
from peak_memory import write_json  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")


def unsplit_prefixes():
    """The engine as before prefixes were split into shares of the variants: a prefix too large
    for the budget runs its rows whole (way 4 here, `sweep_layout.py --unsplit`)."""
    from depthcurse.prune.layout import Batcher

    return mock.patch.object(Batcher, "_variant_chunks", lambda *a: None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="arc_easy")
    parser.add_argument("--limit", type=int, default=40, help="examples per subtask")
    parser.add_argument("--shots", type=int, default=0)
    parser.add_argument("--every", type=int, default=3, help="remove every n-th layer (1: all of them)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-memory", default="auto", help="the engine's budget (auto: 2GB on a CPU)")
    parser.add_argument("--ways", default="every,rule,none,unsplit", help="which of the four ways, comma-separated")
    parser.add_argument("--out", type=Path, default=None, help="also write the result as JSON here")
    args = parser.parse_args()

    from depthcurse.loading import load_model
    from depthcurse.prune.requests import LmEvalRequests
    from depthcurse.prune.layout import parse_memory, small_batch_tokens
    from depthcurse.prune.scoring import score_requests
    from depthcurse.prune.stepping import Stepper
    from depthcurse.tasks import build_task
    from depthcurse.tasks.harness import quiet_lm_eval

    quiet_lm_eval()
    loaded = load_model("smollm2-135m", device=args.device, fp32_on_cpu="as this benchmark's figures in docs/benchmarks.md were measured")
    task = build_task(args.task, loaded.tokenizer, limit=args.limit, num_fewshot=args.shots)
    requests = LmEvalRequests(task, loaded.model).requests
    n = len(loaded.model.model.layers)
    variants = [()] + [(i,) for i in range(0, n, args.every)]
    stepper = Stepper(loaded.model)
    budget = parse_memory(args.max_memory, stepper.device)
    ways = {"every": ("every prefix", dict(min_prefix_saving=0)), "rule": ("the rule", {}), "none": ("none", dict(share_prefixes=False)),
            "unsplit": ("rule, unsplit", {})}
    chosen = args.ways.split(",")
    if not chosen or set(chosen) - set(ways):
        parser.error(f"--ways: some of {','.join(ways)}")
    result = {"task": args.task, "limit": args.limit, "shots": args.shots, "requests": len(requests), "variants": len(variants),
              "device": (platform.processor() or platform.machine()) if args.device == "cpu" else torch.cuda.get_device_name(),
              "threads": torch.get_num_threads(), "small_batch_tokens": small_batch_tokens(stepper), "ways": {}}
    score_requests(stepper, requests[:16], variants[:2], max_memory=budget)  # warm-up
    scores = {}
    for way in chosen:
        name, options = ways[way]
        t0 = time.perf_counter()
        with unsplit_prefixes() if way == "unsplit" else contextlib.nullcontext():
            scores[name], _, stats = score_requests(stepper, requests, variants, max_memory=budget, **options)
        seconds = time.perf_counter() - t0
        keys = ("batches", "prefix_groups", "prefix_groups_split", "prefix_groups_too_large", "block_passes")
        result["ways"][name] = {"seconds": round(seconds, 2), **{k: stats[k] for k in keys}}
        print(f"{name:<13} {seconds:8.1f} s  {stats['batches']:5d} batches  {stats['prefix_groups']:5d} prefix groups "
              f"({stats['prefix_groups_split']} split, {stats['prefix_groups_too_large']} too large)  {stats['block_passes']:>10,} token-block passes", flush=True)
    first = next(iter(scores.values()))
    result["max_abs_ll_difference"] = max(float((s - first).abs().max()) for s in scores.values())
    print(json.dumps(result))
    write_json(args.out, result)


if __name__ == "__main__":
    main()
