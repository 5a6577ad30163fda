"""Perplexity on real text: the task that needs no benchmark, only text and a language-model head."""

from __future__ import annotations

import logging
import math
from typing import Callable

import torch
import torch.nn.functional as F

from depthcurse.errors import DepthcurseError
from depthcurse.kept_state import tensors_digest
from depthcurse.tasks.base import Score
from depthcurse.text import start_text, start_tokens
from depthcurse.train.data import make_rows


class PerplexityTask:
    """Mean next-token loss over non-overlapping windows of `seq_len` tokens of real text.

    Documents are joined with the EOS token and cut into pieces, so every window is full and no
    padding is needed. Each window begins as every sequence the model was trained on began: with
    the tokens its tokenizer puts first (`start_tokens`: BOS for Llama, Gemma, Mistral; none for
    GPT-2 or SmolLM2), then `seq_len` minus those of text, every one of them scored. A model that
    expects BOS and never gets it is measured on input it never saw (one held-out Llama-style
    model: loss 5.34 without, 3.75 with).

    This is the first window of lm-eval's rolling log-likelihood (`loglikelihood_rolling`, whose
    first window starts from the model's prefix token, BOS where there is one) for every window:
    lm-eval's later windows of a long document continue it without BOS, each window here is a
    sequence of its own. `bos=False` cuts the text with nothing put first, the first token of
    each window unscored, as the WikiText perplexities of pruning papers (GPTQ, SparseGPT, Wanda).
    """

    name = "ppl"
    metric = "loss"
    higher_is_better = False

    def __init__(self, tokenizer, texts: list[str], *, source: str, seq_len: int = 512, limit: int | None = 32, batch_size: int = 4, warn_short: bool = True,
                 bos: bool = True, start: list[int] | None = None):
        # `start`: other ids put first instead (`depth-map --as csordas`: their BOS pad, id 0 where the tokenizer has no BOS)
        self.prefix = list(start) if start is not None else start_tokens(tokenizer) if bos else []
        if seq_len < len(self.prefix) + 2:
            raise DepthcurseError(f"--seq-len must be at least {len(self.prefix) + 2}")
        self.source, self.seq_len, self.batch_size = source, seq_len, max(1, batch_size)
        self.bos = start_text(tokenizer, self.prefix)
        want = None if limit is None else limit * (seq_len - len(self.prefix))  # text tokens
        eos = tokenizer.eos_token_id
        docs: list[list[int]] = []
        count = 0
        for text in texts:
            docs.append(tokenizer(text, add_special_tokens=False)["input_ids"])
            count += len(docs[-1]) + (eos is not None)
            if want is not None and count >= want:
                break
        # the rows `lns-train` and `heal` pack from text, so a healed model's held-out loss is this
        windows, _ = make_rows(docs, seq_len, 0, eos, pack=True, start=self.prefix)
        if len(windows) == 0:
            raise DepthcurseError(f"the text in {source} has {count} tokens, fewer than one window of --seq-len {seq_len}")
        if warn_short and limit is not None and len(windows) < limit:  # a default limit only caps
            logging.getLogger("depthcurse").warning("%s holds only %d windows of %d tokens; using them all", source, len(windows), seq_len)
        self.windows = windows if limit is None else windows[:limit]

    @classmethod
    def of_windows(cls, windows: torch.Tensor, *, source: str, bos: str | None, batch_size: int = 4) -> "PerplexityTask":
        """The task over windows made elsewhere (`heal`'s held-out rows, cut by the same `make_rows`)."""
        task = cls.__new__(cls)
        task.windows, task.source, task.seq_len, task.batch_size, task.bos = windows, source, windows.shape[1], max(1, batch_size), bos
        return task

    def describe(self) -> dict:
        # "bos": what each window starts with; None (text cut as it comes) matches runs made before it was recorded
        return {"task": "ppl", "data": self.source, "seq_len": self.seq_len, "windows": len(self.windows), "tokens": self.windows.numel(), "bos": self.bos,
                "windows_sha256": tensors_digest(self.windows)}  # the tokens themselves: another text of the same shape is another run

    def evaluate(self, model: torch.nn.Module) -> Score:
        return self.evaluate_logits(lambda ids: model(input_ids=ids, use_cache=False).logits, model.get_input_embeddings().weight.device, per_window=True)

    @torch.inference_mode()
    def evaluate_logits(self, logits_of: Callable[[torch.Tensor], torch.Tensor], device, reference_of: Callable[[torch.Tensor], torch.Tensor] | None = None,
                        per_window: bool = False) -> Score:
        """The score of the model whose logits for a batch of windows `logits_of` gives. With
        `reference_of`, the logits of the model it is compared with (the unpruned one), also `kl`,
        the mean KL(reference || model) of the next-token distributions per predicted token (nats),
        and `agreement`, the share of positions where both put the same token first: how close the
        model stays to the one it was made from, which a distillation is trained to minimise.
        `per_window`: each window's mean loss too (`details`), the spread a difference between two
        models is judged against; with `reference_of`, each window's KL and agreement as well."""
        total, count, windows, window_kl, window_agree = 0.0, 0, [], [], []
        kl, agree = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.long)
        for batch in self.windows.split(self.batch_size):
            batch = batch.to(device)
            reference = reference_of(batch)[:, :-1] if reference_of is not None else None
            logits = logits_of(batch)[:, :-1]
            # fp32 for the loss: bf16 log-softmax over a 50k vocabulary loses the digits a sweep compares
            token_losses = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), batch[:, 1:].reshape(-1).to(logits.device), reduction="none")
            loss = token_losses.sum()
            windows += token_losses.view(batch.shape[0], -1).mean(-1).tolist()
            total += loss.item()
            count += batch[:, 1:].numel()
            if reference is not None and per_window:  # window by window: the same sums, and each window's share
                for row, ref_row in zip(logits, reference.to(logits.device)):
                    row_kl, row_agree = kl_and_agreement(row, ref_row)
                    kl, agree = kl + row_kl.cpu(), agree + row_agree.cpu()
                    window_kl.append(float(row_kl) / row.shape[0])
                    window_agree.append(int(row_agree) / row.shape[0])
            elif reference is not None:
                batch_kl, batch_agree = kl_and_agreement(logits, reference.to(logits.device))
                kl, agree = kl + batch_kl.cpu(), agree + batch_agree.cpu()
        score = self.score(total, count)
        if per_window:
            score.details["per_window"] = windows
            if reference_of is not None:
                score.details.update(per_window_kl=window_kl, per_window_agreement=window_agree)
        if reference_of is not None:
            score.metrics.update(kl=float(kl) / count, agreement=int(agree) / count)
        return score

    def score(self, total: float, count: int) -> Score:
        """The score for a summed next-token loss `total` over `count` predicted tokens."""
        mean = total / count
        if not math.isfinite(mean):
            return Score({"loss": float("nan"), "ppl": float("nan")}, len(self.windows), {"tokens": count})
        return Score({"loss": mean, "ppl": math.exp(min(mean, 700.0))}, len(self.windows), {"tokens": count})


def kl_and_agreement(logits: torch.Tensor, reference: torch.Tensor, chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed over positions: KL(softmax(reference) || softmax(logits)) in fp32, and the number of
    positions whose top token is the same. A few rows at a time, so that no fp32 copy of the
    whole [positions, vocab] logits is made."""
    vocab = logits.shape[-1]
    rows, ref = logits.reshape(-1, vocab), reference.reshape(-1, vocab)
    kl = torch.zeros((), dtype=torch.float32, device=rows.device)
    same = torch.zeros((), dtype=torch.long, device=rows.device)
    for start in range(0, rows.shape[0], chunk):
        r, t = rows[start:start + chunk], ref[start:start + chunk]
        log_r, log_t = r.float().log_softmax(-1), t.float().log_softmax(-1)
        kl += (log_t.exp() * (log_t - log_r)).sum()
        same += (r.argmax(-1) == t.argmax(-1)).sum()
    return kl, same
