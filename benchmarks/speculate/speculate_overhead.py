"""What speculative decoding's own parts cost on this machine (issue 70's speed goals).

1. The check: one pass of the whole model over gamma + 1 tokens after a cached prompt, against one
   decoding step (one token), the two in turns (A B, B A) in one process; each v = check / step is
   the median of the pairs' ratios with its distribution-free interval (`speed.paired`). Goal: at
   most 1.3 at batch 1.
2. The loop: an oracle draft that proposes the whole model's own greedy continuation (known in
   advance) and costs nothing, so that every token is accepted. Its decoding time against the sum
   of its checks is the loop's own time; its speedup against decoding alone (in turns, per prompt)
   beside (gamma + 1) / v, what a free draft accepted whole buys at the measured check cost.
3. Memory: the self-draft's KV cache against the whole model's after each prompt, and the peak rise
   of the process's resident memory (Linux VmHWM) during decoding alone and during speculative
   decoding with the self-draft.

    .venv/bin/python benchmarks/speculate/speculate_overhead.py --model smollm2-135m --skip 12-15 --out runs/bench/speculate-overhead.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

from depthcurse.loading import load_model
from depthcurse.speculate import DecodeSettings, Draft, LayerSkipDraft, Proposal, Stopwatch, build_length, load_prompts, plain, speculative
from depthcurse.speculate.draft import CachedModel
from depthcurse.speculate.run import eos_tokens, parse_skip
from depthcurse.speed.measure import PeakMemory
from depthcurse.speed.paired import PairedRatio
from depthcurse.surgery import num_layers


class Oracle(Draft):
    """Proposes the given continuation, free: every token accepted, no forward pass."""

    name = "oracle"

    def __init__(self, continuation: list[int], prompt_length: int):
        super().__init__()
        self.continuation, self.prompt_length = continuation, prompt_length

    def propose(self, sequence, most, stop, sampler):
        done = sequence.shape[1] - self.prompt_length
        return Proposal(self.continuation[done : done + most])


def ratio(values: list[float]) -> dict:
    pair = PairedRatio(values)
    return {"median": pair.median, "interval": pair.interval, "pairs": len(values)}


@torch.inference_mode()
def check_costs(model, prompt: torch.Tensor, gammas: list[int], pairs: int, watch: Stopwatch) -> dict:
    lm = CachedModel(model)
    lm.feed(prompt)
    base = lm.length
    tokens = prompt[:, -1:].expand(1, max(gammas) + 1).clone()
    out = {}
    for gamma in gammas:
        ratios = []
        for r in range(pairs + 1):
            times = {}
            for name in (("step", "check") if r % 2 == 0 else ("check", "step")):
                feed = tokens[:, :1] if name == "step" else tokens[:, : gamma + 1]
                _, times[name] = watch(lambda feed=feed: lm.feed(feed))
                lm.keep(base)
            if r:  # the first pair warms up
                ratios.append(times["check"] / times["step"])
        out[str(gamma)] = ratio(ratios)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--skip", default="12-15")
    parser.add_argument("--gammas", default="1,2,4,8")
    parser.add_argument("--pairs", type=int, default=12)
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--per-kind", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    loaded = load_model(args.model, fp32_on_cpu="as this benchmark's figures in docs/benchmarks.md were measured")
    model, tokenizer = loaded.model.eval(), loaded.tokenizer
    watch = Stopwatch(loaded.device)
    prompts = [tokenizer(p.text, return_tensors="pt").input_ids.to(loaded.device) for p in load_prompts("suite", args.per_kind)]
    gammas = [int(g) for g in args.gammas.split(",")]
    record = {"command": " ".join(sys.argv), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "model": args.model,
              "threads": torch.get_num_threads(), "check": check_costs(model, prompts[0], gammas, args.pairs, watch)}
    skip = parse_skip(args.skip, num_layers(model))
    settings = DecodeSettings(args.max_new_tokens, eos_tokens(model, tokenizer))
    loop, memory = [], {"plain_rise": [], "speculative_rise": [], "draft_cache_bytes": [], "cache_bytes": []}
    peak = PeakMemory(loaded.device)
    for i, prompt in enumerate(prompts):
        reference = plain(model, prompt, settings, watch)  # warms up too
        runs = {}
        for name in (("plain", "oracle", "self") if i % 2 == 0 else ("self", "oracle", "plain")):
            peak.start()
            if name == "plain":
                runs[name] = plain(model, prompt, settings, watch)
            else:
                draft = Oracle(reference.tokens[1:], prompt.shape[1] + 1) if name == "oracle" else LayerSkipDraft(model, skip, watch=watch)
                runs[name] = speculative(model, draft, prompt, settings, build_length("fixed", args.draft_tokens), watch)
            rise = peak.rise()
            if name != "oracle":
                memory[f"{'plain' if name == 'plain' else 'speculative'}_rise"].append(rise)
        assert runs["oracle"].tokens == runs["self"].tokens == reference.tokens
        oracle, alone = runs["oracle"], runs["plain"]
        if not alone.steps:  # ended at its first token: nothing decoded to time
            continue
        loop.append({"loop_share": 1 - oracle.step_s / oracle.decode_s, "speedup": alone.decode_s / oracle.decode_s,
                     "checks": oracle.steps, "check_s": oracle.step_s / oracle.steps, "step_s": alone.step_s / alone.steps,
                     "plain_loop_share": 1 - alone.step_s / alone.decode_s})
        memory["draft_cache_bytes"].append(runs["self"].draft_cache_bytes)
        memory["cache_bytes"].append(runs["self"].cache_bytes)
    v = statistics.median(p["check_s"] / p["step_s"] for p in loop)
    record["oracle"] = {"prompts": loop, "loop_share_median": statistics.median(p["loop_share"] for p in loop),
                        "plain_loop_share_median": statistics.median(p["plain_loop_share"] for p in loop),
                        "speedup_median": statistics.median(p["speedup"] for p in loop), "v_median": v,
                        "expected_free_draft": (args.draft_tokens + 1) / v}
    record["memory"] = {**memory, "draft_share": statistics.fmean(d / c for d, c in zip(memory["draft_cache_bytes"], memory["cache_bytes"])),
                        "layers_share": (num_layers(model) - len(skip)) / num_layers(model)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    for gamma, r in record["check"].items():
        print(f"check of {int(gamma) + 1} tokens / one step: {r['median']:.3f}x {r['interval']}")
    o = record["oracle"]
    print(f"oracle draft (free, all accepted), gamma {args.draft_tokens}: speedup {o['speedup_median']:.3f}x, (gamma + 1) / v = {o['expected_free_draft']:.3f}x; "
          f"the loop's own time {o['loop_share_median']:.1%} of decoding (plain: {o['plain_loop_share_median']:.1%})")
    m = record["memory"]
    print(f"self-draft KV cache / the whole model's: {m['draft_share']:.3f} (its kept layers: {m['layers_share']:.3f}); peak rise plain "
          f"{statistics.median(m['plain_rise']) / 2**20:.1f} MiB, speculative {statistics.median(m['speculative_rise']) / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
