"""Training data for `lns-train`: rows of token ids in a deterministic, resumable order.

Two sources:
- C4 `en` streamed from the hub (the papers' setup), shuffled with a seeded buffer;
- a fixed list of documents (the offline Wikipedia text, or a local file) held in memory,
  with a fixed held-out split for validation and a seeded permutation per epoch.

A row is `seq_len` token ids plus its real length. Either one document per row, truncated and
padded (the papers' choice), or documents joined with EOS and cut into full rows (`pack`).
The loss never sees padding: `targets` marks it -100.

Every stream takes `rank` and `world_size` and yields only its own share, so data-parallel
training can shard it without changes here.
"""

from __future__ import annotations

import collections
import itertools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from depthcurse import assets
from depthcurse.errors import DepthcurseError, first_line
from depthcurse.text import TEXT_SOURCES, load_texts
from depthcurse.runtime import World

log = logging.getLogger("depthcurse")

C4_REPO = "allenai/c4"
DEFAULT_TOKENIZERS = {"c4": "t5-base"}  # the papers' tokenizer; offline text uses SmolLM2's
OFFLINE_TOKENIZER = "smollm2-135m"
VAL_FRACTION = 0.05  # share of local documents held out for validation
VAL_SPLIT_SEED = 0  # fixed, so runs with different seeds are validated on the same text


def load_tokenizer(name: str | None, data: str):
    """`name` (hub id, local folder or offline alias); None picks t5-base for C4 and the
    SmolLM2 tokenizer (available offline) for anything else."""
    from transformers import AutoTokenizer  # lazy: only building a run's tokenizer needs transformers

    name = name or DEFAULT_TOKENIZERS.get(data, OFFLINE_TOKENIZER)
    if name.startswith("bpe:"):
        raise DepthcurseError("a bpe:N tokenizer is trained per run: use depthcurse.train.data.bpe_tokenizer")
    source = assets.resolve_model(name)
    try:
        tok = AutoTokenizer.from_pretrained(source, local_files_only=not assets.hub_reachable())
    except (OSError, ValueError) as exc:
        raise DepthcurseError(f"cannot load tokenizer {name!r}: {first_line(exc)} "
                              f"(offline, use --tokenizer {OFFLINE_TOKENIZER})") from exc
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # padding is masked out of the loss, so any id will do
    return tok


def bpe_tokenizer(data: str, vocab_size: int, folder):
    """A byte-level BPE tokenizer trained on the TRAINING documents of `data` (never the held-out
    ones), saved in `folder` and reloaded from there on resume. On a CPU a 49k-token head costs
    more than a small model's whole stack; a 4k vocabulary makes the tiny runs 2-3x faster."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # lazy: as in load_tokenizer

    folder = Path(folder)
    if (folder / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(folder)
    if data == "c4":
        raise DepthcurseError("--tokenizer bpe:N trains on local documents: use it with --data wiki or a file")
    if not 256 < vocab_size <= 1_000_000:
        raise DepthcurseError(f"--tokenizer bpe:{vocab_size}: the vocabulary must be larger than 256 (the bytes)")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # lazy: only bpe:N trains one

    train_texts, _ = _split_docs(load_texts(data)[0])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(train_texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(folder)
    return fast


def require_source(data: str) -> None:
    """C4 streams from the hub; a local file must exist; every other named source (`text.TEXT_SOURCES`:
    wiki, code, math, dialogue) is offline, as select's --calibration reads them. Said before the
    tokenizer is fetched."""
    if data == "c4" and not assets.hub_reachable():
        raise DepthcurseError("C4 is streamed from the hub, which is not reachable: use --data wiki or --data PATH")
    if data not in TEXT_SOURCES and not Path(data).expanduser().exists():
        raise DepthcurseError(f"no such data file: {data} (or use one of {', '.join(s for s in TEXT_SOURCES if s != 'auto')})")


def run_tokenizer(name: str | None, data: str, folder: Path, world: World = World()):
    """The tokenizer of a run: a named one (`load_tokenizer`), or with `bpe:N` one trained on the
    run's data and kept in `folder`, trained by rank 0 alone and loaded by the other ranks."""
    if not (name and name.startswith("bpe:")):
        return load_tokenizer(name, data)
    try:
        vocab = int(name.removeprefix("bpe:"))
    except ValueError:
        raise DepthcurseError(f"--tokenizer {name}: write bpe:N with N the vocabulary size, e.g. bpe:4096") from None
    if world.main:
        tokenizer = bpe_tokenizer(data, vocab, folder)
    world.barrier()
    if not world.main:
        tokenizer = bpe_tokenizer(data, vocab, folder)
    return tokenizer


def targets_for(rows: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Next-token targets: position t predicts token t+1 of the same row; -100 where there is none."""
    targets = torch.full_like(rows, -100)
    targets[:, :-1] = rows[:, 1:]
    positions = torch.arange(rows.shape[1], device=rows.device)
    targets[positions[None, :] + 1 >= lengths[:, None]] = -100
    return targets


def make_rows(docs_ids: list[list[int]], seq_len: int, pad_id: int, eos_id: int | None, pack: bool, start: list[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [N, seq_len], lengths [N]) from tokenised documents.

    Packed, the documents are joined with EOS and cut into rows; each row begins with `start`
    (a pretrained model's BOS, `text.start_tokens`: every sequence it saw began so) and then
    `seq_len` minus those tokens of the stream. Pre-training from scratch packs with no `start`.
    """
    if pack:
        stream: list[int] = []
        for ids in docs_ids:
            stream.extend(ids)
            if eos_id is not None:
                stream.append(eos_id)
        body = seq_len - len(start)
        n = len(stream) // body
        rows = torch.tensor(stream[: n * body], dtype=torch.long).view(n, body)
        if start:
            rows = torch.cat([torch.tensor(list(start), dtype=torch.long).expand(n, -1), rows], dim=1)
        return rows, torch.full((n,), seq_len, dtype=torch.long)
    kept = [ids[:seq_len] for ids in docs_ids if len(ids) >= 2]  # a 1-token row has nothing to predict
    rows = torch.full((len(kept), seq_len), pad_id, dtype=torch.long)
    for i, ids in enumerate(kept):
        rows[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return rows, torch.tensor([len(ids) for ids in kept], dtype=torch.long)


# Documents per tokenizer call: a fast tokenizer spreads one call over the cores, without the
# GIL, where one call per document runs on one core (the ids are the same either way).
TOKENISE_DOCS = 64


def tokenise(tokenizer, texts: list[str], pack: bool) -> list[list[int]]:
    # One document per row follows the papers' `tokenizer(text, truncation=True, padding=...)`,
    # special tokens included; packed documents are joined with EOS instead.
    chunks = (texts[i : i + TOKENISE_DOCS] for i in range(0, len(texts), TOKENISE_DOCS))
    return [ids for chunk in chunks for ids in tokenizer(chunk, add_special_tokens=not pack)["input_ids"]]


@dataclass
class Batch:
    input_ids: torch.Tensor
    targets: torch.Tensor

    @property
    def tokens(self) -> int:
        """Tokens the loss is computed on."""
        return int((self.targets != -100).sum())


class LocalRows:
    """Rows of an in-memory document list, in a seeded order that is the same on every run.

    State is (epoch, position in the epoch): resuming re-derives the permutation and jumps to
    the position, so no data is repeated or skipped.
    """

    def __init__(self, rows: torch.Tensor, lengths: torch.Tensor, seed: int, rank: int = 0, world_size: int = 1):
        self.rows, self.lengths = rows, lengths
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.epoch, self.pos = 0, 0
        if len(self._order()) == 0:
            raise DepthcurseError("no training rows for this rank: more data or fewer ranks needed")

    def _order(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 100003 + self.epoch)
        return torch.randperm(len(self.rows), generator=g)[self.rank :: self.world_size]

    def next_batch(self, n: int) -> Batch:
        picked, count = [], 0
        order = self._order()
        while count < n:
            if self.pos >= len(order):
                self.epoch, self.pos = self.epoch + 1, 0
                order = self._order()
            take = order[self.pos : self.pos + n - count]
            picked.append(take)
            count += len(take)
            self.pos += len(take)
        idx = torch.cat(picked)
        return Batch(self.rows[idx], targets_for(self.rows[idx], self.lengths[idx]))

    def state_dict(self) -> dict:
        return {"kind": "local", "epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])


class C4Rows:
    """C4 `en` train, streamed from the hub and shuffled with a seeded buffer.

    Documents are tokenised `TOKENISE_DOCS` per call: one call per document took the host 0.53 s
    per 512-row step of the 130M preset on 2 cores, longer than the step on an H100, and 64 per
    call 0.27 s (docs/benchmarks.md). The rows are those of tokenising each document in turn:
    tokenised documents not yet in a row are kept (`pending`), and saved with the stream's position.

    Resuming restores the stream's position with `datasets`' own state_dict; the shuffle
    buffer is refilled from there (documented datasets behaviour), so the order after a resume
    is close to, not identical with, an uninterrupted run.
    """

    def __init__(self, tokenizer, seq_len: int, pack: bool, seed: int, rank: int = 0, world_size: int = 1, buffer: int = 10_000, start: list[int] = ()):
        import datasets  # lazy: as in build_data
        from datasets.distributed import split_dataset_by_node

        ds = datasets.load_dataset(C4_REPO, "en", split="train", streaming=True).shuffle(seed=seed, buffer_size=buffer)
        self.ds = split_dataset_by_node(ds, rank=rank, world_size=world_size)
        self.tokenizer, self.seq_len, self.pack, self.start = tokenizer, seq_len, pack, list(start)
        self._iter = None
        self._pending: collections.deque[list[int]] = collections.deque()  # tokenised documents not yet in a row
        self._carry: list[int] = []  # packed tokens not yet in a row

    def _tokenise_more(self) -> None:
        if self._iter is None:
            self._iter = iter(self.ds)
        ids = _tokenise_next(self._iter, self.tokenizer, self.pack)
        if not ids:
            raise DepthcurseError("the C4 stream ran out of documents")
        # one document per row keeps only its first seq_len tokens: no more of it waits in the checkpoint
        self._pending.extend(ids if self.pack else (x[: self.seq_len] for x in ids))

    def next_batch(self, n: int) -> Batch:
        tok = self.tokenizer
        ids_list: list[list[int]] = []
        while len(ids_list) < n:
            if not self._pending:
                self._tokenise_more()
            ids = self._pending.popleft()
            if self.pack:
                self._carry.extend(ids + ([tok.eos_token_id] if tok.eos_token_id is not None else []))
                body = self.seq_len - len(self.start)
                while len(self._carry) >= body and len(ids_list) < n:
                    ids_list.append(self.start + self._carry[:body])
                    self._carry = self._carry[body:]
            elif len(ids) >= 2:
                ids_list.append(ids)
        rows, lengths = make_rows(ids_list, self.seq_len, tok.pad_token_id, None, pack=False)
        return Batch(rows, targets_for(rows, lengths))

    def state_dict(self) -> dict:
        return {"kind": "c4", "stream": self.ds.state_dict(), "carry": list(self._carry), "pending": [list(ids) for ids in self._pending]}

    def load_state_dict(self, state: dict) -> None:
        self.ds.load_state_dict(state["stream"])
        self._carry = list(state["carry"])
        self._pending = collections.deque(state.get("pending", []))  # absent: saved before documents were tokenised ahead
        self._iter = None


def _tokenise_next(docs, tokenizer, pack: bool) -> list[list[int]]:
    """The token ids of the stream's next `TOKENISE_DOCS` documents (fewer at its end), in one call."""
    return tokenise(tokenizer, [doc["text"] for doc in itertools.islice(docs, TOKENISE_DOCS)], pack)


def _split_docs(texts: list[str]) -> tuple[list[str], list[str]]:
    if len(texts) < 2:
        raise DepthcurseError("the training text needs at least 2 documents: one is held out for validation")
    g = torch.Generator().manual_seed(VAL_SPLIT_SEED)
    order = torch.randperm(len(texts), generator=g).tolist()
    n_val = max(1, round(VAL_FRACTION * len(texts)))
    return [texts[i] for i in order[n_val:]], [texts[i] for i in order[:n_val]]


def _take_budget(rows: torch.Tensor, lengths: torch.Tensor, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first rows whose target tokens (length - 1 each) add up to at least `budget`."""
    counted = (lengths - 1).clamp(min=0).cumsum(0)
    n = int((counted < budget).sum()) + 1
    return rows[:n], lengths[:n]


@dataclass
class TrainData:
    train: LocalRows | C4Rows
    val_rows: torch.Tensor
    val_lengths: torch.Tensor
    label: str
    tokenizer: object

    def val_batches(self, batch_size: int):
        for start in range(0, len(self.val_rows), batch_size):
            rows, lengths = self.val_rows[start : start + batch_size], self.val_lengths[start : start + batch_size]
            yield Batch(rows, targets_for(rows, lengths))

    @property
    def val_tokens(self) -> int:
        return int((self.val_lengths - 1).clamp(min=0).sum())


def build_data(data: str, tokenizer, *, seq_len: int, pack: bool, seed: int, val_tokens: int, rank: int = 0, world_size: int = 1,
               warn_short: bool = True, start: list[int] = (), pack_optional: bool = True) -> TrainData:
    """Training stream and validation rows for `data`: c4, wiki, or a local text file.

    `val_tokens` is a budget: held-out text shorter than it is used whole, with a warning when
    `warn_short` (the user asked for that many; a preset's default only caps). Packed rows begin
    with `start` (see `make_rows`); the held-out rows are then the windows `prune --task ppl`
    scores, cut from held-out documents. `pack_optional`: the caller has a --pack to leave out
    (lns-train; heal always packs), which an error may then advise.
    """
    if pack and seq_len < len(start) + 2:
        raise DepthcurseError(f"--seq-len must be at least {len(start) + 2}")
    if seq_len < 2:
        raise DepthcurseError("--seq-len must be at least 2")
    if val_tokens < 1:
        raise DepthcurseError("--val-tokens must be at least 1")
    require_source(data)
    if data == "c4":
        import datasets  # lazy: only C4 streams through datasets (1 s to import)

        try:
            train = C4Rows(tokenizer, seq_len, pack, seed, rank, world_size, start=start)
            val_stream = datasets.load_dataset(C4_REPO, "en", split="validation", streaming=True)
        except Exception as exc:  # network and hub errors come in many types
            raise DepthcurseError(f"cannot stream C4 from the hub: {exc}") from exc
        val_ids: list[list[int]] = []
        seen, docs = 0, iter(val_stream)
        while seen < val_tokens and (chunk := _tokenise_next(docs, tokenizer, pack)):
            for ids in chunk:
                val_ids.append(ids)
                seen += min(len(ids), seq_len) - 1 if not pack else len(ids)
                if seen >= val_tokens:
                    break
        vr, vl = make_rows(val_ids, seq_len, tokenizer.pad_token_id, tokenizer.eos_token_id, pack, start)
        vr, vl = _take_budget(vr, vl, val_tokens)
        return TrainData(train, vr, vl, "c4-en", tokenizer)

    texts, label = load_texts(data)
    train_texts, val_texts = _split_docs(texts)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    rows, lengths = make_rows(tokenise(tokenizer, train_texts, pack), seq_len, pad, eos, pack, start)
    if len(rows) == 0:
        advice = "use more text, a shorter --seq-len, or no --pack" if pack and pack_optional else "use more text or a shorter --seq-len"
        raise DepthcurseError(f"{label} gives no training rows of {seq_len} tokens: {advice}")
    vr, vl = make_rows(tokenise(tokenizer, val_texts, pack), seq_len, pad, eos, pack, start)
    if len(vr) == 0:
        raise DepthcurseError(f"the held-out part of {label} gives no validation rows of {seq_len} tokens: use more text or a shorter --seq-len")
    vr, vl = _take_budget(vr, vl, val_tokens)
    if warn_short and int((vl - 1).sum()) < val_tokens:
        log.warning("held-out %s has only %d tokens (asked for --val-tokens %d): using all of them", label, int((vl - 1).sum()), val_tokens)
    return TrainData(LocalRows(rows, lengths, seed, rank, world_size), vr, vl, label, tokenizer)
