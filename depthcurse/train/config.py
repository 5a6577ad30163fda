"""What a training run is: one dataclass, its presets, and its checks.

`TrainConfig` is the single list of a run's settings. Each field carries its command-line flag
and help in its metadata, so `depthcurse lns-train` builds its options from the fields (as
torchtitan builds its job config's) and a new setting is one line here.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

from depthcurse.errors import DepthcurseError
from depthcurse.train.norms import BUILTIN_NORMS, REGISTRY
from depthcurse.train.tracking import parse_report_to

CONFIG = "config.json"  # the resolved TrainConfig, in the run folder
PRECISIONS = ("auto", "fp32", "bf16-mixed", "bf16")
OPTIMIZERS = ("adam", "adamw")
PARALLEL = ("ddp", "fsdp")

# The normalisation variants that come with depthcurse, one module each in `norms/` (a user's own
# registers by defining a `Normalisation` subclass).
NORMS = BUILTIN_NORMS
# "authors": each variant initialised as its authors' code does (model.INIT_RULES); "common":
# LLaMA's N(0, 0.02) for every variant, plus only the rules that define it (scaled-init's, DeepNorm's).
INITS = ("authors", "common")
# How the model computes its norms and loss. "off": the eager modules (the numerics every export
# and equality test is checked against). "torch" / "triton": `depthcurse.train.kernels` (fused residual
# add + norm, chunked linear + cross-entropy) on its PyTorch or its Triton path. "auto" is
# resolved by `resolve_kernels`: Triton on CUDA without --compile, off otherwise.
KERNELS = ("auto", "triton", "torch", "off")
# What --compile compiles: "blocks", each block's forward (and the loss with the plain model),
# torchtitan's unit, which FSDP2 hooks around; or "model", the whole forward with its loss as one
# graph (fusion across block boundaries; not under FSDP2). The modes are torch.compile's:
# "reduce-overhead" replays CUDA graphs (no kernel launches from Python), "max-autotune" also
# searches matmul configurations.
COMPILE_SCOPES = ("blocks", "model")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")

# The papers' sizes and schedules (LLaMA-style, batch 512 x 256 tokens, t5-base vocabulary:
# steps, warm-up, peak lr); `tiny` is sized for a CPU: a few thousand steps of 16 x 128 tokens
# of the offline Wikipedia text.
PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=128, intermediate_size=352, num_heads=4, num_layers=12,
                 lr=1e-3, steps=2000, warmup=200, batch_size=16, micro_batch=16, seq_len=128, max_seq_len=256,
                 data="wiki", pack=True, val_tokens=32768, eval_every=250, save_every=250, log_every=10),
    "130m": dict(hidden_size=768, intermediate_size=2048, num_heads=12, num_layers=12,
                 lr=1e-3, steps=20_000, warmup=2000, batch_size=512, micro_batch=64),
    "250m": dict(hidden_size=768, intermediate_size=2560, num_heads=16, num_layers=24,
                 lr=1e-3, steps=40_000, warmup=4000, batch_size=512, micro_batch=64),
    "350m": dict(hidden_size=1024, intermediate_size=2736, num_heads=16, num_layers=24,
                 lr=5e-4, steps=60_000, warmup=6000, batch_size=512, micro_batch=32),
    "1b": dict(hidden_size=2048, intermediate_size=5461, num_heads=32, num_layers=24,
               lr=5e-4, steps=100_000, warmup=1000, batch_size=512, micro_batch=16),
}
COMMON_DEFAULTS = dict(seq_len=256, max_seq_len=256, data="c4", pack=False, val_tokens=10_000_000,
                       eval_every=1000, save_every=1000, log_every=10)

# Fields that may change between a run and its resume: they change nothing that is computed.
RESUMABLE_CHANGES = {"eval_every", "save_every", "log_every", "device", "kernels", "compile", "compile_scope",
                     "compile_mode", "fuse_projections", "activation_checkpointing", "parallel", "layer_metrics_tokens", "layer_metrics_probes", "report_to"}


def _setting(default, help: str, flag: str | None = None):
    """A field that is also an `lns-train` option: `--name-with-dashes` unless `flag` says otherwise."""
    return field(default=default, metadata={"help": help, "flag": flag})


@dataclass
class TrainConfig:
    """What a run is. None means: the preset's value."""

    preset: str = _setting("tiny", "tiny (CPU, offline Wikipedia), or the papers' 130m, 250m, 350m, 1b (C4).")
    norm: str = _setting("pre", "pre, post, deepnorm, mix, lns, scaled-init, sandwich, layerscale, skipinit, depth-scaled-init, lns+scaled-init, "
                                "dyt (Dynamic Tanh), hybridnorm (QKV-norm, Post-Norm FFN), hybridnorm-star (HybridNorm*: block 0 Pre-Norm) "
                                "or completep (depth-muP, alpha = 1).")
    init: str = _setting("authors", "authors (each norm initialised as its authors' code does: HybridNorm's OLMo full_megatron, Mix-LN's embedding) "
                                    "or common (LLaMA's N(0, 0.02) for every norm, plus only the rules that define it: everything but the norm held fixed).")
    mix_ratio: float = _setting(0.25, "Mix-LN: share of the first layers that are Post-LN.")
    dyt_alpha_attn: float = _setting(0.8, "dyt: alpha0 of the attention's DyT (the LLaMA-7B code's 0.8; its 13B 0.6, 34B/70B 0.2).")
    dyt_alpha_ffn: float = _setting(0.2, "dyt: alpha0 of the MLP's and the final DyT (the LLaMA-7B code's 0.2; 13B 0.15, 34B/70B 0.05).")
    base_layers: int = _setting(12, "completep: the base depth L0 its branches (times L0/L) and Adam's eps are scaled against.")
    data: str | None = _setting(None, "c4 (streamed from the hub), wiki (offline), or a .txt/.jsonl/.parquet file (default: the preset's).")
    tokenizer: str | None = _setting(None, "Tokenizer (default t5-base for c4, SmolLM2's offline otherwise), or bpe:N to train an N-token BPE on the training text.")
    pack: bool | None = _setting(None, "Join documents with EOS into full rows, or one document per row, truncated and padded (the papers).", "--pack/--no-pack")
    seq_len: int | None = _setting(None, "Tokens per row.")
    max_seq_len: int | None = _setting(None, "Longest sequence the model accepts (RoPE is computed, not learnt).")
    hidden_size: int | None = _setting(None, "Width of the residual stream.")
    intermediate_size: int | None = _setting(None, "Width of the SwiGLU MLP.")
    num_layers: int | None = _setting(None, "Number of transformer blocks (how many, where --layers elsewhere names which).", "--num-layers")
    num_heads: int | None = _setting(None, "Attention heads.", "--heads")
    steps: int | None = _setting(None, "Optimizer steps.")
    tokens: int | None = _setting(None, "Train on this many tokens instead of --steps (batch x seq-len per step).")
    lr: float | None = _setting(None, "Peak learning rate.")
    warmup: int | None = _setting(None, "Linear warm-up steps.")
    min_lr_ratio: float = _setting(0.1, "Cosine decays to this share of the peak.")
    batch_size: int | None = _setting(None, "Sequences per optimizer step.")
    micro_batch: int | None = _setting(None, "Sequences per forward/backward (gradient accumulation).")
    largest_micro_batch: bool = _setting(False, "One process: start with the whole batch as one micro-batch and halve it while the GPU runs out of memory, "
                                                "down to --micro-batch; the first step that fits fixes it for the run (chosen again on resume).", "--largest-micro-batch")
    optimizer: str = _setting("adam", "adam (the papers) or adamw.")
    weight_decay: float = _setting(0.0, "Weight decay.")
    beta1: float = field(default=0.9, metadata={"flag": None})  # the papers' Adam betas: not an option
    beta2: float = field(default=0.999, metadata={"flag": None})
    grad_clip: float = _setting(0.0, "Clip the gradient norm to this (0: off, the papers).")
    precision: str = _setting("auto", "auto (bf16-mixed on GPU, fp32 on CPU), fp32, bf16-mixed (fp32 master weights) or bf16 (pure, the papers).")
    seed: int = _setting(42, "Seed of the initial weights and the data order.")
    val_tokens: int | None = _setting(None, "Held-out tokens for the validation loss.")
    eval_every: int | None = _setting(None, "Steps between validation losses.")
    save_every: int | None = _setting(None, "Checkpoint every this many steps.")
    log_every: int | None = _setting(None, "Steps between logged training losses.")
    layer_metrics_tokens: int = _setting(512, "At every evaluation, per layer: gradient norm, residual variance and identity distance, over this many validation tokens (0: off).")
    layer_metrics_probes: int = _setting(2, "Random probes per sequence for the identity distance at each evaluation.")
    report_to: str = _setting("none", "Also send what metrics.jsonl records, as it happens, to: none, tensorboard, wandb, or both (comma separated); "
                              "W&B offline unless an API key is set up. Rank 0 only; a resume continues the same curves.")
    device: str = _setting("auto", "auto, cpu or cuda.")
    kernels: str = _setting("auto", "auto (Triton on CUDA without --compile, the plain model otherwise), triton, torch (the fused kernels' PyTorch path) or off (the plain model).")
    compile: bool = _setting(False, "torch.compile each block, and the loss with --kernels off.", "--compile")
    compile_scope: str = _setting("blocks", "With --compile: blocks (each block, and the loss) or model (the whole forward with its loss as one graph; not with --parallel fsdp).")
    compile_mode: str = _setting("default", "With --compile: torch.compile's mode: default, reduce-overhead (CUDA graphs: did not train on torch 2.11, docs/benchmarks.md), max-autotune or max-autotune-no-cudagraphs.")
    fuse_projections: bool = _setting(False, "One matmul for q, k and v and one for gate and up (weights concatenated at each forward; the same parameters, checkpoints and exports).", "--fuse-projections")
    activation_checkpointing: bool = _setting(False, "Recompute each block's activations in the backward pass (less memory, about a third more compute).", "--activation-checkpointing")
    parallel: str | None = _setting(None, "Under torchrun: ddp (default) or fsdp (FSDP2, sharded weights and optimizer state).")

    def resolved(self) -> "TrainConfig":
        """A copy with every None filled from the preset and checked: what the run records."""
        if self.preset not in PRESETS:
            raise DepthcurseError(f"unknown preset {self.preset!r}: use one of {', '.join(PRESETS)}")
        if self.norm not in REGISTRY:  # before the preset fills the rest: the first thing to say
            raise DepthcurseError(f"unknown norm {self.norm!r}: use one of {', '.join(REGISTRY)}")
        defaults = {**COMMON_DEFAULTS, **PRESETS[self.preset]}
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


def options() -> list:
    """The fields that are command-line options, in order: (field, flag, help)."""
    out = []
    for f in fields(TrainConfig):
        if "help" in f.metadata:
            out.append((f, f.metadata["flag"] or "--" + f.name.replace("_", "-"), f.metadata["help"]))
    return out


def check_architecture(norm: str, hidden_size: int, num_heads: int, mix_ratio: float, dyt_alphas: tuple[float, ...] = (1.0,),
                       base_layers: int = 1, init: str = "authors") -> None:
    """The model's own constraints, checked with the run's settings before anything is written."""
    if norm not in REGISTRY:
        raise DepthcurseError(f"unknown norm {norm!r}: use one of {', '.join(REGISTRY)}")
    if init not in INITS:
        raise DepthcurseError(f"unknown --init {init!r}: use authors or common")
    if not all(a > 0 and math.isfinite(a) for a in dyt_alphas):
        raise DepthcurseError(f"--dyt-alpha-attn and --dyt-alpha-ffn must be positive, got {', '.join(map(str, dyt_alphas))}")
    if base_layers < 1:
        raise DepthcurseError(f"--base-layers must be at least 1, got {base_layers}")
    if num_heads < 1 or hidden_size % num_heads or (hidden_size // num_heads) % 2:
        raise DepthcurseError(f"--hidden-size {hidden_size} must split into --heads {num_heads} heads of even size")
    if not 0.0 <= mix_ratio <= 1.0:
        raise DepthcurseError(f"--mix-ratio must be between 0 and 1, got {mix_ratio}")


def check_schedule(lr: float, warmup: int, steps: int, min_lr_ratio: float, weight_decay: float, grad_clip: float) -> None:
    """The optimiser's and the schedule's settings (lns-train's and heal's)."""
    if not (lr > 0 and math.isfinite(lr)):
        raise DepthcurseError(f"--lr must be a positive number, got {lr}")
    if not 0 <= warmup <= steps:
        raise DepthcurseError(f"--warmup must be between 0 and the number of steps ({steps}), got {warmup}")
    if not 0 <= min_lr_ratio <= 1:
        raise DepthcurseError(f"--min-lr-ratio must be between 0 and 1, got {min_lr_ratio}")
    if weight_decay < 0 or grad_clip < 0:
        raise DepthcurseError("--weight-decay and --grad-clip must not be negative")


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
    check_schedule(cfg.lr, cfg.warmup, cfg.steps, cfg.min_lr_ratio, cfg.weight_decay, cfg.grad_clip)
    if cfg.optimizer not in OPTIMIZERS:
        raise DepthcurseError(f"unknown optimizer {cfg.optimizer!r}: use adam or adamw")
    if cfg.precision not in PRECISIONS:
        raise DepthcurseError(f"unknown precision {cfg.precision!r}: use one of {', '.join(PRECISIONS)}")
    parse_report_to(cfg.report_to)
    if cfg.layer_metrics_tokens < 0 or cfg.layer_metrics_probes < 1:
        raise DepthcurseError("--layer-metrics-tokens must be 0 or more and --layer-metrics-probes at least 1")
    if not (0 <= cfg.beta1 < 1 and 0 <= cfg.beta2 < 1):
        raise DepthcurseError("Adam betas must be in [0, 1)")
    if cfg.kernels not in KERNELS:
        raise DepthcurseError(f"unknown --kernels {cfg.kernels!r}: use one of {', '.join(KERNELS)}")
    if cfg.compile_scope not in COMPILE_SCOPES:
        raise DepthcurseError(f"unknown --compile-scope {cfg.compile_scope!r}: use blocks or model")
    if cfg.compile_mode not in COMPILE_MODES:
        raise DepthcurseError(f"unknown --compile-mode {cfg.compile_mode!r}: use one of {', '.join(COMPILE_MODES)}")
    if not cfg.compile and (cfg.compile_scope, cfg.compile_mode) != ("blocks", "default"):
        raise DepthcurseError("--compile-scope and --compile-mode say how to compile: they need --compile")
    if cfg.parallel == "fsdp" and cfg.compile and cfg.compile_scope == "model":
        raise DepthcurseError("--compile-scope model does not run under --parallel fsdp, which gathers each block's weights around its forward: use --compile-scope blocks")
    if cfg.parallel is not None and cfg.parallel not in PARALLEL:
        raise DepthcurseError(f"unknown --parallel {cfg.parallel!r}: use ddp or fsdp")
    check_architecture(cfg.norm, cfg.hidden_size, cfg.num_heads, cfg.mix_ratio, (cfg.dyt_alpha_attn, cfg.dyt_alpha_ffn), cfg.base_layers, cfg.init)
