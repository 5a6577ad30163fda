"""Triton device code behind `depthcurse.train.kernels`: RMSNorm (+ residual add, + LNS scale) and a
cross-entropy pass over one chunk of logits.

Import this module only through `depthcurse.train.kernels`, which decides when Triton is used. Triton
picks compiled kernels or its CPU interpreter when the `@triton.jit` decorators run, that is when
this module is first imported: `TRITON_INTERPRET=1` must be set before that. `INTERPRETED` says
which mode this process got.

Every kernel computes in fp32 whatever the storage dtype, and rounds once on the store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs

INTERPRETED = bool(knobs.runtime.interpret)

# One program holds a whole row in registers; past this the row no longer fits (Triton's
# block limit), and the callers fall back to PyTorch or say so.
MAX_FUSED_SIZE = 65536


def _num_warps(block: int) -> int:
    # More warps for wider rows, so each thread keeps a handful of elements (the usual
    # choice of the Triton tutorials, Apex and Liger).
    if block >= 32768:
        return 32
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    return 4


# The norm's backward runs this many programs per SM, each looping over a slice of rows and
# keeping one partial sum of the weight's gradient (benchmarks/train/norm_kernels.py weighs it).
BACKWARD_PROGRAMS_PER_SM = 1


def _programs_for(device: torch.device) -> int:
    # The interpreter gains nothing from more than a few programs.
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count * BACKWARD_PROGRAMS_PER_SM
    return 4


# --------------------------------------------------------------------------------------------
# RMSNorm: y = scale * w * r * rstd, r = x (+ residual), rstd = 1 / sqrt(mean(r^2) + eps)


@triton.jit
def _rms_norm_fwd(X, RES, R_OUT, Y, W, RSTD, stride_x, stride_res, stride_r, stride_y, n_cols, eps, scale, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    r = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r += tl.load(RES + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        # Round the sum to the residual stream's dtype before normalising: the norm must see the
        # very r that is returned (and saved for backward), as `x + residual` in eager PyTorch.
        r = r.to(R_OUT.dtype.element_ty)
        tl.store(R_OUT + row * stride_r + cols, r, mask=mask)
        r = r.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(r * r, axis=0) / n_cols + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (r * rstd * (w * scale)).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit
def _rms_norm_bwd(DY, DR, R, W, RSTD, DX, DX_LOW, DW_PARTIAL, stride_dy, stride_dr, stride_r, stride_dx, stride_low, n_rows, n_cols, scale, rows_per_program,
                  HAS_DR: tl.constexpr, HAS_LOW: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32) * scale
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    # Pointers advance by a row each step: 64-bit pointer arithmetic, no int32 row * stride overflow.
    first = row_start.to(tl.int64)
    R += first * stride_r
    DY += first * stride_dy
    DR += first * stride_dr
    DX += first * stride_dx
    DX_LOW += first * stride_low
    for row in range(row_start, row_end):
        r = tl.load(R + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        r_hat = r * rstd
        g = dy * w
        dx = rstd * (g - r_hat * (tl.sum(g * r_hat, axis=0) / n_cols))
        if HAS_DR:
            dx += tl.load(DR + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + cols, dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_LOW:  # the same gradient for a lower-precision x (a bf16 branch output added to an fp32 stream)
            tl.store(DX_LOW + cols, dx.to(DX_LOW.dtype.element_ty), mask=mask)
        dw += dy * r_hat
        R += stride_r
        DY += stride_dy
        DR += stride_dr
        DX += stride_dx
        DX_LOW += stride_low
    # One partial sum per program; the caller adds the programs' rows (deterministic, no atomics).
    tl.store(DW_PARTIAL + pid * n_cols + cols, dw * scale, mask=mask)


def rms_norm_forward(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, scale: float, out_dtype: torch.dtype | None = None):
    """x, residual: [rows, d] with unit column stride. Returns (y, r, rstd); r is x without
    residual; y in `out_dtype`, by default r's."""
    n_rows, n_cols = x.shape
    block = triton.next_power_of_2(n_cols)
    r_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    r = x if residual is None else torch.empty(n_rows, n_cols, dtype=r_dtype, device=x.device)
    y = torch.empty(n_rows, n_cols, dtype=out_dtype or r_dtype, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    res = x if residual is None else residual  # a placeholder pointer when HAS_RES is off
    _rms_norm_fwd[(n_rows,)](
        x, res, r, y, weight, rstd, x.stride(0), res.stride(0), r.stride(0), y.stride(0), n_cols, eps, scale,
        HAS_RES=residual is not None, BLOCK=block, num_warps=_num_warps(block),
    )
    return y, r, rstd


def rms_norm_backward(dy: torch.Tensor, dr: torch.Tensor | None, r: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, scale: float,
                      low_dtype: torch.dtype | None = None):
    """Returns (dx, dx_low, dw): dx in r's dtype (it is also d/d residual), the same in
    `low_dtype` (None without it: one store in the same pass instead of a cast after), dw in fp32."""
    n_rows, n_cols = r.shape
    block = triton.next_power_of_2(n_cols)
    rows_per_program = triton.cdiv(n_rows, _programs_for(r.device))
    n_programs = triton.cdiv(n_rows, rows_per_program)
    dx = torch.empty_like(r)
    dx_low = None if low_dtype is None else torch.empty_like(r, dtype=low_dtype)
    low = dx if dx_low is None else dx_low  # a placeholder pointer when HAS_LOW is off
    dw_partial = torch.empty(n_programs, n_cols, dtype=torch.float32, device=r.device)
    dr_ = dy if dr is None else dr
    _rms_norm_bwd[(n_programs,)](
        dy, dr_, r, weight, rstd, dx, low, dw_partial, dy.stride(0), dr_.stride(0), r.stride(0), dx.stride(0), low.stride(0),
        n_rows, n_cols, scale, rows_per_program, HAS_DR=dr is not None, HAS_LOW=dx_low is not None, BLOCK=block, num_warps=_num_warps(block),
    )
    return dx, dx_low, dw_partial.sum(0)


# --------------------------------------------------------------------------------------------
# Cross-entropy over one chunk of logits, gradient written in place


@triton.jit
def _cross_entropy_fwd_bwd(LOGITS, TARGETS, LOSS, stride_row, n_cols, ignore_index, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    LOGITS += row * stride_row
    target = tl.load(TARGETS + row)
    if target == ignore_index:
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            tl.store(LOGITS + cols, tl.zeros([BLOCK], dtype=tl.float32).to(LOGITS.dtype.element_ty), mask=cols < n_cols)
        tl.store(LOSS + row, 0.0)
        return

    # Pass 1: log-sum-exp with a running maximum (online softmax), one block of the vocabulary
    # at a time, so a row of any width streams through registers once.
    m = float("-inf")
    s = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = tl.load(LOGITS + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    # Read the target's logit before pass 2 overwrites it.
    loss = lse - tl.load(LOGITS + target).to(tl.float32)

    # Pass 2: d loss / d logits = softmax - onehot(target), over the logits themselves.
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        z = tl.load(LOGITS + cols, mask=mask, other=0.0).to(tl.float32)
        grad = tl.exp(z - lse) - tl.where(cols == target, 1.0, 0.0)
        tl.store(LOGITS + cols, grad.to(LOGITS.dtype.element_ty), mask=mask)
    tl.store(LOSS + row, loss)


def cross_entropy_chunk(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, block: int | None = None) -> torch.Tensor:
    """Per-row loss (fp32, 0 for ignored rows); `logits` [rows, V] is overwritten with
    d(sum of the losses)/d(logits). `block` (a power of two) overrides the vocabulary tile."""
    n_rows, n_cols = logits.shape
    block = block or min(MAX_FUSED_SIZE // 2, triton.next_power_of_2(n_cols))
    loss = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    _cross_entropy_fwd_bwd[(n_rows,)](logits, targets, loss, logits.stride(0), n_cols, ignore_index, BLOCK=block, num_warps=_num_warps(block))
    return loss
