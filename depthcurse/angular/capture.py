"""Reading the residual stream from inside a forward pass: hooks on every block.

The residual stream x_l is the INPUT of block l (l = 0..L-1) and x_L the OUTPUT of the last
block, before the model's final norm. They are captured with a forward pre-hook on every block
and a forward hook on the last one, so Hugging Face's ``hidden_states[-1]`` (which is after the
final norm in most models) is never used.

Per batch, the hooks keep only what is needed: the selected tokens of every stream (normalised,
float64) for the angular matrix, and running sums over all real tokens for the per-layer
statistics. One batched matmul then gives every cosine between the L+1 streams of each token.
Padding never enters anything: only tokens with attention mask 1 are read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from depthcurse.errors import DepthcurseError

# Massive activations (Sun et al., 2024) sit in a handful of channels: a token's variance without
# its few largest entries is the bulk's, which the paper's gradual growth is about.
OUTLIER_CHANNELS = 4


def _hidden_from_inputs(args: tuple, kwargs: dict) -> torch.Tensor:
    value = kwargs.get("hidden_states")
    if torch.is_tensor(value):
        return value
    for a in args:
        if torch.is_tensor(a) and a.dim() == 3:
            return a
    for v in kwargs.values():
        if torch.is_tensor(v) and v.dim() == 3:
            return v
    raise DepthcurseError("cannot find the hidden states among a block's inputs: unsupported architecture")


def _hidden_from_output(output) -> torch.Tensor:
    if torch.is_tensor(output):
        return output
    if isinstance(output, (tuple, list)):
        for item in output:
            if torch.is_tensor(item):
                return item
    try:  # ModelOutput-like
        first = output[0]
        if torch.is_tensor(first):
            return first
    except (TypeError, KeyError, IndexError):
        pass
    raise DepthcurseError(f"cannot find the hidden states in a block's output ({type(output).__name__}): unsupported architecture")


@dataclass
class _Sums:
    """Running sums, float64 on the accumulation device."""

    n_streams: int
    angle_sum: torch.Tensor | None = None  # [L+1, L+1]
    samples: int = 0
    stat_tokens: int = 0
    norm_sum: list[float] = field(default_factory=list)
    var_sum: list[float] = field(default_factory=list)
    cos_sum: list[float] = field(default_factory=list)
    update_sum: list[float] = field(default_factory=list)
    bulk_var_sum: list[float] = field(default_factory=list)
    max_abs: list[float] = field(default_factory=list)  # the largest |activation| seen at each depth
    max_channel: list[int] = field(default_factory=list)  # and its channel
    max_position: list[int] = field(default_factory=list)  # the position of its token in its sequence
    max_token: list[int] = field(default_factory=list)  # and that token's id (-1: ids not given)
    median_sum: list[float] = field(default_factory=list)  # each batch's median |activation|, summed
    batches: int = 0

    def __post_init__(self):
        self.norm_sum = [0.0] * self.n_streams
        self.var_sum = [0.0] * self.n_streams
        self.bulk_var_sum = [0.0] * self.n_streams
        self.max_abs = [0.0] * self.n_streams
        self.max_channel = [-1] * self.n_streams
        self.max_position = [-1] * self.n_streams
        self.max_token = [-1] * self.n_streams
        self.median_sum = [0.0] * self.n_streams
        self.cos_sum = [0.0] * (self.n_streams - 1)
        self.update_sum = [0.0] * (self.n_streams - 1)


class StreamCapture:
    """Hooks on every block that read the residual stream of the current batch.

    Call `start_batch(mask)` before each forward pass and `finish_batch()` after it.
    """

    def __init__(self, blocks: torch.nn.ModuleList, position: str, device: torch.device | None = None):
        self.blocks = blocks
        self.position = position
        self.n_streams = len(blocks) + 1
        self.device = device
        self.sums = _Sums(self.n_streams)
        self._handles = []
        self._mask = None

    def __enter__(self) -> "StreamCapture":
        for i, block in enumerate(self.blocks):
            self._handles.append(block.register_forward_pre_hook(self._pre_hook(i), with_kwargs=True))
        self._handles.append(self.blocks[-1].register_forward_hook(self._post_hook(self.n_streams - 1)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pre_hook(self, k: int):
        def hook(module, args, kwargs):
            self._take(k, _hidden_from_inputs(args, kwargs))

        return hook

    def _post_hook(self, k: int):
        def hook(module, args, output):
            self._take(k, _hidden_from_output(output))

        return hook

    def start_batch(self, attention_mask: torch.Tensor, input_ids: torch.Tensor | None = None) -> None:
        mask = attention_mask.bool().cpu()
        self._ids = input_ids.cpu() if input_ids is not None else None
        lengths = mask.sum(dim=1)
        self._mask = mask
        self._flat_idx = mask.flatten().nonzero().squeeze(1)  # real tokens, row-major
        # Where each row's last real token sits among the real tokens (any padding side).
        self._last_in_real = torch.cumsum(lengths, 0) - 1
        self._last_in_real = self._last_in_real[lengths > 0]
        self._streams: list[torch.Tensor | None] = [None] * self.n_streams
        self._prev = None
        self._seen = [False] * self.n_streams
        self._all_real = bool(mask.all())
        n = self.n_streams
        self._batch_stats = {"norm": [None] * n, "var": [None] * n, "bulk_var": [None] * n, "max": [None] * n, "median": [None] * n, "cos": [None] * (n - 1), "update": [None] * (n - 1)}

    def _take(self, k: int, hidden: torch.Tensor) -> None:
        if self._mask is None:
            return  # a forward pass outside start_batch/finish_batch: not ours to measure
        if hidden.dim() != 3 or tuple(hidden.shape[:2]) != tuple(self._mask.shape):
            raise DepthcurseError(
                f"block {k} sees hidden states of shape {tuple(hidden.shape)}, expected (batch, sequence, hidden) = "
                f"{tuple(self._mask.shape)} + (d,): unsupported architecture"
            )
        if self.device is None:
            self.device = hidden.device
        flat = hidden.detach().reshape(-1, hidden.shape[-1])
        if not self._all_real:
            flat = flat.index_select(0, self._flat_idx.to(flat.device))
        # Per-token statistics in fp32 (sums in fp64): exact inputs for an fp32 model, and cheap.
        x = flat.to(self.device, torch.float32, copy=self._all_real)  # never a view: a block may work in place
        norm = torch.linalg.vector_norm(x, dim=-1)
        tiny = torch.finfo(torch.float32).tiny
        stats = self._batch_stats
        stats["norm"][k] = norm.sum(dtype=torch.float64)
        stats["var"][k] = x.var(dim=-1, unbiased=False).sum(dtype=torch.float64)
        c = min(OUTLIER_CHANNELS, x.shape[-1] - 2)
        top = x.abs().topk(c, dim=-1)
        keep = torch.ones_like(x).scatter_(-1, top.indices, 0.0)  # masked, not subtracted: no cancellation
        mean = (x * keep).sum(-1, keepdim=True) / (x.shape[-1] - c)
        stats["bulk_var"][k] = (((x - mean) * keep) ** 2).sum(-1).div(x.shape[-1] - c).sum(dtype=torch.float64)
        token = top.values[:, 0].argmax()
        stats["max"][k] = torch.stack([top.values[token, 0].double(), top.indices[token, 0].double(), token.double()])
        # Sun et al.'s yardstick for a massive activation: the median magnitude of the layer's activations
        stats["median"][k] = x.abs().median().double()
        if k > 0:
            if self._prev is None:
                raise DepthcurseError(f"block {k - 1} was skipped in the forward pass: cannot measure this model")
            prev, prev_norm = self._prev
            cos = torch.linalg.vecdot(prev, x) / (prev_norm * norm).clamp_min(tiny)
            stats["cos"][k - 1] = cos.sum(dtype=torch.float64)
            stats["update"][k - 1] = (torch.linalg.vector_norm(x - prev, dim=-1) / prev_norm.clamp_min(tiny)).sum(dtype=torch.float64)
        self._prev = (x, norm)
        # The angular matrix in fp64: cosines near 1 need it (arccos is steep there).
        sel = x.index_select(0, self._last_in_real.to(x.device)) if self.position == "last" else x
        sel = sel.to(torch.float64)
        self._streams[k] = sel / torch.linalg.vector_norm(sel, dim=-1, keepdim=True).clamp_min(1e-300)
        self._seen[k] = True

    def finish_batch(self) -> None:
        missing = [k for k, seen in enumerate(self._seen) if not seen]
        if missing:
            raise DepthcurseError(f"the hooks did not see residual streams {missing}: this model skips or reorders blocks")
        s = self.sums
        stacked = torch.stack(self._streams, dim=1)  # [N, L+1, D]
        gram = torch.bmm(stacked, stacked.transpose(1, 2)).clamp_(-1.0, 1.0)  # [N, L+1, L+1]
        angles = torch.arccos(gram).sum(dim=0) / math.pi
        s.angle_sum = angles if s.angle_sum is None else s.angle_sum + angles
        s.samples += stacked.shape[0]
        # One host sync per batch, not one per layer.
        for name, total in (("norm", s.norm_sum), ("var", s.var_sum), ("bulk_var", s.bulk_var_sum), ("cos", s.cos_sum), ("update", s.update_sum)):
            values = torch.stack(self._batch_stats[name]).cpu().tolist()
            for i, v in enumerate(values):
                total[i] += v
        width = self._mask.shape[1]
        for i, (value, channel, token) in enumerate(torch.stack(self._batch_stats["max"]).cpu().tolist()):
            if value > s.max_abs[i]:
                flat = int(self._flat_idx[int(token)])  # the token among the batch's [rows x width] slots
                s.max_abs[i], s.max_channel[i], s.max_position[i] = value, int(channel), flat % width
                s.max_token[i] = int(self._ids.flatten()[flat]) if self._ids is not None else -1
        for i, median in enumerate(torch.stack(self._batch_stats["median"]).cpu().tolist()):
            s.median_sum[i] += median
        s.batches += 1
        s.stat_tokens += int(self._flat_idx.numel())
        self._streams = [None] * self.n_streams
        self._prev = None
        self._mask = None
