"""The residual stream between blocks, taken from a model's own forward by hooks, and the forward
stopped as soon as it has given what was asked: the maps and the new layers need the stream at a
block of a model run as it is (any architecture's own arguments to its blocks), never its logits."""

from __future__ import annotations

import torch
from torch import nn


class StopForward(Exception):
    """Raised from a hook once a forward has passed everything it was run for."""


def first_tensor(output) -> torch.Tensor:
    """A block's or branch's output: the tensor itself, or the first of a tuple (attention's weights follow it)."""
    return output[0] if isinstance(output, tuple) else output


def run_stopped(model: nn.Module, ids: torch.Tensor) -> None:
    """`model` on `ids`, until a hook raises `StopForward` (or to the end)."""
    try:
        model(input_ids=ids, use_cache=False)
    except StopForward:
        pass


@torch.no_grad()
def stream_after(model: nn.Module, block: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The residual stream `block` leaves, in a forward of `model` stopped right after it."""
    seen = {}

    def hook(module, args, output):
        seen["out"] = first_tensor(output).detach()
        raise StopForward

    handle = block.register_forward_hook(hook)
    try:
        run_stopped(model, ids)
    finally:
        handle.remove()
    return seen["out"]


@torch.no_grad()
def stream_before(model: nn.Module, block: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The residual stream `block` is given, in a forward of `model` stopped as it reaches it."""
    seen = {}

    def hook(module, args, kwargs):
        seen["in"] = (args[0] if args else kwargs["hidden_states"]).detach()
        raise StopForward

    handle = block.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        run_stopped(model, ids)
    finally:
        handle.remove()
    return seen["in"]
