"""Checkpoints of a training run, assembled from parts that save their own state.

As in torchtitan's CheckpointManager, the checkpoint is `{name: part.state_dict()}` over the
run's stateful parts (model, optimizer, schedule, data position, RNG, step counters), and
resuming hands each part its own entry back. A part knows how to gather itself: the model and
optimizer come whole, on the CPU and keyed by parameter name, whatever the wrapper (DDP, FSDP2)
and number of ranks, so a checkpoint resumes on any number of ranks.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from depthcurse.errors import DepthcurseError
from depthcurse.io import atomic_write, ensure_out_dir, refuse_other_run
from depthcurse.train.config import CONFIG, RESUMABLE_CHANGES
from depthcurse.runtime import World

CHECKPOINT = "checkpoint.pt"


class ModelState:
    """The model's weights, gathered whole on the CPU (a collective under torchrun); with
    `trainable_only`, only those that train (a healed model's adapters, not its frozen 7B)."""

    def __init__(self, model: torch.nn.Module, trainable_only: bool = False):
        self.model, self.trainable_only = model, trainable_only

    def state_dict(self) -> dict:
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=self.trainable_only))
        if self.trainable_only:
            # ignore_frozen_params drops the frozen parameters it finds by name, and a tied weight
            # has two names of which named_parameters() gives one: a tied output head (262,144 x
            # 640 in fp32 for Gemma 3, 652 MB) stayed. Only what trains is kept.
            training = {_state_key(self.model, n) for n, p in self.model.named_parameters(remove_duplicate=False) if p.requires_grad}
            state = {k: v for k, v in state.items() if k in training}
        return state

    def load_state_dict(self, state: dict) -> None:
        set_model_state_dict(self.model, state, options=StateDictOptions(full_state_dict=True, strict=not self.trainable_only))


def _state_key(model: torch.nn.Module, name: str) -> str:
    """A parameter's name as the state dict keys it: without what wrappers add to the path (DDP's
    `module`, torch.compile's `_orig_mod`, activation checkpointing's wrapped module)."""
    kept, obj = [], model
    for part in name.split("."):
        wrapper = part in ("_orig_mod", "_checkpoint_wrapped_module") or (part == "module" and isinstance(obj, DistributedDataParallel))
        obj = getattr(obj, part)
        if not wrapper:
            kept.append(part)
    return ".".join(kept)


class OptimizerState:
    """The optimizer's moments, keyed by parameter name (a collective under torchrun)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        return get_optimizer_state_dict(self.model, self.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_state_dict(self, state: dict) -> None:
        if all(isinstance(p, int) for group in state["param_groups"] for p in group["params"]):
            self.optimizer.load_state_dict(state)  # written before checkpoints were keyed by name
        else:
            set_optimizer_state_dict(self.model, self.optimizer, state, options=StateDictOptions(full_state_dict=True))


class RNGState:
    """Python's and torch's random generators (dropout-free models still draw for the data order)."""

    def state_dict(self) -> dict:
        state = {"python": random.getstate(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict) -> None:
        random.setstate(state["python"])
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class TrainState:
    """How far the run has come."""

    step: int = 0
    tokens: int = 0
    seconds: float = 0.0  # time spent in training steps, over every resumed part of the run

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        self.step, self.tokens, self.seconds = int(state["step"]), int(state["tokens"]), float(state["seconds"])


class CheckpointManager:
    """Saves `{name: part.state_dict()}` atomically to `folder/checkpoint.pt`, and loads it back.

    Under torchrun every rank calls `save` (the model and optimizer parts gather across ranks);
    rank 0 writes, and no rank runs ahead of a checkpoint that might not be written yet.
    """

    def __init__(self, folder: Path, parts: dict, *, config: dict, world: World = World()):
        self.path = Path(folder) / CHECKPOINT
        self.parts, self.config, self.world = parts, config, world

    def save(self) -> None:
        state = {"config": self.config, "world_size": self.world.size, **{name: part.state_dict() for name, part in self.parts.items()}}
        if self.world.main:
            atomic_write(self.path, lambda tmp: torch.save(state, tmp))
        self.world.barrier()

    def load(self, state: dict) -> None:
        if "train_state" not in state:  # written before the step counters had an entry of their own
            state["train_state"] = {k: state[k] for k in ("step", "tokens", "seconds")}
        for name, part in self.parts.items():
            part.load_state_dict(state[name])


def load_checkpoint(path: Path) -> dict:
    try:
        # Python's random state is a tuple; weights_only still refuses any code.
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise DepthcurseError(f"cannot read checkpoint {path}: {type(exc).__name__}: {exc}") from exc


def prepare_out_dir(out_dir: Path, cfg: dict, resume: bool) -> dict | None:
    """The checkpoint to continue from, or None for a fresh run; refuses to mix runs."""
    ensure_out_dir(out_dir)
    ckpt_path, saved_cfg_path = out_dir / CHECKPOINT, out_dir / CONFIG
    if not resume:
        if ckpt_path.exists() or saved_cfg_path.exists():
            raise DepthcurseError(f"{out_dir} already holds a run: pass --resume to continue it, or choose another --out")
        return None
    if not ckpt_path.exists():
        if saved_cfg_path.exists():  # started, but stopped before its first checkpoint
            refuse_other_run(out_dir, json.loads(saved_cfg_path.read_text()), cfg, ignore=RESUMABLE_CHANGES, what="training run")
        return None
    state = load_checkpoint(ckpt_path)
    refuse_other_run(out_dir, state.get("config", {}), cfg, ignore=RESUMABLE_CHANGES, what="training run")
    return state
