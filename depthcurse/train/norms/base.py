"""The contract a normalisation variant meets, and the registry that finds it by name.

A variant is one module in this folder defining a `Normalisation` subclass, which registers it by
its `name` (as a recovery method registers in `heal/methods/`). It says where a block's norms sit
(`kind`: one of the four wirings `model.Block` computes), the constants a block's original depth
fixes (LNS's factor, DeepNorm's alpha, CompleteP's multiplier), its initialisation (the rules that
define the variant, and its authors' own draw where that differs from LLaMA's), whether it
exports as a stock Llama, and its authors' code beside ours (`reference`, `differs`). A user's
own variant is a subclass defined anywhere: defining it registers it.

No torch at import: `TrainConfig` (which `depthcurse --help` reads) lists the names from here.
"""

from __future__ import annotations

from depthcurse.errors import DepthcurseError

KINDS = ("pre", "post", "sandwich", "hybrid")  # the block wirings `model.Block` computes


class Normalisation:
    name: str = ""
    title: str = ""  # as tables name it
    block: str = ""  # the block, as docs/lns-train.md writes it
    reference: str = ""  # the authors' code it was checked against: repository @ commit, file
    differs: str = ""  # where ours differs from that code, and why ("" where it does not)
    stock_llama: bool = False  # plain Pre-LN at inference: exports as a stock LlamaForCausalLM
    lns: bool = False  # each block's norm outputs times 1/sqrt(l), l its 1-based original index
    dyt: bool = False  # DyT in place of every norm, and a learnt scalar on the embedding
    branch_scale: str | None = None  # "layerscale" or "skipinit": a learnt scale on each branch

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.name:
            REGISTRY[cls.name] = cls()

    def kind(self, origin: int, cfg) -> str:
        """Block `origin`'s wiring (`KINDS`); `cfg` is the model's config (`trained_layers`, ...)."""
        return "pre"

    def residual_alpha(self, cfg) -> float:
        """DeepNorm's a in N(a x + F(x)); 1 elsewhere."""
        return 1.0

    def branch_multiplier(self, cfg) -> float:
        """A fixed factor on each branch's output (CompleteP's L0 / L); 1 elsewhere."""
        return 1.0

    def branch_scale_init(self, cfg) -> float:
        """Where `branch_scale` is set: the learnt scale's initial value."""
        return 0.0

    def qkv_norm(self, origin: int, cfg) -> bool:
        """Whether block `origin` RMS-normalises each head's q, k and v."""
        return False

    def adam_eps_factor(self, cfg) -> float:
        """Adam's eps times this (CompleteP's L0 / L); `cfg` has `base_layers` and `num_layers`."""
        return 1.0

    def defining_init(self, model, cfg) -> None:
        """The initialisation rules that define the variant (scaled-init's, DeepNorm's), applied
        after LLaMA's N(0, init_std) under every `--init`: without them it is another variant."""

    def authors_init(self, model, cfg) -> None:
        """The authors' own draw where it differs from LLaMA's (HybridNorm's OLMo init), applied
        last and only under `--init authors`."""


REGISTRY: dict[str, Normalisation] = {}


def find_norm(name: str) -> Normalisation:
    try:
        return REGISTRY[name]
    except KeyError:
        raise DepthcurseError(f"unknown norm {name!r}: use one of {', '.join(REGISTRY)}") from None


def original_layers(cfg) -> int:
    """L, the depth the model was trained at (a pruned model keeps it)."""
    return cfg.trained_layers or cfg.num_layers


def blocks(model):
    """The trainable model's blocks, in order."""
    return model.model.layers
