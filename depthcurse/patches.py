"""Linear patches on the residual stream: a d x d matrix the stream is multiplied by where it
enters a block (or the final norm), as LinearPatch puts one at each cut of a pruned model.

No weight of a stock pre-norm block can absorb such a matrix (the stream passes the residual and
a norm whose scale a non-orthogonal matrix changes), so a checkpoint that has one keeps it beside
its weights in `linear_patch.safetensors` (`before.<k>`: the stream entering the pruned model's
block k; `before.final`: entering its final norm), and `loading.load_model` puts it back.
transformers' `from_pretrained` alone loads the model without it, which the card says."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from depthcurse.errors import DepthcurseError
from depthcurse.surgery import find_blocks

PATCH_FILE = "linear_patch.safetensors"
FINAL_NORMS = ("norm", "final_layernorm", "ln_f", "final_layer_norm", "norm_f")
FINAL = "final"


def final_norm(model: nn.Module) -> nn.Module:
    """The norm the stream goes through after the last block."""
    base = getattr(model, model.base_model_prefix, model)
    for name in FINAL_NORMS:
        norm = getattr(base, name, None)
        if isinstance(norm, nn.Module):
            return norm
    raise DepthcurseError(f"{type(model).__name__} has no final norm where one was looked for ({', '.join(FINAL_NORMS)})")


def patch_site(model: nn.Module, where: int | str) -> nn.Module:
    """The module whose input stream a patch at `where` (a block index, or "final") multiplies."""
    return final_norm(model) if where == FINAL else find_blocks(model).layers[int(where)]


def _patch_hook(matrix: torch.Tensor):
    def hook(module, args, kwargs):
        if args:
            x = args[0]
            return (x @ matrix.to(x.device, x.dtype), *args[1:]), kwargs
        x = kwargs["hidden_states"]
        return args, {**kwargs, "hidden_states": x @ matrix.to(x.device, x.dtype)}
    return hook


@contextlib.contextmanager
def patched(model: nn.Module, patches: dict[int | str, torch.Tensor]) -> Iterator[nn.Module]:
    """`model` with each stream multiplied by its patch where it enters that module; as it was afterwards."""
    handles = []
    try:
        for where, matrix in patches.items():
            handles.append(patch_site(model, where).register_forward_pre_hook(_patch_hook(matrix), with_kwargs=True))
        yield model
    finally:
        for h in handles:
            h.remove()


def save_patches(patches: dict[int | str, torch.Tensor], folder: Path) -> Path:
    from safetensors.torch import save_file  # lazy: only a patched checkpoint needs it

    path = Path(folder) / PATCH_FILE
    save_file({f"before.{k}": t.detach().float().cpu().contiguous() for k, t in patches.items()}, str(path))
    return path


def load_patches(folder: Path) -> dict[int | str, torch.Tensor]:
    from safetensors.torch import load_file  # lazy: as above

    path = Path(folder) / PATCH_FILE
    if not path.is_file():
        return {}
    out = {}
    for key, tensor in load_file(str(path)).items():
        where = key.removeprefix("before.")
        out[where if where == FINAL else int(where)] = tensor
    return out


def apply_saved_patches(model: nn.Module, folder: Path) -> int:
    """The patches a checkpoint keeps beside its weights, put on `model` for good (hooks); how many."""
    patches = load_patches(folder)
    for where, matrix in patches.items():
        patch_site(model, where).register_forward_pre_hook(_patch_hook(matrix), with_kwargs=True)
    return len(patches)
