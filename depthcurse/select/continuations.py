"""Calibration on the model's own greedy continuations of prompts: what a self-draft meets when it
drafts (`select --calibration continuations`, or `continuations:FILE` for a prompts file).

Draft & Verify score a candidate skip set by decoding their prompts with it, and SWIFT by its
matchness on the text it has just generated; both measure the draft on the whole model's own
continuations, never on natural text. Here every window is a prompt (the offline suite that
`speculate` runs on: dialogue, code, math and summary prompts, a seeded shuffle split into
calibration and held-out prompts; or a file's) followed by the whole model's greedy continuation of
`--seq-len` tokens (fewer where it emits an end-of-sequence token first; a prompt it ends at once is
passed over, and said in `select.json`), and the scores count only
the positions a draft predicts: the continuation's tokens after its first (the first is the whole
model's own, from its prefill, as `speculate` and SWIFT take it). There, teacher-forced top-1
agreement with the whole model is a greedy self-draft's per-token acceptance.

Windows of different lengths are right-padded, which changes nothing before the padding (causal
attention), and the padding is not scored. The token ids are kept in `select.json`, so a resumed run
scores the same windows without generating again.
"""

from __future__ import annotations

import torch

from depthcurse.errors import DepthcurseError
from depthcurse.select.windows import Texts
from depthcurse.speculate.prompts import KINDS, Prompt, from_file, suite

PREFIX = "continuations"


def is_continuations(source: str) -> bool:
    return source == PREFIX or source.startswith(PREFIX + ":")


def label_of(source: str) -> str:
    """The source's short name: `continuations`, or `continuations:` and the prompts file's name."""
    return source if source == PREFIX else f"{PREFIX}:{source.split(':', 1)[1].rsplit('/', 1)[-1].rsplit('.', 1)[0]}"


def _prompts(source: str, wanted: int) -> list[Prompt]:
    """The pool of prompts: a file's, or the suite at twice the prompts wanted (a prompt the model ends at
    once gives no draft position and is passed over)."""
    if source == PREFIX:
        return suite(2 * -(-wanted // len(KINDS)))
    found = from_file(source.split(":", 1)[1])
    if len(found) < wanted:
        raise DepthcurseError(f"--calibration {source}: the file holds {len(found)} prompts, fewer than --calib-windows + --eval-windows ({wanted})")
    return found


def pad_of(tokenizer) -> int:
    """The token padding goes in (never scored, never attended to by what precedes it)."""
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    return tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0


@torch.no_grad()
def generate(model, tokenizer, prompt: Prompt, new_tokens: int) -> tuple[list[int], list[int]]:
    """A prompt's token ids and the whole model's greedy continuation of at most `new_tokens` tokens."""
    device = model.get_input_embeddings().weight.device
    ids = tokenizer(prompt.text, return_tensors="pt").input_ids.to(device)
    made = model.generate(ids, do_sample=False, max_new_tokens=new_tokens, pad_token_id=pad_of(tokenizer))
    return ids[0].tolist(), made[0, ids.shape[1]:].tolist()


def windows_of(pairs: list[tuple[list[int], list[int]]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The windows (prompt then continuation, right-padded with `pad`) and which of their predictions
    are scored: position t predicts token t + 1, and a draft predicts the continuation's tokens after
    its first, so positions len(prompt) to len(prompt) + len(continuation) - 2."""
    length = max(len(p) + len(c) for p, c in pairs)
    ids = torch.full((len(pairs), length), pad, dtype=torch.long)
    mask = torch.zeros(len(pairs), length - 1)
    for row, (prompt, continuation) in enumerate(pairs):
        ids[row, : len(prompt) + len(continuation)] = torch.tensor(prompt + continuation)
        mask[row, len(prompt) : len(prompt) + len(continuation) - 1] = 1.0
    return ids, mask


def continuation_texts(model, tokenizer, source: str, cfg, kept: dict | None = None) -> tuple[Texts, dict]:
    """The calibration and held-out windows of `source` (`continuations` or `continuations:FILE`): a
    seeded shuffle of the prompts split into `cfg.calib_windows` and `cfg.eval_windows`, each with the
    model's greedy continuation of `cfg.seq_len` tokens; and what `select.json` keeps of them (`kept`:
    that from an earlier run, read instead of generating)."""
    if kept is None:
        wanted = cfg.calib_windows + cfg.eval_windows
        prompts = _prompts(source, wanted)
        kept = {"prompts": [], "ids": [], "passed_over": []}
        for i in torch.randperm(len(prompts), generator=torch.Generator().manual_seed(cfg.seed)).tolist():  # a seeded shuffle, in turn until enough
            if len(kept["ids"]) == wanted:
                break
            prompt, continuation = generate(model, tokenizer, prompts[i], cfg.seq_len)
            if len(continuation) < 2:  # ended at once: no prediction a draft makes
                kept["passed_over"].append(prompts[i].source)
                continue
            kept["prompts"].append(prompts[i].source)
            kept["ids"].append([prompt, continuation])
        if len(kept["ids"]) < wanted:
            raise DepthcurseError(f"--calibration {source}: {len(kept['ids'])} of {len(prompts)} prompts give the model a continuation of 2 tokens or "
                                  f"more (the rest end at once), fewer than --calib-windows + --eval-windows ({wanted})")
    calibration, calibration_mask = windows_of(kept["ids"][: cfg.calib_windows], pad_of(tokenizer))
    held_out, held_out_mask = windows_of(kept["ids"][cfg.calib_windows :], pad_of(tokenizer))
    return Texts(label_of(source), calibration, held_out, calibration_mask, held_out_mask), kept
