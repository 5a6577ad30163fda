"""What healing minimises, as a module `train.loop.train_step` trains: `(ids, targets) -> summed loss`.

The student is the pruned model with its adapters; the layers are taken out for each forward
(`surgery.removed_layers`: no weight copied) and put back after it. So the teacher of `--loss
distill` is the same weights in memory: the layers back, the adapters switched off (peft's
`disable_adapter`), the unpruned model exactly. Healing a 7B model by distillation needs one
copy of it, not two.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from depthcurse.surgery import removed_layers


class HealObjective(nn.Module):
    def __init__(self, peft_model, removed: tuple[int, ...], loss: str):
        super().__init__()
        self.model = peft_model.base_model.model  # the transformers model, its linears wrapped by peft
        self.removed, self.loss = tuple(removed), loss
        self.__dict__["peft"] = peft_model  # not a submodule: its parameters are the model's

    def student_logits(self, ids: torch.Tensor) -> torch.Tensor:
        with removed_layers(self.model, self.removed):
            return self.model(input_ids=ids, use_cache=False).logits

    @torch.no_grad()
    def teacher_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """The unpruned model's logits: every layer, no adapter, no dropout."""
        training = self.model.training
        self.model.eval()
        try:
            with self.peft.disable_adapter():
                return self.model(input_ids=ids, use_cache=False).logits
        finally:
            self.model.train(training)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The summed loss over the positions with a target (-100: none), in fp32: next-token
        cross-entropy, or KL(teacher || student) of the next-token distributions."""
        logits = self.student_logits(ids)
        if self.loss == "lm":
            return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), ignore_index=-100, reduction="sum")
        return distill_kl(logits, self.teacher_logits(ids), targets != -100)


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
        # target are selected away, not skipped.
        for start in range(0, rows.shape[0], chunk):
            keep = scored[start:start + chunk].unsqueeze(-1)
            log_s = rows[start:start + chunk].float().log_softmax(-1)
            log_t = teacher[start:start + chunk].float().log_softmax(-1)
            p_t = log_t.exp()
            total += torch.where(keep, p_t * (log_t - log_s), 0.0).sum()
            grad[start:start + chunk] = torch.where(keep, log_s.exp_().sub_(p_t), 0.0)
        ctx.save_for_backward(grad)
        ctx.shape, ctx.dtype = student.shape, student.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):
        (grad,) = ctx.saved_tensors
        return (grad * grad_total).to(ctx.dtype).reshape(ctx.shape), None, None
