"""A LLaMA-style decoder with a choice of normalisation, in one file.

The architecture is LLaMA's (RMSNorm, SwiGLU MLP, rotary embeddings, untied head, N(0, 0.02)
init); only where the norms sit and how the blocks are scaled or initialised changes with
`norm`. With `norm="pre"` the model computes exactly what transformers' LlamaForCausalLM
computes on the same weights, and its parameter names are Llama's, so exporting is a rename.

The variants are `depthcurse.train.norms`, one module each (found by name: `find_norm`): each
says which of the four wirings below a block gets, the constants its depth fixes and its
initialisation; this file computes the wirings (L = number of layers, l = the 1-based index of a
layer in the ORIGINAL stack):

  pre       x = x + Attn(N(x));       x = x + MLP(N(x))      (LNS: N times 1/sqrt(l); DyT: N = w tanh(alpha x);
                                                               CompleteP: each branch times L0/L; LayerScale,
                                                               SkipInit: each branch times a learnt scale)
  post      x = N(a x + Attn(x));     x = N(a x + MLP(x))    (a = 1, DeepNorm's (2L)^(1/4))
  sandwich  x = x + N(Attn(N(x)));    x = x + N(MLP(N(x)))
  hybrid    x = x + Attn(x), q, k, v RMS-normed per head; x = N(x); x = x + MLP(x)

Initialisation (`init`): "authors" (the default) draws each variant's weights as its authors' code
does (`Normalisation.authors_init`: HybridNorm's OLMo `full_megatron`, Mix-LN's embedding);
"common" gives every variant LLaMA's N(0, 0.02) plus only the rules that define it
(`Normalisation.defining_init`: scaled-init's, DeepNorm's), for a comparison where everything but
the norm is held fixed.

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
from depthcurse.train.norms import REGISTRY, find_norm

# Variants whose blocks are plain Pre-LN at inference (LNS folds into the norm gains), so a
# trained model exports as a stock LlamaForCausalLM.
STOCK_LLAMA_NORMS = tuple(name for name, norm in REGISTRY.items() if norm.stock_llama)


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
    dyt_alpha_attn: float = 0.8  # DyT's alpha0 for the attention's norm, the MLP's and the final one (the LLaMA-7B code's)
    dyt_alpha_ffn: float = 0.2
    dyt_alpha_final: float = 0.2
    base_layers: int = 12  # CompleteP's base depth L0: the depth its hyper-parameters are tuned at
    init: str = "authors"  # "authors": each variant's own init from its authors' code; "common": LLaMA's for all (see INITS)

    def __post_init__(self):
        check_architecture(self.norm, self.hidden_size, self.num_heads, self.mix_ratio, (self.dyt_alpha_attn, self.dyt_alpha_ffn, self.dyt_alpha_final),
                           self.base_layers, self.init)
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

    kind: str  # "pre", "post", "sandwich" or "hybrid"
    lns_scale: float  # multiplies the block's norm outputs (1.0 unless LNS)
    residual_alpha: float  # DeepNorm's a in N(a*x + F(x)); 1.0 otherwise
    branch_scale: str | None  # "layerscale", "skipinit" or None
    layerscale_init: float = 0.0
    branch_multiplier: float = 1.0  # CompleteP's L0/L on each branch: a float fixed at build, as LNS's
    dyt: bool = False  # DyT in place of the norms
    qkv_norm: bool = False  # each head's q, k and v RMS-normed (HybridNorm)


def block_spec(cfg: ModelConfig, origin: int) -> BlockSpec:
    norm = find_norm(cfg.norm)
    return BlockSpec(
        kind=norm.kind(origin, cfg),
        lns_scale=1.0 / math.sqrt(origin + 1) if norm.lns else 1.0,
        residual_alpha=norm.residual_alpha(cfg),
        branch_scale=norm.branch_scale,
        layerscale_init=norm.branch_scale_init(cfg),
        branch_multiplier=norm.branch_multiplier(cfg),
        dyt=norm.dyt,
        qkv_norm=norm.qkv_norm(origin, cfg),
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


class DyT(nn.Module):
    """Dynamic Tanh (Zhu et al., CVPR 2025) in place of a norm: weight * tanh(alpha * x), alpha a
    learnable scalar started at `alpha0`; as the authors' LLaMA code, no bias. Nothing to fuse:
    the kernels' path computes it in PyTorch, which --compile fuses into one elementwise pass."""

    def __init__(self, dim: int, alpha0: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.alpha = nn.Parameter(torch.full((1,), float(alpha0)))
        self.alpha0 = float(alpha0)  # a float: what init_weights puts back, to_empty or not

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * torch.tanh(self.alpha * x)

    def fused(self, x: torch.Tensor, residual: torch.Tensor | None, kernels: str, to_matmul: bool = False):
        """As `RMSNorm.fused`: with `residual`, (D(x + residual), x + residual)."""
        if residual is None:
            return self(x)
        total = x + residual
        return self(total), total

    def extra_repr(self) -> str:
        return f"{self.weight.numel()}, alpha0={self.alpha0}"


def make_norm(cfg: ModelConfig, spec: BlockSpec | None, which: str) -> nn.Module:
    """The norm at `which` ("attn", "ffn", "final"): DyT for dyt, else RMSNorm (times LNS's factor in a block)."""
    if find_norm(cfg.norm).dyt:
        return DyT(cfg.hidden_size, {"attn": cfg.dyt_alpha_attn, "ffn": cfg.dyt_alpha_ffn, "final": cfg.dyt_alpha_final}[which])
    return RMSNorm(cfg.hidden_size, cfg.norm_eps, spec.lns_scale if spec is not None else 1.0)


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
    def __init__(self, cfg: ModelConfig, qkv_norm: bool = False):
        super().__init__()
        d = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        if qkv_norm:  # HybridNorm: each head's query, key and value RMS-normed (affine), before RoPE
            self.q_norm, self.k_norm, self.v_norm = (RMSNorm(self.head_dim, cfg.norm_eps) for _ in range(3))
        self.qkv_norm = qkv_norm
        self.fused = False  # see Transformer.set_fused_projections

    def forward(self, x, cos, sin, mask=None):
        B, T, _ = x.shape
        if self.fused:
            qkv = F.linear(x, torch.cat((self.q_proj.weight, self.k_proj.weight, self.v_proj.weight)))
            parts = qkv.split(self.q_proj.out_features, dim=-1)
        else:
            parts = (p(x) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k, v = (t.view(B, T, self.num_heads, self.head_dim).transpose(1, 2) for t in parts)
        if self.qkv_norm:
            q, k, v = self.q_norm(q), self.k_norm(k), self.v_norm(v)
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
        self.self_attn = Attention(cfg, qkv_norm=spec.qkv_norm)
        self.mlp = MLP(cfg)
        if spec.kind != "hybrid":  # HybridNorm's attention reads the stream as it is
            self.input_layernorm = make_norm(cfg, spec, "attn")
        self.post_attention_layernorm = make_norm(cfg, spec, "ffn")
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
        kind, a, c = self.spec.kind, self.spec.residual_alpha, self.spec.branch_multiplier
        if kind == "post":
            # x * 1.0 is exact, so Post-LN and DeepNorm share one line.
            x = self.input_layernorm(x * a + self.self_attn(x, cos, sin, mask))
            return self.post_attention_layernorm(x * a + self.mlp(x))
        if kind == "hybrid":
            x = x + self.self_attn(x, cos, sin, mask)
            x = self.post_attention_layernorm(x)
            return x + self.mlp(x)
        h = self.self_attn(self.input_layernorm(x), cos, sin, mask)
        if c != 1.0:
            h = h * c
        if kind == "sandwich":
            h = self.attn_out_norm(h)
        if self.spec.branch_scale:
            h = h * self.attn_scale
        x = x + h
        h = self.mlp(self.post_attention_layernorm(x))
        if c != 1.0:
            h = h * c
        if kind == "sandwich":
            h = self.mlp_out_norm(h)
        if self.spec.branch_scale:
            h = h * self.mlp_scale
        return x + h

    def _forward_fused(self, x, pending, cos, sin, mask, kernels: str):
        """`_forward` through the fused kernels. `pending` is the previous block's last branch
        output, not yet added to the stream `x`: this block's first norm adds it in the same pass.
        Returns (x, pending) in the same sense for the next block (or the final norm)."""
        kind, a, c = self.spec.kind, self.spec.residual_alpha, self.spec.branch_multiplier
        if kind == "post":
            if pending is not None:  # only after a pre block, which Mix-LN never puts before a post one
                x = x + pending
            x, _ = self.input_layernorm.fused(self.self_attn(x, cos, sin, mask), x * a, kernels)
            x, _ = self.post_attention_layernorm.fused(self.mlp(x), x * a, kernels)
            return x, None
        if kind == "hybrid":
            if pending is not None:
                x = x + pending
            x = self.post_attention_layernorm.fused(self.self_attn(x, cos, sin, mask), x, kernels)[0]
            return x, self.mlp(x)
        if pending is None:
            h = self.input_layernorm.fused(x, None, kernels, to_matmul=True)
        else:
            h, x = self.input_layernorm.fused(pending, x, kernels, to_matmul=True)
        h = self.self_attn(h, cos, sin, mask)
        if c != 1.0:
            h = h * c
        if kind == "sandwich":
            h = self.attn_out_norm.fused(h, None, kernels)
        if self.spec.branch_scale:
            h = h * self.attn_scale
        h, x = self.post_attention_layernorm.fused(h, x, kernels, to_matmul=True)
        h = self.mlp(h)
        if c != 1.0:
            h = h * c
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
        self.norm = make_norm(cfg, None, "final")
        if find_norm(cfg.norm).dyt:  # the authors' LLaMA code: a learnable scalar on the embedding, started at sqrt(d) (tanh is not scale-free)
            self.embed_scale = nn.Parameter(torch.full((1,), math.sqrt(cfg.hidden_size)))
        self.kernels = "off"  # "off", "torch" or "triton": see KERNELS

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * self.embed_scale if hasattr(self, "embed_scale") else x

    def block_inputs(self, length: int, device) -> dict:
        """What every block takes besides the stream, for `length` positions from the first and no
        padding: the rotary tables and no mask (plain causality). Prune's stepper calls the blocks
        one by one with these (depth-use, the depth map)."""
        if length > self.cfg.max_seq_len:
            raise DepthcurseError(f"a sequence of {length} tokens is longer than the model allows ({self.cfg.max_seq_len})")
        cos, sin = rope_cos_sin(length, self.cfg.head_dim, self.cfg.rope_theta, device)
        return {"cos": cos, "sin": sin, "mask": None}

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **_ignored) -> torch.Tensor:
        T = input_ids.shape[1]
        inputs = self.block_inputs(T, input_ids.device)
        cos, sin = inputs["cos"], inputs["sin"]
        # None when nothing is padded (always in training): SDPA then runs plain causal
        # attention, for which the flash and memory-efficient backends are eligible.
        mask = _padding_mask(attention_mask, T)
        x = self.embed(input_ids)
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
    """N(0, init_std) for every linear and embedding, ones for the norm gains, each learnt scale its
    start, then the variant's defining rules and (init "authors") its authors' own draw."""
    norm = find_norm(cfg.norm)
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=cfg.init_std)
        elif isinstance(m, RMSNorm):
            nn.init.ones_(m.weight)
        elif isinstance(m, DyT):
            nn.init.ones_(m.weight)
            m.alpha.fill_(m.alpha0)
    if hasattr(model.model, "embed_scale"):
        model.model.embed_scale.fill_(math.sqrt(cfg.hidden_size))
    for block in model.model.layers:
        # every learnable scale from the block's own float constants: what a model built on the meta device and
        # materialised by to_empty (garbage values) gets back, as one built on a device
        if block.spec.branch_scale == "layerscale":
            block.attn_scale.fill_(block.spec.layerscale_init)
            block.mlp_scale.fill_(block.spec.layerscale_init)
        elif block.spec.branch_scale == "skipinit":
            block.attn_scale.zero_()
            block.mlp_scale.zero_()
    norm.defining_init(model, cfg)
    if cfg.init == "authors":
        norm.authors_init(model, cfg)
