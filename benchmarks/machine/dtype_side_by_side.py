"""bf16 against fp32 on every command's work, side by side in one process (issue 82, item 1), and
each job's time against its floor (item 3).

    .venv/bin/python benchmarks/machine/dtype_side_by_side.py --out /tmp/b82          # every part
    .venv/bin/python benchmarks/machine/dtype_side_by_side.py --parts exact3 --out /tmp/b82

The model is loaded twice, in fp32 and in bf16, and each part runs its work on both in turns (A B,
then B A), so that a machine that changes speed changes both:

    sweep           the demo's prune sweep, from the prune.json of `depthcurse prune ... --dtype fp32`
                    and `--dtype bf16` (`--sweeps`): its time against the arithmetic it ran
    exact2, exact3  select's scorer (`CalibrationScorer.score_many`) over every removal of k = 2 or 3
                    blocks, chunk by chunk as `exact` runs them: the time, every removal's KL and loss
                    in each dtype (their rank correlation, the largest difference, the optimum)
    greedy4         the recipe's greedy search at k = 4 (k steps, each scoring every one-more removal)
    depth-use       `measure_depth_use` with the influence matrix: every figure's largest difference
    check           speculate's check of `--check-tokens` tokens after a cached prompt against one
                    decoding step: v = check / step in each dtype, and the step's own time
    speculate       speculative decoding with the self-draft (layers `--skip` skipped) against plain
                    decoding on speculate's suite prompts: speedup, acceptance, and whether the two
                    dtypes' greedy continuations are the same
    heal            heal's LoRA training step in fp32 and under bf16 autocast (the weights fp32 in
                    both; bf16 weights would train the adapters in bf16): step time and the losses
    probes          the capability probes through prune's reuse engine, every single removal and the
                    unpruned model: each example's exact match in both dtypes

Each part's floor is the arithmetic it ran (torch's FlopCounterMode over one unit of its work: one
chunk, one step, one batch) at this machine's matmul peak in that dtype (`gemm_peak.peak_rates`, the
fastest block matmul at 512 rows), or for decoding the weights' bytes at the memory bandwidth
(`gemm_peak.bandwidth`). Prints one Markdown table for docs/benchmarks.md and writes
`side_by_side.json` under --out. `--profile` instead profiles one unit of each part named (sweep:
the reuse engine on the unpruned model and two removals over 4 windows of `--sweep-seq-len`; exact2,
exact3, depth-use, check) in each dtype: the share of the operators' time in matmuls, attention,
softmaxes over the vocabulary, copies and casts, and the rest. Freed memory is kept in the process
as every command keeps it (`depthcurse.heap`; `DEPTHCURSE_KEEP_FREED=0`: the C library's own).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemm_peak import bandwidth, peak_rates  # noqa: E402

from depthcurse import heap  # noqa: E402
from depthcurse.loading import load_model  # noqa: E402
from depthcurse.speed.paired import PairedRatio  # noqa: E402
from depthcurse.stats.correlation import spearman  # noqa: E402

DTYPES = ("fp32", "bf16")
PARTS = ("sweep", "check", "heal", "speculate", "greedy4", "exact2", "depth-use", "probes", "exact3")


# Where a unit's time goes, by the operators' own (self) CPU time: the matmuls the floor counts,
# attention, the softmaxes over the vocabulary and the rest.
KINDS = {"matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear", "aten::matmul", "mkldnn"),
         "attention": ("scaled_dot_product", "flash_attention"),
         "softmax": ("softmax", "log_softmax", "logsumexp"),
         "copy and cast": ("aten::copy_", "aten::to", "aten::_to_copy", "aten::contiguous", "aten::clone", "aten::cat")}


def where_time_goes(fn, rows: int = 8) -> dict:
    """One call of `fn` under torch.profiler: each kind's share of the operators' self CPU time, and
    the `rows` costliest operators."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = [(e.key, e.self_cpu_time_total) for e in prof.key_averages()]
    total = sum(t for _, t in events) or 1.0
    shares = {kind: 0.0 for kind in (*KINDS, "other")}
    for name, t in events:
        kind = next((k for k, marks in KINDS.items() if any(m in name for m in marks)), "other")
        shares[kind] += t / total
    top = sorted(events, key=lambda e: -e[1])[:rows]
    return {"shares": shares, "top": [[name, t / total] for name, t in top], "seconds": total / 1e6}


def turns(r: int) -> tuple[str, str]:
    return DTYPES if r % 2 == 0 else DTYPES[::-1]


def flops_of(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def ratio_summary(fp32: list[float], bf16: list[float]) -> dict:
    pair = PairedRatio([b / a for a, b in zip(fp32, bf16)])
    return {"fp32_s": sum(fp32), "bf16_s": sum(bf16), "ratio": pair.median, "interval": pair.interval, "pairs": len(fp32)}


def floor_shares(row: dict, flops: dict[str, float], rates: dict[str, float]) -> dict:
    """Each dtype's time over its arithmetic at its peak."""
    return {d: row[f"{d}_s"] / (flops[d] / (rates[d] * 1e9)) for d in DTYPES}


# ---- prune's sweep (from its records) ------------------------------------------------------------

def sweep_part(models, args, rates) -> dict:
    """The demo's sweep, run as `depthcurse prune ... --dtype fp32|bf16` (each a process, in turns;
    their prune.json given by `--sweeps fp32=PATH,bf16=PATH`): its time against the arithmetic its
    engine ran: the block passes it counted, each a token through one block (the FLOPs of a
    whole-model forward over `--sweep-seq-len` tokens, less the head's, per token and block), and
    every variant's head over every token."""
    paths = dict(item.split("=", 1) for item in args.sweeps.split(","))
    records = {d: json.loads(Path(paths[d]).read_text()) for d in DTYPES}
    config = models["fp32"].config
    tokens = args.sweep_seq_len
    with torch.inference_mode():
        whole = flops_of(lambda: models["fp32"](torch.zeros(1, tokens, dtype=torch.long)))
    head_token = 2 * config.hidden_size * config.vocab_size
    block_token = (whole - head_token * tokens) / (config.num_hidden_layers * tokens)
    engine = records["fp32"]["engine"]
    flops = engine["block_passes"] * block_token + len(records["fp32"]["variants"]) * engine["batch_tokens"] * head_token
    base = {d: records[d]["variants"][0]["metrics"]["loss"] for d in DTYPES}
    drops = {d: [v["metrics"]["loss"] - base[d] for v in records[d]["variants"][1:]] for d in DTYPES}
    row = {"job": f"prune: the demo's sweep ({len(records['fp32']['variants'])} variants, ppl on 16 x 512 tokens of wiki)",
           "fp32_s": records["fp32"]["wall_time_s"], "bf16_s": records["bf16"]["wall_time_s"],
           "ratio": records["bf16"]["wall_time_s"] / records["fp32"]["wall_time_s"], "interval": None, "pairs": 1,
           "agreement": {"unpruned_loss": base, "drop_spearman": spearman(drops["fp32"], drops["bf16"]),
                         "drop_max_abs_diff": max(abs(a - b) for a, b in zip(drops["fp32"], drops["bf16"])),
                         "cheapest_five": {d: sorted(range(len(drops[d])), key=drops[d].__getitem__)[:5] for d in DTYPES}},
           "flops": {d: flops for d in DTYPES}}
    row["floor_share"] = floor_shares(row, row["flops"], rates)
    return row


# ---- select's scorer ----------------------------------------------------------------------------

def scorers(models, tokenizer, args):
    from depthcurse.select.config import SelectConfig
    from depthcurse.select.scoring import CalibrationScorer
    from depthcurse.select.windows import text_windows

    cfg = SelectConfig(k=2, calibration=("wiki",), calib_windows=args.windows, eval_windows=2, seq_len=args.seq_len, batch_size=args.windows)
    windows = text_windows(tokenizer, "wiki", cfg).calibration
    return {d: CalibrationScorer(models[d], windows, args.windows, {}, lambda: None) for d in DTYPES}


def exact_part(models, tokenizer, args, k: int, rates) -> dict:
    from depthcurse.select.searches.exact import CHUNK

    score = scorers(models, tokenizer, args)
    n = score["fp32"].n
    every = list(itertools.combinations(range(n), k))
    size = min(CHUNK, -(-len(every) // 8))  # exact's chunks, or smaller where that gives fewer than 8 pairs
    chunks = [every[i : i + size] for i in range(0, len(every), size)]
    times = {d: [] for d in DTYPES}
    got = {d: [] for d in DTYPES}
    for r, chunk in enumerate(chunks):
        for d in turns(r):
            started = time.perf_counter()
            got[d].append(score[d].score_many(chunk))
            times[d].append(time.perf_counter() - started)
    kl = {d: [s["kl"] for part in got[d] for s in part] for d in DTYPES}
    loss = {d: [s["ppl"] for part in got[d] for s in part] for d in DTYPES}
    best = {d: every[min(range(len(every)), key=kl[d].__getitem__)] for d in DTYPES}
    best_loss = {d: every[min(range(len(every)), key=loss[d].__getitem__)] for d in DTYPES}
    cost = score["bf16"].cost.summary(args.windows)
    per = {d: cost["block_passes"] * block_flops(score[d]) + cost["head_passes"] * head_flops(score[d]) for d in DTYPES}
    row = {"job": f"select: exact at k = {k} ({len(every):,} removals, {args.windows} x {args.seq_len} tokens of wiki)",
           **ratio_summary(times["fp32"], times["bf16"]),
           "agreement": {"kl_spearman": spearman(kl["fp32"], kl["bf16"]), "loss_spearman": spearman(loss["fp32"], loss["bf16"]),
                         "kl_max_abs_diff": max(abs(a - b) for a, b in zip(kl["fp32"], kl["bf16"])),
                         "loss_max_abs_diff": max(abs(a - b) for a, b in zip(loss["fp32"], loss["bf16"])),
                         "optimum_kl": {d: list(best[d]) for d in DTYPES}, "optimum_loss": {d: list(best_loss[d]) for d in DTYPES}},
           "flops": per}
    row["floor_share"] = floor_shares(row, per, rates)
    return row


def block_flops(scorer) -> int:
    stepper, batch = scorer.stepper, scorer.batches[0]
    n = scorer.n
    with torch.inference_mode():
        return flops_of(lambda: stepper.block(n // 2, batch.entering[n // 2], batch.ctx))


def head_flops(scorer) -> int:
    stepper, batch = scorer.stepper, scorer.batches[0]
    with torch.inference_mode():
        return flops_of(lambda: stepper.logits(batch.entering[scorer.n // 2]))


def greedy_part(models, tokenizer, args, rates) -> dict:
    """The recipe's greedy at k = 4 by KL: each step adds the block whose removal beside the chosen
    ones costs least, every candidate scored in one `score_many`."""
    score = scorers(models, tokenizer, args)
    n = score["fp32"].n
    chosen = {d: () for d in DTYPES}
    times = {d: [] for d in DTYPES}
    for step in range(4):
        for d in turns(step):
            candidates = [tuple(sorted((*chosen[d], i))) for i in range(n) if i not in chosen[d]]
            started = time.perf_counter()
            scores = score[d].score_many(candidates)
            times[d].append(time.perf_counter() - started)
            chosen[d] = candidates[min(range(len(candidates)), key=lambda j: scores[j]["kl"])]
    return {"job": f"select: the recipe's greedy at k = 4 ({args.windows} x {args.seq_len} tokens of wiki)", **ratio_summary(times["fp32"], times["bf16"]),
            "agreement": {"pick": {d: list(chosen[d]) for d in DTYPES}, "same": chosen["fp32"] == chosen["bf16"]}}


# ---- depth-use ----------------------------------------------------------------------------------

def depth_use_part(models, tokenizer, args, rates) -> dict:
    from depthcurse.depth.measure import measure_depth_use
    from depthcurse.tasks.perplexity import PerplexityTask
    from depthcurse.text import load_texts

    texts, label = load_texts("wiki", option="--data")
    windows = PerplexityTask(tokenizer, texts, source=label, seq_len=args.depth_seq_len, limit=args.depth_windows, warn_short=False).windows
    times, uses = {d: [] for d in DTYPES}, {}
    for r in range(2):
        for d in turns(r):
            started = time.perf_counter()
            uses[d] = measure_depth_use(models[d], windows, args.depth_batch, influence=True)
            times[d].append(time.perf_counter() - started)
    a, b = uses["fp32"].summary(), uses["bf16"].summary()
    diffs = {}
    for name, value in a.items():
        if isinstance(value, list) and value and isinstance(value[0], list):
            pairs = [(x, y) for ra, rb in zip(value, b[name]) for x, y in zip(ra, rb) if x == x and y == y]
            diffs[name] = max(abs(x - y) for x, y in pairs)
    means = {d: [statistics.fmean(row) for row in uses[d].lens_kl] for d in DTYPES}
    influence = {d: [statistics.fmean(v for v in row if v == v) for row in uses[d].influence[:-1]] for d in DTYPES}
    with torch.inference_mode():
        per = {d: flops_of(lambda: measure_depth_use(models[d], windows[: args.depth_batch], args.depth_batch, influence=True))
               * len(windows) / args.depth_batch for d in DTYPES}
    row = {"job": f"depth-use with influence ({args.depth_windows} x {args.depth_seq_len} tokens of wiki)", **ratio_summary(times["fp32"], times["bf16"]),
           "agreement": {"max_abs_diff": diffs, "lens_kl_spearman": spearman(means["fp32"], means["bf16"]),
                         "influence_row_spearman": spearman(influence["fp32"], influence["bf16"])}, "flops": per}
    # `per` is one run's arithmetic, and the row's times sum both rounds: the floor against one run's (median) time
    row["floor_share"] = floor_shares({f"{d}_s": statistics.median(times[d]) for d in DTYPES}, per, rates)
    return row


# ---- speculate ----------------------------------------------------------------------------------

def check_part(models, tokenizer, args, rates, bytes_per_s) -> dict:
    from depthcurse.speculate import Stopwatch, load_prompts
    from depthcurse.few_row_linear import few_row_kernel
    from depthcurse.few_row_linear import status as few_row_linear_status
    from depthcurse.speculate.draft import CachedModel

    prompt = tokenizer(load_prompts("suite", 1)[0].text, return_tensors="pt").input_ids
    watch = Stopwatch(torch.device("cpu"))
    caches = {}
    for d in DTYPES:
        lm = CachedModel(models[d])
        with torch.inference_mode():
            lm.feed(prompt)
        caches[d] = (lm, lm.length)
    tokens = prompt[:, -1:].expand(1, args.check_tokens).clone()
    # the check as speculate runs it (few_row_linear's kernel for fp32's few rows) and by torch's linear alone
    times = {name: {d: [] for d in DTYPES} for name in ("step", "check", "check, torch's linear")}
    with torch.inference_mode():
        for r in range(args.pairs + 1):
            for d in turns(r):
                lm, base = caches[d]
                for name in (list(times) if r % 2 == 0 else list(times)[::-1]):
                    feed = tokens[:, :1] if name == "step" else tokens
                    with few_row_kernel(models[d]) if name == "check" else contextlib.nullcontext():
                        _, seconds = watch(lambda feed=feed: lm.feed(feed))
                    lm.keep(base)
                    if r:  # the first round warms up
                        times[name][d].append(seconds)
    step = times["step"]
    weights = {d: sum(p.numel() * p.element_size() for p in models[d].parameters()) for d in DTYPES}
    v = {name: {d: PairedRatio([c / s for c, s in zip(times[name][d], step[d])]).summary() for d in DTYPES} for name in list(times)[1:]}
    row = {"job": f"speculate: one decoding step (1 token after a {prompt.shape[1]}-token prompt)", **ratio_summary(step["fp32"], step["bf16"]),
           "agreement": {"check_tokens": args.check_tokens, "check_linear": few_row_linear_status(),
                         **{"v" if name == "check" else "v, torch's linear": {d: {"median": v[name][d]["median"], "interval": v[name][d]["interval"]}
                                                                           for d in DTYPES} for name in v}},
           "floor_bytes": weights}
    row["floor_share"] = {d: statistics.median(step[d]) / (weights[d] / bytes_per_s) for d in DTYPES}
    row["fp32_s"], row["bf16_s"] = statistics.median(step["fp32"]), statistics.median(step["bf16"])
    return row


def speculate_part(models, tokenizer, args, rates) -> dict:
    from depthcurse.speculate import DecodeSettings, LayerSkipDraft, Stopwatch, build_length, load_prompts, plain, speculative
    from depthcurse.speculate.run import eos_tokens, parse_skip
    from depthcurse.surgery import num_layers

    prompts = [tokenizer(p.text, return_tensors="pt").input_ids for p in load_prompts("suite", args.per_kind)]
    watch = Stopwatch(torch.device("cpu"))
    skip = parse_skip(args.skip, num_layers(models["fp32"]))
    settings = DecodeSettings(args.max_new_tokens, eos_tokens(models["fp32"], tokenizer))
    plain_s, spec_s = {d: [] for d in DTYPES}, {d: [] for d in DTYPES}
    tokens, drafted, accepted, lossless = {d: [] for d in DTYPES}, {d: 0 for d in DTYPES}, {d: 0 for d in DTYPES}, {d: 0 for d in DTYPES}
    with torch.inference_mode():
        for i, prompt in enumerate(prompts):
            for d in turns(i):
                alone = plain(models[d], prompt, settings, watch)
                run = speculative(models[d], LayerSkipDraft(models[d], skip, watch=watch), prompt, settings,
                                  build_length("fixed", args.draft_tokens), watch)
                lossless[d] += run.tokens == alone.tokens  # bf16's check (several rows) may round a near-tie otherwise than its step (one)
                plain_s[d].append(alone.decode_s)
                spec_s[d].append(run.decode_s)
                tokens[d].append(alone.tokens)
                drafted[d] += sum(r[0] for r in run.rounds)
                accepted[d] += sum(r[1] for r in run.rounds)
    speedup = {d: sum(plain_s[d]) / sum(spec_s[d]) for d in DTYPES}
    return {"job": f"speculate: decoding with the self-draft (skip {args.skip}, {len(prompts)} prompts, {args.max_new_tokens} tokens)",
            **ratio_summary(spec_s["fp32"], spec_s["bf16"]),
            "agreement": {"speedup": speedup, "acceptance": {d: accepted[d] / max(1, drafted[d]) for d in DTYPES},
                          "same_as_plain": lossless, "same_continuations": sum(a == b for a, b in zip(tokens["fp32"], tokens["bf16"])), "prompts": len(prompts)}}


# ---- heal ---------------------------------------------------------------------------------------

def heal_part(args, rates) -> dict:
    from depthcurse.heal import HealConfig, HealContext
    from depthcurse.heal.adapters import trainable
    from depthcurse.loading import window_length
    from depthcurse.surgery import parse_layers
    from depthcurse.text import start_tokens
    from depthcurse.train.data import build_data
    from depthcurse.train.loop import autocast_for, lr_factor, train_step

    cfg = HealConfig(layers=tuple(parse_layers(args.heal_layers, 10**6)), method_args={"loss": "lm", "lora_rank": 8}, data="wiki",
                     steps=args.heal_steps, batch_size=args.heal_batch, seq_len=args.heal_seq_len, lr=2e-4, eval_windows=2, seed=1234,
                     save_every=10**6).resolved()
    ways = {}
    for d in DTYPES:
        loaded = load_model(args.model, dtype="fp32")
        method = cfg.build()
        ctx = HealContext(model=loaded.model, layers=cfg.layers, calibration=None, seed=cfg.seed)
        method.prepare(ctx)
        objective = method.objective(ctx).train()
        optimizer = torch.optim.AdamW(trainable(objective), lr=cfg.lr, weight_decay=cfg.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg.warmup, cfg.steps, cfg.min_lr_ratio))
        amp = autocast_for("bf16-mixed" if d == "bf16" else "fp32", loaded.device)
        ways[d] = (objective, optimizer, scheduler, amp, loaded)
    loaded = ways["fp32"][4]
    seq_len = window_length(loaded.model, cfg.seq_len)
    data = build_data(cfg.data, loaded.tokenizer, seq_len=seq_len, pack=True, seed=cfg.seed, val_tokens=seq_len, start=start_tokens(loaded.tokenizer))
    rows = [data.train.next_batch(cfg.batch_size) for _ in range(cfg.steps)]
    times, losses = {d: [] for d in DTYPES}, {d: [] for d in DTYPES}
    for i, batch in enumerate(rows):
        for d in turns(i):
            objective, optimizer, scheduler, amp, here = ways[d]
            started = time.perf_counter()
            loss, _ = train_step(objective, optimizer, scheduler, batch, cfg.micro_batch, amp, cfg.grad_clip, here.device)
            value = float(loss)
            times[d].append(time.perf_counter() - started)
            losses[d].append(value)
    per = {}
    for d in DTYPES:  # one more step each, after the timed ones, counted
        objective, optimizer, scheduler, amp, here = ways[d]
        per[d] = flops_of(lambda: train_step(objective, optimizer, scheduler, rows[0], cfg.micro_batch, amp, cfg.grad_clip, here.device))
    row = {"job": f"heal: a LoRA training step ({args.heal_batch} x {args.heal_seq_len} tokens, layers {args.heal_layers} removed; bf16 = autocast)",
           **ratio_summary(times["fp32"][1:], times["bf16"][1:]),
           "agreement": {"losses": losses, "last_loss_diff": losses["bf16"][-1] - losses["fp32"][-1],
                         "max_loss_diff": max(abs(a - b) for a, b in zip(losses["fp32"], losses["bf16"]))},
           "flops": {d: per[d] * (len(rows) - 1) for d in DTYPES}}
    row["floor_share"] = floor_shares(row, row["flops"], rates)
    return row


# ---- probes -------------------------------------------------------------------------------------

def probes_part(models, tokenizer, args, rates) -> dict:
    from depthcurse.prune.engine import evaluate_variants
    from depthcurse.surgery import num_layers
    from depthcurse.tasks import build_task

    variants = [(), *((i,) for i in range(num_layers(models["fp32"])))]
    got, times = {}, {d: [] for d in DTYPES}
    for r in range(2):
        for d in turns(r):
            task = build_task("probes", tokenizer, limit=args.probe_limit, model=models[d])
            task.per_example = True
            started = time.perf_counter()
            scores, _ = evaluate_variants(models[d], task, variants, checked=True)
            times[d].append(time.perf_counter() - started)
            got[d] = {v: scores[v].details["per_example"] for v in variants}
    examples = [(v, name, i) for v in variants for name, row in got["fp32"][v].items() for i in range(len(row))]
    differ = [e for e in examples if got["fp32"][e[0]][e[1]][e[2]] != got["bf16"][e[0]][e[1]][e[2]]]
    solved = {d: [statistics.fmean(x for row in got[d][v].values() for x in row) for v in variants] for d in DTYPES}
    return {"job": f"probes: every single removal and the unpruned model ({len(variants)} variants, {args.probe_limit} examples a probe)",
            **ratio_summary(times["fp32"], times["bf16"]),
            "agreement": {"examples": len(examples), "exact_match_differs": len(differ), "solved_spearman": spearman(solved["fp32"], solved["bf16"]),
                          "solved_max_abs_diff": max(abs(a - b) for a, b in zip(solved["fp32"], solved["bf16"]))}}


def profile_part(part: str, models, tokenizer, args) -> dict:
    """Where one unit of `part`'s work spends its time, in each dtype (`where_time_goes`)."""
    from depthcurse.depth.measure import measure_depth_use
    from depthcurse.speculate import load_prompts
    from depthcurse.speculate.draft import CachedModel

    units = {}
    for d in DTYPES:
        if part.startswith("exact"):
            scorer = scorers(models, tokenizer, args)[d]
            removals = list(itertools.combinations(range(scorer.n), int(part[-1])))[:64]
            units[d] = lambda scorer=scorer, removals=removals: (scorer.windowed.clear(), scorer.per_window(removals))  # measured again each call
        elif part == "depth-use":
            from depthcurse.tasks.perplexity import PerplexityTask
            from depthcurse.text import load_texts

            texts, label = load_texts("wiki", option="--data")
            windows = PerplexityTask(tokenizer, texts, source=label, seq_len=args.depth_seq_len, limit=args.depth_batch, warn_short=False).windows
            units[d] = lambda d=d, windows=windows: measure_depth_use(models[d], windows, args.depth_batch, influence=True)
        elif part == "sweep":
            from depthcurse.prune.engine import evaluate_variants
            from depthcurse.tasks.perplexity import PerplexityTask
            from depthcurse.text import load_texts

            texts, label = load_texts("wiki", option="--data")
            task = PerplexityTask(tokenizer, texts, source=label, seq_len=args.sweep_seq_len, limit=4, warn_short=False)
            units[d] = lambda d=d, task=task: evaluate_variants(models[d], task, [(), (3,), (14,)], checked=True)
        elif part == "check":
            prompt = tokenizer(load_prompts("suite", 1)[0].text, return_tensors="pt").input_ids
            lm = CachedModel(models[d])
            with torch.inference_mode():
                lm.feed(prompt)
            base = lm.length

            def steps(lm=lm, base=base, token=prompt[:, -1:]):
                for _ in range(8):
                    lm.feed(token)
                    lm.keep(base)

            units[d] = steps
        else:
            raise SystemExit(f"--profile covers sweep, exact2, exact3, depth-use and check, not {part}")
    out = {}
    for d in DTYPES:
        with torch.inference_mode():
            units[d]()  # warm
            out[d] = where_time_goes(units[d])
    return {"part": part, "profile": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--parts", help=f"comma-separated, of {', '.join(PARTS)}; default every one (sweep where --sweeps is given)")
    parser.add_argument("--windows", type=int, default=4, help="select: calibration windows")
    parser.add_argument("--seq-len", type=int, default=64, help="select: tokens a window")
    parser.add_argument("--depth-windows", type=int, default=8)
    parser.add_argument("--depth-seq-len", type=int, default=128)
    parser.add_argument("--depth-batch", type=int, default=4)
    parser.add_argument("--check-tokens", type=int, default=5)
    parser.add_argument("--pairs", type=int, default=12)
    parser.add_argument("--skip", default="12-15")
    parser.add_argument("--per-kind", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--heal-layers", default="21-24")
    parser.add_argument("--heal-steps", type=int, default=9)
    parser.add_argument("--heal-batch", type=int, default=4)
    parser.add_argument("--heal-seq-len", type=int, default=256)
    parser.add_argument("--probe-limit", type=int, default=4)
    parser.add_argument("--sweeps", help="sweep: fp32=PATH,bf16=PATH, the demo's prune.json in each dtype")
    parser.add_argument("--sweep-seq-len", type=int, default=512)
    parser.add_argument("--profile", action="store_true", help="instead of timing the parts: where one unit of each spends its time")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    print(f"heap: {heap.keep_freed_memory()}", flush=True)  # as every command does (DEPTHCURSE_KEEP_FREED=0: the C library's own)
    args.parts = args.parts or ",".join(p for p in PARTS if p != "sweep" or args.sweeps)
    args.out.mkdir(parents=True, exist_ok=True)
    rates, bytes_per_s = peak_rates(), bandwidth()
    print(f"{torch.get_num_threads()} threads; matmul peak at 512 rows: fp32 {rates['fp32']:.0f}, bf16 {rates['bf16']:.0f} GFLOP/s; "
          f"memory bandwidth {bytes_per_s / 1e9:.1f} GB/s", flush=True)
    models, tokenizer = {}, None
    for d in DTYPES:
        loaded = load_model(args.model, dtype=d)
        models[d], tokenizer = loaded.model.eval(), loaded.tokenizer
    if args.profile:
        profiles = [profile_part(part, models, tokenizer, args) for part in args.parts.split(",")]
        (args.out / "profiles.json").write_text(json.dumps(profiles, indent=1))
        print("| work | dtype | " + " | ".join(f"{k} share" for k in (*KINDS, "other")) + " | costliest operators |")
        print("|---|---|" + "---|" * (len(KINDS) + 2))
        for p in profiles:
            for d, prof in p["profile"].items():
                top = ", ".join(f"{name} {share:.0%}" for name, share in prof["top"][:4])
                print(f"| {p['part']} | {d} | " + " | ".join(f"{v:.0%}" for v in prof["shares"].values()) + f" | {top} |")
        return
    rows = []
    for part in args.parts.split(","):
        started = time.perf_counter()
        if part == "sweep":
            row = sweep_part(models, args, rates)
        elif part in ("exact2", "exact3"):
            row = exact_part(models, tokenizer, args, int(part[-1]), rates)
        elif part == "greedy4":
            row = greedy_part(models, tokenizer, args, rates)
        elif part == "depth-use":
            row = depth_use_part(models, tokenizer, args, rates)
        elif part == "check":
            row = check_part(models, tokenizer, args, rates, bytes_per_s)
        elif part == "speculate":
            row = speculate_part(models, tokenizer, args, rates)
        elif part == "heal":
            row = heal_part(args, rates)
        elif part == "probes":
            row = probes_part(models, tokenizer, args, rates)
        else:
            raise SystemExit(f"unknown part {part!r}: {', '.join(PARTS)}")
        row["part"], row["wall_s"] = part, time.perf_counter() - started
        rows.append(row)
        print(json.dumps(row, default=str), flush=True)
        (args.out / f"side_by_side.{part}.json").write_text(json.dumps(row, indent=1, default=str))
    record = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"), "threads": torch.get_num_threads(), "peak_gflops": rates,
              "bandwidth_bytes_per_s": bytes_per_s, "rows": rows}
    (args.out / "side_by_side.json").write_text(json.dumps(record, indent=1, default=str))
    print("| job | fp32 (s) | bf16 (s) | bf16 / fp32 (median of pairs, interval) | fp32 / floor | bf16 / floor |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        share = row.get("floor_share", {})
        interval = row.get("interval")
        shown = f"{row['ratio']:.3f}" + (f" [{interval[0]:.3f}, {interval[1]:.3f}]" if interval else "")
        print(f"| {row['job']} | {row['fp32_s']:.2f} | {row['bf16_s']:.2f} | {shown} | "
              f"{share.get('fp32', float('nan')):.2f}x | {share.get('bf16', float('nan')):.2f}x |")


if __name__ == "__main__":
    main()
