"""What a method that trains the model's predictions minimises, as a module `train.loop.train_step`
trains: `(ids, targets) -> summed loss`.

The student is the pruned model with the method's changes on (and the changes of the methods
before it in a composition: `linear+lora`'s maps), as `HealContext.student` makes it of the one
model in memory: the layers are taken out for each forward (`surgery.removed_layers`: no weight
copied) and put back after it. So the teacher of `loss="distill"` is the same weights: the layers
back, every method's changes off (`HealContext.teacher`), the unpruned model exactly. Healing a 7B
model by distillation needs one copy of it, not two.

Where the first blocks are the same in both (nothing changed or removed before them: LoRA's
`adapt=after`), the teacher runs first and the student starts from the stream it left there:
those blocks run once per batch, and without a gradient.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from depthcurse.surgery import find_blocks


class HealObjective(nn.Module):
    """`method`'s next-token objective: `loss` "lm" (cross-entropy on the text) or "distill" (KL
    from the unpruned model). `trained`: the modules holding what trains (the model itself where
    its own parameters are wrapped, as peft's are)."""

    def __init__(self, ctx, method, loss: str, trained: list[nn.Module], *, shared_blocks: int = 0):
        super().__init__()
        self.model = ctx.model
        self.trained = nn.ModuleList([m for m in trained if m is not ctx.model])
        self.loss = loss
        self.shared_blocks = shared_blocks if loss == "distill" else 0  # only a teacher's forward has them to share
        self.__dict__["ctx"], self.__dict__["method"] = ctx, method  # not submodules

    def student_logits(self, ids: torch.Tensor, prefix: torch.Tensor | tuple | None = None) -> torch.Tensor:
        """The healed model's logits; given the stream the first `shared_blocks` leave (`prefix`,
        from the teacher), it starts from there."""
        replay = _replayed(self.model, self.shared_blocks, prefix) if prefix is not None else contextlib.nullcontext()
        with replay, self.ctx.student(self.method):
            return self.model(input_ids=ids, use_cache=False).logits

    @torch.no_grad()
    def teacher_logits(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | tuple | None]:
        """The unpruned model's logits (every layer, no method's change, no dropout), and the
        stream its first `shared_blocks` leave (None when none are shared)."""
        training = self.model.training
        self.model.eval()
        seen = {}
        hook = None
        if self.shared_blocks:
            hook = find_blocks(self.model).layers[self.shared_blocks - 1].register_forward_hook(lambda m, a, output: seen.__setitem__("out", output))
        try:
            with self.ctx.teacher(self.method):
                return self.model(input_ids=ids, use_cache=False).logits, seen.get("out")
        finally:
            if hook is not None:
                hook.remove()
            self.model.train(training)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The summed loss over the positions with a target (-100: none), in fp32: next-token
        cross-entropy, or KL(teacher || student) of the next-token distributions."""
        if self.loss == "lm":
            logits = self.student_logits(ids)
            return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), ignore_index=-100, reduction="sum")
        teacher, prefix = self.teacher_logits(ids)
        return distill_kl(self.student_logits(ids, prefix), teacher, targets != -100)


class _Replay(nn.Module):
    """Stands for a block whose output is known already: gives it back, computing nothing."""

    def __init__(self, output):
        super().__init__()
        self.output = output

    def forward(self, *args, **kwargs):
        return self.output


@contextlib.contextmanager
def _replayed(model: nn.Module, n: int, output):
    """`model` with its first `n` blocks standing in by `output`, what the n-th leaves (the blocks
    in between return it too: each next one ignores its input); put back afterwards."""
    blocks = find_blocks(model).layers
    old = [blocks[i] for i in range(n)]
    try:
        for i in range(n):
            blocks[i] = _Replay(output)
        yield model
    finally:
        for i, block in enumerate(old):
            blocks[i] = block


def distill_kl(student: torch.Tensor, teacher: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """sum over the `scored` positions of KL(softmax(teacher) || softmax(student)), in fp32;
    `F.kl_div(student.log_softmax(-1), teacher.log_softmax(-1), log_target=True, reduction="sum")`
    over those rows, with its gradient, in about half its time on a CPU."""
    return _DistillKL.apply(student, teacher.detach(), scored)


class _DistillKL(torch.autograd.Function):
    # The gradient, softmax(student) - softmax(teacher), is made with the loss, a few rows at a
    # time: each pass over the vocabulary then stays in cache, where log_softmax, kl_div and their
    # backward pass over the whole [tokens, vocab] logits several times each (1.02 s against 0.53 s
    # for 1,020 tokens of SmolLM2's 49,152, 2 CPU cores). The same on a GPU, in bigger chunks.
    @staticmethod
    def forward(ctx, student, teacher, scored):
        vocab = student.shape[-1]
        rows, teacher, scored = student.reshape(-1, vocab), teacher.reshape(-1, vocab), scored.reshape(-1)
        grad = torch.zeros(rows.shape, dtype=torch.float32, device=rows.device)
        total = torch.zeros((), dtype=torch.float32, device=rows.device)
        chunk = 32 if rows.device.type == "cpu" else 2048
        # No test of `scored` on the host (a wait for the GPU per chunk): the rows without a
        # target are weighted by zero, per row for the loss and in place for the gradient
        # (torch.where over the whole chunk, twice, was 12% of a distilling step on a CPU).
        weight = scored.to(torch.float32)
        for start in range(0, rows.shape[0], chunk):
            keep = weight[start:start + chunk]
            log_s = rows[start:start + chunk].float().log_softmax(-1)
            log_t = teacher[start:start + chunk].float().log_softmax(-1)
            p_t = log_t.exp()
            per_row = (p_t * (log_t - log_s)).sum(-1)
            total += torch.where(keep > 0, per_row, 0.0).sum()  # a row of non-finite logits without a target adds nothing
            grad[start:start + chunk] = log_s.exp_().sub_(p_t).mul_(keep.unsqueeze(-1))
        ctx.save_for_backward(grad)
        ctx.shape, ctx.dtype = student.shape, student.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):
        (grad,) = ctx.saved_tensors
        return (grad * grad_total).to(ctx.dtype).reshape(ctx.shape), None, None
