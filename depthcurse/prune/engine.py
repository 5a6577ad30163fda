"""The reuse engine: score every variant of a prune sweep without recomputing what they share.

Variant "without layer l" is identical to the unpruned model up to block l. So for each batch of
inputs the unpruned model runs once, keeping the residual stream at the input of every block a
variant starts from, and variant l continues from the stream at block l, skipping the removed
blocks: it computes only the blocks after l. On top of that:

* only the positions a task scores go through the final norm and the head (the answer tokens of
  a multiple-choice question; every position of a ppl window, in chunks, so the full
  [tokens, vocab] logits never exist at once);
* inputs that share a long token prefix (the few-shot examples of an MMLU subject) get that
  prefix's keys and values computed once per variant; the rest of each input attends to them;
* inputs of different lengths are packed into shared sequences, each attending only to itself
  (a block-diagonal causal mask, positions restarting per input), so batches carry almost no
  padding;
* lm-eval's requests are built and tokenised once (by lm-eval's own HFLM code), and each
  variant's responses go back through lm-eval's own filters, metrics and aggregation.

The blocks are the model's own decoder-layer modules, called with the arguments the model's own
forward passes them (rotary position embeddings, one additive mask per layer type). Before use,
`Stepper.check` compares this block-by-block forward against the model's forward; an
architecture that does not match, or a task the engine does not know, is reported as
unsupported and the sweep falls back to evaluating each variant on its own.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from depthcurse.errors import DepthcurseError
from depthcurse.prune.requests import LmEvalRequests, ppl_requests
from depthcurse.prune.layout import parse_memory
from depthcurse.prune.scoring import score_requests
from depthcurse.prune.stepping import Stepper, Unsupported, checked_stepper
from depthcurse.runtime import World
from depthcurse.tasks.base import Score
from depthcurse.tasks.harness import LmEvalTask
from depthcurse.tasks.perplexity import PerplexityTask


def why_unsupported(model, task) -> str | None:
    """None when the engine can run this model and task; otherwise the reason it cannot."""
    if not isinstance(task, (PerplexityTask, LmEvalTask)):
        return f"task {getattr(task, 'name', type(task).__name__)} is not supported by the reuse engine"
    if getattr(task, "generative", False):
        # Variants share only the prompt's pass up to their first removed block; every generated
        # token after that is the variant's own, so generation runs per variant.
        return f"task {task.name} generates text: each variant's continuation is its own"
    try:
        checked_stepper(model)
    except Unsupported as exc:
        return str(exc)
    except Exception as exc:  # an architecture whose blocks want something the stepper does not give them
        return f"{type(model).__name__}: stepping through its blocks failed ({type(exc).__name__}: {exc})"
    return None


def evaluate_variants(
    model,
    task,
    variants: list[tuple[int, ...]],
    *,
    max_memory: int | str | None = None,
    store: Path | None = None,
    fingerprint: str = "",
    on_batch: Callable[[int, int], None] | None = None,
    share_prefixes: bool = True,
    pack: bool = True,
    granularity: str = "layer",
    compile: bool = False,
    checked: bool = False,
    world: World = World(),
) -> tuple[dict[tuple, Score] | None, dict]:
    """Scores of every variant (tuples of removed layers, or with `granularity` "attn"/"mlp" of the
    layers whose branch is removed; () is the unpruned model) and run statistics. With `compile`,
    the blocks run through torch.compile (`stepping.compile_blocks`).

    Raises Unsupported (with the reason) for a model or task the engine cannot run, unless
    `checked` says `why_unsupported` already found none. Under torchrun every rank calls this
    and scores its share of the requests; rank 0 gets every score (lm-eval's metrics computed
    once, from all the requests), the other ranks get None.
    """
    reason = None if checked else why_unsupported(model, task)
    if reason:
        raise Unsupported(reason)
    started = time.perf_counter()
    stepper = Stepper(model, compile=compile)
    asked = list(dict.fromkeys([(), *variants]))
    if isinstance(task, PerplexityTask):
        requests, lm_requests = ppl_requests(task), None
    else:
        lm_requests = LmEvalRequests(task, model)
        requests = lm_requests.requests
    if not requests:
        raise DepthcurseError(f"task {task.name} produced no requests to score")
    t_requests = time.perf_counter() - started
    lp, greedy, stats = score_requests(stepper, requests, asked, max_memory=parse_memory(max_memory, stepper.device), store=store, fingerprint=fingerprint,
                                       on_batch=on_batch, share_prefixes=share_prefixes, pack=pack, granularity=granularity, need_greedy=lm_requests is not None, world=world)
    if lp is None:  # another rank's share, gathered on rank 0
        return None, stats
    scores = {}
    for vi, v in enumerate(asked):
        if lm_requests is None:
            count = sum(len(r.targets) for r in requests)
            scores[v] = task.score(-float(lp[vi].sum()), count)
            # each window's mean loss: what a drop's paired interval is over (`Sweep.drop_interval`)
            scores[v].details["per_window"] = [-float(lp[vi][w]) / len(r.targets) for w, r in enumerate(requests)]
        else:
            scores[v] = lm_requests.score(lp[vi], greedy[vi])
    stats.update(
        requests=len(requests),
        compiled=compile,
        seconds_building_requests=round(t_requests, 3),
        seconds=round(time.perf_counter() - started, 3),
    )
    return scores, stats
