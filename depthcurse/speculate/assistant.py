"""The self-draft as transformers takes an assistant: `model.generate(..., assistant_model=draft)`.

transformers' assisted decoding (`AssistedCandidateGenerator`) asks its assistant for a device, a
config, a generation config of its own (where the number of draft tokens and its schedule live), and
a `generate` that it calls each round with the assistant's own KV cache. `SelfDraftAssistant` gives
all of these from the model it drafts for: its `generate` runs the model's own `generate` inside
`surgery.removed_layers`, so that every block, config field and `layer_idx` agree with a model built
without the skipped blocks while it drafts, and put everything back before transformers checks the
proposal with the whole model. No weight is copied and the assistant's KV cache, which transformers
keeps between rounds and crops to the accepted prefix, holds only the kept blocks' keys and values.
Anything else transformers reads off an assistant is the model's own.
"""

from __future__ import annotations

import copy

from torch import nn

from depthcurse.surgery import num_layers, parse_removal, removed_layers


class SelfDraftAssistant:
    """`model` with blocks `skip` left out, for `model.generate(..., assistant_model=...)`.
    `num_assistant_tokens` and `schedule` are transformers' (constant, heuristic, heuristic_transient)."""

    def __init__(self, model: nn.Module, skip, num_assistant_tokens: int = 4, schedule: str = "constant"):
        self.model = model
        spec = skip if isinstance(skip, str) else ",".join(map(str, skip))
        self.skip = tuple(parse_removal(spec, num_layers(model), "skip"))
        self.generation_config = copy.deepcopy(model.generation_config)
        self.generation_config.num_assistant_tokens = num_assistant_tokens
        self.generation_config.num_assistant_tokens_schedule = schedule
        # transformers' confidence stop (its threshold adapted by scikit-learn's ROC curve when installed)
        # is theirs to keep; off here, so that the draft length is the one asked for
        self.generation_config.assistant_confidence_threshold = 0.0

    def generate(self, *args, **kwargs):
        with removed_layers(self.model, self.skip):
            return self.model.generate(*args, **kwargs)

    def __getattr__(self, name):
        # only reached for what this class does not define: the model's device, config, dtype, ...
        return getattr(self.model, name)
