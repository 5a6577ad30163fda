"""The fused kernels against independent references: a hand-written RMSNorm with autograd, and
`F.cross_entropy(hidden @ W.T, targets)`.

Every test that takes `path` runs for the PyTorch path here and for the Triton path in a child
pytest process with TRITON_INTERPRET=1 (Triton's CPU interpreter): Triton chooses compiled or
interpreted kernels when they are defined, so the variable must be set before anything imports
them, and a child process keeps it away from the rest of the suite. The interpreter runs the
kernels as Python, so a separate test compiles each of them for an H100 (no GPU needed). Where a
GPU exists, the same tests also run the compiled kernels on it (`cuda_path`).

Tolerances: fp32 results must agree to about 1e-5. bf16 outputs are compared with the fp32 maths
on the same bf16 inputs; a bf16 value carries 8 significant bits, so they may differ by one unit
in the last place (2^-7 relative: Triton's interpreter rounds fp32 -> bf16 towards zero where a
GPU rounds to nearest, so a full unit, not half). For the same reason the bf16 residual sum r is
bit-exact only on the PyTorch path (and on a GPU); under the interpreter it may be one unit lower,
and the norm is checked against the r the kernel returned. The loss path rounds the logits to
bf16 too (like eager bf16), hence its looser bounds, each measured and given headroom.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

from depthcurse.train import kernels
from depthcurse.errors import DepthcurseError
from helpers import under_triton_interpreter

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
# cuda_path: the compiled Triton kernels on a GPU, inputs copied there and results back (only where one exists)
PATHS = ["torch_path", "triton_path"] if INTERPRETER else ["torch_path"] + (["cuda_path"] if torch.cuda.is_available() else [])
BF16 = dict(rtol=1.6e-2, atol=1e-5)  # one bf16 unit in the last place, relative
FP32 = dict(rtol=1e-5, atol=1e-5)  # sums of O(1) terms in another order differ by ~1e-6

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _use_triton(path: str) -> bool:
    return path in ("triton_path", "cuda_path")


def _device_type(path: str) -> str:
    return "cuda" if path == "cuda_path" else "cpu"


def _there(path: str, t):
    """`t` on the path's device: a differentiable copy, so gradients still reach the CPU leaf."""
    return t.cuda() if path == "cuda_path" and t is not None else t


def _back(out):
    return tuple(o.cpu() for o in out) if isinstance(out, tuple) else out.cpu()


def _rms_norm(path, x, weight, eps, scale=1.0, residual=None):
    return _back(kernels.rms_norm(_there(path, x), _there(path, weight), eps, scale, residual=_there(path, residual), use_triton=_use_triton(path)))


def _linear_ce(path, hidden, weight, targets, **kwargs):
    return _back(kernels.fused_linear_cross_entropy(_there(path, hidden), _there(path, weight), _there(path, targets), use_triton=_use_triton(path), **kwargs))


def reference_rms_norm(x, weight, eps, scale, residual=None):
    """Eager maths written out, fp32 throughout; r rounded to the stream's dtype like `x + residual`."""
    r = x if residual is None else x + residual
    rf = r.float()
    y = rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + eps) * weight.float() * scale
    return y, r


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _norm_case(shape, dtype, w_dtype, res_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype)
    res = None if res_dtype is None else (torch.randn(shape, generator=g) * 2).to(res_dtype)
    w = (1 + 0.3 * torch.randn(shape[-1], generator=g)).to(w_dtype)
    return x, res, w


def _norm_grads(fn, x, res, w, dy, dr):
    """Outputs and gradients of sum(y * dy) + sum(r * dr) w.r.t. x, residual and weight."""
    x, w = _leaf(x), _leaf(w)
    res = None if res is None else _leaf(res)
    out = fn(x, w, res)
    y, r = out if isinstance(out, tuple) else (out, None)
    loss = (y.float() * dy).sum()
    if r is not None and dr is not None:
        loss = loss + (r.float() * dr).sum()
    inputs = [t for t in (x, res, w) if t is not None]
    return y, r, torch.autograd.grad(loss, inputs)


# --------------------------------------------------------------------------------------------
# RMSNorm


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("with_residual", [False, True], ids=["norm", "add_norm"])
@pytest.mark.parametrize("scale", [1.0, 1 / math.sqrt(7)], ids=["scale1", "lns_l7"])
def test_rms_norm_fp32_matches_reference(path, with_residual, scale):
    # 2 x 19 = 38 rows (not a multiple of the backward's row slices), width 48 (not a power of two)
    x, res, w = _norm_case((2, 19, 48), torch.float32, torch.float32, torch.float32 if with_residual else None)
    g = torch.Generator().manual_seed(1)
    dy, dr = torch.randn(x.shape, generator=g), torch.randn(x.shape, generator=g)
    eps = 1e-6
    y, r, grads = _norm_grads(lambda x, w, res: _rms_norm(path, x, w, eps, scale, residual=res), x, res, w, dy, dr)
    y_ref, r_ref, grads_ref = _norm_grads(lambda x, w, res: reference_rms_norm(x, w, eps, scale, res) if res is not None else reference_rms_norm(x, w, eps, scale)[0], x, res, w, dy, dr)
    torch.testing.assert_close(y, y_ref, **FP32)
    if with_residual:
        torch.testing.assert_close(r, r_ref, rtol=0, atol=0)
    assert len(grads) == len(grads_ref) == (3 if with_residual else 2)
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got, want, **FP32)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16], ids=["fp32_gain", "bf16_gain"])
def test_rms_norm_bf16_add_norm(path, w_dtype):
    """bf16 activations; the gain either an fp32 master weight (autocast training) or bf16."""
    x, res, w = _norm_case((37, 40), torch.bfloat16, w_dtype, torch.bfloat16, seed=2)
    g = torch.Generator().manual_seed(3)
    dy = torch.randn(x.shape, generator=g).bfloat16().float()  # the bf16 grads autograd would pass
    dr = torch.randn(x.shape, generator=g).bfloat16().float()
    scale = 1 / math.sqrt(5)
    y, r, grads = _norm_grads(lambda x, w, res: _rms_norm(path, x, w, 1e-5, scale, residual=res), x, res, w, dy, dr)
    assert y.dtype == r.dtype == torch.bfloat16
    assert [t.dtype for t in grads] == [torch.bfloat16, torch.bfloat16, w_dtype]
    torch.testing.assert_close(r, x + res, **(BF16 if path == "triton_path" else dict(rtol=0, atol=0)))
    # The reference: fp32 maths on the very residual sum the kernel normalised.
    y_ref, _, grads_ref = _norm_grads(lambda rr, w, _: reference_rms_norm(rr, w, 1e-5, scale)[0], r.detach().float(), None, w.float(), dy, None)
    torch.testing.assert_close(y.float(), y_ref, **BF16)
    d_r_ref, dw_ref = grads_ref
    d_r_ref = d_r_ref + dr  # the gradient reaching the returned r adds to the norm's
    # The PyTorch path, like eager PyTorch, rounds the norm's gradient to bf16 before adding the
    # one reaching r, two roundings where Triton has one: allow a bf16 unit of the addends (~1).
    tol = BF16 if path == "triton_path" else dict(rtol=1.6e-2, atol=8e-3)
    torch.testing.assert_close(grads[0].float(), d_r_ref, **tol)
    torch.testing.assert_close(grads[1].float(), d_r_ref, **tol)
    tol = BF16 if w_dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)  # fp32 gain keeps an fp32 grad
    torch.testing.assert_close(grads[2].float(), dw_ref, **tol)


@pytest.mark.parametrize("path", PATHS)
def test_rms_norm_mixed_dtypes_promote_like_eager(path):
    """A bf16 branch output added to an fp32 residual stream (autocast with fp32 activations)."""
    x, res, w = _norm_case((11, 24), torch.bfloat16, torch.float32, torch.float32, seed=4)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    y, r, grads = _norm_grads(lambda x, w, res: _rms_norm(path, x, w, 1e-6, 0.5, residual=res), x, res, w, dy, None)
    y_ref, r_ref, grads_ref = _norm_grads(lambda x, w, res: reference_rms_norm(x, w, 1e-6, 0.5, res), x, res, w, dy, None)
    assert y.dtype == r.dtype == torch.float32
    assert [t.dtype for t in grads] == [torch.bfloat16, torch.float32, torch.float32]
    torch.testing.assert_close(r, r_ref, rtol=0, atol=0)
    torch.testing.assert_close(y, y_ref, **FP32)
    torch.testing.assert_close(grads[0], grads_ref[0], **BF16)
    torch.testing.assert_close(grads[1], grads_ref[1], **FP32)
    torch.testing.assert_close(grads[2], grads_ref[2], **FP32)


@pytest.mark.parametrize("path", PATHS)
def test_rms_norm_matches_torch_rms_norm(path):
    """A second, library reference: F.rms_norm times the scale, at a wider row (d = 300)."""
    x, _, w = _norm_case((9, 300), torch.float32, torch.float32, None, seed=6)
    got = _rms_norm(path, x, w, 1e-6, 0.25)
    torch.testing.assert_close(got, F.rms_norm(x, (300,), w, 1e-6) * 0.25, **FP32)


@pytest.mark.parametrize("path", PATHS)
def test_compiled_code_calls_the_norm_inside_its_graph(path):
    """Compiled blocks call the norm without breaking their graph (the Triton norm is a custom
    operator: an autograd.Function launching Triton from Python broke the graph at every norm),
    and the compiled loss and gradients are the eager ones."""
    g = torch.Generator().manual_seed(7)
    x, res, w = (torch.randn(*shape, generator=g, requires_grad=True) for shape in ((2, 5, 48), (2, 5, 48), (48,)))

    def two_norms(x, res, w):  # the residual add and LNS scale, then a norm without a residual
        y, r = _rms_norm(path, x * 2, w, 1e-6, 0.5, residual=res)
        return (_rms_norm(path, y + 1, w, 1e-6) * r).sum()

    torch._dynamo.reset()
    explained = torch._dynamo.explain(two_norms)(x, res, w)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    want = two_norms(x, res, w)
    want_grads = torch.autograd.grad(want, (x, res, w))
    got = torch.compile(two_norms)(x, res, w)
    torch.testing.assert_close(got, want, **FP32)
    for a, b in zip(torch.autograd.grad(got, (x, res, w)), want_grads):
        torch.testing.assert_close(a, b, **FP32)


@pytest.mark.parametrize("path", PATHS)
def test_rms_norm_writes_y_in_the_asked_dtype(path):
    """`out_dtype`: y written in bf16 at once is y rounded to bf16 afterwards (what autocast does
    before a matmul), with the same gradients; the stream r keeps its dtype."""
    g = torch.Generator().manual_seed(8)
    x, res = (torch.randn(3, 5, 40, generator=g, requires_grad=True) for _ in range(2))
    w = (1 + 0.2 * torch.randn(40, generator=g)).requires_grad_()
    dy = torch.randn(3, 5, 40, generator=g).bfloat16()
    y, r = kernels.rms_norm(_there(path, x), _there(path, w), 1e-6, 0.5, residual=_there(path, res), use_triton=_use_triton(path), out_dtype=torch.bfloat16)
    assert (y.dtype, r.dtype) == (torch.bfloat16, torch.float32)
    want_y, want_r = kernels.rms_norm(x, w, 1e-6, 0.5, residual=res, use_triton=False)
    # the interpreter rounds to bf16 towards zero, torch to nearest: one unit apart at most there
    torch.testing.assert_close(y.cpu(), want_y.bfloat16(), **(BF16 if path == "triton_path" else dict(rtol=0, atol=0)))
    got = torch.autograd.grad((y.float() * _there(path, dy).float()).sum() + r.sum(), (x, res, w))
    want = torch.autograd.grad((want_y.bfloat16().float() * dy.float()).sum() + want_r.sum(), (x, res, w))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **FP32)


def test_rms_norm_rejects_bad_input():
    x = torch.randn(3, 8)
    with pytest.raises(DepthcurseError, match="finite Python float"):
        kernels.rms_norm(x, torch.ones(8), 1e-6, scale=torch.tensor(0.5))
    with pytest.raises(DepthcurseError, match="finite Python float"):
        kernels.rms_norm(x, torch.ones(8), 1e-6, scale=float("nan"))
    with pytest.raises(DepthcurseError, match=r"expected \(8,\)"):
        kernels.rms_norm(x, torch.ones(7), 1e-6)
    with pytest.raises(DepthcurseError, match="residual has shape"):
        kernels.rms_norm(x, torch.ones(8), 1e-6, residual=torch.randn(3, 7))


@pytest.mark.skipif(INTERPRETER, reason="needs a process without TRITON_INTERPRET")
def test_forcing_triton_on_cpu_without_the_interpreter_is_a_clear_error():
    x = torch.randn(3, 8)
    with pytest.raises(DepthcurseError, match="TRITON_INTERPRET=1"):
        kernels.rms_norm(x, torch.ones(8), 1e-6, use_triton=True)
    with pytest.raises(DepthcurseError, match="TRITON_INTERPRET=1"):
        kernels.fused_linear_cross_entropy(x, torch.randn(5, 8), torch.zeros(3, dtype=torch.long), use_triton=True)


def test_dispatch_defaults_to_pytorch_off_cuda():
    x = torch.randn(2, 4)
    assert kernels._use_triton(None, x) is False
    assert kernels._use_triton(False, x) is False


# --------------------------------------------------------------------------------------------
# Linear + cross-entropy


def _ce_case(n, d, vocab, dtype=torch.float32, n_ignored=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g).to(dtype)
    weight = (torch.randn(vocab, d, generator=g) / math.sqrt(d) * 3).to(dtype)  # logits of std ~3
    targets = torch.randint(0, vocab, (n,), generator=g)
    targets[torch.randperm(n, generator=g)[:n_ignored]] = -100
    return hidden, weight, targets


def _ce_grads(fn, hidden, weight, targets, upstream=1.0):
    h, w = _leaf(hidden), _leaf(weight)
    loss = fn(h, w, targets)
    dh, dw = torch.autograd.grad(loss * upstream, (h, w))
    return loss, dh, dw


def _naive(h, w, t, reduction="mean"):
    return F.cross_entropy(h @ w.T, t, reduction=reduction)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("chunk_size", [8, 64, None], ids=["chunk8", "chunk64", "default_chunk"])
def test_linear_ce_fp32_matches_naive(path, chunk_size):
    # 37 tokens (not a multiple of the chunk), vocabulary 203, 5 padding targets
    hidden, weight, targets = _ce_case(37, 24, 203, n_ignored=5)
    got = _ce_grads(lambda h, w, t: _linear_ce(path, h, w, t, chunk_size=chunk_size), hidden, weight, targets)
    want = _ce_grads(_naive, hidden, weight, targets)
    assert got[0].dtype == torch.float32 and got[0].shape == ()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **FP32)


@pytest.mark.parametrize("path", PATHS)
def test_linear_ce_sum_reduction_batched_shape_and_upstream_gradient(path):
    hidden, weight, targets = _ce_case(2 * 13, 16, 97, n_ignored=3, seed=1)
    hidden, targets = hidden.view(2, 13, 16), targets.view(2, 13)
    fn = lambda h, w, t: _linear_ce(path, h, w, t, chunk_size=10, reduction="sum")  # noqa: E731
    got = _ce_grads(fn, hidden, weight, targets, upstream=0.37)
    want = _ce_grads(lambda h, w, t: _naive(h.view(-1, 16), w, t.view(-1), "sum"), hidden, weight, targets, upstream=0.37)
    assert got[1].shape == (2, 13, 16)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **FP32)


@pytest.mark.parametrize("path", PATHS)
def test_linear_ce_bf16_close_to_fp32_maths(path):
    hidden, weight, targets = _ce_case(45, 32, 301, dtype=torch.bfloat16, n_ignored=4, seed=2)
    loss, dh, dw = _ce_grads(lambda h, w, t: _linear_ce(path, h, w, t, chunk_size=16), hidden, weight, targets)
    assert (loss.dtype, dh.dtype, dw.dtype) == (torch.float32, torch.bfloat16, torch.bfloat16)
    # Gold: the fp32 maths on the same bf16 inputs. Measured max errors, both paths: loss 4.2e-4,
    # dh 3.5e-4, dW 7e-4 (gradients up to 0.05 and 0.11). Eager bf16, F.cross_entropy on bf16
    # logits: loss 8.5e-3 (it returns a bf16 loss), dh 3.3e-4, dW 7e-4.
    gold = _ce_grads(_naive, hidden.float(), weight.float(), targets)
    torch.testing.assert_close(loss, gold[0], rtol=0, atol=5e-3)
    torch.testing.assert_close(dh.float(), gold[1], rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(dw.float(), gold[2], rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("path", PATHS)
def test_linear_ce_under_autocast_keeps_fp32_master_grads(path):
    """fp32 hidden and weight under bf16 autocast: bf16 matmuls, fp32 gradients for fp32 inputs."""
    hidden, weight, targets = _ce_case(30, 32, 150, n_ignored=2, seed=3)
    with torch.autocast(_device_type(path), dtype=torch.bfloat16):
        loss, dh, dw = _ce_grads(lambda h, w, t: _linear_ce(path, h, w, t, chunk_size=12), hidden, weight, targets)
    assert (loss.dtype, dh.dtype, dw.dtype) == (torch.float32,) * 3
    # Measured max errors: loss 1.2e-3, dh 5.6e-4, dW 1.1e-3 (Triton path; PyTorch path lower).
    gold = _ce_grads(_naive, hidden.bfloat16().float(), weight.bfloat16().float(), targets)
    torch.testing.assert_close(loss, gold[0], rtol=0, atol=5e-3)
    torch.testing.assert_close(dh, gold[1], rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(dw, gold[2], rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("path", PATHS)
def test_linear_ce_all_targets_ignored_gives_zero_not_nan(path):
    hidden, weight, targets = _ce_case(9, 8, 50, n_ignored=9, seed=4)
    assert torch.isnan(_naive(hidden, weight, targets))  # what PyTorch does, for the record
    loss, dh, dw = _ce_grads(lambda h, w, t: _linear_ce(path, h, w, t, chunk_size=4), hidden, weight, targets)
    assert loss.item() == 0.0
    assert not dh.any() and not dw.any()


@pytest.mark.parametrize("path", PATHS)
def test_linear_ce_no_grad_and_frozen_weight(path):
    hidden, weight, targets = _ce_case(20, 12, 64, n_ignored=2, seed=5)
    with torch.no_grad():
        loss = _linear_ce(path, hidden, weight, targets, chunk_size=7)
    torch.testing.assert_close(loss, _naive(hidden, weight, targets), **FP32)
    h = _leaf(hidden)
    loss = _linear_ce(path, h, weight, targets, chunk_size=7)
    loss.backward()
    h_ref = _leaf(hidden)
    _naive(h_ref, weight, targets).backward()
    torch.testing.assert_close(h.grad, h_ref.grad, **FP32)
    assert weight.grad is None


@pytest.mark.skipif(not INTERPRETER, reason="runs in the TRITON_INTERPRET=1 child of test_interpreter_subprocess")
def test_kernel_vocabulary_tiles_triton_path():
    """The kernel's online log-sum-exp over several vocabulary tiles (203 columns in tiles of 64)."""
    from depthcurse.train import triton_kernels

    g = torch.Generator().manual_seed(6)
    logits = torch.randn(7, 203, generator=g) * 4
    # A row whose first tile is far above the rest: exp of the gap overflows fp32 unless the
    # running maximum is carried from tile to tile.
    logits[6, :64] += 90
    logits[6, 64:] -= 90
    targets = torch.tensor([0, 202, -100, 64, 63, 128, 5])
    want_grad = logits.clone()
    want = kernels._cross_entropy_chunk_torch(want_grad, targets, -100)
    got_grad = logits.clone()
    got = triton_kernels.cross_entropy_chunk(got_grad, targets, -100, block=64)
    torch.testing.assert_close(got, want, **FP32)
    torch.testing.assert_close(got_grad, want_grad, **FP32)
    assert not got_grad[2].any() and got[2].item() == 0.0


def test_linear_ce_rejects_bad_input():
    hidden, weight, targets = _ce_case(6, 8, 20)
    with pytest.raises(DepthcurseError, match="target id 20 is outside the vocabulary"):
        kernels.fused_linear_cross_entropy(hidden, weight, torch.tensor([1, 2, 20, 3, 4, 5]))
    with pytest.raises(DepthcurseError, match="target id -1 is outside"):
        kernels.fused_linear_cross_entropy(hidden, weight, torch.tensor([1, 2, -1, 3, 4, 5]))
    with pytest.raises(DepthcurseError, match="5 targets for 6 hidden states"):
        kernels.fused_linear_cross_entropy(hidden, weight, targets[:5])
    with pytest.raises(DepthcurseError, match=r"expected \(vocab, 8\)"):
        kernels.fused_linear_cross_entropy(hidden, weight[:, :7], targets)
    with pytest.raises(DepthcurseError, match="integer token ids"):
        kernels.fused_linear_cross_entropy(hidden, weight, targets.float())
    with pytest.raises(DepthcurseError, match="chunk_size"):
        kernels.fused_linear_cross_entropy(hidden, weight, targets, chunk_size=0)
    with pytest.raises(DepthcurseError, match="reduction"):
        kernels.fused_linear_cross_entropy(hidden, weight, targets, reduction="none")


def test_linear_ce_gradients_serve_one_backward_only():
    hidden, weight, targets = _ce_case(6, 8, 20, seed=7)
    loss = kernels.fused_linear_cross_entropy(_leaf(hidden), _leaf(weight), targets)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward pass only"):
        loss.backward()


def test_default_chunk_size():
    # Logits of a chunk hold about as many values as the hidden states: 4096 * 256 / 49152 = 21.3
    # rows, raised to the 256-row floor; never more rows than there are tokens.
    assert kernels.default_chunk_size(4096, 256, 49152) == 256
    assert kernels.default_chunk_size(65536, 768, 32000) == 2048  # 1572.9 -> next power of two
    assert kernels.default_chunk_size(100, 768, 32000) == 100
    # on a GPU at least 2048 rows: smaller chunks cost a third more time there (docs/benchmarks.md)
    assert kernels.default_chunk_size(16384, 768, 32100, "cuda") == 2048
    assert kernels.default_chunk_size(65536, 768, 32000, "cuda") == 2048
    assert kernels.default_chunk_size(262144, 768, 32000, "cuda") == 8192


# --------------------------------------------------------------------------------------------
# The Triton path: compiled for a GPU here, run under the interpreter in a child process


def _signature(kernel, pointers: dict, scalars: dict, constexprs: dict) -> dict:
    sig = {**{k: f"*{v}" for k, v in pointers.items()}, **scalars, **{k: "constexpr" for k in constexprs}}
    assert sorted(sig) == sorted(kernel.arg_names), f"the test's signature of {kernel.__name__} is out of date"
    return sig


@pytest.mark.skipif(INTERPRETER, reason="needs the compiled (not interpreted) kernels")
def test_kernels_compile_for_an_h100(tmp_path, monkeypatch):
    """The interpreter runs plain Python and accepts code the compiler rejects; so compile every
    kernel variant for sm_90 (H100) down to a cubin, which Triton's own ptxas does without a GPU."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from depthcurse.train import triton_kernels as tk

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compile for real, leave nothing behind
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    cases = []
    for act, res in [("bf16", "bf16"), ("bf16", "fp32"), ("fp32", "fp32")]:
        r = "fp32" if "fp32" in (act, res) else "bf16"
        for y in sorted({r, "bf16"}):  # y in the stream's dtype, or in the matmuls' (out_dtype)
            for has_res in (True, False):
                cases.append((tk._rms_norm_fwd, dict(X=act, RES=res, R_OUT=r, Y=y, W="fp32", RSTD="fp32"),
                              dict(stride_x="i32", stride_res="i32", stride_r="i32", stride_y="i32", n_cols="i32", eps="fp32", scale="fp32"), dict(HAS_RES=has_res, BLOCK=1024), 4))
    for dt in ("bf16", "fp32"):
        for has_dr in (True, False):
            # an fp32 stream may get y's gradient in bf16, and give x's in bf16 too (HAS_LOW)
            for dy, has_low in [(dt, False)] + ([("bf16", False), ("bf16", True)] if dt == "fp32" else []):
                cases.append((tk._rms_norm_bwd, dict(DY=dy, DR=dt, R=dt, W="fp32", RSTD="fp32", DX=dt, DX_LOW="bf16" if has_low else dt, DW_PARTIAL="fp32"),
                              dict(stride_dy="i32", stride_dr="i32", stride_r="i32", stride_dx="i32", stride_low="i32", n_rows="i32", n_cols="i32", scale="fp32", rows_per_program="i32"),
                              dict(HAS_DR=has_dr, HAS_LOW=has_low, BLOCK=8192), 16))
        cases.append((tk._cross_entropy_fwd_bwd, dict(LOGITS=dt, TARGETS="i64", LOSS="fp32"), dict(stride_row="i32", n_cols="i32", ignore_index="i32"), dict(BLOCK=32768), 32))
    for kernel, pointers, scalars, constexprs, warps in cases:
        src = ASTSource(fn=kernel, signature=_signature(kernel, pointers, scalars, constexprs), constexprs=constexprs)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        assert compiled.asm["cubin"], kernel.__name__
        outputs = [pointers[k] for k in ("Y", "DX", "LOGITS") if k in pointers] + (["bf16"] if constexprs.get("HAS_LOW") else [])
        if "bf16" in outputs:
            assert "cvt.rn.bf16" in compiled.asm["ptx"]  # on a GPU, fp32 -> bf16 rounds to nearest even




@pytest.mark.skipif(INTERPRETER, reason="this is the child run itself")
def test_interpreter_subprocess():
    # every Triton-path parametrisation above: 4 + 2 + 1 + 1 + 1 + 1 norm cases, 3 + 1 + 1 + 1 + 1 + 1 + 1 loss cases
    under_triton_interpreter(__file__, "triton_path", expected=19)
