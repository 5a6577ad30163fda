"""Depth diagnostics from one forward pass: angular distances between residual streams
(Gromov et al.), ShortGPT Block Influence, relative update size and residual-stream growth.

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
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from depthcurse.errors import DepthcurseError

POSITIONS = ("last", "all")


# --------------------------------------------------------------------------- options and data


def check_options(*, tokens: int, seq_len: int, batch_size: int, position: str) -> None:
    """Validate the options that do not need the model (raises DepthcurseError)."""
    if tokens <= 0:
        raise DepthcurseError(f"--tokens must be positive (got {tokens})")
    if seq_len < 1:
        raise DepthcurseError(f"--seq-len must be at least 1 (got {seq_len})")
    if batch_size < 1:
        raise DepthcurseError(f"--batch-size must be at least 1 (got {batch_size})")
    if position not in POSITIONS:
        raise DepthcurseError(f"unknown --token-position {position!r}: use last or all")


def check_max_n(max_n: int | None, n_layers: int) -> int:
    """The largest block size n, 1..L; None means L."""
    if n_layers < 1:
        raise DepthcurseError("the model has no layers")
    if max_n is None:
        return n_layers
    if not 1 <= max_n <= n_layers:
        raise DepthcurseError(f"--max-n {max_n} is out of range: the model has {n_layers} layers (use 1-{n_layers})")
    return max_n


@dataclass
class TokenisedData:
    sequences: list[list[int]]
    tokens: int  # real tokens kept (the budget, or everything the data holds)
    requested: int
    exhausted: bool  # the data ran out before the budget was reached


def tokenise_docs(tokenizer, docs: Iterable[str], *, seq_len: int, budget: int, chunk: int = 64) -> TokenisedData:
    """One document per row, truncated to `seq_len`, until `budget` real tokens are reached.

    The tokenizer's own special tokens are kept (BOS for Llama-likes that add one, CLS/SEP for
    BERT). The last document is cut so that exactly `budget` tokens are used when the data
    holds at least that many.
    """
    if tokenizer is None:
        raise DepthcurseError("this model has no tokenizer: angular distances need one to read text")
    docs = [d for d in docs if isinstance(d, str) and d.strip()]
    seqs: list[list[int]] = []
    total = 0
    for start in range(0, len(docs), chunk):
        enc = tokenizer(docs[start : start + chunk], truncation=True, max_length=seq_len)["input_ids"]
        for ids in enc:
            ids = list(ids)
            if not ids:
                continue
            take = min(len(ids), budget - total)
            seqs.append(ids[:take])
            total += take
            if total >= budget:
                return TokenisedData(seqs, total, budget, exhausted=False)
    if not seqs:
        raise DepthcurseError("the data holds no tokens after tokenisation")
    return TokenisedData(seqs, total, budget, exhausted=True)


def pad_id_of(tokenizer) -> int:
    for name in ("pad_token_id", "eos_token_id", "unk_token_id"):
        value = getattr(tokenizer, name, None) if tokenizer is not None else None
        if isinstance(value, int):
            return value
    return 0


def make_batches(sequences: list[list[int]], batch_size: int, pad_id: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids, attention_mask) per batch, right-padded to the batch's longest row."""
    batches = []
    for start in range(0, len(sequences), batch_size):
        rows = sequences[start : start + batch_size]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            mask[i, : len(r)] = 1
        batches.append((ids, mask))
    return batches


def forward_module(model: torch.nn.Module) -> torch.nn.Module:
    """The bare transformer under any head: no logits are computed (they are not needed)."""
    base = getattr(model, "base_model", None)
    return base if isinstance(base, torch.nn.Module) else model


def run_forward(module: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, device) -> None:
    kwargs = {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}
    if getattr(getattr(module, "config", None), "use_cache", None) is not None:
        kwargs["use_cache"] = False
    module(**kwargs)


# --------------------------------------------------------------------------- capture


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

    def __post_init__(self):
        self.norm_sum = [0.0] * self.n_streams
        self.var_sum = [0.0] * self.n_streams
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

    def start_batch(self, attention_mask: torch.Tensor) -> None:
        mask = attention_mask.bool().cpu()
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
        self._batch_stats = {"norm": [None] * n, "var": [None] * n, "cos": [None] * (n - 1), "update": [None] * (n - 1)}

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
        for name, total in (("norm", s.norm_sum), ("var", s.var_sum), ("cos", s.cos_sum), ("update", s.update_sum)):
            values = torch.stack(self._batch_stats[name]).cpu().tolist()
            for i, v in enumerate(values):
                total[i] += v
        s.stat_tokens += int(self._flat_idx.numel())
        self._streams = [None] * self.n_streams
        self._prev = None
        self._mask = None


# --------------------------------------------------------------------------- results


@dataclass
class AngularResult:
    num_layers: int
    max_n: int
    position: str
    pairwise: list[list[float]]  # [L+1][L+1]: mean d(x_i, x_j)
    samples: int  # tokens averaged in the angular matrix
    stat_tokens: int  # real tokens behind the per-layer statistics
    block_influence: list[float]  # [L]
    relative_update: list[float]  # [L]
    norm: list[float]  # [L+1]
    variance: list[float]  # [L+1]
    sequences: int = 0
    seconds: float = 0.0
    run: dict = field(default_factory=dict)

    def distance(self, l: int, n: int) -> float:
        return self.pairwise[l][l + n]

    def matrix(self) -> list[list[float | None]]:
        """matrix[n-1][l] = d(x_l, x_{l+n}) for n = 1..max_n, l = 0..L-1; None where l+n > L."""
        L = self.num_layers
        return [[self.distance(l, n) if l + n <= L else None for l in range(L)] for n in range(1, self.max_n + 1)]

    def best_blocks(self) -> list[dict]:
        """For each n, l* = argmin_l d(x_l, x_{l+n}): the n blocks l*..l*+n-1 that change the stream least."""
        out = []
        for n in range(1, self.max_n + 1):
            candidates = [(self.distance(l, n), l) for l in range(self.num_layers - n + 1)]
            d, l = min(candidates)
            out.append({"n": n, "l": l, "layers": f"{l}-{l + n - 1}" if n > 1 else str(l), "distance": d})
        return out

    def block_choices(self, n: int) -> list["BlockChoice"]:
        """The two n-layer blocks `prune --block n` compares: the one angular distance picks
        (l* = argmin_l d(x_l, x_{l+n})) and the n deepest layers before the final one, the
        rule of thumb the heuristic has to beat."""
        L = self.num_layers
        if not 1 <= n <= L - 1:
            raise DepthcurseError(f"--block {n} is out of range: the model has {L} layers (use 1-{L - 1}; the final layer is kept)")
        if n > self.max_n:
            raise DepthcurseError(f"--block {n} exceeds the angular result's max n ({self.max_n}); measure it with a larger --max-n")
        best = min((self.distance(l, n), l) for l in range(L - n + 1))[1]
        deepest = L - 1 - n
        return [
            BlockChoice("angular", tuple(range(best, best + n)), self.distance(best, n)),
            BlockChoice("deepest", tuple(range(deepest, deepest + n)), self.distance(deepest, n)),
        ]

    def angular_rows(self) -> list[dict]:
        return [
            {"l": l, "n": n, "distance": self.distance(l, n), "count": self.samples}
            for n in range(1, self.max_n + 1)
            for l in range(self.num_layers - n + 1)
        ]

    def layer_rows(self) -> list[dict]:
        rows = []
        for l in range(self.num_layers + 1):
            last = l == self.num_layers
            rows.append({
                "l": l,
                "block_influence": None if last else self.block_influence[l],
                "relative_update": None if last else self.relative_update[l],
                "norm": self.norm[l],
                "variance": self.variance[l],
                "count": self.stat_tokens,
            })
        return rows

    def to_json(self) -> dict:
        return {
            "run": self.run,
            "num_layers": self.num_layers,
            "max_n": self.max_n,
            "token_position": self.position,
            "samples": self.samples,
            "sequences": self.sequences,
            "seconds": self.seconds,
            "definition": "d(x_l, x_{l+n}) = arccos(cos(x_l, x_{l+n}))/pi, x_l = input of block l, x_L = output of the last block before the final norm",
            "matrix_index": "matrix[n-1][l] = d(x_l, x_{l+n}); null where l+n > L",
            "matrix": self.matrix(),
            "pairwise": self.pairwise,
            "best_blocks": self.best_blocks(),
            "layers": {
                "block_influence": self.block_influence,
                "relative_update": self.relative_update,
                "norm": self.norm,
                "variance": self.variance,
                "tokens": self.stat_tokens,
            },
        }


@dataclass(frozen=True)
class BlockChoice:
    rule: str  # "angular" or "deepest"
    layers: tuple[int, ...]
    distance: float  # d(x_first, x_first+n) measured on the unpruned model

    @property
    def label(self) -> str:
        return f"{self.layers[0]}-{self.layers[-1]}" if len(self.layers) > 1 else str(self.layers[0])


def load_angular(path) -> AngularResult:
    """An `angular.json` written by `depthcurse angular-distance` (or `prune --block`), read back."""
    import json
    from pathlib import Path

    path = Path(path)
    if path.is_dir():
        path = path / "angular.json"
    try:
        data = json.loads(path.read_text())
        layers = data["layers"]
        return AngularResult(
            num_layers=data["num_layers"], max_n=data["max_n"], position=data["token_position"],
            pairwise=data["pairwise"], samples=data["samples"], stat_tokens=layers["tokens"],
            block_influence=layers["block_influence"], relative_update=layers["relative_update"],
            norm=layers["norm"], variance=layers["variance"], sequences=data.get("sequences", 0),
            seconds=data.get("seconds", 0.0), run=data.get("run", {}),
        )
    except FileNotFoundError as exc:
        raise DepthcurseError(f"no angular-distance result at {path}: run `depthcurse angular-distance` first") from exc
    except (ValueError, KeyError, TypeError) as exc:
        raise DepthcurseError(f"{path} is not a depthcurse angular.json ({type(exc).__name__}: {exc})") from exc


def measure_text(
    model: torch.nn.Module,
    tokenizer,
    data: str = "auto",
    *,
    tokens: int = 65536,
    seq_len: int = 512,
    batch_size: int = 4,
    position: str = "last",
    max_n: int | None = None,
    device=None,
    on_batch: Callable[[int, int], None] | None = None,
) -> tuple[AngularResult, TokenisedData, str]:
    """`measure` on text read by `load_texts(data)`: one document per row, up to `tokens` tokens.

    Returns the result, what was tokenised (check `.exhausted`) and the data's label.
    """
    from depthcurse.text import load_texts

    check_options(tokens=tokens, seq_len=seq_len, batch_size=batch_size, position=position)
    docs, label = load_texts(data)
    tokenised = tokenise_docs(tokenizer, docs, seq_len=seq_len, budget=tokens)
    batches = make_batches(tokenised.sequences, batch_size, pad_id_of(tokenizer))
    result = measure(model, batches, position=position, max_n=max_n, device=device, on_batch=on_batch)
    result.run = {"data": label, "tokens_requested": tokens, "tokens_seen": tokenised.tokens, "data_exhausted": tokenised.exhausted,
                  "seq_len": seq_len, "batch_size": batch_size, "token_position": position}
    return result, tokenised, label


def measure(
    model: torch.nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    position: str = "last",
    max_n: int | None = None,
    device=None,
    on_batch: Callable[[int, int], None] | None = None,
) -> AngularResult:
    """Angular distances and per-layer statistics of `model` over `batches` (ids, mask)."""
    from depthcurse.surgery import find_blocks

    if position not in POSITIONS:
        raise DepthcurseError(f"unknown --token-position {position!r}: use last or all")
    if not batches:
        raise DepthcurseError("no data to measure")
    blocks = find_blocks(model).layers
    L = len(blocks)
    max_n = check_max_n(max_n, L)
    module = forward_module(model)
    if device is None:
        device = model.get_input_embeddings().weight.device
    total = sum(int(m.sum()) for _, m in batches)
    done = 0
    started = time.perf_counter()
    with torch.inference_mode(), StreamCapture(blocks, position) as cap:
        for ids, mask in batches:
            cap.start_batch(mask)
            run_forward(module, ids, mask, device)
            cap.finish_batch()
            done += int(mask.sum())
            if on_batch is not None:
                on_batch(done, total)
    seconds = time.perf_counter() - started
    s = cap.sums
    pairwise = (s.angle_sum / s.samples).cpu().tolist()
    t = s.stat_tokens
    return AngularResult(
        num_layers=L,
        max_n=max_n,
        position=position,
        pairwise=pairwise,
        samples=s.samples,
        stat_tokens=t,
        block_influence=[1.0 - c / t for c in s.cos_sum],
        relative_update=[u / t for u in s.update_sum],
        norm=[v / t for v in s.norm_sum],
        variance=[v / t for v in s.var_sum],
        sequences=sum(int(m.shape[0]) for _, m in batches),
        seconds=seconds,
    )


def bare_forward(model: torch.nn.Module, batches, device=None) -> float:
    """Seconds for the same forward passes without any hook (the cost baseline)."""
    module = forward_module(model)
    if device is None:
        device = model.get_input_embeddings().weight.device
    started = time.perf_counter()
    with torch.inference_mode():
        for ids, mask in batches:
            run_forward(module, ids, mask, device)
    return time.perf_counter() - started

