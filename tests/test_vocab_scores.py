"""The vocabulary kernel (`depthcurse.vocab_scores`, issue 89 item 4): each position's loss, KL from a
reference and top-1 agreement in one read of its logits. Against values worked out by hand, against
torch's definitions at every remainder of the vocabulary, at a tie and far into exp's tail, the
scorer's figures through it and through torch's path, and the ways it is left for torch's, said."""

from __future__ import annotations

import math

import pytest
import torch

from depthcurse import kernel_build, vocab_scores
from depthcurse.select import scoring
from depthcurse.select.scoring import Reference, head_scores, logit_scores, position_scores
from helpers import fresh_kernel_cache, needs_compiler

pytestmark = pytest.mark.instruments
BUILT = "depthcurse's vocabulary kernel (each row of logits read once)"


@pytest.fixture
def fresh_kernel(monkeypatch, tmp_path):
    yield from fresh_kernel_cache(monkeypatch, tmp_path, vocab_scores, "DEPTHCURSE_VOCAB_KERNEL")


def test_the_kernel_builds_here_and_says_so():
    # wherever a compiler is (CI's machine has one), the kernel builds: one that silently fell back would leave the rest untested
    if kernel_build.compiler() is None:
        pytest.skip("no C++ compiler on this machine: select scores by torch's log-softmax")
    assert vocab_scores.status() == BUILT
    assert vocab_scores.status("cuda:0") == "torch's log-softmax, product and argmax (on cuda: the kernel is the CPU's)"


@needs_compiler
def test_a_row_worked_out_by_hand():
    # logits (0, ln 3): q = (1/4, 3/4). Target 0: loss ln 4. Against p = (1/2, 1/2): KL(p || q) = 1/2 ln(4/3)
    # (KL(q || p), the other direction, is 1/4 ln(1/2) + 3/4 ln(3/2) = 0.1308, not 0.1438). p's top-1 is the
    # first of its tie, token 0; q's is token 1: no agreement. Against p = q itself: KL 0, agreement 1.
    logits = torch.tensor([[0.0, math.log(3.0)], [0.0, math.log(3.0)]])
    p = torch.tensor([[0.5, 0.5], [0.25, 0.75]])
    reference = Reference(p, (p * p.log()).sum(-1), torch.tensor([0, 1]))
    loss, kl, agree = logit_scores(logits, torch.tensor([0, 1]), reference)
    assert loss.tolist() == pytest.approx([math.log(4.0), math.log(4.0 / 3.0)], rel=1e-6)
    assert kl.tolist() == pytest.approx([0.5 * math.log(4.0 / 3.0), 0.0], abs=1e-7)
    assert agree.tolist() == [0.0, 1.0]
    assert logit_scores(logits, torch.tensor([0, 1]), None)[1:] == (None, None)


@needs_compiler
def test_a_model_equal_to_its_reference_has_a_kl_of_zero_never_below():
    # the two sums' rounding leaves about half of such rows a hair below 0 unclamped
    logits = torch.randn(64, 3000, generator=torch.Generator().manual_seed(0)) * 4
    reference = Reference.of(torch.log_softmax(logits, -1))
    loss, kl, agree = logit_scores(logits, torch.zeros(64, dtype=torch.long), reference)
    assert kl.min() >= 0 and kl.max() < 1e-5 and agree.tolist() == [1.0] * 64


@needs_compiler
def test_the_figures_hold_their_definitions_for_a_reference_that_is_not_normalised():
    # KL's sum p log p - sum p log q and a lens's sum p (log p - log q) as written, whatever p sums to
    # (sum p is a term of the kernel's, which a normalised p would hide)
    logits, targets, reference = case(3, 2, 4, 500)
    p = reference.probs * 0.5
    got = vocab_scores.scored(logits, targets, p, (p * reference.probs.log()).sum(-1), reference.top1)
    want = vocab_scores.torch_scores(logits, targets, p, (p * reference.probs.log()).sum(-1), reference.top1)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=vocab_scores.TOLERANCE, atol=vocab_scores.TOLERANCE)
    lp = reference.probs.log()
    torch.testing.assert_close(vocab_scores.lens_read(logits[0], lp, p, 0)[0], vocab_scores.torch_lens(logits[0], lp, p, 1)[0],
                               rtol=vocab_scores.TOLERANCE, atol=vocab_scores.TOLERANCE)


def case(seed: int, groups: int, positions: int, vocab: int, scale: float = 4.0):
    """Logits of `groups` x `positions` rows, a reference of `positions` rows (its first row the first
    group's own), targets, and a tie for the max in the last row of every group."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(groups, positions, vocab, generator=g) * scale
    tied = [1, 17, vocab - 1] if vocab > 18 else [1, vocab - 1]  # 1 and 17 share a vector's lane
    logits[:, -1, tied] = logits[:, -1].max(-1, keepdim=True).values + 1
    raw = torch.randn(positions, vocab, generator=g) * scale
    raw[-1, 1] = raw[-1].max() + 1  # the reference's top-1 is the tie's first token
    ref = torch.log_softmax(raw, -1)
    ref[0] = torch.log_softmax(logits[0, 0], -1)
    return logits, torch.randint(0, vocab, (positions,), generator=g), Reference.of(ref)


@needs_compiler
@pytest.mark.parametrize("groups,positions,vocab", [(1, 4, 1), (2, 3, 15), (3, 5, 16), (2, 4, 1023), (1, 6, 1024), (2, 3, 3089), (1, 2, 49152)])
def test_every_vocabulary_remainder_equals_torchs_definitions(groups, positions, vocab):
    # vocabularies below a vector's 16 lanes, at it, past a block of 1,024, and SmolLM2's; several removals' logits against one reference
    logits, targets, reference = case(vocab, groups, positions, max(vocab, 2))
    logits, reference = logits[..., :vocab], Reference.of(torch.log_softmax(reference.probs.log()[..., :vocab], -1))
    got = logit_scores(logits, targets % vocab, reference)
    want = vocab_scores.torch_scores(logits, targets % vocab, reference.probs, reference.self_term, reference.top1)
    assert [tuple(g.shape) for g in got] == [(groups, positions)] * 3
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=vocab_scores.TOLERANCE, atol=vocab_scores.TOLERANCE)
    if vocab > 2:
        assert got[2][:, -1].tolist() == [1.0] * groups  # a tie: the first token, as argmax takes it and the reference's top-1 is
        assert got[2][0, 0] == 1.0 and 0 <= got[1][0, 0] < 1e-5  # the reference's own row


@needs_compiler
def test_logits_far_apart_reach_exps_tail():
    # a spread of 400: most exps underflow, as they do in torch
    logits, targets, reference = case(1, 2, 3, 300, scale=100.0)
    got = logit_scores(logits, targets, reference)
    want = position_scores(torch.log_softmax(logits.double(), -1).float(), targets, reference)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-4)


@needs_compiler
def test_the_heads_figures_are_torchs_path_figures():
    # the scorer's head through the kernel and through torch's log-softmax (what DEPTHCURSE_VOCAB_KERNEL=0 gives)
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(8, 3000, bias=False)
    h, ids = torch.randn(2, 3, 7, 8, generator=g), torch.randint(0, 3000, (3, 7), generator=g)
    reference = Reference.of(torch.log_softmax(torch.randn(3, 6, 3000, generator=g), -1))
    with torch.no_grad():
        got = head_scores(lambda x: head(x).float(), h, ids, reference)
        with pytest.MonkeyPatch.context() as m:
            m.setattr(vocab_scores, "takes", lambda logits: False)
            want = head_scores(lambda x: head(x).float(), h, ids, reference)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_what_the_kernel_takes():
    fp32 = torch.zeros(2, 5)
    assert not vocab_scores.takes(fp32.bfloat16()) and not vocab_scores.takes(torch.zeros(()))
    assert not vocab_scores.takes(torch.zeros(2, 5, requires_grad=True))  # no backward
    assert vocab_scores.takes(fp32) == (vocab_scores.kernel().library is not None)
    with torch.no_grad():
        assert vocab_scores.takes(torch.zeros(2, 5, requires_grad=True)) == (vocab_scores.kernel().library is not None)


def test_told_not_to_it_is_torchs_path(fresh_kernel, monkeypatch):
    monkeypatch.setenv("DEPTHCURSE_VOCAB_KERNEL", "0")
    assert vocab_scores.status() == "torch's log-softmax, product and argmax: DEPTHCURSE_VOCAB_KERNEL=0"
    assert not vocab_scores.takes(torch.zeros(2, 5))
    assert not (fresh_kernel / "cache").exists()  # nothing compiled


@needs_compiler
@pytest.mark.parametrize("right,wrong,why", [
    ("*agree = first == top1 ? 1.0f : 0.0f;", "*agree = first == top1 ? 1.0f : 0.5f;", "its top-1 agreement differs from torch's at a vocabulary of 1037 (by up to 0.5)"),
    ("ints above = v > best;", "ints above = v >= best;", "its top-1 agreement differs from torch's at a vocabulary of 1037 (by up to 1)"),  # a tie's last
    ("while (j > 0 && v > vals[j - 1])", "while (j > 0 && v >= vals[j - 1])", "its lens top-8 differs from torch's at a vocabulary of 1037"),
    ("log_sum_exp(x, V, top1) * sum_p", "log_sum_exp(x, V, top1) * sum_p * 1.01", "its lens KL differs from torch's at a vocabulary of 1037 (by up to"),
])
def test_a_build_that_computes_otherwise_is_not_used(fresh_kernel, monkeypatch, right, wrong, why):
    wrong_source = fresh_kernel / "vocab_scores.cpp"
    wrong_source.write_text(vocab_scores.SOURCE.read_text().replace(right, wrong))
    monkeypatch.setattr(vocab_scores, "SOURCE", wrong_source)
    assert vocab_scores.status().startswith(f"torch's log-softmax, product and argmax: the vocabulary kernel was built but {why}")
    assert not vocab_scores.takes(torch.zeros(2, 5))


@pytest.mark.searching
def test_the_walk_scores_removals_heads_together_up_to_head_rows(monkeypatch):
    """The prefix walk scores the heads of removals that reach them one after another in one matmul
    while their positions stay within `HEAD_ROWS`, and each batch's last ones at its end: the same
    figures as each alone, in fewer calls of the head, counted here."""
    from depthcurse.select.scoring import CalibrationScorer
    from helpers import tiny_llama

    model = tiny_llama(300, layers=6)
    windows = torch.randint(0, 300, (5, 16), generator=torch.Generator().manual_seed(0))
    every = [(i, j) for i in range(6) for j in range(i + 1, 6)]
    got, calls = {}, {}
    for rows in (0, 64, scoring.HEAD_ROWS):
        monkeypatch.setattr(scoring, "HEAD_ROWS", rows)
        scorer = CalibrationScorer(model, windows, 2, {}, lambda: None)
        heads = []
        logits = scorer.stepper.logits
        scorer.stepper.logits = lambda h: heads.append(h.shape[:-1]) or logits(h)
        got[rows], calls[rows] = scorer.per_window(every), heads
    # 15 removals; batches of 2, 2 and 1 windows: 30, 30 and 15 positions a removal. At 64: 2, 2 and 4 together
    assert [len(calls[r]) for r in (0, 64, scoring.HEAD_ROWS)] == [45, 8 + 8 + 4, 3]
    assert calls[64][:8] == [(2, 30)] * 7 + [(1, 30)] and calls[64][-4:] == [(4, 15)] * 3 + [(3, 15)]
    for rows in (64, scoring.HEAD_ROWS):
        for a, b in zip(got[rows], got[0]):
            for x, y in zip(a, b):
                assert x == pytest.approx(y, rel=1e-6, abs=1e-7)


@needs_compiler
def test_depth_uses_figures_through_the_kernel_are_torchs_path_figures(monkeypatch):
    # every lens row (KL(output || lens), top-1, top-5) and every skip's output change, read by the kernel
    # and by torch's log-softmax (what DEPTHCURSE_VOCAB_KERNEL=0 gives), on a tiny Llama
    from depthcurse.depth.measure import measure_depth_use
    from helpers import tiny_llama

    model = tiny_llama(300, layers=4)
    windows = torch.randint(0, 300, (3, 12), generator=torch.Generator().manual_seed(0))
    reads = []
    lens_read = vocab_scores.lens_read
    monkeypatch.setattr(vocab_scores, "lens_read", lambda *a: reads.append(a[-1]) or lens_read(*a))
    fused = measure_depth_use(model, windows, 2)
    monkeypatch.setattr(vocab_scores, "takes", lambda logits: False)
    plain = measure_depth_use(model, windows, 2)
    assert reads.count(5) == 3 * 3 and reads.count(0) == 4 * 3  # the 3 lens rows below the output, 4 skips, each of 3 windows
    assert fused.output_change == pytest.approx(plain.output_change, rel=1e-4, abs=1e-6)
    for row, (a, b) in enumerate(zip(fused.lens_kl, plain.lens_kl)):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-6), row
    for name in ("lens_top1", "lens_top5", "settled"):
        assert getattr(fused, name) == getattr(plain, name), name


@needs_compiler
@pytest.mark.parametrize("k,vocab", [(5, 49152), (8, 1030), (1, 3), (3, 3)])
def test_a_lens_rows_top_k_is_a_stable_sorts_and_its_kl_the_definitions(k, vocab):
    # ties for the first and the k-th places: the first token of a tie first, as a stable sort and torch's max
    g = torch.Generator().manual_seed(k)
    logits = torch.randn(6, vocab, generator=g) * 3
    logits[0, [vocab - 1, 0, vocab // 2]] = 40.0
    logits[1, :k + 1] = 30.0
    lp = torch.log_softmax(torch.randn(6, vocab, generator=g) * 3, -1)
    kl, top = vocab_scores.lens_read(logits, lp, lp.exp(), k)
    want_kl, want_top = vocab_scores.torch_lens(logits, lp, lp.exp(), k)
    assert torch.equal(top, want_top) and top[0, 0] == 0 and top[1].tolist() == list(range(k))
    torch.testing.assert_close(kl, want_kl, rtol=vocab_scores.TOLERANCE, atol=vocab_scores.TOLERANCE)
    assert vocab_scores.lens_read(logits, None, None, k)[0] is None and vocab_scores.lens_read(logits, lp, lp.exp(), 0)[1] is None


@needs_compiler
def test_a_lens_that_barely_moves_the_output_keeps_its_small_kl():
    # KLs of about 3e-6: against a double reference the kernel is within 1e-6, torch's float log-softmax off by more than the KL's size
    g = torch.Generator().manual_seed(0)
    lp = torch.log_softmax(torch.randn(16, 49152, generator=g) * 4, -1)
    logits = lp + 1e-4 * torch.randn(16, 49152, generator=g)
    exact = (lp.double().exp() * (lp.double() - torch.log_softmax(logits.double(), -1))).sum(-1)
    kl = vocab_scores.lens_read(logits, lp, lp.exp(), 0)[0]
    floats = torch.linalg.vecdot(lp.exp(), lp - torch.log_softmax(logits, -1))
    assert exact.min() > 2e-6 and (kl.double() - exact).abs().max() < 1e-6 < (floats.double() - exact).abs().max()


def test_a_lens_read_asked_for_more_than_the_kernel_keeps_is_refused():
    if vocab_scores.kernel().library is None:
        pytest.skip("no kernel here")
    with pytest.raises(ValueError, match="k = 9"):
        vocab_scores.lens_read(torch.zeros(2, 20), None, None, vocab_scores.TOP_MOST + 1)


def test_a_kernel_runs_on_torchs_threads_from_the_grain_on_and_on_one_in_a_forked_child(monkeypatch):
    monkeypatch.setattr(kernel_build, "_forked", False)
    assert kernel_build.threads_for(kernel_build.GRAIN - 1) == 1 and kernel_build.threads_for(kernel_build.GRAIN) == torch.get_num_threads()
    kernel_build._after_fork_in_child()  # what a fork calls in the child (os.register_at_fork)
    assert kernel_build._forked and kernel_build.threads_for(10**9) == 1
