"""The capability probes through prune's reuse engine (every variant at once, one teacher-forced
pass per example) against the same probes by `model.generate`, greedy, variant by variant and
example by example: the time ratio, interleaved A B A B in one process, and whether every
example's exact match is the same. docs/benchmarks.md has the figures, from:

    python benchmarks/prune/probes_engine.py --model smollm2-135m --probes probe_add_1d,probe_brackets_2,probe_copy_8,probe_recall_4 \
        --limit 10 --layers 8,16,24 --repeats 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from depthcurse.loading import load_model
from depthcurse.prune.engine import evaluate_variants
from depthcurse.surgery import removed_layers
from depthcurse.tasks import build_task
from depthcurse.tasks.probes import examples


def by_generate(model, tokenizer, names, limit, variants) -> dict:
    out = {}
    for v in variants:
        with removed_layers(model, v):
            for name in names:
                row = []
                for ex in examples(name, n=limit):
                    context = tokenizer(ex["prompt"], add_special_tokens=False)["input_ids"]
                    answer = tokenizer(ex["prompt"] + ex["target"], add_special_tokens=False)["input_ids"][len(context):]
                    with torch.no_grad():
                        got = model.generate(torch.tensor([context]), max_new_tokens=len(answer), do_sample=False, pad_token_id=0)
                    row.append(float(got[0, len(context):].tolist() == answer))
                out[v, name] = row
    return out


def by_engine(model, task, names, variants) -> dict:
    task.per_example = True
    scores, _ = evaluate_variants(model, task, variants, checked=True)
    return {(v, name): scores[v].details["per_example"][name] for v in variants for name in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--probes", default="probe_add_1d,probe_brackets_2,probe_copy_8,probe_recall_4")
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--layers", default="8,16,24", help="single removals measured beside the unpruned model")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    loaded = load_model(args.model, fp32_on_cpu="as this benchmark's figures in docs/benchmarks.md were measured")
    names = tuple(args.probes.split(","))
    variants = [(), *((int(i),) for i in args.layers.split(","))]
    task = build_task(",".join(names), loaded.tokenizer, limit=args.limit, model=loaded.model)
    times = {"engine": [], "generate": []}
    results = {}
    for r in range(args.repeats):
        for kind in (("engine", "generate") if r % 2 == 0 else ("generate", "engine")):
            started = time.perf_counter()
            results[kind] = by_engine(loaded.model, task, names, variants) if kind == "engine" else by_generate(loaded.model, loaded.tokenizer, names, args.limit, variants)
            times[kind].append(time.perf_counter() - started)
    same = results["engine"] == results["generate"]
    ratio = statistics.median(times["engine"]) / statistics.median(times["generate"])
    solved = {name: sum(results["engine"][(), name]) / args.limit for name in names}
    print(f"{len(variants)} variants x {len(names)} probes x {args.limit} examples, {torch.get_num_threads()} threads")
    print(f"engine {times['engine']} s; generate {times['generate']} s; engine / generate = {ratio:.3f}x")
    print(f"every example's exact match the same: {same}; unpruned solved: {solved}")


if __name__ == "__main__":
    main()
