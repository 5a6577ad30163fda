"""What a removal buys: the unpruned model against the pruned one, timed in one process, alternated.

For each model: prefill (a batch of prompts through the model, building its KV cache) in tokens
per second; decoding with the KV cache, one greedy token at a time after a prompt, in seconds
per generated token, at batch 1 and a larger batch; the memory each of those needs above the
model at rest; the parameters; the KV cache's bytes per token (read off the cache itself). The
two models take turns (A B, B A, ...), and each pair gives a ratio, so that a machine that slows
down slows both halves of it; pairs are added until every time ratio's interval is tight or the
budget is spent (`paired`). Each figure's median is reported with its spread (the extremes and
the quartiles), each ratio with its interval and a verdict: steady, unstable, or impossible.

On a GPU the times are CUDA events and the memory the allocator's peak above what was allocated
before; on a CPU, wall time and the rise of the process's resident high-water mark (Linux). The
ratios come from the same run's figures, and beside each time ratio the shares the pruned model
keeps of the layers, of the arithmetic (matrix products of the blocks and the head, attention over
the context) and of the bytes moved (weights read, KV cache): which cost a time follows decides
which share it reaches, and the lowest of them, the layers', is the floor. Embeddings and head do
not shrink.
"""

from __future__ import annotations

import contextlib
import re
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

from depthcurse.errors import DepthcurseError
from depthcurse.io import environment
from depthcurse.kv_cache import cache_bytes, cache_keyword, cache_of
from depthcurse.speed.paired import MIN_PAIRS, TOLERANCE, PairedRatio, Shares, enough, judge
from depthcurse.surgery import find_blocks

MODELS = ("unpruned", "pruned")


@dataclass
class SpeedConfig:
    prefill_batch: int = 1
    prefill_len: int = 512
    decode_batches: tuple[int, ...] = (1, 8)
    prompt_len: int = 128
    new_tokens: int = 32
    repeats: int = MIN_PAIRS  # pairs at least; more until every time ratio is steady
    max_repeats: int = 40
    max_seconds: float = 300.0  # of measuring after the warm-up, checked after each pair
    tolerance: float = TOLERANCE  # steady: the ratio's 95% interval within +-this share of it
    warmup: int = 1
    seed: int = 0

    def checked(self) -> "SpeedConfig":
        for name in ("prefill_batch", "prefill_len", "prompt_len", "new_tokens"):
            if getattr(self, name) < 1:
                raise DepthcurseError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.repeats < MIN_PAIRS:
            raise DepthcurseError(f"--repeats must be at least {MIN_PAIRS}, the fewest pairs a 95% interval of the median rests on, got {self.repeats}")
        if self.max_repeats < self.repeats:
            raise DepthcurseError(f"--max-repeats must be at least --repeats ({self.repeats}), got {self.max_repeats}")
        if not self.tolerance > 0 or not self.max_seconds >= 0:
            raise DepthcurseError(f"--tolerance must be above 0 and --max-seconds 0 or more, got {self.tolerance} and {self.max_seconds}")
        if self.warmup < 0:
            raise DepthcurseError(f"--warmup must be 0 or more, got {self.warmup}")
        if not self.decode_batches or min(self.decode_batches) < 1:
            raise DepthcurseError(f"--decode-batches must be batch sizes of at least 1, got {','.join(map(str, self.decode_batches)) or 'none'}")
        return self


def parse_batches(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(b) for b in text.split(",") if b.strip())
    except ValueError:
        raise DepthcurseError(f"--decode-batches {text!r}: give batch sizes, e.g. 1,8") from None


class _Clock:
    """Seconds of what runs between `start` and `stop`: CUDA events on a GPU, wall time on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.begin, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.begin.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> float:
        if self.cuda:
            self.end.record()
            self.end.synchronize()
            return self.begin.elapsed_time(self.end) / 1000
        return time.perf_counter() - self.t0


class PeakMemory:
    """`start()` opens a measuring window, `rise()` gives the peak bytes above its start: the CUDA
    allocator's peak, or on a CPU the process's resident high-water mark (Linux VmHWM, restarted
    by writing 5 to /proc/self/clear_refs)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.before = 0

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts at the current size
            self.before = _status_bytes("VmRSS")

    def rise(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() if self.cuda else _status_bytes("VmHWM")
        return max(0, peak - self.before)


def _status_bytes(key: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{key}:\s+(\d+) kB", text, re.M).group(1)) * 1024


def arithmetic(model: nn.Module, context: float) -> float:
    """Multiply-adds times two per token of the model as it is now: every linear layer in its
    blocks and its output head (embedding lookups cost none), and attention's scores and sums over
    `context` earlier positions in each block."""
    blocks = find_blocks(model).layers
    linear = sum(m.weight.numel() for block in blocks for m in block.modules() if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_weights = head.weight.numel() if head is not None else 0
    config = model.config
    heads = getattr(config, "num_attention_heads", 0) or 0
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else 0)
    return 2.0 * (linear + head_weights) + 4.0 * len(blocks) * heads * head_dim * context


def _spread(values: list[float]) -> dict:
    values = sorted(values)
    quartiles = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return {"median": statistics.median(values), "min": values[0], "max": values[-1], "quartiles": [quartiles[0], quartiles[2]], "runs": values}


def _tokens(vocab: int, shape: tuple[int, int], seed: int, device) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed)).to(device)


@torch.inference_mode()
def _prefill(model: nn.Module, ids: torch.Tensor, clock: _Clock, memory: PeakMemory) -> tuple[float, int, int]:
    """(seconds, memory rise, KV-cache bytes) of one prefill of `ids`, building the cache."""
    memory.start()
    clock.start()
    out = model(input_ids=ids, use_cache=True)
    seconds = clock.stop()
    return seconds, memory.rise(), cache_bytes(cache_of(out))


@torch.inference_mode()
def _decode(model: nn.Module, prompt: torch.Tensor, new_tokens: int, clock: _Clock, memory: PeakMemory) -> tuple[float, int]:
    """(seconds per generated token, memory rise) of greedy decoding after `prompt`, one token
    at a time with the KV cache; the prompt's own prefill is not timed."""
    key = cache_keyword(model)
    memory.start()
    out = model(input_ids=prompt, use_cache=True)
    clock.start()
    for _ in range(new_tokens):
        nxt = out.logits[:, -1:].argmax(-1)
        out = model(input_ids=nxt, use_cache=True, **{key: cache_of(out)})
    seconds = clock.stop()
    return seconds / new_tokens, memory.rise()


def measure_speed(as_model: dict[str, Callable[[], contextlib.AbstractContextManager]], device: torch.device, cfg: SpeedConfig, vocab: int,
                  on_step: Callable[[str, int, int], None] | None = None, clock=None, now: Callable[[], float] = time.monotonic) -> dict:
    """The two models `as_model` makes ("unpruned", "pruned": each a context in which the model
    it gives is that one), measured in turns until every time ratio is steady or the budget is
    spent; the figures, their ratios (the median of the pairs'), each ratio's interval and verdict,
    and the shares of layers, arithmetic and bytes it could reach. `clock`: what times a
    measurement (`start()`, `stop() -> seconds`), CUDA events or wall time by default; `now`, what
    the time budget (`max_seconds`) is read from."""
    cfg = cfg.checked()
    began = now()
    clock, memory = clock or _Clock(device), PeakMemory(device)
    prefill_ids = _tokens(vocab, (cfg.prefill_batch, cfg.prefill_len), cfg.seed, device)
    prompts = {b: _tokens(vocab, (b, cfg.prompt_len), cfg.seed + b, device) for b in cfg.decode_batches}
    names = list(as_model)
    out = {name: {"prefill_s": [], "prefill_rise": [], "decode_s": {b: [] for b in cfg.decode_batches}, "decode_rise": {b: [] for b in cfg.decode_batches}}
           for name in names}
    timed = ["prefill_time", *(f"decode_time_b{b}" for b in cfg.decode_batches)]
    pairs = {key: PairedRatio([]) for key in timed}
    done, started, r = 0, None, 0
    while True:
        this_round = {}
        if r >= cfg.warmup:
            pair_started = now()
            started = started or pair_started  # the budget counts from the first measured pair's start
        for name in names if r % 2 == 0 else reversed(names):  # A B, then B A: neither always goes first
            with as_model[name]() as model:
                seconds, rise, kv = _prefill(model, prefill_ids, clock, memory)
                decoded = {b: _decode(model, prompts[b], cfg.new_tokens, clock, memory) for b in cfg.decode_batches}
                this_round[name] = [seconds, *(decoded[b][0] for b in cfg.decode_batches)]
                if r >= cfg.warmup:
                    record = out[name]
                    record["prefill_s"].append(seconds)
                    record["prefill_rise"].append(rise)
                    record["kv_bytes_per_token"] = kv / prefill_ids.numel()
                    for b, (per_token, rise_b) in decoded.items():
                        record["decode_s"][b].append(per_token)
                        record["decode_rise"][b].append(rise_b)
                if r == 0:
                    out[name].update(_static(model, cfg))
            done += 1
            if on_step:
                on_step(name, done, 2 * max(r + 1, cfg.warmup + cfg.repeats))
        if r >= cfg.warmup:
            for key, u, p in zip(timed, this_round["unpruned"], this_round["pruned"]):
                pairs[key].ratios.append(p / u)
            ended = now()
            if enough(list(pairs.values()), r + 1 - cfg.warmup, cfg.repeats, cfg.max_repeats, ended - started, cfg.max_seconds, cfg.tolerance,
                      last_pair_s=ended - pair_started):
                break
        r += 1
    models = {}
    for name, m in out.items():
        prefill = _spread(m["prefill_s"])
        models[name] = {
            **{k: m[k] for k in ("layers", "params", "weight_bytes", "read_bytes", "kv_bytes_per_token", "flops_per_token")},
            "prefill": {"seconds": prefill, "tokens_per_s": prefill_ids.numel() / prefill["median"], "peak_rise_bytes": max(m["prefill_rise"])},
            "decode": {str(b): {"seconds_per_token": _spread(m["decode_s"][b]), "peak_rise_bytes": max(m["decode_rise"][b])} for b in cfg.decode_batches},
        }
    shares = _shares(models, cfg)
    checks = {key: {**pairs[key].summary(), **asdict(judge(pairs[key], shares[key], ceiling=1.0, tolerance=cfg.tolerance))} for key in timed}
    return {"config": {**asdict(cfg), "decode_batches": list(cfg.decode_batches)}, "device": str(device), "models": models,
            "ratios": _ratios(models, pairs), "shares": {key: dict(s) for key, s in shares.items()},
            "floor": {**{key: s.lowest for key, s in shares.items()}, "kv_bytes_per_token": shares["prefill_time"]["layers"]},
            "checks": checks, "trusted": all(c["status"] == "ok" for c in checks.values()), "includes": _includes(device),
            "wall_time_s": round(now() - began, 3), "environment": environment()}


def _static(model: nn.Module, cfg: SpeedConfig) -> dict:
    """What a model is, whatever the clock: layers, parameters, bytes and arithmetic per token."""
    params = list(model.parameters())
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    # A lookup reads a row of the input embedding, not the table; a tied table is read whole as the head.
    looked_up = embedding.weight if embedding is not None and (head is None or head.weight is not embedding.weight) else None
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    return {"params": sum(p.numel() for p in params), "weight_bytes": weight_bytes,
            "read_bytes": weight_bytes - (looked_up.numel() * looked_up.element_size() if looked_up is not None else 0),
            "layers": len(find_blocks(model).layers),
            "flops_per_token": {"prefill": arithmetic(model, (cfg.prefill_len + 1) / 2), "decode": arithmetic(model, _decode_context(cfg))}}


def _decode_context(cfg: SpeedConfig) -> float:
    """The mean number of earlier positions a generated token attends to."""
    return cfg.prompt_len + (cfg.new_tokens + 1) / 2


def _shares(models: dict, cfg: SpeedConfig) -> dict[str, Shares]:
    """For each time ratio, the share of layers, arithmetic and bytes moved the pruned model keeps.
    Bytes: the weights read once per forward (the input embedding's table is only looked up), and
    the KV cache written by a prefill or read by each decoding step at its mean context."""
    u, p = models["unpruned"], models["pruned"]
    layers = p["layers"] / u["layers"]

    def moved(m, kv_tokens):
        return m["read_bytes"] + m["kv_bytes_per_token"] * kv_tokens

    shares = {"prefill_time": Shares(layers=layers, arithmetic=p["flops_per_token"]["prefill"] / u["flops_per_token"]["prefill"],
                                     bytes=moved(p, cfg.prefill_batch * cfg.prefill_len) / moved(u, cfg.prefill_batch * cfg.prefill_len))}
    for b in cfg.decode_batches:
        shares[f"decode_time_b{b}"] = Shares(layers=layers, arithmetic=p["flops_per_token"]["decode"] / u["flops_per_token"]["decode"],
                                             bytes=moved(p, b * _decode_context(cfg)) / moved(u, b * _decode_context(cfg)))
    return shares


def _ratios(models: dict, pairs: dict[str, PairedRatio]) -> dict:
    """Pruned over unpruned: each time the median of the pairs' ratios, the rest of the same run's figures."""
    u, p = models["unpruned"], models["pruned"]
    ratios = {key: pair.median for key, pair in pairs.items()}
    return {"prefill_time": ratios.pop("prefill_time"), "prefill_tokens_per_s": 1 / pairs["prefill_time"].median, **ratios,
            "params": p["params"] / u["params"], "weight_bytes": p["weight_bytes"] / u["weight_bytes"],
            "kv_bytes_per_token": p["kv_bytes_per_token"] / u["kv_bytes_per_token"] if u["kv_bytes_per_token"] else None,
            "peak_memory_prefill": (p["weight_bytes"] + p["prefill"]["peak_rise_bytes"]) / (u["weight_bytes"] + u["prefill"]["peak_rise_bytes"])}


def _includes(device: torch.device) -> str:
    if device.type == "cuda":
        return ("times: CUDA events around the model's forward calls (prefill: one forward building the KV cache; decoding: the greedy "
                "loop after an untimed prompt); memory: the allocator's peak above what was allocated before, plus the weights")
    return ("times: wall time around the model's forward calls (prefill: one forward building the KV cache; decoding: the greedy loop "
            "after an untimed prompt); memory: the rise of the process's resident high-water mark (Linux VmHWM) above its size before, "
            "plus the weights' bytes; both models are in memory, so the resting size holds both")


@contextlib.contextmanager
def as_is(model: nn.Module) -> Iterator[nn.Module]:
    yield model
