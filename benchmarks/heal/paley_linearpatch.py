"""LinearPatch with the Hadamard matrix depthcurse built before issue 58 (a Paley construction),
as a recovery method from outside, to compare with the authors' matrix on the same removal:

    depthcurse heal smollm2-135m --layers 12-15 --methods linearpatch,benchmarks/heal/paley_linearpatch.py:PaleyLinearPatch ...
"""

from __future__ import annotations

import math

import torch

from depthcurse.heal.methods import linearpatch

SYLVESTER = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)


def _prime(q: int) -> bool:
    return q > 1 and all(q % p for p in range(2, math.isqrt(q) + 1))


def _jacobsthal(q: int) -> torch.Tensor:
    """Q[i, j] = chi(j - i), chi the quadratic character mod the prime q."""
    squares = {i * i % q for i in range(1, q)}
    chi = torch.tensor([0.0] + [1.0 if i in squares else -1.0 for i in range(1, q)], dtype=torch.float64)
    idx = torch.arange(q)
    return chi[(idx[None, :] - idx[:, None]) % q]


def _core(m: int) -> torch.Tensor | None:
    """A Hadamard matrix of order m by Paley's constructions I and II, or None."""
    if m in (1, 2):
        return torch.ones(1, 1, dtype=torch.float64) if m == 1 else SYLVESTER.clone()
    if m % 4:
        return None
    q = m - 1
    if _prime(q) and q % 4 == 3:
        ones = torch.ones(q, 1, dtype=torch.float64)
        return torch.cat([torch.cat([torch.ones(1, 1, dtype=torch.float64), ones.T], 1), torch.cat([-ones, _jacobsthal(q) + torch.eye(q, dtype=torch.float64)], 1)])
    q = m // 2 - 1
    if _prime(q) and q % 4 == 1:
        c = torch.zeros(q + 1, q + 1, dtype=torch.float64)
        c[0, 1:], c[1:, 0], c[1:, 1:] = 1.0, 1.0, _jacobsthal(q)
        return torch.kron(c, torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)) + torch.kron(torch.eye(q + 1, dtype=torch.float64), SYLVESTER)
    return None


def paley_hadamard(n: int) -> torch.Tensor:
    m, k = n, 0
    while (core := _core(m)) is None:
        if m % 2:
            raise ValueError(f"no Paley-Sylvester Hadamard matrix of order {n}")
        m, k = m // 2, k + 1
    for _ in range(k):
        core = torch.kron(core, SYLVESTER)
    return core / math.sqrt(n)


class PaleyLinearPatch(linearpatch.LinearPatch):
    name = "linearpatch-paley"
    title = "linear patch, Paley Hadamard (before issue 58)"

    def prepare(self, ctx):
        authors = linearpatch.hadamard
        linearpatch.hadamard = paley_hadamard  # the one matrix prepare() builds
        try:
            return super().prepare(ctx)
        finally:
            linearpatch.hadamard = authors
