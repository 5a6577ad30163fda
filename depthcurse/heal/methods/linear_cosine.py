"""ReplaceMe's cosine map (Shopkhoev et al., 2025, arXiv 2505.02819; code mts-ai/ReplaceMe,
`cosine_dist.py` with `loss: cosine`, `solver: adam`): the map T that minimises the mean cosine
distance between m T and x_after - y over calibration tokens, by Adam from the identity (lr 1e-4,
10 epochs, batches of 1,024 tokens, as the code), folded like the least-squares map. The paper's
headline numbers (Llama-2-7B without 25%: MMLU .453) are this variant; least squares gave .451.

`accurate=true` is the code's `accurate` mode: cos(m T + y, x_after) instead. Where this differs
from the code: every rank gathers the calibration pairs (in batch order, so that two ranks
solve exactly as one process); the activations are fp32 here, bf16 there."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from depthcurse.errors import DepthcurseError
from depthcurse.heal.method import HealContext, at_least
from depthcurse.heal.methods.linear import Linear


@dataclass
class CosineSettings:
    calib_tokens: int = 16384
    epochs: int = 10
    lr: float = 1e-4
    batch_tokens: int = 1024
    accurate: bool = False


class CosinePairs:
    """One run's tokens (m, y + m, x_after), then T by Adam on the cosine distance."""

    def __init__(self, d: int, device, settings: CosineSettings, world, seed: int, steps=lambda what, plan: plan):
        self.settings, self.world, self.seed, self.d, self.steps = settings, world, seed, d, steps
        self.seen: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def add(self, m: torch.Tensor, out: torch.Tensor, target: torch.Tensor, index: int) -> None:
        self.seen.append((index, m.float().cpu(), (out - m).float().cpu(), target.float().cpu()))

    def solve(self, reduce) -> torch.Tensor:
        gathered = self.world.broadcast(self.world.gather(self.seen)) if self.world.parallel else [self.seen]
        ordered = sorted((p for rank in gathered for p in rank), key=lambda p: p[0])  # batch order: as one process saw them
        m, y, target = (torch.cat([p[i] for p in ordered]) for i in (1, 2, 3))
        s = self.settings
        t = torch.eye(self.d, dtype=torch.float32, requires_grad=True)
        optimizer = torch.optim.Adam([t], lr=s.lr)
        gen = torch.Generator().manual_seed(self.seed)
        for _ in self.steps("the cosine map's epochs", range(s.epochs)):
            for chunk in torch.randperm(m.shape[0], generator=gen).split(s.batch_tokens):
                # the code's default: cos(m T, x_after - y); `accurate`: cos(m T + y, x_after)
                out, goal = (m[chunk] @ t + y[chunk], target[chunk]) if s.accurate else (m[chunk] @ t, target[chunk] - y[chunk])
                loss = 1 - torch.nn.functional.cosine_similarity(out, goal, dim=-1).mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        return t.detach().double()


class LinearCosine(Linear):
    name = "linear-cosine"
    title = "cosine map (ReplaceMe)"
    source = "Shopkhoev et al. 2025, arXiv 2505.02819; github.com/mts-ai/ReplaceMe (cosine, adam)"
    Settings = CosineSettings

    def check_settings(self):
        s = self.settings
        for name in ("calib_tokens", "epochs", "batch_tokens"):
            at_least(s, name)
        if not s.lr > 0:
            raise DepthcurseError(f"--method-args lr must be positive, got {s.lr}")

    def fit_check(self, tokens: int, d: int, where: str) -> None:
        return None  # Adam from the identity: any number of tokens gives a map (no system to solve)

    def solver(self, ctx: HealContext):
        return lambda d, device: CosinePairs(d, device, self.settings, ctx.world, ctx.seed, steps=ctx.steps)

    def describe(self):
        s = self.settings
        return f"a linear map per removed run by Adam on the cosine distance ({s.epochs} epochs, lr {s.lr}) on {s.calib_tokens:,} calibration tokens"
