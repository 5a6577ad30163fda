"""The C++ kernels on torch's threads (`kernel_build.threads_for`). The suite's workers run torch on
one thread, so the kernels' OpenMP loops would otherwise be tested on one thread alone: here each
splits its rows (the vocabulary kernel) or its weight rows (the few-row kernel) over two threads and
gives every figure the one thread gives, to the bit. (Not in mutmut's selection: its children are
forked from the process that ran the tests, and GNU OpenMP hangs in a child forked after its
threads ran.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from depthcurse import kernel_build, vocab_scores
from depthcurse.few_row_linear import few_row_kernel
from depthcurse.select.scoring import Reference, logit_scores
from helpers import needs_compiler

pytestmark = needs_compiler


def run_both(monkeypatch, compute):
    """`compute()` on one thread and on two."""
    got = []
    for n in (1, 2):
        monkeypatch.setattr(kernel_build, "threads_for", lambda work, n=n: n)
        got.append(compute())
    return got


def test_the_vocabulary_kernel_on_two_threads_gives_one_threads_figures(monkeypatch):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 37, 1000, generator=g) * 4
    reference = Reference.of(torch.log_softmax(torch.randn(37, 1000, generator=g) * 4, -1))
    targets = torch.randint(0, 1000, (37,), generator=g)
    lp = reference.probs.log()
    one, two = run_both(monkeypatch, lambda: (*logit_scores(logits, targets, reference), *vocab_scores.lens_read(logits[0], lp, reference.probs, 5)))
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    assert vocab_scores.takes(logits)  # the kernel's figures, not torch's


def test_the_few_row_kernel_on_two_threads_gives_one_threads_rows(monkeypatch):
    torch.manual_seed(0)
    lin = nn.Linear(576, 1536)
    x = torch.randn(5, 576)

    def rows():
        with torch.no_grad(), few_row_kernel(lin) as said:
            return lin(x), said

    (one, said), (two, _) = run_both(monkeypatch, rows)
    assert said.startswith("depthcurse's few-row kernel") and torch.equal(one, two)
