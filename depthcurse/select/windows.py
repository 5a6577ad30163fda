"""A text's windows for `select`: those the choice is made on and those it is judged on, apart;
a model's per-window scores on them; and the pass that keeps the streams the stream searches read."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from depthcurse.angular.measurement import measure
from depthcurse.errors import DepthcurseError
from depthcurse.select.scoring import window_scores
from depthcurse.tasks import PerplexityTask
from depthcurse.text import load_texts


@dataclass
class Texts:
    """One source's windows: those the choice is made on and those it is judged on, apart."""

    label: str
    calibration: torch.Tensor
    held_out: torch.Tensor


def text_windows(tokenizer, source: str, cfg) -> Texts:
    """`calib_windows` + `eval_windows` windows of `source` (heal's and ppl's packing), split by a
    seeded shuffle so that neither part is one stretch of the text, and no window is in both."""

    texts, label = load_texts(source, option="--calibration")
    want = cfg.calib_windows + cfg.eval_windows
    windows = PerplexityTask(tokenizer, texts, source=label, seq_len=cfg.seq_len, limit=want, warn_short=False).windows
    if len(windows) < want:
        raise DepthcurseError(f"{label} holds {len(windows)} windows of {cfg.seq_len} tokens: fewer than --calib-windows + --eval-windows ({want})")
    order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(cfg.seed))
    return Texts(label, windows[order[: cfg.calib_windows]], windows[order[cfg.calib_windows:want]])


@torch.no_grad()
def per_window(model, windows: torch.Tensor, batch_size: int, reference: list[torch.Tensor] | None = None
               ) -> tuple[list[float], list[float] | None, list[float] | None, list[torch.Tensor]]:
    """Each window's mean next-token loss and, against `reference` (the unpruned model's log-probs,
    batch by batch), its mean KL(unpruned || model) and rejection (1 - top-1 agreement); and this
    model's log-probs batch by batch."""
    device = model.get_input_embeddings().weight.device
    losses, kls, rejections, logprobs = [], [] if reference is not None else None, [] if reference is not None else None, []
    for b, start in enumerate(range(0, len(windows), batch_size)):
        ids = windows[start : start + batch_size].to(device)
        logp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[:, :-1].float(), dim=-1)
        loss, kl, agreement = window_scores(logp, ids, reference[b] if reference is not None else None)
        losses += loss.mean(1).tolist()
        if reference is not None:
            kls += kl.mean(1).tolist()
            rejections += (1.0 - agreement.mean(1)).tolist()
        logprobs.append(logp.cpu())
    return losses, kls, rejections, logprobs


def stream_pass(model, windows: torch.Tensor, batch_size: int, k: int):
    """The angular-distance pass the stream searches read, over every token of the calibration
    windows (`angular.measure`: a few windows have too few last tokens)."""
    masks = torch.ones_like(windows)
    batches = [(windows[i : i + batch_size], masks[i : i + batch_size]) for i in range(0, len(masks), batch_size)]
    return measure(model, batches, position="all", max_n=k, identity_tokens=0)
