"""The tuned lens (Belrose et al., "Eliciting Latent Predictions from Transformers with the Tuned
Lens", 2023; AlignmentResearch/tuned-lens @ 8db471b, `nn/lenses.py` and `scripts/train_loop.py`):
one affine translator per stream, h + A h + b, read by the model's own final norm and head, and
trained so that its distribution matches the model's output (KL(output || lens)).

As their code does it: a translator for each stream their loop reads, `hidden_states[:-1]`: the
embedding's output (their index 0) and the stream after every layer but the last (index l + 1
after layer l; the last layer's stream is the model's output and has none), so index i is the
stream entering layer i; every translator starts at zero (the lens starts as the logit lens, and
weight decay pulls it back there, not to zero); the loss is each stream's KL at the same position
(their default `--loss kl`, shift 0), each translator's backward in turn; SGD with Nesterov momentum
0.9 at lr `lr_scale * (1 - 0.9)` (they undo PyTorch's 1 / (1 - momentum) gain), weight decay 1e-3,
the learning rate falling linearly to 0 over the steps with no warm-up (theirs for SGD), the
gradient clipped to norm 1 over every translator, the embedding's included, before each step; 250
steps of 2^18 tokens (fewer where the text has fewer: the steps then go round the same windows, in
a seeded shuffled order as their loader shuffles). Their steps run in bf16 autocast on a GPU; here
the translators keep fp32 weights and compute in fp32 on the model's stream (whatever its dtype,
float32 on the CPU by default), their output cast back to the stream's dtype for the final norm
and head. `LensSettings(embedding=False)` leaves the embedding's
translator out (the form this project trained before: its clip then sees the other translators only).

A lens is a file (`save`, `load_lens`): the translators (safetensors) and a fingerprint of the
model it read (its width, depth and a hash of its final norm and head), so that a lens trained on
another model is refused in one line instead of read through the wrong head.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from depthcurse.depth.measure import output_kl
from depthcurse.errors import DepthcurseError
from depthcurse.forecast import Forecast
from depthcurse.io import atomic_write
from depthcurse.kept_state import call_identity
from depthcurse.prune.stepping import Stepper

LENS_FILE = "tuned_lens.safetensors"

# Why `--dtype auto` is fp32 on a CPU with a tuned lens (runtime.pick_dtype): the lens trains in the
# model's dtype, as its authors' does in bf16 autocast only on a GPU.
FP32_ON_CPU = "as a tuned lens trains or reads in the model's dtype"


@dataclass(frozen=True)
class LensSettings:
    steps: int = 250  # their --num_steps
    tokens_per_step: int = 2**18  # their --tokens_per_step; at most the training text's tokens here
    lr_scale: float = 1.0  # their --lr_scale: SGD's lr is lr_scale * (1 - momentum)
    momentum: float = 0.9
    weight_decay: float = 1e-3
    micro_batch: int = 4  # windows per backward (a step accumulates tokens_per_step's worth)
    seed: int = 42  # the order the steps take the windows in (their --seed)
    embedding: bool = True  # their translator of the embedding's output (index 0), trained and clipped with the others

    def check(self) -> None:
        if self.steps < 1 or self.tokens_per_step < 1 or self.micro_batch < 1:
            raise DepthcurseError(f"--lens-steps, the lens's tokens per step and its micro-batch must each be at least 1 (got {self.steps}, "
                                  f"{self.tokens_per_step}, {self.micro_batch})")
        if not 0 <= self.momentum < 1 or self.lr_scale <= 0 or self.weight_decay < 0:
            raise DepthcurseError("the tuned lens needs 0 <= momentum < 1, lr_scale > 0 and weight_decay >= 0")


class TunedLens(torch.nn.Module):
    """A translator for each stream entering a layer (their indexing: 0 the embedding's output, l + 1
    the stream after layer l), none for the output; `forward(h, i)` is stream i made ready for the
    model's final norm and head (stream `layers`, the output, as it is)."""

    def __init__(self, width: int, layers: int, fingerprint: dict, embedding: bool = True):
        super().__init__()
        self.fingerprint, self.layers = fingerprint, layers
        self.translators = torch.nn.ModuleDict({str(i): torch.nn.Linear(width, width) for i in range(0 if embedding else 1, layers)})
        for t in self.translators.values():  # the logit lens to start, and what weight decay pulls toward
            torch.nn.init.zeros_(t.weight)
            torch.nn.init.zeros_(t.bias)

    @property
    def embedding(self) -> bool:
        return "0" in self.translators

    def forward(self, h: torch.Tensor, stream: int) -> torch.Tensor:
        translator = self.translators[str(stream)] if str(stream) in self.translators else None
        if translator is None:  # the output's stream, or the embedding's in the form without its translator
            return h
        # residual, as theirs: decay regularises toward the identity. The translators keep fp32 weights and
        # compute in fp32 whatever the model's dtype (theirs: fp32 weights under bf16 autocast), the result
        # in the stream's dtype for the model's final norm and head
        x = h.float()
        return (x + translator(x)).to(h.dtype)

    def save(self, path: Path, record: dict | None = None) -> Path:
        from safetensors.torch import save_file

        meta = {"fingerprint": json.dumps(self.fingerprint), "training": json.dumps(record or {}), "indexing": "entering"}
        save_file({k: v.detach().contiguous() for k, v in self.translators.state_dict().items()}, str(path), metadata=meta)
        return Path(path)


def fingerprint(stepper: Stepper) -> dict:
    """What a lens depends on: the stream's width, the layers, and the final norm and head it is read
    by (a hash of their weights)."""
    digest = hashlib.sha256()
    for tensor in (stepper.norm.weight, stepper.head.weight):
        digest.update(tensor.detach().float().cpu().numpy().tobytes())
    return {"width": int(stepper.head.weight.shape[1]), "layers": int(stepper.n_layers), "head_sha256": digest.hexdigest()[:16]}


def load_lens(path: Path, stepper: Stepper) -> tuple[TunedLens, dict]:
    """A saved lens for this model, and how it was trained; one line where it was trained on another."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise DepthcurseError(f"--lens {path}: no such file")
    try:
        with safe_open(str(path), "pt") as f:  # the metadata and the tensors in one read
            meta = f.metadata() or {}
            state = {name: f.get_tensor(name) for name in f.keys()}
        theirs = json.loads(meta["fingerprint"])
    except (SafetensorError, KeyError, ValueError, OSError) as exc:
        raise DepthcurseError(f"--lens {path} is not a tuned lens written by depth-use ({exc})") from None
    if meta.get("indexing") != "entering":
        raise DepthcurseError(f"--lens {path} was written by an older depth-use, whose translators are numbered by another rule: train one again with --tuned-lens")
    ours = fingerprint(stepper)
    if theirs != ours:
        raise DepthcurseError(f"--lens {path} was trained on another model (width {theirs.get('width')}, {theirs.get('layers')} layers, head "
                              f"{theirs.get('head_sha256')}; this one: width {ours['width']}, {ours['layers']} layers, head {ours['head_sha256']}): "
                              "train one for it with --tuned-lens")
    lens = TunedLens(ours["width"], ours["layers"], ours, embedding=any(k.startswith("0.") for k in state))
    lens.translators.load_state_dict(state)
    return lens.to(stepper.device), json.loads(meta.get("training", "{}"))


@contextlib.contextmanager
def _frozen(model: torch.nn.Module):
    """The model's own weights out of the backward: only the lens learns."""
    kept = {name: p.requires_grad for name, p in model.named_parameters()}
    model.requires_grad_(False)
    try:
        yield
    finally:
        for name, p in model.named_parameters():
            p.requires_grad_(kept[name])


def _kl(final: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(output || lens) per token: their loss, `sum(labels.exp() * (labels - logits.log_softmax(-1)))`."""
    return output_kl(final, torch.log_softmax(logits.float(), -1))


@torch.no_grad()
def _streams(stepper: Stepper, ids: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The stream entering every layer (their `hidden_states[:-1]`: the embedding's output first),
    and the output's log-probabilities."""
    every = stepper.streams(ids, embedding=True)
    return every[:-1], torch.log_softmax(stepper.logits(every[-1]), -1)


PARTIAL_FILE = "tuned_lens.partial.safetensors"


def _save_state(path: Path, lens: TunedLens, opt: torch.optim.Optimizer, step: int, order: list[int], rng: random.Random, last: list[float],
                identity: dict, seconds: float) -> None:
    """Training so far, after `step` steps: the translators, SGD's momentum, the windows' order and its
    generator, written whole or not at all (safetensors and JSON: nothing is unpickled on resume)."""
    from safetensors.torch import save_file

    tensors = {f"lens.{k}": v.detach().contiguous() for k, v in lens.translators.state_dict().items()}
    for i, p in enumerate(lens.parameters()):
        if "momentum_buffer" in opt.state.get(p, {}):
            tensors[f"momentum.{i}"] = opt.state[p]["momentum_buffer"].detach().contiguous()
    version, state, gauss = rng.getstate()
    meta = {"identity": json.dumps(identity), "step": str(step), "order": json.dumps(order), "rng": json.dumps([version, list(state), gauss]),
            "last": json.dumps(last), "seconds": str(seconds)}
    atomic_write(Path(path), lambda temporary: save_file(tensors, str(temporary), metadata=meta))


def _load_state(path: Path, identity: dict) -> dict | None:
    """What `_save_state` wrote, where it is this training's (the same model, settings and windows)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as f:
            meta, tensors = f.metadata() or {}, {name: f.get_tensor(name) for name in f.keys()}
        if json.loads(meta["identity"]) != identity:
            return None
        version, state, gauss = json.loads(meta["rng"])
        return {"tensors": tensors, "step": int(meta["step"]), "order": json.loads(meta["order"]), "rng": (version, tuple(state), gauss),
                "last": json.loads(meta["last"]), "seconds": float(meta["seconds"])}
    except (SafetensorError, KeyError, ValueError, OSError):
        return None


def partial_step(path: Path) -> tuple[int, int] | None:
    """(steps kept, steps in all) of an interrupted training kept in `path` (None: nothing kept)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        return int(meta["step"]), int(json.loads(meta["identity"])["settings"]["steps"])
    except (SafetensorError, KeyError, ValueError, OSError):
        return None


def train_tuned_lens(model, stepper: Stepper, windows: torch.Tensor, settings: LensSettings = LensSettings(),
                     on_step=lambda text, done, total: None, clock=time.perf_counter, state: Path | None = None,
                     forecast: Forecast | None = None) -> tuple[TunedLens, dict]:
    """A tuned lens for `model`, trained on `windows` (token ids, windows x tokens): the lens and what
    its training did (each translated stream's mean KL over the last step, the tokens it saw, the seconds).
    With `state`, training so far is kept there after every step and taken up from it: an interrupted
    training resumes where it stopped and ends as one that never stopped (the file is left for the
    caller to remove once the lens is saved). `forecast` hears each finished step (it says, after the
    first, how long the rest will take)."""
    identity = call_identity(train_tuned_lens, locals(), leave_out={"stepper"})  # the stepper is the model's own, digested with it
    settings.check()
    started = clock()
    n, width = stepper.n_layers, int(stepper.head.weight.shape[1])
    lens = TunedLens(width, n, fingerprint(stepper), embedding=settings.embedding).to(stepper.device)
    trained = [int(i) for i in lens.translators]  # the streams with a translator, in order
    per_window = windows.shape[1]
    step_windows = max(1, min(len(windows), settings.tokens_per_step // per_window))
    momentum = settings.momentum
    opt = torch.optim.SGD(lens.parameters(), lr=settings.lr_scale * (1 - momentum), momentum=momentum, nesterov=momentum > 0,
                          weight_decay=settings.weight_decay)
    # transformers' get_linear_schedule_with_warmup(opt, 0, steps): 1 - step / steps
    factor = lambda step: max(0.0, (settings.steps - step) / settings.steps)  # noqa: E731
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    order: list[int] = []
    rng = random.Random(settings.seed)
    last = [0.0] * len(trained)
    first, before = 0, 0.0
    kept = _load_state(state, identity) if state is not None and Path(state).is_file() else None
    if kept is not None:  # the translators, the momentum, the learning rate, the order and its generator, as they stood
        lens.translators.load_state_dict({k.removeprefix("lens."): v for k, v in kept["tensors"].items() if k.startswith("lens.")})
        for i, p in enumerate(lens.parameters()):
            if f"momentum.{i}" in kept["tensors"]:
                opt.state[p]["momentum_buffer"] = kept["tensors"][f"momentum.{i}"].to(p.device)
        first, order, last, before = kept["step"], kept["order"], kept["last"], kept["seconds"]
        rng.setstate(kept["rng"])
        schedule.last_epoch = first
        for group, base in zip(opt.param_groups, schedule.base_lrs):
            group["lr"] = base * factor(first)
    forecast = forecast or Forecast("the tuned lens's steps")
    with _frozen(model):
        for step, _ in forecast.over(range(settings.steps), first, kept_in=state):
            on_step("training the tuned lens", step, settings.steps)
            while len(order) < step_windows:  # go round the windows, each round in a fresh shuffled order
                round_ = list(range(len(windows)))
                rng.shuffle(round_)
                order += round_
            taken, order = order[:step_windows], order[step_windows:]
            sums = [0.0] * len(trained)
            for start in range(0, step_windows, settings.micro_batch):
                ids = windows[taken[start : start + settings.micro_batch]]
                entering, final = _streams(stepper, ids)
                share = len(ids) / step_windows  # each micro-batch's part of the step's mean
                for k, stream in enumerate(trained):  # one translator's backward at a time, as theirs (memory)
                    loss = _kl(final, stepper.logits(lens(entering[stream], stream))).mean()
                    (loss * share).backward()
                    sums[k] += loss.item() * share
            torch.nn.utils.clip_grad_norm_(lens.parameters(), 1.0)  # over every translator, the embedding's included
            opt.step()
            opt.zero_grad(set_to_none=False)
            schedule.step()
            last = sums
            if state is not None:
                _save_state(state, lens, opt, step + 1, order, rng, last, identity, before + clock() - started)
    record = {"settings": asdict(settings), "train_windows": len(windows), "tokens_per_step": step_windows * per_window,
              "translated_streams": trained, "train_kl_last_step": last, "seconds": round(before + clock() - started, 3)}
    if first:
        record["resumed_at_step"] = first
    return lens.eval(), record
