"""A speculate run on screen and on disk: the table of drafts, what not to miss a line each, the
per-prompt CSV and the figure of measured against expected speedup."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from depthcurse.io import atomic_write, csv_text, read_record, save_figure
from depthcurse.speculate.run import SPECULATE_JSON

SPECULATE_CSV = "speculate.csv"
SPECULATE_PNG = "speculate.png"


def read_speculate(folder: Path) -> dict:
    return read_record(folder, SPECULATE_JSON, "finished speculate run", needs=("summary", "drafts"))


def _num(value, digits: int = 2, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def _est(estimate: dict | None, digits: int = 2) -> str:
    """A mean and its interval; one number alone (one prompt) says it has none."""
    if not estimate:
        return "-"
    interval = estimate.get("interval")
    return f"{estimate['mean']:.{digits}f}" + (f" ({interval[0]:.{digits}f}-{interval[1]:.{digits}f})" if interval else " (no interval)")


def _prompts(n: int) -> str:
    return "1 prompt" if n == 1 else f"{n} prompts"


def _span(values: list[float]) -> str:
    """Several drafts' figures as their range; one, or all equal, as one number."""
    low, high = f"{min(values):.2f}", f"{max(values):.2f}"
    return low if low == high else f"{low}-{high}"


def _speedup(ratio: dict | None) -> str:
    if not ratio:
        return "-"
    interval = ratio.get("interval")
    return f"{ratio['median']:.2f}x" + (f" ({interval[0]:.2f}-{interval[1]:.2f})" if interval else " (no interval)")


def _length(run: dict) -> str:
    return {"fixed": f"{run['draft_tokens']}", "confidence": f"at most {run['draft_tokens']}, confidence stop",
            "heuristic": f"from {run['draft_tokens']}, heuristic"}[run["draft_length"]]


def speculate_table(record: dict) -> Table:
    run, summary = record["run"], record["summary"]
    done = len(record["prompts"])
    what = "greedy" if run["temperature"] == 0 else f"sampling at temperature {run['temperature']:g}"
    table = Table(title=f"{run['model']}: drafts checked by the whole model ({what}), {done} of {record['asked']} prompts"
                        f"{'' if record.get('complete') else ' (incomplete)'}, {run['max_new_tokens']} new tokens at most; draft length {_length(run)}"
                        + ("" if (summary.get("timing") or {"status": "ok"})["status"] == "ok" else ": TIMINGS NOT TRUSTED, see the verdicts"),
                  caption="95% intervals over prompts (Student's t; speedups: the median of per-prompt time ratios, distribution-free). c: a draft "
                          "step's seconds, v: a check's, in decoding steps of the whole model alone. Expected: Leviathan et al.'s "
                          "E\\[tokens] / (gamma c + v) at v = 1 and at the measured v. Ceiling: every token accepted. Break-even: the acceptance "
                          "the draft pays at.")
    for header in ("draft", "tokens/s (decoding)", "speedup (decoding)", "speedup (with prefills)", "acceptance", "tokens per check", "c", "v",
                   "expected: v = 1 | measured v", "ceiling: v = 1 | v", "break-even acceptance: v = 1 | v", "same tokens as generate"):
        table.add_column(header, overflow="fold")
    plain = summary["plain"]
    trusted = (summary.get("timing") or {"status": "ok"})["status"] == "ok"  # else what pays is not said: no cell says it either
    table.add_row("decoding alone: the whole model, a token a pass", _est(plain["tokens_per_s"], 1), "1", "1", "", "1", "", "1", "", "", "",
                  f"{plain['lossless']['equal']} of {plain['lossless']['compared']}" if plain["lossless"]["compared"] else "sampling: -")
    for name, s in summary["drafts"].items():
        lossless = s["lossless"]
        table.add_row(f"{name}: {record['methods'][name]['what']}", _est(s["tokens_per_s"], 1), _speedup(s["speedup"]), _speedup(s["end_to_end"]),
                      _est(s["alpha"]), _est(s["tokens_per_check"]), _est(s["c"]), _est(s["v"]), f"{_est(s['expected'])} | {_est(s['expected_v'])}",
                      f"{_num(s.get('ceiling'), 2, 'x')} | {_num(s.get('ceiling_v'), 2, 'x')}",
                      f"{_alpha(s, 'break_even')} | {_alpha(s, 'break_even_v')}" if trusted else "not said: timings not trusted",
                      f"{lossless['equal']} of {lossless['compared']}" if lossless["compared"] else "sampling: -")
    helper = summary.get("transformers-assistant")
    if helper:  # transformers' own loop, timed whole against its own decoding alone (`generate`)
        lossless = helper["lossless"]
        table.add_row(f"transformers-assistant: {record['methods']['transformers-assistant']['what']} (against model.generate)", "", "",
                      _speedup(helper["speedup"]), "", "", "", "", "", "", "",
                      f"{lossless['equal']} of {lossless['compared']}" if lossless["compared"] else "sampling: -")
    return table


def _alpha(s: dict, key: str) -> str:
    if key not in s:
        return "-"
    return "none pays" if s[key] is None else f"{s[key]:.2f}"


def speculate_verdicts(record: dict) -> list[str]:
    """What not to miss, a line each: lossless or not, which drafts pay and why not, the check's cost,
    the loop's own time, the draft's memory."""
    run, summary = record["run"], record["summary"]
    lines = []
    if run["temperature"] == 0:
        for name, s in summary["drafts"].items():
            lossless = s["lossless"]
            if lossless["compared"] and lossless["equal"] == lossless["compared"]:
                continue
            where = ", ".join(f"prompt {d['prompt']} at token {d['at']}" for d in lossless["differ"][:4])
            lines.append(f"{name}: greedy output differs from model.generate's on {len(lossless['differ'])} of {lossless['compared']} prompts ({where})")
        compared = [s["lossless"] for s in summary["drafts"].values()]
        if all(c["compared"] and c["equal"] == c["compared"] for c in compared):
            lines.append(f"lossless: every draft's greedy output equals model.generate's, token for token, on every prompt ({compared[0]['compared']} of "
                         f"{compared[0]['compared']})")
    else:
        lines.append(f"sampling at temperature {run['temperature']:g}: each draft's tokens follow the whole model's distribution by Leviathan "
                     "et al.'s rule (tests/test_speculate.py checks the rule exactly and by a chi-square test); no token-for-token check")
    timing = summary.get("timing") or {"status": "ok"}
    if timing["status"] != "ok":  # speed's rule: the timings are no finding here, the acceptance is
        lines.append(f"the timings cannot be trusted here: the whole model's decoding, timed twice a prompt (this loop and model.generate, the "
                     f"same tokens in turns), gave {timing['reason']}; no speedup, c or v below is a finding, so the drafts are said by their "
                     "acceptance alone")
        for name, s in summary["drafts"].items():
            if s.get("alpha"):
                lines.append(f"{name}: acceptance {_est(s['alpha'])} over {_prompts(s['alpha']['n'])} (what pays: not said, the timings are not trusted)")
    for name, s in summary["drafts"].items() if timing["status"] == "ok" else ():
        speed, alpha = s["speedup"], (s["alpha"] or {}).get("mean")
        if not speed:
            continue
        pays = speed["interval"] is not None and speed["interval"][0] > 1.0
        slower = speed["interval"] is not None and speed["interval"][1] < 1.0
        verdict = "pays" if pays else ("does not pay" if slower else "cannot be told from decoding alone")
        why = ""
        if "break_even_v" in s and alpha is not None:
            be = s["break_even_v"]
            why = (f": acceptance {alpha:.2f}, and at c = {s['c']['mean']:.2f}, v = {s['v']['mean']:.2f} and {s['gamma']['mean']:.1f} tokens a round "
                   + ("no acceptance pays (even every token accepted gives " + f"{s['ceiling_v']:.2f}x)" if be is None else f"it pays above {be:.2f}")
                   + (_largest(s) if "largest_c" in s and not pays else ""))
        fidelity = f"; measured / expected at the measured v: {s['measured_over_expected']:.2f}" if "measured_over_expected" in s else ""
        lines.append(f"{name} {verdict} ({_speedup(speed)} measured){why}{fidelity}")
    for name, d in (summary.get("versus") or {}).items():
        if d is None:
            continue
        iv = d["interval"]
        said = f"{d['difference']:+.3f}" + (f" [{iv[0]:+.3f}, {iv[1]:+.3f}]" if iv else " (one prompt: no interval)")
        word = "cannot tell" if d["verdict"] == "cannot tell" else f"accepted {d['verdict']}"
        lines.append(f"{name} against {d['against']}: {word} ({said} acceptance, paired over {_prompts(d['prompts'])}, Student's t)")
    v = [s["v"]["mean"] for s in summary["drafts"].values() if s.get("v")]
    if v and timing["status"] == "ok":
        linear = f"; its matmuls: {record['check_linear']}" if record.get("check_linear") else ""  # absent from a record before issue 89
        lines.append(f"the check of a draft's tokens costs {_span(v)} decoding steps (v; Leviathan et al. assume 1){linear}")
    overheads = {name: s["overhead"]["mean"] for name, s in summary["drafts"].items() if s.get("overhead")}
    if overheads and summary["plain"].get("overhead"):
        lines.append("the loop's own time, outside forward passes: " + ", ".join(f"{n} {o:.1%}" for n, o in overheads.items())
                     + f"; decoding alone {summary['plain']['overhead']['mean']:.1%}")
    kv = [(n, s) for n, s in summary["drafts"].items() if s.get("draft_cache_bytes")]
    if kv:
        lines.append("the draft's extra memory is its KV cache: " + ", ".join(f"{n} {s['draft_cache_bytes'] / 2**20:.2f} MiB at most "
                                                                             f"({s['draft_cache_share']:.2f} of the whole model's)" for n, s in kv))
    return lines


def _largest(s: dict) -> str:
    if s["largest_c"] < 0:
        return "; at this acceptance no draft pays however cheap: the check alone costs more than the tokens a round gives"
    return f"; at this acceptance a draft step must cost at most {s['largest_c']:.2f} of a decoding step"


def kind_table(record: dict) -> Table:
    table = Table(title="by kind of prompt: acceptance and speedup (decoding), 95% intervals over the kind's prompts")
    table.add_column("kind")
    drafts = list(record["summary"]["drafts"])
    for name in drafts:
        table.add_column(f"{name}: acceptance | speedup", overflow="fold")
    for kind, by in record["summary"]["by_kind"].items():
        table.add_row(kind, *(f"{_est(by[n]['alpha'])} | {_speedup(by[n]['speedup'])}" for n in drafts))
    return table


def prompt_rows(record: dict) -> list[dict]:
    """A row per prompt and draft: what it generated, accepted and cost, and whether its tokens are generate's."""
    rows = []
    for i, p in sorted(record["prompts"].items(), key=lambda kv: int(kv[0])):
        plain = p["plain"]
        for name in record["summary"]["drafts"]:
            d = p[name]
            rows.append({"prompt": int(i), "kind": p["kind"], "source": p["source"], "prompt_tokens": p["prompt_tokens"], "draft": name,
                         "generated": d["generated"], "rounds": len(d["rounds"]), "drafted": sum(r[0] for r in d["rounds"]),
                         "accepted": sum(r[1] for r in d["rounds"]), "checks": d["steps"], "decode_s": d["decode_s"], "plain_decode_s": plain["decode_s"],
                         "draft_s": d["draft_s"], "check_s": d["step_s"], "plain_step_s": plain["step_s"], "plain_steps": plain["steps"],
                         "same_tokens_as_generate": d.get("tokens_equal")})
    return rows


def write_speculate_files(record: dict, out_dir: Path) -> list[Path]:
    """The per-prompt CSV and the figure beside `speculate.json`."""
    out_dir = Path(out_dir)
    written = [atomic_write(out_dir / SPECULATE_CSV, csv_text(prompt_rows(record)))]
    written.append(save_figure(speedup_figure(record), out_dir / SPECULATE_PNG))
    return written


# the figure's look (what it marks, where, and its labels are tested; not its colours and sizes)
MEASURED = {"fmt": "o", "color": "C0"}  # pragma: no mutate
EXPECTED = ((0.0, "expected", "C1", "expected, v = 1"), (0.15, "expected_v", "C2", "expected, measured v"))  # pragma: no mutate
CEILING = {"color": "grey", "markersize": 18}  # pragma: no mutate


def speedup_figure(record: dict):
    """Each draft's measured speedup (median, 95% interval) beside its expected ones and its ceiling."""
    import matplotlib  # lazy: matplotlib takes a second to import

    matplotlib.use("Agg")  # pragma: no mutate (the drawing's look: what it marks is tested, not its colours and sizes)
    import matplotlib.pyplot as plt

    drafts = record["summary"]["drafts"]
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(drafts), 4.2))  # pragma: no mutate
    for x, (name, s) in enumerate(drafts.items()):
        if s["speedup"]:
            lo, hi = s["speedup"]["interval"] or (s["speedup"]["median"],) * 2
            ax.errorbar(x - 0.15, s["speedup"]["median"], yerr=[[s["speedup"]["median"] - lo], [hi - s["speedup"]["median"]]], **MEASURED,
                        label="measured (median, 95%)" if x == 0 else None)
        for offset, key, colour, label in EXPECTED:
            if s.get(key):
                ax.plot(x + offset, s[key]["mean"], "s", color=colour, label=label if x == 0 else None)
        if s.get("ceiling") is not None:
            ax.plot(x, s["ceiling"], "_", **CEILING, label="ceiling (every token accepted), v = 1" if x == 0 else None)
    ax.axhline(1.0, color="black", linewidth=0.8)  # pragma: no mutate
    ax.set_xticks(range(len(drafts)), list(drafts))
    ax.set_ylabel("speedup of decoding over the whole model alone")
    run = record["run"]
    ax.set_title(f"{run['model']}: {len(record['prompts'])} prompts, draft length {_length(run)}", fontsize=9)  # pragma: no mutate
    ax.legend(fontsize=7)  # pragma: no mutate
    fig.tight_layout()
    return fig
