"""Many processes: this rank's place in a torchrun launch, and the model wrapped for it.

Under torchrun (`torchrun --nproc-per-node N -m depthcurse lns-train ...`) every rank draws the
same global batch from the same seeded order and trains on its slice, with DDP or FSDP2, so N
ranks compute what one process computes. A lone process is `World()`, and nothing here runs.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

from depthcurse.errors import DepthcurseError
from depthcurse.runtime import World, join_torchrun, launched_by_torchrun, pick_device
from depthcurse.train.config import TrainConfig
from depthcurse.train.model import Transformer, cross_entropy_sum


def setup_world(cfg: TrainConfig) -> tuple[World, torch.device]:
    """The process group (nccl on CUDA, gloo on CPU) and this rank's device; checks first, so
    a bad launch fails the same way on every rank before any process waits for another."""
    device = torch.device(pick_device(cfg.device))
    if not launched_by_torchrun():
        if cfg.parallel is not None:
            raise DepthcurseError(f"--parallel {cfg.parallel} needs several processes: launch with torchrun --nproc-per-node N -m depthcurse lns-train ...")
        return World(), device
    size = int(os.environ["WORLD_SIZE"])
    if cfg.batch_size % size:
        raise DepthcurseError(f"--batch-size {cfg.batch_size} does not split evenly over {size} ranks: use a multiple of {size}")
    if cfg.largest_micro_batch and size > 1:
        raise DepthcurseError("--largest-micro-batch runs in one process (a rank out of memory would leave the others waiting for it): give --micro-batch")
    per_rank = cfg.batch_size // size
    if per_rank % min(cfg.micro_batch, per_rank):
        raise DepthcurseError(f"each of the {size} ranks gets {per_rank} sequences, not a multiple of --micro-batch {cfg.micro_batch}")
    return join_torchrun(device.type, cfg.parallel or "ddp")


def parallelize(model: Transformer, cfg: TrainConfig, world: World, device: torch.device) -> torch.nn.Module:
    """Checkpointing, compilation and the data-parallel wrapper, innermost first (torchtitan's
    order): each block's forward is compiled (and the loss, with the plain model), or with
    `--compile-scope model` the whole forward, and FSDP's all-gathers hook around the blocks."""
    model.set_activation_checkpointing(cfg.activation_checkpointing)
    if cfg.compile:
        compile = functools.partial(torch.compile, mode=cfg.compile_mode)
        # The forward, not the module: parameter names stay as they are (no `_orig_mod.`),
        # and hooks around the call (FSDP's, DDP's) run eagerly.
        if cfg.compile_scope == "model":
            # One graph per micro-batch, loss included; under DDP its gradients are ready only
            # when the whole backward is, so they are not sent while it runs.
            model.forward = compile(model.forward)
        else:
            # Blocks share one compiled code object, with a variant per block kind (LNS factor 1
            # or not, Post or Pre in Mix-LN) and grad mode (training, evaluation): more than the default 8.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
            for block in model.model.layers:
                block.forward = compile(block.forward)
            if model.loss_fn is cross_entropy_sum:
                # The head and the plain loss too (torchtitan's "loss" component): inductor fuses the fp32
                # upcast, log-softmax and its gradient over the [tokens, vocab] logits, which the
                # eager loss writes and reads back in full several times.
                model.loss_fn = compile(model.loss_fn)
    if world.parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard  # lazy: only a torchrun launch needs it

        for block in model.model.layers:
            fully_shard(block)
        fully_shard(model)  # the embedding, final norm and head
        return model
    if world.parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel  # lazy: as above

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return model


@contextlib.contextmanager
def eager_blocks(model: Transformer):
    """The blocks' own forwards for a while, where `parallelize` compiled them: the per-layer
    metrics take Jacobian-vector products through each block, which a compiled forward does not
    propagate (its outputs would carry no tangent)."""
    compiled = {block: block.__dict__.pop("forward") for block in model.model.layers if "forward" in block.__dict__}
    try:
        yield
    finally:
        for block, forward in compiled.items():
            block.forward = forward


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
