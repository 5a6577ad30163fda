"""Where a removal and its repair act, and what sits there: the massive activation (Sun et al.
2024). A few blocks write into the stream, on one or two tokens (the first of a text), values a
thousand times the median that the rest of the model reads as a bias. A removal of such a block,
or a repair folded into the block right before the cut (ReplaceMe's map in its MLP output,
Prune&Comp's scale on its writers), changes that value; a loss that weighs every token alike (the cosine map's)
barely sees the error it makes on those few tokens, and the model's output does. So a heal says
when its cut or its fold site is a block that writes one."""

from __future__ import annotations

import torch

from depthcurse.angular import measure
from depthcurse.surgery import runs_of


def massive_at_sites(model: torch.nn.Module, windows: torch.Tensor, layers: tuple[int, ...], batch_size: int) -> dict:
    """The unpruned `model`'s massive activation on `windows` (`AngularResult.massive`), and the
    blocks among the cut (the removed layers) and the fold sites (each run's block before it) that write one."""
    ones = torch.ones_like(windows)
    batches = [(windows[i:i + batch_size], ones[i:i + batch_size]) for i in range(0, len(windows), batch_size)]
    found = measure(model, batches, position="last", identity_tokens=0).massive()
    folds = [run[0] - 1 for run in runs_of(layers) if run[0] > 0]
    found["cut_writers"] = sorted(set(found["writers"]) & set(layers))
    found["fold_writers"] = sorted(set(found["writers"]) & set(folds))
    found["fold_sites"] = folds
    del found["ratio"], found["massive"]  # per depth: angular-distance's layers.csv has them
    return found
