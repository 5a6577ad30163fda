"""What a search will cost, said before it starts: its expected block and head passes (a search's
`passes`), and this machine's seconds for each (`PassTiming`, measured warm).

A pass is one block (or the output head, with the log-softmax and the scores a removal's windows
take) over every calibration window once, as `scoring.Cost` counts them. The timing runs the same
code the scorer runs (prune's `Stepper`, block by block), after one warm-up block and head: the first
call on a fresh process is slow (allocation, kernel choice), and timing it alone made `exact`'s
estimate 5.6x too long at k = 2. Each block's time is the median over the blocks, so that a stray
slow one does not count 30 times.

The expected passes are exact where a search's removals are known in advance (`exact`: the prefix
walk over every k-set, `walk_passes`) and an expectation over removals drawn at random elsewhere (a
removal runs from its first removed unit: `mean_run`). Searches that converge on late blocks run
fewer blocks than random ones: the record keeps the estimate beside the time taken.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch

from depthcurse.prune.stepping import Unsupported, checked_stepper
from depthcurse.select.scoring import Reference, head_scores
from depthcurse.surgery import find_blocks, num_layers


@dataclass(frozen=True)
class PassTiming:
    """Seconds for one block, and for the head with the scores, over every calibration window."""

    block: float
    head: float

    def seconds(self, block_passes: float, head_passes: float) -> float:
        return block_passes * self.block + head_passes * self.head

    def summary(self) -> dict:
        return {"seconds_per_block_pass": self.block, "seconds_per_head_pass": self.head}

    def scaled(self, factor: float) -> "PassTiming":
        """The same over windows of `factor` times the tokens (another text's: the model's own
        continuations are longer than a window of text), a pass's time taken as its tokens'."""
        return PassTiming(self.block * factor, self.head * factor)

    def estimate(self, block_passes: float, head_passes: float) -> dict:
        """What a search expects, as a cell keeps it (the timing itself is the record's `pass_timing`)."""
        return {"block_passes": round(block_passes, 1), "head_passes": round(head_passes, 1), "seconds": round(self.seconds(block_passes, head_passes), 1)}


def head_blocks(model) -> float:
    """The output head's cost in blocks, each token: its parameters over a block's (SmolLM2-135M's
    about 8: a 49,152-token vocabulary on a 576-wide stream)."""
    block = sum(p.numel() for p in find_blocks(model).layers[0].parameters())
    return model.get_output_embeddings().weight.numel() / block if block else 0.0


@torch.no_grad()
def pass_timing(model, windows: torch.Tensor, batch_size: int, clock=time.perf_counter) -> PassTiming:
    """One pass over `windows` timed block by block and head by head, after a warm-up (see the module
    docstring); where prune's stepper cannot run the model, its forward, shared out over the blocks
    and the head by their parameters."""
    device = model.get_input_embeddings().weight.device
    batches = [windows[i : i + batch_size].to(device) for i in range(0, len(windows), batch_size)]
    n = num_layers(model)
    try:
        stepper = checked_stepper(model)
    except Unsupported:
        stepper = None
    if stepper is None:
        model(input_ids=batches[0], use_cache=False)  # warm-up
        started = clock()
        for ids in batches:
            model(input_ids=ids, use_cache=False)
        per_block = (clock() - started) / (n + head_blocks(model))
        return PassTiming(per_block, per_block * head_blocks(model))

    def head(h, ids, reference):
        head_scores(stepper.logits, h, ids, reference)  # one removal's, as the scorer runs it (a prefix walk's wait for company aside)

    first = batches[0]
    ctx = stepper.context(first.shape[1], 0)
    h = stepper.block(0, stepper.embed(first), ctx)
    # a reference of the first batch's shape, worked out once as the unpruned model's is (not a
    # removal's cost); what it is scored against changes nothing in the time
    reference = Reference.of(torch.log_softmax(stepper.logits(h)[:, :-1], dim=-1))
    head(h, first, reference)  # warm-up
    blocks = [0.0] * n
    heads = 0.0
    for ids in batches:
        ctx = stepper.context(ids.shape[1], 0)
        h = stepper.embed(ids)
        for i in range(n):
            started = clock()
            h = stepper.block(i, h, ctx)
            blocks[i] += clock() - started
        started = clock()
        head(h, ids, reference[: len(ids), : ids.shape[1] - 1])
        heads += clock() - started
    return PassTiming(statistics.median(blocks), heads)


def mean_run(n: int, k: int, granularity: str = "layer") -> float:
    """The blocks a removal drawn at random runs, from its first removed unit to the last block:
    whole blocks skip their k removed ones (n - first - k); branches run every block from the
    first touched one (n - first), since a zeroed branch's block still runs."""
    if granularity == "layer":
        total = math.comb(n, k)
        return sum(math.comb(n - 1 - m, k - 1) / total * (n - m - k) for m in range(n - k + 1))
    if granularity == "sub-block":  # k attention and k MLP branches, drawn apart
        at_least = lambda m: (math.comb(n - m, k) / math.comb(n, k)) ** 2  # noqa: E731  (P(first touched >= m))
    else:  # k branches of the 2n
        at_least = lambda m: math.comb(2 * (n - m), k) / math.comb(2 * n, k)  # noqa: E731
    return sum((at_least(m) - at_least(m + 1)) * (n - m) for m in range(n))


def trie_passes(removals, n: int) -> float:
    """The block passes of the prefix walk (`CalibrationScorer._walk`) over these whole-block
    removals, counted as it counts them: each node advances past the kept blocks up to each child's
    removed one, each leaf runs the blocks after its last removed one."""
    trie: dict = {}
    for r in removals:
        node = trie
        for layer in sorted(r):
            node = node.setdefault(layer, {})
        node[None] = True

    def visit(node, at, root):
        blocks = n - at if None in node else 0
        for layer in sorted(k for k in node if k is not None):
            if not root:
                blocks += layer - at
                at = layer
            blocks += visit(node[layer], layer + 1, False)
        return blocks

    return float(visit(trie, 0, True))


