"""A text's windows for `select`: those the choice is made on and those it is judged on, apart;
a model's per-window scores on them; and the pass that keeps the streams the stream searches read."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from depthcurse.angular.measurement import measure
from depthcurse.errors import DepthcurseError
from depthcurse.select.scoring import Reference, logit_scores, masked_means, window_scores
from depthcurse.tasks import PerplexityTask
from depthcurse.text import load_texts


@dataclass
class Texts:
    """One source's windows: those the choice is made on and those it is judged on, apart; and, where
    only some positions are scored (the model's own continuations of prompts), which predictions count
    ([windows, tokens - 1], 1 where scored; None: every one)."""

    label: str
    calibration: torch.Tensor
    held_out: torch.Tensor
    calibration_mask: torch.Tensor | None = None
    held_out_mask: torch.Tensor | None = None


HELD_OUT = {"windows": "other windows of the same documents (a seeded shuffle of the windows)",
            "documents": "windows of other documents (a seeded shuffle of the documents)"}


def text_windows(tokenizer, source: str, cfg) -> Texts:
    """`calib_windows` + `eval_windows` windows of `source` (heal's and ppl's packing), split by a
    seeded shuffle so that neither part is one stretch of the text, and no window is in both; with
    `cfg.held_out == "documents"`, the documents are shuffled and split instead, so that no document
    gives windows to both parts (a choice judged on text it never saw any of)."""

    texts, label = load_texts(source, option="--calibration")
    if getattr(cfg, "held_out", "windows") == "documents":
        return _document_windows(tokenizer, texts, label, cfg)
    want = cfg.calib_windows + cfg.eval_windows
    windows = PerplexityTask(tokenizer, texts, source=label, seq_len=cfg.seq_len, limit=want, warn_short=False).windows
    if len(windows) < want:
        raise DepthcurseError(f"{label} holds {len(windows)} windows of {cfg.seq_len} tokens: fewer than --calib-windows + --eval-windows ({want})")
    order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(cfg.seed))
    return Texts(label, windows[order[: cfg.calib_windows]], windows[order[cfg.calib_windows:want]])


def _document_windows(tokenizer, texts: list[str], label: str, cfg) -> Texts:
    """The calibration windows from the first documents of a seeded shuffle, as many as they take,
    and the held-out windows from the documents after them."""
    if len(texts) < 2:
        raise DepthcurseError(f"--held-out documents: {label} is one document (no boundaries to split at): use --held-out windows")
    order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    docs = [texts[i] for i in order]
    need, used, cut = cfg.calib_windows * cfg.seq_len, 0, 0
    while cut < len(docs) and used < need:  # ends: each step takes one document
        used += len(tokenizer(docs[cut]).input_ids) + 1
        cut += 1
    while True:  # the packing may need a document more than the count says; ends by the one-line error below
        calibration = PerplexityTask(tokenizer, docs[:cut], source=label, seq_len=cfg.seq_len, limit=cfg.calib_windows, warn_short=False).windows
        if len(calibration) >= cfg.calib_windows or cut >= len(docs) - 1:
            break
        cut += 1
    held_out = PerplexityTask(tokenizer, docs[cut:], source=label, seq_len=cfg.seq_len, limit=cfg.eval_windows, warn_short=False).windows \
        if cut < len(docs) else calibration[:0]
    if len(calibration) < cfg.calib_windows or len(held_out) < cfg.eval_windows:
        raise DepthcurseError(f"--held-out documents: {label}'s {len(texts)} documents give {len(calibration)} calibration and {len(held_out)} held-out "
                              f"windows of {cfg.seq_len} tokens, fewer than --calib-windows {cfg.calib_windows} and --eval-windows {cfg.eval_windows}")
    return Texts(label, calibration[: cfg.calib_windows], held_out[: cfg.eval_windows])


@torch.no_grad()
def per_window(model, windows: torch.Tensor, batch_size: int, reference: list[Reference] | None = None, mask: torch.Tensor | None = None
               ) -> tuple[list[float], list[float] | None, list[float] | None, list[Reference]]:
    """Each window's mean next-token loss and, against `reference` (the unpruned model's predictions,
    batch by batch), its mean KL(unpruned || model) and rejection (1 - top-1 agreement), over the
    predictions `mask` scores (all where None); and, without `reference`, this model's predictions
    batch by batch, as the reference of another's (None each where a reference was given)."""
    device = model.get_input_embeddings().weight.device
    losses, kls, rejections, references = [], [] if reference is not None else None, [] if reference is not None else None, []
    for b, start in enumerate(range(0, len(windows), batch_size)):
        ids = windows[start : start + batch_size].to(device)
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
        if reference is not None:  # a removal's: scored in one read of its logits where the kernel takes them
            loss, kl, agreement = logit_scores(logits, ids[:, 1:], reference[b])
        else:  # the unpruned model's, whose log-probs are the reference of the others
            logp = torch.log_softmax(logits, dim=-1)
            loss, kl, agreement = window_scores(logp, ids, None)
        rows = None if mask is None else mask[start : start + batch_size]
        losses += masked_means(loss, rows)
        if reference is not None:
            kls += masked_means(kl, rows)
            rejections += [1.0 - a for a in masked_means(agreement, rows)]
        references.append(Reference.of(logp.cpu()) if reference is None else None)  # only the unpruned model's are read
    return losses, kls, rejections, references


def tokens_read(scored: torch.Tensor) -> torch.Tensor:
    """Each window's tokens up to its last scored prediction's target ([windows, tokens], 1 where read),
    from which predictions are scored ([windows, tokens - 1]): the padding after them left out."""
    last = scored.shape[1] - 1 - torch.flip(scored, [1]).argmax(1)  # each window's last scored prediction
    return (torch.arange(scored.shape[1] + 1)[None] <= last[:, None] + 1).long()


def stream_pass(model, windows: torch.Tensor, batch_size: int, k: int, scored: torch.Tensor | None = None):
    """The angular-distance pass the stream searches read, over every token of the calibration
    windows (`angular.measure`: a few windows have too few last tokens); where only some predictions
    are scored (`scored`, [windows, tokens - 1]), over each window's tokens up to its last scored
    prediction's target (the padding after it left out)."""
    masks = torch.ones_like(windows) if scored is None else tokens_read(scored).to(windows.dtype)
    batches = [(windows[i : i + batch_size], masks[i : i + batch_size]) for i in range(0, len(masks), batch_size)]
    return measure(model, batches, position="all", max_n=k, identity_tokens=0)
