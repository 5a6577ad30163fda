"""Where and in what precision a model runs: the device and dtype choice every command shares."""

from __future__ import annotations

import torch

from depthcurse.errors import DepthcurseError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def pick_device(device: str) -> str:
    """`auto` is CUDA where torch sees a GPU, the CPU otherwise."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise DepthcurseError("--device cuda was asked for but no CUDA GPU is visible to torch")
    if device not in {"cpu", "cuda"}:
        raise DepthcurseError(f"unknown --device {device!r}: use auto, cpu or cuda")
    return device


def pick_dtype(dtype: str, device: str) -> torch.dtype | str:
    """`auto` keeps the checkpoint's dtype on a GPU; on a CPU it means fp32, since bf16 matmuls
    there are slow and a sweep's small differences should not drown in rounding."""
    if dtype == "auto":
        return "auto" if device == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise DepthcurseError(f"unknown --dtype {dtype!r}: use auto, bf16, fp16 or fp32")
    return DTYPES[dtype]
