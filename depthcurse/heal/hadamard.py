"""Hadamard matrices as LinearPatch's code builds them (chenxinrui-tsinghua/LinearPatch @ d1274e8,
rotate_utils/hadamard_utils.py, from QuaRot): for a width n = K 2^k, the stored matrix of order K
(`hadamard_known`) times Sylvester's doublings, K the first of 172, 156, 140, 108, 60, 52, 36, 28,
40, 20, 12 that divides n (a power of two: K = 1), normalised so that H H^T = I. Which matrix
matters: two Hadamard matrices of one order rotate the stream differently, and LinearPatch's
channel scales are fitted in the rotated basis (docs/healing.md measures the difference)."""

from __future__ import annotations

import math

import torch

from depthcurse.errors import DepthcurseError
from depthcurse.heal.hadamard_known import KNOWN

# The order in which the authors' `get_hadK` tries the stored orders (not sorted: 40 after 28).
SEARCH_ORDER = (172, 156, 140, 108, 60, 52, 36, 28, 40, 20, 12)
SYLVESTER = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)


def known(order: int) -> torch.Tensor:
    """The stored +-1 matrix of `order`, decoded from its rows' hexadecimal signs."""
    rows = []
    for row in KNOWN[order]:
        bits = bin(int(row, 16))[2:].zfill(4 * len(row))[:order]
        rows.append([1.0 if b == "1" else -1.0 for b in bits])
    return torch.tensor(rows, dtype=torch.float64)


def stored_order(n: int) -> int | None:
    """K with n = K 2^k as the authors' code picks it (1 for a power of two), or None where it cannot build n."""
    for k in SEARCH_ORDER:
        if n % k == 0:
            # the authors' code asserts here: the first K that divides n must leave a power of two
            m = n // k
            return k if m & (m - 1) == 0 else None
    return 1 if n > 0 and n & (n - 1) == 0 else None


def hadamard(n: int) -> torch.Tensor:
    """The authors' orthonormal Hadamard matrix of order n (float64): `get_hadamard_matrix(n)`, which
    runs their butterfly `matmul_hadU` on the identity. The butterfly pairs neighbouring entries, so
    the doublings are the outer factor, and it multiplies by H_K from the left of each row's
    reshaped (K, n / K) view, which puts H_K in transposed: H = (Sylvester^(x k) (x) H_K^T) / sqrt(n).
    `tests/test_hadamard.py` checks this against a line-by-line port of their loop."""
    k_order = stored_order(n)
    if k_order is None:
        raise DepthcurseError(f"no Hadamard matrix of order {n} as LinearPatch's code builds them (a power of two times one of "
                              f"{', '.join(map(str, sorted(SEARCH_ORDER)))}): --method-args rotate=false (a diagonal scale alone)")
    h = known(k_order).T.contiguous() if k_order > 1 else torch.ones(1, 1, dtype=torch.float64)
    for _ in range(int(math.log2(n // k_order))):
        h = torch.kron(h, SYLVESTER)
    return h / math.sqrt(n)
