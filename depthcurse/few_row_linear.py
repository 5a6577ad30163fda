"""A linear layer over a few rows that reads each weight once: speculate's check of gamma + 1 tokens.

A decoding step multiplies one row by every weight, a check of 5 tokens 5 rows. Both are bound by
the weights' bytes, so at the bytes' floor a check costs one step. On a CPU torch's linear (MKL's
sgemm) takes 1.75-2x a row's time at 4-8 rows, so the check cost 1.64 decoding steps of
SmolLM2-135M in fp32. The kernel in `few_row_linear.cpp` multiplies every row by a weight row while
that row is in cache and fetches the rows after it ahead of use: 1.18-1.32x a row's time at 4-6
rows, and the check 1.28 steps (docs/benchmarks.md, "A check near one decoding step").

It is C++, compiled on first use for this CPU (`-march=native`; OpenMP, whose runtime is torch's
own, loaded before it) into the cache (`$DEPTHCURSE_CACHE/kernels`), under a name made of its
source, the compile command and the CPU, so a cache shared by machines never hands one another's
build. It is used only after it equals torch's linear on a test of its own. Where no compiler
works or the test fails, torch's linear is used and `status()` says why; `DEPTHCURSE_FEW_ROW_KERNEL=0`
keeps torch's linear. Every output row is summed in the same order whatever the number of rows, so
a row's result does not depend on the rows beside it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from depthcurse.assets.cache import cache_dir
from depthcurse.io import cpu_fields, cpu_model

SOURCE = Path(__file__).with_suffix(".cpp")
ROWS = range(2, 9)  # what the kernel's register blocks are written for; one row is torch's GEMV, which already streams the weights
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
COMPILE_SECONDS = 300
NO_LAYER = "torch's linear (no plain fp32 linear layer on the CPU for the few-row kernel)"


class Kernel(NamedTuple):
    """The loaded library, or None, and what is used, in words (the records say it)."""

    library: ctypes.CDLL | None
    words: str


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def build_name(source: str, command: list[str]) -> str:
    """The library's file name: another source, compile command or CPU (its model and its instruction
    sets: x86's flags, ARM's features) is another file."""
    fields = cpu_fields()
    flags = fields.get("flags") or fields.get("Features") or platform.processor()
    key = "\n".join([source, " ".join(command), platform.machine(), cpu_model(), flags])
    return f"few_row_linear-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"


def build(source: Path | None = None, folder: Path | None = None) -> Path:
    """The compiled library for this CPU, compiled now unless the cache has it; RuntimeError with the
    compiler's first line of complaint where it cannot be."""
    source = source or SOURCE
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (c++, g++ or clang++ on PATH, or CXX)")
    folder = folder or cache_dir() / "kernels"
    target = folder / build_name(source.read_text(), [cxx, *FLAGS])
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:  # beside the target: a rank compiling at once never reads half a file
        built = Path(tmp) / target.name
        try:
            done = subprocess.run([cxx, *FLAGS, "-o", str(built), str(source)], capture_output=True, text=True, timeout=COMPILE_SECONDS)
        except OSError as e:  # CXX names no program, or one that cannot run
            raise RuntimeError(f"{cxx} cannot be run ({e.strerror or e})") from e
        if done.returncode != 0:
            said = (done.stderr.strip() or done.stdout.strip() or f"exit {done.returncode}").splitlines()[0]
            raise RuntimeError(f"{Path(cxx).name} failed: {said}")
        os.replace(built, target)
    return target


def load(path: Path) -> ctypes.CDLL:
    library = ctypes.CDLL(str(path))
    library.few_row_linear.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]  # x, w, y; R, K, N; threads
    library.few_row_linear.restype = ctypes.c_int
    return library


def self_test(library: ctypes.CDLL) -> str | None:
    """Why the library cannot be used (its rows differ from torch's linear), or None. The shapes have
    a remainder past the vectors' width and past the weight rows' blocks."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 45, generator=g)
    for rows in ROWS:
        x = torch.randn(rows, 45, generator=g)
        got, want = torch.empty(rows, 37), F.linear(x, w)
        library.few_row_linear(x.data_ptr(), w.data_ptr(), got.data_ptr(), rows, 45, 37, torch.get_num_threads())
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
            return f"it differs from torch's linear at {rows} rows (by up to {(got - want).abs().max().item():.3g})"
    return None


@functools.lru_cache(maxsize=1)
def kernel() -> Kernel:
    """This process's kernel, built or found once."""
    torchs = "torch's linear (its own GEMM at 2-8 rows)"
    if os.environ.get("DEPTHCURSE_FEW_ROW_KERNEL") == "0":
        return Kernel(None, f"{torchs}: DEPTHCURSE_FEW_ROW_KERNEL=0")
    try:
        library = load(build())
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:  # OSError: the library would not load
        return Kernel(None, f"{torchs}: the few-row kernel could not be built or loaded ({e})")
    why = self_test(library)
    if why is not None:
        return Kernel(None, f"{torchs}: the few-row kernel was built but {why}")
    return Kernel(library, "depthcurse's few-row kernel at 2-8 rows (each weight read once for all rows), torch's linear otherwise")


def status() -> str:
    return kernel().words


def _layer_forward(layer: nn.Linear):
    """`layer`'s forward by the kernel at 2-8 rows: its weight's case checked once here (`_streams`),
    each input's at each call, in as few steps as can be (a check runs some 200 layers: a microsecond
    a call is about 1% of it)."""
    weight, bias, width, n = layer.weight, layer.bias, layer.in_features, layer.out_features
    call = kernel().library.few_row_linear
    params = [weight, *([bias] if bias is not None else [])]

    def forward(x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):  # the kernel has no backward
            return F.linear(x, weight, bias)
        if x.dtype is torch.float32 and x.is_cpu and x.dim() and x.shape[-1] == width:
            rows = x.numel() // width
            if rows in ROWS:
                x = x if x.is_contiguous() else x.contiguous()
                out = torch.empty(x.shape[:-1] + (n,))
                call(x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, width, n, torch.get_num_threads())  # the pointer read now: `.data` may be swapped
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
