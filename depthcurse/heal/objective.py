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
        scored = targets != -100
        if self.loss == "lm":
            return F.cross_entropy(logits[scored].float(), targets[scored], reduction="sum")
        teacher = self.teacher_logits(ids)[scored].float().log_softmax(-1)
        return F.kl_div(logits[scored].float().log_softmax(-1), teacher, log_target=True, reduction="sum")
