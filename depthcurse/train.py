"""Pre-train the papers' comparison models: one trainer, any normalisation variant.

The pieces are separate functions so that compilation, activation checkpointing and data or
model parallelism can wrap them later without restructuring (torchtitan-style):

  resolve_config -> build_model -> build_optimizer / build_scheduler -> build_data
  -> train_step (gradient accumulation, clipping, divergence check) -> evaluate
  -> save_checkpoint / load_checkpoint -> MetricsLog -> export

Speed (issue 6): `kernels` picks the model's fused norms and chunked loss (model.KERNELS),
`compile` compiles each block, `activation_checkpointing` recomputes each block in the backward
pass, and under torchrun (`torchrun --nproc-per-node N -m depthcurse lns-train ...`) the global
batch is split over the ranks with DDP or FSDP2 (`parallel`). Every rank draws the same global
batch from the same seeded order and trains on its slice, so N ranks compute what one process
computes, and the checkpoint (gathered whole on rank 0) resumes on any number of ranks.

A run lives in one folder: `config.json` (the resolved configuration), `checkpoint.pt` (model,
optimizer, scheduler, RNG and data position, rewritten atomically), `metrics.jsonl` (one JSON
object per logged step), `summary.json`, `loss.png`, and at the end `hf/` (a Hugging Face
checkpoint with the right norms) plus `hf-llama/` (a stock LlamaForCausalLM) for Pre-LN-family
variants.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable

import torch

from depthcurse import model as M
from depthcurse.errors import DepthcurseError

CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
CONFIG = "config.json"
PRECISIONS = ("auto", "fp32", "bf16-mixed", "bf16")
OPTIMIZERS = ("adam", "adamw")
PARALLEL = ("ddp", "fsdp")

# The papers' schedules (steps, warm-up, peak lr), batch 512 x 256 tokens; `tiny` is sized for
# a CPU: a few thousand steps of 16 x 128 tokens of the offline Wikipedia text.
TRAIN_PRESETS: dict[str, dict] = {
    "tiny": dict(lr=1e-3, steps=2000, warmup=200, batch_size=16, micro_batch=16, seq_len=128, max_seq_len=256,
                 data="wiki", pack=True, val_tokens=32768, eval_every=250, save_every=250, log_every=10),
    "130m": dict(lr=1e-3, steps=20_000, warmup=2000, batch_size=512, micro_batch=64),
    "250m": dict(lr=1e-3, steps=40_000, warmup=4000, batch_size=512, micro_batch=64),
    "350m": dict(lr=5e-4, steps=60_000, warmup=6000, batch_size=512, micro_batch=32),
    "1b": dict(lr=5e-4, steps=100_000, warmup=1000, batch_size=512, micro_batch=16),
}
COMMON_DEFAULTS = dict(seq_len=256, max_seq_len=256, data="c4", pack=False, val_tokens=10_000_000,
                       eval_every=1000, save_every=1000, log_every=10)

# Fields that may change between a run and its resume: they change nothing that is computed.
RESUMABLE_CHANGES = {"eval_every", "save_every", "log_every", "device", "kernels", "compile",
                     "activation_checkpointing", "parallel"}


@dataclass
class TrainConfig:
    """What a run is. None means: the preset's value."""

    preset: str = "tiny"
    norm: str = "pre"
    mix_ratio: float = 0.25
    data: str | None = None  # c4, wiki, or a local text file
    tokenizer: str | None = None  # t5-base for c4, the SmolLM2 tokenizer (offline) otherwise
    pack: bool | None = None
    seq_len: int | None = None
    max_seq_len: int | None = None  # longest sequence the model accepts (RoPE is computed, not learnt)
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_layers: int | None = None
    num_heads: int | None = None
    steps: int | None = None
    tokens: int | None = None  # alternative to steps: train on this many (row) tokens
    lr: float | None = None
    warmup: int | None = None
    min_lr_ratio: float = 0.1  # cosine decays to this share of the peak
    batch_size: int | None = None  # sequences per optimizer step
    micro_batch: int | None = None  # sequences per forward/backward (gradient accumulation)
    optimizer: str = "adam"
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    grad_clip: float = 0.0  # 0: no clipping (the papers)
    precision: str = "auto"  # bf16-mixed on GPU, fp32 on CPU; bf16 = pure bf16 weights (the papers)
    seed: int = 42
    val_tokens: int | None = None
    eval_every: int | None = None
    save_every: int | None = None
    log_every: int | None = None
    device: str = "auto"
    kernels: str = "auto"  # model.KERNELS: Triton on CUDA, the plain eager model elsewhere
    compile: bool = False  # torch.compile each block
    activation_checkpointing: bool = False
    parallel: str | None = None  # ddp or fsdp under torchrun (default ddp); must be None without it

    def resolved(self) -> "TrainConfig":
        """A copy with every None filled from the preset and checked: what the run records."""
        if self.preset not in TRAIN_PRESETS or self.preset not in M.PRESETS:
            raise DepthcurseError(f"unknown preset {self.preset!r}: use one of {', '.join(TRAIN_PRESETS)}")
        if self.norm not in M.NORMS:
            raise DepthcurseError(f"unknown norm {self.norm!r}: use one of {', '.join(M.NORMS)}")
        defaults = {**COMMON_DEFAULTS, **M.PRESETS[self.preset], **TRAIN_PRESETS[self.preset]}
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        for k, v in values.items():
            if v is None and k in defaults:
                values[k] = defaults[k]
        cfg = TrainConfig(**values)
        if cfg.tokens is not None:
            if cfg.tokens < 1:
                raise DepthcurseError("--tokens must be at least 1")
            cfg.steps = math.ceil(cfg.tokens / (cfg.batch_size * cfg.seq_len))
        if self.warmup is None and cfg.steps != defaults["steps"]:
            # Keep the preset's warm-up share of the run when only its length changes.
            cfg.warmup = round(defaults["warmup"] * cfg.steps / defaults["steps"])
        cfg.micro_batch = min(cfg.micro_batch, cfg.batch_size)
        _check(cfg)
        return cfg

    def to_dict(self) -> dict:
        return asdict(self)

    def model_config(self, vocab_size: int) -> M.ModelConfig:
        return M.ModelConfig(
            vocab_size=vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_layers=self.num_layers, num_heads=self.num_heads, max_seq_len=self.max_seq_len,
            norm=self.norm, mix_ratio=self.mix_ratio,
        )


def _check(cfg: TrainConfig) -> None:
    positive = ("steps", "batch_size", "micro_batch", "seq_len", "max_seq_len", "hidden_size", "intermediate_size",
                "num_layers", "num_heads", "val_tokens", "eval_every", "save_every", "log_every")
    for name in positive:
        if getattr(cfg, name) < 1:
            raise DepthcurseError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(cfg, name)}")
    if cfg.seq_len > cfg.max_seq_len:
        raise DepthcurseError(f"--seq-len {cfg.seq_len} is longer than the model allows ({cfg.max_seq_len}): use a shorter --seq-len or raise --max-seq-len")
    if cfg.batch_size % cfg.micro_batch:
        raise DepthcurseError(f"--batch-size {cfg.batch_size} is not a multiple of --micro-batch {cfg.micro_batch}")
    if not (cfg.lr > 0 and math.isfinite(cfg.lr)):
        raise DepthcurseError(f"--lr must be a positive number, got {cfg.lr}")
    if not 0 <= cfg.warmup <= cfg.steps:
        raise DepthcurseError(f"--warmup must be between 0 and the number of steps ({cfg.steps}), got {cfg.warmup}")
    if not 0 <= cfg.min_lr_ratio <= 1:
        raise DepthcurseError(f"--min-lr-ratio must be between 0 and 1, got {cfg.min_lr_ratio}")
    if cfg.optimizer not in OPTIMIZERS:
        raise DepthcurseError(f"unknown optimizer {cfg.optimizer!r}: use adam or adamw")
    if cfg.precision not in PRECISIONS:
        raise DepthcurseError(f"unknown precision {cfg.precision!r}: use one of {', '.join(PRECISIONS)}")
    if cfg.weight_decay < 0 or cfg.grad_clip < 0:
        raise DepthcurseError("--weight-decay and --grad-clip must not be negative")
    if not (0 <= cfg.beta1 < 1 and 0 <= cfg.beta2 < 1):
        raise DepthcurseError("Adam betas must be in [0, 1)")
    if cfg.kernels not in M.KERNELS:
        raise DepthcurseError(f"unknown --kernels {cfg.kernels!r}: use one of {', '.join(M.KERNELS)}")
    if cfg.parallel is not None and cfg.parallel not in PARALLEL:
        raise DepthcurseError(f"unknown --parallel {cfg.parallel!r}: use ddp or fsdp")


# --------------------------------------------------------------------------- building blocks


def pick_device(device: str) -> torch.device:
    from depthcurse.loading import pick_device as pick

    return torch.device(pick(device))


def precision_of(cfg: TrainConfig, device: torch.device) -> str:
    if cfg.precision != "auto":
        return cfg.precision
    # bf16 matmuls on a CPU are slow and gain nothing at tiny sizes.
    return "bf16-mixed" if device.type == "cuda" else "fp32"


def autocast_for(precision: str, device: torch.device):
    if precision == "bf16-mixed":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def build_model(cfg: TrainConfig, vocab_size: int, device: torch.device, precision: str) -> M.Transformer:
    torch.manual_seed(cfg.seed)  # same seed, same initial weights, whatever the norm, on every rank
    model = M.Transformer(cfg.model_config(vocab_size), kernels=M.resolve_kernels(cfg.kernels, device, cfg.compile)).to(device)
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    return model


# --------------------------------------------------------------------------- many processes


@dataclass
class World:
    """This process's place in a torchrun launch; World() is a lone process."""

    rank: int = 0
    size: int = 1
    parallel: str | None = None  # "ddp" or "fsdp" under torchrun, None alone
    owns_group: bool = False  # run() started the process group, so it ends it

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

    def close(self) -> None:
        if self.owns_group:
            torch.distributed.destroy_process_group()


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def setup_world(cfg: TrainConfig) -> tuple[World, torch.device]:
    """The process group (nccl on CUDA, gloo on CPU) and this rank's device; checks first, so
    a bad launch fails the same way on every rank before any process waits for another."""
    device = pick_device(cfg.device)
    if not launched_by_torchrun():
        if cfg.parallel is not None:
            raise DepthcurseError(f"--parallel {cfg.parallel} needs several processes: launch with torchrun --nproc-per-node N -m depthcurse lns-train ...")
        return World(), device
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if cfg.batch_size % size:
        raise DepthcurseError(f"--batch-size {cfg.batch_size} does not split evenly over {size} ranks: use a multiple of {size}")
    per_rank = cfg.batch_size // size
    if per_rank % min(cfg.micro_batch, per_rank):
        raise DepthcurseError(f"each of the {size} ranks gets {per_rank} sequences, not a multiple of --micro-batch {cfg.micro_batch}")
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    owns = not torch.distributed.is_initialized()
    if owns:
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return World(rank, size, cfg.parallel or "ddp", owns), device


def parallelize(model: M.Transformer, cfg: TrainConfig, world: World, device: torch.device) -> torch.nn.Module:
    """Checkpointing, compilation and the data-parallel wrapper, innermost first (torchtitan's
    order): each block's forward is compiled, and FSDP's all-gathers hook around it."""
    model.set_activation_checkpointing(cfg.activation_checkpointing)
    if cfg.compile:
        # Blocks share one compiled code object, with a variant per block kind (LNS factor 1 or
        # not, Post or Pre in Mix-LN) and grad mode (training, evaluation): more than the default 8.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
        for block in model.model.layers:
            # The forward, not the module: parameter names stay as they are (no `_orig_mod.`),
            # and hooks around the call (FSDP) run eagerly.
            block.forward = torch.compile(block.forward)
    if world.parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.model.layers:
            fully_shard(block)
        fully_shard(model)  # the embedding, final norm and head
        return model
    if world.parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return model


@contextlib.contextmanager
def gradient_sync(model: torch.nn.Module, world: World, on: bool):
    """Communicate gradients only on the last micro-batch of a step."""
    if world.parallel == "ddp" and not on:
        with model.no_sync():
            yield
        return
    if world.parallel == "fsdp":
        model.set_requires_gradient_sync(on)
    yield


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> tuple[dict, dict | None]:
    """Model and optimizer state, whole, on the CPU, keyed by parameter name: the same on any
    number of ranks with any wrapper. A collective under torchrun (every rank calls it; rank 0
    gets the tensors)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(model, options=options)
    return model_state, None if optimizer is None else get_optimizer_state_dict(model, optimizer, options=options)


def load_full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optimizer_state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_state, options=options)
    if all(isinstance(p, int) for group in optimizer_state["param_groups"] for p in group["params"]):
        optimizer.load_state_dict(optimizer_state)  # written before checkpoints were keyed by name
    else:
        set_optimizer_state_dict(model, optimizer, optimizer_state, options=options)


def build_optimizer(cfg: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    cls = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
    params = [p for p in model.parameters() if p.requires_grad]
    fused = {"fused": True} if params and params[0].is_cuda else {}
    return cls(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay, **fused)


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up to the peak, then cosine down to `min_ratio` of it at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg.warmup, cfg.steps, cfg.min_lr_ratio))


class Diverged(DepthcurseError):
    pass


def train_step(model, optimizer, scheduler, batch, micro_batch: int, amp, grad_clip: float, device, world: World = World()) -> tuple[float, float]:
    """One optimizer step over the global `batch`: this rank's slice of it, split into
    micro-batches. The loss is the mean over the global batch's real target tokens, whatever the
    split over ranks and micro-batches, so neither changes anything."""
    n_tokens = batch.tokens  # every rank holds the whole global batch: no all-reduce needed
    ids, targets = world.shard(batch.input_ids), world.shard(batch.targets)
    micro = list(zip(ids.split(micro_batch), targets.split(micro_batch)))
    optimizer.zero_grad(set_to_none=True)
    total = torch.zeros((), device=device)
    for i, (ids, targets) in enumerate(micro):
        with gradient_sync(model, world, on=i == len(micro) - 1):
            with amp:
                loss = model(ids.to(device), targets.to(device)) / n_tokens
            # DDP and FSDP average the ranks' gradients; the ranks' losses are shares of one sum.
            (loss * world.size if world.size > 1 else loss).backward()
        total += loss.detach().float()
    total = world.sum(total)
    params = [p for p in model.parameters() if p.grad is not None]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    if hasattr(grad_norm, "full_tensor"):  # FSDP: a DTensor over the shards
        grad_norm = grad_norm.full_tensor()
    loss_value, norm_value = total.item(), grad_norm.item()
    if not (math.isfinite(loss_value) and math.isfinite(norm_value)):
        # Stop before the step: the weights stay as they were, and the last checkpoint is intact.
        raise Diverged(f"loss {loss_value} / gradient norm {norm_value}")
    optimizer.step()
    scheduler.step()
    return loss_value, norm_value


@torch.no_grad()
def evaluate(model, data, batch_size: int, amp, device) -> dict:
    """Mean next-token loss over the fixed validation rows, and its perplexity."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for batch in data.val_batches(batch_size):
        with amp:
            total += model(batch.input_ids.to(device), batch.targets.to(device)).float().item()
        count += batch.tokens
    model.train(was_training)
    loss = total / count
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0)) if math.isfinite(loss) else float("nan"), "val_tokens": count}


# --------------------------------------------------------------------------- checkpoints


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: Path, state: dict) -> None:
    """torch.save to a temporary file beside `path`, then rename: a crash mid-write leaves the
    previous checkpoint whole."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_checkpoint(path: Path) -> dict:
    try:
        # Python's random state is a tuple; weights_only still refuses any code.
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise DepthcurseError(f"cannot read checkpoint {path}: {type(exc).__name__}: {exc}") from exc


def config_differences(saved: dict, current: dict) -> list[str]:
    keys = sorted((set(saved) | set(current)) - RESUMABLE_CHANGES)
    return [f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in keys if saved.get(k) != current.get(k)]


class MetricsLog:
    """metrics.jsonl: one JSON object per logged step, appended and flushed as it happens."""

    def __init__(self, path: Path):
        self.path = path

    def rows(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def truncate_after(self, step: int) -> None:
        """On resume, forget what was logged after the checkpoint: those steps run again."""
        from depthcurse.report import atomic_write

        kept = [r for r in self.rows() if r.get("step", 0) <= step]
        atomic_write(self.path, "".join(json.dumps(r) + "\n" for r in kept))

    def append(self, row: dict) -> None:
        with open(self.path, "a") as fh:
            fh.write(json.dumps(_finite(row)) + "\n")
            fh.flush()


def _finite(row: dict) -> dict:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}


# --------------------------------------------------------------------------- the run


@dataclass
class Progress:
    step: int
    total: int
    loss: float
    lr: float
    tokens: int
    tokens_per_s: float


def prepare_out_dir(out_dir: Path, cfg: dict, resume: bool) -> dict | None:
    """The checkpoint to continue from, or None for a fresh run; refuses to mix runs."""
    from depthcurse.report import ensure_out_dir

    ensure_out_dir(out_dir)
    ckpt_path = out_dir / CHECKPOINT
    saved_cfg_path = out_dir / CONFIG
    if not resume:
        if ckpt_path.exists() or saved_cfg_path.exists():
            raise DepthcurseError(f"{out_dir} already holds a run: pass --resume to continue it, or choose another --out")
        return None
    if not ckpt_path.exists():
        if saved_cfg_path.exists():
            saved = json.loads(saved_cfg_path.read_text())
            diffs = config_differences(saved, cfg)
            if diffs:
                raise DepthcurseError(f"{out_dir} holds a run with a different configuration ({'; '.join(diffs)}): use another --out")
        return None  # nothing saved yet: start from the beginning
    state = load_checkpoint(ckpt_path)
    diffs = config_differences(state.get("config", {}), cfg)
    if diffs:
        raise DepthcurseError(f"cannot resume {out_dir}: it was trained with a different configuration ({'; '.join(diffs)})")
    return state


def run(cfg: TrainConfig, out_dir, *, resume: bool = False, on_progress: Callable[[Progress], None] | None = None,
        on_eval: Callable[[int, dict], None] | None = None, on_start: Callable[[dict], None] | None = None,
        stop_after: int | None = None) -> dict:
    """Train (or continue training) the run in `out_dir`; returns the summary.

    `stop_after` ends the call after that many total steps, as a preemption would (checkpoint
    written, no final evaluation or export): the next `resume=True` call continues exactly.
    Under torchrun every rank calls this; only rank 0 writes files or calls the callbacks.
    """
    cfg = cfg.resolved()
    world, device = setup_world(cfg)
    try:
        return _run(cfg, Path(out_dir), world, device, resume, on_progress, on_eval, on_start, stop_after)
    finally:
        world.close()


def _run(cfg, out_dir, world, device, resume, on_progress, on_eval, on_start, stop_after) -> dict:
    from depthcurse import report
    from depthcurse.train_data import bpe_tokenizer, build_data, load_tokenizer

    cfg_dict = cfg.to_dict()
    state = prepare_out_dir(out_dir, cfg_dict, resume)
    world.barrier()  # every rank has checked the folder before rank 0 writes into it
    if world.main and not (out_dir / CONFIG).exists() and (out_dir / "tokenizer").is_dir():
        shutil.rmtree(out_dir / "tokenizer")  # left by an attempt that failed before it started: maybe other data

    precision = precision_of(cfg, device)
    amp = autocast_for(precision, device)
    if cfg.tokenizer and cfg.tokenizer.startswith("bpe:"):
        try:
            vocab = int(cfg.tokenizer.removeprefix("bpe:"))
        except ValueError:
            raise DepthcurseError(f"--tokenizer {cfg.tokenizer}: write bpe:N with N the vocabulary size, e.g. bpe:4096") from None
        if world.main:  # trained once, by rank 0; the others load what it saved
            tokenizer = bpe_tokenizer(cfg.data, vocab, out_dir / "tokenizer")
        world.barrier()
        if not world.main:
            tokenizer = bpe_tokenizer(cfg.data, vocab, out_dir / "tokenizer")
    else:
        tokenizer = load_tokenizer(cfg.tokenizer, cfg.data)
    # One global stream on every rank (not rank-sharded): each rank takes its slice of the same
    # batch, so the run and its checkpoint do not depend on the number of ranks.
    data = build_data(cfg.data, tokenizer, seq_len=cfg.seq_len, pack=cfg.pack, seed=cfg.seed, val_tokens=cfg.val_tokens)
    if world.main:
        # Written once the data is known to be usable: a failed start leaves a folder that can be reused.
        report.atomic_write(out_dir / CONFIG, json.dumps(cfg_dict, indent=2) + "\n")
    raw = build_model(cfg, len(tokenizer), device, precision)
    model = parallelize(raw, cfg, world, device)
    optimizer = build_optimizer(cfg, model)
    scheduler = build_scheduler(cfg, optimizer)
    metrics = MetricsLog(out_dir / METRICS)
    micro_batch = min(cfg.micro_batch, cfg.batch_size // world.size)

    step, tokens, seconds = 0, 0, 0.0
    last_saved = None
    if state is not None:
        load_full_state(model, optimizer, state["model"], state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        data.train.load_state_dict(state["data"])
        set_rng_state(state["rng"])
        step, tokens, seconds = state["step"], state["tokens"], state["seconds"]
        last_saved = step
        if world.main:
            metrics.truncate_after(step)
    elif world.main and (out_dir / METRICS).exists():
        (out_dir / METRICS).unlink()  # a run that died before its first checkpoint starts over
    del state  # a whole model and optimizer on the CPU

    def checkpoint() -> None:
        model_state, optimizer_state = full_state(model, optimizer)  # every rank takes part
        if world.main:
            save_checkpoint(out_dir / CHECKPOINT, {
                "step": step, "tokens": tokens, "seconds": seconds, "config": cfg_dict,
                "model": model_state, "optimizer": optimizer_state, "scheduler": scheduler.state_dict(),
                "data": data.train.state_dict(), "rng": rng_state(), "world_size": world.size,
            })
        world.barrier()  # no rank runs ahead of a checkpoint that might not be written yet

    info = {"params": raw.num_params(), "device": str(device),
            "precision": precision, "kernels": raw.model.kernels, "world_size": world.size, "parallel": world.parallel,
            "data": data.label, "val_tokens": data.val_tokens, "start_step": step, "steps": cfg.steps,
            "vocab_size": len(tokenizer)}
    if on_start and world.main:
        on_start(info)
    model.train()
    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    tick, tick_tokens = time.perf_counter(), 0
    while step < end:
        batch = data.train.next_batch(cfg.batch_size)
        lr = optimizer.param_groups[0]["lr"]
        t0 = time.perf_counter()
        try:
            loss, grad_norm = train_step(model, optimizer, scheduler, batch, micro_batch, amp, cfg.grad_clip, device, world)
        except Diverged as exc:
            raise _diverged(exc, step + 1, out_dir, last_saved) from exc
        if loss > 2 * math.log(len(tokenizer)):
            raise _diverged(Diverged(f"loss {loss:.3f}, over twice that of a uniform guess"), step + 1, out_dir, last_saved)
        seconds += time.perf_counter() - t0
        step += 1
        tokens += batch.input_ids.numel()
        tick_tokens += batch.input_ids.numel()
        if step % cfg.log_every == 0 or step == end:
            now = time.perf_counter()
            rate = tick_tokens / max(now - tick, 1e-9)
            if world.main:
                metrics.append({"step": step, "loss": loss, "lr": lr, "tokens": tokens, "grad_norm": grad_norm, "tokens_per_s": rate})
            tick, tick_tokens = now, 0
            if on_progress and world.main:
                on_progress(Progress(step, cfg.steps, loss, lr, tokens, rate))
        if step % cfg.eval_every == 0 and step < cfg.steps:
            result = evaluate(model, data, cfg.micro_batch, amp, device)
            if world.main:
                metrics.append({"step": step, "tokens": tokens, **result})
            if on_eval and world.main:
                on_eval(step, result)
        if step % cfg.save_every == 0 or step == end:
            checkpoint()
            last_saved = step

    if step < cfg.steps:
        return {"finished": False, "step": step}
    final = evaluate(model, data, cfg.micro_batch, amp, device)
    model_state, _ = full_state(model)
    summary = {
        "finished": True, "norm": cfg.norm, "preset": cfg.preset, "step": step, "tokens": tokens,
        "train_seconds": seconds, **final, "params": info["params"], "precision": precision, "device": str(device),
        "kernels": info["kernels"], "world_size": world.size, "parallel": world.parallel,
        "data": data.label, "config": cfg_dict,
    }
    if not world.main:
        return summary
    rows = metrics.rows()
    if not rows or rows[-1].get("val_loss") is None or rows[-1].get("step") != step:
        metrics.append({"step": step, "tokens": tokens, **final})
    if on_eval:
        on_eval(step, final)
    summary["exports"] = export_run(model_state, raw.cfg, tokenizer, out_dir)
    summary["environment"] = report.environment()
    report.atomic_write(out_dir / SUMMARY, json.dumps(_finite(summary) | {"config": cfg_dict}, indent=2) + "\n")
    from depthcurse.train_report import plot_loss

    plot_loss(metrics.rows(), out_dir / "loss.png", title=f"{cfg.preset} · {cfg.norm} · {data.label}")
    return summary


def _diverged(exc: Exception, step: int, out_dir: Path, last_saved: int | None) -> DepthcurseError:
    kept = f"the last good checkpoint (step {last_saved}) is kept in {out_dir}" if last_saved is not None else "no checkpoint had been written yet"
    return DepthcurseError(f"training diverged at step {step} ({exc}); {kept}: lower --lr, raise --warmup or set --grad-clip")


def export_run(model_state: dict, model_cfg: M.ModelConfig, tokenizer, out_dir: Path) -> dict:
    """hf/ (our class, any norm) and, for Pre-LN-family variants, hf-llama/ (stock Llama), from
    the gathered state: a plain fp32 CPU model, whatever wrapper, device and precision trained it."""
    with torch.device("meta"):  # no initialisation to throw away: the weights come from the state
        model = M.Transformer(model_cfg)
    # Safe on meta: the LNS factors are plain floats of the modules, not tensors the state replaces.
    model.load_state_dict({k: v.float() for k, v in model_state.items()}, assign=True)
    exports = {"hf": str(M.export(model, out_dir / "hf", tokenizer))}
    if model.cfg.norm in M.STOCK_LLAMA_NORMS:
        exports["hf-llama"] = str(M.export(model, out_dir / "hf-llama", tokenizer, stock=True))
    return exports
