"""LinearPatch's Hadamard matrix is the authors' (chenxinrui-tsinghua/LinearPatch @ d1274e8,
rotate_utils/hadamard_utils.py): checked against their butterfly loop ported line by line, their
stored 12 x 12 matrix typed from their file, and values their code computed."""

import pytest
import torch

from depthcurse.errors import DepthcurseError
from depthcurse.heal.hadamard import hadamard, known, stored_order

# The widths of real models' residual streams.
WIDTHS = (576, 768, 896, 960, 1024, 1536, 2048, 2304, 2560, 3072, 3584, 4096, 5120, 8192)

# get_had12() in the authors' file, as printed there.
HAD12 = [
    [+1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1],
    [+1, +1, -1, +1, -1, -1, -1, +1, +1, +1, -1, +1],
    [+1, +1, +1, -1, +1, -1, -1, -1, +1, +1, +1, -1],
    [+1, -1, +1, +1, -1, +1, -1, -1, -1, +1, +1, +1],
    [+1, +1, -1, +1, +1, -1, +1, -1, -1, -1, +1, +1],
    [+1, +1, +1, -1, +1, +1, -1, +1, -1, -1, -1, +1],
    [+1, +1, +1, +1, -1, +1, +1, -1, +1, -1, -1, -1],
    [+1, -1, +1, +1, +1, -1, +1, +1, -1, +1, -1, -1],
    [+1, -1, -1, +1, +1, +1, -1, +1, +1, -1, +1, -1],
    [+1, -1, -1, -1, +1, +1, +1, -1, +1, +1, -1, +1],
    [+1, +1, -1, -1, -1, +1, +1, +1, -1, +1, +1, -1],
    [+1, -1, +1, -1, -1, -1, +1, +1, +1, -1, +1, +1],
]

# sum(H * arange(n * n).view(n, n)) of the authors' get_hadamard_matrix(n), run on their file.
AUTHORS_WEIGHTED_SUM = {576: -3988224.0, 768: 19509.820646623357, 896: -12028859.41702201, 960: 29248.769403987902,
                        2560: 61525.27341012338}


def authors_matmul_hadU(X, hadK, K):
    """Their `matmul_hadU(X)`, line by line (the transposed case left out: they never ask for it)."""
    n = X.shape[-1]
    input = X.clone().view(-1, n, 1)
    output = input.clone()
    while input.shape[1] > K:
        input = input.view(input.shape[0], input.shape[1] // 2, 2, input.shape[2])
        output = output.view(input.shape)
        output[:, :, 0, :] = input[:, :, 0, :] + input[:, :, 1, :]
        output[:, :, 1, :] = input[:, :, 0, :] - input[:, :, 1, :]
        output = output.view(input.shape[0], input.shape[1], -1)
        (input, output) = (output, input)
    del output
    if K > 1:
        input = hadK.view(1, K, K).to(input) @ input
    return input.view(X.shape) / torch.tensor(n).sqrt()


def test_the_stored_matrices_decode_to_the_authors_and_are_hadamard():
    assert torch.equal(known(12), torch.tensor(HAD12, dtype=torch.float64))
    for order in (12, 20, 28, 36, 40, 52, 60, 108, 140, 156, 172):
        h = known(order)
        assert torch.equal(h @ h.T, order * torch.eye(order, dtype=torch.float64)), order


@pytest.mark.parametrize("n", (12, 24, 576, 768, 896, 960, 2560))
def test_equals_the_authors_butterfly_on_the_identity(n):
    k = stored_order(n)
    reference = authors_matmul_hadU(torch.eye(n, dtype=torch.float64), known(k) if k > 1 else None, k)
    # their scale, torch.tensor(n).sqrt(), is a float32 (an integer tensor's sqrt): equal to its rounding
    torch.testing.assert_close(hadamard(n), reference, rtol=1e-7, atol=0)


def test_equals_values_the_authors_code_computed():
    for n, expected in AUTHORS_WEIGHTED_SUM.items():
        weighted = float((hadamard(n) * torch.arange(n * n, dtype=torch.float64).view(n, n)).sum())
        assert weighted == pytest.approx(expected, rel=1e-6, abs=1e-3), n


@pytest.mark.parametrize("n", WIDTHS)
def test_orthonormal_at_real_models_widths(n):
    h = hadamard(n)
    rows = torch.randperm(n, generator=torch.Generator().manual_seed(n))[:48]
    torch.testing.assert_close(h[rows] @ h.T, torch.eye(n, dtype=torch.float64)[rows], rtol=0, atol=1e-10)
    assert torch.equal((h * n**0.5).abs().round(), torch.ones_like(h))  # +-1 up to the scale


def test_the_first_stored_order_in_the_authors_sequence_decides():
    # 2560 = 40 x 64 = 20 x 128: their sequence tries 40 before 20; 5120 likewise
    assert stored_order(2560) == 40 and stored_order(5120) == 40 and stored_order(4096) == 1 and stored_order(576) == 36


@pytest.mark.parametrize("n", (1000, 100, 7))
def test_a_width_it_cannot_build_is_refused_in_one_line(n):
    with pytest.raises(DepthcurseError, match=f"order {n}.*rotate=false") as err:
        hadamard(n)
    assert "\n" not in str(err.value)
