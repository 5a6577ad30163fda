"""What a heal run is: the layers removed, how the removal is won back (the method), the adapters,
the data, the schedule, the loss and what it is measured on. No torch here: the command line
checks a run's settings before loading a model."""

from __future__ import annotations

import math
import shlex
from dataclasses import asdict, dataclass, fields

from depthcurse.errors import DepthcurseError
from depthcurse.train.config import check_schedule

LOSSES = ("lm", "distill")
TARGETS = ("mlp", "attn", "all")  # which branches of each kept block get adapters
# How a removal is won back: LoRA adapters trained on text (Gromov et al.); a least-squares linear
# map folded into the MLP output of the block before each cut (ReplaceMe, training-free); one
# layer per cut trained to give what the removed run gave (LLM-Streamline); the map, then LoRA.
METHODS = ("lora", "linear", "layer", "linear+lora")
TRAINED = ("lora", "layer", "linear+lora")
ADAPT = ("all", "after")  # adapters on every kept block, or only on those after the first removed layer
CONFIG = "config.json"


@dataclass
class HealConfig:
    """One heal: `layers` removed, LoRA adapters (peft) on the kept blocks' `targets` trained for
    `steps` on `data`, the model measured unpruned, pruned and healed on held-out windows of that
    data and on `task`. Defaults follow Gromov et al.'s healing: adapters on the MLPs, a small
    rank, dropout 0.05, next-token loss, a cosine schedule."""

    layers: tuple[int, ...]
    method: str = "lora"
    loss: str = "lm"
    targets: str = "mlp"
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.05
    data: str = "auto"
    steps: int = 100
    batch_size: int = 8
    micro_batch: int | None = None  # sequences per forward and backward (None: the whole batch)
    seq_len: int | None = None  # None: 512, or the model's maximum if less
    lr: float = 2e-4
    warmup: int | None = None  # None: a tenth of the steps
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    eval_windows: int = 32  # held-out windows of seq_len tokens
    task: str | None = None
    limit: int | None = None
    num_fewshot: int = 0
    seed: int = 1234
    save_every: int = 25
    log_every: int = 1
    adapt: str = "all"  # where the adapters go: every kept block, or only the blocks after the first removed layer
    calib_tokens: int = 16384  # linear: tokens of the training text the maps are estimated on
    ridge: float = 0.0  # linear: pulls each map toward the identity (the plain removal), relative to the mean eigenvalue of its Gram matrix

    def for_method(self, method: str) -> "HealConfig":
        """This run by `method` (in a comparison: `loss` is the adapters' and applies to the methods that train some)."""
        return HealConfig(**{**asdict(self), "method": method, "loss": self.loss if method in ("lora", "linear+lora") else "lm"})

    def command(self, model: str) -> str:
        """The `depthcurse heal` command that makes this run again: every setting not at its default
        (and the data, the steps and the seed always)."""
        defaults = HealConfig(layers=())
        parts = ["depthcurse", "heal", shlex.quote(model), "--layers", ",".join(map(str, self.layers))]
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("layers", "save_every", "log_every") or value is None or (value == getattr(defaults, f.name) and f.name not in ALWAYS_SAID):
                continue
            if f.name in NOT_OPTIONS:
                parts.append(f"# and {f.name}={value} (set in Python)")
                continue
            parts += [f"--{f.name.replace('_', '-')}", shlex.quote(str(value))]
        return " ".join(p for p in parts if not p.startswith("#")) + "".join(f"  {p}" for p in parts if p.startswith("#"))

    def healing(self) -> dict:
        """How the removal was won back, in the settings that mattered to the method (a model card's)."""
        out = {"method": self.method, "data": self.data, "seed": self.seed}
        if self.maps:
            out.update(calib_tokens=self.calib_tokens, ridge=self.ridge)
        if self.trains:
            out.update(steps=self.steps, batch_size=self.batch_size, seq_len=self.seq_len, lr=self.lr, warmup=self.warmup)
        if self.adapters:
            out.update(loss=self.loss, lora_rank=self.lora_rank, lora_alpha=self.lora_alpha, lora_dropout=self.lora_dropout, targets=self.targets,
                       adapt=self.adapt)
        return out

    @property
    def trains(self) -> bool:
        return self.method in TRAINED

    @property
    def maps(self) -> bool:
        return self.method in ("linear", "linear+lora")

    @property
    def adapters(self) -> bool:
        return self.method in ("lora", "linear+lora")

    def resolved(self) -> "HealConfig":
        """Checked (all but the layers, which `heal.loop.check` checks against the model), with the
        defaults that depend on others filled in: what the run records."""
        cfg = HealConfig(**asdict(self))
        twice = sorted({i for i in self.layers if list(self.layers).count(i) > 1})
        if twice:
            raise DepthcurseError(f"layers {','.join(map(str, self.layers))} name layer {','.join(map(str, twice))} more than once: name each layer once")
        cfg.layers = tuple(sorted(self.layers))
        cfg.micro_batch = min(self.micro_batch or self.batch_size, self.batch_size)
        cfg.warmup = max(1, round(0.1 * self.steps)) if self.warmup is None else self.warmup
        _check(cfg)
        return cfg

    def identity(self) -> dict:
        """What a resumed run must share with the one in the folder (how often it saves or logs may
        change). Settings the method does not use at their defaults are left out, so that a run
        made before they existed is the same run."""
        unused = {"method": self.method == "lora", "adapt": self.adapt == "all", "calib_tokens": not self.maps, "ridge": not self.maps}
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items() if k not in RESUMABLE_CHANGES and not unused.get(k)}


RESUMABLE_CHANGES = frozenset({"save_every", "log_every"})
ALWAYS_SAID = frozenset({"method", "data", "steps", "seed"})  # in a run's command even at their defaults
NOT_OPTIONS = frozenset({"min_lr_ratio", "weight_decay", "grad_clip"})  # settings `depthcurse heal` takes no option for


def _check(cfg: HealConfig) -> None:
    if cfg.method not in METHODS:
        raise DepthcurseError(f"unknown --method {cfg.method!r}: use {', '.join(METHODS)}")
    if cfg.adapt not in ADAPT:
        raise DepthcurseError(f"unknown --adapt {cfg.adapt!r}: use all (every kept block) or after (the blocks after the first removed layer)")
    if cfg.calib_tokens < 1:
        raise DepthcurseError(f"--calib-tokens must be at least 1, got {cfg.calib_tokens}")
    if not (cfg.ridge >= 0 and math.isfinite(cfg.ridge)):
        raise DepthcurseError(f"--ridge must be 0 or more, got {cfg.ridge}")
    if cfg.loss not in LOSSES:
        raise DepthcurseError(f"unknown --loss {cfg.loss!r}: use lm (next-token) or distill (KL from the unpruned model)")
    if cfg.loss != "lm" and not cfg.adapters:
        raise DepthcurseError(f"--loss {cfg.loss} trains adapters: --method {cfg.method} " + ("trains its new layers on the removed runs' output (MSE)" if cfg.method == "layer" else "trains nothing"))
    if cfg.targets not in TARGETS:
        raise DepthcurseError(f"unknown --targets {cfg.targets!r}: use mlp (the paper's), attn or all")
    if cfg.lora_rank < 1:
        raise DepthcurseError(f"--lora-rank must be at least 1, got {cfg.lora_rank}")
    if not (cfg.lora_alpha > 0 and math.isfinite(cfg.lora_alpha)):
        raise DepthcurseError(f"--lora-alpha must be positive, got {cfg.lora_alpha}")
    if not 0 <= cfg.lora_dropout < 1:
        raise DepthcurseError(f"--lora-dropout must be in [0, 1), got {cfg.lora_dropout}")
    for name in ("steps", "batch_size", "micro_batch", "eval_windows", "save_every", "log_every"):
        if getattr(cfg, name) < 1:
            raise DepthcurseError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(cfg, name)}")
    if cfg.batch_size % cfg.micro_batch:
        raise DepthcurseError(f"--batch-size {cfg.batch_size} is not a multiple of --micro-batch {cfg.micro_batch}")
    if cfg.seq_len is not None and cfg.seq_len < 3:
        raise DepthcurseError(f"--seq-len must be at least 3, got {cfg.seq_len}")
    check_schedule(cfg.lr, cfg.warmup, cfg.steps, cfg.min_lr_ratio, cfg.weight_decay, cfg.grad_clip)
    if cfg.limit is not None and cfg.limit < 1:
        raise DepthcurseError("--limit must be a positive number")
    if cfg.num_fewshot < 0:
        raise DepthcurseError(f"--num-fewshot must be 0 or more, got {cfg.num_fewshot}")
