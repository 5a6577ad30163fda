"""Plain text for perplexity and representation measurements: C4, the offline Wikipedia, offline
code, mathematics or dialogue (`assets.kinds`), or a file.

`load_texts` returns documents (strings); tokenising and windowing belong to whoever measures,
who puts `start_tokens` (the model's BOS) first where the model expects it.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from depthcurse import assets
from depthcurse.assets.kinds import KINDS, kind_texts
from depthcurse.errors import DepthcurseError

C4_REPO = "allenai/c4"
# The first validation shard (about 45k documents) is more text than any measurement here uses.
C4_VALIDATION_FILE = "en/c4-validation.00000-of-00008.json.gz"

TEXT_SOURCES = ("auto", "c4", "wiki", *KINDS)


def text_source(data: str) -> str:
    """`auto` as what it means here: C4 where the hub is reachable, the offline Wikipedia text otherwise."""
    if data == "auto":
        return "c4" if assets.hub_reachable() else "wiki"
    return data


def text_kind(data: str) -> str:
    """What sort of text a source is, as a finding must say: prose, code, mathematics, dialogue, or a file's."""
    data = text_source(data)
    if data in KINDS:
        return KINDS[data].kind
    return {"c4": "prose (web)", "wiki": "prose (encyclopedic)"}.get(data, "a file")


def load_texts(data: str = "auto", option: str = "--data") -> tuple[list[str], str]:
    """Documents for `data` and a short label for the results files.

    `auto` is C4 validation where the hub is reachable and the offline Wikipedia text otherwise;
    `code`, `math` and `dialogue` are offline texts of those kinds (`assets.kinds`). Anything that
    is not a source name is read as a local .txt, .jsonl/.json or .parquet file. `option` is the
    command-line option that named `data`, for the one-line errors.
    """
    data = text_source(data)
    if data == "c4":
        return _c4_validation(option), "c4-validation"
    if data == "wiki":
        return [t for t in assets.wiki_texts() if t.strip()], "wiki"
    if data in KINDS:
        return kind_texts(data), data
    path = Path(data).expanduser()
    if not path.exists():
        raise DepthcurseError(f"{option} {data}: no such data file (or use one of: {', '.join(TEXT_SOURCES)})")
    if path.is_dir():
        raise DepthcurseError(f"{option} {path} is a folder: give a .txt, .jsonl, .json or .parquet file")
    texts = _read_file(path)
    wrong = next(((i, t) for i, t in enumerate(texts) if not isinstance(t, str)), None)
    if wrong is not None:
        i, value = wrong
        raise DepthcurseError(f"{path}: record {i + 1} holds {type(value).__name__} {str(value)[:40]!r} where its text should be")
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise DepthcurseError(f"{path} holds no text")
    return texts, str(path)


def start_tokens(tokenizer) -> list[int]:
    """The ids a tokenizer puts before a text's own: BOS where it adds one (Llama, Gemma, Mistral),
    none where it adds none (GPT-2, SmolLM2). It is what began every sequence the model was
    trained on, so a window of text should begin with it too."""
    probe = "The"
    plain = tokenizer(probe, add_special_tokens=False)["input_ids"]
    full = tokenizer(probe)["input_ids"]
    at = next((i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), 0)
    return list(full[:at])


def start_text(tokenizer, ids: list[int]) -> str | None:
    """`start_tokens` as text for a results file (`<s>`), None for none."""
    return "".join(tokenizer.convert_ids_to_tokens(ids)) if ids else None


def _c4_validation(option: str = "--data") -> list[str]:
    if not assets.hub_reachable():
        raise DepthcurseError(f"{option} c4: C4 comes from the hub, which is not reachable: use {option} wiki (or code, math, dialogue, a file)")
    import datasets  # lazy: only C4 needs datasets (1 s to import)

    try:
        ds = datasets.load_dataset(C4_REPO, data_files={"validation": C4_VALIDATION_FILE}, split="validation")
    except Exception as exc:  # network and hub errors come in many types
        raise DepthcurseError(f"cannot load C4 validation from the hub: {exc}") from exc
    return list(ds["text"])


def _read_file(path: Path) -> list[str]:
    suffix = "".join(path.suffixes[-2:]) if path.suffix == ".gz" else path.suffix
    try:
        if suffix in {".txt", ".md"}:
            # Blank lines separate documents, as in most plain-text corpora.
            return [block for block in path.read_text(encoding="utf-8").split("\n\n")]
        if suffix in {".jsonl", ".jsonl.gz", ".json"}:
            return _read_json_lines(path)
        if suffix == ".parquet":
            import pandas as pd  # lazy: only .parquet files need pandas

            frame = pd.read_parquet(path)
            if "text" not in frame.columns:
                raise DepthcurseError(f"{path} has no 'text' column (columns: {', '.join(map(str, frame.columns))})")
            return frame["text"].tolist()
    except DepthcurseError:
        raise
    except UnicodeDecodeError as exc:
        raise DepthcurseError(f"{path} is not UTF-8 text: {exc.reason}") from exc
    except Exception as exc:  # pyarrow / gzip / json raise many kinds for a corrupt file
        raise DepthcurseError(f"cannot read {path}: it looks corrupt ({type(exc).__name__}: {exc})") from exc
    raise DepthcurseError(f"unsupported data file type {suffix!r}: use .txt, .jsonl, .json or .parquet")


def _read_json_lines(path: Path) -> list[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        raw = fh.read()
    if path.suffix == ".json" and raw.lstrip().startswith("["):
        rows = enumerate(json.loads(raw), 1)
        where = "record"
    else:
        rows, where = [], "line"
        for number, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append((number, json.loads(line)))
            except json.JSONDecodeError as exc:  # its own "line 1" is the line's, not the file's
                raise DepthcurseError(f"{path}: line {number} is not JSON ({exc.msg} at column {exc.colno})") from exc
    texts = []
    for number, row in rows:
        if not isinstance(row, dict) or "text" not in row:
            raise DepthcurseError(f"{path}: {where} {number} has no 'text' field")
        texts.append(row["text"])
    return texts
