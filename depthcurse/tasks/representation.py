"""How much of the unpruned model's representation a pruned model keeps: a task that needs no head.

Every passage of real text is embedded the way sentence encoders do it (mean of the last hidden
states over the passage's tokens). The task remembers the unpruned model's embeddings when it is
built; a variant's score is the cosine similarity of its embedding to the unpruned one,
averaged over passages. 1.0 means removing the layer changed nothing a user of the embeddings
can see; the lower, the more of the representation is lost. Any encoder (and any decoder) can be
swept this way, with or without a task head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from depthcurse.errors import DepthcurseError
from depthcurse.tasks.base import Score

MIN_WORDS = 8  # shorter lines in prose are headings and list items, not sentences


def passages(texts: list[str], limit: int) -> list[str]:
    """The first `limit` paragraphs of at least MIN_WORDS words, in document order."""
    out = []
    for text in texts:
        for para in text.split("\n"):
            para = " ".join(para.split())
            if len(para.split()) >= MIN_WORDS:
                out.append(para)
                if len(out) == limit:
                    return out
    return out


class RepresentationTask:
    """Mean cosine similarity of mean-pooled embeddings to those of the unpruned model."""

    name = "repr"
    metric = "cos"
    higher_is_better = True

    def __init__(self, tokenizer, model: torch.nn.Module, texts: list[str], *, source: str, seq_len: int = 128, limit: int = 256, batch_size: int = 16):
        if model is None:
            raise DepthcurseError("the repr task compares against the unpruned model: build it with model=...")
        if seq_len < 2:
            raise DepthcurseError("--seq-len must be at least 2")
        paras = passages(texts, limit)
        if not paras:
            raise DepthcurseError(f"{source} holds no paragraph of {MIN_WORDS} or more words")
        max_len = min(seq_len, getattr(tokenizer, "model_max_length", seq_len) or seq_len)
        self.rows = [tokenizer(p, truncation=True, max_length=max_len)["input_ids"] for p in paras]
        self.source, self.seq_len, self.batch_size = source, max_len, max(1, batch_size)
        self.reference = self.embed(model)  # the model is unpruned while the task is built

    def describe(self) -> dict:
        return {"task": "repr", "data": self.source, "passages": len(self.rows), "tokens": sum(map(len, self.rows)), "seq_len": self.seq_len, "pooling": "mean of last hidden states"}

    @torch.inference_mode()
    def embed(self, model: torch.nn.Module) -> torch.Tensor:
        device = model.get_input_embeddings().weight.device
        pooled = []
        for b in range(0, len(self.rows), self.batch_size):
            rows = self.rows[b : b + self.batch_size]
            width = max(map(len, rows))
            # Pad with id 0 behind an attention mask: works whether or not the tokenizer has a pad token.
            ids = torch.zeros((len(rows), width), dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for i, r in enumerate(rows):
                ids[i, : len(r)] = torch.tensor(r)
                mask[i, : len(r)] = 1
            out = model(input_ids=ids.to(device), attention_mask=mask.to(device))
            hidden = getattr(out, "last_hidden_state", None)
            if hidden is None:
                raise DepthcurseError(f"{type(model).__name__} returns no hidden states: load it without a head (head='base') for the repr task")
            m = mask.to(hidden.device).unsqueeze(-1).float()
            pooled.append(((hidden.float() * m).sum(1) / m.sum(1)).cpu())
        return torch.cat(pooled)

    def evaluate(self, model: torch.nn.Module) -> Score:
        cos = F.cosine_similarity(self.embed(model).double(), self.reference.double(), dim=-1)
        return Score({"cos": cos.mean().item(), "cos_min": cos.min().item()}, len(self.rows), {"tokens": sum(map(len, self.rows))})
