"""Fused kernels for pre-training: RMSNorm with the LNS scale (and the residual add before it),
and a linear + cross-entropy loss that never holds the full [tokens, vocab] logits.

Each function has two paths with the same maths: Triton kernels (`depthcurse.train.triton_kernels`)
and plain PyTorch. `use_triton=None` takes Triton for CUDA tensors and PyTorch elsewhere; `True`
insists on Triton (on CPU tensors this needs Triton's interpreter, `TRITON_INTERPRET=1` set before
the first Triton call); `False` insists on PyTorch.

In a pre-LN block with LNS (s_l = 1/sqrt(l), l the layer's original 1-based index), each norm takes
the residual add before it, so the stream is read and written once per norm:

    a_in = rms_norm(h, attn_norm.weight, eps, s_1)                     # first block: no add yet
    m_in, h = rms_norm(attn(a_in), mlp_norm.weight, eps, s_l, residual=h)   # h += attn; norm
    a_in, h = rms_norm(mlp(m_in), next_attn_norm.weight, eps, s_l1, residual=h)
    ...
    out, h = rms_norm(mlp(m_in), final_norm.weight, eps, 1.0, residual=h)  # final norm: no LNS
    loss = fused_linear_cross_entropy(out, lm_head.weight, targets)

RMSNorm with LayerNorm Scaling, and its backward
------------------------------------------------
Forward, per row of d values (r = x + residual when a residual is given, else r = x):

    rstd = 1 / sqrt(mean(r^2) + eps),   r_hat = r * rstd,   y = s * w * r_hat

with w the learnable gain and s the LNS factor 1/sqrt(l), a plain float. Backward, with g = s * w * dy:

    dr = rstd * (g - r_hat * mean(g * r_hat))   (+ the gradient arriving at the returned r)
    dw = s * sum over rows of dy * r_hat

Why: r_hat depends on every element of its row through rstd. Differentiating r * rstd gives the
direct term rstd * g plus, through d rstd / d r = -rstd^3 * r / d, a correction along r_hat itself;
the correction removes the part of g that would only change the row's scale, which the norm
undoes anyway. Only r and rstd (one float per row) are saved: r_hat is recomputed, cheaper than
storing it. x and residual enter only through their sum, so both receive dr. dw sums over every
row; the kernel keeps one fp32 partial sum per program and adds them afterwards (no atomics, so
results are deterministic).

Linear + cross-entropy, and its backward
----------------------------------------
loss_i = logsumexp(z_i) - z_i[t_i] with z_i = W h_i, averaged over the rows whose target is not
`ignore_index`. Its gradient is closed-form:

    d loss_i / d z_i = softmax(z_i) - onehot(t_i),   dh_i = W^T dz_i,   dW = sum_i dz_i h_i^T

so the gradient is known the moment the logits are. We therefore compute it in the forward pass,
chunk by chunk: a chunk's logits are turned into their gradient in place, used for the chunk's
dh and its share of dW, and freed. Only [chunk, V] logits ever exist instead of [N, V], and the
backward pass just scales the saved dh and dW by the incoming gradient (1 for a plain
`loss.backward()`). The cost is holding dh [N, d] and dW [V, d] (fp32) from forward to backward,
memory that autograd would need anyway. This is the approach of Liger-Kernel's
FusedLinearCrossEntropy.
"""

from __future__ import annotations

import importlib.util
import math
import os
from typing import Optional

import torch
import torch.nn.functional as F

from depthcurse.errors import DepthcurseError


# Looked up once: a module constant also keeps torch.compile from tracing into importlib.
_HAVE_TRITON = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    return _HAVE_TRITON


def _triton_module():
    # lazy: triton is optional, and importing it fixes the interpreter-or-GPU mode for the process
    from depthcurse.train import triton_kernels

    return triton_kernels


def _use_triton(flag: bool | None, tensor: torch.Tensor) -> bool:
    if flag is None:
        return tensor.is_cuda and triton_available()
    if not flag:
        return False
    if not triton_available():
        raise DepthcurseError("use_triton=True needs the triton package: pip install triton (or pass use_triton=False)")
    if not tensor.is_cuda:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise DepthcurseError("Triton kernels need CUDA tensors; to run them on the CPU set TRITON_INTERPRET=1 before the first Triton call, or pass use_triton=False")
        if not _triton_module().INTERPRETED:
            raise DepthcurseError("the Triton kernels were loaded before TRITON_INTERPRET=1 was set: set it at the start of the process, or pass use_triton=False")
    return True


def _check_scale(scale) -> float:
    # A float on purpose: a tensor or buffer factor can be wiped by meta-device init (to_empty),
    # silently turning LNS off (see the paper notes).
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise DepthcurseError(f"the norm scale must be a finite Python float, got {scale!r}")
    return float(scale)


# --------------------------------------------------------------------------------------------
# RMSNorm (+ residual add) with the LNS scale


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, scale: float = 1.0, residual: torch.Tensor | None = None,
             use_triton: bool | None = None, out_dtype: torch.dtype | None = None):
    """`s * w * r / sqrt(mean(r^2) + eps)` over the last dimension, with r = x (+ residual).

    Without `residual` returns y. With it returns (y, r): the block's residual add and the next
    norm in one pass, r being the new residual stream. r has the promoted dtype of x and residual,
    and y has r's dtype, or `out_dtype`; the arithmetic is fp32 throughout, rounded once on output.
    Why `out_dtype`: under autocast a norm feeding a matmul is cast to bf16 right after; written
    in bf16 at once, y is the same and skips a pass over fp32 values each way.
    """
    scale = _check_scale(scale)
    d = x.shape[-1]
    if weight.shape != (d,):
        raise DepthcurseError(f"the norm weight has shape {tuple(weight.shape)}, expected ({d},) for inputs of width {d}")
    if residual is not None and residual.shape != x.shape:
        raise DepthcurseError(f"the residual has shape {tuple(residual.shape)}, expected {tuple(x.shape)} like x")
    if _use_triton(use_triton, x) and x.numel() > 0:
        tk = _triton_module()
        if d > tk.MAX_FUSED_SIZE:
            if use_triton:
                raise DepthcurseError(f"the Triton RMSNorm keeps a row in registers, at most {tk.MAX_FUSED_SIZE} values; got {d}: pass use_triton=False")
        else:
            d2 = (-1, d)
            norm = _triton_norm_op if torch.compiler.is_compiling() else _TritonNormEager.apply
            y, r, _ = norm(x.reshape(d2).contiguous(), None if residual is None else residual.reshape(d2).contiguous(), weight.contiguous(), eps, scale, out_dtype)
            return y.view(x.shape) if residual is None else (y.view(x.shape), r.view(x.shape))
    return _rms_norm_torch(x, weight, eps, scale, residual, out_dtype)


def _rms_norm_torch(x, weight, eps, scale, residual, out_dtype=None):
    r = x if residual is None else x + residual
    y = (F.rms_norm(r.float(), (r.shape[-1],), weight.float(), eps) * scale).to(out_dtype or r.dtype)
    return y if residual is None else (y, r)


def _triton_norm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float, scale: float,
                 out_dtype: Optional[torch.dtype]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, residual: [rows, d], rows contiguous. (y, r, rstd); r is empty without a residual (it
    would be x itself, and an operator's output may not alias its input)."""
    y, r, rstd = _triton_module().rms_norm_forward(x, residual, weight, eps, scale, out_dtype)
    return y, (r if residual is not None else x.new_empty(0)), rstd


# Inside compiled code the Triton norm is a custom operator, forward and backward, with its output
# shapes declared (`register_fake`): the compiled blocks call it as one opaque kernel within their
# graph, where dynamo would break the graph at a Python function launching Triton. The names carry
# a version, to be raised with any change of arguments: inductor's on-disk cache knows compiled
# code by the operators' names, and served code calling the old arguments after a change.
OPS_VERSION = 1
_triton_norm_op = torch.library.custom_op(f"depthcurse::rms_norm_triton_v{OPS_VERSION}", _triton_norm, mutates_args=())


@_triton_norm_op.register_fake
def _(x, residual, weight, eps, scale, out_dtype):
    r_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    r = x.new_empty(x.shape if residual is not None else (0,), dtype=r_dtype)
    return x.new_empty(x.shape, dtype=out_dtype or r_dtype), r, x.new_empty(x.shape[:1], dtype=torch.float32)


@torch.library.custom_op(f"depthcurse::rms_norm_triton_backward_v{OPS_VERSION}", mutates_args=())
def _triton_norm_backward(dy: torch.Tensor, dr: Optional[torch.Tensor], r: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, scale: float,
                          low_dtype: Optional[torch.dtype]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d r, d r in `low_dtype` or empty, d weight): d r in r's dtype (it is also d residual), d weight in fp32."""
    dx, dx_low, dw = _triton_module().rms_norm_backward(dy, dr, r, weight, rstd, scale, low_dtype)
    return dx, (dx_low if dx_low is not None else r.new_empty(0)), dw


@_triton_norm_backward.register_fake
def _(dy, dr, r, weight, rstd, scale, low_dtype):
    low = torch.empty_like(r, dtype=low_dtype) if low_dtype is not None else r.new_empty(0)
    return torch.empty_like(r), low, weight.new_empty(weight.shape, dtype=torch.float32)


def _triton_norm_save(ctx, inputs, output):
    x, residual, weight, _eps, scale, _out_dtype = inputs
    ctx.save_for_backward(x if residual is None else output[1], weight, output[2])
    ctx.scale = scale
    ctx.dtypes = (x.dtype, None if residual is None else residual.dtype)


def _triton_norm_grad(ctx, dy, dr, _drstd):
    r, weight, rstd = ctx.saved_tensors
    dy = torch.zeros_like(r) if dy is None else dy.contiguous()
    dr = None if dr is None or dr.numel() == 0 else dr.contiguous()  # empty: the placeholder r
    x_dtype, res_dtype = ctx.dtypes
    # x's gradient in x's own dtype from the same pass, where it is lower than the stream's
    low = x_dtype if x_dtype.itemsize < r.dtype.itemsize else None
    dr_total, dx_low, dw = _triton_norm_backward(dy, dr, r, weight, rstd, ctx.scale, low)
    d_res = None if res_dtype is None else dr_total.to(res_dtype)
    return (dx_low if low is not None else dr_total.to(x_dtype)), d_res, dw.to(weight.dtype), None, None, None


_triton_norm_op.register_autograd(_triton_norm_grad, setup_context=_triton_norm_save)


class _TritonNormEager(torch.autograd.Function):
    """The same forward and backward for eager code, where a custom operator's autograd costs
    about 50 us more per norm (forward and backward, measured on a CPU) than an autograd.Function."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, scale, out_dtype):
        out = _triton_norm(x, residual, weight, eps, scale, out_dtype)
        _triton_norm_save(ctx, (x, residual, weight, eps, scale, out_dtype), out)
        ctx.set_materialize_grads(False)
        return out

    backward = staticmethod(_triton_norm_grad)


# --------------------------------------------------------------------------------------------
# Chunked linear + cross-entropy


#: Fewest rows per chunk. On an H100, bf16, 16k tokens x 768 x 32k vocabulary
#: (benchmarks/train/kernels.py): 512-row chunks took 1.35x the naive loss's time, 2048-row chunks
#: 1.05x at 0.11x its memory. A CPU core is saturated by far smaller matmuls.
MIN_CHUNK_ROWS = {"cuda": 2048, "cpu": 256}


def default_chunk_size(n_tokens: int, hidden_size: int, vocab_size: int, device_type: str = "cpu") -> int:
    """Rows per chunk so that a chunk's logits take about as many values as the hidden states
    (the memory the loss adds stays at the size of its input), rounded up to a power of two, at
    least MIN_CHUNK_ROWS so each matmul stays efficient, at most all the tokens."""
    rows = math.ceil(n_tokens * hidden_size / vocab_size)
    floor = MIN_CHUNK_ROWS.get(device_type, MIN_CHUNK_ROWS["cuda"])
    return max(1, min(n_tokens, max(floor, 1 << (rows - 1).bit_length())))


# Eager even inside torch.compile: dynamo would unroll the chunk loop (and stop at the target
# check's sync), and the work is matmuls that compilation cannot speed up.
@torch.compiler.disable
def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100, chunk_size: int | None = None, reduction: str = "mean", use_triton: bool | None = None) -> torch.Tensor:
    """`F.cross_entropy(hidden @ weight.T, targets)` without the full logits in memory.

    hidden [..., d], weight [V, d] (an lm_head without bias), targets [...] of token ids. Rows
    whose target is `ignore_index` count for nothing; "mean" divides by the number of the other
    rows, and gives 0 (with zero gradients) when every row is ignored, where PyTorch gives NaN.
    The loss is fp32. The matmuls run in hidden's dtype, or in the autocast dtype when autocast
    is on; softmax and loss are fp32 and dW is accumulated in fp32 over the chunks.
    """
    d = hidden.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != d:
        raise DepthcurseError(f"the output weight has shape {tuple(weight.shape)}, expected (vocab, {d}) for hidden states of width {d}")
    hidden2 = hidden.reshape(-1, d)
    targets = targets.reshape(-1)
    if targets.numel() != hidden2.shape[0]:
        raise DepthcurseError(f"{targets.numel()} targets for {hidden2.shape[0]} hidden states: they must match one to one")
    if hidden2.shape[0] == 0:
        raise DepthcurseError("no tokens to compute a loss on")
    if targets.dtype not in (torch.int64, torch.int32):
        raise DepthcurseError(f"targets must be integer token ids, got {targets.dtype}")
    if reduction not in ("mean", "sum"):
        raise DepthcurseError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if chunk_size is not None and chunk_size < 1:
        raise DepthcurseError(f"chunk_size must be at least 1, got {chunk_size}")
    vocab = weight.shape[0]
    # A bad id would read out of bounds in the kernel. On a GPU the check is an assertion on the
    # device, which stops the process at its next sync: reading the answer here would wait for
    # the GPU in every call, once per micro-batch in training.
    outside = ((targets < 0) | (targets >= vocab)) & (targets != ignore_index)
    if targets.device.type != "cpu":
        torch._assert_async(~outside.any(), f"a target id is outside the vocabulary [0, {vocab}) and is not ignore_index ({ignore_index})")
    elif bool(outside.any()):
        bad = targets[outside][0].item()
        raise DepthcurseError(f"target id {bad} is outside the vocabulary [0, {vocab}) and is not ignore_index ({ignore_index})")
    targets = targets.to(torch.int64).contiguous()
    triton_path = _use_triton(use_triton, hidden)
    chunk = chunk_size or default_chunk_size(hidden2.shape[0], d, vocab, hidden2.device.type)
    args = (hidden2, weight, targets, ignore_index, chunk, reduction, triton_path)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _FusedLinearCrossEntropy.apply(*args)
    return _linear_cross_entropy(*args, need_dh=False, need_dw=False)[0]


def _cross_entropy_chunk_torch(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """The PyTorch twin of `triton_kernels.cross_entropy_chunk`: per-row loss, gradient in place."""
    z = logits.float()  # the logits themselves when they are fp32
    lse = torch.logsumexp(z, dim=-1)
    valid = targets != ignore_index
    safe = torch.where(valid, targets, 0)
    loss = torch.where(valid, lse - z.gather(1, safe[:, None]).squeeze(1), 0.0)
    grad = z.sub_(lse[:, None]).exp_()
    grad.scatter_add_(1, safe[:, None], torch.full_like(lse[:, None], -1.0))
    grad.mul_(valid[:, None])
    if grad is not logits:
        logits.copy_(grad)
    return loss


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(t.device.type):
        return torch.get_autocast_dtype(t.device.type)
    return t.dtype


def _linear_cross_entropy(hidden, weight, targets, ignore_index, chunk, reduction, triton_path, need_dh, need_dw):
    """Loss and, when asked, its gradients for hidden [N, d] and weight [V, d]."""
    n, d = hidden.shape
    dtype = _compute_dtype(hidden)
    # Our own casts below are the whole mixed-precision policy; autocast would re-cast each matmul.
    with torch.autocast(hidden.device.type, enabled=False):
        w = weight.to(dtype)
        ce_chunk = _triton_module().cross_entropy_chunk if triton_path else _cross_entropy_chunk_torch
        losses = torch.empty(n, dtype=torch.float32, device=hidden.device)
        dh = torch.empty(n, d, dtype=hidden.dtype, device=hidden.device) if need_dh else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=hidden.device) if need_dw else None
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            h = hidden[start:end].to(dtype)
            logits = h @ w.T
            losses[start:end] = ce_chunk(logits, targets[start:end], ignore_index)
            # `logits` now holds d(sum of the chunk's losses) / d(logits).
            if need_dh:
                if dh.dtype == dtype:
                    torch.mm(logits, w, out=dh[start:end])
                else:  # fp32 hidden states under autocast
                    dh[start:end] = logits @ w
            if need_dw:
                if dtype == torch.float32:
                    dw.addmm_(logits.T, h)
                else:  # a bf16/fp16 product per chunk, summed over the chunks in fp32
                    dw += logits.T @ h
            del logits  # before the next chunk's matmul, or two chunks' logits coexist at the peak
        total = losses.sum()
        if reduction == "mean":
            # No sync: an all-ignored batch divides 0 by 1 instead of raising or giving NaN.
            denom = (targets != ignore_index).sum().clamp(min=1)
            total = total / denom
            if need_dh:
                dh.div_(denom)
            if need_dw:
                dw.div_(denom)
    return total, dh, dw


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, chunk, reduction, triton_path):
        loss, dh, dw = _linear_cross_entropy(hidden, weight, targets, ignore_index, chunk, reduction, triton_path, need_dh=hidden.requires_grad, need_dw=weight.requires_grad)
        ctx.grads = (dh, None if dw is None else dw.to(weight.dtype))
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.grads is None:
            raise RuntimeError("fused_linear_cross_entropy keeps its gradients for one backward pass only (retain_graph is not supported)")
        dh, dw = ctx.grads
        ctx.grads = None  # scaled in place below, so a second use would be wrong
        if dh is not None:
            dh.mul_(grad_loss)
        if dw is not None:
            dw.mul_(grad_loss)
        return dh, dw, None, None, None, None, None
