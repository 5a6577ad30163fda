"""A prune sweep's results: what `prune.json` and `prune.csv` hold, written and read in one place.

`prune.json` is the record of a run: its identity (model, revision, dtype, task, data, shots,
limit, seed), the package versions and wall time, and every finished variant. It is rewritten
atomically after each variant (or batch), so it is also what an interrupted sweep resumes from.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable

from depthcurse.errors import DepthcurseError
from depthcurse.tasks.harness import SUITE_METRIC
from depthcurse.tasks.probes import capability_scores, per_rung
from depthcurse.io import atomic_write, csv_text, json_text
from depthcurse.stats.intervals import mean_interval

RESULTS_JSON = "prune.json"
RESULTS_CSV = "prune.csv"
PARTIAL_DIR = "prune.partial"  # the reuse engine's finished batches, until the sweep ends
VARIANTS_DIR = "prune.variants"  # variants evaluated on their own: claimed, then finished, until the sweep ends


@dataclass
class VariantResult:
    removed: list[int]  # [] for the unpruned baseline
    metrics: dict[str, float]
    examples: int
    seconds: float
    details: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        return variant_label(self.removed)


def removal_key(variant: int | Iterable[int]) -> tuple[int, ...]:
    """A variant as the sorted tuple of removed layers: 3 -> (3,), [5, 4] -> (4, 5)."""
    return (variant,) if isinstance(variant, int) else tuple(sorted(set(variant)))


def variant_label(removed: Iterable[int]) -> str:
    removed = list(removed)
    return "none" if not removed else ",".join(map(str, removed))


# What a removal takes out, in words: a whole layer, or one branch of it (`--granularity`).
UNIT_NAMES = {"layer": "layers", "attn": "attention branches", "mlp": "MLP branches"}
UNIT_NAME = {"layer": "layer", "attn": "attention branch", "mlp": "MLP branch"}


@dataclass
class Sweep:
    """Everything `prune.json` holds; `variants[0]` is the baseline once it has run."""

    run: dict  # what identifies the run: resuming requires the same
    metric: str
    higher_is_better: bool
    n_layers: int
    variants: list[VariantResult] = field(default_factory=list)
    meta: dict = field(default_factory=dict)  # versions, wall time: informative, not identity
    asked: list[list[int]] | None = None  # what the last command asked for (None: written before this was kept)

    @property
    def granularity(self) -> str:
        return self.run.get("granularity", "layer")

    @property
    def unit(self) -> str:
        """What one removal takes out: "layer", "attention branch" or "MLP branch"."""
        return UNIT_NAME[self.granularity]

    @property
    def pending(self) -> list[list[int]]:
        """The variants asked for that have no result yet (an interrupted sweep's)."""
        done = {tuple(v.removed) for v in self.variants}
        return [a for a in self.asked or [] if tuple(a) not in done]

    @property
    def complete(self) -> bool:
        return not self.pending

    def status_text(self) -> str:
        """"complete", or how far an interrupted sweep came."""
        if self.complete:
            return "complete"
        return f"partial: {len(self.asked) - len(self.pending)} of {len(self.asked)} variants measured (rerun its command to finish)"

    def data_text(self) -> str:
        """What each variant's score rests on, in words: `16 windows x 512 tokens of wiki`, `570 examples of arc_easy, 5-shot`."""
        return data_text(self.run, self.baseline.examples if self.baseline else None)

    @property
    def baseline(self) -> VariantResult | None:
        return next((v for v in self.variants if not v.removed), None)

    @property
    def single_removals(self) -> list[VariantResult]:
        """The variants without one layer each, by that layer."""
        return sorted((v for v in self.variants if len(v.removed) == 1), key=lambda v: v.removed[0])

    def drop(self, v: VariantResult) -> tuple[float, float]:
        """(absolute, relative) worsening against the baseline: positive means worse."""
        base = self.baseline
        if base is None:
            return float("nan"), float("nan")
        b, x = base.metrics[self.metric], v.metrics[self.metric]
        worse = b - x if self.higher_is_better else x - b
        return worse, (worse / abs(b) if b else float("nan"))

    def drop_interval(self, v: VariantResult) -> list[float] | None:
        """The drop's 95% interval, paired over the windows both the variant and the baseline scored
        (each window's loss, `details["per_window"]`: a ppl sweep's): Student's t at windows - 1 degrees
        of freedom; None where the windows are not kept (another task, a record from before) or fewer than 2."""
        base = self.baseline
        mine, theirs = (None if r is None else r.details.get("per_window") for r in (v, base))
        if not mine or not theirs or len(mine) != len(theirs) or self.metric != "loss" or v is base:
            return None
        return mean_interval([x - b for x, b in zip(mine, theirs)])

    def capabilities(self, v: VariantResult) -> dict[str, dict]:
        """The capability probes among `v`'s scores, by capability: the share solved over its rungs'
        examples with its Wilson interval (empty where no probe ran)."""
        return capability_scores(v.metrics, per_rung(self.run.get("limit")))

    def to_json(self) -> dict:
        capabilities = {v.label: c for v in self.variants if (c := self.capabilities(v))}
        return {"run": self.run, "metric": self.metric, "higher_is_better": self.higher_is_better, "n_layers": self.n_layers,
                "unit": self.unit, "complete": self.complete, "asked": self.asked, **self.meta, "variants": [asdict(v) for v in self.variants],
                **({"capabilities": capabilities} if capabilities else {})}

    @classmethod
    def from_json(cls, data: dict) -> "Sweep":
        keys = {"run", "metric", "higher_is_better", "n_layers", "variants", "unit", "complete", "asked", "capabilities"}
        return cls(
            run=data["run"],
            metric=data["metric"],
            higher_is_better=data["higher_is_better"],
            n_layers=data["n_layers"],
            variants=[VariantResult(**v) for v in data["variants"]],
            meta={k: v for k, v in data.items() if k not in keys},
            asked=data.get("asked"),
        )


def data_text(run: dict, examples: int | None = None) -> str:
    """What a run's scores rest on, in words, from its record: `16 windows x 512 tokens of wiki`,
    `570 examples of arc_easy, 5-shot` (`examples` of the task, where known)."""
    task = run.get("task", "?")
    if task == "ppl":
        start = "" if run.get("bos") is None else f", each after {run['bos']}"
        return f"{run.get('windows', '?')} windows x {run.get('seq_len', '?')} tokens of {run.get('data', '?')}{start}"
    unit = {"squad": "questions", "repr": "passages"}.get(task, "examples")
    shots = run.get("num_fewshot")
    source = run.get("data", "?") if task in ("squad", "repr") else task
    return f"{examples if examples is not None else 'the'} {unit} of {source}" + (f", {shots}-shot" if shots not in (None, 0, []) else "")


def read_sweep(folder: Path) -> Sweep | None:
    """The sweep saved in a results folder (or at a prune.json path); None when there is none."""
    folder = Path(folder)
    path = folder if folder.suffix == ".json" else folder / RESULTS_JSON
    if not path.is_file():
        return None
    try:
        return Sweep.from_json(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError) as exc:
        raise DepthcurseError(f"{path} is not a depthcurse prune result ({exc}); remove it or choose another --out") from exc


def prune_rows(sweep: Sweep) -> list[dict]:
    """One flat row per variant: the unit removed and which, metrics, drop, relative drop,
    examples, seconds, and the data the scores rest on."""
    rows = []
    metric_names = list(dict.fromkeys(k for v in sweep.variants for k in v.metrics))
    data = sweep.data_text()
    base = sweep.baseline
    suite = sweep.metric == SUITE_METRIC and base is not None and base.metrics.get(SUITE_METRIC)
    paired = base is not None and sweep.metric == "loss" and bool(base.details.get("per_window"))
    for v in sweep.variants:
        drop, rel = sweep.drop(v)
        row = {"unit": sweep.unit, "removed": v.label, "data": data}
        row.update({m: v.metrics.get(m, float("nan")) for m in metric_names})
        if suite:  # a suite's average as the share of the unpruned model's, as the pruning papers report it
            row["retained"] = v.metrics.get(SUITE_METRIC, float("nan")) / base.metrics[SUITE_METRIC]
        for capability, c in sweep.capabilities(v).items():  # the probes by capability, with Wilson's interval over their examples
            row.update({capability: c["score"], f"{capability} 95% low": c["interval"][0], f"{capability} 95% high": c["interval"][1],
                        f"{capability} examples": c["examples"]})
        row.update({"drop": drop, "rel_drop": rel, "examples": v.examples, "seconds": v.seconds})
        if paired:  # a ppl sweep's drop, paired over its windows (none for the baseline itself)
            interval = sweep.drop_interval(v) or [float("nan")] * 2
            row.update({"drop 95% low": interval[0], "drop 95% high": interval[1]})
        rows.append(row)
    return rows


def write_sweep(sweep: Sweep, out_dir: Path) -> None:
    """prune.csv (one row per variant) and prune.json (everything), each written atomically."""
    atomic_write(out_dir / RESULTS_CSV, csv_text(prune_rows(sweep), digits=6, empty_header=["unit", "removed", "data"]))
    atomic_write(out_dir / RESULTS_JSON, json_text(sweep.to_json()))
