"""Csordás et al.'s depth map as their code fits and scores it (`depth-map --as csordas`):
robertcsordas/llm_effective_depth, read in ShayanTalaei/llm_effective_depth @ e757a77,
`training/tasks/map_layers.py` (`MapLayers`) run by `training/framework/task/simple_task.py`'s
training step with the settings of `training/sweeps/map_qwen.yaml`.

For each stream of the shallow model that their sweep's `src_layer` reaches (the embedding's output,
then the stream after each layer, before the final norm), one linear map with a bias to every stream
of the deep model at once (the embedding's output and the stream after each layer: one output of
width x (layers + 1)), trained on the mean squared error over all of them together, the first
(BOS) position of every window left out. AdamW (lr 2.5e-4, betas 0.9 / 0.999, eps 1e-8, weight
decay 0.01 on every parameter), the gradient clipped to norm 0.25, the learning rate rising linearly
over 200 steps and then following a cosine to 0.1 of itself over `steps` (their `stop_after`: 10,000)
counted from the end of the warm-up, batches of 64 windows. Their score is the relative error
||map(x) - y|| / ||y|| per token and deep stream, its mean over the held-out tokens (here per window,
then the mean over windows with a Student's t interval), lower is better.

Every window is theirs: the tokenizer's BOS id, or 0 where it has none (their `F.pad(..., value=
vocabulary.bos_token())`, whose value None pads 0: Qwen 2.5's tokenizer, the pair of their sweep, has no
BOS), then `--seq-len` - 1 tokens of text, every one of them fitted and scored (`their_start`).

Where theirs differs and ours does not follow (docs/depth-use.md's table): their batches are fresh C4
windows of 512 tokens; here the fitting windows of `--data`, in a seeded shuffled order round after
round; their models run 8-bit quantized (`map_layers.quantize: 1`) and their steps in bf16 autocast on
a GPU, here in the dtype loaded and float32.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass

import torch

from depthcurse.errors import DepthcurseError


@dataclass(frozen=True)
class MapSettings:
    steps: int = 10000  # stop_after
    batch_windows: int = 64  # batch_size
    lr: float = 2.5e-4
    weight_decay: float = 0.01  # wd
    grad_clip: float = 0.25
    warmup: int = 200  # lr_warmup
    min_lr_multiplier: float = 0.1
    seed: int = 0  # the map's initial weights and the order of the fitting windows

    def check(self) -> None:
        if self.steps < 1 or self.batch_windows < 1 or self.warmup < 0 or self.lr <= 0 or self.grad_clip <= 0:
            raise DepthcurseError(f"--map-steps and the map's batch must be at least 1, its warm-up 0 or more, its lr and clip above 0 (got {asdict(self)})")

    def summary(self) -> dict:
        return asdict(self)


def their_start(tokenizer) -> list[int]:
    """What their `get_src_target` puts before every window: `F.pad(data, (1, 0), value=vocabulary.bos_token())`,
    `HuggingfaceVocabulary.bos_token()` being the tokenizer's `bos_token_id`, and F.pad's value None a 0."""
    bos = getattr(tokenizer, "bos_token_id", None)
    return [0 if bos is None else int(bos)]


def learning_rate(settings: MapSettings, step: int) -> float:
    """`SimpleTask.set_lr` at iteration `step`: CosineAnnealingLR's closed form (what `step(epoch)`
    gives) at max(0, step - warmup) over `steps`, down to min_lr_multiplier x lr; below the warm-up
    `set_linear_warmup`, lr / warmup x (step + 1)."""
    if step < settings.warmup:
        return settings.lr / settings.warmup * (step + 1)
    low = settings.min_lr_multiplier * settings.lr
    return low + (settings.lr - low) * (1 + math.cos(math.pi * max(0, step - settings.warmup) / settings.steps)) / 2


def window_order(windows: int, settings: MapSettings) -> list[int]:
    """The fitting windows each step takes, batch after batch: rounds over all of them, each in a fresh
    order of random.Random(seed)."""
    rng, order = random.Random(settings.seed), []
    while len(order) < settings.steps * min(settings.batch_windows, windows):
        round_ = list(range(windows))
        rng.shuffle(round_)
        order += round_
    return order


def train_map(source: torch.Tensor, targets: torch.Tensor, settings: MapSettings) -> torch.nn.Linear:
    """One map from a shallow stream ([windows, tokens, width]) to every deep stream at once
    ([windows, tokens, streams, width]), trained as their `MapLayers` is, the first position left out."""
    width, out = source.shape[-1], targets.shape[-2] * targets.shape[-1]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.seed)
        model = torch.nn.Linear(width, out)  # torch's own initialisation, as their `create_model`
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay, betas=(0.9, 0.999), eps=1e-8)
    batch = min(settings.batch_windows, len(source))
    order = window_order(len(source), settings)
    for step in range(settings.steps):
        for group in opt.param_groups:
            group["lr"] = learning_rate(settings, step)
        opt.zero_grad(set_to_none=True)
        taken = order[step * batch : (step + 1) * batch]
        x, y = source[taken][:, 1:], targets[taken][:, 1:]  # "Do not include the BOS token in every batch"
        loss = torch.nn.functional.mse_loss(model(x), y.flatten(start_dim=-2))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        opt.step()
    return model.eval()


@torch.no_grad()
def relative_errors(model: torch.nn.Linear, source: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Their `validate`'s relative error per held-out window and deep stream ([windows, streams]): the
    mean over a window's tokens (the first left out) of ||map(x) - y|| / ||y||."""
    y = targets[:, 1:]
    predicted = model(source[:, 1:]).view_as(y)
    norm = y.norm(dim=-1)
    error = (predicted - y).norm(dim=-1)
    return (error / norm.clamp(min=torch.finfo(norm.dtype).tiny)).mean(1)
