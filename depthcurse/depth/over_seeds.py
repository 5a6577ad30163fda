"""Runs of one architecture on one text, trained from other seeds: what depth-use and the depth map
say of each, the mean over runs with Student's t interval at runs - 1 degrees of freedom, and every
other architecture against the first with Welch's interval (independent samples: nothing pairs one
normalisation's seed 1 with another's, so nothing is paired).

Runs are grouped by the model's own config (`architecture`, stored in each record: the norm, the
depth, the widths; not the seed, which no config holds) and by what they were measured on. A model
measured twice is one run: its second record would add no spread, only a narrower interval.

Each figure is a scalar per run (`use_figures`, `map_figures`). The halves split the layers at
n // 2; "second half" is layers n // 2 .. n - 1 (the influence rows stop at n - 2: the last layer
has no later one to change).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from rich.table import Table

from depthcurse.depth.definitions import same_definitions
from depthcurse.depth.depth_map import deciding
from depthcurse.depth.measure import DepthUse, half_settled, influence_row_means
from depthcurse.errors import DepthcurseError
from depthcurse.stats.intervals import apart, mean, mean_interval, welch_interval
from depthcurse.stats.verdicts import difference_word

NOISE = ("transformers_version", "torch_dtype", "dtype", "architectures", "auto_map", "name_or_path")


def architecture(model) -> dict:
    """The model's config as a plain dict, without what does not change the computation (names,
    dtypes, versions): two seeds of one lns-train setting give equal ones."""
    config = getattr(model, "config", None)
    if config is None:
        return {}
    return {k: v for k, v in sorted(config.to_dict().items()) if not k.startswith("_") and k not in NOISE}


@dataclass(frozen=True)
class Figure:
    key: str
    label: str
    digits: int = 3
    bounds: tuple[float, float] | None = None  # a figure that cannot leave a range (a correlation, a relative depth): its interval is cut there
    words: tuple[str, str] = ("more", "less")  # what a difference above 0 and below 0 is called

LAYER = ("later", "earlier")  # a layer index's difference
USE_NOTE = "the halves split the layers at n // 2"
MAP_NOTE = ("relative depth: (layer + 1) / layers (stream / layers by their definitions); the score: the map's deciding one; a correlation's, "
            "a relative depth's and an R^2's interval cut at the ends of its range")


USE_FIGURES = (
    Figure("phase", "phase transition (layer)", 1, words=LAYER),
    Figure("half_settled", "half of the tokens settled, logit lens (layer)", 1, words=LAYER),
    Figure("tuned_half_settled", "half of the tokens settled, tuned lens (layer)", 1, words=LAYER),
    Figure("attn_first", "attention ||a||/||h||, first half"),
    Figure("attn_second", "attention ||a||/||h||, second half"),
    Figure("mlp_first", "MLP ||m||/||h||, first half"),
    Figure("mlp_second", "MLP ||m||/||h||, second half"),
    Figure("influence_first", "influence on later layers, first half"),
    Figure("influence_second", "influence on later layers, second half"),
    Figure("skip_kl_first", "output KL when skipped, first half (nats)"),
    Figure("skip_kl_second", "output KL when skipped, second half (nats)"),
    Figure("lens_kl_middle", "logit lens KL at layer n/2 - 1 (nats)"),
    Figure("tuned_kl_middle", "tuned lens KL at layer n/2 - 1 (nats)"),
)

MAP_FIGURES = (
    Figure("depth_gap", "best match's distance from the same relative depth"),
    Figure("order", "Spearman's rho, shallow depth against its best match's", bounds=(-1.0, 1.0)),
    Figure("last_reach", "shallow last layer's best match (relative depth)", bounds=(0.0, 1.0)),
    Figure("last_r2", "shallow last layer's best R^2", bounds=(float("-inf"), 1.0)),
    Figure("deep_last_r2", "deep last layer's R^2 from the best shallow layer", bounds=(float("-inf"), 1.0)),
)
SCORE_FIGURES = {  # the last two figures by the maps' deciding score (an R^2 cannot pass 1; an error cannot fall below 0)
    "r2_dims": (Figure("last_r2", "shallow last layer's best per-dimension R^2", bounds=(float("-inf"), 1.0)),
                Figure("deep_last_r2", "deep last layer's per-dimension R^2 from the best shallow layer", bounds=(float("-inf"), 1.0))),
    "r2": MAP_FIGURES[3:],
    "relative_error": (Figure("last_r2", "shallow last layer's lowest relative error", bounds=(0.0, float("inf"))),
                       Figure("deep_last_r2", "deep last layer's relative error from the best shallow layer", bounds=(0.0, float("inf")))),
}


def _average(values) -> float | None:
    values = [v for v in values if v is not None and v == v]  # NaN in memory, null read back
    return sum(values) / len(values) if values else None


def use_figures(record: dict) -> dict[str, float | None]:
    """One depth-use run's figures: where its phase transition and settling lie, and what the layers of
    each half add, change later and cost when skipped."""
    use = DepthUse(**record["use"])
    n, rows = use.n_layers, record["layers"]
    middle = n // 2

    def halves(values: list) -> tuple[float | None, float | None]:
        return _average(values[:middle]), _average(values[middle:])

    attn, mlp = halves([r["attn_norm"] for r in rows]), halves([r["mlp_norm"] for r in rows])
    influence = halves([*influence_row_means(use), None]) if use.influence else (None, None)
    skip = halves(use.output_change) if use.output_change else (None, None)
    return {"phase": record.get("phase_transition"), "half_settled": half_settled(use.settled),
            "tuned_half_settled": None if use.tuned_settled is None else half_settled(use.tuned_settled),
            "attn_first": attn[0], "attn_second": attn[1], "mlp_first": mlp[0], "mlp_second": mlp[1],
            "influence_first": influence[0], "influence_second": influence[1], "skip_kl_first": skip[0], "skip_kl_second": skip[1],
            "lens_kl_middle": rows[middle - 1]["lens_kl"] if middle else None,
            "tuned_kl_middle": rows[middle - 1].get("tuned_kl") if middle else None}


def map_figures(record: dict) -> dict[str, float | None]:
    """One depth map's figures: how far the best matches lie from the diagonal, and how far the
    shallow model's end reaches into the deep one, by the map's deciding score."""
    _, matrix, higher = deciding(record)
    pick = max if higher else min
    last = pick(range(len(matrix[-1])), key=lambda j: matrix[-1][j])
    reach = last / record["deep_layers"] if record.get("streams") == "entering" else (last + 1) / record["deep_layers"]
    return {"depth_gap": record["relative_depth"]["mean_abs_difference"], "order": record["relative_depth"]["spearman"], "last_reach": reach,
            "last_r2": matrix[-1][last], "deep_last_r2": pick(row[-1] for row in matrix)}


def _use_key(record: dict) -> tuple[str, str]:
    run = record["run"]
    arch = run.get("architecture") or {"source": run.get("source")}  # a record from before architectures were kept: alone
    tuned = (record.get("tuned_lens") or {}).get("settings")
    return json.dumps([arch, run["data"], run["windows"], run["seq_len"], tuned], sort_keys=True, default=str), _label(arch)


def _map_key(record: dict) -> tuple[str, str]:
    run = record["run"]
    archs = [run[side].get("architecture") or {"source": run[side].get("source")} for side in ("shallow", "deep")]
    key = json.dumps([archs, run["data"], run["seq_len"], record["fit_windows"], record["held_out_windows"]], sort_keys=True, default=str)
    return key, f"{_label(archs[0])} -> {_label(archs[1])}"


def _label(arch: dict) -> str:
    if "source" in arch and len(arch) == 1:
        return str(arch["source"])
    name = arch.get("norm") or arch.get("model_type") or "model"
    if arch.get("init_rule") not in (None, "default", "authors"):  # lns-train's default: each norm's authors' init
        name += f" + {arch['init_rule']} init"
    layers = arch.get("num_hidden_layers")
    return f"{name}, {layers} layers" if layers else name


def _group(records: list[dict], names: list[str], key_of, figures_of) -> list[dict]:
    groups: dict[str, dict] = {}
    for name, record in zip(names, records):
        key, label = key_of(record)
        group = groups.setdefault(key, {"label": label, "runs": [], "sources": [], "figures": []})
        run = record["run"]
        source = (run["shallow"].get("source"), run["deep"].get("source")) if "deep" in run else run.get("source")
        if source in group["sources"]:
            continue  # the same weights measured again: no new run
        group["runs"].append(name)
        group["sources"].append(source)
        group["figures"].append(figures_of(record))
    out = list(groups.values())
    seen: dict[str, int] = {}
    for group in out:  # two groups the same label would hide (another text, another width): numbered
        seen[group["label"]] = seen.get(group["label"], 0) + 1
        if seen[group["label"]] > 1:
            group["label"] += f" #{seen[group['label']]}"
    return out


def _within(interval: list[float] | None, bounds: tuple[float, float] | None) -> list[float] | None:
    if interval is None or bounds is None:
        return interval
    return [max(interval[0], bounds[0]), min(interval[1], bounds[1])]


def _summarise(groups: list[dict], figures: tuple[Figure, ...], note: str) -> dict:
    for group in groups:
        group["summary"] = {}
        for figure in figures:
            values = [f[figure.key] for f in group["figures"] if f[figure.key] is not None]
            group["summary"][figure.key] = {"values": values, "mean": mean(values) if values else None,
                                            "interval": _within(mean_interval(values), figure.bounds)}
    differences = []
    for group in groups[1:]:
        for figure in figures:
            a, b = group["summary"][figure.key]["values"], groups[0]["summary"][figure.key]["values"]
            if a and b:
                iv = welch_interval(a, b)
                differences.append({"group": group["label"], "against": groups[0]["label"], "figure": figure.key, "label": figure.label,
                                    "difference": mean(a) - mean(b), "interval": iv, "apart": apart(iv), "verdict": difference_word(iv, *figure.words)})
    return {"figures": [{"key": f.key, "label": f.label, "digits": f.digits} for f in figures], "groups": groups, "differences": differences, "note": note}


def summarise_runs(groups: dict[str, list[dict]], kind: str = "use", score: str = "r2") -> dict:
    """The summary `report` prints, from each group's per-run figures alone (`use_figures` or
    `map_figures` of each run, by group label, the first group the one the others are set against):
    what a finding's stored figures are checked against (`tests/test_findings.py`)."""
    figures = USE_FIGURES if kind == "use" else MAP_FIGURES[:3] + SCORE_FIGURES[score]
    note = USE_NOTE if kind == "use" else MAP_NOTE
    return _summarise([{"label": label, "runs": [f"{label} #{i + 1}" for i in range(len(runs))], "figures": runs} for label, runs in groups.items()],
                      figures, note)


def use_over_seeds(records: list[dict], names: list[str]) -> dict:
    """depth-use records grouped by architecture and text, in the order first met (the first group
    is what the others are compared with); records of two definitions are one line."""
    same_definitions(records, names)
    return _summarise(_group(records, names, _use_key, use_figures), USE_FIGURES, USE_NOTE)


def map_over_seeds(records: list[dict], names: list[str]) -> dict:
    """depth-map records grouped by the two architectures and the text; maps of two definitions, or
    decided by two scores, are one line."""
    same_definitions(records, names, what="maps")
    scores = [deciding(r)[0] for r in records]
    for name, score in zip(names, scores):
        if score != scores[0]:
            raise DepthcurseError(f"maps of two scores: {names[0]} decided by {scores[0]}, {name} by {score}; not set side by side (rerun one with --score)")
    figures = MAP_FIGURES[:3] + SCORE_FIGURES[scores[0] if scores else "r2"]
    return _summarise(_group(records, names, _map_key, map_figures), figures, MAP_NOTE)


def repeated(summary: dict) -> bool:
    """Whether any group has two runs or more (else there is nothing over seeds to say)."""
    return any(len(g["runs"]) > 1 for g in summary["groups"])


def _cell(entry: dict | None, digits: int, signed: bool = False) -> str:
    if entry is None or entry.get("mean", entry.get("difference")) is None:
        return "-"
    value = entry["mean"] if "mean" in entry else entry["difference"]
    form = f"{{:{'+' if signed else ''}.{digits}f}}"
    iv = entry.get("interval")
    if iv and iv[0] == iv[1]:  # no spread between the runs (a layer index, say): no interval to give, only that
        return form.format(value) + " (every run)"
    return form.format(value) + (f" [{form.format(iv[0])}, {form.format(iv[1])}]" if iv else "")


def seeds_table(summary: dict, what: str) -> Table:
    """A figure per row, a group per column: the mean over its runs and the 95% interval."""
    table = Table(title=f"{what} over seeds: each architecture's runs on the same text",
                  caption="mean over runs (seeds), in brackets the 95% interval (Student's t at runs - 1 df; none from one run; (every run): "
                          f"every run gave this value, no spread to give an interval of); {summary['note']}", caption_justify="left")
    table.add_column("figure", justify="left")
    for group in summary["groups"]:
        table.add_column(f"{group['label']} ({len(group['runs'])} run{'s' if len(group['runs']) != 1 else ''})", justify="right")
    for figure in summary["figures"]:
        cells = [_cell(g["summary"][figure["key"]], figure["digits"]) for g in summary["groups"]]
        if any(c != "-" for c in cells):
            table.add_row(figure["label"], *cells)
    return table


def differences_table(summary: dict) -> Table:
    """Each group against the first, figure by figure: the difference of means and Welch's interval."""
    first = summary["groups"][0]["label"]
    table = Table(title=f"each architecture against {first}: the difference of the means over seeds",
                  caption="in brackets Welch's 95% interval (independent seeds, each group's own variance, Welch-Satterthwaite df); "
                          "more / less (later / earlier for a layer): the interval lies above / below 0; cannot tell: it holds 0, or a group has one run; "
                          "(every run): every run of both groups gave one value each, "
                          "so there is no spread to give an interval of", caption_justify="left")
    table.add_column("figure", justify="left")
    others = [g["label"] for g in summary["groups"][1:]]
    for label in others:
        table.add_column(f"{label} - {first}", justify="right")
    digits = {f["key"]: f["digits"] for f in summary["figures"]}
    for figure in summary["figures"]:
        found = {d["group"]: d for d in summary["differences"] if d["figure"] == figure["key"]}
        if not found:
            continue
        cells = []
        for label in others:
            d = found.get(label)
            verdict = None if d is None else _verdict(d)
            mark = "" if verdict in (None, "equal", "constant") else f" {verdict}"
            cells.append(_cell(d, digits[figure["key"]], signed=True) + mark)
        table.add_row(figure["label"], *cells)
    return table


def _verdict(difference: dict) -> str:
    """equal: every run of both groups gave one value (a layer index, say), the same: a tie;
    constant: every run of each gave one value, and they differ (Welch's interval has no width
    there, and no coverage to claim); else the interval's word (`stats.verdicts`, kept by `_summarise`): more / less
    (later / earlier), or cannot tell where it holds 0 or there is none."""
    iv = difference["interval"]
    if iv is not None and iv[0] == iv[1]:
        return "equal" if difference["difference"] == 0.0 else "constant"
    return difference["verdict"]


def seeds_verdicts(summary: dict) -> list[str]:
    """A line per group against the first: the figures whose intervals leave 0 out, and how many cannot tell."""
    lines = []
    by_group: dict[str, list[dict]] = {}
    for d in summary["differences"]:
        by_group.setdefault(d["group"], []).append(d)
    for group, rows in by_group.items():
        verdicts = [_verdict(d) for d in rows]
        told = [(d, v) for d, v in zip(rows, verdicts) if v not in ("equal", "constant", "cannot tell")]
        said = "; ".join(f"{d['label']} {v} {d['difference']:+.3g} [{d['interval'][0]:+.3g}, {d['interval'][1]:+.3g}]" for d, v in told)
        constant = "; ".join(f"{d['label']} {d['difference']:+.3g}" for d, v in zip(rows, verdicts) if v == "constant")
        equal = verdicts.count("equal")
        lines.append(f"{group} against {rows[0]['against']}: " + (said if told else "no figure told apart")
                     + (f"; the same in every run of each, and different: {constant}" if constant else "")
                     + f" ({verdicts.count('cannot tell')} of {len(rows)} cannot tell at these seeds" + (f", {equal} equal in every run)" if equal else ")"))
    return lines
