"""What a heal run is: the layers removed, the method that wins the removal back (by name, with
its own settings: `heal.method`), the text it calibrates or trains on, the schedule of the methods
that train, and what the models are measured on. The command line checks a run's settings with
this before loading a model."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field, fields, replace

from depthcurse.errors import DepthcurseError
from depthcurse.kept_state import identity_of, plain
from depthcurse.heal.method import Method, addresses, build_method, method_settings_text, parse_method_args
from depthcurse.train.config import check_schedule
from depthcurse.train.tracking import parse_report_to

CONFIG = "config.json"


@dataclass
class HealConfig:
    """One heal: `layers` removed, won back by `method` (a registered name, `a+b`, or
    `module:Class`) with `method_args` (its settings, `key=value` as text or typed), trained (by
    the methods that train) for `steps` on `data`, the model measured unpruned, pruned and healed
    on held-out windows of that data, of `eval_data` (text of another source, where given) and on
    `task`. The schedule follows Gromov et al.'s healing: AdamW, linear warm-up, cosine decay."""

    layers: tuple[int, ...]
    method: str = "lora"
    method_args: dict = field(default_factory=dict)
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
    eval_data: str | None = None  # text of another source the models are also measured on
    task: str | None = None
    limit: int | None = None
    num_fewshot: int = 0
    seed: int = 1234
    save_every: int = 25
    log_every: int = 1
    report_to: str = "none"  # live trackers of the training (train/tracking.py): none, tensorboard, wandb

    def build(self) -> Method:
        """The method, its settings checked (one clear line for a bad one)."""
        return build_method(self.method, self.method_args)

    def for_method(self, method: str) -> "HealConfig":
        """This run by `method` alone, with the settings among `method_args` that are its own (in a
        comparison, each method takes those of its fields; `name.key` is that method's only)."""
        mine = {}
        own, named = _fields_of(build_method(method)), addresses(method)
        for key, value in self.method_args.items():
            scope, dot, bare = key.rpartition(".")
            if dot and scope in named:
                mine[key] = value
            elif not dot and bare in own:
                mine[key] = value
        return replace(self, method=method, method_args=mine)

    def command(self, model: str) -> str:
        """The `depthcurse heal` command that makes this run again: the method and its settings
        away from their defaults, and the common options the method uses (the schedule only for
        one that trains)."""
        method = self.build()
        defaults = HealConfig(layers=())
        parts = ["depthcurse", "heal", shlex.quote(model), "--layers", ",".join(map(str, self.layers)), "--method", shlex.quote(self.method)]
        settings = method_settings_text(method)
        if settings:
            parts += ["--method-args", shlex.quote(settings)]
        schedule = {"steps", "batch_size", "micro_batch", "lr", "warmup", "min_lr_ratio", "weight_decay", "grad_clip"}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("layers", "method", "method_args") or f.name in RESUMABLE_CHANGES or value is None or (f.name in schedule and not method.trains):
                continue
            if value == getattr(defaults, f.name) and f.name not in ALWAYS_SAID:
                continue
            if f.name in NOT_OPTIONS:
                parts.append(f"# and {f.name}={value} (set in Python)")
                continue
            parts += [f"--{f.name.replace('_', '-')}", shlex.quote(str(value))]
        return " ".join(p for p in parts if not p.startswith("#")) + "".join(f"  {p}" for p in parts if p.startswith("#"))

    def healing(self, method: Method) -> dict:
        """How the removal was won back, in the settings that mattered to the method (a model card's)."""
        out = {"method": method.name, "title": method.title, "how": method.describe(), "settings": method.recorded(), "data": self.data, "seed": self.seed,
               "spec": self.method}  # as typed: an outside method's file or module and class
        if method.trains:
            out.update(steps=self.steps, batch_size=self.batch_size, seq_len=self.seq_len, lr=self.lr, warmup=self.warmup)
        return out

    def resolved(self) -> "HealConfig":
        """Checked (all but the layers, which `heal.loop.check` checks against the model), with the
        defaults that depend on others filled in: what the run records."""
        cfg = replace(self, method_args=dict(self.method_args))
        twice = sorted({i for i in self.layers if list(self.layers).count(i) > 1})
        if twice:
            raise DepthcurseError(f"layers {','.join(map(str, self.layers))} name layer {','.join(map(str, twice))} more than once: name each layer once")
        cfg.layers = tuple(sorted(self.layers))
        cfg.micro_batch = min(self.micro_batch or self.batch_size, self.batch_size)
        cfg.warmup = max(1, round(0.1 * self.steps)) if self.warmup is None else self.warmup
        _check(cfg)
        cfg.build()  # the method's own settings
        return cfg

    def identity(self) -> dict:
        """What a resumed run must share with the one in the folder: every field (`kept_state`) but how
        often it saves, logs and reports, and the method's settings as the method typed them, defaults
        included, in place of `--method-args` as given."""
        method = self.build()
        return {**identity_of(self, leave_out=RESUMABLE_CHANGES | {"method_args"}), "method": method.name, "method_settings": plain(method.recorded())}


RESUMABLE_CHANGES = frozenset({"save_every", "log_every", "report_to"})
ALWAYS_SAID = frozenset({"data", "steps", "seed"})  # in a run's command even at their defaults
NOT_OPTIONS = frozenset({"min_lr_ratio", "weight_decay", "grad_clip"})  # settings `depthcurse heal` takes no option for


def _fields_of(method: Method) -> set[str]:
    members = getattr(method, "members", [method])
    return {f.name for m in members for f in fields(m.Settings)}


def method_args(text: str | None, **common) -> dict:
    """`--method-args` parsed, with the command line's common options given (not None) under
    their field names: what `HealConfig.method_args` holds."""
    args = {k: v for k, v in common.items() if v is not None}
    args.update(parse_method_args(text))
    return args


def _check(cfg: HealConfig) -> None:
    parse_report_to(cfg.report_to)
    for name in ("steps", "batch_size", "micro_batch", "eval_windows", "save_every", "log_every"):
        if getattr(cfg, name) < 1:
            raise DepthcurseError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(cfg, name)}")
    if cfg.eval_windows < 2:
        raise DepthcurseError(f"--eval-windows must be at least 2, got {cfg.eval_windows}: every share and difference comes with a 95% interval, "
                              "which needs two paired windows at least")
    if cfg.batch_size % cfg.micro_batch:
        raise DepthcurseError(f"--batch-size {cfg.batch_size} is not a multiple of --micro-batch {cfg.micro_batch}")
    if cfg.seq_len is not None and cfg.seq_len < 3:
        raise DepthcurseError(f"--seq-len must be at least 3, got {cfg.seq_len}")
    check_schedule(cfg.lr, cfg.warmup, cfg.steps, cfg.min_lr_ratio, cfg.weight_decay, cfg.grad_clip)
    if cfg.limit is not None and cfg.limit < 1:
        raise DepthcurseError("--limit must be a positive number")
    if cfg.num_fewshot < 0:
        raise DepthcurseError(f"--num-fewshot must be 0 or more, got {cfg.num_fewshot}")
