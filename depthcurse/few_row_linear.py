"""A linear layer over a few rows that reads each weight once: speculate's check of gamma + 1 tokens.

A decoding step multiplies one row by every weight, a check of 5 tokens 5 rows. Both are bound by
the weights' bytes, so at the bytes' floor a check costs one step. On a CPU torch's linear (MKL's
sgemm) takes 1.75-2x a row's time at 4-8 rows, so the check cost 1.64 decoding steps of
SmolLM2-135M in fp32. The kernel in `few_row_linear.cpp` multiplies every row by a weight row while
that row is in cache and fetches the rows after it ahead of use: 1.18-1.32x a row's time at 4-6
rows, and the check 1.28 steps (docs/benchmarks.md, "A check near one decoding step").

It is C++, compiled on first use for this CPU (`kernel_build`) and used only after it equals
torch's linear on a test of its own. Where no compiler works or the test fails, torch's linear is
used and `status()` says why; `DEPTHCURSE_FEW_ROW_KERNEL=0` keeps torch's linear. Every output row
is summed in the same order whatever the number of rows, so a row's result does not depend on the
rows beside it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from depthcurse import kernel_build
from depthcurse.kernel_build import Kernel

SOURCE = Path(__file__).with_suffix(".cpp")
ROWS = range(2, 9)  # what the kernel's register blocks are written for; one row is torch's GEMV, which already streams the weights
NO_LAYER = "torch's linear (no plain fp32 linear layer on the CPU for the few-row kernel)"


def bind(library: ctypes.CDLL) -> None:
    library.few_row_linear.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]  # x, w, y; R, K, N; threads
    library.few_row_linear.restype = ctypes.c_int


def self_test(library: ctypes.CDLL) -> str | None:
    """Why the library cannot be used (its rows differ from torch's linear), or None. The shapes have
    a remainder past the vectors' width and past the weight rows' blocks."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 45, generator=g)
    for rows in ROWS:
        x = torch.randn(rows, 45, generator=g)
        got, want = torch.empty(rows, 37), F.linear(x, w)
        library.few_row_linear(x.data_ptr(), w.data_ptr(), got.data_ptr(), rows, 45, 37, kernel_build.threads_for(w.numel()))
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
            return f"it differs from torch's linear at {rows} rows (by up to {(got - want).abs().max().item():.3g})"
    return None


@functools.lru_cache(maxsize=1)
def kernel() -> Kernel:
    """This process's kernel, built or found once (`kernel_build.prepare`)."""
    return kernel_build.prepare(SOURCE, "DEPTHCURSE_FEW_ROW_KERNEL", "few-row kernel", "torch's linear (its own GEMM at 2-8 rows)",
                                "depthcurse's few-row kernel at 2-8 rows (each weight read once for all rows), torch's linear otherwise",
                                bind, self_test)


def status() -> str:
    return kernel().words


def _layer_forward(layer: nn.Linear):
    """`layer`'s forward by the kernel at 2-8 rows: its weight's case checked once here (`_streams`),
    each input's at each call, in as few steps as can be (a check runs some 200 layers: a microsecond
    a call is about 1% of it)."""
    weight, bias, width, n = layer.weight, layer.bias, layer.in_features, layer.out_features
    call, threads_for = kernel().library.few_row_linear, kernel_build.threads_for
    params = [weight, *([bias] if bias is not None else [])]

    def forward(x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):  # the kernel has no backward
            return F.linear(x, weight, bias)
        if x.dtype is torch.float32 and x.is_cpu and x.dim() and x.shape[-1] == width:
            rows = x.numel() // width
            if rows in ROWS:
                x = x if x.is_contiguous() else x.contiguous()
                out = torch.empty(x.shape[:-1] + (n,))
                call(x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, width, n, threads_for(width * n))  # the pointer read now: `.data` may be swapped
                return out if bias is None else out.add_(bias)
        return F.linear(x, weight, bias)

    return forward


def _streams(layer: nn.Module) -> bool:
    """Whether `layer`'s forward can be the kernel's: a plain fp32 `nn.Linear` on the CPU, its weight
    contiguous, its forward not replaced (accelerate's offloading hooks, an enclosing `few_row_kernel`)."""
    if type(layer) is not nn.Linear or "forward" in vars(layer) or hasattr(layer, "_hf_hook"):
        return False
    params = [layer.weight, *([layer.bias] if layer.bias is not None else [])]
    return all(p.dtype == torch.float32 and p.device.type == "cpu" for p in params) and layer.weight.is_contiguous()


@contextlib.contextmanager
def few_row_kernel(model: nn.Module):
    """`model` with its fp32 `nn.Linear` layers computed by the kernel at 2-8 rows inside the block
    (`_streams` says which layers; a subclass, LoRA's or a quantised one, is left as it is). Gives
    the words `status()` gives, or `NO_LAYER` where no layer is one the kernel takes (then nothing is
    built)."""
    layers = [m for m in model.modules() if _streams(m)]
    said = NO_LAYER  # a model on a GPU, or in bf16: nothing to build the kernel for
    if layers:
        built = kernel()
        said, layers = built.words, layers if built.library is not None else []
    for m in layers:
        m.forward = _layer_forward(m)
    try:
        yield said
    finally:
        for m in layers:
            vars(m).pop("forward", None)
