"""The prompts speculative decoding is measured on: a suite of task kinds, offline, or a file.

Spec-Bench (Xia et al., 2024; hemingkx/Spec-Bench) compares drafts on the same prompts of several
kinds, because how often a draft is right depends on what is being written: code and retrieval-like
text repeat their context, dialogue and prose do not. Its kinds need the hub (MT-Bench, CNN/DM, GSM8K,
Natural Questions); these are the nearest offline ones, each prompt the opening of a document the
model is asked to go on with:
- `dialogue`: a CoQA conversation's first three question-and-answer turns and its fourth question,
  ending "A:" (Spec-Bench's multi-turn conversation);
- `code`: a HumanEval problem's signature and docstring (the model writes the function);
- `math`: a MATH competition problem, ending "Solution:" (Spec-Bench's mathematical reasoning);
- `summary`: the opening of an offline Wikipedia article as "Article: ...", ending "Summary:"
  (Spec-Bench's summarisation, Draft & Verify's CNN/DM and XSum prompt).
Documents are taken evenly spaced through each source, the same ones on every machine. A file
(`--prompts FILE`: .jsonl with a "text" field, each prompt exactly as written; or .txt, prompts
separated by blank lines, each trimmed of its leading and trailing newlines, which that format
cannot hold) gives its own prompts, of kind "file".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from depthcurse.errors import DepthcurseError
from depthcurse.text import load_texts

KINDS = ("dialogue", "code", "math", "summary")
TRIMS = (".txt",)  # prompt files whose format trims each prompt's leading and trailing newlines (blank lines part them)
SUMMARY_WORDS = 160  # of the article's opening: a prompt of about 200-250 tokens


@dataclass(frozen=True)
class Prompt:
    kind: str
    text: str
    source: str  # where it comes from: the offline text and the document's index, or the file


def _dialogue(text: str) -> str | None:
    turns = re.findall(r"Q: (.*?)\nA: (.*?)(?:\n|$)", text)
    if len(turns) < 4:
        return None
    return "".join(f"Q: {q}\nA: {a}\n" for q, a in turns[:3]) + f"Q: {turns[3][0]}\nA:"


_DOCSTRING = re.compile(r'(?s)^(.*?def [^\n]*:\n[ \t]+""".*?""")\n')


def _code(text: str) -> str | None:
    # a HumanEval prompt ends with its function's docstring; MBPP's solutions have none
    found = _DOCSTRING.match(text)
    return found.group(1).lstrip("\n") + "\n" if found else None


def _math(text: str) -> str | None:
    cut = text.find("\nSolution:\n")
    return text[: cut + len("\nSolution:\n")] if cut >= 0 else None


def _summary(text: str) -> str | None:
    words = text.split()
    if len(words) < SUMMARY_WORDS:
        return None
    return "Article: " + " ".join(words[:SUMMARY_WORDS]) + "\nSummary:"


MAKERS = {"dialogue": ("dialogue", _dialogue), "code": ("code", _code), "math": ("math", _math), "summary": ("wiki", _summary)}


def suite(per_kind: int, kinds: tuple[str, ...] = KINDS) -> list[Prompt]:
    """`per_kind` prompts of each kind, from documents evenly spaced through its source."""
    unknown = [k for k in kinds if k not in MAKERS]
    if unknown:
        raise DepthcurseError(f"--kinds {','.join(kinds)}: {unknown[0]!r} is not a kind of the suite ({', '.join(KINDS)})")
    if per_kind < 1:
        raise DepthcurseError(f"--per-kind must be at least 1, got {per_kind}")
    out = []
    for kind in kinds:
        source, make = MAKERS[kind]
        texts, label = load_texts(source, option="--prompts")
        made = [(i, p) for i, p in ((i, make(t)) for i, t in enumerate(texts)) if p]
        if len(made) < per_kind:
            raise DepthcurseError(f"the {kind} prompts: {label} gives {len(made)}, fewer than --per-kind {per_kind}")
        step = len(made) / per_kind
        out += [Prompt(kind, made[int(j * step)][1], f"{label}#{made[int(j * step)][0]}") for j in range(per_kind)]
    return out


def from_file(path: str) -> list[Prompt]:
    """A file's prompts: a .jsonl's (or .json's, .parquet's) exactly as written, a chat prompt's closing
    newline kept; a .txt's between blank lines, whose format cannot hold a prompt's leading or trailing
    newlines, so they are trimmed (`TRIMS`). A text source's name (wiki, c4, ...) gives its documents,
    each whole, as `load_texts` reads them."""
    found = Path(path).expanduser()
    texts, label = load_texts(str(found), option="--prompts")
    trimmed = found.suffix in TRIMS
    return [Prompt("file", text.strip("\n") if trimmed else text, f"{label}#{i}") for i, text in enumerate(texts)]


def load_prompts(prompts: str, per_kind: int, kinds: tuple[str, ...] = KINDS) -> list[Prompt]:
    """`suite` for "suite", else the prompts of the file `prompts` names."""
    return suite(per_kind, kinds) if prompts == "suite" else from_file(prompts)
