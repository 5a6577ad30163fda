"""Where and in what precision a model runs: the device and dtype choice every command shares,
and this process's place among several under torchrun."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

import torch

from depthcurse import cpu_precision
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


def told_bf16() -> bool | None:
    """What `DEPTHCURSE_CPU_BF16` says (0: no bf16, 1: bf16 without measuring), None where it says
    neither."""
    told = os.environ.get("DEPTHCURSE_CPU_BF16")
    return {"0": False, "1": True}.get(told)


def cpu_computes_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX tiles). There a block's bf16
    matmuls run at about 4x fp32's rate (benchmarks/machine/gemm_peak.py); elsewhere bf16 is
    emulated, slower than fp32. `DEPTHCURSE_CPU_BF16=0` (or `1`) overrides the detection: a machine
    told 0 computes in fp32 by default, as one without native bf16 does."""
    told = told_bf16()
    if told is not None:
        return told
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(probe() for probe in probes if probe is not None)


def check_dtype(dtype: str) -> None:
    if dtype not in {"auto", *DTYPES}:
        raise DepthcurseError(f"unknown --dtype {dtype!r}: use auto, bf16, fp16 or fp32")


class Precision(NamedTuple):
    """The dtype a model is loaded in, and why: what every header and record says about it."""

    dtype: torch.dtype | str  # "auto": the checkpoint's own (transformers' `dtype="auto"`)
    why: str


def pick_dtype(dtype: str, device: str, keep_checkpoint: bool = False, stored: torch.dtype | None = torch.bfloat16,
               fp32_on_cpu: str | None = None, shape=None) -> Precision:
    """`auto` keeps the checkpoint's dtype on a GPU (and, with `keep_checkpoint`, anywhere). On a
    CPU it keeps a bf16 checkpoint in bf16 where the CPU computes bf16 natively and, for a model of
    `shape` (`cpu_precision.BlockShape`), bf16 was measured to pay on this machine (kept per machine:
    on one CPU with the flag a sweep took about half fp32's time, on another 1.5 times it), and is
    fp32 otherwise: on a CPU without it, where it does not pay, for an fp32 or fp16 checkpoint, and
    for work that says why it needs fp32 (`fp32_on_cpu`: speculate's token-for-token equality with
    `model.generate`, which bf16's rounding breaks on near-ties; training, whose trajectory bf16
    moves). `DEPTHCURSE_CPU_BF16=1` (or no shape) takes the flag's word without measuring. Figures
    computed in bf16 differ from fp32's in their later decimals, so `why` says which machine gives which."""
    check_dtype(dtype)
    if dtype != "auto":
        return Precision(DTYPES[dtype], f"--dtype {dtype}")
    if device == "cuda" or keep_checkpoint:
        return Precision("auto", "auto: the checkpoint's own dtype")
    if stored != torch.bfloat16:
        return Precision(torch.float32, "auto: fp32 on a CPU for a checkpoint not stored in bf16")
    if fp32_on_cpu:
        return Precision(torch.float32, f"auto: fp32 on a CPU {fp32_on_cpu}")
    if cpu_computes_bf16():
        if shape is not None and told_bf16() is None:  # told 1: the flag's word, unmeasured
            pays, why = cpu_precision.bf16_pays(shape)
            return Precision(torch.bfloat16 if pays else torch.float32, why)
        return Precision(torch.bfloat16, "auto: the checkpoint's bf16, which this CPU computes natively; "
                                         "a CPU without computes fp32, whose figures differ in the later decimals")
    return Precision(torch.float32, "auto: fp32, as this CPU has no native bf16; "
                                    "a CPU with it computes bf16, whose figures differ in the later decimals")


# Dense bf16 peaks (TFLOP/s) by device name, for the MFU a run reports; the SXM parts (a PCIe
# H100 is about 756). A device not listed gets no MFU rather than a wrong one.
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "GH200": 989.0, "A100": 312.0, "B200": 2250.0}


def peak_tflops(device_name: str, precision: str) -> float | None:
    """The dense peak of `device_name` (as torch.cuda.get_device_name says it) for a run in
    `precision`: bf16 only (fp32 runs in TF32 or slower, whose peaks are not this table's)."""
    if "bf16" not in precision:
        return None
    if "PCIe" in device_name or "PCIE" in device_name:
        return None  # its clocks and peak differ from the SXM part's
    return next((v for k, v in sorted(PEAK_BF16_TFLOPS.items(), key=lambda kv: -len(kv[0])) if k in device_name), None)


@dataclass
class World:
    """This process's place in a torchrun launch; World() is a lone process."""

    rank: int = 0
    size: int = 1
    parallel: str | None = None  # how the work is split: "ddp"/"fsdp" (training), "requests" (a sweep); None alone
    owns_group: bool = False  # this process started the process group, so it ends it

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.parallel:
            torch.distributed.barrier()

    def shard(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's consecutive slice of a global batch."""
        n = rows.shape[0] // self.size
        return rows[self.rank * n : (self.rank + 1) * n]

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        if self.parallel:
            torch.distributed.all_reduce(value)
        return value

    def broadcast(self, obj):
        """Rank 0's `obj`, on every rank (what rank 0 decided)."""
        if not self.parallel:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank; [obj] alone."""
        if not self.parallel:
            return [obj]
        out = [None] * self.size
        torch.distributed.all_gather_object(out, obj)
        return out

    def gather(self, obj) -> list | None:
        """Every rank's `obj`, in rank order, on rank 0 (None elsewhere); [obj] alone."""
        if not self.parallel:
            return [obj]
        out = [None] * self.size if self.main else None
        torch.distributed.gather_object(obj, out, dst=0)
        return out

    def close(self) -> None:
        if self.owns_group:
            torch.distributed.destroy_process_group()


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def join_torchrun(device: str, parallel: str) -> tuple[World, torch.device]:
    """This rank's place and device under torchrun: the process group (nccl on CUDA, gloo on the
    CPU) and, on CUDA, the GPU of its local rank."""
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", rank_gpus()[0])
        torch.cuda.set_device(dev)
    owns = not torch.distributed.is_initialized()
    if owns:
        torch.distributed.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return World(rank, size, parallel, owns), dev


def rank_gpus() -> list[int]:
    """The GPUs of this rank: the node's GPUs split evenly over its local ranks (a model bigger
    than one GPU spans several per rank)."""
    local, per_node = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    count = torch.cuda.device_count()
    each = count // per_node
    if each < 1:
        raise DepthcurseError(f"{per_node} ranks on this node but {count} GPU(s): launch at most {count} with --nproc-per-node")
    return list(range(local * each, (local + 1) * each))
