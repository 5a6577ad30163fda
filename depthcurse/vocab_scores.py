"""The vocabulary's work in one read of the logits, on the CPU: each position's loss, KL from a
reference and top-1 agreement (select's scorer, `scored`), and a lens row's KL(output || lens) and
top k (depth-use, `lens_read`).

Scoring a removal's 252 positions of SmolLM2-135M (a vocabulary of 49,152) in torch makes a
log-softmax of the logits (a pass to find each row's max, one to sum its exps, one to write the
log-probs), a product with the reference's probabilities (written whole, then summed), a gather and
an argmax: some seven passes over 50 MB, bound by memory, 15% of `exact`'s time at k = 2. The kernel
in `vocab_scores.cpp` reads each row of logits and of the reference once, finding its max, where
the max first is and sum p x in that read, then sums the row's exps from cache, and writes three
numbers a row: 18 ms where torch took 84 for 1,008 positions; exact's scorer 0.90x its time,
depth-use 0.86x (docs/benchmarks.md, "The vocabulary's work in one read").

The sums are taken in float lanes over blocks and in double across them, where torch's are float
throughout, and lse in double; a row's top-1 is the first of tied maxima, as torch's max, and a
lens row's top k a stable sort's. Where torch's float sums cancel (a KL of 3e-6) the kernel's are
the nearer the exact value. It is C++, compiled on first use for this CPU (`kernel_build`), used
only after it equals the figures' definitions on a test of its own; where it cannot be, torch's
path is used and `status()` says why. `DEPTHCURSE_VOCAB_KERNEL=0` keeps torch's path.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from depthcurse import kernel_build
from depthcurse.kernel_build import Kernel

SOURCE = Path(__file__).with_suffix(".cpp")
TORCHS = "torch's log-softmax, product and argmax"
TOP_MOST = 8  # the most top tokens `lens_scores` keeps a row
TOLERANCE = 1e-5  # of a loss or KL against its definition in double, relative and absolute (measured: 1.1e-6 of its size at 49,152 tokens)


def bind(library: ctypes.CDLL) -> None:
    # logits, R, V, targets, P, probs, self, top1, loss, kl, agree, threads
    library.vocab_scores.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 6 + [ctypes.c_int]
    library.vocab_scores.restype = ctypes.c_int
    # logits, R, V, log p, p, K, kl, top, threads
    library.lens_scores.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    library.lens_scores.restype = ctypes.c_int


def torch_scores(logits: torch.Tensor, targets: torch.Tensor, probs: torch.Tensor | None, self_term: torch.Tensor | None,
                 top1: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The figures by their definitions in torch, for the self-test: the log-softmax's negative at the
    target, KL(p || softmax) = sum p log p - sum p log q, and whether the argmax is the reference's."""
    logp = torch.log_softmax(logits.double(), -1)
    loss = -logp.gather(-1, targets.expand(logits.shape[:-1])[..., None])[..., 0]
    if probs is None:
        return loss.float(), None, None
    kl = (self_term.double() - (probs.double() * logp).sum(-1)).clamp_min(0.0)
    return loss.float(), kl.float(), (logits.argmax(-1) == top1).float()


def _case(g: torch.Generator, groups: int, positions: int, vocab: int, agreeing: int):
    """Logits of `groups` x `positions` rows and a reference of `positions` rows, its first `agreeing`
    rows the first group's own (top-1 agreement 1, KL 0), and a tie for the max in the last row, whose
    first token is the reference's top-1 (agreement 1 only where the first of the tie is taken)."""
    logits = torch.randn(groups, positions, vocab, generator=g) * 4
    tied = [1, 17, vocab - 2] if vocab > 18 else [1, vocab - 2]  # 1 and 17 share a vector's lane
    logits[:, -1, tied] = logits[:, -1].max(-1, keepdim=True).values + 1
    raw = torch.randn(positions, vocab, generator=g) * 4
    raw[-1, 1] = raw[-1].max() + 1
    ref = torch.log_softmax(raw, -1)
    ref[:agreeing] = torch.log_softmax(logits[0, :agreeing], -1)
    probs = ref.exp()
    return logits, torch.randint(0, vocab, (positions,), generator=g), probs, (probs * ref).sum(-1), ref.argmax(-1)


def self_test(library: ctypes.CDLL) -> str | None:
    """Why the library cannot be used (its figures differ from `torch_scores`), or None. The
    vocabularies leave a remainder past the vectors' width and past a block; one has none."""
    g = torch.Generator().manual_seed(0)
    for groups, positions, vocab in ((2, 5, 1037), (1, 3, 2048), (3, 4, 7)):
        logits, targets, probs, self_term, top1 = _case(g, groups, positions, vocab, agreeing=2)
        for reference in ((probs, self_term, top1), (None, None, None)):
            got, want = scores(library, logits, targets, *reference), torch_scores(logits, targets, *reference)
            for name, a, b in zip(("loss", "KL", "top-1 agreement"), got, want):
                if b is not None and not torch.allclose(a, b, rtol=TOLERANCE, atol=TOLERANCE):
                    return f"its {name} differs from torch's at a vocabulary of {vocab} (by up to {(a - b).abs().max().item():.3g})"
        lp = torch.log_softmax(probs.log() + logits[0] * 0.1, -1)  # an output near the reference, beside the lens rows
        kl, top = lens_scores(library, logits[0], lp, lp.exp(), min(TOP_MOST, vocab))
        want_kl, want_top = torch_lens(logits[0], lp, lp.exp(), min(TOP_MOST, vocab))
        if not torch.allclose(kl, want_kl, rtol=TOLERANCE, atol=TOLERANCE):
            return f"its lens KL differs from torch's at a vocabulary of {vocab} (by up to {(kl - want_kl).abs().max().item():.3g})"
        if not torch.equal(top, want_top):
            return f"its lens top-{min(TOP_MOST, vocab)} differs from torch's at a vocabulary of {vocab}"
    return None


def torch_lens(logits: torch.Tensor, lp: torch.Tensor, p: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A lens row's figures by their definitions in torch, for the self-test: KL(output || lens) =
    sum p (log p - log q), and the top k tokens by a stable sort (a tie's first token first)."""
    kl = (p.double() * (lp.double() - torch.log_softmax(logits.double(), -1))).sum(-1).float()
    return kl, torch.sort(logits, stable=True, dim=-1, descending=True).indices[..., :k]


def lens_scores(library: ctypes.CDLL, logits: torch.Tensor, lp: torch.Tensor | None, p: torch.Tensor | None, k: int
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Each row's KL(output || lens) against the output's log-probs `lp` and probabilities `p` (None:
    no KL) and its top `k` tokens (0: none), by the kernel: `logits`, `lp`, `p` [..., V] fp32 on the CPU."""
    vocab = logits.shape[-1]
    logits = logits.contiguous()
    rows, shape = logits.numel() // vocab, logits.shape[:-1]
    kl = None if p is None else torch.empty(shape)
    top = torch.empty(*shape, k, dtype=torch.int64) if k else None
    if p is not None:
        lp, p = lp.expand(logits.shape).contiguous(), p.expand(logits.shape).contiguous()
    said = library.lens_scores(logits.data_ptr(), rows, vocab, None if p is None else lp.data_ptr(), None if p is None else p.data_ptr(), k,
                               None if kl is None else kl.data_ptr(), None if top is None else top.data_ptr(), kernel_build.threads_for(logits.numel()))
    if said:
        raise ValueError(f"lens_scores refused {tuple(logits.shape)} with k = {k}")
    return kl, top


def scores(library: ctypes.CDLL, logits: torch.Tensor, targets: torch.Tensor, probs: torch.Tensor | None = None,
           self_term: torch.Tensor | None = None, top1: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Each row's loss, KL and agreement (`torch_scores`) by the kernel: `logits` [..., P, V] fp32 on
    the CPU, every leading row scored against the same P targets and reference rows (`probs` [P, V],
    `self_term` and `top1` [P]; None: losses alone)."""
    vocab, positions = logits.shape[-1], targets.numel()
    logits = logits.contiguous()
    targets = targets.reshape(-1).to(torch.int64).contiguous()
    shape = logits.shape[:-1]
    loss = torch.empty(shape)
    kl = agree = None
    pointers = [None] * 3
    if probs is not None:
        probs, self_term, top1 = probs.reshape(positions, vocab).contiguous(), self_term.reshape(-1).float().contiguous(), top1.reshape(-1).to(torch.int64).contiguous()
        kl, agree = torch.empty(shape), torch.empty(shape)
        pointers = [probs.data_ptr(), self_term.data_ptr(), top1.data_ptr()]
    said = library.vocab_scores(logits.data_ptr(), logits.numel() // vocab, vocab, targets.data_ptr(), positions, *pointers,
                                loss.data_ptr(), None if kl is None else kl.data_ptr(), None if agree is None else agree.data_ptr(),
                                kernel_build.threads_for(logits.numel()))
    if said:
        raise ValueError(f"vocab_scores refused {tuple(logits.shape)} against {positions} positions")
    return loss, kl, agree


@functools.lru_cache(maxsize=1)
def kernel() -> Kernel:
    """This process's kernel, built or found once (`kernel_build.prepare`)."""
    return kernel_build.prepare(SOURCE, "DEPTHCURSE_VOCAB_KERNEL", "vocabulary kernel", TORCHS,
                                "depthcurse's vocabulary kernel (each row of logits read once)", bind, self_test)


def status(device: torch.device | str = "cpu") -> str:
    """What scores logits on `device`, in words, for the records."""
    return kernel().words if torch.device(device).type == "cpu" else f"{TORCHS} (on {torch.device(device).type}: the kernel is the CPU's)"


def takes(logits: torch.Tensor) -> bool:
    """Whether the kernel scores these logits: fp32 on the CPU, outside autograd, and the kernel
    built and trusted here."""
    if logits.dtype is not torch.float32 or not logits.is_cpu or not logits.dim() or (torch.is_grad_enabled() and logits.requires_grad):
        return False
    return kernel().library is not None


def lens_read(logits: torch.Tensor, lp: torch.Tensor | None, p: torch.Tensor | None, k: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """`lens_scores` by this process's kernel (`takes` said yes)."""
    return lens_scores(kernel().library, logits, lp, p, k)


def scored(logits: torch.Tensor, targets: torch.Tensor, probs: torch.Tensor | None = None, self_term: torch.Tensor | None = None,
           top1: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`scores` by this process's kernel (`takes` said yes)."""
    return scores(kernel().library, logits, targets, probs, self_term, top1)

