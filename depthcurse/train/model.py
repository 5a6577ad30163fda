"""A LLaMA-style decoder with a choice of normalisation, in one file.

The architecture is LLaMA's (RMSNorm, SwiGLU MLP, rotary embeddings, untied head, N(0, 0.02)
init); only where the norms sit and how the blocks are scaled or initialised changes with
`norm`. With `norm="pre"` the model computes exactly what transformers' LlamaForCausalLM
computes on the same weights, and its parameter names are Llama's, so exporting is a rename.

Variants (L = number of layers, l = 1-based index of a layer in the ORIGINAL stack):

  pre                x = x + Attn(N(x));             x = x + MLP(N(x))
  post               x = N(x + Attn(x));             x = N(x + MLP(x))
  deepnorm           x = N(a*x + Attn(x)), a = (2L)^(1/4); xavier init, gain b = (8L)^(-1/4)
  mix                the first round(mix_ratio*L) blocks post, the others pre
  lns                pre, with each block's two norm outputs times 1/sqrt(l)
  scaled-init        pre, o_proj and down_proj init std 0.02/sqrt(2L)
  sandwich           x = x + N(Attn(N(x)));          x = x + N(MLP(N(x)))
  layerscale         pre, each branch times a learnable per-channel vector (CaiT init)
  skipinit           pre, each branch times a learnable scalar initialised to 0
  depth-scaled-init  pre, every linear of block l init with std 0.02/sqrt(2l)
  lns+scaled-init    lns with the scaled-init initialisation

Everything a block needs to know about its depth (its LNS factor, whether it is post-LN in
Mix-LN, the DeepNorm constants) is fixed when the block is built, from its ORIGINAL index, as
plain Python floats: removing other layers later, or building on the meta device, cannot
change it.

Kernels and distribution plug in at two seams: `RMSNorm` (a fused norm can replace it) and
`Transformer.loss_fn(hidden, head_weight, targets)` (a fused linear + cross-entropy can replace
it). `Transformer(cfg, kernels=...)` uses them (see KERNELS): "off" is the plain eager model
above, the reference; "torch" and "triton" run `depthcurse.train.kernels`, where each norm also takes
the residual add before it, and the loss never holds the full [tokens, vocab] logits.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from depthcurse.errors import DepthcurseError
from depthcurse.train import kernels as K
from depthcurse.train.config import KERNELS, check_architecture

# Variants whose blocks are plain Pre-LN at inference (LNS folds into the norm gains), so a
# trained model exports as a stock LlamaForCausalLM.
STOCK_LLAMA_NORMS = ("pre", "lns", "scaled-init", "depth-scaled-init", "lns+scaled-init")
LNS_NORMS = ("lns", "lns+scaled-init")


@dataclass
class ModelConfig:
    vocab_size: int = 32000
    hidden_size: int = 768
    intermediate_size: int = 2048
    num_layers: int = 12
    num_heads: int = 12
    max_seq_len: int = 256  # the longest sequence the model accepts
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    norm: str = "pre"
    mix_ratio: float = 0.25
    init_std: float = 0.02
    # The original index of each block. A pruned model keeps its blocks' depth-bound
    # constants (LNS factor, Mix-LN kind, DeepNorm alpha) by remembering where they came from.
    layer_origins: list[int] | None = None
    trained_layers: int | None = None  # L of the stack as trained (DeepNorm, Mix-LN, inits)

    def __post_init__(self):
        check_architecture(self.norm, self.hidden_size, self.num_heads, self.mix_ratio)
        if self.num_layers < 1 and self.layer_origins is None:
            raise DepthcurseError("the model needs at least one layer")
        if self.layer_origins is None:
            self.layer_origins = list(range(self.num_layers))
        if self.trained_layers is None:
            self.trained_layers = self.num_layers
        if len(self.layer_origins) != self.num_layers:
            raise DepthcurseError(f"layer_origins has {len(self.layer_origins)} entries for {self.num_layers} layers")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True)
class BlockSpec:
    """What one block is, derived once from the config and the block's original index."""

    kind: str  # "pre", "post" or "sandwich"
    lns_scale: float  # multiplies the block's norm outputs (1.0 unless LNS)
    residual_alpha: float  # DeepNorm's a in N(a*x + F(x)); 1.0 otherwise
    branch_scale: str | None  # "layerscale", "skipinit" or None
    layerscale_init: float = 0.0


def block_spec(cfg: ModelConfig, origin: int) -> BlockSpec:
    L, norm = cfg.trained_layers, cfg.norm
    kind = "pre"
    if norm in ("post", "deepnorm") or (norm == "mix" and origin < round(cfg.mix_ratio * L)):
        kind = "post"
    elif norm == "sandwich":
        kind = "sandwich"
    # CaiT's rule for the LayerScale init: smaller for deeper stacks.
    ls_init = 0.1 if L <= 18 else (1e-5 if L <= 24 else 1e-6)
    return BlockSpec(
        kind=kind,
        lns_scale=1.0 / math.sqrt(origin + 1) if norm in LNS_NORMS else 1.0,
        residual_alpha=(2 * L) ** 0.25 if norm == "deepnorm" else 1.0,
        branch_scale=norm if norm in ("layerscale", "skipinit") else None,
        layerscale_init=ls_init,
    )


class RMSNorm(nn.Module):
    """LLaMA's RMSNorm, times a fixed float `scale` (LNS) applied after the gain."""

    def __init__(self, dim: int, eps: float, scale: float = 1.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.scale = scale  # a float, not a buffer: nothing (to_empty, load_state_dict) can reset it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return h * self.scale if self.scale != 1.0 else h

    def fused(self, x: torch.Tensor, residual: torch.Tensor | None, kernels: str, to_matmul: bool = False):
        """The same norm through `depthcurse.train.kernels`; with `residual`, (norm(x + residual), x + residual).
        `to_matmul`: the output only feeds matmuls, so under autocast it is written in their dtype
        (the same values; the matmuls' input gradients are then summed in bf16, not fp32)."""
        out_dtype = torch.get_autocast_dtype(x.device.type) if to_matmul and torch.is_autocast_enabled(x.device.type) else None
        return K.rms_norm(x, self.weight, self.eps, self.scale, residual, use_triton=kernels == "triton", out_dtype=out_dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.numel()}, eps={self.eps}, scale={self.scale:.6g}"


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    # Same formula and rotate-half layout as transformers' Llama, computed in fp32.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        self.fused = False  # see Transformer.set_fused_projections

    def forward(self, x, cos, sin, mask=None):
        B, T, _ = x.shape
        if self.fused:
            qkv = F.linear(x, torch.cat((self.q_proj.weight, self.k_proj.weight, self.v_proj.weight)))
            parts = qkv.split(self.q_proj.out_features, dim=-1)
        else:
            parts = (p(x) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k, v = (t.view(B, T, self.num_heads, self.head_dim).transpose(1, 2) for t in parts)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.fused = False  # see Transformer.set_fused_projections

    def forward(self, x):
        if self.fused:
            gate, up = F.linear(x, torch.cat((self.gate_proj.weight, self.up_proj.weight))).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """One transformer block. The two norms keep Llama's names: `input_layernorm` is the
    attention's norm and `post_attention_layernorm` the MLP's, wherever `spec.kind` puts them."""

    def __init__(self, cfg: ModelConfig, origin: int):
        super().__init__()
        self.spec = spec = block_spec(cfg, origin)
        self.origin = origin
        d = cfg.hidden_size
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(d, cfg.norm_eps, spec.lns_scale)
        self.post_attention_layernorm = RMSNorm(d, cfg.norm_eps, spec.lns_scale)
        if spec.kind == "sandwich":
            self.attn_out_norm = RMSNorm(d, cfg.norm_eps)
            self.mlp_out_norm = RMSNorm(d, cfg.norm_eps)
        if spec.branch_scale == "layerscale":
            self.attn_scale = nn.Parameter(torch.full((d,), spec.layerscale_init))
            self.mlp_scale = nn.Parameter(torch.full((d,), spec.layerscale_init))
        elif spec.branch_scale == "skipinit":
            self.attn_scale = nn.Parameter(torch.zeros(()))
            self.mlp_scale = nn.Parameter(torch.zeros(()))
        # Recompute the block's activations in the backward pass instead of keeping them.
        self.activation_checkpointing = False

    def forward(self, x, cos, sin, mask=None, pending=None, kernels: str = "off"):
        """The plain block (kernels "off": returns x), or through the fused kernels (returns
        (x, pending), see `_forward_fused`). Checkpointing sits inside `forward` so that wrappers
        hooked around the call (FSDP's all-gather) stay outside the recomputed region."""
        if kernels == "off":
            fn, args = self._forward, (x, cos, sin, mask)
        else:
            fn, args = self._forward_fused, (x, pending, cos, sin, mask, kernels)
        if self.activation_checkpointing and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)
        return fn(*args)

    def _forward(self, x, cos, sin, mask=None):
        kind, a = self.spec.kind, self.spec.residual_alpha
        if kind == "post":
            # x * 1.0 is exact, so Post-LN and DeepNorm share one line.
            x = self.input_layernorm(x * a + self.self_attn(x, cos, sin, mask))
            return self.post_attention_layernorm(x * a + self.mlp(x))
        h = self.self_attn(self.input_layernorm(x), cos, sin, mask)
        if kind == "sandwich":
            h = self.attn_out_norm(h)
        if self.spec.branch_scale:
            h = h * self.attn_scale
        x = x + h
        h = self.mlp(self.post_attention_layernorm(x))
        if kind == "sandwich":
            h = self.mlp_out_norm(h)
        if self.spec.branch_scale:
            h = h * self.mlp_scale
        return x + h

    def _forward_fused(self, x, pending, cos, sin, mask, kernels: str):
        """`_forward` through the fused kernels. `pending` is the previous block's last branch
        output, not yet added to the stream `x`: this block's first norm adds it in the same pass.
        Returns (x, pending) in the same sense for the next block (or the final norm)."""
        kind, a = self.spec.kind, self.spec.residual_alpha
        if kind == "post":
            if pending is not None:  # only after a pre block, which Mix-LN never puts before a post one
                x = x + pending
            x, _ = self.input_layernorm.fused(self.self_attn(x, cos, sin, mask), x * a, kernels)
            x, _ = self.post_attention_layernorm.fused(self.mlp(x), x * a, kernels)
            return x, None
        if pending is None:
            h = self.input_layernorm.fused(x, None, kernels, to_matmul=True)
        else:
            h, x = self.input_layernorm.fused(pending, x, kernels, to_matmul=True)
        h = self.self_attn(h, cos, sin, mask)
        if kind == "sandwich":
            h = self.attn_out_norm.fused(h, None, kernels)
        if self.spec.branch_scale:
            h = h * self.attn_scale
        h, x = self.post_attention_layernorm.fused(h, x, kernels, to_matmul=True)
        h = self.mlp(h)
        if kind == "sandwich":
            h = self.mlp_out_norm.fused(h, None, kernels)
        if self.spec.branch_scale:
            h = h * self.mlp_scale
        return x, h


class Body(nn.Module):
    """Embedding, blocks and final norm: the part every head shares (HF's `model.`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, origin) for origin in cfg.layer_origins)
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.kernels = "off"  # "off", "torch" or "triton": see KERNELS

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **_ignored) -> torch.Tensor:
        T = input_ids.shape[1]
        if T > self.cfg.max_seq_len:
            raise DepthcurseError(f"a sequence of {T} tokens is longer than the model allows ({self.cfg.max_seq_len})")
        cos, sin = rope_cos_sin(T, self.cfg.head_dim, self.cfg.rope_theta, input_ids.device)
        # None when nothing is padded (always in training): SDPA then runs plain causal
        # attention, for which the flash and memory-efficient backends are eligible.
        mask = _padding_mask(attention_mask, T)
        x = self.embed_tokens(input_ids)
        if self.kernels == "off":
            for block in self.layers:
                x = block(x, cos, sin, mask)
            return self.norm(x)
        pending = None
        for block in self.layers:
            x, pending = block(x, cos, sin, mask, pending, self.kernels)
        # The final norm writes the stream's dtype: the chunked loss returns its gradient in its
        # input's dtype, and scaled in bf16 that gradient would round where in fp32 it does not.
        if pending is None:
            return self.norm.fused(x, None, self.kernels)
        return self.norm.fused(pending, x, self.kernels)[0]


def _padding_mask(attention_mask: torch.Tensor | None, T: int) -> torch.Tensor | None:
    """Causal + key-padding boolean mask, or None when nothing is padded (plain causal)."""
    if attention_mask is None or bool(attention_mask.all()):
        return None
    causal = torch.ones(T, T, dtype=torch.bool, device=attention_mask.device).tril()
    mask = causal[None, None] & attention_mask.bool()[:, None, None, :]
    # A padded query may see no key at all; letting it see itself avoids NaN (its output is unused).
    return mask | torch.eye(T, dtype=torch.bool, device=mask.device)[None, None]


def cross_entropy_sum(hidden: torch.Tensor, head_weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed next-token loss; targets of -100 are ignored. Logits go to fp32 for the softmax."""
    logits = F.linear(hidden, head_weight)
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100, reduction="sum")


def resolve_kernels(kernels: str, device, compile: bool = False) -> str:
    """"auto" -> "triton" on CUDA (when Triton is installed, else "torch"), "off" elsewhere, and
    "off" under `compile`: on an H100 at 130M, inductor fusing the plain blocks trained 1.62x the
    eager reference's tokens/s, our kernels inside compiled blocks 1.35x (Triton, then with a
    graph break at every norm) and 1.40x (torch path), docs/benchmarks.md. The kernels stay the
    choice for the least memory."""
    if kernels not in KERNELS:
        raise DepthcurseError(f"unknown --kernels {kernels!r}: use one of {', '.join(KERNELS)}")
    if kernels == "triton" and not K.triton_available():
        raise DepthcurseError("--kernels triton needs the triton package: pip install triton, or use --kernels torch")
    if kernels != "auto":
        return kernels
    if torch.device(device).type == "cuda" and not compile:
        return "triton" if K.triton_available() else "torch"
    return "off"


class Transformer(nn.Module):
    """The trainable model: `forward(ids)` gives logits, `forward(ids, targets)` the summed loss."""

    def __init__(self, cfg: ModelConfig, loss_fn=None, kernels: str = "off"):
        super().__init__()
        if kernels not in KERNELS[1:]:
            raise DepthcurseError(f"unknown kernels {kernels!r}: use triton, torch or off (resolve auto with resolve_kernels)")
        self.cfg = cfg
        self.model = Body(cfg)
        self.model.kernels = kernels
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if loss_fn is None and kernels != "off":
            loss_fn = functools.partial(K.fused_linear_cross_entropy, reduction="sum", use_triton=kernels == "triton")
        self.loss_fn = loss_fn or cross_entropy_sum
        init_weights(self, cfg)

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.model(input_ids)
        if targets is None:
            return self.lm_head(hidden)
        return self.loss_fn(hidden, self.lm_head.weight, targets)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs (forward and backward) per token, PaLM's count: 6 N, N the parameters
        outside the input embedding (a lookup), plus 12 L d T for attention's scores and
        weighted values over T positions, as if unmasked."""
        c = self.cfg
        n = self.num_params() - self.model.embed_tokens.weight.numel()
        return 6 * n + 12 * c.num_layers * c.hidden_size * seq_len

    def set_activation_checkpointing(self, on: bool) -> None:
        for block in self.model.layers:
            block.activation_checkpointing = on

    def set_fused_projections(self, on: bool) -> None:
        """One matmul for q, k and v and one for gate and up, on their weights concatenated at each
        call. Why: a GEMM three (two) times as wide runs nearer the device's peak at small widths,
        and the backward gets the input's gradient from one GEMM instead of summing three (two).
        The copies hold 3 d^2 + 2 d I values per call, small beside the activations. The parameters, and
        so checkpoints and exports, are the same either way; only rounding differs."""
        for block in self.model.layers:
            block.self_attn.fused = block.mlp.fused = on


@torch.no_grad()
def init_weights(model: nn.Module, cfg: ModelConfig) -> None:
    """N(0, init_std) for every linear and embedding, ones for the norm gains, then each
    variant's own rule for the blocks."""
    std, L = cfg.init_std, cfg.trained_layers
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=std)
        elif isinstance(m, RMSNorm):
            nn.init.ones_(m.weight)
    for block in model.model.layers:
        attn, mlp = block.self_attn, block.mlp
        if cfg.norm in ("scaled-init", "lns+scaled-init"):
            for w in (attn.o_proj.weight, mlp.down_proj.weight):
                nn.init.normal_(w, mean=0.0, std=std / math.sqrt(2 * L))
        elif cfg.norm == "depth-scaled-init":
            for m in block.modules():
                if isinstance(m, nn.Linear):
                    nn.init.normal_(m.weight, mean=0.0, std=std / math.sqrt(2 * (block.origin + 1)))
        elif cfg.norm == "deepnorm":
            beta = (8 * L) ** -0.25
            for lin in (attn.q_proj, attn.k_proj):
                nn.init.xavier_normal_(lin.weight, gain=1.0)
            for lin in (attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
                nn.init.xavier_normal_(lin.weight, gain=beta)
