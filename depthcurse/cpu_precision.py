"""Whether bf16 pays on this CPU, for a model of this shape: measured once, kept per machine (issue 89).

A CPU flag (AVX512-BF16, AMX) says bf16 matmuls run in hardware, not that a model computes faster
in bf16: the casts and reductions around the matmuls (RMSNorm's fp32 round trip, the rotary
embedding, softmax) are memory-bound, and their share differs from CPU to CPU and with the load. On
one CPU with the flag the demo's sweep took 0.34-0.52x fp32's time in bf16; on another, busy, 0.60-
1.15x. So `--dtype auto` measures: one block of the model's shape (its hidden and MLP widths and
heads: a Llama block, RMSNorm in fp32 as transformers computes it, rotary, causal attention, SwiGLU)
over `ROWS` tokens, in fp32 and bf16 in turns (A B, A B, after one of each to warm up), and chooses
bf16 where the median pair gives it at most `PAYS` of fp32's time. The result is kept in the cache
(`KEPT`, one file per CPU model, torch version, thread count and shape), so the measurement runs
once per machine; the header and every record say the ratio and where it is kept.
`DEPTHCURSE_CPU_BF16=0/1` and `--dtype` still decide when given.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from depthcurse.assets.cache import cache_dir
from depthcurse.errors import DepthcurseError
from depthcurse.io import atomic_write, cpu_model, json_text

PAYS = 0.9  # bf16 is chosen where a block takes at most this share of fp32's time: a tenth saved, beyond the pairs' noise
ROWS = 256  # tokens the measured block runs: 2 windows of 128, the scale of a sweep's or a scorer's batch (one row decodes slower in bf16)
PAIRS = 5  # under load a single pair can be far off (0.29x among 1.3-1.8x beside a CPU-bound job): the median of five
KEPT = "cpu_precision"  # the cache's folder of kept measurements


@dataclass(frozen=True)
class BlockShape:
    """What a block's cost depends on: its widths and heads."""

    hidden: int
    intermediate: int
    heads: int

    @classmethod
    def of_config(cls, config) -> "BlockShape | None":
        """From a transformers config (Llama's names, GPT-2's and NeoX's too); None where it does not say."""
        get = lambda *names: next((getattr(config, n) for n in names if isinstance(getattr(config, n, None), int)), None)  # noqa: E731
        hidden = get("hidden_size", "n_embd", "d_model")
        if hidden is None:
            return None
        heads = get("num_attention_heads", "n_head") or max(1, hidden // 64)
        return cls(hidden, get("intermediate_size", "n_inner", "ffn_dim") or 4 * hidden, heads if hidden % heads == 0 else 1)


def _block(shape: BlockShape, dtype: torch.dtype, seed: int = 0) -> Callable[[], torch.Tensor]:
    """One Llama block of `shape` in `dtype` over `ROWS` tokens (2 x ROWS/2), its weights random: a
    function that runs it once (its `weights`, as x @ w, and its input `x` beside it, for a test to
    run transformers' own block on)."""
    g = torch.Generator().manual_seed(seed)
    d, f, h = shape.hidden, shape.intermediate, shape.heads
    w = {name: (torch.randn(a, b, generator=g) / math.sqrt(a)).to(dtype) for name, (a, b) in
         {"q": (d, d), "k": (d, d), "v": (d, d), "o": (d, d), "gate": (d, f), "up": (d, f), "down": (f, d)}.items()}
    x = torch.randn(2, ROWS // 2, d, generator=g).to(dtype)
    t = ROWS // 2
    angle = torch.outer(torch.arange(t, dtype=torch.float32), 10000.0 ** (-torch.arange(0, d // h, 2, dtype=torch.float32) / (d // h)))
    cos, sin = torch.cat([angle.cos()] * 2, -1).to(dtype), torch.cat([angle.sin()] * 2, -1).to(dtype)

    def norm(z):  # transformers' LlamaRMSNorm: fp32 for the reduction, back to the model's dtype
        z32 = z.float()
        return (z32 * torch.rsqrt(z32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)

    def rotary(z):
        half = z.shape[-1] // 2
        return z * cos + torch.cat([-z[..., half:], z[..., :half]], -1) * sin

    def run() -> torch.Tensor:
        with torch.inference_mode():
            n = norm(x)
            q, k, v = ((n @ w[p]).view(2, t, h, d // h).transpose(1, 2) for p in "qkv")
            a = torch.nn.functional.scaled_dot_product_attention(rotary(q), rotary(k), v, is_causal=True)
            y = x + a.transpose(1, 2).reshape(2, t, d) @ w["o"]
            m = norm(y)
            return y + (torch.nn.functional.silu(m @ w["gate"]) * (m @ w["up"])) @ w["down"]

    run.weights, run.x = w, x
    return run


def measure_ratios(shape: BlockShape, pairs: int = PAIRS, clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """bf16's time over fp32's for one block of `shape`, pair by pair (fp32 then bf16 in each), after
    one of each to warm up."""
    runs = {dtype: _block(shape, dtype) for dtype in (torch.float32, torch.bfloat16)}
    for run in runs.values():
        run()
    ratios = []
    for _ in range(pairs):
        took = {}
        for dtype, run in runs.items():
            start = clock()
            run()
            took[dtype] = clock() - start
        ratios.append(took[torch.bfloat16] / took[torch.float32])
    return ratios


def machine_key(shape: BlockShape) -> dict:
    """What a kept measurement holds for: this CPU, this torch, these threads, this shape."""
    return {"cpu": cpu_model(), "torch": torch.__version__, "threads": torch.get_num_threads(), **asdict(shape)}


def _kept_ratio(path: Path, key: dict) -> float | None:
    """The ratio kept at `path` for this machine and shape (None: none, or another's)."""
    try:
        kept = json.loads(path.read_text())
        return float(kept["ratio"]) if kept.get("key") == key else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


@contextlib.contextmanager
def _measuring(path: Path) -> Iterator[None]:
    """This machine's one measurement for `path` at a time (flock on a lock file beside it): the ranks
    of one run, each loading the model at once, take one figure and so one dtype. No lock where the
    cache cannot be written (each process measures for itself, as before)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_suffix(".lock"), "a")
    except OSError:
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released as the file closes
        yield


def bf16_pays(shape: BlockShape, kept_dir: Path | None = None, measure: Callable[[BlockShape], list[float]] = measure_ratios) -> tuple[bool, str]:
    """Whether bf16 pays for a model of `shape` on this machine, and the line that says why: the
    kept measurement for this machine and shape, or one made now and kept (in `kept_dir`, by default
    the cache's `KEPT` folder)."""
    if kept_dir is None:
        kept_dir = cache_dir() / KEPT
    key = machine_key(shape)
    path = Path(kept_dir) / (hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16] + ".json")
    ratio, when = _kept_ratio(path, key), "kept"
    if ratio is None:
        with _measuring(path):
            ratio = _kept_ratio(path, key)  # another process of this machine (a torchrun rank) measured while this one waited
            if ratio is None:
                ratios = measure(shape)
                ratio, when = statistics.median(ratios), "measured"
                try:
                    atomic_write(path, json_text({"key": key, "ratio": ratio, "ratios": ratios, "rows": ROWS, "pays_below": PAYS,
                                                  "when": time.strftime("%Y-%m-%d %H:%M:%S")}))
                except (OSError, DepthcurseError):  # atomic_write's line for a full or read-only disk, or no folder at all
                    path = None  # measured again next time
    pays = ratio <= PAYS
    basis = (f"a block of this model's shape ({shape.hidden} wide, {ROWS} tokens) took {ratio:.2f}x fp32's time in bf16 on this CPU "
             f"({key['cpu']}, {key['threads']} threads; {when}" + (f" in {path}" if path is not None else "") + ")")
    if pays:
        return True, f"auto: the checkpoint's bf16, as {basis}; a CPU where it does not pay computes fp32, whose figures differ in the later decimals"
    return False, (f"auto: fp32, as bf16 does not pay here: {basis}, above the {PAYS:.2f}x at which it pays; a CPU where it pays computes bf16, whose figures differ in "
                   "the later decimals")
