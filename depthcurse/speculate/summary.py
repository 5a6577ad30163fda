"""A speculate run's figures, from its prompts: each draft's acceptance, cost and speedup, measured
and expected, with intervals over the prompts.

Pure: a function of the `speculate.json` record (numbers, no torch), so that every figure can be
checked against one worked out by hand (`tests/test_speculate.py`).

Per draft, over the prompts that decoded at least one token after the first:
- `acceptance`: each prompt's maximum-likelihood rate (`expected.acceptance_rate`: accepted tokens
  over accepted tokens plus rejections), their mean with Student's t interval; `pooled`, the rate
  of all rounds together;
- `tokens_per_check`: tokens emitted per pass of the whole model after its prefill (Spec-Bench's mean
  accepted length, the correction or bonus token included);
- `draft_length`: tokens drafted per round;
- `c`: the draft's seconds per forward pass over the whole model's per decoding step (`plain`'s, on the
  same prompt); prompt lookup runs no forward pass, so its c is 0 and its search is loop time;
- `v`: the whole model's seconds per check over its seconds per decoding step;
- `speedup`: decoding time alone over decoding time with the draft, both after their prefills, the
  median of the prompts' ratios with its distribution-free interval (`speed.paired`: the two timed
  in turns on each prompt); `end_to_end` with the prefills (the draft's too);
- `expected`: Leviathan's expected speedup per prompt from its acceptance, mean draft length and c,
  the check priced at one step (`v = 1`, their Theorem 3.8) and at its measured v;
- `ceiling` (every token accepted) and `break_even` (the acceptance at which the draft pays, None
  where none does) at the mean c and draft length, at v = 1 and at the measured v;
- `largest_c`: the most a draft step may cost to pay at the mean acceptance and measured v, and
  `best_gamma`, the draft length that would do best there;
- `measured_over_expected`: the measured speedup over the expected one at the measured v (1: the
  loop adds nothing the three numbers do not account for);
- `overhead`: the share of the decoding time outside the forward passes (the loop's own);
- `lossless`: prompts whose greedy output equals `model.generate`'s, of those compared;
- `draft_cache_bytes`: the draft's KV cache at the end (its extra memory), beside the whole model's.

`timing`: whether the timings can be trusted, by `speed`'s rule (`speed.paired.judge`): the whole
model's decoding is timed twice on every prompt, in this loop (`plain`) and in `model.generate`, the
same tokens in turns, so their ratio holds still on a steady machine; where its interval is wider
than `speed`'s tolerance (or too few prompts give one), no speedup, c or v is a finding, and the
verdicts speak of acceptance alone.

`versus`: every other draft against the first self-draft on the same prompts: the difference of their
acceptances, paired over the prompts both decoded, with Student's t interval and its word (`stats.verdicts`:
"more" or "less" accepted, or "cannot tell").
"""

from __future__ import annotations

import statistics

from depthcurse.speculate.expected import acceptance_rate, best_gamma, break_even, ceiling, expected_speedup, largest_cost
from depthcurse.speed.paired import PairedRatio, judge
from depthcurse.stats import difference_word, mean_interval

REFERENCES = ("generate", "plain")


def _estimate(values: list[float]) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"mean": statistics.fmean(values), "interval": mean_interval(values) if len(values) > 1 else None, "n": len(values)}


def _ratio(ratios: list[float]) -> dict | None:
    """Speedup from time ratios (with over without): 1 / their median, its interval inverted."""
    if not ratios:
        return None
    pair = PairedRatio(ratios)
    interval = pair.interval
    return {"median": 1.0 / pair.median, "interval": None if interval is None else [1.0 / interval[1], 1.0 / interval[0]], "pairs": len(ratios)}


def _per_step(record: dict) -> float | None:
    return record["step_s"] / record["steps"] if record.get("steps") else None


def _decoded(record: dict) -> int:
    return max(0, record["generated"] - 1)


def _prompt_figures(plain: dict, draft: dict) -> dict:
    """One prompt's figures for one draft, against the whole model alone on the same prompt."""
    accepted = sum(a for _, a in draft["rounds"])
    rejections = sum(1 for d, a in draft["rounds"] if a < d)
    alpha = acceptance_rate(accepted, rejections)
    step = _per_step(plain)
    c = (draft["draft_s"] / draft["draft_calls"] / step if draft["draft_calls"] else 0.0) if step else None
    v = _per_step(draft) / step if step and draft["steps"] else None
    gamma = statistics.fmean(d for d, _ in draft["rounds"]) if draft["rounds"] else None
    expected = expected_speedup(alpha, gamma, c) if None not in (alpha, gamma, c) else None
    expected_v = expected_speedup(alpha, gamma, c, v) if None not in (alpha, gamma, c, v) else None
    return {"alpha": alpha, "accepted": accepted, "rejections": rejections, "c": c, "v": v, "gamma": gamma,
            "tokens_per_check": _decoded(draft) / draft["steps"] if draft["steps"] else None,
            "ratio": draft["decode_s"] / plain["decode_s"],
            "end_to_end": (draft["prefill_s"] + draft["draft_prefill_s"] + draft["decode_s"]) / (plain["prefill_s"] + plain["decode_s"]),
            "expected": expected, "expected_v": expected_v,
            "overhead": 1.0 - (draft["draft_s"] + draft["step_s"]) / draft["decode_s"] if draft["decode_s"] else None,
            "tokens_per_s": _decoded(draft) / draft["decode_s"] if draft["decode_s"] else None}


def _lossless(prompts: list[dict], name: str) -> dict:
    compared = [p[name].get("tokens_equal") for p in prompts if name in p and p[name].get("tokens_equal") is not None]
    differ = [{"prompt": p["index"], "at": p[name].get("first_difference")} for p in prompts if name in p and p[name].get("tokens_equal") is False]
    return {"equal": sum(compared), "compared": len(compared), "differ": differ}


def _draft_summary(prompts: list[dict], name: str) -> dict:
    usable = [p for p in prompts if name in p and _decoded(p["plain"]) > 0 and _decoded(p[name]) > 0]
    figures = [_prompt_figures(p["plain"], p[name]) for p in usable]
    accepted, rejections = sum(f["accepted"] for f in figures), sum(f["rejections"] for f in figures)
    out = {key: _estimate([f[key] for f in figures]) for key in ("alpha", "c", "v", "gamma", "tokens_per_check", "expected", "expected_v",
                                                                 "overhead", "tokens_per_s")}
    out["pooled_alpha"] = acceptance_rate(accepted, rejections)
    out["speedup"] = _ratio([f["ratio"] for f in figures])
    out["end_to_end"] = _ratio([f["end_to_end"] for f in figures])
    out["prompts"] = len(usable)
    c, v, gamma = (out[k]["mean"] if out[k] else None for k in ("c", "v", "gamma"))
    if c is not None and gamma:
        out["ceiling"] = ceiling(gamma, c)
        out["break_even"] = break_even(gamma, c)
        if v is not None:
            out["ceiling_v"] = ceiling(gamma, c, v)
            out["break_even_v"] = break_even(gamma, c, v)
            if out["alpha"] is not None:
                out["largest_c"] = largest_cost(out["alpha"]["mean"], gamma, v)
                out["best_gamma"] = dict(zip(("gamma", "speedup"), best_gamma(out["alpha"]["mean"], c, v)))
    if out["speedup"] and out["expected_v"]:
        out["measured_over_expected"] = out["speedup"]["median"] / out["expected_v"]["mean"]
    out["lossless"] = _lossless(prompts, name)
    kv = [p[name]["draft_cache_bytes"] for p in usable]
    whole = [p[name]["cache_bytes"] for p in usable]
    out["draft_cache_bytes"] = max(kv) if kv else None
    out["draft_cache_share"] = statistics.fmean(k / w for k, w in zip(kv, whole) if w) if any(whole) else None
    return out


def _versus(prompts: list[dict], name: str, first: str) -> dict | None:
    """`name`'s acceptance against `first`'s, prompt by prompt (those both decoded past their first
    token with a rate): the mean difference, its t interval and its word."""
    differences = []
    for p in prompts:
        if name in p and first in p and _decoded(p["plain"]) > 0 and _decoded(p[name]) > 0 and _decoded(p[first]) > 0:
            a, b = (_prompt_figures(p["plain"], p[m])["alpha"] for m in (name, first))
            if a is not None and b is not None:
                differences.append(a - b)
    if not differences:
        return None
    interval = mean_interval(differences) if len(differences) > 1 else None
    return {"against": first, "difference": statistics.fmean(differences), "interval": interval, "prompts": len(differences),
            "verdict": difference_word(interval)}


def _against(prompts: list[dict], name: str, reference: str, time_of) -> dict:
    """A method timed whole against a reference timed whole (transformers' loops; ours against theirs)."""
    usable = [p for p in prompts if name in p and reference in p and time_of(p[reference]) > 0]
    return {"speedup": _ratio([time_of(p[name]) / time_of(p[reference]) for p in usable]), "prompts": len(usable),
            "lossless": _lossless(prompts, name)}


def _whole(record: dict) -> float:
    return record["seconds"] if "seconds" in record else record["prefill_s"] + record["decode_s"]


def timing_check(prompts: list[dict]) -> dict:
    """`speed`'s verdict on the control: this loop's whole-model decoding over `model.generate`'s, prompt by prompt."""
    ratios = [_whole(p["plain"]) / _whole(p["generate"]) for p in prompts if "generate" in p and _whole(p["generate"]) > 0]
    if not ratios:
        return {"status": "unstable", "reason": "no prompt has model.generate's time beside this loop's, nothing to judge the timings by", "prompts": 0}
    verdict = judge(PairedRatio(ratios))
    return {"status": verdict.status, "reason": verdict.reason, "prompts": len(ratios)}


def summarise(record: dict) -> dict:
    """Every draft's figures over every prompt, then by the prompts' kind."""
    prompts = [{**p, "index": int(i)} for i, p in sorted(record["prompts"].items(), key=lambda kv: int(kv[0]))]
    drafts = [m for m in record.get("methods", {}) if m != "transformers-assistant"]
    decoding = [p for p in prompts if _decoded(p["plain"]) > 0]  # a prompt that ended at its first token timed no decoding
    out = {"drafts": {name: _draft_summary(prompts, name) for name in drafts},
           "versus": {name: _versus(prompts, name, drafts[0]) for name in drafts[1:]} if drafts else {},
           "plain": {"tokens_per_s": _estimate([_decoded(p["plain"]) / p["plain"]["decode_s"] for p in decoding]),
                     "overhead": _estimate([1.0 - p["plain"]["step_s"] / p["plain"]["decode_s"] for p in decoding]),
                     **_against(prompts, "plain", "generate", _whole)},
           "timing": timing_check(prompts)}
    if "transformers-assistant" in record.get("methods", {}):
        out["transformers-assistant"] = _against(prompts, "transformers-assistant", "generate", _whole)
    kinds = sorted({p["kind"] for p in prompts})
    out["by_kind"] = {kind: {name: {k: v for k, v in _draft_summary([p for p in prompts if p["kind"] == kind], name).items()
                                    if k in ("alpha", "pooled_alpha", "tokens_per_check", "speedup", "expected_v", "prompts", "lossless")}
                             for name in drafts} for kind in kinds}
    return out
