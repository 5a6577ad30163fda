"""LoRA adapters on the blocks a removal keeps, with peft (not a LoRA of our own), and saved in
peft's format for the pruned model; `heal.healed` merges them when the healed model is saved."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from torch import nn

from depthcurse.errors import DepthcurseError
from depthcurse.surgery import branch_of, find_blocks, removed_layers

PARTS = {"mlp": ("mlp",), "attn": ("attn",), "all": ("attn", "mlp")}


def _is_linear(module: nn.Module) -> bool:
    # GPT-2's projections are transformers' Conv1D (a linear with its weight transposed), which peft adapts too
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def target_modules(model: nn.Module, removed: tuple[int, ...], targets: str, after: int | None = None) -> list[str]:
    """The full names of the linear layers in the `targets` branches of every kept block (with
    `after`, of the kept blocks after that layer only): where the adapters go. Exact names, so
    that peft puts none on a removed block or outside the blocks."""
    blocks = find_blocks(model)
    names = {id(m): n for n, m in model.named_modules()}
    out = []
    for i, block in enumerate(blocks.layers):
        if i in removed or (after is not None and i <= after):
            continue
        for part in PARTS[targets]:
            branch = branch_of(block, part)
            found = [names[id(m)] for m in branch.modules() if _is_linear(m)]
            if not found:
                kind = {"attn": "attention", "mlp": "MLP"}[part]
                raise DepthcurseError(f"--targets {targets}: the {kind} of {type(block).__name__} has no linear layer for an adapter "
                                      "(its weights are not nn.Linear modules, as in fused mixture-of-experts MLPs): try --targets attn")
            out += found
    if not out:
        raise DepthcurseError(f"--adapt after puts adapters on the kept blocks after layer {after}, and there is none: "
                              "use --adapt all, or remove layers before the last")
    return out


def add_adapters(model: nn.Module, removed: tuple[int, ...], *, targets: str, rank: int, alpha: float, dropout: float, after: int | None = None):
    """`model` with LoRA adapters (peft's `get_peft_model`) on its kept blocks' `targets` (with
    `after`, those after that layer only); only the adapters train. Their B matrices start at
    zero, so the adapted model starts as the pruned one."""
    from peft import LoraConfig, get_peft_model  # lazy: only heal needs peft

    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, bias="none",
                        target_modules=target_modules(model, removed, targets, after))
    with warnings.catch_warnings():
        # peft reads transformers' `is_gradient_checkpointing`, deprecated in transformers 5: a
        # warning on every heal about code that is neither ours nor the user's
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, config)


def trainable(model: nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def save_adapters(peft_model, removed: tuple[int, ...], folder: Path) -> Path:
    """The adapters in peft's own format, numbered for the pruned model (its layers run 0..n-k-1):
    `PeftModel.from_pretrained` on a checkpoint `drop` saved without the same layers loads them
    into the model `heal` measured."""
    config = peft_model.peft_config["default"]
    model = peft_model.base_model.model
    targets = config.target_modules
    with removed_layers(model, removed):
        config.target_modules = sorted(name for name, module in model.named_modules() if isinstance(getattr(module, "lora_A", None), nn.ModuleDict))
        try:
            peft_model.save_pretrained(str(folder))
        finally:
            config.target_modules = targets
    # peft records the unpruned model's path as the base: AutoPeftModel would load the adapters onto
    # it without a word, every layer after the cut one off; with none named it refuses instead
    path = Path(folder) / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "base_model_name_or_path": None}, indent=2))
    return Path(folder)
