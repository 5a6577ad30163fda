"""Extractive question answering on SQuAD v1.1: data, windows, answer extraction, official scoring.

The pipeline is the standard one for BERT-style QA models (Hugging Face's run_qa example):

1. each (question, context) pair is tokenised as ``[CLS] question [SEP] context [SEP]``; a
   context longer than ``max_length`` (384) tokens is cut into several windows that overlap by
   ``stride`` (128) tokens, so every answer lies whole inside at least one window;
2. the model gives a start and an end logit per token;
3. per question, the ``n_best`` (20) highest start and end positions of EVERY window are paired;
   a pair is a candidate when both tokens are context tokens, end >= start, and the span is at
   most ``max_answer_length`` (30) tokens; the candidate with the highest start + end logit wins,
   and its text is cut from the context by the tokens' character offsets;
4. the official v1.1 script scores it: exact match and token F1 after normalisation (lowercase,
   no punctuation, no articles a/an/the, single spaces), best over the gold answers, in percent.

Where the data comes from: the hub's SQuAD v1.1 validation split (10,570 questions) where the hub
is reachable, the 1,000-question offline copy (`depthcurse assets`) otherwise, or a local file.
"""

from __future__ import annotations

import json
import re
import string
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from depthcurse import assets
from depthcurse.errors import DepthcurseError
from depthcurse.tasks.base import Score

HUB_DATASET = "rajpurkar/squad"
SQUAD_SOURCES = ("auto", "hub", "offline")
#: written by `depthcurse finetune-qa` into the checkpoint folder: which rows it trained on
TRAINING_RECORD = "depthcurse_qa.json"

# --------------------------------------------------------------------------- official v1.1 scoring
# A faithful transcription of evaluate-v1.1.py (https://rajpurkar.github.io/SQuAD-explorer/).
# Note the order: lowercase, punctuation, articles, whitespace. ASCII punctuation only (v1.1
# keeps e.g. the en dash and curly quotes, unlike MLQA's unicode-aware variant).

_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match_score(prediction: str, truth: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(truth))


def f1_score(prediction: str, truth: str) -> float:
    pred_tokens = normalize_answer(prediction).split()
    truth_tokens = normalize_answer(truth).split()
    same = sum((Counter(pred_tokens) & Counter(truth_tokens)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_tokens), same / len(truth_tokens)
    return 2 * precision * recall / (precision + recall)


def score_predictions(examples: list[dict], predictions: dict[str, str]) -> dict[str, float]:
    """{"exact_match", "f1"} in percent over `examples`; a question without a prediction scores 0."""
    if not examples:
        raise DepthcurseError("no SQuAD questions to score")
    em = f1 = 0.0
    for ex in examples:
        if ex["id"] not in predictions:
            continue
        pred, truths = predictions[ex["id"]], ex["answers"]["text"]
        em += max(exact_match_score(pred, t) for t in truths)
        f1 += max(f1_score(pred, t) for t in truths)
    return {"exact_match": 100.0 * em / len(examples), "f1": 100.0 * f1 / len(examples)}


# --------------------------------------------------------------------------- data


def load_squad(data: str = "auto", split: str = "validation") -> tuple[list[dict], str]:
    """SQuAD rows {id, title, context, question, answers: {text, answer_start}} and a label.

    `data`: auto (the hub where reachable, else the offline copy), hub, offline, or a local
    file: the official nested .json (``{"data": [{"paragraphs": [{"context", "qas"}]}]}``) or
    .jsonl / .json list with one flat row per question. The offline copy holds the 1,000-row
    validation split only.
    """
    if data == "auto":
        data = "hub" if assets.hub_reachable() else "offline"
    if data == "hub":
        rows = _hub_rows(split)
        label = f"{HUB_DATASET}:{split}"
    elif data == "offline":
        if split != "validation":
            raise DepthcurseError(f"the offline SQuAD copy has the validation split only, not {split!r}")
        path = assets.squad_dev_path()
        rows = _read_file(path)
        label = "squad-offline:validation"
    else:
        path = Path(data).expanduser()
        if not path.is_file():
            raise DepthcurseError(f"no such SQuAD file: {data} (or use one of: {', '.join(SQUAD_SOURCES)})")
        rows = _read_file(path)
        label = str(path)
    if not rows:
        raise DepthcurseError(f"{label} holds no SQuAD questions")
    return rows, label


def _hub_rows(split: str) -> list[dict]:
    if not assets.hub_reachable():
        raise DepthcurseError("the hub is not reachable: use --data offline (1,000 dev questions) or a local SQuAD file")
    import datasets  # lazy: only the hub's copy needs datasets (1 s to import)

    try:
        ds = datasets.load_dataset(HUB_DATASET, split=split)
    except Exception as exc:  # network and hub errors come in many types
        raise DepthcurseError(f"cannot load {HUB_DATASET} {split} from the hub: {exc}") from exc
    return [_check_row(dict(row), i, HUB_DATASET) for i, row in enumerate(ds)]


def _read_file(path: Path) -> list[dict]:
    try:
        raw = path.read_text(encoding="utf-8")
        if path.suffix == ".jsonl":
            records = [json.loads(line) for line in raw.splitlines() if line.strip()]
        elif path.suffix == ".json":
            records = json.loads(raw)
        else:
            raise DepthcurseError(f"unsupported SQuAD file type {path.suffix!r}: use the official .json or a .jsonl with one question per line")
    except DepthcurseError:
        raise
    except (ValueError, UnicodeDecodeError) as exc:
        raise DepthcurseError(f"cannot read {path}: it looks corrupt ({type(exc).__name__}: {exc})") from exc
    if isinstance(records, dict) and "data" in records:  # the official nested layout
        flat = []
        for article in records["data"]:
            for para in article.get("paragraphs", []):
                for qa in para.get("qas", []):
                    answers = qa.get("answers", [])
                    flat.append({"id": qa.get("id"), "title": article.get("title", ""), "context": para.get("context"), "question": qa.get("question"),
                                 "answers": {"text": [a.get("text") for a in answers], "answer_start": [a.get("answer_start") for a in answers]}})
        records = flat
    if not isinstance(records, list):
        raise DepthcurseError(f"{path} is neither the official SQuAD layout nor a list of questions")
    return [_check_row(r, i, str(path)) for i, r in enumerate(records)]


def _check_row(row, i: int, where: str) -> dict:
    if not isinstance(row, dict):
        raise DepthcurseError(f"{where}: record {i + 1} is not an object")
    missing = [k for k in ("id", "context", "question", "answers") if not row.get(k)]
    if missing:
        raise DepthcurseError(f"{where}: record {i + 1} lacks {', '.join(missing)}")
    answers = row["answers"]
    if not isinstance(answers, dict) or not answers.get("text") or len(answers["text"]) != len(answers.get("answer_start") or []):
        raise DepthcurseError(f"{where}: record {i + 1} ({row['id']}) needs answers {{text: [...], answer_start: [...]}} of equal, non-zero length")
    return {"id": str(row["id"]), "title": row.get("title", ""), "context": row["context"], "question": row["question"],
            "answers": {"text": list(answers["text"]), "answer_start": [int(s) for s in answers["answer_start"]]}}


def training_record(model_source: str | Path | None) -> dict | None:
    """The finetune-qa record of a checkpoint folder (which rows it was trained on), if any."""
    if model_source is None:
        return None
    path = Path(model_source) / TRAINING_RECORD
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise DepthcurseError(f"{path} is corrupt ({exc}); delete it or re-run finetune-qa") from exc


# --------------------------------------------------------------------------- windows


@dataclass
class Features:
    """Tokenised windows. `offsets[i][t]` is the (start, end) character span of token t in the
    context, or None for question and special tokens; `example[i]` is the row window i came from."""

    input_ids: list[list[int]]
    token_type_ids: list[list[int]] | None
    offsets: list[list[tuple[int, int] | None]]
    example: list[int]
    start_positions: list[int] | None = None  # training labels (CLS index when the answer is not in the window)
    end_positions: list[int] | None = None

    def __len__(self) -> int:
        return len(self.input_ids)


def prepare_features(tokenizer, examples: list[dict], *, max_length: int = 384, stride: int = 128, labels: bool = False) -> Features:
    """Cut every (question, context) into windows of `max_length` tokens overlapping by `stride`."""
    if not getattr(tokenizer, "is_fast", False):
        raise DepthcurseError("SQuAD needs a fast (Rust) tokenizer for character offsets; this model's tokenizer is a slow one")
    if not 0 <= stride < max_length:
        raise DepthcurseError(f"the window overlap ({stride}) must be smaller than the window ({max_length})")
    question_first = tokenizer.padding_side == "right"
    # Leading spaces in questions (they exist in SQuAD) waste window room and confuse some tokenizers.
    questions = [ex["question"].lstrip() for ex in examples]
    contexts = [ex["context"] for ex in examples]
    try:
        enc = tokenizer(
            questions if question_first else contexts,
            contexts if question_first else questions,
            truncation="only_second" if question_first else "only_first",
            max_length=max_length,
            stride=stride,
            return_overflowing_tokens=True,
            return_offsets_mapping=True,
            padding=False,
        )
    except Exception as exc:  # the tokenizer refuses a question that leaves no room for the context
        raise DepthcurseError(f"cannot cut SQuAD into windows of {max_length} tokens with overlap {stride}: {exc}") from exc
    context_seq = 1 if question_first else 0
    feats = Features(list(enc["input_ids"]), list(enc["token_type_ids"]) if "token_type_ids" in enc else None, [], list(enc["overflow_to_sample_mapping"]))
    if labels:
        feats.start_positions, feats.end_positions = [], []
    for i in range(len(feats.input_ids)):
        seq_ids = enc.sequence_ids(i)
        offsets = [tuple(o) if s == context_seq else None for o, s in zip(enc["offset_mapping"][i], seq_ids)]
        feats.offsets.append(offsets)
        if labels:
            start, end = _label(offsets, examples[feats.example[i]], feats.input_ids[i], tokenizer)
            feats.start_positions.append(start)
            feats.end_positions.append(end)
    return feats


def _label(offsets, example, input_ids, tokenizer) -> tuple[int, int]:
    """Token positions of the first gold answer in this window, or the CLS position twice."""
    cls = input_ids.index(tokenizer.cls_token_id) if tokenizer.cls_token_id in input_ids else 0
    start_char = example["answers"]["answer_start"][0]
    end_char = start_char + len(example["answers"]["text"][0])
    ctx = [t for t, o in enumerate(offsets) if o is not None]
    if not ctx or offsets[ctx[0]][0] > start_char or offsets[ctx[-1]][1] < end_char:
        return cls, cls
    start = next(t for t in ctx if offsets[t][1] > start_char)
    end = next(t for t in reversed(ctx) if offsets[t][0] < end_char)
    return start, end


def collate(features: Features, index: list[int], pad_id: int, device) -> dict[str, torch.Tensor]:
    """A padded batch of windows (padding to the longest in the batch, masked out)."""
    width = max(len(features.input_ids[i]) for i in index)
    ids = torch.full((len(index), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(index), width), dtype=torch.long)
    types = torch.zeros((len(index), width), dtype=torch.long) if features.token_type_ids is not None else None
    for row, i in enumerate(index):
        n = len(features.input_ids[i])
        ids[row, :n] = torch.tensor(features.input_ids[i])
        mask[row, :n] = 1
        if types is not None:
            types[row, :n] = torch.tensor(features.token_type_ids[i])
    batch = {"input_ids": ids.to(device), "attention_mask": mask.to(device)}
    if types is not None:
        batch["token_type_ids"] = types.to(device)
    return batch


# --------------------------------------------------------------------------- answers


def extract_answers(examples: list[dict], features: Features, start_logits: list[np.ndarray], end_logits: list[np.ndarray], *, n_best: int = 20, max_answer_length: int = 30) -> dict[str, str]:
    """The best-scoring valid span of each question over all its windows, as text (id -> answer)."""
    by_example: dict[int, list[int]] = {}
    for i, ex in enumerate(features.example):
        by_example.setdefault(ex, []).append(i)
    answers = {}
    for ex_index, example in enumerate(examples):
        best_score, best_span = -np.inf, None
        for i in by_example.get(ex_index, []):
            offsets, starts, ends = features.offsets[i], start_logits[i][: len(features.offsets[i])], end_logits[i][: len(features.offsets[i])]
            top_starts = np.argsort(-starts, kind="stable")[:n_best]
            top_ends = np.argsort(-ends, kind="stable")[:n_best]
            for s in top_starts:
                if offsets[s] is None:
                    continue
                for e in top_ends:
                    if offsets[e] is None or e < s or e - s + 1 > max_answer_length:
                        continue
                    score = float(starts[s]) + float(ends[e])
                    if score > best_score:
                        best_score, best_span = score, (offsets[s][0], offsets[e][1])
        answers[example["id"]] = "" if best_span is None else example["context"][best_span[0] : best_span[1]]
    return answers


# --------------------------------------------------------------------------- the task


class SquadTask:
    """SQuAD v1.1 exact match and F1 (percent) of an extractive QA model (AutoModelForQuestionAnswering)."""

    name = "squad"
    metric = "f1"
    higher_is_better = True

    def __init__(self, tokenizer, examples: list[dict], *, source: str, max_length: int = 384, stride: int = 128, n_best: int = 20, max_answer_length: int = 30, batch_size: int = 8, excluded: int = 0):
        if not examples:
            raise DepthcurseError(f"{source}: no SQuAD questions left to evaluate")
        if n_best < 1 or max_answer_length < 1:
            raise DepthcurseError("n-best and the maximum answer length must be at least 1")
        self.examples, self.source, self.excluded = examples, source, excluded
        self.max_length, self.stride, self.n_best, self.max_answer_length = max_length, stride, n_best, max_answer_length
        self.batch_size = max(1, batch_size)
        self.features = prepare_features(tokenizer, examples, max_length=max_length, stride=stride)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.predictions: dict[str, str] = {}  # of the last evaluate(), for inspection

    def describe(self) -> dict:
        return {"task": "squad", "data": self.source, "questions": len(self.examples), "windows": len(self.features),
                "excluded_training_questions": self.excluded, "max_length": self.max_length, "doc_stride": self.stride,
                "n_best": self.n_best, "max_answer_length": self.max_answer_length}

    @torch.inference_mode()
    def logits(self, model: torch.nn.Module) -> tuple[list[np.ndarray], list[np.ndarray]]:
        device = model.get_input_embeddings().weight.device
        starts, ends = [], []
        order = list(range(len(self.features)))
        for b in range(0, len(order), self.batch_size):
            index = order[b : b + self.batch_size]
            out = model(**collate(self.features, index, self.pad_id, device))
            if not hasattr(out, "start_logits"):
                raise DepthcurseError(f"{type(model).__name__} is not an extractive QA model (no start/end logits): SQuAD needs AutoModelForQuestionAnswering")
            s, e = out.start_logits.float().cpu().numpy(), out.end_logits.float().cpu().numpy()
            for row, i in enumerate(index):
                n = len(self.features.input_ids[i])
                starts.append(s[row, :n])
                ends.append(e[row, :n])
        return starts, ends

    def evaluate(self, model: torch.nn.Module) -> Score:
        starts, ends = self.logits(model)
        self.predictions = extract_answers(self.examples, self.features, starts, ends, n_best=self.n_best, max_answer_length=self.max_answer_length)
        metrics = score_predictions(self.examples, self.predictions)
        return Score({"f1": metrics["f1"], "exact_match": metrics["exact_match"]}, len(self.examples), {"windows": len(self.features)})


def build_squad_task(tokenizer, *, data: str = "auto", limit: int | None = None, batch_size: int = 8, model_source: str | None = None, **window) -> SquadTask:
    """The SQuAD task on `data`, minus the questions the model was fine-tuned on (when a
    finetune-qa record sits in its folder), cut to the first `limit` questions."""
    if tokenizer is None:
        raise DepthcurseError("this model has no tokenizer: SQuAD needs one")
    examples, source = load_squad(data)
    record = training_record(model_source)
    excluded = 0
    if record is not None:
        trained = set(record.get("train_ids", []))
        kept = [ex for ex in examples if ex["id"] not in trained]
        excluded = len(examples) - len(kept)
        examples = kept
    if limit is not None:
        examples = examples[:limit]
    return SquadTask(tokenizer, examples, source=source, batch_size=batch_size, excluded=excluded, **window)
